"""Quantized-weight GEMMs (kernels/quant/: NVFP4 W4A16, block FP8 w8a8) against their PyTorch references, and
the format rules themselves (nibble order, e2m1 / e4m3 rounding, quantize -> dequantize).

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton is imported) at
small awkward sizes: M in {1, 3, 17}, K in {32, 48, 272} (272 = two 128-column groups and a partial third;
17 e2m1 scale blocks), N in {16, 40} (not multiples of the N tiles), E = 5 experts with empty ones (first,
middle and last). Outputs are NaN-filled before the kernel writes them, so an element it forgets fails.
Up to 8 rows per weight matrix take the decode GEMV kernels (with and without split-K: the *_gemv_* tests
force both), more rows the tensor-core kernels (M = 17, 10 rows per expert, the prefill tile tests).
tests/test_kernels_quant_gpu.py holds the release-shape and CUDA-graph checks.

Tolerances, kernel vs reference, as a fraction of the largest |reference| output (both compute the same fp32
sums: the dequantized NVFP4 weight is exact in bf16 / fp16 and the fp8 products are exact in fp32, so they
differ only in summation order, and for 16-bit outputs in the final rounding):
  float32   1e-5: summation order over K <= 272 in fp32 (and the fp32 activation split into three bf16
            pieces, exact to 2^-24) [measured <= 6e-7 in the interpreter];
  float16   1e-3: one fp16 ulp (2^-10) of the largest output, from rounding fp32 sums that agree to ~1e-7;
  bfloat16  8e-3: one bf16 ulp (2^-7) likewise.
The activation quantization kernel is held to bit equality with its reference (same divisions rounded to
nearest, same ties-to-even e4m3 rounding).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.quant import _common as quant_common  # noqa: E402
from kernels.quant import block_fp8, nvfp4  # noqa: E402
from kernels.quant.block_fp8 import (  # noqa: E402
    block_fp8_dequantize,
    block_fp8_grouped_mm,
    block_fp8_grouped_mm_ref,
    block_fp8_linear,
    block_fp8_linear_ref,
    block_fp8_quantize,
    block_scaled_mm_supported,
    quantize_activation_per_token_group,
    quantize_activation_per_token_group_ref,
)
from kernels.quant.nvfp4 import (  # noqa: E402
    E2M1_GRID,
    nvfp4_dequantize,
    nvfp4_grouped_mm,
    nvfp4_grouped_mm_ref,
    nvfp4_linear,
    nvfp4_linear_ref,
    nvfp4_quantize,
    round_to_e2m1,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = tuple(TOL)
SHAPES = [(1, 32, 16), (3, 48, 40), (17, 272, 40)]  # (M, K, N)
FP8 = torch.float8_e4m3fn


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any(), "an output element was not written (NaN poison survived)"
    scale = want.float().abs().max().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


def _nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _randn(*shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _offsets(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)


# ---------------------------------------------------------------------------------------------------------
# NVFP4: the format
# ---------------------------------------------------------------------------------------------------------


def test_nvfp4_nibble_order_element_2j_in_the_low_nibble():
    # byte 0x72: low nibble 2 (+1.0) is element 0, high nibble 7 (+6.0) element 1; 0x9A: low A = -1.0,
    # high 9 = -0.5 (sign bit 3). One block scale of 2.0 and a global 0.5: multipliers of 1.
    weight = torch.zeros(1, 16, dtype=torch.uint8)
    weight[0, 0], weight[0, 1] = 0x72, 0x9A
    scale = torch.full((1, 2), 2.0).to(FP8)
    s2 = torch.tensor(0.5)
    w = nvfp4_dequantize(weight, scale, s2, torch.float32)
    assert w[0, :4].tolist() == [1.0, 6.0, -1.0, -0.5] and not w[0, 4:].any()
    q, s, s2q = nvfp4_quantize(w)  # amax 6 -> s2 = 6 / 2688, block scale 448: codes on the grid exactly
    assert q[0, :2].tolist() == [0x72, 0x9A] and not q[0, 2:].any()
    assert float(s[0, 0]) == 448.0 and float(s[0, 1]) == 0.0 and float(s2q) == pytest.approx(6 / 2688)
    # the kernel reads the same order: x picks single columns
    x = torch.eye(4, 32, dtype=torch.float32, device=DEVICE)
    y = nvfp4_linear(x, weight.to(DEVICE), scale.to(DEVICE), s2.to(DEVICE), out=_nan(4, 1, dtype=x.dtype))
    assert y[:, 0].tolist() == [1.0, 6.0, -1.0, -0.5]


def test_e2m1_rounding_is_nearest_ties_to_even_and_saturates():
    grid = torch.tensor(E2M1_GRID)
    assert round_to_e2m1(grid).tolist() == list(range(8))
    assert round_to_e2m1(-grid[1:]).tolist() == list(range(9, 16))
    mids = (grid[1:] + grid[:-1]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5: ties go to the even code
    assert round_to_e2m1(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert round_to_e2m1(torch.tensor([0.26, 0.74, 5.01, 7.0, 100.0, -0.1])).tolist() == [1, 1, 7, 7, 7, 8]


def test_nvfp4_quantize_round_trip_error_and_idempotence():
    w = _randn(3, 40, 48, seed=1).cpu()
    w[1, :, :16] = 0  # an all-zero block: scale 0, codes 0
    q, s, s2 = nvfp4_quantize(w)
    assert q.shape == (3, 40, 24) and s.shape == (3, 40, 3) and s2.shape == (3,)
    assert torch.allclose(s2, w.abs().amax(dim=(1, 2)) / 2688)
    dq = nvfp4_dequantize(q, s, s2, torch.float32)
    # per element at most half the widest e2m1 gap (1, between 4 and 6) times the block's step, which the
    # e4m3 rounding of the block scale stretches by at most 2^-4
    step = (s.float() * s2[:, None, None]).repeat_interleave(16, dim=-1)
    assert ((dq - w).abs() <= step * (1 + 2**-4) + 1e-12).all()
    assert not dq[1, :, :16].any()
    # a dequantized weight re-quantized with the same global scales gives the same scales and values (codes
    # may differ in the sign of a zero: a negative value that rounded to -0 dequantizes to -0.0, re-read as 0)
    q2, s_2, _ = nvfp4_quantize(dq, weight_scale_2=s2)
    assert torch.equal(s_2.float(), s.float())
    assert torch.equal(nvfp4_dequantize(q2, s_2, s2, torch.float32), dq)
    assert torch.equal(q2 & 0x77, q & 0x77)  # the magnitudes of both nibbles agree


def test_nvfp4_stacked_dequantize_matches_per_matrix():
    q, s, s2 = nvfp4_quantize(_randn(2, 16, 32, seed=2).cpu())
    both = nvfp4_dequantize(q, s, s2, torch.bfloat16)
    for e in range(2):
        assert torch.equal(both[e], nvfp4_dequantize(q[e], s[e], s2[e], torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------
# NVFP4: kernels vs references
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, K, N", SHAPES)
def test_nvfp4_linear_matches_reference(M, K, N, dtype):
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(N, K, seed=K + N).cpu()))
    x, bias = _randn(M, K, seed=M, dtype=dtype), _randn(N, seed=3, dtype=dtype)
    y = nvfp4_linear(x, q, s, s2, bias, out=_nan(M, N, dtype=dtype))
    _close(y, nvfp4_linear_ref(x, q, s, s2, bias), dtype)


@pytest.mark.parametrize("K", (48, 36))  # 36: K / 2 = 18 bytes per row, not whole int32 words
def test_nvfp4_byte_path_matches_word_path(K):
    """The kernel reads the codes as int32 words where rows are whole words (8 codes per load) and byte by
    byte otherwise; both decode the same values (bit-equal outputs in fp32: same products, same order)."""
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(40, K, seed=K).cpu()))
    x = _randn(3, K, seed=15)
    assert nvfp4.words_ok(q) == (K % 8 == 0)
    by_bytes = nvfp4_linear(x, q, s, s2, out=_nan(3, 40, dtype=x.dtype), force_bytes=True)
    _close(by_bytes, nvfp4_linear_ref(x, q, s, s2), torch.float32)
    if K % 8 == 0:
        _close(nvfp4_linear(x, q, s, s2), by_bytes, torch.float32)


# Empty first / middle / last experts; one expert with 17 rows (two row tiles); a single row.
GROUPED_CASES = [((3, 0, 13, 0, 1), dt) for dt in DTYPES] + [((0, 0, 17, 0, 0), torch.float16),
                                                              ((0, 1, 0, 0, 0), torch.bfloat16)]


@pytest.mark.parametrize("counts, dtype", GROUPED_CASES)
def test_nvfp4_grouped_mm_matches_reference(counts, dtype):
    E, K, N = 5, 48, 40
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(E, N, K, seed=4).cpu()))
    P = sum(counts)
    x, offs = _randn(P, K, seed=P, dtype=dtype), _offsets(counts)
    y = nvfp4_grouped_mm(x, q, s, s2, offs, out=_nan(P, N, dtype=dtype))
    _close(y, nvfp4_grouped_mm_ref(x, q, s, s2, offs), dtype)
    if dtype != torch.float16:
        return
    # and each expert's rows equal the dense kernel on that expert alone (one dtype: the interpreter is slow)
    start = 0
    for e, c in enumerate(counts):
        if c:
            assert torch.equal(y[start:start + c], nvfp4_linear(x[start:start + c], q[e], s[e], s2[e]))
        start += c


def test_nvfp4_mma_config_defaults_are_tile_config_and_the_block_k_rule():
    """nvfp4.MMA_TILE / MMA_BLOCK_K / MMA_NUM_STAGES unset give the launches the kernel always had."""
    assert (nvfp4.MMA_TILE, nvfp4.MMA_BLOCK_K, nvfp4.MMA_NUM_STAGES) == (None, None, 3)
    for rows, N, tiles in ((11.0, 2688, 512), (11.0, 1024, 512), (3.0, 40, 5), (200.0, 4096, 2),
                           (64.0, 16, 1)):
        bm, bn, warps = quant_common.tile_config(rows, N, tiles)
        assert nvfp4.mma_config(rows, N, tiles) == (bm, bn, warps, 64 if bm >= 64 else 128, 3)


@pytest.mark.parametrize("setting, value", [("MMA_TILE", (16, 24, 4)), ("MMA_TILE", (8, 64, 4)),
                                            ("MMA_TILE", (16, 64, 3)), ("MMA_BLOCK_K", 16),
                                            ("MMA_BLOCK_K", 96), ("MMA_NUM_STAGES", 0)])
def test_nvfp4_mma_config_refuses_settings_the_kernel_cannot_take(setting, value, monkeypatch):
    monkeypatch.setattr(nvfp4, setting, value)
    with pytest.raises(ValueError, match=setting):
        nvfp4.mma_config(11.0, 64, 4)


# (BLOCK_M, BLOCK_N, num_warps), BLOCK_K, num_stages: the codes as bytes (BLOCK_K 64), as words over two
# 256-column tiles with a 32-row tile, and the default launch set explicitly
MMA_OVERRIDES = [((16, 32, 4), 64, 1), ((32, 16, 8), 256, 4), ((16, 16, 4), 128, 3)]


@pytest.mark.parametrize("tile, block_k, stages", MMA_OVERRIDES)
def test_nvfp4_grouped_mm_under_overridden_launch_settings(tile, block_k, stages, monkeypatch):
    """The tensor-core kernel under other launch settings (benchmarks/sweep_nvfp4_grouped.py's grid) keeps the
    product: bf16 within one step of the reference, and the default launch set explicitly is bit-equal to
    the rule's."""
    E, K, N, counts = 5, 272, 40, (3, 0, 13, 0, 1)
    monkeypatch.setattr(quant_common, "GEMV_MAX_ROWS", 0)  # the tensor-core kernel at these row counts
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(E, N, K, seed=7).cpu()))
    P = sum(counts)
    x, offs = _randn(P, K, seed=P, dtype=torch.bfloat16), _offsets(counts)
    default = nvfp4_grouped_mm(x, q, s, s2, offs)
    monkeypatch.setattr(nvfp4, "MMA_TILE", tile)
    monkeypatch.setattr(nvfp4, "MMA_BLOCK_K", block_k)
    monkeypatch.setattr(nvfp4, "MMA_NUM_STAGES", stages)
    y = nvfp4_grouped_mm(x, q, s, s2, offs, out=_nan(P, N, dtype=x.dtype))
    _close(y, nvfp4_grouped_mm_ref(x, q, s, s2, offs), torch.bfloat16)
    if (tile, block_k, stages) == ((16, 16, 4), 128, 3):
        assert quant_common.tile_config(P / E, N, min(E, P)) == tile  # the rule's own launch
        assert torch.equal(y, default)


