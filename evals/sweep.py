"""A sweep's end: one table of every job (entry, settings, GSM8K, acceptance, verdict, folder) and the worst
job status, for `python run.py -m ...` and `python run.py +experiment=nightly` alike.

Each job of a multirun records how it ended in `<job folder>/job.json` (`record_job`, called by run.py: exit
status, the error line of a refused or crashed job, its overrides and the sweep folder). After the last job,
Hydra calls `SweepSummary.on_multirun_end` (registered in configs/config.yaml under hydra.callbacks) in the
launching process: it reads every job folder under the sweep folder (results.json + job.json, so it works the
same when the jobs ran elsewhere, e.g. as SLURM tasks through hydra-submitit-launcher), prints the table,
writes it to `<sweep dir>/sweep_summary.md`, imports the jobs' runs into the history database (a no-op for
runs the jobs recorded themselves, evals/history.py) and keeps the worst status for run.py's exit.

Exit statuses are run.py's: 0 passed (or no reference), 1 a check failed (or the job crashed, or left no
status: killed), 2 a user error.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from evals.outdir import JOB_STATUS_FILE
from evals.task import DEFAULT_TASK, TASKS, EvalTask, get_task, task_of_results

SUMMARY_FILE = "sweep_summary.md"

_last_worst: int | None = None  # set by SweepSummary.on_multirun_end, read by run.py (worst_status)


def in_multirun() -> bool:
    """Whether the current Hydra job is one job of a multirun (sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _write_json_atomic(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record_job(exit_code: int, error: str | None = None) -> Path | None:
    """Write job.json into the current multirun job's folder (no-op outside a multirun; returns its path).

    exit_code: the job's status (0 / 1 / 2 as run.py); error: the `error: ...` line of a refused job or the
    exception of a crashed one. Written through a temporary file + rename: a reader never sees half of it.
    """
    if not in_multirun():
        return None
    from hydra.core.hydra_config import HydraConfig

    h = HydraConfig.get()
    folder = Path(h.runtime.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "exit_code": int(exit_code),
        "error": error,
        "entry": h.runtime.choices.get("model"),
        "overrides": list(h.overrides.task),
        "job_num": int(h.job.num),
        "sweep_dir": str((Path(h.runtime.cwd) / str(h.sweep.dir)).resolve()),
    }
    path = folder / JOB_STATUS_FILE
    _write_json_atomic(path, data)
    return path


@dataclass
class JobRow:
    """One job of a sweep as the summary shows it."""

    folder: Path
    entry: str
    overrides: list[str]
    scores: str
    acceptance: str
    verdict: str
    exit_code: int
    job_num: int | None = None
    error: str | None = None  # the error / crash line of a refused or crashed job
    # exit 0 without a judged check (verdict.passed None: no baseline row, or dummy weights): "no reference"
    no_reference: bool = False
    task: str | None = None  # the task row whose scores `scores` shows (evals.task), None without results


def _pct(x: Any) -> str:
    return f"{100 * x:.2f}" if isinstance(x, int | float) else "-"


def _verdict_text(results: dict[str, Any]) -> str:
    verdict = results.get("verdict") or {}
    checks = verdict.get("checks") or []
    failed = [c["name"] for c in checks if c.get("status") == "fail"]
    noref = [c["name"] for c in checks if c.get("status") == "no_reference"]
    if failed:
        return "FAIL: " + ", ".join(failed)
    if verdict.get("passed") is None:
        return "no reference"
    return "PASS" + (f" (no reference: {', '.join(noref)})" if noref else "")


def _job_folders(sweep_dir: Path) -> list[Path]:
    """Folders of the sweep's jobs: those holding job.json or Hydra's .hydra/ (not descended into)."""
    found = []

    def walk(d: Path) -> None:
        if (d / JOB_STATUS_FILE).is_file() or (d / ".hydra").is_dir():
            found.append(d)
            return
        for sub in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
            walk(sub)

    if sweep_dir.is_dir():
        walk(sweep_dir)
    return found


def _overrides_of(folder: Path, job: dict[str, Any]) -> list[str]:
    if isinstance(job.get("overrides"), list):
        return [str(o) for o in job["overrides"]]
    path = folder / ".hydra" / "overrides.yaml"
    if path.is_file():
        import yaml

        with contextlib.suppress(Exception):
            return [str(o) for o in yaml.safe_load(path.read_text()) or []]
    return []


def collect_jobs(sweep_dir: str | os.PathLike) -> list[JobRow]:
    """Every job folder under sweep_dir as a JobRow, in job order (job number, else folder name).

    A job with results.json shows its scores and verdict; one with only job.json its error line; one with
    neither (killed, or still running) "no status" with exit 1.
    """
    from evals.results import RESULTS_FILE  # imports the engine's statistics (torch): not at module level

    rows = []
    for folder in _job_folders(Path(sweep_dir)):
        job: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            job = json.loads((folder / JOB_STATUS_FILE).read_text())
        results: dict[str, Any] | None = None
        with contextlib.suppress(OSError, ValueError):
            results = json.loads((folder / RESULTS_FILE).read_text())
        overrides = _overrides_of(folder, job)
        entry = job.get("entry") or (results or {}).get("entry") or next(
            (o.split("=", 1)[1] for o in overrides if o.startswith("model=")), "?")
        if results is not None:
            task = task_of_results(results)
            g = results.get(task.section) or {}
            scores = f"{' / '.join(_pct(g.get(k)) for k in task.filters)} % (n={g.get('n')})"
            acc = results.get("acceptance") or {}
            rate, length = acc.get("rate"), acc.get("length")
            if isinstance(rate, float) and isinstance(length, float):
                acceptance = f"{rate:.3f} / {length:.2f}"
            else:
                acceptance = "- (no drafts)" if not acc else "-"
            verdict = _verdict_text(results)
            passed = (results.get("verdict") or {}).get("passed")
            code = int(job.get("exit_code", 1 if passed is False else 0))
            no_reference = code == 0 and passed is None and not job.get("error")
        else:
            scores = acceptance = "-"
            no_reference = False
            code = int(job.get("exit_code", 1))
            verdict = ("no results.json in the job folder (out_dir= elsewhere?)" if job
                       else "no status: killed, or still running")
        error = str(job["error"]).splitlines()[0] if job.get("error") else None
        if error:  # a refused or crashed job (also one that crashed after writing results.json)
            verdict = "CRASH" if error.startswith("crash:") else f"ERROR (exit {code})"
        rows.append(JobRow(folder, str(entry), overrides, scores, acceptance, verdict, code,
                           job.get("job_num"), error, no_reference,
                           task_of_results(results).name if results is not None else None))
    rows.sort(key=lambda r: (r.job_num is None, r.job_num if r.job_num is not None else 0, str(r.folder)))
    return rows


@dataclass
class Summary:
    """A sweep's summary: the jobs, the worst exit status (0 for an empty sweep) and the table text."""

    sweep_dir: Path
    jobs: list[JobRow]
    worst: int
    text: str


def _scores_header(jobs: list[JobRow]) -> str:
    """The scores column's header: the task rows' title and short score labels when every job with results
    ran a row of the same header (the default row's when none has results), else "scores"."""
    def header(task: EvalTask) -> str:
        return f"{task.shown_title} {' / '.join(task.short_labels[k] for k in task.filters)}"

    headers = {header(get_task(j.task)) for j in jobs if j.task is not None} or {header(TASKS[DEFAULT_TASK])}
    return headers.pop() if len(headers) == 1 else "scores"


def format_table(jobs: list[JobRow], sweep_dir: Path) -> str:
    """The jobs as an aligned Markdown table, preceded by the overrides every job shares."""
    settings_of = [[o for o in j.overrides if not o.lstrip("+~").startswith(("model=", "experiment="))]
                   for j in jobs]
    common = [o for o in settings_of[0] if all(o in s for s in settings_of)] if jobs else []
    header = ["job", "entry", "settings", _scores_header(jobs), "acceptance rate / length", "verdict",
              "folder"]
    table = [header]
    for i, (j, settings) in enumerate(zip(jobs, settings_of)):
        own = " ".join(o for o in settings if o not in common) or "-"
        try:
            folder = str(j.folder.relative_to(sweep_dir)) or "."
        except ValueError:
            folder = str(j.folder)
        table.append([str(j.job_num if j.job_num is not None else i), j.entry, own, j.scores, j.acceptance,
                      j.verdict, folder])
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    lines = [line(table[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [line(r) for r in table[1:]]
    errors = [(row[0], j.error) for row, j in zip(table[1:], jobs) if j.error]
    if errors:
        lines += [""] + [f"job {num}: {err}" for num, err in errors]
    worst = max((j.exit_code for j in jobs), default=0)
    # exit 0 is "passed" or, with no check judged (no baseline row, dummy weights), "no reference"
    outcomes = sorted({(j.exit_code, j.no_reference) for j in jobs})
    counts = {o: sum((j.exit_code, j.no_reference) == o for j in jobs) for o in outcomes}
    words = {0: "passed", 1: "failed", 2: "refused (user error)"}
    tally = ", ".join(f"{n} {'no reference' if noref else words.get(code, f'exit {code}')}"
                      for (code, noref), n in counts.items())
    head = [f"Sweep {sweep_dir}: {len(jobs)} jobs ({tally or 'none'}); exit status {worst}"]
    if common:
        head.append(f"every job: {' '.join(common)}")
    return "\n".join(head + [""] + lines)


def summarize(sweep_dir: str | os.PathLike) -> Summary:
    """collect_jobs + format_table + the worst exit status of the sweep in sweep_dir."""
    sweep_dir = Path(sweep_dir).resolve()
    jobs = collect_jobs(sweep_dir)
    worst = max((j.exit_code for j in jobs), default=0)
    return Summary(sweep_dir, jobs, worst, format_table(jobs, sweep_dir))


def worst_status() -> int | None:
    """The worst job status of the last sweep summarised in this process (None: no sweep ended here)."""
    return _last_worst


class SweepSummary(Callback):
    """Hydra callback (configs/config.yaml hydra.callbacks.sweep_summary): the sweep's table at its end."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _last_worst
        sweep_dir = Path(str(config.hydra.sweep.dir))
        summary = summarize(sweep_dir)
        _last_worst = summary.worst
        print("\n" + summary.text)
        with contextlib.suppress(OSError):
            (summary.sweep_dir / SUMMARY_FILE).write_text(summary.text + "\n")
        self._import_history(config, summary.sweep_dir)

    @staticmethod
    def _import_history(config: DictConfig, sweep_dir: Path) -> None:
        """Record the sweep's runs that are not in the history yet (jobs on other hosts, failed writes)."""
        from evals.history import find_run_dirs, import_runs, resolve_db

        try:
            db = resolve_db((config.get("history") or {}).get("db"))
            if db is None or not find_run_dirs([sweep_dir]):
                return
            done = import_runs([sweep_dir], db)
        except Exception as e:  # noqa: BLE001 - the table and the exit status matter more than the import
            print(f"warning: the sweep's runs were not imported into the history: {e}", file=sys.stderr)
            return
        new = sum(r.inserted for _, r in done)
        print(f"history: {db} ({len(done)} run(s) of this sweep, {new} added now)")
