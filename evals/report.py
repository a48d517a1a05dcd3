"""Readable report of one run: the console table, summary.md and PNG plots, from the results dict
(docs/results_schema.md).

Every section is optional: a run without speculative decoding gets no acceptance plots, a run without a
reference gets no threshold line, a run without a comparison gets one arm per plot. Plots use matplotlib's
object API on an Agg canvas (no pyplot, no global backend switch), so reports can be written from any
thread or process without a display.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evals.mpl import Figure, FigureCanvasAgg
from evals.outdir import ensure_writable_dir, write_atomic
from evals.results import RESULTS_FILE, RESULTS_SCHEMA_VERSION, read_results
from evals.task import EvalTask, task_of_results
from evals.verdict import NO_LOWER_BOUND, format_threshold, headline, threshold_binds
from registry.errors import UserError

SUMMARY_NAME = "summary.md"
PLOT_ACCURACY = "gsm8k_accuracy.png"
PLOT_PER_POSITION = "acceptance_per_position.png"
PLOT_LENGTH_HIST = "accepted_length_hist.png"



@dataclass
class ReportFiles:
    """Paths written by write_report: the Markdown summary and {plot name: PNG path}."""

    summary: Path
    plots: dict[str, Path] = field(default_factory=dict)


def _check_schema(results: Mapping[str, Any]) -> None:
    version = results.get("schema_version")
    if version != RESULTS_SCHEMA_VERSION:
        raise ValueError(
            f"results schema_version is {version!r}; this report reads {RESULTS_SCHEMA_VERSION} "
            "(docs/results_schema.md)"
        )


def _score_check(results: Mapping[str, Any], task: EvalTask) -> Mapping[str, Any] | None:
    """The verdict's first check of the task's scores (named "<section>.<...>"), None without one."""
    verdict = results.get("verdict") or {}
    for check in verdict.get("checks", []):
        if str(check.get("name", "")).startswith(task.section + "."):
            return check
    return None


def _acceptance_arms(results: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """[(label, acceptance dict)] for the plots: both arms of a comparison, else the run's own section."""
    comparison = results.get("comparison") or {}
    diff = comparison.get("acceptance")
    if diff:
        return [
            (
                comparison.get("label_a", "a"),
                {
                    "per_position": diff.get("per_position_a") or [],
                    "num_accepted_hist": diff.get("num_accepted_hist_a") or [],
                },
            ),
            (
                comparison.get("label_b", "b"),
                {
                    "per_position": diff.get("per_position_b") or [],
                    "num_accepted_hist": diff.get("num_accepted_hist_b") or [],
                },
            ),
        ]
    acceptance = results.get("acceptance")
    return [("this run", acceptance)] if acceptance else []


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return write_atomic(path, buf.getvalue())


def plot_title(results: Mapping[str, Any], what: str) -> str:
    """A plot's title: what it shows, then the run it belongs to -- entry, replay setting (or the compared
    arms), draft length K and the run's date (environment.timestamp_utc)."""
    c = results.get("config") or {}
    comparison = results.get("comparison")
    if comparison:
        replay = f"{comparison.get('label_a', 'a')} vs {comparison.get('label_b', 'b')}"
    else:
        replay = f"ssm_replay={str(c.get('ssm_replay')).lower()}"
    when = str((results.get("environment") or {}).get("timestamp_utc") or "")[:10] or "date unknown"
    return f"{what}\n{results.get('entry', '?')}, {replay}, K={c.get('draft_len', '?')}, {when}"


def _acceptance_floors(results: Mapping[str, Any]) -> dict[str, float]:
    """{"rate": floor, "length": floor} of the verdict's acceptance checks that had a reference."""
    out = {}
    for check in (results.get("verdict") or {}).get("checks", []):
        if (
            check.get("name") in ("acceptance.rate", "acceptance.length")
            and check.get("threshold") is not None
        ):
            out[check["name"].split(".")[1]] = float(check["threshold"])
    return out


def _grouped_bars(ax, categories: list[str], arms: list[tuple[str, list[float]]]) -> None:
    width = 0.8 / max(len(arms), 1)
    for j, (label, values) in enumerate(arms):
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(values))]
        bars = ax.bar(xs, values, width=width, label=label, zorder=2)
        # value labels on a white box above every reference / threshold line (zorder 3), so none hides them
        ax.bar_label(
            bars,
            fmt="%.2f",
            fontsize=7,
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
        )
    ax.set_xticks(range(len(categories)), categories)


