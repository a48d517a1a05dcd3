"""The trend report of the results history (evals/history.py): a static HTML page, the same content as
Markdown, and one PNG of trends per entry x setting, all in one folder.

`python -m evals.history report --out DIR` writes DIR/index.html, DIR/report.md and DIR/trend_*.png:
- latest status per entry x setting (the last run of each series, its verdict, what changed since the run
  before it with the same number of scored samples n: a score and its threshold depend on n, so runs of
  different n are never compared, in the table as in the plots -- by_sample_count);
- regressions since the previous run: a verdict check that passed in the previous run of the same entry,
  setting and n and fails in the latest one (a check never judged before at that n that fails now is listed
  as a failure);
- replay-vs-rewind flips: from compare=replay runs' comparison sections, and from every pair of a replay and
  a rewind job of one sweep with the same entry and otherwise equal settings (paired per sample with
  evals.compare.compare_runs; "tokens differ" compares hashes of the generated token ids);
- trend plots over time of the task's accuracy (with the reference and each run's pass threshold, which
  depends on the number of samples) and of the acceptance rate and length (with their floors), failing runs
  marked.

The page is plain HTML + CSS with relative image links: no JavaScript, nothing fetched from the network.
Plots use matplotlib's object API on an Agg canvas, as evals/report.py does.
"""

from __future__ import annotations

import datetime as dt
import html
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evals.mpl import AutoDateLocator, DateFormatter, Figure, FigureCanvasAgg
from evals.outdir import ensure_writable_dir
from evals.task import task_of_setting
from evals.verdict import NO_LOWER_BOUND, format_threshold, threshold_binds

HTML_NAME = "index.html"
MARKDOWN_NAME = "report.md"
_WORD = {"pass": "PASS", "fail": "FAIL", "no_reference": "no reference"}


@dataclass
class TrendFiles:
    """Paths written by write_trend_report."""

    html: Path
    markdown: Path
    plots: list[Path] = field(default_factory=list)


@dataclass
class Change:
    """What changed between two consecutive runs of one entry x setting (`prev` None: the first run)."""

    newly_failed: list[str]
    fixed: list[str]
    accuracy_delta: float | None  # percent points, latest - previous
    rate_delta: float | None
    answers_changed: int | None  # samples whose strict-match correctness differs (same doc ids), else None
    tokens_changed: int | None

    @property
    def regression(self) -> bool:
        return bool(self.newly_failed)


@dataclass
class Flip:
    """Replay vs rewind on the same samples: a compare=replay run, or a replay / rewind pair of a sweep."""

    when: str
    entry: str
    setting: str
    source: str  # "compare run" | "sweep pair"
    n: int
    strict: tuple[int, int]  # (right in rewind only, right in replay only)
    flexible: tuple[int, int]
    tokens_differ: int | None
    mcnemar_p: float | None  # strict-match, exact McNemar
    where: str  # run folder (compare run) or sweep folder (pair)

    @property
    def flipped(self) -> bool:
        return sum(self.strict) + sum(self.flexible) > 0 or bool(self.tokens_differ)


# ----------------------------------------------------------------------------------------------------------
# Analysis


def accuracy_value(run: Mapping[str, Any]) -> float | None:
    """The judged accuracy in percent: the verdict's value, else the mean of the two filters."""
    if run.get("accuracy_value") is not None:
        return float(run["accuracy_value"])
    s, f = run.get("strict_match"), run.get("flexible_extract")
    return 100.0 * (s + f) / 2 if s is not None and f is not None else None


