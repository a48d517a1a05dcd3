"""NVFP4 weights (NVIDIA ModelOpt's checkpoint format) run weight-only on Hopper (W4A16): the dequantizing
GEMM and grouped GEMM in Triton, beside the plain-PyTorch references (quantize, dequantize, dequantize-then-
matmul) they are tested against.

Format (ModelOpt's HF export, as vLLM's ``ModelOptNvFp4LinearMethod`` reads it): a linear layer's weight
W [N, K] is stored as
- ``weight`` uint8 [N, K/2]: two e2m1 (fp4) codes per byte, element 2j in the low nibble, 2j+1 in the high
  nibble; a code is sign (bit 3) and magnitude index (bits 0-2) into the e2m1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6;
- ``weight_scale`` float8_e4m3fn [N, K/16]: one scale per 16 consecutive input columns;
- ``weight_scale_2`` float32 scalar: the global scale (per expert, [E], for stacked routed experts).
W[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2. ModelOpt's recipe writes
weight_scale_2 = amax(|W|) / (448 * 6) and weight_scale = block_amax / 6 / weight_scale_2 rounded to e4m3
(:func:`nvfp4_quantize`).

Kernels (the Marlin idea, written here for Triton): the packed weight is read from HBM, decoded in registers
and fed to the tensor cores; the dequantized weight never exists in memory. Each program owns an N tile and a
row tile of x and computes out^T = W x^T (the weight is the MMA's wide operand, the few activation rows the
narrow one: 16 rows suffice at decode). Per K tile of BLOCK_K columns: BLOCK_N x BLOCK_K / 2 packed bytes
and BLOCK_N x BLOCK_K / 16 scales are loaded; the low and high nibbles become two fp32 halves (codes to fp32
by bit arithmetic), each times its block scale; x's tile is split into its even and odd columns to match, so
no interleave is needed: acc += W_even x_even^T + W_odd x_odd^T. An e2m1 value times an e4m3 scale has at
most 2 + 4 significant bits and lies in [2^-10, 2688]: exact in bfloat16 and float16, so the product on
bf16 / fp16 tensor cores has the activation's precision; fp32 activations are split into three bf16 pieces
(kernels/_mma.py: fp32-accurate). weight_scale_2 multiplies the fp32 accumulator once at the end.

- :func:`nvfp4_linear` (dense): grid (N tiles, M tiles).
- :func:`nvfp4_grouped_mm` (routed experts, torch._grouped_mm's convention): grid (N tiles, a row-tile bound
  fixed by the shapes); each program finds its expert from the offsets on the device
  (kernels/quant/_common.py): no host synchronisation, CUDA-graph capturable, work proportional to the rows
  present.
Both run the Triton kernel on CUDA and under TRITON_INTERPRET=1; a plain CPU run calls the reference.

Shapes: M activation rows (dense), P (token, expert) pairs sorted by expert (grouped), E experts, N output
features, K input features (even; weight_scale has ceil(K / 16) columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, interpreter_active
from kernels.quant._common import (
    FP8_DTYPE,
    FP8_MAX,
    block_m_for,
    check_activation,
    check_bias,
    check_offsets,
    grouped_row_tiles,
    grouped_tile,
    mma,
    offsets_list,
    use_kernel,
)

NVFP4_BLOCK = 16  # input columns per weight_scale entry
E2M1_MAX = 6.0  # largest e2m1 magnitude
# e2m1 magnitudes by code (bits 0-2); bit 3 is the sign
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between consecutive grid values: the round-to-nearest boundaries
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ---------------------------------------------------------------------------------------------------------
# checks and references
# ---------------------------------------------------------------------------------------------------------


def _check_weights(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                   stacked: bool | None, name: str) -> tuple[tuple[int, ...], int, int]:
    """Validate an NVFP4 weight triple; returns (leading dims, N, K). ``stacked``: True requires [E, N, K/2],
    False [N, K/2], None allows any leading dims.

    Raises:
        ValueError: a dtype, rank or shape that does not fit the format.
    """
    if weight.dtype != torch.uint8:
        raise ValueError(f"{name}: weight must be uint8 (two e2m1 codes per byte), got {weight.dtype}")
    want = {True: 3, False: 2}.get(stacked)
    if weight.dim() < 2 or (want is not None and weight.dim() != want):
        shape = {True: "[E, N, K/2]", False: "[N, K/2]", None: "[..., N, K/2]"}[stacked]
        raise ValueError(f"{name}: weight must be {shape}, got shape {tuple(weight.shape)}")
    lead, N, K = tuple(weight.shape[:-2]), weight.shape[-2], 2 * weight.shape[-1]
    if weight_scale.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    want_scale = (*lead, N, triton.cdiv(K, NVFP4_BLOCK))
    if tuple(weight_scale.shape) != want_scale:
        raise ValueError(f"{name}: weight_scale must have shape {want_scale} (one scale per {NVFP4_BLOCK} "
                         f"input columns of the weight {tuple(weight.shape)}), got {tuple(weight_scale.shape)}")
    if weight_scale_2.dtype != torch.float32:
        raise ValueError(f"{name}: weight_scale_2 must be float32, got {weight_scale_2.dtype}")
    ok = tuple(weight_scale_2.shape) == lead or (not lead and weight_scale_2.numel() == 1)
    if not ok:
        want2 = lead if lead else "() or (1,)"
        raise ValueError(f"{name}: weight_scale_2 must have shape {want2} (one global scale per weight "
                         f"matrix), got {tuple(weight_scale_2.shape)}")
    devices = {weight.device, weight_scale.device, weight_scale_2.device}
    if len(devices) != 1:
        raise ValueError(f"{name}: weight, weight_scale and weight_scale_2 must be on one device, got "
                         f"{sorted(map(str, devices))}")
    return lead, N, K


def nvfp4_unpack(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] -> int64 e2m1 codes [..., N, K] (element 2j from the low nibble of byte j)."""
    lo, hi = weight & 0xF, weight >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2).long()


def nvfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Integer e2m1 codes [..., K] (K even, values 0..15) -> uint8 [..., K/2], element 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 codes (any integer tensor, 0..15): sign bit 3, magnitude E2M1_GRID[bits 0-2]."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    table = torch.cat((grid, -grid))
    return table[codes.long()]


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of float32 ``v`` rounded to the nearest e2m1 value, ties to the even code (the
    value whose mantissa bit is 0, as IEEE round-half-to-even; ModelOpt's ``_cast_fp4`` rounds ties the same
    way), magnitudes above 6 saturating to 6; the sign of a negative value is kept even when it rounds to 0."""
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=v.device)
    a = v.abs().float().contiguous()
    lo = torch.searchsorted(bounds, a, right=False)  # a tie goes to the lower code ...
    hi = torch.searchsorted(bounds, a, right=True)  # ... or the upper; they differ only at a tie
    mag = torch.where(lo % 2 == 0, lo, hi)
    return (mag + 8 * (v < 0)).to(torch.uint8)


def nvfp4_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference dequantization: W[..., n, k] = e2m1(code) * float(weight_scale[..., n, k // 16]) *
    weight_scale_2[...], computed in float32 and returned in ``dtype``.

    Args:
        weight: uint8 [..., N, K/2] (element 2j in the low nibble). weight_scale: float8_e4m3fn
            [..., N, ceil(K/16)]. weight_scale_2: float32, shape [...] (the leading dims, e.g. [E] for stacked
            experts), or () / (1,) for one matrix.

    Returns:
        [..., N, K] in ``dtype``. Mutates nothing.

    Raises:
        ValueError: dtypes or shapes that do not fit the format.
    """
    lead, N, K = _check_weights(weight, weight_scale, weight_scale_2, stacked=None, name="nvfp4_dequantize")
    vals = e2m1_values(nvfp4_unpack(weight))
    scale = weight_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)[..., :K]
    s2 = weight_scale_2.float().reshape(*lead, 1, 1)
    return (vals * scale * s2).to(dtype)


