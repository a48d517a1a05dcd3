"""results.json of one run: what it holds (docs/results_schema.md) and how it is computed from an evaluation.

`build_results` puts the resolved settings, the GSM8K scores, the acceptance statistics (from the engine's
raw sums: runners.engine.GenerationStats, the one definition of rate, length and per-position acceptance),
memory and timings into one dict; evals.verdict adds the verdict, evals.report renders it, evals.compare
pairs two of them.
"""

from __future__ import annotations

import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

from registry.schema import REPO_ROOT
from runners.engine import GenerationStats

RESULTS_SCHEMA_VERSION = 1  # readers (evals/report.py) refuse other versions
RESULTS_FILE = "results.json"


def git_commit(repo: Path = REPO_ROOT) -> tuple[str | None, bool]:
    """(HEAD's commit of the checkout, whether tracked files changed); (None, False) outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return None, False


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def acceptance_section(stats: dict[str, Any], draft_len: int) -> dict[str, Any] | None:
    """results.json `acceptance`: GenerationStats.acceptance() of the scored requests' summed counters, with
    the run's draft length K and `requests_without_stats` (scored requests of a killed and resumed part whose
    steps are missing from the sums); None when speculation is off (K = 0).

    stats: the evaluation's `generation` dict (evals.gsm8k.scored_stats: GenerationStats fields and more).
    """
    if draft_len == 0:
        return None
    names = {f.name for f in fields(GenerationStats)}
    counters = GenerationStats.from_dict({k: v for k, v in stats.items() if k in names})
    return {"draft_len": draft_len, **counters.acceptance(),
            "requests_without_stats": int(stats.get("requests_without_stats", 0))}


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
) -> dict[str, Any]:
    """The results dict of one evaluated arm, without its verdict (docs/results_schema.md).

    config: the resolved settings (registry.resolve.ResolvedRun.to_dict(), with the backend that ran).
    evaluation: the evals.gsm8k.GSM8KResult. memory: engine.cache_memory(). Seconds: loading the engine and
    evaluating. load: the engine's load report (runners.memory.LoadReport.to_dict(): seconds, weight / cache
    bytes, host and device peaks), None when the engine was not loaded from a checkpoint. Throughputs divide
    the tokens of every generate call of the folder by the seconds of those same calls (timing_* of the
    generation stats).
    """
    stats = dict(evaluation.stats)
    prefill_s, decode_s = stats.get("prefill_seconds", 0.0), stats.get("decode_seconds", 0.0)
    commit, dirty = git_commit()
    return {
        "schema_version": RESULTS_SCHEMA_VERSION,
        "entry": entry,
        "model_key": model_key,
        "config": config,
        "composed_config": composed_config,
        "git_commit": commit,
        "git_dirty": dirty,
        "gsm8k": {k: evaluation.scores[k] for k in ("strict_match", "flexible_extract", "n")},
        # lm-eval task version, few-shot settings, lm-eval version and the data source actually read
        "task": dict(evaluation.task),
        "acceptance": acceptance_section(stats, draft_len),
        "memory": {k: int(v) for k, v in memory.items()},
        "load": load,
        "timings": {
            "wall_seconds": load_seconds + eval_seconds,
            "load_seconds": load_seconds,
            "eval_seconds": eval_seconds,
            "prefill_seconds": prefill_s,
            "decode_seconds": decode_s,
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


def exit_code(results: dict[str, Any]) -> int:
    """Process status for a results dict: 1 when a verdict check failed, else 0.

    0 also covers "no reference yet" (placeholder rows) and runs with verdict.require_reference=false that
    matched no row: nothing failed. Configuration problems never get here (UserError, status 2).
    """
    verdict = results.get("verdict") or {}
    return 1 if verdict.get("passed") is False else 0
