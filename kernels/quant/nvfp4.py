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
narrow one: 16 rows suffice at decode). Per K tile of BLOCK_K columns it loads BLOCK_N x BLOCK_K / 2 packed
bytes and BLOCK_N x BLOCK_K / 16 scales. Decode: a code's three magnitude bits, moved to bits 9-11 of an fp16
pattern with its sign at bit 15, read as the e2m1 value times 2^-14 (the two smallest codes as fp16
subnormals, which the fp16 -> fp32 conversion keeps exactly); the 2^14 is folded into the block scale, one
fp32 multiply per element. Where a row of codes is whole int32 words (K % 8 == 0) and at decode tile sizes,
the codes are read as words and two elements are decoded per 32-bit operation (elements 0 and 4, 1 and 5,
2 and 6, 3 and 7 of a word go to the low and high fp16 halves), x's tile is split into the 8 matching column
classes and the tile's product is 8 products of BLOCK_K / 8 columns; otherwise bytes are read, their low and
high nibbles decoded apart, and x split into even and odd columns (2 products). Either way no interleave of
the decoded weight is needed. An e2m1 value times an e4m3 scale has at most 2 + 4 significant bits and lies
in [2^-10, 2688]: exact in bfloat16 and float16, so the product on bf16 / fp16 tensor cores has the
activation's precision; fp32 activations are split into three bf16 pieces (as kernels/_mma.py: fp32-accurate).
weight_scale_2 multiplies the fp32 accumulator once at the end. A second decode, "direct" (``DECODE``, per
kernel), puts each code's bits straight into an fp32's (:func:`e2m1_word_f32`: about three integer operations
per element and no conversion instruction, the fp16 -> fp32 convert being a quarter-rate operation); its
outputs are bit-equal to the convert decode's (every rescaling is by a power of two). Measured, it leads only
in the per-pair GEMV, with that kernel's vector activation load (``PAIR_X_LOAD``); the other kernels keep
the convert decode.

Decode sizes (<= GEMV_MAX_ROWS = 8 rows per weight matrix, kernels/quant/_common.py, and for grouped launches
<= GROUPED_GEMV_MAX_ROWS rows in all) where the codes are words take a CUDA-core GEMV kernel instead (:func:`_nvfp4_gemv_kernel`): each program decodes its weight tile
once and multiplies it into each of its few rows, reducing over K in fp32; no MMA tile padded to 16 rows, no
shared-memory layout conversion of the decoded weight; split over K with a partial-sum launch where N tiles
alone give too few programs (:func:`kernels.quant._common.gemv_config`).

- :func:`nvfp4_linear` (dense): grid (N tiles, M tiles).
- :func:`nvfp4_grouped_mm` (routed experts, torch._grouped_mm's convention): grid (N tiles, a row-tile bound
  fixed by the shapes); each program finds its expert from the offsets on the device
  (kernels/quant/_common.py): no host synchronisation, CUDA-graph capturable, work proportional to the rows
  present.
