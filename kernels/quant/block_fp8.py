"""Block-scaled FP8 (DeepSeek-V3 / Qwen3-Next-FP8 releases, transformers' fine-grained FP8): weights in
128 x 128 blocks with a per-block multiplier, activations quantized at run time per token and 128-column
group; the w8a8 GEMM and grouped GEMM in Triton beside the plain-PyTorch references they are tested against.

Format (``quantization_config``: ``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic
activations): a linear layer's W [N, K] is ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv``
[ceil(N/128), ceil(K/128)] (bfloat16 in Qwen's release, float32 in DeepSeek's; despite the name a multiplier:
W[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]). At run time each activation row is quantized
per 128-column group g: a_scale[m, g] = amax(|x[m, g]|) / 448, qa = x / a_scale rounded to e4m3 (as vLLM's
and SGLang's ``per_token_group_quant_fp8``; amax is floored at 1e-10 so an all-zero group gives zeros). Then

    out[m, n] = sum_g a_scale[m, g] * w_scale[n // 128, g] * sum_{k in g} qa[m, k] * qw[n, k]

accumulated in float32 (the per-group partial products are promoted to float32 and scaled once per group, as
DeepSeek-V3's report prescribes for FP8 GEMMs on Hopper, whose FP8 tensor-core accumulation is narrower than
fp32). A K that is not a multiple of 128 leaves the last group partial; an N likewise the last row block.

Kernels (written from the description of vLLM / SGLang's ``w8a8_block_fp8_matmul`` and their fused-MoE
variant): each program owns an N tile (<= 128, so within one weight row block) and a row tile of x and
computes out^T = W qa^T (the weight is the MMA's wide operand; 16 activation rows suffice at decode). The
activation quantization is fused at decode sizes: per 128-column group the program loads its rows of x,
takes the amax, quantizes in registers and runs one fp8 x fp8 tensor-core product, so decode is a single
launch reading x, W and the scales (this tensor-core path now runs for 9..63 rows per weight matrix). At
decode sizes of <= GEMV_MAX_ROWS = 8 rows per weight matrix (grouped: and <= GROUPED_GEMV_MAX_ROWS
rows in all) x is quantized once by the quantization kernel
(into fp32 e4m3 values) and a CUDA-core GEMV kernel runs (:func:`_block_fp8_gemv_kernel`: weight tiles
converted to fp32 once, each row loaded straight into the tile's register layout, reduced over K per
128-column group; split over K with a partial-sum launch where N tiles alone give too few programs, as for
Qwen3-Next's k / v and o projections). At prefill sizes (row tiles >= 64) x is quantized once by
:func:`quantize_activation_per_token_group` (the same rule as its own kernel) and the GEMM reads qa and its
scales.

- :func:`block_fp8_linear` (dense); :func:`block_fp8_grouped_mm` (routed experts, torch._grouped_mm's
  convention; expert of each row tile found from the offsets on the device: no host synchronisation,
  CUDA-graph capturable, work proportional to the rows present; kernels/quant/_common.py).
- :func:`block_scaled_mm_supported`: whether this torch runs ``torch._scaled_mm`` with DeepSeek-style block
  scales (1 x 128 activations, 128 x 128 weights; cuBLASLt 12.9+, PyTorch PR 158037) on a device, probed once
  per device against the reference; :func:`block_fp8_linear` uses it for prefill-sized inputs where it holds
  and the shapes are whole blocks, the Triton kernel otherwise.
- ``scheme="w8a16"`` (:data:`SCHEMES`) of :func:`block_fp8_linear` / :func:`block_fp8_grouped_mm`: the
  activation kept in its dtype against the fp8 weight (converted in registers, each 128-column group's sum
  scaled by its block scale), the GEMV kernel alone at any row count; where K is split, the last program of
  each output tile sums the splits' partials in order inside the launch (:func:`_serial_split_sum`; the
  bits of the splitk_sum launch). One launch per product instead of three (quantization, GEMV, split sum).
  Not yet the engine's choice: bench_quant_gemm's ``*_w8a16`` rows measure it beside w8a8 and BF16.
- :func:`moe_gemv_block_fp8` (routed experts at decode sizes, kernels/quant/moe_gemv.py's per-pair scheme):
  one program per (token, expert) pair and output tile; reference :func:`moe_gemv_block_fp8_ref`.
Triton on CUDA and under TRITON_INTERPRET=1; a plain CPU run calls the references.

Shapes: M activation rows (dense), P (token, expert) pairs sorted by expert (grouped), E experts, N output
features, K input features, G = ceil(K / 128) groups.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from kernels import moe_gemv as pair_gemv
from kernels._common import check_launchable, interpreter_active
from kernels.moe_gemv import pair_gemv_config, run_pair_launches, store_pair_rows
from kernels.quant import _common as quant_common
from kernels.quant import pair_cuda
from kernels.quant._common import (
    FP8_DTYPE,
    FP8_MAX,
    X_DTYPES,
    block_m_for,
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
    to_e4m3,
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

log = logging.getLogger(__name__)

BLOCK = 128  # weight block edge (weight_block_size [128, 128]) and activation group width
# A grouped (routed-experts) launch takes the GEMV up to this many (token, expert) rows in all, the
# tensor-core kernel above: on the H200 at Qwen3-Next's expert shapes the GEMV leads up to 40 rows and is
# level at 80 (docs/kernel_performance.md, "Quantized formats"). Read at call time (benchmarks lift it).
GROUPED_GEMV_MAX_ROWS = 80
AMAX_EPS = 1e-10  # floor of a group's amax (vLLM / SGLang per_token_group_quant_fp8's eps)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# From this row-tile size on (prefill), activations are quantized by their own kernel first: fused, every N
# tile's program would quantize its rows again (N / BLOCK_N times); at decode tiles (16 rows) the fused
# quantization costs less than a second launch.
PREQUANT_BLOCK_M = 64
IMPLS = ("triton", "scaled_mm")
# What the activations are in the product: "w8a8" quantized per token and 128-column group (the format's
# own rule, vLLM's and SGLang's), "w8a16" kept in their 16- or 32-bit dtype against the dequantized weight
# (the fp8 weight converted in registers, its block scale applied per 128-column group: no quantization
# launch; Marlin's recipe for low-bit weights at decode sizes, where a batch-1 w8a8 GEMM runs slower than
# bf16, vLLM issue #23280). w8a16 runs the GEMV kernel at any row count (up to 8 rows per program).
SCHEMES = ("w8a8", "w8a16")
# Schemes whose K-split GEMV sums its partials inside the launch (:func:`_serial_split_sum`) instead of in a
# second launch (splitk_sum); read at call time, so a benchmark times both.
SERIAL_SPLIT_SCHEMES = ("w8a16",)
SCALED_MM_MIN_ROWS = 64  # impl=None takes torch._scaled_mm (where supported) from this many rows on


# ---------------------------------------------------------------------------------------------------------
# checks and references
# ---------------------------------------------------------------------------------------------------------


def _check_weights(weight: torch.Tensor, weight_scale_inv: torch.Tensor, *, stacked: bool | None,
                   name: str) -> tuple[tuple[int, ...], int, int]:
    """Validate a block-FP8 weight pair; returns (leading dims, N, K).

    Raises:
        ValueError: a dtype, rank, shape or device that does not fit the format.
    """
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: weight must be float8_e4m3fn, got {weight.dtype}")
    want = {True: 3, False: 2}.get(stacked)
    if weight.dim() < 2 or (want is not None and weight.dim() != want):
        shape = {True: "[E, N, K]", False: "[N, K]", None: "[..., N, K]"}[stacked]
        raise ValueError(f"{name}: weight must be {shape}, got shape {tuple(weight.shape)}")
    lead, (N, K) = tuple(weight.shape[:-2]), weight.shape[-2:]
    if weight_scale_inv.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name}: weight_scale_inv dtype must be one of {SCALE_DTYPES}, got "
                         f"{weight_scale_inv.dtype}")
    want_scale = (*lead, triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))
    if tuple(weight_scale_inv.shape) != want_scale:
        raise ValueError(f"{name}: weight_scale_inv must have shape {want_scale} (one scale per {BLOCK} x "
                         f"{BLOCK} block of the weight {tuple(weight.shape)}), got "
                         f"{tuple(weight_scale_inv.shape)}")
    if weight.device != weight_scale_inv.device:
        raise ValueError(f"{name}: weight is on {weight.device}, weight_scale_inv on {weight_scale_inv.device}")
    return lead, N, K



def _expand_blocks(scale: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """[..., ceil(N/128), ceil(K/128)] -> float32 [..., N, K] (each block's scale over its elements)."""
    s = scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return s[..., :N, :K]


def _check_group_input(x: torch.Tensor, group: int, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"{name}: x dtype must be one of {X_DTYPES}, got {x.dtype}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"{name}: group must be a positive int, got {group!r}")


def quantize_activation_per_token_group_ref(x: torch.Tensor, group: int = BLOCK
                                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference dynamic activation quantization per token and ``group`` consecutive columns: scale[m, g] =
    max(amax(|x[m, g*group : (g+1)*group]|), 1e-10) / 448 (IEEE division on every device), qx =
    clamp(x / scale, -448, 448) rounded to float8_e4m3fn (nearest, ties to even), all in float32; the last
    group may be partial.

    Args:
        x: [M, K] float32 / bfloat16 / float16. group: columns per scale (128 for the block-FP8 GEMM).

    Returns:
        (qx float8_e4m3fn [M, K], scale float32 [M, ceil(K / group)]). Mutates nothing.

    Raises:
        ValueError: x not a 2-D float tensor, or a group < 1.
    """
    _check_group_input(x, group, "quantize_activation_per_token_group_ref")
    M, K = x.shape
    G = triton.cdiv(K, group)
    xf = torch.nn.functional.pad(x.float(), (0, G * group - K)).reshape(M, G, group)
    scale = true_divide(xf.abs().amax(dim=-1).clamp(min=AMAX_EPS), FP8_MAX)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(M, G * group)[:, :K].contiguous(), scale


def block_fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize W [..., N, K] to block FP8 (the DeepSeek-V3 / Qwen FP8 release layout): per 128 x 128 block,
    scale = amax(|block|) / 448 (1.0 for an all-zero block), weight = clamp(W / scale, -448, 448) rounded to
    float8_e4m3fn; edge blocks cover what remains of N and K.

    Args:
        w: [..., N, K] float.

    Returns:
        (weight float8_e4m3fn [..., N, K], weight_scale_inv float32 [..., ceil(N/128), ceil(K/128)]: the
        multiplier that dequantizes). Mutates nothing.

    Raises:
        ValueError: w with fewer than 2 dims or not a float tensor.
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"block_fp8_quantize: w must be a float tensor [..., N, K], got {w.dtype} "
                         f"{tuple(w.shape)}")
    lead, (N, K) = tuple(w.shape[:-2]), w.shape[-2:]
    GN, GK = triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK)
    wp = torch.nn.functional.pad(w.float(), (0, GK * BLOCK - K, 0, GN * BLOCK - N))
    blocks = wp.reshape(*lead, GN, BLOCK, GK, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., GN, GK]
    scale = torch.where(amax > 0, true_divide(amax, FP8_MAX), torch.ones_like(amax))
    q = (w.float() / _expand_blocks(scale, N, K)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


# The repacked code word (format "block_fp8_repacked" of kernels/quant/pair_cuda.py, read by pair_gemv.cu's
# BlockFp8Repacked): the same 4 columns of one row per 32-bit little-endian word as the natural layout (byte c
# holds column c), with bit b of column c's e4m3 code (b 0-6 the magnitude, 7 the sign) moved to bit
# REPACK_BITS[c][b]. Column pairs (0, 1) and (2, 3) then decode to bf16x2 of e4m3 * 2^-120 (magnitudes at bits
# 4-10 / 20-26, signs at 15 / 31) as v & 0x87F087F0 and ((v << 4) & 0x00700070) | (rotl(v, 12) & 0x87808780)
# (the .cu's BlockFp8Repacked::pair).
REPACK_BITS = ((4, 5, 6, 7, 8, 9, 10, 15), (20, 21, 22, 23, 24, 25, 26, 31),
               (0, 1, 2, 27, 28, 29, 30, 3), (16, 17, 18, 11, 12, 13, 14, 19))


def repack_codes(weight: torch.Tensor) -> torch.Tensor:
    """Block-FP8 codes (float8_e4m3fn [..., K], K % 4 == 0) -> the repacked layout the CUDA kernels'
    "block_fp8_repacked" format reads (REPACK_BITS: a bit permutation inside each 32-bit word; shapes, word
    addresses and the block scales unchanged): a new float8_e4m3fn tensor whose bytes are no longer e4m3
    values (only that format reads them). Load-time work (kernels/quant/_common.py repack_words). Source of the idea: Marlin's load-time weight
    repacking (Frantar et al., PPoPP 2025); the bit map is this project's.

    Raises:
        ValueError: not float8_e4m3fn, or K not a multiple of 4.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"repack_codes: block-FP8 codes must be float8_e4m3fn, got {weight.dtype}")
    return repack_words(weight.view(torch.uint8), REPACK_BITS, "repack_codes").view(torch.float8_e4m3fn)


def unrepack_codes(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`repack_codes` (float8_e4m3fn in, float8_e4m3fn e4m3 codes out).

    Raises:
        ValueError: not float8_e4m3fn, or K not a multiple of 4.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"unrepack_codes: block-FP8 codes must be float8_e4m3fn, got {weight.dtype}")
    return repack_words(weight.view(torch.uint8), REPACK_BITS, "unrepack_codes",
                        inverse=True).view(torch.float8_e4m3fn)


def block_fp8_dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference dequantization: W[..., n, k] = float(weight[..., n, k]) * weight_scale_inv[..., n // 128,
    k // 128], computed in float32, returned in ``dtype``.

    Args:
        weight: float8_e4m3fn [..., N, K]. weight_scale_inv: float32 / bfloat16 / float16
            [..., ceil(N/128), ceil(K/128)].

    Returns:
        [..., N, K] in ``dtype``. Mutates nothing.

    Raises:
        ValueError: dtypes or shapes that do not fit the format.
    """
    _, N, K = _check_weights(weight, weight_scale_inv, stacked=None, name="block_fp8_dequantize")
    return (weight.float() * _expand_blocks(weight_scale_inv, N, K)).to(dtype)


def _activations(x: torch.Tensor, scheme: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, group scales [M, G] float32) of x under ``scheme``: w8a8 the quantized codes and their
    scales (:func:`quantize_activation_per_token_group_ref`), w8a16 x in float32 and scales of 1. Raises
    ValueError for an unknown scheme."""
    if scheme == "w8a8":
        return quantize_activation_per_token_group_ref(x, BLOCK)
    if scheme == "w8a16":
        return x.float(), torch.ones(x.shape[0], triton.cdiv(x.shape[1], BLOCK), device=x.device)
    raise ValueError(f"{name}: scheme must be one of {SCHEMES}, got {scheme!r}")


def _block_product(qx: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """sum_g xs[:, g] ws[n // 128, g] (qx_g @ qw_g^T) in float32: [M, N]."""
    N, K = weight.shape
    wsn = ws.float().repeat_interleave(BLOCK, dim=0)[:N]  # [N, G]
    y = torch.zeros(qx.shape[0], N, dtype=torch.float32, device=qx.device)
    for g in range(triton.cdiv(K, BLOCK)):
        k = slice(g * BLOCK, min(K, (g + 1) * BLOCK))
        y += (qx[:, k].float() @ weight[:, k].float().T) * xs[:, g, None] * wsn[None, :, g]
    return y


def block_fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                         scheme: str = "w8a8") -> torch.Tensor:
    """Reference block-FP8 linear (the specification): w8a8, x quantized per token and 128-column group
    (:func:`quantize_activation_per_token_group_ref`), then the exact block-scaled product in float32 (module
    docstring) plus bias, result in x's dtype; w8a16 (:data:`SCHEMES`), the same product with x's own values
    in float32 and group scales of 1 (x times the dequantized weight, summed per 128-column group).

    Args:
        x: [M, K] float32 / bfloat16 / float16. weight: float8_e4m3fn [N, K]. weight_scale_inv: float32 /
            bfloat16 / float16 [ceil(N/128), ceil(K/128)]. bias: [N] or None.
        out: optional [M, N] tensor in x's dtype to write the result into.
        scheme: one of :data:`SCHEMES`.

    Returns:
        [M, N] in x's dtype. Mutates only ``out``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit.
    """
    name = "block_fp8_linear_ref"
    _, N, K = _check_weights(weight, weight_scale_inv, stacked=False, name=name)
    check_activation(x, K, name)
    check_bias(bias, N, x.device, name)
    qx, xs = _activations(x, scheme, name)
    y = _block_product(qx, xs, weight, weight_scale_inv)
    if bias is not None:
        y = y + bias.float()
    return copy_into(y.to(x.dtype), out, x, name)


def block_fp8_grouped_mm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                             offsets: torch.Tensor, *, out: torch.Tensor | None = None,
                             scheme: str = "w8a8") -> torch.Tensor:
    """Reference grouped block-FP8 product: rows offsets[e-1] .. offsets[e] - 1 of x through
    :func:`block_fp8_linear_ref` with expert e's weight and the same ``scheme``. Reads the offsets on the host (a synchronisation:
    the specification, not a fast path); rows past offsets[-1] are zero.

    Args:
        x: [P, K] rows sorted by expert. weight: float8_e4m3fn [E, N, K]. weight_scale_inv:
            [E, ceil(N/128), ceil(K/128)]. offsets: int32 [E], cumulative row ends.
        out: optional [P, N] tensor in x's dtype.

    Returns:
        [P, N] in x's dtype. Mutates only ``out``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit.
    """
    name = "block_fp8_grouped_mm_ref"
    (E,), N, K = _check_weights(weight, weight_scale_inv, stacked=True, name=name)
    check_activation(x, K, name)
    check_offsets(offsets, E, x.shape[0], x.device, name)
    qx, xs = _activations(x, scheme, name)
    y = torch.zeros(x.shape[0], N, dtype=torch.float32, device=x.device)
    for e, (s, t) in enumerate(offsets_list(offsets)):
        if t > s:
            y[s:t] = _block_product(qx[s:t], xs[s:t], weight[e], weight_scale_inv[e])
    return copy_into(y.to(x.dtype), out, x, name)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def group_scale_quant(xt, INTERP: tl.constexpr):
    """fp32 [R, C] (one group per row; masked columns 0) -> (q [R, C] e4m3 (fp32 on the grid under the
    interpreter), scale [R] fp32) with the reference's rule; divisions rounded to nearest like torch's."""
    amax = tl.max(tl.abs(xt), 1)
    scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
    q = tl.div_rn(xt, tl.broadcast_to(scale[:, None], xt.shape))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return to_e4m3(q, INTERP), scale


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                        GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                        INTERP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    c = tl.arange(0, BLOCK_G)
    cols = g * GROUP + c
    mask = (rows < M)[:, None] & ((c < GROUP) & (cols < K))[None, :]
    r64 = rows.to(tl.int64)[:, None]
    xt = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = group_scale_quant(xt, INTERP)
    tl.store(q_ptr + r64 * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g, scale, mask=rows < M)


def quantize_activation_per_token_group(x: torch.Tensor, group: int = BLOCK
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization per token and ``group`` columns in Triton; same arguments, result and
    errors as :func:`quantize_activation_per_token_group_ref` (bit-identical: both divide with round to
    nearest and round to e4m3 with ties to even). The reference on a plain CPU run. No host synchronisation.
    """
    name = "quantize_activation_per_token_group"
    _check_group_input(x, group, name)
    if not use_kernel(x):
        return quantize_activation_per_token_group_ref(x, group)
    check_launchable(x, name=name)
    return _quantize_rows(x, group, FP8_DTYPE)


def _quantize_rows(x: torch.Tensor, group: int, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization kernel: (codes [M, K] in ``code_dtype``: float8_e4m3fn, or float32 holding the same
    e4m3 values for the decode GEMV, scales float32 [M, G])."""
    M, K = x.shape
    G = triton.cdiv(K, group)
    q = torch.empty(M, K, dtype=code_dtype, device=x.device)
    s = torch.empty(M, G, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    if x.stride(1) != 1:
        x = x.contiguous()
    block_g = triton.next_power_of_2(group)
    block_r = max(1, min(16, 4096 // block_g))
    _quant_group_kernel[(triton.cdiv(M, block_r), G)](
        x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0),
        GROUP=group, BLOCK_R=block_r, BLOCK_G=block_g, INTERP=interpreter_active(), num_warps=4)
    return q, s


@triton.jit
def _block_fp8_mm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, offsets_ptr,
    M, N, K, E,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_om,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, PREQUANT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, INTERP: tl.constexpr,
):
    GROUP: tl.constexpr = 128
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
        ws_rows = ws_ptr + e64 * stride_se + (offs_n // GROUP) * stride_sn
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        offs_k = tl.arange(0, GROUP)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, GROUP):
            k = k0 + offs_k
            mk = (k < K)[None, :]
            if PREQUANT:  # x holds the quantized activations, xs_ptr their scales [rows, G]
                qx = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mk, other=0.0)
                xs = tl.load(xs_ptr + offs_m.to(tl.int64) * stride_xsm + k0 // GROUP, mask=mask_m, other=0.0)
            else:  # quantize this 128-column group of the rows here (the reference's rule)
                xt = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mk, other=0.0).to(tl.float32)
                qx, xs = group_scale_quant(xt, INTERP)
            w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mk, other=0.0)
            ws = tl.load(ws_rows + (k0 // GROUP) * stride_sk, mask=mask_n, other=0.0).to(tl.float32)
            part = mma(w, tl.trans(qx), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), INTERP)
            acc += part * ws[:, None] * xs[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _fp8_row_part(q_ptr, xs_ptr, row, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16: tl.constexpr,
                  X_VECTOR: tl.constexpr):
    """One activation row's 128-column group dotted with the weight tile: fp32 [BLOCK_N] (0 past row_end).
    w8a8: the row's quantized group (fp32 e4m3 values, by quantize_activation's kernel) times the row's group
    scale; A16 (w8a16): the row's own 16- or 32-bit values, converted to fp32 (no scale). kk: the group's
    column index broadcast over the tile's N rows [BLOCK_N, 128]. How the row is loaded (GEMV_X_LOADS):
    "tile" (X_VECTOR False): through kk, straight into the weight tile's register layout, one load per tile
    element (L1 hits, no layout conversion); "vector": the group's 128 values once, broadcast over the tile's
    rows (Triton lays the load out in the tile's column slice: each thread loads its own columns once)."""
    if X_VECTOR:
        cols = g * 128 + tl.arange(0, 128)
        v = tl.load(q_ptr + row.to(tl.int64) * stride_qm + cols, mask=(cols < K) & ((cols * 0 + row) < row_end),
                    other=0.0)
        q = v.to(tl.float32)[None, :]
    else:
        live = (kk * 0 + row) < row_end
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qm + kk, mask=mk2 & live, other=0.0)
    if A16:
        return tl.sum(w * q.to(tl.float32), 1)
    xs = tl.load(xs_ptr + row.to(tl.int64) * stride_sm + g, mask=tl.where(g < G, row, row_end) < row_end, other=0.0)
    return tl.sum(w * q, 1) * xs


@triton.jit
def _fp8_group(q_ptr, xs_ptr, row0, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, ws, K,
               a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M: tl.constexpr, A16: tl.constexpr, X_VECTOR: tl.constexpr):
    """Accumulators a0..a{BLOCK_M-1} (one per row) plus each row's product with weight group g (w: the
    loaded fp8 tile, 0 where masked; ws [BLOCK_N]: its block scales)."""
    w = w.to(tl.float32)
    a0 += _fp8_row_part(q_ptr, xs_ptr, row0, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
    if BLOCK_M > 1:
        a1 += _fp8_row_part(q_ptr, xs_ptr, row0 + 1, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
    if BLOCK_M > 2:
        a2 += _fp8_row_part(q_ptr, xs_ptr, row0 + 2, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
        a3 += _fp8_row_part(q_ptr, xs_ptr, row0 + 3, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
    if BLOCK_M > 4:
        a4 += _fp8_row_part(q_ptr, xs_ptr, row0 + 4, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
        a5 += _fp8_row_part(q_ptr, xs_ptr, row0 + 5, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
        a6 += _fp8_row_part(q_ptr, xs_ptr, row0 + 6, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
        a7 += _fp8_row_part(q_ptr, xs_ptr, row0 + 7, row_end, stride_qm, stride_sm, G, g, kk, mk2, w, K, A16,
                         X_VECTOR) * ws
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store_row(ptr, row, row_end, stride, offs_n, mask_n, v):
    tl.store(ptr + row.to(tl.int64) * stride + offs_n, v.to(ptr.dtype.element_ty),
             mask=mask_n & ((offs_n * 0 + row) < row_end))


@triton.jit
def _block_fp8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, offsets_ptr, part_ptr, counters_ptr,
    M, N, K, E, STEPS, S,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_om, stride_os,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, UNROLL: tl.constexpr, INTERP: tl.constexpr, A16: tl.constexpr,
    SERIAL: tl.constexpr, X_VECTOR: tl.constexpr,
):
    """Decode GEMV (<= 8 rows per program): grid (N tiles, row tiles, K splits). x_ptr / xs_ptr: the rows
    already quantized (fp32 e4m3 values [rows, K] and their scales [rows, G], quantize_activation's kernel);
    with A16 (w8a16) x_ptr is the activation itself ([rows, K] in its own dtype) and xs_ptr is unused.
    Each program streams its BLOCK_N x 128 weight tiles of K groups [pid_k * STEPS, (pid_k + 1) * STEPS)
    once, converts them to fp32 in registers (e4m3 x e4m3 products are exact in fp32), and for each of its
    rows loads the row's group straight into the weight tile's layout, multiplies and reduces over K on CUDA
    cores (no tensor-core tile padded to 16 rows, no layout conversion, no cross-warp reduction), scaling
    each group's sums once. UNROLL (1, 2, 4) groups' weight tiles are loaded before their arithmetic, so a
    program keeps UNROLL x BLOCK_N x 128 bytes in flight (the loop has no software pipelining otherwise). One
    accumulator per row (a0..a7, unrolled by BLOCK_M). With S > 1 K splits: without SERIAL, out_ptr is the
    fp32 partial-sum buffer [S, rows, N] (stride_os per split) and splitk_sum adds the bias; with SERIAL the
    splits store into part_ptr (the same layout) and the last split of each output tile to arrive sums them
    in split order into out_ptr (:func:`_serial_split_sum`): one launch, the same bits. X_VECTOR: how each
    row is loaded (:func:`_fp8_row_part`)."""
    GROUP: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, row0, row_end = program_tile(offsets_ptr, E, M, pid_m, GROUPED, BLOCK_M, BLOCK_E)
    if expert < E:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        e64 = expert.to(tl.int64)
        w_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        ws_ptrs = ws_ptr + e64 * stride_se + (offs_n // GROUP) * stride_sn
        offs_k = tl.arange(0, GROUP)
        a0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a4 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a5 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a6 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a7 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        g0 = pid_k * STEPS
        g1 = tl.minimum(g0 + STEPS, tl.cdiv(K, GROUP))
        G = tl.cdiv(K, GROUP)
        for g in range(g0, g1, UNROLL):
            # the UNROLL groups' weight tiles are all requested before any arithmetic (loads in flight)
            kk = g * GROUP + offs_k[None, :] + offs_n[:, None] * 0
            mk2 = mask_n[:, None] & (kk < K)
            w = tl.load(w_rows + kk, mask=mk2, other=0.0)
            ws = tl.load(ws_ptrs + g * stride_sk, mask=mask_n, other=0.0).to(tl.float32)
            if UNROLL > 1:
                kk1 = kk + GROUP
                mk1 = mk2 & (kk1 < K) & ((kk1 * 0 + g + 1) < g1)
                w1 = tl.load(w_rows + kk1, mask=mk1, other=0.0)
                ws1 = tl.load(ws_ptrs + (g + 1) * stride_sk, mask=mask_n & ((offs_n * 0 + g + 1) < g1),
                              other=0.0).to(tl.float32)
            if UNROLL > 2:
                kk2 = kk + 2 * GROUP
                mk2b = mk2 & (kk2 < K) & ((kk2 * 0 + g + 2) < g1)
                w2 = tl.load(w_rows + kk2, mask=mk2b, other=0.0)
                ws2 = tl.load(ws_ptrs + (g + 2) * stride_sk, mask=mask_n & ((offs_n * 0 + g + 2) < g1),
                              other=0.0).to(tl.float32)
                kk3 = kk + 3 * GROUP
                mk3 = mk2 & (kk3 < K) & ((kk3 * 0 + g + 3) < g1)
                w3 = tl.load(w_rows + kk3, mask=mk3, other=0.0)
                ws3 = tl.load(ws_ptrs + (g + 3) * stride_sk, mask=mask_n & ((offs_n * 0 + g + 3) < g1),
                              other=0.0).to(tl.float32)
            a0, a1, a2, a3, a4, a5, a6, a7 = _fp8_group(x_ptr, xs_ptr, row0, row_end, stride_xm, stride_xsm, G, g,
                                                        kk, mk2, w, ws, K, a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, A16,
                                                        X_VECTOR)
            if UNROLL > 1:
                a0, a1, a2, a3, a4, a5, a6, a7 = _fp8_group(x_ptr, xs_ptr, row0, row_end, stride_xm, stride_xsm,
                                                            G, g + 1, kk1, mk1, w1, ws1, K,
                                                            a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, A16, X_VECTOR)
            if UNROLL > 2:
                a0, a1, a2, a3, a4, a5, a6, a7 = _fp8_group(x_ptr, xs_ptr, row0, row_end, stride_xm, stride_xsm,
                                                            G, g + 2, kk2, mk2b, w2, ws2, K,
                                                            a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, A16, X_VECTOR)
                a0, a1, a2, a3, a4, a5, a6, a7 = _fp8_group(x_ptr, xs_ptr, row0, row_end, stride_xm, stride_xsm,
                                                            G, g + 3, kk3, mk3, w3, ws3, K,
                                                            a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, A16, X_VECTOR)
        if HAS_BIAS and not SERIAL:  # (SERIAL: the last split adds it to the sum)
            b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            a0 += b
            a1 += b
            a2 += b
            a3 += b
            a4 += b
            a5 += b
            a6 += b
            a7 += b
        if SERIAL:
            o = part_ptr + pid_k.to(tl.int64) * stride_os
        else:
            o = out_ptr + pid_k.to(tl.int64) * stride_os
        _store_row(o, row0, row_end, stride_om, offs_n, mask_n, a0)
        if BLOCK_M > 1:
            _store_row(o, row0 + 1, row_end, stride_om, offs_n, mask_n, a1)
        if BLOCK_M > 2:
            _store_row(o, row0 + 2, row_end, stride_om, offs_n, mask_n, a2)
            _store_row(o, row0 + 3, row_end, stride_om, offs_n, mask_n, a3)
        if BLOCK_M > 4:
            _store_row(o, row0 + 4, row_end, stride_om, offs_n, mask_n, a4)
            _store_row(o, row0 + 5, row_end, stride_om, offs_n, mask_n, a5)
            _store_row(o, row0 + 6, row_end, stride_om, offs_n, mask_n, a6)
            _store_row(o, row0 + 7, row_end, stride_om, offs_n, mask_n, a7)
        if SERIAL:
            _serial_split_sum(part_ptr, out_ptr, b_ptr, counters_ptr + pid_m * tl.num_programs(0) + pid_n, S,
                              row0, row_end, offs_n, mask_n, stride_os, stride_om, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _serial_split_sum(part_ptr, out_ptr, b_ptr, counter_ptr, S, row0, row_end, offs_n, mask_n, stride_ps,
                      stride_m, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K's reduction inside the GEMV launch (CUTLASS's "serial" split-K, with a counter instead of its
    turn-taking lock): each of the S programs of an output tile has stored its fp32 partial sums [BLOCK_M
    rows, BLOCK_N] into part_ptr (split s at s * stride_ps, row stride stride_m, as splitk_sum's buffer) and
    then counts itself in at ``counter_ptr`` (int32, 0 before the launch); the program that counts last
    sums the S partials in split order 0..S-1 from fp32 zero (splitk_sum's order: the same bits, whichever
    program arrives last), adds the bias, stores the rows into out_ptr (row stride stride_m) and sets the
    counter back to 0 for the next launch or graph replay. The barrier before the count makes the program's
    stores precede it; the count's acquire-release semantics at GPU scope make every earlier program's
    stores visible to the last one, whose loads bypass L1 (.cg)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        rows = row0 + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & mask_n[None, :]
        offs = rows.to(tl.int64)[:, None] * stride_m + offs_n[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(S):
            acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


# How the GEMV kernel loads an activation row's 128-column group (_fp8_row_part), per path: "tile" (one load
# per weight tile element, in the tile's layout) or "vector" (the group once, broadcast over the tile's rows).
# Measured by bench_quant_gemm on an H100 (w8a16, 1-8 rows; docs/kernel_performance.md): grouped, "vector" was
# 1.15-1.46x faster at all 8 points (Qwen3-Next up / down); dense, "tile" was level at 1 row and 1.2-1.4x
# faster at 2 and 4 rows in 3 of the 4 shapes (mixed at 8), so each path keeps its faster load.
GEMV_X_LOADS = ("tile", "vector")
GEMV_X_LOAD = {"dense": "tile", "grouped": "vector"}

# Split-K counters of the serial reduction, per device: int32 zeros, each back at 0 when a launch ends.
# Allocated once, outside any CUDA-graph capture where possible (the first launch is an eager warm-up); a
# launch needing more tiles than this holds takes the two-launch split (splitk_sum) instead of allocating.
SERIAL_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed split-K counters (``SERIAL_COUNTERS`` int32), or None when ``tiles`` exceed them or
    they do not exist yet and a CUDA graph is being captured (allocated there, their zero fill would run only
    at the first replay): the caller then takes the two-launch split."""
    if tiles > SERIAL_COUNTERS:
        return None
    if device not in _COUNTERS and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(SERIAL_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _launch_gemv(x, weight, ws, bias, offsets, out, *, grouped: bool, a16: bool = False, serial: bool = False):
    """The GEMV kernel, split over K where the N tiles alone give too few programs (gemv_config). w8a8
    (``a16`` False): x quantized once by the quantization kernel (into fp32 e4m3 values: the GEMV loads them
    in the weight tile's layout without conversions), then the GEMV. w8a16 (``a16``): the GEMV reads x as it
    is, no quantization launch. A K split's partial sums are added by the splitk_sum launch, or with
    ``serial`` inside the GEMV launch (:func:`_serial_split_sum`; where ``out`` is row-contiguous and the
    device's counters cover the tiles, else the splitk_sum launch): the same bits either way."""
    N = weight.shape[-2]
    rows, K = x.shape
    E = weight.shape[0] if grouped else 1
    matrices = min(E, rows) if grouped else 1
    bm, bn, split, steps = gemv_config(rows / matrices, N, matrices, triton.cdiv(K, BLOCK))
    row_tiles = grouped_row_tiles(rows, E, bm) if grouped else triton.cdiv(rows, bm)
    if a16:
        qx, xs = (x if x.stride(1) == 1 else x.contiguous()), ws
    else:
        qx, xs = _quantize_rows(x, BLOCK, torch.float32)
    weight = weight.contiguous()
    grid = (triton.cdiv(N, bn), row_tiles, split)
    counters = _split_counters(x.device, grid[0] * grid[1]) if serial and split > 1 and out.stride(0) == N \
        else None
    part = None if split == 1 else torch.empty(split, rows, N, dtype=torch.float32, device=x.device)
    dst = out if split == 1 or counters is not None else part
    unroll = min(4, 64 // bn, steps)  # 8 KB of weight requested per program and loop iteration
    unroll = 4 if unroll >= 4 else 2 if unroll >= 2 else 1
    _block_fp8_gemv_kernel[grid](
        qx, xs, weight, ws, bias if bias is not None else x, dst, offsets if offsets is not None else ws,
        part if part is not None else dst, counters if counters is not None else ws,
        rows, N, K, E, steps, split,
        qx.stride(0), xs.stride(0), weight.stride(0) if grouped else 0, weight.stride(-2),
        ws.stride(0) if grouped else 0, ws.stride(-2), ws.stride(-1), dst.stride(-2),
        part.stride(0) if part is not None else 0,
        GROUPED=grouped, HAS_BIAS=bias is not None and (split == 1 or counters is not None), BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_E=triton.next_power_of_2(E) if grouped else 1, UNROLL=unroll,
        INTERP=interpreter_active(), A16=a16, SERIAL=counters is not None, X_VECTOR=GEMV_X_LOAD["grouped" if grouped else "dense"] == "vector",
        num_warps=4, num_stages=1,
    )
    if split > 1 and counters is None:
        splitk_sum(part, bias, out, offsets)
    return out


def _launch(x, weight, ws, bias, offsets, out, *, grouped: bool, scheme: str = "w8a8"):
    N = weight.shape[-2]
    rows, K = x.shape
    E = weight.shape[0] if grouped else 1
    serial = scheme in SERIAL_SPLIT_SCHEMES
    if scheme == "w8a16":  # the GEMV, or from W8A16_DOT_MIN_ROWS rows per matrix the w8a16 tensor-core kernel
        if use_w8a16_dot(x, rows / min(E, rows) if grouped else rows, grouped=grouped):
            return _launch_w8a16_dot(x, weight, ws, bias, offsets, out, grouped=grouped, serial=serial)
        return _launch_gemv(x, weight, ws, bias, offsets, out, grouped=grouped, a16=True, serial=serial)
    if (use_gemv(rows / min(E, rows), grouped_rows=rows, grouped_max_rows=GROUPED_GEMV_MAX_ROWS) if grouped
            else use_gemv(rows)):
        return _launch_gemv(x, weight, ws, bias, offsets, out, grouped=grouped, serial=serial)
    if grouped:
        bm, bn, warps = tile_config(rows / E, N, min(E, rows), accumulators=2)
        row_tiles = grouped_row_tiles(rows, E, bm)
    else:
        bm, bn, warps = tile_config(rows, N, triton.cdiv(rows, 16), accumulators=2)
        row_tiles = triton.cdiv(rows, bm)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    # Prefill-sized tiles: quantize x once (one pass over x) instead of once per N tile in every program.
    prequant = bm >= PREQUANT_BLOCK_M
    xs = x
    if prequant:
        x, xs = quantize_activation_per_token_group(x, BLOCK)
    _block_fp8_mm_kernel[(triton.cdiv(N, bn), row_tiles)](
        x, xs, weight, ws, bias if bias is not None else x, out, offsets if offsets is not None else ws,
        rows, N, K, E,
        x.stride(0), xs.stride(0), weight.stride(0) if grouped else 0, weight.stride(-2),
        ws.stride(0) if grouped else 0, ws.stride(-2), ws.stride(-1), out.stride(0),
        GROUPED=grouped, HAS_BIAS=bias is not None, PREQUANT=prequant, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_E=triton.next_power_of_2(E) if grouped else 1, INTERP=interpreter_active(),
        num_warps=warps, num_stages=3,
    )
    return out


# ---------------------------------------------------------------------------------------------------------
# w8a16 on tensor cores: split-K over 128-column groups, rows padded to a 16-row MMA tile
# ---------------------------------------------------------------------------------------------------------

# From how many rows per weight matrix the w8a16 product runs the tensor-core kernel
# (:func:`_block_fp8_w8a16_dot_kernel`) instead of the GEMV, per path; None: never (the GEMV at every row
# count). The GEMV's time grows linearly in the rows (each row is its own pass over the weight tile in
# registers: docs/kernel_performance.md), a tensor-core tile pays for 16 rows at once. Measured by
# bench_quant_gemm's `*_w8a16_dot` rows at Qwen3-Next's block-FP8 shapes (H100; docs/kernel_performance.md,
# "the w8a16 tensor-core kernel"): dense, the kernel is flat from 1 to 16 rows and leads at every shape from
# 4 rows on; at 1-2 rows it leads at the wide outputs (q_gate, gdn_qkvz) and trails by up to 11 % at the
# narrow ones (kv, o), ahead in the sum over the four, so dense takes it at every row count. Grouped (the
# routed experts, about one row per expert at decode) it trails the GEMV from 2 to 16 tokens and leads only
# at 64, where rows per expert barely move: it stays off there. Read at call time.
W8A16_DOT_MIN_ROWS: dict[str, int | None] = {"dense": 1, "grouped": None}
W8A16_DOT_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit tensor-core operands (float32 x: the GEMV)


@triton.jit
def _block_fp8_w8a16_dot_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, offsets_ptr, part_ptr, counters_ptr,
    M, N, K, E, STEPS, S,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_om, stride_os,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, INTERP: tl.constexpr, SERIAL: tl.constexpr,
):
    """w8a16 block-FP8 product on tensor cores, grid (N tiles, row tiles, K splits): out^T = W x^T per tile,
    the weight tile [BLOCK_N, 128] converted from e4m3 to x's 16-bit dtype in registers (exact: e4m3 values
    are bf16 / fp16 values) against the activation tile x^T [128, BLOCK_M] as it is (rows past row_end
    masked to 0, so BLOCK_M = 16 serves 1-16 rows), one MMA per 128-column group into an fp32 tile that is
    scaled by the group's block scale (a scalar: BLOCK_N divides 128, so a tile lies in one scale block)
    and summed in group order. Program k covers groups [k * STEPS, (k + 1) * STEPS). With S > 1: without
    SERIAL out_ptr is the fp32 partial-sum buffer [S, rows, N] (splitk_sum adds the bias); with SERIAL the
    splits store into part_ptr and the last to arrive sums them in split order (:func:`_serial_split_sum`,
    the same bits). The products are exact in fp32 (16-bit x 16-bit): only the summation order differs from
    the reference and from the GEMV."""
    GROUP: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, row0, row_end = program_tile(offsets_ptr, E, M, pid_m, GROUPED, BLOCK_M, BLOCK_E)
    if expert < E:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = row0 + tl.arange(0, BLOCK_M)
        mask_m = rows < row_end
        offs_k = tl.arange(0, GROUP)
        e64 = expert.to(tl.int64)
        w_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        x_cols = x_ptr + rows[None, :].to(tl.int64) * stride_xm
        s_ptr = ws_ptr + e64 * stride_se + ((pid_n * BLOCK_N) // GROUP) * stride_sn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        g0 = pid_k * STEPS
        g1 = tl.minimum(g0 + STEPS, tl.cdiv(K, GROUP))
        for g in range(g0, g1):
            kk = g * GROUP + offs_k
            mk = kk < K
            w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mk[None, :], other=0.0)
            xt = tl.load(x_cols + kk[:, None], mask=mk[:, None] & mask_m[None, :], other=0.0)
            if INTERP:
                part = mma(w.to(tl.float32), xt, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), INTERP)
            else:
                part = mma(w.to(xt.dtype), xt, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), INTERP)
            acc += part * tl.load(s_ptr + g * stride_sk).to(tl.float32)
        if HAS_BIAS and not SERIAL:  # (SERIAL: the last split adds it to the sum)
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        o = (part_ptr if SERIAL else out_ptr) + pid_k.to(tl.int64) * stride_os
        tl.store(o + rows[None, :].to(tl.int64) * stride_om + offs_n[:, None], acc.to(o.dtype.element_ty),
                 mask=mask_n[:, None] & mask_m[None, :])
        if SERIAL:
            _serial_split_sum(part_ptr, out_ptr, b_ptr, counters_ptr + pid_m * tl.num_programs(0) + pid_n, S,
                              row0, row_end, offs_n, mask_n, stride_os, stride_om, HAS_BIAS, BLOCK_M, BLOCK_N)


def w8a16_dot_config(rows: int, E: int, N: int, k_steps: int, *, grouped: bool
                     ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, row tiles, split, k_steps_per_split) of a w8a16 tensor-core launch over ``rows``
    rows (of E experts when ``grouped``), N output features and ``k_steps`` 128-column groups: BLOCK_M the
    smallest MMA tile (16) up to 64 rows per weight matrix, BLOCK_N 64 (it divides the 128-wide scale
    block), and K split so that the launch has about ``GEMV_TARGET_PROGRAMS`` programs (every SM streams
    weights: at decode sizes the N tiles alone are too few)."""
    matrices = min(E, rows) if grouped else 1
    bm = min(64, block_m_for(rows / max(1, matrices)))
    bn = 64
    row_tiles = grouped_row_tiles(rows, E, bm) if grouped else triton.cdiv(rows, bm)
    programs = triton.cdiv(N, bn) * row_tiles
    split = max(1, min(k_steps, triton.cdiv(quant_common.GEMV_TARGET_PROGRAMS, programs)))
    per = triton.cdiv(k_steps, split)
    return bm, bn, row_tiles, triton.cdiv(k_steps, per), per


def use_w8a16_dot(x: torch.Tensor, rows_per_matrix: float, *, grouped: bool) -> bool:
    """Whether a w8a16 product of ``x`` runs the tensor-core kernel: a 16-bit x and at least
    ``W8A16_DOT_MIN_ROWS`` rows per weight matrix on its path (None there: never)."""
    threshold = W8A16_DOT_MIN_ROWS["grouped" if grouped else "dense"]
    return threshold is not None and x.dtype in W8A16_DOT_DTYPES and rows_per_matrix >= threshold


def _launch_w8a16_dot(x, weight, ws, bias, offsets, out, *, grouped: bool, serial: bool = True):
    """The w8a16 tensor-core kernel over x [rows, K] (16-bit), its K split summed inside the launch (where
    ``serial``, ``out`` is row-contiguous and the device's counters cover the tiles) or by splitk_sum."""
    N = weight.shape[-2]
    rows, K = x.shape
    E = weight.shape[0] if grouped else 1
    bm, bn, row_tiles, split, steps = w8a16_dot_config(rows, E, N, triton.cdiv(K, BLOCK), grouped=grouped)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    grid = (triton.cdiv(N, bn), row_tiles, split)
    counters = _split_counters(x.device, grid[0] * grid[1]) if serial and split > 1 and out.stride(0) == N \
        else None
    part = None if split == 1 else torch.empty(split, rows, N, dtype=torch.float32, device=x.device)
    dst = out if split == 1 or counters is not None else part
    _block_fp8_w8a16_dot_kernel[grid](
        x, weight, ws, bias if bias is not None else x, dst, offsets if offsets is not None else ws,
        part if part is not None else dst, counters if counters is not None else ws,
        rows, N, K, E, steps, split,
        x.stride(0), weight.stride(0) if grouped else 0, weight.stride(-2),
        ws.stride(0) if grouped else 0, ws.stride(-2), ws.stride(-1), dst.stride(-2),
        part.stride(0) if part is not None else 0,
        GROUPED=grouped, HAS_BIAS=bias is not None and (split == 1 or counters is not None), BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_E=triton.next_power_of_2(E) if grouped else 1, INTERP=interpreter_active(),
        SERIAL=counters is not None, num_warps=4, num_stages=3,
    )
    if split > 1 and counters is None:
        splitk_sum(part, bias, out, offsets)
    return out


# ---------------------------------------------------------------------------------------------------------
# torch._scaled_mm with block scales (probe)
# ---------------------------------------------------------------------------------------------------------

_PROBED: dict[str, bool] = {}


def _scaled_mm_block(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """block_fp8_linear through torch._scaled_mm (cuBLASLt, DeepSeek recipe: 1 x 128 activation scales,
    128 x 128 weight scales); N and K multiples of 128. The scale layouts are those of PyTorch's
    test_scaled_mm_block_wise_numerics: activation scales [M, K/128] M-major (stride (1, M)); weight scales
    [N/128, K/128] with the K side padded to a multiple of 4, passed transposed ([L4, N/128], stride (1, L4)).
    Both are dequantizing multipliers, as ours. The M side is padded to a multiple of 4 (cuBLASLt's
    alignment, as vLLM's block-wise _scaled_mm kernel does)."""
    M = x.shape[0]
    qx, xs = quantize_activation_per_token_group(x, BLOCK)
    Mp = -(-M // 4) * 4
    if Mp != M:
        qx = torch.nn.functional.pad(qx.view(torch.uint8), (0, 0, 0, Mp - M)).view(FP8_DTYPE)
        xs = torch.nn.functional.pad(xs, (0, 0, 0, Mp - M), value=1.0)
    gk = weight_scale_inv.shape[1]
    ws = weight_scale_inv.float()
    if gk % 4:
        ws = torch.nn.functional.pad(ws, (0, -(-gk // 4) * 4 - gk), value=1.0)
    y = torch._scaled_mm(qx, weight.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(),
                         out_dtype=x.dtype)[:M]
    return y if bias is None else y + bias


def block_scaled_mm_supported(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs DeepSeek-style block-scaled FP8 (1 x 128 activation groups, 128 x 128
    weight blocks) on ``device`` and agrees with :func:`block_fp8_linear_ref`: a CUDA device of compute
    capability 9.x (the recipe PyTorch implements for sm_90 through cuBLASLt 12.9+) on which a 64 x 256 x 384
    probe product runs and matches the reference within bf16 rounding. Probed once per device (the probe
    synchronises; call it at load time, not inside a captured region). False on the CPU and on any error
    (logged)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    key = str(dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()))
    if key in _PROBED:
        return _PROBED[key]
    ok = False
    try:
        if torch.cuda.get_device_capability(dev)[0] == 9 and hasattr(torch, "_scaled_mm"):
            gen = torch.Generator(device=dev).manual_seed(0)
            w, ws = block_fp8_quantize(torch.randn(256, 384, device=dev, generator=gen))
            x = torch.randn(6, 384, device=dev, generator=gen).to(torch.bfloat16)
            got = _scaled_mm_block(x, w, ws, None).float()
            want = block_fp8_linear_ref(x, w, ws).float()
            ok = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))
            if not ok:
                log.warning("block_scaled_mm_supported(%s): torch._scaled_mm ran but disagrees with the "
                            "reference (max error %.3g); using the Triton kernel", key,
                            float((got - want).abs().max()))
    except Exception as e:  # noqa: BLE001  (any failure of the probe means: not supported here)
        log.info("block_scaled_mm_supported(%s): torch._scaled_mm with block scales is not available (%s: %s); "
                 "using the Triton kernel", key, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    _PROBED[key] = ok
    return ok


# ---------------------------------------------------------------------------------------------------------
# public launchers
# ---------------------------------------------------------------------------------------------------------


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                     impl: str | None = None, scheme: str = "w8a8") -> torch.Tensor:
    """Block-FP8 linear: same arguments, result and errors as :func:`block_fp8_linear_ref` (``scheme``:
    w8a8 or w8a16, :data:`SCHEMES`). w8a16 runs the GEMV kernel alone (one launch: no quantization, the K
    split summed inside it) at any row count, and takes impl None or "triton".

    ``impl``: "triton" (<= 8 rows: the quantization kernel and the GEMV kernel, plus a partial-sum launch
    where K is split; 9..63 rows: one launch with the quantization fused; more: quantization then GEMM),
    "scaled_mm"
    (quantization kernel then ``torch._scaled_mm`` with block scales; CUDA, N and K multiples of 128, and the
    torch / device must pass :func:`block_scaled_mm_supported`), or None: "scaled_mm" for M >= 64 rows
    (prefill, cuBLASLt's large tiles) where :func:`block_scaled_mm_supported` holds and the shapes are whole
    blocks, else "triton" (decode: fewer launches than the quantization, padding and cuBLASLt ones;
    bench_quant_gemm measures both). ``impl='scaled_mm'`` where it cannot run raises, also on a plain CPU
    run. A plain CPU run (no interpreter) calls the reference. No host
    synchronisation after the one-time probe (which the first CUDA call with M >= 64 runs: warm up before
    capturing a graph).

    Args:
        x: [M, K] float32 / bfloat16 / float16. weight: float8_e4m3fn [N, K]. weight_scale_inv: float32 /
            bfloat16 / float16 [ceil(N/128), ceil(K/128)]. bias: [N] or None.
        out: optional [M, N] tensor in x's dtype, written in full (tests pass a NaN-filled one).

    Returns:
        [M, N] in x's dtype. Mutates only ``out``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit, an unknown impl, or "scaled_mm" where it cannot
            run.
    """
    name = "block_fp8_linear"
    _, N, K = _check_weights(weight, weight_scale_inv, stacked=False, name=name)
    check_activation(x, K, name)
    check_bias(bias, N, x.device, name)
    if impl not in (None, *IMPLS):
        raise ValueError(f"{name}: impl must be one of {IMPLS} or None, got {impl!r}")
    if scheme not in SCHEMES:
        raise ValueError(f"{name}: scheme must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "w8a16" and impl == "scaled_mm":
        raise ValueError(f"{name}: impl='scaled_mm' multiplies quantized activations (w8a8); scheme='w8a16' "
                         "runs the Triton GEMV: use impl=None or 'triton'")
    aligned = N % BLOCK == 0 and K % BLOCK == 0
    if impl == "scaled_mm" and not (aligned and block_scaled_mm_supported(x.device)):
        raise ValueError(f"{name}: impl='scaled_mm' needs N and K multiples of {BLOCK} (got N={N}, K={K}) and "
                         f"a device where block_scaled_mm_supported() holds ({x.device}); use impl='triton'")
    if not use_kernel(x):
        return block_fp8_linear_ref(x, weight, weight_scale_inv, bias, out=out, scheme=scheme)
    check_launchable(x, weight, weight_scale_inv, name=name)
    if scheme == "w8a16":
        impl = "triton"
    if impl is None:
        prefill = x.shape[0] >= SCALED_MM_MIN_ROWS
        impl = "scaled_mm" if prefill and aligned and x.is_cuda and block_scaled_mm_supported(x.device) \
            else "triton"
    if impl == "scaled_mm" and x.shape[0] > 0:
        return copy_into(_scaled_mm_block(x, weight, weight_scale_inv, bias), out, x, name)
    out = output_buffer(out, x, N, name)
    if x.shape[0] == 0:
        return out
    return _launch(x, weight, weight_scale_inv, bias, None, out, grouped=False, scheme=scheme)


# Which kernel runs block_fp8_grouped_mm's w8a16 scheme on the GPU: "triton" (this file's GEMV, one pass over
# the weight tile per row) or "cuda" (the grouped form of kernels/quant/pair_gemv.cu, as nvfp4.GROUPED_KERNEL:
# each expert's rows as the MMA's N), the latter from GROUPED_CUDA_MIN_ROWS_PER_EXPERT rows per expert on
# average (P / E). w8a8 stays Triton. Measured by bench_moe_gemv at Qwen3-Next's experts (top-10 of 512) on
# an H100 (docs/kernel_performance.md, "The CUDA kernels at the release shapes"): the Triton GEMV led up to
# 96 tokens (1.875 rows per expert: 713 us against 792), the CUDA form from 128 (2.5 rows: 855 against
# 1,229) on, 3.3x at 256 (5 rows, the batch-64 verify: 969 against 3,242). Read at call time.
GROUPED_KERNEL = "cuda"
GROUPED_CUDA_MIN_ROWS_PER_EXPERT = 2.5


def grouped_kernel_for(x: torch.Tensor, w: BlockFP8Experts, offsets: torch.Tensor) -> str:
    """The kernel GROUPED_KERNEL gives one w8a16 grouped product (x [P, K] rows sorted by expert, the experts w,
    int32 offsets [E]): "cuda" where GROUPED_KERNEL asks for it, P >= GROUPED_CUDA_MIN_ROWS_PER_EXPERT * E and
    the CUDA kernel takes the call (pair_cuda.grouped_unsupported), else "triton". Reads shapes only (no host
    synchronisation).

    Raises:
        ValueError: GROUPED_KERNEL is not one of pair_cuda.KERNELS.
    """
    pair_cuda.check_setting(GROUPED_KERNEL, "block_fp8", "GROUPED_KERNEL")
    if x.shape[0] < GROUPED_CUDA_MIN_ROWS_PER_EXPERT * offsets.numel():
        return "triton"
    return pair_cuda.grouped_kernel_for(GROUPED_KERNEL, "block_fp8", x, w, offsets)


def block_fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         offsets: torch.Tensor, *, out: torch.Tensor | None = None,
                         scheme: str = "w8a8") -> torch.Tensor:
    """Grouped block-FP8 product for routed experts (torch._grouped_mm's convention), w8a8 with the
    activations quantized per token and 128-column group on the device, or w8a16 (the GEMV kernel alone, at
    any row count); same arguments and result as :func:`block_fp8_grouped_mm_ref` except that rows past
    offsets[-1] are left unwritten. No host synchronisation, shapes fixed by the inputs (CUDA-graph
    capturable); experts without rows cost only their entry in each program's offsets scan. Triton on CUDA
    and under TRITON_INTERPRET=1, the reference on a plain CPU run.

    Args:
        x: [P, K] rows sorted by expert. weight: float8_e4m3fn [E, N, K]. weight_scale_inv:
            [E, ceil(N/128), ceil(K/128)]. offsets: int32 [E], non-decreasing cumulative row ends,
            offsets[-1] = P (not checked: reading it would synchronise).
        out: optional [P, N] tensor in x's dtype.

    Returns:
        [P, N] in x's dtype. Mutates only ``out``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit.
    """
    name = "block_fp8_grouped_mm"
    (E,), N, K = _check_weights(weight, weight_scale_inv, stacked=True, name=name)
    check_activation(x, K, name)
    check_offsets(offsets, E, x.shape[0], x.device, name)
    if scheme not in SCHEMES:
        raise ValueError(f"{name}: scheme must be one of {SCHEMES}, got {scheme!r}")
    if not use_kernel(x):
        return block_fp8_grouped_mm_ref(x, weight, weight_scale_inv, offsets, out=out, scheme=scheme)
    check_launchable(x, weight, weight_scale_inv, offsets, name=name)
    out = output_buffer(out, x, N, name)
    if x.shape[0] == 0:
        return out
    w = (weight, weight_scale_inv)
    if scheme == "w8a16" and grouped_kernel_for(x, w, offsets) == "cuda":
        return pair_cuda.grouped_mm("block_fp8", x, w, offsets, out=out, name=name)
    return _launch(x, weight, weight_scale_inv, None, offsets, out, grouped=True, scheme=scheme)


# ---------------------------------------------------------------------------------------------------------
# routed experts at decode sizes: per-pair GEMVs (kernels/quant/moe_gemv.py's scheme)
# ---------------------------------------------------------------------------------------------------------
# Each projection quantizes its input row per 128-column group with this file's rule (scale = max(amax,
# 1e-10) / 448, codes rounded to e4m3), multiplies each group's fp32 product by the row's group scale and the
# weight's 128 x 128 block ``weight_scale_inv``, and sums the groups in float32. The kernel quantizes each
# group in the program that needs it (:func:`group_scale_quant`: 128 values, recomputed per output tile,
# instead of a separate launch). Experts: ``(weight float8_e4m3fn [E, out, in], weight_scale_inv float32
# [E, ceil(out / 128), ceil(in / 128)])``.

BlockFP8Experts = tuple  # (weight, weight_scale_inv)


def _check_block_fp8(h, weights, indices, up, gate, down, activation, name) -> None:
    """Raise ValueError unless the arguments fit :func:`moe_gemv_block_fp8_ref`'s contract."""
    check_pair_inputs(h, weights, indices, activation, name)
    logical = {}
    for kind, t in (("up", up), ("gate", gate), ("down", down)):
        if t is None:
            if kind != "gate":
                raise ValueError(f"{name}: {kind} is required")
            logical[kind] = None
            continue
        w, ws = t
        if w.dtype != FP8_DTYPE or w.dim() != 3:
            raise ValueError(f"{name}: {kind} must be float8_e4m3fn [E, out, in], got {w.dtype} "
                             f"{tuple(w.shape)}")
        E, out, inp = w.shape
        want = (E, triton.cdiv(out, BLOCK), triton.cdiv(inp, BLOCK))
        if tuple(ws.shape) != want or ws.dtype != torch.float32:
            raise ValueError(f"{name}: {kind} weight_scale_inv must be float32 {want}, got {ws.dtype} "
                             f"{tuple(ws.shape)}")
        logical[kind] = (E, out, inp)
    check_expert_shapes(h.shape[1], logical, name)


def moe_gemv_block_fp8_ref(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: BlockFP8Experts,
                           gate: BlockFP8Experts | None, down: BlockFP8Experts, activation: str, *,
                           scheme: str = "w8a8") -> torch.Tensor:
    """Reference routed experts with block-FP8 weights, pair by pair (the specification of
    :func:`moe_gemv_block_fp8`): each projection's input rows are quantized per token and 128-column group
    (:func:`quantize_activation_per_token_group_ref`; ``scheme="w8a16"``: kept, in float32, with group scales
    of 1), each group's product with the
    pair's expert weight is summed in float32 and multiplied by the row's group scale and the weight block's
    ``weight_scale_inv``, the groups summed in float32 (:func:`_block_product`'s rule per pair), the
    result rounded to h's dtype; activation, gated product and combine as kernels/moe_gemv.py's
    ``moe_gemv_ref``.

    Args:
        h: [N, L] float32 / bfloat16 / float16. weights: [N, k] float32. indices: [N, k] int64 in [0, E).
        up, gate, down: (weight float8_e4m3fn [E, out, in], weight_scale_inv float32 [E, ceil(out / 128),
            ceil(in / 128)]); up / gate [E, I, L], down [E, L, I]; gate None when not gated.
        activation: "relu2" or "silu".
        scheme: one of :data:`SCHEMES`.

    Returns:
        [N, L] in h's dtype. Mutates nothing.

    Raises:
        ValueError: shapes, dtypes, an activation or a scheme that do not fit.
    """
    name = "moe_gemv_block_fp8_ref"
    _check_block_fp8(h, weights, indices, up, gate, down, activation, name)
    _activations(h[:0], scheme, name)  # the scheme, checked before any work
    mats = {"up": up, "gate": gate, "down": down}

    def linear(x, kind, expert):
        w, ws = mats[kind]
        qx, xs = _activations(x, scheme, name)  # [P, K] e4m3 codes (or x), [P, G]
        K = x.shape[1]
        wsn = ws[expert].float().repeat_interleave(BLOCK, dim=1)[:, : w.shape[1]]  # [P, out, G]
        y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
        for g in range(triton.cdiv(K, BLOCK)):
            cols = slice(g * BLOCK, min(K, (g + 1) * BLOCK))
            part = torch.einsum("poi,pi->po", w[expert][:, :, cols].float(), qx[:, cols].float())
            y += part * xs[:, g, None] * wsn[:, :, g]
        return y

    return pairs_ref(h, weights, indices, linear, gate is not None, activation)


@triton.jit
def _fp8_tile_dot(w_rows, ws_rows, kk, mk, mask_n, q, xs, g):
    """One 128-column group: sum_k w[n, k] * q[k] (fp32) times the row's group scale xs and the weight
    block's scale of each output row: [BLOCK_N]."""
    w = tl.load(w_rows + kk, mask=mk, other=0.0).to(tl.float32)
    ws = tl.load(ws_rows + g, mask=mask_n, other=0.0)
    return tl.sum(w * q, 1) * xs * ws


@triton.jit
def _pair_block_fp8_kernel(
    x_ptr, idx_ptr, w_ptr, ws_ptr, w2_ptr, ws2_ptr, out_ptr, out2_ptr,
    NOUT, K, TOPK, STEPS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_os,
    GATED: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr, A16: tl.constexpr,
):
    """One (pair, output tile, K range) per program, block-FP8 weights: grid (NOUT tiles, pairs, K splits);
    BLOCK_K = 128 (one activation group and one weight block column per iteration). Each group of the input
    row is quantized here with this file's rule (:func:`group_scale_quant`; A16: kept as it is, w8a16), then
    dotted with the expert's fp8 weight tile; the rest as kernels/moe_gemv.py's ``_pair_gemv_kernel``. ws_ptr / ws2_ptr: weight_scale_inv
    [E, ceil(NOUT / 128), ceil(K / 128)] (stride_se, stride_sn; unit column stride)."""
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
    w2_rows = w2_ptr + e64 * stride_we + n64 * stride_wn
    ws_rows = ws_ptr + e64 * stride_se + (offs_n // BLOCK_K).to(tl.int64) * stride_sn
    ws2_rows = ws2_ptr + e64 * stride_se + (offs_n // BLOCK_K).to(tl.int64) * stride_sn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    g_lo = pid_k * STEPS
    g_hi = tl.minimum(g_lo + STEPS, tl.cdiv(K, BLOCK_K))
    for g in range(g_lo, g_hi):
        cols = g * BLOCK_K + offs_k
        xt = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        if A16:
            q, xs = xt[None, :], 1.0
        else:
            q, xs = group_scale_quant(xt[None, :], INTERP)  # [1, BLOCK_K] e4m3 codes, [1] scale
            q = q.to(tl.float32)
        kk = cols[None, :] + offs_n[:, None] * 0
        mk = mask_n[:, None] & (kk < K)
        acc += _fp8_tile_dot(w_rows, ws_rows, kk, mk, mask_n, q, xs, g)
        if GATED:
            acc2 += _fp8_tile_dot(w2_rows, ws2_rows, kk, mk, mask_n, q, xs, g)
    store_pair_rows(out_ptr, out2_ptr, acc, acc2, p, pid_k, offs_n, mask_n, stride_om, stride_os, GATED, ACT,
                    SPLIT)


def _launch_pair(x, idx, w, w2, out_dtype, topk, act_code, *, a16: bool = False):
    """One block-FP8 pair-GEMV launch: x [rows, K]; w, w2: (weight, weight_scale_inv) (w2 None unless
    gated); K in 128-column steps (BLOCK_K = 128 always); ``a16``: w8a16 (x not quantized)."""
    P = idx.numel()
    weight, ws = w
    NOUT, K = weight.shape[1], weight.shape[2]
    bn, _, split, steps = pair_gemv_config(P, NOUT, K, 1 if w2 is None else 2)
    if split == 1:
        steps = triton.cdiv(K, BLOCK)
    out, out2 = pair_outputs(P, NOUT, split, w2 is not None, out_dtype, x.device)
    o2 = w2 if w2 is not None else w
    _pair_block_fp8_kernel[(triton.cdiv(NOUT, bn), P, split)](
        x, idx, weight, ws, o2[0], o2[1], out, out2,
        NOUT, K, topk, steps,
        x.stride(0), weight.stride(0), weight.stride(1), ws.stride(0), ws.stride(1),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        GATED=w2 is not None, ACT=act_code if split == 1 else 0, SPLIT=split > 1,
        BLOCK_N=bn, BLOCK_K=BLOCK, INTERP=interpreter_active(), A16=a16, **pair_gemv.PAIR_LAUNCH,
    )
    return out, (out2 if w2 is not None else None), split


# Which kernel runs moe_gemv_block_fp8's w8a16 projections on the GPU: "triton" (_pair_block_fp8_kernel above)
# or "cuda" (kernels/quant/pair_gemv.cu through kernels/quant/pair_cuda.py: the e4m3 decode in the registers of
# a bf16 mma.sync, the NVFP4 kernel's scheme), the latter up to PAIR_CUDA_MAX_PAIRS pairs (None: any). "cuda"
# runs each w8a16 projection it takes (pair_cuda.unsupported) and leaves the others, and w8a8, to Triton.
# Measured by bench_moe_gemv at Qwen3-Next's experts on an H100 (docs/kernel_performance.md, "The CUDA kernels
# at the release shapes"): the CUDA kernel led at 10 and 20 pairs (24.3 / 38.9 us against 30.5 / 41.9) and
# trailed from 40 (63.9 against 60.9; 108.0 against 102.9 at 80). Read at call time.
PAIR_KERNEL = "cuda"
PAIR_CUDA_MAX_PAIRS: int | None = 20


def pair_kernel_for(x: torch.Tensor, w: BlockFP8Experts, w2: BlockFP8Experts | None, P: int, a16: bool) -> str:
    """The kernel PAIR_KERNEL gives one projection (x [rows, K], the experts w and, gated, w2, P pairs, the
    w8a16 scheme when ``a16``): "cuda" where PAIR_KERNEL asks for it, the scheme is w8a16, P is at most
    PAIR_CUDA_MAX_PAIRS and the CUDA kernel takes the call, else "triton".

    Raises:
        ValueError: PAIR_KERNEL is not one of pair_cuda.KERNELS.
    """
    if not a16 or (PAIR_CUDA_MAX_PAIRS is not None and P > PAIR_CUDA_MAX_PAIRS):  # w8a8: only Triton has it
        pair_cuda.check_setting(PAIR_KERNEL, "block_fp8")
        return "triton"
    return pair_cuda.kernel_for(PAIR_KERNEL, "block_fp8", x, w, w2, P)


def _launch_pair_any(x, idx, w, w2, out_dtype, topk, act_code, dependent: bool = False, *, a16: bool):
    """One projection by the kernel :func:`pair_kernel_for` picks (the ``launch`` of run_pair_launches;
    ``dependent`` reaches the CUDA kernel only)."""
    if pair_kernel_for(x, w, w2, idx.numel(), a16) == "cuda":
        return pair_cuda.launch_pair("block_fp8", x, idx, w, w2, out_dtype, topk, act_code,
                                     name="moe_gemv_block_fp8", dependent=dependent)
    return _launch_pair(x, idx, w, w2, out_dtype, topk, act_code, a16=a16)


def moe_gemv_block_fp8(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: BlockFP8Experts,
                       gate: BlockFP8Experts | None, down: BlockFP8Experts, activation: str, *,
                       scheme: str = "w8a8") -> torch.Tensor:
    """Routed experts with block-FP8 weights as per-pair GEMVs over the chosen experts (kernels/quant/moe_gemv.py),
    activations quantized per token and 128-column group inside the kernels with this file's rule (w8a16:
    kept): same arguments, result and errors as :func:`moe_gemv_block_fp8_ref`, equal to it up to the fp32
    summation order. Three launches, no host synchronisation, grids from shapes only (CUDA-graph capturable). Triton on
    CUDA and under TRITON_INTERPRET=1, the reference on a plain CPU run. Expert ids are not range-checked.

    Raises:
        ValueError: shapes, dtypes or an activation that do not fit.
    """
    name = "moe_gemv_block_fp8"
    _check_block_fp8(h, weights, indices, up, gate, down, activation, name)
    _activations(h[:0], scheme, name)  # the scheme, checked
    if not use_kernel(h):
        return moe_gemv_block_fp8_ref(h, weights, indices, up, gate, down, activation, scheme=scheme)
    up, gate, down = contiguous_experts(up), contiguous_experts(gate), contiguous_experts(down)
    tensors = [t for e in (up, gate, down) if e is not None for t in e]
    check_launchable(h, weights, indices, *tensors, name=name)
    launch = functools.partial(_launch_pair_any, a16=scheme == "w8a16")
    return run_pair_launches(h, weights, indices, up, gate, down, activation, launch, up[0].shape[1])
