"""Quantized checkpoints in the engine: the modules that hold quantized weights, and the swap that puts them
into a model built on the meta device, before its weights are loaded (so quantized tensors go from the files
straight to the device in their on-disk format; the model code never learns about quantization).

What is quantized, and how, is read from the checkpoint (``registry.hf_config.QuantConfig``: config.json's
``quantization_config`` or ModelOpt's ``hf_quant_config.json``), never guessed: each linear layer whose
checkpoint module name has a format (``QuantConfig.module_format``: excluded modules and, in a ModelOpt
MIXED_PRECISION checkpoint, modules its ``quantized_layers`` does not name stay unquantized) becomes the
module of that format, each MoE block whose routed experts have one the MoE of that format:

- ``fp8`` (per-tensor, static activation scale): :class:`FP8Linear` / :class:`FP8MoE`, tensors
  ``weight_scale``, ``input_scale``; GEMMs in runners.engine.models.fp8.
- ``block_fp8`` (128 x 128 blocks, dynamic activations): :class:`BlockFP8Linear` / :class:`BlockFP8MoE`,
  ``weight_scale_inv``; GEMMs kernels.quant.block_fp8 (runners.engine.models.block_fp8).
- ``nvfp4`` (run W4A16): :class:`NVFP4Linear` / :class:`NVFP4MoE`, ``weight_scale``, ``weight_scale_2``,
  ``input_scale``; GEMMs kernels.quant.nvfp4 (runners.engine.models.nvfp4).

With an FP8 KV cache declared, every attention block whose checkpoint stores ``k_proj.k_scale`` /
``v_proj.v_scale`` (ModelOpt's names, e.g. ``backbone.layers.5.mixer.k_proj.k_scale``) gets them as buffers;
a block without them (ModelOpt copies an excluded MTP module without any scale) uses 1.0, the default vLLM
applies when a checkpoint has no KV scales (a log line names the blocks; runners.engine.engine warns again).
The loader then requires exactly the tensors of the swapped modules and no others, so a checkpoint whose files
do not match its own config fails with the tensor names. Never quantized, whatever the config says:
embeddings, norms, the MoE router (a float32 parameter, not a linear layer), convolutions, Qwen3-Next's
``shared_expert_gate`` (read as a router-like float32 gate by ``MoE.forward``) and a head tied to the
embeddings.

Refused with a CheckpointError (runners.engine.quant_formats.check_runnable): per-tensor FP8 with dynamic
activation scales, block FP8 with blocks other than 128 x 128 or static activations; one MoE block whose
experts mix formats.

Tensor parallelism (sharding modules after the build) composes with the FP8 modules: an :class:`FP8Linear`
is sharded like an nn.Linear (rows or columns of ``weight``; ``bias`` with the rows) and its per-tensor
``weight_scale`` / ``input_scale`` stay as they are; :class:`FP8MoE` keeps per-expert scales [E] beside the
stacked weights [E, ...]. Block-FP8 and NVFP4 models run on one GPU (runners.app.support refuses
world_size > 1 with quantized weights).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernels.moe_gemv import ACT_CODES
from kernels.quant.moe_gemv import moe_gemv_block_fp8, moe_gemv_nvfp4, nvfp4_words_ok
from registry.checkpoint import CheckpointError
from registry.hf_config import FORMAT_BLOCK_FP8, FORMAT_FP8, FORMAT_NVFP4, NVFP4_GROUP_SIZE, QuantConfig
from runners.engine.compile import eager_op
from runners.engine.models import block_fp8 as bf8
from runners.engine.models import nvfp4 as nf4
from runners.engine.models.attention import Attention
from runners.engine.models.config import family_module
from runners.engine.models.fp8 import (
    FP8_DTYPE,
    FP8Weights,
    fp8_linear,
    fp8_moe_impl,
    moe_experts_fp8,
    moe_experts_fp8_ref,
    scaled_mm_supported,
)
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.layers import MoE
from runners.engine.models.moe import moe_experts_grouped, use_quant_moe_gemv
from runners.engine.quant_formats import check_runnable

log = logging.getLogger(__name__)

EXPERT_KINDS = ("up", "gate", "down")
# Linear layers the model reads as raw weights (MoE.forward: sigmoid(x W^T) in float32): never FP8.
UNQUANTIZED_LINEARS = ("shared_expert_gate",)
# Checkpoint tensor suffixes that exist only in quantized checkpoints (used to explain loader errors).
QUANT_TENSOR_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale", ".weight_scale_inv",
                         ".weight_scale_2")


class FP8Linear(nn.Module):
    """A linear layer with FP8 weights and a static FP8 activation scale (ModelOpt's FP8 layout):

    ``weight`` [out, in] float8_e4m3fn (a Parameter without gradient), ``weight_scale`` 0-dim float32 and
    ``input_scale`` 0-dim float32 (persistent buffers, the checkpoint's per-tensor scales), ``bias`` [out] in
    the model dtype or None. forward(x [..., in]) -> [..., out] in x's dtype through
    :func:`runners.engine.models.fp8.fp8_linear` (``torch._scaled_mm`` on FP8-capable GPUs, else the
    dequantizing
    reference). Mutates nothing.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """An FP8Linear of ``linear``'s shape, device and bias dtype (its values are not copied: the module is
        filled from a checkpoint)."""
        bias = linear.bias
        return cls(linear.in_features, linear.out_features, bias is not None, device=linear.weight.device,
                   bias_dtype=bias.dtype if bias is not None else torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager_op(fp8_linear)(x, self.weight, self.weight_scale, self.input_scale, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class FP8MoE(MoE):
    """An MoE block whose routed experts hold FP8 weights: ``experts_{up,gate,down}`` float8_e4m3fn with the
    shapes of :class:`runners.engine.models.layers.MoE`, per-expert ``experts_<kind>_weight_scale`` [E] and
    ``experts_<kind>_input_scale`` [E] float32 buffers (checkpoint names
    ``experts.{e}.<kind>_proj.{weight_scale,input_scale}``). Router, shared expert and latent projections are
    those of the MoE it was made from (the shared expert's linears are FP8Linear where the config says so).

    ``experts_impl`` "fused" runs :func:`runners.engine.models.fp8.moe_experts_fp8` with ``fp8_impl`` (set by
    :func:`prepare_fp8` after loading: "scaled_grouped_mm" or "dequant"; None decides per call), "ref" the
    per-expert loop :func:`runners.engine.models.fp8.moe_experts_fp8_ref`.
    """

    fp8_impl: str | None = None

    def fp8_weights(self) -> tuple[FP8Weights, FP8Weights | None, FP8Weights]:
        """(up, gate or None, down) as FP8Weights."""
        out = []
        for kind in EXPERT_KINDS:
            w = getattr(self, f"experts_{kind}")
            scales = (getattr(self, f"experts_{kind}_{s}", None) for s in ("weight_scale", "input_scale"))
            out.append(None if w is None else FP8Weights(w, *scales))
        up, gate, down = out
        return up, gate, down

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        up, gate, down = self.fp8_weights()
        if self.experts_impl == "ref":
            return moe_experts_fp8_ref(h, weights, indices, up, gate, down, self.act)
        return moe_experts_fp8(h, weights, indices, up, gate, down, self.act, impl=self.fp8_impl)


def _to_fp8_moe(moe: MoE) -> None:
    """Turn ``moe`` (on any device, usually meta) into an :class:`FP8MoE` in place: FP8 expert parameters of
    the same shapes, scale buffers of ones."""
    for kind in EXPERT_KINDS:
        p = getattr(moe, f"experts_{kind}")
        if p is None:
            continue
        setattr(moe, f"experts_{kind}",
                nn.Parameter(torch.empty(p.shape, dtype=FP8_DTYPE, device=p.device), requires_grad=False))
        for scale in ("weight_scale", "input_scale"):
            moe.register_buffer(f"experts_{kind}_{scale}", torch.ones(p.shape[0], device=p.device))
    moe.__class__ = FP8MoE


class BlockFP8Linear(nn.Module):
    """A linear layer with block-FP8 weights (transformers' fine-grained FP8): ``weight`` [out, in]
    float8_e4m3fn (a Parameter without gradient), ``weight_scale_inv`` [ceil(out / 128), ceil(in / 128)]
    float32 (a persistent buffer; the checkpoint's bfloat16 / float32 block multipliers, upcast on load),
    ``bias`` [out] or None. forward(x [..., in]) -> [..., out] in x's dtype through
    :func:`runners.engine.models.block_fp8.block_fp8_linear` (activations quantized per token and 128-column
    group at run time). Mutates nothing."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bn, bk = bf8.BLOCK_FP8_BLOCK
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.ones(-(-out_features // bn), -(-in_features // bk),
                                                             dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager_op(bf8.block_fp8_linear)(x, self.weight, self.weight_scale_inv, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class NVFP4Linear(nn.Module):
    """A linear layer with NVFP4 weights run weight-only (W4A16): ``weight`` [out, in / 2] uint8 (two e2m1
    values per byte, element 2j in the low nibble; a Parameter without gradient), ``weight_scale`` [out,
    in / 16] float8_e4m3fn, ``weight_scale_2`` 0-dim float32 (global) and ``input_scale`` 0-dim float32 (the
    W4A4 activation scale, loaded because the checkpoint has it and unused), persistent buffers; ``bias``
    [out] or None. forward(x [..., in]) -> [..., out] in x's dtype through
    :func:`runners.engine.models.nvfp4.nvfp4_linear`. Mutates nothing."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=nf4.NVFP4_PACKED_DTYPE,
                                               device=device), requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // NVFP4_GROUP_SIZE,
                                                         dtype=nf4.NVFP4_SCALE_DTYPE, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager_op(nf4.nvfp4_linear)(x, self.weight, self.weight_scale, self.weight_scale_2, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class BlockFP8MoE(MoE):
    """An MoE block whose routed experts hold block-FP8 weights: ``experts_{up,gate,down}`` float8_e4m3fn
    with the shapes of :class:`runners.engine.models.layers.MoE` ([E, out, in]) and
    ``experts_<kind>_weight_scale_inv`` [E, ceil(out / 128), ceil(in / 128)] float32 buffers (checkpoint names
    ``experts.{e}.<kind>_proj.weight_scale_inv``). The experts run as one grouped GEMM per projection over
    expert-sorted rows (:func:`runners.engine.models.block_fp8.block_fp8_grouped_mm`, no host
    synchronisation), or at decode sizes on CUDA (``use_quant_moe_gemv``: at most
    ``QUANT_MOE_GEMV_MAX_PAIRS["block_fp8"]`` pairs) as kernels/quant/moe_gemv.py's per-pair GEMVs (three
    launches, same math);
    router, shared expert and latent projections are those of the MoE it was made from."""

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.act_name in ACT_CODES and use_quant_moe_gemv(h, indices, "block_fp8"):
            mats = {k: (getattr(self, f"experts_{k}"), getattr(self, f"experts_{k}_weight_scale_inv"))
                    for k in _kinds(self)}
            return moe_gemv_block_fp8(h, weights, indices, mats["up"], mats.get("gate"), mats["down"],
                                      self.act_name)

        def mm(x: torch.Tensor, kind: str, offsets: torch.Tensor) -> torch.Tensor:
            return bf8.block_fp8_grouped_mm(x, getattr(self, f"experts_{kind}"),
                                            getattr(self, f"experts_{kind}_weight_scale_inv"), offsets)

        return moe_experts_grouped(h, weights, indices, _kinds(self), mm, self.act, self.experts_up.shape[0])


class NVFP4MoE(MoE):
    """An MoE block whose routed experts hold NVFP4 weights, run W4A16: ``experts_{up,gate,down}`` uint8 [E,
    out, in / 2], ``experts_<kind>_weight_scale`` float8_e4m3fn [E, out, in / 16],
    ``experts_<kind>_weight_scale_2`` and ``experts_<kind>_input_scale`` [E] float32 (checkpoint names
    ``experts.{e}.<kind>_proj.{weight,weight_scale,weight_scale_2,input_scale}``; input scales unused). One
    grouped GEMM per projection over expert-sorted rows
    (:func:`runners.engine.models.nvfp4.nvfp4_grouped_mm`, no host synchronisation), or at decode sizes on
    CUDA (``use_quant_moe_gemv``: at most ``QUANT_MOE_GEMV_MAX_PAIRS["nvfp4"]`` pairs; codes in whole int32
    words) as
    kernels/quant/moe_gemv.py's per-pair GEMVs (three launches, same math)."""

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        mats = {k: tuple(getattr(self, f"experts_{k}{s}") for s in ("", "_weight_scale", "_weight_scale_2"))
                for k in _kinds(self)}
        if (self.act_name in ACT_CODES and use_quant_moe_gemv(h, indices, "nvfp4")
                and nvfp4_words_ok(*mats.values())):
            return moe_gemv_nvfp4(h, weights, indices, mats["up"], mats.get("gate"), mats["down"],
                                  self.act_name)

        def mm(x: torch.Tensor, kind: str, offsets: torch.Tensor) -> torch.Tensor:
            return nf4.nvfp4_grouped_mm(x, getattr(self, f"experts_{kind}"),
                                        getattr(self, f"experts_{kind}_weight_scale"),
                                        getattr(self, f"experts_{kind}_weight_scale_2"), offsets)

        return moe_experts_grouped(h, weights, indices, _kinds(self), mm, self.act, self.experts_up.shape[0])


def _kinds(moe: MoE) -> tuple[str, ...]:
    return tuple(k for k in EXPERT_KINDS if getattr(moe, f"experts_{k}") is not None)


def _to_quantized_moe(moe: MoE, fmt: str) -> None:
    """Turn ``moe`` (on any device, usually meta) into the MoE class of ``fmt`` in place: expert parameters
    and scale buffers of the format's shapes and dtypes (values unset: the checkpoint fills them)."""
    if fmt == FORMAT_FP8:
        _to_fp8_moe(moe)
        return
    for kind in _kinds(moe):
        p = getattr(moe, f"experts_{kind}")
        E, out, inp = p.shape
        dev = p.device
        if fmt == FORMAT_BLOCK_FP8:
            bn, bk = bf8.BLOCK_FP8_BLOCK
            w = torch.empty(E, out, inp, dtype=FP8_DTYPE, device=dev)
            setattr(moe, f"experts_{kind}", nn.Parameter(w, requires_grad=False))
            moe.register_buffer(f"experts_{kind}_weight_scale_inv",
                                torch.ones(E, -(-out // bn), -(-inp // bk), device=dev))
        else:
            setattr(moe, f"experts_{kind}", nn.Parameter(
                torch.empty(E, out, inp // 2, dtype=nf4.NVFP4_PACKED_DTYPE, device=dev), requires_grad=False))
            moe.register_buffer(f"experts_{kind}_weight_scale", torch.empty(
                E, out, inp // NVFP4_GROUP_SIZE, dtype=nf4.NVFP4_SCALE_DTYPE, device=dev))
            moe.register_buffer(f"experts_{kind}_weight_scale_2", torch.ones(E, device=dev))
            moe.register_buffer(f"experts_{kind}_input_scale", torch.ones(E, device=dev))
    moe.__class__ = BlockFP8MoE if fmt == FORMAT_BLOCK_FP8 else NVFP4MoE


LINEAR_CLASSES = {FORMAT_FP8: FP8Linear, FORMAT_BLOCK_FP8: BlockFP8Linear, FORMAT_NVFP4: NVFP4Linear}


def checkpoint_module_names(model: HybridLM) -> dict[int, str]:
    """``{id(parameter): checkpoint name}`` of every parameter the family's ``checkpoint_targets`` maps as a
    whole (everything but stacked experts, whose rows map to per-expert names)."""
    c = model.config
    targets = family_module(c.family, c.source).checkpoint_targets(model)
    return {id(t): n for n, t in targets.items()}


@dataclass
class QuantTargets:
    """What a QuantConfig quantizes in a model (:func:`quantization_targets`): ``linears`` as (module name in
    the model, checkpoint module name, the nn.Linear), ``moes`` as (module name, checkpoint prefix of the
    block, e.g. ``backbone.layers.2.mixer.``, the MoE) whose routed experts are quantized, ``attentions`` as
    (module name, checkpoint module name, the Attention) that may carry KV-cache scales (empty unless the
    config declares an FP8 KV cache); ``formats`` the weight format of each linear's checkpoint name and
    each MoE's prefix (``registry.hf_config.FORMAT_*``)."""

    linears: list[tuple[str, str, nn.Linear]] = field(default_factory=list)
    moes: list[tuple[str, str, MoE]] = field(default_factory=list)
    attentions: list[tuple[str, str, Attention]] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)


def quantization_targets(model: HybridLM, quant: QuantConfig) -> QuantTargets:
    """The one rule of what is quantized and in which format (the loader's swap, the quantizer and
    runners.tools.synth all use it): every ``nn.Linear`` whose checkpoint module name has a format
    (``quant.module_format``; never :data:`UNQUANTIZED_LINEARS` or a head tied to the embeddings), every MoE
    block whose expert projections ``<prefix>experts.{e}.{kind}_proj`` have one, and with ``kv_cache_quant
    == "fp8"`` every attention block.

    Raises:
        CheckpointError: a config that gives one MoE block's experts different formats (some unquantized and
            others not, or FP8 and NVFP4 mixed; the engine stores one block's experts in one format).
    """
    names = checkpoint_module_names(model)
    out = QuantTargets()
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            ckpt = names.get(id(module.weight))
            if ckpt is None or name.rsplit(".", 1)[-1] in UNQUANTIZED_LINEARS:
                continue  # a head tied to the embeddings; a gate read as a raw weight
            ckpt = ckpt.removesuffix(".weight")
            fmt = quant.module_format(ckpt)
            if fmt is not None:
                out.linears.append((name, ckpt, module))
                out.formats[ckpt] = fmt
        elif isinstance(module, MoE):
            prefix = names[id(module.gate.weight)].removesuffix("gate.weight")
            formats = {
                quant.module_format(f"{prefix}experts.{e}.{k}_proj")
                for e in range(module.experts_up.shape[0]) for k in _kinds(module)
            }
            if len(formats) > 1:
                shown = sorted(f or "unquantized" for f in formats)
                raise CheckpointError(
                    f"{quant.source}: the quantization config gives the routed experts of {prefix}experts "
                    f"different formats ({', '.join(shown)}); the engine stores one MoE block's experts in "
                    "one format",
                    "quantize all experts of a block alike",
                )
            fmt = formats.pop()
            if fmt is not None:
                out.moes.append((name, prefix, module))
                out.formats[prefix] = fmt
        elif isinstance(module, Attention) and quant.kv_cache_quant == "fp8":
            ckpt = names[id(module.k_proj.weight)].removesuffix("k_proj.weight")
            out.attentions.append((name, ckpt, module))
    return out


def apply_quantization(
    model: HybridLM, quant: QuantConfig, tensor_names: Collection[str] | None = None
) -> dict[str, int]:
    """Swap the quantized modules the checkpoint declares into ``model`` in place (model usually on the meta
    device, before loading; :func:`quantization_targets` says which, the module docstring what never is).

    ``tensor_names``: the checkpoint's tensor names; with them an attention block gets ``k_scale`` /
    ``v_scale`` buffers only where the checkpoint stores both (the others use 1.0, logged); None gives every
    attention block of an FP8 KV cache both (the quantizer, which writes them).

    Returns:
        Counts: ``{"<format>_linears": n, "<format>_moe": n, ..., "kv_scales": n}`` (attention blocks given k
        / v scales).

    Raises:
        CheckpointError: a quantization the engine cannot run (:func:`check_runnable`), the problems of
            :func:`quantization_targets`, an attention block with only one of k_scale / v_scale on disk.
    """
    check_runnable(quant)
    t = quantization_targets(model, quant)
    counts: dict[str, int] = {}
    for name, ckpt, linear in t.linears:
        fmt = t.formats[ckpt]
        parent, _, attr = name.rpartition(".")
        bias = linear.bias
        new = LINEAR_CLASSES[fmt](linear.in_features, linear.out_features, bias is not None,
                                  device=linear.weight.device,
                                  bias_dtype=bias.dtype if bias is not None else torch.float32)
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        counts[f"{fmt}_linears"] = counts.get(f"{fmt}_linears", 0) + 1
    for _, prefix, moe in t.moes:
        fmt = t.formats[prefix]
        _to_quantized_moe(moe, fmt)
        counts[f"{fmt}_moe"] = counts.get(f"{fmt}_moe", 0) + 1
    without = []
    kv = 0
    for _, ckpt, attn in t.attentions:
        if tensor_names is not None:
            have = [f"{ckpt}{n}_proj.{n}_scale" in tensor_names for n in ("k", "v")]
            if have[0] != have[1]:
                raise CheckpointError(
                    f"{quant.source}: attention {ckpt.rstrip('.')} stores "
                    f"{'k_proj.k_scale' if have[0] else 'v_proj.v_scale'} but not "
                    f"{'v_proj.v_scale' if have[0] else 'k_proj.k_scale'}; the checkpoint is incomplete",
                    "restore the checkpoint's missing scale tensor (re-download or re-export it)",
                )
            if not have[0]:
                without.append(ckpt.rstrip("."))
                continue
        dev = attn.k_proj.weight.device
        attn.k_proj.register_buffer("k_scale", torch.ones((), device=dev))
        attn.v_proj.register_buffer("v_scale", torch.ones((), device=dev))
        kv += 1
    if without:
        log.info("FP8 KV cache: no k_scale / v_scale was loaded for %d attention blocks (%s); their "
                 "keys and values use scale 1.0 (vLLM's default when a checkpoint has none)", len(without),
                 ", ".join(without[:4]) + (" ..." if len(without) > 4 else ""))
    counts["kv_scales"] = kv
    return counts


def kv_cache_scales(model: HybridLM) -> dict[int, tuple[torch.Tensor, torch.Tensor] | None]:
    """``{cache_index: (k_scale, v_scale)}`` (0-dim float32, the checkpoint's) of every attention block of the
    backbone and MTP module, or None for a block whose checkpoint has no KV scales."""
    blocks = list(model.layers) + (list(model.mtp.blocks) if model.mtp is not None else [])
    out: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
    for block in blocks:
        if block.kind == "attention":
            ks = getattr(block.mixer.k_proj, "k_scale", None)
            vs = getattr(block.mixer.v_proj, "v_scale", None)
            out[block.cache_index] = (ks, vs) if ks is not None and vs is not None else None
    return out


def prepare_fp8(model: HybridLM, dtype: torch.dtype) -> dict[str, Any]:
    """After loading a model of compute dtype ``dtype``: fix which GEMM each quantized module runs on the
    model's device (for the FP8 MoE this probes ``torch._scaled_grouped_mm`` once, so nothing is probed inside
    a captured step) and return a report: ``{"fp8_linears": {"scaled_mm": n, "reference": n}, "fp8_moe":
    {impl: n}, "block_fp8_linears": {path: n}, "block_fp8_moe": {path: n}, "nvfp4_linears": {path: n},
    "nvfp4_moe": {path: n}, "kv_scales": n}`` (path "triton", "triton+scaled_mm" (block FP8) or "reference";
    the block-FP8 and NVFP4 keys only where such modules exist; empty dicts / 0 for an unquantized model). The
    report is logged (INFO) and stored as ``model.quant_report``."""
    report: dict[str, Any] = {"fp8_linears": {}, "fp8_moe": {}, "block_fp8_linears": {}, "block_fp8_moe": {},
                              "nvfp4_linears": {}, "nvfp4_moe": {}, "kv_scales": 0}

    def count(key: str, path: str) -> None:
        report[key][path] = report[key].get(path, 0) + 1

    for module in model.modules():
        if isinstance(module, FP8Linear):
            probe = torch.empty(0, module.in_features, device=module.weight.device, dtype=dtype)
            count("fp8_linears", "scaled_mm" if scaled_mm_supported(probe, module.weight) else "reference")
        elif isinstance(module, FP8MoE):
            up, gate, down = module.fp8_weights()
            probe = torch.empty(0, up.weight.shape[2], device=up.weight.device, dtype=dtype)
            module.fp8_impl = fp8_moe_impl(probe, *(p for p in (up, gate, down) if p is not None))
            count("fp8_moe", module.fp8_impl)
        elif isinstance(module, BlockFP8Linear):
            count("block_fp8_linears", bf8.block_fp8_path(module.weight.device, tuple(module.weight.shape)))
        elif isinstance(module, BlockFP8MoE):
            count("block_fp8_moe", bf8.block_fp8_path(module.experts_up.device))
        elif isinstance(module, NVFP4Linear):
            count("nvfp4_linears", nf4.nvfp4_path(module.weight.device))
        elif isinstance(module, NVFP4MoE):
            count("nvfp4_moe", nf4.nvfp4_path(module.experts_up.device))
    for key in ("block_fp8_linears", "block_fp8_moe", "nvfp4_linears", "nvfp4_moe"):
        if not report[key]:
            del report[key]  # the FP8-only report keeps its shape
    report["kv_scales"] = sum(v is not None for v in kv_cache_scales(model).values())
    if any(report.values()):
        log.info("quantized model: %s", ", ".join(f"{k} {v}" for k, v in report.items() if v))
    model.quant_report = report
    return report
