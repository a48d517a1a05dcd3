"""Quantized routed-experts GEMV kernels (kernels/quant/moe_gemv.py's per-pair scheme, each format's launcher
in its file: NVFP4 W4A16 and block FP8) against their
moe_experts_grouped over kernels/quant's grouped-GEMM references), and the quantized MoE modules' choice of
path.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton is imported) at
small awkward sizes: NVFP4 L = 200, I = 72 (whole int32 words of codes, not whole 16-column scale groups);
block FP8 L = 300, I = 150 (partial 128-column groups and 128 x 128 blocks); E = 7, repeated experts. The
K-split path is forced as in tests/test_kernels_moe_gemv.py. tests/test_kernels_quant_moe_gemv_gpu.py holds
the release-shape and CUDA-graph checks.

Tolerances as tests/test_kernels_moe_gemv.py (fraction of the largest |reference| output; both sides round
at the same points and differ in the fp32 summation order): float32 1e-5, float16 2e-3, bfloat16 1.6e-2.
Against the grouped path the same: it rounds at the same points.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.quant import _common as quant_common  # noqa: E402
from kernels.quant import block_fp8 as bf8  # noqa: E402
from kernels.quant import nvfp4 as nf4  # noqa: E402
from runners.engine.models.layers import ACTIVATIONS  # noqa: E402
from runners.engine.models.moe import moe_experts_grouped  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = {"nvfp4": (200, 72), "block_fp8": (300, 150)}  # (L, I)


def _quantize(fmt, w):
    if fmt == "nvfp4":
        return tuple(t.to(DEVICE) for t in nf4.nvfp4_quantize(w))
    q, s = bf8.block_fp8_quantize(w)
    return q.to(DEVICE), s.float().to(DEVICE)


def _experts(fmt, E, gated, seed=0):
    L, I = SIZES[fmt]
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / math.sqrt(s[-1])
    up, gate, down = r(E, I, L), (r(E, I, L) if gated else None), r(E, L, I)
    return _quantize(fmt, up), (_quantize(fmt, gate) if gated else None), _quantize(fmt, down)


def _routing(N, k, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    indices[-1] = indices[0]  # one token's experts repeated by another
    return torch.rand(N, k, generator=g).to(DEVICE), indices.to(DEVICE)


def _close(got, want, dtype):
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert not got.isnan().any()
    scale = want.float().abs().max().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


KERNELS = {"nvfp4": (nf4.moe_gemv_nvfp4, nf4.moe_gemv_nvfp4_ref),
           "block_fp8": (bf8.moe_gemv_block_fp8, bf8.moe_gemv_block_fp8_ref)}


def _case(fmt, dtype, gated, N=3, k=2, E=7, seed=0):
    up, gate, down = _experts(fmt, E, gated, seed)
    weights, indices = _routing(N, k, E, seed)
    L = SIZES[fmt][0]
    h = torch.randn(N, L, generator=torch.Generator().manual_seed(seed + 3)).to(dtype=dtype, device=DEVICE)
    return h, weights, indices, up, gate, down, "silu" if gated else "relu2"


@pytest.fixture
def unsplit(monkeypatch):
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", 1)


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setattr(quant_common, "GEMV_TARGET_PROGRAMS", 10**6)


@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", list(KERNELS))
def test_kernel_equals_reference(fmt, dtype, gated, unsplit):
    kernel, ref = KERNELS[fmt]
    args = _case(fmt, dtype, gated)
    _close(kernel(*args), ref(*args), dtype)


@pytest.mark.parametrize("fmt", list(KERNELS))
def test_split_k_equals_reference(fmt, split):
    kernel, ref = KERNELS[fmt]
    args = _case(fmt, torch.float16, True, seed=1)
    _close(kernel(*args), ref(*args), torch.float16)


@pytest.mark.parametrize("splitting", ["unsplit", "split"])
def test_nvfp4_pair_decode_and_x_load_variants_give_the_same_bits(splitting, request, monkeypatch):
    """moe_gemv_nvfp4 with the "direct" decode (nvfp4.DECODE["pair"]) and the vector activation load
    (nvfp4.PAIR_X_LOAD), each and both, gives exactly the default's output (the same products summed in the
    same order; the direct decode's rescalings are powers of two), unsplit and with K split, gated, bf16; and
    matches the reference. An unknown PAIR_X_LOAD is refused by name."""
    request.getfixturevalue(splitting)
    # the measured defaults (docs/kernel_performance.md, "NVFP4 decode variants")
    assert nf4.DECODE["pair"] == "direct" and nf4.PAIR_X_LOAD == "vector"
    args = _case("nvfp4", torch.bfloat16, True, seed=5)
    want = nf4.moe_gemv_nvfp4(*args)
    _close(want, nf4.moe_gemv_nvfp4_ref(*args), torch.bfloat16)
    for decode, load in [(d, x) for d in nf4.DECODES for x in nf4.PAIR_X_LOADS]:
        monkeypatch.setattr(nf4, "DECODE", {**nf4.DECODE, "pair": decode})
        monkeypatch.setattr(nf4, "PAIR_X_LOAD", load)
        assert torch.equal(nf4.moe_gemv_nvfp4(*args), want), (decode, load)
    monkeypatch.setattr(nf4, "PAIR_X_LOAD", "rows")
    with pytest.raises(ValueError, match="PAIR_X_LOAD"):
        nf4.moe_gemv_nvfp4(*args)


class _LaunchSpy:
    """Stands in for a Triton kernel object: records each launch's keyword arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


