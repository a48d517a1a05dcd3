"""results.json of one run: what it holds (docs/results_schema.md) and how it is computed from an evaluation.

`build_results` puts the resolved settings, the task's scores, the acceptance statistics (from the engine's
raw sums, read through evals.stats.GenerationCounters: the one definition of rate, length and
per-position acceptance), memory and timings into one dict; evals.verdict adds the verdict, evals.report
renders it, evals.compare pairs two of them. `read_results` is how every command reads a saved one back.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

from evals.stats import GenerationCounters, counters_of
from evals.task import task_of_results
from registry.errors import UserError
from registry.schema import REPO_ROOT, LoadFormat

# 2: environment, the scores' stderr, health (non-finite outputs, degenerate generations),
# config.ssm_state_dtype, verdict.headline, git_dirty counting untracked files under registry/ and configs/;
# acceptance counts only what was committed to the output (the engine's GenerationStats).
RESULTS_SCHEMA_VERSION = 2  # readers (evals/report.py) refuse other versions
RESULTS_FILE = "results.json"
GSM8K_TEST_ROWS = 1319  # questions of GSM8K's test split: the full run a projection is for
# Untracked files here change what a run means (a registry entry, a baseline row, a config group).
GIT_UNTRACKED_DIRS = ("registry", "configs")
# Distributions whose versions results.json records (importlib.metadata names; None when not installed).
VERSIONED_PACKAGES = {"torch": "torch", "triton": "triton", "lm_eval": "lm_eval",
                      "flashinfer": "flashinfer-python", "transformers": "transformers"}


def git_commit(repo: Path = REPO_ROOT) -> tuple[str | None, bool]:
    """(HEAD's commit of the checkout, whether it differs from HEAD); (None, False) outside git.

    Dirty: a tracked file changed, or an untracked file lies under registry/ or configs/ (a new entry,
    baseline file or config group changes the run without changing a tracked file). Untracked files
    elsewhere (outputs/, scratch files) do not count.
    """
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        untracked = subprocess.run(
            ["git", "ls-files", "--others", "--exclude-standard", "--", *GIT_UNTRACKED_DIRS],
            cwd=repo, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha, bool(dirty or untracked)
    except (OSError, subprocess.SubprocessError):
        return None, False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: str) -> str:
    """A readable name of the device a run used: the GPU's name for cuda[:N], the CPU's otherwise."""
    if device.startswith("cuda"):
        import torch

        try:
            return torch.cuda.get_device_name(torch.device(device))
        except (AssertionError, RuntimeError) as e:  # no CUDA build / driver: the run says so elsewhere
            return f"{device} (name unavailable: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu: {cpu}"


def environment(device: str) -> dict[str, Any]:
    """results.json `environment`: when and where the run finished and with which software."""
    return {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": device,
        "device_name": device_name(device),
        "python": platform.python_version(),
        **{name: _version(dist) for name, dist in VERSIONED_PACKAGES.items()},
    }


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def acceptance_section(stats: dict[str, Any], draft_len: int, counters: type[GenerationCounters]
                       ) -> dict[str, Any] | None:
    """results.json `acceptance`: GenerationStats.acceptance() of the scored requests' summed counters, with
    the run's draft length K and `requests_without_stats` (scored requests of a killed and resumed part whose
    steps are missing from the sums); None when speculation is off (K = 0).

    stats: the evaluation's `generation` dict (evals.evaluate.scored_stats: the counters' fields and more).
    """
    if draft_len == 0:
        return None
    return {"draft_len": draft_len, **counters_of(stats, counters).acceptance(),
            "requests_without_stats": int(stats.get("requests_without_stats", 0))}


def prefix_cache_section(stats: dict[str, Any], config: dict[str, Any], counters: type[GenerationCounters]
                         ) -> dict[str, Any]:
    """results.json `prefix_cache`: whether it was on (``enabled``) and its limit (``max_bytes``, from the
    config's runtime settings), with GenerationStats.prefix_cache() of the evaluation's sums (per-request
    lookups and hits of the scored requests; stores and evictions of every generate call of the folder).

    stats: the evaluation's `generation` dict; config: the resolved settings (``prefix_cache``,
    ``prefix_cache_bytes``, ``prefix_cache_off_reason``: why it was off, None when on)."""
    return {"enabled": bool(config.get("prefix_cache", False)), "max_bytes": config.get("prefix_cache_bytes"),
            "off_reason": config.get("prefix_cache_off_reason"),
            **counters_of(stats, counters).prefix_cache()}


def build_results(
    *,
    entry: str,
    model_key: str | None,
    config: dict[str, Any],
    composed_config: dict[str, Any],
    evaluation: Any,
    draft_len: int,
    memory: dict[str, int],
    load_seconds: float,
    eval_seconds: float,
    load: dict[str, Any] | None = None,
    counters: type[GenerationCounters],
) -> dict[str, Any]:
    """The results dict of one evaluated arm, without its verdict (docs/results_schema.md).

    config: the resolved settings (registry.resolve.ResolvedRun.to_dict(), with the backend that ran).
    evaluation: the evals.evaluate.EvalResult (its `task` names the task row whose section holds the
    scores). memory: engine.cache_memory(). Seconds: loading the engine and evaluating. load: the engine's
    load report (runners.engine.memory.LoadReport.to_dict(): seconds, weight / cache bytes, host and device
    peaks), None when the engine was not loaded from a checkpoint. Throughputs divide the tokens of every
    generate call of the folder by the seconds of those same calls (timing_* of the generation stats).
    """
    task = task_of_results({"task": dict(evaluation.task)})
    stats = dict(evaluation.stats)
    prefill_s, decode_s = stats.get("prefill_seconds", 0.0), stats.get("decode_seconds", 0.0)
    commit, dirty = git_commit()
    outputs = {k: v for k, v in (getattr(evaluation, "outputs", None) or {}).items() if k != "stderr"}
    stderr = (getattr(evaluation, "outputs", None) or {}).get("stderr") or {}
    return {
        "schema_version": RESULTS_SCHEMA_VERSION,
        "entry": entry,
        "model_key": model_key,
        "config": config,
        "composed_config": composed_config,
        "git_commit": commit,
        "git_dirty": dirty,
        "environment": environment(str(config.get("device", "cpu"))),
        # the task's scores (its section: {<score key>: fraction, ..., n, stderr})
        task.section: {**{k: evaluation.scores[k] for k in (*task.filters, "n")},
                       "stderr": {k: stderr.get(k) for k in task.filters}},
        # what would make any score meaningless: non-finite model outputs, degenerate generations
        "health": {"nonfinite": stats.get("nonfinite"), "outputs": outputs or None},
        # lm-eval task version, few-shot settings, lm-eval version and the data source actually read
        "task": dict(evaluation.task),
        "acceptance": acceptance_section(stats, draft_len, counters),
        "prefix_cache": prefix_cache_section(stats, config, counters),
        "memory": {k: int(v) for k, v in memory.items()},
        "load": load,
        "timings": {
            "wall_seconds": load_seconds + eval_seconds,
            "load_seconds": load_seconds,
            "eval_seconds": eval_seconds,
            "prefill_seconds": prefill_s,
            "decode_seconds": decode_s,
            "compile_seconds": stats.get("compile_seconds", 0.0),  # torch.compile of the step
            "compile_graphs": int(stats.get("compile_graphs", 0)),  # the graphs dynamo compiled for it
            "prefill_tokens_per_s": _rate(stats.get("timing_prompt_tokens", 0), prefill_s),
            "decode_tokens_per_s": _rate(stats.get("timing_generated_tokens", 0), decode_s),
        },
        "generation": stats,
        "resumed": {
            "num_resumed": evaluation.num_resumed,
            "num_generated": evaluation.num_generated,
            "requests_without_stats": int(stats.get("requests_without_stats", 0)),
        },
        "verdict": None,
        "samples_path": str(evaluation.samples_path),
    }


def read_results(path: str | Path) -> dict[str, Any]:
    """The dict a saved results.json holds; ``path``: the file, or the run folder that holds it.

    Raises UserError naming the file: it does not exist, cannot be read, is not JSON (cut short, e.g. copied
    while being written or from a full disk; the run writes it whole, evals.outdir.write_atomic) or is not a
    JSON object. What a reader needs inside it (`entry`, `config`, ...) is the reader's own check.
    """
    path = Path(path)
    file = path / RESULTS_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{file} does not exist",
                        f"pass the output folder of a finished run (it holds {RESULTS_FILE})")
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{file} is not JSON, or cannot be read ({e})",
                        f"restore it, or rewrite it by resuming its run (python run.py <its overrides> "
                        f"resume=true hydra.run.dir={file.parent}); or pass another run's folder") from None
    if not isinstance(data, dict):
        raise UserError(f"{file} is not a run's {RESULTS_FILE} (it holds a {type(data).__name__}, not an "
                        "object)", "pass the results.json a run wrote (docs/results_schema.md)")
    return data


def load_format(results: dict[str, Any]) -> str:
    """A results dict's ``config.load_format`` (registry.schema.LoadFormat's value: "auto" reads the
    checkpoint, "dummy" ran random weights); results written before the field existed read weights: "auto"."""
    return str((results.get("config") or {}).get("load_format") or LoadFormat.auto.value)


def exit_code(results: dict[str, Any]) -> int:
    """Process status for a results dict: 1 when a verdict check failed, else 0.

    0 also covers "no reference yet" (placeholder rows) and runs with verdict.require_reference=false that
    matched no row: nothing failed. Configuration problems never get here (UserError, status 2).
    """
    verdict = results.get("verdict") or {}
    return 1 if verdict.get("passed") is False else 0


def full_run_projection(timings: dict[str, Any], stats: dict[str, Any], *, max_gen_toks: int,
                        max_batch_size: int, full_n: int = GSM8K_TEST_ROWS) -> dict[str, Any] | None:
    """What the full GSM8K run (``full_n`` questions) would take at this run's measured rates: per question
    the mean prompt and generated tokens of the requests the timing covers (the generation stats'
    ``timing_prompt_tokens`` / ``timing_generated_tokens`` over ``timing_requests``: every generate call of
    the out_dir, so a resumed run's numerator and denominator cover the same requests), over the measured
    prefill and decode tokens/s, i.e. seconds = full_n * (prompt / prefill rate + generated / decode rate);
    ``upper_bound_seconds`` lets every question generate ``max_gen_toks`` tokens. Excludes the load and
    graph capture (``timings``' other entries: paid once).

    The rates hold at the concurrency they were measured at: ``measured_batch`` = the most requests one
    generate call sent (``timing_largest_call``), capped at ``max_batch_size``; the full run batches
    ``full_run_batch`` = min(max_batch_size, full_n). When these differ (a small eval.limit) the projection
    is only a rough upper bound (larger batches decode more tokens/s); ``batch_differs`` says so and the
    reports print it. No scaling model is applied.

    Returns:
        {"questions", "measured_questions", "prompt_tokens_per_question",
        "generated_tokens_per_question", "prefill_tokens_per_s", "decode_tokens_per_s",
        "projected_seconds", "upper_bound_seconds", "max_gen_toks", "measured_batch", "full_run_batch",
        "batch_differs"}; None without a measured rate or request.
    """
    prefill, decode = timings.get("prefill_tokens_per_s"), timings.get("decode_tokens_per_s")
    n = int(stats.get("timing_requests", 0))
    if not n or not prefill or not decode:
        return None
    prompt = stats.get("timing_prompt_tokens", 0) / n
    generated = stats.get("timing_generated_tokens", 0) / n
    measured_batch = min(int(stats.get("timing_largest_call", 0)) or n, max_batch_size)
    full_batch = min(max_batch_size, full_n)
    return {
        "questions": full_n,
        "measured_questions": n,
        "prompt_tokens_per_question": prompt,
        "generated_tokens_per_question": generated,
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": decode,
        "projected_seconds": full_n * (prompt / prefill + generated / decode),
        "upper_bound_seconds": full_n * (prompt / prefill + max_gen_toks / decode),
        "max_gen_toks": max_gen_toks,
        "measured_batch": measured_batch,
        "full_run_batch": full_batch,
        "batch_differs": measured_batch != full_batch,
    }
