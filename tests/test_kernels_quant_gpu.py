"""GPU-only checks of the quantized GEMMs (kernels/quant/) at the released models' shapes, compiled for real,
and their CUDA-graph capture without host synchronisation.

Run on the device machine: python -m pytest tests/test_kernels_quant_gpu.py -m gpu. Skips without CUDA.
Shapes: Nemotron 3 Super's routed experts (latent 1024 -> moe_intermediate 2688 and back, 512 experts, top-22)
in NVFP4; Qwen3-Next's (hidden 2048 -> moe_intermediate 512 and back, 512 experts, top-10) and its dense
projections (q with its gate 2048 -> 8192, k / v 2048 -> 512, o 4096 -> 2048, GDN in_proj_qkvz 2048 -> 12288)
in block FP8; batch 1..8 decode tokens and one prefill-sized batch (the 64 / 128-row tile configs).
Tolerance: bf16 outputs within 1.6e-2 of the largest |reference| output (two bf16 ulps: the kernel and the
reference compute the same fp32 sums in a different order, and fp8 tensor-core accumulation within one
128-column group is narrower than fp32, DeepSeek-V3 report section 3.3.2), float32 references.
"""

from __future__ import annotations

import pytest
import torch
from gpu_memory import random_quantized_experts

from kernels.quant.block_fp8 import (
    block_fp8_grouped_mm,
    block_fp8_grouped_mm_ref,
    block_fp8_linear,
    block_fp8_linear_ref,
    block_fp8_quantize,
    block_scaled_mm_supported,
    quantize_activation_per_token_group,
    quantize_activation_per_token_group_ref,
)
from kernels.quant.nvfp4 import (
    nvfp4_grouped_mm,
    nvfp4_grouped_mm_ref,
    nvfp4_linear,
    nvfp4_linear_ref,
)

# Nemotron 3 Super's 512 NVFP4 experts and their dequantized reference take ~10 GB a test:
# under pytest-xdist the modules of xdist group "gpu_memory" run in one worker, one test at a time; each test
# reserves 10 GiB of the card (8.0 GiB at the peak: tests/gpu_memory.py).
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_memory"), pytest.mark.gpu_memory(10)]

TOL = 1.6e-2
SUPER = {"L": 1024, "I": 2688, "E": 512, "top_k": 22}
QWEN = {"D": 2048, "I": 512, "E": 512, "top_k": 10}
QWEN_DENSE = [(8192, 2048), (512, 2048), (2048, 4096), (12288, 2048)]  # (N, K)
BATCHES = (1, 2, 4, 8)
FP8 = torch.float8_e4m3fn


def _close(got, want):
    assert not got.isnan().any()
    scale = want.float().abs().max().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


def random_nvfp4(E, N, K, seed=0, device="cuda"):
    """Random packed codes, e4m3 block scales in [0.25, 1.75] and global scales ~1e-2 (the kernel is tested,
    not the quantizer, which the CPU tests cover)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=device, generator=gen)
    s = (torch.rand(E, N, K // 16, device=device, generator=gen) * 1.5 + 0.25).to(FP8)
    s2 = torch.rand(E, device=device, generator=gen) * 0.01 + 0.005
    return w, s, s2


def routed_offsets(tokens, top_k, E, seed=0, device="cuda"):
    """(P = tokens * top_k, offsets [E] int32) of random top-k routing (distinct experts per token)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.rand(tokens, E, device=device, generator=gen).topk(top_k, dim=1).indices
    counts = torch.bincount(idx.flatten(), minlength=E)
    return idx.numel(), counts.cumsum(0).to(torch.int32)


