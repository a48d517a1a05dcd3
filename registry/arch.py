"""An entry's `arch:` dimensions (schema.ArchConfig) and the checkpoint's HybridConfig, and world-size checks.

Registry entries of released checkpoints carry their dimensions in an `arch:` block, because the runner needs
them (memory estimates, tensor-parallel divisibility) on machines where the weights are not present. Embedded
tiny checkpoints may leave `arch: null`: their config.json is in the repository, and arch_from_config derives
the block from the parsed config.json (registry.hf_config.HybridConfig) through one table of field names,
:data:`ARCH_FIELDS` (tests/released_shapes.py reads it the other way to size caches at released shapes).
"""

from __future__ import annotations

from dataclasses import asdict, fields, is_dataclass

from registry.errors import UserError
from registry.hf_config import HybridConfig
from registry.schema import ArchConfig, GDNDims, MambaDims

# ArchConfig field (or "mamba." / "gdn." + a MambaDims / GDNDims field) -> HybridConfig field
ARCH_FIELDS = {
    "hidden_size": "hidden_size",
    "vocab_size": "vocab_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "attention_head_dim": "head_dim",
    "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "mamba.num_heads": "mamba_num_heads",
    "mamba.head_dim": "mamba_head_dim",
    "mamba.d_state": "ssm_state_size",
    "mamba.ngroups": "n_groups",
    "mamba.conv_kernel": "conv_kernel",
    "gdn.num_key_heads": "gdn_num_key_heads",
    "gdn.num_value_heads": "gdn_num_value_heads",
    "gdn.key_head_dim": "gdn_key_head_dim",
    "gdn.value_head_dim": "gdn_value_head_dim",
    "gdn.conv_kernel": "conv_kernel",
}
# ArchConfig layer counts -> the HybridConfig block kind they count
LAYER_COUNTS = {
    "num_attention_layers": "attention",
    "num_mamba_layers": "mamba2",
    "num_gdn_layers": "gdn",
    "num_moe_layers": "moe",
    "num_mlp_layers": "mlp",
}


def _from_config(config: HybridConfig, prefix: str) -> dict[str, object]:
    return {k[len(prefix):]: getattr(config, v) for k, v in ARCH_FIELDS.items()
            if k.startswith(prefix) and "." not in k[len(prefix):]}


def arch_from_config(config: HybridConfig) -> ArchConfig:
    """The `arch:` block of a parsed checkpoint config: sizes, layer counts per block kind (a Qwen3-Next
    layer counts once as a mixer and once as an FFN), mamba / gdn dimensions when it has such layers.
    Expert counts are 0 without MoE layers."""
    kinds = config.layer_types
    top = _from_config(config, "")
    if "moe" not in kinds:
        top.update(num_experts=0, num_experts_per_tok=0)
    return ArchConfig(
        **top,
        **{k: kinds.count(kind) for k, kind in LAYER_COUNTS.items()},
        mamba=MambaDims(**_from_config(config, "mamba.")) if "mamba2" in kinds else None,
        gdn=GDNDims(**_from_config(config, "gdn.")) if "gdn" in kinds else None,
    )


def arch_mismatch(entry_arch: ArchConfig, ckpt_arch: ArchConfig) -> list[str]:
    """`arch.<key>: entry X, config.json Y` for every dimension on which the two blocks differ."""

    def diff(x: object, y: object, prefix: str) -> list[str]:
        if is_dataclass(x) and is_dataclass(y):
            return [d for f in fields(x) for d in diff(getattr(x, f.name), getattr(y, f.name),
                                                        f"{prefix}{f.name}.")]
        return [] if x == y else [f"{prefix[:-1]}: entry {_plain(x)}, config.json {_plain(y)}"]

    return diff(entry_arch, ckpt_arch, "arch.")


def _plain(x: object) -> object:
    return asdict(x) if is_dataclass(x) else x


# Counts that may also be smaller than world_size when world_size is a multiple of them: tensor-parallel
# engines replicate KV heads (and mamba groups) across ranks in that case (vLLM, TensorRT-LLM;
# runners/engine/tp.py:
# each rank then holds the one KV head / group its query / mamba heads read, and a mamba group's gated RMSNorm
# reduces its statistics over the ranks that share the group).
_REPLICABLE = ("KV heads", "mamba ngroups")


def sharded_head_counts(arch: ArchConfig) -> dict[str, int]:
    """Head counts a tensor-parallel engine splits across ranks (attention and KV heads, mamba heads and
    groups, GDN key and value heads). Routed experts are not among them: runners/engine/tp.py splits every
    expert
    along its intermediate size (see :func:`sharded_config_counts`), so any expert count shards."""
    counts = {"attention heads": arch.num_attention_heads, "KV heads": arch.num_key_value_heads}
    if arch.mamba is not None:
        counts["mamba heads"] = arch.mamba.num_heads
        counts["mamba ngroups"] = arch.mamba.ngroups
    if arch.gdn is not None:
        counts["GDN key heads"] = arch.gdn.num_key_heads
        counts["GDN value heads"] = arch.gdn.num_value_heads
    return counts


def sharded_config_counts(config: HybridConfig) -> dict[str, int]:
    """Every count of a parsed config.json that tensor parallelism splits: the head counts of
    :func:`sharded_head_counts` plus the intermediate sizes the `arch:` block does not carry (the dense MLP's
    ``intermediate_size``, the routed experts' ``moe_intermediate_size`` and the shared expert's), for the
    block kinds the model (backbone or MTP module) has."""
    counts = sharded_head_counts(arch_from_config(config))
    kinds = set(config.layer_types) | set(config.mtp_layer_types)
    if "attention" not in kinds:
        del counts["attention heads"], counts["KV heads"]
    if "mlp" in kinds:
        counts["MLP intermediate_size"] = config.intermediate_size
    if "moe" in kinds:
        counts["moe_intermediate_size"] = config.moe_intermediate_size
        if config.moe_shared_expert_intermediate_size:
            counts["shared expert intermediate size"] = config.moe_shared_expert_intermediate_size
    return counts


def _shards(count: int, world_size: int, replicable: bool) -> bool:
    return count % world_size == 0 or (replicable and world_size % count == 0)


def world_size_problems(arch: ArchConfig | HybridConfig, world_size: int) -> dict[str, int]:
    """The counts of `arch` (an `arch:` block, or a parsed config.json with its intermediate sizes too) that
    world_size cannot shard ({} when it can)."""
    counts = sharded_config_counts(arch) if isinstance(arch, HybridConfig) else sharded_head_counts(arch)
    return {k: v for k, v in counts.items() if not _shards(v, world_size, k in _REPLICABLE)}


def check_world_size(arch: ArchConfig | HybridConfig, world_size: int, entry_name: str) -> None:
    """Raise UserError when world_size cannot shard every count of `arch` (see :func:`world_size_problems`).

    Attention, mamba and GDN heads and the intermediate sizes must be divisible by world_size; KV heads and
    mamba groups may instead divide world_size (they are replicated).
    """
    bad = world_size_problems(arch, world_size)
    if bad:
        listing = ", ".join(f"{k}={v}" for k, v in bad.items())
        good = [n for n in (1, 2, 4, 8) if not world_size_problems(arch, n)]
        raise UserError(
            f"world_size={world_size} does not divide the {listing} of {entry_name}",
            f"set world_size to one that divides every head count and intermediate size: one of {good}",
        )
