"""Schema of a registry entry (registry/model/<name>.yaml) and its validation.

A registry entry is untrusted pull-request input and is data only: this module merges it into frozen
dataclasses with OmegaConf.structured, so an unknown key, a wrong type or a value outside an enum is an error
naming the entry file, the key and the allowed values. Nothing here imports or instantiates what a file names
(`_target_` and every other key outside the schema is rejected); `hydra.utils.instantiate` is never called on
registry data.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runners.errors import UserError

REGISTRY_DIR = Path(__file__).resolve().parent
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


class SpecAlgorithm(str, Enum):
    none = "none"
    mtp = "mtp"


class SSMBackend(str, Enum):
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

    backend: SSMBackend = SSMBackend.triton
    replay: bool = False  # SSM replay instead of rewind (needs speculative decoding)
    # the checkpointing variant of replay (Mamba2 only): a max(16, T)-token history, the state written on
    # overflow; applies when replay is on (kernels/mamba2_replay.py)
    replay_checkpointing: bool = False
    state_dtype: DType = DType.float32  # 16-bit state loses accuracy on long outputs


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
    runner reads the same numbers from the checkpoint's config.json (registry.arch.arch_from_hf_config).
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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    ssm: SSMConfig = field(default_factory=SSMConfig)
    max_batch_size: int = 64
    max_seq_len: int = 4096
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)
    world_size: int = 1
    # Key into registry/baselines/gsm8k.yaml and registry/baselines/acceptance.yaml.
    baseline: str | None = None
    arch: ArchConfig | None = None


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


_PACKAGE_HEADER = re.compile(r"^\s*#\s*@package", re.MULTILINE)


def check_entry_file(name: str, model_dir: Path = MODEL_DIR, _seen: tuple[str, ...] = ()) -> None:
    """Check the raw file of an entry, and of the entries its defaults list reuses, before Hydra loads it.

    A registry file may hold only schema keys and a `defaults:` list of other entry names and `_self_`.
    Rejected (UserError naming the file): a `# @package` header (it would let the file write outside the
    `model` node, e.g. hydra.callbacks, which Hydra instantiates), defaults that name anything but another
    entry (config groups such as /hydra/...), keys outside the schema, a defaults cycle, a missing base entry.
    """
    path = model_dir / f"{name}.yaml"
    where = _entry_file(name)
    if not path.is_file():
        raise unknown_entry_error(name)
    if name in _seen:
        raise UserError(f"{where}: defaults form a cycle: {' -> '.join((*_seen, name))}", "remove the cycle")
    text = path.read_text()
    if _PACKAGE_HEADER.search(text):
        raise UserError(
            f"{where}: a '# @package' directive is not allowed in a registry entry",
            "remove it; an entry always fills the `model` node",
        )
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"{where}: not valid YAML: {str(e).splitlines()[0]}", "fix the YAML syntax") from None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: must be a mapping of schema keys", "see registry/schema.py:ModelEntry")
    allowed = [f.name for f in dataclasses.fields(ModelEntry)]
    for key in raw:
        if key != "defaults" and key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"{where}: unknown key '{key}'{hint}", f"allowed keys: {', '.join(allowed)}")
    for key, value in _walk_values(raw):
        if isinstance(value, str) and "${" in value:
            raise UserError(
                f"{where}: key '{key}' holds an interpolation ({value!r}); registry entries are plain data "
                "(an interpolation could read environment variables, e.g. secrets, into published results)",
                f"write the literal value of '{key}'",
            )
    defaults = raw.get("defaults") or []
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise UserError(
            f"{where}: defaults must be a list of entry names (and _self_)",
            "write `defaults: [<base entry>, _self_]`; config groups cannot be selected from an entry",
        )
    for base in defaults:
        if base == "_self_":
            continue
        if base.startswith(("/", "override", ".")) or "@" in base or ":" in base:
            raise UserError(
                f"{where}: defaults entry '{base}' is not a registry entry name",
                "list only other entries of registry/model/ (and _self_)",
            )
        check_entry_file(base, model_dir, (*_seen, name))


def _entry_file(name: str) -> str:
    return f"registry/model/{name}.yaml"


def _walk_values(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, leaf value) of every leaf of a parsed YAML mapping / list."""
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _walk_values(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(node, list):
        return [kv for i, v in enumerate(node) for kv in _walk_values(v, f"{prefix}[{i}]")]
    return [(prefix, node)]


def _walk_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            keys.append(path)
            keys += _walk_keys(v, path)
    return keys


def validate_entry(model_cfg: DictConfig | dict, *, name: str | None = None) -> ModelEntry:
    """Check a composed `model` node against the schema and return it as a typed ModelEntry.

    model_cfg: the `model` node of a composed config (the entry after its defaults are merged and overrides
    applied), or a plain dict. name: the entry (file) name, used in messages; defaults to model_cfg.name.
    Raises UserError naming the file and key for: `_target_` anywhere, a key outside the schema, a wrong
    type or an enum value outside the allowed ones, a missing required key.
    """
    if isinstance(model_cfg, DictConfig):
        raw = OmegaConf.to_container(model_cfg, resolve=False)
    else:
        raw = dict(model_cfg)
    name = name or str(raw.get("name", "?"))
    where = _entry_file(name)
    for key in _walk_keys(raw):
        if key.split(".")[-1] in ("_target_", "_partial_", "_recursive_", "_convert_", "_args_"):
            raise UserError(
                f"{where}: key '{key}' is not allowed: registry entries are data, never code to instantiate",
                f"remove '{key}' from {where}; describe the model with the schema keys of registry/schema.py",
            )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ModelEntry), raw)
        entry: ModelEntry = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _schema_error(e, where) from None
    if entry.name != name:
        raise UserError(
            f"{where}: name is {entry.name!r} but the file is {name}.yaml",
            f"set `name: {name}` in {where} (a variant that reuses a base entry must set its own name)",
        )
    _check_values(entry, where)
    return entry


