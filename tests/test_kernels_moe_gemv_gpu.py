"""GPU-only checks of the routed-experts GEMV kernels (kernels/moe_gemv.py) at the released models' expert
shapes, compiled for real, through the engine's entry point, and under CUDA-graph capture without host
synchronisation.

Run on the device machine: python -m pytest tests/test_kernels_moe_gemv_gpu.py -m gpu. Skips without CUDA.
Shapes: Nemotron 3 Super's routed experts (latent L = 1024, moe_intermediate I = 2688, relu2, top-22 of 512)
and Qwen3-Next's (hidden L = 2048, I = 512, gated SiLU, top-10 of 512), bf16, at 1, 2 and 8 decode tokens.
Tolerance: within 1.6e-2 of the largest |reference| output (two bf16 ulps: kernel and references round every
projection to bf16 at the same points and differ in the fp32 summation order; the grouped-GEMM path sums on
tensor cores).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.moe_gemv import moe_gemv, moe_gemv_ref
from runners.engine.models import moe as engine_moe
from runners.engine.models.layers import ACTIVATIONS

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_memory(20)]  # bf16 released experts: 15.8 GiB at the peak

TOL = 1.6e-2
SHAPES = {  # model: (L, I, E, top_k, activation, gated)
    "super_v3": (1024, 2688, 512, 22, "relu2", False),
    "qwen3_next": (2048, 512, 512, 10, "silu", True),
}


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    scale = want.float().abs().max().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


def _experts(model, seed=0):
    L, I, E, _, _, gated = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: (torch.randn(*s, device="cuda", generator=gen) / math.sqrt(s[-1])).to(torch.bfloat16)
    return r(E, I, L), (r(E, I, L) if gated else None), r(E, L, I)


def _inputs(model, tokens, seed=0):
    """(h bf16 [tokens, L], weights float32 [tokens, k], indices int64 [tokens, k]): random distinct experts
    per token (top-k of random scores), router-like weights summing to 1 per token."""
    L, _, E, k, _, _ = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, E, device="cuda", generator=gen)
    top = scores.topk(k, dim=1)
    h = torch.randn(tokens, L, device="cuda", generator=gen).to(torch.bfloat16)
    return h, torch.softmax(top.values, dim=1), top.indices


@pytest.mark.parametrize("tokens", (1, 2, 8))
@pytest.mark.parametrize("model", list(SHAPES))
def test_released_expert_shapes(model, tokens, monkeypatch):
    """The kernels vs their reference, and moe_experts_fused (which takes them at these sizes) vs its
    grouped-GEMM path (forced with MOE_GEMV_MAX_PAIRS = 0) and vs the engine's per-expert loop."""
    up, gate, down = _experts(model)
    h, weights, indices = _inputs(model, tokens, seed=tokens)
    act_name = SHAPES[model][4]
    act = ACTIVATIONS[act_name]
    got = moe_gemv(h, weights, indices, up, gate, down, act_name)
    _close(got, moe_gemv_ref(h, weights, indices, up, gate, down, act_name))
    assert engine_moe.use_moe_gemv(h, indices, up, down)
    fused = engine_moe.moe_experts_fused(h, weights, indices, up, gate, down, act, activation=act_name)
    torch.testing.assert_close(fused, got, rtol=0, atol=0)  # the engine ran the same kernels
    _close(got, engine_moe.moe_experts_ref(h, weights, indices, up, gate, down, act))
    monkeypatch.setattr(engine_moe, "MOE_GEMV_MAX_PAIRS", 0)
    _close(got, engine_moe.moe_experts_fused(h, weights, indices, up, gate, down, act, activation=act_name))


@pytest.mark.parametrize("model", list(SHAPES))
def test_capture_in_a_cuda_graph_without_host_sync(model):
    """An eager call raises nothing under torch's sync debug mode "error"; captured once on static buffers
    and replayed with new routing, combine weights and inputs written into them, the results follow the new
    values (nothing was baked in at capture)."""
    up, gate, down = _experts(model, seed=1)
    act_name = SHAPES[model][4]
    act = ACTIVATIONS[act_name]
    h, weights, indices = _inputs(model, 4, seed=1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_gemv(h, weights, indices, up, gate, down, act_name)
        engine_moe.moe_experts_fused(h, weights, indices, up, gate, down, act, activation=act_name)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up (Triton compiles) outside the capture
            moe_gemv(h, weights, indices, up, gate, down, act_name)
        with torch.cuda.graph(graph):
            y = moe_gemv(h, weights, indices, up, gate, down, act_name)
            y_engine = engine_moe.moe_experts_fused(h, weights, indices, up, gate, down, act,
                                                    activation=act_name)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (2, 3):
        new_h, new_w, new_idx = _inputs(model, 4, seed=seed)
        h.copy_(new_h)
        weights.copy_(new_w)
        indices.copy_(new_idx)
        y.fill_(float("nan"))
        y_engine.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = moe_gemv_ref(h, weights, indices, up, gate, down, act_name)
        _close(y, want)
        _close(y_engine, want)
