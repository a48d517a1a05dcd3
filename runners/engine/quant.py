"""FP8 checkpoints in the engine: the modules that hold FP8 weights, and the swap that puts them into a model
built on the meta device, before its weights are loaded (so FP8 tensors go from the files straight to the
device in FP8; the model code never learns about quantization).

What is quantized is read from the checkpoint (``registry.hf_config.QuantConfig``: config.json's
``quantization_config`` or ModelOpt's ``hf_quant_config.json``), never guessed: every linear layer of the
model whose checkpoint module name the config does not exclude becomes an :class:`FP8Linear`, every MoE
block whose routed experts it does not exclude an :class:`FP8MoE`; with an FP8 KV cache declared, every
attention block's ``k_proj`` / ``v_proj`` gets the per-tensor ``k_scale`` / ``v_scale`` buffer it is stored
under (ModelOpt's names, e.g. ``backbone.layers.5.mixer.k_proj.k_scale``). The loader then requires exactly
those tensors (``weight`` float8_e4m3fn, ``weight_scale`` and ``input_scale`` float32) and no others, so a
checkpoint whose files do not match its own config fails with the tensor names. Never quantized, whatever
the config says: embeddings, norms, the MoE router (a float32 parameter, not a linear layer), convolutions,
Qwen3-Next's ``shared_expert_gate`` (read as a router-like float32 gate by ``MoE.forward``) and a head tied
to the embeddings.

Supported: per-tensor FP8 with static activation scales (ModelOpt ``quant_algo: FP8``; HF / vLLM
``quant_method: fp8`` with ``activation_scheme: static``). Refused with a CheckpointError: NVFP4, block-wise
FP8 (transformers' fine-grained ``weight_block_size``), dynamic activation scales.

Tensor parallelism (sharding modules after the build) composes with these modules: an :class:`FP8Linear`
is sharded like an nn.Linear (rows or columns of ``weight``; ``bias`` with the rows) and its per-tensor
``weight_scale`` / ``input_scale`` stay as they are; :class:`FP8MoE` keeps per-expert scales [E] beside the
stacked weights [E, ...] (expert parallelism slices both along E; sharding the intermediate size keeps them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from registry.checkpoint import CheckpointError
from registry.hf_config import QuantConfig
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
from runners.engine.models.layers import Attention, MoE

log = logging.getLogger(__name__)

EXPERT_KINDS = ("up", "gate", "down")
# Linear layers the model reads as raw weights (MoE.forward: sigmoid(x W^T) in float32): never FP8.
UNQUANTIZED_LINEARS = ("shared_expert_gate",)
# Checkpoint tensor suffixes that exist only in quantized checkpoints (used to explain loader errors).
QUANT_TENSOR_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale", ".weight_scale_inv")


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
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)

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


def check_runnable(quant: QuantConfig) -> None:
    """Raise CheckpointError unless the engine runs this quantization (per-tensor FP8, static activations)."""
    src = quant.source
    if quant.method != "fp8":
        raise CheckpointError(
            f"{src}: {quant.method.upper()} weights ({quant.format} {quant.algo}) are not supported by this "
            "engine (it has an FP8 path only)",
            "use the checkpoint's FP8 or BF16 release",
        )
    if quant.weight_block_size is not None:
        raise CheckpointError(
            f"{src}: block-wise FP8 (weight_block_size {list(quant.weight_block_size)}, transformers' "
            "fine-grained FP8) is not supported: the engine runs per-tensor FP8 scales",
            "quantize the BF16 release with python -m runners.tools.quantize --fp8 SRC DST "
            "(ModelOpt's per-tensor "
            "FP8 layout), or use a ModelOpt FP8 checkpoint",
        )
    if quant.activation_scheme != "static":
        raise CheckpointError(
            f"{src}: activation_scheme {quant.activation_scheme} is not supported: the engine runs static "
            "(calibrated input_scale) FP8 activations",
            "use a checkpoint with static activation scales (python -m runners.tools.quantize --fp8 "
            "writes one)",
        )


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
    block, e.g. ``backbone.layers.2.mixer.``, the MoE) whose routed experts are FP8, ``attentions`` as
    (module name, checkpoint module name, the Attention) that carry KV-cache scales (empty unless the
    config declares an FP8 KV cache)."""

    linears: list[tuple[str, str, nn.Linear]] = field(default_factory=list)
    moes: list[tuple[str, str, MoE]] = field(default_factory=list)
    attentions: list[tuple[str, str, Attention]] = field(default_factory=list)


