"""CPU seconds of the main job, ``python run.py``, for this checkout beside another commit, run side by side.

Runs ``python run.py <overrides> hydra.run.dir=<tmp>/<arm> history.db=null`` once from this checkout
(``new``) and, with ``--ref``, once from a copy of that commit's files (``ref``: ``git archive`` into a
temporary folder, nothing of this checkout changed) at the same time, so that both meet the same load on a
shared machine; then compares them:

- CPU seconds of each process (user + system, from ``os.wait4``, as ``/usr/bin/time`` reports them) and the
  share spent in prefills (``ModelRunner.prefill`` and ``Scheduler.admitted``; before the runner split,
  ``Generation.admit``), in decode steps (``ModelRunner.launch`` / ``read`` and ``Scheduler.read``; before,
  ``Generation.step``) and elsewhere (imports, lm-eval's request building and scoring, tokenizing, the
  report), measured inside the run by ``time.process_time`` around those methods;
- the README's figures of each run (GSM8K strict-match / flexible-extract, acceptance rate and length,
  verdict) and whether every request's generated token ids and per-request counters are the same in both
  (``generations.jsonl``, matched by request key).

    python -m benchmarks.bench_main_job --ref HEAD~3 --out docs/cpu_bench/main_job_full.json   # all 1319
    python -m benchmarks.bench_main_job --ref main --limit 128                                  # a quick look

The data folder is the one this checkout resolves (``eval.data_dir`` / $GSM8K_DIR / ../shared), passed to
both runs. CPU seconds on a shared machine move with what else runs (SMT and cache contention): compare the
two arms of one call, not numbers of different calls. Speed figures are measurements, no test checks them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("strict_match", "flexible_extract", "acceptance_rate", "acceptance_length", "verdict")

# Run inside each arm's process: time the scheduler's two phases, then run run.py as its own __main__.
_BOOT = """
import atexit, json, os, runpy, sys, time
sys.path.insert(0, os.getcwd())
acc = {"prefill_cpu_seconds": 0.0, "decode_cpu_seconds": 0.0}
try:
    import runners.engine.scheduler as scheduler
except ImportError:
    scheduler = None
try:
    import runners.engine.runner as runner
except ImportError:
    runner = None
def timed(cls, name, key):
    f = getattr(cls, name)
    def g(self, *a, **k):
        c = time.process_time()
        try:
            return f(self, *a, **k)
        finally:
            acc[key] += time.process_time() - c
    setattr(cls, name, g)
if scheduler is not None and hasattr(scheduler, "Generation"):  # a checkout before the runner split
    timed(scheduler.Generation, "admit", "prefill_cpu_seconds")
    timed(scheduler.Generation, "step", "decode_cpu_seconds")
elif runner is not None and hasattr(runner, "ModelRunner"):
    timed(runner.ModelRunner, "prefill", "prefill_cpu_seconds")
    timed(scheduler.Scheduler, "admitted", "prefill_cpu_seconds")
    for cls, name in ((runner.ModelRunner, "launch"), (runner.ModelRunner, "read"), (scheduler.Scheduler, "read")):
        timed(cls, name, "decode_cpu_seconds")
def dump():
    acc["process_cpu_seconds"] = time.process_time()
    with open(os.environ["BENCH_MAIN_JOB_SPLIT"], "w") as f:
        json.dump(acc, f)
