"""Paired comparison of two runs over the same GSM8K samples (e.g. SSM replay vs rewind).

Both runs answered the same questions, so the comparison is paired: per sample, did the two arms agree on
correctness, and where did their generated tokens first differ? Accuracy differences are tested with the
exact McNemar test (two-sided binomial test on the discordant pairs, scipy.stats.binomtest): under "no
difference" a sample that one arm gets right and the other wrong is equally likely to go either way. Greedy
replay and rewind should emit identical tokens up to kernel numerics, so the first-divergence positions say
more than the p-value: a bug shows up as early divergence in many samples. Acceptance statistics are
aggregates per run (no per-sample pairing), so they are reported as differences, not tested.

Input per-sample records are the lines of samples.jsonl (docs/results_schema.md): an id, a correctness flag
per filter and the generated token ids.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

from evals.outdir import GENERATIONS_FILE, SAMPLES_FILE, write_atomic
from evals.results import RESULTS_FILE, load_format, read_results
from evals.verdict import DUMMY_NOTE, FAIL, NO_REFERENCE, PASS, Check
from registry.errors import UserError
from registry.schema import LoadFormat

FILTERS = ("strict_match", "flexible_extract")
# compare=replay: the arms' sub-folders of out_dir (ssm_replay false, true)
COMPARE_ARMS = ("rewind", "replay")
COMPARISON_FILE = "comparison.json"
# results.json `task` settings that change what is generated or scored: runs differing in one are compared
# with a warning (the difference, not the code, may explain the flips)
EVAL_SETTINGS = ("task", "version", "num_fewshot", "fewshot_seed", "max_gen_toks", "lm_eval_version")


COMPARE_FIX = "compare the output folders of two finished runs over the same samples"


class ComparisonError(UserError):
    """The two runs cannot be compared (different sample sets, missing fields): a registry.errors.UserError,
    so the CLI prints it as `error:` / `fix:` lines with status 2; ``fix`` defaults to COMPARE_FIX."""

    def __init__(self, problem: str, fix: str = COMPARE_FIX):
        super().__init__(problem, fix)


def _id_order(sample_id: Any) -> tuple[bool, Any]:
    """Sort key of sample ids: numbers in numeric order, then strings."""
    return isinstance(sample_id, str), sample_id


def load_samples_jsonl(path: str | Path, *, id_key: str = "doc_id") -> dict[Any, dict[str, Any]]:
    """Read samples.jsonl into {sample id: record}.

    Raises:
        ComparisonError: a line that is not a JSON object (a file cut short) or has no `id_key`, or an id that
            appears twice (a resumed run that wrote a sample twice must be de-duplicated by its writer).
    """
    out: dict[Any, dict[str, Any]] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = _json_line(line, path, lineno)
            if not isinstance(rec, dict):
                raise ComparisonError(f"{path}:{lineno}: not a JSON object")
            if id_key not in rec:
                raise ComparisonError(f"{path}:{lineno}: record has no {id_key!r} field")
            if rec[id_key] in out:
                raise ComparisonError(f"{path}:{lineno}: sample {rec[id_key]!r} appears twice")
            out[rec[id_key]] = rec
    return out


def _json_line(line: str, path: str | Path, lineno: int) -> Any:
    """One line of a .jsonl file, parsed; ComparisonError naming file and line when it is not JSON."""
    try:
        return json.loads(line)
    except ValueError as e:
        raise ComparisonError(f"{path}:{lineno}: not JSON ({e}); the file was cut short or edited",
                              "restore the file, or pass another finished run's folder") from None


def _by_id(samples: Mapping[Any, Mapping] | Iterable[Mapping], id_key: str, arm: str) -> dict[Any, Mapping]:
    if isinstance(samples, Mapping):
        return dict(samples)
    out: dict[Any, Mapping] = {}
    for rec in samples:
        if id_key not in rec:
            raise ComparisonError(f"arm {arm}: a record has no {id_key!r} field (keys: {sorted(rec)})")
        if rec[id_key] in out:
            raise ComparisonError(f"arm {arm}: sample {rec[id_key]!r} appears twice")
        out[rec[id_key]] = rec
    return out


def first_divergence(tokens_a: Sequence[int], tokens_b: Sequence[int]) -> int | None:
    """Index of the first generated token where the two sequences differ.

    A sequence that is a strict prefix of the other diverges at its length (one arm stopped, the other did
    not). Identical sequences give None.
    """
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        if a != b:
            return i
    if len(tokens_a) != len(tokens_b):
        return min(len(tokens_a), len(tokens_b))
    return None


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Exact two-sided McNemar p-value: binomtest(a_only, a_only + b_only, 0.5).

    Args:
        a_only: samples correct in arm A only; b_only: correct in arm B only (the discordant pairs).
    Returns:
        p in [0, 1]; 1.0 when there are no discordant pairs (nothing contradicts "no difference").
    """
    if a_only < 0 or b_only < 0:
        raise ValueError(f"discordant counts must be >= 0, got {a_only}, {b_only}")
    if a_only + b_only == 0:
        return 1.0
    return float(binomtest(a_only, a_only + b_only, 0.5, alternative="two-sided").pvalue)