PAIR_KERNEL = {"nvfp4": (nf4, "_pair_nvfp4_kernel"), "block_fp8": (bf8, "_pair_block_fp8_kernel")}


@pytest.mark.parametrize("fmt", list(KERNELS))
def test_pair_launch_settings_reach_the_launch_and_keep_the_result(fmt, unsplit, monkeypatch):
    """The swept launch settings (benchmarks/sweep_pair_gemv.py: kernels/moe_gemv.py PAIR_LAUNCH and
    GEMV_MAX_BLOCK_N, nvfp4.PAIR_TILE_WEIGHTS) are what each per-pair launch receives (warps and pipelining
    depth are compile settings the interpreter ignores, so they are checked as passed), and the result stays
    the reference's: other tiles change only the fp32 summation order."""
    from kernels import moe_gemv

    kernel, ref = KERNELS[fmt]
    args = _case(fmt, torch.bfloat16, True, seed=2)
    want = ref(*args)
    module, name = PAIR_KERNEL[fmt]
    spy = _LaunchSpy(getattr(module, name))
    monkeypatch.setattr(module, name, spy)
    _close(kernel(*args), want, torch.bfloat16)
    defaults = spy.launches[:]
    assert [k["num_warps"] for k in defaults] == [4, 4] and [k["num_stages"] for k in defaults] == [1, 1]
    spy.launches.clear()
    monkeypatch.setattr(moe_gemv, "PAIR_LAUNCH", {"num_warps": 8, "num_stages": 3})
    monkeypatch.setattr(moe_gemv, "GEMV_MAX_BLOCK_N", 64)
    monkeypatch.setattr(nf4, "PAIR_TILE_WEIGHTS", 2048)
    _close(kernel(*args), want, torch.bfloat16)
    (gate_up, down), gate_up0 = spy.launches, defaults[0]
    assert all(k["num_warps"] == 8 and k["num_stages"] == 3 for k in (gate_up, down))
    assert gate_up["BLOCK_N"] == 2 * gate_up0["BLOCK_N"] == 32  # the cap, halved for two matrices: 16 -> 32
    if fmt == "nvfp4":  # 2048 weights over 32 rows x 2 matrices: the 128-column minimum instead of 256
        assert gate_up0["BLOCK_K"] == 256 and gate_up["BLOCK_K"] == 128


