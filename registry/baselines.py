"""Reference numbers a run is judged against: GSM8K accuracies and MTP acceptance floors.

The data lives in registry/baselines/{gsm8k,acceptance}.yaml (format: registry/baselines/README.md).
This module loads and validates those files and finds the row that applies to a run; it computes nothing
(the pass/fail arithmetic is in evals.verdict). It lives in the registry because the files are registry data:
`python -m registry validate` checks with these same lookups that every entry's rows exist. Errors are
`BaselineError`, a registry.errors.UserError naming the file, the key and the allowed values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from registry.errors import UserError
from registry.schema import BASELINES_DIR, REPO_ROOT, DType, KVCacheQuant, Quant, SpecAlgorithm
from registry.yamlfile import RegistryYAMLError
from registry.yamlfile import load as load_yaml

GSM8K_BASELINES = BASELINES_DIR / "gsm8k.yaml"
ACCEPTANCE_BASELINES = BASELINES_DIR / "acceptance.yaml"

SCHEMA_VERSION = 1

# Allowed values of the matching columns: the registry schema's. Lookups normalise case and the aliases below.
DTYPES = tuple(v.value for v in DType)
QUANTS = tuple(v.value for v in Quant)
KV_CACHE_QUANTS = tuple(v.value for v in KVCacheQuant)
SPEC_DECS = tuple(v.value for v in SpecAlgorithm)
# Which GSM8K number a reference is: lm-eval exact_match under one filter, or the mean of the two filters
# (TensorRT-LLM's accuracy suite compares the mean of every non-stderr metric of the task).
METRICS = ("mean", "strict_match", "flexible_extract")

_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "": "none",
    "null": "none",
    "false": "none",
    "off": "none",
    "no": "none",
}

# Columns about the recurrent state a row holds for, beyond the matching columns: the value a run must have
# for the row to apply. A row may list several values (`ssm_state_dtype: [float32, bfloat16]`) or omit the
# column (then only the default applies: rows are float32-state references unless they say otherwise). A
# future state setting (e.g. stochastic rounding of a 16-bit state) is one more entry here and in
# registry.resolve.ResolvedRun.baseline_state.
STATE_COLUMNS: dict[str, tuple[tuple[str, ...], str]] = {
    "ssm_state_dtype": (DTYPES, "float32"),
}

_GSM8K_ROW_KEYS = {
    *STATE_COLUMNS,
    "dtype",
    "quant",
    "kv_cache_quant",
    "spec_dec",
    "accuracy",
    "num_samples",
    "measured",
    "sigma",
    "alpha",
    "beta",
    "note",
}
_GSM8K_MODEL_KEYS = {"description", "source", "metric", "protocol", "rows"}
_ACC_ROW_KEYS = {"quant", "draft_len", "measured", "acceptance_rate_floor", "acceptance_length", "note",
                 *STATE_COLUMNS}
_ACC_LENGTH_KEYS = {"reference", "floor", "rel_tolerance"}
_ACC_ENTRY_KEYS = {"description", "protocol", "rows"}


class BaselineError(UserError):
    """A baseline file is malformed, or no reference row applies to a run (problem names the file and key)."""


def normalize(value: Any, allowed: tuple[str, ...], what: str) -> str:
    """Canonical spelling of a matching-column value (case-insensitive, bf16 -> bfloat16, None -> "none").

    Raises:
        BaselineError: the value is not one of `allowed` after normalisation.
    """
    text = "none" if value is None or value is False else str(value).strip().lower()
    text = _ALIASES.get(text, text)
    if text not in allowed:
        raise BaselineError(
            f"{what} {value!r} is not one of {list(allowed)}",
            f"use one of {list(allowed)} (aliases: bf16, fp16, fp32; null means none)",
        )
    return text


def _state_columns(row: dict, where: str) -> dict[str, tuple[str, ...]]:
    """The STATE_COLUMNS of a row: {column: the values it holds for} (the default when the row omits it)."""
    out = {}
    for col, (allowed, default) in STATE_COLUMNS.items():
        raw = row.get(col, default)
        values = raw if isinstance(raw, list) else [raw]
        if not values:
            raise BaselineError(
                f"{where}.{col} is an empty list", f"list the values of {col} the row holds for"
            )
        try:
            out[col] = tuple(sorted({normalize(v, allowed, f"{where}.{col}") for v in values}))
        except BaselineError as e:
            raise BaselineError(e.problem, f"allowed values of {col} are {list(allowed)}") from None
    return out


def normalize_state(state: dict[str, Any] | None) -> dict[str, str]:
    """A run's state settings (e.g. {"ssm_state_dtype": "bfloat16"}) normalised, defaults filled in.

    Raises BaselineError for an unknown column or value."""
    state = dict(state or {})
    unknown = sorted(set(state) - set(STATE_COLUMNS))
    if unknown:
        raise BaselineError(f"unknown state column(s) {unknown}", f"known: {sorted(STATE_COLUMNS)}")
    return {
        col: normalize(state.get(col, default), allowed, col)
        for col, (allowed, default) in STATE_COLUMNS.items()
    }


def _describe_state(state: dict[str, tuple[str, ...]]) -> str:
    """ " ssm_state_dtype=float32" (values a row holds for joined by |)."""
    return "".join(f" {col}={'|'.join(v)}" for col, v in state.items())


def _state_matches(row_state: dict[str, tuple[str, ...]], run_state: dict[str, str]) -> bool:
    return all(run_state[col] in values for col, values in row_state.items())


@dataclass(frozen=True)
class Protocol:
    """How a file's references were measured: few-shot examples per prompt and the generated-token limit
    per question (results.json's task.num_fewshot / task.max_gen_toks, the run's eval.num_fewshot /
    eval.max_gen_toks). A score or an acceptance figure measured under another protocol is another
    benchmark's: the verdict reports it without judging it (:func:`protocol_mismatch`)."""

    num_fewshot: int
    max_gen_toks: int

    def describe(self) -> str:
        return f"{self.num_fewshot}-shot with at most {self.max_gen_toks} generated tokens"