def series(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    """Runs grouped by (entry, setting), each list oldest first, keys sorted."""
    out: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in runs:
        out.setdefault((r["entry"], r["setting"]), []).append(r)
    return {k: sorted(v, key=lambda r: (r["finished_at"], r["id"])) for k, v in sorted(out.items())}


def by_sample_count(runs: Sequence[Mapping[str, Any]]) -> dict[int | None, list[Mapping[str, Any]]]:
    """Runs of one series split by n, the number of samples each scored (None: not recorded), each list in
    the order given, keys ascending (None last). An accuracy and its pass threshold depend on n, so runs
    of different n are separate series in the trend plots and a run is compared only with the previous run
    of its own n (:func:`previous_run`)."""
    out: dict[int | None, list[Mapping[str, Any]]] = {}
    for r in runs:
        out.setdefault(r.get("n"), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def previous_run(runs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The run before the last of `runs` (oldest first) with the same n (by_sample_count); None when the last
    is the first run at its n."""
    same = by_sample_count(runs)[runs[-1].get("n")]
    return same[-2] if len(same) > 1 else None


def _statuses(run: Mapping[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in run.get("checks") or []}


def change(prev: Mapping[str, Any] | None, cur: Mapping[str, Any],
           samples: Mapping[int, Mapping[str, Any]]) -> Change:
    """What changed from prev to cur (the report passes previous_run: the same n); without prev, every
    failing check counts as newly failed."""
    now = _statuses(cur)
    before = _statuses(prev) if prev is not None else {}
    newly = sorted(n for n, s in now.items() if s == "fail" and before.get(n) != "fail")
    fixed = sorted(n for n, s in now.items() if s == "pass" and before.get(n) == "fail")
    if prev is None:
        return Change(newly, fixed, None, None, None, None)
    g0, g1 = accuracy_value(prev), accuracy_value(cur)
    r0, r1 = prev.get("acceptance_rate"), cur.get("acceptance_rate")
    answers = tokens = None
    a, b = samples.get(prev["id"]), samples.get(cur["id"])
    if a and b and a["doc_ids"] == b["doc_ids"]:
        answers = sum(x != y for x, y in zip(a["strict_match"], b["strict_match"]))
        if a.get("tokens_sha256") and b.get("tokens_sha256"):
            tokens = sum(x != y for x, y in zip(a["tokens_sha256"], b["tokens_sha256"]))
    return Change(newly, fixed, g1 - g0 if g0 is not None and g1 is not None else None,
                  r1 - r0 if r0 is not None and r1 is not None else None, answers, tokens)


def _pair_key(setting: str) -> str | None:
    """The setting without its replay / rewind mode (None for other modes): pairs share it."""
    mode, _, rest = setting.partition(" ")
    return rest if mode in ("replay", "rewind") else None


def flips(runs: Sequence[Mapping[str, Any]], comparisons: Sequence[Mapping[str, Any]],
          samples: Mapping[int, Mapping[str, Any]]) -> list[Flip]:
    """Replay-vs-rewind comparisons, newest first: compare=replay runs and replay / rewind pairs of a sweep.

    A sweep pair needs both runs' per-sample rows over the same doc ids (else it is skipped: nothing can be
    paired). When a sweep holds several runs of one side (a resumed job recorded twice), the latest is used.
    """
    from evals.compare import compare_runs

    out: list[Flip] = []
    by_run: dict[int, list[Mapping[str, Any]]] = {}
    for c in comparisons:
        by_run.setdefault(c["run_id"], []).append(c)
    for rows in by_run.values():
        f = {r["filter"]: r for r in rows}
        first = rows[0]
        s, x = f.get("strict_match", {}), f.get("flexible_extract", {})
        out.append(Flip(first["finished_at"], first["entry"], first["setting"], "compare run", first["n"],
                        (s.get("a_only", 0), s.get("b_only", 0)), (x.get("a_only", 0), x.get("b_only", 0)),
                        first.get("num_diverged"), s.get("mcnemar_p"), first.get("run_dir") or ""))
    pairs: dict[tuple[str, str, str], dict[str, Mapping[str, Any]]] = {}
    for r in sorted(runs, key=lambda r: (r["finished_at"], r["id"])):
        key = _pair_key(r["setting"])
        if r.get("sweep_dir") and key is not None:
            pairs.setdefault((r["sweep_dir"], r["entry"], key), {})[r["setting"].split(" ")[0]] = r
    for (sweep_dir, entry, key), sides in pairs.items():
        rewind, replay = sides.get("rewind"), sides.get("replay")
        if rewind is None or replay is None:
            continue
        a, b = samples.get(rewind["id"]), samples.get(replay["id"])
        if not a or not b or a["doc_ids"] != b["doc_ids"] or not a["doc_ids"]:
            continue

        def records(s: Mapping[str, Any]) -> list[dict[str, Any]]:
            return [{"doc_id": d, "strict_match": sm, "flexible_extract": fe}
                    for d, sm, fe in zip(s["doc_ids"], s["strict_match"], s["flexible_extract"])]

        comp = compare_runs(records(a), records(b), label_a="rewind", label_b="replay")
        tokens = None
        if a.get("tokens_sha256") and b.get("tokens_sha256"):
            tokens = sum(x != y for x, y in zip(a["tokens_sha256"], b["tokens_sha256"]))
        s, x = comp.filters["strict_match"], comp.filters["flexible_extract"]
        out.append(Flip(max(rewind["finished_at"], replay["finished_at"]), entry, f"replay|rewind {key}",
                        "sweep pair", comp.n, (s.a_only, s.b_only), (x.a_only, x.b_only), tokens, s.mcnemar_p,
                        sweep_dir))
    return sorted(out, key=lambda f: f.when, reverse=True)


# ----------------------------------------------------------------------------------------------------------
# Plots


def _when(run: Mapping[str, Any]) -> dt.datetime:
    return dt.datetime.fromisoformat(run["finished_at"])


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")


def plot_series(entry: str, setting: str, runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Accuracy and acceptance of one entry x setting over time (one panel each), as a PNG at path
    (:func:`series_figure`)."""
    fig = series_figure(entry, setting, runs)
    fig.savefig(path, format="png", dpi=100)
    return path


def series_figure(entry: str, setting: str, runs: Sequence[Mapping[str, Any]]) -> Figure:
    """The figure of :func:`plot_series`.

    The task's score (its row's title and unit: evals.task.task_of_setting): the judged score, the reference
    (solid) and each run's pass threshold (dashed steps: the threshold depends on the run's sample count n); a
    threshold at or below 0 % (a run of a few questions, whose check cannot fail) is not drawn, so never
    stretches the axis below 0: the legend says there is no lower bound at those n. Acceptance rate: the value
    and its floor; acceptance length: the value, its floor and reference. Runs of different n are separate
    series (by_sample_count), each labelled with its n, their markers larger with n; a run whose verdict
    failed is drawn as a red cross. The x axis reads date and time of each tick (UTC).
    """
    has_acc = any(r.get("acceptance_rate") is not None for r in runs)
    panels = 3 if has_acc else 1
    fig = Figure(figsize=(6.4, 2.1 * panels + 0.6))
    axes = [fig.add_subplot(panels, 1, i + 1) for i in range(panels)]
    xs = [_when(r) for r in runs]
    groups = by_sample_count(runs)
    # a reference / threshold holds from its run until the next one; the last one is drawn a little further
    span = xs[-1] - xs[0]
    pad = max(span * 0.08, dt.timedelta(seconds=1)) if span else dt.timedelta(minutes=30)
    x_end = xs[-1] + pad
    colors = ["tab:blue", "tab:purple", "tab:orange", "tab:brown", "tab:cyan", "tab:olive"]

    def draw(ax, value: Callable[[Mapping[str, Any]], float | None], label: str, unit: str,
             refs: list[tuple[list, str, str]], notes: Sequence[str] = ()) -> None:
        for i, (n, group) in enumerate(groups.items()):
            pts = [(_when(r), value(r), r.get("verdict_passed") == 0) for r in group if value(r) is not None]
            if not pts:
                continue
            size = 3 + 2 * math.log10(max(n or 1, 1))  # marker size grows with the run's n
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=size,
                    color=colors[i % len(colors)], zorder=3,
                    label=f"{label} (n={n})" if n is not None else label)
            bad = [p for p in pts if p[2]]
            if bad:
                ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", s=80, color="tab:red",
                           label="verdict FAIL" if i == 0 else None, zorder=4)
        for ys, name, style in refs:
            line = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if line:
                line.append((x_end, line[-1][1]))
                ax.step([p[0] for p in line], [p[1] for p in line], where="post", linestyle=style,
                        color="tab:green" if "reference" in name else "tab:red", label=name)
        for note in notes:  # a legend line only
            ax.plot([], [], linestyle="none", label=note)
        ax.set_xlim(xs[0] - pad, x_end)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")

    thresholds = [t if threshold_binds(t) else None for t in (r.get("accuracy_threshold") for r in runs)]
    unbound = ", ".join(map(str, by_sample_count([r for r in runs if r.get("accuracy_threshold") is not None
                                                  and not threshold_binds(r["accuracy_threshold"])])))
    threshold_label = f"pass threshold (per run's n; {NO_LOWER_BOUND} for n={unbound})" if unbound else \
        "pass threshold (per run's n)"
    # where no threshold binds there is no line to label: a legend line alone says why
    note = [f"pass threshold: {NO_LOWER_BOUND} (n={unbound})"] if unbound and not any(thresholds) else []
    task = task_of_setting(setting)  # the series' task row: its title and score unit
    score = f"{task.shown_title} (mean of the filters)" if task.mean_score else task.shown_title
    unit = task.score_unit if task.score_check == "bernoulli" else "fraction"  # a floor check's value
    draw(axes[0], accuracy_value, score, unit,
         [([r.get("accuracy_reference") for r in runs], "reference", "-"),
          (thresholds, threshold_label, "--")], note)
    axes[0].set_title(f"{entry} | {setting}", fontsize=10)
    if has_acc:
        draw(axes[1], lambda r: r.get("acceptance_rate"), "acceptance rate", "accepted / drafted",
             [([r.get("acceptance_rate_floor") for r in runs], "floor", "--")])
        draw(axes[2], lambda r: r.get("acceptance_length"), "acceptance length", "tokens / step",
             [([r.get("acceptance_length_reference") for r in runs], "reference", "-"),
              ([r.get("acceptance_length_floor") for r in runs], "floor", "--")])
    when = "%Y-%m-%d\n%H:%M:%S" if x_end - xs[0] < dt.timedelta(hours=1) else "%Y-%m-%d\n%H:%M"
    for ax in axes:
        ax.xaxis.set_major_locator(AutoDateLocator(maxticks=6))
        ax.xaxis.set_major_formatter(DateFormatter(when))  # every tick its date and time, none elided
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("run finished (UTC)")
    FigureCanvasAgg(fig)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------