@pytest.mark.parametrize("tokens", (*BATCHES, 2048))
@pytest.mark.parametrize("proj", ("up", "down"))
def test_nvfp4_grouped_at_super_expert_shapes(tokens, proj):
    N, K = (SUPER["I"], SUPER["L"]) if proj == "up" else (SUPER["L"], SUPER["I"])
    w, s, s2 = random_nvfp4(SUPER["E"], N, K, seed=tokens)
    P, offs = routed_offsets(tokens, SUPER["top_k"], SUPER["E"], seed=tokens)
    x = torch.randn(P, K, device="cuda").to(torch.bfloat16)
    out = torch.full((P, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    _close(nvfp4_grouped_mm(x, w, s, s2, offs, out=out), nvfp4_grouped_mm_ref(x, w, s, s2, offs))


@pytest.mark.parametrize("tokens", (1, 64))
def test_nvfp4_direct_decode_equals_convert_at_super_expert_shapes(tokens, monkeypatch):
    """The "direct" decode (fp32 bit patterns; code 0.5 an fp32 subnormal the compiled kernel must keep, no
    flush-to-zero) gives the same bits as the "convert" decode on the GPU, grouped at Super V3's up shape
    (the GEMV at 1 token, the tensor-core kernel at 64) and dense (GEMV at 1 row, tensor core at 300)."""
    from kernels.quant import nvfp4

    N, K = SUPER["I"], SUPER["L"]
    w, s, s2 = random_nvfp4(SUPER["E"], N, K, seed=tokens)
    P, offs = routed_offsets(tokens, SUPER["top_k"], SUPER["E"], seed=tokens)
    x = torch.randn(P, K, device="cuda").to(torch.bfloat16)
    xd = torch.randn(1 if tokens == 1 else 300, K, device="cuda").to(torch.bfloat16)
    got = {}
    for decode in nvfp4.DECODES:
        monkeypatch.setattr(nvfp4, "DECODE", {"gemv": decode, "mma": decode})
        got[decode] = (nvfp4_grouped_mm(x, w, s, s2, offs), nvfp4_linear(xd, w[0], s[0], s2[0]))
    for a, b in zip(got["direct"], got["convert"]):
        assert torch.equal(a, b)
    _close(got["direct"][0], nvfp4_grouped_mm_ref(x, w, s, s2, offs))


@pytest.mark.parametrize("force_bytes", (False, True))
@pytest.mark.parametrize("M", (1, 8, 300))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_nvfp4_dense(M, dtype, force_bytes):
    w, s, s2 = random_nvfp4(1, 2688, 1024, seed=M)
    x = torch.randn(M, 1024, device="cuda").to(dtype)
    bias = torch.randn(2688, device="cuda").to(dtype)
    _close(nvfp4_linear(x, w[0], s[0], s2[0], bias, force_bytes=force_bytes),
           nvfp4_linear_ref(x, w[0], s[0], s2[0], bias))


def test_activation_quantization_is_bit_identical_on_the_gpu():
    """cvt.rn.satfinite to e4m3 and div.rn in the kernel against torch's division and cast: every e4m3 value
    and every midpoint (ties to even) at scale 1, and random rows spanning 9 decades."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    vals = vals[vals.isfinite()].unique()
    sweep = torch.cat((vals, (vals[1:] + vals[:-1]) / 2))
    x = torch.randn(64, sweep.numel()) * torch.logspace(-6, 3, sweep.numel())
    x[0] = sweep
    x[1] = 0
    x = x.cuda()
    for group in (128, sweep.numel()):
        q, s = quantize_activation_per_token_group(x, group)
        qr, sr = quantize_activation_per_token_group_ref(x, group)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_static_fp8_quantization_is_bit_identical_on_the_gpu_and_captures():
    """kernels.quant.fp8.quantize_fp8 on CUDA: every e4m3 value and every midpoint (ties to even) at scale 1,
    random rows over 9 decades at the scale a checkpoint calibrated, bf16 input; captured in a CUDA graph
    and replayed with a new scale written into its buffer, it follows the new scale."""
    from kernels.quant.fp8 import quantize_fp8, quantize_fp8_ref

    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    vals = vals[vals.isfinite()].unique()
    sweep = torch.cat((vals, (vals[1:] + vals[:-1]) / 2)).cuda()
    one = torch.tensor(1.0, device="cuda")
    bits = lambda t: t.view(torch.uint8)  # noqa: E731
    assert torch.equal(bits(quantize_fp8(sweep, one)), bits(quantize_fp8_ref(sweep, one)))
    x = (torch.randn(16, 4096) * torch.logspace(-6, 3, 4096)).cuda().bfloat16()
    scale = torch.tensor(0.0371, device="cuda")
    assert torch.equal(bits(quantize_fp8(x, scale)), bits(quantize_fp8_ref(x, scale)))
    out = quantize_fp8(x, scale)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_fp8(x, scale, out=out)
    scale.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(quantize_fp8_ref(x, scale)))


@pytest.mark.parametrize("tokens", (*BATCHES, 2048))
@pytest.mark.parametrize("proj", ("up", "down"))
def test_block_fp8_grouped_at_qwen3_next_expert_shapes(tokens, proj):
    N, K = (QWEN["I"], QWEN["D"]) if proj == "up" else (QWEN["D"], QWEN["I"])
    w, ws = block_fp8_quantize(torch.randn(QWEN["E"], N, K, device="cuda"))
    ws = ws.to(torch.bfloat16)  # as Qwen's release stores it
    P, offs = routed_offsets(tokens, QWEN["top_k"], QWEN["E"], seed=tokens)
    x = torch.randn(P, K, device="cuda").to(torch.bfloat16)
    out = torch.full((P, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    _close(block_fp8_grouped_mm(x, w, ws, offs, out=out), block_fp8_grouped_mm_ref(x, w, ws, offs))


@pytest.mark.parametrize("M", (1, 8, 300))
@pytest.mark.parametrize("N, K", QWEN_DENSE)
def test_block_fp8_dense_at_qwen3_next_shapes(N, K, M):
    w, ws = block_fp8_quantize(torch.randn(N, K, device="cuda"))
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    want = block_fp8_linear_ref(x, w, ws)
    _close(block_fp8_linear(x, w, ws, impl="triton"), want)
    if block_scaled_mm_supported(x.device):
        _close(block_fp8_linear(x, w, ws, impl="scaled_mm"), want)


def test_block_scaled_mm_probe_answers():
    # the lead reads this answer on the H200 (True: torch._scaled_mm takes block scales on sm_90 here)
    assert block_scaled_mm_supported("cuda") in (True, False)


def test_grouped_kernels_capture_in_a_cuda_graph_without_host_sync():
    """Capture both grouped GEMMs once on static buffers, then replay with new routing and inputs written into
    those buffers: the results follow the new offsets (nothing was baked in at capture), and an eager call
    under torch's sync debug mode "error" raises on no host synchronisation."""
    E, L, I, k, tokens = SUPER["E"], SUPER["L"], SUPER["I"], SUPER["top_k"], 4
    w, s, s2 = random_nvfp4(E, I, L, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    fw, fws = random_quantized_experts(block_fp8_quantize, E, I, L, gen)  # not 22 GB of float32 at once
    P, offs0 = routed_offsets(tokens, k, E, seed=1)
    x = torch.randn(P, L, device="cuda").to(torch.bfloat16)
    offs = offs0.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        nvfp4_grouped_mm(x, w, s, s2, offs)
        block_fp8_grouped_mm(x, fw, fws, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up (Triton compiles) outside the capture
            nvfp4_grouped_mm(x, w, s, s2, offs)
            block_fp8_grouped_mm(x, fw, fws, offs)
        with torch.cuda.graph(graph):
            y_nv = nvfp4_grouped_mm(x, w, s, s2, offs)
            y_fp8 = block_fp8_grouped_mm(x, fw, fws, offs)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (2, 3):
        _, new_offs = routed_offsets(tokens, k, E, seed=seed)
        offs.copy_(new_offs)
        x.copy_(torch.randn(P, L, device="cuda").to(torch.bfloat16))
        y_nv.fill_(float("nan"))
        y_fp8.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _close(y_nv, nvfp4_grouped_mm_ref(x, w, s, s2, offs))
        _close(y_fp8, block_fp8_grouped_mm_ref(x, fw, fws, offs))


@pytest.mark.parametrize("M", (1, 4, 8, 64))
@pytest.mark.parametrize("N, K", QWEN_DENSE)
def test_block_fp8_w8a16_at_qwen3_next_dense_shapes(N, K, M, monkeypatch):
    """w8a16 (the activation kept in bf16) at Qwen3-Next's dense shapes: within tolerance of its reference;
    the K split summed inside the launch (k / v and o split K at decode sizes) equals the splitk_sum launch
    bit for bit, and every split counter is back at 0 afterwards."""
    from kernels.quant import block_fp8
    w, ws = block_fp8_quantize(torch.randn(N, K, device="cuda"))
    ws = ws.to(torch.bfloat16)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    got = block_fp8_linear(x, w, ws, scheme="w8a16")
    _close(got, block_fp8_linear_ref(x, w, ws, scheme="w8a16"))
    monkeypatch.setattr(block_fp8, "SERIAL_SPLIT_SCHEMES", ())
    assert torch.equal(got, block_fp8_linear(x, w, ws, scheme="w8a16"))
    assert not block_fp8._split_counters(x.device, 1).any()


@pytest.mark.parametrize("tokens", (1, 4, 8))
def test_block_fp8_w8a16_grouped_at_qwen3_next_expert_shapes(tokens):
    N, K = QWEN["I"], QWEN["D"]
    w, ws = block_fp8_quantize(torch.randn(QWEN["E"], N, K, device="cuda"))
    P, offs = routed_offsets(tokens, QWEN["top_k"], QWEN["E"], seed=tokens)
    x = torch.randn(P, K, device="cuda").to(torch.bfloat16)
    out = torch.full((P, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    _close(block_fp8_grouped_mm(x, w, ws, offs, out=out, scheme="w8a16"),
           block_fp8_grouped_mm_ref(x, w, ws, offs, scheme="w8a16"))


def test_block_fp8_w8a16_split_k_replays_in_a_cuda_graph():
    """The k / v projection (2048 -> 512: K split at one row) captured once and replayed with new inputs:
    each replay equals the eager call bit for bit (the last split's sum and the counters' reset are in the
    graph), and the counters are 0 after every replay."""
    from kernels.quant import block_fp8
    w, ws = block_fp8_quantize(torch.randn(512, 2048, device="cuda"))
    x = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(2):
            block_fp8_linear(x, w, ws, scheme="w8a16")
        with torch.cuda.graph(graph):
            y = block_fp8_linear(x, w, ws, scheme="w8a16")
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2, 3):
        x.copy_(torch.randn(1, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, block_fp8_linear(x, w, ws, scheme="w8a16"))
        assert not block_fp8._split_counters(x.device, 1).any()


@pytest.mark.parametrize("M", (1, 8))
@pytest.mark.parametrize("N, K", [(18560, 4096), (4096, 8192), (512, 4096)])
def test_per_tensor_fp8_w8a16_at_super_v3_dense_shapes(N, K, M):
    """runners.engine.models.fp8.fp8_linear_w8a16 (per-tensor FP8 through the block GEMV, the scale as every
    block's) against x @ (W s)^T at Nemotron 3 Super's dense shapes (Mamba2 in / out, k+v)."""
    from runners.engine.models.fp8 import fp8_linear_w8a16

    w = torch.randn(N, K, device="cuda")
    s = (w.abs().max() / 448).reshape(())
    w8 = (w / s).to(FP8)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    want = (x.float() @ (w8.float() * s).T).to(torch.bfloat16)
    _close(fp8_linear_w8a16(x, w8, s), want)


@pytest.mark.parametrize("M", (1, 4, 16, 40))
@pytest.mark.parametrize("N, K", QWEN_DENSE)
def test_block_fp8_w8a16_tensor_core_kernel_at_qwen3_next_shapes(N, K, M, monkeypatch):
    """The w8a16 tensor-core kernel (W8A16_DOT_MIN_ROWS forced to 1; compiled, bf16 MMA operands) at
    Qwen3-Next's dense shapes and, grouped, its expert shapes at 1 / 8 tokens: within tolerance of the
    reference, the in-launch split sum equal to the splitk_sum launch bit for bit, the counters back at 0,
    and a CUDA-graph replay equal to the eager call."""
    from kernels.quant import block_fp8
    monkeypatch.setattr(block_fp8, "W8A16_DOT_MIN_ROWS", {"dense": 1, "grouped": 1})
    w, ws = block_fp8_quantize(torch.randn(N, K, device="cuda"))
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    got = block_fp8_linear(x, w, ws, scheme="w8a16")
    _close(got, block_fp8_linear_ref(x, w, ws, scheme="w8a16"))
    with monkeypatch.context() as m:
        m.setattr(block_fp8, "SERIAL_SPLIT_SCHEMES", ())
        assert torch.equal(got, block_fp8_linear(x, w, ws, scheme="w8a16"))
    assert not block_fp8._split_counters(x.device, 1).any()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        block_fp8_linear(x, w, ws, scheme="w8a16")
        with torch.cuda.graph(graph):
            y = block_fp8_linear(x, w, ws, scheme="w8a16")
    torch.cuda.current_stream().wait_stream(stream)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, got)
    if (N, K) == QWEN_DENSE[0]:
        ew, ews = block_fp8_quantize(torch.randn(QWEN["E"], QWEN["I"], QWEN["D"], device="cuda"))
        for tokens in (1, 8):
            P, offs = routed_offsets(tokens, QWEN["top_k"], QWEN["E"], seed=tokens)
            xe = torch.randn(P, QWEN["D"], device="cuda").to(torch.bfloat16)
            out = torch.full((P, QWEN["I"]), float("nan"), dtype=torch.bfloat16, device="cuda")
            _close(block_fp8_grouped_mm(xe, ew, ews, offs, out=out, scheme="w8a16"),
                   block_fp8_grouped_mm_ref(xe, ew, ews, offs, scheme="w8a16"))