@dataclass
class FilterComparison:
    """Paired correctness under one lm-eval filter. Accuracies in percent; a_only: right in A, wrong in B."""

    filter: str
    n: int
    both_correct: int
    both_wrong: int
    a_only: int
    b_only: int
    accuracy_a: float
    accuracy_b: float
    delta: float  # accuracy_b - accuracy_a, percent points
    agreement: float  # fraction of samples where both arms are right or both wrong
    mcnemar_p: float


@dataclass
class DivergenceSummary:
    """Where generated tokens first differ. Indices count generated tokens (0 = first generated token)."""

    n: int
    num_identical: int
    num_diverged: int
    min_first_divergence: int | None
    median_first_divergence: float | None
    per_sample: dict[str, int | None] = field(default_factory=dict)  # sample id (as str) -> index or None


@dataclass
class AcceptanceDiff:
    """Acceptance of both arms and B - A. Rates are fractions, lengths tokens per request-step.

    per_position_* cover positions 1..K of each arm; the delta covers the positions both arms have.
    """

    rate_a: float | None
    rate_b: float | None
    rate_delta: float | None
    length_a: float | None
    length_b: float | None
    length_delta: float | None
    per_position_a: list[float]
    per_position_b: list[float]
    per_position_delta: list[float]
    num_accepted_hist_a: list[int]
    num_accepted_hist_b: list[int]
    draft_len_a: int
    draft_len_b: int


@dataclass
class Comparison:
    """Everything compare_runs finds; to_dict() is the `comparison` section of results.json."""

    label_a: str
    label_b: str
    n: int
    filters: dict[str, FilterComparison]
    divergence: DivergenceSummary | None
    acceptance: AcceptanceDiff | None
    # both runs' config.load_format (evals.results.load_format); "dummy": random weights, nothing is judged
    load_format: str = "auto"
    warnings: list[str] = field(default_factory=list)  # eval settings that differ (compare_run_dirs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label_a": self.label_a,
            "label_b": self.label_b,
            "n": self.n,
            "filters": {k: asdict(v) for k, v in self.filters.items()},
            "divergence": asdict(self.divergence) if self.divergence is not None else None,
            "acceptance": asdict(self.acceptance) if self.acceptance is not None else None,
            "load_format": self.load_format,
            "warnings": list(self.warnings),
        }


def _correct(rec: Mapping, key: str, sid: Any, arm: str) -> bool:
    if key not in rec:
        raise ComparisonError(f"arm {arm}: sample {sid!r} has no {key!r} field (keys: {sorted(rec)})")
    v = rec[key]
    if v in (0, 1) or isinstance(v, bool):  # lm-eval writes exact_match as 0.0 / 1.0
        return bool(v)
    raise ComparisonError(f"arm {arm}: sample {sid!r} field {key!r} = {v!r} is not 0/1/true/false")


