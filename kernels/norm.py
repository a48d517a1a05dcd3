"""The hybrid blocks' RMSNorms as one Triton kernel each, and their PyTorch references.

Three norms, each a pure function of its inputs (statistics in float32):

- :func:`rms_norm_ref`: ``((offset + w) * x / rms(x))`` over the last dim, returned in x's dtype; ``offset``
  0 (Nemotron 3 Super, Qwen3-Next's gated norm convention) or 1 (Qwen3-Next's ``(1 + w)`` norms). The
  residual blocks' input norms, the final norm and the MTP module's norms (transformers'
  ``NemotronHRMSNorm`` / ``Qwen3NextRMSNorm``).
- :func:`gated_rms_norm_ref`: Qwen3-Next's Gated DeltaNet output norm, per value head, norm then gate:
  ``w * x_hat * silu(z)`` with x_hat rounded to x's dtype before the weight and the product ``w * x_hat``
  in the promoted dtype of (w, x) (transformers' ``Qwen3NextRMSNormGated``, whose roundings it repeats).
- :func:`gated_group_rms_norm_ref`: Mamba2's output norm, gate then norm per group of ``group_size``
  channels: ``w * groupnorm_rms(y * silu(z))``, returned in float32 (mamba_ssm's ``RMSNormGated`` with
  ``norm_before_gate=False``; transformers' ``MambaRMSNormGated``).

:func:`rms_norm`, :func:`gated_rms_norm` and :func:`gated_group_rms_norm` compute the same in one launch
(one program per (row, group); the row held in registers): in the eager decode step each replaces 7-12
elementwise / reduction kernels (runners/engine/models: every residual block's input norm, the GDN and
Mamba2 output norms; issue 27's op counts, benchmarks/count_step_ops.py). They agree with the references to
float32 rounding (the sum of squares is reduced in another order, and Triton's exp and rsqrt are the
hardware approximations), so a 16-bit output may differ from the reference's in its last bit. No backward:
the engine calls them on CUDA outside autograd and outside torch.compile (where inductor fuses the
reference itself); ``runners.engine.models.layers.use_inference_kernel`` is that rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_launchable, interpreter_active, round_rne, row_layout
from kernels.health import HEALTH_DTYPES, flag_if_nonfinite, flag_index, residual_add_ref
from kernels.quant.fp8 import FP8_DTYPE, check_quant_scale, static_fp8, with_codes

NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The largest group one program holds in registers (Super V3's hidden size is 4096, Qwen3-Next's 2048).
MAX_GROUP = 16384


# ---------------------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 quant_scale: torch.Tensor | None = None):
    """``(offset + weight) * x * rsqrt(mean(x^2) + eps)`` over the last dim, in float32, returned in x's dtype
    (with ``quant_scale``: and its FP8 codes, kernels.quant.fp8.with_codes).

    x: [..., N] float32 / bf16 / fp16; weight: [N] (any float dtype; promoted to float32 by the product).
    Pure function.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # without an offset the weight multiplies as it is: float32 * a 16-bit weight promotes to float32, the
    # same products as an explicit float() cast, one kernel fewer (w + 1 must be float32 first)
    scale = weight.float() + offset if offset else weight
    return with_codes((scale * xf).to(x.dtype), quant_scale)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm then gate over the last dim (one value head): ``w * to_x(x_hat) * silu(z)``, returned in x's dtype.

    x, z: [..., V] (same shape); weight: [V]. x_hat = x * rsqrt(mean(x^2) + eps) in float32, rounded to x's
    dtype; ``weight * x_hat`` in the promoted dtype of (weight, x); times silu(z) in float32. Pure function.
    """
    in_dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return ((weight * xf.to(in_dtype)) * F.silu(z.float())).to(in_dtype)


def gated_group_rms_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                             eps: float, out_dtype: torch.dtype = torch.float32,
                             quant_scale: torch.Tensor | None = None):
    """Gate then norm per group: ``weight * groupnorm_rms(y * silu(z))``, float32 [..., N], then cast to
    ``out_dtype`` (float32 by default: no cast); with ``quant_scale`` also its FP8 codes
    (kernels.quant.fp8.with_codes).

    y, z: [..., N] (same shape), N a multiple of group_size; weight: [N]. Pure function.
    """
    y = y.float() * F.silu(z.float())
    g = y.unflatten(-1, (-1, group_size))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    # float32 g promotes the weight: as weight.float()
    return with_codes((weight * g.flatten(-2)).to(out_dtype), quant_scale)


# ---------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------

# MODE: 0 rms_norm, 1 gated_rms_norm (norm then gate), 2 gated_group_rms_norm (gate then norm)


@triton.jit
def _norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, q_ptr, s_ptr, G, NG, R1x, sx0, sx1, R1z, sz0, sz1, eps, offset,
                 MODE: tl.constexpr, ROUND_WX: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                 INTERP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // NG
    grp = pid % NG
    cols = tl.arange(0, BLOCK)
    valid = cols < G
    xrow = (row // R1x) * sx0 + (row % R1x) * sx1 + grp * G
    x_raw = tl.load(x_ptr + xrow + cols, mask=valid, other=0.0)
    x = x_raw.to(tl.float32)
    if MODE != 0:
        zrow = (row // R1z) * sz0 + (row % R1z) * sz1 + grp * G
        z = tl.load(z_ptr + zrow + cols, mask=valid, other=0.0).to(tl.float32)
        gate = z / (1.0 + tl.exp(-z))  # silu, as torch computes it in float32
    if MODE == 2:
        x = x * gate
    w = tl.load(w_ptr + grp * G + cols, mask=valid, other=0.0).to(tl.float32)  # the weight spans the row
    x_hat = x * tl.rsqrt(tl.sum(x * x, axis=0) / G + eps)
    if MODE == 0:
        y = (w + offset) * x_hat
    elif MODE == 1:
        t = round_rne(x_hat, x_raw.dtype)  # x_hat rounded to x's dtype
        u = w * t
        if ROUND_WX:  # weight and x of one 16-bit dtype: their product is rounded to it
            u = round_rne(u, x_raw.dtype)
        y = u * gate
    else:
        y = w * x_hat
    out_row = pid * G  # the output: contiguous, rows x groups x G
    out_dtype = out_ptr.dtype.element_ty
    y = round_rne(y, out_dtype)
    tl.store(out_ptr + out_row + cols, y.to(out_dtype), mask=valid)
    if QUANT:  # the stored value's static FP8 codes: kernels.quant.fp8's rule on it, bit for bit
        tl.store(q_ptr + out_row + cols, static_fp8(y, s_ptr, INTERP).to(q_ptr.dtype.element_ty), mask=valid)


def _row_warps(block: int) -> int:
    """Warps of a program that holds a row (or group) of ``block`` elements: 4 up to 2048, else 8. One rule for
    _norm_kernel and _add_norm_kernel, whose norms agree bit for bit because they reduce the same layout.

    The layout also follows the widest store: with QUANT the 16-byte store of the FP8 codes gives a thread 16
    elements of the row instead of the 8 of a 16-bit load, so a launch that writes codes sums the squares in
    another order than one that does not, and its norm may differ from the codes-free launch's in the last
    bit (the Triton 3.6 GPU test saw it at widths 2048 to 7168). Codes or no codes, _norm_kernel and
    _add_norm_kernel agree: an engine path gets the same bits fused or not."""
    return 4 if block <= 2048 else 8


def _launch(mode: int, x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, group: int | None, eps: float,
            offset: float, out_dtype: torch.dtype, name: str, quant_scale: torch.Tensor | None = None):
    tensors = (x, weight) if z is None else (x, z, weight)
    check_launchable(*tensors, name=name)
    for what, t in zip(("x", "z", "weight") if z is not None else ("x", "weight"), tensors):
        if t.dtype not in NORM_DTYPES:
            raise ValueError(f"{name}: {what} dtype must be one of {NORM_DTYPES}, got {t.dtype}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"{name}: z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if x.dim() == 0:
        raise ValueError(f"{name}: x must have at least one dim (the normalised one), got a 0-dim tensor")
    N = x.shape[-1]
    group = N if group is None else group  # None: the whole row
    if weight.dim() != 1 or weight.shape[0] != N:
        raise ValueError(f"{name}: weight must be ({N},), got {tuple(weight.shape)}")
    check_quant_scale(quant_scale, x.device, name)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    q = None if quant_scale is None else torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if out.numel() == 0:  # no rows, or empty rows (as the references: an empty result)
        return out if q is None else (out, q)
    if group < 1 or N % group:
        raise ValueError(f"{name}: the last dim {N} must be a multiple of the group size {group} (>= 1)")
    if group > MAX_GROUP:
        raise ValueError(f"{name}: a row / group of {group} elements is more than one program holds "
                         f"(MAX_GROUP = {MAX_GROUP}); call the `*_ref` reference for it")
    rows = out.numel() // N
    xv, R1x, sx0, sx1 = row_layout(x)
    zv, R1z, sz0, sz1 = row_layout(z) if z is not None else (xv, R1x, sx0, sx1)
    weight = weight.contiguous()
    round_wx = torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
    block = triton.next_power_of_2(group)
    _norm_kernel[(rows * (N // group),)](
        xv, zv, weight, out, out if q is None else q, weight if q is None else quant_scale, group, N // group,
        R1x, sx0, sx1, R1z, sz0, sz1, float(eps), float(offset),
        MODE=mode, ROUND_WX=round_wx, BLOCK=block, QUANT=q is not None, INTERP=interpreter_active(),
        num_warps=_row_warps(block))
    return out if q is None else (out, q)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             quant_scale: torch.Tensor | None = None):
    """:func:`rms_norm_ref` in one Triton launch (one program per row). x: [..., N], N <= MAX_GROUP, any
    strides; weight: [N]. Returns a new contiguous tensor in x's dtype; mutates nothing. ``quant_scale``: as
    :func:`gated_group_rms_norm`'s (the static scale of the FP8 linear that reads the result first, a
    block's in_proj or up projection): (out, q), q bitwise the quantize rule on out; out may differ from the
    codes-free launch's in the last bit (another summation order: :func:`_row_warps`).

    Raises:
        ValueError: CPU tensors without the Triton interpreter, a dtype outside NORM_DTYPES, a 0-dim x, a
            weight of another length, N > MAX_GROUP, a quant_scale that is not one float32 element on x's
            device.
    """
    return _launch(0, x, None, weight, None, eps, offset, x.dtype, "rms_norm", quant_scale)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm_ref` in one Triton launch (one program per row of V). x, z: [..., V] (any
    strides: z may be a head slice of a projection output); weight: [V]. Returns x's dtype, contiguous.

    Raises:
        ValueError: as :func:`rms_norm`, or z of another shape.
    """
    return _launch(1, x, z, weight, None, eps, 0.0, x.dtype, "gated_rms_norm")


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float, out_dtype: torch.dtype = torch.float32,
                         quant_scale: torch.Tensor | None = None):
    """:func:`gated_group_rms_norm_ref` in one Triton launch (one program per (row, group)). y, z: [..., N];
    weight: [N]; N a multiple of group_size <= MAX_GROUP. Returns [..., N] contiguous, float32 (the
    reference's dtype) or ``out_dtype`` (a NORM_DTYPES member: the float32 result rounded to nearest even, as
    ``.to(out_dtype)`` of the reference's, without a separate cast launch).

    ``quant_scale`` (a one-element float32 tensor on y's device: the static activation scale of the FP8
    linear that reads the result, Mamba2's out_proj) also returns the result's float8_e4m3fn codes from the
    same launch: (out, q), q bitwise ``kernels.quant.fp8.quantize_fp8(out, quant_scale)``; out may differ
    from the codes-free launch's in the last bit (another summation order: :func:`_row_warps`).

    Raises:
        ValueError: as :func:`gated_rms_norm` (group_size > MAX_GROUP), or N not a multiple of group_size,
            group_size < 1, out_dtype outside NORM_DTYPES, a quant_scale that is not one float32 element on
            y's device.
    """
    if out_dtype not in NORM_DTYPES:
        raise ValueError(f"gated_group_rms_norm: out_dtype must be one of {NORM_DTYPES}, got {out_dtype}")
    return _launch(2, y, z, weight, group_size, eps, 0.0, out_dtype, "gated_group_rms_norm", quant_scale)


