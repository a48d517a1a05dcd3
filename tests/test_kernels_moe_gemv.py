"""Routed-experts GEMV kernels (kernels/moe_gemv.py) against their PyTorch reference and against the engine's
per-expert loop (runners/engine/models/moe.py's moe_experts_ref), and the engine's choice of path.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton is imported) at
small awkward sizes: L = 300 and I = 150 (neither a multiple of the 16..64-row output tiles nor of the
128-column K slices), E = 7 experts, routing with experts repeated across tokens, k = 1, all pairs on one
expert. The K-split path (fp32 partial sums, which torch / the combine kernel add) is forced by raising
kernels/quant/_common.py's GEMV_TARGET_PROGRAMS, the unsplit one (activation fused) by lowering it.
tests/test_kernels_moe_gemv_gpu.py holds the release-shape and CUDA-graph checks.

Tolerances, as a fraction of the largest |reference| output. Kernel vs moe_gemv_ref: both round every
projection to the dtype at the same points and differ only in the fp32 summation order; an intermediate that
lands on the other side of a rounding boundary moves the output by about one ulp of the dtype:
  float32 1e-5, float16 2e-3 (two fp16 ulps, 2^-10 each), bfloat16 1.6e-2 (two bf16 ulps, 2^-7).
Kernel vs moe_experts_ref (torch matmuls, same rounding points): the same bounds.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels import moe_gemv as mg  # noqa: E402
from kernels.quant import _common as quant_common  # noqa: E402
from runners.engine.models import moe as engine_moe  # noqa: E402
from runners.engine.models.layers import ACTIVATIONS  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(E, I, L, gated, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) / math.sqrt(s[-1])).to(dtype=dtype, device=DEVICE)
    return r(E, I, L), (r(E, I, L) if gated else None), r(E, L, I)


def _routing(N, k, E, seed=0, mode="random"):
    """(weights float32 [N, k], indices int64 [N, k]): distinct experts per token drawn from ``E``;
    "shared" routes every token to the same k experts (each repeated across all tokens), "one" every pair to
    expert 2."""
    g = torch.Generator().manual_seed(seed)
    if mode == "one":
        indices = torch.full((N, k), 2, dtype=torch.long)
    elif mode == "shared":
        indices = torch.randperm(E, generator=g)[:k].expand(N, k).clone()
    else:
        indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    return weights.to(DEVICE), indices.to(DEVICE)


def _close(got, want, dtype):
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert not got.isnan().any()
    scale = want.float().abs().max().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


@pytest.fixture
def unsplit(monkeypatch):
    """Force the unsplit launches (activation fused): a target of 1 program."""
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", 1)


@pytest.fixture
def split(monkeypatch):
    """Force the K-split launches: a target no grid reaches, so every 128-column step is its own split."""
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", 10**6)


def test_config_splits_only_where_asked(monkeypatch):
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", 10**6)
    bn, bk, split, steps = mg.pair_gemv_config(3, 24, 300)
    assert (bn, bk, split, steps) == (16, 128, 3, 1)  # one 128-column step per split: 3 splits cover 300
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", 1)
    bn, bk, split, steps = mg.pair_gemv_config(3, 24, 300)
    assert split == 1 and bk * steps >= 300 and bk >= mg.GEMV_BLOCK_K


CASES = {  # name: (N tokens, k, E, I, L, routing mode)
    "random": (3, 2, 7, 150, 300, "random"),
    "repeated experts across tokens": (3, 2, 7, 150, 300, "shared"),
    "k = 1": (5, 1, 7, 150, 300, "random"),
    "all pairs on one expert": (3, 2, 7, 150, 300, "one"),
    "tiny sizes": (2, 2, 3, 20, 36, "random"),
}
SPLIT_CASES = {"split": (2, 2, 7, 150, 300, "shared")}  # 3 splits for gate / up, 2 for down


# Every routing case in float32 (the strictest tolerance: a wrong pair, expert or row is an O(1) error), and
# the 16-bit dtypes (their rounding points and casts) on the random routing: routing and dtype are separate
# code paths of the kernels (indices vs loads / stores), so their full cross product repeats the same checks
# at ~1.5 s per interpreted case.
DTYPE_CASES = [(case, torch.float32) for case in CASES] + [
    ("random", dtype) for dtype in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "swiglu"])
@pytest.mark.parametrize("case, dtype", DTYPE_CASES, ids=str)
def test_kernel_equals_reference(case, dtype, gated, unsplit):
    _check_case(case, dtype, gated)


@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_split_k_equals_reference(dtype, gated, split):
    assert mg.pair_gemv_config(4, 150, 300)[2] == 3 and mg.pair_gemv_config(4, 300, 150)[2] == 2
    _check_case("split", dtype, gated)


def _check_case(case, dtype, gated):
    N, k, E, I, L, mode = {**CASES, **SPLIT_CASES}[case]
    up, gate, down = _experts(E, I, L, gated, dtype)
    weights, indices = _routing(N, k, E, mode=mode)
    h = torch.randn(N, L, generator=torch.Generator().manual_seed(3)).to(dtype=dtype, device=DEVICE)
    act = "silu" if gated else "relu2"
    got = mg.moe_gemv(h, weights, indices, up, gate, down, act)
    _close(got, mg.moe_gemv_ref(h, weights, indices, up, gate, down, act), dtype)


@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernel_equals_the_engine_reference_loop(dtype, gated, unsplit):
    N, k, E, I, L = 3, 2, 7, 150, 300
    up, gate, down = _experts(E, I, L, gated, dtype, seed=1)
    weights, indices = _routing(N, k, E, seed=1, mode="shared")
    indices[0, 0] = int(indices[0, 1])  # an expert chosen twice by one token too
    h = torch.randn(N, L, generator=torch.Generator().manual_seed(4)).to(dtype=dtype, device=DEVICE)
    act = "silu" if gated else "relu2"
    want = engine_moe.moe_experts_ref(h, weights, indices, up, gate, down, ACTIVATIONS[act])
    _close(mg.moe_gemv(h, weights, indices, up, gate, down, act), want, dtype)


def test_reference_equals_the_engine_reference_loop_fp32():
    """The two specifications agree: moe_gemv_ref (pair by pair) and moe_experts_ref (expert by expert)."""
    up, gate, down = _experts(6, 24, 40, True, torch.float32, seed=2)
    weights, indices = _routing(9, 3, 6, seed=2)
    h = torch.randn(9, 40, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = engine_moe.moe_experts_ref(h, weights, indices, up, gate, down, ACTIVATIONS["silu"])
    torch.testing.assert_close(mg.moe_gemv_ref(h, weights, indices, up, gate, down, "silu"), want,
                               rtol=1e-5, atol=1e-6)


def test_strided_input_and_no_tokens():
    up, _, down = _experts(5, 20, 36, False, torch.float32)
    weights, indices = _routing(3, 2, 5)
    wide = torch.randn(3, 72, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    h = wide[:, ::2]  # row stride 72, column stride 2
    _close(mg.moe_gemv(h, weights, indices, up, None, down, "relu2"),
           mg.moe_gemv_ref(h.contiguous(), weights, indices, up, None, down, "relu2"), torch.float32)
    empty = mg.moe_gemv(h[:0], weights[:0], indices[:0], up, None, down, "relu2")
    assert empty.shape == (0, 36)


@pytest.mark.parametrize("change, says", [
    (dict(activation="gelu"), "activation must be one of"),
    (dict(h=torch.zeros(3, 35)), "up must be [E, I, L = 35]"),
    (dict(indices=torch.zeros(3, 2, dtype=torch.int32)), "indices must be int64"),
    (dict(weights=torch.zeros(3, 2, dtype=torch.float16)), "weights must be float32"),
    (dict(down=torch.zeros(5, 20, 36)), "down must be [E, L, I]"),
    (dict(gate=torch.zeros(5, 20, 30)), "gate must be [E, I, L]"),
    (dict(h=torch.zeros(3, 36, dtype=torch.float16)), "give the experts h's dtype"),
])
def test_refuses_bad_arguments(change, says):
    up, _, down = _experts(5, 20, 36, False, torch.float32)
    weights, indices = _routing(3, 2, 5)
    args = dict(h=torch.zeros(3, 36), weights=weights.cpu(), indices=indices.cpu(), up=up.cpu(), gate=None,
                down=down.cpu(), activation="relu2")
    args.update(change)
    for fn in (mg.moe_gemv, mg.moe_gemv_ref):
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
            fn(**args)


def test_engine_picks_the_gemv_path_only_on_cuda_below_the_bound():
    w = torch.zeros(4, 8, 16)
    small = torch.zeros(engine_moe.MOE_GEMV_MAX_PAIRS, 1, dtype=torch.long)
    assert not engine_moe.use_moe_gemv(torch.zeros(1, 16), small, w, w)  # the CPU keeps the grouped path
    if torch.cuda.is_available():
        h = torch.zeros(1, 16, device="cuda")
        wc = w.cuda()
        assert engine_moe.use_moe_gemv(h, small.cuda(), wc, wc)
        big = torch.zeros(engine_moe.MOE_GEMV_MAX_PAIRS + 1, 1, dtype=torch.long, device="cuda")
        assert not engine_moe.use_moe_gemv(h, big, wc, wc)
        assert not engine_moe.use_moe_gemv(h, small.cuda(), wc.half(), wc)


@pytest.mark.parametrize("act", ["relu2", "silu"])
def test_moe_block_names_its_activation_to_the_fused_path(act, monkeypatch):
    """MoE hands moe_experts_fused the name of its activation (the GEMV kernels fuse only what they know by
    name), and the kernels' reference computes the same function under that name as layers.ACTIVATIONS."""
    from runners.engine.models import layers
    from runners.engine.models.config import HybridConfig

    x = torch.randn(3, 5)
    torch.testing.assert_close(mg.act_ref(x, act), layers.ACTIVATIONS[act](x), rtol=0, atol=0)
    seen = {}
    record = lambda *args, activation=None: seen.setdefault("a", activation)
    monkeypatch.setattr(engine_moe, "moe_experts_fused", record)
    c = HybridConfig(family="qwen3_next", vocab_size=32, hidden_size=16, layer_types=("moe",),
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                     moe_shared_expert_intermediate_size=8, mlp_hidden_act=act, mlp_gated=act == "silu")
    moe = engine_moe.MoE(c)
    moe._experts(torch.zeros(2, 16), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))
    assert seen["a"] == act