def _schema_error(e: OmegaConfBaseException, where: str) -> UserError:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if "Key '" in msg and "not in" in msg:
        leaf = key.split(".")[-1]
        parent = key.rsplit(".", 1)[0] if "." in key else None
        allowed = _allowed_keys(parent)
        close = difflib.get_close_matches(leaf, allowed, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return UserError(
            f"{where}: unknown key '{key}'{hint}",
            f"remove or rename it; allowed keys{' under ' + parent if parent else ''}: {', '.join(allowed)}",
        )
    if "missing mandatory value" in msg.lower():
        return UserError(f"{where}: required key '{key}' is missing", f"add '{key}' to {where}")
    return UserError(
        f"{where}: bad value for '{key}': {msg}",
        f"fix '{key}' in {where} (or the override model.{key}); types and allowed values: registry/schema.py",
    )


def _allowed_keys(parent: str | None) -> list[str]:
    """Schema keys allowed under `parent` (a dotted path inside ModelEntry; None for the top level)."""
    cls: Any = ModelEntry
    for part in parent.split(".") if parent else []:
        hint = typing.get_type_hints(cls).get(part)
        cls = next((a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)), None)
        if cls is None:
            return []
    return [f.name for f in dataclasses.fields(cls)]


def _check_values(entry: ModelEntry, where: str) -> None:
    """Range checks that types alone cannot express."""
    positive = {
        "max_batch_size": entry.max_batch_size,
        "max_seq_len": entry.max_seq_len,
        "world_size": entry.world_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise UserError(f"{where}: {key} must be >= 1, got {value}", f"set {key} to a positive integer")
    spec = entry.speculative
    if spec.algorithm == SpecAlgorithm.mtp:
        if spec.draft_len < 1 or spec.num_nextn_predict_layers < 1:
            raise UserError(
                f"{where}: speculative.algorithm is mtp but draft_len={spec.draft_len} and "
                f"num_nextn_predict_layers={spec.num_nextn_predict_layers}",
                "set speculative.draft_len >= 1 and speculative.num_nextn_predict_layers >= 1 "
                "(the checkpoint's MTP module count), or set speculative.algorithm: none",
            )
    elif spec.draft_len != 0:
        raise UserError(
            f"{where}: speculative.draft_len={spec.draft_len} but speculative.algorithm is none",
            "set speculative.algorithm: mtp, or speculative.draft_len: 0",
        )
    if any(b < 1 or b > entry.max_batch_size for b in entry.cuda_graph_batch_sizes):
        raise UserError(
            f"{where}: cuda_graph_batch_sizes {entry.cuda_graph_batch_sizes} must lie in [1, max_batch_size="
            f"{entry.max_batch_size}]",
            "fix cuda_graph_batch_sizes or max_batch_size",
        )
    if entry.ssm.backend == SSMBackend.flashinfer and entry.family == Family.qwen3_next:
        raise UserError(
            f"{where}: ssm.backend flashinfer has no Gated DeltaNet kernels (qwen3_next)",
            "set ssm.backend: triton (or torch)",
        )
    if entry.ssm.replay_checkpointing and entry.family != Family.nemotron_h:
        raise UserError(
            f"{where}: ssm.replay_checkpointing exists for Mamba2 layers only (nemotron_h), not "
            f"{entry.family.value}",
            "set ssm.replay_checkpointing: false",
        )
    if not entry.embedded and entry.arch is None:
        raise UserError(
            f"{where}: arch is null, but only embedded checkpoints may omit it (the runner needs the model "
            "dimensions before the weights are there)",
            "add the arch: block (sizes from the checkpoint's config.json)",
        )
