"""The schema of a run's config: the registry entry (registry/model/<name>.yaml) and the settings around it.

Everything `python run.py` composes is declared here once, as dataclasses that Hydra's ConfigStore holds as
the structured config `run_schema` (configs/config.yaml extends it): OmegaConf type-checks every value and
rejects unknown keys while Hydra composes, and registry entries fill the `model: ModelEntry` node. What types
cannot say is written here too, once: range rules of one value (`check_entry_values`, `check_run_values`);
the rules that tie settings together (drafting, replay and compare) resolve a run's speculation, in
registry.resolve (`resolve_speculation`).

A registry entry is untrusted pull-request input and is data only: `check_entry_file` reads the raw file of an
entry (and of the entries its defaults list reuses) before Hydra loads it, and rejects what could reach
outside the `model` node or read the environment. Nothing in a registry file is imported or instantiated
(`_target_` and every other key outside the schema is rejected); `hydra.utils.instantiate` is never called
on registry data.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from registry.errors import UserError, raise_all
from registry.yamlfile import load as load_yaml

REGISTRY_DIR = Path(__file__).resolve().parent
REPO_ROOT = REGISTRY_DIR.parent
MODEL_DIR = REGISTRY_DIR / "model"
EMBEDDED_CHECKPOINTS_DIR = REGISTRY_DIR / "checkpoints"
BASELINES_DIR = REGISTRY_DIR / "baselines"


class Family(str, Enum):
    nemotron_h = "nemotron_h"  # Nemotron 3 Super: Mamba2 + attention + (latent) MoE
    qwen3_next = "qwen3_next"  # Qwen3-Next: Gated DeltaNet + gated attention + MoE


class DType(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Quant(str, Enum):
    none = "none"
    fp8 = "fp8"
    nvfp4 = "nvfp4"


class KVCacheQuant(str, Enum):
    none = "none"
    fp8 = "fp8"


class LoadFormat(str, Enum):
    """Where the weights come from (vLLM's ``--load-format``): ``auto`` reads the checkpoint; ``dummy`` builds
    random weights at the model's configuration and in its checkpoint format on the run's device
    (runners.engine.dummy), for speed and memory runs without the weights; no accuracy is judged."""

    auto = "auto"
    dummy = "dummy"


class SpecAlgorithm(str, Enum):
    none = "none"
    mtp = "mtp"


class SSMBackend(str, Enum):
    # on a GPU the measured faster replay kernel of the model's Mamba2 shape and state dtype
    # (kernels/replay_defaults.json: FlashInfer's checkpointing_ssu or ours), our Triton kernels for the rest
    auto = "auto"
    triton = "triton"  # our kernels (kernels/), also run by the Triton interpreter on the CPU
    flashinfer = "flashinfer"  # flashinfer.mamba (GPU only; Mamba2 only)
    torch = "torch"  # the plain-PyTorch reference path


@dataclass
class SpeculativeConfig:
    """Speculative decoding. draft_len K: tokens drafted per step (a verify forward covers K + 1 tokens)."""

    algorithm: SpecAlgorithm = SpecAlgorithm.none
    draft_len: int = 0
    # MTP modules in the checkpoint; engines apply the last one recursively to reach draft_len.
    num_nextn_predict_layers: int = 0


@dataclass
class SSMConfig:
    """Recurrent-state (Mamba2 / Gated DeltaNet) settings of the verify step."""

    backend: SSMBackend = SSMBackend.auto
    replay: bool = False  # SSM replay instead of rewind (needs speculative decoding)
    # the checkpointing variant of replay (Mamba2 only): a max(16, T)-token history, the state written on
    # overflow; applies when replay is on (kernels/mamba2/replay.py)
    replay_checkpointing: bool = False
    state_dtype: DType = DType.float32  # 16-bit state loses accuracy on long outputs
    # round 16-bit state writes stochastically (unbiased) instead of to nearest: kernels/rounding.py,
    # docs/kernel_performance.md ("16-bit state"); needs state_dtype bfloat16 / float16
    stochastic_rounding: bool = False


@dataclass
class MambaDims:
    """Mamba2 mixer: H heads x P head_dim, N d_state, G ngroups, W conv_kernel."""

    num_heads: int
    head_dim: int
    d_state: int
    ngroups: int
    conv_kernel: int = 4


@dataclass
class GDNDims:
    """Gated DeltaNet mixer: H key heads x K, HV value heads x V, W conv_kernel."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4


@dataclass
class ArchConfig:
    """Model dimensions the runner needs without loading weights (memory estimates, world-size checks).

    Given in the entry for checkpoints too large to ship; for embedded checkpoints it may be null, and the
    runner reads the same numbers from the checkpoint's config.json (registry.arch.arch_from_config).
    When both are present, `python -m registry validate` checks that they agree.
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    attention_head_dim: int
    num_experts: int  # routed experts per MoE layer (0: no MoE)
    num_experts_per_tok: int
    num_attention_layers: int
    num_mamba_layers: int = 0
    num_gdn_layers: int = 0
    num_moe_layers: int = 0
    num_mlp_layers: int = 0
    mamba: MambaDims | None = None
    gdn: GDNDims | None = None


@dataclass
class ModelEntry:
    """One registry entry: a model, how it is served, and which baseline rows judge it."""

    name: str  # must equal the file name (without .yaml)
    family: Family
    hf_id: str | None  # the released checkpoint on the Hugging Face hub (None for embedded tiny models)
    # Checkpoint directory: absolute, or relative to models_root ($LLM_MODELS_ROOT); for embedded entries
    # relative to registry/checkpoints/.
    checkpoint: str
    embedded: bool = False
    dtype: DType = DType.bfloat16
    quant: Quant = Quant.none
    kv_cache_quant: KVCacheQuant = KVCacheQuant.none
    # auto: read the checkpoint; dummy: random weights in the checkpoint's format (LoadFormat); with no
    # checkpoint folder, the entry's released configuration (registry.releases)
    load_format: LoadFormat = LoadFormat.auto
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    ssm: SSMConfig = field(default_factory=SSMConfig)
    max_batch_size: int = 64
    max_seq_len: int = 4096
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)
    world_size: int = 1
    # Key into registry/baselines/gsm8k.yaml and registry/baselines/acceptance.yaml.
    baseline: str | None = None
    arch: ArchConfig | None = None
    # Swept by the nightly job (`python run.py +experiment=nightly`, docs/nightly.md); a variant inherits it
    # from its base entry unless it sets its own.
    nightly: bool = False


# ----------------------------------------------------------------------------------------------------------
# The settings around the entry (configs/config.yaml and its groups eval/, runtime/)


GSM8K_TRAIN_ROWS = 7473  # rows of GSM8K's train split, the pool lm-eval draws few-shot examples from


@dataclass
class EvalConfig:
    """Evaluation settings (the `eval` config group: configs/eval/<name>.yaml)."""

    name: str = "gsm8k"  # the task: a row of evals/task.py (TASKS), which the app dispatches on
    limit: int | None = None  # first N test questions; None: all 1319
    num_fewshot: int = 5
    max_gen_toks: int = 256
    data_dir: str | None = None  # folder with train.jsonl and test.jsonl; None: the task data's lookup
    batch_size: int | None = None  # concurrent requests (engine max_batch_size); None: the entry's


@dataclass
class RuntimeConfig:
    """Device and compute dtype (configs/runtime/)."""

    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: DType | None = None  # compute dtype; None: the entry's
    num_threads: int | None = None  # torch intra-op threads; None: torch's default (one per core)
    # Decode steps as CUDA graphs at the entry's cuda_graph_batch_sizes; on the CPU the same step runs
    # eagerly whatever this says.
    cuda_graphs: bool = True
    # world_size > 1: seconds a collective of the ranks (all-reduce) waits for its peers before the run stops
    collective_timeout_s: int = 600
    # prefix caching (runners/engine/prefix_cache.py): a prompt reuses the state saved after its longest
    # cached prefix and prefills only the rest; false: every prompt is prefilled from scratch. Exact, and so
    # on, only in float32 compute with a float32 SSM state (prefix_cache_off_reason)
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None  # the most its entries may take; None: the engine's default
    # torch.compile (inductor) of the decode step's per-layer math (runners/engine/compile.py); off in both
    # configs/runtime files until its start-up is measured on the H200 (runtime.compile=true turns it on)
    compile: bool = False
    # model.load_format=dummy only: every verify accepts a fixed schedule of drafts with this mean acceptance
    # length (runners.engine.Engine.force_acceptance) instead of comparing them with the target's tokens, so
    # that random weights, whose drafts accept nothing, run and time the steps of MTP at that length and the
    # full-GSM8K projection is the speculative one. None: the drafts are compared as always
    forced_acceptance_length: float | None = None


@dataclass
class VerdictConfig:
    # A run whose (dtype, quant, kv_cache_quant, spec_dec) matches no baseline row is an error unless False.
    require_reference: bool = True


@dataclass
class HistoryConfig:
    """The SQLite results history every finished run is recorded in (evals/history.py,
    docs/history_schema.md)."""

    db: str | None = None  # database file; relative: to the directory run.py was started from; None: none


# compare=replay: ssm_replay=false and =true on the same samples, compared (evals.compare)
COMPARE_MODES = ("replay",)


@dataclass
class RunConfig:
    """The composed config of `python run.py` (configs/config.yaml extends this schema)."""

    model: ModelEntry = MISSING  # a registry entry: the config group `model`, registry/model/<name>.yaml
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    ssm_replay: bool | None = None  # None: the entry's ssm.replay
    draft_len: int | None = None  # MTP drafts per step; 0: speculation off; None: the entry's
    compare: str | None = None  # one of COMPARE_MODES, or None: one run
    world_size: int | None = None  # tensor-parallel ranks; None: the entry's
    models_root: str | None = None  # root of released checkpoints (an entry's relative `checkpoint`)
    resume: bool = False
    seed: int = 0
    out_dir: str | None = None  # None: Hydra's run dir


SCHEMA_NAME = "run_schema"  # the ConfigStore name configs/config.yaml lists first in its defaults
ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


# ----------------------------------------------------------------------------------------------------------
# Entries: names, the raw-file guard, the typed entry


def entry_names() -> list[str]:
    """Names of all registry entries (registry/model/*.yaml), sorted."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def unknown_entry_error(name: str) -> UserError:
    """UserError for a `model=` choice that is not a registry entry, naming the closest entries."""
    names = entry_names()
    if not name:
        return UserError("model= names no registry entry", f"choose one of: {', '.join(names)}")
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return UserError(
        f"unknown registry entry model={name!r}",
        f"{hint}choose one of: {', '.join(names)} (python -m registry list), "
        f"or add registry/model/{name}.yaml",
    )


def entry_file(name: str) -> str:
    """The repository path of an entry's file, as messages name it."""
    return f"registry/model/{name}.yaml"


_PACKAGE_HEADER = re.compile(r"^\s*#\s*@package", re.MULTILINE)


def check_entry_file(name: str, model_dir: Path = MODEL_DIR, _seen: tuple[str, ...] = ()) -> None:
    """Check the raw file of an entry, and of the entries its defaults list reuses, before Hydra loads it.

    A registry file may hold only schema keys and a `defaults:` list of other entry names and `_self_`.
    Rejected (UserError naming the file): a `# @package` header (it would let the file write outside the
    `model` node, e.g. hydra.callbacks, which Hydra instantiates), defaults that name anything but another
    entry (config groups such as /hydra/...), interpolations (`${oc.env:...}` could copy secrets into
    published results), keys outside the schema and values of the wrong type (OmegaConf's check against
    ModelEntry), a defaults cycle, a missing base entry.
    """
    path = model_dir / f"{name}.yaml"
    where = entry_file(name)
    if not path.is_file():
        raise unknown_entry_error(name)
    if name in _seen:
        raise UserError(f"{where}: defaults form a cycle: {' -> '.join((*_seen, name))}", "remove the cycle")
    raise_all(entry_file_problems(name, model_dir))
    raw = load_yaml(path.read_text(), where)
    for base in raw.get("defaults") or []:
        if base != "_self_":
            check_entry_file(base, model_dir, (*_seen, name))


def entry_file_problems(name: str, model_dir: Path = MODEL_DIR) -> list[UserError]:
    """Every problem of the raw file of entry ``name`` itself (not of its bases), as check_entry_file judges
    them: not valid registry YAML (registry.yamlfile: aliases and ``!!python/...`` tags refused), a
    `# @package` header, interpolations, a malformed defaults list, each key outside the schema or of the
    wrong type, a ``checkpoint:`` that leaves its root (registry/checkpoints/ for embedded entries: no
    ``..``, not absolute), ``load_format: dummy`` (a run override). Empty for a good file; a missing file
    is check_entry_file's error."""
    path = model_dir / f"{name}.yaml"
    where = entry_file(name)
    text = path.read_text()
    problems: list[UserError] = []
    if _PACKAGE_HEADER.search(text):
        problems.append(UserError(
            f"{where}: a '# @package' directive is not allowed in a registry entry",
            "remove it; an entry always fills the `model` node",
        ))
    try:
        raw = load_yaml(text, where)
    except UserError as e:
        return [*problems, e]
    if not isinstance(raw, dict):
        return [*problems, UserError(f"{where}: must be a mapping of schema keys",
                                     "see registry/schema.py:ModelEntry")]
    for key, value in _walk_values(raw):
        if isinstance(value, str) and "${" in value:
            problems.append(UserError(
                f"{where}: key '{key}' holds an interpolation ({value!r}); registry entries are plain data "
                "(an interpolation could read environment variables, e.g. secrets, into published results)",
                f"write the literal value of '{key}'",
            ))
    if raw.get("load_format") == LoadFormat.dummy.value:
        problems.append(UserError(
            f"{where}: load_format: dummy is a run override, not a property of a model (an entry file would "
            "publish random weights under a model's name)",
            f"remove load_format from {where} and pass model.load_format=dummy on the command line",
        ))
    raw = dict(raw)
    defaults = raw.pop("defaults", None) or []
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        problems.append(UserError(
            f"{where}: defaults must be a list of entry names (and _self_)",
            "write `defaults: [<base entry>, _self_]`; config groups cannot be selected from an entry",
        ))
        defaults = []
    for base in defaults:
        if base != "_self_" and (base.startswith(("/", "override", ".")) or "@" in base or ":" in base):
            problems.append(UserError(
                f"{where}: defaults entry '{base}' is not a registry entry name",
                "list only other entries of registry/model/ (and _self_)",
            ))
    # unknown keys and wrong types (required keys may come from a base entry): the whole file at once, and
    # when that fails each key on its own, so that every one is reported
    try:
        _typed(ModelEntry, raw, where)
        keys = {}
    except UserError:
        keys = raw
    for key, value in keys.items():
        parts = value.items() if isinstance(value, dict) and value else [(None, value)]
        for sub, v in parts:
            try:
                _typed(ModelEntry, {key: v if sub is None else {sub: v}}, where)
            except UserError as e:
                problems.append(e)
    problems += _checkpoint_problems(raw, defaults, model_dir, where)
    return problems


def _file_embedded(raw: dict[str, Any], defaults: list[str], model_dir: Path, seen: tuple[str, ...]) -> bool:
    """The `embedded` value of an entry file merged over its bases (own key last, as Hydra merges)."""
    if "embedded" in raw:
        return raw["embedded"] is True
    value = False
    for base in defaults:
        path = model_dir / f"{base}.yaml"
        if base == "_self_" or base in seen or not path.is_file():
            continue
        try:
            data = load_yaml(path.read_text(), entry_file(base))
        except UserError:
            continue
        if isinstance(data, dict):
            bases = [d for d in data.get("defaults") or [] if isinstance(d, str)]
            value = _file_embedded(data, bases, model_dir, (*seen, base))
    return value


def _checkpoint_problems(raw: dict[str, Any], defaults: list[str], model_dir: Path,
                         where: str) -> list[UserError]:
    """The file's `checkpoint:` must stay inside its root: no `..` part, no `~`; for an embedded entry also
    not absolute (an entry in a pull request must not point CI at files outside the repository). A user's
    `model.checkpoint=/data/...` override is not a file and is not judged here."""
    ckpt = raw.get("checkpoint")
    if not isinstance(ckpt, str):
        return []
    parts = Path(ckpt).parts
    embedded = _file_embedded(raw, defaults, model_dir, ())
    root = "registry/checkpoints/" if embedded else "models_root ($LLM_MODELS_ROOT)"
    if ".." in parts or ckpt.startswith("~") or (embedded and Path(ckpt).is_absolute()):
        return [UserError(
            f"{where}: checkpoint {ckpt!r} leaves {root}: an entry names a folder under it "
            "(no '..', no '~'" + (", not an absolute path)" if embedded else ")"),
            f"move the checkpoint under {root} and name it relative to it; a local copy elsewhere is "
            "passed at run time: python run.py model=<entry> model.checkpoint=/path/to/it")]
    return []


def _walk_values(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, leaf value) of every leaf of a parsed YAML mapping / list."""
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _walk_values(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(node, list):
        return [kv for i, v in enumerate(node) for kv in _walk_values(v, f"{prefix}[{i}]")]
    return [(prefix, node)]


def typed(schema: type, node: DictConfig | dict) -> DictConfig:
    """`node` as plain data merged into a fresh structured config of `schema`, so OmegaConf rejects unknown
    keys and values of the wrong type (OmegaConfBaseException). Needed even for a node Hydra composed against
    the schema: its `+key=value` adds keys to a structured node without a check, and a merge of two nodes of
    the same schema keeps them."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=False)
    return OmegaConf.merge(OmegaConf.structured(schema), node)


def _typed(schema: type, node: DictConfig | dict, where: str) -> DictConfig:
    """typed(), with OmegaConf's complaint as a UserError about the entry file `where` (schema_error)."""
    try:
        return typed(schema, node)
    except OmegaConfBaseException as e:
        raise schema_error(e, where) from None


def validate_entry(model_cfg: DictConfig | dict, *, name: str | None = None) -> ModelEntry:
    """The composed `model` node (or a plain dict) as a typed ModelEntry, checked against the schema.

    name: the entry (file) name, used in messages; defaults to the node's name.
    Raises UserError naming the file and key for: a key outside the schema (`_target_` included), a wrong
    type or an enum value outside the allowed ones, a missing required key, a name that is not the file's,
    and the range rules of check_entry_values.
    """
    if name is None:
        name = str(model_cfg.get("name", "?"))
    where = entry_file(name)
    try:
        entry: ModelEntry = OmegaConf.to_object(_typed(ModelEntry, model_cfg, where))
    except OmegaConfBaseException as e:
        raise schema_error(e, where) from None
    if entry.name != name:
        raise UserError(
            f"{where}: name is {entry.name!r} but the file is {name}.yaml",
            f"set `name: {name}` in {where} (a variant that reuses a base entry must set its own name)",
        )
    check_entry_values(entry, where)
    return entry


_INSTANTIATE_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def schema_fields(cls: type | None) -> list[str]:
    """Field names of a schema dataclass (the keys allowed in its node); [] for anything else."""
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def schema_error(e: OmegaConfBaseException, where: str) -> UserError:
    """UserError for OmegaConf's complaint about a registry entry node (keys relative to the entry)."""
    key = e.full_key or "?"
    parent, _, leaf = key.rpartition(".")
    msg = str(e).splitlines()[0]
    if leaf in _INSTANTIATE_KEYS:
        return UserError(
            f"{where}: key '{key}' is not allowed: registry entries are data, never code to instantiate",
            f"remove '{key}' from {where}; describe the model with the schema keys of registry/schema.py",
        )
    if isinstance(e, ConfigKeyError | ConfigAttributeError):
        allowed = schema_fields(e.object_type)
        close = difflib.get_close_matches(leaf, allowed, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return UserError(
            f"{where}: unknown key '{key}'{hint}",
            f"remove or rename it; allowed keys{' under ' + parent if parent else ''}: {', '.join(allowed)}",
        )
    if isinstance(e, MissingMandatoryValue):
        return UserError(f"{where}: required key '{key}' is missing", f"add '{key}' to {where}")
    return UserError(
        f"{where}: bad value for '{key}': {msg}",
        f"fix '{key}' in {where} (or the override model.{key}); types and allowed values: registry/schema.py",
    )


# ----------------------------------------------------------------------------------------------------------
# Rules that types cannot express


def check_entry_values(entry: ModelEntry, where: str) -> None:
    """Range and consistency rules of one entry. Raises UserError naming the file and the keys (UserErrors
    when several rules fail: every one is reported)."""
    problems: list[UserError] = []
    positive = {
        "max_batch_size": entry.max_batch_size,
        "max_seq_len": entry.max_seq_len,
        "world_size": entry.world_size,
    }
    for key, value in positive.items():
        if value < 1:
            problems.append(UserError(f"{where}: {key} must be >= 1, got {value}",
                                      f"set {key} to a positive integer"))
    spec = entry.speculative
    if spec.algorithm == SpecAlgorithm.mtp:
        if spec.draft_len < 1 or spec.num_nextn_predict_layers < 1:
            problems.append(UserError(
                f"{where}: speculative.algorithm is mtp but draft_len={spec.draft_len} and "
                f"num_nextn_predict_layers={spec.num_nextn_predict_layers}",
                "set speculative.draft_len >= 1 and speculative.num_nextn_predict_layers >= 1 "
                "(the checkpoint's MTP module count), or set speculative.algorithm: none",
            ))
    elif spec.draft_len != 0:
        problems.append(UserError(
            f"{where}: speculative.draft_len={spec.draft_len} but speculative.algorithm is none",
            "set speculative.algorithm: mtp, or speculative.draft_len: 0",
        ))
    if spec.num_nextn_predict_layers < 0:
        problems.append(UserError(f"{where}: speculative.num_nextn_predict_layers must be >= 0",
                                  "set it to the checkpoint's MTP module count"))
    if any(b < 1 or b > entry.max_batch_size for b in entry.cuda_graph_batch_sizes):
        problems.append(UserError(
            f"{where}: cuda_graph_batch_sizes {entry.cuda_graph_batch_sizes} must lie in [1, max_batch_size="
            f"{entry.max_batch_size}]",
            "fix cuda_graph_batch_sizes or max_batch_size",
        ))
    if entry.ssm.backend == SSMBackend.flashinfer and entry.family == Family.qwen3_next:
        problems.append(UserError(
            f"{where}: ssm.backend flashinfer has no Gated DeltaNet kernels (qwen3_next)",
            "set ssm.backend: triton (or torch)",
        ))
    if entry.ssm.stochastic_rounding and entry.ssm.state_dtype == DType.float32:
        problems.append(UserError(
            f"{where}: ssm.stochastic_rounding rounds 16-bit state writes, but ssm.state_dtype is float32",
            "set ssm.state_dtype: bfloat16 (or float16), or ssm.stochastic_rounding: false",
        ))
    if entry.ssm.replay_checkpointing and entry.family != Family.nemotron_h:
        problems.append(UserError(
            f"{where}: ssm.replay_checkpointing exists for Mamba2 layers only (nemotron_h), not "
            f"{entry.family.value}",
            "set ssm.replay_checkpointing: false",
        ))
    if not entry.embedded and entry.arch is None:
        problems.append(UserError(
            f"{where}: arch is null, but only embedded checkpoints may omit it (the runner needs the model "
            "dimensions before the weights are there)",
            "add the arch: block (sizes from the checkpoint's config.json)",
        ))
    raise_all(problems)


def acceptance_length_in_range(length: float, draft_len: int) -> bool:
    """Whether ``length`` (tokens per verify step: accepted drafts + the target's own token) is a possible
    mean acceptance length with ``draft_len`` drafts, i.e. in [1, draft_len + 1] (False for NaN)."""
    return 1.0 <= length <= draft_len + 1


def check_run_values(run: RunConfig) -> None:
    """Range rules of the settings around the entry. Raises UserError naming the setting."""
    if run.world_size is not None and run.world_size < 1:
        raise UserError(f"world_size must be >= 1, got {run.world_size}",
                        "set world_size=1 (or the GPU count)")
    if run.eval.limit is not None and run.eval.limit < 1:
        raise UserError(f"eval.limit must be >= 1 or null, got {run.eval.limit}", "set eval.limit=N or null")
    if not 0 <= run.eval.num_fewshot <= GSM8K_TRAIN_ROWS:
        raise UserError(
            f"eval.num_fewshot={run.eval.num_fewshot} is outside [0, {GSM8K_TRAIN_ROWS}]: the few-shot "
            f"examples come from GSM8K's train split ({GSM8K_TRAIN_ROWS} rows; a task with fixed exemplars "
            "has fewer), and every one lengthens each prompt (~100-200 tokens a shot; prompts must fit "
            "model.max_seq_len)",
            f"set eval.num_fewshot to the task's own (configs/eval/{run.eval.name}.yaml), or 0 for zero-shot")
    if run.eval.max_gen_toks < 1:
        raise UserError(f"eval.max_gen_toks={run.eval.max_gen_toks} must be >= 1 (the most tokens generated "
                        "per question)", "set eval.max_gen_toks=256 (lm-eval's default)")
    if run.eval.batch_size is not None and run.eval.batch_size < 1:
        raise UserError(f"eval.batch_size must be >= 1, got {run.eval.batch_size}", "set eval.batch_size=N")
    if run.runtime.device not in ("cpu", "cuda") and not run.runtime.device.startswith("cuda:"):
        raise UserError(
            f"runtime.device must be cpu or cuda[:N], got {run.runtime.device!r}",
            "use runtime=cpu or runtime=gpu",
        )
    if run.runtime.num_threads is not None and run.runtime.num_threads < 1:
        raise UserError(f"runtime.num_threads={run.runtime.num_threads} must be >= 1 (or null)",
                        "set runtime.num_threads=1, or null for torch's default")
    if run.runtime.collective_timeout_s < 1:
        raise UserError(f"runtime.collective_timeout_s={run.runtime.collective_timeout_s} must be >= 1",
                        "set runtime.collective_timeout_s=600 (seconds; the default)")
    if run.runtime.prefix_cache_bytes is not None and run.runtime.prefix_cache_bytes < 0:
        raise UserError(f"runtime.prefix_cache_bytes={run.runtime.prefix_cache_bytes} must be >= 0 (or null)",
                        "set runtime.prefix_cache_bytes=N bytes, null for the default, or "
                        "runtime.prefix_cache=false to turn prefix caching off")