def quantization_targets(model: HybridLM, quant: QuantConfig) -> QuantTargets:
    """The one rule of what is FP8 (the loader's swap and the quantizer both use it): every ``nn.Linear``
    whose checkpoint module name ``quant`` does not exclude (never :data:`UNQUANTIZED_LINEARS` or a head tied
    to the embeddings), every MoE block none of whose experts ``<prefix>experts.{e}.{kind}_proj`` it
    excludes, and with ``kv_cache_quant == "fp8"`` every attention block.

    Raises:
        CheckpointError: an exclude list that keeps some experts of one MoE block unquantized and quantizes
            others (the engine stores one block's experts in one dtype).
    """
    names = checkpoint_module_names(model)
    out = QuantTargets()
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            ckpt = names.get(id(module.weight))
            if ckpt is None or name.rsplit(".", 1)[-1] in UNQUANTIZED_LINEARS:
                continue  # a head tied to the embeddings; a gate read as a raw weight
            ckpt = ckpt.removesuffix(".weight")
            if not quant.is_excluded(ckpt):
                out.linears.append((name, ckpt, module))
        elif isinstance(module, MoE):
            prefix = names[id(module.gate.weight)].removesuffix("gate.weight")
            kinds = [k for k in EXPERT_KINDS if getattr(module, f"experts_{k}") is not None]
            excluded = {
                quant.is_excluded(f"{prefix}experts.{e}.{k}_proj")
                for e in range(module.experts_up.shape[0]) for k in kinds
            }
            if excluded == {True, False}:
                raise CheckpointError(
                    f"{quant.source}: the exclude list keeps some routed experts of {prefix}experts in BF16 "
                    "and quantizes others; the engine stores one MoE block's experts in one dtype",
                    "quantize all experts of a block or none",
                )
            if excluded == {False}:
                out.moes.append((name, prefix, module))
        elif isinstance(module, Attention) and quant.kv_cache_quant == "fp8":
            ckpt = names[id(module.k_proj.weight)].removesuffix("k_proj.weight")
            out.attentions.append((name, ckpt, module))
    return out


def apply_quantization(model: HybridLM, quant: QuantConfig) -> dict[str, int]:
    """Swap the FP8 modules the checkpoint declares into ``model`` in place (model usually on the meta device,
    before loading; :func:`quantization_targets` says which, the module docstring what never is).

    Returns:
        Counts: ``{"fp8_linears": n, "fp8_moe": n, "kv_scales": n}`` (attention blocks given k / v scales).

    Raises:
        CheckpointError: a quantization the engine cannot run (:func:`check_runnable`), or the problems of
            :func:`quantization_targets`.
    """
    check_runnable(quant)
    t = quantization_targets(model, quant)
    for name, _, linear in t.linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, FP8Linear.from_linear(linear))
    for _, _, moe in t.moes:
        _to_fp8_moe(moe)
    for _, _, attn in t.attentions:
        dev = attn.k_proj.weight.device
        attn.k_proj.register_buffer("k_scale", torch.ones((), device=dev))
        attn.v_proj.register_buffer("v_scale", torch.ones((), device=dev))
    return {"fp8_linears": len(t.linears), "fp8_moe": len(t.moes), "kv_scales": len(t.attentions)}


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
    """After loading a model of compute dtype ``dtype``: fix which FP8 GEMM each module runs on the model's
    device (for the MoE this probes
    ``torch._scaled_grouped_mm`` once, so nothing is probed inside a captured step) and return a report:
    ``{"fp8_linears": {"scaled_mm": n, "reference": n}, "fp8_moe": {impl: n}, "kv_scales": n}`` (empty
    dicts / 0 for an unquantized model). The report is logged (INFO) and stored as ``model.quant_report``."""
    report: dict[str, Any] = {"fp8_linears": {}, "fp8_moe": {}, "kv_scales": 0}
    for module in model.modules():
        if isinstance(module, FP8Linear):
            probe = torch.empty(0, module.in_features, device=module.weight.device, dtype=dtype)
            path = "scaled_mm" if scaled_mm_supported(probe, module.weight) else "reference"
            report["fp8_linears"][path] = report["fp8_linears"].get(path, 0) + 1
        elif isinstance(module, FP8MoE):
            up, gate, down = module.fp8_weights()
            probe = torch.empty(0, up.weight.shape[2], device=up.weight.device, dtype=dtype)
            module.fp8_impl = fp8_moe_impl(probe, *(p for p in (up, gate, down) if p is not None))
            report["fp8_moe"][module.fp8_impl] = report["fp8_moe"].get(module.fp8_impl, 0) + 1
    report["kv_scales"] = sum(v is not None for v in kv_cache_scales(model).values())
    if report["fp8_linears"] or report["fp8_moe"] or report["kv_scales"]:
        log.info("FP8 model: linear GEMMs %s, MoE experts %s, attention blocks with KV scales: %d",
                 report["fp8_linears"], report["fp8_moe"], report["kv_scales"])
    model.quant_report = report
    return report