atexit.register(dump)
sys.argv = ["run.py"] + sys.argv[1:]
runpy.run_path("run.py", run_name="__main__")
"""


def _export(ref: str, dest: Path) -> str:
    """The files of commit ``ref`` in ``dest`` (``git archive``); returns the full commit hash."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def _start(checkout: Path, overrides: list[str], out: Path, log: Path) -> tuple[subprocess.Popen, Path]:
    split = out.with_suffix(".split.json")
    env = {**os.environ, "BENCH_MAIN_JOB_SPLIT": str(split)}
    cmd = [sys.executable, "-c", _BOOT, *overrides, f"hydra.run.dir={out}", "history.db=null"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, split


def _wait(proc: subprocess.Popen) -> tuple[int, float, float]:
    """(exit status, user, system CPU seconds) of the finished process."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime, usage.ru_stime


def _figures(run_dir: Path) -> dict:
    r = json.loads((run_dir / "results.json").read_text())
    g, a = r["gsm8k"], r.get("acceptance") or {}
    return {"strict_match": g.get("strict_match"), "flexible_extract": g.get("flexible_extract"),
            "n": g.get("n"), "acceptance_rate": a.get("rate"), "acceptance_length": a.get("length"),
            "verdict": (r.get("verdict") or {}).get("status"), "timings": r.get("timings")}


def _generations(run_dir: Path) -> dict[str, dict]:
    lines = (run_dir / "generations.jsonl").read_text().splitlines()
    return {rec["key"]: rec for rec in map(json.loads, filter(None, lines))}


def compare_generations(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """How many requests (by key) both runs hold, and of those how many have the same generated ids and the
    same per-request counters; the first few keys that differ."""
    both = sorted(a.keys() & b.keys())
    ids = [k for k in both if a[k]["generated_ids"] == b[k]["generated_ids"]]
    stats = [k for k in both if a[k].get("request_stats") == b[k].get("request_stats")]
    differ = [k for k in both if k not in set(ids) or k not in set(stats)]
    return {"requests": len(both), "only_in_one": len(a.keys() ^ b.keys()), "same_generated_ids": len(ids),
            "same_request_stats": len(stats), "differing_keys": differ[:10]}


def main(argv: list[str] | None = None) -> int:
    from evals.tasks.gsm8k import gsm8k_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", default=None, help="a commit to run beside this checkout (e.g. HEAD~3, main)")
    p.add_argument("--limit", type=int, default=None, help="eval.limit (default: all 1319 questions)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here (printed either way)")
    p.add_argument("--keep", type=Path, default=None, help="a folder to keep both runs' output folders in")
    p.add_argument("overrides", nargs="*", help="more run.py overrides, for both arms")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit {args.limit}: give a number of questions >= 1, or leave it out for all")
    data_dir, _ = gsm8k_dir(None)
    if data_dir is None:
        p.error("no GSM8K folder found (eval.data_dir / $GSM8K_DIR / ../shared/data/gsm8k)")
    overrides = [f"eval.data_dir={data_dir}", *([f"eval.limit={args.limit}"] if args.limit else []),
                 *args.overrides]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip())
    report = {
        "command": "python -m benchmarks.bench_main_job " + " ".join(argv if argv is not None else sys.argv[1:]),
        "run_py_overrides": overrides,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average_before": os.getloadavg(),
        "arms": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_main_job_") as tmp:
        base = args.keep or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        arms = {"new": (REPO, f"{head}{' (uncommitted changes)' if dirty else ''}")}
        if args.ref:
            arms["ref"] = (Path(tmp) / "ref_checkout", None)
            arms["ref"] = (arms["ref"][0], _export(args.ref, arms["ref"][0]))
        procs = {}
        t0 = time.perf_counter()
        for arm, (checkout, _) in arms.items():
            procs[arm] = _start(checkout, overrides, base / arm, base / f"{arm}.log")
        for arm, (proc, split) in procs.items():
            status, user, system = _wait(proc)
            inside = json.loads(split.read_text()) if split.is_file() else {}
            entry = {"commit": arms[arm][1], "exit_status": status, "wall_seconds": time.perf_counter() - t0,
                     "user_seconds": user, "system_seconds": system, "cpu_seconds": user + system, **inside}
            if "process_cpu_seconds" in inside:
                entry["other_cpu_seconds"] = (inside["process_cpu_seconds"] - inside["prefill_cpu_seconds"]
                                              - inside["decode_cpu_seconds"])
            if (base / arm / "results.json").is_file():
                entry["figures"] = _figures(base / arm)
            else:
                entry["log_tail"] = (base / f"{arm}.log").read_text()[-2000:]
            report["arms"][arm] = entry
            print(f"{arm}: exit {status}, {user + system:.1f} CPU s", file=sys.stderr, flush=True)
        report["load_average_after"] = os.getloadavg()
        if "ref" in report["arms"] and all("figures" in e for e in report["arms"].values()):
            new, ref = report["arms"]["new"], report["arms"]["ref"]
            report["same_figures"] = all(new["figures"][k] == ref["figures"][k] for k in FIGURES)
            report["generations"] = compare_generations(_generations(base / "new"), _generations(base / "ref"))
            report["cpu_ratio_ref_over_new"] = ref["cpu_seconds"] / new["cpu_seconds"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    failed = any(e["exit_status"] not in (0, 1) for e in report["arms"].values())
    return 1 if failed or report.get("same_figures") is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
