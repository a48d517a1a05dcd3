"""Paired comparison of two runs (evals.compare) on constructed samples with hand-checkable numbers."""

from __future__ import annotations

import json

import pytest

from evals.compare import (
    COMPARE_ARMS,
    COMPARISON_FILE,
    ComparisonError,
    compare_arms,
    compare_run_dirs,
    compare_runs,
    comparison_checks,
    first_divergence,
    load_run_samples,
    load_samples_jsonl,
    mcnemar_exact,
)
from evals.compare import main as compare_main
from evals.verdict import Check, Verdict
from registry.errors import UserError


def test_mcnemar_exact_by_hand():
    # Exact two-sided binomial on the discordant pairs, p = 0.5, symmetric so p = 2 * P(X <= min):
    assert mcnemar_exact(0, 5) == pytest.approx(2 * 0.5**5)  # 0.0625
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 2**10)  # 22/1024 = 0.0214844
    assert mcnemar_exact(1, 5) == pytest.approx(2 * (1 + 6) / 2**6)  # 14/64 = 0.21875
    assert mcnemar_exact(3, 3) == pytest.approx(1.0)
    assert mcnemar_exact(0, 0) == 1.0
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([5], [6]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one arm stopped earlier
    assert first_divergence([], []) is None


def _arms():
    """20 samples. strict_match: 10 both right, 4 both wrong, 1 right in A only, 5 right in B only.
    flexible_extract: identical in both arms (all right except ids 0..2).
    Tokens: samples 0..16 identical; 17 diverges at 4, 18 at 7, 19 at 10 (B stops early)."""
    a, b = [], []
    pattern = [(1, 1)] * 10 + [(0, 0)] * 4 + [(1, 0)] + [(0, 1)] * 5
    for i, (ca, cb) in enumerate(pattern):
        toks = list(range(100 + i, 112 + i))
        ta, tb = list(toks), list(toks)
        if i == 17:
            tb[4] = -1
        if i == 18:
            tb[7] = -1
        if i == 19:
            tb = tb[:10]
        flex = i >= 3
        a.append({"doc_id": i, "strict_match": float(ca), "flexible_extract": flex, "tokens": ta})
        b.append({"doc_id": i, "strict_match": float(cb), "flexible_extract": flex, "tokens": tb})
    return a, b


def test_compare_runs_counts_pvalue_and_divergence():
    a, b = _arms()
    acc_a = {
        "rate": 0.80,
        "length": 3.40,
        "per_position": [0.9, 0.8, 0.7],
        "num_accepted_hist": [0, 1, 2, 3, 4],
        "draft_len": 3,
    }
    acc_b = {
        "rate": 0.78,
        "length": 3.34,
        "per_position": [0.9, 0.78, 0.66],
        "num_accepted_hist": [0, 1, 3, 3, 3],
        "draft_len": 3,
    }
    cmp = compare_runs(
        a, list(reversed(b)), acceptance_a=acc_a, acceptance_b=acc_b, label_a="rewind", label_b="replay"
    )
    strict = cmp.filters["strict_match"]
    assert (strict.both_correct, strict.both_wrong, strict.a_only, strict.b_only) == (10, 4, 1, 5)
    assert strict.accuracy_a == pytest.approx(100 * 11 / 20)  # 55 %
    assert strict.accuracy_b == pytest.approx(100 * 15 / 20)  # 75 %
    assert strict.delta == pytest.approx(20.0)
    assert strict.agreement == pytest.approx(14 / 20)
    assert strict.mcnemar_p == pytest.approx(14 / 64)
    flex = cmp.filters["flexible_extract"]
    assert (flex.a_only, flex.b_only, flex.agreement, flex.mcnemar_p) == (0, 0, 1.0, 1.0)

    div = cmp.divergence
    assert (div.n, div.num_identical, div.num_diverged) == (20, 17, 3)
    assert div.min_first_divergence == 4 and div.median_first_divergence == 7.0
    assert div.per_sample["17"] == 4 and div.per_sample["19"] == 10 and div.per_sample["0"] is None

    acc = cmp.acceptance
    assert acc.rate_delta == pytest.approx(-0.02) and acc.length_delta == pytest.approx(-0.06)
    assert acc.per_position_delta == pytest.approx([0.0, -0.02, -0.04])
    d = cmp.to_dict()
    json.dumps(d)
    assert d["label_b"] == "replay" and d["filters"]["strict_match"]["b_only"] == 5


def test_identical_runs():
    a, _ = _arms()
    cmp = compare_runs({r["doc_id"]: r for r in a}, a)
    assert all(f.a_only == f.b_only == 0 and f.mcnemar_p == 1.0 for f in cmp.filters.values())
    assert cmp.divergence.num_diverged == 0 and cmp.divergence.min_first_divergence is None
    assert cmp.acceptance is None


def test_different_sample_sets_are_an_error():
    a, b = _arms()
    with pytest.raises(ComparisonError, match=r"1 only in a \(e.g. \[19\]\), 0 only in b"):
        compare_runs(a, b[:-1])
    with pytest.raises(ComparisonError, match="appears twice"):
        compare_runs(a, b + b[:1])
    with pytest.raises(ComparisonError, match="empty"):
        compare_runs([], [])


def test_missing_fields_are_errors():
    a, b = _arms()
    b_no_tokens = [{k: v for k, v in r.items() if k != "tokens"} for r in b]
    with pytest.raises(ComparisonError, match="token ids"):
        compare_runs(a, b_no_tokens)
    a_no_tokens = [{k: v for k, v in r.items() if k != "tokens"} for r in a]
    assert compare_runs(a_no_tokens, b_no_tokens).divergence is None
    b_bad = [dict(r, strict_match=0.5) for r in b]
    with pytest.raises(ComparisonError, match="not 0/1"):
        compare_runs(a, b_bad)
    with pytest.raises(ComparisonError, match="one arm only"):
        compare_runs(a, b, acceptance_a={"rate": 0.5})


def test_load_samples_jsonl(tmp_path):
    a, _ = _arms()
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in a) + "\n")
    loaded = load_samples_jsonl(path)
    assert sorted(loaded) == list(range(20)) and loaded[3]["tokens"] == a[3]["tokens"]
    path.write_text(json.dumps(a[0]) + "\n" + json.dumps(a[0]) + "\n")
    with pytest.raises(ComparisonError, match="appears twice"):
        load_samples_jsonl(path)