def plot_accuracy(results: Mapping[str, Any], path: str | Path) -> Path | None:
    """The task's accuracy per score (percent), with the reference and pass threshold as lines and the band
    between them shaded when the verdict has a reference. With a comparison: both arms side by side.
    A threshold at or below 0 % (too few samples) is neither drawn nor written as a number: the legend says
    there is no lower bound at this n, and the y axis never goes below 0 %.

    Returns the PNG path, or None when the run's task (evals.task.task_of_results) declares no
    "accuracy_plot" report section or the results have no section of its scores.
    """
    task = task_of_results(results)
    scores = results.get(task.section)
    if not scores or "accuracy_plot" not in task.report_sections:
        return None
    comparison = results.get("comparison") or {}
    filters = comparison.get("filters") or {}
    keys = list(task.filters)
    categories = [task.labels.get(k, k) for k in keys]
    if filters and all(k in filters for k in keys):
        arms = [
            (comparison.get("label_a", "a"), [filters[k]["accuracy_a"] for k in keys]),
            (comparison.get("label_b", "b"), [filters[k]["accuracy_b"] for k in keys]),
        ]
    else:
        arms = [("this run", [100.0 * scores[k] for k in keys])]
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    _grouped_bars(ax, categories, arms)
    check = _score_check(results, task)
    shown = [v for _, values in arms for v in values]
    if check is not None and check.get("reference") is not None:
        ref, thr = check["reference"], check["threshold"]
        metric = check.get("details", {}).get("metric", "")
        n = scores.get("n")
        if threshold_binds(thr):
            ax.axhspan(
                thr,
                ref,
                color="tab:green",
                alpha=0.12,
                zorder=1,
                label=f"pass band: score >= threshold ({ref - thr:.2f} below the reference at n = {n})",
            )
        ax.axhline(ref, color="tab:green", linestyle="-", zorder=3, label=f"reference {ref:.2f} ({metric})")
        if threshold_binds(thr):
            ax.axhline(thr, color="tab:red", linestyle="--", zorder=3, label=f"pass threshold {thr:.2f}")
            shown.append(thr)
        else:  # a legend line only: nothing to draw, every score passes
            ax.plot([], [], linestyle="none", label=f"pass threshold: {NO_LOWER_BOUND} (n = {n}), any score "
                    "passes")
        ax.axhline(
            check["value"],
            color="black",
            linestyle=":",
            zorder=3,
            label=f"this run, {metric} {check['value']:.2f}",
        )
        shown.append(ref)
    # Zoom on the interesting range (a threshold band of a few points vanishes on a 0-100 axis); accuracies,
    # the reference and a drawn threshold all lie in [0, 100], and so does the axis.
    lo, hi = min(shown), max(shown)
    ax.set_ylim(max(0.0, lo - 10.0), min(100.0, hi + 5.0))
    ax.set_ylabel(task.score_unit)
    title = f"{task.shown_title}, n = {scores.get('n')} (y axis zoomed)"
    ax.set_title(plot_title(results, title), fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    return _save(fig, Path(path))


def plot_acceptance_per_position(results: Mapping[str, Any], path: str | Path) -> Path | None:
    """Fraction of request-steps whose draft i (i = 1..K) was accepted; both arms for a comparison.

    Returns the PNG path, or None without acceptance data (no speculative decoding).
    """
    arms = [(label, list(acc.get("per_position") or [])) for label, acc in _acceptance_arms(results)]
    arms = [(label, values) for label, values in arms if values]
    if not arms:
        return None
    k = max(len(values) for _, values in arms)
    arms = [(label, values + [0.0] * (k - len(values))) for label, values in arms]
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    _grouped_bars(ax, [str(i) for i in range(1, k + 1)], arms)
    floor = _acceptance_floors(results).get("rate")
    if floor is not None:
        # the mean over positions is the acceptance rate (every request-step drafts K), so its floor is a
        # line the positions' mean must reach
        ax.axhline(
            floor,
            color="tab:red",
            linestyle="--",
            zorder=3,
            label=f"acceptance-rate floor {floor:.2f} (mean over positions)",
        )
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance (fraction of request-steps)")
    ax.set_ylim(0, 1.1)
    ax.set_title(plot_title(results, "MTP per-position acceptance"), fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, Path(path))


def plot_accepted_length_hist(results: Mapping[str, Any], path: str | Path) -> Path | None:
    """Histogram of num_accepted_tokens per request-step (bars for 1..K+1 tokens committed), as fractions,
    with a vertical line at each arm's mean (its acceptance length) and at the acceptance-length floor.

    Returns the PNG path, or None without a histogram.
    """
    arms, means = [], []
    for label, acc in _acceptance_arms(results):
        hist = [int(x) for x in acc.get("num_accepted_hist") or []]
        total = sum(hist)
        if total > 0:
            arms.append((label, [h / total for h in hist]))
            means.append((label, sum(i * h for i, h in enumerate(hist)) / total))  # the acceptance length
    if not arms:
        return None
    size = max(len(values) for _, values in arms)
    arms = [(label, values + [0.0] * (size - len(values))) for label, values in arms]
    # num_accepted_tokens is in [1, K + 1] (the bonus token always commits): index 0 is always empty
    arms = [(label, values[1:]) for label, values in arms]
    fig = Figure(figsize=(6, 4.6))  # taller than the others: the legend sits below the axes
    ax = fig.add_subplot()
    _grouped_bars(ax, [str(i) for i in range(1, size)], arms)
    floor = _acceptance_floors(results).get("length")
    if floor is not None:
        # bar i sits at x = i - 1 (i tokens): the floor of the mean length at its place on that axis
        ax.axvline(
            floor - 1,
            color="tab:red",
            linestyle="--",
            zorder=3,
            label=f"acceptance-length floor {floor:.2f} tokens (the mean must reach it)",
        )
    for (label, mean), style in zip(means, ("-", ":")):
        # the run's mean (its acceptance length), on the bar axis like the floor (i tokens at x = i - 1)
        ax.axvline(mean - 1, color="black", linestyle=style, zorder=3,
                   label=f"mean{'' if len(means) == 1 else ' ' + label}: {mean:.2f} tokens")
    ax.set_xlabel("tokens committed per request-step (num_accepted_tokens)")
    ax.set_ylabel("fraction of request-steps")
    ax.set_title(plot_title(results, "Accepted length"), fontsize=9)
    # below the axes and their x label (inside, it covered the floor and mean lines); borderaxespad, in font
    # sizes (7 pt), clears the tick labels and the x label whatever the axes' height
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=5.5, ncol=2)
    return _save(fig, Path(path))