def _acceptance_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> AcceptanceDiff:
    def sub(x, y):
        return None if x is None or y is None else y - x

    pa = [float(x) for x in a.get("per_position") or []]
    pb = [float(x) for x in b.get("per_position") or []]
    return AcceptanceDiff(
        rate_a=a.get("rate"),
        rate_b=b.get("rate"),
        rate_delta=sub(a.get("rate"), b.get("rate")),
        length_a=a.get("length"),
        length_b=b.get("length"),
        length_delta=sub(a.get("length"), b.get("length")),
        per_position_a=pa,
        per_position_b=pb,
        per_position_delta=[y - x for x, y in zip(pa, pb)],
        num_accepted_hist_a=[int(x) for x in a.get("num_accepted_hist") or []],
        num_accepted_hist_b=[int(x) for x in b.get("num_accepted_hist") or []],
        draft_len_a=int(a.get("draft_len", len(pa))),
        draft_len_b=int(b.get("draft_len", len(pb))),
    )


def compare_runs(
    samples_a: Mapping[Any, Mapping] | Iterable[Mapping],
    samples_b: Mapping[Any, Mapping] | Iterable[Mapping],
    *,
    acceptance_a: Mapping[str, Any] | None = None,
    acceptance_b: Mapping[str, Any] | None = None,
    label_a: str = "a",
    label_b: str = "b",
    id_key: str = "doc_id",
    token_key: str = "tokens",
    filters: Sequence[str] = FILTERS,
) -> Comparison:
    """Compare two runs sample by sample.

    Args:
        samples_a, samples_b: {sample id: record} or a list of records carrying `id_key`. A record needs a
            0/1 (or bool) field per filter and, for the divergence summary, the generated token ids under
            `token_key` (list[int]; if no record of either arm has it, divergence is None).
        acceptance_a, acceptance_b: the runs' `acceptance` sections (rate, length, per_position,
            num_accepted_hist, draft_len); both or neither.
        label_a, label_b: arm names for reports (e.g. "rewind", "replay").
    Returns:
        Comparison; its to_dict() is JSON-serialisable.
    Raises:
        ComparisonError: the arms cover different sample ids (the message counts and shows a few of each
            side's extras), no samples, a missing / non-0/1 correctness field, tokens present in one arm only.
    """
    a = _by_id(samples_a, id_key, label_a)
    b = _by_id(samples_b, id_key, label_b)
    if set(a) != set(b):
        extras = {label: sorted(ids, key=_id_order) for label, ids in ((label_a, set(a) - set(b)),
                                                                         (label_b, set(b) - set(a)))}
        raise ComparisonError(
            f"the runs scored different samples ({len(a)} in {label_a}, {len(b)} in {label_b}): " + ", ".join(
                f"{len(ids)} only in {label}" + (f" (e.g. {ids[:5]})" if ids else "")
                for label, ids in extras.items()),
            "compare runs with the same eval.limit and data, or finish the interrupted run (resume=true) "
            "first")
    if not a:
        raise ComparisonError("both runs are empty: nothing to compare")
    ids = sorted(a, key=_id_order)
    n = len(ids)

    results: dict[str, FilterComparison] = {}
    for key in filters:
        counts = {(True, True): 0, (False, False): 0, (True, False): 0, (False, True): 0}
        for sid in ids:
            counts[(_correct(a[sid], key, sid, label_a), _correct(b[sid], key, sid, label_b))] += 1
        a_only, b_only = counts[(True, False)], counts[(False, True)]
        acc_a = 100.0 * (counts[(True, True)] + a_only) / n
        acc_b = 100.0 * (counts[(True, True)] + b_only) / n
        results[key] = FilterComparison(
            filter=key,
            n=n,
            both_correct=counts[(True, True)],
            both_wrong=counts[(False, False)],
            a_only=a_only,
            b_only=b_only,
            accuracy_a=acc_a,
            accuracy_b=acc_b,
            delta=acc_b - acc_a,
            agreement=(n - a_only - b_only) / n,
            mcnemar_p=mcnemar_exact(a_only, b_only),
        )

    has_a = [token_key in a[s] for s in ids]
    has_b = [token_key in b[s] for s in ids]
    divergence = None
    if any(has_a) or any(has_b):
        if not (all(has_a) and all(has_b)):
            raise ComparisonError(
                f"generated token ids ({token_key!r}) are missing for {has_a.count(False)} samples of "
                f"{label_a} and {has_b.count(False)} of {label_b}; both runs must record them"
            )
        per_sample = {str(s): first_divergence(a[s][token_key], b[s][token_key]) for s in ids}
        firsts = [d for d in per_sample.values() if d is not None]
        divergence = DivergenceSummary(
            n=n,
            num_identical=n - len(firsts),
            num_diverged=len(firsts),
            min_first_divergence=min(firsts) if firsts else None,
            median_first_divergence=float(statistics.median(firsts)) if firsts else None,
            per_sample=per_sample,
        )

    if (acceptance_a is None) != (acceptance_b is None):
        raise ComparisonError("acceptance stats given for one arm only; pass both or neither")
    acceptance = _acceptance_diff(acceptance_a, acceptance_b) if acceptance_a is not None else None
    return Comparison(label_a, label_b, n, results, divergence, acceptance)