def test_compare_run_dirs(tmp_path):
    a, b = _arms()
    acceptance = {
        "rate": 0.8,
        "length": 3.4,
        "per_position": [0.9, 0.8, 0.7],
        "num_accepted_hist": [0, 1, 1, 1, 2],
    }
    for name, samples, acc in (("rewind", a, acceptance), ("replay", b, None)):
        d = tmp_path / name
        d.mkdir()
        (d / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in samples) + "\n")
        (d / "results.json").write_text(json.dumps({"schema_version": 1, "acceptance": acc}))
    cmp = compare_run_dirs(tmp_path / "rewind", tmp_path / "replay")
    assert (cmp.label_a, cmp.label_b) == ("rewind", "replay")
    assert cmp.filters["strict_match"].b_only == 5 and cmp.acceptance is None  # replay has no acceptance
    with pytest.raises(UserError, match="does not exist"):  # evals.results.read_results, the one reader
        compare_run_dirs(tmp_path / "rewind", tmp_path / "nowhere")


def _write_gsm8k_run(d, records, **results):
    """A run folder as evals.evaluate writes it: correctness under `correct`, token ids in generations.jsonl
    (keyed by request_key, with a stale earlier line for one key that the later line overrides); `results`
    adds top-level results.json sections (config, task)."""
    d.mkdir()
    samples, gens = [], [{"key": "k0", "generated_ids": [999], "text": "stale"}]
    for r in records:
        key = f"k{r['doc_id']}"
        samples.append({"doc_id": r["doc_id"], "request_key": key,
                        "correct": {"strict_match": bool(r["strict_match"]),
                                    "flexible_extract": bool(r["flexible_extract"])}})
        gens.append({"key": key, "generated_ids": r["tokens"], "text": "t"})
    (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (d / "generations.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gens))
    (d / "results.json").write_text(json.dumps({"schema_version": 1, "acceptance": None, **results}))


def test_run_dirs_in_the_gsm8k_layout(tmp_path):
    a, b = _arms()
    _write_gsm8k_run(tmp_path / "a", a)
    _write_gsm8k_run(tmp_path / "b", b)
    loaded = load_run_samples(tmp_path / "a")
    assert loaded[0]["tokens"] == a[0]["tokens"] and loaded[0]["strict_match"] is True
    cmp = compare_run_dirs(tmp_path / "a", tmp_path / "b")
    assert cmp.filters["strict_match"].a_only == 1 and cmp.filters["strict_match"].b_only == 5
    assert cmp.divergence.num_diverged == 3 and cmp.divergence.per_sample["19"] == 10
    (tmp_path / "b" / "generations.jsonl").write_text("")
    with pytest.raises(ComparisonError, match="no generation for sample"):
        load_run_samples(tmp_path / "b")
    (tmp_path / "b" / "generations.jsonl").unlink()  # no generations file: no token ids, no divergence
    assert "tokens" not in load_run_samples(tmp_path / "b")[0]


def test_comparison_checks_exact_and_mcnemar():
    a, b = _arms()
    cmp = compare_runs(a, b)
    exact = {c.name: c for c in comparison_checks(cmp, exact=True)}
    # strict_match: 1 + 5 = 6 flipped samples; flexible_extract: none; tokens: 3 samples diverge.
    flipped = exact["comparison.strict_match.flipped"]
    assert flipped.value == 6 and flipped.status == "fail"
    assert exact["comparison.flexible_extract.flipped"].status == "pass"
    assert exact["comparison.diverged"].value == 3 and exact["comparison.diverged"].status == "fail"
    assert exact["comparison.diverged"].details["min_first_divergence"] == 4
    loose = {c.name: c for c in comparison_checks(cmp, exact=False)}
    # McNemar 1 vs 5: p = 14/64 = 0.21875 >= 0.05 passes; at alpha 0.25 it fails.
    assert loose["comparison.strict_match.mcnemar_p"].value == pytest.approx(0.21875)
    assert loose["comparison.strict_match.mcnemar_p"].status == "pass" and "comparison.diverged" not in loose
    strict_alpha = {c.name: c for c in comparison_checks(cmp, exact=False, alpha=0.25)}
    assert strict_alpha["comparison.strict_match.mcnemar_p"].status == "fail"
    no_tokens = [{k: v for k, v in r.items() if k != "tokens"} for r in a]
    same = {c.name: c.status for c in comparison_checks(compare_runs(no_tokens, no_tokens), exact=True)}
    assert same == {"comparison.strict_match.flipped": "pass", "comparison.flexible_extract.flipped": "pass",
                    "comparison.diverged": "no_reference"}


def test_cli_exit_status(tmp_path, capsys):
    a, b = _arms()
    _write_gsm8k_run(tmp_path / "a", a)
    _write_gsm8k_run(tmp_path / "b", b)
    _write_gsm8k_run(tmp_path / "a2", a)
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "a2"), "--exact"]) == 0
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "b"), "--exact",
                         "--out", str(tmp_path / "c.json")]) == 1
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0  # p = 0.21875: no significant change
    assert json.loads((tmp_path / "c.json").read_text())["checks"][0]["status"] == "fail"
    assert "strict_match: 55.00% -> 75.00% (+20.00), flipped 1 / 5" in capsys.readouterr().out


