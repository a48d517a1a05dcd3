"""The trend report (evals/trends.py): latest status, regressions since the previous run, replay-vs-rewind
flips (compare runs and sweep pairs), trend plots; the page rendered in a real headless browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from history_factory import make_results, write_run

from evals import history
from evals.history import write_trend_report
from registry.schema import REPO_ROOT

BASELINE_COMPARE_RUN = REPO_ROOT / "docs" / "baselines" / "tiny_nemotron_h_mtp"
T0 = 1_790_000_000  # 2026-09-21, seconds since the epoch
DAY = 86_400


def _at(folder: Path, when: float) -> Path:
    os.utime(folder / "results.json", (when, when))  # finished_at is results.json's modification time
    return folder


@pytest.fixture
def history_db(tmp_path) -> Path:
    """Two nightly sweeps of one entry (rewind + replay) and a compare=replay run, recorded as imports.

    Night 1: both arms pass and agree. Night 2: replay flips sample 2 (right in replay only), its outputs
    differ on that sample, and its acceptance rate falls below the floor (a regression against night 1).
    """
    db = tmp_path / "history.db"
    folders = []
    for night, sweep_name in enumerate(("night1", "night2")):
        sweep = tmp_path / sweep_name
        for replay in (False, True):
            correct = [1, 0, 0, 1]
            tokens = [[7, i] for i in range(4)]
            rate = 0.55
            if night == 1 and replay:
                correct, tokens, rate = [1, 0, 1, 1], [[7, 0], [7, 1], [9, 9], [7, 3]], 0.2
            res = make_results(ssm_replay=replay, correct=correct, rate=rate, commit=f"commit{night}")
            folder = write_run(sweep / f"ssm_replay-{replay}", res, correct=correct, tokens=tokens,
                               sweep_dir=sweep)
            folders.append(_at(folder, T0 + night * DAY + replay))
    cmp_dir = tmp_path / "compare"
    shutil.copytree(BASELINE_COMPARE_RUN, cmp_dir)
    folders.append(_at(cmp_dir, T0 + DAY / 2))
    odd = make_results(entry="x<b>&y", commit="commit0")
    folders.append(_at(write_run(tmp_path / "odd", odd), T0))
    history.import_runs(folders, db)
    return db


def test_report_marks_regressions_and_lists_flips(history_db, tmp_path):
    files = write_trend_report(history_db, tmp_path / "report")
    page = files.html.read_text()
    md = files.markdown.read_text()
    # latest status: one row per entry x setting; the replay row is marked as a regression
    assert page.count('<tr class="regression">') == 1
    replay_row = next(line for line in page.splitlines() if line.startswith('<tr class="regression">'))
    assert "replay K=3 float32 ws=1 cpu" in replay_row and "REGRESSION: acceptance.rate" in replay_row
    assert '<td class="fail">FAIL</td>' in replay_row and "1 answers changed" in replay_row
    assert "1 outputs differ" in replay_row and "commit1" in replay_row
    assert "tiny_nemotron_h_mtp | replay K=3 float32 ws=1 cpu: acceptance.rate fails" in page
    rewind_row = next(line for line in page.splitlines() if "rewind K=3 float32 ws=1 cpu</td>" in line)
    assert '<td class="pass">PASS</td>' in rewind_row and "0 answers changed" in rewind_row
    # flips: night 2's pair flipped (1 sample right in replay only, 1 output differs), night 1's did not,
    # and the compare run's comparison section (0 / 0 over 1319 samples) is listed too
    flipped = [line for line in page.splitlines() if line.startswith('<tr class="flipped">')]
    assert len(flipped) == 1
    assert "<td>sweep pair</td><td>4</td><td>0 / 1</td><td>0 / 1</td><td>1</td>" in flipped[0]
    assert str(tmp_path / "night2") in flipped[0]
    assert "<td>compare run</td><td>1319</td><td>0 / 0</td><td>0 / 0</td><td>0</td>" in page
    assert "3 comparisons, 1 with flipped samples or differing outputs" in page
    # plots: one per entry x setting, linked relatively and present
    assert len(files.plots) == 4
    for plot in files.plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f'src="{plot.name}"' in page
        assert f"]({plot.name})" in md
    # no script, nothing from the network, user data escaped
    assert "<script" not in page.lower() and "http://" not in page and "https://" not in page
    assert "x&lt;b&gt;&amp;y" in page and "x<b>" not in page
    assert "## Regressions since the previous run" in md and "REGRESSION: acceptance.rate" in md


def test_a_check_failing_in_a_first_run_is_listed(tmp_path):
    db = tmp_path / "h.db"
    history.import_runs([write_run(tmp_path / "r", make_results(rate=0.1))], db)
    page = write_trend_report(db, tmp_path / "out").html.read_text()
    assert "acceptance.rate fails in its first run" in page and "first run" in page


def test_report_command(history_db, tmp_path, capsys):
    out = tmp_path / "cli"
    assert history.main(["--db", str(history_db), "report", "--out", str(out)]) == 0
    assert (out / "index.html").is_file() and (out / "report.md").is_file()
    assert history.main(["--db", str(tmp_path / "absent.db"), "report", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: no history database at" in err and "fix: " in err


def test_page_renders_in_headless_chromium(history_db, tmp_path):
    """Open the page in Debian's chromium through Playwright (evals/screenshot.py): every image loads, nothing
    but the report's own files is requested, and the tables are there. (.ci/run installs chromium; where it
    could not, e.g. offline, this test alone skips and names the missing piece.)"""
    pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip install '.[test]')")
    from evals.screenshot import BrowserUnavailable, render

    files = write_trend_report(history_db, tmp_path / "report")
    try:
        check = render(files.html, tmp_path / "page.png")
    except BrowserUnavailable as exc:
        pytest.skip(f"no headless browser: {exc}")
    assert check.problems == []
    assert len(check.images) == 4 and all(done and width == 640 for done, width in check.images), check.images
    assert check.headings == ["Latest status per entry × setting", "Regressions since the previous run",
                              "Replay vs rewind", "Trends"]
    assert check.table_rows == 1 + 4 + 1 + 3  # status header + 4 series, flips header + 3 comparisons
    assert all(u.startswith("file://") for u in check.requested) and len(check.requested) == 1 + 4
    assert check.screenshot.stat().st_size > 50_000  # a page with four plots, not a blank one


def test_missing_browser_is_browser_unavailable(history_db, tmp_path, monkeypatch):
    """Without a browser (an offline CI machine where chromium could not be installed) render raises
    BrowserUnavailable naming the path and the fix, which the test above turns into a skip, and the
    screenshot command prints error / fix lines and exits 2."""
    pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip install '.[test]')")
    from evals import screenshot

    absent = tmp_path / "no-chromium"
    monkeypatch.setenv("HYBRID_EVAL_CHROMIUM", str(absent))
    assert screenshot.chromium_path() == absent
    files = write_trend_report(history_db, tmp_path / "report")
    with pytest.raises(screenshot.BrowserUnavailable, match="no browser at .*no-chromium.*apt-get install"):
        screenshot.render(files.html, tmp_path / "page.png")
    assert screenshot.main([str(files.html), str(tmp_path / "page.png")]) == 2
    assert not (tmp_path / "page.png").exists()
    # a browser that is there but does not start (here a program that exits at once) is unavailable too
    with pytest.raises(screenshot.BrowserUnavailable, match="did not launch"):
        screenshot.render(files.html, tmp_path / "page.png", executable=shutil.which("false") or "/bin/false")


def test_trend_figure_axis_dates_threshold_and_sample_counts():
    """Ticks read date and time (not '30, 13:39'); a 4-question run's negative pass threshold does not pull
    the GSM8K axis below 0; runs of n = 4 and n = 1319 are two labelled series with different markers."""
    import re

    from evals.trends import series_figure

    def run(minute: int, n: int, value: float, threshold: float) -> dict:
        return {"finished_at": f"2026-11-30T13:{minute:02d}:00+00:00", "n": n, "accuracy_value": value,
                "accuracy_reference": 1.9, "accuracy_threshold": threshold, "verdict_passed": 1,
                "acceptance_rate": 0.53, "acceptance_rate_floor": 0.42, "acceptance_length": 2.6,
                "acceptance_length_reference": 2.587, "acceptance_length_floor": 2.07}

    runs = [run(39, 4, 0.0, -14.0), run(40, 1319, 1.8, 0.9), run(55, 4, 12.5, -14.0)]
    fig = series_figure("tiny_nemotron_h_mtp", "K=3 float32", runs)
    fig.canvas.draw()
    gsm8k = fig.axes[0]
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(re.fullmatch(r"2026-11-30\n13:\d\d(:\d\d)?", t) for t in labels), labels
    assert gsm8k.get_ylim()[0] > -1, gsm8k.get_ylim()  # the -14 % threshold cannot bind: not drawn
    legend = [t.get_text() for t in gsm8k.get_legend().get_texts()]
    assert "GSM8K (mean of the filters) (n=4)" in legend and "GSM8K (mean of the filters) (n=1319)" in legend
    assert "pass threshold (per run's n; no lower bound at this n for n=4)" in legend, legend
    sizes = {line.get_label(): line.get_markersize() for line in gsm8k.get_lines()}
    assert sizes["GSM8K (mean of the filters) (n=1319)"] > sizes["GSM8K (mean of the filters) (n=4)"]


def test_since_previous_run_compares_runs_of_the_same_n(tmp_path):
    """A run is compared with the previous run of its own n (as the plots keep n apart), never with a run over
    another number of questions; the column header says so. A series' first run at a new n is marked so, and
    a check it fails is listed as failing in its first run at that n. A threshold at or below 0 % reads "no
    lower bound at this n" in the table, never a negative score."""
    from evals.verdict import NO_LOWER_BOUND

    db = tmp_path / "h.db"
    folders = []
    # rewind series: n = 50 (1 right), n = 8 (none right), n = 50 again (2 right: ids 0 and 1)
    for day, correct in enumerate(([1] + [0] * 49, [0] * 8, [1, 1] + [0] * 48)):
        res = make_results(correct=correct, commit=f"c{day}")
        folders.append(_at(write_run(tmp_path / f"rewind{day}", res, correct=correct), T0 + day * DAY))
    # replay series: n = 50 passes, then n = 8 fails its acceptance floor
    for day, (correct, rate) in enumerate(((([1] + [0] * 49), 0.55), ([0] * 8, 0.1))):
        res = make_results(ssm_replay=True, correct=correct, rate=rate, commit=f"r{day}")
        folders.append(_at(write_run(tmp_path / f"replay{day}", res, correct=correct), T0 + day * DAY))
    history.import_runs(folders, db)
    files = write_trend_report(db, tmp_path / "out")
    page, md = files.html.read_text(), files.markdown.read_text()
    assert "<th>since previous run at the same n</th>" in page
    assert "| since previous run at the same n |" in md
    rewind = next(line for line in page.splitlines() if "rewind K=3 float32 ws=1 cpu</td>" in line)
    # against the first n = 50 run: 4.00 - 2.00 points, sample 1 changed (against the n = 8 run: +4.00)
    assert "<td>accuracy +2.00; rate +0.000; 1 answers changed</td>" in rewind, rewind
    assert f"<td>4.00 ({NO_LOWER_BOUND} / 1.90)</td>" in rewind and "-20.00" not in page
    replay = next(line for line in page.splitlines() if "replay K=3 float32 ws=1 cpu</td>" in line)
    assert "<td>first run at n = 8</td>" in replay, replay
    assert "acceptance.rate fails in its first run at n = 8" in page