PROTOCOL_KEYS = ("num_fewshot", "max_gen_toks")


def _protocol(raw: Any, where: str) -> Protocol:
    """A `protocol:` mapping of a baselines file or model block, checked."""
    _check_keys(raw, set(PROTOCOL_KEYS), where, required=PROTOCOL_KEYS)
    values = {}
    for key, lo in (("num_fewshot", 0), ("max_gen_toks", 1)):
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise BaselineError(f"{where}.{key} must be an integer >= {lo}, got {v!r}",
                                f"write the eval.{key} the references were measured with")
        values[key] = v
    return Protocol(**values)


def _file_protocol(data: dict, path: Path) -> Protocol:
    if "protocol" not in data:
        raise BaselineError(
            f"{path}: missing key 'protocol' (how the references were measured)",
            "add protocol: {num_fewshot: <N>, max_gen_toks: <N>} (the eval.num_fewshot and eval.max_gen_toks "
            "the numbers were measured with; see registry/baselines/README.md)",
        )
    return _protocol(data["protocol"], f"{path}: protocol")


def file_protocol(path: str | Path) -> Protocol:
    """The file-level ``protocol`` of a baselines file (its model blocks may override it). Raises
    BaselineError for a missing file or a missing / malformed protocol."""
    path = Path(path)
    return _file_protocol(_read_yaml(path), path)


def run_protocol(num_fewshot: Any, max_gen_toks: Any) -> Protocol:
    """A run's protocol from its settings (eval.num_fewshot, eval.max_gen_toks, or results.json's task
    section). Raises ValueError when either is not an integer (results.json without them)."""
    if isinstance(num_fewshot, bool) or isinstance(max_gen_toks, bool) or \
            not isinstance(num_fewshot, int) or not isinstance(max_gen_toks, int):
        raise ValueError(f"a run's num_fewshot and max_gen_toks must be integers, got {num_fewshot!r} and "
                         f"{max_gen_toks!r}")
    return Protocol(num_fewshot, max_gen_toks)


