"""Quantized checkpoints in the engine: the swap that puts each weight format's modules into a model built on
the meta device, before its weights are loaded (so quantized tensors go from the files straight to the device
in their on-disk format; the model code never learns about quantization).

What is quantized, and how, is read from the checkpoint (``registry.hf_config.QuantConfig``: config.json's
``quantization_config`` or ModelOpt's ``hf_quant_config.json``), never guessed: each linear layer whose
checkpoint module name has a format (``QuantConfig.module_format``: excluded modules and, in a ModelOpt
MIXED_PRECISION checkpoint, modules its ``quantized_layers`` does not name stay unquantized) becomes the
module of that format, each MoE block whose routed experts have one the MoE of that format. Each format is
one module of runners/engine/formats/ (its rules: what it runs, its tensors, its hardware) with its torch
modules and GEMMs in runners/engine/models/<format>.py; this module dispatches through
``runners.engine.formats.get_format`` and names none.

With an FP8 KV cache declared, every attention block whose checkpoint stores ``k_proj.k_scale`` /
``v_proj.v_scale`` (ModelOpt's names, e.g. ``backbone.layers.5.mixer.k_proj.k_scale``) gets them as buffers;
a block without them (ModelOpt copies an excluded MTP module without any scale) uses 1.0, the default vLLM
applies when a checkpoint has no KV scales (a log line names the blocks; runners.engine.engine warns again).
The loader then requires exactly the tensors of the swapped modules and no others, so a checkpoint whose files
do not match its own config fails with the tensor names. Never quantized, whatever the config says:
embeddings, norms, the MoE router (a float32 parameter, not a linear layer), convolutions, Qwen3-Next's
``shared_expert_gate`` (read as a router-like float32 gate by ``MoE.forward``) and a head tied to the
embeddings.

Refused with a CheckpointError (runners.engine.formats.check_runnable): per-tensor FP8 with dynamic
activation scales, block FP8 with blocks other than 128 x 128 or static activations; one MoE block whose
experts mix formats.

Tensor parallelism: quantized models run on one GPU (runners.app.support refuses world_size > 1 with
quantized weights).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from registry.checkpoint import CheckpointError
from registry.hf_config import QuantConfig
from runners.engine.formats import all_formats, check_runnable, get_format
from runners.engine.models.attention import Attention
from runners.engine.models.config import family_module
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.moe import MoE, expert_kinds

log = logging.getLogger(__name__)

# Linear layers the model reads as raw weights (MoE.forward: sigmoid(x W^T) in float32): never FP8.
UNQUANTIZED_LINEARS = ("shared_expert_gate",)
# Checkpoint tensor suffixes that exist only in quantized checkpoints (used to explain loader errors): every
# format's scales and the FP8 KV cache's.
QUANT_TENSOR_SUFFIXES = tuple(dict.fromkeys(
    [s for f in all_formats() for s in f.tensor_suffixes] + [".k_scale", ".v_scale"]))


def _to_quantized_moe(moe: MoE, fmt: str) -> None:
    """Turn ``moe`` (on any device, usually meta) into the MoE class of ``fmt`` in place: expert parameters
    and scale buffers of the format's shapes and dtypes (values unset: the checkpoint fills them)."""
    get_format(fmt).to_moe(moe)


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
                for e in range(module.experts_up.shape[0]) for k in expert_kinds(module)
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
        new = get_format(fmt).linear(linear.in_features, linear.out_features, bias is not None,
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
    model's device (each module's ``gemm_path``; the FP8 MoE probes ``torch._scaled_grouped_mm`` once, so
    nothing is probed inside a captured step) and return a report: ``{"<format>_linears": {path: n},
    "<format>_moe": {path: n}, ..., "kv_scales": n}`` in format order (the paths: each module class's
    ``gemm_path``, e.g. "scaled_mm" or "reference" for an FP8 linear, "scaled_grouped_mm" or "dequant" for
    FP8 experts, "triton" or "reference" for the Triton formats); a format's keys only where such modules
    exist, except the FP8 keys
    (``report_always``: empty dicts for a model without FP8 modules), and 0 KV-scaled blocks. The report is
    logged (INFO) and stored as ``model.quant_report``."""
    formats = [f for f in all_formats() if f.method is not None]
    report: dict[str, Any] = {f"{f.name}_{kind}": {} for f in formats for kind in ("linears", "moe")}
    report["kv_scales"] = 0

    for module in model.modules():
        fmt = getattr(module, "weight_format", None)
        if fmt is not None:
            counts = report[f"{fmt}_{'moe' if isinstance(module, MoE) else 'linears'}"]
            path = module.gemm_path(dtype)
            counts[path] = counts.get(path, 0) + 1
    for f in formats:
        for kind in ("linears", "moe"):
            if not f.report_always and not report[f"{f.name}_{kind}"]:
                del report[f"{f.name}_{kind}"]
    report["kv_scales"] = sum(v is not None for v in kv_cache_scales(model).values())
    if any(report.values()):
        log.info("quantized model: %s", ", ".join(f"{k} {v}" for k, v in report.items() if v))
    model.quant_report = report
    return report
