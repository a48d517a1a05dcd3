"""Qwen3-Next (Qwen3NextForCausalLM) family code: config parsing and the checkpoint-name mapping.

A Qwen3-Next decoder layer is two residual blocks of the shared hybrid decoder: a token mixer (``gdn`` for
'linear_attention' layers, gated ``attention`` for 'full_attention' layers) and an FFN (``moe``, or a dense
SwiGLU ``mlp`` for ``mlp_only_layers`` / off the ``decoder_sparse_step``). Layer ``i`` is blocks ``2i`` and
``2i + 1``. The family's options of the shared modules: RMSNorm scale ``1 + w``
(``norm_weight_offset = 1``), attention with a per-head output gate, q / k norm and partial NeoX RoPE, gated
SiLU experts, softmax router and a sigmoid-gated shared expert.

``config.json`` is read in both dialects: released checkpoints (``full_attention_interval``, top-level
``rope_theta`` / ``partial_rotary_factor``) and transformers 5 ``save_pretrained`` (``layer_types``,
``rope_parameters``). It has no MTP field: released checkpoints carry one ``mtp.*`` module, so
``num_nextn_predict_layers`` defaults to 1 (as vLLM and SGLang assume); the loader loads it when the files
have it.

Checkpoint names (released checkpoints; transformers 5 writes the same, per-expert MoE tensors included):
- ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent when tied);
- ``model.layers.{i}.input_layernorm.weight`` + ``linear_attn.*`` (GDN: in_proj_qkvz, in_proj_ba, conv1d,
  dt_bias, A_log, norm, out_proj) or ``self_attn.{q,k,v,o}_proj`` / ``{q,k}_norm``;
- ``model.layers.{i}.post_attention_layernorm.weight`` + ``mlp.gate.weight``,
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_expert.{gate,up,down}_proj.weight``,
  ``mlp.shared_expert_gate.weight`` (or a dense ``mlp.{gate,up,down}_proj.weight``);
- MTP: ``mtp.fc.weight`` [D, 2D] over concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)]
  (embedding first, as vLLM's and SGLang's qwen3_next_mtp), ``mtp.pre_fc_norm_{embedding,hidden}.weight``,
  ``mtp.layers.0.*`` (one full-attention decoder layer, named like a backbone layer), ``mtp.norm.weight``.
  These are the shared :class:`runners.models.hybrid.MTPModule`'s ``hnorm`` / ``enorm`` / ``eh_proj`` /
  ``blocks`` / ``final_norm``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from runners.models.config import ConfigError, HybridConfig, validate
from runners.models.hybrid import HybridLM
from runners.models.layers import unstack_expert_names

_MIXER_KIND = {"linear_attention": "gdn", "full_attention": "attention"}
# transformers' Qwen3NextConfig defaults (the 80B-A3B sizes), used when config.json omits a field
_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "intermediate_size": 5632,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
}


def _get(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    return _DEFAULTS[key] if value is None else value


def _rope(raw: dict[str, Any], source: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` (transformers 5) or the top-level keys
    and ``rope_scaling`` (released configs). Raises ConfigError for a scaled RoPE (not implemented)."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"{source}: RoPE type {rope_type!r} is not supported (only 'default'); remove rope_scaling / set "
            "rope_parameters.rope_type to 'default', or extend runners.models.layers.apply_rope"
        )
    theta = params.get("rope_theta", raw.get("rope_theta"))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    theta = _DEFAULTS["rope_theta"] if theta is None else theta
    factor = _DEFAULTS["partial_rotary_factor"] if factor is None else factor
    return float(theta), float(factor)


def _ffn_kind(i: int, raw: dict[str, Any]) -> str:
    """transformers' rule: MoE unless the layer is in ``mlp_only_layers``, there are no experts, or it is off
    the ``decoder_sparse_step``."""
    sparse = i not in (raw.get("mlp_only_layers") or []) and _get(raw, "num_experts") > 0
    return "moe" if sparse and (i + 1) % _get(raw, "decoder_sparse_step") == 0 else "mlp"


def parse_config(raw: dict[str, Any], source: str) -> HybridConfig:
    """Parse a Qwen3-Next ``config.json`` dict (either dialect, floats already decoded) into a HybridConfig.

    Raises:
        ConfigError: unknown layer types, a layout that disagrees with num_hidden_layers, a scaled RoPE,
            more than one MTP module, or inconsistent sizes.
    """
    for key in ("vocab_size", "hidden_size"):
        if key not in raw:
            raise ConfigError(f"{source}: {key} is missing; a Qwen3-Next config.json must set it")
    n_layers = _get(raw, "num_hidden_layers")
    mixers = raw.get("layer_types")
    if mixers is None:
        interval = _get(raw, "full_attention_interval")
        mixers = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if not isinstance(mixers, list) or sorted(set(mixers) - set(_MIXER_KIND)):
        raise ConfigError(f"{source}: layer_types must be a list of {sorted(_MIXER_KIND)}; got {mixers!r}")
    if len(mixers) != n_layers:
        raise ConfigError(
            f"{source}: num_hidden_layers={n_layers} but layer_types lists {len(mixers)} layers; "
            "make them agree"
        )
    layer_types: list[str] = []
    for i, mixer in enumerate(mixers):
        layer_types += [_MIXER_KIND[mixer], _ffn_kind(i, raw)]
    n_mtp = raw.get("num_nextn_predict_layers")
    n_mtp = 1 if n_mtp is None else int(n_mtp)
    if n_mtp > 1:
        raise ConfigError(
            f"{source}: num_nextn_predict_layers={n_mtp}; only 1 MTP module (applied recursively) is "
            "supported"
        )
    # the MTP decoder layer is built like backbone layer 0 (vLLM builds mtp.layers.0 with layer index 0)
    mtp_types = ("attention", _ffn_kind(0, raw)) if n_mtp == 1 else ()
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    theta, rotary = _rope(raw, source)
    num_heads = _get(raw, "num_attention_heads")
    cfg = HybridConfig(
        family="qwen3_next",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        layer_types=tuple(layer_types),
        norm_eps=_get(raw, "rms_norm_eps"),
        norm_weight_offset=1.0,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=_get(raw, "max_position_embeddings"),
        num_attention_heads=num_heads,
        num_key_value_heads=_get(raw, "num_key_value_heads"),
        head_dim=raw.get("head_dim") or _DEFAULTS["head_dim"],
        attention_bias=bool(raw.get("attention_bias", False)),
        attn_output_gate=True,
        qk_norm=True,
        rope_theta=theta,
        partial_rotary_factor=rotary,
        gdn_num_key_heads=_get(raw, "linear_num_key_heads"),
        gdn_num_value_heads=_get(raw, "linear_num_value_heads"),
        gdn_key_head_dim=_get(raw, "linear_key_head_dim"),
        gdn_value_head_dim=_get(raw, "linear_value_head_dim"),
        conv_kernel=_get(raw, "linear_conv_kernel_dim"),
        intermediate_size=_get(raw, "intermediate_size"),
        mlp_hidden_act=_get(raw, "hidden_act"),
        mlp_gated=True,
        n_routed_experts=_get(raw, "num_experts"),
        num_experts_per_tok=_get(raw, "num_experts_per_tok"),
        moe_intermediate_size=_get(raw, "moe_intermediate_size"),
        moe_shared_expert_intermediate_size=_get(raw, "shared_expert_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_scoring_func="softmax",
        moe_shared_expert_gate=True,
        num_nextn_predict_layers=n_mtp,
        mtp_layer_types=mtp_types,
        source=source,
    )
    validate(cfg)
    return cfg


# our MTPModule attribute -> the checkpoint's name below "mtp."
_MTP_NAMES = {
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "eh_proj.": "fc.",
    "final_norm.": "norm.",
}
_BLOCK = re.compile(r"^(layers|mtp\.blocks)\.(\d+)\.(norm|mixer)\.(.+)$")


def _block_name(prefix: str, block: int, kind: str, part: str, rest: str) -> str:
    """Checkpoint name of ``<part>.<rest>`` of block ``block`` (of ``kind``) below ``prefix``: block 2i is
    layer i's token mixer, block 2i + 1 its FFN."""
    layer, ffn = divmod(block, 2)
    if part == "norm":
        return f"{prefix}{layer}.{'post_attention_layernorm' if ffn else 'input_layernorm'}.{rest}"
    module = {"gdn": "linear_attn", "attention": "self_attn", "mlp": "mlp", "moe": "mlp"}[kind]
    if kind == "moe":
        rest = rest.replace("shared_experts.", "shared_expert.", 1)
    return f"{prefix}{layer}.{module}.{rest}"


