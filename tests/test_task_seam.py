"""The task seam: a task row (evals.task.EvalTask) declares its scores, checks and report sections, and the
verdict, the report, the sweep table, the results history and its trend figures read what it declares.

A test-only task, `echo`, scores chrF (a character n-gram F-score, not exact match) and is judged by a floor
of its own instead of a reference row's hypothesis test; it runs no health check but `finite` and `empty` and
its report has the scores' table only. Its run goes through the same code paths a GSM8K run goes through, and
none of GSM8K's section, checks or plot appear.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from types import MappingProxyType

import pytest
from test_report import _results as gsm8k_results

import evals.task
from evals import history
from evals.report import PLOT_ACCURACY, format_console, render_markdown, write_report
from evals.results import RESULTS_SCHEMA_VERSION
from evals.sweep import collect_jobs, format_table
from evals.task import EvalTask, task_of_results
from evals.verdict import FAIL, PASS, evaluate_verdict

ECHO = EvalTask(
    name="echo", lm_eval_task="echo_chrf", local_task="echo_chrf_local", filters={"chrf": "chrf"},
    metric="chrf", section="echo", title="Echo", score_labels={"chrf": "chrF"}, score_unit="chrF (%)",
    score_check="floor", score_floors={"chrf": 0.40}, health_checks=("finite", "empty"),
    report_sections=("scores",), baselines="none.yaml", acceptance_baselines=None,
)


@pytest.fixture
def echo_task(monkeypatch):
    """The echo row added to the task table for the test."""
    monkeypatch.setattr(evals.task, "TASKS", MappingProxyType({**evals.task.TASKS, ECHO.name: ECHO}))
    return ECHO


def _echo_results(chrf: float = 0.55, n: int = 10) -> dict:
    """An echo run's results.json (docs/results_schema.md's shape, the echo task's section instead of
    GSM8K's), without its verdict."""
    return {
        "schema_version": RESULTS_SCHEMA_VERSION,
        "entry": "tiny_nemotron_h_mtp",
        "model_key": "tiny_nemotron_h_mtp",
        "config": {"model": {"name": "tiny_nemotron_h_mtp", "family": "nemotron_h",
                             "ssm": {"state_dtype": "float32", "backend": "torch"}},
                   "dtype": "float32", "device": "cpu", "ssm_replay": False, "world_size": 1, "draft_len": 3,
                   "ssm_backend": "torch", "eval": {"name": "echo", "limit": n, "num_fewshot": 0}},
        "git_commit": "0123abcd",
        "echo": {"chrf": chrf, "n": n, "stderr": {"chrf": 0.03}},
        "task": {"task": "echo_chrf", "version": 1.0, "num_fewshot": 0, "lm_eval_version": "0.4.13"},
        "health": {"nonfinite": [], "outputs": {"n": n, "empty": 1, "repeated_token": 9, "no_answer": n,
                                                "ended": n, "ended_no_answer": n}},
        "acceptance": {"draft_len": 3, "rate": 0.5, "length": 2.5, "per_position": [0.7, 0.5, 0.3],
                       "drafted": 30, "accepted": 15, "request_steps": 10,
                       "num_accepted_hist": [0, 2, 3, 3, 2]},
        "memory": {"ssm_state_bytes": 1024, "kv_cache_bytes": 2048},
        "timings": {"wall_seconds": 2.0, "prefill_seconds": 0.5, "decode_seconds": 1.0,
                    "prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 100.0},
    }


def _judged(results: dict) -> dict:
    verdict = evaluate_verdict(results, model_key=None, entry=results["entry"], dtype="float32",
                               spec_dec="mtp", draft_len=3, task=task_of_results(results))
    return json.loads(json.dumps({**results, "verdict": verdict.to_dict()}))


def test_the_row_is_found_from_the_results(echo_task):
    assert task_of_results(_echo_results()) is echo_task
    assert task_of_results(gsm8k_results()).section == "gsm8k"


def test_the_verdict_runs_the_declared_checks_only(echo_task):
    """The floor check on chrF and the two declared health checks; no reference row is needed (a floor
    judges), no GSM8K check, no repeated-token or answers check (the run would fail both)."""
    res = _judged(_echo_results(chrf=0.55))
    checks = {c["name"]: c for c in res["verdict"]["checks"]}
    assert set(checks) == {"echo.chrf", "health.finite", "health.empty", "acceptance.rate",
                           "acceptance.length"}
    assert checks["echo.chrf"]["status"] == PASS and checks["echo.chrf"]["threshold"] == 0.40
    assert checks["echo.chrf"]["unit"] == "fraction"
    assert res["verdict"]["passed"] is True and not any(n.startswith("gsm8k") for n in checks)

    failed = _judged(_echo_results(chrf=0.25))
    assert failed["verdict"]["passed"] is False
    assert failed["verdict"]["headline"].startswith("FAIL: echo.chrf")
    assert {c["name"]: c["status"] for c in failed["verdict"]["checks"]}["echo.chrf"] == FAIL


def test_the_verdict_refuses_results_without_the_tasks_section(echo_task):
    res = _echo_results()
    del res["echo"]
    with pytest.raises(ValueError, match=r"results\['echo'\] must hold chrf and n"):
        evaluate_verdict(res, model_key=None, entry="x", dtype="float32", task=echo_task)


def test_the_report_shows_the_declared_sections(echo_task, tmp_path):
    """summary.md has the echo section with its label and unit and no accuracy plot (not declared); the
    console names the task's title; GSM8K's section, labels and plot appear nowhere."""
    res = _judged(_echo_results())
    files = write_report(res, tmp_path)
    md = files.summary.read_text()
    assert "# tiny_nemotron_h_mtp: Echo and MTP acceptance" in md
    assert "## Echo" in md and "| chrF | 55.00 | 3.00 |" in md and "chrF (%)" in md
    assert "Samples scored: 10" in md and "mean of" not in md
    assert PLOT_ACCURACY not in files.plots
    console = format_console(res)
    assert "Echo chrF" in console and "55.00% (n=10)" in console
    for text in (md, console):
        assert "GSM8K" not in text and "strict-match" not in text and "flexible-extract" not in text
    # the GSM8K row's run still gets its own section and plot from the same code
    gsm8k_md = render_markdown(gsm8k_results(), {PLOT_ACCURACY: tmp_path / PLOT_ACCURACY})
    assert "## GSM8K" in gsm8k_md and "mean of both" in gsm8k_md and "## Echo" not in gsm8k_md


def test_the_sweep_table_and_the_history_read_the_tasks_section(echo_task, tmp_path):
    """A sweep job's row shows the echo score; the history records the run's score check under its own name
    and the trend report is written from it."""
    res = _judged(_echo_results())
    job = tmp_path / "sweep" / "0"
    job.mkdir(parents=True)
    (job / "results.json").write_text(json.dumps(res))
    (job / "job.json").write_text(json.dumps({"exit_code": 0, "sweep_dir": str(tmp_path / "sweep")}))
    (row,) = collect_jobs(tmp_path / "sweep")
    assert row.scores == "55.00 % (n=10)" and row.task == "echo"
    table = format_table([row], tmp_path / "sweep")
    assert "| Echo chrF " in table and "GSM8K" not in table
    gsm8k_row = dataclasses.replace(row, task="gsm8k_cot")
    assert "| scores " in format_table([row, gsm8k_row], tmp_path / "sweep")  # two rows' scores: no title
    assert "| GSM8K strict / flex " in format_table([gsm8k_row], tmp_path / "sweep")

    db = tmp_path / "history.db"
    history.import_runs([job], db)
    with sqlite3.connect(db) as con:
        names = {r[0] for r in con.execute("SELECT name FROM checks")}
        n, value, setting = con.execute("SELECT n, accuracy_value, setting FROM runs").fetchone()
    assert "echo.chrf" in names and not any(name.startswith("gsm8k") for name in names)
    assert n == 10 and value == pytest.approx(0.55) and "task=echo" in setting
    files = history.write_trend_report(db, tmp_path / "report")
    assert files.markdown.is_file()


def test_the_trend_figure_names_the_series_task(echo_task):
    """A history series of the echo task (its setting label names it) plots the echo score under the row's
    title; a series of the default row keeps GSM8K's."""
    from evals.trends import series_figure

    runs = [{"finished_at": f"2026-11-30T13:{m:02d}:00+00:00", "n": 10, "accuracy_value": v,
             "accuracy_threshold": 0.4, "verdict_passed": 1} for m, v in ((39, 0.55), (40, 0.6))]
    fig = series_figure("tiny_nemotron_h_mtp", "rewind K=3 float32 ws=1 cpu task=echo", runs)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "Echo (n=10)" in legend and not any("GSM8K" in t for t in legend), legend
    assert fig.axes[0].get_ylabel() == "fraction"
    fig = series_figure("tiny_nemotron_h_mtp", "rewind K=3 float32 ws=1 cpu", runs)
    assert fig.axes[0].get_ylabel() == "exact match (%)"