def load_run_samples(run_dir: str | Path, *, id_key: str = "doc_id") -> dict[Any, dict[str, Any]]:
    """A run folder's per-sample records in compare_runs' form: {id: {id_key, <filter>: bool, "tokens"}}.

    Reads run_dir/samples.jsonl as the evaluator writes it (correctness under `correct: {filter: bool}`) or in
    the flat form (`<filter>` at top level), and joins the generated token ids from run_dir/generations.jsonl
    (`generated_ids`, matched on the sample's `request_key`) when the record carries no `tokens` itself.

    Raises:
        ComparisonError: samples.jsonl missing or malformed (see load_samples_jsonl), a line of
            generations.jsonl that is not JSON, or a sample whose request_key has no line there.
    """
    run_dir = Path(run_dir)
    samples = load_samples_jsonl(run_dir / SAMPLES_FILE, id_key=id_key)
    generations: dict[str, list[int]] = {}
    gen_path = run_dir / GENERATIONS_FILE
    if gen_path.exists():
        for lineno, line in enumerate(gen_path.read_text().splitlines(), 1):
            rec = _json_line(line, gen_path, lineno) if line.strip() else None
            if isinstance(rec, dict) and "key" in rec and "generated_ids" in rec:
                generations[rec["key"]] = rec["generated_ids"]  # later lines win, as in the resume store
    out = {}
    for sid, rec in samples.items():
        flat = dict(rec)
        for name, value in (rec.get("correct") or {}).items():
            flat.setdefault(name, value)
        if "tokens" not in flat and gen_path.exists() and "request_key" in rec:
            if rec["request_key"] not in generations:
                raise ComparisonError(
                    f"{gen_path}: no generation for sample {sid!r} (request_key {rec['request_key']})"
                )
            flat["tokens"] = generations[rec["request_key"]]
        out[sid] = flat
    return out


