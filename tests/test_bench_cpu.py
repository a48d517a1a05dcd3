"""benchmarks/bench_cpu.py and benchmarks/profile_cpu.py run end to end on a few GSM8K prompts (speed figures
are not checked: they are measurements, docs/performance.md)."""

from __future__ import annotations

import json

from benchmarks import bench_cpu, profile_cpu


def test_bench_cpu_compares_engine_arms_with_hf(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--prompts", "2", "--new-tokens", "4", "--repeats", "1",
            "--arms", "hf,engine_k0,engine_k3_replay", "--out", str(out)]
    assert bench_cpu.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and report["prefix_cache"] is True
    arms = report["arms"]
    assert set(arms) == {"hf", "engine_k0", "engine_k3_replay"}
    for arm in arms.values():
        assert arm["generated_tokens"] == 2 * 4 and arm["best_cpu_seconds"] > 0
    assert arms["engine_k3_replay"]["tokens_equal_to_k0"] is True  # speculation changes no token
    assert 0 <= arms["engine_k0"]["tokens_equal_to_hf"] <= 1 and "speedup_vs_hf_cpu" in arms["engine_k0"]
    assert arms["engine_k3_replay"]["runs"][0]["acceptance_length"] >= 1
    for arm in ("engine_k0", "engine_k3_replay"):
        run = arms[arm]["runs"][0]
        assert 0 < run["prefill_cpu_seconds"] < run["cpu_seconds"]
        assert run["decode_cpu_seconds"] == run["cpu_seconds"] - run["prefill_cpu_seconds"]
    assert arms["engine_k3_replay"]["decode_speedup_vs_k0_cpu"] > 0


def test_profile_cpu_labels_the_step_phases(capsys):
    assert profile_cpu.main(["--prompts", "2", "--new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    labels = ("DECODE", "DRAFT", "VERIFY", "COMMIT", "CATCHUP", "TARGET_FWD", "MTP_FWD", "LM_HEAD", "STEP")
    for label in labels:
        assert f"  {label} " in printed, label


def test_profile_cpu_prefill_mode_times_one_prompt_prefills(capsys):
    assert profile_cpu.main(["--prefill", "2", "--slots", "4"]) == 0
    printed = capsys.readouterr().out
    assert "prefill: 2 prompts of" in printed and "ms of CPU per prompt" in printed
    assert "scaled_dot_product" in printed  # the operator table of the profiled pass