def nvfp4_quantize(w: torch.Tensor, *, weight_scale_2: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W [..., N, K] to NVFP4 with ModelOpt's recipe (modelopt NVFP4QTensor: global scale from the
    tensor's amax, per-16 block scales in e4m3, codes by round-to-nearest onto the e2m1 grid).

    weight_scale_2 = amax(|W|) / (448 * 6) per matrix (1.0 for an all-zero matrix, so nothing divides by 0);
    weight_scale = min(block_amax / 6 / weight_scale_2, 448) cast to float8_e4m3fn (round to nearest);
    code = round_to_e2m1(W / (float(weight_scale) * weight_scale_2)) (0 where the block scale is 0). The last
    block of a K that is not a multiple of 16 covers the remaining columns.

    Args:
        w: [..., N, K] float (K even).
        weight_scale_2: optional float32 global scale(s) of shape [...] (or () for one matrix) to use instead
            of the amax rule (ModelOpt gives fused projections such as gate / up one shared scale).

    Returns:
        (weight uint8 [..., N, K/2], weight_scale float8_e4m3fn [..., N, ceil(K/16)], weight_scale_2 float32
        [...]: 0-dim for one matrix). Mutates nothing.

    Raises:
        ValueError: w with fewer than 2 dims, an odd K, a non-float w, or a weight_scale_2 of the wrong shape.
    """
    name = "nvfp4_quantize"
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"{name}: w must be a float tensor [..., N, K], got {w.dtype} {tuple(w.shape)}")
    lead, (N, K) = tuple(w.shape[:-2]), w.shape[-2:]
    if K % 2:
        raise ValueError(f"{name}: K = {K} must be even (two e2m1 codes per byte)")
    wf = w.float()
    if weight_scale_2 is None:
        amax = wf.abs().amax(dim=(-2, -1))
        s2 = torch.where(amax > 0, amax / (FP8_MAX * E2M1_MAX), torch.ones_like(amax))
    else:
        if weight_scale_2.dtype != torch.float32 or tuple(weight_scale_2.shape) not in (lead, ()):
            raise ValueError(f"{name}: weight_scale_2 must be float32 of shape {lead}, got "
                             f"{weight_scale_2.dtype} {tuple(weight_scale_2.shape)}")
        s2 = weight_scale_2.to(wf.device).expand(lead)
    G = triton.cdiv(K, NVFP4_BLOCK)
    blocks = torch.nn.functional.pad(wf, (0, G * NVFP4_BLOCK - K)).reshape(*lead, N, G, NVFP4_BLOCK)
    s2b = s2.reshape(*lead, 1, 1)
    block_amax = blocks.abs().amax(dim=-1)
    scale = (block_amax / E2M1_MAX / s2b).clamp(max=FP8_MAX).to(FP8_DTYPE)
    full = (scale.float() * s2b)[..., None]
    scaled = torch.where(full > 0, blocks / torch.where(full > 0, full, 1.0), 0.0)
    codes = round_to_e2m1(scaled).reshape(*lead, N, G * NVFP4_BLOCK)[..., :K]
    return nvfp4_pack(codes), scale, s2.clone().contiguous()


def nvfp4_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference W4A16 linear: dequantize the weight in float32 (:func:`nvfp4_dequantize`), x @ W^T + bias in
    float32, result in x's dtype.

    Args:
        x: [M, K] float32 / bfloat16 / float16. weight: uint8 [N, K/2]. weight_scale: float8_e4m3fn
            [N, ceil(K/16)]. weight_scale_2: float32 () or (1,). bias: [N] or None.
        out: optional [M, N] tensor in x's dtype to write the result into.

    Returns:
        [M, N] in x's dtype (``out`` when given). Mutates only ``out``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit.
    """
    name = "nvfp4_linear_ref"
    _, N, K = _check_weights(weight, weight_scale, weight_scale_2, stacked=False, name=name)
    check_activation(x, K, name)
    check_bias(bias, N, x.device, name)
    y = x.float() @ nvfp4_dequantize(weight, weight_scale, weight_scale_2, torch.float32).T
    if bias is not None:
        y = y + bias.float()
    return _into(y.to(x.dtype), out, (x.shape[0], N), x, name)


def nvfp4_grouped_mm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2: torch.Tensor, offsets: torch.Tensor, *,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference grouped W4A16 product: rows offsets[e-1] .. offsets[e] - 1 of x times expert e's weight
    (dequantized in float32) transposed, float32 math, result in x's dtype. Reads the offsets on the host (a
    synchronisation: this is the specification, not a fast path); rows past offsets[-1] are zero.

    Args:
        x: [P, K] rows sorted by expert. weight: uint8 [E, N, K/2]. weight_scale: float8_e4m3fn
            [E, N, ceil(K/16)]. weight_scale_2: float32 [E]. offsets: int32 [E], cumulative row ends.
        out: optional [P, N] tensor in x's dtype to write the result into.

    Returns:
        [P, N] in x's dtype. Mutates only ``out``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit.
    """
    name = "nvfp4_grouped_mm_ref"
    (E,), N, K = _check_weights(weight, weight_scale, weight_scale_2, stacked=True, name=name)
    check_activation(x, K, name)
    check_offsets(offsets, E, x.shape[0], x.device, name)
    y = torch.zeros(x.shape[0], N, dtype=torch.float32, device=x.device)
    for e, (s, t) in enumerate(offsets_list(offsets)):
        if t > s:
            w = nvfp4_dequantize(weight[e], weight_scale[e], weight_scale_2[e], torch.float32)
            y[s:t] = x[s:t].float() @ w.T
    return _into(y.to(x.dtype), out, (x.shape[0], N), x, name)


def _into(y: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor,
          name: str) -> torch.Tensor:
    if out is None:
        return y
    _check_out(out, shape, x, name)
    return out.copy_(y)


def _check_out(out: torch.Tensor, shape: tuple[int, int], x: torch.Tensor, name: str) -> None:
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be a row-contiguous {shape} {x.dtype} tensor on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")


# ---------------------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_to_f32(c):
    """int32 e2m1 codes (0..15) -> fp32 by bit arithmetic: magnitude index m = 2 * exponent + mantissa; for
    m >= 2 the fp32 pattern is (exponent + 126) << 23 | mantissa << 22 = (m + 252) << 22; m = 1 is 0.5 =
    252 << 22; m = 0 is 0. Bit 3 of the code is the sign."""
    m = c & 7
    bits = tl.where(m >= 2, m + 252, m * 252) << 22
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _w_dot_x(w, x, acc, X_KIND: tl.constexpr, INTERP: tl.constexpr):
    """acc [BN, BM] + w [BN, BK2] @ x^T, for fp32 w exactly representable in bf16 / fp16 (dequantized
    weights) and x [BM, BK2] in the activation dtype (X_KIND 0: fp16, 1: bf16, 2: fp32 as three bf16
    pieces)."""
    xt = tl.trans(x)
    if X_KIND == 0:
        acc = mma(w.to(tl.float16), xt, acc, INTERP)
    elif X_KIND == 1:
        acc = mma(w.to(tl.bfloat16), xt, acc, INTERP)
    else:
        wb = w.to(tl.bfloat16)
        x0 = xt.to(tl.bfloat16)
        r = xt - x0.to(tl.float32)
        x1 = r.to(tl.bfloat16)
        x2 = (r - x1.to(tl.float32)).to(tl.bfloat16)
        acc = mma(wb, x0, acc, INTERP)
        acc = mma(wb, x1, acc, INTERP)
        acc = mma(wb, x2, acc, INTERP)
    return acc


@triton.jit
def _nvfp4_mm_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, out_ptr, offsets_ptr,
    M, N, K, E,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, X_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if GROUPED:
        expert, row0, row_end = grouped_tile(offsets_ptr, E, pid_m, BLOCK_M, BLOCK_E)
    else:
        expert = pid_m * 0
        row0 = pid_m * BLOCK_M
        row_end = M
    if expert < E:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        e64 = expert.to(tl.int64)
        w_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        s_rows = s_ptr + e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        offs_j = tl.arange(0, BLOCK_K // 2)  # packed byte columns of a K tile
        offs_g = tl.arange(0, BLOCK_K // 16)  # scale columns of a K tile
        offs_k = tl.arange(0, BLOCK_K)
        KH = K // 2
        KG = (K + 15) // 16
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + offs_j
            p = tl.load(w_rows + j[None, :], mask=mask_n[:, None] & (j < KH)[None, :], other=0).to(tl.int32)
            g = k0 // 16 + offs_g
            sc = tl.load(s_rows + g[None, :], mask=mask_n[:, None] & (g < KG)[None, :], other=0.0)
            sc = sc.to(tl.float32)
            lo = tl.reshape(_e2m1_to_f32(p & 15), (BLOCK_N, BLOCK_K // 16, 8)) * sc[:, :, None]
            hi = tl.reshape(_e2m1_to_f32(p >> 4), (BLOCK_N, BLOCK_K // 16, 8)) * sc[:, :, None]
            k = k0 + offs_k
            xt = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))
            acc = _w_dot_x(tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)), x_even, acc, X_KIND, INTERP)
            acc = _w_dot_x(tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)), x_odd, acc, X_KIND, INTERP)
        acc = acc * tl.load(s2_ptr + expert)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


X_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _tiles(rows_per_matrix: float, n_tiles_64: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode sizes (16 rows) use 64-wide N tiles, 32-wide when a
    launch would have fewer than about two programs per SM of an H200 (132 SMs); prefill sizes 128-wide."""
    bm = block_m_for(rows_per_matrix)
    if bm >= 64:
        return bm, 128, 64, 8
    bn = 64 if n_tiles_64 >= 264 else 32
    return bm, bn, 128, 4