- :func:`moe_gemv_nvfp4` (routed experts at decode sizes, kernels/quant/moe_gemv.py's per-pair scheme): one
  program per (token, expert) pair and output tile; reference :func:`moe_gemv_nvfp4_ref`. On the GPU its
  projections run by default on the CUDA kernel of kernels/quant/pair_cuda.py (``PAIR_KERNEL``), this
  file's Triton kernel taking what that one does not.
Each runs the Triton kernel on CUDA and under TRITON_INTERPRET=1; a plain CPU run calls the reference.

Shapes: M activation rows (dense), P (token, expert) pairs sorted by expert (grouped), E experts, N output
features, K input features (even; weight_scale has ceil(K / 16) columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import moe_gemv as pair_gemv
from kernels._common import check_launchable, interpreter_active
from kernels.moe_gemv import pair_gemv_config, run_pair_launches, store_pair_rows
from kernels.quant import pair_cuda
from kernels.quant._common import (
    FP8_DTYPE,
    FP8_MAX,
    check_activation,
    check_bias,
    check_offsets,
    copy_into,
    gemv_config,
    grouped_row_tiles,
    mma,
    offsets_list,
    output_buffer,
    program_tile,
    repack_words,
    splitk_sum,
    tile_config,
    true_divide,
    use_gemv,
    use_kernel,
)
from kernels.quant.moe_gemv import (
    check_expert_shapes,
    check_pair_inputs,
    contiguous_experts,
    pair_outputs,
    pairs_ref,
)

NVFP4_BLOCK = 16  # input columns per weight_scale entry
# A grouped (routed-experts) launch takes the GEMV up to this many (token, expert) rows in all, the
# tensor-core kernel above, whatever the rows per expert: on the H200 at the released expert shapes the
# tensor-core kernel leads from 44 rows on, the GEMV only at 22 (docs/kernel_performance.md, "Quantized
# formats"). Read at call time (benchmarks lift it).
GROUPED_GEMV_MAX_ROWS = 22
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


# The repacked code word (format "nvfp4_repacked" of kernels/quant/pair_cuda.py, read by pair_gemv.cu's
# Nvfp4Repacked): the same 8 columns of one row per 32-bit little-endian word as the natural layout (byte j
# holds columns 2j, 2j + 1), with bit b of column c's code (b 0-2 the magnitude, 3 the sign) moved to bit
# REPACK_BITS[c][b]. Each column pair (2j, 2j + 1) then decodes to a bf16x2 (magnitudes at bits 6-8 / 22-24,
# signs at 15 / 31) in one to four integer operations: v & M, (v << 4) & M, rotl(v, 10) & M and
# ((v << 6) & 0x80C080C0) | ((v >> 2) & 0x01000100), M = 0x81C081C0 (the .cu's Nvfp4Repacked::pair).
REPACK_BITS = ((6, 7, 8, 15), (22, 23, 24, 31), (2, 3, 4, 11), (18, 19, 20, 27),
               (28, 29, 30, 5), (12, 13, 14, 21), (0, 1, 10, 9), (16, 17, 26, 25))


def repack_codes(weight: torch.Tensor) -> torch.Tensor:
    """NVFP4 codes in the natural layout -> the repacked layout the CUDA kernels' "nvfp4_repacked" format reads
    (REPACK_BITS: a bit permutation inside each 32-bit word; shapes, word addresses and the scales unchanged).
    Load-time work (kernels/quant/_common.py repack_words: one pass per bit, in chunks). Source of the idea: Marlin's load-time weight
    repacking (Frantar et al., PPoPP 2025); the bit map is this project's.

    Args:
        weight: uint8 [..., K/2] (element 2j in the low nibble), K % 8 == 0.

    Returns:
        a new uint8 tensor of weight's shape, on its device. Mutates nothing.

    Raises:
        ValueError: not uint8, or K not a multiple of 8.
    """
    return repack_words(weight, REPACK_BITS, "repack_codes")


def unrepack_codes(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`repack_codes`: repacked codes -> the natural layout (uint8, weight's shape).

    Raises:
        ValueError: not uint8, or K not a multiple of 8.
    """
    return repack_words(weight, REPACK_BITS, "unrepack_codes", inverse=True)


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
        s2 = torch.where(amax > 0, true_divide(amax, FP8_MAX * E2M1_MAX), torch.ones_like(amax))
    else:
        if weight_scale_2.dtype != torch.float32 or tuple(weight_scale_2.shape) not in (lead, ()):
            raise ValueError(f"{name}: weight_scale_2 must be float32 of shape {lead}, got "
                             f"{weight_scale_2.dtype} {tuple(weight_scale_2.shape)}")
        s2 = weight_scale_2.to(wf.device).expand(lead)
    G = triton.cdiv(K, NVFP4_BLOCK)
    blocks = torch.nn.functional.pad(wf, (0, G * NVFP4_BLOCK - K)).reshape(*lead, N, G, NVFP4_BLOCK)
    s2b = s2.reshape(*lead, 1, 1)
    block_amax = blocks.abs().amax(dim=-1)
    scale = (true_divide(block_amax, E2M1_MAX) / s2b).clamp(max=FP8_MAX).to(FP8_DTYPE)
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
    return copy_into(y.to(x.dtype), out, x, name)


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
    return copy_into(y.to(x.dtype), out, x, name)



# ---------------------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_pair(p):
    """int32 bytes p (0..255, two e2m1 codes) -> (low, high) fp32 values times 2^-14.

    A code's magnitude bits 0-2 are exponent (2 bits) and mantissa (1 bit) of a float with exponent bias 1;
    moved to bits 9-11 of an fp16 pattern (exponent bits 10-11, mantissa bit 9) with the sign at bit 15 they
    read as the same value times 2^-14 (codes 0.5 and 0 become fp16 subnormals, which the fp16 -> fp32
    conversion keeps exactly). Per element: two shifts, two logic ops and one conversion (the 2^14 is folded
    into the block scale by the caller)."""
    lo = ((p << 9) & 0x0E00) | ((p << 12) & 0x8000)
    hi = ((p << 5) & 0x0E00) | ((p << 8) & 0x8000)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _half_to_f32(h):
    """int32 holding an fp16 pattern in its low 16 bits -> that value in fp32 (exact, subnormals kept)."""
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_word(w):
    """int32 words w (4 packed bytes: the codes of 8 consecutive elements 0..7, byte j holding elements 2j in
    its low and 2j + 1 in its high nibble, little-endian) -> the 8 elements as fp32 values times 2^-14.

    The fp16-pattern rule of :func:`_e2m1_pair`, applied to two elements per 32-bit operation: a shift and a
    mask put one code's magnitude in bits 9-11 and its sign in bit 15 of the low half-word and another's in
    bits 25-27 / 31 of the high one (elements 0 and 4, 1 and 5, 2 and 6, 3 and 7): about 1.5 integer
    operations per element instead of 3, and no byte extraction."""
    mag = 0x0E000E00
    sgn = -2147450880  # 0x80008000: bits 15 and 31
    a = ((w << 9) & mag) | ((w << 12) & sgn)  # elements 0 (low half) and 4 (high half)
    b = ((w << 5) & mag) | ((w << 8) & sgn)  # 1 and 5
    c = ((w << 1) & mag) | ((w << 4) & sgn)  # 2 and 6
    d = ((w >> 3) & mag) | (w & sgn)  # 3 and 7
    return (_half_to_f32(a), _half_to_f32(b), _half_to_f32(c), _half_to_f32(d),
            _half_to_f32(a >> 16), _half_to_f32(b >> 16), _half_to_f32(c >> 16), _half_to_f32(d >> 16))


# The "direct" decode: each code's bits moved into an fp32's own bit positions (magnitude to bits 22-24,
# sign to bit 31), so the value, e2m1 * 2^-126, needs no conversion instruction (e2m1_word's fp16 -> fp32
# convert runs on the quarter-rate unit, one per element). Code 0.5 becomes an fp32 subnormal, which Triton's
# fp32 arithmetic keeps (fma.rn.f32, no flush-to-zero); one exact multiply by a power of two makes every value
# normal before it meets an activation. DECODE picks per kernel (read at call time).
# Measured on an H200 (docs/kernel_performance.md, "NVFP4 decode variants"): in the grouped GEMV and the
# tensor-core kernel the direct decode ran at 0.78-1.00x of the convert decode, so they keep it; in the
# per-pair GEMV with the vector activation load (below) it ran fastest, 1.08-1.17x over the old default at
# 1-16 tokens.
DECODES = ("convert", "direct")
DECODE = {"gemv": "convert", "mma": "convert", "pair": "direct"}
# How the per-pair GEMV (moe_gemv_nvfp4, the engine's routed experts at decode) reads the activation row: "tile"
# (one load per weight-tile element, in the tile's layout) or "vector" (each column class once per word,
# broadcast over the tile's rows). "vector": 1.07-1.11x faster alone on the H200, and what lets the direct
# decode lead. Read at call time.
PAIR_X_LOADS = ("tile", "vector")
PAIR_X_LOAD = "vector"
# Weights the per-pair GEMV decodes per program and K step, over its matrices (unsplit launches; 8192: 4 KB of
# codes), with kernels/moe_gemv.py's PAIR_LAUNCH. Read at call time.
PAIR_TILE_WEIGHTS = 8192
# GEMV: the decoded values times 2^64 (the per-pair GEMV with the vector x load multiplies x instead: the same
# exact products), 2^62 = 2^126 / 2^64 folded in with weight_scale_2 at the end.
# MMA: the block scales times 2^118 (448 * 2^118 < 2^127); a decoded value times one is e2m1 * scale * 2^-8,
# exact in bf16 and fp16 (at most 6 significant bits, in [2^-18, 10.5]); 2^8 folded in at the end.
DIRECT_F32_SCALE = tl.constexpr(2.0 ** 64)
DIRECT_F32_FOLD = tl.constexpr(2.0 ** 62)
DIRECT_MMA_SCALE = tl.constexpr(2.0 ** 118)
DIRECT_MMA_FOLD = tl.constexpr(2.0 ** 8)


@triton.jit
def _f32_code(w, MAG_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """One element of each int32 word w as fp32 = e2m1 * 2^-126: its magnitude bits moved to 22-24 and its
    sign bit to 31 (a shift is left for a positive constexpr, right for a negative one)."""
    if MAG_SHIFT >= 0:
        mag = (w << MAG_SHIFT) & 0x01C00000
    else:
        mag = (w >> (-MAG_SHIFT)) & 0x01C00000
    return (mag | ((w << SIGN_SHIFT) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_word_f32(w):
    """int32 words w (as :func:`e2m1_word`) -> the 8 elements as fp32 values times 2^-126 (element c's nibble
    at bits 4c..4c+3), no conversion instruction: about three integer operations per element."""
    return (_f32_code(w, 22, 28), _f32_code(w, 18, 24), _f32_code(w, 14, 20), _f32_code(w, 10, 16),
            _f32_code(w, 6, 12), _f32_code(w, 2, 8), _f32_code(w, -2, 4), _f32_code(w, -6, 0))


@triton.jit
def _gemv_word(w, DIRECT: tl.constexpr):
    """The CUDA-core kernels' decode of int32 words w: the 8 elements as fp32, times 2^-14 (:func:`e2m1_word`)
    or, DIRECT, times 2^-62 (:func:`e2m1_word_f32`'s 2^-126 made normal by one exact multiply by 2^64 each,
    no convert); the caller folds the power of two back with weight_scale_2."""
    if DIRECT:
        e0, e1, e2, e3, e4, e5, e6, e7 = e2m1_word_f32(w)
        return (e0 * DIRECT_F32_SCALE, e1 * DIRECT_F32_SCALE, e2 * DIRECT_F32_SCALE, e3 * DIRECT_F32_SCALE,
                e4 * DIRECT_F32_SCALE, e5 * DIRECT_F32_SCALE, e6 * DIRECT_F32_SCALE, e7 * DIRECT_F32_SCALE)
    else:
        return e2m1_word(w)


@triton.jit
def _scaled(v, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """v [BLOCK_N, BLOCK_K / 8] (one element per packed word) times the block scale of its word (two words per
    16-column block): sc [BLOCK_N, BLOCK_K / 16]."""
    return tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 16, 2)) * sc[:, :, None], (BLOCK_N, BLOCK_K // 8))


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
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, X_KIND: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    INTERP: tl.constexpr, DIRECT: tl.constexpr = False,
):
    """WORDS: w_ptr is the packed weight viewed as int32 (K % 8 == 0; strides in words), 8 codes decoded per
    load; else uint8 bytes, 2 codes per load (any even K). DIRECT (WORDS only): the words decoded by
    :func:`e2m1_word_f32` (no fp16 -> fp32 convert), the block scales times 2^118 instead of 2^14."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert, row0, row_end = program_tile(offsets_ptr, E, M, pid_m, GROUPED, BLOCK_M, BLOCK_E)
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
        offs_w = tl.arange(0, BLOCK_K // 8)  # packed int32 word columns of a K tile (WORDS)
        offs_g = tl.arange(0, BLOCK_K // 16)  # scale columns of a K tile
        offs_k = tl.arange(0, BLOCK_K)
        KH = K // 2
        KG = (K + 15) // 16
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            g = k0 // 16 + offs_g
            sc = tl.load(s_rows + g[None, :], mask=mask_n[:, None] & (g < KG)[None, :], other=0.0)
            if DIRECT:  # scales times 2^118 against values times 2^-126 (module notes: exact products)
                sc = sc.to(tl.float32) * DIRECT_MMA_SCALE
            else:
                sc = sc.to(tl.float32) * 16384.0  # 2^14: the decoded values are e2m1 * 2^-14
            k = k0 + offs_k
            xt = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
            if WORDS:
                jw = k0 // 8 + offs_w
                wd = tl.load(w_rows + jw[None, :], mask=mask_n[:, None] & (jw < K // 8)[None, :], other=0)
                if DIRECT:
                    e0, e1, e2, e3, e4, e5, e6, e7 = e2m1_word_f32(wd)
                else:
                    e0, e1, e2, e3, e4, e5, e6, e7 = e2m1_word(wd)
                # x's columns 8w + c for c = 4 b2 + 2 b1 + b0, split bit by bit (last axes: b2, b1, b0)
                x_b0_0, x_b0_1 = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 8, 2, 2, 2)))
                x_c04, x_c26 = tl.split(x_b0_0)
                x_c15, x_c37 = tl.split(x_b0_1)
                x0, x4 = tl.split(x_c04)
                x2, x6 = tl.split(x_c26)
                x1, x5 = tl.split(x_c15)
                x3, x7 = tl.split(x_c37)
                acc = _w_dot_x(_scaled(e0, sc, BLOCK_N, BLOCK_K), x0, acc, X_KIND, INTERP)
                acc = _w_dot_x(_scaled(e1, sc, BLOCK_N, BLOCK_K), x1, acc, X_KIND, INTERP)
                acc = _w_dot_x(_scaled(e2, sc, BLOCK_N, BLOCK_K), x2, acc, X_KIND, INTERP)
                acc = _w_dot_x(_scaled(e3, sc, BLOCK_N, BLOCK_K), x3, acc, X_KIND, INTERP)
                acc = _w_dot_x(_scaled(e4, sc, BLOCK_N, BLOCK_K), x4, acc, X_KIND, INTERP)
                acc = _w_dot_x(_scaled(e5, sc, BLOCK_N, BLOCK_K), x5, acc, X_KIND, INTERP)
                acc = _w_dot_x(_scaled(e6, sc, BLOCK_N, BLOCK_K), x6, acc, X_KIND, INTERP)
                acc = _w_dot_x(_scaled(e7, sc, BLOCK_N, BLOCK_K), x7, acc, X_KIND, INTERP)
            else:
                j = k0 // 2 + offs_j
                p = tl.load(w_rows + j[None, :], mask=mask_n[:, None] & (j < KH)[None, :], other=0)
                lo, hi = _e2m1_pair(p.to(tl.int32))
                lo = tl.reshape(lo, (BLOCK_N, BLOCK_K // 16, 8)) * sc[:, :, None]
                hi = tl.reshape(hi, (BLOCK_N, BLOCK_K // 16, 8)) * sc[:, :, None]
                x_even, x_odd = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))
                acc = _w_dot_x(tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)), x_even, acc, X_KIND, INTERP)
                acc = _w_dot_x(tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)), x_odd, acc, X_KIND, INTERP)
        if DIRECT:
            acc = acc * (tl.load(s2_ptr + expert) * DIRECT_MMA_FOLD)
        else:
            acc = acc * tl.load(s2_ptr + expert)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _nvfp4_row_part(x_ptr, row, row_end, stride_xm, KW, kw, mkw, e0, e1, e2, e3, e4, e5, e6, e7, scw):
    """One activation row times a decoded tile: sum over the tile's words w and their elements c of
    e_c[n, w] * x[row, 8 w + c] * scw[n, w], fp32 [BLOCK_N] (0 for a row past row_end). x_ptr: the rows in
    fp32, column class major ([rows, 8, K / 8]: element c of every word contiguous, so each class is read
    as vectors of consecutive words); e_c: fp32 [BLOCK_N, WORDS] (element c of each word, times 2^-14);
    scw: each word's block scale."""
    live = mkw & ((kw * 0 + row) < row_end)
    xw = x_ptr + row.to(tl.int64) * stride_xm + kw
    t = e0 * tl.load(xw, mask=live, other=0.0)[None, :]
    t += e1 * tl.load(xw + KW, mask=live, other=0.0)[None, :]
    t += e2 * tl.load(xw + 2 * KW, mask=live, other=0.0)[None, :]
    t += e3 * tl.load(xw + 3 * KW, mask=live, other=0.0)[None, :]
    t += e4 * tl.load(xw + 4 * KW, mask=live, other=0.0)[None, :]
    t += e5 * tl.load(xw + 5 * KW, mask=live, other=0.0)[None, :]
    t += e6 * tl.load(xw + 6 * KW, mask=live, other=0.0)[None, :]
    t += e7 * tl.load(xw + 7 * KW, mask=live, other=0.0)[None, :]
    return tl.sum(t * scw, 1)


@triton.jit
def _store_row(ptr, row, row_end, stride, offs_n, mask_n, v):
    tl.store(ptr + row.to(tl.int64) * stride + offs_n, v.to(ptr.dtype.element_ty),
             mask=mask_n & ((offs_n * 0 + row) < row_end))


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, out_ptr, offsets_ptr,
    M, N, K, KW, E, STEPS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_os,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, DIRECT: tl.constexpr = False,
):
    """Decode GEMV (<= 8 rows per program; codes read as int32 words, K % 8 == 0; x_ptr: the rows in fp32,
    column class major [rows, 8, KW = K / 8]): grid (N tiles, row tiles, K splits). Each program streams the
    packed words of its N tile over K tiles [pid_k * STEPS, (pid_k + 1) * STEPS) once, decodes them in
    registers (:func:`e2m1_word`, no scaling per element), and for each of its rows multiplies by the
    activations and reduces over K on CUDA cores: the block scale multiplies once per word and row,
    weight_scale_2 and the 2^14 of the decode once at the end. No tensor-core tile padded to 16 rows and no
    register-to-shared layout conversion of the decoded weight. One accumulator per row (a0..a7, unrolled by
    BLOCK_M). With K splits, out_ptr is the fp32 partial-sum buffer [S, rows, N]."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, row0, row_end = program_tile(offsets_ptr, E, M, pid_m, GROUPED, BLOCK_M, BLOCK_E)
    if expert < E:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        e64 = expert.to(tl.int64)
        w_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        s_rows = s_ptr + e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        offs_w = tl.arange(0, WORDS)
        a0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a4 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a5 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a6 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a7 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        t0 = pid_k * STEPS
        t1 = tl.minimum(t0 + STEPS, tl.cdiv(K, BLOCK_K))
        for t in range(t0, t1):
            kw = t * WORDS + offs_w
            mkw = kw < KW
            m2 = mask_n[:, None] & mkw[None, :]
            wd = tl.load(w_rows + kw[None, :], mask=m2, other=0)
            scw = tl.load(s_rows + (kw // 2)[None, :], mask=m2, other=0.0).to(tl.float32)  # 2 words / block
            e0, e1, e2, e3, e4, e5, e6, e7 = _gemv_word(wd, DIRECT)
            a0 += _nvfp4_row_part(x_ptr, row0, row_end, stride_xm, KW, kw, mkw,
                                  e0, e1, e2, e3, e4, e5, e6, e7, scw)
            if BLOCK_M > 1:
                a1 += _nvfp4_row_part(x_ptr, row0 + 1, row_end, stride_xm, KW, kw, mkw,
                                      e0, e1, e2, e3, e4, e5, e6, e7, scw)
            if BLOCK_M > 2:
                a2 += _nvfp4_row_part(x_ptr, row0 + 2, row_end, stride_xm, KW, kw, mkw,
                                      e0, e1, e2, e3, e4, e5, e6, e7, scw)
                a3 += _nvfp4_row_part(x_ptr, row0 + 3, row_end, stride_xm, KW, kw, mkw,
                                      e0, e1, e2, e3, e4, e5, e6, e7, scw)
            if BLOCK_M > 4:
                a4 += _nvfp4_row_part(x_ptr, row0 + 4, row_end, stride_xm, KW, kw, mkw,
                                      e0, e1, e2, e3, e4, e5, e6, e7, scw)
                a5 += _nvfp4_row_part(x_ptr, row0 + 5, row_end, stride_xm, KW, kw, mkw,
                                      e0, e1, e2, e3, e4, e5, e6, e7, scw)
                a6 += _nvfp4_row_part(x_ptr, row0 + 6, row_end, stride_xm, KW, kw, mkw,
                                      e0, e1, e2, e3, e4, e5, e6, e7, scw)
                a7 += _nvfp4_row_part(x_ptr, row0 + 7, row_end, stride_xm, KW, kw, mkw,
                                      e0, e1, e2, e3, e4, e5, e6, e7, scw)
        if DIRECT:
            g = tl.load(s2_ptr + expert) * DIRECT_F32_FOLD  # weight_scale_2, and 2^126 / 2^64 of the decode
        else:
            g = tl.load(s2_ptr + expert) * 16384.0  # weight_scale_2, and the 2^14 of the decode
        b = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        o = out_ptr + pid_k.to(tl.int64) * stride_os
        _store_row(o, row0, row_end, stride_om, offs_n, mask_n, a0 * g + b)
        if BLOCK_M > 1:
            _store_row(o, row0 + 1, row_end, stride_om, offs_n, mask_n, a1 * g + b)
        if BLOCK_M > 2:
            _store_row(o, row0 + 2, row_end, stride_om, offs_n, mask_n, a2 * g + b)
            _store_row(o, row0 + 3, row_end, stride_om, offs_n, mask_n, a3 * g + b)
        if BLOCK_M > 4:
            _store_row(o, row0 + 4, row_end, stride_om, offs_n, mask_n, a4 * g + b)
            _store_row(o, row0 + 5, row_end, stride_om, offs_n, mask_n, a5 * g + b)
            _store_row(o, row0 + 6, row_end, stride_om, offs_n, mask_n, a6 * g + b)
            _store_row(o, row0 + 7, row_end, stride_om, offs_n, mask_n, a7 * g + b)


# K columns per step of the GEMV kernel at 64-wide N tiles (16 int32 words of codes per weight row; the 8
# decoded [BLOCK_N, 16] fp32 element tensors take 64 registers per thread with 4 warps); 32 / 16-wide tiles
# take 256 / 512 columns (the same registers and 4 KB of codes per step: Triton does not software-pipeline
# this loop, so the bytes a program requests per step are what it keeps in flight). Split-K launches keep 128.
GEMV_BLOCK_K = 128


def _launch_gemv(x, weight, weight_scale, weight_scale_2, bias, offsets, out, *, grouped: bool):
    """Decode sizes (<= GEMV_MAX_ROWS rows per weight matrix, codes readable as words): the GEMV kernel,
    split over K (plus the splitk_sum launch) where the N tiles alone give too few programs."""
    N = weight.shape[-2]
    rows, K = x.shape
    E = weight.shape[0] if grouped else 1
    matrices = min(E, rows) if grouped else 1
    bm, bn, split, steps = gemv_config(rows / matrices, N, matrices, triton.cdiv(K, GEMV_BLOCK_K))
    bk = GEMV_BLOCK_K
    if split == 1:  # narrower N tiles take longer K steps: 4 KB of codes requested per program and step
        bk = GEMV_BLOCK_K * 64 // bn
        steps = triton.cdiv(K, bk)
    row_tiles = grouped_row_tiles(rows, E, bm) if grouped else triton.cdiv(rows, bm)
    # x in fp32, column class major: xp[r, c, w] = x[r, 8 w + c] (one small copy; each class of a word tile
    # is then one vector load per row in the kernel instead of strided scalar gathers)
    xp = torch.empty(rows, 8, K // 8, dtype=torch.float32, device=x.device)
    xp.copy_(x.reshape(rows, K // 8, 8).transpose(1, 2))
    dst = out if split == 1 else torch.empty(split, rows, N, dtype=torch.float32, device=x.device)
    _nvfp4_gemv_kernel[(triton.cdiv(N, bn), row_tiles, split)](
        xp, weight.view(torch.int32), weight_scale, weight_scale_2.reshape(-1), bias if bias is not None else x,
        dst, offsets if offsets is not None else weight_scale_2,
        rows, N, K, K // 8, E, steps,
        xp.stride(0), weight.stride(0) // 4 if grouped else 0, weight.stride(-2) // 4,
        weight_scale.stride(0) if grouped else 0, weight_scale.stride(-2), dst.stride(-2),
        dst.stride(0) if split > 1 else 0,
        GROUPED=grouped, HAS_BIAS=bias is not None and split == 1, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E) if grouped else 1, DIRECT=_decode("gemv") == "direct",
        num_warps=4, num_stages=1,
    )
    if split > 1:
        splitk_sum(dst, bias, out, offsets)
    return out


X_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _decode(kernel: str) -> str:
    """DECODE[kernel] ("gemv" / "mma" / "pair"), checked: ValueError naming the choices for anything else."""
    choice = DECODE[kernel]
    if choice not in DECODES:
        raise ValueError(f"nvfp4.DECODE[{kernel!r}] = {choice!r}: expected one of {DECODES}")
    return choice


def _pair_x_load() -> str:
    """PAIR_X_LOAD, checked: ValueError naming the choices for anything else."""
    if PAIR_X_LOAD not in PAIR_X_LOADS:
        raise ValueError(f"nvfp4.PAIR_X_LOAD = {PAIR_X_LOAD!r}: expected one of {PAIR_X_LOADS}")
    return PAIR_X_LOAD


def words_ok(weight: torch.Tensor) -> bool:
    """Whether a contiguous packed weight [..., N, K/2] can be read as int32 words: K % 8 == 0 and the data
    4-byte aligned."""
    return weight.shape[-1] % 4 == 0 and weight.data_ptr() % 4 == 0


# The tensor-core kernel's launch settings (_nvfp4_mm_kernel, dense and grouped; read at call time, so a sweep,
# benchmarks/sweep_nvfp4_grouped.py, can time other values at the real shapes): MMA_TILE None takes
# tile_config's (BLOCK_M, BLOCK_N, num_warps), else that triple for every launch; MMA_BLOCK_K None takes 64 K
# columns per tile at prefill tiles (BLOCK_M >= 64) and 128 below, else that power of two (>= 32); the codes
# are read as int32 words only from 128 (a word's 8 column classes make 8 products of BLOCK_K / 8 columns,
# which must reach the MMA's 16); MMA_NUM_STAGES: Triton's software-pipelining depth. The defaults are the
# launches the kernel always had.
MMA_TILE: tuple[int, int, int] | None = None
MMA_BLOCK_K: int | None = None
MMA_NUM_STAGES = 3


def _pow2_at_least(v, low: int) -> bool:
    """Whether v is an int power of two >= low."""
    return isinstance(v, int) and v >= low and v & (v - 1) == 0


def mma_config(rows_per_matrix: float, N: int, row_tiles: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, BLOCK_K, num_stages) of a tensor-core launch with about
    ``rows_per_matrix`` rows per weight matrix, N output features and ``row_tiles`` row tiles sharing each N
    tile: :func:`kernels.quant._common.tile_config` and the BLOCK_K rule, or the module's MMA_TILE /
    MMA_BLOCK_K / MMA_NUM_STAGES where set.

    Raises:
        ValueError: an MMA_TILE that is not (power of two >= 16, power of two >= 16, 1 / 2 / 4 / 8 warps), an
            MMA_BLOCK_K that is not a power of two >= 32, or an MMA_NUM_STAGES below 1.
    """
    if MMA_TILE is None:
        bm, bn, warps = tile_config(rows_per_matrix, N, row_tiles)
    else:
        bm, bn, warps = MMA_TILE
        if not (_pow2_at_least(bm, 16) and _pow2_at_least(bn, 16) and warps in (1, 2, 4, 8)):
            raise ValueError(f"nvfp4.MMA_TILE = {MMA_TILE!r}: expected (BLOCK_M, BLOCK_N, num_warps) with powers "
                             "of two >= 16 and 1, 2, 4 or 8 warps")
    if MMA_BLOCK_K is None:
        bk = 64 if bm >= 64 else 128  # K columns per tile (BLOCK_K / 2 packed bytes per weight row)
    elif _pow2_at_least(MMA_BLOCK_K, 32):
        bk = MMA_BLOCK_K
    else:
        raise ValueError(f"nvfp4.MMA_BLOCK_K = {MMA_BLOCK_K!r}: expected None or a power of two >= 32")
    if not (isinstance(MMA_NUM_STAGES, int) and MMA_NUM_STAGES >= 1):
        raise ValueError(f"nvfp4.MMA_NUM_STAGES = {MMA_NUM_STAGES!r}: expected an int >= 1")
    return bm, bn, warps, bk, MMA_NUM_STAGES


def _launch(x, weight, weight_scale, weight_scale_2, bias, offsets, out, *, grouped: bool,
            force_bytes: bool = False):
    """One product on the GPU (or the interpreter): the GEMV kernel at decode sizes where the codes are words
    (:func:`_launch_gemv`), else the tensor-core kernel with :func:`mma_config`'s launch settings. x [rows, K];
    offsets: the grouped launch's int32 [E] row ends (None dense). Mutates and returns ``out``."""
    N = weight.shape[-2]
    K = x.shape[1]
    rows = x.shape[0]
    E = weight.shape[0] if grouped else 1
    if grouped:
        bm, bn, warps, bk, stages = mma_config(rows / E, N, min(E, rows))
        row_tiles = grouped_row_tiles(rows, E, bm)
    else:
        bm, bn, warps, bk, stages = mma_config(rows, N, triton.cdiv(rows, 16))
        row_tiles = triton.cdiv(rows, bm)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()
    gemv = (use_gemv(rows / min(E, rows), grouped_rows=rows, grouped_max_rows=GROUPED_GEMV_MAX_ROWS)
            if grouped else use_gemv(rows))
    if gemv and words_ok(weight) and force_bytes is False:
        return _launch_gemv(x, weight, weight_scale, weight_scale_2, bias, offsets, out, grouped=grouped)
    # Decode sizes read the codes as int32 words (8 per load, cheaper to decode: e2m1_word) where the rows
    # are whole words; prefill sizes (BLOCK_K 64: 8-column products would be too small) read bytes.
    words = words_ok(weight) and bk >= 128 and force_bytes is False
    w = weight.view(torch.int32) if words else weight
    unit = 4 if words else 1
    grid = (triton.cdiv(N, bn), row_tiles)
    _nvfp4_mm_kernel[grid](
        x, w, weight_scale, weight_scale_2.reshape(-1), bias if bias is not None else x, out,
        offsets if offsets is not None else weight_scale_2,
        rows, N, K, E,
        x.stride(0), weight.stride(0) // unit if grouped else 0, weight.stride(-2) // unit,
        weight_scale.stride(0) if grouped else 0, weight_scale.stride(-2), out.stride(0),
        GROUPED=grouped, HAS_BIAS=bias is not None, X_KIND=X_KIND[x.dtype], WORDS=words,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E) if grouped else 1,
        INTERP=interpreter_active(), num_warps=warps, num_stages=stages,
        DIRECT=words and _decode("mma") == "direct",
    )
    return out


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, force_bytes: bool = False) -> torch.Tensor:
    """W4A16 linear with an NVFP4 weight: x @ W^T + bias with W dequantized in registers (see the module
    docstring); same arguments, result and errors as :func:`nvfp4_linear_ref`. Triton on CUDA and under
    TRITON_INTERPRET=1, the reference on a plain CPU run. No host synchronisation.

    Args:
        x: [M, K] float32 / bfloat16 / float16. weight: uint8 [N, K/2]. weight_scale: float8_e4m3fn
            [N, ceil(K/16)]. weight_scale_2: float32 () or (1,). bias: [N] or None.
        out: optional [M, N] tensor in x's dtype, written in full (tests pass a NaN-filled one).
        force_bytes: read the codes byte by byte even where int32 words would do (tests of that path).

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
    out = output_buffer(out, x, N, name)
    if x.shape[0] == 0:
        return out
    return _launch(x, weight, weight_scale, weight_scale_2, bias, None, out, grouped=False,
                   force_bytes=force_bytes)


# Which kernel runs nvfp4_grouped_mm on the GPU: "triton" (this file's kernels) or "cuda" (the grouped form of
# kernels/quant/pair_gemv.cu through pair_cuda.grouped_mm, in pair_cuda.grouped_form's form: the expert's rows as the
# MMA's N, each weight chunk decoded once for all the rows of a pass). "cuda" runs each call it takes
# (pair_cuda.grouped_unsupported) and leaves the others to Triton. Measured by bench_moe_gemv at Super V3's
# experts (top-22 of 512) on an H100 (docs/kernel_performance.md, "The grouped CUDA kernel's pipelined
# form"): the pipelined form ahead of Triton at every point, 4 to 256 tokens (1.26-1.47x;
# 256 tokens, the batch-64 verify: 1,165.5 against 1,464.8 us). Read at call time.
GROUPED_KERNEL = "cuda"


def nvfp4_grouped_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, offsets: torch.Tensor, *,
                     out: torch.Tensor | None = None, force_bytes: bool = False) -> torch.Tensor:
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
        force_bytes: read the codes byte by byte even where int32 words would do (tests of that path).

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
    out = output_buffer(out, x, N, name)
    if x.shape[0] == 0:
        return out
    w = (weight, weight_scale, weight_scale_2)
    if not force_bytes and pair_cuda.grouped_kernel_for(GROUPED_KERNEL, "nvfp4", x, w, offsets) == "cuda":
        return pair_cuda.grouped_mm("nvfp4", x, w, offsets, out=out, name=name)
    return _launch(x, weight, weight_scale, weight_scale_2, None, offsets, out, grouped=True,
                   force_bytes=force_bytes)


# ---------------------------------------------------------------------------------------------------------
# routed experts at decode sizes: per-pair GEMVs (kernels/quant/moe_gemv.py's scheme)
# ---------------------------------------------------------------------------------------------------------
# Each projection is ``W = e2m1 * weight_scale * weight_scale_2`` times the activation in its own dtype
# (W4A16), summed in float32. The codes are read as int32 words and decoded by :func:`e2m1_word` (two
# elements per 32-bit operation, the 2^14 folded into the final scale; the K step sized as this file's GEMV:
# 4 KB of codes per program and step). Experts: ``(weight uint8 [E, out, in / 2], weight_scale
# float8_e4m3fn [E, out, in / 16], weight_scale_2 float32 [E])`` with in % 8 == 0 (whole int32 words).

NVFP4Experts = tuple  # (weight, weight_scale, weight_scale_2)


def _check_nvfp4(h, weights, indices, up, gate, down, activation, name) -> None:
    """Raise ValueError unless the arguments fit :func:`moe_gemv_nvfp4_ref`'s contract (values not read)."""
    check_pair_inputs(h, weights, indices, activation, name)
    logical = {}
    for kind, t in (("up", up), ("gate", gate), ("down", down)):
        if t is None:
            if kind != "gate":
                raise ValueError(f"{name}: {kind} is required")
            logical[kind] = None
            continue
        w, s, s2 = t
        if w.dtype != torch.uint8 or w.dim() != 3 or s.dtype != FP8_DTYPE or s2.dtype != torch.float32:
            raise ValueError(f"{name}: {kind} must be (uint8 [E, out, in / 2], float8_e4m3fn scales, float32 "
                             f"[E]), got {w.dtype} {tuple(w.shape)}, {s.dtype}, {s2.dtype}")
        E, out, half = w.shape
        if tuple(s.shape) != (E, out, triton.cdiv(2 * half, NVFP4_BLOCK)) or tuple(s2.shape) != (E,):
            raise ValueError(f"{name}: {kind} scales must be [E, out, in / 16] and [E] = "
                             f"{(E, out, triton.cdiv(2 * half, NVFP4_BLOCK))}, ({E},); got "
                             f"{tuple(s.shape)}, {tuple(s2.shape)}")
        logical[kind] = (E, out, 2 * half)
    check_expert_shapes(h.shape[1], logical, name)


