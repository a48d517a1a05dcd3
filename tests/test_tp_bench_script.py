"""tests/gpu/tp_bench.py (world size 2 against 1 on the two-GPU machine): its argument checks, and one small
run on the CPU (gloo) whose JSON has every number the GPU run reports, with tokens (computed in float32 over
a bf16 checkpoint) equal across world sizes and arms."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = ["tests/gpu/tp_bench.py"]
SMALL = ["--set=hidden_size=128", "--set=vocab_size=4096", "--set=linear_key_head_dim=32",
         "--set=linear_value_head_dim=48", "--set=head_dim=64", "--set=moe_intermediate_size=64",
         "--set=shared_expert_intermediate_size=64"]


def _run(args, **kw):
    return subprocess.run([sys.executable, *SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900, **kw)


@pytest.mark.parametrize("args, says", [
    (["--out", "x.json"], "--workdir"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--family", "llama"], "invalid choice"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--prompt-len", "8", "--device", "cpu"], ">= 64"),
    (["--workdir", "tests", "--out", "{tmp}/o.json", "--device", "cpu"], "outside the repository"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--world-sizes", "1", "2"], "needs 2 GPU(s)"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--device", "cpu", "--share-gpu"],
     "needs --device cuda"),
])
def test_refuses_bad_arguments(args, says, tmp_path, monkeypatch, capsys):
    """In this process (the script's main; a new interpreter importing torch cost ~13 s a case): exit
    status 2 and the message on stderr, nothing created. The CPU run below runs the script as a command."""
    if "--world-sizes" in args:
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has the GPUs")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends its folders: undone afterwards
    monkeypatch.chdir(REPO)
    spec = importlib.util.spec_from_file_location("tp_bench", REPO / SCRIPT[0])
    tp_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_bench)
    with pytest.raises(SystemExit) as e:
        tp_bench.main([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_cpu_run_reports_everything(tmp_path):
    # one batch size: the loop over --batch only re-runs the same arms at another size (every arm, both graph
    # modes, both world sizes and every comparison still run); a second size doubled this test's 100 s
    out = tmp_path / "tp_bench.json"
    proc = _run(["--workdir", str(tmp_path / "work"), "--out", str(out), "--family", "qwen3_next", "--device",
                 "cpu", "--dtype", "bfloat16", "--compute-dtype", "float32", "--num-layers", "2",
                 "--num-experts", "8", "--batch", "2", "--graphs", "on", "off", "--prompt-len", "64",
                 "--new-tokens", "4", *SMALL])
    assert proc.returncode == 0, proc.stderr[-3000:]
    fam = json.loads(out.read_text())["families"][0]
    assert fam["family"] == "qwen3_next" and sorted(fam["runs"]) == ["1", "2"]
    assert fam["compute_dtype"] == "float32"  # over a bf16 checkpoint
    keys = [f"{arm}/b2/graphs_{g}" for arm in ("plain", "replay", "rewind") for g in ("on", "off")]
    for ws, run in fam["runs"].items():
        assert run["world_size"] == int(ws) and {"seconds", "weight_bytes", "cache_bytes"} <= set(run["load"])
        assert run["backend"] == "gloo" and run["device"] == "cpu"
        assert sorted(run["arms"]) == sorted(keys)
        for key, arm in run["arms"].items():
            assert arm["generated_tokens"] == 4 * arm["batch"] and arm["decode_tokens_per_s"] > 0, key
            assert arm["decode_tokens_per_s_per_gpu"] == pytest.approx(arm["decode_tokens_per_s"] / int(ws))
            # the CPU runs every step eagerly, whatever was asked; nothing is dropped by the launch
            assert not arm["cuda_graphs"] and arm["graphs_captured"] == [], key
            assert arm["graphs_captured_ahead"] == 0, key
            assert arm["cuda_graphs_off_reason"] is None, key
    assert fam["runs"]["2"]["load"]["weight_bytes"] < fam["runs"]["1"]["load"]["weight_bytes"]
    cmp, speedup = fam["compare"]["2"], fam["speedup"]["2"]
    same = {"identical_requests": 1.0, "mean_prefix_fraction": 1.0}  # float32
    for g in ("on", "off"):
        assert cmp[f"replay_vs_rewind/b2/graphs_{g}"] == same
        assert cmp[f"rewind_vs_plain/b2/graphs_{g}"] == same
    for key in keys:
        assert cmp[f"{key}_vs_world_size_1"] == same, key
        assert speedup[f"{key}_vs_world_size_1"] > 0, key
        if key.endswith("graphs_on"):
            assert cmp[f"{key}_vs_graphs_off"] == same and speedup[f"{key}_vs_graphs_off"] > 0, key
    assert cmp["last_logits"]["top1_agreement"] == 1.0 and cmp["last_logits"]["max_abs_difference"] < 1e-4
    assert not (tmp_path / "work" / "qwen3_next").exists()  # deleted after use
