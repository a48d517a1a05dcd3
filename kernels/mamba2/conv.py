"""Mamba2's causal depthwise conv + SiLU over a step's tokens, reading the conv window from the cache and
writing the new one back, in one Triton launch; and the PyTorch reference (what the mixer runs on the CPU).

For batch row b (mamba_ssm's ``causal_conv1d_update``; transformers' ``NemotronHMamba2Mixer`` decode path;
the cache layouts of ``runners.engine.cache``):

    window = [src[src_rows[b], :, c0 : c0 + W - 1],  x[b]^T]       (C, W - 1 + T), src's dtype;
                                                                    c0 = src_cols[b] (0 without src_cols)
    out[b, t, c] = silu(sum_j weight[c, j] window[c, t + j] + bias[c])    (T, C), rounded as the reference
    dst[dst_rows[b], :, : W - 1 + T - dst_from] = window[:, dst_from:]   (when dst is given)

The engine's three uses: a decode step (T = 1; src = dst = the window cache, dst_from = T: the last W - 1
inputs), a rewind verify (dst = the per-step window buffer, dst_from = 0: the whole window), a replay verify
(src = the replay conv buffer read at each row's offset, dst = the same buffer, dst_from = 1).

The reference (:func:`causal_conv_step_ref`) is a gather, a concatenation, the conv (an einsum at T = 1, then
the bias; ``F.conv1d`` with its bias for T > 1), an ``index_copy_`` and SiLU: 5-7 launches per Mamba2 block
and step. :func:`causal_conv_step` does it in one, one program per (row, block of channels), each channel's
window read before it is written (src and dst may be the same tensor: a channel belongs to one thread, whose
loads precede its stores). It agrees with the reference to float32 rounding (the W products are summed in
another order, Triton's exp is the hardware one), so an output element may differ in its last bit; the
stored window is bitwise the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_launchable, round_rne

CONV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_T = 16  # decode / verify sizes: the tokens are unrolled in the kernel


def causal_conv_step_ref(x: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, dst: torch.Tensor | None = None,
                         dst_rows: torch.Tensor | None = None, dst_from: int = 0,
                         src_cols: torch.Tensor | None = None) -> torch.Tensor:
    """The module docstring's computation in PyTorch.

    Args:
        x: [B, T, C] the step's conv inputs (xBC; any strides).
        src: [S, C, Ws] the window cache, Ws >= W - 1 (+ the largest src_cols).
        src_rows: [B] integer rows of src (PAD rows mapped to the scratch row by the caller; a negative row
            counts from the end, here and in dst_rows).
        weight: [C, W] depthwise conv weight; bias: [C] or None.
        dst, dst_rows, dst_from: where the new window goes (mutated in place: dst[dst_rows[b], :, :n] with
            n = W - 1 + T - dst_from); dst None writes nothing.
        src_cols: [B] integer first column of each row's window in src, or None (column 0).

    Returns:
        [B, T, C] silu(conv), in the dtype torch's conv of (src dtype, weight dtype) gives.
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    if src_cols is None:
        prev = src[src_rows][:, :, : W - 1]
    else:
        cols = src_cols[:, None] + torch.arange(W - 1, device=src.device)
        prev = src[src_rows[:, None, None], torch.arange(C, device=src.device)[None, :, None], cols[:, None, :]]
    window = torch.cat([prev, x.transpose(1, 2).to(prev.dtype)], dim=-1)  # (B, C, W - 1 + T)
    if T == 1:
        out = torch.einsum("bcw,cw->bc", window, weight)[:, None, :]
        if bias is not None:
            out = out + bias
    else:
        out = F.conv1d(window, weight[:, None, :], bias, groups=C).transpose(1, 2)
    if dst is not None:
        # a negative row counts from the end, as in the gather above (index_copy_ itself refuses one)
        dst.index_copy_(0, dst_rows % dst.shape[0], window[:, :, dst_from:].to(dst.dtype))
    return F.silu(out)


@triton.jit
def _window(src_row, x_row, s_xt, c64, cm, P: tl.constexpr, W: tl.constexpr, dt: tl.constexpr):
    """Window column P of the program's channels, float32, rounded to src's dtype (as the reference's cat):
    column P of the cache row for P < W - 1, else token P - (W - 1) of x."""
    if P < W - 1:
        v = tl.load(src_row + P, mask=cm, other=0.0).to(tl.float32)
    else:
        v = round_rne(tl.load(x_row + (P - (W - 1)) * s_xt + c64, mask=cm, other=0.0).to(tl.float32), dt)
    return v