def protocol_mismatch(reference: Protocol, run: Protocol, path: str | Path | list, key: str | None = None
                      ) -> str:
    """"" when a run measured under `run` can be judged against references measured under `reference`;
    else the sentence that says why not (the verdict's "no_reference" note, the runner's warning), naming
    the settings that differ, the model key's references and the file (or files: a list)."""
    if reference == run:
        return ""
    differ = [k for k in PROTOCOL_KEYS if getattr(run, k) != getattr(reference, k)]
    shown = " and ".join(str(_shown(Path(p))) for p in (path if isinstance(path, list) else [path]))
    whose = f"the {key} references in {shown} were" if key else f"the references in {shown} were"
    ours = ", ".join(f"eval.{k}={getattr(run, k)}" for k in differ)
    theirs = " ".join(f"eval.{k}={getattr(reference, k)}" for k in differ)
    return (f"{whose} measured {reference.describe()} and this run sets {ours}: another benchmark, so its "
            f"figures are reported, not judged (set {theirs} to judge them)")


def _shown(path: Path) -> Path:
    """``path`` relative to the repository when it is inside it (what messages print)."""
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


def reference_protocol(key: str, path: str | Path | None = None, *, acceptance: bool = False
                       ) -> Protocol | None:
    """The protocol of model key ``key``'s block in a baselines file (every row of a block shares it): the
    accuracy file at ``path`` (default gsm8k.yaml), or with ``acceptance`` the acceptance file (default
    acceptance.yaml); None when the file has no block for ``key``. Raises BaselineError for a malformed
    file."""
    blocks = load_acceptance_baselines(path) if acceptance else load_accuracy_baselines(path)
    rows = blocks.get(key)
    return rows[0].protocol if rows else None