def test_grouped_rows_past_the_last_offset_are_not_written():
    E, K, N = 5, 32, 16
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(E, N, K, seed=5).cpu()))
    x = _randn(6, K, seed=6)
    y = nvfp4_grouped_mm(x, q, s, s2, _offsets([2, 0, 1, 0, 0]), out=_nan(6, N, dtype=x.dtype))
    assert not y[:3].isnan().any() and y[3:].isnan().all()


# ---------------------------------------------------------------------------------------------------------
# block FP8
# ---------------------------------------------------------------------------------------------------------


def _e4m3_sweep() -> torch.Tensor:
    """One row whose amax is 448 (scale exactly 1): every finite e4m3 value, both signs, and the midpoint
    between each pair of neighbours (ties), subnormals included."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    return torch.cat((vals, mids))[None, :]


def test_activation_quantization_kernel_is_bit_identical_to_reference():
    sweep = _e4m3_sweep()
    x = torch.zeros(4, sweep.shape[1])
    x[0] = sweep[0]
    x[1] = _randn(sweep.shape[1], seed=7).cpu() * torch.logspace(-6, 3, sweep.shape[1])
    x[3] = -x[1] / 3  # row 2 stays zero: scale 1e-10 / 448, codes 0
    for group in (128, 48):
        q, s = quantize_activation_per_token_group(x.to(DEVICE), group)
        qr, sr = quantize_activation_per_token_group_ref(x, group)
        assert q.shape == x.shape and s.shape == (4, -(-x.shape[1] // group))
        assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s.cpu(), sr)
    # with group = K the sweep row's scale is exactly 1: grid values stay, each tie goes to the even code
    q, s = quantize_activation_per_token_group(x[:1].to(DEVICE), sweep.shape[1])
    assert float(s[0, 0]) == 1.0
    assert torch.equal(q.cpu().view(torch.uint8), sweep.to(FP8).view(torch.uint8))


def test_block_fp8_quantize_round_trip():
    w = _randn(200, 300, seed=8).cpu()  # partial row and column blocks
    w[128:, :128] = 0
    q, s = block_fp8_quantize(w)
    assert q.dtype == FP8 and s.shape == (2, 3) and float(s[1, 0]) == 1.0
    assert torch.allclose(s[0, 0], w[:128, :128].abs().max() / 448)
    dq = block_fp8_dequantize(q, s, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus half the subnormal spacing 2^-9 x scale
    sx = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert ((dq - w).abs() <= w.abs() * 2**-4 + sx * 2**-10).all()
    assert torch.equal(block_fp8_dequantize(q, s.to(torch.bfloat16), torch.float32),
                       q.float() * s.to(torch.bfloat16).float().repeat_interleave(128, 0)
                       .repeat_interleave(128, 1)[:200, :300])


@pytest.mark.parametrize("M, K, N, dtype", [(*shape, dt) for shape in SHAPES for dt in DTYPES]
                         + [(5, 300, 200, torch.bfloat16)])  # two weight row blocks, a partial K group
def test_block_fp8_linear_matches_reference(M, K, N, dtype):
    q, s = (t.to(DEVICE) for t in block_fp8_quantize(_randn(N, K, seed=K + N).cpu()))
    s = s.to(torch.bfloat16)  # Qwen's release stores weight_scale_inv in bf16
    x, bias = _randn(M, K, seed=M, dtype=dtype), _randn(N, seed=9, dtype=dtype)
    y = block_fp8_linear(x, q, s, bias, out=_nan(M, N, dtype=dtype), impl="triton")
    _close(y, block_fp8_linear_ref(x, q, s, bias), dtype)


@pytest.mark.parametrize("counts, dtype", GROUPED_CASES)
def test_block_fp8_grouped_mm_matches_reference(counts, dtype):
    E, K, N = 5, 272, 40
    q, s = (t.to(DEVICE) for t in block_fp8_quantize(_randn(E, N, K, seed=10).cpu()))
    P = sum(counts)
    x, offs = _randn(P, K, seed=P + 1, dtype=dtype), _offsets(counts)
    y = block_fp8_grouped_mm(x, q, s, offs, out=_nan(P, N, dtype=dtype))
    _close(y, block_fp8_grouped_mm_ref(x, q, s, offs), dtype)


@pytest.mark.parametrize("target", [1, 10**6])
def test_block_fp8_gemv_with_and_without_split_k(target, monkeypatch):
    """The decode GEMV path (<= 8 rows per weight matrix) with each program over all of K (program target 1)
    and with K split as far as it goes (one 128-column group per program, the fp32 partial sums added by
    splitk_sum with the bias), dense at 2 and 8 rows and grouped; and, at target 1, the grouped tensor-core
    decode tile (> 8 rows per expert: 50 rows over 5 experts) and the 4-group unrolled K loop."""
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", target)
    K, N, E, dtype = 300, 40, 5, torch.float16
    q, s = (t.to(DEVICE) for t in block_fp8_quantize(_randn(E, N, K, seed=15).cpu()))
    bias = _randn(N, seed=16, dtype=dtype)
    for M in (2, 8):
        x = _randn(M, K, seed=M + 20, dtype=dtype)
        _close(block_fp8_linear(x, q[0], s[0], bias, out=_nan(M, N, dtype=dtype), impl="triton"),
               block_fp8_linear_ref(x, q[0], s[0], bias), dtype)
    for counts in [(3, 0, 13, 0, 1)] + ([(20, 0, 0, 0, 30)] if target == 1 else []):
        P = sum(counts)
        x, offs = _randn(P, K, seed=P, dtype=dtype), _offsets(counts)
        _close(block_fp8_grouped_mm(x, q, s, offs, out=_nan(P, N, dtype=dtype)),
               block_fp8_grouped_mm_ref(x, q, s, offs), dtype)
    if target == 1:  # 5 groups with 4 per loop iteration: the second iteration has 3 groups past the end
        q5, s5 = (t.to(DEVICE) for t in block_fp8_quantize(_randn(N, 600, seed=21).cpu()))
        x = _randn(8, 600, seed=22, dtype=dtype)
        _close(block_fp8_linear(x, q5, s5, bias, out=_nan(8, N, dtype=dtype), impl="triton"),
               block_fp8_linear_ref(x, q5, s5, bias), dtype)


@pytest.mark.parametrize("target", [1, 10**6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_fp8_w8a16_matches_its_reference_and_splits_k_in_one_launch(target, dtype, monkeypatch):
    """scheme="w8a16" (activations kept, the fp8 weight converted in registers): the GEMV kernel alone at 1,
    3, 8 and 17 rows dense (17: three row tiles) and grouped (empty experts first, middle and last), each
    program over all of K (target 1) or one 128-column group per program; the K split summed inside the
    launch equals the splitk_sum launch bit for bit, and leaves every counter at 0 for the next launch. The
    w8a16 reference is x times the dequantized weight, and differs from w8a8's (the quantized activations)."""
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", target)
    K, N, E = 300, 40, 5
    q, s = (t.to(DEVICE) for t in block_fp8_quantize(_randn(E, N, K, seed=31).cpu()))
    bias = _randn(N, seed=32, dtype=dtype)
    counters = block_fp8._split_counters(torch.device(DEVICE), 1)

    def both(call):
        """call() (each into its own NaN-filled output) with the in-launch split sum and with the
        splitk_sum launch: equal bits."""
        serial = call()
        monkeypatch.setattr(block_fp8, "SERIAL_SPLIT_SCHEMES", ())
        two_launches = call()
        monkeypatch.setattr(block_fp8, "SERIAL_SPLIT_SCHEMES", ("w8a16",))
        assert torch.equal(serial, two_launches)
        assert not counters.any()
        return serial

    for M in (1, 3, 8, 17):
        x = _randn(M, K, seed=M + 33, dtype=dtype)
        want = block_fp8_linear_ref(x, q[0], s[0], bias, scheme="w8a16")
        got = both(lambda x=x, M=M: block_fp8_linear(x, q[0], s[0], bias, out=_nan(M, N, dtype=dtype),
                                                     scheme="w8a16"))
        _close(got, want, dtype)
        if M == 17:
            assert (want.float() - block_fp8_linear_ref(x, q[0], s[0], bias).float()).abs().max() > 0
    for counts in [(0, 3, 0, 13, 0), (20, 0, 0, 0, 30)]:
        P = sum(counts)
        x, offs = _randn(P, K, seed=P + 34, dtype=dtype), _offsets(counts)
        got = both(lambda x=x, offs=offs, P=P: block_fp8_grouped_mm(
            x, q, s, offs, out=_nan(P, N, dtype=dtype), scheme="w8a16"))
        _close(got, block_fp8_grouped_mm_ref(x, q, s, offs, scheme="w8a16"), dtype)