def moe_gemv_nvfp4_ref(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: NVFP4Experts,
                       gate: NVFP4Experts | None, down: NVFP4Experts, activation: str) -> torch.Tensor:
    """Reference routed experts with NVFP4 weights, pair by pair (the specification of
    :func:`moe_gemv_nvfp4`): each pair's expert matrices are gathered and dequantized in float32
    (:func:`nvfp4_dequantize`), each projection summed in float32 with the activation in
    its own dtype (W4A16) and rounded to h's dtype; activation, gated product and combine as
    kernels/moe_gemv.py's ``moe_gemv_ref``. Gathers P dequantized matrices: small inputs (or a GPU) only.

    Args:
        h: [N, L] float32 / bfloat16 / float16. weights: [N, k] float32. indices: [N, k] int64 in [0, E).
        up, gate, down: (weight uint8 [E, out, in / 2], weight_scale float8_e4m3fn [E, out, in / 16],
            weight_scale_2 float32 [E]); up / gate logical [E, I, L], down [E, L, I]; gate None when not
            gated. activation: "relu2" or "silu".

    Returns:
        [N, L] in h's dtype. Mutates nothing.

    Raises:
        ValueError: shapes, dtypes or an activation that do not fit.
    """
    _check_nvfp4(h, weights, indices, up, gate, down, activation, "moe_gemv_nvfp4_ref")
    mats = {"up": up, "gate": gate, "down": down}

    def linear(x, kind, expert):
        w, s, s2 = mats[kind]
        wd = nvfp4_dequantize(w[expert], s[expert], s2[expert], torch.float32)  # [P, out, in]
        return torch.einsum("poi,pi->po", wd, x.float())

    return pairs_ref(h, weights, indices, linear, gate is not None, activation)


