"""summary.md and PNG plots from a results dict (evals.report)."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from evals.compare import compare_runs
from evals.report import (
    PLOT_ACCURACY,
    PLOT_LENGTH_HIST,
    PLOT_PER_POSITION,
    format_console,
    render_markdown,
    write_report,
)
from evals.results import RESULTS_SCHEMA_VERSION
from evals.verdict import evaluate_verdict

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _acceptance(rate, length, per_position, hist):
    return {
        "draft_len": 3,
        "drafted": 3000,
        "accepted": int(rate * 3000),
        "request_steps": 1000,
        "rate": rate,
        "length": length,
        "per_position": per_position,
        "num_accepted_hist": hist,
    }


def _results(spec=True, reference=True):
    results = {
        "schema_version": RESULTS_SCHEMA_VERSION,
        "entry": "super_v3_mtp" if spec else "super_v3",
        "config": {"model": {"name": "super_v3_mtp", "dtype": "bfloat16"}, "ssm_replay": True, "limit": None},
        "git_commit": "0123abcd",
        "gsm8k": {"strict_match": 0.7998, "flexible_extract": 0.8102, "n": 1319},
        "task": {"task": "gsm8k", "version": 3.0, "num_fewshot": 5, "max_gen_toks": 256},
        "acceptance": _acceptance(0.82, 3.46, [0.93, 0.83, 0.70], [0, 70, 100, 200, 630]) if spec else None,
        "memory": {
            "ssm_state_bytes": 1048576,
            "conv_state_bytes": 4096,
            "kv_cache_bytes": 2097152,
            "spec_buffers_bytes": 0,
        },
        "timings": {"prefill_seconds": 12.5, "decode_seconds": 301.25},
    }
    kwargs = {
        "model_key": "super_v3",
        "entry": results["entry"],
        "dtype": "bf16",
        "quant": "nvfp4",
        "kv_cache_quant": "fp8",
        "spec_dec": "mtp" if spec else "none",
        "draft_len": 3,
    }
    if not reference:
        kwargs |= {"dtype": "float32", "require_reference": False}
    results["verdict"] = evaluate_verdict(results, **kwargs).to_dict()
    return json.loads(json.dumps(results))  # exactly what results.json would hold


def _assert_png(path):
    assert path.exists() and path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_full_report(tmp_path):
    files = write_report(_results(), tmp_path / "out")
    assert set(files.plots) == {PLOT_ACCURACY, PLOT_PER_POSITION, PLOT_LENGTH_HIST}
    for path in files.plots.values():
        _assert_png(path)
        assert path.parent == tmp_path / "out"
    md = files.summary.read_text()
    assert files.summary.name == "summary.md"
    assert "# super_v3_mtp" in md and "`0123abcd`" in md
    assert "**Verdict: PASS**" in md
    assert "| gsm8k.mean | 80.50 | 80.85 | 77.65 | pass |" in md  # mean of 79.98 and 81.02, ref - 3.20
    assert "| strict-match | 79.98 |" in md and "| flexible-extract | 81.02 |" in md
    assert "| acceptance.rate | 0.8200 | - | 0.4500 | pass |" in md
    assert "| acceptance.length | 3.4600 | 3.4700 | 3.2965 | pass |" in md
    assert "| acceptance | 0.9300 | 0.8300 | 0.7000 |" in md
    assert "| ssm_state_bytes | 1,048,576 | 1.00 |" in md
    assert "| decode_seconds | 301.250 |" in md
    assert "| ssm_replay | `true` |" in md and '| model.dtype | `"bfloat16"` |' in md
    for name in files.plots:
        assert f"]({name})" in md


def test_failing_run_is_marked(tmp_path):
    results = _results()
    results["gsm8k"] |= {"strict_match": 0.70, "flexible_extract": 0.71}
    results["verdict"] = evaluate_verdict(
        results,
        model_key="super_v3",
        entry="super_v3_mtp",
        dtype="bf16",
        quant="nvfp4",
        kv_cache_quant="fp8",
        spec_dec="mtp",
        draft_len=3,
    ).to_dict()
    md = write_report(results, tmp_path).summary.read_text()
    assert "**Verdict: FAIL: gsm8k.mean**" in md and "| gsm8k.mean | 70.50 | 80.85 | 77.65 | **FAIL** |" in md


def test_no_spec_decoding_no_reference(tmp_path):
    files = write_report(_results(spec=False, reference=False), tmp_path)
    assert set(files.plots) == {PLOT_ACCURACY}
    _assert_png(files.plots[PLOT_ACCURACY])
    md = files.summary.read_text()
    assert "No speculative decoding in this run." in md
    assert "**Verdict: NO REFERENCE**" in md and "no reference" in md
    assert PLOT_PER_POSITION not in md


def test_minimal_results(tmp_path):
    files = write_report({"schema_version": RESULTS_SCHEMA_VERSION, "entry": "x"}, tmp_path)
    assert files.plots == {}
    md = files.summary.read_text()
    assert "No verdict was computed" in md and "No speculative decoding" in md
    with pytest.raises(ValueError, match=f"schema_version is {RESULTS_SCHEMA_VERSION + 1}"):
        write_report({"schema_version": RESULTS_SCHEMA_VERSION + 1}, tmp_path)


def test_comparison_report(tmp_path):
    a = [
        {"doc_id": i, "strict_match": i % 4 != 0, "flexible_extract": i % 5 != 0, "tokens": [1, 2, 3, i]}
        for i in range(40)
    ]
    b = [
        dict(r, strict_match=r["strict_match"] or r["doc_id"] < 6, tokens=[1, 2, 9, r["doc_id"]])
        if r["doc_id"] < 10
        else r
        for r in a
    ]
    rewind = _acceptance(0.82, 3.46, [0.93, 0.83, 0.70], [0, 70, 100, 200, 630])
    replay = _acceptance(0.81, 3.43, [0.93, 0.82, 0.68], [0, 72, 101, 205, 622])
    results = _results()
    results["acceptance"] = replay
    results["comparison"] = compare_runs(
        a, b, acceptance_a=rewind, acceptance_b=replay, label_a="rewind", label_b="replay"
    ).to_dict()
    files = write_report(json.loads(json.dumps(results)), tmp_path)
    assert set(files.plots) == {PLOT_ACCURACY, PLOT_PER_POSITION, PLOT_LENGTH_HIST}
    for path in files.plots.values():
        _assert_png(path)
    md = files.summary.read_text()
    # strict: ids 0, 4 (i % 4 == 0, < 6) flip to right in replay; 0 right in rewind only.
    # accuracy rewind 30/40 = 75.00 %, replay 32/40 = 80.00 %; McNemar p = 2 * 0.5^2 = 0.5
    assert "## Comparison: rewind (A) vs replay (B), 40 paired samples" in md
    assert "| strict-match | 75.00 | 80.00 | +5.00 | 0 | 2 | 0.9500 | 0.5 |" in md
    assert "| flexible-extract | 80.00 | 80.00 | +0.00 | 0 | 0 | 1.0000 | 1 |" in md
    assert "30 of 40 samples identical, 10 diverge; first divergence at token min 2, median 2.0" in md
    assert "| acceptance rate | 0.8200 | 0.8100 | -0.0100 |" in md
    assert "| position 3 | 0.7000 | 0.6800 | -0.0200 |" in md
    # memory and timings of a comparison are the replay arm's: the headings say so
    assert "## Memory (replay arm)" in md and "## Timings (replay arm)" in md, md


def test_accepted_length_histogram_marks_each_arms_mean(tmp_path, monkeypatch):
    """A vertical line at the run's mean accepted length (its acceptance length), one per arm."""
    import evals.report as report

    figures = []
    save = report._save
    monkeypatch.setattr(report, "_save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    hist = [0, 70, 100, 200, 630]
    results = _results()
    results["acceptance"] = _acceptance(0.82, 3.39, [0.9, 0.8, 0.7], hist)
    assert report.plot_accepted_length_hist(results, tmp_path / "h.png") is not None
    mean = sum(i * h for i, h in enumerate(hist)) / sum(hist)  # 3.39
    lines = {line.get_label(): line.get_xdata() for line in figures[-1].axes[0].get_lines()}
    assert list(lines[f"mean: {mean:.2f} tokens"]) == [mean - 1, mean - 1]  # bar i sits at x = i - 1


def test_render_markdown_without_plots():
    md = render_markdown(_results())
    assert "![" not in md and "80.50" in md


def test_cli_rewrites_a_saved_run(tmp_path, capsys):
    from evals.report import main

    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results(spec=False)))
    assert main([str(path), "--out", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(tmp_path / "rep" / "summary.md")
    assert (tmp_path / "rep" / PLOT_ACCURACY).exists() and "80.50" in (
        tmp_path / "rep" / "summary.md"
    ).read_text()
    # the run folder works too (evals.compare takes folders): its results.json, the report beside it
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.split()[0] == str(tmp_path / "summary.md")
    # an --out folder that cannot be made, or a file: error / fix lines and exit 2, no traceback
    for out in ("/proc/x", str(path)):
        assert main([str(tmp_path), "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: output folder {out} "), err
        assert "\n  fix: pass a writable folder" in err, err


def test_report_cli_rejects_files_that_are_not_results(tmp_path, capsys):
    from evals.report import main

    empty = tmp_path / "empty.json"
    empty.write_text("")
    other = tmp_path / "other.json"
    other.write_text('{"schema_version": 1}')
    with pytest.raises(SystemExit) as e:
        main([str(other)])
    assert e.value.code == 2 and "is not a run's results.json" in capsys.readouterr().err
    assert main([str(empty)]) == 2  # evals.results.read_results: error / fix lines, as evals.compare says it
    assert capsys.readouterr().err.startswith(f"error: {empty} is not JSON")


def _tiny_results(n: int) -> dict:
    """The tiny Nemotron-H entry's run over n questions at 2 % (its measured reference 1.895 %, sigma 13.6):
    at n = 50 the pass threshold is 1.895 - 1.6449 * 13.6 * sqrt(2 / 50) = -2.58 %, at n = 1319 1.02 %."""
    results = _results()
    results["entry"] = "tiny_nemotron_h_mtp"
    results["config"] |= {"dtype": "float32", "ssm_state_dtype": "bfloat16", "draft_len": 3}
    results["gsm8k"] = {"strict_match": 0.02, "flexible_extract": 0.02, "n": n}
    results["acceptance"] = _acceptance(0.52, 2.56, [0.71, 0.51, 0.34], [0, 290, 200, 180, 330])
    results["verdict"] = evaluate_verdict(results, model_key="tiny_nemotron_h_mtp", entry=results["entry"],
                                          dtype="float32", spec_dec="mtp", draft_len=3).to_dict()
    return json.loads(json.dumps(results))


def _figures(monkeypatch) -> list:
    """The figures evals.report saves, in order (their canvases drawn, so extents can be measured)."""
    import evals.report as report

    figures = []
    save = report._save
    monkeypatch.setattr(report, "_save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    return figures


def test_threshold_below_zero_is_no_lower_bound_in_plot_summary_and_console(tmp_path, monkeypatch):
    """At n = 50 the tiny model's GSM8K threshold is -2.58 %: nothing draws or prints a negative accuracy.
    The plot's axis starts at 0 % with no threshold line or band, and the plot, summary.md and the console
    verdict line say "no lower bound at this n"; the verdict itself still passes any score."""
    import re

    from evals.report import _format_check, plot_accuracy
    from evals.verdict import NO_LOWER_BOUND

    figures = _figures(monkeypatch)
    small = _tiny_results(50)
    check = small["verdict"]["checks"][0]
    assert check["name"] == "gsm8k.mean" and check["threshold"] == pytest.approx(-2.58, abs=0.01)
    assert check["status"] == "pass"  # the verdict's logic is unchanged: a threshold below 0 passes any score
    plot_accuracy(small, tmp_path / "small.png")
    ax = figures[-1].axes[0]
    assert ax.get_ylim()[0] == 0.0, ax.get_ylim()
    assert all(min(line.get_ydata(), default=0) >= 0 for line in ax.get_lines())
    assert all(p.get_y() >= 0 for p in ax.patches)  # bars only: no pass band reaching below 0
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(NO_LOWER_BOUND in t for t in legend), legend
    assert not any(re.search(r"-\d", t) for t in legend), legend
    md = render_markdown(small)
    assert f"| gsm8k.mean | 2.00 | 1.90 | {NO_LOWER_BOUND} | pass |" in md
    assert "-2.58" not in md
    line = _format_check(check)
    assert line.startswith(f"2.00 vs {NO_LOWER_BOUND}, reference 1.90: pass (cannot fail at n=50"), line
    assert not re.search(r"-\d", line), line

    # at n = 1319 the threshold binds: drawn as a line and a band, written as a number
    full = _tiny_results(1319)
    thr = full["verdict"]["checks"][0]["threshold"]
    assert thr == pytest.approx(1.02, abs=0.01)
    plot_accuracy(full, tmp_path / "full.png")
    labels = {line.get_label(): list(line.get_ydata()) for line in figures[-1].axes[0].get_lines()}
    assert labels[f"pass threshold {thr:.2f}"] == [thr, thr]
    assert f"| gsm8k.mean | 2.00 | 1.90 | {thr:.2f} | pass |" in render_markdown(full)
    assert _format_check(full["verdict"]["checks"][0]).startswith(f"2.00 vs threshold {thr:.2f}, reference")


def test_accepted_length_legend_clears_the_floor_and_mean_lines(tmp_path, monkeypatch):
    """The legend of accepted_length_hist.png sits below the axes and their x label: it covers neither the
    floor line, the mean line nor a bar, and stays inside the image."""
    from evals.report import plot_accepted_length_hist

    figures = _figures(monkeypatch)
    results = _tiny_results(1319)
    assert plot_accepted_length_hist(results, tmp_path / "h.png") is not None
    fig = figures[-1]
    ax = fig.axes[0]
    assert any(line.get_label().startswith("acceptance-length floor") for line in ax.get_lines())
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    xaxis = ax.xaxis.get_tightbbox(renderer)  # tick labels and the x label
    assert legend.y1 < ax.get_window_extent(renderer).y0 and legend.y1 < xaxis.y0, (legend, xaxis)
    assert legend.y0 >= 0 and legend.x0 >= 0 and legend.x1 <= fig.bbox.x1  # not cut off
    _assert_png(tmp_path / "h.png")


def test_summary_settings_name_the_state_dtype_once():
    md = render_markdown(_tiny_results(50))
    assert "- settings: dtype float32, SSM state bfloat16, draft length K = 3," in md, md
    assert "state bfloat16 state" not in md


def test_the_protocol_is_in_the_settings_and_the_console_table():
    """summary.md's settings line and the console table say how the prompts and generations were made
    (few-shot count, generation limit: the protocol the references are compared under)."""
    results = _tiny_results(50)
    results["task"] = {**results.get("task", {}), "num_fewshot": 0, "max_gen_toks": 256}
    md = render_markdown(results)
    assert ", prompts 0-shot, at most 256 generated tokens" in md, md
    results["config"]["model"] |= {"family": "nemotron_h", "ssm": {"backend": "auto"}}
    results["config"] |= {"device": "cpu", "world_size": 1, "ssm_backend": "torch"}
    results |= {"timings": {"prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0, "wall_seconds": 1.0},
                "memory": {"kv": 1}}
    assert "prompts                  0-shot, at most 256 generated tokens" in format_console(results)
