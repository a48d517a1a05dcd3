"""The effective settings of one run: a composed config in, a checked ResolvedRun out (no weights loaded).

Top-level settings (ssm_replay, draft_len, world_size, runtime.dtype, eval.batch_size) override the entry's;
the checkpoint directory is found (absolute, under registry/checkpoints/ for embedded entries, else under
models_root); the checkpoint's config.json, where present, gives the model dimensions and must agree with the
entry. Everything here holds on any machine: what the engine of this machine can run is the runner's check
(runners.app.main), and `python -m registry validate` resolves every entry with this same function.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from registry.arch import arch_from_config, arch_mismatch, check_world_size
from registry.checkpoint import CONFIG_FILE, check_checkpoint_dir
from registry.compose import check_composed, override_error
from registry.errors import UserError
from registry.hf_config import HybridConfig
from registry.releases import FormatError, release_hybrid_config
from registry.schema import (
    COMPARE_MODES,
    EMBEDDED_CHECKPOINTS_DIR,
    ArchConfig,
    LoadFormat,
    ModelEntry,
    RunConfig,
    SpecAlgorithm,
    acceptance_length_in_range,
    check_run_values,
    entry_file,
    entry_names,
    typed,
    unknown_entry_error,
    validate_entry,
)

# the run.py override that sets each resume-fingerprint / engine_settings key (for messages that name them)
SETTING_OVERRIDES = {
    "entry": "model", "checkpoint_dir": "model.checkpoint", "load_format": "model.load_format",
    "ssm_replay": "ssm_replay", "world_size": "world_size", "draft_len": "draft_len",
    "device": "runtime.device", "dtype": "runtime.dtype", "ssm_state_dtype": "model.ssm.state_dtype",
    "max_batch_size": "eval.batch_size / model.max_batch_size", "ssm_backend": "model.ssm.backend",
    "ssm_replay_checkpointing": "model.ssm.replay_checkpointing", "quant": "model.quant",
    "kv_cache_quant": "model.kv_cache_quant", "max_seq_len": "model.max_seq_len",
    "num_threads": "runtime.num_threads", "num_fewshot": "eval.num_fewshot",
    "max_gen_toks": "eval.max_gen_toks", "data_dir": "eval.data_dir",
    "ssm_stochastic_rounding": "model.ssm.stochastic_rounding", "task": "eval",
    "forced_acceptance_length": "runtime.forced_acceptance_length",
}


@dataclass
class ResolvedRun:
    """The effective settings of one run, after every default and override is applied."""

    entry: ModelEntry
    run: RunConfig
    ssm_replay: bool
    world_size: int
    draft_len: int
    device: str
    dtype: str  # compute dtype: runtime.dtype, else the entry's
    max_batch_size: int
    checkpoint_dir: Path
    checkpoint_setting: str  # which setting points at checkpoint_dir (for error messages)
    arch: ArchConfig | None  # None only when an embedded checkpoint is not there yet
    # the checkpoint's config.json, when it is on this machine; for load_format=dummy without one, the entry's
    # released configuration (registry.releases.release_hybrid_config)
    checkpoint_config: HybridConfig | None

    @property
    def dummy(self) -> bool:
        """Whether the run's weights are random (model.load_format=dummy): no accuracy can be judged."""
        return self.entry.load_format == LoadFormat.dummy

    @property
    def ssm_backend(self) -> str:
        """The recurrent-kernel backend asked of the engine: the entry's on a GPU; "torch" (the kernels'
        PyTorch references) on the CPU, where the Triton interpreter would be orders of magnitude slower."""
        return self.entry.ssm.backend.value if self.device.startswith("cuda") else "torch"

    def compare_arm(self, replay: bool) -> ResolvedRun:
        """The run of one compare=replay arm: these settings with ``ssm_replay`` = ``replay``
        (:func:`resolve_speculation` resolves a compare run to its first arm, replay off)."""
        return dataclasses.replace(self, ssm_replay=replay)

    @property
    def ssm_replay_checkpointing(self) -> bool:
        """The entry's checkpointing replay variant, in effect only when the run replays."""
        return self.ssm_replay and self.entry.ssm.replay_checkpointing

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """The padded batch sizes the engine captures its decode step at: the entry's, up to the run's
        max_batch_size (eval.batch_size may lower it); none when runtime.cuda_graphs is false or the device is
        the CPU (where the same step runs eagerly). With world_size > 1 every rank captures them, the model's
        NCCL all-reduces inside the graphs (runners.engine.launch)."""
        if not (self.run.runtime.cuda_graphs and self.device.startswith("cuda")):
            return []
        return sorted(b for b in set(self.entry.cuda_graph_batch_sizes) if b <= self.max_batch_size)

    @property
    def cuda_graphs_off_reason(self) -> str | None:
        """Why the run asked for CUDA graphs (runtime.cuda_graphs) and gets none, or None: on the CPU the same
        step runs eagerly. (A tensor-parallel engine adds its own reason: runners.engine.launch.)"""
        if self.run.runtime.cuda_graphs and not self.device.startswith("cuda"):
            return (f"runtime.cuda_graphs=true on {self.device}: CUDA graphs need a CUDA device; the step "
                    "runs eagerly")
        return None

    @property
    def compile_off_reason(self) -> str | None:
        """Why the run asked for runtime.compile and gets the eager step, or None: the step compiles at the
        CUDA-graph batch sizes (runners.engine.compile) and this run captures none."""
        if self.run.runtime.compile and not self.cuda_graph_batch_sizes:
            return ("runtime.compile=true compiles the decode step at its CUDA-graph batch sizes and this "
                    "run captures none (the CPU, or runtime.cuda_graphs=false): the step runs eagerly")
        return None

    @property
    def baseline_state(self) -> dict[str, str]:
        """The run's values of the baseline files' state columns (registry.baselines.STATE_COLUMNS): a row
        judges the run only if it holds for them (a 16-bit SSM state is not judged by a float32-state row)."""
        return {"ssm_state_dtype": self.entry.ssm.state_dtype.value}

    @property
    def spec_dec(self) -> str:
        """The speculative algorithm as the baseline files name it: "mtp" when drafting, else "none"."""
        return self.entry.speculative.algorithm.value if self.draft_len > 0 else "none"

    def engine_settings(self) -> dict[str, Any]:
        """The resolved settings the engine runs with, by the names results.json's `config` and a run's
        resume fingerprint (runners.app.rundir.fingerprint) both record them under."""
        return {
            "ssm_replay": self.ssm_replay,
            "world_size": self.world_size,
            "draft_len": self.draft_len,
            "device": self.device,
            "dtype": self.dtype,
            "ssm_state_dtype": self.entry.ssm.state_dtype.value,
            "max_batch_size": self.max_batch_size,
            "ssm_backend": self.ssm_backend,
            "ssm_replay_checkpointing": self.ssm_replay_checkpointing,
            # present only when set: fingerprints and results written before the option equal today's without
            **({"forced_acceptance_length": self.run.runtime.forced_acceptance_length}
               if self.run.runtime.forced_acceptance_length is not None else {}),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (enums as their values, paths as strings): results.json's `config`."""
        return {
            "model": plain(self.entry),
            **self.engine_settings(),
            "cuda_graph_batch_sizes": self.cuda_graph_batch_sizes,
            "checkpoint_dir": str(self.checkpoint_dir),
            "load_format": self.entry.load_format.value,
            # where the model's configuration came from (config.json, or the released one for dummy weights)
            "config_source": self.checkpoint_config.source if self.checkpoint_config is not None else None,
            "arch": plain(self.arch) if self.arch is not None else None,
            "eval": plain(self.run.eval),
            "seed": self.run.seed,
            "resume": self.run.resume,
            "compare": self.run.compare,
            "require_reference": self.run.verdict.require_reference,
        }


def plain(obj: Any) -> Any:
    """A schema dataclass as plain JSON-able containers (enums as their values)."""
    return OmegaConf.to_container(OmegaConf.structured(obj), enum_to_str=True)


def hydra_choice(group: str) -> str | None:
    """The option chosen for a config group (e.g. the registry entry name), when Hydra's run is active."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def _task_overrides() -> list[str]:
    """The command line's overrides of the running Hydra job ([] outside one, e.g. the compose API)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    # unresolved: an override's own `${...}` must not be resolved just to print it
    return [str(o) for o in OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)]


