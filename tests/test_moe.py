"""Fused MoE (grouped GEMMs over expert-sorted pairs) against the per-expert reference loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runners.engine.models.config import HybridConfig
from runners.engine.models.layers import ACTIVATIONS
from runners.engine.models.moe import (
    MoE,
    group_pairs,
    grouped_mm_supported,
    moe_experts_fused,
    moe_experts_ref,
)


def _experts(E, I, L, gated, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) / math.sqrt(s[-1])).to(dtype=dtype, device=device)
    return r(E, I, L), (r(E, I, L) if gated else None), r(E, L, I)


def _routing(N, k, E, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(device)
    weights = torch.rand(N, k, generator=g).to(device)
    return weights, indices


CASES = {  # name: (N tokens, k, E experts, I, L, routing override)
    "random": (13, 3, 16, 24, 40, None),
    "zero-token experts": (3, 2, 16, 24, 40, None),  # at most 6 of 16 experts get tokens
    "all to one expert": (9, 1, 8, 24, 40, "one"),
    "top-k = num_experts": (7, 8, 8, 24, 40, None),
    "one token": (1, 4, 8, 24, 40, None),
    "unaligned sizes (bmm path)": (11, 3, 6, 20, 22, None),  # 22 * 4 bytes: not 16-byte aligned
}


@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "swiglu"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_reference_fp32(case, gated):
    N, k, E, I, L, mode = CASES[case]
    up, gate, down = _experts(E, I, L, gated)
    weights, indices = _routing(N, k, E)
    if mode == "one":
        indices = torch.full((N, k), 5, dtype=torch.long)
    h = torch.randn(N, L, generator=torch.Generator().manual_seed(3))
    act = ACTIVATIONS["silu" if gated else "relu2"]
    ref = moe_experts_ref(h, weights, indices, up, gate, down, act)
    fused = moe_experts_fused(h, weights, indices, up, gate, down, act)
    assert fused.dtype == ref.dtype == torch.float32 and fused.shape == (N, L)
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
    stacked = (up, down) if gate is None else (up, gate, down)
    assert grouped_mm_supported(h, *stacked) == ("bmm" not in case)


def test_sort_pairs_offsets():
    indices = torch.tensor([[3, 0], [3, 1], [0, 3]])
    order, inverse, offsets = group_pairs(indices, 5)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [2, 3, 3, 6, 6]
    assert indices.flatten()[order].tolist() == [0, 0, 1, 3, 3, 3]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: pairs of one expert in token order
    assert inverse[order].tolist() == list(range(6))


def test_fused_bf16_matches_reference_within_bf16_rounding():
    up, gate, down = _experts(16, 32, 64, gated=True, dtype=torch.bfloat16)
    weights, indices = _routing(20, 4, 16)
    h = torch.randn(20, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert grouped_mm_supported(h, up, gate, down)
    act = ACTIVATIONS["silu"]
    ref = moe_experts_ref(h, weights, indices, up, gate, down, act)
    fused = moe_experts_fused(h, weights, indices, up, gate, down, act)
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), ref.float(), rtol=2e-2, atol=2e-2)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("L", [40, 22], ids=["grouped_mm", "bmm"])
def test_fused_path_reads_nothing_back_to_the_host(L):
    """No .item() / .tolist() (aten._local_scalar_dense), no nonzero / bincount (data-dependent shapes);
    the reference does read its expert counts back, which shows the check can fail."""
    up, gate, down = _experts(8, 24, L, gated=True)
    weights, indices = _routing(10, 3, 8)
    h = torch.randn(10, L)
    act = ACTIVATIONS["silu"]
    syncing = {"_local_scalar_dense", "nonzero", "bincount", "unique", "masked_select"}
    with _OpLog() as log:
        moe_experts_fused(h, weights, indices, up, gate, down, act)
    assert not syncing & set(log.ops), sorted(syncing & set(log.ops))
    assert ("_grouped_mm" in log.ops) == (L == 40)
    with _OpLog() as log:
        moe_experts_ref(h, weights, indices, up, gate, down, act)
    assert {"_local_scalar_dense", "bincount"} & set(log.ops)


def _moe_config(family: str) -> HybridConfig:
    common = dict(vocab_size=32, hidden_size=48, layer_types=("moe",), n_routed_experts=12,
                  num_experts_per_tok=4, moe_intermediate_size=24, moe_shared_expert_intermediate_size=32)
    if family == "nemotron_h":  # latent relu2 experts, sigmoid router with correction bias, scaling 5
        return HybridConfig(family=family, moe_latent_size=16, routed_scaling_factor=5.0, **common)
    return HybridConfig(family=family, mlp_hidden_act="silu", mlp_gated=True, moe_scoring_func="softmax",
                        moe_shared_expert_gate=True, norm_weight_offset=1.0, **common)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_moe_block_fused_equals_ref(family):
    torch.manual_seed(0)
    moe = MoE(_moe_config(family))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
        if hasattr(moe.gate, "e_score_correction_bias"):
            moe.gate.e_score_correction_bias.copy_(0.1 * torch.randn(12))
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        fused = moe(x)
        moe.experts_impl = "ref"
        ref = moe(x)
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
    assert fused.abs().max() > 0.1  # the routed part is not vanishing


def test_router_dispatches_to_the_decode_forms_where_allowed(monkeypatch):
    """TopkRouter.forward hands x (unit-stride rows), the float32 weight and its routing options to
    kernels.router.router_fused where router_form says "fused", to router_logits then topk_route where it says
    "logits", and computes F.linear + the reference otherwise; router_form is "linear" for CPU tensors, past
    the table's last bound, for group-limited routing, other dtypes, under autograd and with an empty table,
    and refuses a table it cannot honour (bounds out of order or above ROUTER_FUSED_MAX_TOKENS, unknown
    forms) at any token count."""
    import runners.engine.models.moe as moe_mod
    from kernels.router import topk_route_ref

    torch.manual_seed(0)
    moe = MoE(_moe_config("nemotron_h"))
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape))
    x = torch.randn(2, 48)
    assert moe_mod.router_form(x, 1) == "linear"
    monkeypatch.setattr(moe_mod, "ROUTER_FORMS", ((1, "fused"), (8, "logits")))
    assert moe_mod.router_form(x, 1) == "linear"  # CPU
    with torch.no_grad():
        want = moe.gate(x)
    calls = []

    def fake_fused(xx, weight, top_k, **kw):
        calls.append(("fused", xx.stride(-1), weight.dtype, top_k, sorted(kw)))
        return topk_route_ref(torch.nn.functional.linear(xx.float(), weight), top_k, **kw)

    def fake_logits(xx, weight):
        calls.append(("logits", xx.stride(-1), weight.dtype))
        return torch.nn.functional.linear(xx.float(), weight)

    def fake_topk(logits, top_k, **kw):
        calls.append(("topk", logits.dtype, top_k, sorted(kw)))
        return topk_route_ref(logits, top_k, **kw)

    monkeypatch.setattr(moe_mod, "router_fused", fake_fused)
    monkeypatch.setattr(moe_mod, "router_logits", fake_logits)
    monkeypatch.setattr(moe_mod, "topk_route", fake_topk)
    opts = ["bias", "norm_topk_prob", "scaling", "softmax"]
    k = moe.gate.top_k
    for form, expect in (("fused", [("fused", 1, torch.float32, k, opts)]),
                         ("logits", [("logits", 1, torch.float32), ("topk", torch.float32, k, opts)])):
        calls.clear()
        monkeypatch.setattr(moe_mod, "router_form", lambda xx, n_group, f=form: f)
        with torch.no_grad():
            got = moe.gate(x.t().contiguous().t())  # column-major x: handed over with unit-stride rows
        assert calls == expect
        assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0])
    monkeypatch.undo()
    # the dispatch as CUDA sees it (on_cuda: what count_step_ops asks on the CPU)
    form = moe_mod.router_form
    monkeypatch.setattr(moe_mod, "ROUTER_FORMS", ((1, "fused"), (2, "logits")))
    with torch.no_grad():
        assert [form(x[:n], 1, on_cuda=True) for n in (1, 2)] == ["fused", "logits"]
        assert form(torch.cat([x, x]), 1, on_cuda=True) == "linear"  # past the last bound
        assert form(x, 2, on_cuda=True) == "linear"  # group-limited routing
        assert form(x.to(torch.int32), 1, on_cuda=True) == "linear"  # a dtype the kernels do not read
    assert form(x[:1], 1, on_cuda=True) == "linear"  # autograd on: the kernels have no backward
    monkeypatch.setattr(moe_mod, "ROUTER_FORMS", ())
    with torch.no_grad():
        assert form(x[:1], 1, on_cuda=True) == "linear"  # an empty table
    # a table that cannot be honoured is refused whole, whatever the token count asked
    for bad in (((1, "fused"), (16, "logits")), ((8, "logits"), (1, "fused")), ((1, "sorted"),),
                ((0, "fused"),)):
        monkeypatch.setattr(moe_mod, "ROUTER_FORMS", bad)
        with pytest.raises(ValueError, match="ROUTER_FORMS entry"), torch.no_grad():
            form(x[:1], 1, on_cuda=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
@pytest.mark.parametrize("form", ["fused", "logits"])
def test_gpu_decode_router_forms_route_as_the_three_launches(family, form, monkeypatch):
    """On CUDA, each decode form of ROUTER_FORMS gives the MoE block the routing of the three launches
    (F.linear, topk_route) at 1 and 4 tokens, eager and replayed from a CUDA graph."""
    import runners.engine.models.moe as moe_mod

    torch.manual_seed(0)
    moe = MoE(_moe_config(family)).cuda()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    for n in (1, 4):
        x = torch.randn(n, 48, device="cuda").bfloat16()
        with torch.no_grad():
            monkeypatch.setattr(moe_mod, "ROUTER_FORMS", ())  # the three launches: the reference routing
            want = moe.gate(x)
            monkeypatch.setattr(moe_mod, "ROUTER_FORMS", ((8, form),))
            assert moe_mod.router_form(x, moe.gate.n_group) == form
            got = moe.gate(x)
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = moe.gate(static)
            static.copy_(x)
            graph.replay()
            monkeypatch.setattr(moe_mod, "ROUTER_FORMS", ())
        for w, i in (got, captured):
            assert torch.equal(i, want[1])
            torch.testing.assert_close(w, want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "swiglu"])
def test_fused_moe_cuda_graph_replay_equals_eager(gated):
    """bf16 on CUDA (torch._grouped_mm's CUTLASS path): no host sync (sync debug mode "error"), and a
    CUDA graph of the whole MoE step replays equal to eager on new inputs copied into its static buffers."""
    dev = "cuda"
    E, I, L, N, k = 64, 256, 128, 8, 6
    up, gate, down = _experts(E, I, L, gated, dtype=torch.bfloat16, device=dev)
    act = ACTIVATIONS["silu" if gated else "relu2"]
    h = torch.randn(N, L, device=dev, dtype=torch.bfloat16)
    weights, indices = _routing(N, k, E, device=dev)
    assert grouped_mm_supported(h, up, down)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = moe_experts_fused(h, weights, indices, up, gate, down, act)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = moe_experts_ref(h, weights, indices, up, gate, down, act)
    torch.testing.assert_close(eager.float(), ref.float(), rtol=2e-2, atol=2e-2)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            moe_experts_fused(h, weights, indices, up, gate, down, act)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_fused(h, weights, indices, up, gate, down, act)
    for seed in (1, 2):
        w2, i2 = _routing(N, k, E, seed=seed, device=dev)
        h2 = torch.randn(N, L, device=dev, dtype=torch.bfloat16)
        h.copy_(h2), weights.copy_(w2), indices.copy_(i2)
        graph.replay()
        torch.cuda.synchronize()
        want = moe_experts_fused(h2, w2, i2, up, gate, down, act)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_moe_block_cuda_graph_replay_equals_eager(family):
    """The whole MoE block (router, latent projections / gated shared expert, fused experts) in bf16 is
    captured in one CUDA graph and replays equal to eager on a new input."""
    c = _moe_config(family)
    sizes = dict(hidden_size=256, moe_intermediate_size=128, moe_shared_expert_intermediate_size=128,
                 n_routed_experts=32, moe_latent_size=64 if family == "nemotron_h" else None)
    c = HybridConfig(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, **sizes})
    torch.manual_seed(0)
    moe = MoE(c)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    moe = moe.cuda()
    for name, p in moe.named_parameters():
        if not name.startswith("gate."):  # the router stays float32, as the loader keeps it
            p.data = p.data.bfloat16()
    x = torch.randn(4, 3, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                moe(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        x2 = torch.randn_like(x)
        x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, moe(x2), rtol=0, atol=0)