# ---------------------------------------------------------------------------------------------------------
# the residual add of one block fused with the next block's input norm
# ---------------------------------------------------------------------------------------------------------


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                     flags: torch.Tensor, index: int, quant_scale: torch.Tensor | None = None):
    """(``y = x + delta`` with ``flags[index]`` set where y holds a NaN or an infinity
    (kernels.health.residual_add_ref), :func:`rms_norm_ref` of y (with ``quant_scale``: and its FP8 codes)):
    (y, norm) or (y, norm, q). Mutates only ``flags[index]``."""
    y = residual_add_ref(x, delta, flags, index)
    out = rms_norm_ref(y, weight, eps, offset, quant_scale)
    return (y, out) if quant_scale is None else (y, *out)


@triton.jit
def _add_norm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, out_ptr, q_ptr, s_ptr, flag_ptr, N, eps, offset,
                     BLOCK: tl.constexpr, QUANT: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    dt = y_ptr.dtype.element_ty
    # the residual add, rounded to the stream's dtype as torch's 16-bit add (kernels.health._check_kernel)
    v = tl.load(x_ptr + row * N + cols, mask=valid, other=0.0).to(tl.float32)
    v = round_rne(v + tl.load(d_ptr + row * N + cols, mask=valid, other=0.0).to(tl.float32), dt)
    tl.store(y_ptr + row * N + cols, v.to(dt), mask=valid)
    flag_if_nonfinite(v, valid, flag_ptr)
    # the norm of the stored value: _norm_kernel's MODE 0 arithmetic on it
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    x_hat = v * tl.rsqrt(tl.sum(v * v, axis=0) / N + eps)
    o = round_rne((w + offset) * x_hat, dt)
    tl.store(out_ptr + row * N + cols, o.to(dt), mask=valid)
    if QUANT:
        tl.store(q_ptr + row * N + cols, static_fp8(o, s_ptr, INTERP).to(q_ptr.dtype.element_ty), mask=valid)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 flags: torch.Tensor, index: int, quant_scale: torch.Tensor | None = None):
    """:func:`add_rms_norm_ref` in one Triton launch (one program per row): a residual block's add with its
    health flag (kernels.health.residual_add) and the next block's input norm (:func:`rms_norm`, with its
    ``quant_scale`` codes), reading the residual stream once. y is bitwise residual_add's; the norm is
    rms_norm's arithmetic on y (the same launch shape: one program per row, the row in registers), so it
    is bitwise ``rms_norm(y, weight, eps, offset, quant_scale)``'s, codes included: the two launches the
    fusion replaces.

    Args:
        x, delta: [..., N] of one shape and dtype (HEALTH_DTYPES), N <= MAX_GROUP (non-contiguous: copied).
        weight: [N]. eps, offset: as rms_norm's. flags: bool [n]; index: the flag of y.
        quant_scale: a one-element float32 tensor on x's device, or None.

    Returns:
        (y, norm) or, with quant_scale, (y, norm, q): new contiguous tensors in x's dtype (q float8_e4m3fn).
        Mutates only ``flags[index]`` (sets it).

    Raises:
        ValueError: CPU tensors without the Triton interpreter, x and delta of different shapes or dtypes,
            a dtype outside HEALTH_DTYPES, a weight of another length, N > MAX_GROUP, bad flags or index, a bad
            quant_scale.
    """
    name = "add_rms_norm"
    check_launchable(x, delta, weight, flags, name=name)
    if x.shape != delta.shape or x.dtype != delta.dtype or x.dtype not in HEALTH_DTYPES or x.dim() == 0:
        raise ValueError(f"{name}: x and delta must share a shape (at least 1-D) and a dtype in {HEALTH_DTYPES};"
                         f" got {tuple(x.shape)} {x.dtype} and {tuple(delta.shape)} {delta.dtype}")
    N = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != N:
        raise ValueError(f"{name}: weight must be ({N},), got {tuple(weight.shape)}")
    if N > MAX_GROUP:
        raise ValueError(f"{name}: a row of {N} elements is more than one program holds (MAX_GROUP = "
                         f"{MAX_GROUP}); call add_rms_norm_ref")
    i = flag_index(flags, index, name)
    check_quant_scale(quant_scale, x.device, name)
    x, delta, weight = x.contiguous(), delta.contiguous(), weight.contiguous()
    y, out = torch.empty_like(x), torch.empty_like(x)
    q = None if quant_scale is None else torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    rows = x.numel() // max(1, N)
    if rows and N:
        block = triton.next_power_of_2(N)
        _add_norm_kernel[(rows,)](x, delta, weight, y, out, out if q is None else q,
                                  weight if q is None else quant_scale, flags[i:], N, float(eps), float(offset),
                                  BLOCK=block, QUANT=q is not None, INTERP=interpreter_active(),
                                  num_warps=_row_warps(block))
    return (y, out) if q is None else (y, out, q)
