"""Pieces shared by the quantized GEMMs of kernels/quant/: input checks, the grouped (routed-experts) tile map,
the interpreter-safe float8_e4m3fn rounding, the tensor-core product helper and the tile-size choice.

Grouped GEMMs follow ``torch._grouped_mm``'s convention (as runners/engine/models/moe.py uses it): x [P, K]
holds the (token, expert) pairs sorted by expert, ``offsets`` [E] int32 holds the cumulative end of each
expert's rows (expert e owns rows ``offsets[e-1] .. offsets[e] - 1``, ``offsets[-1]`` = P). The kernels run
a 2-D grid (N tiles, row tiles) whose row-tile count is the bound ``P // BLOCK_M + min(E, P)`` (each expert
that has rows adds at most one partial tile), fixed by the shapes; each program finds its expert from the
offsets on the device (:func:`grouped_tile`) and programs past the last real tile return at once. So the work
follows the rows present (an expert with no rows costs nothing but its entry in the offsets scan), nothing is
read on the host, and a launch can be captured in a CUDA graph. The idea is vLLM's fused_moe
``moe_align_block_size`` (each expert's rows padded to whole tiles), done inside the GEMM instead of by a sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INPUT_DTYPES, check_dtype, interpreter_active

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# bf16 pieces that hold an activation of each dtype exactly (kernels/_mma.py): fp32 x is split into 3 so a
# product on bf16 tensor cores keeps fp32 accuracy; fp16 runs natively (its own tensor-core type).
X_DTYPES = INPUT_DTYPES
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def use_kernel(x: torch.Tensor) -> bool:
    """True when the Triton kernel runs for ``x``: a CUDA tensor, or any tensor under TRITON_INTERPRET=1."""
    return x.is_cuda or interpreter_active()


def check_activation(x: torch.Tensor, K: int, name: str) -> None:
    """Raise ValueError unless x is a float32 / bfloat16 / float16 [M, K] matrix."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [M, K], got shape {tuple(x.shape)}")
    check_dtype(x, X_DTYPES, "x", name)
    if x.shape[1] != K:
        raise ValueError(f"{name}: x has {x.shape[1]} columns but the weight has K = {K} input columns")


def check_bias(bias: torch.Tensor | None, N: int, device: torch.device, name: str) -> None:
    """Raise ValueError unless bias is None or an [N] float tensor on ``device``."""
    if bias is None:
        return
    if tuple(bias.shape) != (N,):
        raise ValueError(f"{name}: bias must have shape ({N},), got {tuple(bias.shape)}")
    check_dtype(bias, X_DTYPES, "bias", name)
    if bias.device != device:
        raise ValueError(f"{name}: bias is on {bias.device}, x on {device}")


def check_offsets(offsets: torch.Tensor, E: int, P: int, device: torch.device, name: str) -> None:
    """Raise ValueError unless offsets is an [E] int32 tensor on ``device`` (values are not read: that would
    synchronise; they must be non-decreasing with offsets[-1] = P, rows past offsets[-1] are not written)."""
    if tuple(offsets.shape) != (E,):
        raise ValueError(f"{name}: offsets must have shape ({E},) (one cumulative row end per expert), "
                         f"got {tuple(offsets.shape)}")
    if offsets.dtype != torch.int32:
        raise ValueError(f"{name}: offsets must be int32 (torch._grouped_mm's offs), got {offsets.dtype}")
    if offsets.device != device:
        raise ValueError(f"{name}: offsets is on {offsets.device}, x on {device}")
    if P >= 2**31:
        raise ValueError(f"{name}: {P} rows do not fit int32 offsets")


def offsets_list(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) rows of every expert, read on the host (references only: this synchronises)."""
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def grouped_row_tiles(P: int, E: int, block_m: int) -> int:
    """Row tiles a grouped launch covers: every expert's rows rounded up to whole tiles fit in this many."""
    return P // block_m + min(E, P)


def block_m_for(rows_per_group: float) -> int:
    """Row-tile size (the MMA's N side: the kernels compute out^T = W x^T) for about ``rows_per_group`` rows
    per weight matrix: 16 (the smallest tensor-core tile) at decode sizes, up to 128 for prefill."""
    return int(min(128, max(16, triton.next_power_of_2(max(1, int(rows_per_group))))))


@triton.jit
def grouped_tile(offsets_ptr, E, pid_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row tile ``pid_m`` of a grouped launch; expert >= E when pid_m is past
    the last real tile (the program has nothing to do). BLOCK_E: power of two >= E.

    Expert e owns rows [offsets[e-1], offsets[e]) cut into ceil(count / BLOCK_M) tiles; tiles are numbered
    expert by expert. One scan of the E offsets per program (2 KB for 512 experts, from L2)."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets_ptr + e, mask=e < E, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=(e >= 1) & (e < E), other=0)
    counts = tl.maximum(ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)  # inclusive: tiles of experts <= e
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)  # first expert whose tiles reach past pid_m
    pick = e == expert
    first_tile = tl.sum(tl.where(pick, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(pick, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(pick, ends, 0), 0)
    return expert, row0, row_end


@triton.jit
def round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, returned as fp32.

    The interpreter's fp32 -> fp8 cast mis-rounds (a mantissa carry does not reach the exponent: 127.9 -> 64;
    ties go away from zero); on the GPU ``.to(tl.float8e4nv)`` is cvt.rn (ties to even), like torch's cast. This
    is the same rule in fp32 arithmetic: the grid spacing at |v| is 2^(max(e, -6) - 3) (3 mantissa bits,
    subnormal below 2^-6), and adding then subtracting 1.5 * 2^23 rounds |v| / spacing (< 2^5) to an integer,
    ties to even, in fp32 round-to-nearest arithmetic; the sign bit is copied back (-0 stays -0)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6) - 3
    ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    r = ((tl.abs(v) * inv + magic) - magic) * ulp
    sign = bits & -2147483648  # the sign bit: a negative value that rounds to 0 stays -0, as in torch
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(v, INTERP: tl.constexpr):
    """fp32 v (|v| <= 448) -> float8_e4m3fn, round to nearest even; under the interpreter the rounded value is
    kept as fp32 (its dot path computes in fp32; the value is exactly an e4m3 value)."""
    if INTERP:
        res = round_to_e4m3(v)
    else:
        res = v.to(tl.float8e4nv)
    return res


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b on tensor cores for 16-bit or fp8 a, b (fp32 acc). The interpreter computes bf16 / fp8
    products wrongly, so there both go through an fp32 (ieee) product: exact products, only the summation
    order differs from the GPU."""
    if INTERP:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        res = tl.dot(a, b, acc)
    return res

