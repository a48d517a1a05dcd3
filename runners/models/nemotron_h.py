"""NemotronH (Nemotron 3 Super / Nano) family code: config parsing and the checkpoint-name mapping.

``config.json`` comes in two dialects, both read by :func:`parse_config`:
- released checkpoints: ``hybrid_override_pattern`` ("M" mamba2, "*" attention, "E" moe, "-" mlp) and
  ``mtp_hybrid_override_pattern``; legacy aliases such as ``mamba_n_groups`` / ``mamba_d_conv``;
- transformers 5 ``save_pretrained``: ``layers_block_type`` / ``mtp_layers_block_type`` lists of
  'linear_attention' / 'full_attention' / 'moe' / 'mlp' (both may be present; they must agree).

Names on disk are the
released checkpoints' names, which transformers 5 ``save_pretrained`` also writes (verified with 5.24.0:
``backbone.*``, per-expert ``mixer.experts.{e}.{up,down}_proj.weight``):

- ``backbone.embeddings.weight``, ``backbone.norm_f.weight``, ``lm_head.weight`` (absent when tied)
- ``backbone.layers.{i}.norm.weight`` and ``backbone.layers.{i}.mixer.<parameter>``; the routed experts
  ``mixer.experts.{e}.up_proj.weight`` [I, L] / ``down_proj.weight`` [L, I] are rows of our stacked
  ``experts_up`` / ``experts_down``
- MTP: ``mtp.layers.0.{enorm,hnorm,eh_proj}.weight``, ``mtp.layers.{j}.norm.weight``,
  ``mtp.layers.{j}.mixer.*`` and ``mtp.layers.{last}.final_layernorm.weight``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from runners.models.config import ConfigError, HybridConfig, validate
from runners.models.hybrid import HybridLM
from runners.models.layers import unstack_expert_names

_NEMOTRON_PATTERN = {"M": "mamba2", "*": "attention", "E": "moe", "-": "mlp"}
_NEMOTRON_LAYER_TYPE = {
    "linear_attention": "mamba2",
    "mamba": "mamba2",
    "full_attention": "attention",
    "attention": "attention",
    "moe": "moe",
    "mlp": "mlp",
}
# Legacy NemotronH field names (released configs) -> transformers 5 names.
_NEMOTRON_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "mamba_d_state": "ssm_state_size",
}


def _kinds_from_list(types: list[str], key: str, source: str) -> tuple[str, ...]:
    if not isinstance(types, list):
        raise ConfigError(f"{source}: {key} must be a list of layer types, got {type(types).__name__}")
    bad = sorted({t for t in types if t not in _NEMOTRON_LAYER_TYPE})
    if bad:
        raise ConfigError(
            f"{source}: {key} has unknown layer types {bad}; allowed: {sorted(_NEMOTRON_LAYER_TYPE)}"
        )
    return tuple(_NEMOTRON_LAYER_TYPE[t] for t in types)


def _kinds_from_pattern(pattern: str, key: str, source: str) -> tuple[str, ...]:
    bad = sorted({c for c in pattern if c not in _NEMOTRON_PATTERN})
    if bad:
        raise ConfigError(
            f"{source}: {key} has unknown letters {bad}; allowed: M (mamba2), * (attention), E (moe), - (mlp)"
        )
    return tuple(_NEMOTRON_PATTERN[c] for c in pattern)


def parse_config(raw: dict[str, Any], source: str) -> HybridConfig:
    """Parse a NemotronH ``config.json`` dict (either dialect, floats already decoded) into a HybridConfig.

    Raises:
        ConfigError: a missing or unknown layout, layouts that disagree, or inconsistent sizes.
    """
    raw = dict(raw)
    for old, new in _NEMOTRON_ALIASES.items():
        if old in raw and new not in raw:
            raw[new] = raw[old]
    if raw.get("layers_block_type") is not None:
        layer_types = _kinds_from_list(raw["layers_block_type"], "layers_block_type", source)
        pattern = raw.get("hybrid_override_pattern")
        if (
            pattern is not None
            and _kinds_from_pattern(pattern, "hybrid_override_pattern", source) != layer_types
        ):
            raise ConfigError(
                f"{source}: hybrid_override_pattern {pattern!r} disagrees with layers_block_type; "
                "keep one of them (transformers 5 reads layers_block_type) or make them agree"
            )
    elif raw.get("hybrid_override_pattern") is not None:
        layer_types = _kinds_from_pattern(raw["hybrid_override_pattern"], "hybrid_override_pattern", source)
    else:
        raise ConfigError(
            f"{source}: neither layers_block_type nor hybrid_override_pattern is set; add one "
            '(e.g. "hybrid_override_pattern": "M*E")'
        )
    if "num_hidden_layers" in raw and raw["num_hidden_layers"] not in (None, len(layer_types)):
        raise ConfigError(
            f"{source}: num_hidden_layers={raw['num_hidden_layers']} but the layout lists "
            f"{len(layer_types)} layers; make them agree"
        )
    n_mtp = int(raw.get("num_nextn_predict_layers") or 0)
    mtp_types: tuple[str, ...] = ()
    if n_mtp > 0:
        if raw.get("mtp_layers_block_type") is not None:
            mtp_types = _kinds_from_list(raw["mtp_layers_block_type"], "mtp_layers_block_type", source)
        elif raw.get("mtp_hybrid_override_pattern") is not None:
            mtp_types = _kinds_from_pattern(
                raw["mtp_hybrid_override_pattern"], "mtp_hybrid_override_pattern", source
            )
        else:
            mtp_types = ("attention", "moe")  # transformers' default
        if n_mtp != 1:
            raise ConfigError(
                f"{source}: num_nextn_predict_layers={n_mtp}; only 1 MTP module (applied "
                "recursively) is supported"
            )
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    num_heads = raw.get("mamba_num_heads", 128)  # transformers' default; d_inner = H * P (not expand * D)
    limit = raw.get("time_step_limit", (0.0, math.inf))
    cfg = HybridConfig(
        family="nemotron_h",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        layer_types=layer_types,
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        num_attention_heads=raw.get("num_attention_heads", 0),
        num_key_value_heads=raw.get("num_key_value_heads") or raw.get("num_attention_heads", 0),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // max(raw.get("num_attention_heads", 1), 1),
        attention_bias=bool(raw.get("attention_bias", False)),
        mamba_num_heads=num_heads,
        mamba_head_dim=raw.get("mamba_head_dim", 64),
        ssm_state_size=raw.get("ssm_state_size", 128),
        n_groups=raw.get("n_groups", 8),
        conv_kernel=raw.get("conv_kernel", 4),
        chunk_size=raw.get("chunk_size", 128),
        use_conv_bias=bool(raw.get("use_conv_bias", True)),
        mamba_proj_bias=bool(raw.get("use_bias", raw.get("mamba_proj_bias", False))),
        time_step_limit=(float(limit[0]), float(limit[1])),
        mamba_ssm_cache_dtype=raw.get("mamba_ssm_cache_dtype", "float32"),
        intermediate_size=raw.get("intermediate_size", 0),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        n_routed_experts=raw.get("n_routed_experts", 0),
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        moe_shared_expert_intermediate_size=raw.get("moe_shared_expert_intermediate_size", 0),
        moe_latent_size=raw.get("moe_latent_size"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_group=raw.get("n_group", 1),
        topk_group=raw.get("topk_group", 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        num_nextn_predict_layers=n_mtp,
        mtp_layer_types=mtp_types,
        source=source,
    )
    validate(cfg)
    return cfg


def checkpoint_targets(model: HybridLM) -> dict[str, torch.Tensor]:
    """Map every checkpoint tensor name to the model tensor it fills.

    Returns:
        ``{name: destination}``; a destination is a parameter / buffer or (experts) a view of one row of a
        stacked parameter, so ``destination.copy_(tensor)`` loads it in place. MTP names appear only when
        the model was built with its MTP module; ``lm_head.weight`` is absent for tied embeddings.
    """
    targets: dict[str, torch.Tensor] = {}
    n_mtp = len(model.mtp.blocks) if model.mtp is not None else 0
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    for name, tensor in named.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.startswith(("embeddings.", "layers.", "norm_f.")):
            ckpt = "backbone." + name
        elif name.startswith("mtp."):
            rest = name[len("mtp.") :]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                ckpt = "mtp.layers.0." + rest
            elif rest.startswith("final_norm."):
                ckpt = f"mtp.layers.{n_mtp - 1}.final_layernorm." + rest[len("final_norm.") :]
            else:
                ckpt = "mtp.layers." + rest[len("blocks.") :]
        else:
            ckpt = name
        targets.update(unstack_expert_names(ckpt, tensor))
    return targets