@triton.jit
def _nvfp4_tile_dot(x_row, w_rows, s_rows, kw, mkw, mask_n, offs_n, KW, DIRECT: tl.constexpr,
                    XVEC: tl.constexpr):
    """sum over one K tile of decoded weight (BLOCK_N rows, the words kw) times the input row x (fp32 sums,
    times 2^-14 as ``e2m1_word`` decodes, or 2^-62 with DIRECT as ``e2m1_word_f32`` then 2^64): [BLOCK_N].
    XVEC False: x loaded in the weight tile's layout (element c of word w at column 8 w + c; one load per
    tile element, L1 hits); True: each column class once as a vector over the tile's words, broadcast over
    its rows (one load per word and class)."""
    m2 = mask_n[:, None] & mkw[None, :]
    wd = tl.load(w_rows + kw[None, :], mask=m2, other=0)
    scw = tl.load(s_rows + (kw // 2)[None, :], mask=m2, other=0.0).to(tl.float32)  # 2 words per 16 columns
    if XVEC:
        # each column class of x once per word, broadcast over the tile's rows; with DIRECT the decode's 2^64
        # is moved onto x (one multiply per x value instead of one per weight): e * 2^-126 times x * 2^64 is
        # the same exact product as e * 2^-62 times x, so each fp32 product and sum rounds the same (x below
        # 2^64 in magnitude, which no activation reaches)
        if DIRECT:
            e0, e1, e2, e3, e4, e5, e6, e7 = e2m1_word_f32(wd)
            xs = DIRECT_F32_SCALE
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = e2m1_word(wd)
            xs = 1.0
        xv = x_row + 8 * kw
        t = e0 * (tl.load(xv, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
        t += e1 * (tl.load(xv + 1, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
        t += e2 * (tl.load(xv + 2, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
        t += e3 * (tl.load(xv + 3, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
        t += e4 * (tl.load(xv + 4, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
        t += e5 * (tl.load(xv + 5, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
        t += e6 * (tl.load(xv + 6, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
        t += e7 * (tl.load(xv + 7, mask=mkw, other=0.0).to(tl.float32) * xs)[None, :]
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = _gemv_word(wd, DIRECT)
        xc = x_row + 8 * kw[None, :] + offs_n[:, None] * 0
        t = e0 * tl.load(xc, mask=m2, other=0.0).to(tl.float32)
        t += e1 * tl.load(xc + 1, mask=m2, other=0.0).to(tl.float32)
        t += e2 * tl.load(xc + 2, mask=m2, other=0.0).to(tl.float32)
        t += e3 * tl.load(xc + 3, mask=m2, other=0.0).to(tl.float32)
        t += e4 * tl.load(xc + 4, mask=m2, other=0.0).to(tl.float32)
        t += e5 * tl.load(xc + 5, mask=m2, other=0.0).to(tl.float32)
        t += e6 * tl.load(xc + 6, mask=m2, other=0.0).to(tl.float32)
        t += e7 * tl.load(xc + 7, mask=m2, other=0.0).to(tl.float32)
    return tl.sum(t * scw, 1)


@triton.jit
def _pair_nvfp4_kernel(
    x_ptr, idx_ptr, w_ptr, s_ptr, g_ptr, w2_ptr, s2_ptr, g2_ptr, out_ptr, out2_ptr,
    NOUT, KW, TOPK, STEPS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_os,
    GATED: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr = False, XVEC: tl.constexpr = False,
):
    """One (pair, output tile, K range) per program, NVFP4 weights: grid (NOUT tiles, pairs, K splits). As
    kernels/moe_gemv.py's ``_pair_gemv_kernel`` (input row p // TOPK, w = gate and w2 = up when GATED), with
    the weights read as int32 words of codes (w_ptr / w2_ptr, KW = K / 8 words per row), their block scales
    (s_ptr / s2_ptr) and global scales (g_ptr / g2_ptr, [E]); stride_we / stride_wn in words."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(idx_ptr + p)
    e64 = expert.to(tl.int64)
    row = p // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NOUT
    n64 = offs_n[:, None].to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + n64 * stride_wn
    s_rows = s_ptr + e64 * stride_se + n64 * stride_sn
    w2_rows = w2_ptr + e64 * stride_we + n64 * stride_wn
    s2_rows = s2_ptr + e64 * stride_se + n64 * stride_sn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs_w = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_lo = pid_k * STEPS * WORDS
    w_hi = tl.minimum(w_lo + STEPS * WORDS, KW)
    for w0 in range(w_lo, w_hi, WORDS):
        kw = w0 + offs_w
        mkw = kw < w_hi
        acc += _nvfp4_tile_dot(x_row, w_rows, s_rows, kw, mkw, mask_n, offs_n, KW, DIRECT, XVEC)
        if GATED:
            acc2 += _nvfp4_tile_dot(x_row, w2_rows, s2_rows, kw, mkw, mask_n, offs_n, KW, DIRECT, XVEC)
    if DIRECT:  # weight_scale_2, and the decode's 2^-126 times 2^64
        fold = DIRECT_F32_FOLD
    else:  # weight_scale_2, and the 2^14 of the decode
        fold = 16384.0
    acc = acc * (tl.load(g_ptr + expert) * fold)
    if GATED:
        acc2 = acc2 * (tl.load(g2_ptr + expert) * fold)
    store_pair_rows(out_ptr, out2_ptr, acc, acc2, p, pid_k, offs_n, mask_n, stride_om, stride_os, GATED, ACT,
                    SPLIT)


def _launch_pair(x, idx, w, w2, out_dtype, topk, act_code):
    """One NVFP4 pair-GEMV launch: x [rows, K]; w, w2: (weight, weight_scale, weight_scale_2) (w2 None
    unless gated). Returns (out, out2, split) as kernels/moe_gemv.py's ``_launch_pair_gemv``."""
    P = idx.numel()
    weight, scale, s2 = w
    NOUT, K = weight.shape[1], 2 * weight.shape[2]
    matrices = 1 if w2 is None else 2
    bn, bk, split, steps = pair_gemv_config(P, NOUT, K, matrices)
    if split == 1:  # PAIR_TILE_WEIGHTS per program and step (over matrices)
        bk = max(GEMV_BLOCK_K, min(PAIR_TILE_WEIGHTS // (bn * matrices), triton.next_power_of_2(K)))
        steps = triton.cdiv(K, bk)
    out, out2 = pair_outputs(P, NOUT, split, w2 is not None, out_dtype, x.device)
    words = weight.view(torch.int32)
    o2 = w2 if w2 is not None else w
    _pair_nvfp4_kernel[(triton.cdiv(NOUT, bn), P, split)](
        x, idx, words, scale, s2, o2[0].view(torch.int32), o2[1], o2[2], out, out2,
        NOUT, K // 8, topk, steps,
        x.stride(0), words.stride(0), words.stride(1), scale.stride(0), scale.stride(1),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        GATED=w2 is not None, ACT=act_code if split == 1 else 0, SPLIT=split > 1,
        BLOCK_N=bn, BLOCK_K=bk, DIRECT=_decode("pair") == "direct", XVEC=_pair_x_load() == "vector",
        **pair_gemv.PAIR_LAUNCH,
    )
    return out, (out2 if w2 is not None else None), split


# Which kernel runs moe_gemv_nvfp4's projections on the GPU: "triton" (_pair_nvfp4_kernel above) or "cuda"
# (kernels/quant/pair_gemv.cu through kernels/quant/pair_cuda.py: the e2m1 decode in the registers of a bf16
# mma.sync, about 3.6 SASS instructions per weight against this kernel's 8.6). "cuda" runs each projection it
# takes (pair_cuda.unsupported: bf16, K % 32 == 0, aligned rows, an nvcc) and leaves the others to Triton.
# Measured on an H100 (docs/kernel_performance.md, "The CUDA per-pair NVFP4 kernel"; bench_moe_gemv at Super
# V3's experts): 1.61-1.97x faster than Triton at 1-8 tokens (49.0 against 78.9 us at one token). Read at call
# time.
PAIR_KERNEL = "cuda"


def pair_kernel_for(x: torch.Tensor, w: NVFP4Experts, w2: NVFP4Experts | None, P: int) -> str:
    """The kernel PAIR_KERNEL gives one projection (x [rows, K], the experts w and, gated, w2, P pairs):
    "cuda" where PAIR_KERNEL asks for it and the CUDA kernel takes the call, else "triton".

    Raises:
        ValueError: PAIR_KERNEL is not one of pair_cuda.KERNELS.
    """
    return pair_cuda.kernel_for(PAIR_KERNEL, "nvfp4", x, w, w2, P)


def _launch_pair_any(x, idx, w, w2, out_dtype, topk, act_code, dependent: bool = False):
    """One projection by the kernel :func:`pair_kernel_for` picks (the ``launch`` of run_pair_launches;
    ``dependent`` reaches the CUDA kernel only)."""
    if pair_kernel_for(x, w, w2, idx.numel()) == "cuda":
        return pair_cuda.launch_pair("nvfp4", x, idx, w, w2, out_dtype, topk, act_code, dependent=dependent)
    return _launch_pair(x, idx, w, w2, out_dtype, topk, act_code)


def nvfp4_words_ok(*experts: NVFP4Experts | None) -> bool:
    """Whether every NVFP4 expert stack's codes read as int32 words (in % 8 == 0, 4-byte aligned): the
    condition of :func:`moe_gemv_nvfp4` (reads only shapes and pointers)."""
    return all(e is None or (e[0].shape[-1] % 4 == 0 and e[0].data_ptr() % 4 == 0) for e in experts)


def moe_gemv_nvfp4(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: NVFP4Experts,
                   gate: NVFP4Experts | None, down: NVFP4Experts, activation: str) -> torch.Tensor:
    """Routed experts with NVFP4 weights (W4A16) as per-pair GEMVs over the chosen experts (kernels/quant/moe_gemv.py):
    same arguments, result and errors as :func:`moe_gemv_nvfp4_ref`, equal to it up to the fp32 summation
    order. Three launches, no host synchronisation, grids from shapes only (CUDA-graph capturable). Triton on
    CUDA and under TRITON_INTERPRET=1 (or, with PAIR_KERNEL "cuda", the CUDA kernel of
    kernels/quant/pair_cuda.py for the projections it takes), the reference on a plain CPU run. Expert ids
    are not range-checked.

    Raises:
        ValueError: as the reference, and codes that are not whole int32 words (:func:`nvfp4_words_ok`).
    """
    name = "moe_gemv_nvfp4"
    _check_nvfp4(h, weights, indices, up, gate, down, activation, name)
    if not use_kernel(h):
        return moe_gemv_nvfp4_ref(h, weights, indices, up, gate, down, activation)
    up, gate, down = contiguous_experts(up), contiguous_experts(gate), contiguous_experts(down)
    if not nvfp4_words_ok(up, gate, down):
        raise ValueError(f"{name}: the experts' input widths must be multiples of 8 (codes read as int32 "
                         "words); use runners.engine.models.moe.moe_experts_grouped for other widths")
    tensors = [t for e in (up, gate, down) if e is not None for t in e]
    check_launchable(h, weights, indices, *tensors, name=name)
    return run_pair_launches(h, weights, indices, up, gate, down, activation, _launch_pair_any,
                             up[0].shape[1])
