"""Pass/fail verdicts (evals.verdict) against hand-computed thresholds."""

from __future__ import annotations

import json
import math

import pytest

from evals.verdict import (
    FAIL,
    NO_LOWER_BOUND,
    NO_REFERENCE,
    PASS,
    Check,
    Verdict,
    accuracy_hypothesis_test,
    accuracy_pct,
    check_acceptance,
    check_accuracy,
    evaluate_verdict,
    format_threshold,
)
from registry.baselines import BaselineError, find_acceptance_reference, find_accuracy_reference

# Phi^-1(0.05) = -1.6448536, Phi^-1(0.2) = -0.8416212 (standard normal quantiles).
# n = 1319, sigma = 50: scale = sqrt(2 * 50^2 / 1319) = sqrt(5000 / 1319) = sqrt(3.7907506) = 1.9469850
#   threshold = ref + (-1.6448536 * 1.9469850) = ref - 3.2025
#   theta = (1.6448536 + 0.8416212) * 1.9469850 = 2.4864748 * 1.9469850 = 4.8411
# n = 100: scale = sqrt(5000 / 100) = sqrt(50) = 7.0710678
#   threshold = ref - 1.6448536 * 7.0710678 = ref - 11.6309; theta = 2.4864748 * 7.0710678 = 17.5820
# n = 1319, sigma = 40: scale = sqrt(3200 / 1319) = 1.5575880; threshold = ref - 2.5620


def test_threshold_and_theta_for_full_gsm8k():
    t = accuracy_hypothesis_test(80.85, 1319)
    assert t.scale == pytest.approx(1.9469850, abs=1e-6)
    assert t.reference - t.threshold == pytest.approx(3.2025, abs=1e-4)
    assert round(t.reference - t.threshold, 2) == 3.20
    assert t.theta == pytest.approx(4.8411, abs=1e-4)
    assert round(t.theta, 2) == 4.84


def test_threshold_for_a_short_run_and_overrides():
    t = accuracy_hypothesis_test(50.0, 100)
    assert t.threshold == pytest.approx(50.0 - 11.6309, abs=1e-4)
    assert t.theta == pytest.approx(17.5820, abs=1e-4)
    t40 = accuracy_hypothesis_test(50.0, 1319, sigma=40.0)
    assert t40.reference - t40.threshold == pytest.approx(2.5620, abs=1e-4)
    # alpha = 0.5 puts the threshold on the reference itself (Phi^-1(0.5) = 0).
    assert accuracy_hypothesis_test(70.0, 10, alpha=0.5).threshold == pytest.approx(70.0)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"n": 0}, "scored no samples"),
        ({"sigma": 0.0}, "sigma"),
        ({"alpha": 1.0}, "alpha"),
        ({"beta": 0.0}, "beta"),
        ({"reference": 101.0}, "outside"),
    ],
)
def test_hypothesis_test_rejects_bad_input(kwargs, pattern):
    args = {"reference": 80.0, "n": 1319} | kwargs
    with pytest.raises(ValueError, match=pattern):
        accuracy_hypothesis_test(**args)


def test_score_metric_and_fraction_guard():
    assert accuracy_pct(0.80, 0.82, "mean") == pytest.approx(81.0)
    assert accuracy_pct(0.80, 0.82, "strict_match") == pytest.approx(80.0)
    assert accuracy_pct(0.80, 0.82, "flexible_extract") == pytest.approx(82.0)
    with pytest.raises(ValueError, match="not a fraction"):
        accuracy_pct(80.0, 0.82, "mean")
    with pytest.raises(ValueError, match="unknown GSM8K metric"):
        accuracy_pct(0.8, 0.8, "exact")


def test_gsm8k_check_pass_and_fail_at_the_threshold():
    ref = find_accuracy_reference("super_v3", "bfloat16", "nvfp4", "fp8", "mtp")  # 80.85, metric mean
    threshold = 80.85 - 3.2025
    # mean of the two filters just above / below the threshold (77.6475 %)
    above = check_accuracy(0.7765, 0.7765, 1319, ref)
    below = check_accuracy(0.7764, 0.7764, 1319, ref)
    assert above.status == PASS and above.passed is True
    assert below.status == FAIL and below.passed is False
    assert above.threshold == pytest.approx(threshold, abs=1e-4)
    assert above.reference == 80.85
    assert above.details["theta"] == pytest.approx(4.8411, abs=1e-4)
    assert above.details["n"] == 1319
    # Same score with n = 100 passes: the threshold widens to ref - 11.63 = 69.22.
    assert check_accuracy(0.70, 0.70, 100, ref).status == PASS
    assert check_accuracy(0.69, 0.69, 100, ref).status == FAIL


