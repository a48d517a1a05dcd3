"""benchmarks/sweep_nvfp4_grouped.py (the grouped NVFP4 tensor-core GEMM's launch settings swept on the GPU):
its --smoke run on the CPU under the interpreter (rows written, outputs checked against the default's), the
grid's order, that a config reaches the launcher and is put back, the output check, the choice of the best
and the argument checks. The timings themselves run on the GPU machine."""

from __future__ import annotations

import json

import pytest

from benchmarks import sweep_nvfp4_grouped as sweep
from kernels.quant import _common, nvfp4

DEFAULT = {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 3, "block_k": 128}


def test_smoke_run_writes_ok_rows_that_match_the_default(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU smoke run (on a GPU the call.sh run covers it)")
    out = tmp_path / "smoke.json"
    assert sweep.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    configs = [r for r in report["rows"] if r["kind"] == "config"]
    assert len(configs) == 2 and report["skipped"] == []
    for r in configs:
        assert r["ok"] is True and r["error"] is None and r["bad_elements"] == 0, r
        assert r["max_rel_err"] <= 2.0**-7 and r["us"] > 0 and r["x_floor"] > 0
    launch = [r for r in configs if r["is_default_launch"]]
    assert len(launch) == 1 and launch[0]["bitwise_equal_default"] is True
    default = next(r for r in report["rows"] if r["kind"] == "default")
    assert default["ok"] is True  # against nvfp4_grouped_mm_ref
    cuda = next(r for r in report["rows"] if r["kind"] == "cuda")
    assert cuda["ok"] is False and cuda["error"].startswith("unsupported")
    assert report["best"]["up_t8"]["configs_ok"] == 2 and report["best_common"] is not None
    assert report["verdict"]["adopt"] is False  # host-clock times decide nothing
    assert {r["role"] for r in report["confirm"]} >= {"default", "default_launch"}
    # the settings are put back
    assert (nvfp4.MMA_TILE, nvfp4.MMA_BLOCK_K, nvfp4.MMA_NUM_STAGES) == (None, None, 3)


def test_the_grid_starts_at_the_default_then_single_changes():
    grid = sweep.configs(DEFAULT)
    assert grid[0] == DEFAULT
    keys = {tuple(c.values()) for c in grid}
    assert len(keys) == len(grid) == 2 * 4 * 2 * 4 * 3
    changed = [sum(c[k] != DEFAULT[k] for k in sweep.KEYS) for c in grid]
    assert changed == sorted(changed) and changed.count(1) == 3 + 1 + 3 + 2 + 1
    assert grid[1]["num_stages"] != 3  # the most promising axis first
    assert len(sweep.configs(DEFAULT, [16])) == 96
    # a default outside the grid is still timed first
    odd = {**DEFAULT, "block_n": 16}
    assert sweep.configs(odd, [16])[0] == odd and len(sweep.configs(odd, [16])) == 97


def test_the_default_launch_is_tile_config_at_the_verify_shape():
    assert sweep.default_launch(5632, 512, 2688) == DEFAULT
    assert sweep.default_launch(5632, 512, 1024) == DEFAULT


def test_a_config_is_seen_by_the_launcher_and_put_back():
    seen = lambda: (nvfp4.MMA_TILE, nvfp4.MMA_BLOCK_K, nvfp4.MMA_NUM_STAGES, nvfp4.GROUPED_KERNEL,
                    _common.GEMV_MAX_ROWS)
    keep = seen()
    c = {"block_m": 32, "block_n": 128, "num_warps": 8, "num_stages": 2, "block_k": 256}
    assert sweep.run_with(c, seen) == ((32, 128, 8), 256, 2, "triton", 0)
    assert seen() == keep

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        sweep.run_with(c, boom)
    assert seen() == keep


def test_the_check_flags_a_wrong_or_non_finite_output():
    import torch

    ref = torch.tensor([[1.0, -2.0, 0.0, 100.0]], dtype=torch.bfloat16)
    assert sweep.compare(ref.clone(), ref)["ok"] is True
    one_step = ref.clone()
    one_step[0, 3] = 100.5  # one bf16 step above 100
    assert sweep.compare(one_step, ref)["ok"] is True
    wrong = ref.clone()
    wrong[0, 0] = 1.5
    got = sweep.compare(wrong, ref)
    assert got["ok"] is False and got["bad_elements"] == 1 and got["max_rel_err"] == pytest.approx(0.005)
    nan = ref.clone()
    nan[0, 1] = float("nan")
    assert sweep.compare(nan, ref)["ok"] is False
    assert sweep.compare(ref[:, :2], ref)["ok"] is False


def test_best_is_the_fastest_ok_row_and_best_common_is_ok_everywhere():
    def r(proj, kind, us, ok=True, config=None, **kw):
        return {"proj": proj, "tokens": 256, "kind": kind, "us": us, "x_floor": us / 100, "gb_per_s": 1.0,
                "ok": ok, "config": config, **kw}

    a, b, c = ({**DEFAULT, "block_n": n} for n in (32, 128, 256))
    rows = [r("up", "default", 300.0), r("up", "cuda", 250.0), r("down", "default", 200.0),
            r("up", "config", 300.0, config=DEFAULT, is_default_launch=True),
            r("down", "config", 200.0, config=DEFAULT, is_default_launch=True),
            r("up", "config", 100.0, ok=False, config=a), r("down", "config", 100.0, config=a),  # wrong at up
            r("up", "config", 240.0, config=b), r("down", "config", 190.0, config=b),
            r("up", "config", 230.0, config=c), {"proj": "down", "tokens": 256, "kind": "config", "config": c,
                                                 "ok": False, "error": "OutOfResources"}]
    got = sweep.summarize(rows)
    assert got["best"]["up_t256"]["config"] == c and got["best"]["up_t256"]["speedup_vs_default"] == 1.304
    assert got["best"]["down_t256"]["config"] == a
    assert got["best"]["up_t256"]["cuda_us"] == 250.0 and got["best"]["down_t256"]["configs_failed"] == 1
    assert got["best_common"]["config"] == b and got["best_common"]["total_us"] == 430.0


@pytest.mark.parametrize("argv, says", [(["--out", "x.json", "--tokens", "0"], "--tokens"),
                                        (["--out", "x.json", "--budget-s", "0"], "--budget-s"),
                                        (["--out", "x.json", "--projs", "gate"], "invalid choice"),
                                        (["--out", "x.json", "--precompile", "-1"], "--precompile")])
def test_refuses_bad_arguments(argv, says, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(argv)
    assert says in capsys.readouterr().err


def test_needs_cuda_without_smoke(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert sweep.main(["--out", str(tmp_path / "s.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_precompile_runs_the_grid_in_worker_processes_and_stops_at_its_deadline():
    """--precompile's plumbing on the CPU (the workers inherit TRITON_INTERPRET=1 and run the smoke point):
    every config done in order, the while_waiting hook run once, a deadline that ends the workers early."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU plumbing check")
    spec = {"tokens": [sweep.SMOKE["tokens"]], "projs": sweep.SMOKE["projs"], "E": sweep.SMOKE["E"],
            "top_k": sweep.SMOKE["top_k"], "seed": 0, "device": "cpu"}
    small = {**DEFAULT, "block_n": 16}
    calls = []
    got = sweep.precompile(spec, [small, {**small, "block_k": 64}], 1, 60.0, lambda: calls.append(1))
    assert got["done_in_order"] == 2 and calls == [1]
    got = sweep.precompile(spec, [small] * 50, 1, 0.5)
    assert got["done_in_order"] < 50 and got["seconds"] < 20
