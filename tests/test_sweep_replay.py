"""benchmarks/sweep_replay.py end to end on the CPU (Triton interpreter, tiny shapes, one configuration
besides the current kernel): every operator gets checked headline rows, a best configuration, grid rows, the
stochastic-rounding rows, a JSON document and the plot. Times are not checked (they mean nothing here)."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks import sweep_replay  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep, not the dry run")
def test_dry_run_writes_json_plot_and_table(tmp_path, capsys):
    assert sweep_replay.main(["--dry-run", "--out", str(tmp_path), "--configs", "mma",
                              "--dtypes", "bfloat16"]) == 0
    res = json.loads((tmp_path / "sweep_replay.json").read_text())
    assert (tmp_path / "sweep_replay.png").stat().st_size > 0
    for op in sweep_replay.OPS:
        rows = res["headline_rows"][f"{op}/bfloat16"]
        assert set(rows) == {"fma", "mma"}
        assert all(r["ok"] and r["us"] > 0 and r["bytes"] > 0 for r in rows.values()), rows
        assert res["best"][f"{op}/bfloat16"] in rows
        assert {g["config"] for g in res["grid"] if g["op"] == op} >= {"fma"}
    writers = ("m2_write", "m2_flush", "gdn")
    assert set(res["sr"]) == {f"{op}/bfloat16/{res['best'][f'{op}/bfloat16']}" for op in writers}
    assert "error" in res["flashinfer"]
    assert "m2_write/bfloat16" in capsys.readouterr().out


def test_bad_arguments_are_refused(capsys):
    for argv, says in ((["--dry-run"], "--out DIR is required"),
                       (["--out", "x", "--dtypes", "int8"], "--dtypes"),
                       (["--out", "x", "--configs", "nope"], "--configs")):
        with pytest.raises(SystemExit) as e:
            sweep_replay.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
