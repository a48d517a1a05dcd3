"""benchmarks/bench_e2e.py (the GPU end-to-end benchmark): its argument checks, and a small CPU run whose JSON
and plot have every field the GPU run reports (graphs are off on the CPU; the synthetic models shrunk)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHRINK = ("hidden_size=128", "vocab_size=4096", "mamba_num_heads=8", "moe_latent_size=64",
          "moe_intermediate_size=64", "moe_shared_expert_intermediate_size=64")
SMALL_SYNTH = ["--synth-layers", "4", "4", "--synth-experts", "8", "8", "--dtype", "float32",
               *[f"--synth-set={kv}" for kv in SHRINK]]
FAST = ["--device", "cpu", "--batch-sizes", "1", "--steps", "2", "--warmup-steps", "1", "--hf-steps", "8",
        "--prompt-len", "12", *SMALL_SYNTH]


def _run(args, timeout=900):
    cmd = [sys.executable, "-m", "benchmarks.bench_e2e", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, says", [
    ([], "--out"),
    (["--out", "{tmp}", "--parts", "tiny,gpt"], "unknown ['gpt']"),
    (["--out", "{tmp}", "--accept-length", "5"], "must lie in [1, K + 1 = 4]"),
    (["--out", "{tmp}", "--profile", "super_v3:replay:8"], "MODEL:ARM:BATCH:graphs|eager"),
    (["--out", "{tmp}", "--steps", "0"], "must be >= 1"),
    (["--out", "{tmp}", "--parts", ","], "names no part"),
    (["--out", "{tmp}", "--profile", "tiny_nemotron_h:replay:0:eager"], "BATCH >= 1"),
    (["--out", "{tmp}", "--full-layers", "89", "0"], "nemotron_h has 88 layers; give 1-88, or 0"),
    (["--out", "{tmp}", "--full-layers", "0", "-1"], "qwen3_next has 48 layers"),
    (["--out", "{tmp}", "--full-layers", "0", "1"], "Qwen3-Next needs >= 2 layers"),
    (["--out", "{tmp}", "--full-layers", "44", "0", "--synth-set", "hybrid_override_pattern=ME*"],
     "--full-layers cuts nemotron_h and --synth-set sets hybrid_override_pattern"),
])
def test_refuses_bad_arguments(args, says, tmp_path):
    proc = _run([a.format(tmp=tmp_path / "o") for a in args], timeout=120)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def _refusal(argv, capsys) -> str:
    """bench_e2e.main(argv) in this process: its exit status must be 2 (argparse's SystemExit or the returned
    `error:` / `fix:` status); returns stderr."""
    from benchmarks.bench_e2e import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_refuses_a_bad_device_or_out_before_running(tmp_path, capsys, monkeypatch):
    """--device that torch cannot parse or this benchmark does not run on, cuda without CUDA, and an --out
    that is (or lies under) a plain file: refused up front, nothing written."""
    import torch

    out = str(tmp_path / "o")
    assert "--device 'foo' is not a device" in _refusal(["--out", out, "--device", "foo"], capsys)
    assert "use cuda, cuda:N or cpu" in _refusal(["--out", out, "--device", "meta"], capsys)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refusal(["--out", out, "--device", "cuda:0"], capsys)
    assert "error: --device cuda:0 but CUDA is not available here" in err and "fix:" in err
    assert not (tmp_path / "o").exists()
    plain = tmp_path / "plain.txt"
    plain.write_text("not a folder\n")
    for bad in (plain, plain / "sub"):
        err = _refusal(["--out", str(bad), "--device", "cpu"], capsys)
        assert f"{plain} is a file, not a folder" in err, err
    assert plain.read_text() == "not a folder\n"
    # an arm that names a GPU backend on the CPU (the review saw every such point fail, exit 0)
    argv = ["--out", out, "--device", "cpu", "--arms", "plain", "replay_flashinfer", "replay_ckpt_triton"]
    err = _refusal(argv, capsys)
    assert "error: --arms replay_flashinfer replay_ckpt_triton name a GPU backend" in err
    assert "fix: run them on the GPU machine, or use --arms plain rewind replay on the CPU" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("setting", ["nokey=3", "hidden_size=abc", "hidden_size=0", "mamba_num_heads=2.5",
                                     "linear_num_key_heads=0"])
def test_refuses_a_bad_synth_set_before_any_point(setting, tmp_path, capsys, monkeypatch):
    """A --synth-set the synthetic builders would refuse is refused before any point runs, with the builders'
    own message (runners.tools.synth.check_overrides), not as an error row of a run that exits 0."""
    from benchmarks import bench_e2e
    from runners.tools.synth import SynthError, _parse_set, check_overrides

    monkeypatch.setattr(bench_e2e, "copy_bandwidth", lambda *a: pytest.fail("the run started"))
    family = "qwen3_next" if setting.startswith("linear") else "nemotron_h"  # the family whose field it is
    with pytest.raises(SynthError) as builder:
        check_overrides(family, _parse_set([setting]), other_families_ok=True)
    err = _refusal(["--out", str(tmp_path / "o"), "--device", "cpu", "--parts", "super_v3",
                    f"--synth-set={setting}"], capsys)
    assert f"error: --synth-set: {builder.value.problem}\n  fix: {builder.value.fix}" in err, err
    assert not (tmp_path / "o").exists()


def test_fused_stages_switch_restores_and_bench_times_both(tmp_path):
    """fused_stages(False) turns use_inference_kernel off (the references run), restores on exit, even on an
    exception; bench_e2e --fused both times each point both ways (rows carry ``fused``)."""
    import torch

    from runners.engine.models import layers

    assert layers.FUSED_STAGES is True
    with pytest.raises(RuntimeError), layers.fused_stages(False):
        assert layers.FUSED_STAGES is False
        assert not layers.use_inference_kernel(torch.zeros(1))
        raise RuntimeError
    assert layers.FUSED_STAGES is True
    out = tmp_path / "bench"
    proc = _run(["--out", str(out), "--parts", "super_v3", "--arms", "plain", "--fused", "both", *FAST])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "bench_e2e.json").read_text())["rows"]
    assert sorted(r["fused"] for r in rows) == [False, True]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)


def test_cpu_run_reports_every_point(tmp_path):
    out = tmp_path / "bench"
    proc = _run(["--out", str(out), "--parts", "tiny,hf,super_v3", "--arms", "plain", "replay", *FAST])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_e2e.json").read_text())
    rows = report["rows"]
    assert not [r for r in rows if r.get("error")], [r["error"] for r in rows if r.get("error")]
    engine_rows = [r for r in rows if not r["model"].startswith("hf_")]
    got = sorted((r["model"], r["arm"], r["batch"], r["graphs"]) for r in engine_rows)
    want = sorted((m, a, 1, False) for m in ("tiny_nemotron_h", "tiny_qwen3_next", "super_v3")
                  for a in ("plain", "replay"))  # graphs asked both ways; no graphs on the CPU: one point
    assert got == want
    for r in engine_rows:
        assert r["decode_tokens_per_s"] > 0 and r["step_ms"] > 0 and r["steps"] >= 2
        phases = {"decode"} if r["arm"] == "plain" else {"draft", "verify", "commit", "catchup"}
        assert set(r["device_ms_per_step"]) == phases
        assert {"launch", "wait", "bookkeeping"} <= set(r["host_ms_per_step"])
        # the floor: active weight bytes (dense + distinct chosen experts) over the run's copy bandwidth
        assert not r.get("census_error") and r["census_steps"] >= 1 and r["compile"] is False
        assert r["active_weight_bytes"] == r["dense_weight_bytes"] + r["expert_weight_bytes"] > 0
        bw = report["environment"]["copy_bandwidth_bytes_per_s"]
        assert r["floor_ms"] == pytest.approx(1e3 * r["active_weight_bytes"] / bw)
        assert r["floor_tokens_per_s"] > 0 and r["kernels_per_step"] is None  # no device kernels on the CPU
    distinct = {r["arm"]: r["distinct_experts_per_step"] for r in engine_rows if r["model"] == "super_v3"}
    # 4 layers (Mamba2, MoE, attention, Mamba2) with 8 experts, top-k 8: every expert, every step; the MTP
    # module's MoE block adds its 8 when the step drafts
    assert distinct == {"plain": 8, "replay": 16}
    synth = [r for r in engine_rows if r["model"] == "super_v3" and r["arm"] == "replay"]
    assert synth and all(r["forced_acceptance_length"] == 2.6 for r in synth)
    assert all(abs(r["acceptance_length"] - 2.6) < 0.7 for r in synth)  # 2 steps: 2 or 3 tokens each
    hf = [r for r in rows if r["model"].startswith("hf_")]
    assert sorted(r["model"] for r in hf) == ["hf_tiny_nemotron_h", "hf_tiny_qwen3_next"]
    assert all(r["decode_tokens_per_s"] > 0 for r in hf)
    assert report["models"]["super_v3"]["num_layers"] == 4 and "targets" in report
    targets = set(report["targets"])
    assert {"super_v3_replay_vs_plain_b1", "tiny_nemotron_h_plain_graph_step_speedup_b1"} <= targets
    assert (out / "bench_e2e.png").stat().st_size > 1000


def test_cpu_profile_of_one_point(tmp_path):
    out = tmp_path / "prof"
    proc = _run(["--out", str(out), "--profile", "tiny_qwen3_next:rewind:1:eager", *FAST])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((out / "bench_e2e.json").read_text())["rows"]
    assert row["profile"] == "profile_tiny_qwen3_next_rewind_b1_eager.txt" and not row.get("error")
    assert "Self CPU" in (out / row["profile"]).read_text()
    assert (out / "profile_tiny_qwen3_next_rewind_b1_eager.json").stat().st_size > 1000


def test_full_depth_part_builds_dummy_weights_in_the_release_format(tmp_path):
    """A full-depth part (issue 26) builds the release's configuration in its format with dummy weights; on
    the CPU cut to three layers by --full-layers (the release's proportions: "ME*") and shrunk to eight
    experts through --synth-set (the GPU run uses the release's). The cut says so in the report and keeps the
    full-depth rate goal out of the targets; issue 43's step / floor goal is evaluated at any depth."""
    out = tmp_path / "bench"
    shrink = [*SHRINK, "n_routed_experts=8", "num_experts_per_tok=2"]
    proc = _run(["--out", str(out), "--parts", "super_v3_nvfp4", "--full-layers", "3", "0", "--arms", "plain",
                 "replay",
                 "--accept-length", "3.0", "--device", "cpu", "--batch-sizes", "1", "--steps", "2",
                 "--warmup-steps", "1", "--prompt-len", "12", "--dtype", "float32",
                 *[f"--synth-set={kv}" for kv in shrink]])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_e2e.json").read_text())
    info = report["models"]["super_v3_nvfp4"]
    assert info["format"] == "MIXED_PRECISION" and info["num_experts"] == 8
    assert info["num_layers"] == 3 and info["depth"] == "3 of 88 layers, --synth-set overrides"
    targets = report["targets"]
    assert "super_v3_nvfp4_plain_b1_tokens_per_s" not in targets
    over = targets["super_v3_nvfp4_plain_b1_step_over_floor"]
    plain = next(r for r in report["rows"] if r["arm"] == "plain")
    assert over["goal"] == "<= 2.0" and over["value"] is None and plain["graphs"] is False  # CPU: no graphs
    assert "released" in info["config_source"]
    rows = report["rows"]
    assert not [r for r in rows if r.get("error")], [r["error"] for r in rows if r.get("error")]
    assert sorted(r["arm"] for r in rows) == ["plain", "replay"]
    replay = next(r for r in rows if r["arm"] == "replay")
    assert replay["forced_acceptance_length"] == 3.0 and replay["decode_tokens_per_s"] > 0
    assert (out / "bench_e2e.png").stat().st_size > 1000  # full-depth parts get their panel too


def test_targets_are_the_issues_goals_per_model_and_compile_mode():
    """evaluate_targets: plain batch-1 step over its floor (<= 2), replay / plain tokens/s (>= 2.0 at batch 1,
    1.6 at 8), replay / rewind per batch (>= 1), compiled rows under their own keys, full-depth rates."""
    from benchmarks.bench_e2e import evaluate_targets

    def row(model, arm, batch, tps, compile=False, **kw):
        return {"model": model, "arm": arm, "batch": batch, "graphs": True, "compile": compile,
                "decode_tokens_per_s": tps, "step_ms": 1e3 * batch / tps, **kw}

    rows = [row("super_v3", "plain", 1, 250.0, floor_ms=2.5), row("super_v3", "replay", 1, 600.0),
            row("super_v3", "rewind", 1, 610.0), row("super_v3", "plain", 8, 1000.0),
            row("super_v3", "replay", 8, 1700.0), row("super_v3", "rewind", 8, 1600.0),
            row("super_v3", "plain", 1, 400.0, compile=True, floor_ms=2.5),
            row("qwen3_next_fp8", "plain", 1, 190.0),
            row("qwen3_next_fp8", "replay", 1, 300.0, token_digests=["a", "b", "c", "d"],
                first_request_tokens=[5, 6, 7, 8]),
            row("qwen3_next_fp8", "rewind", 1, 290.0, token_digests=["a", "x", "c", "d"],
                first_request_tokens=[5, 6, 9, 8])]
    t = evaluate_targets(rows)
    # replay vs rewind tokens: 3 of the 4 requests share their digest (informational, no goal met or missed)
    assert t["qwen3_next_fp8_replay_tokens_equal_rewind"]["value"] == {1: 0.75}
    assert t["qwen3_next_fp8_replay_tokens_equal_rewind"]["met"] is None
    assert t["qwen3_next_fp8_replay_rewind_first_divergence"]["value"] == {1: 2}  # the third token differs
    assert "super_v3_replay_tokens_equal_rewind" not in t  # its rows carry no digests
    assert not any(k.startswith("tiny_") for k in t)  # the tiny entries did not run: no empty goal rows
    assert t["super_v3_plain_b1_step_over_floor"] == {"value": 1.6, "goal": "<= 2.0", "met": True}
    for B, want in ((1, 2.4), (8, 1.7)):
        got = t[f"super_v3_replay_vs_plain_b{B}"]
        assert got["value"] == pytest.approx(want) and got["met"] is True
    assert t["super_v3_replay_vs_plain_b64"] == {"value": None, "goal": 1.6, "met": None}
    rr = t["super_v3_replay_vs_rewind"]
    assert rr["value"][1] == pytest.approx(600 / 610) and rr["met"] is False  # behind rewind at batch 1
    assert t["super_v3_compiled_plain_b1_step_over_floor"]["value"] == pytest.approx(1.0)
    assert t["super_v3_compiled_replay_vs_plain_b1"]["met"] is None  # no compiled replay row
    assert "qwen3_next_plain_b1_step_over_floor" not in t  # the quarter-depth Qwen3-Next did not run
    assert t["qwen3_next_fp8_plain_b1_tokens_per_s"]["met"] is True
    assert t["qwen3_next_fp8_replay_b1_tokens_per_s"] == {"value": 300.0, "goal": ">= 340.0", "met": False}
    assert "super_v3_nvfp4_plain_b1_tokens_per_s" not in t
    # graphs on and off are kept apart; a row whose outputs went non-finite counts towards no speed goal
    t2 = evaluate_targets([row("m", "replay", 8, 1e9, token_digests=["a", "b"], nonfinite=["lm_head"]),
                          row("m", "rewind", 8, 10.0, token_digests=["a", "b"]),
                          {**row("m", "replay", 8, 1e9, token_digests=["a", "b"]), "graphs": False},
                          {**row("m", "rewind", 8, 10.0, token_digests=["a", "x"]), "graphs": False},
                          row("super_v3", "plain", 8, 100.0),
                          row("super_v3", "replay", 8, 1e9, nonfinite=["layers.3.mamba"])])
    assert t2["m_replay_tokens_equal_rewind"]["value"] == {8: 1.0}
    assert t2["m_eager_replay_tokens_equal_rewind"]["value"] == {8: 0.5}
    assert t2["super_v3_replay_vs_plain_b8"]["value"] is None
    # --fused off rows (the references of the fused stages, a comparison) count towards no goal and no token
    # fraction; rows without the key (older runs) are fused rows
    t3 = evaluate_targets([{**row("super_v3", "plain", 1, 1e9, floor_ms=2.5), "fused": False},
                           row("super_v3", "plain", 1, 250.0, floor_ms=2.5, fused=True),
                           {**row("m", "replay", 8, 10.0, token_digests=["a"]), "fused": False},
                           row("m", "rewind", 8, 10.0, token_digests=["a"])])
    assert t3["super_v3_plain_b1_step_over_floor"]["value"] == 1.6
    assert "m_replay_tokens_equal_rewind" not in t3


def test_full_depth_rate_goal_reads_neither_unfused_nor_nonfinite_rows():
    """The full-depth batch-1 tokens/s goal takes the best fused, finite row: a faster --fused off row (the
    references, a comparison) or a row whose outputs went non-finite does not meet it."""
    from benchmarks.bench_e2e import evaluate_targets

    def row(tps, **kw):
        return {"model": "qwen3_next_fp8", "arm": "plain", "batch": 1, "graphs": True, "compile": False,
                "decode_tokens_per_s": tps, "step_ms": 1e3 / tps, **kw}

    t = evaluate_targets([row(170.0), row(500.0, fused=False), row(900.0, nonfinite=["lm_head"])])
    assert t["qwen3_next_fp8_plain_b1_tokens_per_s"] == {"value": 170.0, "goal": ">= 180.0", "met": False}
    assert evaluate_targets([row(190.0, fused=True)])["qwen3_next_fp8_plain_b1_tokens_per_s"]["met"] is True


def test_first_divergence():
    from benchmarks.bench_e2e import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [4, 2, 3]) == 0
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one is a prefix of the other: they part at its end
    assert first_divergence([], []) is None


def test_a_run_whose_every_point_failed_exits_one(tmp_path, monkeypatch, capsys):
    """Nothing measured is a failed run (exit 1), not a success with error rows (the review saw exit 0)."""
    from benchmarks import bench_e2e

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(bench_e2e, "_engine_point", broken)
    code = bench_e2e.main(["--out", str(tmp_path / "o"), "--parts", "super_v3", "--arms", "plain", *FAST])
    rows = json.loads((tmp_path / "o" / "bench_e2e.json").read_text())["rows"]
    assert code == 1 and rows and all(r.get("error") for r in rows)


def test_the_default_backend_is_held_to_the_fastest_named_one():
    """Issue 45's goal: per batch, the default backend's replay tokens/s over the faster named backend's
    (the one it is slowest against), met within DEFAULT_BACKEND_NOISE at every batch; batches without a
    named arm are left out; no named arm at all: no verdict."""
    from benchmarks.bench_e2e import DEFAULT_BACKEND_NOISE, evaluate_targets

    def row(arm, batch, tps):
        return {"model": "super_v3", "arm": arm, "batch": batch, "graphs": True, "compile": False,
                "decode_tokens_per_s": tps, "step_ms": 1e3 * batch / tps}

    rows = [row("replay", 1, 300.0), row("replay_triton", 1, 310.0), row("replay_flashinfer", 1, 300.0),
            row("replay", 8, 1200.0), row("replay_triton", 8, 1100.0), row("replay_flashinfer", 8, 1199.0),
            row("replay", 64, 6000.0)]
    t = evaluate_targets(rows)["super_v3_replay_default_vs_fastest_backend"]
    assert t["value"] == {1: 300.0 / 310.0, 8: 1200.0 / 1199.0} and t["against"] == {1: "replay_triton",
                                                                                      8: "replay_flashinfer"}
    assert t["met"] is False  # 0.968 at batch 1
    rows[1] = row("replay_triton", 1, 300.0 * (1 + DEFAULT_BACKEND_NOISE / 2))
    assert evaluate_targets(rows)["super_v3_replay_default_vs_fastest_backend"]["met"] is True
    bare = [row("replay", 1, 300.0)]
    assert evaluate_targets(bare)["super_v3_replay_default_vs_fastest_backend"] == {
        "value": {}, "against": {}, "goal": t["goal"], "met": None}


def test_release_step_over_floor_at_any_depth_and_rates_only_at_full_depth():
    """Issue 43's step / floor goals for the release parts (Super V3 NVFP4 plain batch 1 <= 2.0, Qwen3-Next
    FP8 <= 4.3, replay batch 64 <= 2.5) come from the rows at any depth; the full-depth tokens/s goals only
    from a part the report's models say ran at full depth (a part cut by --full-layers has its depth)."""
    from benchmarks.bench_e2e import evaluate_targets

    def row(model, arm, batch, step_ms, floor_ms):
        return {"model": model, "arm": arm, "batch": batch, "graphs": True, "compile": False,
                "decode_tokens_per_s": 1e3 * batch / step_ms, "step_ms": step_ms, "floor_ms": floor_ms}

    rows = [row("super_v3_nvfp4", "plain", 1, 5.0, 2.0), row("super_v3_nvfp4", "replay", 64, 50.0, 20.0),
            row("qwen3_next_fp8", "plain", 1, 4.0, 1.0),
            {**row("qwen3_next_fp8", "plain", 1, 3.0, 1.0), "compile": True}]
    half = {"super_v3_nvfp4": {"depth": "44 of 88 layers"}, "qwen3_next_fp8": {"depth": "24 of 48 layers"}}
    t = evaluate_targets(rows, half)
    assert t["super_v3_nvfp4_plain_b1_step_over_floor"] == {"value": 2.5, "goal": "<= 2.0", "met": False}
    assert t["super_v3_nvfp4_replay_b64_step_over_floor"] == {"value": 2.5, "goal": "<= 2.5", "met": True}
    assert t["qwen3_next_fp8_plain_b1_step_over_floor"] == {"value": 4.0, "goal": "<= 4.3", "met": True}
    assert t["qwen3_next_fp8_compiled_plain_b1_step_over_floor"]["value"] == 3.0  # compiled rows apart
    assert t["qwen3_next_fp8_replay_b64_step_over_floor"] == {"value": None, "goal": "<= 2.5", "met": None}
    assert "super_v3_nvfp4_compiled_plain_b1_step_over_floor" not in t  # no compiled Super rows
    assert not any(k.endswith("_tokens_per_s") for k in t)  # half depth: no full-depth rate
    full = evaluate_targets(rows, {"qwen3_next_fp8": {"depth": "full"}})
    assert full["qwen3_next_fp8_plain_b1_tokens_per_s"] == {"value": 333.3333333333333, "goal": ">= 180.0",
                                                            "met": True}
    assert "super_v3_nvfp4_plain_b1_tokens_per_s" not in full  # not among the models: its build failed
    older = evaluate_targets(rows, {"super_v3_nvfp4": {}})  # a report from before depths: full depth
    assert older["super_v3_nvfp4_plain_b1_tokens_per_s"]["value"] == 200.0


def test_part_depth_counts_the_releases_layers():
    """part_depth: "full" only for all of the release's layers with no --synth-set override; Qwen3-Next cut to
    24 of its 48 layers (each a mixer and an MoE: 96 layer types in the engine's config) says 24 of 48."""
    from benchmarks.bench_e2e import DEPTH_KEYS, part_depth
    from registry.releases import release_hybrid_config
    from runners.tools.synth import synth_config

    for family, n, most in (("qwen3_next", 24, 48), ("nemotron_h", 44, 88)):
        cut = {k: v for k, v in synth_config(family, num_layers=n).items() if k in DEPTH_KEYS}
        assert part_depth(family, cut, {}) == f"{n} of {most} layers"
    cut = {k: v for k, v in synth_config("qwen3_next", num_layers=24).items() if k in DEPTH_KEYS}
    assert len(release_hybrid_config("qwen3_next", "fp8", "fp8", overrides=cut).layer_types) == 48  # not 24
    assert part_depth("nemotron_h", {}, {}) == "full" and part_depth("qwen3_next", {}, {}) == "full"
    assert part_depth("nemotron_h", {"hidden_size": 128}, {"hidden_size": 128}) == (
        "88 of 88 layers, --synth-set overrides")


def test_kernel_settings_are_parsed_by_type_and_refused_by_name(tmp_path, capsys, monkeypatch):
    """--kernel-setting MODULE.NAME=VALUE sets one of bench_e2e.kernel_settings() (a choice of its module's
    own list, a bool, a float >= 0; spaces around the parts ignored) before any point runs; a name outside
    the list (another module, a constant, a dunder), a choice the setting does not take, a bad bool or number
    and an item without "=" are refused by name (exit 2, nothing written), and nothing is set when any item
    is refused."""
    from benchmarks.bench_e2e import apply_kernel_settings
    from kernels.quant import block_fp8, nvfp4, pair_cuda
    from runners.engine.models import moe

    for module, name in ((nvfp4, "GROUPED_KERNEL"), (pair_cuda, "PDL"), (pair_cuda, "GROUPED_FORM"),
                         (block_fp8, "GROUPED_CUDA_MIN_ROWS_PER_EXPERT"), (moe, "GLUE_KERNELS")):
        monkeypatch.setattr(module, name, getattr(module, name))  # put back after the test
    got = apply_kernel_settings(["kernels.quant.nvfp4.GROUPED_KERNEL = triton",
                                 "kernels.quant.pair_cuda.PDL=true",
                                 "kernels.quant.block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT=4",
                                 "runners.engine.models.moe.GLUE_KERNELS=false"])
    assert got == {"kernels.quant.nvfp4.GROUPED_KERNEL": "triton", "kernels.quant.pair_cuda.PDL": True,
                   "kernels.quant.block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT": 4.0,
                   "runners.engine.models.moe.GLUE_KERNELS": False}
    assert nvfp4.GROUPED_KERNEL == "triton" and pair_cuda.PDL is True and moe.GLUE_KERNELS is False
    assert block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT == 4.0
    form = pair_cuda.GROUPED_FORM
    with pytest.raises(ValueError, match="GROUPED_KERNEL must be one of"):
        apply_kernel_settings(["kernels.quant.pair_cuda.GROUPED_FORM=wide",
                               "kernels.quant.nvfp4.GROUPED_KERNEL=x"])
    assert pair_cuda.GROUPED_FORM == form  # the first item was not applied either
    out = str(tmp_path / "o")
    for item, says in (("torch.cuda.FOO=1", "is not a kernel setting this benchmark sets"),
                       ("kernels.quant.pair_cuda.ABI=99", "is not a kernel setting"),
                       ("kernels.quant.nvfp4.__doc__=x", "is not a kernel setting"),
                       ("kernels.quant.nvfp4.GROUPED_KERNEL=bogus", "must be one of ('triton', 'cuda')"),
                       ("kernels.quant.nvfp4.GROUPED_KERNEL=", "must be one of"),
                       ("kernels.quant.pair_cuda.GROUPED_FORM=tall", "must be one of ('auto', 'split'"),
                       ("kernels.quant.pair_cuda.PDL=maybe", "is a bool; give true or false"),
                       ("kernels.quant.block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT=nan", "is a number >= 0"),
                       ("kernels.quant.block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT=-5", "is a number >= 0"),
                       ("kernels.quant.nvfp4.GROUPED_KERNEL", "give MODULE.NAME=VALUE")):
        err = _refusal(["--out", out, "--device", "cpu", "--kernel-setting", item], capsys)
        assert says in err, (item, err)
    assert not (tmp_path / "o").exists()