@triton.jit
def _conv_step_kernel(x_ptr, src_ptr, srows_ptr, scols_ptr, w_ptr, b_ptr, dst_ptr, drows_ptr, out_ptr, C,
                      S_SRC, S_DST, s_xb, s_xt, s_sr, s_sc, s_dr, s_dc,
                      T: tl.constexpr, W: tl.constexpr, HAS_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_DST: tl.constexpr, DST_FROM: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    c64 = c.to(tl.int64)
    dt = src_ptr.dtype.element_ty
    srow = tl.load(srows_ptr + b).to(tl.int64)
    srow = tl.where(srow < 0, srow + S_SRC, srow)  # -1: the last (scratch) row, as torch indexes it
    c0 = tl.load(scols_ptr + b).to(tl.int64) if HAS_COLS else 0
    src_row = src_ptr + srow * s_sr + c64 * s_sc + c0
    x_row = x_ptr + b * s_xb
    if HAS_DST:
        drow = tl.load(drows_ptr + b).to(tl.int64)
        drow = tl.where(drow < 0, drow + S_DST, drow)
        dst_row = dst_ptr + drow * s_dr + c64 * s_dc
    bias = tl.load(b_ptr + c64, mask=cm, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    for t in tl.static_range(T):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(W):
            acc += (tl.load(w_ptr + c64 * W + j, mask=cm, other=0.0).to(tl.float32)
                    * _window(src_row, x_row, s_xt, c64, cm, t + j, W, dt))
        if T == 1:  # the einsum's rounded result, then the bias as a separate add
            o = round_rne(round_rne(acc, dt) + bias, dt)
        else:  # F.conv1d adds its bias inside
            o = round_rne(acc + bias, dt)
        s = round_rne(o / (1.0 + tl.exp(-o)), dt)
        tl.store(out_ptr + (b * T + t) * C + c64, s.to(dt), mask=cm)
    if HAS_DST:
        # window columns DST_FROM .. W - 2 + T to dst columns 0 ..: column j is read before column j is
        # written (at step j + 1 - DST_FROM >= j + 1 when src is dst, or never), by the channel's own thread
        for j in tl.static_range(DST_FROM, W - 1 + T):
            v = _window(src_row, x_row, s_xt, c64, cm, j, W, dt)
            tl.store(dst_row + (j - DST_FROM), v.to(dst_ptr.dtype.element_ty), mask=cm)


def causal_conv_step(x: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, dst: torch.Tensor | None = None,
                     dst_rows: torch.Tensor | None = None, dst_from: int = 0,
                     src_cols: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`causal_conv_step_ref` in one Triton launch (grid: B x blocks of 128 channels). Same arguments,
    effects and result (a new contiguous [B, T, C] tensor in src's dtype). x may be a strided view with a
    unit-stride last dim; src / dst rows may be strided with a unit-stride last dim. T <= MAX_T. Row and
    column indices are read as torch reads them (strided ones copied first, a negative row counting from the
    end) but not bounds-checked (that would take a host synchronisation): a row outside [-S, S) or a column
    past the buffer reads or writes outside it.

    Raises:
        ValueError: CPU tensors without the Triton interpreter, dtypes that differ (x, src, weight, bias) or lie
            outside CONV_DTYPES, shapes that do not fit together, T > MAX_T, dst without dst_rows.
    """
    name = "causal_conv_step"
    tensors = [x, src, src_rows, weight] + [t for t in (bias, dst, dst_rows, src_cols) if t is not None]
    check_launchable(*tensors, name=name)
    if x.dim() != 3 or src.dim() != 3 or weight.dim() != 2:
        raise ValueError(f"{name}: x must be [B, T, C], src [S, C, Ws], weight [C, W]; got {tuple(x.shape)}, "
                         f"{tuple(src.shape)}, {tuple(weight.shape)}")
    B, T, C = x.shape
    W = weight.shape[1]
    dtypes = {x.dtype, src.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1 or x.dtype not in CONV_DTYPES:
        raise ValueError(f"{name}: x, src, weight and bias must share one dtype of {CONV_DTYPES}; got "
                         f"{sorted(map(str, dtypes))}")
    if src.shape[1] != C or weight.shape[0] != C or (bias is not None and bias.shape != (C,)):
        raise ValueError(f"{name}: {C} channels expected in src, weight and bias; got {tuple(src.shape)}, "
                         f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}")
    for label, rows in (("src_rows", src_rows), ("src_cols", src_cols), ("dst_rows", dst_rows)):
        if rows is not None and (rows.shape != (B,) or rows.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name}: {label} must be a ({B},) int32 / int64 tensor, got "
                             f"{tuple(rows.shape)} {rows.dtype}")
    if (dst is None) != (dst_rows is None):
        raise ValueError(f"{name}: pass dst and dst_rows together")
    n_dst = W - 1 + T - dst_from
    if dst is not None and (dst.dim() != 3 or dst.shape[1] != C or dst.shape[2] < n_dst or not 0 <= dst_from
                            <= W - 1 + T):
        raise ValueError(f"{name}: dst must be [S, {C}, >= {n_dst}] for dst_from = {dst_from}; got "
                         f"{tuple(dst.shape)}")
    if src_cols is None and src.shape[2] < W - 1:
        raise ValueError(f"{name}: src must hold the W - 1 = {W - 1} window columns, got {tuple(src.shape)}")
    if T > MAX_T:
        raise ValueError(f"{name}: T = {T} > {MAX_T} (decode / verify sizes); use causal_conv_step_ref")
    if x.stride(-1) != 1:
        x = x.contiguous()
    src_rows, src_cols, dst_rows = (None if t is None else t.contiguous() for t in (src_rows, src_cols, dst_rows))
    if src.stride(-1) != 1 or (dst is not None and dst.stride(-1) != 1):
        raise ValueError(f"{name}: src and dst need a unit-stride last dim")
    out = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    if B == 0 or T == 0 or C == 0:
        return out
    block_c = 128
    _conv_step_kernel[(B, triton.cdiv(C, block_c))](
        x, src, src_rows, src_cols if src_cols is not None else src_rows, weight.contiguous(),
        bias if bias is not None else weight, dst if dst is not None else src,
        dst_rows if dst_rows is not None else src_rows, out, C, src.shape[0],
        dst.shape[0] if dst is not None else 1, x.stride(0), x.stride(1), src.stride(0), src.stride(1),
        dst.stride(0) if dst is not None else 0, dst.stride(1) if dst is not None else 0,
        T=T, W=W, HAS_COLS=src_cols is not None, HAS_BIAS=bias is not None, HAS_DST=dst is not None,
        DST_FROM=dst_from, BLOCK_C=block_c, num_warps=4)
    return out
