"""The "cuda" per-pair kernels (kernels/quant/pair_gemv.cu, launched by kernels/quant/pair_cuda.py) on the
CPU: their own source in host emulation (tests/pair_gemv_host.cc: g++, one thread per CUDA thread, the MMA
emulated over each warp) against the dequantizing references: NVFP4 with every e2m1 code and e4m3 scales
across their range (subnormals and a NaN included), block FP8 with every finite e4m3 code (subnormals
included) and several 128 x 128 scale blocks, partial row tiles and chunks and gated pairs; nvcc's build for
sm_90; and the dispatch rule. The GPU tests (tests/test_kernels_quant_moe_gemv_gpu.py) run them for real."""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import _nvcc
from kernels.moe_gemv import ACT_CODES, act_ref
from kernels.quant import block_fp8 as bf8
from kernels.quant import nvfp4 as nf4
from kernels.quant import pair_cuda
from kernels.quant.block_fp8 import BLOCK
from kernels.quant.nvfp4 import nvfp4_dequantize

HOST_SOURCE = Path(__file__).with_name("pair_gemv_host.cc")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@functools.cache
def _host_lib(folder: str):
    out = str(Path(folder) / "pair_gemv_host.so")
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{pair_cuda.SOURCE.parent}",
           str(HOST_SOURCE), "-o", out]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    lib = ctypes.CDLL(out)
    lib.nvp_host_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong)]
    return lib


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    return _host_lib(str(tmp_path_factory.mktemp("pair_gemv_host")))