# Rendering


def _f(x: Any, digits: int = 2, unit: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def _signed(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:+.{digits}f}"


def _verdict_word(run: Mapping[str, Any]) -> str:
    return _WORD.get(run.get("verdict_status") or "", run.get("verdict_status") or "-")


@dataclass
class Row:
    """One line of the latest-status table (all strings, unescaped) plus its verdict status and marks."""

    cells: list[str]
    status: str
    regression: bool


STATUS_HEADER = ["entry", "setting", "last run (UTC)", "commit", "n", "accuracy % (threshold / reference)",
                 "acceptance rate (floor)", "length (floor)", "verdict", "since previous run at the same n",
                 "runs"]


def _status_rows(groups: Mapping[tuple[str, str], list[Mapping[str, Any]]],
                 changes: Mapping[tuple[str, str], Change]) -> list[Row]:
    rows = []
    for (entry, setting), runs in groups.items():
        cur = runs[-1]
        ch = changes[(entry, setting)]
        commit = (cur.get("git_commit") or "-")[:10] + ("*" if cur.get("git_dirty") else "")
        if len(runs) == 1:
            since = "first run"
        elif previous_run(runs) is None:
            since = f"first run at n = {cur.get('n')}"
        else:
            parts = []
            if ch.newly_failed:
                parts.append("REGRESSION: " + ", ".join(ch.newly_failed))
            if ch.fixed:
                parts.append("fixed: " + ", ".join(ch.fixed))
            parts.append(f"accuracy {_signed(ch.accuracy_delta, 2)}")
            if ch.rate_delta is not None:
                parts.append(f"rate {_signed(ch.rate_delta, 3)}")
            if ch.answers_changed is not None:
                parts.append(f"{ch.answers_changed} answers changed")
            if ch.tokens_changed:
                parts.append(f"{ch.tokens_changed} outputs differ")
            since = "; ".join(parts)
        rows.append(Row([
            entry, setting, cur["finished_at"].replace("+00:00", ""), commit, str(cur.get("n") or "-"),
            f"{_f(accuracy_value(cur))} ({format_threshold(cur.get('accuracy_threshold'))} / "
            f"{_f(cur.get('accuracy_reference'))})",
            f"{_f(cur.get('acceptance_rate'), 3)} ({_f(cur.get('acceptance_rate_floor'), 3)})",
            f"{_f(cur.get('acceptance_length'))} ({_f(cur.get('acceptance_length_floor'))})",
            _verdict_word(cur), since, str(len(runs)),
        ], cur.get("verdict_status") or "", ch.regression))
    return rows


FLIP_HEADER = ["finished (UTC)", "entry", "setting", "source", "n",
               "strict-match flips (rewind / replay only)", "flexible-extract flips", "outputs differ",
               "McNemar p (strict)", "folder"]


def _flip_cells(f: Flip) -> list[str]:
    return [f.when.replace("+00:00", ""), f.entry, f.setting, f.source, str(f.n),
            f"{f.strict[0]} / {f.strict[1]}", f"{f.flexible[0]} / {f.flexible[1]}",
            "-" if f.tokens_differ is None else str(f.tokens_differ), _f(f.mcnemar_p, 3), f.where]


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def esc(c: str) -> str:
        return c.replace("|", "\\|").replace("\n", " ")

    return (["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(map(esc, r)) + " |" for r in rows])


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.pass { background: #dff5df; } td.fail { background: #f9d6d5; font-weight: bold; }
td.no_reference { background: #f3f3f3; color: #555; }
tr.regression td { border-top: 2px solid #c00; border-bottom: 2px solid #c00; }
tr.flipped td { background: #fff1c2; }
figure { display: inline-block; margin: 0.5em 1em 1em 0; }
figcaption { font-size: 0.8em; color: #555; }
code { font-size: 0.9em; }
"""


def render_html(db: Path, runs: list[Mapping[str, Any]], rows: list[Row], regressions: list[str],
                flip_list: list[Flip], plots: list[tuple[str, str, str]]) -> str:
    """The report page: inline CSS, relative image links, everything user-supplied escaped."""
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>hybrid-mtp-eval results history</title>", f"<style>{_CSS}</style></head><body>",
           "<h1>Results history</h1>",
           f"<p>{len(runs)} runs from <code>{e(str(db))}</code>; generated "
           f"{e(dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds'))}. Schema: "
           "docs/history_schema.md.</p>",
           "<h2>Latest status per entry &times; setting</h2>", "<table><tr>"
           + "".join(f"<th>{e(h)}</th>" for h in STATUS_HEADER) + "</tr>"]
    verdict_col = STATUS_HEADER.index("verdict")
    for r in rows:
        cls = ' class="regression"' if r.regression else ""
        cells = [f'<td class="{e(r.status)}">{e(c)}</td>' if i == verdict_col else f"<td>{e(c)}</td>"
                 for i, c in enumerate(r.cells)]
        out.append(f"<tr{cls}>{''.join(cells)}</tr>")
    out.append("</table>")
    out.append("<h2>Regressions since the previous run</h2>")
    out.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in regressions) + "</ul>" if regressions
               else "<p>None: no check that passed in the previous run of its entry, setting and n fails "
               "now.</p>")
    out.append("<h2>Replay vs rewind</h2>")
    if flip_list:
        n_flipped = sum(f.flipped for f in flip_list)
        out.append(f"<p>{len(flip_list)} comparisons, {n_flipped} with flipped samples or differing outputs "
                   "(highlighted). Flips count samples right in one arm only.</p>")
        out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in FLIP_HEADER) + "</tr>")
        for f in flip_list:
            cls = ' class="flipped"' if f.flipped else ""
            out.append(f"<tr{cls}>" + "".join(f"<td>{e(c)}</td>" for c in _flip_cells(f)) + "</tr>")
        out.append("</table>")
    else:
        out.append("<p>No compare=replay run and no replay / rewind pair of one sweep in the history.</p>")
    out.append("<h2>Trends</h2>")
    for name, entry, setting in plots:
        out.append(f'<figure><img src="{e(name)}" alt="{e(entry)} {e(setting)} trend" width="640">'
                   f"<figcaption>{e(entry)} | {e(setting)}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def render_markdown(db: Path, runs: list[Mapping[str, Any]], rows: list[Row], regressions: list[str],
                    flip_list: list[Flip], plots: list[tuple[str, str, str]]) -> str:
    """The same report as Markdown (pipe tables, image links)."""
    lines = ["# Results history", "", f"{len(runs)} runs from `{db}`. Schema: docs/history_schema.md.", "",
             "## Latest status per entry x setting", ""]
    lines += _md_table(STATUS_HEADER, [r.cells for r in rows])
    lines += ["", "## Regressions since the previous run", ""]
    lines += [f"- {x}" for x in regressions] or ["None."]
    lines += ["", "## Replay vs rewind", ""]
    lines += _md_table(FLIP_HEADER, [_flip_cells(f) for f in flip_list]) if flip_list else ["No comparisons."]
    lines += ["", "## Trends", ""]
    lines += [f"![{entry} | {setting}]({name})" for name, entry, setting in plots]
    return "\n".join(lines) + "\n"


def render_trend_report(db: str | os.PathLike, runs: list[dict[str, Any]], comparisons: list[dict[str, Any]],
                        samples: Mapping[int, Any], out_dir: str | os.PathLike) -> TrendFiles:
    """Write the report of the history's rows into out_dir (created; files overwritten).

    db: the database the rows came from (named in the page). runs, comparisons, samples: what
    evals.history.fetch_runs / fetch_comparisons / fetch_samples return for it. This module reads no database:
    evals.history.write_trend_report reads one and calls this (the store below, the view above it).
    Raises registry.errors.UserError when out_dir cannot be created or written
    (evals.outdir.ensure_writable_dir).
    """
    db, out = Path(db), Path(out_dir)
    ensure_writable_dir(out, fix=f"pass a writable folder with --out (not {out})")
    groups = series(runs)
    changes = {k: change(previous_run(v), v[-1], samples) for k, v in groups.items()}
    rows = _status_rows(groups, changes)
    regressions = []
    for (entry, setting), ch in changes.items():
        if ch.newly_failed:
            runs_of = groups[(entry, setting)]
            cur = runs_of[-1]
            if previous_run(runs_of) is not None:
                what = "fails"
            elif len(runs_of) == 1:
                what = "fails in its first run"
            else:
                what = f"fails in its first run at n = {cur.get('n')}"
            regressions.append(f"{entry} | {setting}: {', '.join(ch.newly_failed)} {what} "
                               f"({cur['finished_at']}, commit {(cur.get('git_commit') or '-')[:10]}, "
                               f"{cur.get('run_dir') or '-'})")
    flip_list = flips(runs, comparisons, samples)
    plots, files = [], []
    for (entry, setting), series_runs in groups.items():
        name = f"trend_{_slug(entry)}_{_slug(setting)}.png"
        files.append(plot_series(entry, setting, series_runs, out / name))
        plots.append((name, entry, setting))
    html_path, md_path = out / HTML_NAME, out / MARKDOWN_NAME
    html_path.write_text(render_html(db, runs, rows, regressions, flip_list, plots))
    md_path.write_text(render_markdown(db, runs, rows, regressions, flip_list, plots))
    return TrendFiles(html_path, md_path, files)
