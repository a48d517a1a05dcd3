"""Per-tensor FP8 (float8_e4m3fn codes, one float32 scale per tensor: NVIDIA ModelOpt's FP8 checkpoints as vLLM
runs them, vllm/model_executor/layers/quantization/modelopt.py): the static activation quantization in one
launch, beside its plain-PyTorch reference.

    q = round_to_e4m3(clamp(x / scale, -448, 448))        (float32 division, ties to even; 448 = e4m3's max)

- :func:`quantize_fp8_ref`: the rule in PyTorch (any scale broadcastable to x: 0-dim per tensor, [rows, 1] per
  row). The engine's CPU path, the tests' reference, and the GPU path for per-row scales.
- :func:`quantize_fp8`: the same with a 0-dim (per-tensor) scale read from device memory, as one Triton launch
  instead of the reference's three elementwise launches and float32 temporary before every
  ``torch._scaled_mm`` of an FP8 linear (docs/kernel_performance.md, "Quantized formats"); bit-identical to
  the reference on finite inputs (the division rounded to nearest like torch's, e4m3 rounding ties to even).
  No host synchronisation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_dtype, check_launchable, interpreter_active
from kernels.quant._common import X_DTYPES, to_e4m3, use_kernel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
QUANT_BLOCK = 1024  # elements per program


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` rounded to float8_e4m3fn, computed in float32 (the clamp keeps values out
    of range finite: e4m3fn has no infinity). ``scale``: float32, broadcastable to x (0-dim for per-tensor,
    [rows, 1] for per-row). Returns float8_e4m3fn of x's shape. Mutates nothing."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@triton.jit
def static_fp8(x, s_ptr, INTERP: tl.constexpr):
    """The rule on float32 values x with the one-element float32 scale at s_ptr: float8_e4m3fn codes (kept as
    fp32 values under the interpreter; store them with ``.to`` the output's element type). For the kernels
    that produce an FP8 linear's input (kernels/norm.py, kernels/activation.py) and quantize it in the same
    launch."""
    s = tl.load(s_ptr)
    q = tl.div_rn(x, tl.zeros_like(x) + s)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return to_e4m3(q, INTERP)


@triton.jit
def _quant_static_kernel(x_ptr, s_ptr, q_ptr, n, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, static_fp8(x, s_ptr, INTERP).to(q_ptr.dtype.element_ty), mask=mask)


def with_codes(out: torch.Tensor, quant_scale: torch.Tensor | None):
    """``out``, or (out, :func:`quantize_fp8_ref` of it under the static scale) when ``quant_scale`` is given:
    the ``quant_scale`` contract of the references of the kernels that produce an FP8 linear's input
    (kernels/norm.py, kernels/activation.py), which the kernels meet in the same launch (:func:`static_fp8`)."""
    return out if quant_scale is None else (out, quantize_fp8_ref(out, quant_scale))


def check_quant_scale(scale: torch.Tensor | None, device: torch.device, name: str) -> None:
    """Raise ValueError unless ``scale`` is None or a one-element float32 tensor on ``device`` (the static scale a
    producing kernel quantizes its output with)."""
    if scale is not None and not (isinstance(scale, torch.Tensor) and scale.numel() == 1
                                  and scale.dtype == torch.float32 and scale.device == device):
        got = f"{scale.dtype} {tuple(scale.shape)} on {scale.device}" if isinstance(scale, torch.Tensor) \
            else type(scale).__name__
        raise ValueError(f"{name}: quant_scale must be a one-element float32 tensor on {device}, got {got}")


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, *, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """:func:`quantize_fp8_ref` in one Triton launch where it can run: ``scale`` a one-element float32 tensor
    on x's device (the per-tensor static scale), x float32 / bfloat16 / float16 on CUDA (or under
    TRITON_INTERPRET=1); elsewhere (a Python or per-row scale, a plain CPU run) the reference.

    Args:
        x: [...] activations. scale: 0-dim (or one-element) float32 tensor, or anything the reference takes.
        out: optional float8_e4m3fn tensor of x's shape, contiguous, written in full (kernel path only).

    Returns:
        float8_e4m3fn of x's shape (``out`` when given). Mutates only ``out``.

    Raises:
        ValueError: ``out`` of another shape or dtype, or not contiguous; x of another dtype (kernel path).
    """
    name = "quantize_fp8"
    if not (isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.dtype == torch.float32
            and scale.device == x.device and use_kernel(x)):
        q = quantize_fp8_ref(x, scale)
        return q if out is None else out.copy_(q)
    check_dtype(x, X_DTYPES, "x", name)
    check_launchable(x, scale, name=name)
    if out is None:
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    elif out.shape != x.shape or out.dtype != FP8_DTYPE or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous float8_e4m3fn tensor of shape {tuple(x.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    n = x.numel()
    if n == 0:
        return out
    x = x.contiguous()
    _quant_static_kernel[(triton.cdiv(n, QUANT_BLOCK),)](x, scale, out, n, BLOCK=QUANT_BLOCK,
                                                         INTERP=interpreter_active(), num_warps=4)
    return out