@pytest.mark.parametrize("splitting", ["unsplit", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_fp8_w8a16_pairs_equal_their_reference_and_the_grouped_path(dtype, splitting, request):
    """scheme="w8a16" (activations kept): the per-pair kernels equal their reference, unsplit and with K
    split, and the grouped path over block_fp8_grouped_mm_ref's w8a16; and differ from w8a8 (the
    quantization of the activations is gone)."""
    request.getfixturevalue(splitting)
    h, weights, indices, up, gate, down, act = _case("block_fp8", dtype, True, seed=4)
    got = bf8.moe_gemv_block_fp8(h, weights, indices, up, gate, down, act, scheme="w8a16")
    want = bf8.moe_gemv_block_fp8_ref(h, weights, indices, up, gate, down, act, scheme="w8a16")
    _close(got, want, dtype)
    mats = {"up": up, "gate": gate, "down": down}
    grouped = moe_experts_grouped(
        h, weights, indices, ("up", "gate", "down"),
        lambda x, kind, offsets: bf8.block_fp8_grouped_mm_ref(x, *mats[kind], offsets, scheme="w8a16"),
        ACTIVATIONS[act], up[0].shape[0])
    _close(got, grouped, dtype)
    w8a8 = bf8.moe_gemv_block_fp8_ref(h, weights, indices, up, gate, down, act)
    assert (w8a8.float() - want.float()).abs().max() > 0
    with pytest.raises(ValueError, match="scheme must be one of"):
        bf8.moe_gemv_block_fp8(h, weights, indices, up, gate, down, act, scheme="w4a16")


@pytest.mark.parametrize("fmt", list(KERNELS))
def test_kernel_equals_the_grouped_path(fmt, unsplit):
    """The per-pair kernels compute what the quantized MoE's grouped path (sorted pairs, the format's grouped
    GEMM reference, activation, inverse permutation, combine) computes."""
    kernel, _ = KERNELS[fmt]
    h, weights, indices, up, gate, down, act = _case(fmt, torch.float32, fmt == "block_fp8", seed=2)
    mats = {"up": up, "gate": gate, "down": down}
    if fmt == "nvfp4":
        mm = lambda x, kind, offsets: nf4.nvfp4_grouped_mm_ref(x, *mats[kind], offsets)
    else:
        mm = lambda x, kind, offsets: bf8.block_fp8_grouped_mm_ref(x, *mats[kind], offsets)
    kinds = ("up", "down") if gate is None else ("up", "gate", "down")
    want = moe_experts_grouped(h, weights, indices, kinds, mm, ACTIVATIONS[act], up[0].shape[0])
    _close(kernel(h, weights, indices, up, gate, down, act), want, torch.float32)


@pytest.mark.parametrize("fmt", list(KERNELS))
def test_no_tokens_and_bad_arguments(fmt):
    kernel, ref = KERNELS[fmt]
    h, weights, indices, up, gate, down, act = _case(fmt, torch.float32, False)
    assert kernel(h[:0], weights[:0], indices[:0], up, gate, down, act).shape == (0, h.shape[1])
    for fn in (kernel, ref):
        with pytest.raises(ValueError, match="activation must be one of"):
            fn(h, weights, indices, up, gate, down, "gelu")
        with pytest.raises(ValueError, match="indices must be int64"):
            fn(h, weights, indices.int(), up, gate, down, act)
        with pytest.raises(ValueError, match="down must be"):
            fn(h, weights, indices, up, gate, up, act)


def _quantized_moe(fmt, gated):
    """(an NVFP4MoE / BlockFP8MoE over _experts(fmt, 7, gated, seed=4), its HybridConfig)."""
    from runners.engine import quant
    from runners.engine.models import moe as engine_moe
    from runners.engine.models.config import HybridConfig

    L, I = SIZES[fmt]
    c = HybridConfig(family="qwen3_next", vocab_size=32, hidden_size=L, layer_types=("moe",),
                     n_routed_experts=7, num_experts_per_tok=2, moe_intermediate_size=I,
                     moe_shared_expert_intermediate_size=16, mlp_hidden_act="silu" if gated else "relu2",
                     mlp_gated=gated)
    moe = engine_moe.MoE(c)
    quant._to_quantized_moe(moe, fmt)
    up, gate, down = _experts(fmt, 7, gated, seed=4)
    names = ("", "_weight_scale", "_weight_scale_2") if fmt == "nvfp4" else ("", "_weight_scale_inv")
    for kind, mats in (("up", up), ("gate", gate), ("down", down)):
        for suffix, t in zip(names, mats or ()):
            getattr(moe, f"experts_{kind}{suffix}").data = t.clone()
    return moe, c


@pytest.mark.parametrize("fmt", list(KERNELS))
def test_quantized_moe_takes_the_pair_path_where_the_gate_holds(fmt, monkeypatch, unsplit):
    """NVFP4MoE / BlockFP8MoE run the per-pair kernels where their format's use_moe_gemv holds and the
    grouped path otherwise (both forced here), with the same result."""
    import importlib

    from runners.engine.formats import get_format

    gated = fmt == "block_fp8"
    moe, c = _quantized_moe(fmt, gated)
    h, weights, indices = _case(fmt, torch.float32, gated, seed=4)[:3]
    calls = []
    attr = "moe_gemv_nvfp4" if fmt == "nvfp4" else "moe_gemv_block_fp8"
    module = importlib.import_module(f"runners.engine.models.{fmt}")  # the format's modules
    kernel = getattr(module, attr)
    monkeypatch.setattr(module, attr, lambda *a, **kw: calls.append(a[-1]) or kernel(*a, **kw))
    # the gate forced both ways (on CUDA it holds at these sizes, on the CPU it never does)
    monkeypatch.setattr(get_format(fmt), "use_moe_gemv", lambda *a, **kw: False)
    grouped = moe._experts(h, weights, indices)
    assert calls == []
    monkeypatch.setattr(get_format(fmt), "use_moe_gemv", lambda *a, **kw: True)
    _close(moe._experts(h, weights, indices), grouped, torch.float32)
    assert calls == [c.mlp_hidden_act]


@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "swiglu"])
def test_nvfp4_pair_bound_is_the_pair_kernels(gated, monkeypatch):
    """NVFP4MoE takes the pair bound of the per-pair kernel its projections would run on
    (runners.engine.formats.nvfp4: 176 for the CUDA kernel, 44 for Triton's): "cuda" only where gate / up
    (gate and up when gated, else up; all the pairs) and down both take it (kernels.quant.nvfp4.
    pair_kernel_for). 60 pairs take the per-pair path when both do and the grouped path when either runs on
    Triton; 22 pairs (under both bounds) and 200 (over both) never ask. The device rule (CUDA) is forced."""
    from runners.engine.formats import get_format
    from runners.engine.models import moe as engine_moe
    from runners.engine.models import nvfp4 as nvfp4_modules

    fmt = get_format("nvfp4")
    assert (fmt.moe_gemv_bound("triton"), fmt.moe_gemv_bound("cuda")) == (44, engine_moe.MOE_GEMV_MAX_PAIRS)
    assert engine_moe.MOE_GEMV_MAX_PAIRS == 176
    assert fmt.moe_gemv_bound() == fmt.moe_gemv_bound(nf4.PAIR_KERNEL)
    moe, _ = _quantized_moe("nvfp4", gated)
    monkeypatch.setattr(engine_moe, "use_moe_gemv", lambda *a: True)
    pair_calls = []
    monkeypatch.setattr(nvfp4_modules, "moe_gemv_nvfp4", lambda h, *a: pair_calls.append(a) or 0 * h)
    for N, kernels, pair_path in ((30, ("cuda", "cuda"), True), (30, ("triton", "triton"), False),
                                  (30, ("cuda", "triton"), False), (30, ("triton", "cuda"), False),
                                  (11, ("triton", "triton"), True), (100, ("cuda", "cuda"), False)):
        asked = []
        monkeypatch.setattr(nvfp4_modules, "pair_kernel_for",
                            lambda *a, ks=kernels, seen=asked: seen.append(a) or ks[len(seen) - 1])
        h = torch.randn(N, SIZES["nvfp4"][0], generator=torch.Generator().manual_seed(1))
        weights, indices = _routing(N, 2, 7, seed=1)
        pair_calls.clear()
        assert moe._experts(h, weights, indices).shape == h.shape
        assert len(pair_calls) == int(pair_path), (N, kernels)
        if not 44 < 2 * N <= 176:
            assert asked == []  # the kernel changes nothing there: not asked (no CUDA build in a prefill)
            continue
        (x, w, w2, P), (x_down, w_down, none, P_down) = asked
        assert x is h and x_down is h and P == P_down == 2 * N and none is None
        assert w_down[0] is moe.experts_down
        if gated:
            assert w[0] is moe.experts_gate and w2[0] is moe.experts_up
        else:
            assert w[0] is moe.experts_up and w2 is None
    indices = _routing(30, 2, 7, seed=1)[1]
    assert fmt.use_moe_gemv(h, indices[:22], pair_kernel="triton")  # 44 pairs
    assert not fmt.use_moe_gemv(h, indices, pair_kernel="triton") and fmt.use_moe_gemv(h, indices, "cuda")


