"""The feed-forward activations of the hybrid blocks' MLPs (dense blocks and shared experts) as one Triton
launch each, and their PyTorch references.

- :func:`relu2_ref`: ``square(relu(x))``, Nemotron 3 Super's "relu2" (transformers' ``ReLUSquaredActivation``;
  the NemotronH MLP is ``down(relu2(up(x)))``).
- :func:`silu_mul_ref`: ``silu(gate) * up``, Qwen3-Next's SwiGLU shared expert
  (``down(silu(gate(x)) * up(x))``, transformers' ``Qwen3NextMLP``).

Each reference is two launches in the eager step (the activation, then the square or the product); the
kernels do both in one pass over the elements, with the references' roundings: every intermediate that
torch stores in the 16-bit dtype (``relu(x)``, ``silu(gate)``) is rounded to it before the next operation
(``kernels._common.round_rne``), products in float32 rounded once. ``relu2`` is therefore bitwise the
reference (a NaN stays NaN, as in ``torch.relu``); ``silu_mul`` may differ in the last bit of an element,
Triton's ``exp`` being the hardware approximation. No backward: the engine calls them where
``runners.engine.models.layers.use_inference_kernel`` holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_launchable, interpreter_active, round_rne
from kernels.quant.fp8 import FP8_DTYPE, check_quant_scale, static_fp8, with_codes

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 2048  # elements per program (four warps)


def relu2_ref(x: torch.Tensor, quant_scale: torch.Tensor | None = None):
    """``square(relu(x))`` in x's dtype (a new tensor); with ``quant_scale`` also its FP8 codes
    (kernels.quant.fp8.with_codes)."""
    return with_codes(torch.square(F.relu(x)), quant_scale)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor, quant_scale: torch.Tensor | None = None):
    """``silu(gate) * up`` in their dtype (a new tensor); with ``quant_scale`` also its FP8 codes."""
    return with_codes(F.silu(gate) * up, quant_scale)


@triton.jit
def _act_kernel(x_ptr, u_ptr, out_ptr, q_ptr, s_ptr, n, GATED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                QUANT: tl.constexpr, INTERP: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    m = offs < n
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if GATED:
        s = round_rne(x / (1.0 + tl.exp(-x)), dt)
        y = s * tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    else:
        r = tl.where(x < 0.0, 0.0, x)  # NaN < 0 is false: a NaN stays NaN, as torch.relu keeps it
        y = r * r
    y = round_rne(y, dt)
    tl.store(out_ptr + offs, y.to(dt), mask=m)
    if QUANT:  # the stored value's static FP8 codes: kernels.quant.fp8's rule on it, bit for bit
        tl.store(q_ptr + offs, static_fp8(y, s_ptr, INTERP).to(q_ptr.dtype.element_ty), mask=m)


def _launch(name: str, x: torch.Tensor, up: torch.Tensor | None, quant_scale: torch.Tensor | None = None):
    check_launchable(*(t for t in (x, up) if t is not None), name=name)
    check_quant_scale(quant_scale, x.device, name)
    if x.dtype not in ACTIVATION_DTYPES or (up is not None and (up.shape != x.shape or up.dtype != x.dtype)):
        raise ValueError(f"{name}: inputs must share a shape and a dtype in {ACTIVATION_DTYPES}; got "
                         f"{tuple(x.shape)} {x.dtype}" + ("" if up is None else f" and {tuple(up.shape)} {up.dtype}"))
    x = x.contiguous()
    up = None if up is None else up.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    q = None if quant_scale is None else torch.empty(x.shape, device=x.device, dtype=FP8_DTYPE)
    n = x.numel()
    if n:
        _act_kernel[(triton.cdiv(n, BLOCK),)](x, x if up is None else up, out, out if q is None else q,
                                             x if q is None else quant_scale, n, GATED=up is not None,
                                             BLOCK_SIZE=BLOCK, QUANT=q is not None,
                                             INTERP=interpreter_active(), num_warps=4)
    return out if q is None else (out, q)


def relu2(x: torch.Tensor, quant_scale: torch.Tensor | None = None):
    """:func:`relu2_ref` in one Triton launch, bitwise. A non-contiguous x is copied first; mutates nothing.
    ``quant_scale`` (a one-element float32 tensor on x's device: the static activation scale of the FP8 down
    projection that reads the result) also returns the result's float8_e4m3fn codes from the same launch:
    (out, q), q bitwise ``kernels.quant.fp8.quantize_fp8(out, quant_scale)``.

    Raises:
        ValueError: CPU tensors without the Triton interpreter, a dtype outside ACTIVATION_DTYPES, a
            quant_scale that is not one float32 element on x's device.
    """
    return _launch("relu2", x, None, quant_scale)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, quant_scale: torch.Tensor | None = None):
    """:func:`silu_mul_ref` in one Triton launch (to the last bit of an element). Non-contiguous inputs are
    copied first; mutates nothing. ``quant_scale``: as :func:`relu2`'s.

    Raises:
        ValueError: CPU tensors without the Triton interpreter, gate and up of different shapes or dtypes, a
            dtype outside ACTIVATION_DTYPES, a bad quant_scale.
    """
    return _launch("silu_mul", gate, up, quant_scale)
