"""FP8 (float8_e4m3fn) operators with per-tensor scales: the FP8 GEMM and the FP8 routed experts, each beside
the plain-PyTorch reference it is tested against. The quantization rule and its one-launch kernel are
kernels.quant.fp8's (``quantize_fp8``, ``quantize_fp8_ref``, ``FP8_DTYPE``, ``FP8_MAX``: import them from
there).

The numerics are those of NVIDIA ModelOpt's FP8 checkpoints as vLLM runs them (vllm/model_executor/layers/
quantization/modelopt.py: ``ModelOptFp8LinearMethod``, ``ModelOptFp8MoEMethod``): a weight ``W`` is stored as
``W_fp8`` with a float32 per-tensor ``weight_scale`` (``W = W_fp8 * weight_scale``); an activation ``x`` is
quantized with a static, calibrated float32 ``input_scale`` (``x_fp8 = clamp(x / input_scale, -448, 448)``,
rounded to nearest by the cast); then ``y = (x_fp8 W_fp8^T) * input_scale * weight_scale`` accumulated in
float32. 448 is the largest float8_e4m3fn value. Nothing here reads a device value on the host, so every
function can be captured in a CUDA graph.

- :func:`fp8_linear`: ``torch._scaled_mm`` (cuBLASLt FP8 GEMM, per-tensor scales) on CUDA devices of compute
  capability >= 8.9 when both GEMM dimensions of the weight are multiples of 16 (its alignment rule); else
  :func:`fp8_linear_ref`, which quantizes the activation the same way, dequantizes both operands and
  multiplies in float32 (the CPU path: tests and CI run it).
- :func:`moe_experts_fp8`: the routed experts of :mod:`runners.engine.models.moe` with FP8 expert weights
(per-expert
  weight and input scales). Pairs are sorted by expert as in ``moe_experts_fused``; each row is quantized
  with its expert's input scale (ModelOpt stores one per expert; vLLM folds them into their maximum, we keep
  them exact: a per-row scale costs one gather). The GEMMs are, by :func:`fp8_moe_impl`:
  ``"scaled_grouped_mm"`` -- ``torch._scaled_grouped_mm`` (CUTLASS grouped FP8 GEMM, row-wise scales: the
  rows' input scales and each expert's weight scale broadcast over its output columns), on CUDA when torch
  has it, the device is sm_90 or newer, the dimensions are multiples of 16 and a one-time probe on the device
  agrees with the reference; else ``"dequant"`` -- the weights are dequantized to the activation dtype at
  every call and run through ``moe_experts_fused``'s grouped GEMM / gathered bmm (the documented fallback:
  correct, more memory traffic; a per-expert loop of ``torch._scaled_mm`` would need each expert's row count
  on the host). :func:`moe_experts_fp8_ref` is the per-expert loop the tests hold both to.
- The modules runners.engine.quant swaps in (``FP8Linear`` / ``FP8MoE``) are
  runners.engine.models.fp8_modules': these operators are also the FP8 KV cache's (runners.engine.cache),
  which the layers import.

Shapes: N tokens, k experts per token, P = N k pairs, E experts, L MoE width, I expert intermediate size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from kernels.quant.fp8 import FP8_DTYPE, quantize_fp8, quantize_fp8_ref
from runners.engine.models.moe import (
    _gathered_linear,
    _grouped_linear,
    combine_pairs,
    group_pairs,
    grouped_mm_supported,
    moe_experts_ref,
)

log = logging.getLogger(__name__)

# GEMM dimensions of FP8 cuBLASLt / CUTLASS kernels must be multiples of 16 elements (16-byte rows).
FP8_ALIGN = 16


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in float32, returned in ``dtype`` (q float8_e4m3fn, scale broadcastable)."""
    return (q.float() * scale).to(dtype)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference FP8 linear: quantize ``x`` [..., K] with ``input_scale`` (0-dim float32), dequantize it and
    ``weight`` [N, K] float8_e4m3fn (times ``weight_scale``, 0-dim float32), multiply in float32, add
    ``bias`` [N]. Returns [..., N] in x's dtype."""
    s = input_scale
    xd = quantize_fp8_ref(x, s).float() * s
    y = xd @ (weight.float() * weight_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` runs ``torch._scaled_mm`` for ``x`` against ``weight`` [N, K]: a CUDA device
    of compute capability >= 8.9 (FP8 tensor cores: Ada, Hopper and newer), N and K multiples of 16, a
    contiguous weight. Host-side only (device properties are cached by torch)."""
    if x.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    n, k = weight.shape
    if n % FP8_ALIGN or k % FP8_ALIGN or not weight.is_contiguous():
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    xq: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 linear ``x W^T + b`` with per-tensor scales: one ``torch._scaled_mm`` where
    :func:`scaled_mm_supported`, else :func:`fp8_linear_ref` (same arguments and result up to the GEMM's
    accumulation order).

    Args:
        x: [..., K] activations (bfloat16 / float16 / float32). weight: [N, K] float8_e4m3fn.
        weight_scale: 0-dim float32. input_scale: 0-dim float32 (the static activation scale).
        bias: [N] or None.
        xq: x's float8_e4m3fn codes under input_scale (``quantize_fp8(x, input_scale)``, x's shape), computed
            by the kernel that produced x (kernels/norm.py, kernels/activation.py ``quant_scale``): the
            quantization launch is skipped. Ignored by the reference path, which quantizes x itself.

    Returns:
        [..., N] in x's dtype. No host synchronisation.

    Raises:
        ValueError: xq not float8_e4m3fn of x's shape.
    """
    if xq is not None and (xq.dtype != FP8_DTYPE or xq.shape != x.shape):
        raise ValueError(f"fp8_linear: xq must be float8_e4m3fn of x's shape {tuple(x.shape)}, got "
                         f"{xq.dtype} {tuple(xq.shape)}")
    if not scaled_mm_supported(x, weight):
        return fp8_linear_ref(x, weight, weight_scale, input_scale, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], n)
    s = input_scale
    xq = quantize_fp8(x2, s) if xq is None else xq.reshape(-1, k)
    # cuBLASLt takes a bias only with a 16-bit output; a float32 output adds it afterwards
    fused_bias = bias if bias is not None and x.dtype in (torch.bfloat16, torch.float16) else None
    y = torch._scaled_mm(xq, weight.t(), scale_a=s, scale_b=weight_scale, bias=fused_bias, out_dtype=x.dtype)
    if bias is not None and fused_bias is None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], n)


def fp8_linear_w8a16(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 linear with the activation kept in its dtype (w8a16): ``x`` [..., K] times ``weight`` [N, K]
    float8_e4m3fn converted in registers and scaled by ``weight_scale`` (0-dim float32), plus ``bias``: no
    activation cast, one launch. It runs kernels.quant.block_fp8's w8a16 GEMV with the per-tensor scale as
    every 128 x 128 block's (a stride-0 view), on CUDA; its reference elsewhere. Returns [..., N] in x's
    dtype. No host synchronisation."""
    from kernels.quant import block_fp8

    n, k = weight.shape
    x2 = x.reshape(-1, k)
    blocks = weight_scale.float().reshape(1, 1).expand(-(-n // block_fp8.BLOCK), -(-k // block_fp8.BLOCK))
    gemm = block_fp8.block_fp8_linear if x.is_cuda else block_fp8.block_fp8_linear_ref
    return gemm(x2, weight, blocks, bias, scheme="w8a16").reshape(*x.shape[:-1], n)


class FP8Weights(NamedTuple):
    """One stacked expert projection in FP8: ``weight`` [E, out, in] float8_e4m3fn, ``weight_scale`` [E]
    float32, ``input_scale`` [E] float32 (static activation scale per expert)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor


def _expert_linear_ref(x: torch.Tensor, w: FP8Weights, e: int) -> torch.Tensor:
    return fp8_linear_ref(x, w.weight[e], w.weight_scale[e], w.input_scale[e])


def moe_experts_fp8_ref(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    up: FP8Weights,
    gate: FP8Weights | None,
    down: FP8Weights,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Reference FP8 routed experts: a Python loop over the experts that received tokens (host-synchronising),
    each projection :func:`fp8_linear_ref` with that expert's scales.

    Args:
        h: [N, L]. weights: [N, k] float32 combine weights. indices: [N, k] int64 expert ids.
        up, gate: FP8Weights of [E, I, L] (gate None for non-gated experts); down: FP8Weights of [E, L, I].
        act: the activation.

    Returns:
        [N, L] in h's dtype; each token's k expert outputs weighted and summed in float32.
    """
    return moe_experts_ref(h, weights, indices, up, gate, down, act, linear=_expert_linear_ref,
                           num_experts=up.weight.shape[0])


# device -> whether torch._scaled_grouped_mm ran and agreed with the reference there (probed once)
_GROUPED_PROBE: dict[torch.device, bool] = {}


def _probe_scaled_grouped_mm(device: torch.device) -> bool:
    """Run ``torch._scaled_grouped_mm`` once on a small problem on ``device`` and compare it with the
    dequantized product; False (with a log line) when it raises or disagrees. Cached per device."""
    if device in _GROUPED_PROBE:
        return _GROUPED_PROBE[device]
    ok = False
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        E, K, N, P = 2, 32, 48, 24
        a = (torch.randn(P, K, generator=g) * 0.5).to(device)
        w = (torch.randn(E, N, K, generator=g) * 0.5).to(device).to(FP8_DTYPE)
        s_a = torch.full((P,), 0.01, device=device)
        s_w = torch.tensor([0.02, 0.03], device=device)
        offsets = torch.tensor([10, P], dtype=torch.int32, device=device)
        aq = quantize_fp8_ref(a, s_a[:, None])
        got = torch._scaled_grouped_mm(aq, w.transpose(1, 2), s_a, s_w[:, None].expand(E, N).contiguous(),
                                       offs=offsets, out_dtype=torch.bfloat16).float()
        expert = (torch.arange(P, device=device) >= 10).long()
        w_rows = w.float()[expert] * s_w[expert, None, None]
        ref = torch.einsum("pk,pnk->pn", aq.float() * s_a[:, None], w_rows)
        err = ((got - ref).norm() / ref.norm()).item()
        ok = err < 2e-2
        if not ok:
            log.warning("torch._scaled_grouped_mm disagrees with the reference on %s (rel. error %.3g); the "
                        "FP8 MoE dequantizes to the compute dtype instead", device, err)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        log.warning("torch._scaled_grouped_mm is not usable on %s (%s); the FP8 MoE dequantizes its experts "
                    "to the compute dtype instead", device, str(e).splitlines()[0] if str(e) else type(e))
    _GROUPED_PROBE[device] = ok
    return ok


def fp8_moe_impl(h: torch.Tensor, *projections: FP8Weights) -> str:
    """Which GEMMs :func:`moe_experts_fp8` runs for activations ``h`` and these stacked FP8 projections:
    ``"scaled_grouped_mm"`` (CUDA, sm_90+, torch has ``_scaled_grouped_mm`` and the one-time probe agreed,
    every dimension a multiple of 16, contiguous weights) or ``"dequant"`` (see the module docstring).
    Host-side only after the first call on a device (the probe runs then)."""
    if h.device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return "dequant"
    if torch.cuda.get_device_capability(h.device) < (9, 0):
        return "dequant"
    for p in projections:
        if p.weight.shape[1] % FP8_ALIGN or p.weight.shape[2] % FP8_ALIGN or not p.weight.is_contiguous():
            return "dequant"
    return "scaled_grouped_mm" if _probe_scaled_grouped_mm(h.device) else "dequant"


def moe_experts_fp8(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    up: FP8Weights,
    gate: FP8Weights | None,
    down: FP8Weights,
    act: Callable[[torch.Tensor], torch.Tensor],
    impl: str | None = None,
) -> torch.Tensor:
    """FP8 routed experts over expert-sorted pairs; same arguments and result as :func:`moe_experts_fp8_ref`
    (up to accumulation order and, on the grouped FP8 GEMM, its bfloat16 output). No per-expert Python loop,
    no host synchronisation, shapes fixed by N, k and the weights (CUDA-graph capturable).

    ``impl``: "scaled_grouped_mm" | "dequant" (default: :func:`fp8_moe_impl`).

    Returns:
        [N, L] in h's dtype.
    """
    n, k = indices.shape
    E = up.weight.shape[0]
    projections = (up, down) if gate is None else (up, gate, down)
    impl = impl or fp8_moe_impl(h, *projections)
    order, inverse, offsets = group_pairs(indices, E)
    expert = indices.flatten().index_select(0, order)  # [P] expert of each sorted pair
    x = h.index_select(0, order // k)  # [P, L]

    if impl == "scaled_grouped_mm":

        def linear(inp: torch.Tensor, p: FP8Weights) -> torch.Tensor:
            s_rows = p.input_scale.index_select(0, expert)  # [P] float32: each row's expert input scale
            q = quantize_fp8_ref(inp, s_rows[:, None])  # per-row scales: torch ops
            s_w = p.weight_scale[:, None].expand(E, p.weight.shape[1]).contiguous()  # [E, out]
            return torch._scaled_grouped_mm(q, p.weight.transpose(1, 2), s_rows, s_w, offs=offsets,
                                            out_dtype=torch.bfloat16).to(h.dtype)

    elif impl == "dequant":
        # the activations are quantized and dequantized per row (the FP8 numerics), the weights dequantized
        # to the compute dtype at every call, then moe_experts_fused's grouped GEMM or gathered bmm
        dtype = h.dtype
        use_grouped = grouped_mm_supported(x, *(_shape_probe(p, dtype) for p in projections))

        def linear(inp: torch.Tensor, p: FP8Weights) -> torch.Tensor:
            s_rows = p.input_scale.index_select(0, expert)[:, None]
            xd = (quantize_fp8_ref(inp, s_rows).float() * s_rows).to(dtype)
            w = (p.weight.float() * p.weight_scale[:, None, None]).to(dtype)
            if use_grouped:
                return _grouped_linear(xd, w, offsets)
            return _gathered_linear(xd, w, expert)

    else:
        raise ValueError(f"FP8 MoE impl {impl!r} is not one of 'scaled_grouped_mm', 'dequant'")

    if gate is None:
        a = act(linear(x, up))
    else:
        a = act(linear(x, gate)) * linear(x, up)
    y = linear(a, down)  # [P, L] in expert order
    return combine_pairs(y.to(h.dtype), inverse, weights)


def _shape_probe(p: FP8Weights, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor with p's weight shape in ``dtype``: grouped_mm_supported decides from shapes and dtypes
    only, so no dequantized copy is needed to ask it."""
    return torch.empty(p.weight.shape, dtype=dtype, device="meta")