def _launch(x, weight, weight_scale, weight_scale_2, bias, offsets, out, *, grouped: bool):
    N = weight.shape[-2]
    K = x.shape[1]
    rows = x.shape[0]
    E = weight.shape[0] if grouped else 1
    n64 = triton.cdiv(N, 64)
    if grouped:
        bm, bn, bk, warps = _tiles(rows / E, n64 * min(E, rows))
        row_tiles = grouped_row_tiles(rows, E, bm)
    else:
        bm, bn, bk, warps = _tiles(rows, n64 * triton.cdiv(rows, 128))
        row_tiles = triton.cdiv(rows, bm)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()
    grid = (triton.cdiv(N, bn), row_tiles)
    _nvfp4_mm_kernel[grid](
        x, weight, weight_scale, weight_scale_2.reshape(-1), bias if bias is not None else x, out,
        offsets if offsets is not None else weight_scale_2,
        rows, N, K, E,
        x.stride(0), weight.stride(0) if grouped else 0, weight.stride(-2),
        weight_scale.stride(0) if grouped else 0, weight_scale.stride(-2), out.stride(0),
        GROUPED=grouped, HAS_BIAS=bias is not None, X_KIND=X_KIND[x.dtype],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E) if grouped else 1,
        INTERP=interpreter_active(), num_warps=warps, num_stages=3,
    )
    return out


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """W4A16 linear with an NVFP4 weight: x @ W^T + bias with W dequantized in registers (see the module
    docstring); same arguments, result and errors as :func:`nvfp4_linear_ref`. Triton on CUDA and under
    TRITON_INTERPRET=1, the reference on a plain CPU run. No host synchronisation.

    Args:
        x: [M, K] float32 / bfloat16 / float16. weight: uint8 [N, K/2]. weight_scale: float8_e4m3fn
            [N, ceil(K/16)]. weight_scale_2: float32 () or (1,). bias: [N] or None.
        out: optional [M, N] tensor in x's dtype, written in full (tests pass a NaN-filled one).

    Returns:
        [M, N] in x's dtype (fp32 accumulation). Mutates only ``out``.

    Example:
        >>> w, s, s2 = nvfp4_quantize(torch.randn(64, 128))
        >>> nvfp4_linear(torch.randn(3, 128), w, s, s2).shape
        torch.Size([3, 64])
    """
    name = "nvfp4_linear"
    _, N, K = _check_weights(weight, weight_scale, weight_scale_2, stacked=False, name=name)
    check_activation(x, K, name)
    check_bias(bias, N, x.device, name)
    if not use_kernel(x):
        return nvfp4_linear_ref(x, weight, weight_scale, weight_scale_2, bias, out=out)
    check_launchable(x, weight, weight_scale, weight_scale_2, name=name)
    if out is None:
        out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, (x.shape[0], N), x, name)
    if x.shape[0] == 0:
        return out
    return _launch(x, weight, weight_scale, weight_scale_2, bias, None, out, grouped=False)


