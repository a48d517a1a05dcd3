"""benchmarks/sweep_replay.py end to end on the CPU (Triton interpreter, tiny shapes, one configuration
besides the current kernel): every operator gets checked headline rows, a best configuration, grid rows, the
stochastic-rounding rows, a JSON document and the plot. Times are not checked (they mean nothing here)."""

from __future__ import annotations

import json
import os
import re
import statistics
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks import ncu, sweep_replay  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep, not the dry run")
def test_dry_run_writes_json_plot_and_table(tmp_path, capsys):
    assert sweep_replay.main(["--dry-run", "--out", str(tmp_path), "--configs", "mma",
                              "--dtypes", "bfloat16"]) == 0
    res = json.loads((tmp_path / "sweep_replay.json").read_text())
    assert (tmp_path / "sweep_replay.png").stat().st_size > 0
    assert not (tmp_path / "sweep_replay.partial.json").exists()  # the whole document replaced it
    for op in sweep_replay.OPS:
        rows = dict(res["headline_rows"][f"{op}/bfloat16"])
        default = rows.pop("default", None)  # the engine's kernel there, beside the configurations
        assert set(rows) == {"fma", "mma"}
        assert all(r["ok"] and r["us"] > 0 and r["bytes"] > 0 for r in rows.values()), rows
        if any(op in ops for ops in sweep_replay.ENGINE_OPS.values()):  # (no FlashInfer in the dry run)
            assert default["backend"] == "triton" and default["us"] == rows[default["config"]]["us"], default
        assert res["best"][f"{op}/bfloat16"] in rows
        # the grid times the current kernel and the confirmed best of every operator of the op's engine launch
        group = next((ops for ops in sweep_replay.ENGINE_OPS.values() if op in ops), (op,))
        want = {"fma"} | {res["best"][f"{o}/bfloat16"] for o in group}
        assert {g["config"] for g in res["grid"] if g["op"] == op} == want
        assert sweep_replay.grid_configs(res, op, "bfloat16") == sorted(want)
    writers = ("m2_write", "m2_flush", "gdn")
    # the stochastic-rounding rows follow the confirmation pass: they time the confirmed choice
    assert set(res["sr"]) == {f"{op}/{d}/{res['best'][f'{op}/bfloat16']}" for op in writers
                              for d in ("bfloat16", "float16")}
    for key, rows in res["sr"].items():
        assert "error" not in rows, (key, rows)
        assert rows["stochastic"]["us"] > 0 and rows["round_to_nearest"]["bytes"] > 0
        assert rows["stochastic_philox"]["us"] > 0
    assert "error" in res["flashinfer"] and "error" in res["fla"] and "error" in res["flashinfer_gdn"]
    # the confirmation pass timed each operator's leaders again (the median of its rounds replaces the
    # headline time); "best" is the least of the updated rows
    assert set(res["confirm"]) == {f"{op}/bfloat16" for op in sweep_replay.OPS}
    for key, times in res["confirm"].items():
        rows = res["headline_rows"][key]
        assert set(times) == {"fma", "mma"}
        assert all(len(t) == sweep_replay.CONFIRM_ROUNDS for t in times.values())
        assert all(rows[c]["us"] == round(statistics.median(t), 2) and rows[c]["us_first"] > 0
                   for c, t in times.items())
        assert res["best"][key] == min(rows, key=lambda c: rows[c]["us"])
        assert res["best"][key] in times  # the choice is always a re-timed configuration
    assert "m2_write/bfloat16" in capsys.readouterr().out
    # the engine's defaults beside `best`, and the table the same run writes with --write-defaults
    assert res["defaults"] and set(res["defaults"].values()) <= {"fma", "mma"}
    assert {k.split("/")[0] for k in res["defaults"]} == {"mamba2_per_step", "mamba2_checkpointing", "gdn"}
    assert res["defaults"] == {k: v["config"] for k, v in sweep_replay.defaults_table(res)["rows"].items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep, not the dry run")
def test_a_sweep_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    """A sweep that dies after its headline (the device call's limit, a crash) leaves
    sweep_replay.partial.json with the headline rows and the last stage done."""
    def die(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_replay, "confirm_headline", die)
    with pytest.raises(KeyboardInterrupt):
        sweep_replay.main(["--dry-run", "--out", str(tmp_path), "--configs", "mma", "--dtypes", "bfloat16"])
    kept = json.loads((tmp_path / "sweep_replay.partial.json").read_text())
    assert kept["partial"] == "headline" and not (tmp_path / "sweep_replay.json").exists()
    assert set(kept["headline_rows"]) == {f"{op}/bfloat16" for op in sweep_replay.OPS}
    assert all(r["us"] > 0 for rows in kept["headline_rows"].values() for r in rows.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep, not the dry run")
def test_a_configuration_failing_in_the_grid_leaves_the_others_timed(tmp_path, monkeypatch):
    """One configuration raising at a grid point is that configuration's error row; the others are still
    timed there (they used to be skipped with it, so the defaults table could not compare them at that T)."""
    in_grid = {"on": False}
    grid_configs = sweep_replay.grid_configs

    def mark_grid(*a, **k):
        in_grid["on"] = True
        return grid_configs(*a, **k)

    timer_call = sweep_replay.Timer.__call__

    def failing(self, fn, *args, **kw):
        if in_grid["on"] and args and args[0] == sweep_replay.M2_CONFIGS["fma"]:
            raise RuntimeError("injected")
        return timer_call(self, fn, *args, **kw)

    monkeypatch.setattr(sweep_replay, "grid_configs", mark_grid)
    monkeypatch.setattr(sweep_replay.Timer, "__call__", failing)
    assert sweep_replay.main(["--dry-run", "--out", str(tmp_path), "--configs", "mma", "--dtypes",
                              "bfloat16", "--no-flashinfer"]) == 0
    grid = json.loads((tmp_path / "sweep_replay.json").read_text())["grid"]
    m2 = [g for g in grid if g["op"].startswith("m2_")]
    failed = [g for g in m2 if g.get("config") == "fma"]
    assert failed and all("injected" in g["error"] for g in failed)
    with_mma = {g["op"] for g in m2 if g.get("config") == "mma"}  # the operators whose grid times mma
    assert with_mma
    points = {(g["op"], g["T"], g["batch"]) for g in m2 if g["op"] in with_mma}
    timed_mma = {(g["op"], g["T"], g["batch"]) for g in m2 if g.get("config") == "mma" and "us" in g}
    assert timed_mma == points  # every point, though fma failed at each of them first


def test_bad_arguments_are_refused(capsys):
    for argv, says in ((["--dry-run"], "--out DIR is required"),
                       (["--out", "x", "--dtypes", "int8"], "--dtypes"),
                       (["--out", "x", "--configs", "nope"], "--configs")):
        with pytest.raises(SystemExit) as e:
            sweep_replay.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_no_gpu_is_refused_as_the_other_bad_arguments(monkeypatch, capsys, tmp_path):
    """Without a GPU (and without --dry-run) the sweep is refused in argparse's form (usage, `error:`,
    exit 2), naming the CPU alternative, before anything is written."""
    monkeypatch.setattr(sweep_replay.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        sweep_replay.main(["--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and "error: no CUDA GPU here" in err and "--dry-run" in err
    assert not (tmp_path / "o").exists()


def test_quick_sets_its_preset_unless_given(monkeypatch):
    seen = {}
    monkeypatch.setattr(sweep_replay.torch.cuda, "is_available", lambda: True)  # --ncu needs a GPU
    monkeypatch.setattr(sweep_replay, "ncu", lambda args: seen.update(vars(args)) or 0)
    assert sweep_replay.main(["--ncu", "--quick", "--out", "x"]) == 0
    assert seen["budget_s"] == 150.0 and seen["flashinfer_extra_s"] == 0.0
    assert seen["configs"] == ",".join(sweep_replay.QUICK_CONFIGS)
    assert sweep_replay.main(["--ncu", "--quick", "--out", "x", "--budget-s=50", "--configs", "mma"]) == 0
    assert seen["budget_s"] == 50.0 and seen["configs"] == "mma"


NCU_TEXT = """  _replay_verify_mma_kernel (128, 64, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Frequency                  Ghz         3.19
    Memory Throughput                 %        83.41
    DRAM Throughput                   %        83.41
    Duration                         us       101.95
    Compute (SM) Throughput           %        35.20
    Section: Launch Statistics
    Registers Per Thread    register/thread     110
    Shared Memory Configuration Size  Kbyte   1,024.00
    Section: Occupancy
    Block Limit Registers             block           4
    Theoretical Occupancy                 %       25
    Achieved Occupancy                    %    23.77
"""


def test_parse_ncu_reads_the_headline_metrics():
    got = sweep_replay.parse_ncu(NCU_TEXT)
    assert got["memory_throughput_pct"] == {"value": 83.41, "unit": "%"}
    assert got["duration"] == {"value": 101.95, "unit": "us"}
    assert got["registers_per_thread"]["value"] == 110
    assert got["achieved_occupancy_pct"]["value"] == 23.77
    assert got["theoretical_occupancy_pct"]["value"] == 25
    assert got["block_limit_registers"]["value"] == 4
    assert set(got) == set(sweep_replay.NCU_METRICS)
    assert sweep_replay.parse_ncu("==ERROR== no kernels were profiled") == {}


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
SWEEP = os.path.join(DOCS, "gpu", "kperf_1", "sweep", "sweep_replay.json")  # a committed sweep (H200)
EMPTY_SWEEP = {"shapes": {}, "headline": {}, "headline_rows": {}, "grid": []}


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it"),
    ("{bad", "not valid JSON"),
    ("[1, 2]", "a JSON list, not a sweep_replay output"),
    ("{}", "not a sweep_replay output: it lacks shapes"),
    ('{"rows": "x", "date": 5}', "not a sweep_replay output"),
    (json.dumps(EMPTY_SWEEP), "yields no defaults row"),
    (json.dumps({**EMPTY_SWEEP, "headline_rows": {"m2_write/bfloat16": 5}}), "malformed sweep_replay output"),
])
def test_from_json_refuses_what_is_not_a_sweep_and_writes_nothing(tmp_path, capsys, content, says):
    src, out = tmp_path / "sweep.json", tmp_path / "defaults.json"
    if content is not None:
        src.write_text(content)
    out.write_text("kept")  # e.g. kernels/replay_defaults.json: a refusal must leave it as it was
    assert sweep_replay.main(["--from-json", str(src), "--write-defaults", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "\n  fix: " in err, err
    assert out.read_text() == "kept"


def test_from_json_refuses_the_compile_report_and_an_unwritable_out(tmp_path, capsys):
    report = os.path.join(DOCS, "compile_report_sm90.json")
    argv = ["--from-json", report, "--write-defaults", str(tmp_path / "d.json")]
    assert sweep_replay.main(argv) == 2 and "not a sweep_replay output" in capsys.readouterr().err
    assert not (tmp_path / "d.json").exists()
    argv = ["--from-json", SWEEP, "--write-defaults", str(tmp_path / "no" / "d.json")]
    assert sweep_replay.main(argv) == 2
    err = capsys.readouterr().err
    assert "--write-defaults" in err and "cannot write it" in err and "\n  fix: " in err, err


def test_from_json_writes_the_table_of_a_committed_sweep(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert sweep_replay.main(["--from-json", SWEEP, "--write-defaults", str(out),
                              "--source-date", "2026-01-01"]) == 0
    doc = json.loads(out.read_text())
    want = sweep_replay.defaults_table(json.loads(open(SWEEP).read()), source=SWEEP, date="2026-01-01")
    assert doc == want and doc["rows"]
    assert f"{len(doc['rows'])} rows from {SWEEP}" in capsys.readouterr().out


def test_ncu_profiles_flashinfer_beside_ours_and_its_failure_is_not_the_runs(tmp_path, monkeypatch, capsys):
    """--ncu adds FlashInfer's checkpointing_ssu (3 pending, flush; both state dtypes) with its own kernel
    filter; a FlashInfer launch that fails is recorded with its exit code without failing the run,
    --no-flashinfer leaves it out."""
    import subprocess
    import types

    cmds = []

    def fake_run(cmd, capture_output, text):
        cmds.append(cmd)
        fi = cmd[-1].startswith("fi:")
        return types.SimpleNamespace(returncode=1 if fi else 0, stdout="" if fi else NCU_TEXT, stderr="")

    monkeypatch.setattr(ncu.shutil, "which", lambda name: sys.executable)
    monkeypatch.setattr(sweep_replay.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "ncu"
    assert sweep_replay.main(["--ncu", "--out", str(out)]) == 0
    summary = json.loads((out / "ncu_summary.json").read_text())
    fi = sorted(k for k in summary if k.startswith("fi:"))
    assert fi == sorted(sweep_replay.flashinfer_ncu_specs()) and len(fi) == 4
    assert "fi:checkpointing_ssu_pnat13_flush:float32" in fi  # ring 16 + T = 20 rows, flush at 13 pending
    assert all(summary[k]["exit"] == 1 for k in fi)
    fi_cmd = next(c for c in cmds if c[-1].startswith("fi:"))
    assert fi_cmd[fi_cmd.index("-k") + 1] == "regex:checkpointing_ssu|selective_state_update"
    ours = next(k for k in summary if not k.startswith("fi:"))
    assert summary[ours]["exit"] == 0 and summary[ours]["duration"]["value"] > 0
    cmds.clear()
    assert sweep_replay.main(["--ncu", "--no-flashinfer", "--out", str(tmp_path / "n2")]) == 0
    assert cmds and not any(c[-1].startswith("fi:") for c in cmds)


def test_ncu_configs_adds_those_configurations_where_an_operator_has_them(tmp_path, monkeypatch, capsys):
    """--ncu-configs cuda,fma_bv8: "cuda" (checkpointing only) on m2_ckpt / m2_flush, "fma_bv8" on gdn, each
    state dtype, once, beside the default specs, under the kernel filter that matches the CUDA kernel's name;
    --ncu-configs without --ncu and an unknown name are refused."""
    import subprocess
    import types

    cmds = []
    monkeypatch.setattr(ncu.shutil, "which", lambda name: sys.executable)
    monkeypatch.setattr(sweep_replay.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(subprocess, "run", lambda cmd, capture_output, text: cmds.append(cmd) or
                        types.SimpleNamespace(returncode=0, stdout=NCU_TEXT, stderr=""))
    assert sweep_replay.main(["--ncu", "--no-flashinfer", "--ncu-configs", "cuda,fma_bv8,fma",
                              "--dtypes", "bfloat16", "--out", str(tmp_path / "n")]) == 0
    specs = [c[-1] for c in cmds]
    assert len(specs) == len(set(specs))
    assert {sp for sp in specs if sp.split(":")[1] in ("cuda", "fma_bv8")} == {
        "m2_ckpt:cuda:bfloat16", "m2_flush:cuda:bfloat16", "gdn:fma_bv8:bfloat16"}
    cuda_cmd = next(c for c in cmds if c[-1] == "m2_ckpt:cuda:bfloat16")
    cu = (sweep_replay.mamba2.replay_cuda.SOURCE).read_text()
    kernel_name = re.search(r"__global__ void \w+ (\w+)\(", cu).group(1)  # the name ncu sees
    assert re.search(cuda_cmd[cuda_cmd.index("-k") + 1].removeprefix("regex:"), kernel_name)
    for argv, says in ((["--ncu-configs", "cuda", "--out", "x"], "is an option of --ncu"),
                       (["--ncu", "--ncu-configs", "nope", "--out", "x"], "--ncu-configs ['nope']")):
        with pytest.raises(SystemExit) as e:
            sweep_replay.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_ncu_sr_profiles_the_stochastic_rounding_rows_rn_and_sr(tmp_path, monkeypatch, capsys):
    """--ncu-sr: each state-writing operator's bf16 best from --sweep (the current kernel where the sweep
    has none), bf16 and fp16 state, round to nearest and stochastic, after the --dtypes filter (fp16 kept),
    each report in its own file; without --ncu it is refused."""
    import subprocess
    import types

    cmds = []
    monkeypatch.setattr(ncu.shutil, "which", lambda name: sys.executable)
    monkeypatch.setattr(sweep_replay.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(subprocess, "run", lambda cmd, capture_output, text: cmds.append(cmd) or
                        types.SimpleNamespace(returncode=0, stdout=NCU_TEXT, stderr=""))
    doc = json.loads(open(SWEEP).read())
    doc["best"] = {k: v for k, v in doc["best"].items() if not k.startswith("m2_flush/")}  # none: the current
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(doc))
    out = tmp_path / "n"
    assert sweep_replay.main(["--ncu", "--no-flashinfer", "--ncu-sr", "--sweep", str(sweep), "--dtypes",
                              "bfloat16", "--out", str(out)]) == 0
    sr = sorted(c[-1] for c in cmds if c[-1].count(":") == 3)
    chosen = {op: doc["best"].get(f"{op}/bfloat16") or sweep_replay.CURRENT for op in sweep_replay.SR_OPS}
    assert chosen["m2_flush"] == sweep_replay.CURRENT
    want = sorted(f"{op}:{cfg}:{d}:{m}" for op, cfg in chosen.items() for d in ("bfloat16", "float16")
                  for m in ("rn", "sr"))
    assert sr == want and len(sr) == 12
    assert (out / f"ncu_gdn_{chosen['gdn']}_float16_sr.txt").exists()
    assert f"gdn:{chosen['gdn']}:float16:sr" in json.loads((out / "ncu_summary.json").read_text())
    with pytest.raises(SystemExit) as e:
        sweep_replay.main(["--ncu-sr", "--out", "x"])
    assert e.value.code == 2 and "--ncu-sr is an option of --ncu" in capsys.readouterr().err
    # --ncu-sr-configs: that configuration's pairs too, on the operators that have it (GDN: no mma_c16_r80);
    # --ncu-sr-only: nothing but the pairs
    cmds.clear()
    assert sweep_replay.main(["--ncu", "--no-flashinfer", "--ncu-sr", "--ncu-sr-configs", "mma_c16_r80",
                              "--ncu-sr-only", "--sweep", str(sweep), "--dtypes", "bfloat16",
                              "--out", str(out)]) == 0
    extra = sorted(c[-1] for c in cmds if ":mma_c16_r80:" in c[-1])
    assert extra == sorted(f"{op}:mma_c16_r80:{d}:{m}" for op in ("m2_flush", "m2_write")
                           for d in ("bfloat16", "float16") for m in ("rn", "sr"))
    assert all(c[-1].count(":") == 3 for c in cmds) and len(cmds) == 12 + 8
    for flag in ("--ncu-sr-configs", "--ncu-sr-only"):
        with pytest.raises(SystemExit) as e:
            value = ["mma_c16_r80"] if flag == "--ncu-sr-configs" else []
            sweep_replay.main(["--ncu", flag, *value, "--out", "x"])
        assert e.value.code == 2 and "give --ncu --ncu-sr too" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a misspelt configuration is named, not silently dropped
        sweep_replay.main(["--ncu", "--ncu-sr", "--ncu-sr-configs", "mma_c16_r8", "--out", "x"])
    assert e.value.code == 2 and "--ncu-sr-configs ['mma_c16_r8']: not among" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_ncu_without_a_gpu_or_nsight_compute_is_refused_with_a_fix(tmp_path, monkeypatch, capsys):
    """--ncu on a machine without CUDA is refused as the sweep is (argparse's error, exit 2); with a GPU but
    no ncu, an error / fix pair; neither writes the output folder."""
    with pytest.raises(SystemExit) as e:
        sweep_replay.main(["--ncu", "--out", str(tmp_path / "a")])
    assert e.value.code == 2 and "--ncu: no CUDA GPU here" in capsys.readouterr().err
    monkeypatch.setattr(sweep_replay.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ncu.shutil, "which", lambda name: None)
    monkeypatch.setattr(sweep_replay.os.path, "exists", lambda path: False)
    assert sweep_replay.main(["--ncu", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "error: sweep_replay --ncu: Nsight Compute (ncu) is neither on PATH" in err
    assert "fix: install" in err
    monkeypatch.undo()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_ncu_with_a_sweep_without_best_and_from_json_with_ncu_are_refused(tmp_path, monkeypatch, capsys):
    """--ncu --sweep FILE whose JSON lacks "best" (or is not a sweep) is an error / fix pair, not a
    KeyError traceback; --from-json with --ncu / --ncu-configs (which it would ignore) is refused in
    argparse's form."""
    monkeypatch.setattr(ncu.shutil, "which", lambda name: sys.executable)
    monkeypatch.setattr(sweep_replay.torch.cuda, "is_available", lambda: True)
    bad = tmp_path / "sweep.json"
    bad.write_text(json.dumps({"shapes": {}, "headline": {}, "headline_rows": {}, "grid": []}))
    assert sweep_replay.main(["--ncu", "--sweep", str(bad), "--out", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert 'without its "best" configurations' in err and "fix:" in err
    bad.write_text("[1, 2]")
    assert sweep_replay.main(["--ncu", "--sweep", str(bad), "--out", str(tmp_path / "n")]) == 2
    assert "not a sweep_replay output" in capsys.readouterr().err
    for extra in (["--ncu"], ["--ncu-configs", "cuda"]):
        with pytest.raises(SystemExit) as e:
            sweep_replay.main(["--from-json", str(bad), "--write-defaults", str(tmp_path / "t.json"), *extra])
        assert e.value.code == 2 and "--from-json writes the defaults table" in capsys.readouterr().err


def test_confirmation_never_chooses_a_configuration_timed_once(monkeypatch):
    """confirm_headline: when the re-timed leaders all come back slower than a configuration the headline
    timed once, that one is re-timed too, and "best" is the fastest re-timed configuration (kperf_3 chose a
    once-timed 119.7 us that its own family re-timed at 270-320 us)."""
    op, key = "m2_ckpt", "m2_ckpt/bfloat16"
    names = ["fma", "mma", "mma_st3", "mma_p32w2", "mma_c16", "mma_split3"]
    headline = {"mma": 100.0, "mma_st3": 101.0, "mma_p32w2": 102.0, "mma_c16": 103.0, "mma_split3": 104.0,
                "fma": 200.0}
    retimed = {"mma": 300.0, "mma_st3": 310.0, "mma_p32w2": 320.0, "mma_c16": 150.0, "mma_split3": 140.0,
               "fma": 200.0}
    cfg_name = {id(sweep_replay._configs(op)[n]): n for n in names}
    calls = []

    class FakeTimer:
        def __call__(self, call, cfg, ms=None):
            calls.append(cfg_name[id(cfg)])
            return retimed[cfg_name[id(cfg)]]

        def copy_us(self, nbytes):
            return 1.0

    monkeypatch.setattr(sweep_replay, "_setup", lambda *a: (None, 1000, None))
    res = {"headline_rows": {key: {n: {"us": us, "ok": True} for n, us in headline.items()}},
           "best": {key: "mma"}}
    times = sweep_replay.confirm_headline(res, ["bfloat16"], 64, 4, FakeTimer(), "cpu", True)[key]
    # leaders (3 fastest + the current) all slower than mma_c16's single time -> mma_c16 re-timed (150), then
    # mma_split3's 104 beats it -> re-timed (140): the best, and no once-timed row is faster
    assert set(times) == {"mma", "mma_st3", "mma_p32w2", "fma", "mma_c16", "mma_split3"}
    assert res["best"][key] == "mma_split3" and res["best_first"][key] == "mma"
    assert all(len(t) == sweep_replay.CONFIRM_ROUNDS for t in times.values())
    assert res["headline_rows"][key]["mma_split3"]["us_first"] == 104.0


def test_warmups_done_waits_a_bounded_time_and_keeps_the_output():
    """warmups_done: a finished warm-up is done and its output is kept for the FlashInfer rows; one still
    running after the wait is not done (nothing killed), and a later read gets all of its output."""
    import subprocess

    quick = subprocess.Popen([sys.executable, "-c", "print('built' * 20000)"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # more than a pipe buffer holds
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3); print('late')"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert sweep_replay.warmups_done([quick], 30.0)
    assert sweep_replay._warmup_output(quick, 1.0).startswith("builtbuilt")
    assert not sweep_replay.warmups_done([quick, slow], 0.2)
    assert slow.poll() is None  # still running, not killed
    assert sweep_replay._warmup_output(slow, 30.0).strip() == "late"


def test_peers_are_timed_after_the_warmups_end(monkeypatch):
    """time_peers, as the sweep calls it after the grid while a FlashInfer warm-up may still be building: it
    waits for the warm-up (up to its deadline) before timing any peer, fla-core's first row included (kperf_4
    timed fla during the builds: 1.2-1.5x slow); with --no-flashinfer only fla-core's rows are timed."""
    import subprocess
    import time

    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5); print('built')"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []

    def peer(name):
        return lambda *a, **k: seen.append((name, build.poll() is not None)) or {"row": name}

    for fn in ("_flashinfer_rows", "_fla_rows", "_flashinfer_gdn_rows"):
        monkeypatch.setattr(sweep_replay, fn, peer(fn))
    res = {}
    sweep_replay.time_peers(res, [build], ["bfloat16"], None, "cuda", {}, time.time() + 30)
    assert sorted(name for name, _ in seen) == ["_fla_rows", "_flashinfer_gdn_rows", "_flashinfer_rows"]
    assert all(ended for _, ended in seen), seen
    assert res == {"flashinfer": {"row": "_flashinfer_rows"}, "fla": {"row": "_fla_rows"},
                   "flashinfer_gdn": {"row": "_flashinfer_gdn_rows"}}
    seen.clear()
    sweep_replay.time_peers(res, [], ["bfloat16"], None, "cuda", {}, time.time() + 30, no_flashinfer=True)
    assert [name for name, _ in seen] == ["_fla_rows"] and res["flashinfer"] == {"error": "--no-flashinfer"}