def test_fused_path_dispatches_to_the_kernels_when_chosen(monkeypatch, unsplit):
    """moe_experts_fused with an activation name runs moe_gemv where use_moe_gemv holds (forced here: on the
    CPU it never does) and equals the engine's reference loop; without a name it keeps the grouped path."""
    up, gate, down = _experts(5, 20, 36, True, torch.float32, seed=3)
    weights, indices = _routing(3, 2, 5, seed=3)
    h = torch.randn(3, 36, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    calls = []
    kernel = engine_moe.moe_gemv
    monkeypatch.setattr(engine_moe, "use_moe_gemv", lambda *a: True)
    monkeypatch.setattr(engine_moe, "moe_gemv", lambda *a: calls.append(a[-1]) or kernel(*a))
    act = ACTIVATIONS["silu"]
    want = engine_moe.moe_experts_ref(h, weights, indices, up, gate, down, act)
    got = engine_moe.moe_experts_fused(h, weights, indices, up, gate, down, act, activation="silu")
    assert calls == ["silu"]
    _close(got, want, torch.float32)
    engine_moe.moe_experts_fused(h, weights, indices, up, gate, down, act)
    assert calls == ["silu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, k", [(5, 3), (1, 1), (4, 22)])
def test_combine_sorted_equals_its_reference(N, k, dtype):
    """combine_sorted (the grouped path's last step: y's expert-sorted rows read through ``rows``, weighted
    and summed over the k choices in float32) against combine_sorted_ref, L = 300 (not a multiple of the
    256-column tile), y a column slice of a wider tensor; and against the sum in float64, which a wrong row or
    weight would miss (the summation order only within the tolerance)."""
    g = torch.Generator().manual_seed(N * 100 + k)
    L = 300
    wide = torch.randn(N * k, L + 7, generator=g).to(dtype)
    y = wide[:, 7:]
    rows = torch.randperm(N * k, generator=g)
    weights = torch.rand(N, k, generator=g)
    y, rows, weights = y.to(DEVICE), rows.to(DEVICE), weights.to(DEVICE)
    got = mg.combine_sorted(y, rows, weights)
    _close(got, mg.combine_sorted_ref(y, rows, weights), dtype)
    ordered = y.double()[rows].view(N, k, L)
    want = torch.zeros(N, L, dtype=torch.float64, device=DEVICE)
    for j in range(k):
        want += ordered[:, j] * weights[:, j, None].double()
    _close(got, want.to(dtype), dtype)


def test_combine_sorted_refuses_bad_arguments():
    y, rows, w = torch.zeros(6, 4), torch.arange(6), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"N \* k = P"):
        mg.combine_sorted(y, rows[:5], w)
    with pytest.raises(ValueError, match="rows must be int64 and weights float32"):
        mg.combine_sorted(y, rows.int(), w)
    with pytest.raises(ValueError, match="rows must be int64 and weights float32"):
        mg.combine_sorted(y, rows, w.double())
    with pytest.raises(ValueError, match="y must be float32, bfloat16 or float16"):
        mg.combine_sorted(y.double(), rows, w)
    for N, k in ((0, 3), (2, 0)):  # no tokens, no choices: zeros from the kernel and the reference alike
        args = (torch.zeros(N * k, 4), torch.zeros(N * k, dtype=torch.long), torch.zeros(N, k))
        assert torch.equal(mg.combine_sorted(*args), torch.zeros(N, 4))
        assert torch.equal(mg.combine_sorted_ref(*args), torch.zeros(N, 4))