def compare_run_dirs(
    dir_a: str | Path,
    dir_b: str | Path,
    *,
    label_a: str | None = None,
    label_b: str | None = None,
    id_key: str = "doc_id",
) -> Comparison:
    """compare_runs on two run output folders (results.json + samples.jsonl each, docs/results_schema.md).

    Samples are read by load_run_samples (token ids from generations.jsonl when present). Labels default to
    the folder names. Acceptance is compared when both results.json have a non-null `acceptance` section.
    The Comparison's load_format is the runs' (config.load_format); its warnings name each EVAL_SETTINGS
    entry of results.json `task` (e.g. max_gen_toks) whose values differ, runs of two registry entries, and
    one folder passed twice.

    Raises:
        ComparisonError: a missing samples.jsonl, runs of different load_format (random weights against
            real ones: nothing to compare), or the errors of compare_runs.
        UserError: a results.json that is missing or not JSON (evals.results.read_results).
    """
    dirs = {"a": Path(dir_a), "b": Path(dir_b)}
    results = {k: read_results(d) for k, d in dirs.items()}  # missing or not JSON: its UserError
    for d in dirs.values():
        if not (d / SAMPLES_FILE).exists():
            arms = [d / arm for arm in COMPARE_ARMS if (d / arm / SAMPLES_FILE).is_file()]
            fix = (f"pass one of its arms, {' or '.join(map(str, arms))} (a compare=replay run)" if arms
                   else f"pass the output folder of a finished run (it holds {SAMPLES_FILE})")
            raise ComparisonError(f"{d / SAMPLES_FILE} does not exist", fix)
    formats = {k: load_format(r) for k, r in results.items()}
    if formats["a"] != formats["b"]:
        raise ComparisonError(
            f"{dirs['a']} ran model.load_format={formats['a']} and {dirs['b']} model.load_format="
            f"{formats['b']}: random (dummy) weights cannot be compared with a checkpoint's",
            "compare runs of the same model.load_format")
    tasks = {k: r.get("task") or {} for k, r in results.items()}
    warnings = [f"{key} differs: {tasks['a'][key]!r} in {dirs['a']}, {tasks['b'][key]!r} in {dirs['b']} "
                "(differences may come from the settings)" for key in EVAL_SETTINGS
                if key in tasks["a"] and key in tasks["b"] and tasks["a"][key] != tasks["b"][key]]
    entries = {k: r.get("entry") for k, r in results.items()}
    if None not in entries.values() and entries["a"] != entries["b"]:  # two models: a paired test of what?
        warnings.insert(0, f"the runs are of different registry entries: {entries['a']!r} in {dirs['a']}, "
                           f"{entries['b']!r} in {dirs['b']}")
    if dirs["a"].resolve() == dirs["b"].resolve():
        warnings.insert(0, f"both runs are the same folder, {dirs['a']}")
    acc_a, acc_b = results["a"].get("acceptance"), results["b"].get("acceptance")
    both = acc_a is not None and acc_b is not None
    comparison = compare_runs(
        load_run_samples(dirs["a"], id_key=id_key),
        load_run_samples(dirs["b"], id_key=id_key),
        acceptance_a=acc_a if both else None,
        acceptance_b=acc_b if both else None,
        label_a=label_a or dirs["a"].name,
        label_b=label_b or dirs["b"].name,
        id_key=id_key,
    )
    comparison.load_format, comparison.warnings = formats["a"], warnings
    return comparison


