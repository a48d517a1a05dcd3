"""Registry checks behind `python -m registry list|validate`.

Every entry is composed the way run.py composes it (registry.compose: the raw-file guard, then Hydra's compose
API on configs/ with the entry as group `model`, type-checked against the schema) and resolved by
registry.resolve.resolve without loading weights, with its own settings (errors) and with each ssm_replay in
{true, false} and world_size in {1, 4} (combinations the resolution refuses are reported as notes). An
embedded checkpoint must exist (the fix is the command that restores it) and be complete (config.json
parsed, every weight file present and its safetensors header readable; that the tensors fit the model is
the loader's check, run by tests/test_tiny.py). The baseline rows each entry would be judged against must
exist in registry/baselines/ (registry.baselines, the verdict's own lookups).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from registry.baselines import BaselineError, find_acceptance_reference, find_accuracy_reference
from registry.checkpoint import check_checkpoint_dir, tensor_files
from registry.compose import compose_config
from registry.errors import UserError, UserErrors
from registry.resolve import ResolvedRun, resolve
from registry.schema import EMBEDDED_CHECKPOINTS_DIR, REPO_ROOT, entry_names

SWEEP_SSM_REPLAY = (True, False)
SWEEP_WORLD_SIZE = (1, 4)


def compose_entry(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The composed config of `python run.py model=<name> <overrides>`; raises UserError."""
    return compose_config([f"model={name}", *(overrides or [])])


@dataclass
class EntryReport:
    name: str
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # sweep combinations the runner would refuse, and why
    resolved: ResolvedRun | None = None


def _line(e: UserError) -> str:
    return f"{e.problem} -- fix: {e.fix}"


def _lines(e: UserError) -> list[str]:
    """One line per problem: every problem of a UserErrors (all of a file's), else the one."""
    return [_line(x) for x in e.errors] if isinstance(e, UserErrors) else [_line(e)]


def validate_one(name: str) -> EntryReport:
    """Check one entry; problems go to report.errors, refused sweep combinations to notes."""
    report = EntryReport(name)
    try:
        base = compose_entry(name)
        report.resolved = resolve(base, entry_name=name, check_checkpoint=False)
    except UserError as e:
        report.errors += _lines(e)
        return report
    entry = report.resolved.entry
    for ssm_replay in SWEEP_SSM_REPLAY:
        for world_size in SWEEP_WORLD_SIZE:
            # ssm_replay and world_size are top-level scalars, not config groups: setting them on the composed
            # config is what Hydra's override does, without recomposing (tests/test_config.py composes each).
            cfg = base.copy()
            cfg.ssm_replay, cfg.world_size = ssm_replay, world_size
            try:
                resolve(cfg, entry_name=name, check_checkpoint=False)
            except UserError as e:
                combo = f"ssm_replay={str(ssm_replay).lower()} world_size={world_size}"
                report.notes.append(f"{combo} refused: {e.problem}")
    if entry.embedded:
        ckpt = EMBEDDED_CHECKPOINTS_DIR / entry.checkpoint
        if ckpt.exists():
            try:
                check_checkpoint_dir(ckpt, "model.checkpoint")
                tensor_files(ckpt)
            except UserError as e:
                report.errors.append(
                    f"embedded checkpoint {ckpt} does not load: {e.problem} -- fix: "
                    f"{restore_command(ckpt, _build_command(entry))}"
                )
        else:
            report.errors.append(
                f"embedded checkpoint {ckpt} does not exist (an embedded entry ships its "
                f"checkpoint) -- fix: {restore_command(ckpt, _build_command(entry))}"
            )
    report.errors += baseline_problems(report.resolved)
    return report


def _build_command(entry) -> str:
    """The command that writes an embedded entry's checkpoint (registry/checkpoints/README.md)."""
    if entry.quant.value == "fp8":
        return "python -m runners.tools.quantize --fp8"
    return "python -m runners.tools.tiny"


def restore_command(ckpt: Path, build: str = "python -m runners.tools.tiny") -> str:
    """The command that builds an embedded checkpoint folder: `git checkout` of the shipped files when the
    repository tracks them (the trained tiny weights are data, restored bit for bit), else the command that
    writes it (`build`, see registry/checkpoints/README.md) and what to add."""
    rel = ckpt.relative_to(REPO_ROOT) if ckpt.is_relative_to(REPO_ROOT) else ckpt
    try:
        tracked = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "ls-files", "--", str(rel)],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        tracked = ""
    if tracked:
        return f"git -C {REPO_ROOT} checkout HEAD -- {rel}"
    return (
        f"build it with {build} (registry/checkpoints/README.md) and add the folder {rel}/ to the change, "
        "or set embedded: false and point checkpoint at a folder under models_root"
    )


def baseline_problems(rr: ResolvedRun) -> list[str]:
    """The baseline rows a run of this entry (with its own settings) would be judged against must exist:
    gsm8k.yaml's (dtype, quant, kv_cache_quant, spec_dec) row and, with speculation, acceptance.yaml's
    (quant, draft_len) row, found with the verdict's own lookups. The dtype is the entry's (a run's
    runtime.dtype may differ: the runner checks that row before it loads anything). Placeholder rows
    (measured: false) count."""
    entry = rr.entry
    if entry.baseline is None:
        return []
    problems = []
    try:
        find_accuracy_reference(
            entry.baseline,
            entry.dtype.value,
            entry.quant.value,
            entry.kv_cache_quant.value,
            rr.spec_dec,
            state=rr.baseline_state,
        )
    except BaselineError as e:
        problems.append(_line(e))
    if rr.draft_len > 0:
        try:
            find_acceptance_reference(
                entry.baseline, entry.quant.value, rr.draft_len, state=rr.baseline_state
            )
        except BaselineError as e:
            problems.append(_line(e))
    return problems


def validate_all(names: list[str] | None = None) -> list[EntryReport]:
    """validate_one for every entry (or the given names)."""
    return [validate_one(n) for n in (names or entry_names())]


def resolve_all() -> list[EntryReport]:
    """Each entry with its own settings only (for `list`): errors but no sweep, baseline or file notes."""
    reports = []
    for name in entry_names():
        report = EntryReport(name)
        try:
            report.resolved = resolve(compose_entry(name), entry_name=name, check_checkpoint=False)
        except UserError as e:
            report.errors.append(_line(e))
        reports.append(report)
    return reports
