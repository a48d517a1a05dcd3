"""Tiny random Qwen3-Next checkpoints for engine and loader tests, with transformers' model as the oracle.

`runners.tools.tiny.write_random_checkpoint` writes the checkpoint (released names, per-expert MoE tensors, an
`mtp.*` module); the weights are then re-drawn at a scale that gives distinct logits (HF's init makes every
logit ~0, so greedy ties would dominate) and the oracle is transformers' `Qwen3NextForCausalLM` loaded from
the same files. Sizes are awkward on purpose: HV = 2H GDN value heads, head_k_dim 12 != head_v_dim 20 (a
transposed state fails), partial rotary (4 of 16 dims), GQA, a dense SwiGLU layer among MoE layers.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runners.tools.tiny import write_random_checkpoint

QWEN_TINY = dict(
    vocab_size=61,
    hidden_size=48,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mlp_only_layers=[2],  # one dense SwiGLU layer (intermediate_size)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=12,
    linear_value_head_dim=20,
    linear_conv_kernel_dim=4,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=28,
    intermediate_size=36,
    max_position_embeddings=256,
)

# norms that scale by (1 + w) in Qwen3-Next (the GDN output norm `linear_attn.norm` scales by w)
_OFFSET_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "pre_fc_norm_embedding.weight",
                 "pre_fc_norm_hidden.weight", "model.norm.weight", "mtp.norm.weight")


def _redraw(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):  # decay rates in [0.05, 1]: the state carries across the sequence
        return (torch.rand(shape, generator=g) * 0.95 + 0.05).log()
    if name.endswith("dt_bias"):
        return torch.rand(shape, generator=g) * 2 - 1
    if name.endswith(_OFFSET_NORMS):
        return 0.3 * torch.randn(shape, generator=g)
    if name.endswith("linear_attn.norm.weight"):
        return 1 + 0.3 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])  # fan-in scale (conv: fan-in W)


def write_qwen_checkpoint(path: str | Path, seed: int = 0, *, with_mtp: bool = True, **overrides) -> Path:
    """A float32 tiny Qwen3-Next checkpoint dir (QWEN_TINY updated by `overrides`) with well-scaled random
    weights; `with_mtp=False` drops the `mtp.*` tensors."""
    path = Path(path)
    write_random_checkpoint(path, "qwen3_next", {**QWEN_TINY, **overrides}, seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {
        name: _redraw(name, t.shape, g)
        for name, t in sorted(tensors.items())
        if with_mtp or not name.startswith("mtp.")
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_hf(path: str | Path):
    """transformers' Qwen3NextForCausalLM from `path` in float32, eval mode (it ignores `mtp.*`)."""
    from transformers import Qwen3NextForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "mtp.* unexpected" and reference-kernel fallback notices
    try:
        return Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(level)