def comparison_checks(comparison: Comparison, *, exact: bool, alpha: float = 0.05) -> list[Check]:
    """Pass/fail checks of a paired comparison, in the verdict's Check form (evals.verdict).

    exact=True (two arms that must emit identical tokens, e.g. SSM replay vs rewind in float32): per filter,
    "comparison.<filter>.flipped" passes only with 0 samples flipped either way (a_only + b_only); and
    "comparison.diverged" passes only when no sample's generated tokens differ (needs token ids; a
    "no_reference" check without them); and "comparison.acceptance" (when both arms have acceptance data)
    passes only when their num_accepted_tokens histograms are equal (the same states give the same drafts).
    exact=False (arms that may differ by rounding, or two nights): per filter,
    "comparison.<filter>.mcnemar_p" passes when the exact McNemar p-value is >= alpha (no significant
    accuracy difference); flipped counts are reported in the note.
    A comparison of dummy-weight runs (load_format "dummy") judges nothing: every check is "no_reference"
    (DUMMY_NOTE; random weights accept no drafts, so replay and rewind never differ in what they run).
    """
    checks = []
    for name, f in comparison.filters.items():
        counts = {"a_only": f.a_only, "b_only": f.b_only}
        flipped = f.a_only + f.b_only
        note = (f"{f.a_only} right in {comparison.label_a} only, {f.b_only} right in {comparison.label_b} "
                f"only, of {f.n}; McNemar exact p = {f.mcnemar_p:.4g}")
        if exact:
            status = PASS if flipped == 0 else FAIL
            checks.append(Check(f"comparison.{name}.flipped", float(flipped), 0.0, 0.0, status, "samples",
                                note + "; pass if no sample flipped", counts))
        else:
            status = PASS if f.mcnemar_p >= alpha else FAIL
            checks.append(Check(f"comparison.{name}.mcnemar_p", f.mcnemar_p, None, alpha, status, "p-value",
                                note + f"; pass if p >= {alpha}", counts))
    if exact:
        div = comparison.divergence
        if div is None:
            checks.append(Check("comparison.diverged", None, None, None, NO_REFERENCE, "samples",
                                "no generated token ids recorded: divergence not checked"))
        else:
            where = (f"; first divergence at token {div.min_first_divergence}"
                     if div.min_first_divergence is not None else "")
            note = f"{div.num_diverged} of {div.n} samples' generated tokens differ{where}; pass if none do"
            status = PASS if div.num_diverged == 0 else FAIL
            checks.append(Check("comparison.diverged", float(div.num_diverged), 0.0, 0.0, status, "samples",
                                note, {"min_first_divergence": div.min_first_divergence}))
        acc = comparison.acceptance
        if acc is not None:
            # the same committed states give the same drafts: equal acceptance, request-step by request-step
            same = acc.num_accepted_hist_a == acc.num_accepted_hist_b
            delta = abs(acc.rate_delta) if acc.rate_delta is not None else 0.0
            checks.append(Check(
                "comparison.acceptance", delta, 0.0, 0.0, PASS if same else FAIL, "fraction",
                f"acceptance rate {_pct(acc.rate_a)} in {comparison.label_a}, {_pct(acc.rate_b)} in "
                f"{comparison.label_b}; pass if the num_accepted_tokens histograms are equal",
                {"num_accepted_hist_a": acc.num_accepted_hist_a,
                 "num_accepted_hist_b": acc.num_accepted_hist_b}))
    if comparison.load_format == LoadFormat.dummy.value:
        checks = [Check(c.name, c.value, None, None, NO_REFERENCE, c.unit, f"{DUMMY_NOTE}; {c.note}",
                        c.details) for c in checks]
    return checks


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def divergence_line(div: DivergenceSummary) -> str:
    """`tokens: 1319 of 1319 identical, no divergence` (or where the first one is)."""
    where = (
        "no divergence"
        if div.min_first_divergence is None
        else f"first divergence at token {div.min_first_divergence}"
    )
    return f"tokens: {div.num_identical} of {div.n} identical, {where}"


