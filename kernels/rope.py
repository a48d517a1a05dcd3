"""Rotary position embedding (NeoX rotate-half, partial rotary) and, for attention with per-head q / k norms
(Qwen3-Next), the head norm and the rotation in one Triton launch; the PyTorch references.

    rope_rotate(x, cos, sin):  on the first rd = 2 * cos.shape[-1] dims of each head, (x1, x2) halves ->
                               (x1 cos - x2 sin, x2 cos + x1 sin) in float32, rounded to x's dtype; the rest
                               pass through (transformers' ``apply_rotary_pos_emb`` with ``rotate_half``;
                               Su et al., "RoFormer", 2021)
    norm_rope_ref(x, w, ...):  rope_rotate(rms_norm_ref(x, w, eps, offset), cos, sin), the attention layer's
                               ``q_norm`` / ``k_norm`` followed by the rotation (Qwen3NextAttention)

:func:`norm_rope` computes the second in one program per (token, head): the row's RMS in float32, the normed
row rounded to x's dtype as the norm returns it, and the rotation of its first rd dims against the partner
half (re-read and normed in registers); in the eager decode step it replaces the norm's launch and the
rotation's eight or so per tensor (slices, casts, products, two concatenations; issue 27). It agrees with the
reference to float32 rounding (the sum of squares is reduced in another order; the rotation's products may
be fused into FMAs), so a 16-bit element may differ in its last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, round_rne, row_layout
from kernels.norm import NORM_DTYPES, rms_norm_ref


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE with its angles given: x [B, T, H, hd]; cos, sin float32 [B or 1, T, 1, rd / 2] (rd <= hd).
    Computed in float32, returned in x's dtype; pure function."""
    rd = 2 * cos.shape[-1]
    rot, rest = x[..., :rd].float(), x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rot.to(x.dtype), rest], dim=-1)


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm over head_dim (scale ``offset + weight``, kernels.norm.rms_norm_ref), then :func:`rope_rotate`.
    x [B, T, H, hd]; weight [hd]; cos, sin [B or 1, T, 1, rd / 2] float32. Returns x's dtype; pure."""
    return rope_rotate(rms_norm_ref(x, weight, eps, offset), cos, sin)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, HD, HALF, H, T, R1, s0, s1, eps, offset,
                      COS_PER_BATCH: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (token, head) row, heads fastest
    offs = tl.arange(0, BLOCK)
    m = offs < HD
    xrow = x_ptr + (r // R1) * s0 + (r % R1) * s1
    x = tl.load(xrow + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    y = round_rne((w + offset) * (x * rstd), dt)
    rot = offs < 2 * HALF
    first = offs < HALF
    partner = tl.where(first, offs + HALF, offs - HALF)
    xp = tl.load(xrow + partner, mask=rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    yp = round_rne((wp + offset) * (xp * rstd), dt)
    bt = r // H
    crow = bt if COS_PER_BATCH else bt % T
    c = tl.load(cos_ptr + crow * HALF + offs % HALF, mask=rot, other=0.0)
    s = tl.load(sin_ptr + crow * HALF + offs % HALF, mask=rot, other=0.0)
    rotated = tl.where(first, y * c - yp * s, y * c + yp * s)
    out = tl.where(rot, round_rne(rotated, dt), y)
    tl.store(out_ptr + r * HD + offs, out.to(dt), mask=m)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """:func:`norm_rope_ref` in one Triton launch (one program per (token, head)). x [B, T, H, hd], any strides
    (e.g. q as a per-head half of the q projection; rows that need more than two strides are copied first);
    weight [hd]; cos, sin float32 [B or 1, T, 1, rd / 2], rd <= hd. Returns a new contiguous
    [B, T, H, hd] in x's dtype; mutates nothing.

    Raises:
        ValueError: CPU tensors without the Triton interpreter, a dtype outside NORM_DTYPES, shapes that do not
            fit together.
    """
    name = "norm_rope"
    check_launchable(x, weight, cos, sin, name=name)
    if x.dim() != 4 or x.dtype not in NORM_DTYPES:
        raise ValueError(f"{name}: x must be [B, T, H, hd] of {NORM_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    B, T, H, hd = x.shape
    half = cos.shape[-1]
    if weight.shape != (hd,):
        raise ValueError(f"{name}: weight must be ({hd},), got {tuple(weight.shape)}")
    if (cos.shape != sin.shape or cos.dim() != 4 or cos.shape[0] not in (1, B) or cos.shape[1] != T
            or cos.shape[2] != 1 or 2 * half > hd or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        raise ValueError(f"{name}: cos / sin must be float32 [{B} or 1, {T}, 1, rd / 2] with rd <= {hd}, got "
                         f"{tuple(cos.shape)} {cos.dtype} / {tuple(sin.shape)} {sin.dtype}")
    out = torch.empty(B, T, H, hd, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    xv, R1, s0, s1 = row_layout(x)
    _norm_rope_kernel[(B * T * H,)](xv, weight.contiguous(), cos.contiguous(), sin.contiguous(), out, hd, half,
                                    H, T, R1, s0, s1, float(eps), float(offset), COS_PER_BATCH=cos.shape[0] > 1,
                                    BLOCK=triton.next_power_of_2(hd), num_warps=1 if hd <= 256 else 4)
    return out
