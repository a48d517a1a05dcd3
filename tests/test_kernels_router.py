"""kernels/router.py: the sort-free top-k router kernel against its PyTorch reference (the router the MoE
layer runs), in the Triton interpreter on the CPU (fp32), and at the releases' router shapes on a GPU.

Sizes: E in {5, 12, 64} (not powers of two but 64), k in {1, 4, 5} (k = E once), N in {1, 3, 9}; sigmoid with
and without the correction bias, softmax; with and without renormalisation; a routed scaling factor. Logits
are random (no ties, so the indices must agree exactly); the weights agree to float32 rounding (rtol 1e-6:
the softmax's sum is reduced in another order). Outputs are NaN / garbage-filled by ``torch.empty`` and every
element is compared.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

import kernels.router as router  # noqa: E402
from kernels.router import router_fused, topk_route, topk_route_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(N, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5
    return logits.to(DEV), bias.to(DEV)


@pytest.mark.parametrize("N, E, k", [(1, 5, 1), (3, 12, 4), (9, 64, 5), (2, 5, 5)])
@pytest.mark.parametrize("mode", ["sigmoid", "sigmoid+bias", "softmax"])
@pytest.mark.parametrize("norm, scaling", [(True, 2.5), (False, 1.0)])
def test_kernel_equals_reference(N, E, k, mode, norm, scaling):
    logits, bias = _case(N, E, seed=N * E + k)
    kw = dict(softmax=mode == "softmax", bias=bias if mode == "sigmoid+bias" else None, norm_topk_prob=norm,
              scaling=scaling)
    w, i = topk_route(logits, k, **kw)
    w_ref, i_ref = topk_route_ref(logits, k, **kw)
    assert i.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == i.shape == (N, k)
    assert torch.equal(i, i_ref), (i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shift", [-5.0, -0.5, None])
def test_release_sizes_with_negative_choices(shift):
    """Super V3's router size (top-22 of 512) with every choice negative (sigmoid scores plus a bias shifted
    by -5), mixed in sign (shifted by -0.5) and softmax's positive ones: the kernel's integer keys must order
    negative floats as the floats order, so the indices match the reference exactly and the weights to
    float32 rounding."""
    logits, bias = _case(3, 512, seed=7)
    if shift is not None:
        choices = torch.sigmoid(logits) + bias + shift
        assert (choices < 0).all() if shift == -5.0 else ((choices < 0).any() and (choices > 0).any())
    kw = dict(softmax=shift is None, bias=None if shift is None else bias + shift, norm_topk_prob=True,
              scaling=2.5)
    w, i = topk_route(logits, 22, **kw)
    w_ref, i_ref = topk_route_ref(logits, 22, **kw)
    assert torch.equal(i, i_ref), (i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_bias_selects_but_does_not_weight():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=DEV)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], device=DEV)
    w, i = topk_route(logits, 2, softmax=False, bias=bias, norm_topk_prob=False)
    assert i.tolist() == [[0, 3]]  # expert 0 chosen through its bias
    torch.testing.assert_close(w, torch.sigmoid(logits[:, [0, 3]]))


def test_ties_go_to_the_lower_index():
    logits = torch.zeros(1, 6, device=DEV)
    w, i = topk_route(logits, 3, softmax=True)
    assert i.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(w, torch.full((1, 3), 1 / 3, device=DEV))


@pytest.mark.parametrize("mode", ["sigmoid", "sigmoid+bias", "softmax"])
def test_nan_rows_give_in_range_indices(mode):
    """A poisoned PAD row (NaN logits, as the CUDA-graph tests' poisoned buffers make) must not index past
    E: the MoE gathers by these indices (an out-of-range one is a device-side assert on CUDA). Rows with
    one NaN pick it first, as torch.topk ranks NaN; the finite rows are untouched."""
    logits, bias = _case(4, 24)
    logits[1] = float("nan")
    logits[2, 7] = float("nan")
    kw = dict(softmax=mode == "softmax", bias=bias if mode == "sigmoid+bias" else None)
    w, i = topk_route(logits, 4, **kw)
    assert ((i >= 0) & (i < 24)).all(), i
    assert i[1].tolist() == [0, 1, 2, 3] and w[1].isnan().all()
    if mode != "softmax":  # softmax spreads one NaN over the whole row
        assert i[2, 0] == 7
    w_ref, i_ref = topk_route_ref(logits, 4, **kw)
    for r in (0, 3):
        assert i[r].tolist() == i_ref[r].tolist()
        torch.testing.assert_close(w[r], w_ref[r])


def _fused_case(N, E, D, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, D, generator=g) * 2).to(torch.bfloat16)
    weight = torch.randn(E, D, generator=g) / D ** 0.5
    bias = torch.randn(E, generator=g) * 0.5
    return x.to(DEV), weight.to(DEV), bias.to(DEV)


# launch shapes of the fused router: the table's, one expert per program with the whole row in one tile
# (one warp: one row routed per pass at 512 experts), and two narrower tiles routing several rows per pass
_CONFIGS = [None, router.FusedConfig(1, 0, 1), router.FusedConfig(2, 256, 2), router.FusedConfig(1, 64, 4)]


# (the interpreter runs programs one after another: the release-sized case keeps the table's shape; 300
# experts route one row per pass on one warp, two per pass on two)
@pytest.mark.parametrize("N, E, D, k, configs", [
    (1, 5, 16, 1, _CONFIGS), (3, 12, 700, 4, _CONFIGS[:2]), (8, 64, 1030, 5, _CONFIGS[:1]),
    (4, 512, 2048, 22, _CONFIGS[:1]), (3, 300, 64, 4, _CONFIGS[1:3])])
@pytest.mark.parametrize("mode", ["sigmoid+bias", "softmax"])
def test_fused_router_equals_linear_then_reference(N, E, D, k, configs, mode):
    """router_fused (the logits GEMV and the routing in one launch, the last program routing, one row or
    several per pass) against F.linear in float32 then topk_route_ref, at each launch shape: indices exact
    (random data: no near-ties), weights to float32 rounding; D not a multiple of the weight tile, E not of
    the experts per program, N not of the rows per pass; the device counter is back at 0 and a second call
    gives the same bits. router_logits (the GEMV alone) gives F.linear's logits to float32 rounding."""
    x, weight, bias = _fused_case(N, E, D, seed=N * E + D)
    kw = dict(softmax=mode == "softmax", bias=None if mode == "softmax" else bias, norm_topk_prob=True,
              scaling=2.5)
    logits = torch.nn.functional.linear(x.float(), weight)
    w_ref, i_ref = topk_route_ref(logits, k, **kw)
    for config in configs:
        _check_fused(x, weight, k, kw, config, logits, w_ref, i_ref)


def _check_fused(x, weight, k, kw, config, logits, w_ref, i_ref):
    N = x.shape[0]
    torch.testing.assert_close(router.router_logits(x, weight, config), logits, rtol=1e-5, atol=1e-5)
    w, i = router_fused(x, weight, k, config=config, **kw)
    assert i.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == i.shape == (N, k)
    assert torch.equal(i, i_ref), (i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    assert router._COUNTERS[x.device].item() == 0
    w2, i2 = router_fused(x, weight, k, config=config, **kw)
    assert torch.equal(w2, w) and torch.equal(i2, i)


def test_fused_configs_and_rows_per_pass():
    """FusedConfig refuses what the kernel cannot take (experts and warps powers of two, block_d 0 or a
    power of two); rows per pass keep at most 16 keys per lane and stay within the padded tokens; the table
    has an entry for every token count the fused router takes."""
    for bad in (dict(experts=3, block_d=0, num_warps=1), dict(experts=1, block_d=100, num_warps=1),
                dict(experts=1, block_d=0, num_warps=0)):
        with pytest.raises(ValueError, match="power of two"):
            router.FusedConfig(**bad)
    assert router.FusedConfig(2, 0, 4).name == "e2_drow_w4"
    assert router.route_rows_per_pass(8, 512, 1) == 1
    assert router.route_rows_per_pass(8, 512, 4) == 4
    assert router.route_rows_per_pass(2, 64, 4) == 2
    assert router.route_rows_per_pass(1, 4096, 1) == 1
    for n in range(1, router.ROUTER_FUSED_MAX_TOKENS + 1):
        assert isinstance(router.fused_config(n), router.FusedConfig)
    with pytest.raises(ValueError, match="no entry"):
        router.fused_config(router.ROUTER_FUSED_MAX_TOKENS + 1)


def test_a_config_table_that_cannot_be_honoured_is_refused_whole(monkeypatch):
    """ROUTER_FUSED_CONFIGS is checked whole before a lookup: bounds out of order, above
    ROUTER_FUSED_MAX_TOKENS or not configs are refused even for a token count an earlier entry covers."""
    c = router.FusedConfig(1, 0, 1)
    for bad in (((8, c), (1, c)), ((1, c), (16, c)), ((8, "e1"),)):
        monkeypatch.setattr(router, "ROUTER_FUSED_CONFIGS", bad)
        with pytest.raises(ValueError, match="ROUTER_FUSED_CONFIGS entry"):
            router.fused_config(1)


@pytest.mark.gpu
@pytest.mark.parametrize("E, D, k, softmax", [(512, 4096, 22, False), (512, 2048, 10, True)])
def test_gpu_fused_router_release_shapes_replayed(E, D, k, softmax):
    """router_fused at the releases' router shapes against F.linear + topk_route: every launch shape of
    FUSED_CANDIDATES eager at 1, 3 and 8 tokens (router_logits too), and the table's over repeated CUDA-graph
    replays with new inputs each time."""
    kw = dict(softmax=softmax, norm_topk_prob=True, scaling=1.0 if softmax else 5.0)
    x, weight, bias = _fused_case(4, E, D, seed=11)
    kw["bias"] = None if softmax else bias

    def want(xx):
        return topk_route(torch.nn.functional.linear(xx.float(), weight), k, **kw)

    for config in router.FUSED_CANDIDATES:  # every launch shape bench_router times, eager
        for n in (1, 3, 8):
            xn = _fused_case(n, E, D, seed=20 + n)[0]
            w_ref, i_ref = want(xn)
            w, i = router_fused(xn, weight, k, config=config, **kw)
            assert torch.equal(i, i_ref), config
            torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(router.router_logits(xn, weight, config),
                                       torch.nn.functional.linear(xn.float(), weight), rtol=1e-5, atol=1e-5)
    w, i = router_fused(x, weight, k, **kw)
    assert torch.equal(i, want(x)[1])
    static = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        wg, ig = router_fused(static, weight, k, **kw)
    for seed in range(5):
        new = _fused_case(4, E, D, seed=100 + seed)[0]
        static.copy_(new)
        g.replay()
        w_ref, i_ref = want(new)
        assert torch.equal(ig, i_ref), seed
        torch.testing.assert_close(wg, w_ref, rtol=1e-5, atol=1e-6)
    assert router._COUNTERS[x.device].item() == 0


def test_fused_router_nan_rows_and_refusals():
    """A poisoned PAD row (NaN activations) routes to in-range experts with NaN weights and leaves the other
    rows as the reference routes them; more tokens than ROUTER_FUSED_MAX_TOKENS, a weight not float32 and a
    bias with softmax are refused with the fix named."""
    x, weight, bias = _fused_case(3, 24, 64, seed=3)
    x[1] = float("nan")
    w, i = router_fused(x, weight, 4, softmax=False, bias=bias)
    assert ((i >= 0) & (i < 24)).all() and w[1].isnan().all()
    w_ref, i_ref = topk_route_ref(torch.nn.functional.linear(x.float(), weight), 4, softmax=False, bias=bias)
    for r in (0, 2):
        assert torch.equal(i[r], i_ref[r])
    big = torch.zeros(router.ROUTER_FUSED_MAX_TOKENS + 1, 64, device=DEV)
    with pytest.raises(ValueError, match="ROUTER_FUSED_MAX_TOKENS"):
        router_fused(big, weight, 4, softmax=True)
    with pytest.raises(ValueError, match="float32"):
        router_fused(x, weight.half(), 4, softmax=True)
    with pytest.raises(ValueError, match="sigmoid scoring only"):
        router_fused(x, weight, 4, softmax=True, bias=bias)


@pytest.mark.parametrize("bad, says", [
    (dict(logits=torch.zeros(2, 4, dtype=torch.float16)), "float32"),
    (dict(top_k=5), "top_k=5"),
    (dict(softmax=True, bias=torch.zeros(4)), "sigmoid scoring only"),
])
def test_refuses_bad_inputs(bad, says):
    args = dict(logits=torch.zeros(2, 4), top_k=2, softmax=False, bias=None)
    args.update(bad)
    args = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=says):
        topk_route(args.pop("logits"), args.pop("top_k"), **args)


# the releases' routers: Super V3 512 experts top-22 sigmoid + bias, scaling 5; Qwen3-Next 512 top-10 softmax
@pytest.mark.gpu
@pytest.mark.parametrize("E, k, softmax, scaling", [(512, 22, False, 5.0), (512, 10, True, 1.0)])
@pytest.mark.parametrize("N", [1, 8, 256])
def test_gpu_release_shapes_and_graph_capture(E, k, softmax, scaling, N):
    logits, bias = _case(N, E, seed=7)
    kw = dict(softmax=softmax, bias=None if softmax else bias, scaling=scaling)
    w, i = topk_route(logits, k, **kw)
    w_ref, i_ref = topk_route_ref(logits, k, **kw)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    static = logits.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        wg, ig = topk_route(static, k, **kw)
    static.copy_(logits.flip(0))
    g.replay()
    w2, i2 = topk_route_ref(logits.flip(0), k, **kw)
    assert torch.equal(ig, i2)
    torch.testing.assert_close(wg, w2, rtol=1e-6, atol=1e-6)


def test_a_table_that_passed_is_checked_once():
    """check_bounds_table remembers a table that passed (the router's eager calls pay the check once) and
    still refuses a malformed one every time; a list (unhashable) is checked on each call."""
    seen = []

    def allowed(v):
        seen.append(v)
        return v in ("a", "b")

    table = ((1, "a"), (router.ROUTER_FUSED_MAX_TOKENS, "b"))
    for _ in range(3):
        router.check_bounds_table("T_once", table, allowed)
    assert seen == ["a", "b"]
    for _ in range(2):
        router.check_bounds_table("T_list", [(1, "a")], allowed)
    assert seen == ["a", "b", "a", "a"]
    for _ in range(2):
        with pytest.raises(ValueError, match="T_bad entry"):
            router.check_bounds_table("T_bad", ((2, "a"), (1, "b")), allowed)