def test_gsm8k_check_that_cannot_fail_says_so():
    """The tiny model's reference (1.90 %) at n = 20: threshold = 1.90 - 1.6449 * sqrt(5000 / 20) < 0, so a
    score of 0 passes; the note and the printed verdict line say the check has no power there."""
    from evals.report import _format_check

    ref = find_accuracy_reference("tiny_nemotron_h_mtp", "float32", "none", "none", "mtp")
    small, full = check_accuracy(0.0, 0.0, 20, ref), check_accuracy(0.0, 0.0, 1319, ref)
    assert small.status == PASS and small.threshold < 0 and "cannot fail" in small.note
    assert "cannot fail at n=20" in _format_check(small.to_dict())
    assert full.threshold > 0 and "cannot fail" not in full.note + _format_check(full.to_dict())
    # the words every report uses for such a threshold, never the negative number
    assert NO_LOWER_BOUND in small.note and NO_LOWER_BOUND not in full.note
    assert format_threshold(small.threshold) == NO_LOWER_BOUND == format_threshold(0.0)
    assert format_threshold(full.threshold) == f"{full.threshold:.2f}"
    assert format_threshold(None) == "-"


def test_gsm8k_check_placeholder_and_missing_reference():
    placeholder = find_accuracy_reference("tiny_nemotron_h_mtp", "bfloat16", "none", "none", "mtp")
    check = check_accuracy(0.1, 0.2, 50, placeholder)
    assert check.status == NO_REFERENCE and check.passed is None
    assert check.threshold is None and "placeholder" in check.note
    assert check.value == pytest.approx(15.0)
    assert check_accuracy(0.1, 0.2, 50, None).status == NO_REFERENCE


def test_acceptance_floors():
    ref = find_acceptance_reference("super_v3", "nvfp4", 3)  # rate >= 0.45, length >= 3.47 * 0.95
    ok = check_acceptance(0.45, 3.2965, ref)
    assert [(c.name, c.status) for c in ok] == [("acceptance.rate", PASS), ("acceptance.length", PASS)]
    bad = check_acceptance(0.4499, 3.29, ref)
    assert [c.status for c in bad] == [FAIL, FAIL]
    assert bad[1].reference == 3.47 and bad[1].threshold == pytest.approx(3.2965)
    # bf16 row has a rate floor only: the length check reports no reference.
    bf16 = check_acceptance(0.8, 3.4, find_acceptance_reference("super_v3", "none", 3))
    assert [c.status for c in bf16] == [PASS, NO_REFERENCE]
    placeholder = check_acceptance(0.3, 1.9, find_acceptance_reference("qwen3_next", "none", 3))
    assert [c.status for c in placeholder] == [NO_REFERENCE, NO_REFERENCE]
    # the measured tiny row: floor 0.34, length floor 2.284 * 0.8 = 1.827
    tiny = find_acceptance_reference("tiny_qwen3_next_mtp", "none", 3)
    assert [c.status for c in check_acceptance(0.3, 1.8, tiny)] == [FAIL, FAIL]
    assert [c.status for c in check_acceptance(0.4279, 2.284, tiny)] == [PASS, PASS]
    with pytest.raises(ValueError, match="not a fraction"):
        check_acceptance(45.0, None, ref)
    with pytest.raises(ValueError, match="length"):
        check_acceptance(None, 0.5, ref)


def _results(strict, flexible, n, rate=None, length=None):
    out = {"gsm8k": {"strict_match": strict, "flexible_extract": flexible, "n": n},
           "task": {"num_fewshot": 5, "max_gen_toks": 256}}  # the baselines' protocol
    if rate is not None:
        out["acceptance"] = {"rate": rate, "length": length}
    return out


def test_evaluate_verdict_matched():
    verdict = evaluate_verdict(
        _results(0.80, 0.81, 1319, rate=0.82, length=3.46),
        model_key="super_v3",
        entry="super_v3_mtp",
        dtype="bf16",
        quant="nvfp4",
        kv_cache_quant="fp8",
        spec_dec="mtp",
        draft_len=3,
    )
    d = verdict.to_dict()
    json.dumps(d)  # results.json must be able to hold it
    assert d["passed"] is True and d["status"] == PASS and d["complete"] is True
    assert [c["name"] for c in d["checks"]] == ["gsm8k.mean", "acceptance.rate", "acceptance.length"]
    assert d["checks"][0]["value"] == pytest.approx(80.5)
    failing = evaluate_verdict(
        _results(0.70, 0.72, 1319, rate=0.82, length=3.46),
        model_key="super_v3",
        entry="super_v3_mtp",
        dtype="bf16",
        quant="nvfp4",
        kv_cache_quant="fp8",
        spec_dec="mtp",
        draft_len=3,
    )
    assert failing.passed is False and failing.status == FAIL


