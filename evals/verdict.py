"""Pass/fail verdicts of one run against its baselines: its task's score checks, health, acceptance floors.

The checks a run gets are what its task row declares (evals.task.EvalTask: score_check, health_checks). An
accuracy ("bernoulli", GSM8K's) uses the one-sided hypothesis test of TensorRT-LLM's accuracy suite
(tests/integration/defs/accuracy/README.md there): the run's accuracy is a mean of n Bernoulli scores whose
standard deviation is at most sigma = 50 (percent points), so the difference of two such means has standard
error scale = sqrt(2 sigma^2 / n). With false-failure rate alpha and missed-regression rate beta,

    threshold = ref + Phi^-1(alpha) * scale           (pass if score >= threshold)
    theta     = -(Phi^-1(alpha) + Phi^-1(beta)) * scale  (smallest regression caught with prob. 1 - beta)

n is the number of samples the run actually scored. A reference judges a run only when both were measured
under one protocol (few-shot examples, generated-token limit: registry.baselines.Protocol, results.json's
task section): another protocol is another benchmark, so its accuracy and acceptance checks are
"no_reference", saying which setting differs. Acceptance checks are plain floors (rate >= floor,
length >= floor). Health checks need no reference and can fail at any n (a run over 3 questions, whose GSM8K
test cannot fail, still fails on them): no non-finite model output, and not a degenerate model (thresholds
below: MAX_EMPTY_FRACTION, MAX_REPEATED_FRACTION, MIN_ANSWERED). The module is pure: it reads baselines
through registry.baselines and returns data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from evals.task import DEFAULT_TASK, HEALTH_CHECKS, TASKS, EvalTask
from registry.baselines import (
    AcceptanceReference,
    AccuracyReference,
    BaselineError,
    find_acceptance_reference,
    find_accuracy_reference,
    protocol_mismatch,
    reference_protocol,
    run_protocol,
)

DEFAULT_SIGMA = 50.0  # percent points: the largest standard deviation of a 0/100 Bernoulli score
DEFAULT_ALPHA = 0.05  # probability that a run without regression fails
DEFAULT_BETA = 0.2  # probability that a regression of theta passes

PASS, FAIL, NO_REFERENCE = "pass", "fail", "no_reference"
DUMMY_NOTE = "dummy weights (model.load_format=dummy): no accuracy can be judged"

# Health thresholds (evals.evaluate.output_health counts them). A trained model with a GSM8K prompt writes
# text, varies its tokens and produces a number somewhere; a broken one (NaN weights decoding to token 0, a
# collapsed model) fails whatever its GSM8K score: the tiny models of this repository, at 2 % accuracy, have
# no empty generation and an extractable number in most.
MAX_EMPTY_FRACTION = 0.5  # fail when more than half the generations are empty (no text before the stop)
MAX_REPEATED_FRACTION = 0.5  # fail when more than half repeat one token id (>= 4 tokens, all the same)
MIN_ANSWERED = 1  # fail when no generation that ended on its own has a number flexible-extract can read

# A GSM8K threshold at or below 0 % (a run over too few samples) passes every score: reports say so in these
# words instead of printing or drawing a negative accuracy (format_threshold).
NO_LOWER_BOUND = "no lower bound at this n"

_PHI = NormalDist()


@dataclass(frozen=True)
class HypothesisTest:
    """Threshold arithmetic of one GSM8K check; scores, reference, scale, threshold and theta in percent."""

    reference: float
    n: int
    sigma: float
    alpha: float
    beta: float
    scale: float
    threshold: float
    theta: float


def accuracy_hypothesis_test(
    reference: float,
    n: int,
    sigma: float = DEFAULT_SIGMA,
    alpha: float = DEFAULT_ALPHA,
    beta: float = DEFAULT_BETA,
) -> HypothesisTest:
    """Threshold and minimum detectable effect for a reference accuracy and n scored samples.

    Args:
        reference: reference accuracy in percent (0-100).
        n: samples the run scored (> 0).
        sigma: per-sample score standard deviation in percent points (> 0).
        alpha, beta: error rates in (0, 1).
    Returns:
        HypothesisTest with scale = sqrt(2 sigma^2 / n), threshold = reference + Phi^-1(alpha) * scale,
        theta = -(Phi^-1(alpha) + Phi^-1(beta)) * scale. For n = 1319 and the defaults: threshold =
        reference - 3.20, theta = 4.84.
    Raises:
        ValueError: n <= 0, sigma <= 0, alpha or beta outside (0, 1), reference outside [0, 100].
    """
    if not 0.0 <= reference <= 100.0:
        raise ValueError(f"reference accuracy {reference} is outside [0, 100] (percent)")
    if n <= 0:
        raise ValueError(f"n = {n}: the run scored no samples, so there is nothing to test")
    if sigma <= 0:
        raise ValueError(f"sigma = {sigma} must be > 0")
    for name, p in (("alpha", alpha), ("beta", beta)):
        if not 0.0 < p < 1.0:
            raise ValueError(f"{name} = {p} must lie in (0, 1)")
    scale = math.sqrt(2.0 * sigma**2 / n)
    z_alpha, z_beta = _PHI.inv_cdf(alpha), _PHI.inv_cdf(beta)
    return HypothesisTest(
        reference=reference,
        n=n,
        sigma=sigma,
        alpha=alpha,
        beta=beta,
        scale=scale,
        threshold=reference + z_alpha * scale,
        theta=-(z_alpha + z_beta) * scale,
    )


@dataclass
class Check:
    """One verdict line.

    status is "pass", "fail" or "no_reference"; passed is True / False / None accordingly. value,
    reference and threshold are in the check's unit ("percent" for GSM8K, "fraction" for acceptance
    rate, "tokens" for acceptance length). details holds the arithmetic (n, sigma, alpha, beta, scale,
    theta) or the row used.
    """

    name: str
    value: float | None
    reference: float | None
    threshold: float | None
    status: str
    unit: str
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool | None:
        return None if self.status == NO_REFERENCE else self.status == PASS

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        return d


@dataclass
class Verdict:
    """All checks of a run.

    passed: False if any check failed (health checks included); True if at least one check against a
    reference passed and none failed; None if no check had a reference (health checks, which need none, can
    fail a run but not make it pass). complete: every check had a reference.
    """

    checks: list[Check]

    @property
    def passed(self) -> bool | None:
        if any(c.passed is False for c in self.checks):
            return False
        referenced = [c.passed for c in self.checks if c.passed is not None and not is_health(c.name)]
        return True if referenced else None

    @property
    def status(self) -> str:
        return {True: PASS, False: FAIL, None: NO_REFERENCE}[self.passed]

    @property
    def complete(self) -> bool:
        return all(c.status != NO_REFERENCE for c in self.checks)

    @property
    def headline(self) -> str:
        """The verdict in one line: PASS / FAIL (naming the failed checks) / NO REFERENCE, and which kinds of
        check had no reference, e.g. "PASS (acceptance: no reference)", "FAIL: health.empty"."""
        return headline(self.status, [(c.name, c.status) for c in self.checks])

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "status": self.status,
            "complete": self.complete,
            "headline": self.headline,
            "checks": [c.to_dict() for c in self.checks],
        }


def is_health(name: str) -> bool:
    """A health check (check_health; also an arm's, e.g. "rewind.health.empty"): needs no reference."""
    return name.startswith("health.") or ".health." in name


def headline(status: str, checks: list[tuple[str, str]]) -> str:
    """Verdict.headline from a status and (check name, check status) pairs (also for a saved verdict).
    A check's kind is its name without the last part (the task's section, `acceptance`,
    `rewind.acceptance`)."""
    word = {PASS: "PASS", FAIL: "FAIL", NO_REFERENCE: "NO REFERENCE"}.get(status, "?")
    failed = [name for name, st in checks if st == FAIL]
    if failed:
        word += ": " + ", ".join(failed)
    if status != NO_REFERENCE:
        kinds = list(dict.fromkeys(name.rpartition(".")[0] or name
                                   for name, st in checks if st == NO_REFERENCE))
        if kinds:
            word += f" ({', '.join(kinds)}: no reference)"
    return word


def check_health(health: dict[str, Any] | None, kinds: tuple[str, ...] = HEALTH_CHECKS,
                 answer_label: str = "flexible-extract") -> list[Check]:
    """Checks that need no reference and can fail at any n, from results.json `health`, those of `kinds`
    (evals.task.HEALTH_CHECKS; a task row's `health_checks`):

    - ``health.finite``: no model output held NaN / infinite values in any forward (the engine's per-layer
      flags); the note names where they first appeared;
    - ``health.empty``: at most MAX_EMPTY_FRACTION of the generations are empty;
    - ``health.repeated_token``: at most MAX_REPEATED_FRACTION of them repeat one token id;
    - ``health.answers``: at least MIN_ANSWERED of the generations that ended on their own (not cut by
      max_gen_toks) has an answer the task's answer filter (`answer_label`) can read; absent when every
      generation was cut.
    A results dict without a `health` section (or without `outputs`) gets the checks it has data for.
    """
    if not health:
        return []
    checks = []
    nonfinite = list(health.get("nonfinite") or [])
    if health.get("nonfinite") is not None and "finite" in kinds:
        note = (
            f"NaN / infinite values first in {nonfinite[0]}"
            + (
                f", then {', '.join(nonfinite[1:4])}" + (" ..." if len(nonfinite) > 4 else "")
                if len(nonfinite) > 1
                else ""
            )
            if nonfinite
            else "no NaN / infinite values in any layer's output"
        )
        checks.append(
            Check(
                "health.finite",
                float(len(nonfinite)),
                None,
                0.0,
                FAIL if nonfinite else PASS,
                "outputs",
                note + "; pass if none",
                {"nonfinite": nonfinite},
            )
        )
    out = health.get("outputs")
    if out and out.get("n"):
        n = int(out["n"])
        for name, key, limit, what in (
            ("health.empty", "empty", MAX_EMPTY_FRACTION, "empty"),
            ("health.repeated_token", "repeated_token", MAX_REPEATED_FRACTION, "one token id repeated"),
        ):
            if key not in kinds:
                continue
            frac = out[key] / n
            checks.append(
                Check(
                    name,
                    frac,
                    None,
                    limit,
                    PASS if frac <= limit else FAIL,
                    "fraction",
                    f"{out[key]} of {n} generations {what}; pass if at most {limit:.0%}",
                    {"count": out[key], "n": n},
                )
            )
        # judged on the generations that ended on their own: one cut by max_gen_toks may not have reached
        # its answer yet (a short eval.max_gen_toks cuts them all; then there is nothing to judge)
        ended = int(out.get("ended", n))
        if ended and "answers" in kinds:
            answered = ended - int(out.get("ended_no_answer", out["no_answer"]))
            checks.append(
                Check(
                    "health.answers",
                    float(answered),
                    None,
                    float(MIN_ANSWERED),
                    PASS if answered >= MIN_ANSWERED else FAIL,
                    "samples",
                    f"{answered} of {ended} generations that ended before max_gen_toks hold a number "
                    f"{answer_label} reads; pass if at least {MIN_ANSWERED}",
                    {"no_answer": out["no_answer"], "ended": ended, "n": n},
                )
            )
    return checks


def accuracy_pct(strict_match: float, flexible_extract: float, metric: str) -> float:
    """The number a GSM8K reference is compared with, in percent.

    Args:
        strict_match, flexible_extract: lm-eval exact_match fractions in [0, 1] (as in results.json).
        metric: "mean" (of the two filters, as TensorRT-LLM compares), "strict_match" or "flexible_extract".
    Raises:
        ValueError: a fraction outside [0, 1] (a percent passed by mistake) or an unknown metric.
    """
    for name, v in (("strict_match", strict_match), ("flexible_extract", flexible_extract)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(
                f"score {name} = {v} is not a fraction in [0, 1] (results.json stores fractions)"
            )
    if metric == "mean":
        return 100.0 * (strict_match + flexible_extract) / 2.0
    if metric == "strict_match":
        return 100.0 * strict_match
    if metric == "flexible_extract":
        return 100.0 * flexible_extract
    raise ValueError(f"unknown GSM8K metric {metric!r}; expected mean, strict_match or flexible_extract")


def threshold_binds(threshold: float | None) -> bool:
    """Whether a GSM8K pass threshold (percent) can fail a score: it is above 0 %. At or below 0 % (too few
    samples scored for the test to have power) every score passes: the threshold is no lower bound."""
    return threshold is not None and threshold > 0


def format_threshold(threshold: float | None, digits: int = 2) -> str:
    """A GSM8K pass threshold (percent) for a report: "-" (none), :data:`NO_LOWER_BOUND` when it is at or
    below 0 % (never a negative accuracy), else the number with `digits` decimals."""
    if threshold is None:
        return "-"
    return f"{threshold:.{digits}f}" if threshold_binds(threshold) else NO_LOWER_BOUND


def check_accuracy(
    strict_match: float,
    flexible_extract: float,
    n: int,
    reference: AccuracyReference | None,
    *,
    no_reference_note: str = "",
    section: str = TASKS[DEFAULT_TASK].section,
) -> Check:
    """The accuracy check of one run ("bernoulli") against `reference` (None or a placeholder row: status
    "no_reference"), named "<section>.<metric>".

    Args:
        strict_match, flexible_extract: the run's exact_match fractions in [0, 1].
        n: samples scored.
        reference: the matched row of the task's accuracy references; its metric picks the score, its
            sigma / alpha / beta override the defaults.
        no_reference_note: why there is no reference (shown in the report).
        section: the task row's results.json section (the check's name prefix).
    """
    metric = reference.metric if reference is not None else "mean"
    value = accuracy_pct(strict_match, flexible_extract, metric)
    base = {"metric": metric, "n": n, "strict_match": strict_match, "flexible_extract": flexible_extract}
    if reference is None or not reference.measured:
        note = no_reference_note or (
            f"reference row for {reference.model} ({reference.describe()}) is a placeholder, to be measured"
            if reference is not None
            else "no reference"
        )
        if reference is not None:
            base["reference_row"] = reference.to_dict()
        return Check(f"{section}.{metric}", value, None, None, NO_REFERENCE, "percent", note, base)
    test = accuracy_hypothesis_test(
        reference.accuracy,
        n,
        sigma=reference.sigma if reference.sigma is not None else DEFAULT_SIGMA,
        alpha=reference.alpha if reference.alpha is not None else DEFAULT_ALPHA,
        beta=reference.beta if reference.beta is not None else DEFAULT_BETA,
    )
    details = {
        **base,
        "sigma": test.sigma,
        "alpha": test.alpha,
        "beta": test.beta,
        "scale": test.scale,
        "theta": test.theta,
        "reference_num_samples": reference.num_samples,
        "reference_row": reference.to_dict(),
    }
    status = PASS if value >= test.threshold else FAIL
    note = (
        f"one-sided test: pass if score >= ref {test.reference:.2f} - {test.reference - test.threshold:.2f} "
        f"(n={n}); detects a drop of {test.theta:.2f} points with probability {1 - test.beta:.0%}"
    )
    if not threshold_binds(test.threshold):
        note += (f"; {NO_LOWER_BOUND} (n={n}: the threshold is at or below 0 %), so this check cannot fail: "
                 "score more samples")
    return Check(f"{section}.{metric}", value, test.reference, test.threshold, status, "percent", note,
                 details)


def check_floors(scores: dict[str, Any], task: EvalTask, *, no_reference_note: str = "") -> list[Check]:
    """The "floor" score checks of a task row: one per score, "<section>.<score key>", pass if the score (a
    fraction in [0, 1]) >= the row's floor; "no_reference" with `no_reference_note` when it is set (e.g.
    dummy weights). Raises ValueError on a score outside [0, 1]."""
    checks = []
    for key in task.filters:
        value = float(scores[key])
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"score {key} = {value} is not a fraction in [0, 1] (results.json stores "
                             "fractions)")
        floor = float(task.score_floors[key])
        details = {"n": int(scores["n"]), "score": key}
        if no_reference_note:
            checks.append(Check(f"{task.section}.{key}", value, None, None, NO_REFERENCE, "fraction",
                                no_reference_note, details))
            continue
        checks.append(Check(f"{task.section}.{key}", value, None, floor, PASS if value >= floor else FAIL,
                            "fraction", f"pass if {task.labels[key]} >= {floor:.4f}", details))
    return checks


def _score_checks(scores: dict[str, Any], task: EvalTask, reference: AccuracyReference | None,
                  note: str) -> list[Check]:
    """The score checks `task.score_check` declares, of the run's scores (results[task.section])."""
    if task.score_check == "floor":
        return check_floors(scores, task, no_reference_note=note)
    if set(task.filters) != {"strict_match", "flexible_extract"}:
        raise ValueError(f"task {task.name}: the bernoulli check compares the strict_match and "
                         f"flexible_extract accuracies; the row scores {sorted(task.filters)}")
    return [check_accuracy(scores["strict_match"], scores["flexible_extract"], int(scores["n"]), reference,
                           no_reference_note=note, section=task.section)]


def _health(results: dict[str, Any], task: EvalTask) -> list[Check]:
    """check_health of the results with the checks the task row declares."""
    label = task.labels.get(task.answer_filter, "") if task.answer_filter else ""
    kinds = tuple(k for k in task.health_checks if k != "answers" or task.answer_filter)
    return check_health(results.get("health"), kinds, label)


def check_acceptance(
    rate: float | None,
    length: float | None,
    reference: AcceptanceReference | None,
    *,
    no_reference_note: str = "",
) -> list[Check]:
    """Acceptance-rate and acceptance-length floors (pass if value >= floor).

    Args:
        rate: accepted drafts / drafted tokens, in [0, 1] (None: not measured).
        length: 1 + accepted drafts per request-step, in tokens (None: not measured).
        reference: the matched acceptance.yaml row, or None / a placeholder (checks get "no_reference").
    Returns:
        one Check per number the run has: "acceptance.rate", "acceptance.length". A row without a floor for
        one of them gives that check status "no_reference".
    Raises:
        ValueError: rate outside [0, 1] or length < 1.
    """
    if rate is not None and not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate {rate} is not a fraction in [0, 1]")
    if length is not None and length < 1.0:
        raise ValueError(f"acceptance length {length} < 1: every request-step commits at least one token")
    usable = reference is not None and reference.measured
    note = ""
    if not usable:
        note = no_reference_note or (
            f"acceptance row for {reference.entry} ({reference.describe()}) is a placeholder, to be measured"
            if reference is not None
            else "no reference"
        )
    row = {"reference_row": reference.to_dict()} if reference is not None else {}

    def floor_check(name: str, value: float, unit: str, ref: float | None, floor: float | None, key: str):
        if not usable or floor is None:
            why = note if not usable else f"row has no {key}"
            return Check(name, value, None, None, NO_REFERENCE, unit, why, row)
        status = PASS if value >= floor else FAIL
        text = f"pass if {name.split('.')[1]} >= {floor:.4f}" + (
            f" (reference {ref})" if ref is not None else ""
        )
        return Check(name, value, ref, floor, status, unit, text, row)

    checks = []
    if rate is not None:
        floor = reference.acceptance_rate_floor if usable else None
        checks.append(floor_check("acceptance.rate", rate, "fraction", None, floor, "acceptance_rate_floor"))
    if length is not None:
        ref = reference.acceptance_length_reference if usable else None
        floor = reference.acceptance_length_floor if usable else None
        checks.append(floor_check("acceptance.length", length, "tokens", ref, floor, "acceptance_length"))
    return checks


def evaluate_verdict(
    results: dict[str, Any],
    *,
    model_key: str | None,
    entry: str,
    dtype: Any,
    quant: Any = "none",
    kv_cache_quant: Any = "none",
    spec_dec: Any = "none",
    draft_len: int = 0,
    state: dict[str, Any] | None = None,
    require_reference: bool = True,
    accuracy_baselines: str | Path | None = None,
    acceptance_baselines: str | Path | None = None,
    task: EvalTask = TASKS[DEFAULT_TASK],
    dummy: bool = False,
) -> Verdict:
    """The verdict of a results dict (docs/results_schema.md) against the baseline files of its task.

    Args:
        results: needs the task's section (`task.section`: {<score key>: fraction, ..., n}); `acceptance`
            {rate, length, ...} is checked when present, not None, and spec_dec is not "none"; `task`
            {num_fewshot, max_gen_toks} (the run's protocol) when a reference row is looked up: a row
            measured under another protocol does not judge the run (its checks are "no_reference", the
            note names the settings).
        model_key: key in the task's baseline files (e.g. "super_v3"); None: the entry has no
            `baseline` (registry entry ``baseline: null``), so no row can judge it (a BaselineError saying so
            with require_reference=True, else "no_reference" checks that say so).
        entry: registry entry name (reported only).
        dtype, quant, kv_cache_quant, spec_dec: the run's GSM8K matching columns (normalised).
        draft_len: K, used to find the acceptance row.
        state: the run's state columns (registry.baselines.STATE_COLUMNS, e.g. {"ssm_state_dtype":
            "bfloat16"}); a row judges the run only if it holds for them. None: the defaults (float32 state).
        require_reference: when False, a missing row becomes a "no_reference" check instead of an error.
        accuracy_baselines, acceptance_baselines: file overrides (tests).
        task: the evals.task.TASKS row that ran: its score_check and health_checks are the checks; its
            `baselines` file holds the accuracy references of a "bernoulli" check; without
            `acceptance_baselines` (no floor measured on its prompts) the acceptance checks are reported as
            "no_reference" (not judged), whatever require_reference says.
        dummy: the weights were random (model.load_format=dummy): no accuracy can be judged. No baseline is
            read; the accuracy, acceptance and text-health checks are "no_reference" with
            :data:`DUMMY_NOTE`, and only ``health.finite`` judges (random weights must still compute finite
            values through every layer).
    Raises:
        BaselineError: a missing row with require_reference=True (message lists the rows and the fix).
        ValueError: malformed results (e.g. percent where a fraction belongs, no task protocol where a row
            is looked up).
    """
    scores = results.get(task.section)
    keys = [*task.filters, "n"]
    if not isinstance(scores, dict) or not set(keys) <= set(scores):
        raise ValueError(f"results[{task.section!r}] must hold {', '.join(keys[:-1])} and {keys[-1]}")
    if dummy:
        return _dummy_verdict(results, spec_dec, task)
    checks: list[Check] = []
    no_key = BaselineError(
        f"entry {entry} has no `baseline` key (baseline: null), so no reference row judges it",
        "set baseline: <model key of the task's baseline files> in the entry once rows are measured, or run "
        "with verdict.require_reference=false",
    ) if not model_key else None
    try:
        if task.score_check != "bernoulli":  # judged by the row's own floors: no reference row to find
            ref, note = None, ""
        else:
            if no_key is not None:
                raise no_key
            path = accuracy_baselines if accuracy_baselines is not None else task.baselines_path
            proto = reference_protocol(model_key, path)  # another protocol: no row is needed, none judges
            note = protocol_mismatch(proto, _protocol_of(results), path, model_key) if proto else ""
            ref = None if note else find_accuracy_reference(model_key, dtype, quant, kv_cache_quant, spec_dec,
                                                            state=state, path=path)
    except BaselineError as e:
        if require_reference:
            raise
        ref, note = None, e.problem
    checks.extend(_score_checks(scores, task, ref, note))

    checks.extend(_health(results, task))

    acceptance = results.get("acceptance")
    spec_on = str(spec_dec).strip().lower() not in ("none", "", "false")
    if acceptance and spec_on:
        acceptance_path = acceptance_baselines if acceptance_baselines is not None else \
            task.acceptance_baselines_path
        if acceptance_path is None:
            aref, note = None, (f"no acceptance floor is measured on {task.name}'s prompts (the floors "
                                "depend on the text the model writes): not judged")
        else:
            try:
                if no_key is not None:
                    raise no_key
                proto = reference_protocol(model_key, acceptance_path, acceptance=True)
                note = protocol_mismatch(proto, _protocol_of(results), acceptance_path, model_key) if proto \
                    else ""
                aref = None if note else find_acceptance_reference(model_key, quant, draft_len, state=state,
                                                                   path=acceptance_path)
            except BaselineError as e:
                if require_reference:
                    raise
                aref, note = None, e.problem
        checks.extend(
            check_acceptance(acceptance.get("rate"), acceptance.get("length"), aref, no_reference_note=note)
        )
    return Verdict(checks)


def _protocol_of(results: dict[str, Any]):
    """The run's registry.baselines.Protocol from results["task"]; ValueError when it is not recorded."""
    task = results.get("task")
    if not isinstance(task, dict):
        raise ValueError("results['task'] must record num_fewshot and max_gen_toks (the protocol a reference "
                         "row is compared under)")
    return run_protocol(task.get("num_fewshot"), task.get("max_gen_toks"))


def _dummy_verdict(results: dict[str, Any], spec_dec: Any, task: EvalTask) -> Verdict:
    """evaluate_verdict of a run over random weights: every check but ``health.finite`` is not judged."""
    checks = _score_checks(results[task.section], task, None, DUMMY_NOTE)
    for c in _health(results, task):
        if c.name != "health.finite":
            c = Check(c.name, c.value, None, None, NO_REFERENCE, c.unit, DUMMY_NOTE, c.details)
        checks.append(c)
    acceptance = results.get("acceptance")
    if acceptance and str(spec_dec).strip().lower() not in ("none", "", "false"):
        checks.extend(check_acceptance(acceptance.get("rate"), acceptance.get("length"), None,
                                       no_reference_note=DUMMY_NOTE))
    return Verdict(checks)