@dataclass(frozen=True)
class AccuracyReference:
    """One row of gsm8k.yaml.

    accuracy is in percent (0-100) of `metric`; None when `measured` is False (a placeholder that a run
    reports as "no reference yet"). sigma / alpha / beta are per-row overrides of the hypothesis test's
    defaults (None: use evals.verdict's defaults).
    """

    model: str
    dtype: str
    quant: str
    kv_cache_quant: str
    spec_dec: str
    accuracy: float | None
    num_samples: int | None
    measured: bool
    metric: str
    sigma: float | None = None
    alpha: float | None = None
    beta: float | None = None
    source: str = ""
    note: str = ""
    # STATE_COLUMNS: the values the row holds for (default: a float32 SSM state only)
    state: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"ssm_state_dtype": ("float32",)})
    protocol: Protocol = Protocol(5, 256)  # how the row was measured: the loaders set the file's or block's

    @property
    def match_key(self) -> tuple[str, str, str, str]:
        return (self.dtype, self.quant, self.kv_cache_quant, self.spec_dec)

    def describe(self) -> str:
        value = f"{self.accuracy:.2f}" if self.measured else "not measured"
        return (
            f"dtype={self.dtype} quant={self.quant} kv_cache_quant={self.kv_cache_quant} "
            f"spec_dec={self.spec_dec}{_describe_state(self.state)}: {value}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (state values as lists, as they read back)."""
        d = asdict(self)
        d["state"] = {col: list(values) for col, values in self.state.items()}
        return d


@dataclass(frozen=True)
class AcceptanceReference:
    """One row of acceptance.yaml: floors for a registry entry at one (quant, draft_len).

    acceptance_rate_floor is a fraction in [0, 1]; acceptance lengths are tokens per request-step in
    [1, draft_len + 1]. Any of them may be None (no such check). All are None when `measured` is False.
    """

    entry: str
    quant: str
    draft_len: int
    measured: bool
    acceptance_rate_floor: float | None = None
    acceptance_length_reference: float | None = None
    acceptance_length_floor: float | None = None
    note: str = ""
    state: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"ssm_state_dtype": ("float32",)})
    protocol: Protocol = Protocol(5, 256)  # how the row was measured: the loaders set the file's or block's

    def describe(self) -> str:
        where = f"quant={self.quant} draft_len={self.draft_len}{_describe_state(self.state)}"
        if not self.measured:
            return f"{where}: not measured"
        def num(x: float | None) -> str:  # what a person reads: 2.0696000000000003 -> 2.0696
            return "-" if x is None else f"{round(x, 4):g}"

        return (
            f"{where}: rate floor {num(self.acceptance_rate_floor)}, "
            f"length ref {num(self.acceptance_length_reference)} floor {num(self.acceptance_length_floor)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (state values as lists, as they read back)."""
        d = asdict(self)
        d["state"] = {col: list(values) for col, values in self.state.items()}
        return d


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise BaselineError(
            f"baseline file {path} does not exist",
            "restore it from git or pass the path of an existing file",
        )
    try:
        data = load_yaml(path.read_text(), str(path))
    except RegistryYAMLError as e:
        raise BaselineError(e.problem, e.fix) from None
    if not isinstance(data, dict):
        raise BaselineError(f"{path}: top level must be a mapping", "see registry/baselines/README.md")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BaselineError(
            f"{path}: schema_version is {version!r}, this code reads {SCHEMA_VERSION}",
            f"set schema_version: {SCHEMA_VERSION} (and check the format in the README)",
        )
    return data


def _check_keys(mapping: Any, allowed: set[str], where: str, required: tuple[str, ...] = ()) -> None:
    if not isinstance(mapping, dict):
        raise BaselineError(
            f"{where} must be a mapping, got {type(mapping).__name__}",
            "see registry/baselines/README.md for the format",
        )
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise BaselineError(f"{where}: unknown key(s) {unknown}", f"allowed keys are {sorted(allowed)}")
    missing = [k for k in required if k not in mapping]
    if missing:
        raise BaselineError(
            f"{where}: missing key(s) {missing}", f"add {missing} (required: {list(required)})"
        )


def _number(
    value: Any, where: str, lo: float, hi: float, *, open_lo: bool = False, open_hi: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BaselineError(f"{where} must be a number, got {value!r}", f"write a number in [{lo}, {hi}]")
    bad = value < lo or value > hi or (open_lo and value == lo) or (open_hi and value == hi)
    if bad:
        interval = f"{'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}"
        raise BaselineError(f"{where} = {value} is outside {interval}", f"write a number in {interval}")
    return float(value)


def _column(row: dict, key: str, allowed: tuple[str, ...], where: str) -> str:
    try:
        return normalize(row[key], allowed, f"{where}.{key}")
    except BaselineError as e:
        raise BaselineError(e.problem, f"allowed values of {key} are {list(allowed)}") from None


def load_accuracy_baselines(path: str | Path | None = None) -> dict[str, list[AccuracyReference]]:
    """Load and validate gsm8k.yaml.

    Args:
        path: the file; default registry/baselines/gsm8k.yaml.
    Returns:
        model key -> its rows, in file order.
    Raises:
        BaselineError: naming the file, model, row and key of the first problem found (unknown keys, values
            outside the allowed sets, accuracy outside [0, 100], no or a malformed `protocol`, duplicate match
            keys, a measured row without accuracy / num_samples, a placeholder row with numbers).
    """
    path = Path(path) if path is not None else GSM8K_BASELINES
    data = _read_yaml(path)
    _check_keys(data, {"schema_version", "metric", "protocol", "models"}, str(path), required=("models",))
    default_metric = normalize(data.get("metric", "mean"), METRICS, f"{path}: metric")
    file_protocol = _file_protocol(data, path)
    models = data["models"]
    if not isinstance(models, dict) or not models:
        raise BaselineError(
            f"{path}: models must be a non-empty mapping of model key -> block",
            "see registry/baselines/README.md",
        )
    out: dict[str, list[AccuracyReference]] = {}
    for model, block in models.items():
        where = f"{path}: models.{model}"
        _check_keys(block, _GSM8K_MODEL_KEYS, where, required=("rows",))
        metric = normalize(block.get("metric", default_metric), METRICS, f"{where}.metric")
        protocol = _protocol(block["protocol"], f"{where}.protocol") if "protocol" in block else file_protocol
        rows = block["rows"]
        if not isinstance(rows, list) or not rows:
            raise BaselineError(f"{where}.rows must be a non-empty list", "add at least one row")
        refs: list[AccuracyReference] = []
        seen: dict[tuple, list[tuple[int, AccuracyReference]]] = {}
        for i, row in enumerate(rows):
            rw = f"{where}.rows[{i}]"
            _check_keys(row, _GSM8K_ROW_KEYS, rw, required=("dtype", "quant", "kv_cache_quant", "spec_dec"))
            measured = row.get("measured", True)
            if not isinstance(measured, bool):
                raise BaselineError(
                    f"{rw}.measured must be true or false, got {measured!r}", "write true or false"
                )
            if measured:
                _check_keys(row, _GSM8K_ROW_KEYS, rw, required=("accuracy", "num_samples"))
                accuracy = _number(row["accuracy"], f"{rw}.accuracy", 0.0, 100.0)
                num_samples = row["num_samples"]
                if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
                    raise BaselineError(
                        f"{rw}.num_samples must be a positive integer, got {num_samples!r}",
                        "write the number of GSM8K samples the reference was measured on",
                    )
            else:
                if row.get("accuracy") is not None or row.get("num_samples") is not None:
                    raise BaselineError(
                        f"{rw} has measured: false but carries accuracy / num_samples",
                        "set measured: true when the numbers are real, or remove them",
                    )
                accuracy, num_samples = None, None
            ref = AccuracyReference(
                model=str(model),
                dtype=_column(row, "dtype", DTYPES, rw),
                quant=_column(row, "quant", QUANTS, rw),
                kv_cache_quant=_column(row, "kv_cache_quant", KV_CACHE_QUANTS, rw),
                spec_dec=_column(row, "spec_dec", SPEC_DECS, rw),
                accuracy=accuracy,
                num_samples=num_samples,
                measured=measured,
                metric=metric,
                sigma=_number(row["sigma"], f"{rw}.sigma", 0.0, 100.0, open_lo=True)
                if "sigma" in row
                else None,
                alpha=_number(row["alpha"], f"{rw}.alpha", 0.0, 1.0, open_lo=True, open_hi=True)
                if "alpha" in row
                else None,
                beta=_number(row["beta"], f"{rw}.beta", 0.0, 1.0, open_lo=True, open_hi=True)
                if "beta" in row
                else None,
                source=str(block.get("source", "")).strip(),
                note=str(row.get("note", "")),
                state=_state_columns(row, rw),
                protocol=protocol,
            )
            for j, other in seen.get(ref.match_key, []):
                if all(set(a) & set(b) for a, b in zip(ref.state.values(), other.state.values())):
                    raise BaselineError(
                        f"{rw} repeats the (dtype, quant, kv_cache_quant, spec_dec"
                        f"{''.join(', ' + c for c in STATE_COLUMNS)}) of rows[{j}]: {ref.match_key}"
                        f"{_describe_state(ref.state)}",
                        "keep one row per combination",
                    )
            seen.setdefault(ref.match_key, []).append((i, ref))
            refs.append(ref)
        out[str(model)] = refs
    return out


def load_acceptance_baselines(path: str | Path | None = None) -> dict[str, list[AcceptanceReference]]:
    """Load and validate acceptance.yaml.

    Args:
        path: the file; default registry/baselines/acceptance.yaml.
    Returns:
        model key (the registry entry's `baseline`) -> its rows, in file order.
    Raises:
        BaselineError: naming the file, entry, row and key of the first problem (unknown keys, a rate floor
            outside [0, 1], a length outside [1, draft_len + 1], both or neither of floor / rel_tolerance,
            duplicate (quant, draft_len), no or a malformed `protocol`, a placeholder row with numbers, a
            measured row with no floor).
    """
    path = Path(path) if path is not None else ACCEPTANCE_BASELINES
    data = _read_yaml(path)
    _check_keys(data, {"schema_version", "protocol", "models"}, str(path), required=("models",))
    file_protocol = _file_protocol(data, path)
    entries = data["models"]
    if not isinstance(entries, dict) or not entries:
        raise BaselineError(
            f"{path}: models must be a non-empty mapping of model key -> block",
            "see registry/baselines/README.md",
        )
    out: dict[str, list[AcceptanceReference]] = {}
    for entry, block in entries.items():
        where = f"{path}: models.{entry}"
        _check_keys(block, _ACC_ENTRY_KEYS, where, required=("rows",))
        protocol = _protocol(block["protocol"], f"{where}.protocol") if "protocol" in block else file_protocol
        rows = block["rows"]
        if not isinstance(rows, list) or not rows:
            raise BaselineError(f"{where}.rows must be a non-empty list", "add a row or remove the entry")
        refs: list[AcceptanceReference] = []
        seen: dict[tuple, list[tuple[int, AcceptanceReference]]] = {}
        for i, row in enumerate(rows):
            rw = f"{where}.rows[{i}]"
            _check_keys(row, _ACC_ROW_KEYS, rw, required=("quant", "draft_len"))
            quant = _column(row, "quant", QUANTS, rw)
            k = row["draft_len"]
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise BaselineError(
                    f"{rw}.draft_len must be an integer >= 1, got {k!r}",
                    "write the number of drafted tokens per step the numbers were measured at",
                )
            measured = row.get("measured", True)
            if not isinstance(measured, bool):
                raise BaselineError(
                    f"{rw}.measured must be true or false, got {measured!r}", "write true or false"
                )
            rate_floor = length_ref = length_floor = None
            if not measured:
                if "acceptance_rate_floor" in row or "acceptance_length" in row:
                    raise BaselineError(
                        f"{rw} has measured: false but carries numbers",
                        "set measured: true when the numbers are real, or remove them",
                    )
            else:
                if "acceptance_rate_floor" not in row and "acceptance_length" not in row:
                    raise BaselineError(
                        f"{rw} has neither acceptance_rate_floor nor acceptance_length",
                        "add at least one of them, or mark the row measured: false",
                    )
                if "acceptance_rate_floor" in row:
                    rate_floor = _number(
                        row["acceptance_rate_floor"], f"{rw}.acceptance_rate_floor", 0.0, 1.0
                    )
                if "acceptance_length" in row:
                    lw = f"{rw}.acceptance_length"
                    length = row["acceptance_length"]
                    _check_keys(length, _ACC_LENGTH_KEYS, lw, required=("reference",))
                    length_ref = _number(length["reference"], f"{lw}.reference", 1.0, k + 1.0)
                    if ("floor" in length) == ("rel_tolerance" in length):
                        raise BaselineError(
                            f"{lw} needs exactly one of floor / rel_tolerance",
                            "give an absolute floor or a relative tolerance (e.g. 0.05), not both",
                        )
                    if "floor" in length:
                        length_floor = _number(length["floor"], f"{lw}.floor", 1.0, length_ref)
                    else:
                        tol = _number(length["rel_tolerance"], f"{lw}.rel_tolerance", 0.0, 1.0, open_hi=True)
                        length_floor = length_ref * (1.0 - tol)
            ref = AcceptanceReference(
                entry=str(entry),
                quant=quant,
                draft_len=k,
                measured=measured,
                acceptance_rate_floor=rate_floor,
                acceptance_length_reference=length_ref,
                acceptance_length_floor=length_floor,
                note=str(row.get("note", "")),
                state=_state_columns(row, rw),
                protocol=protocol,
            )
            key = (quant, k)
            for j, other in seen.get(key, []):
                if all(set(a) & set(b) for a, b in zip(ref.state.values(), other.state.values())):
                    raise BaselineError(
                        f"{rw} repeats the (quant, draft_len{''.join(', ' + c for c in STATE_COLUMNS)}) of "
                        f"rows[{j}]: {key}{_describe_state(ref.state)}",
                        "keep one row per combination",
                    )
            seen.setdefault(key, []).append((i, ref))
            refs.append(ref)
        out[str(entry)] = refs
    return out


_NO_REF_FIX = (
    "add the row to {file} (measure it, or copy a published number with its source), "
    "or run with verdict.require_reference=false to report the run without a pass/fail verdict"
)


def find_accuracy_reference(
    key: str,
    dtype: Any,
    quant: Any,
    kv_cache_quant: Any,
    spec_dec: Any,
    *,
    state: dict[str, Any] | None = None,
    path: str | Path | None = None,
) -> AccuracyReference:
    """The gsm8k.yaml row of model `key` matching (dtype, quant, kv_cache_quant, spec_dec) exactly and
    holding for the run's `state` (STATE_COLUMNS, e.g. {"ssm_state_dtype": "bfloat16"}; None / omitted
    columns: their defaults, a float32 SSM state).

    Values are normalised first (case, bf16 -> bfloat16, None -> "none"). A returned row may be a placeholder
    (`measured` False): the caller reports "no reference yet" for it.

    Raises:
        BaselineError: a value outside the allowed sets; an unknown model key (the message lists the known
            keys); or no row matches (the message lists the model's rows and how to add one).
    """
    path = Path(path) if path is not None else GSM8K_BASELINES
    wanted = (
        normalize(dtype, DTYPES, "dtype"),
        normalize(quant, QUANTS, "quant"),
        normalize(kv_cache_quant, KV_CACHE_QUANTS, "kv_cache_quant"),
        normalize(spec_dec, SPEC_DECS, "spec_dec"),
    )
    models = load_accuracy_baselines(path)
    if key not in models:
        raise BaselineError(
            f"no GSM8K baselines for model key {key!r} in {_shown(path)}; known keys: {sorted(models)}",
            _NO_REF_FIX.format(file=_shown(path)),
        )
    run_state = normalize_state(state)
    for ref in models[key]:
        if ref.match_key == wanted and _state_matches(ref.state, run_state):
            return ref
    rows = "\n".join(f"    {r.describe()}" for r in models[key])
    state_text = "".join(f" {c}={v}" for c, v in run_state.items())
    raise BaselineError(
        f"no GSM8K reference for {key!r} with dtype={wanted[0]} quant={wanted[1]} kv_cache_quant={wanted[2]} "
        f"spec_dec={wanted[3]}{state_text} in {_shown(path)}; its rows are:\n{rows}",
        _NO_REF_FIX.format(file=_shown(path)),
    )


def find_acceptance_reference(
    key: str,
    quant: Any,
    draft_len: int,
    *,
    state: dict[str, Any] | None = None,
    path: str | Path | None = None,
) -> AcceptanceReference:
    """The acceptance.yaml row of model key `key` (a registry entry's `baseline`) at (quant, draft_len),
    holding for the run's `state` (as in find_accuracy_reference).

    Raises:
        BaselineError: unknown model key (lists the known ones) or no row at that quant / draft length
            (lists the key's rows and how to add one).
    """
    path = Path(path) if path is not None else ACCEPTANCE_BASELINES
    q = normalize(quant, QUANTS, "quant")
    entries = load_acceptance_baselines(path)
    entry = key
    if entry not in entries:
        raise BaselineError(
            f"no acceptance baselines for model key {entry!r} in {_shown(path)}; "
            f"known keys: {sorted(entries)}",
            _NO_REF_FIX.format(file=_shown(path)),
        )
    run_state = normalize_state(state)
    for ref in entries[entry]:
        if ref.quant == q and ref.draft_len == draft_len and _state_matches(ref.state, run_state):
            return ref
    rows = "\n".join(f"    {r.describe()}" for r in entries[entry])
    state_text = "".join(f" {c}={v}" for c, v in run_state.items())
    raise BaselineError(
        f"no acceptance reference for {entry!r} at quant={q} draft_len={draft_len}{state_text} in "
        f"{_shown(path)}; "
        f"its rows are:\n{rows}",
        _NO_REF_FIX.format(file=_shown(path)),
    )