@pytest.mark.parametrize("task, differ", [
    ({"num_fewshot": 0, "max_gen_toks": 256}, "eval.num_fewshot=0"),
    ({"num_fewshot": 5, "max_gen_toks": 64}, "eval.max_gen_toks=64"),
])
def test_a_reference_of_another_protocol_does_not_judge_the_run(task, differ):
    """The rows were measured 5-shot with 256 tokens: a 0-shot or 64-token run of a score that would fail
    (and acceptance below its floor) is reported, not judged, each check saying which setting differs and
    what would be judged; the same run under the references' protocol fails."""
    results = _results(0.10, 0.10, 1319, rate=0.10, length=1.3)
    kwargs = {"model_key": "super_v3", "entry": "super_v3_mtp", "dtype": "bf16", "quant": "nvfp4",
              "kv_cache_quant": "fp8", "spec_dec": "mtp", "draft_len": 3}
    assert evaluate_verdict(results, **kwargs).status == FAIL
    verdict = evaluate_verdict({**results, "task": task}, **kwargs)
    assert verdict.status == NO_REFERENCE and verdict.passed is None
    judged = {c.name: c for c in verdict.checks}
    for name, file in (("gsm8k.mean", "gsm8k.yaml"), ("acceptance.rate", "acceptance.yaml"),
                       ("acceptance.length", "acceptance.yaml")):
        c = judged[name]
        assert c.status == NO_REFERENCE and c.threshold is None, name
        assert f"the super_v3 references in registry/baselines/{file} were measured 5-shot with at most " \
               f"256 generated tokens and this run sets {differ}" in c.note, c.note
        assert "reported, not judged" in c.note
    # a run that records no protocol cannot be compared at all
    with pytest.raises(ValueError, match="num_fewshot and max_gen_toks"):
        evaluate_verdict({k: v for k, v in results.items() if k != "task"}, **kwargs)


def test_evaluate_verdict_unmatched_reference():
    kwargs = {"model_key": "super_v3", "entry": "super_v3_mtp", "dtype": "float32", "spec_dec": "none"}
    with pytest.raises(BaselineError, match="dtype=float32") as err:
        evaluate_verdict(_results(0.8, 0.8, 1319), **kwargs)
    assert "require_reference=false" in err.value.fix
    verdict = evaluate_verdict(_results(0.8, 0.8, 1319), require_reference=False, **kwargs)
    assert verdict.passed is None and verdict.status == NO_REFERENCE and not verdict.complete
    assert "no GSM8K reference" in verdict.checks[0].note
    # MTP on at a draft length without an acceptance row: an error unless references are optional.
    mtp = kwargs | {"dtype": "bfloat16", "spec_dec": "mtp", "draft_len": 5}
    with pytest.raises(BaselineError, match="draft_len=5"):
        evaluate_verdict(_results(0.83, 0.84, 1319, rate=0.7, length=4.5), **mtp)
    partial = evaluate_verdict(
        _results(0.83, 0.84, 1319, rate=0.7, length=4.5), require_reference=False, **mtp
    )
    assert partial.passed is True and not partial.complete
    assert [c.status for c in partial.checks] == [PASS, NO_REFERENCE, NO_REFERENCE]


def test_evaluate_verdict_entry_without_baseline_says_so():
    # an entry with `baseline: null` (e.g. qwen3_next_mtp_fp8): the checks name the entry and the missing key
    kwargs = {"model_key": None, "entry": "qwen3_next_mtp_fp8", "dtype": "bfloat16", "spec_dec": "mtp",
              "draft_len": 3, "quant": "fp8"}
    results = _results(0.0, 0.0, 32, rate=0.0, length=1.0)
    with pytest.raises(BaselineError, match="qwen3_next_mtp_fp8 has no `baseline` key") as err:
        evaluate_verdict(results, **kwargs)
    assert "require_reference=false" in err.value.fix
    verdict = evaluate_verdict(results, require_reference=False, **kwargs)
    judged = [c for c in verdict.checks if c.name.startswith(("gsm8k", "acceptance"))]
    assert [c.status for c in judged] == [NO_REFERENCE] * 3
    assert all("has no `baseline` key" in c.note and "''" not in c.note for c in judged)


def test_evaluate_verdict_ignores_acceptance_without_spec_decoding():
    verdict = evaluate_verdict(
        _results(0.83, 0.84, 1319, rate=0.9, length=2.0),
        model_key="super_v3",
        entry="super_v3",
        dtype="bfloat16",
        spec_dec="none",
    )
    assert [c.name for c in verdict.checks] == ["gsm8k.mean"]


def test_verdict_aggregation():
    p = Check("a", 1.0, None, 0.5, PASS, "fraction")
    f = Check("b", 0.1, None, 0.5, FAIL, "fraction")
    n = Check("c", 0.1, None, None, NO_REFERENCE, "fraction")
    assert Verdict([p, n]).passed is True
    assert Verdict([p, f, n]).passed is False
    assert Verdict([n]).passed is None
    assert Verdict([]).passed is None
    assert math.isclose(Verdict([p]).to_dict()["checks"][0]["value"], 1.0)