def acceptance_line(acc: AcceptanceDiff, label_a: str, label_b: str) -> str:
    """`acceptance: rate 53.87% -> 53.87% (+0.00 points), length 2.62 -> 2.62 (+0.000)`."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    rate_d = "" if acc.rate_delta is None else f" ({100 * acc.rate_delta:+.2f} points)"
    len_d = "" if acc.length_delta is None else f" ({acc.length_delta:+.3f})"
    return (
        f"acceptance ({label_a} -> {label_b}): rate {_pct(acc.rate_a)} -> {_pct(acc.rate_b)}{rate_d}, "
        f"length {num(acc.length_a, '.3f')} -> {num(acc.length_b, '.3f')}{len_d}"
    )


def compare_arms(out_dir: Path, rewind_verdict: dict[str, Any], *, exact: bool) -> tuple[dict[str, Any],
                                                                                        list[Check]]:
    """The comparison of a compare=replay run: its rewind and replay arm folders (COMPARE_ARMS) under out_dir.

    Writes out_dir/comparison.json. Returns the `comparison` section of the top-level results.json and the
    checks its verdict adds to the replay arm's own: the rewind arm's checks (rewind_verdict, names prefixed
    "rewind.") and the comparison's (comparison_checks with `exact`).
    Raises ComparisonError when the arms cannot be compared (different samples, missing files).
    """
    comparison = compare_run_dirs(out_dir / COMPARE_ARMS[0], out_dir / COMPARE_ARMS[1])
    checks = comparison_checks(comparison, exact=exact)
    section = {**comparison.to_dict(), "exact": exact, "checks": [c.to_dict() for c in checks]}
    write_atomic(out_dir / COMPARISON_FILE, json.dumps(section, indent=2) + "\n")
    rewind_checks = [
        Check(**{**{k: v for k, v in c.items() if k != "passed"}, "name": f"{COMPARE_ARMS[0]}.{c['name']}"})
        for c in rewind_verdict["checks"]
    ]
    return section, rewind_checks + checks


def combine_arms(replay: dict[str, Any], rewind: dict[str, Any], comparison: dict[str, Any]
                 ) -> dict[str, Any]:
    """The top-level results of a compare=replay run (without its verdict): the replay arm's, with the
    `comparison` section; its wall time covers both arms (per-arm timings stay in the arms' results.json)."""
    results = {**replay, "comparison": comparison, "verdict": None}
    wall = replay["timings"]["wall_seconds"] + rewind["timings"]["wall_seconds"]
    results["timings"] = {**replay["timings"], "wall_seconds": wall, "scope": "both arms"}
    return results


def check_out_file(path: Path) -> None:
    """Refuse an --out the comparison cannot or must not be written to: a folder, a path whose folder does not
    exist, or a file a run folder already holds (its results.json, samples, generations, comparison: writing
    there would replace that run's own record). Raises UserError."""
    fix = "pass --out a new file path, e.g. a comparison.json in a folder of its own"
    if path.is_dir():
        raise UserError(f"--out {path} is a folder", fix)
    if not path.parent.is_dir():
        raise UserError(f"--out {path}: folder {path.parent} does not exist", fix)
    run_files = (GENERATIONS_FILE, SAMPLES_FILE, RESULTS_FILE)
    if path.exists() and any((path.parent / name).is_file() for name in run_files):
        raise UserError(f"--out {path} would replace a file of the run in {path.parent}", fix)


def main(argv: list[str] | None = None) -> int:
    """`python -m evals.compare DIR_A DIR_B [--exact]`: compare two finished runs; 1 if a check fails."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m evals.compare", description=main.__doc__)
    parser.add_argument("dir_a", type=Path, help="output folder of run A (e.g. last night's, or rewind)")
    parser.add_argument("dir_b", type=Path, help="output folder of run B (e.g. tonight's, or replay)")
    parser.add_argument("--exact", action="store_true",
                        help="require identical correctness and tokens (replay vs rewind in float32)")
    parser.add_argument("--out", type=Path, default=None, help="write the comparison JSON here")
    args = parser.parse_args(argv)
    try:
        if args.out is not None:
            check_out_file(args.out)
        comparison = compare_run_dirs(args.dir_a, args.dir_b)
    except UserError as e:  # ComparisonError, or a results.json that cannot be read (evals.results)
        print(e.format(), file=sys.stderr)
        return 2
    for warning in comparison.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    checks = comparison_checks(comparison, exact=args.exact)
    data = {**comparison.to_dict(), "exact": args.exact, "checks": [c.to_dict() for c in checks]}
    if args.out is not None:
        try:
            write_atomic(args.out, json.dumps(data, indent=2) + "\n")
        except UserError as e:
            refused = UserError(e.problem, "pass --out a file path in a writable folder")
            print(refused.format(), file=sys.stderr)
            return 2
    for f in comparison.filters.values():
        print(
            f"{f.filter}: {f.accuracy_a:.2f}% -> {f.accuracy_b:.2f}% ({f.delta:+.2f}), "
            f"flipped {f.a_only} / {f.b_only}, McNemar p = {f.mcnemar_p:.4g}"
        )
    if comparison.divergence is not None:
        print(divergence_line(comparison.divergence))
    if comparison.acceptance is not None:
        print(acceptance_line(comparison.acceptance, comparison.label_a, comparison.label_b))
    for c in checks:
        print(f"{c.name}: {c.status}")
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