@pytest.mark.parametrize("x_load", block_fp8.GEMV_X_LOADS)
def test_block_fp8_gemv_loads_its_rows_either_way(x_load, monkeypatch):
    """The GEMV kernel with each activation-row load on both paths (block_fp8.GEMV_X_LOAD: in the weight
    tile's layout, or the 128-column group once, broadcast) matches the references: w8a8 and w8a16, 1 / 3 /
    8 rows, K = 300 (a part group last), dense with bias and grouped, each program over all of K and K split
    per group."""
    monkeypatch.setattr(block_fp8, "GEMV_X_LOAD", {"dense": x_load, "grouped": x_load})
    K, N, E, dtype = 300, 40, 5, torch.bfloat16
    q, s = (t.to(DEVICE) for t in block_fp8_quantize(_randn(E, N, K, seed=41).cpu()))
    bias = _randn(N, seed=42, dtype=dtype)
    for target in (1, 10**6):
        monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", target)
        for scheme in block_fp8.SCHEMES:
            for M in (1, 3, 8):
                x = _randn(M, K, seed=M + 43, dtype=dtype)
                _close(block_fp8_linear(x, q[0], s[0], bias, out=_nan(M, N, dtype=dtype), impl="triton",
                                        scheme=scheme),
                       block_fp8_linear_ref(x, q[0], s[0], bias, scheme=scheme), dtype)
            counts = (0, 3, 0, 5, 1)
            x, offs = _randn(sum(counts), K, seed=44, dtype=dtype), _offsets(counts)
            _close(block_fp8_grouped_mm(x, q, s, offs, out=_nan(sum(counts), N, dtype=dtype), scheme=scheme),
                   block_fp8_grouped_mm_ref(x, q, s, offs, scheme=scheme), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("serial", [True, False])
def test_block_fp8_w8a16_tensor_core_kernel_matches_the_references(dtype, serial, monkeypatch):
    """The w8a16 tensor-core kernel (block_fp8.W8A16_DOT_MIN_ROWS forced to 1 row on both paths) matches the
    w8a16 references: dense with bias at 1 / 3 / 16 / 20 / 100 rows (16-, 32- and 64-row tiles, part
    tiles), N = 40 (a part N tile) and 200 (tiles in two scale blocks), K = 300 (a part group last), each
    program over all of K and K split per group, the split summed inside the launch or by splitk_sum;
    grouped over experts with 0 / 3 / 0 / 20 / 1 rows (16-row tiles) and 100 / 90 / 110 / 0 / 40 (64). A
    float32 activation keeps the GEMV (no 16-bit MMA operands)."""
    monkeypatch.setattr(block_fp8, "W8A16_DOT_MIN_ROWS", {"dense": 1, "grouped": 1})
    monkeypatch.setattr(block_fp8, "SERIAL_SPLIT_SCHEMES", ("w8a16",) if serial else ())
    launched = []
    real = block_fp8._launch_w8a16_dot
    monkeypatch.setattr(block_fp8, "_launch_w8a16_dot", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    K, E = 300, 5
    for N in (40, 200):
        q, sc = (t.to(DEVICE) for t in block_fp8_quantize(_randn(E, N, K, seed=N + 50).cpu()))
        bias = _randn(N, seed=51, dtype=dtype)
        for target in (1, 10**6):
            monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", target)
            for M in (1, 3, 16, 20, 100):  # 16-row tiles, then 32 and 64 (two tiles at 100)
                x = _randn(M, K, seed=M + 52, dtype=dtype)
                _close(block_fp8_linear(x, q[0], sc[0], bias, out=_nan(M, N, dtype=dtype), impl="triton",
                                        scheme="w8a16"),
                       block_fp8_linear_ref(x, q[0], sc[0], bias, scheme="w8a16"), dtype)
            for counts in ((0, 3, 0, 20, 1), (100, 90, 110, 0, 40)):  # 16- and 64-row tiles per expert
                x, offs = _randn(sum(counts), K, seed=53, dtype=dtype), _offsets(counts)
                out = _nan(sum(counts), N, dtype=dtype)
                got = block_fp8_grouped_mm(x, q, sc, offs, out=out, scheme="w8a16")
                _close(got, block_fp8_grouped_mm_ref(x, q, sc, offs, scheme="w8a16"), dtype)
    assert len(launched) == 2 * 2 * 7  # every product above took the tensor-core kernel
    launched.clear()
    x32 = _randn(3, K, seed=54)
    _close(block_fp8_linear(x32, q[0], sc[0], None, impl="triton", scheme="w8a16"),
           block_fp8_linear_ref(x32, q[0], sc[0], None, scheme="w8a16"), torch.float32)
    assert not launched


def test_the_w8a16_tensor_core_kernel_runs_where_measured_ahead():
    """W8A16_DOT_MIN_ROWS as measured (kernels/quant/block_fp8.py): the dense path takes the tensor-core
    kernel from 1 row, the grouped path never (its GEMV leads at decode's rows per expert); a threshold
    applies per path and to 16-bit activations only (float32 x keeps the GEMV)."""
    x = torch.zeros(8, 128, dtype=torch.bfloat16)
    assert block_fp8.W8A16_DOT_MIN_ROWS == {"dense": 1, "grouped": None}
    assert block_fp8.use_w8a16_dot(x, 1, grouped=False)
    assert block_fp8.use_w8a16_dot(x.half(), 8, grouped=False)
    assert not block_fp8.use_w8a16_dot(x, 64, grouped=True)
    assert not block_fp8.use_w8a16_dot(x.float(), 1, grouped=False)
    saved = dict(block_fp8.W8A16_DOT_MIN_ROWS)
    try:
        block_fp8.W8A16_DOT_MIN_ROWS.update(dense=4)
        assert block_fp8.use_w8a16_dot(x, 4, grouped=False)
        assert not block_fp8.use_w8a16_dot(x, 3, grouped=False)
        assert not block_fp8.use_w8a16_dot(x, 64, grouped=True)
        assert not block_fp8.use_w8a16_dot(x.float(), 64, grouped=False)
    finally:
        block_fp8.W8A16_DOT_MIN_ROWS.clear()
        block_fp8.W8A16_DOT_MIN_ROWS.update(saved)


def test_nvfp4_direct_decode_reads_every_code_as_its_value():
    """e2m1_word_f32 (the "direct" decode): each of the 16 codes, at each of a word's 8 positions, is its e2m1
    value times 2^-126 exactly (code 0.5 an fp32 subnormal, kept), in the fp32 bits themselves."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(w_ptr, o_ptr, WORDS: tl.constexpr):
        offs = tl.arange(0, WORDS)
        e0, e1, e2, e3, e4, e5, e6, e7 = nvfp4.e2m1_word_f32(tl.load(w_ptr + offs))
        tl.store(o_ptr + offs * 8 + 0, e0)
        tl.store(o_ptr + offs * 8 + 1, e1)
        tl.store(o_ptr + offs * 8 + 2, e2)
        tl.store(o_ptr + offs * 8 + 3, e3)
        tl.store(o_ptr + offs * 8 + 4, e4)
        tl.store(o_ptr + offs * 8 + 5, e5)
        tl.store(o_ptr + offs * 8 + 6, e6)
        tl.store(o_ptr + offs * 8 + 7, e7)

    codes = (torch.arange(16, dtype=torch.uint8)[:, None] + torch.arange(8, dtype=torch.uint8)) % 16
    w = nvfp4.nvfp4_pack(codes).view(torch.int32).reshape(-1).to(DEVICE)
    out = torch.full((16 * 8,), float("nan"), device=DEVICE)
    decode[(1,)](w, out, WORDS=16)
    want = nvfp4.e2m1_values(codes.long()).float() * 2.0 ** -126
    assert torch.equal(out.cpu().reshape(16, 8), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_direct_decode_equals_the_convert_decode(dtype, monkeypatch):
    """DECODE "direct" (fp32 bit patterns, scaled by powers of two folded out at the end) gives the same
    bits as "convert" (fp16 patterns converted to fp32) in both kernels: the GEMV (dense 1 and 8 rows,
    grouped) and the tensor-core kernel (dense 20 rows, grouped past GROUPED_GEMV_MAX_ROWS), since every
    scaling is by a power of two and no value leaves fp32's normal range; and both match the reference.
    An unknown DECODE is refused by name."""
    E, N, K = 3, 40, 256
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(E, N, K, seed=23).cpu()))
    counts = (5, 0, 30)
    cases = [(_randn(M, K, seed=M, dtype=dtype), None) for M in (1, 8, 20)]
    cases.append((_randn(sum(counts), K, seed=9, dtype=dtype), _offsets(counts)))

    def run(decode, x, offs):
        monkeypatch.setattr(nvfp4, "DECODE", {"gemv": decode, "mma": decode})
        if offs is None:
            return nvfp4_linear(x, q[0], s[0], s2[0], out=_nan(x.shape[0], N, dtype=dtype))
        return nvfp4_grouped_mm(x, q, s, s2, offs, out=_nan(x.shape[0], N, dtype=dtype))

    for x, offs in cases:
        direct = run("direct", x, offs)
        assert torch.equal(direct, run("convert", x, offs)), (x.shape, offs)
        ref = (nvfp4_linear_ref(x, q[0], s[0], s2[0]) if offs is None
               else nvfp4_grouped_mm_ref(x, q, s, s2, offs))
        _close(direct, ref, dtype)
    monkeypatch.setattr(nvfp4, "DECODE", {"gemv": "lut", "mma": "convert"})
    with pytest.raises(ValueError, match="nvfp4.DECODE"):
        nvfp4_linear(cases[0][0], q[0], s[0], s2[0])


@pytest.mark.parametrize("target", [1, 10**6])
def test_nvfp4_gemv_with_and_without_split_k(target, monkeypatch):
    """The NVFP4 decode GEMV path (codes as words, <= 8 rows per matrix), K = 600 in 128 / 256 / 512-column
    steps (64 / 32 / 16-wide N tiles), the last partial, and a partial last 16-column scale block; each
    program over all of K (target 1) or one step per program with the partial sums added by splitk_sum
    (with the bias); dense at 2 and 8 rows, grouped with 1-13 rows per expert; at target 1 also the grouped
    tensor-core decode tile (10 rows per expert)."""
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", target)
    K, N, E, dtype = 600, 40, 5, torch.bfloat16
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(E, N, K, seed=17).cpu()))
    bias = _randn(N, seed=18, dtype=dtype)
    for M in (2, 8):
        x = _randn(M, K, seed=M + 30, dtype=dtype)
        _close(nvfp4_linear(x, q[0], s[0], s2[0], bias, out=_nan(M, N, dtype=dtype)),
               nvfp4_linear_ref(x, q[0], s[0], s2[0], bias), dtype)
    for counts in [(3, 0, 13, 0, 1)] + ([(20, 0, 0, 0, 30)] if target == 1 else []):  # then the MMA tile
        x, offs = _randn(sum(counts), K, seed=19, dtype=dtype), _offsets(counts)
        _close(nvfp4_grouped_mm(x, q, s, s2, offs, out=_nan(sum(counts), N, dtype=dtype)),
               nvfp4_grouped_mm_ref(x, q, s, s2, offs), dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "block_fp8"])
def test_grouped_launches_above_the_rows_bound_take_the_tensor_core_kernel(fmt, monkeypatch):
    """GROUPED_GEMV_MAX_ROWS (each format's kernel file): a grouped launch with more rows in all than its
    format's bound takes the tensor-core kernel even at few rows per expert (and still matches the reference);
    at or below it, the GEMV; dense launches follow GEMV_MAX_ROWS alone."""
    from kernels.quant import block_fp8 as fp8_mod
    from kernels.quant import nvfp4 as nvfp4_mod

    mod = nvfp4_mod if fmt == "nvfp4" else fp8_mod
    bound = mod.GROUPED_GEMV_MAX_ROWS
    assert quant_common.use_gemv(2.0, grouped_rows=bound, grouped_max_rows=bound)
    assert not quant_common.use_gemv(2.0, grouped_rows=bound + 1, grouped_max_rows=bound)
    assert quant_common.use_gemv(2.0) and not quant_common.use_gemv(9.0)
    gemv_calls = []
    real = mod._launch_gemv
    monkeypatch.setattr(mod, "_launch_gemv", lambda *a, **k: gemv_calls.append(1) or real(*a, **k))
    K, N, E, dtype = 256, 40, 5, torch.bfloat16 if fmt == "nvfp4" else torch.float16
    counts = (3, 0, 13, 0, 1)  # 17 rows, 3.4 per expert present: the GEMV by rows per expert
    x, offs = _randn(sum(counts), K, seed=40, dtype=dtype), _offsets(counts)
    w = _randn(E, N, K, seed=41).cpu()
    for bound, want_gemv in ((17, True), (16, False)):
        monkeypatch.setattr(mod, "GROUPED_GEMV_MAX_ROWS", bound)
        gemv_calls.clear()
        if fmt == "nvfp4":
            q, sc, s2 = (t.to(DEVICE) for t in nvfp4_quantize(w))
            y, ref = nvfp4_grouped_mm(x, q, sc, s2, offs), nvfp4_grouped_mm_ref(x, q, sc, s2, offs)
        else:
            q, sc = (t.to(DEVICE) for t in block_fp8_quantize(w))
            y, ref = block_fp8_grouped_mm(x, q, sc, offs), block_fp8_grouped_mm_ref(x, q, sc, offs)
        assert bool(gemv_calls) == want_gemv, (bound, gemv_calls)
        _close(y, ref, dtype)


def test_gemv_config_splits_k_only_where_n_tiles_are_too_few():
    # Qwen3-Next at one decode token: q / gate 2048 -> 8192 fills the GPU with 16-wide N tiles; k / v
    # 2048 -> 512 and o 4096 -> 2048 split K; 8 rows per program at 8 rows, 1 at 1.
    assert quant_common.gemv_config(1, 8192, 1, 16) == (1, 16, 1, 16)
    bm, bn, split, steps = quant_common.gemv_config(1, 512, 1, 16)
    assert (bm, bn) == (1, 16) and split > 1 and split * steps >= 16 > (split - 1) * steps
    assert quant_common.gemv_config(1, 2048, 1, 32)[2] > 1
    assert quant_common.gemv_config(8, 8192, 1, 16)[0] == 8
    assert quant_common.gemv_config(1.2, 2048, 74, 4)[:3] == (2, 64, 1)  # Qwen3-Next down, 8 tokens


def test_block_scaled_mm_probe_and_impl_choice_on_the_cpu():
    assert block_scaled_mm_supported("cpu") is False
    q, s = block_fp8_quantize(torch.randn(128, 128))
    with pytest.raises(ValueError, match="impl='scaled_mm' needs"):
        block_fp8_linear(torch.randn(2, 128), q, s, impl="scaled_mm")
    with pytest.raises(ValueError, match="impl must be one of"):
        block_fp8_linear(torch.randn(2, 128), q, s, impl="cublas")


# ---------------------------------------------------------------------------------------------------------
# dispatch and input checks
# ---------------------------------------------------------------------------------------------------------


def test_plain_cpu_run_calls_the_references(monkeypatch):
    monkeypatch.setattr(nvfp4, "use_kernel", lambda x: False)
    monkeypatch.setattr(block_fp8, "use_kernel", lambda x: False)
    x = torch.randn(3, 48)
    q, s, s2 = nvfp4_quantize(torch.randn(16, 48))
    assert torch.equal(nvfp4_linear(x, q, s, s2), nvfp4_linear_ref(x, q, s, s2))
    qf, sf = block_fp8_quantize(torch.randn(16, 48))
    assert torch.equal(block_fp8_linear(x, qf, sf), block_fp8_linear_ref(x, qf, sf))
    assert torch.equal(block_fp8_linear(x, qf, sf, scheme="w8a16"),
                       block_fp8_linear_ref(x, qf, sf, scheme="w8a16"))
    qa, sa = quantize_activation_per_token_group(x)
    assert torch.equal(sa, quantize_activation_per_token_group_ref(x)[1])


def test_bad_inputs_are_refused_with_the_reason():
    q, s, s2 = nvfp4_quantize(torch.randn(16, 32))
    x = torch.randn(2, 32)
    fp8 = block_fp8_quantize(torch.randn(16, 32))
    cases = [
        (lambda: nvfp4_linear(x, q.view(torch.int8), s, s2), "weight must be uint8"),
        (lambda: nvfp4_linear(x, q, s.float(), s2), "weight_scale must be float8_e4m3fn"),
        (lambda: nvfp4_linear(x, q, s[:, :1], s2), r"weight_scale must have shape \(16, 2\)"),
        (lambda: nvfp4_linear(x, q, s, torch.ones(2)), "weight_scale_2 must have shape"),
        (lambda: nvfp4_linear(torch.randn(2, 30), q, s, s2), "K = 32"),
        (lambda: nvfp4_linear(x.long(), q, s, s2), "x dtype"),
        (lambda: nvfp4_linear(x, q, s, s2, torch.zeros(15)), r"bias must have shape \(16,\)"),
        (lambda: nvfp4_grouped_mm(x, q[None], s[None], s2[None], torch.tensor([2])), "offsets must be int32"),
        (lambda: nvfp4_grouped_mm(x, q[None], s[None], s2.reshape(1), torch.tensor([1, 2]).int()),
         r"offsets must have shape \(1,\)"),
        (lambda: nvfp4_quantize(torch.randn(4, 31)), "must be even"),
        (lambda: block_fp8_linear(x, q, torch.ones(1, 1)), "weight must be float8_e4m3fn"),
        (lambda: block_fp8_linear(x, torch.zeros(16, 32).to(FP8), torch.ones(2, 1)),
         r"weight_scale_inv must have shape \(1, 1\)"),
        (lambda: quantize_activation_per_token_group(x, group=0), "group must be a positive int"),
        (lambda: block_fp8_linear(x, *fp8, scheme="w4a16"),
         r"scheme must be one of \('w8a8', 'w8a16'\), got 'w4a16'"),
        (lambda: block_fp8_linear(x, *fp8, impl="scaled_mm", scheme="w8a16"),
         "scheme='w8a16' runs the Triton GEMV"),
        (lambda: block_fp8_grouped_mm(x, fp8[0][None], fp8[1][None], torch.tensor([2]).int(), scheme="a16"),
         "scheme must be one of"),
        (lambda: block_fp8_linear_ref(x, *fp8, scheme="w8"), "scheme must be one of"),
    ]
    for call, says in cases:
        with pytest.raises(ValueError, match=says):
            call()


# ---------------------------------------------------------------------------------------------------------
# every tile configuration (the small shapes above all take the narrowest decode tile)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["decode_wide_n", "prefill"])
def test_other_tile_configs_match_reference(config, monkeypatch):
    """decode_wide_n: 64-wide N tiles (as at the released shapes; forced by lowering the program target);
    prefill: >= 64 rows per weight matrix, 64 x 128 tiles (and BLOCK_K 64 for NVFP4)."""
    if config == "decode_wide_n":
        monkeypatch.setattr(quant_common, "TARGET_PROGRAMS", 1)
        M, counts, K = 3, (3, 0, 13, 0, 1), 272
    else:
        M, counts, K = 64, (0, 128), 48
    assert quant_common.tile_config(M if config == "prefill" else 1, 40, 1)[1] == (128 if config == "prefill"
                                                                                  else 64)
    N, E, dtype = 40, len(counts), torch.float16
    x, xg = _randn(M, K, seed=11, dtype=dtype), _randn(sum(counts), K, seed=12, dtype=dtype)
    offs = _offsets(counts)
    q, s, s2 = (t.to(DEVICE) for t in nvfp4_quantize(_randn(E, N, K, seed=13).cpu()))
    _close(nvfp4_linear(x, q[0], s[0], s2[0], out=_nan(M, N, dtype=dtype)),
           nvfp4_linear_ref(x, q[0], s[0], s2[0]), dtype)
    _close(nvfp4_grouped_mm(xg, q, s, s2, offs, out=_nan(len(xg), N, dtype=dtype)),
           nvfp4_grouped_mm_ref(xg, q, s, s2, offs), dtype)
    qf, sf = (t.to(DEVICE) for t in block_fp8_quantize(_randn(E, N, K, seed=14).cpu()))
    _close(block_fp8_linear(x, qf[0], sf[0], out=_nan(M, N, dtype=dtype), impl="triton"),
           block_fp8_linear_ref(x, qf[0], sf[0]), dtype)
    _close(block_fp8_grouped_mm(xg, qf, sf, offs, out=_nan(len(xg), N, dtype=dtype)),
           block_fp8_grouped_mm_ref(xg, qf, sf, offs), dtype)


def test_static_fp8_quantization_kernel_is_bit_identical_to_the_reference():
    """kernels.quant.fp8.quantize_fp8 (one launch, the per-tensor static scale read from device memory) gives
    the reference's codes bit for bit: every input dtype, magnitudes from 1e-6 to 1e3 times the scale, values
    past +-448 (clamped), +0 and -0, a size that is not a multiple of the block, a non-contiguous input and an
    ``out`` buffer; a per-row scale and a Python float take the reference; a wrong ``out`` is refused."""
    from kernels.quant.fp8 import FP8_DTYPE, QUANT_BLOCK, quantize_fp8, quantize_fp8_ref

    scale = torch.tensor(0.05, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (_randn(3, QUANT_BLOCK // 2 + 7, seed=51) * torch.logspace(-6, 3, QUANT_BLOCK // 2 + 7,
                                                                         device=DEVICE)).to(dtype)
        x[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0], device=DEVICE, dtype=dtype)
        for inp in (x, x.t()):
            want = quantize_fp8_ref(inp, scale)
            assert torch.equal(quantize_fp8(inp, scale).view(torch.uint8), want.view(torch.uint8)), dtype
        out = torch.full(x.shape, float("nan"), device=DEVICE).to(FP8_DTYPE)
        assert quantize_fp8(x, scale, out=out) is out
        assert torch.equal(out.view(torch.uint8), quantize_fp8_ref(x, scale).view(torch.uint8))
    rows = torch.rand(3, 1, device=DEVICE) + 0.01
    assert torch.equal(quantize_fp8(x, rows).view(torch.uint8), quantize_fp8_ref(x, rows).view(torch.uint8))
    assert torch.equal(quantize_fp8(x, 0.5).view(torch.uint8), quantize_fp8_ref(x, 0.5).view(torch.uint8))
    with pytest.raises(ValueError, match="out must be a contiguous float8_e4m3fn tensor"):
        quantize_fp8(x, scale, out=torch.empty(x.shape, device=DEVICE))


def test_block_fp8_split_counters_are_not_first_allocated_inside_a_capture(monkeypatch):
    """The serial split-K counters are allocated zeroed at the first eager launch on a device; asked for the
    first time while a CUDA graph is captured (where the zero fill would run only at replay) they are None,
    and the launch takes the two-launch split."""
    monkeypatch.setattr(block_fp8, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert block_fp8._split_counters(torch.device("cuda"), 1) is None
    assert block_fp8._COUNTERS == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cpu = block_fp8._split_counters(torch.device("cpu"), 1)
    assert cpu is not None and not cpu.any() and block_fp8._split_counters(torch.device("cpu"), 1) is cpu
    assert block_fp8._split_counters(torch.device("cpu"), block_fp8.SERIAL_COUNTERS + 1) is None