def _with_model_overrides(e: UserError) -> UserError:
    """An entry check names the registry file; when model.* overrides were given, they may be the cause."""
    given = [o for o in _task_overrides() if o.lstrip("+~").startswith("model.")]
    if not given:
        return e
    fix = e.fix if "override" in e.fix else f"{e.fix}; or change the override"
    return UserError(f"{e.problem} (the entry as changed by the override(s) {' '.join(given)})", fix)


def run_config(cfg: DictConfig) -> RunConfig:
    """The composed config as a typed RunConfig (interpolations resolved). A fresh schema node rejects keys
    that Hydra's `+key=value` added without a check. Raises UserError."""
    try:
        return OmegaConf.to_object(typed(RunConfig, cfg))
    except OmegaConfBaseException as e:
        raise override_error(e, _task_overrides()) from None


def checkpoint_path(entry: ModelEntry, models_root: str | None, *, required: bool = True) -> tuple[Path, str]:
    """(checkpoint directory, the setting that points there) for an entry.

    An absolute `checkpoint` is used as is; a relative one lies under registry/checkpoints/ for embedded
    entries and under models_root ($LLM_MODELS_ROOT) otherwise. Raises UserError when models_root is needed
    but unset, unless required=False (registry validation on a machine without the models): then the path is
    only informative, "$LLM_MODELS_ROOT/<checkpoint>".
    """
    ckpt = Path(os.path.expanduser(entry.checkpoint))
    if ckpt.is_absolute():
        return ckpt, "model.checkpoint"
    if entry.embedded:
        return EMBEDDED_CHECKPOINTS_DIR / ckpt, "model.checkpoint (relative to registry/checkpoints/)"
    if not models_root:
        if not required:
            return Path("$LLM_MODELS_ROOT") / entry.checkpoint, "models_root / $LLM_MODELS_ROOT"
        raise UserError(
            f"entry {entry.name} needs models_root: its checkpoint '{entry.checkpoint}' is relative to it",
            "set $LLM_MODELS_ROOT or pass models_root=/path/to/models (the folder that holds "
            f"{entry.checkpoint}/), or model.checkpoint=/absolute/path",
        )
    return Path(os.path.expanduser(models_root)) / ckpt, "models_root / $LLM_MODELS_ROOT + model.checkpoint"


