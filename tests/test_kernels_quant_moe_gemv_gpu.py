"""GPU-only checks of the quantized routed-experts GEMV kernels (kernels/quant/moe_gemv.py) at the released
models' expert shapes, compiled for real, against their references and the quantized MoE's grouped path
(the Triton grouped GEMMs of kernels/quant), and under CUDA-graph capture without host synchronisation.

Run on the device machine: python -m pytest tests/test_kernels_quant_moe_gemv_gpu.py -m gpu. Skips without
CUDA. Shapes: Nemotron 3 Super's routed experts in NVFP4 (latent L = 1024, I = 2688, relu2, top-22 of 512)
and Qwen3-Next's in block FP8 (L = 2048, I = 512, gated SiLU, top-10 of 512), bf16 activations, at 1, 2 and 8
decode tokens. Tolerance: within 1.6e-2 of the largest |reference| output (two bf16 ulps: every path rounds
each projection to bf16 at the same points and differs in the fp32 summation order).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from gpu_memory import random_quantized_experts

from kernels.moe_gemv import ACT_CODES, act_ref
from kernels.quant import block_fp8 as bf8
from kernels.quant import nvfp4 as nf4
from kernels.quant import pair_cuda
from kernels.quant.block_fp8 import block_fp8_quantize
from kernels.quant.nvfp4 import nvfp4_quantize
from runners.engine.models.layers import ACTIVATIONS
from runners.engine.models.moe import moe_experts_grouped
from runners.engine.models.nvfp4 import nvfp4_grouped_mm

# 512 released-width experts per model, cached per process, several GB each:
# under pytest-xdist the modules of xdist group "gpu_memory" run in one worker, one test at a time; each test
# reserves 10 GiB of the card (7.9 GiB at the peak: tests/gpu_memory.py).
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_memory"), pytest.mark.gpu_memory(10)]

TOL = 1.6e-2
SHAPES = {  # model: (format, L, I, E, top_k, activation, gated)
    "super_v3": ("nvfp4", 1024, 2688, 512, 22, "relu2", False),
    "qwen3_next": ("block_fp8", 2048, 512, 512, 10, "silu", True),
}
# the grouped GEMM in the per-pair kernel's default scheme (block FP8: w8a8; the engine's wrapper would pick
# w8a16 at these rows, whose per-pair counterpart test_block_fp8_w8a16_at_qwen3_next_expert_shapes checks)
KERNELS = {"nvfp4": (nf4.moe_gemv_nvfp4, nf4.moe_gemv_nvfp4_ref, nvfp4_grouped_mm),
           "block_fp8": (bf8.moe_gemv_block_fp8, bf8.moe_gemv_block_fp8_ref,
                         partial(bf8.block_fp8_grouped_mm, scheme="w8a8"))}


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    scale = want.float().abs().max().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


def _quantize(fmt, w):
    if fmt == "nvfp4":
        return nvfp4_quantize(w)
    q, s = block_fp8_quantize(w)
    return q, s.float()


_EXPERTS: dict = {}


def _experts(model):
    """(up, gate or None, down) quantized in the model's release format (cached: quantizing 512 experts
    takes a moment)."""
    if model not in _EXPERTS:
        fmt, L, I, E, _, _, gated = SHAPES[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = lambda n, k: random_quantized_experts(lambda w: _quantize(fmt, w), E, n, k, gen)
        _EXPERTS[model] = (q(I, L), q(I, L) if gated else None, q(L, I))
    return _EXPERTS[model]


def _inputs(model, tokens, seed=0):
    _, L, _, E, k, _, _ = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    top = torch.rand(tokens, E, device="cuda", generator=gen).topk(k, dim=1)
    h = torch.randn(tokens, L, device="cuda", generator=gen).to(torch.bfloat16)
    return h, torch.softmax(top.values, dim=1), top.indices


@pytest.mark.parametrize("pair_kernel", ("triton", "cuda"))
@pytest.mark.parametrize("tokens", (1, 2, 8))
@pytest.mark.parametrize("model", list(SHAPES))
def test_released_expert_shapes(model, tokens, pair_kernel, monkeypatch):
    """The kernels (each per-pair kernel: PAIR_KERNEL "triton" and "cuda"; block FP8 runs its default w8a8
    scheme here, which only Triton has) vs their reference and vs the quantized MoE's grouped path (the
    Triton grouped GEMMs)."""
    monkeypatch.setattr(nf4, "PAIR_KERNEL", pair_kernel)
    monkeypatch.setattr(bf8, "PAIR_KERNEL", pair_kernel)
    fmt, *_, act, gated = SHAPES[model]
    kernel, ref, grouped_mm = KERNELS[fmt]
    up, gate, down = _experts(model)
    h, weights, indices = _inputs(model, tokens, seed=tokens)
    got = kernel(h, weights, indices, up, gate, down, act)
    _close(got, ref(h, weights, indices, up, gate, down, act))
    mats = {"up": up, "gate": gate, "down": down}
    kinds = ("up", "down") if gate is None else ("up", "gate", "down")
    mm = lambda x, kind, offsets: grouped_mm(x, *mats[kind], offsets)
    _close(got, moe_experts_grouped(h, weights, indices, kinds, mm, ACTIVATIONS[act], up[0].shape[0]))


@pytest.mark.parametrize("tokens", (1, 8))
def test_nvfp4_pair_variants_give_the_same_bits_at_super_shapes(tokens, monkeypatch):
    """The per-pair NVFP4 GEMVs with the "direct" decode (fp32 bit patterns: the compiled kernel must keep
    code 0.5's fp32 subnormal) and with the vector activation load, each and both, equal the default bit for
    bit at Super V3's released expert shapes."""
    _, *_, act, _ = SHAPES["super_v3"]
    up, gate, down = _experts("super_v3")
    h, weights, indices = _inputs("super_v3", tokens, seed=tokens + 20)
    monkeypatch.setattr(nf4, "PAIR_KERNEL", "triton")  # the variants are the Triton kernel's
    want = nf4.moe_gemv_nvfp4(h, weights, indices, up, gate, down, act)
    for decode, load in [(d, x) for d in nf4.DECODES for x in nf4.PAIR_X_LOADS]:
        monkeypatch.setattr(nf4, "DECODE", {**nf4.DECODE, "pair": decode})
        monkeypatch.setattr(nf4, "PAIR_X_LOAD", load)
        assert torch.equal(nf4.moe_gemv_nvfp4(h, weights, indices, up, gate, down, act), want), (decode, load)


@pytest.mark.parametrize("tokens", (1, 8))
def test_block_fp8_w8a16_at_qwen3_next_expert_shapes(tokens):
    """scheme="w8a16" (activations kept in bf16) vs its reference and the grouped path over the w8a16
    grouped GEMM, at Qwen3-Next's released expert shapes."""
    _, *_, act, _ = SHAPES["qwen3_next"]
    up, gate, down = _experts("qwen3_next")
    h, weights, indices = _inputs("qwen3_next", tokens, seed=tokens + 10)
    got = bf8.moe_gemv_block_fp8(h, weights, indices, up, gate, down, act, scheme="w8a16")
    _close(got, bf8.moe_gemv_block_fp8_ref(h, weights, indices, up, gate, down, act, scheme="w8a16"))
    mats = {"up": up, "gate": gate, "down": down}
    # the kernel's grouped GEMM in the scheme under test (the engine's wrapper picks the scheme by rows)
    mm = lambda x, kind, offsets: bf8.block_fp8_grouped_mm(x, *mats[kind], offsets, scheme="w8a16")
    _close(got, moe_experts_grouped(h, weights, indices, ("up", "gate", "down"), mm, ACTIVATIONS[act],
                                    up[0].shape[0]))


@pytest.mark.parametrize("pair_kernel", ("triton", "cuda"))
@pytest.mark.parametrize("model", list(SHAPES))
def test_capture_in_a_cuda_graph_without_host_sync(model, pair_kernel, monkeypatch):
    """No host synchronisation (sync debug mode "error"); captured once and replayed with new routing,
    weights and inputs written into the static buffers, the result follows the new values and equals
    eager's bits (each per-pair kernel; block FP8's CUDA kernel in the w8a16 scheme it runs)."""
    monkeypatch.setattr(nf4, "PAIR_KERNEL", pair_kernel)
    monkeypatch.setattr(bf8, "PAIR_KERNEL", pair_kernel)
    fmt, *_, act, _ = SHAPES[model]
    kernel, ref, _ = KERNELS[fmt]
    if fmt == "block_fp8" and pair_kernel == "cuda":
        kernel, ref = partial(kernel, scheme="w8a16"), partial(ref, scheme="w8a16")
    up, gate, down = _experts(model)
    h, weights, indices = _inputs(model, 4, seed=1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernel(h, weights, indices, up, gate, down, act)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            kernel(h, weights, indices, up, gate, down, act)
        with torch.cuda.graph(graph):
            y = kernel(h, weights, indices, up, gate, down, act)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (2, 3):
        new_h, new_w, new_idx = _inputs(model, 4, seed=seed)
        h.copy_(new_h)
        weights.copy_(new_w)
        indices.copy_(new_idx)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _close(y, ref(h, weights, indices, up, gate, down, act))
        assert torch.equal(y, kernel(h, weights, indices, up, gate, down, act))


@pytest.mark.parametrize("model", list(SHAPES))
def test_cuda_pair_prefetch_and_pdl_change_no_bit(model, monkeypatch):
    """kernels/quant/pair_cuda.py's PREFETCH (every weight chunk of a CTA into L2 first) and PDL (the down
    projection launched as a programmatic dependent of gate / up, waiting for it before reading its output):
    eager, each combination gives the plain CUDA kernel's bits, and the down launch (only it) goes out with
    PDL on an sm_90+ GPU; captured in a CUDA graph (a programmatic edge there) and replayed on new routing and
    inputs, the same bits as eager on them. Also with gate / up on the Triton kernel (an input whose rows are
    not 16-byte aligned, which the CUDA kernel leaves to Triton) before a PDL down. Both formats' CUDA
    kernels (block FP8 in its w8a16 scheme)."""
    from kernels.quant import pair_cuda

    monkeypatch.setattr(nf4, "PAIR_KERNEL", "cuda")
    monkeypatch.setattr(bf8, "PAIR_KERNEL", "cuda")
    fmt, L, *_, act, _ = SHAPES[model]
    kernel = KERNELS[fmt][0] if fmt == "nvfp4" else partial(KERNELS[fmt][0], scheme="w8a16")
    up, gate, down = _experts(model)
    h, weights, indices = _inputs(model, 2, seed=7)
    unaligned = torch.empty(h.shape[0], L + 3, dtype=h.dtype, device="cuda")[:, :L]  # rows 2 * (L + 3) apart
    unaligned.copy_(h)
    plain = kernel(h, weights, indices, up, gate, down, act)
    plain_triton_up = kernel(unaligned, weights, indices, up, gate, down, act)
    pdl_launches: list[bool] = []
    launch_args = pair_cuda.launch_args

    def spy(*args, **kwargs):
        pdl_launches.append(kwargs.get("pdl", False))
        return launch_args(*args, **kwargs)

    monkeypatch.setattr(pair_cuda, "launch_args", spy)
    hopper = torch.cuda.get_device_capability() >= pair_cuda.PDL_MIN_CAPABILITY
    for prefetch, pdl in ((True, False), (False, True), (True, True)):
        monkeypatch.setattr(pair_cuda, "PREFETCH", prefetch)
        monkeypatch.setattr(pair_cuda, "PDL", pdl)
        pdl_launches.clear()
        assert torch.equal(kernel(h, weights, indices, up, gate, down, act), plain), (prefetch, pdl)
        assert pdl_launches == [False, pdl and hopper]  # gate / up, then down
        pdl_launches.clear()
        assert torch.equal(kernel(unaligned, weights, indices, up, gate, down, act), plain_triton_up)
        assert pdl_launches == [pdl and hopper]  # gate / up ran on Triton
        g_h, g_w, g_idx = (t.clone() for t in (h, weights, indices))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kernel(g_h, g_w, g_idx, up, gate, down, act)
            with torch.cuda.graph(graph):
                y = kernel(g_h, g_w, g_idx, up, gate, down, act)
        torch.cuda.current_stream().wait_stream(stream)
        new_h, new_w, new_idx = _inputs(model, 2, seed=8)
        g_h.copy_(new_h)
        g_w.copy_(new_w)
        g_idx.copy_(new_idx)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, kernel(new_h, new_w, new_idx, up, gate, down, act)), (prefetch, pdl)


def _nvfp4_cuda_case(gated, tokens, seed):
    """Super V3's NVFP4 experts, or (gated) Qwen3-Next's widths in NVFP4 (64 experts, top-10, SiLU)."""
    if not gated:
        up, gate, down = _experts("super_v3")
        return (up, gate, down, "relu2", *_inputs("super_v3", tokens, seed=seed))
    if "qwen3_next_nvfp4" not in _EXPERTS:
        gen = torch.Generator(device="cuda").manual_seed(5)
        q = lambda n, k: random_quantized_experts(nvfp4_quantize, 64, n, k, gen)
        _EXPERTS["qwen3_next_nvfp4"] = (q(512, 2048), q(512, 2048), q(2048, 512))
    up, gate, down = _EXPERTS["qwen3_next_nvfp4"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    top = torch.rand(tokens, 64, device="cuda", generator=gen).topk(10, dim=1)
    h = torch.randn(tokens, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    return up, gate, down, "silu", h, torch.softmax(top.values, dim=1), top.indices


@pytest.mark.parametrize("tokens", (1, 8))
@pytest.mark.parametrize("gated", (False, True))
def test_nvfp4_cuda_pair_kernel_vs_reference_and_triton(gated, tokens, monkeypatch):
    """PAIR_KERNEL "cuda" (kernels/quant/pair_gemv.cu, built with nvcc here) takes both projections at Super
    V3's released expert shapes (and gated at Qwen3-Next's widths): the reference and the Triton per-pair
    kernel within two bf16 ulps, the same bits on a second call (the warps' sums meet in a fixed order)."""
    up, gate, down, act, h, weights, indices = _nvfp4_cuda_case(gated, tokens, seed=tokens + 30)
    monkeypatch.setattr(nf4, "PAIR_KERNEL", "triton")
    triton_out = nf4.moe_gemv_nvfp4(h, weights, indices, up, gate, down, act)
    monkeypatch.setattr(nf4, "PAIR_KERNEL", "cuda")
    first = gate if gated else up
    assert nf4.pair_kernel_for(h, first, up if gated else None, indices.numel()) == "cuda"
    a = torch.empty(indices.numel(), up[0].shape[1], dtype=torch.bfloat16, device="cuda")
    assert nf4.pair_kernel_for(a, down, None, indices.numel()) == "cuda"
    got = nf4.moe_gemv_nvfp4(h, weights, indices, up, gate, down, act)
    _close(got, nf4.moe_gemv_nvfp4_ref(h, weights, indices, up, gate, down, act))
    _close(got, triton_out)
    assert torch.equal(nf4.moe_gemv_nvfp4(h, weights, indices, up, gate, down, act), got)


@pytest.mark.parametrize("tokens", (1, 8))
def test_block_fp8_cuda_pair_kernel_vs_reference_and_triton(tokens, monkeypatch):
    """block_fp8's PAIR_KERNEL "cuda" (kernels/quant/pair_gemv.cu) takes the w8a16 projections at Qwen3-Next's
    released expert shapes (gated SiLU): the w8a16 reference and the Triton per-pair kernel within two bf16
    ulps, the same bits on a second call."""
    _, *_, act, _ = SHAPES["qwen3_next"]
    up, gate, down = _experts("qwen3_next")
    h, weights, indices = _inputs("qwen3_next", tokens, seed=tokens + 50)
    monkeypatch.setattr(bf8, "PAIR_KERNEL", "triton")
    triton_out = bf8.moe_gemv_block_fp8(h, weights, indices, up, gate, down, act, scheme="w8a16")
    monkeypatch.setattr(bf8, "PAIR_KERNEL", "cuda")
    monkeypatch.setattr(bf8, "PAIR_CUDA_MAX_PAIRS", None)  # 8 tokens x top-10 is past the default bound
    assert bf8.pair_kernel_for(h, gate, up, indices.numel(), a16=True) == "cuda"
    a = torch.empty(indices.numel(), up[0].shape[1], dtype=torch.bfloat16, device="cuda")
    assert bf8.pair_kernel_for(a, down, None, indices.numel(), a16=True) == "cuda"
    got = bf8.moe_gemv_block_fp8(h, weights, indices, up, gate, down, act, scheme="w8a16")
    _close(got, bf8.moe_gemv_block_fp8_ref(h, weights, indices, up, gate, down, act, scheme="w8a16"))
    _close(got, triton_out)
    assert torch.equal(bf8.moe_gemv_block_fp8(h, weights, indices, up, gate, down, act, scheme="w8a16"), got)


@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("tokens", (1, 8))
@pytest.mark.parametrize("model", list(SHAPES))
def test_pair_persistent_form_vs_reference_and_the_split_kernel(model, tokens, pdl, monkeypatch):
    """PAIR_FORM "persistent" (the per-pair persistent_kernel of kernels/quant/pair_gemv.cu) at the released
    expert shapes, both formats' CUDA per-pair kernels (block FP8 w8a16, its gate / up gated): the whole
    routed-experts call within two bf16 ulps of the reference and of the split kernel, the same bits on a
    second call and replayed from a CUDA graph; with PDL (the down projection a programmatic dependent of gate
    / up on sm_90+) the same bits as without."""
    fmt, *_, act, _ = SHAPES[model]
    module = nf4 if fmt == "nvfp4" else bf8
    monkeypatch.setattr(module, "PAIR_KERNEL", "cuda")
    if fmt == "block_fp8":
        monkeypatch.setattr(bf8, "PAIR_CUDA_MAX_PAIRS", None)  # 8 tokens x top-10 is past the default bound
    kw = {} if fmt == "nvfp4" else {"scheme": "w8a16"}
    kernel, ref = KERNELS[fmt][0], KERNELS[fmt][1]
    up, gate, down = _experts(model)
    h, weights, indices = _inputs(model, tokens, seed=tokens + 90)
    call = lambda: kernel(h, weights, indices, up, gate, down, act, **kw)  # noqa: E731
    split = call()
    monkeypatch.setattr(pair_cuda, "PAIR_FORM", "persistent")
    got = call()
    _close(got, ref(h, weights, indices, up, gate, down, act, **kw))
    _close(got, split)
    assert torch.equal(call(), got)
    assert torch.equal(_graph_replay(call), got)
    monkeypatch.setattr(pair_cuda, "PDL", pdl)
    assert torch.equal(call(), got)


@pytest.mark.parametrize("form", pair_cuda.GROUPED_FORMS)
@pytest.mark.parametrize("rows_per_expert", (1, 11, 40))
@pytest.mark.parametrize("model", list(SHAPES))
def test_cuda_grouped_kernel_vs_reference_and_triton(model, rows_per_expert, form, monkeypatch):
    """GROUPED_KERNEL "cuda" (the grouped form of kernels/quant/pair_gemv.cu, each of pair_cuda's
    GROUPED_FORMS) at the released expert shapes (Super V3 NVFP4 up, Qwen3-Next block FP8 w8a16 gate) with
    about 1, 11 (the batch-64 verify) and 40 rows per expert (up to 80: several passes over the weights):
    the grouped reference and the Triton grouped kernel within two bf16 ulps, the same bits on a second
    call; the pipelined form the wide form's bits (each sum in the same order); NVFP4's pipelined and m32
    forms the same bits with X_PERM, and its m32 form with GROUPED_PREFETCH, eager and replayed from a CUDA
    graph; the persistent form (its default
    grid of 3 CTAs per SM) and the m32 form the pipelined form's bits, also replayed from a CUDA graph."""
    monkeypatch.setattr(pair_cuda, "GROUPED_FORM", form)
    fmt = SHAPES[model][0]
    up = _experts(model)[0]
    E = up[0].shape[0]
    K = up[0].shape[2] * (2 if fmt == "nvfp4" else 1)
    gen = torch.Generator(device="cuda").manual_seed(rows_per_expert)
    counts = torch.randint(0, 2 * rows_per_expert + 1, (E,), device="cuda", generator=gen)
    offsets = counts.cumsum(0).to(torch.int32)
    P = int(offsets[-1])
    x = torch.randn(P, K, device="cuda", generator=gen).to(torch.bfloat16)
    module = nf4 if fmt == "nvfp4" else bf8
    kw = {} if fmt == "nvfp4" else {"scheme": "w8a16"}
    mm = nf4.nvfp4_grouped_mm if fmt == "nvfp4" else bf8.block_fp8_grouped_mm
    ref = nf4.nvfp4_grouped_mm_ref if fmt == "nvfp4" else bf8.block_fp8_grouped_mm_ref
    monkeypatch.setattr(module, "GROUPED_KERNEL", "triton")
    triton_out = mm(x, *up, offsets, **kw)
    monkeypatch.setattr(module, "GROUPED_KERNEL", "cuda")
    got = mm(x, *up, offsets, **kw)
    _close(got, ref(x, *up, offsets, **kw))
    _close(got, triton_out)
    assert torch.equal(mm(x, *up, offsets, **kw), got)
    if form in pair_cuda.X_PERM_FORMS and fmt == "nvfp4":  # X_PERM: x permuted, the same bits, also captured
        monkeypatch.setattr(pair_cuda, "X_PERM", True)
        assert torch.equal(mm(x, *up, offsets, **kw), got)
        assert torch.equal(_graph_replay(lambda: mm(x, *up, offsets, **kw)), got)
        monkeypatch.setattr(pair_cuda, "X_PERM", False)
    if form == "pipelined":
        monkeypatch.setattr(pair_cuda, "GROUPED_FORM", "wide")
        assert torch.equal(mm(x, *up, offsets, **kw), got)
    if form == "m32" and fmt == "nvfp4":  # GROUPED_PREFETCH: the same loads asked ahead, the same bits
        monkeypatch.setattr(pair_cuda, "GROUPED_PREFETCH", True)
        assert torch.equal(mm(x, *up, offsets, **kw), got)
        assert torch.equal(_graph_replay(lambda: mm(x, *up, offsets, **kw)), got)
        monkeypatch.setattr(pair_cuda, "GROUPED_PREFETCH", False)
    if form in ("persistent", "m32"):
        assert torch.equal(_graph_replay(lambda: mm(x, *up, offsets, **kw)), got)
        monkeypatch.setattr(pair_cuda, "GROUPED_FORM", "pipelined")
        assert torch.equal(mm(x, *up, offsets, **kw), got)


def _graph_replay(fn):
    """fn()'s output captured in a CUDA graph (after one warm-up call off the capture, on a side stream) and
    replayed: what a captured step computes, for comparison with the eager result."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            captured = fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return captured


@pytest.mark.parametrize("form", pair_cuda.REPACKED_FORMS)
@pytest.mark.parametrize("rows_per_expert", (1, 11))
@pytest.mark.parametrize("model", list(SHAPES))
def test_repacked_kernels_vs_reference_and_the_natural_kernels(model, rows_per_expert, form, monkeypatch):
    """The repacked formats ("<fmt>_repacked": kernels.quant.<fmt>.repack_codes, the codes' bits moved inside
    each word for a cheaper decode) at the released expert shapes (Super V3 NVFP4 up, relu2; Qwen3-Next block
    FP8 gate, w8a16): the grouped kernel in each of its forms (REPACKED_FORMS; about 1 and 11 rows per
    expert) and the per-pair kernel (8 tokens) on repacked codes against the grouped reference of the natural
    codes and the natural kernels (themselves held to their references above), within two bf16 ulps;
    NVFP4's per-pair output also against its dequantizing reference; the same bits on a second call and
    replayed from a CUDA graph."""
    monkeypatch.setattr(pair_cuda, "GROUPED_FORM", form)
    fmt, _, _, E, k, act, gated = SHAPES[model]
    module = nf4 if fmt == "nvfp4" else bf8
    w = _experts(model)[1 if gated else 0]
    packed = (module.repack_codes(w[0]), *w[1:])
    repacked = f"{fmt}_repacked"
    K = w[0].shape[2] * (2 if fmt == "nvfp4" else 1)
    gen = torch.Generator(device="cuda").manual_seed(rows_per_expert + 70)
    counts = torch.randint(0, 2 * rows_per_expert + 1, (E,), device="cuda", generator=gen)
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(offsets[-1]), K, device="cuda", generator=gen).to(torch.bfloat16)
    assert pair_cuda.grouped_unsupported(repacked, x, packed, offsets) is None
    grouped = lambda: pair_cuda.grouped_mm(repacked, x, packed, offsets)
    got = grouped()
    if fmt == "nvfp4":
        _close(got, nf4.nvfp4_grouped_mm_ref(x, *w, offsets))
    else:
        _close(got, bf8.block_fp8_grouped_mm_ref(x, *w, offsets, scheme="w8a16"))
    _close(got, pair_cuda.grouped_mm(fmt, x, w, offsets))
    assert torch.equal(grouped(), got)
    assert torch.equal(_graph_replay(grouped), got)
    h, _, indices = _inputs(model, 8, seed=rows_per_expert + 71)
    idx = indices.flatten()
    launch = lambda f, m: pair_cuda.launch_pair(f, h, idx, m, None, torch.bfloat16, k, ACT_CODES[act])[0]
    pair = launch(repacked, packed)
    _close(pair, launch(fmt, w))
    assert torch.equal(launch(repacked, packed), pair)
    if fmt == "nvfp4":  # ungated: the activation applies to this projection alone
        want = torch.stack([nf4.nvfp4_linear_ref(h[p // k:p // k + 1], w[0][e], w[1][e], w[2][e])[0]
                            for p, e in enumerate(idx.tolist())])
        _close(pair, act_ref(want, act))
