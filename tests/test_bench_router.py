"""benchmarks/bench_router.py on the CPU: its arguments, its release router shapes and the message a machine
without CUDA gets (the timings themselves run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_router as bench


@pytest.mark.parametrize("argv, says", [([], "--out"), (["--out", "o.json", "--tokens", "0"], "1 to"),
                                        (["--out", "o.json", "--tokens", "9"], "ROUTER_FUSED_MAX_TOKENS"),
                                        (["--out", "o.json", "--models", "llama"], "invalid choice")])
def test_refuses_bad_arguments(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_router_shapes_are_the_releases():
    """MODELS comes from registry.releases: Super V3 routes top-22 of 512 over D = 4096 by sigmoid with
    scaling 5, Qwen3-Next top-10 of 512 over D = 2048 by softmax (the releases' config.json)."""
    assert bench.MODELS["super_v3"] == (4096, 512, 22, False, 5.0)
    assert bench.MODELS["qwen3_next"] == (2048, 512, 10, True, 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_needs_cuda(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "o.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "o.json").exists()
