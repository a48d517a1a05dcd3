"""Model dimensions (schema.ArchConfig) from a checkpoint's HF config.json, and the world-size check.

Registry entries of released checkpoints carry their dimensions in an `arch:` block, because the runner needs
them (memory estimates, tensor-parallel divisibility) on machines where the weights are not present. Embedded
tiny checkpoints may leave `arch: null`: their config.json is in the repository and is read here. Both HF
spellings of the NemotronH layer layout are understood: the released `hybrid_override_pattern` string
(M mamba, * attention, E MoE, - MLP) and transformers 5's `layers_block_type` list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from registry.schema import ArchConfig, Family, GDNDims, MambaDims
from runners.errors import UserError

_PATTERN_TO_TYPE = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
_BLOCK_TYPE_TO_TYPE = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
                       "attention": "attention", "moe": "moe", "mlp": "mlp"}


def arch_from_hf_config(config: dict[str, Any], family: Family | str) -> ArchConfig:
    """ArchConfig from a parsed HF config.json of a NemotronH or Qwen3-Next checkpoint.

    Layer counts: NemotronH layers are single blocks (one of mamba / attention / MoE / MLP); a Qwen3-Next
    layer is a token mixer (Gated DeltaNet or attention) followed by an MoE (or, in mlp_only_layers, an MLP).
    Raises UserError when a key the runner needs is missing.
    """
    family = Family(family)
    try:
        if family == Family.nemotron_h:
            if "hybrid_override_pattern" in config:
                kinds = [_PATTERN_TO_TYPE[c] for c in config["hybrid_override_pattern"]]
            else:
                kinds = [_BLOCK_TYPE_TO_TYPE[t] for t in config["layers_block_type"]]
            return ArchConfig(
                hidden_size=config["hidden_size"],
                vocab_size=config["vocab_size"],
                num_attention_heads=config["num_attention_heads"],
                num_key_value_heads=config["num_key_value_heads"],
                attention_head_dim=config.get("head_dim")
                or config["hidden_size"] // config["num_attention_heads"],
                num_experts=config.get("n_routed_experts", 0) if "moe" in kinds else 0,
                num_experts_per_tok=config.get("num_experts_per_tok", 0) if "moe" in kinds else 0,
                num_attention_layers=kinds.count("attention"),
                num_mamba_layers=kinds.count("mamba"),
                num_moe_layers=kinds.count("moe"),
                num_mlp_layers=kinds.count("mlp"),
                mamba=MambaDims(
                    num_heads=config["mamba_num_heads"],
                    head_dim=config["mamba_head_dim"],
                    d_state=config["ssm_state_size"],
                    ngroups=config["n_groups"],
                    conv_kernel=config.get("conv_kernel", 4),
                ),
            )
        n_layers = config["num_hidden_layers"]
        if "layer_types" in config:
            kinds = list(config["layer_types"])
        else:
            interval = config.get("full_attention_interval", 4)
            kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(n_layers)]
        num_mlp = len(config.get("mlp_only_layers") or [])
        return ArchConfig(
            hidden_size=config["hidden_size"],
            vocab_size=config["vocab_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            attention_head_dim=config.get("head_dim")
            or config["hidden_size"] // config["num_attention_heads"],
            num_experts=config["num_experts"],
            num_experts_per_tok=config["num_experts_per_tok"],
            num_attention_layers=kinds.count("full_attention"),
            num_gdn_layers=kinds.count("linear_attention"),
            num_moe_layers=n_layers - num_mlp,
            num_mlp_layers=num_mlp,
            gdn=GDNDims(
                num_key_heads=config["linear_num_key_heads"],
                num_value_heads=config["linear_num_value_heads"],
                key_head_dim=config["linear_key_head_dim"],
                value_head_dim=config["linear_value_head_dim"],
                conv_kernel=config.get("linear_conv_kernel_dim", 4),
            ),
        )
    except KeyError as e:
        raise UserError(
            f"config.json of a {family.value} checkpoint lacks the key {e.args[0]!r}",
            "use a complete HF config.json for this family, or give the dimensions in the entry's arch:",
        ) from None


_RESTORE_CONFIG = "restore the checkpoint's config.json (or point model.checkpoint at a complete one)"


def read_checkpoint_arch(checkpoint_dir: Path, family: Family | str) -> ArchConfig:
    """arch_from_hf_config of checkpoint_dir/config.json; UserError when it is not a JSON object."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} cannot be read as JSON: {e}", _RESTORE_CONFIG) from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object (got {type(config).__name__})", _RESTORE_CONFIG)
    return arch_from_hf_config(config, family)


# Counts that may also be smaller than world_size when world_size is a multiple of them: tensor-parallel
# engines replicate KV heads (and mamba groups) across ranks in that case (vLLM, TensorRT-LLM).
_REPLICABLE = ("KV heads", "mamba ngroups")


def sharded_head_counts(arch: ArchConfig) -> dict[str, int]:
    """Counts a tensor-parallel engine splits across ranks (heads, groups, experts)."""
    counts = {"attention heads": arch.num_attention_heads, "KV heads": arch.num_key_value_heads}
    if arch.mamba is not None:
        counts["mamba heads"] = arch.mamba.num_heads
        counts["mamba ngroups"] = arch.mamba.ngroups
    if arch.gdn is not None:
        counts["GDN key heads"] = arch.gdn.num_key_heads
        counts["GDN value heads"] = arch.gdn.num_value_heads
    if arch.num_experts:
        counts["experts"] = arch.num_experts
    return counts


def _shards(count: int, world_size: int, replicable: bool) -> bool:
    return count % world_size == 0 or (replicable and world_size % count == 0)


def world_size_problems(arch: ArchConfig, world_size: int) -> dict[str, int]:
    """The head / expert counts of `arch` that world_size cannot shard ({} when it can)."""
    return {
        k: v for k, v in sharded_head_counts(arch).items() if not _shards(v, world_size, k in _REPLICABLE)
    }


def check_world_size(arch: ArchConfig, world_size: int, entry_name: str) -> None:
    """Raise UserError when world_size cannot shard every head / expert count of `arch`.

    Attention, mamba and GDN heads and experts must be divisible by world_size; KV heads and mamba groups
    may instead divide world_size (they are replicated).
    """
    bad = world_size_problems(arch, world_size)
    if bad:
        listing = ", ".join(f"{k}={v}" for k, v in bad.items())
        good = [n for n in (1, 2, 4, 8) if not world_size_problems(arch, n)]
        raise UserError(
            f"world_size={world_size} does not divide the {listing} of {entry_name}",
            f"set world_size to one that divides every head and expert count: one of {good}",
        )