def nvfp4_grouped_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, offsets: torch.Tensor, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped W4A16 product for routed experts (torch._grouped_mm's convention): rows offsets[e-1] ..
    offsets[e] - 1 of x times expert e's NVFP4 weight, dequantized in registers, transposed. Same arguments
    and result as :func:`nvfp4_grouped_mm_ref` except that rows past offsets[-1] are left unwritten. No host
    synchronisation, shapes fixed by the inputs (CUDA-graph capturable); experts without rows cost only their
    entry in each program's offsets scan. Triton on CUDA and under TRITON_INTERPRET=1, the reference on a
    plain CPU run.

    Args:
        x: [P, K] rows sorted by expert, float32 / bfloat16 / float16. weight: uint8 [E, N, K/2].
            weight_scale: float8_e4m3fn [E, N, ceil(K/16)]. weight_scale_2: float32 [E]. offsets: int32 [E],
            non-decreasing cumulative row ends, offsets[-1] = P (not checked: reading it would synchronise).
        out: optional [P, N] tensor in x's dtype.

    Returns:
        [P, N] in x's dtype. Mutates only ``out``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit.
    """
    name = "nvfp4_grouped_mm"
    (E,), N, K = _check_weights(weight, weight_scale, weight_scale_2, stacked=True, name=name)
    check_activation(x, K, name)
    check_offsets(offsets, E, x.shape[0], x.device, name)
    if not use_kernel(x):
        return nvfp4_grouped_mm_ref(x, weight, weight_scale, weight_scale_2, offsets, out=out)
    check_launchable(x, weight, weight_scale, weight_scale_2, offsets, name=name)
    if out is None:
        out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, (x.shape[0], N), x, name)
    if x.shape[0] == 0:
        return out
    return _launch(x, weight, weight_scale, weight_scale_2, None, offsets, out, grouped=True)