def resolve_speculation(entry: ModelEntry, run: RunConfig) -> tuple[int, bool]:
    """(draft_len K, ssm_replay) of a run: the entry's, or the top-level overrides, checked together.

    The one statement of the rules that tie drafting, replay and compare together:
    - draft_len: None keeps the entry's (0 when its algorithm is none); 0 turns speculation off (plain
      greedy decoding); K >= 1 needs an entry with MTP weights (speculative.algorithm: mtp);
    - SSM replay commits recurrent state after a verify step, so it needs speculative decoding (K >= 1);
    - compare=replay runs ssm_replay=false and =true itself: it needs speculative decoding and takes no
      ssm_replay override; the first arm (ssm_replay False) is returned.
    Raises UserError with the setting to change.
    """
    spec = entry.speculative
    spec_on = spec.algorithm != SpecAlgorithm.none and spec.draft_len > 0
    if run.draft_len is None:
        draft_len = spec.draft_len if spec_on else 0
    elif run.draft_len < 0:
        raise UserError(f"draft_len must be >= 0 or null, got {run.draft_len}",
                        "set draft_len=0 (speculation off), draft_len=K (K MTP drafts per step) or null")
    elif run.draft_len > 0 and spec.algorithm == SpecAlgorithm.none:
        raise UserError(
            f"draft_len={run.draft_len} needs MTP speculative decoding, but entry {entry.name} has "
            "speculative.algorithm=none",
            "use an entry with MTP weights (a *_mtp entry), or drop draft_len",
        )
    else:
        draft_len = run.draft_len
    if run.compare is not None:
        if run.compare not in COMPARE_MODES:
            raise UserError(f"compare={run.compare} is not a comparison this runner knows",
                            "use compare=replay (SSM rewind vs replay on the same samples), or compare=null")
        if draft_len == 0:
            raise UserError(
                f"compare=replay needs speculative decoding, but draft_len is 0 for entry {entry.name}",
                "drop draft_len=0, or use an entry with speculative.algorithm: mtp",
            )
        if run.ssm_replay is not None:
            raise UserError(f"compare=replay runs both ssm_replay=false and ssm_replay=true, so "
                            f"ssm_replay={str(run.ssm_replay).lower()} has no meaning here",
                            "drop the ssm_replay override (or drop compare=replay to run one arm)")
        return draft_len, False
    ssm_replay = entry.ssm.replay if run.ssm_replay is None else run.ssm_replay
    if ssm_replay and draft_len == 0:
        if not spec_on:
            why = f"entry {entry.name} has speculative.algorithm={spec.algorithm.value}"
            fix = "drop ssm_replay=true, or use an entry with speculative.algorithm: mtp and draft_len >= 1"
        else:
            why = "draft_len=0 turns speculation off"
            if run.ssm_replay:
                fix = "drop ssm_replay=true, or drop draft_len=0"
            else:
                fix = f"add ssm_replay=false (entry {entry.name} sets ssm.replay: true), or drop draft_len=0"
        raise UserError(f"ssm_replay requires speculative decoding, but {why}", fix)
    return draft_len, ssm_replay


