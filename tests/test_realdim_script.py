"""tests/gpu/realdim.py (the real-dimension benchmark for the GPU machine): its argument checks, and one small
run on the CPU whose JSON has every number the GPU run reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = ["tests/gpu/realdim.py"]
SMALL = ["--set=hidden_size=128", "--set=vocab_size=4096", "--set=linear_key_head_dim=32",
         "--set=linear_value_head_dim=48", "--set=head_dim=64", "--set=moe_intermediate_size=64",
         "--set=shared_expert_intermediate_size=64"]


def _run(args, **kw):
    return subprocess.run([sys.executable, *SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, **kw)


@pytest.mark.parametrize("args, says", [
    (["--out", "x.json"], "--workdir"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--family", "llama"], "invalid choice"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--new-tokens", "0", "--device", "cpu"], ">= 1"),
    (["--workdir", "tests", "--out", "{tmp}/o.json", "--device", "cpu"], "outside the repository"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--shard-size", "big", "--device", "cpu"],
     "size 'big'"),
])
def test_refuses_bad_arguments(args, says, tmp_path):
    proc = _run([a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_cpu_run_reports_everything(tmp_path):
    out = tmp_path / "realdim.json"
    proc = _run(["--workdir", str(tmp_path / "work"), "--out", str(out), "--family", "qwen3_next", "--device",
                 "cpu", "--dtype", "float32", "--num-layers", "2", "--num-experts", "8", "--batch-sizes", "1",
                 "--prompt-len", "16", "--new-tokens", "4", *SMALL])
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    fam = report["families"][0]
    assert fam["family"] == "qwen3_next" and fam["synth"]["num_shards"] == 1
    assert {"seconds", "weight_bytes", "cache_bytes", "host_peak_rss_bytes"} <= set(fam["load"])
    assert fam["logits_check"]["finite"]
    assert [(r["draft_len"], r["arm"]) for r in fam["runs"]] == [(0, "plain"), (3, "rewind"), (3, "replay")]
    for r in fam["runs"]:
        assert r["generated_tokens"] == 4 and r["prompt_tokens"] == 16
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert set(fam["same_tokens"]["batch1"]) == {"replay_vs_rewind", "rewind_vs_plain"}
    # float32: replay, rewind and plain greedy decoding give the same tokens
    for pair in fam["same_tokens"]["batch1"].values():
        assert pair == {"fraction_identical": 1.0, "first_divergence": [None]}
    assert not (tmp_path / "work" / "qwen3_next").exists()  # deleted after use
