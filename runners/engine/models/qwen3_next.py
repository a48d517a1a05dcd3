"""Qwen3-Next (Qwen3NextForCausalLM) family code: the checkpoint-name mapping.

A Qwen3-Next decoder layer is two residual blocks of the shared hybrid decoder: a token mixer (``gdn`` for
'linear_attention' layers, gated ``attention`` for 'full_attention' layers) and an FFN (``moe``, or a dense
SwiGLU ``mlp`` for ``mlp_only_layers`` / off the ``decoder_sparse_step``). Layer ``i`` is blocks ``2i`` and
``2i + 1``. The family's options of the shared modules: RMSNorm scale ``1 + w``
(``norm_weight_offset = 1``), attention with a per-head output gate, q / k norm and partial NeoX RoPE, gated
SiLU experts, softmax router and a sigmoid-gated shared expert.

``config.json`` (both dialects) is parsed by registry.hf_config.parse_qwen3_next. It has no MTP field:
released checkpoints carry one ``mtp.*`` module, so ``num_nextn_predict_layers`` defaults to 1 (as vLLM and
SGLang assume); the loader loads it when the files have it.

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
  These are the shared :class:`runners.engine.models.mtp.MTPModule`'s ``hnorm`` / ``enorm`` / ``eh_proj`` /
  ``blocks`` / ``final_norm``.
"""

from __future__ import annotations

import re

import torch

from runners.engine.models.hybrid import HybridLM
from runners.engine.models.moe import unstack_expert_names

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