def check_forced_acceptance(length: float | None, *, dummy: bool, draft_len: int) -> None:
    """runtime.forced_acceptance_length's rules: dummy weights only (with real weights it would replace the
    greedy comparison of the drafts and so change the answers), speculative decoding on, and a length in
    [1, draft_len + 1] (runners.engine.step.ForcedAcceptance's range). Raises UserError naming the fix."""
    if length is None:
        return
    name = f"runtime.forced_acceptance_length={length}"
    if not dummy:
        raise UserError(f"{name} replaces the comparison of the drafts with the target's greedy tokens, so "
                        "the answers would no longer be the model's: it is for dummy weights only, whose "
                        "drafts accept nothing", "drop runtime.forced_acceptance_length (null), or add "
                        "model.load_format=dummy to time MTP at that acceptance length")
    if draft_len < 1:
        raise UserError(f"{name} needs speculative decoding, and this run drafts nothing (draft_len=0)",
                        "use an _mtp entry or set draft_len=3, or drop runtime.forced_acceptance_length")
    if not acceptance_length_in_range(length, draft_len):
        hint = (" (TensorRT-LLM's CI records 3.47 for Super V3 NVFP4 with three drafts)"
                if draft_len >= 3 else "")
        raise UserError(f"{name} is outside [1, draft_len + 1 = {draft_len + 1}]: a step accepts 0 to "
                        f"{draft_len} drafts plus the target's own token",
                        f"set runtime.forced_acceptance_length to a value in [1, {draft_len + 1}]{hint}")


def dummy_folder_given(entry: ModelEntry, models_root: str | None) -> bool:
    """Whether a ``model.load_format=dummy`` run names a checkpoint folder, whose config.json it must then
    read: an embedded entry's (registry/checkpoints/, always its own config.json), an absolute
    ``checkpoint``, or a relative one under a set models_root. Only a release entry's relative checkpoint
    without models_root leaves the folder unnamed: then the entry's released configuration is built
    (registry.releases.release_hybrid_config). A typo in a named folder must not switch to the release."""
    return (entry.embedded or Path(os.path.expanduser(entry.checkpoint)).is_absolute()
            or bool(models_root))


def check_quant_agrees(entry: ModelEntry, config: HybridConfig, name: str) -> None:
    """The entry's ``quant`` must be the weight quantization the checkpoint declares (config.json's
    quantization_config / hf_quant_config.json, ``HybridConfig.quantization``): an fp8 entry on a bf16
    checkpoint would be judged against fp8 baseline rows while running bf16 weights, and the reverse.
    ``kv_cache_quant`` is a run setting and may differ (an FP8 KV cache on a checkpoint without k / v scales
    runs with scale 1.0 and a warning; a checkpoint's scales are unused with ``kv_cache_quant: none``).

    Raises:
        UserError: the two disagree (names both and the entry or checkpoint to use instead).
    """
    q = config.quantization
    have = q.method if q is not None else "none"
    if entry.quant.value == have:
        return
    where = (f"{q.source} ({q.format} {q.algo})" if q is not None
             else f"{config.source} (no quantization_config)")
    raise _with_model_overrides(UserError(
        f"{entry_file(name)} sets quant: {entry.quant.value}, but the checkpoint is quant {have}: {where}",
        f"use an entry with quant: {have} (or model.quant={have}), or point model.checkpoint at "
        + {"none": "an unquantized checkpoint",
           "fp8": "an FP8 checkpoint (python -m runners.tools.quantize --fp8 SRC DST writes one)"}.get(
            entry.quant.value, f"a {entry.quant.value} checkpoint"),
    ))