# ---------------------------------------------------------------------------------------------- console


def format_console(results: Mapping[str, Any]) -> str:
    """The short table run.py prints: model, settings, scores, acceptance, speed, memory, and the verdict
    with one line per check."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    def num(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:,.2f}{unit}"

    task = task_of_results(results)
    c, g, t = results["config"], results[task.section], results["timings"]
    acc = results.get("acceptance") or {}
    mem = sum(v for v in results["memory"].values() if isinstance(v, int | float))
    resumed = results.get("resumed") or {}
    ckpt = " (checkpointing)" if c.get("ssm_replay_checkpointing") else ""
    comparison = results.get("comparison")
    replay = "both arms (compare=replay)" if comparison else f"{c['ssm_replay']}{ckpt}"
    rows = [
        ("model", f"{results['entry']} ({c['model']['family']}, {c['dtype']}, {c['device']})"),
        *([("weights", "DUMMY (model.load_format=dummy: random; no accuracy can be judged)")]
          if c.get("load_format") == "dummy" else []),
        *([("acceptance", f"FORCED to length {c['forced_acceptance_length']} "
                          "(runtime.forced_acceptance_length)")]
          if c.get("forced_acceptance_length") is not None else []),
        ("ssm_replay / world_size", f"{replay} / {c['world_size']}"),
        ("ssm backend / state", f"{_backend_note(c)} / {_state_dtype(c)} state"),
        *([("FP8 GEMMs", _fp8_note(c["fp8_gemms"]))] if c.get("fp8_gemms") else []),
        ("draft length K", str(c["draft_len"]) + ("" if c["draft_len"] else " (speculation off)")),
        *([("prompts", _protocol_note(results))] if _protocol_note(results) else []),
    ]
    if comparison:  # one column per arm, labelled the same way for both
        rows += _arm_rows(comparison, g["n"], task)
    else:
        rows += [
            *((f"{task.shown_title} {task.labels[k]}", pct(g[k]) + (f" (n={g['n']})" if i == 0 else ""))
              for i, k in enumerate(task.filters)),
            ("acceptance rate", pct(acc.get("rate"))),
            ("acceptance length", num(acc.get("length"), " tokens/step")),
        ]
    # with compare=replay the speed, memory and load figures are the replay arm's (its results.json)
    arm = f" ({comparison.get('label_b', 'replay')} arm)" if comparison else ""
    rows += [
        (f"prefill{arm}", num(t["prefill_tokens_per_s"], " tok/s")),
        (f"decode{arm}", num(t["decode_tokens_per_s"], " tok/s")),
        (f"wall time{arm}", num(t["wall_seconds"], " s")
         + (f" (capture {t['capture_seconds']:,.1f} s)" if t.get("capture_seconds") else "")),
        (f"cache memory{arm}", f"{mem / 2**20:,.1f} MiB"),
    ]
    load = results.get("load")
    if load:
        weights = f"weights {load['weight_bytes'] / 2**30:,.2f} GiB"
        if load.get("weights_seconds"):  # the weights' read (or dummy build) rate
            weights += f" at {load['weight_bytes'] / load['weights_seconds'] / 1e9:,.2f} GB/s"
        peaks = [f"{where} peak {load[key] / 2**30:,.2f} GiB"
                 for where, key in (("device", "device_peak_bytes"), ("host RSS", "host_peak_rss_bytes"))
                 if load.get(key)]
        rows.append((f"load{arm}", ", ".join([f"{load['seconds']:,.1f} s", weights, *peaks])))
    pc = results.get("prefix_cache") or {}
    if pc.get("enabled"):
        rows.append(("prefix cache", f"{pct(pc.get('hit_rate'))} of prompt tokens reused "
                                     f"({pc.get('saved_prefill_tokens', 0):,} prefill tokens saved)"))
    if resumed.get("num_resumed"):
        done, new = resumed["num_resumed"], resumed["num_generated"]
        rows.append(("resumed", f"{done} samples from disk, {new} generated now"))
    proj = results.get("projection")
    if proj:
        rows.append((f"full {task.shown_title} projected{arm}", _projection_note(proj)))
    verdict = results.get("verdict")
    if verdict:
        rows.append(("verdict", _headline(verdict)))
        for ch in verdict["checks"]:
            rows.append((f"  {ch['name']}", _format_check(ch)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _projection_note(proj: Mapping[str, Any]) -> str:
    """`1,319 questions: 412.3 s (upper bound 655.0 s at 256 new tokens each), from 2 measured; measured at
    batch 2, the full run batches 16: a rough upper bound` (the last clause only when the batches differ;
    evals.results.full_run_projection)."""
    note = (f"{proj['questions']:,} questions: {proj['projected_seconds']:,.1f} s (upper bound "
            f"{proj['upper_bound_seconds']:,.1f} s at {proj['max_gen_toks']} new tokens each), from "
            f"{proj['measured_questions']} measured")
    measured, full = proj.get("measured_batch"), proj.get("full_run_batch")
    if measured is not None and full is not None and measured != full:
        note += f"; measured at batch {measured}, the full run batches {full}: a rough upper bound"
    return note


def _headline(verdict: Mapping[str, Any]) -> str:
    """The verdict line: the saved headline, or (older results) one built from the checks."""
    return verdict.get("headline") or headline(
        verdict.get("status", "?"),
        [(c.get("name", "?"), c.get("status", "?")) for c in verdict.get("checks", [])],
    )


def _state_dtype(config: Mapping[str, Any]) -> str:
    """The SSM state dtype that ran (``config.ssm_state_dtype``, else the entry's), "?" when unknown."""
    dtype = config.get("ssm_state_dtype") or ((config.get("model") or {}).get("ssm") or {}).get("state_dtype")
    return str(dtype or "?")


def _arm_rows(comparison: Mapping[str, Any], n: int, task: EvalTask) -> list[tuple[str, str]]:
    """Console rows of a comparison: each quantity once, with both arms' values under their labels."""
    a, b = comparison.get("label_a", "a"), comparison.get("label_b", "b")
    filters = comparison.get("filters") or {}
    acc = comparison.get("acceptance") or {}

    def pct(x: float | None, scale: float = 1.0) -> str:
        return "-" if x is None else f"{scale * x:.2f}%"

    def pair(x: str, y: str) -> str:
        return f"{a} {x:>10}   {b} {y:>10}"

    rows = [("arms", f"{a} (A, ssm_replay=false) vs {b} (B, ssm_replay=true), n={n} each")]
    for key, label in ((k, f"{task.shown_title} {task.labels[k]}") for k in task.filters):
        f = filters.get(key) or {}
        rows.append((label, pair(pct(f.get("accuracy_a")), pct(f.get("accuracy_b")))))
    rows.append(("acceptance rate", pair(pct(acc.get("rate_a"), 100), pct(acc.get("rate_b"), 100))))
    la, lb = acc.get("length_a"), acc.get("length_b")
    rows.append(
        (
            "acceptance length",
            pair("-" if la is None else f"{la:.2f}", "-" if lb is None else f"{lb:.2f}") + " tokens/step",
        )
    )
    div = comparison.get("divergence")
    if div:
        where = (
            "no divergence"
            if div.get("min_first_divergence") is None
            else f"first divergence at token {div['min_first_divergence']}"
        )
        rows.append(("generated tokens", f"{div['num_identical']} of {div['n']} samples identical; {where}"))
    return rows


def _format_check(ch: Mapping[str, Any]) -> str:
    digits = _DIGITS.get(ch.get("unit"), 4)

    def f(x: Any) -> str:
        return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))

    if ch["status"] == "no_reference":
        why = (ch.get("note") or "no row").splitlines()[0]
        return f"{f(ch['value'])}: no reference ({why})"
    word = "pass" if ch["status"] == "pass" else "FAIL"
    ref = f", reference {f(ch['reference'])}" if ch.get("reference") is not None else ""
    threshold = ch.get("threshold")
    if ch.get("unit") == "percent" and threshold is not None and not threshold_binds(threshold):
        n = (ch.get("details") or {}).get("n")
        word += f" (cannot fail at n={n}: too few samples for this test)"
        return f"{f(ch['value'])} vs {NO_LOWER_BOUND}{ref}: {word}"
    return f"{f(ch['value'])} vs threshold {f(ch['threshold'])}{ref}: {word}"