def test_cli_out_never_replaces_a_runs_files_and_refuses_a_folder(tmp_path, capsys):
    """--out naming a run's own file (its results.json, samples, generations) is refused before anything is
    written: the run stays byte for byte; a folder, or a path under a missing folder, is refused with
    error / fix lines and status 2, not a traceback."""
    a, b = _arms()
    _write_gsm8k_run(tmp_path / "a", a)
    _write_gsm8k_run(tmp_path / "b", b)
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    for target in ("b/results.json", "b/samples.jsonl", "b/generations.jsonl", "b", "missing/c.json"):
        capsys.readouterr()
        assert compare_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / target)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[0].startswith("error: --out ") and err[1].startswith("  fix: pass --out"), (target, err)
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before
    assert not (tmp_path / "missing").exists()
    new = tmp_path / "b" / "c.json"
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(new)]) == 0
    assert json.loads(new.read_text())["checks"]  # a new file beside them: written


def test_dummy_against_real_weights_is_refused(tmp_path, capsys):
    """A dummy-weight run against a checkpoint's (older results without load_format read as "auto"): nothing
    to compare, so the CLI refuses with status 2 and says how to fix it."""
    a, _ = _arms()
    _write_gsm8k_run(tmp_path / "real", a)
    _write_gsm8k_run(tmp_path / "dummy", a, config={"load_format": "dummy"})
    with pytest.raises(ComparisonError, match="load_format=auto.*load_format=dummy"):
        compare_run_dirs(tmp_path / "real", tmp_path / "dummy")
    assert compare_main([str(tmp_path / "real"), str(tmp_path / "dummy")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and err[1] == "  fix: compare runs of the same model.load_format", err


def test_dummy_comparison_judges_nothing(tmp_path):
    """Two dummy runs with identical tokens would pass every exact check trivially (no draft was accepted,
    so replay never ran): every check is no_reference and the verdict is NO REFERENCE, not PASS."""
    a, _ = _arms()
    _write_gsm8k_run(tmp_path / "rewind", a, config={"load_format": "dummy"})
    _write_gsm8k_run(tmp_path / "replay", a, config={"load_format": "dummy"})
    cmp = compare_run_dirs(tmp_path / "rewind", tmp_path / "replay")
    assert cmp.load_format == "dummy" and cmp.to_dict()["load_format"] == "dummy"
    checks = comparison_checks(cmp, exact=True)
    assert {c.status for c in checks} == {"no_reference"} and all("dummy weights" in c.note for c in checks)
    assert Verdict(checks).status == "no_reference"
    real = comparison_checks(compare_runs(a, a), exact=True)
    assert Verdict(real).status == "pass"  # the same samples on real weights do pass


def test_differing_eval_settings_warn(tmp_path, capsys):
    """Runs whose max_gen_toks differ are compared, with a warning naming the setting."""
    a, _ = _arms()
    _write_gsm8k_run(tmp_path / "a", a, task={"max_gen_toks": 256, "num_fewshot": 5})
    _write_gsm8k_run(tmp_path / "b", a, task={"max_gen_toks": 16, "num_fewshot": 5})
    assert compare_run_dirs(tmp_path / "a", tmp_path / "b").warnings == [
        f"max_gen_toks differs: 256 in {tmp_path / 'a'}, 16 in {tmp_path / 'b'} (differences may come from "
        "the settings)"]
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "warning: max_gen_toks differs" in err and "num_fewshot" not in err


def test_two_entries_or_one_folder_twice_warn_and_a_compare_run_names_its_arms(tmp_path, capsys):
    a, _ = _arms()
    _write_gsm8k_run(tmp_path / "a", a)
    _write_gsm8k_run(tmp_path / "b", a)
    for d, entry in (("a", "tiny_nemotron_h_mtp"), ("b", "tiny_qwen3_next_mtp")):
        r = json.loads((tmp_path / d / "results.json").read_text())
        (tmp_path / d / "results.json").write_text(json.dumps({**r, "entry": entry}))
    assert compare_run_dirs(tmp_path / "a", tmp_path / "b").warnings == [
        f"the runs are of different registry entries: 'tiny_nemotron_h_mtp' in {tmp_path / 'a'}, "
        f"'tiny_qwen3_next_mtp' in {tmp_path / 'b'}"]
    assert compare_run_dirs(tmp_path / "a", tmp_path / "a").warnings == [f"both runs are the same folder, "
                                                                        f"{tmp_path / 'a'}"]
    (tmp_path / "pair").mkdir()
    for arm in ("rewind", "replay"):
        _write_gsm8k_run(tmp_path / "pair" / arm, a)
    (tmp_path / "pair" / "results.json").write_text((tmp_path / "a" / "results.json").read_text())
    capsys.readouterr()
    assert compare_main([str(tmp_path / "pair"), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == f"  fix: pass one of its arms, {tmp_path / 'pair' / 'rewind'} or " \
                     f"{tmp_path / 'pair' / 'replay'} (a compare=replay run)", err


def test_compare_arms_on_dummy_weights_is_no_reference(tmp_path):
    """compare=replay's arms on dummy weights: the rewind arm's verdict (evals.verdict's dummy verdict: only
    health.finite judged) plus the comparison's checks give NO REFERENCE, not PASS."""
    a, _ = _arms()
    for arm in COMPARE_ARMS:
        _write_gsm8k_run(tmp_path / arm, a, config={"load_format": "dummy"})
    rewind_verdict = Verdict([Check("health.finite", 0.0, None, None, "pass", "outputs", ""),
                              Check("gsm8k.strict_match", 0.0, None, None, "no_reference", "percent", "")]
                             ).to_dict()
    section, checks = compare_arms(tmp_path, rewind_verdict, exact=True)
    assert section["load_format"] == "dummy" and (tmp_path / COMPARISON_FILE).exists()
    verdict = Verdict(checks)
    assert verdict.status == "no_reference" and verdict.headline == "NO REFERENCE"


def test_cli_refusals_are_two_lines(tmp_path, capsys):
    """Every refusal of `python -m evals.compare` is the project's `error:` / `fix:` pair with status 2 (not
    argparse's usage line): a folder without results.json, a samples.jsonl missing, runs that scored
    different samples."""
    a, _ = _arms()
    _write_gsm8k_run(tmp_path / "a", a)
    _write_gsm8k_run(tmp_path / "short", a[:15])
    (tmp_path / "empty").mkdir()
    _write_gsm8k_run(tmp_path / "nosamples", a)
    (tmp_path / "nosamples" / "samples.jsonl").unlink()
    cases = [("empty", f"error: {tmp_path / 'empty' / 'results.json'} does not exist"),
             ("nosamples", f"error: {tmp_path / 'nosamples' / 'samples.jsonl'} does not exist"),
             ("short", "error: the runs scored different samples (20 in a, 15 in short): 5 only in a "
                       "(e.g. [15, 16, 17, 18, 19]), 0 only in short")]
    for other, first in cases:
        assert compare_main([str(tmp_path / "a"), str(tmp_path / other)]) == 2
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert len(lines) == 2 and lines[0].startswith(first) and lines[1].startswith("  fix: "), lines
        assert "usage:" not in err and out == ""


def test_sample_ids_of_a_mismatch_are_listed_in_numeric_order():
    """Runs of 50 and 300 samples: 250 only in the longer one, its first extras 50..54 (not 100, 101, ...
    as strings sort), and none only in the shorter one (no empty example list)."""
    def run(n):
        return [{"doc_id": i, "strict_match": 1, "flexible_extract": 1} for i in range(n)]

    with pytest.raises(ComparisonError) as e:
        compare_runs(run(50), run(300), label_a="rv50", label_b="rv300")
    assert e.value.problem.startswith(
        "the runs scored different samples (50 in rv50, 300 in rv300): 0 only in rv50, 250 only in rv300 "
        "(e.g. [50, 51, 52, 53, 54])"), e.value.problem