def resolve(cfg: DictConfig, *, entry_name: str | None = None, check_checkpoint: bool = True) -> ResolvedRun:
    """Check a composed config and compute the effective settings of the run.

    entry_name: the registry entry (file) composed as `model`; default: Hydra's choice, else model.name.
    check_checkpoint=False: no models_root needed and no checkpoint directory checks (registry validation on
    machines without the weights); a config.json that is there is still read and checked.
    Raises UserError for: an interpolation that does not resolve or a `???` value
    (registry.compose.check_composed), a bad registry entry or top-level value, the cross-setting rules of
    resolve_speculation, a world_size that cannot shard the model's heads / intermediate
    sizes, a missing / incomplete checkpoint, an entry arch: block, num_nextn_predict_layers or quant that
    disagrees with the checkpoint's config.json (check_quant_agrees); for model.load_format=dummy, a
    world_size > 1 and a named checkpoint folder (dummy_folder_given) without config.json.
    """
    check_composed(cfg, _task_overrides())
    name = entry_name or hydra_choice("model") or OmegaConf.select(cfg, "model.name", default=None)
    if name not in entry_names():
        raise unknown_entry_error(str(name))
    try:
        entry = validate_entry(cfg.model, name=name)
    except UserError as e:
        raise _with_model_overrides(e) from None
    run = run_config(cfg)
    check_run_values(run)
    draft_len, ssm_replay = resolve_speculation(entry, run)
    world_size = entry.world_size if run.world_size is None else run.world_size

    # With an arch: block, check before the checkpoint: it holds on machines without the weights.
    if entry.arch is not None:
        check_world_size(entry.arch, world_size, name)
    dummy = entry.load_format == LoadFormat.dummy
    if dummy and world_size > 1:  # refused here, before any rank is spawned (runners.engine.launch)
        raise UserError(
            f"model.load_format=dummy with world_size={world_size}: dummy weights are built on one device",
            "pass world_size=1 (dummy weights are not sharded over ranks)",
        )
    check_forced_acceptance(run.runtime.forced_acceptance_length, dummy=dummy, draft_len=draft_len)
    checkpoint_dir, setting = checkpoint_path(entry, run.models_root, required=check_checkpoint and not dummy)
    has_config = (checkpoint_dir / CONFIG_FILE).is_file()
    if dummy and check_checkpoint and not has_config and dummy_folder_given(entry, run.models_root):
        raise _with_model_overrides(UserError(
            f"model.load_format=dummy reads config.json from the checkpoint folder {checkpoint_dir} "
            f"({setting}), but "
            + (f"it has no {CONFIG_FILE}" if checkpoint_dir.is_dir() else "it does not exist"),
            "correct model.checkpoint=DIR (a folder with the model's config.json), or "
            + ("leave model.checkpoint unset (the entry's own checkpoint under registry/checkpoints/)"
               if entry.embedded else "leave model.checkpoint and models_root unset to build the entry's "
               "released configuration"),
        ))
    ckpt_config = HybridConfig.from_pretrained(checkpoint_dir) if has_config else None
    if dummy and ckpt_config is None:  # dummy weights without the folder: the entry's released configuration
        try:
            ckpt_config = release_hybrid_config(entry.family.value, entry.quant.value,
                                                entry.kv_cache_quant.value)
        except FormatError as e:
            raise _with_model_overrides(UserError(
                f"{entry_file(name)}: model.load_format=dummy without a checkpoint folder needs the released "
                f"configuration, but {e}",
                f"put the checkpoint's config.json into {checkpoint_dir} (model.checkpoint=DIR), or use an "
                "entry of a released format",
            )) from None
    arch = entry.arch
    if ckpt_config is not None:
        if ckpt_config.family != entry.family.value:
            raise _with_model_overrides(UserError(
                f"{entry_file(name)} has family {entry.family.value}, but {ckpt_config.source} is a "
                f"{ckpt_config.family} checkpoint (model_type)",
                "point model.checkpoint at a checkpoint of the entry's family, or use an entry of that "
                "family",
            ))
        ckpt_arch = arch_from_config(ckpt_config)
        if arch is not None and (mismatch := arch_mismatch(arch, ckpt_arch)):
            raise UserError(
                f"{entry_file(name)} arch: block disagrees with {ckpt_config.source}: {'; '.join(mismatch)}",
                "fix the arch: block (or set arch: null for an embedded checkpoint to read config.json)",
            )
        if arch is None:
            arch = ckpt_arch
        check_world_size(ckpt_config, world_size, name)  # heads and the intermediate sizes of config.json
        n_entry, n_ckpt = entry.speculative.num_nextn_predict_layers, ckpt_config.num_nextn_predict_layers
        if n_entry != n_ckpt:
            raise _with_model_overrides(UserError(
                f"{entry_file(name)}: speculative.num_nextn_predict_layers is {n_entry}, but "
                f"{ckpt_config.source} declares {n_ckpt} MTP module(s)",
                f"set speculative.num_nextn_predict_layers: {n_ckpt} (the checkpoint's MTP module count)",
            ))
        check_quant_agrees(entry, ckpt_config, name)
    if check_checkpoint and not dummy:  # dummy weights read at most config.json
        check_checkpoint_dir(checkpoint_dir, setting)

    return ResolvedRun(
        entry=entry,
        run=run,
        ssm_replay=ssm_replay,
        world_size=world_size,
        draft_len=draft_len,
        device=run.runtime.device,
        dtype=(run.runtime.dtype or entry.dtype).value,
        max_batch_size=run.eval.batch_size or entry.max_batch_size,
        checkpoint_dir=checkpoint_dir,
        checkpoint_setting=setting,
        arch=arch,
        checkpoint_config=ckpt_config,
    )
