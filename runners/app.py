"""The application: a composed Hydra config in, one judged GSM8K evaluation run and its report out.

`run(cfg)` is what run.py and the tests call. It validates the config (registry schema, top-level schema,
cross-setting rules), resolves the effective settings (top-level ssm_replay / draft_len / world_size override
the entry's), checks the checkpoint directory and that a baseline row exists, builds the engine, evaluates
GSM8K (resumable: evals.gsm8k streams every finished request to disk), judges the scores against the
baselines (evals.verdict), and writes results.json (docs/results_schema.md), summary.md and plots
(evals.report). `compare=replay` runs the rewind and the replay arm and compares them (evals.compare).
`exit_code(results)` is the process status. Every problem the user can fix raises runners.errors.UserError
before anything heavy is loaded. The engine and the evaluation are imported inside run(), so composing,
`--cfg job` and validation work without them (and without torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from registry.arch import check_world_size, read_checkpoint_arch
from registry.schema import (
    EMBEDDED_CHECKPOINTS_DIR,
    ArchConfig,
    DType,
    ModelEntry,
    SpecAlgorithm,
    SSMBackend,
    check_entry_file,
    entry_names,
    unknown_entry_error,
    validate_entry,
)
from runners.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
RESULTS_SCHEMA_VERSION = 1


# ----------------------------------------------------------------------------------------------------------
# Top-level schema (everything but the `model` node, which registry.schema checks)


@dataclass
class EvalConfig:
    name: str = "gsm8k"
    limit: int | None = None
    num_fewshot: int = 5
    max_gen_toks: int = 256
    data_dir: str | None = None
    batch_size: int | None = None


@dataclass
class RuntimeConfig:
    device: str = "cpu"
    dtype: DType | None = None
    # torch intra-op threads; null: torch's default (one per core). See configs/runtime/cpu.yaml.
    num_threads: int | None = None


@dataclass
class VerdictConfig:
    # A run whose (dtype, quant, kv_cache_quant, spec_dec) matches no baseline row is an error unless False.
    require_reference: bool = True


@dataclass
class AppConfig:
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    ssm_replay: bool | None = None
    draft_len: int | None = None  # MTP drafts per step; 0: speculation off; null: the entry's
    compare: str | None = None  # "replay": run ssm_replay=false and =true on the same samples and compare
    world_size: int | None = None
    models_root: str | None = None
    resume: bool = False
    seed: int = 0
    out_dir: str | None = None


@dataclass
class ResolvedRun:
    """The effective settings of one run, after every default and override is applied."""

    entry: ModelEntry
    app: AppConfig
    ssm_replay: bool
    world_size: int
    draft_len: int
    device: str
    dtype: str  # compute dtype: runtime.dtype, else the entry's
    max_batch_size: int
    checkpoint_dir: Path
    checkpoint_setting: str  # which setting points at checkpoint_dir (for error messages)
    arch: ArchConfig | None  # None only when an embedded checkpoint is not there yet

    @property
    def ssm_backend(self) -> str:
        """The recurrent-kernel backend asked of the engine: the entry's on a GPU; "torch" (the kernels'
        PyTorch references) on the CPU, where the Triton interpreter would be orders of magnitude slower."""
        return self.entry.ssm.backend.value if self.device.startswith("cuda") else "torch"

    @property
    def ssm_replay_checkpointing(self) -> bool:
        """The entry's checkpointing replay variant, in effect only when the run replays."""
        return self.ssm_replay and self.entry.ssm.replay_checkpointing

    @property
    def spec_dec(self) -> str:
        """The speculative algorithm as the baseline files name it: "mtp" when drafting, else "none"."""
        return self.entry.speculative.algorithm.value if self.draft_len > 0 else "none"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (enums as their values, paths as strings)."""
        return {
            "model": _plain(self.entry),
            "ssm_replay": self.ssm_replay,
            "world_size": self.world_size,
            "draft_len": self.draft_len,
            "device": self.device,
            "dtype": self.dtype,
            "max_batch_size": self.max_batch_size,
            "ssm_backend": self.ssm_backend,
            "ssm_replay_checkpointing": self.ssm_replay_checkpointing,
            "checkpoint_dir": str(self.checkpoint_dir),
            "arch": _plain(self.arch) if self.arch is not None else None,
            "eval": _plain(self.app.eval),
            "seed": self.app.seed,
            "resume": self.app.resume,
            "compare": self.app.compare,
            "require_reference": self.app.verdict.require_reference,
        }


def _plain(obj: Any) -> Any:
    return OmegaConf.to_container(OmegaConf.structured(obj), enum_to_str=True)


# ----------------------------------------------------------------------------------------------------------
# Validation and resolution


def hydra_choice(group: str) -> str | None:
    """The option chosen for a config group (e.g. the registry entry name), when Hydra's run is active."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def _with_model_overrides(e: UserError) -> UserError:
    """An entry check names the registry file; when model.* overrides were given, they may be the cause."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return e
    given = [o for o in HydraConfig.get().overrides.task if o.lstrip("+~").startswith("model.")]
    if not given:
        return e
    fix = e.fix if "override" in e.fix else f"{e.fix}; or change the override"
    return UserError(f"{e.problem} (the entry as changed by the override(s) {' '.join(given)})", fix)


def _validate_app(cfg: DictConfig) -> AppConfig:
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("model", None)
    raw.pop("hydra", None)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AppConfig), raw))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        if "not in" in msg and "Key '" in msg:
            allowed = [f.name for f in dataclasses.fields(AppConfig)]
            close = difflib.get_close_matches(key.split(".")[-1], allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return_error = UserError(f"unknown config key '{key}'{hint}", f"use one of: {', '.join(allowed)}")
        else:
            fix = f"set {key} to {_expected_type(key)} (schema: runners/app.py)"
            return_error = UserError(f"bad value for '{key}': {msg}", fix)
        raise return_error from None


def _expected_type(key: str) -> str:
    """'true or false', 'an integer or null', ... for a dotted key of AppConfig."""
    import typing

    cls: Any = AppConfig
    hint: Any = None
    for part in key.split("."):
        hint = typing.get_type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
        cls = hint
    args = set(typing.get_args(hint)) or {hint}
    words = {bool: "true or false", int: "an integer", str: "a string", DType: "float32, bfloat16 or float16"}
    names = [w for t, w in words.items() if t in args]
    return " or ".join(names + (["null"] if type(None) in args else [])) or "a value of the right type"


def resolve_checkpoint(entry: ModelEntry, models_root: str | None) -> tuple[Path, str]:
    """(checkpoint directory, the setting that points there) for an entry.

    An absolute `checkpoint` is used as is; a relative one lies under registry/checkpoints/ for embedded
    entries and under models_root ($LLM_MODELS_ROOT) otherwise. Raises UserError when models_root is needed
    but unset.
    """
    ckpt = Path(os.path.expanduser(entry.checkpoint))
    if ckpt.is_absolute():
        return ckpt, "model.checkpoint"
    if entry.embedded:
        return EMBEDDED_CHECKPOINTS_DIR / ckpt, "model.checkpoint (relative to registry/checkpoints/)"
    if not models_root:
        raise UserError(
            f"entry {entry.name} needs models_root: its checkpoint '{entry.checkpoint}' is relative to it",
            "set $LLM_MODELS_ROOT or pass models_root=/path/to/models (the folder that holds "
            f"{entry.checkpoint}/), or model.checkpoint=/absolute/path",
        )
    return Path(os.path.expanduser(models_root)) / ckpt, "models_root / $LLM_MODELS_ROOT + model.checkpoint"


def check_checkpoint_dir(path: Path, setting: str) -> None:
    """Raise UserError unless `path` is a complete HF checkpoint directory.

    Needs config.json, tokenizer.json and the weights: model.safetensors, or model.safetensors.index.json
    plus every shard it lists.
    """
    if not path.is_dir():
        raise UserError(
            f"checkpoint directory {path} does not exist (set by {setting})",
            "point model.checkpoint at an HF checkpoint directory, or set models_root / $LLM_MODELS_ROOT to "
            "the folder that holds it (embedded tiny checkpoints: python -m runners.tiny rebuilds them)",
        )
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise UserError(
                f"checkpoint directory {path} has no {name} (set by {setting})",
                f"copy the complete checkpoint (with {name}) there, or point model.checkpoint elsewhere",
            )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise UserError(
                f"checkpoint directory {path} is incomplete: {len(missing)} of {len(shards)} weight shards "
                f"listed in model.safetensors.index.json are missing, e.g. {missing[0]} (set by {setting})",
                "finish downloading the checkpoint (every shard of the index), or point model.checkpoint "
                "elsewhere",
            )
    elif not (path / "model.safetensors").is_file():
        raise UserError(
            f"checkpoint directory {path} has no weights: neither model.safetensors nor "
            f"model.safetensors.index.json (set by {setting})",
            "copy the safetensors weights there, or point model.checkpoint elsewhere",
        )


def _arch_mismatch(entry_arch: ArchConfig, ckpt_arch: ArchConfig) -> list[str]:
    a, b = _plain(entry_arch), _plain(ckpt_arch)

    def diff(x: Any, y: Any, prefix: str) -> list[str]:
        if isinstance(x, dict) and isinstance(y, dict):
            return [d for k in x for d in diff(x[k], y.get(k), f"{prefix}{k}.")]
        return [] if x == y else [f"{prefix[:-1]}: entry {x}, config.json {y}"]

    return diff(a, b, "arch.")


def resolve(
    cfg: DictConfig,
    *,
    entry_name: str | None = None,
    check_checkpoint: bool = True,
    check_runtime: bool = True,
) -> ResolvedRun:
    """Validate a composed config and compute the effective settings of the run.

    entry_name: the registry entry (file) composed as `model`; default: Hydra's choice, else model.name.
    check_checkpoint=False skips the checkpoint directory checks and check_runtime=False the device / engine
    checks of world_size > 1 (registry validation on machines without the weights or GPUs).
    Raises UserError for: a bad registry entry or top-level value, ssm_replay without speculative decoding,
    a world_size that cannot shard the model's heads / experts, world_size > 1 where the engine cannot run
    it, a missing / incomplete checkpoint, an entry arch: block that disagrees with config.json.
    """
    name = entry_name or hydra_choice("model") or OmegaConf.select(cfg, "model.name", default=None)
    if name not in entry_names():
        raise unknown_entry_error(str(name))
    check_entry_file(name)
    try:
        entry = validate_entry(cfg.model, name=name)
    except UserError as e:
        raise _with_model_overrides(e) from None
    app = _validate_app(cfg)

    draft_len = _resolve_draft_len(entry, app.draft_len)
    ssm_replay = entry.ssm.replay if app.ssm_replay is None else app.ssm_replay
    if app.compare is not None:
        _check_compare(app, draft_len, name)
        ssm_replay = False  # the first arm; run() runs the second with ssm_replay=True
    if ssm_replay and draft_len == 0:
        if entry.speculative.algorithm == SpecAlgorithm.none or entry.speculative.draft_len == 0:
            why = f"entry {name} has speculative.algorithm={entry.speculative.algorithm.value}"
            fix = "drop ssm_replay=true, or use an entry with speculative.algorithm: mtp and draft_len >= 1"
        else:
            why = "draft_len=0 turns speculation off"
            if app.ssm_replay:
                fix = "drop ssm_replay=true, or drop draft_len=0"
            else:
                fix = f"add ssm_replay=false (entry {name} sets ssm.replay: true), or drop draft_len=0"
        raise UserError(f"ssm_replay requires speculative decoding, but {why}", fix)
    world_size = entry.world_size if app.world_size is None else app.world_size
    if world_size < 1:
        raise UserError(f"world_size must be >= 1, got {world_size}", "set world_size=1 (or the GPU count)")

    if app.eval.limit is not None and app.eval.limit < 1:
        raise UserError(f"eval.limit must be >= 1 or null, got {app.eval.limit}", "set eval.limit=N or null")
    if app.eval.batch_size is not None and app.eval.batch_size < 1:
        raise UserError(f"eval.batch_size must be >= 1, got {app.eval.batch_size}", "set eval.batch_size=N")
    if app.runtime.device not in ("cpu", "cuda") and not app.runtime.device.startswith("cuda:"):
        raise UserError(
            f"runtime.device must be cpu or cuda[:N], got {app.runtime.device!r}",
            "use runtime=cpu or runtime=gpu",
        )

    # a runtime fact (validate composes GPU entries on machines without one)
    if check_runtime and app.runtime.device == "cpu" and entry.ssm.backend == SSMBackend.flashinfer:
        raise UserError(
            f"entry {name} uses ssm.backend=flashinfer, which runs only on CUDA GPUs; runtime.device is cpu",
            "use runtime=gpu, or model.ssm.backend=torch (on the CPU the PyTorch references run anyway)",
        )

    def check_sharding(arch: ArchConfig | None) -> None:
        if arch is not None:
            check_world_size(arch, world_size, name)
        if world_size > 1 and check_runtime:
            _check_parallel_runtime(world_size, app.runtime.device)

    # With an arch: block, check before the checkpoint: it holds on machines without the weights.
    if entry.arch is not None:
        check_sharding(entry.arch)
    if check_checkpoint:
        checkpoint_dir, setting = resolve_checkpoint(entry, app.models_root)
    else:
        checkpoint_dir, setting = _resolve_checkpoint_lenient(entry, app.models_root)
    arch = entry.arch
    ckpt_config = checkpoint_dir / "config.json"
    ckpt_arch = read_checkpoint_arch(checkpoint_dir, entry.family) if ckpt_config.is_file() else None
    if arch is not None and ckpt_arch is not None and (mismatch := _arch_mismatch(arch, ckpt_arch)):
        raise UserError(
            f"registry/model/{name}.yaml arch: block disagrees with {ckpt_config}: {'; '.join(mismatch)}",
            "fix the arch: block (or set arch: null for an embedded checkpoint to read config.json)",
        )
    if arch is None:
        arch = ckpt_arch  # None only while an embedded checkpoint is not built
        check_sharding(arch)
    if check_checkpoint:
        check_checkpoint_dir(checkpoint_dir, setting)

    return ResolvedRun(
        entry=entry,
        app=app,
        ssm_replay=ssm_replay,
        world_size=world_size,
        draft_len=draft_len,
        device=app.runtime.device,
        dtype=(app.runtime.dtype or entry.dtype).value,
        max_batch_size=app.eval.batch_size or entry.max_batch_size,
        checkpoint_dir=checkpoint_dir,
        checkpoint_setting=setting,
        arch=arch,
    )


def _resolve_draft_len(entry: ModelEntry, override: int | None) -> int:
    """Drafts per MTP step: the entry's (0 when its algorithm is none), or the top-level override.

    override None keeps the entry's; 0 turns speculation off (plain greedy decoding); K >= 1 needs an entry
    with MTP weights (speculative.algorithm: mtp). Raises UserError otherwise.
    """
    spec_on = entry.speculative.algorithm != SpecAlgorithm.none and entry.speculative.draft_len > 0
    if override is None:
        return entry.speculative.draft_len if spec_on else 0
    if override < 0:
        raise UserError(f"draft_len must be >= 0 or null, got {override}",
                        "set draft_len=0 (speculation off), draft_len=K (K MTP drafts per step) or null")
    if override > 0 and entry.speculative.algorithm == SpecAlgorithm.none:
        raise UserError(
            f"draft_len={override} needs MTP speculative decoding, but entry {entry.name} has "
            "speculative.algorithm=none",
            "use an entry with MTP weights (a *_mtp entry), or drop draft_len",
        )
    return override


COMPARE_MODES = ("replay",)


def _check_compare(app: AppConfig, draft_len: int, name: str) -> None:
    if app.compare not in COMPARE_MODES:
        raise UserError(f"compare={app.compare} is not a comparison this runner knows",
                        "use compare=replay (SSM rewind vs replay on the same samples), or compare=null")
    if draft_len == 0:
        raise UserError(f"compare=replay needs speculative decoding, but draft_len is 0 for entry {name}",
                        "drop draft_len=0, or use an entry with speculative.algorithm: mtp")
    if app.ssm_replay is not None:
        raise UserError(f"compare=replay runs both ssm_replay=false and ssm_replay=true, so "
                        f"ssm_replay={str(app.ssm_replay).lower()} has no meaning here",
                        "drop the ssm_replay override (or drop compare=replay to run one arm)")


def _resolve_checkpoint_lenient(entry: ModelEntry, models_root: str | None) -> tuple[Path, str]:
    try:
        return resolve_checkpoint(entry, models_root)
    except UserError:  # no models_root on this machine: the path is only informative here
        return Path("$LLM_MODELS_ROOT") / entry.checkpoint, "models_root / $LLM_MODELS_ROOT"


def _check_parallel_runtime(world_size: int, device: str) -> None:
    engine_cls = _engine_class()
    import inspect

    # the engine first: while it has no tensor parallelism, a device hint would only lead to this refusal
    if "world_size" not in inspect.signature(engine_cls.from_pretrained).parameters:
        raise UserError(
            f"world_size={world_size}: the engine (runners.Engine) does not implement tensor parallelism yet",
            "run with world_size=1 (the registry's _ws4 entries compose and check head divisibility only)",
        )
    if device == "cpu":
        raise UserError(
            f"world_size={world_size} on the CPU: the engine runs tensor parallelism only across CUDA GPUs",
            "use world_size=1 on the CPU, or runtime=gpu on a host with that many GPUs",
        )
    import torch

    num_gpus = torch.cuda.device_count()
    if num_gpus < world_size:
        raise UserError(
            f"world_size={world_size} needs {world_size} CUDA GPUs, this host has {num_gpus}",
            f"run on a host with {world_size} GPUs, or set world_size={max(1, num_gpus)}",
        )


# ----------------------------------------------------------------------------------------------------------
# The run


def _engine_class():
    from runners import Engine  # lazy: the engine pulls in torch and the model code

    return Engine


def _evaluate_fn():
    from evals.gsm8k import evaluate_gsm8k  # lazy: lm-eval and datasets

    return evaluate_gsm8k


def git_commit(repo: Path = REPO_ROOT) -> tuple[str | None, bool]:
    """(HEAD's commit of the checkout, whether tracked files changed); (None, False) outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return None, False


def _out_dir(app: AppConfig, entry_name: str) -> Path:
    if app.out_dir:
        return Path(app.out_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return REPO_ROOT / "outputs" / entry_name / time.strftime("%Y-%m-%d_%H-%M-%S")


def _stats_dict(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    if hasattr(stats, "to_dict"):
        return dict(stats.to_dict())
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return dict(stats)


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


# GSM8K beside the checkout (the layout of the project's machines and CI: ../shared/data/gsm8k).
SIBLING_GSM8K_DIR = REPO_ROOT.parent / "shared" / "data" / "gsm8k"


def gsm8k_data_dir(configured: str | None) -> str | None:
    """The GSM8K folder to pass to evals.gsm8k: eval.data_dir; else None when $GSM8K_DIR is set (evals reads
    it and names it in its errors); else ../shared/data/gsm8k beside the checkout when it holds test.jsonl;
    else None (evals.gsm8k then tries the hub dataset openai/gsm8k)."""
    if configured:
        return str(configured)
    if os.environ.get("GSM8K_DIR"):
        return None  # evals.gsm8k reads $GSM8K_DIR itself, so its errors name the variable
    if (SIBLING_GSM8K_DIR / "test.jsonl").is_file():
        return str(SIBLING_GSM8K_DIR)
    return None


def _raised_in(e: BaseException) -> str:
    """Module name of the frame that raised `e` (a builtin ValueError's type says nothing about that)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""


@contextlib.contextmanager
def _user_errors(setting: str):
    """Turn the loader's, the evaluation's and the baselines' input errors into UserError (no traceback).

    Errors carrying .problem / .fix (GSM8KDataError, BaselineError) keep them; CheckpointError and the
    engine's option ValueErrors carry the fix in their message, so the fix line names the setting to change.
    """
    from runners.loader import CheckpointError

    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if hasattr(e, "problem") and hasattr(e, "fix"):
            raise UserError(e.problem, e.fix) from None
        if isinstance(e, CheckpointError | ValueError) and _raised_in(e).startswith(("runners.", "evals.")):
            raise UserError(str(e), f"check {setting}") from None
        raise


GENERATIONS_FILE = "generations.jsonl"  # evals.gsm8k's resume file (one line per finished request)
COMPARE_ARMS = ("rewind", "replay")  # compare=replay: sub-folders of out_dir, ssm_replay false / true


def check_references(rr: ResolvedRun) -> None:
    """Fail fast, before anything heavy is loaded, when no baseline row can judge the run.

    With verdict.require_reference (the default) the entry needs a `baseline` key and gsm8k.yaml needs a
    row for (dtype, quant, kv_cache_quant, spec_dec) -- and acceptance.yaml one for (quant, draft_len) when
    speculation is on. A placeholder row (measured: false) counts as found: the run then reports "no
    reference yet". Raises UserError naming the missing row and the fix.
    """
    if not rr.app.verdict.require_reference:
        return
    from evals.baselines import BaselineError, find_acceptance_reference, find_gsm8k_reference

    e = rr.entry
    if e.baseline is None:
        raise UserError(
            f"entry {e.name} has no `baseline` key, so no reference can judge this run",
            "set baseline: <model key of registry/baselines/gsm8k.yaml> in the entry, or pass "
            "verdict.require_reference=false to run without a pass/fail verdict",
        )
    try:
        find_gsm8k_reference(e.baseline, rr.dtype, e.quant.value, e.kv_cache_quant.value, rr.spec_dec)
        if rr.draft_len > 0:
            find_acceptance_reference(e.baseline, e.quant.value, rr.draft_len)
    except BaselineError as err:
        raise UserError(err.problem, err.fix) from None


def _check_tokenizer(path: Path) -> None:
    """Load the checkpoint's tokenizer.json once before the model, so a broken one is a UserError."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise UserError(
            f"{path} cannot be loaded by the tokenizers library: {e}",
            "restore the checkpoint's tokenizer.json (or point model.checkpoint at a complete one)",
        ) from None


def _backend_note(config: dict[str, Any]) -> str:
    """The backend that ran, and the entry's when that differs (the CPU runs the PyTorch references; the
    engine falls back from flashinfer to triton where FlashInfer cannot run)."""
    ran = config.get("ssm_backend", "?")
    asked = ((config.get("model") or {}).get("ssm") or {}).get("backend")
    if asked is None or asked == ran:
        return ran
    why = "the CPU runs the PyTorch references" if config.get("device") == "cpu" else "fallback, see the log"
    return f"{ran} (entry: {asked}; {why})"


# fingerprint keys added after runs were written without them: absent from a stored fingerprint = not checked
_FINGERPRINT_KEYS_ADDED = frozenset({"ssm_backend", "ssm_replay_checkpointing"})


def _check_out_dir(out_dir: Path, resume: bool, fp: dict[str, Any]) -> None:
    """Refuse to overwrite or to mix runs, before the model is loaded.

    Without resume, an out_dir holding an earlier run's generations is an error; with resume, the stored
    fingerprint (generations.meta.json, written by evals.gsm8k) must equal `fp`. Raises UserError.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output folder {out_dir} exists and is not a folder",
                        "choose another out_dir= / hydra.run.dir=")
    gen = out_dir / GENERATIONS_FILE
    if not resume and gen.is_file() and gen.stat().st_size > 0:
        raise UserError(
            f"{out_dir} already holds generations of an earlier run ({gen})",
            "pass resume=true to continue that run (finished samples are kept), or choose another out_dir= "
            "/ hydra.run.dir=",
        )
    meta = out_dir / "generations.meta.json"
    if resume and meta.is_file():
        try:
            stored = json.loads(meta.read_text()).get("fingerprint") or {}
        except (json.JSONDecodeError, AttributeError):
            stored = None
        if stored is None:
            raise UserError(f"{meta} is unreadable, so the run cannot be resumed safely",
                            "choose another out_dir= / hydra.run.dir=, or delete that folder")
        now = json.loads(json.dumps(fp))
        keys = (stored.keys() | now.keys()) - (_FINGERPRINT_KEYS_ADDED - stored.keys())
        diff = sorted(k for k in keys if stored.get(k) != now.get(k))
        if diff:
            what = ", ".join(f"{k}: {stored.get(k)!r} then, {now.get(k)!r} now" for k in diff)
            raise UserError(
                f"cannot resume the run in {out_dir}: its generations were made with other settings ({what})",
                "resume with the settings of that run, or choose another out_dir= / hydra.run.dir=",
            )


def fingerprint(rr: ResolvedRun) -> dict[str, Any]:
    """The settings stored generations depend on; resuming with different ones is refused (evals.gsm8k).

    Included besides the engine settings: eval.num_fewshot and eval.max_gen_toks (they change the prompts and
    the generations, hence the acceptance counters) and the GSM8K data folder (absolute path; None = hub).
    Not included: the git commit (resuming across a code change is allowed; results.json records the commit
    of the finishing run), eval.limit (a resumed run may score more or fewer samples: evals.gsm8k reports the
    counters of exactly the scored ones), paths of the outputs.
    """
    data_dir = gsm8k_data_dir(rr.app.eval.data_dir)
    return {
        "entry": rr.entry.name,
        "checkpoint_dir": str(rr.checkpoint_dir),
        "device": rr.device,
        "dtype": rr.dtype,
        "ssm_state_dtype": rr.entry.ssm.state_dtype.value,
        "draft_len": rr.draft_len,
        "ssm_replay": rr.ssm_replay,
        "ssm_backend": rr.ssm_backend,
        "ssm_replay_checkpointing": rr.ssm_replay_checkpointing,
        "max_batch_size": rr.max_batch_size,
        "world_size": rr.world_size,
        "num_fewshot": rr.app.eval.num_fewshot,
        "max_gen_toks": rr.app.eval.max_gen_toks,
        "data_dir": str(Path(data_dir).expanduser().resolve()) if data_dir else None,
    }


def acceptance_section(stats: dict[str, Any], draft_len: int) -> dict[str, Any] | None:
    """results.json `acceptance` from the engine's raw sums (docs/results_schema.md); None if draft_len == 0.

    rate = accepted_drafts / drafted_tokens; length = 1 + accepted_drafts / request_steps; per_position[i] =
    accepted_per_position[i] / request_steps (fraction of request-steps whose draft i + 1 was accepted).
    Ratios are None when their denominator is 0. `requests_without_stats` counts scored requests of a killed
    and resumed part, whose steps are missing from the sums.
    """
    if draft_len == 0:
        return None
    drafted, accepted = int(stats.get("drafted_tokens", 0)), int(stats.get("accepted_drafts", 0))
    steps = int(stats.get("request_steps", 0))
    per_position = [int(x) for x in stats.get("accepted_per_position") or []]
    return {
        "draft_len": draft_len,
        "rate": _rate(accepted, drafted),
        "length": (1.0 + accepted / steps) if steps else None,
        "per_position": [x / steps for x in per_position] if steps else [0.0] * len(per_position),
        "drafted": drafted,
        "accepted": accepted,
        "request_steps": steps,
        "accepted_per_position": per_position,
        "num_accepted_hist": [int(x) for x in stats.get("num_accepted_hist") or []],
        "requests_without_stats": int(stats.get("requests_without_stats", 0)),
    }


def _build_engine(rr: ResolvedRun):
    import torch

    with _user_errors(f"model.checkpoint={rr.checkpoint_dir}"):
        return _engine_class().from_pretrained(
            str(rr.checkpoint_dir),
            device=rr.device,
            dtype=getattr(torch, rr.dtype),
            draft_len=rr.draft_len,
            ssm_replay=rr.ssm_replay,
            max_batch_size=rr.max_batch_size,
            max_seq_len=rr.entry.max_seq_len,
            ssm_state_dtype=getattr(torch, rr.entry.ssm.state_dtype.value),
            ssm_backend=rr.ssm_backend,
            ssm_replay_checkpointing=rr.ssm_replay_checkpointing,
        )


def _verdict(rr: ResolvedRun, results: dict[str, Any], extra_checks: list | None = None):
    """evals.verdict.Verdict of a results dict (plus extra checks, e.g. a comparison's)."""
    from evals.baselines import BaselineError
    from evals.verdict import Verdict, evaluate_verdict

    e = rr.entry
    try:
        verdict = evaluate_verdict(
            results,
            model_key=e.baseline or "",
            entry=e.name,
            dtype=rr.dtype,
            quant=e.quant.value,
            kv_cache_quant=e.kv_cache_quant.value,
            spec_dec=rr.spec_dec,
            draft_len=rr.draft_len,
            require_reference=rr.app.verdict.require_reference,
        )
    except BaselineError as err:
        raise UserError(err.problem, err.fix) from None
    return Verdict(verdict.checks + list(extra_checks or []))


def _evaluate_arm(cfg: DictConfig, rr: ResolvedRun, out_dir: Path) -> dict[str, Any]:
    """Build the engine, evaluate GSM8K into out_dir and return the results dict (without verdict)."""
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = _build_engine(rr)
    t_loaded = time.perf_counter()
    with _user_errors("the eval.* settings, model.max_seq_len, eval.data_dir / $GSM8K_DIR"):
        result = _evaluate_fn()(
            engine,
            str(rr.checkpoint_dir / "tokenizer.json"),
            data_dir=gsm8k_data_dir(rr.app.eval.data_dir),
            limit=rr.app.eval.limit,
            num_fewshot=rr.app.eval.num_fewshot,
            max_gen_toks=rr.app.eval.max_gen_toks,
            out_dir=str(out_dir),
            resume=rr.app.resume,
            progress=True,  # a bar on a terminal, a line every 30 s in a log (evals.lm_adapter)
            fingerprint=fingerprint(rr),
        )
    t_end = time.perf_counter()

    stats = _stats_dict(result.stats)
    config = rr.to_dict()
    # what ran: the engine can fall back from flashinfer (not importable, unverified sizes) to triton
    config["ssm_backend"] = getattr(engine, "ssm_backend", config["ssm_backend"])
    prefill_s, decode_s = stats.get("prefill_seconds", 0.0), stats.get("decode_seconds", 0.0)
    # throughput: the seconds cover every generate call of out_dir, so divide the tokens of those same calls
    prefill_tok = stats.get("timing_prompt_tokens", stats.get("prompt_tokens", 0))
    decode_tok = stats.get("timing_generated_tokens", stats.get("generated_tokens", 0))
    commit, dirty = git_commit()
    return {
        "schema_version": RESULTS_SCHEMA_VERSION,
        "entry": rr.entry.name,
        "model_key": rr.entry.baseline,
        "config": config,
        "composed_config": OmegaConf.to_container(cfg, resolve=True),
        "git_commit": commit,
        "git_dirty": dirty,
        "gsm8k": {k: result.scores[k] for k in ("strict_match", "flexible_extract", "n")},
        # lm-eval task version, few-shot settings, lm-eval version and the data source actually read
        "task": dict(getattr(result, "task", None) or {}),
        "acceptance": acceptance_section(stats, rr.draft_len),
        "memory": {k: int(v) for k, v in dict(engine.cache_memory()).items()},
        "timings": {
            "wall_seconds": t_end - t0,
            "load_seconds": t_loaded - t0,
            "eval_seconds": t_end - t_loaded,
            "prefill_seconds": prefill_s,
            "decode_seconds": decode_s,
            "prefill_tokens_per_s": _rate(prefill_tok, prefill_s),
            "decode_tokens_per_s": _rate(decode_tok, decode_s),
        },
        "generation": stats,
        "resumed": {
            "num_resumed": getattr(result, "num_resumed", 0),
            "num_generated": getattr(result, "num_generated", result.scores["n"]),
            "requests_without_stats": int(stats.get("requests_without_stats", 0)),
        },
        "verdict": None,
        "samples_path": str(getattr(result, "samples_path", out_dir / "samples.jsonl")),
    }


def _finish(results: dict[str, Any], out_dir: Path) -> None:
    """Write results.json, summary.md and the plots into out_dir; print the table and the paths."""
    from evals.report import write_report

    path = out_dir / "results.json"
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    files = write_report(results, out_dir)
    print(format_summary(results))
    print(f"results: {path}\nreport:  {files.summary}")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured GSM8K evaluation, judge it against its baselines, write results and report.

    cfg: a composed config (configs/config.yaml with a registry entry as `model`). Output folder: cfg.out_dir,
    else Hydra's run directory. It receives generations.jsonl (appended as requests finish; the resume file),
    samples.jsonl, results.json (docs/results_schema.md), summary.md and PNG plots. An out_dir that already
    holds generations is continued with resume=true and refused without it.

    compare=replay runs two arms on the same samples, ssm_replay=false into out_dir/rewind and ssm_replay=true
    into out_dir/replay, and writes out_dir/comparison.json plus a results.json / summary.md of the replay arm
    with the `comparison` section and the comparison's checks in its verdict.

    Returns the results dict written to out_dir/results.json; exit_code(results) is the process status.
    Raises UserError (before loading anything heavy) for every configuration problem (see resolve() and
    check_references()), and for a missing baseline row when verdict.require_reference is true.
    """
    rr = resolve(cfg)
    check_references(rr)
    out_dir = _out_dir(rr.app, rr.entry.name)
    # A folder holds one kind of run: a single run (generations.jsonl at the top) or a compare run (one
    # folder per arm); continuing or overwriting the other kind would mix or lose results.
    single = (out_dir / GENERATIONS_FILE).is_file()
    arms = [arm for arm in COMPARE_ARMS if (out_dir / arm / GENERATIONS_FILE).is_file()]
    if (rr.app.compare and single) or (not rr.app.compare and arms):
        held = "a single run" if single else "a compare=replay run"
        asked = "compare=replay" if single else "a single run"
        raise UserError(
            f"{out_dir} holds {held}; {asked} cannot be written or resumed there",
            "choose another out_dir= / hydra.run.dir=, or rerun with the settings of the run it holds",
        )
    if rr.app.compare:
        for arm, replay in zip(COMPARE_ARMS, (False, True)):
            arm_fp = fingerprint(dataclasses.replace(rr, ssm_replay=replay))
            _check_out_dir(out_dir / arm, rr.app.resume, arm_fp)
    else:
        _check_out_dir(out_dir, rr.app.resume, fingerprint(rr))
    _check_tokenizer(rr.checkpoint_dir / "tokenizer.json")

    if rr.device == "cpu":
        # Triton kernels run in its interpreter on the CPU; the switch is read when triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if rr.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"runtime.device is {rr.device} but CUDA is not available here", "use runtime=cpu")
    if rr.app.runtime.num_threads is not None:
        if rr.app.runtime.num_threads < 1:
            raise UserError(f"runtime.num_threads={rr.app.runtime.num_threads} must be >= 1 (or null)",
                            "set runtime.num_threads=1, or null for torch's default")
        torch.set_num_threads(rr.app.runtime.num_threads)

    if not rr.app.compare:
        torch.manual_seed(rr.app.seed)
        results = _evaluate_arm(cfg, rr, out_dir)
        results["verdict"] = _verdict(rr, results).to_dict()
        _finish(results, out_dir)
        return results
    return _run_compare_replay(cfg, rr, out_dir)


def _run_compare_replay(cfg: DictConfig, rr: ResolvedRun, out_dir: Path) -> dict[str, Any]:
    """compare=replay: the rewind arm, the replay arm, their paired comparison (see run())."""
    import torch

    from evals.compare import ComparisonError, compare_run_dirs, comparison_checks

    arm_results = {}
    for arm, replay in zip(COMPARE_ARMS, (False, True)):
        arm_rr = dataclasses.replace(rr, ssm_replay=replay)
        print(f"== arm {arm}: ssm_replay={str(replay).lower()} -> {out_dir / arm}")
        torch.manual_seed(rr.app.seed)
        res = _evaluate_arm(cfg, arm_rr, out_dir / arm)
        res["verdict"] = _verdict(arm_rr, res).to_dict()
        _finish(res, out_dir / arm)
        arm_results[arm] = (arm_rr, res)
    try:
        comparison = compare_run_dirs(out_dir / COMPARE_ARMS[0], out_dir / COMPARE_ARMS[1])
    except ComparisonError as err:
        raise UserError(str(err), "rerun both arms with the same settings into a fresh out_dir") from None
    # Replay and rewind commit the same recurrent state; in float32 any token difference is a bug. In 16-bit
    # the two orders of rounding may flip a few tokens, so only a significant accuracy difference fails.
    exact = rr.dtype == "float32" and rr.entry.ssm.state_dtype.value == "float32"
    checks = comparison_checks(comparison, exact=exact)
    comp = {**comparison.to_dict(), "exact": exact, "checks": [c.to_dict() for c in checks]}
    with open(out_dir / "comparison.json", "w") as f:
        json.dump(comp, f, indent=2)

    # The top-level verdict: the replay arm's checks, the rewind arm's (prefixed "rewind."), the comparison's.
    from evals.verdict import Check

    rewind_checks = []
    for c in arm_results[COMPARE_ARMS[0]][1]["verdict"]["checks"]:
        fields = {k: v for k, v in c.items() if k != "passed"}
        rewind_checks.append(Check(**{**fields, "name": f"{COMPARE_ARMS[0]}.{c['name']}"}))
    replay_rr, results = arm_results[COMPARE_ARMS[1]]
    results = dict(results)
    results["verdict"] = _verdict(replay_rr, results, rewind_checks + checks).to_dict()
    results["comparison"] = comp
    # The top level reports the replay arm; its wall time covers both arms (per-arm timings stay in the
    # arms' own results.json).
    results["timings"] = {**results["timings"], "wall_seconds": sum(
        r["timings"]["wall_seconds"] for _, r in arm_results.values()), "scope": "both arms"}
    print(f"== comparison {COMPARE_ARMS[0]} (A) vs {COMPARE_ARMS[1]} (B) -> {out_dir / 'comparison.json'}")
    _finish(results, out_dir)
    return results


def exit_code(results: dict[str, Any]) -> int:
    """Process status for a results dict: 1 when a verdict check failed, else 0.

    0 also covers "no reference yet" (placeholder rows) and runs with verdict.require_reference=false that
    matched no row: nothing failed. Configuration problems never get here (UserError, status 2).
    """
    verdict = results.get("verdict") or {}
    return 1 if verdict.get("passed") is False else 0


def format_summary(results: dict[str, Any]) -> str:
    """A short human-readable table of a results.json dict, ending with the verdict and its checks."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    def num(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:,.2f}{unit}"

    c, g, t = results["config"], results["gsm8k"], results["timings"]
    acc = results.get("acceptance") or {}
    mem = sum(v for v in results["memory"].values() if isinstance(v, int | float))
    resumed = results.get("resumed") or {}
    ckpt = " (checkpointing)" if c.get("ssm_replay_checkpointing") else ""
    rows = [
        ("model", f"{results['entry']} ({c['model']['family']}, {c['dtype']}, {c['device']})"),
        ("ssm_replay / world_size", f"{c['ssm_replay']}{ckpt} / {c['world_size']}"),
        ("ssm backend", _backend_note(c)),
        ("GSM8K strict-match", f"{pct(g['strict_match'])} (n={g['n']})"),
        ("GSM8K flexible-extract", pct(g["flexible_extract"])),
        ("draft length K", str(c["draft_len"]) + ("" if c["draft_len"] else " (speculation off)")),
        ("acceptance rate", pct(acc.get("rate"))),
        ("acceptance length", num(acc.get("length"), " tokens/step")),
        ("prefill", num(t["prefill_tokens_per_s"], " tok/s")),
        ("decode", num(t["decode_tokens_per_s"], " tok/s")),
        ("wall time", num(t["wall_seconds"], " s")),
        ("cache memory", f"{mem / 2**20:,.1f} MiB"),
    ]
    if resumed.get("num_resumed"):
        done, new = resumed["num_resumed"], resumed["num_generated"]
        rows.append(("resumed", f"{done} samples from disk, {new} generated now"))
    verdict = results.get("verdict")
    if verdict:
        word = {"pass": "PASS", "fail": "FAIL", "no_reference": "no reference yet"}[verdict["status"]]
        rows.append(("verdict", word))
        for ch in verdict["checks"]:
            rows.append((f"  {ch['name']}", _format_check(ch)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _format_check(ch: dict[str, Any]) -> str:
    digits = {"percent": 2, "samples": 0}.get(ch.get("unit"), 4)

    def f(x: Any) -> str:
        return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))

    if ch["status"] == "no_reference":
        why = (ch.get("note") or "no row").splitlines()[0]
        return f"{f(ch['value'])}: no reference ({why})"
    word = "pass" if ch["status"] == "pass" else "FAIL"
    ref = f", reference {f(ch['reference'])}" if ch.get("reference") is not None else ""
    if ch.get("unit") == "percent" and ch.get("threshold") is not None and ch["threshold"] <= 0:
        n = (ch.get("details") or {}).get("n")
        word += f" (cannot fail at n={n}: too few samples for this test)"
    return f"{f(ch['value'])} vs threshold {f(ch['threshold'])}{ref}: {word}"


# ----------------------------------------------------------------------------------------------------------
# Hydra-level problems, caught before Hydra composes (run.py)


def _group_options(group: str) -> list[str]:
    if group == "model":
        return entry_names()
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def preflight(overrides: list[str]) -> None:
    """Check command-line overrides the way Hydra will, but raise UserError with the fix.

    Hydra reports an unknown group option or key with its own message and exit status 1; run.py calls this
    first so the user sees which entry / key is wrong and the closest valid names. Composes the config once
    (without the `hydra.*` overrides) with the compose API. Raises UserError; returns None when Hydra will
    accept the overrides.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        problem = f"cannot parse the overrides: {str(e).strip().splitlines()[0]}"
        raise UserError(problem, "write each override as key=value (python run.py --help)") from None
    models = [default_entry()]
    for o in parsed:
        key = o.key_or_group
        if key not in ("model", "eval", "runtime") or o.is_delete():
            continue
        # a sweep (`model=a,b` with -m) is checked option by option
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        for value in values:
            if isinstance(value, str):
                _check_group_option(key, value)
        if key == "model":
            models = [v for v in values if isinstance(v, str)] or models
    # Before Hydra loads the entry: a registry file must not reach outside the `model` node.
    for model in models:
        check_entry_file(model)
    # Compose once with the first option of every sweep (Hydra composes each job itself).
    app_overrides = []
    for text, o in zip(overrides, parsed):
        if o.key_or_group.startswith("hydra"):
            continue
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()), None)
            if first is None:
                continue
            text = f"{o.get_key_element()}={first}"
        app_overrides.append(text)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        try:
            cfg = compose("config", overrides=app_overrides)
        except HydraException as e:
            raise _composition_error(e, app_overrides) from None
    del cfg


def default_entry() -> str:
    """The registry entry configs/config.yaml selects when no `model=` override is given."""
    import yaml

    defaults = yaml.safe_load((CONFIG_DIR / "config.yaml").read_text())["defaults"]
    return next(d["model"] for d in defaults if isinstance(d, dict) and "model" in d)


def _check_group_option(group: str, value: str) -> None:
    options = _group_options(group)
    if value in options:
        return
    if group == "model":
        raise unknown_entry_error(value)
    close = difflib.get_close_matches(value, options, n=1)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    raise UserError(f"unknown {group} option {group}={value}", f"{hint}choose one of: {', '.join(options)}")


def _composition_error(e: Exception, overrides: list[str]) -> UserError:
    import re

    msg = str(e)
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        parent, _, leaf = key.rpartition(".")
        if parent:
            allowed = _known_keys(parent)
        else:
            allowed = ["model", "eval", "runtime"] + [f.name for f in dataclasses.fields(AppConfig)
                                                       if f.name not in ("eval", "runtime")]
        close = difflib.get_close_matches(leaf, allowed, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
        return UserError(
            f"unknown config key '{key}' in the override '{_find(overrides, key)}'",
            f"{hint}known keys{' of ' + parent if parent else ''}: {', '.join(allowed)}",
        )
    first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    return UserError(f"the config does not compose: {first}", "check the overrides (python run.py --help)")


def _known_keys(parent: str) -> list[str]:
    """Field names of the config node at dotted path `parent` (e.g. "model.ssm"), walking the dataclasses
    of the schema; [] when the path names no dataclass node."""
    import typing

    roots = {"model": ModelEntry, "eval": EvalConfig, "runtime": RuntimeConfig, "verdict": VerdictConfig}
    head, *rest = parent.split(".")
    cls = roots.get(head)
    for name in rest:
        if cls is None:
            return []
        hint = typing.get_type_hints(cls).get(name)
        # a nested node, possibly optional (ArchConfig | None)
        cls = next((a for a in (*typing.get_args(hint), hint) if dataclasses.is_dataclass(a)), None)
    return [f.name for f in dataclasses.fields(cls)] if cls is not None else []


def _find(overrides: list[str], key: str) -> str:
    return next((o for o in overrides if o.lstrip("+~").split("=")[0] == key), key)
