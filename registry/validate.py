"""Registry checks behind `python -m registry list|validate`.

Every entry's raw file is checked (registry.schema.check_entry_file), then the entry is composed the way
run.py composes it (Hydra compose API on configs/, the entry as group `model`) and checked by
runners.app.resolve without loading weights, with its own settings (errors) and with each ssm_replay in
{true, false} and world_size in {1, 4} (combinations the runner would refuse are reported as notes).
The baseline rows each entry would be judged against must exist in registry/baselines/ (evals.baselines).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

from registry.schema import (
    EMBEDDED_CHECKPOINTS_DIR,
    ModelEntry,
    SpecAlgorithm,
    check_entry_file,
    entry_names,
)
from runners.app import CONFIG_DIR, ResolvedRun, check_checkpoint_dir, resolve
from runners.errors import UserError

SWEEP_SSM_REPLAY = (True, False)
SWEEP_WORLD_SIZE = (1, 4)


@contextmanager
def hydra_context() -> Iterator[None]:
    """Initialise Hydra's compose API on configs/ (absolute path: works from any cwd)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield


def compose_entry(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The composed config of `python run.py model=<name> <overrides>` (call inside hydra_context())."""
    try:
        return compose("config", overrides=[f"model={name}", *(overrides or [])])
    except HydraException as e:
        raise UserError(
            f"registry/model/{name}.yaml does not compose: {str(e).strip().splitlines()[0]}",
            "fix its YAML / defaults list (a variant lists its base entry and _self_ under defaults:)",
        ) from None


@dataclass
class EntryReport:
    name: str
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # sweep combinations the runner would refuse, and why
    resolved: ResolvedRun | None = None


def validate_one(name: str) -> EntryReport:
    """Check one entry (call inside hydra_context()); problems go to report.errors, refusals to notes."""
    report = EntryReport(name)
    try:
        check_entry_file(name)
        report.resolved = resolve(compose_entry(name), entry_name=name, check_checkpoint=False,
                                  check_runtime=False)
    except UserError as e:
        report.errors.append(f"{e.problem} -- fix: {e.fix}")
        return report
    entry = report.resolved.entry
    base = compose_entry(name)
    for ssm_replay in SWEEP_SSM_REPLAY:
        for world_size in SWEEP_WORLD_SIZE:
            # ssm_replay and world_size are top-level scalars, not config groups: setting them on the composed
            # config is what Hydra's override does, without recomposing (tests/test_config.py composes each).
            cfg = base.copy()
            cfg.ssm_replay, cfg.world_size = ssm_replay, world_size
            try:
                resolve(cfg, entry_name=name, check_checkpoint=False, check_runtime=False)
            except UserError as e:
                combo = f"ssm_replay={str(ssm_replay).lower()} world_size={world_size}"
                report.notes.append(f"{combo} refused: {e.problem}")
    if entry.embedded:
        ckpt = EMBEDDED_CHECKPOINTS_DIR / entry.checkpoint
        if ckpt.exists():
            try:
                check_checkpoint_dir(ckpt, "model.checkpoint")
                _load_embedded(ckpt)
            except UserError as e:
                report.errors.append(f"{e.problem} -- fix: {e.fix}")
        else:
            report.notes.append(f"embedded checkpoint {ckpt} not built yet (python -m runners.tiny)")
    report.errors += _baseline_problems(entry)
    return report


def _load_embedded(ckpt) -> None:
    """Load a shipped (small) checkpoint with the engine's loader: every tensor present, named and shaped as
    the config says, files readable. Raises UserError with the loader's message."""
    from runners.loader import CheckpointError, load_model

    try:
        load_model(ckpt)
    except CheckpointError as e:
        raise UserError(f"embedded checkpoint {ckpt} does not load: {e}",
                        "rebuild it (registry/checkpoints/README.md) or restore it from git") from None


def _baseline_problems(entry: ModelEntry) -> list[str]:
    """The baseline rows a run of this entry would be judged against must exist (placeholders count).

    Uses the same loaders and lookups as the verdict (evals.baselines), so a file error, an unknown key or a
    missing (dtype, quant, kv_cache_quant, spec_dec) / (quant, draft_len) row is caught in the PR's CI.
    """
    from evals.baselines import BaselineError, find_acceptance_reference, find_gsm8k_reference

    if entry.baseline is None:
        return []
    mtp = entry.speculative.algorithm == SpecAlgorithm.mtp
    lookups = [
        lambda: find_gsm8k_reference(
            entry.baseline, entry.dtype.value, entry.quant.value, entry.kv_cache_quant.value,
            "mtp" if mtp else "none",
        )
    ]
    if mtp:
        lookups.append(
            lambda: find_acceptance_reference(entry.baseline, entry.quant.value, entry.speculative.draft_len)
        )
    problems = []
    for lookup in lookups:
        try:
            lookup()
        except BaselineError as e:
            problems.append(f"{e.problem} -- fix: {e.fix}")
    return problems


def validate_all(names: list[str] | None = None) -> list[EntryReport]:
    """validate_one for every entry (or the given names)."""
    with hydra_context():
        return [validate_one(n) for n in (names or entry_names())]


def resolve_all() -> list[EntryReport]:
    """Each entry with its own settings only (for `list`): errors but no sweep, baseline or file notes."""
    reports = []
    with hydra_context():
        for name in entry_names():
            report = EntryReport(name)
            try:
                check_entry_file(name)
                report.resolved = resolve(compose_entry(name), entry_name=name, check_checkpoint=False,
                                          check_runtime=False)
            except UserError as e:
                report.errors.append(f"{e.problem} -- fix: {e.fix}")
            reports.append(report)
    return reports
