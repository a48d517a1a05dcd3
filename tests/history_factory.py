"""Run folders and results dicts for the history / trend tests, in the shape runners.app.main writes them
(docs/results_schema.md), without running a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def check(name: str, value: float, threshold: float | None, reference: float | None, unit: str) -> dict:
    status = "no_reference" if threshold is None else ("pass" if value >= threshold else "fail")
    return {"name": name, "value": value, "reference": reference, "threshold": threshold, "status": status,
            "passed": None if threshold is None else status == "pass", "unit": unit, "note": "",
            "details": {"metric": "mean", "n": 4} if name.startswith("gsm8k") else {}}


def make_results(entry: str = "tiny_nemotron_h_mtp", *, ssm_replay: bool = False,
                 correct: list[int] | None = None,
                 rate: float = 0.55, length: float = 2.6, rate_floor: float | None = 0.43,
                 accuracy_threshold: float | None = -20.0, commit: str = "abc123", compare: str | None = None,
                 comparison: dict | None = None, wall: float = 1.0) -> dict[str, Any]:
    """A results dict of one run over len(correct) questions (correct[i]: strict = flexible correctness)."""
    correct = [1, 0, 0, 1] if correct is None else correct
    n = len(correct)
    acc = sum(correct) / n
    checks = [check("gsm8k.mean", 100 * acc, accuracy_threshold, 1.9, "percent"),
              check("acceptance.rate", rate, rate_floor, None, "fraction"),
              check("acceptance.length", length, 2.09, 2.616, "tokens")]
    statuses = [c["status"] for c in checks]
    verdict_status = "fail" if "fail" in statuses else ("pass" if "pass" in statuses else "no_reference")
    out = {
        "schema_version": 1, "entry": entry, "model_key": entry,
        "config": {"model": {"name": entry, "ssm": {"state_dtype": "float32"}}, "ssm_replay": ssm_replay,
                   "world_size": 1, "draft_len": 3, "device": "cpu", "dtype": "float32",
                   "eval": {"limit": n, "num_fewshot": 5}, "compare": compare},
        "composed_config": {}, "git_commit": commit, "git_dirty": False,
        "gsm8k": {"strict_match": acc, "flexible_extract": acc, "n": n},
        "task": {"lm_eval_version": "0.4.13"},
        "acceptance": {"draft_len": 3, "rate": rate, "length": length},
        "memory": {"ssm_state_bytes": 1024, "kv_cache_bytes": 2048},
        "timings": {"wall_seconds": wall, "decode_tokens_per_s": 100.0, "prefill_tokens_per_s": 1000.0},
        "generation": {}, "resumed": {},
        "verdict": {"passed": {"fail": False, "pass": True}.get(verdict_status), "status": verdict_status,
                    "complete": None not in [c["threshold"] for c in checks], "checks": checks},
        "samples_path": "samples.jsonl",
    }
    if comparison is not None:
        out["comparison"] = comparison
    return out


def write_run(folder: Path, results: dict[str, Any], *, correct: list[int] | None = None,
              tokens: list[list[int]] | None = None, sweep_dir: Path | None = None) -> Path:
    """Write folder/results.json (+ samples.jsonl and generations.jsonl when correct is given, + job.json
    naming sweep_dir) as a finished run would leave them; returns folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results, indent=2))
    if correct is not None:
        tokens = tokens or [[7, i] for i in range(len(correct))]
        with open(folder / "samples.jsonl", "w") as s, open(folder / "generations.jsonl", "w") as g:
            for i, (c, t) in enumerate(zip(correct, tokens)):
                flags = {"strict_match": bool(c), "flexible_extract": bool(c)}
                s.write(json.dumps({"doc_id": i, "request_key": f"k{i}", "correct": flags}) + "\n")
                g.write(json.dumps({"key": f"k{i}", "generated_ids": t}) + "\n")
    if sweep_dir is not None:
        (folder / "job.json").write_text(json.dumps({"exit_code": 0, "sweep_dir": str(sweep_dir)}))
    return folder