def checkpoint_targets(model: HybridLM) -> dict[str, torch.Tensor]:
    """Map every checkpoint tensor name to the model tensor it fills.

    Returns:
        ``{name: destination}``; a destination is a parameter or (experts) a view of one row of a stacked
        parameter, so ``destination.copy_(tensor)`` loads it in place. MTP names appear only when the model
        was built with its MTP module; ``lm_head.weight`` is absent for tied embeddings.
    """
    kinds = {"layers": [b.kind for b in model.layers]}
    if model.mtp is not None:
        kinds["mtp.blocks"] = [b.kind for b in model.mtp.blocks]
    targets: dict[str, torch.Tensor] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    for name, tensor in named.items():
        block = _BLOCK.match(name)
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if block:
            where, b, part, rest = block.group(1), int(block.group(2)), block.group(3), block.group(4)
            prefix = "model.layers." if where == "layers" else "mtp.layers."
            ckpt = _block_name(prefix, b, kinds[where][b], part, rest)
        elif name.startswith("mtp."):
            rest = name[len("mtp.") :]
            old = next(k for k in _MTP_NAMES if rest.startswith(k))
            ckpt = "mtp." + _MTP_NAMES[old] + rest[len(old) :]
        elif name == "embeddings.weight":
            ckpt = "model.embed_tokens.weight"
        elif name.startswith("norm_f."):
            ckpt = "model.norm." + name[len("norm_f.") :]
        else:
            ckpt = name
        targets.update(unstack_expert_names(ckpt, tensor))
    return targets
