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

import math

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


def repack_words(codes: torch.Tensor, bits: tuple[tuple[int, ...], ...], name: str, *,
                 inverse: bool = False) -> torch.Tensor:
    """A bit permutation inside each little-endian 32-bit word of ``codes`` (uint8 [..., n], n % 4 == 0): the
    word's len(bits) codes of w = 32 / len(bits) bits each (code c at bits c * w .. c * w + w - 1), bit b of
    code c moved to bit ``bits[c][b]`` (``inverse``: moved back). How kernels/quant's formats lay their codes
    out for the CUDA kernels (nvfp4.repack_codes, block_fp8.repack_codes; the tables beside them). Load-time
    work: one elementwise pass per bit over int32 words, REPACK_CHUNK_BYTES of codes at a time (peak extra
    memory about three times a chunk).

    Returns:
        a new uint8 tensor of codes' shape, on its device. Mutates nothing.

    Raises:
        ValueError: codes not uint8, n not whole words, or ``bits`` not a permutation of 0..31 in codes of equal
            width.
    """
    if codes.dtype != torch.uint8 or codes.shape[-1] % 4:
        raise ValueError(f"{name}: codes must be uint8 [..., n] with whole 32-bit words (n % 4 == 0; NVFP4: "
                         f"K % 8 == 0, FP8: K % 4 == 0), got {codes.dtype} {tuple(codes.shape)}")
    width = 32 // len(bits)
    dst = [d for code in bits for d in code]
    if sorted(dst) != list(range(32)) or any(len(code) != width for code in bits):
        raise ValueError(f"{name}: the bit table must move each of a word's 32 bits once, {width} per code, got "
                         f"{bits}")
    src = [width * c + b for c in range(len(bits)) for b in range(width)]
    if inverse:
        src, dst = dst, src
    words = codes.contiguous().view(torch.int32).reshape(-1)  # little-endian: byte j is bits 8j .. 8j + 7
    out = torch.empty_like(words)
    step = max(1, REPACK_CHUNK_BYTES // 4)
    for i in range(0, words.numel(), step):
        w = words[i:i + step]
        acc = torch.zeros_like(w)
        for a, d in zip(src, dst):
            acc |= ((w >> a) & 1) << d  # int32: >> is arithmetic, & 1 keeps bit a; << 31 sets the sign bit
        out[i:i + step] = acc
    return out.view(torch.uint8).reshape(codes.shape)


# Codes per repack_words step (bounds its temporaries at load time).
REPACK_CHUNK_BYTES = 64 * 2**20


def true_divide(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` rounded to nearest (IEEE division) on every device. torch's CUDA kernel for a tensor
    divided by a Python (CPU) scalar multiplies by the rounded reciprocal instead (aten's
    div_true_kernel_cuda), which differs from true division in the last bit for divisors such as 448, and so
    from the CPU result and from the kernels' ``tl.div_rn``; dividing by a tensor of the divisor keeps IEEE
    division everywhere."""
    return t / torch.full_like(t, divisor)


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


def check_out(out: torch.Tensor, shape: tuple[int, int], x: torch.Tensor, name: str) -> None:
    """Refuse an ``out`` that is not a row-contiguous ``shape`` tensor in x's dtype on x's device.

    Raises:
        ValueError: naming ``name``, the expected and the given tensor."""
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be a row-contiguous {shape} {x.dtype} tensor on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")


def output_buffer(out: torch.Tensor | None, x: torch.Tensor, N: int, name: str) -> torch.Tensor:
    """The [x.shape[0], N] result tensor of a kernel: ``out`` checked (:func:`check_out`) or a new one."""
    if out is None:
        return torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    check_out(out, (x.shape[0], N), x, name)
    return out


def copy_into(y: torch.Tensor, out: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor:
    """A reference's result ``y``: returned as is, or copied into ``out`` (checked) and ``out`` returned."""
    if out is None:
        return y
    check_out(out, tuple(y.shape), x, name)
    return out.copy_(y)


def grouped_row_tiles(P: int, E: int, block_m: int) -> int:
    """Row tiles a grouped launch covers: every expert's rows rounded up to whole tiles fit in this many."""
    return P // block_m + min(E, P)


# Programs a decode launch should have at least: about two per SM of an H200 (132 SMs), so every SM streams
# weights; narrower N tiles are taken until a launch has this many (down to 16, the smallest MMA side).
TARGET_PROGRAMS = 264


def tile_config(rows_per_matrix: float, N: int, row_tiles: int, *, accumulators: int = 1
                ) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of a quantized GEMM launch for about ``rows_per_matrix`` rows per weight
    matrix, N output features and ``row_tiles`` row tiles sharing each N tile: prefill sizes (>= 64 rows)
    8 warps and 128-wide N tiles, 64-wide where BLOCK_M x BLOCK_N x ``accumulators`` fp32 tiles would exceed
    16384 values (the block-FP8 kernel keeps a per-group product beside its accumulator: at 128 x 128 it
    spills on sm_90); decode sizes 16 rows and the widest N tile of 64 / 32 that still gives TARGET_PROGRAMS
    programs, else 16."""
    bm = block_m_for(rows_per_matrix)
    if bm >= 64:
        return bm, 128 if bm * 128 * accumulators <= 16384 else 64, 8
    for bn in (64, 32):
        if triton.cdiv(N, bn) * row_tiles >= TARGET_PROGRAMS:
            return bm, bn, 4
    return bm, 16, 4


# Decode GEMV path (CUDA cores, no tensor cores): up to this many rows per weight matrix, and the programs a
# launch aims for (about 4 per H200 SM: several programs' loads in flight per SM hide the DRAM latency).
GEMV_MAX_ROWS = 8
GEMV_TARGET_PROGRAMS = 528


def use_gemv(rows_per_matrix: float, *, grouped_rows: int | None = None,
             grouped_max_rows: float | None = None) -> bool:
    """Whether a launch with about ``rows_per_matrix`` rows per weight matrix takes the GEMV kernel (<=
    GEMV_MAX_ROWS) and, for a grouped launch (``grouped_rows``: its rows in all), has at most
    ``grouped_max_rows`` rows (the format's ``GROUPED_GEMV_MAX_ROWS``, which its launcher reads at call time,
    as GEMV_MAX_ROWS here: a benchmark can set GEMV_MAX_ROWS = 0 to time the tensor-core kernel at decode
    sizes, or raise a format's grouped bound to time the GEMV above it)."""
    if grouped_rows is not None and grouped_rows > grouped_max_rows:
        return False
    return rows_per_matrix <= GEMV_MAX_ROWS


def gemv_config(rows_per_matrix: float, N: int, matrices: int, k_steps: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, split, k_steps_per_split) of a decode GEMV launch: ``rows_per_matrix`` (<=
    GEMV_MAX_ROWS) rows per weight matrix, ``matrices`` weight matrices with rows (experts present; 1 dense),
    N output features and ``k_steps`` K steps (128-column groups). BLOCK_M: rows per program (power of two
    >= the rows per matrix, so one program usually covers an expert's rows and reads its weight tile once).
    BLOCK_N: the widest of 64 / 32 / 16 (at most 128 / BLOCK_M: each thread holds its N rows' copy of every
    activation row) that gives GEMV_TARGET_PROGRAMS programs. Where even 16-wide N tiles
    give fewer than half that (few output features: Qwen3-Next's k / v 2048 -> 512, o 4096 -> 2048), K is
    split into ``split`` ranges of ``k_steps_per_split`` steps whose fp32 partial sums a second launch adds
    (:func:`splitk_sum`): each program's serial chain of dependent loads gets shorter and every SM streams."""
    rows = max(1, math.ceil(rows_per_matrix))
    bm = min(GEMV_MAX_ROWS, triton.next_power_of_2(rows))
    row_tiles = matrices * triton.cdiv(rows, bm)
    for bn in [b for b in (64, 32, 16) if b * bm <= 128] or [16]:  # 8 rows x 64 spilled on sm_90
        programs = triton.cdiv(N, bn) * row_tiles
        if programs >= GEMV_TARGET_PROGRAMS:
            return bm, bn, 1, k_steps
    if 2 * programs >= GEMV_TARGET_PROGRAMS:
        return bm, 16, 1, k_steps
    per = triton.cdiv(k_steps, min(k_steps, triton.cdiv(GEMV_TARGET_PROGRAMS, programs)))
    return bm, 16, triton.cdiv(k_steps, per), per


@triton.jit
def _splitk_sum_kernel(part_ptr, b_ptr, out_ptr, offsets_ptr, R, N, E, S, stride_ps, stride_om,
                       GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GROUPED:
        row_end = tl.load(offsets_ptr + E - 1)  # rows past the last expert's end were never written
    else:
        row_end = R
    mask = (rows < row_end)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def splitk_sum(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               offsets: torch.Tensor | None) -> torch.Tensor:
    """out[r, n] = sum_s part[s, r, n] (+ bias[n]) in fp32, in split order (deterministic: no atomics), cast
    to out's dtype. part: float32 [S, R, N] contiguous (the split-K partial sums); out: [R, N] row-contiguous.
    offsets: the grouped launch's [E] int32 row ends (rows past offsets[-1] are left unwritten, read on the
    device) or None (dense). Mutates ``out``; returns it."""
    S, R, N = part.shape
    block_n = min(128, triton.next_power_of_2(N))
    _splitk_sum_kernel[(triton.cdiv(R, 8), triton.cdiv(N, block_n))](
        part, bias if bias is not None else part, out, offsets if offsets is not None else part,
        R, N, offsets.shape[0] if offsets is not None else 1, S, part.stride(0), out.stride(0),
        GROUPED=offsets is not None, HAS_BIAS=bias is not None, BLOCK_R=8, BLOCK_N=block_n, num_warps=4)
    return out


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
def program_tile(offsets_ptr, E, M, pid_m, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row tile ``pid_m``: :func:`grouped_tile` for a grouped launch, else
    expert 0 and rows [pid_m * BLOCK_M, M) of a dense one. The prologue of every kernel in kernels/quant."""
    if GROUPED:
        expert, row0, row_end = grouped_tile(offsets_ptr, E, pid_m, BLOCK_M, BLOCK_E)
    else:
        expert = pid_m * 0
        row0 = pid_m * BLOCK_M
        row_end = M
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