def _protocol_note(results: dict[str, Any]) -> str:
    """"5-shot, at most 256 generated tokens": the protocol the run's prompts and generations had (its task
    section), "" for results without it."""
    t = results.get("task") or {}
    if t.get("num_fewshot") is None or t.get("max_gen_toks") is None:
        return ""
    return f"{t['num_fewshot']}-shot, at most {t['max_gen_toks']} generated tokens"


def _backend_note(config: Mapping[str, Any]) -> str:
    """The backend that ran, and the entry's when that differs (the CPU runs the PyTorch references; the
    engine falls back from flashinfer to triton where FlashInfer cannot run)."""
    ran = config["ssm_backend"]
    asked = config["model"]["ssm"]["backend"]
    if asked == ran:
        return ran
    why = "the CPU runs the PyTorch references" if config["device"] == "cpu" else "fallback, see the log"
    return f"{ran} (entry: {asked}; {why})"


def _fp8_note(report: Mapping[str, Any]) -> str:
    """``config.fp8_gemms`` (runners.engine.quant.prepare_fp8's report) in words: how many FP8 linear layers
    ran
    torch._scaled_mm or the dequantizing reference, which GEMMs the FP8 MoE blocks ran, the block-FP8 / NVFP4
    modules' GEMMs where the model has them, KV-scaled blocks."""

    def counts(d: Mapping[str, int]) -> str:
        return ", ".join(f"{n} {path}" for path, n in sorted(d.items())) or "none"

    linear, moe = counts(report.get("fp8_linears") or {}), counts(report.get("fp8_moe") or {})
    extra = "".join(f"; {label} {counts(report[key])}" for key, label in (
        ("block_fp8_linears", "block-FP8 linear"), ("block_fp8_moe", "block-FP8 MoE experts"),
        ("nvfp4_linears", "NVFP4 linear"), ("nvfp4_moe", "NVFP4 MoE experts")) if report.get(key))
    kv = report.get("kv_scales", 0)
    return f"linear {linear}; MoE experts {moe}{extra}; KV scales for {kv} attention blocks"