@pytest.mark.parametrize("fmt", list(KERNELS))
def test_grouped_path_with_its_kernels_equals_the_references(fmt, monkeypatch):
    """Where use_inference_kernel holds (forced here; the Triton kernels run in the interpreter),
    moe_experts_grouped runs the activation named ``activation`` as one launch (relu2, or silu_mul gated) and
    the sum over the choices as combine_sorted: the references' result within the dtype's rounding (bf16), and
    the kernels are the ones called."""
    from runners.engine.models import moe as engine_moe

    gated = fmt == "block_fp8"
    h, weights, indices, up, gate, down, act = _case(fmt, torch.bfloat16, gated, N=4, k=3, seed=6)
    mats = {"up": up, "gate": gate, "down": down}
    if fmt == "nvfp4":
        mm = lambda x, kind, offsets: nf4.nvfp4_grouped_mm_ref(x, *mats[kind], offsets)
    else:
        mm = lambda x, kind, offsets: bf8.block_fp8_grouped_mm_ref(x, *mats[kind], offsets, scheme="w8a16")
    kinds = ("up", "gate", "down") if gated else ("up", "down")
    args = (h, weights, indices, kinds, mm, ACTIVATIONS[act], up[0].shape[0])
    want = moe_experts_grouped(*args, activation=act)  # CPU tensors: the references
    calls = []
    for name in ("relu2", "silu_mul", "combine_sorted"):
        real = getattr(engine_moe, name)
        monkeypatch.setattr(engine_moe, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    monkeypatch.setattr(engine_moe, "use_inference_kernel", lambda x: True)
    got = moe_experts_grouped(*args, activation=act)
    assert calls == (["silu_mul", "combine_sorted"] if gated else ["relu2", "combine_sorted"])
    _close(got, want, torch.bfloat16)
    calls.clear()
    _close(moe_experts_grouped(*args), want, torch.bfloat16)  # no name: act itself, the combine kernel
    assert calls == ["combine_sorted"]
    calls.clear()
    monkeypatch.setattr(engine_moe, "use_inference_kernel", lambda x: False)  # autograd, torch.compile
    assert torch.equal(moe_experts_grouped(*args, activation=act), want)
    assert calls == []
