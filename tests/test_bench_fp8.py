"""benchmarks/bench_fp8.py (FP8 vs BF16 end to end, for the GPU machine): its argument checks, and its `super`
stage on the CPU at small sizes, whose JSON has every number the GPU run reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--set=hidden_size=128", "--set=vocab_size=4096", "--set=mamba_num_heads=8",
         "--set=mamba_head_dim=16", "--set=ssm_state_size=16", "--set=n_groups=2",
         "--set=num_attention_heads=4", "--set=head_dim=32",
         "--set=moe_intermediate_size=64", "--set=moe_shared_expert_intermediate_size=64",
         "--set=moe_latent_size=64", "--set=num_experts_per_tok=2"]


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=900, **kw)


@pytest.mark.parametrize("args, says", [
    (["--out", "x.json"], "--workdir"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--stages", "nano"], "invalid choice"),
    (["--workdir", "benchmarks", "--out", "{tmp}/o.json", "--device", "cpu"], "outside the repository"),
    (["--workdir", "{tmp}/w", "--out", "{tmp}/o.json", "--new-tokens", "0", "--device", "cpu"], ">= 1"),
])
def test_refuses_bad_arguments(args, says, tmp_path):
    proc = _run([a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_cpu_super_stage_reports_bf16_and_fp8(tmp_path, gsm8k_dir):
    out = tmp_path / "bench.json"
    proc = _run(["--workdir", str(tmp_path / "work"), "--out", str(out), "--stages", "super",
                 "--device", "cpu", "--num-layers", "4", "--num-experts", "8", "--batch-sizes", "1",
                 "--prompt-len", "32",
                 "--new-tokens", "4", "--calib-samples", "2", "--calib-tokens", "2", "--eval-limit", "1",
                 "--max-gen-toks", "8", "--data-dir", str(gsm8k_dir), *SMALL])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())["super"]
    # ME*M: one MoE layer, the MTP one stays bf16
    assert report["quantize"]["counts"]["quantized_moe_blocks"] == 1
    for arm in ("bf16", "fp8"):
        runs = report[arm]["runs"]
        assert [(r["batch"], r["draft_len"]) for r in runs] == [(1, 0), (1, 3)]
        assert all(r["generated_tokens"] == 4 and r["decode_tokens_per_s"] > 0 for r in runs)
    assert report["fp8"]["quant_report"]["fp8_moe"] == {"dequant": 1}  # the CPU: the dequantizing path
    kv_bf16 = report["bf16"]["runs"][0]["cache_memory"]["kv_cache_bytes"]
    assert report["fp8"]["runs"][0]["cache_memory"]["kv_cache_bytes"] * 4 == kv_bf16  # fp32 on the CPU
    assert set(report["fp8_over_bf16_decode"]) == {"batch1_k0", "batch1_k3"}
    # the run completes; random weights draft nothing (acceptance 0), but an 8-token run is not the
    # references' protocol (256 tokens), so super_v3's acceptance floor does not judge it (no reference, 0)
    assert report["eval"]["exit_code"] == 0 and report["eval"]["results"]["gsm8k"]["n"] == 1
    assert report["eval"]["results"]["acceptance_rate"] == 0.0
    assert report["eval"]["results"]["verdict"] == "no_reference"
    assert not (tmp_path / "work" / "bf16").exists() and not (tmp_path / "work" / "fp8").exists()