# ---------------------------------------------------------------------------------------------- Markdown

# Decimal places of a check's numbers by its unit (console and summary.md alike).
_DIGITS = {"percent": 2, "samples": 0, "outputs": 0}


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _flatten(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(config, Mapping):
        out = []
        for k, v in config.items():
            out += _flatten(v, f"{prefix}{k}.")
        return out
    return [(prefix.rstrip("."), config)]


def _verdict_lines(verdict: Mapping[str, Any]) -> list[str]:
    lines = [f"**Verdict: {_headline(verdict)}**", ""]
    rows = []
    for c in verdict.get("checks", []):
        digits = _DIGITS.get(c.get("unit"), 4)
        status = {"pass": "pass", "fail": "**FAIL**", "no_reference": "no reference"}.get(
            c.get("status"), "?"
        )
        # a GSM8K threshold at or below 0 % reads "no lower bound at this n", never a negative score
        fmt_threshold = format_threshold if c.get("unit") == "percent" else _fmt
        threshold = fmt_threshold(c.get("threshold"), digits)
        rows.append(
            [
                c.get("name"),
                _fmt(c.get("value"), digits),
                _fmt(c.get("reference"), digits),
                threshold,
                status,
                c.get("note", ""),
            ]
        )
    return lines + _table(["check", "value", "reference", "threshold", "result", "note"], rows)


def render_markdown(results: Mapping[str, Any], plots: Mapping[str, str | Path] | None = None) -> str:
    """The summary.md text for `results`; `plots` maps plot names to files linked relative to summary.md."""
    _check_schema(results)
    plots = plots or {}
    entry = results.get("entry", "?")
    task = task_of_results(results)
    out = [f"# {entry}: {task.shown_title} and MTP acceptance", ""]
    if (results.get("config") or {}).get("load_format") == "dummy":
        out += ["**Dummy weights** (`model.load_format=dummy`): random weights at the model's configuration "
                f"({results['config'].get('config_source')}); speed and memory are real, no accuracy can be "
                "judged." + (f" Acceptance forced to length {results['config']['forced_acceptance_length']} "
                             "(`runtime.forced_acceptance_length`): every verify accepts a fixed schedule of "
                             "drafts, so the steps and the projection are those of MTP at that length."
                             if results["config"].get("forced_acceptance_length") is not None else ""), ""]
    commit = results.get("git_commit")
    out += [f"- git commit: `{commit or 'unknown'}`" + (" (dirty tree)" if results.get("git_dirty") else "")]
    hf_id = ((results.get("config") or {}).get("model") or {}).get("hf_id")
    if hf_id:
        out += [f"- checkpoint: [`{hf_id}`](https://huggingface.co/{hf_id}) (the entry's `hf_id`)"]
    if results.get("model_key"):
        out += [f"- baseline key: `{results['model_key']}` (registry/baselines/)"]
    fp8 = (results.get("config") or {}).get("fp8_gemms")
    if fp8:
        out += [f"- FP8 GEMMs that ran: {_fp8_note(fp8)}"]
    resumed = results.get("resumed") or {}
    if resumed.get("num_resumed"):
        out += [f"- resumed: {resumed['num_resumed']} samples read from generations.jsonl, "
                f"{resumed['num_generated']} generated by the finishing run"]
    env = results.get("environment") or {}
    if env:
        versions = ", ".join(
            f"{k} {env[k]}"
            for k in ("torch", "triton", "lm_eval", "flashinfer", "transformers")
            if env.get(k)
        )
        out += [
            f"- finished: {env.get('timestamp_utc')} (UTC) on {env.get('host')}, {env.get('device_name')}",
            f"- software: Python {env.get('python')}, {versions}",
        ]
    c = results.get("config") or {}
    if c:
        prompts = _protocol_note(results)
        out += [
            f"- settings: dtype {c.get('dtype')}, SSM state {_state_dtype(c)}, draft length K = "
            f"{c.get('draft_len')}, ssm_replay {str(c.get('ssm_replay')).lower()}, backend "
            f"{c.get('ssm_backend')}" + (f", prompts {prompts}" if prompts else "")
        ]
    out += [f"- results schema: {results['schema_version']}", ""]

    verdict = results.get("verdict")
    out += ["## Verdict", ""]
    out += _verdict_lines(verdict) if verdict else ["No verdict was computed for this run.", ""]

    scores = results.get(task.section)
    if scores and "scores" in task.report_sections:
        out += _score_lines(scores, task, plots)

    health = results.get("health")
    if health:
        out += ["## Health", ""]
        nonfinite = health.get("nonfinite") or []
        out += [
            ("NaN / infinite model outputs: first in `" + nonfinite[0] + "` (" + ", ".join(nonfinite) + ")")
            if nonfinite
            else "No NaN / infinite model output in any forward.",
            "",
        ]
        o = health.get("outputs") or {}
        if o.get("n"):
            out += _table(
                ["generations", "count", "of"],
                [
                    ["empty", o["empty"], o["n"]],
                    ["one token repeated", o["repeated_token"], o["n"]],
                    ["no number to extract", o["no_answer"], o["n"]],
                ],
            )

    acceptance = results.get("acceptance")
    out += ["## MTP acceptance", ""]
    if acceptance:
        rows = [
            ["draft length K", _fmt(acceptance.get("draft_len"))],
            ["acceptance rate (accepted / drafted)", _fmt(acceptance.get("rate"))],
            ["acceptance length (1 + accepted per request-step)", _fmt(acceptance.get("length"), 3)],
            ["drafted tokens", _fmt(acceptance.get("drafted"))],
            ["accepted drafts", _fmt(acceptance.get("accepted"))],
            ["request-steps", _fmt(acceptance.get("request_steps"))],
        ]
        out += _table(["quantity", "value"], rows)
        per_pos = acceptance.get("per_position") or []
        if per_pos:
            out += _table(
                ["draft position", *[str(i) for i in range(1, len(per_pos) + 1)]],
                [["acceptance", *[f"{p:.4f}" for p in per_pos]]],
            )
    else:
        out += ["No speculative decoding in this run.", ""]
    for name, title in (
        (PLOT_PER_POSITION, "per-position acceptance"),
        (PLOT_LENGTH_HIST, "accepted length"),
    ):
        if name in plots:
            out += [f"![{title}]({Path(plots[name]).name})", ""]

    # with compare=replay, memory and timings are the replay arm's (the run's results.json is that arm's)
    comparison = results.get("comparison")
    arm = f" ({comparison.get('label_b', 'replay')} arm)" if comparison else ""
    memory = results.get("memory")
    if memory:
        out += [f"## Memory{arm}", ""]
        rows = [[k, f"{int(v):,}", f"{int(v) / 2**20:.2f}"] for k, v in memory.items() if v is not None]
        out += _table(["buffer", "bytes", "MiB"], rows)

    prefix = results.get("prefix_cache")
    if prefix:
        out += ["## Prefix cache", ""]
        out += _table(["quantity", "value"], [[k, _fmt(v, 4)] for k, v in prefix.items()])

    timings = results.get("timings")
    if timings:
        out += [f"## Timings{arm}", ""]
        out += _table(["quantity", "value"], [[k, _fmt(v, 3)] for k, v in timings.items()])
    proj = results.get("projection")
    if proj:
        out += [f"## Full {task.shown_title} projection{arm}", "",
                f"Measured wall time {_fmt(timings.get('wall_seconds') if timings else None, 1)} s over "
                f"{proj['measured_questions']} questions; at the measured rates the full set would take "
                f"{_projection_note(proj)}.", ""]
        out += _table(["quantity", "value"], [[k, _fmt(v, 3)] for k, v in proj.items()])

    comparison = results.get("comparison")
    if comparison:
        out += _comparison_lines(comparison, task)

    config = results.get("config")
    if config:
        out += ["## Resolved configuration", "", "<details><summary>all keys</summary>", ""]
        out += _table(["key", "value"], [[k, f"`{json.dumps(v)}`"] for k, v in _flatten(config)])
        out += ["</details>", ""]
    return "\n".join(out)


def _score_lines(scores: Mapping[str, Any], task: EvalTask, plots: Mapping[str, str | Path]) -> list[str]:
    """summary.md's section of the task's scores ("scores"): one row per score (percent, standard error),
    the mean of the scores when the task reports it, the samples scored, and the accuracy plot when written
    (the "accuracy_plot" section)."""
    keys = list(task.filters)
    stderr = scores.get("stderr") or {}
    rows = [
        [task.labels[k], f"{100.0 * scores[k]:.2f}",
         "-" if stderr.get(k) is None else f"{100.0 * stderr[k]:.2f}"]
        for k in keys
    ]
    if task.mean_score:
        label = "mean of both" if len(keys) == 2 else "mean of all"
        rows.append([label, f"{100.0 / len(keys) * sum(scores[k] for k in keys):.2f}", ""])
    out = [f"## {task.shown_title}", ""]
    out += _table(["filter", task.score_unit, "standard error (%)"], rows)
    out += [f"Samples scored: {scores.get('n')}", ""]
    if PLOT_ACCURACY in plots and "accuracy_plot" in task.report_sections:
        out += [f"![{task.shown_title} accuracy]({Path(plots[PLOT_ACCURACY]).name})", ""]
    return out


def _comparison_lines(c: Mapping[str, Any], task: EvalTask) -> list[str]:
    a, b = c.get("label_a", "a"), c.get("label_b", "b")
    out = [f"## Comparison: {a} (A) vs {b} (B), {c.get('n')} paired samples", ""]
    rows = []
    for f in (c.get("filters") or {}).values():
        rows.append(
            [
                task.labels.get(f["filter"], f["filter"]),
                f"{f['accuracy_a']:.2f}",
                f"{f['accuracy_b']:.2f}",
                f"{f['delta']:+.2f}",
                f["a_only"],
                f["b_only"],
                f"{f['agreement']:.4f}",
                f"{f['mcnemar_p']:.4g}",
            ]
        )
    out += _table(
        [
            "filter",
            f"{a} (%)",
            f"{b} (%)",
            "B - A",
            f"right in {a} only",
            f"right in {b} only",
            "agreement",
            "McNemar exact p",
        ],
        rows,
    )
    div = c.get("divergence")
    if div:
        where = (
            "no divergence"
            if div.get("min_first_divergence") is None
            else f"first divergence at token min {_fmt(div['min_first_divergence'])}, median "
            f"{_fmt(div['median_first_divergence'], 1)}"
        )
        out += [
            f"Generated tokens: {div['num_identical']} of {div['n']} samples identical, "
            f"{div['num_diverged']} diverge; {where}.",
            "",
        ]
    acc = c.get("acceptance")
    if acc:
        rows = [
            ["acceptance rate", _fmt(acc["rate_a"]), _fmt(acc["rate_b"]), _fmt(acc["rate_delta"])],
            [
                "acceptance length",
                _fmt(acc["length_a"], 3),
                _fmt(acc["length_b"], 3),
                _fmt(acc["length_delta"], 3),
            ],
        ]
        for i, d in enumerate(acc.get("per_position_delta") or [], 1):
            rows.append(
                [
                    f"position {i}",
                    _fmt(acc["per_position_a"][i - 1]),
                    _fmt(acc["per_position_b"][i - 1]),
                    _fmt(d),
                ]
            )
        out += _table(["quantity", a, b, "B - A"], rows)
    return out


def write_report(results: Mapping[str, Any], out_dir: str | Path) -> ReportFiles:
    """Write summary.md and the plots that the results support into out_dir (created if missing).

    Returns:
        ReportFiles with the summary path and {plot name: path} of the PNGs written.
    Raises:
        ValueError: results of another schema version.
    """
    _check_schema(results)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path] = {}
    for name, fn in (
        (PLOT_ACCURACY, plot_accuracy),
        (PLOT_PER_POSITION, plot_acceptance_per_position),
        (PLOT_LENGTH_HIST, plot_accepted_length_hist),
    ):
        written = fn(results, out_dir / name)
        if written is not None:
            plots[name] = written
    summary = write_atomic(out_dir / SUMMARY_NAME, render_markdown(results, plots))
    return ReportFiles(summary=summary, plots=plots)


def main(argv: list[str] | None = None) -> int:
    """`python -m evals.report RESULTS_JSON [--out DIR]`: (re)write summary.md and plots for a saved run."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m evals.report", description=main.__doc__)
    parser.add_argument("results", type=Path, help="a results.json written by a run, or its run folder")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: beside results.json)")
    args = parser.parse_args(argv)
    if args.results.is_dir():  # a run folder, as evals.compare takes
        args.results = args.results / RESULTS_FILE
    try:
        results = read_results(args.results)
    except UserError as e:  # missing, not JSON: as evals.compare and evals.history say it
        print(e.format(), file=sys.stderr)
        return 2
    section = task_of_results(results).section
    if not {"entry", section} <= results.keys():
        parser.error(f"{args.results} is not a run's results.json (it needs 'entry' and '{section}'; "
                     "docs/results_schema.md)")
    out = args.out or args.results.parent
    try:
        ensure_writable_dir(out, fix=f"pass a writable folder with --out (not {out})")
    except UserError as e:
        print(e.format(), file=sys.stderr)
        return 2
    files = write_report(results, out)
    print(files.summary)
    for path in files.plots.values():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
