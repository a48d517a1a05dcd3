"""The device-machine scripts refuse bad invocations before doing any work (they run on the CPU here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "usage: bash tests/gpu/run_checks.sh OUTDIR STAGE"),
        (["kernels"], "usage:"),  # OUTDIR forgotten: the stage is not taken for a folder
        (["{tmp}", "kernals"], "unknown stage 'kernals'"),
        (["kernels", "engine"], "is a source folder of the repository"),
        (["benchmarks/out", "bench"], "is a source folder of the repository"),
    ],
)
def test_run_checks_refuses_bad_arguments(args, says, tmp_path):
    args = [a.format(tmp=tmp_path / "logs") for a in args]
    cmd = ["bash", "tests/gpu/run_checks.sh", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr
    stages = "stages: kernels sanitize bench sweep ncu engine e2e e2e_full flashinfer"
    assert stages in proc.stderr or "source folder" in proc.stderr
    assert not (tmp_path / "logs").exists()
    assert not (REPO / "kernels" / "machine.txt").exists() and not (REPO / "benchmarks" / "out").exists()


def test_flashinfer_sizes_needs_gpu_and_flashinfer():
    import importlib.util

    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("this machine can run the probe")
    proc = subprocess.run([sys.executable, "tests/gpu/flashinfer_sizes.py"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU and flashinfer" in proc.stderr
