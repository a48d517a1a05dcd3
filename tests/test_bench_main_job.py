"""benchmarks/bench_main_job.py: the side-by-side CPU measurement of `python run.py` (its numbers are
measurements, docs/performance.md; here only that it runs, splits the CPU time and compares generations)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_main_job


def _rec(ids, stats=None):
    return {"generated_ids": ids, "request_stats": stats or {"accepted_drafts": len(ids)}}


def test_compare_generations_counts_same_ids_and_counters_by_key():
    a = {"k1": _rec([1, 2]), "k2": _rec([3]), "k3": _rec([4, 5]), "only_a": _rec([9])}
    b = {"k1": _rec([1, 2]), "k2": _rec([3, 3]), "k3": _rec([4, 5], {"accepted_drafts": 0}),
         "only_b": _rec([])}
    got = bench_main_job.compare_generations(a, b)
    assert got == {"requests": 3, "only_in_one": 2, "same_generated_ids": 2, "same_request_stats": 1,
                   "differing_keys": ["k2", "k3"]}


def test_limit_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main_job.main(["--limit", "0"])
    assert e.value.code == 2 and "--limit 0" in capsys.readouterr().err


def test_one_arm_runs_run_py_and_splits_its_cpu_time(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert bench_main_job.main(["--limit", "2", "--out", str(out), "--keep", str(tmp_path / "runs")]) == 0
    report = json.loads(out.read_text())
    new = report["arms"]["new"]
    assert new["exit_status"] == 0 and set(report["arms"]) == {"new"}
    assert new["cpu_seconds"] == pytest.approx(new["user_seconds"] + new["system_seconds"])
    assert 0 < new["prefill_cpu_seconds"] and 0 < new["decode_cpu_seconds"] and new["other_cpu_seconds"] > 0
    assert new["figures"]["n"] == 2 and new["figures"]["verdict"] in ("pass", "fail")
    assert (tmp_path / "runs" / "new" / "generations.jsonl").is_file()