def _experts(E, N, K, gen, nan_scale=False):
    """Random NVFP4 experts: every code byte, every finite e4m3 scale byte (subnormals included), global
    scales around ModelOpt's magnitude; optionally one NaN scale."""
    codes = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    sbytes = torch.randint(0, 127, (E, N, K // 16), generator=gen, dtype=torch.uint8)  # 0x00-0x7E: +finite
    sbytes |= (torch.randint(0, 2, sbytes.shape, generator=gen, dtype=torch.uint8) << 7)  # either sign
    if nan_scale:
        sbytes[0, 1, 0] = 0x7F
    scales = sbytes.view(torch.float8_e4m3fn)
    s2 = torch.rand(E, generator=gen) * 1e-3 + 1e-4
    return codes, scales, s2


def _fp8_experts(E, N, K, gen):
    """Random block-FP8 experts: every finite e4m3 code of either sign (subnormals included), block scales
    weight_scale_inv spread over a few decades."""
    codes = torch.randint(0, 127, (E, N, K), generator=gen, dtype=torch.uint8)  # 0x00-0x7E, 448 included
    codes |= torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8) << 7
    scales = torch.rand(E, -(-N // BLOCK), -(-K // BLOCK), generator=gen) * 10.0 ** torch.randint(
        -4, 0, (E, -(-N // BLOCK), -(-K // BLOCK)), generator=gen).float()
    return codes.view(torch.float8_e4m3fn), scales


def _dequantize(fmt, m, idx):
    """Expert idx[p]'s matrix for each pair, dequantized in float32: [P, N, K]."""
    if fmt == "nvfp4":
        return nvfp4_dequantize(m[0][idx], m[1][idx], m[2][idx], torch.float32)
    w, ws = m[0][idx].float(), m[1][idx]
    N, K = w.shape[1:]
    return w * ws.repeat_interleave(BLOCK, 1)[:, :N].repeat_interleave(BLOCK, 2)[:, :, :K]


def _projection_ref(x, idx, w, w2, topk, act, fmt="nvfp4"):
    """One projection of the per-pair path: row p // topk of x times expert idx[p]'s dequantized matrix,
    summed in fp32, rounded to bf16, the activation (and a gated pair's rounded up projection) in bf16."""
    rows = x[torch.arange(idx.numel()) // topk].float()

    def lin(m):
        return torch.einsum("pnk,pk->pn", _dequantize(fmt, m, idx), rows).to(torch.bfloat16)

    y = lin(w)
    if act != "none":
        y = act_ref(y, act)
    if w2 is not None:
        y = y * lin(w2)
    return y


def _host_launch(lib, x, idx, w, w2, topk, act, fmt="nvfp4", prefetch=False, form="split", ctas=0, rc=0):
    P, N = idx.numel(), w[0].shape[1]
    out = torch.full((P, N), float("nan"), dtype=torch.bfloat16)
    code = 0 if act == "none" else ACT_CODES[act]
    c_ptrs, c_ints = pair_cuda.launch_args(fmt, x, idx, w, w2, out, topk, code, prefetch=prefetch, form=form,
                                           ctas=ctas)
    assert lib.nvp_host_launch(c_ptrs, c_ints) == rc
    return out


# (E, N, K, pairs, topk, activation, gated, strided x): N 40 and 24 end in partial 16-row tiles; K 96 is
# one partial chunk (the last lane past K), K 704 five whole chunks (warp 0 takes two in one step) and a
# partial one (warp 1's), K 256 two whole chunks; topk > 1 makes pairs share their input row
CASES = {
    "down_partial_chunk": (5, 40, 96, 6, 1, "none", False, False),
    "up_relu2_chunks_and_tail": (4, 32, 704, 4, 2, "relu2", False, True),
    "gated_silu": (6, 24, 256, 6, 3, "silu", True, False),
}
# block FP8: N 272 spans three 128-row scale blocks (the last partial) in 17 row tiles; K 416 is three whole
# chunks (three scale blocks) and a partial one (its own block); K 128 is one chunk, gated
FP8_CASES = {
    "fp8_down_blocks_and_tail": (3, 272, 416, 4, 1, "none", False, True),
    "fp8_gated_silu": (4, 40, 128, 4, 2, "silu", True, False),
}


def test_repacked_codes_decode_to_each_column_pair():
    """kernels.quant.nvfp4.repack_codes is a bit permutation of each 32-bit word (REPACK_BITS covers the 32
    bits once; unrepack_codes undoes it), and the .cu's four decodes of a repacked word (Nvfp4Repacked::pair,
    written out here in Python) give column pair (2j, 2j + 1) as bf16x2 halves with the code's magnitude at
    bits 6-8 and its sign at bit 15, nothing else set, for every code in every column; a K that is not whole
    words is refused."""
    assert sorted(b for bits in nf4.REPACK_BITS for b in bits) == list(range(32))
    i = torch.arange(256)
    # every byte value at every byte of a word (every code in every column): 2 experts x 16 rows x 8 words
    codes = torch.stack([(i + 37 * j) % 256 for j in range(4)], dim=-1).to(torch.uint8).reshape(2, 16, 32)
    packed = nf4.repack_codes(codes)
    assert packed.shape == codes.shape and packed.dtype == torch.uint8 and not torch.equal(packed, codes)
    assert torch.equal(nf4.unrepack_codes(packed), codes)
    mask = 0x81C081C0

    def rotl(v, r):
        return ((v << r) | (v >> (32 - r))) & 0xFFFFFFFF

    def word(b):
        return int(b[0]) | int(b[1]) << 8 | int(b[2]) << 16 | int(b[3]) << 24

    natural = nf4.nvfp4_unpack(codes).reshape(-1, 8)  # codes of 8 columns per word
    for v, cols in zip((word(b) for b in packed.reshape(-1, 4)), natural.tolist()):
        pairs = (v & mask, (v << 4) & mask, rotl(v, 10) & mask,
                 ((v << 6) & 0x80C080C0) | ((v >> 2) & 0x01000100))
        for j, out in enumerate(pairs):
            for h in range(2):
                half, code = (out >> (16 * h)) & 0xFFFF, cols[2 * j + h]
                assert half & ~0x81C0 == 0
                assert (half >> 6) & 7 == code & 7 and half >> 15 == code >> 3
    with pytest.raises(ValueError, match="K % 8 == 0"):
        nf4.repack_codes(torch.zeros(2, 6, dtype=torch.uint8))


def test_repack_words_in_chunks_and_its_table_checks(monkeypatch):
    """kernels/quant/_common.repack_words gives the same words whatever its chunk size (REPACK_CHUNK_BYTES,
    a chunk boundary inside a row), reads strided codes, and refuses a table that is not a permutation of the
    32 bits in codes of equal width."""
    from kernels.quant import _common

    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (5, 9, 24), generator=gen, dtype=torch.uint8)
    whole = _common.repack_words(codes, nf4.REPACK_BITS, "t")
    monkeypatch.setattr(_common, "REPACK_CHUNK_BYTES", 12)  # 3 words a step
    assert torch.equal(_common.repack_words(codes, nf4.REPACK_BITS, "t"), whole)
    assert torch.equal(_common.repack_words(codes[:, :, 8:], nf4.REPACK_BITS, "t"), whole[:, :, 8:])
    uneven = ((0, 1, 2), (3, 4, 5, 6, 7)) + tuple(tuple(range(8 + 4 * i, 12 + 4 * i)) for i in range(6))
    assert sorted(b for code in uneven for b in code) == list(range(32))  # a permutation, widths 3 and 5
    for bad in (((0,) * 4,) * 8, uneven):
        with pytest.raises(ValueError, match="each of a word's 32 bits once"):
            _common.repack_words(codes, bad, "t")


def test_repacked_fp8_codes_decode_to_each_column_pair():
    """kernels.quant.block_fp8.repack_codes is a bit permutation of each 32-bit word (unrepack_codes undoes
    it) and the .cu's two decodes of a repacked word (BlockFp8Repacked::pair, written out here) give column
    pairs (0, 1) and (2, 3) as bf16x2 halves with the code's 7 magnitude bits at bits 4-10 and its sign at 15,
    nothing else set, for every byte value in every column; other dtypes are refused."""
    assert sorted(b for bits in bf8.REPACK_BITS for b in bits) == list(range(32))
    i = torch.arange(256)
    codes = torch.stack([(i + 37 * j) % 256 for j in range(4)], dim=-1).to(torch.uint8).reshape(4, 8, 32)
    packed = bf8.repack_codes(codes.view(torch.float8_e4m3fn))
    assert packed.dtype == torch.float8_e4m3fn and packed.shape == codes.shape
    assert torch.equal(bf8.unrepack_codes(packed).view(torch.uint8), codes)

    def rotl(v, r):
        return ((v << r) | (v >> (32 - r))) & 0xFFFFFFFF

    for word, cols in zip(packed.view(torch.uint8).reshape(-1, 4).tolist(), codes.reshape(-1, 4).tolist()):
        v = word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24
        pairs = (v & 0x87F087F0, ((v << 4) & 0x00700070) | (rotl(v, 12) & 0x87808780))
        for j, out in enumerate(pairs):
            for h in range(2):
                half, code = (out >> (16 * h)) & 0xFFFF, cols[2 * j + h]
                assert half & ~0x87F0 == 0 and (half >> 4) & 0x7F == code & 0x7F and half >> 15 == code >> 7
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        bf8.repack_codes(codes)


def _repack(fmt, m):
    """Experts tuple ``m`` of format `fmt` with its codes repacked (kernels.quant.<fmt>.repack_codes); None
    stays None."""
    return m and ((nf4 if fmt == "nvfp4" else bf8).repack_codes(m[0]), *m[1:])


@needs_gxx
@pytest.mark.parametrize("repacked", (False, True))
@pytest.mark.parametrize("case", list(CASES) + list(FP8_CASES))
def test_host_emulated_kernel_matches_the_dequantizing_reference(host_lib, case, repacked):
    """The per-pair kernel of each format against its dequantizing reference (block FP8: w8a16).
    Repacked ("<fmt>_repacked": the codes repacked at load time, the cheaper decode, x's words unpermuted):
    the kernel on repacked codes against the reference of the natural codes with the same tolerance, and
    against the natural kernel (the MMAs pair other columns: fp32 order only); natural codes read as repacked
    give other results, so the format code does change the decode."""
    fmt = "nvfp4" if case in CASES else "block_fp8"
    E, N, K, P, topk, act, gated, strided = {**CASES, **FP8_CASES}[case]
    gen = torch.Generator().manual_seed(len(case) + (0 if fmt == "nvfp4" else 100))
    make = _experts if fmt == "nvfp4" else _fp8_experts
    w = make(E, N, K, gen)
    w2 = make(E, N, K, gen) if gated else None
    pad = (64 if fmt == "nvfp4" else 32) if strided else 0
    x = (torch.randn(P // topk, K + pad, generator=gen) * 2).to(torch.bfloat16)[:, :K]
    idx = torch.randint(0, E, (P,), generator=gen)
    kernel_fmt = f"{fmt}_repacked" if repacked else fmt
    # everything but the device fits
    assert pair_cuda.unsupported(kernel_fmt, x, w, w2, P) == "CUDA tensors only, got cpu"
    codes = (_repack(fmt, w), _repack(fmt, w2)) if repacked else (w, w2)
    got = _host_launch(host_lib, x, idx, *codes, topk, act, fmt=kernel_fmt)
    want = _projection_ref(x, idx, w, w2, topk, act, fmt=fmt)
    assert not want.isnan().any()
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2 * scale.item())
    # most outputs land on the same bf16 value: the sums differ in fp32 order only
    assert (got == want).float().mean() > 0.9
    if repacked:
        natural = _host_launch(host_lib, x, idx, w, w2, topk, act, fmt=fmt)
        assert (got == natural).float().mean() > 0.9
        assert not torch.equal(_host_launch(host_lib, x, idx, w, w2, topk, act, fmt=kernel_fmt), natural)


@needs_gxx
@pytest.mark.parametrize("repacked", (False, True))
@pytest.mark.parametrize("case", list(CASES) + list(FP8_CASES))
def test_host_emulated_pair_persistent_kernel_matches_the_reference_on_any_grid(host_lib, case, repacked):
    """The per-pair persistent form (PAIR_FORM "persistent": each warp one pair's 16 rows over all of K,
    CTAs walking the (pair, 64-row) tiles, the next tile's codes loaded in the last step of the current one;
    a gated pair's gate and up together) on every case, natural and repacked codes: its dequantizing reference
    within the per-pair kernel's tolerance (the activation, and a gated pair's product, applied as the
    per-pair kernel applies them), mostly the per-pair kernel's values (each sum in another fp32 order), the
    same bits on 1, 3 and more CTAs than tiles (the grid capped at the tiles); a grid of no CTAs with no SM
    count is refused (cudaErrorInvalidValue's place in the harness: 1; the device launcher fills in its
    default)."""
    fmt = "nvfp4" if case in CASES else "block_fp8"
    E, N, K, P, topk, act, gated, strided = {**CASES, **FP8_CASES}[case]
    gen = torch.Generator().manual_seed(len(case) + 7)
    make = _experts if fmt == "nvfp4" else _fp8_experts
    w = make(E, N, K, gen)
    w2 = make(E, N, K, gen) if gated else None
    pad = (64 if fmt == "nvfp4" else 32) if strided else 0
    x = (torch.randn(P // topk, K + pad, generator=gen) * 2).to(torch.bfloat16)[:, :K]
    idx = torch.randint(0, E, (P,), generator=gen)
    kernel_fmt = f"{fmt}_repacked" if repacked else fmt
    codes = (_repack(fmt, w), _repack(fmt, w2)) if repacked else (w, w2)
    got = _host_launch(host_lib, x, idx, *codes, topk, act, fmt=kernel_fmt, form="persistent", ctas=2)
    want = _projection_ref(x, idx, w, w2, topk, act, fmt=fmt)
    assert not want.isnan().any()
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2 * scale.item())
    assert (got == want).float().mean() > 0.9
    split = _host_launch(host_lib, x, idx, *codes, topk, act, fmt=kernel_fmt)
    assert (got == split).float().mean() > 0.9
    tiles = -(-N // 64) * P
    for ctas in (1, 3, tiles + 2):
        again = _host_launch(host_lib, x, idx, *codes, topk, act, fmt=kernel_fmt, form="persistent",
                             ctas=ctas)
        assert torch.equal(again, got), ctas
    _host_launch(host_lib, x, idx, *codes, topk, act, fmt=kernel_fmt, form="persistent", ctas=0, rc=1)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] of t's elements (any strides)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _sectors(addrs: list[int], lo: int, hi: int) -> set[int]:
    """The 32-byte sectors (address // 32) of the addresses in [lo, hi)."""
    return {a // 32 for a in addrs if lo <= a < hi}


def _recorded(lib, kind: int) -> list[int]:
    n = lib.nvp_host_records(kind, None)
    out = (ctypes.c_longlong * n)()
    lib.nvp_host_records(kind, out)
    return list(out)


# (format, E, N, K, idx, topk, activation, gated): partial 16-row tiles (N 40 / 24 / 272) with the last
# expert routed, so the clamped rows sit at the very end of the tensors; whole and partial chunks (K 704 =
# 5.5 x 128, 416 = 3.25 x 128; 256), several 128-row FP8 scale blocks
PREFETCH_CASES = {
    "nvfp4": ("nvfp4", 3, 40, 704, (2, 0, 2, 1), 2, "relu2", False),
    "nvfp4_gated": ("nvfp4", 4, 24, 256, (3, 1, 0, 3), 2, "silu", True),
    "block_fp8": ("block_fp8", 3, 272, 416, (2, 1, 0), 1, "none", False),
}


@needs_gxx
@pytest.mark.parametrize("case", list(PREFETCH_CASES))
def test_host_emulated_prefetch_covers_exactly_what_the_loop_loads(host_lib, case):
    """PREFETCH's L2 prefetch (pair_gemv.cu's prefetch_rows), recorded by the host harness: the same output
    bits as without it; per weight tensor (each matrix's codes and scales apart), the 32-byte sectors it
    prefetches are exactly the sectors the kernel's loop loads from that tensor; no prefetch outside them;
    one prefetch per lane, row and chunk of codes, scales once per row (NVFP4) or once per CTA (block FP8: one
    128-row scale block)."""
    fmt, E, N, K, idx, topk, act, gated = PREFETCH_CASES[case]
    gen = torch.Generator().manual_seed(5)
    make = _experts if fmt == "nvfp4" else _fp8_experts
    w = make(E, N, K, gen)
    w2 = make(E, N, K, gen) if gated else None
    idx = torch.tensor(idx)
    x = (torch.randn(idx.numel() // topk, K, generator=gen) * 2).to(torch.bfloat16)
    host_lib.nvp_host_record(1)
    plain = _host_launch(host_lib, x, idx, w, w2, topk, act, fmt=fmt)
    loads = _recorded(host_lib, 0)
    host_lib.nvp_host_record(1)
    fetched = _host_launch(host_lib, x, idx, w, w2, topk, act, fmt=fmt, prefetch=True)
    prefetches = _recorded(host_lib, 1)
    host_lib.nvp_host_record(0)
    assert torch.equal(fetched.view(torch.int16), plain.view(torch.int16))
    tensors = [t for m in (w, w2) if m is not None for t in m[:2]]
    inside = 0
    for t in tensors:
        lo, hi = _byte_range(t)
        loaded, fetched_sectors = _sectors(loads, lo, hi), _sectors(prefetches, lo, hi)
        assert loaded, "the loop loads from every weight tensor"
        assert fetched_sectors == loaded
        inside += sum(lo <= a < hi for a in prefetches)
    assert inside == len(prefetches)
    pieces = -(-K // 32)  # 32-column pieces below K: one lane each per chunk
    chunks = -(-K // 128)
    scale_prefetches = 16 * chunks if fmt == "nvfp4" else chunks  # rows g, g + 8 from t = 0; or lane 0 alone
    ctas = -(-N // 16) * idx.numel()
    assert len(prefetches) == ctas * (16 * pieces + scale_prefetches) * (2 if gated else 1)


def test_fp8_reference_here_is_the_module_reference():
    """This file's block-FP8 projection reference equals kernels.quant.block_fp8's own (w8a16) on one
    ungated projection, so the host test above checks against the format's specification."""
    gen = torch.Generator().manual_seed(3)
    E, L, I = 3, 256, 160
    up, down = _fp8_experts(E, I, L, gen), _fp8_experts(E, L, I, gen)
    h = torch.randn(2, L, generator=gen).to(torch.bfloat16)
    indices = torch.tensor([[0, 2], [1, 0]])
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    want = bf8.moe_gemv_block_fp8_ref(h, weights, indices, up, None, down, "relu2", scheme="w8a16")
    idx = indices.flatten()
    a = _projection_ref(h, idx, up, None, 2, "relu2", fmt="block_fp8")
    y = _projection_ref(a, idx, down, None, 1, "none", fmt="block_fp8").view(2, 2, -1)
    assert torch.equal((y.float() * weights[..., None]).sum(1).to(torch.bfloat16), want)


@needs_gxx
def test_host_emulated_kernel_keeps_a_nan_scale_in_its_row_only(host_lib):
    gen = torch.Generator().manual_seed(7)
    w = _experts(2, 16, 128, gen, nan_scale=True)
    x = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([0, 1])
    got = _host_launch(host_lib, x, idx, w, None, 2, "none")
    want = _projection_ref(x, idx, w, None, 2, "none")
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1 and got[0, 1].isnan()


def test_unsupported_names_each_missing_condition():
    gen = torch.Generator().manual_seed(0)
    w = _experts(2, 16, 128, gen)
    x = torch.randn(2, 128).to(torch.bfloat16)
    assert "bfloat16" in pair_cuda.unsupported("nvfp4", x.half(), w, None, 2)
    w48 = _experts(2, 16, 48, gen)
    assert "multiple of 32" in pair_cuda.unsupported("nvfp4", x[:, :48], w48, None, 2)
    assert "65535" in pair_cuda.unsupported("nvfp4", x, w, None, 70000)
    shifted = torch.randn(2, 129).to(torch.bfloat16)[:, 1:]
    assert "16-byte aligned" in pair_cuda.unsupported("nvfp4", shifted, w, None, 2)
    assert "CUDA tensors only" in pair_cuda.unsupported("nvfp4", x, w, None, 2)
    f8 = _fp8_experts(2, 16, 48, gen)
    assert "multiple of 32" in pair_cuda.unsupported("block_fp8", x[:, :48], f8, None, 2)
    f8 = _fp8_experts(2, 16, 128, gen)
    assert "scales must be torch.float32" in pair_cuda.unsupported("block_fp8", x, (f8[0], f8[1].bfloat16()),
                                                                   None, 2)
    assert "global scales" in pair_cuda.unsupported("nvfp4", x, (w[0], w[1], w[2].double()), None, 2)
    padded = torch.zeros(2, 16, 72, dtype=torch.uint8)[:, :, 4:68]  # rows start 4 bytes in: not 16-aligned
    assert "codes must be contiguous rows" in pair_cuda.unsupported("nvfp4", x, (padded, w[1], w[2]), None, 2)
    w2 = (torch.zeros(2, 16, 80, dtype=torch.uint8)[:, :, :64], w[1], w[2])  # row stride 80, not 64
    assert "share their strides" in pair_cuda.unsupported("nvfp4", x, w, w2, 2)
    offsets = torch.full((70000,), 2, dtype=torch.int32)
    assert "at most 65535 experts" in pair_cuda.grouped_unsupported("nvfp4", x, w, offsets)
    assert "rows per expert" in pair_cuda.grouped_unsupported("nvfp4", torch.randn(129, 128).bfloat16(), w,
                                                              torch.tensor([0, 129], dtype=torch.int32))
    with pytest.raises(ValueError, match="format must be one of"):
        pair_cuda.unsupported("mxfp4", x, w, None, 2)


def test_pair_kernel_setting_is_checked_and_falls_back_to_triton(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    w = _experts(2, 16, 128, gen)
    x = torch.randn(2, 128).to(torch.bfloat16)
    monkeypatch.setattr(nf4, "PAIR_KERNEL", "cuda")
    assert nf4.pair_kernel_for(x, w, None, 2) == "triton"  # CPU tensors: the CUDA kernel does not take them
    monkeypatch.setattr(nf4, "PAIR_KERNEL", "marlin")
    with pytest.raises(ValueError, match="PAIR_KERNEL must be one of"):
        nf4.pair_kernel_for(x, w, None, 2)
    f8 = _fp8_experts(2, 16, 128, gen)
    monkeypatch.setattr(bf8, "PAIR_KERNEL", "cuda")
    assert bf8.pair_kernel_for(x, f8, None, 2, a16=True) == "triton"  # CPU tensors
    assert bf8.pair_kernel_for(x, f8, None, 2, a16=False) == "triton"  # w8a8: Triton only
    monkeypatch.setattr(bf8, "PAIR_KERNEL", "fast")
    with pytest.raises(ValueError, match="block_fp8.PAIR_KERNEL must be one of"):
        bf8.pair_kernel_for(x, f8, None, 2, a16=True)


@pytest.mark.skipif(_nvcc.find_nvcc() is None, reason="nvcc is not installed here")
@pytest.mark.parametrize("arch", ("sm_80", "sm_89", "sm_90"))
def test_kernel_source_compiles_and_loads(arch, tmp_path, monkeypatch):
    """nvcc builds pair_gemv.cu into the cache for every architecture unsupported() admits (sm_80 and sm_89
    have no bf16x2 multiply: the fma form), a second build is the cached file; the library loads without a
    GPU and reports the ABI the launcher expects."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = pair_cuda.build(pair_cuda.build_flags(arch))
    assert path.parent == _nvcc.cache_dir() and path.stat().st_size > 0
    assert pair_cuda.build(pair_cuda.build_flags(arch)) == path
    assert pair_cuda.load(str(path)).nvp_abi() == pair_cuda.ABI


def test_no_nvcc_leaves_the_projection_to_triton(monkeypatch):
    """A GPU machine without the CUDA toolkit keeps the Triton kernel instead of failing at the first
    launch: unsupported names the missing nvcc (checked after everything else, so a CPU tensor still says so
    first)."""
    gen = torch.Generator().manual_seed(0)
    w = _experts(2, 16, 128, gen)
    x = torch.randn(2, 128).to(torch.bfloat16)
    monkeypatch.setattr(pair_cuda, "_nvcc_path", lambda: None)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert pair_cuda.unsupported("nvfp4", x, w, None, 2).startswith("no nvcc")
    monkeypatch.setattr(nf4, "PAIR_KERNEL", "cuda")
    assert nf4.pair_kernel_for(x, w, None, 2) == "triton"


def _grouped_inputs(fmt, E, N, K, counts, seed, extra_rows=0):
    """A grouped launch's inputs: E random experts [N, K] of `fmt` ("nvfp4" or "block_fp8"), x [sum(counts) +
    extra_rows, K] bf16 (the extra rows past offsets[-1]) and the int32 offsets of `counts` rows per expert,
    drawn in that order from a generator seeded `seed`, which is returned for what a test draws next."""
    gen = torch.Generator().manual_seed(seed)
    w = _experts(E, N, K, gen) if fmt == "nvfp4" else _fp8_experts(E, N, K, gen)
    x = (torch.randn(sum(counts) + extra_rows, K, generator=gen) * 2).to(torch.bfloat16)
    return w, x, torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32), gen


def _host_grouped(lib, fmt, x, w, offsets, form="split", x_permuted=False, rc=0, ctas=None, prefetch=False):
    """The grouped launch in the host harness; the persistent form on 3 CTAs unless `ctas` says (fewer than
    most cases' tiles: each CTA walks several); `prefetch` the m32 form's rolling L2 prefetch."""
    out = torch.full((x.shape[0], w[0].shape[1]), float("nan"), dtype=torch.bfloat16)
    if ctas is None:
        ctas = 3 if form == "persistent" else 0
    c_ptrs, c_ints = pair_cuda.launch_args(fmt, x, offsets, w, None, out, 1, 0, experts=offsets.numel(),
                                           form=form, x_permuted=x_permuted, ctas=ctas, prefetch=prefetch)
    lib.nvp_host_launch_grouped.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                            ctypes.POINTER(ctypes.c_longlong)]
    assert lib.nvp_host_launch_grouped(c_ptrs, c_ints) == rc
    return out


# (format, E, N, K, rows per expert): experts without rows, with one row, with 9 (two token groups, the
# second partial) and 37 (a second pass over the weights: more than 32 tokens); N 40 ends in a partial row
# tile (the wide form: a warp whose rows all lie past N), K 288 in a partial chunk after two whole ones (and,
# block FP8, a partial scale block); "_k416": three whole chunks (the wide form's step of one chunk) and N 72
# (a second 64-row tile, partial); "_k256" / "_k96": whole chunks only, a partial chunk only; "_k640" /
# "_k544": five / four whole chunks (the pipelined form's codes of the next two in flight, an odd and an even
# count) and 20 rows (three token groups: the pipelined form's passes of 16 and 4 rows)
GROUPED_CASES = {
    "nvfp4": ("nvfp4", 4, 40, 288, (0, 1, 9, 37)),
    "block_fp8": ("block_fp8", 4, 40, 288, (9, 0, 37, 1)),
    "nvfp4_k416": ("nvfp4", 3, 72, 416, (5, 0, 33)),
    "block_fp8_k416": ("block_fp8", 3, 72, 416, (33, 5, 0)),
    "nvfp4_k256": ("nvfp4", 2, 24, 256, (3, 10)),  # whole chunks only
    "block_fp8_k96": ("block_fp8", 2, 24, 96, (10, 3)),  # a partial chunk only
    "nvfp4_k640": ("nvfp4", 3, 40, 640, (20, 0, 11)),
    "block_fp8_k544": ("block_fp8", 2, 72, 544, (7, 20)),
}


@needs_gxx
@pytest.mark.parametrize("form", pair_cuda.GROUPED_FORMS)
@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_host_emulated_grouped_kernel_matches_the_grouped_reference(host_lib, case, form):
    """The grouped form against the format's grouped reference (block FP8: w8a16), with rows past
    offsets[-1] left unwritten: "split" (one CTA per 16 rows and expert, its warps splitting K), "wide"
    (one CTA per 64 rows and expert, a warp per 16 rows over all of K), "pipelined" (the wide form with the
    next chunks' codes in flight) and "persistent" (3 CTAs walking the pipelined form's tiles, the next pass's
    codes in flight across tiles); the expert's rows are the MMA's N. The pipelined and persistent forms add
    each sum in the wide form's order: the same bits."""
    fmt, E, N, K, counts = GROUPED_CASES[case]
    w, x, offsets, _ = _grouped_inputs(fmt, E, N, K, counts, 11, extra_rows=3)  # 3 rows past offsets[-1]
    P = sum(counts)
    got = _host_grouped(host_lib, fmt, x, w, offsets, form=form)
    if form in ("pipelined", "persistent", "m32"):  # NaN rows past offsets[-1] in both
        assert torch.equal(got[:P], _host_grouped(host_lib, fmt, x, w, offsets, form="wide")[:P])
    if fmt == "nvfp4":
        want = nf4.nvfp4_grouped_mm_ref(x, *w, offsets)
    else:
        want = bf8.block_fp8_grouped_mm_ref(x, *w, offsets, scheme="w8a16")
    assert got[P:].isnan().all()  # unwritten
    got, want = got[:P], want[:P]
    assert not want.isnan().any()
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2 * scale.item())
    assert (got == want).float().mean() > 0.9
    assert pair_cuda.grouped_unsupported(fmt, x, w, offsets) == "CUDA tensors only, got cpu"
    assert pair_cuda.grouped_unsupported(fmt, x, w, offsets.long()) == "offsets must be contiguous int32"


def _code_tiles(form: str, N: int) -> int:
    """16-row tiles whose codes a grouped form reads per pass over N output rows: each tile that starts below
    N; the m32 form's warps take 32 rows, so past a multiple of 32 they also read a second, clamped tile (its
    outputs never stored; every release shape is a multiple of 128)."""
    return 2 * -(-N // 32) if form == "m32" else -(-N // 16)


# Rows of one expert per pass over its weights, per grouped form (pair_gemv.cu: 4 token groups of 8, or 2 for
# the pipelined and persistent forms)
ROWS_PER_PASS = {"split": 32, "wide": 32, "pipelined": 16, "persistent": 16, "m32": 16}


@needs_gxx
@pytest.mark.parametrize("form", pair_cuda.GROUPED_FORMS)
@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_host_emulated_grouped_loads_stay_inside_and_read_the_codes_once_per_pass(host_lib, case, form):
    """Every load of each grouped form, recorded by the host harness, lies inside an argument tensor (x, the
    offsets, the codes, the scales, the global scales), and each 16-row tile of an expert with rows loads its
    codes exactly once per pass: 32 lanes x (2 x 16 bytes NVFP4, 4 x 16 block FP8) per 128-column chunk,
    ceil(rows / ROWS_PER_PASS) passes. A lookahead past the last chunk, or more passes than the form's, would
    change the count (or leave the tensors)."""
    fmt, E, N, K, counts = GROUPED_CASES[case]
    w, x, offsets, _ = _grouped_inputs(fmt, E, N, K, counts, 7)
    host_lib.nvp_host_record(1)
    _host_grouped(host_lib, fmt, x, w, offsets, form=form)
    loads = _recorded(host_lib, 0)
    host_lib.nvp_host_record(0)
    ranges = [_byte_range(t) for t in (x, offsets, *w)]
    outside = [a for a in loads if not any(lo <= a < hi for lo, hi in ranges)]
    assert not outside, f"{len(outside)} loads outside the argument tensors"
    lo, hi = _byte_range(w[0])
    code_loads = sum(lo <= a < hi for a in loads)
    per_chunk = 32 * (2 if fmt == "nvfp4" else 4)
    tiles = _code_tiles(form, N)
    passes = sum(-(-c // ROWS_PER_PASS[form]) for c in counts)
    assert code_loads == passes * tiles * -(-K // 128) * per_chunk


@needs_gxx
@pytest.mark.parametrize("case", [c for c in GROUPED_CASES if GROUPED_CASES[c][0] == "nvfp4"])
def test_host_emulated_xperm_forms_with_permuted_x_give_the_same_bits(host_lib, case):
    """X_PERM: the NVFP4 pipelined and m32 kernels fed x with each 8 columns in X_PERM_ORDER
    (permute_x_columns) take its words as the MMA's B registers unpermuted, and give the natural layout's
    pipelined result bit for bit; the flag on another form or format is refused (cudaErrorInvalidValue's
    place in the harness: 1)."""
    _, E, N, K, counts = GROUPED_CASES[case]
    w, x, offsets, gen = _grouped_inputs("nvfp4", E, N, K, counts, 5)
    want = _host_grouped(host_lib, "nvfp4", x, w, offsets, form="pipelined")
    for form in ("pipelined", "m32"):
        got = _host_grouped(host_lib, "nvfp4", pair_cuda.permute_x_columns(x), w, offsets, form=form,
                            x_permuted=True)
        assert torch.equal(got, want), form
        assert not torch.equal(_host_grouped(host_lib, "nvfp4", x, w, offsets, form=form, x_permuted=True),
                               want), form  # the flag does change how x is read
    for form in ("wide", "split", "persistent"):
        _host_grouped(host_lib, "nvfp4", x, w, offsets, form=form, x_permuted=True, rc=1, ctas=2)
    f8 = _fp8_experts(E, N, K, gen)
    for form in ("pipelined", "m32"):
        _host_grouped(host_lib, "block_fp8", x, f8, offsets, form=form, x_permuted=True, rc=1)


@needs_gxx
@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_host_emulated_grouped_repacked_kernel_matches_the_grouped_reference(host_lib, case):
    """The repacked formats ("nvfp4_repacked", "block_fp8_repacked") in the grouped kernel: its forms
    (REPACKED_FORMS: pipelined, persistent) on repacked codes against the grouped reference of the natural
    codes (block FP8: w8a16; rows past offsets[-1] unwritten), and the natural pipelined kernel (fp32 order
    only), the persistent form bit for bit the pipelined one; its code loads stay one per lane, row tile,
    chunk and pass of 16 rows; the other forms and X_PERM are refused for it (cudaErrorInvalidValue's place in
    the harness: 1)."""
    fmt, E, N, K, counts = GROUPED_CASES[case]
    w, x, offsets, _ = _grouped_inputs(fmt, E, N, K, counts, 13, extra_rows=3)  # 3 rows past offsets[-1]
    P = sum(counts)
    wr = _repack(fmt, w)
    repacked = f"{fmt}_repacked"
    if fmt == "nvfp4":
        want = nf4.nvfp4_grouped_mm_ref(x, *w, offsets)[:P]
    else:
        want = bf8.block_fp8_grouped_mm_ref(x, *w, offsets, scheme="w8a16")[:P]
    natural = _host_grouped(host_lib, fmt, x, w, offsets, form="pipelined")[:P]
    scale = want.float().abs().max().item()
    per_form = {}
    for form in pair_cuda.REPACKED_FORMS:
        host_lib.nvp_host_record(1)
        got = _host_grouped(host_lib, repacked, x, wr, offsets, form=form)
        loads = _recorded(host_lib, 0)
        host_lib.nvp_host_record(0)
        assert got[P:].isnan().all()
        got = per_form[form] = got[:P]
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2 * scale)
        assert (got == want).float().mean() > 0.9
        assert (got == natural).float().mean() > 0.9
        ranges = [_byte_range(t) for t in (x, offsets, *wr)]
        assert all(any(lo <= a < hi for lo, hi in ranges) for a in loads)
        lo, hi = _byte_range(wr[0])
        passes = sum(-(-c // ROWS_PER_PASS[form]) for c in counts)
        per_chunk = 32 * (2 if fmt == "nvfp4" else 4)
        assert sum(lo <= a < hi for a in loads) == passes * _code_tiles(form, N) * -(-K // 128) * per_chunk
    for form in pair_cuda.REPACKED_FORMS:
        assert torch.equal(per_form[form], per_form["pipelined"]), form
    for form in ("split", "wide"):
        _host_grouped(host_lib, repacked, x, wr, offsets, form=form, rc=1)
    _host_grouped(host_lib, repacked, x, wr, offsets, form="pipelined", x_permuted=True, rc=1)


@needs_gxx
@pytest.mark.parametrize("fmt", ["nvfp4", "block_fp8"])
def test_host_emulated_persistent_kernel_gives_the_same_bits_on_any_grid(host_lib, fmt):
    """The persistent form walks the (expert, 64-row) tiles from any number of CTAs: one CTA (every tile in
    turn, the next pass's codes loaded across every boundary), 2 and 5 (a stride that splits an expert's row
    tiles across CTAs), as many as the tiles and more (the grid capped at the tiles): the pipelined form's
    bits each time.
    Experts with no rows between ones with rows, a second pass of 16 rows and N 72 (a second, partial row
    tile: warps past N skip it). A grid of 0 CTAs is the device launcher's "pick the default" (it fills in 3
    per SM before the dispatch); the dispatch itself refuses it (cudaErrorInvalidValue's place in the harness:
    1)."""
    E, N, K, counts = 5, 72, 640, (0, 20, 0, 3, 9)
    w, x, offsets, _ = _grouped_inputs(fmt, E, N, K, counts, 17)
    want = _host_grouped(host_lib, fmt, x, w, offsets, form="pipelined")
    assert not want.isnan().any()
    tiles = -(-N // 64) * E
    for ctas in (1, 2, 5, tiles, tiles + 3):
        got = _host_grouped(host_lib, fmt, x, w, offsets, form="persistent", ctas=ctas)
        assert torch.equal(got, want), ctas
    _host_grouped(host_lib, fmt, x, w, offsets, form="persistent", ctas=0, rc=1)


def test_permute_x_columns_moves_each_group_of_8_columns():
    """Column 8j + m of permute_x_columns(x) is x's column 8j + X_PERM_ORDER[m]; K not a multiple of 8 or a
    1-D x is refused."""
    x = torch.arange(3 * 16, dtype=torch.float32).reshape(3, 16)
    got = pair_cuda.permute_x_columns(x)
    for j in range(2):
        for m, src in enumerate(pair_cuda.X_PERM_ORDER):
            assert torch.equal(got[:, 8 * j + m], x[:, 8 * j + src])
    assert sorted(pair_cuda.X_PERM_ORDER) == list(range(8))
    for bad in (torch.zeros(2, 12), torch.zeros(16)):
        with pytest.raises(ValueError, match="K % 8 == 0"):
            pair_cuda.permute_x_columns(bad)


def test_grouped_form_setting_is_checked_before_any_build(monkeypatch):
    """pair_cuda.GROUPED_FORM (read at call time) outside GROUPED_FORM_SETTINGS is refused by name."""
    gen = torch.Generator().manual_seed(3)
    w = _experts(2, 16, 64, gen)
    monkeypatch.setattr(pair_cuda, "GROUPED_FORM", "tall")
    forms = r"\('auto', 'split', 'wide', 'pipelined', 'persistent', 'm32'\)"
    with pytest.raises(ValueError, match=r"GROUPED_FORM = 'tall': expected one of " + forms):
        pair_cuda.grouped_mm("nvfp4", torch.zeros(3, 64, dtype=torch.bfloat16), w,
                             torch.tensor([1, 3], dtype=torch.int32))


def test_grouped_form_auto_runs_m32_for_nvfp4_from_its_measured_rows_per_expert(monkeypatch):
    """GROUPED_FORM "auto" (the default) picks the m32 form for the stored NVFP4 codes from
    M32_MIN_ROWS_PER_EXPERT rows per expert and the pipelined form below it and for every other format; a
    named form is run as named (a repacked format falling back to "pipelined" where the form has no repacked
    build)."""
    assert pair_cuda.GROUPED_FORM == "auto" and "auto" not in pair_cuda.GROUPED_FORMS
    lo = pair_cuda.M32_MIN_ROWS_PER_EXPERT
    assert pair_cuda.grouped_form("nvfp4", lo) == "m32"
    assert pair_cuda.grouped_form("nvfp4", 11.0) == "m32"
    assert pair_cuda.grouped_form("nvfp4", lo - 0.01) == "pipelined"
    for fmt in ("block_fp8", "nvfp4_repacked", "block_fp8_repacked"):
        assert pair_cuda.grouped_form(fmt, 11.0) == "pipelined"
    monkeypatch.setattr(pair_cuda, "GROUPED_FORM", "pipelined")
    assert pair_cuda.grouped_form("nvfp4", 11.0) == "pipelined"
    monkeypatch.setattr(pair_cuda, "GROUPED_FORM", "wide")
    assert pair_cuda.grouped_form("nvfp4", 0.1) == "wide"
    assert pair_cuda.grouped_form("nvfp4_repacked", 0.1) == "pipelined"
    monkeypatch.setattr(pair_cuda, "GROUPED_FORM", "m32")
    assert pair_cuda.grouped_form("block_fp8", 0.1) == "m32"


@needs_gxx
@pytest.mark.parametrize("case", [c for c in GROUPED_CASES if GROUPED_CASES[c][0] == "nvfp4"])
def test_host_emulated_m32_prefetch_asks_ahead_for_exactly_what_the_loop_loads(host_lib, case):
    """GROUPED_PREFETCH's rolling L2 prefetch in the m32 form (pair_gemv.cu two_set_chunks with PF), recorded
    by the host harness: the same bits as without it (natural codes, and repacked against repacked); every
    code address it asks for is one the loop loads, and every code load of a whole chunk past the first two
    (which are loaded at once) was asked for; nothing else (the scales and the partial chunk are left to the
    loop's loads). Other forms and formats refuse the flag (cudaErrorInvalidValue's place in the harness:
    1)."""
    _, E, N, K, counts = GROUPED_CASES[case]
    w, x, offsets, gen = _grouped_inputs("nvfp4", E, N, K, counts, 7)
    host_lib.nvp_host_record(1)
    plain = _host_grouped(host_lib, "nvfp4", x, w, offsets, form="m32")
    loads = _recorded(host_lib, 0)
    host_lib.nvp_host_record(1)
    fetched = _host_grouped(host_lib, "nvfp4", x, w, offsets, form="m32", prefetch=True)
    prefetches = _recorded(host_lib, 1)
    host_lib.nvp_host_record(0)
    assert torch.equal(fetched.view(torch.int16), plain.view(torch.int16))
    lo, hi = _byte_range(w[0])
    row_bytes = w[0].stride(1)  # K / 2 bytes of codes per output row; a 128-column chunk is 64 of them
    code_loads = {a for a in loads if lo <= a < hi}
    code_prefetches = {a for a in prefetches if lo <= a < hi}
    assert code_prefetches <= code_loads
    ahead = {a for a in code_loads if 2 <= (a - lo) % row_bytes // 64 < K // 128}  # whole chunks past two
    assert ahead <= code_prefetches and (ahead or K < 384)
    assert all(lo <= a < hi for a in prefetches)  # codes only
    wr = (nf4.repack_codes(w[0]), *w[1:])
    assert torch.equal(_host_grouped(host_lib, "nvfp4_repacked", x, wr, offsets, form="m32", prefetch=True),
                       _host_grouped(host_lib, "nvfp4_repacked", x, wr, offsets, form="m32"))
    _host_grouped(host_lib, "nvfp4", x, w, offsets, form="pipelined", prefetch=True, rc=1)
    f8 = _fp8_experts(E, N, K, gen)
    _host_grouped(host_lib, "block_fp8", x, f8, offsets, form="m32", prefetch=True, rc=1)


def test_grouped_mm_runs_the_form_of_its_rows_per_expert(monkeypatch):
    """grouped_mm hands grouped_form x's rows over all of offsets' experts (empty ones included): Super V3's
    64 tokens (64 x 22 pairs over 512 experts, 2.75 rows per expert) launch the m32 form, 63 tokens the
    pipelined one; block FP8 the pipelined one. The launch is stopped at launch_args (no GPU here)."""
    seen = []

    class Stop(Exception):
        pass

    def launch_args(*args, form, **kwargs):
        seen.append(form)
        raise Stop

    monkeypatch.setattr(pair_cuda, "_library", lambda *a: None)
    monkeypatch.setattr(pair_cuda, "launch_args", launch_args)
    w = (torch.zeros(512, 64, 32, dtype=torch.uint8),)
    offsets = torch.zeros(512, dtype=torch.int32)
    for fmt, tokens in (("nvfp4", 64), ("nvfp4", 63), ("block_fp8", 64)):
        with pytest.raises(Stop):
            pair_cuda.grouped_mm(fmt, torch.zeros(tokens * 22, 64, dtype=torch.bfloat16), w, offsets)
    assert seen == ["m32", "pipelined", "pipelined"]


def test_pair_form_setting_is_checked_before_any_build(monkeypatch):
    """pair_cuda.PAIR_FORM (read at call time) outside PAIR_FORMS is refused by name, before the library is
    built or loaded."""
    gen = torch.Generator().manual_seed(3)
    w = _experts(2, 16, 64, gen)
    monkeypatch.setattr(pair_cuda, "PAIR_FORM", "tall")
    monkeypatch.setattr(pair_cuda, "_library", lambda *a: pytest.fail("built before the setting was checked"))
    with pytest.raises(ValueError, match=r"PAIR_FORM = 'tall': expected one of \('split', 'persistent'\)"):
        pair_cuda.launch_pair("nvfp4", torch.zeros(1, 64, dtype=torch.bfloat16),
                              torch.zeros(2, dtype=torch.int64), w, None, torch.bfloat16, 2, 0)


def test_grouped_kernel_setting_is_checked_and_falls_back_to_triton():
    gen = torch.Generator().manual_seed(0)
    w = _experts(2, 16, 128, gen)
    x = torch.randn(3, 128).to(torch.bfloat16)
    offsets = torch.tensor([1, 3], dtype=torch.int32)
    assert pair_cuda.grouped_kernel_for("cuda", "nvfp4", x, w, offsets) == "triton"  # CPU tensors
    assert pair_cuda.grouped_kernel_for("triton", "nvfp4", x, w, offsets) == "triton"
    with pytest.raises(ValueError, match="nvfp4.GROUPED_KERNEL must be one of"):
        pair_cuda.grouped_kernel_for("gemlite", "nvfp4", x, w, offsets)


def test_block_fp8_cuda_kernels_take_only_the_sizes_they_won(monkeypatch):
    """block_fp8's per-pair CUDA kernel is asked only up to PAIR_CUDA_MAX_PAIRS pairs (None: always) and its
    grouped form only from GROUPED_CUDA_MIN_ROWS_PER_EXPERT rows per expert on average; outside those sizes
    the Triton kernel runs without pair_cuda being asked, and a bad setting is still refused there."""
    gen = torch.Generator().manual_seed(0)
    f8 = _fp8_experts(4, 16, 128, gen)
    x = torch.randn(2, 128).to(torch.bfloat16)
    asked = []

    def pair_cuda_says_cuda(setting, fmt, *args):
        asked.append((setting, fmt, args[-1] if isinstance(args[-1], int) else args[-1].numel()))
        return "cuda"

    monkeypatch.setattr(pair_cuda, "kernel_for", pair_cuda_says_cuda)
    monkeypatch.setattr(pair_cuda, "grouped_kernel_for", pair_cuda_says_cuda)
    monkeypatch.setattr(bf8, "PAIR_KERNEL", "cuda")
    monkeypatch.setattr(bf8, "PAIR_CUDA_MAX_PAIRS", 20)
    assert bf8.pair_kernel_for(x, f8, None, 20, a16=True) == "cuda"
    assert bf8.pair_kernel_for(x, f8, None, 21, a16=True) == "triton"
    assert asked == [("cuda", "block_fp8", 20)]
    monkeypatch.setattr(bf8, "PAIR_CUDA_MAX_PAIRS", None)
    assert bf8.pair_kernel_for(x, f8, None, 5000, a16=True) == "cuda"
    monkeypatch.setattr(bf8, "PAIR_KERNEL", "fast")
    monkeypatch.setattr(bf8, "PAIR_CUDA_MAX_PAIRS", 20)
    with pytest.raises(ValueError, match="block_fp8.PAIR_KERNEL must be one of"):
        bf8.pair_kernel_for(x, f8, None, 21, a16=True)

    asked.clear()
    monkeypatch.setattr(bf8, "GROUPED_KERNEL", "cuda")
    monkeypatch.setattr(bf8, "GROUPED_CUDA_MIN_ROWS_PER_EXPERT", 5.0)
    offsets = torch.zeros(4, dtype=torch.int32)  # E = 4: the CUDA form from 20 rows
    assert bf8.grouped_kernel_for(torch.randn(19, 128).bfloat16(), f8, offsets) == "triton"
    assert asked == []
    assert bf8.grouped_kernel_for(torch.randn(20, 128).bfloat16(), f8, offsets) == "cuda"
    assert asked == [("cuda", "block_fp8", 4)]
    monkeypatch.setattr(bf8, "GROUPED_KERNEL", "gemlite")
    with pytest.raises(ValueError, match="block_fp8.GROUPED_KERNEL must be one of"):
        bf8.grouped_kernel_for(torch.randn(19, 128).bfloat16(), f8, offsets)


def test_block_fp8_grouped_mm_asks_for_the_cuda_form_only_in_w8a16(monkeypatch):
    """block_fp8_grouped_mm sends a w8a16 product to the grouped CUDA kernel where grouped_kernel_for says
    "cuda" and never a w8a8 one (the CUDA kernel has no activation quantization)."""
    gen = torch.Generator().manual_seed(1)
    f8 = _fp8_experts(2, 16, 128, gen)
    x = torch.randn(12, 128).to(torch.bfloat16)
    offsets = torch.tensor([5, 12], dtype=torch.int32)
    calls = []
    monkeypatch.setattr(bf8, "use_kernel", lambda t: True)
    monkeypatch.setattr(bf8, "check_launchable", lambda *a, **k: None)
    monkeypatch.setattr(bf8, "grouped_kernel_for", lambda *a: "cuda")
    monkeypatch.setattr(pair_cuda, "grouped_mm", lambda fmt, *a, **k: calls.append(fmt) or "cuda ran")
    monkeypatch.setattr(bf8, "_launch", lambda *a, **k: "triton ran")
    assert bf8.block_fp8_grouped_mm(x, *f8, offsets, scheme="w8a16") == "cuda ran"
    assert bf8.block_fp8_grouped_mm(x, *f8, offsets, scheme="w8a8") == "triton ran"
    assert calls == ["block_fp8"]


@needs_gxx
def test_host_emulated_block_fp8_kernels_at_qwen3_next_widths(host_lib):
    """Block FP8 at Qwen3-Next's released expert widths (gate / up 2048 -> 512, gated SiLU, per pair; down
    512 -> 2048 grouped), which no GPU has run yet: the per-pair and grouped forms against the references."""
    gen = torch.Generator().manual_seed(21)
    gate, up = _fp8_experts(2, 512, 2048, gen), _fp8_experts(2, 512, 2048, gen)
    x = torch.randn(1, 2048, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([1, 0])
    got = _host_launch(host_lib, x, idx, gate, up, 2, "silu", fmt="block_fp8")
    want = _projection_ref(x, idx, gate, up, 2, "silu", fmt="block_fp8")
    _assert_close_bf16(got, want)
    assert (got == want).float().mean() > 0.9
    down = _fp8_experts(2, 2048, 512, gen)
    a = torch.randn(5, 512, generator=gen).to(torch.bfloat16)
    offsets = torch.tensor([2, 5], dtype=torch.int32)
    got = _host_grouped(host_lib, "block_fp8", a, down, offsets)
    want = bf8.block_fp8_grouped_mm_ref(a, *down, offsets, scheme="w8a16")
    _assert_close_bf16(got, want)
    assert (got == want).float().mean() > 0.9


def _assert_close_bf16(got, want):
    """Within two bf16 ulps of the largest |reference| (the sums differ in fp32 order only)."""
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2 * scale)


def test_a_failed_build_leaves_the_calls_to_triton_with_one_warning(monkeypatch):
    """A toolkit that cannot build the kernel for this GPU: unsupported says so (and warns once), so the
    formats' dispatch picks Triton instead of failing the call."""
    gen = torch.Generator().manual_seed(0)
    w = _experts(2, 16, 128, gen)
    x = torch.randn(2, 128).to(torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(pair_cuda, "_nvcc_path", lambda: "/usr/bin/nvcc")

    def broken(*args):
        raise ValueError("nvcc failed (exit 1): unsupported gpu architecture")

    monkeypatch.setattr(pair_cuda, "_library", broken)
    pair_cuda._build_failure.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built"):
            assert pair_cuda.unsupported("nvfp4", x, w, None, 2).startswith("the CUDA build failed")
        assert pair_cuda.kernel_for("cuda", "nvfp4", x, w, None, 2) == "triton"  # cached: no second warning
    finally:
        pair_cuda._build_failure.cache_clear()


def test_a_stale_library_abi_is_refused_with_the_fix():
    _nvcc.check_abi(pair_cuda.ABI, pair_cuda.ABI, "x.so", "pair_cuda")  # the same number: accepted
    with pytest.raises(ValueError, match=r"x\.so has ABI 3, this module expects 4; delete .* and rerun"):
        _nvcc.check_abi(3, 4, "x.so", "pair_cuda")
