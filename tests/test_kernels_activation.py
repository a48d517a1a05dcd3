"""kernels/activation.py: relu2 and silu_mul against their PyTorch references, in the Triton interpreter on
the CPU and at the releases' shared-expert widths on a GPU; the MLP takes them exactly where
``use_inference_kernel`` says.

relu2 is compared bitwise (relu is exact, the square one rounded product), NaN and infinities included;
silu_mul at 2 ulps of its dtype relative to |silu(gate)| |up| (Triton's exp is the hardware one, so the
rounded silu may differ in its last bit). Sizes cross the kernel's block of 2048 elements and end mid-block.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.activation import BLOCK, relu2, relu2_ref, silu_mul, silu_mul_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2**-21, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _r(*shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 48), (3, 1000), (BLOCK + 9,)])
def test_relu2_is_the_reference_bitwise(dtype, shape):
    x = _r(*shape, dtype=dtype, seed=1)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    got, want = relu2(x), relu2_ref(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got.view(-1)[0].isnan() and got.view(-1)[1] == float("inf") and got.view(-1)[2] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 48), (3, 1000), (BLOCK + 9,)])
def test_silu_mul_matches_reference(dtype, shape):
    gate, up = _r(*shape, dtype=dtype, seed=2), _r(*shape, dtype=dtype, seed=3)
    got, want = silu_mul(gate, up), silu_mul_ref(gate, up)
    assert got.dtype == dtype and got.shape == gate.shape
    bound = 2 * ULP[dtype] * (torch.nn.functional.silu(gate.float()).abs() * up.float().abs()) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_strided_inputs_and_bad_inputs():
    g = _r(40, 8, dtype=torch.bfloat16, seed=4).t()  # not contiguous: copied first
    u = _r(8, 40, dtype=torch.bfloat16, seed=5)
    assert torch.equal(relu2(g), relu2_ref(g))
    assert silu_mul(g, u).shape == (8, 40)
    with pytest.raises(ValueError, match="share a shape and a dtype"):
        silu_mul(g, u[:, :20])
    with pytest.raises(ValueError, match="share a shape and a dtype"):
        silu_mul(g, u.float())
    with pytest.raises(ValueError, match="share a shape and a dtype"):
        relu2(u.long())
    assert relu2(u[:0]).shape == (0, 40)


def test_mlp_takes_the_kernels_exactly_where_use_inference_kernel_says(monkeypatch):
    """MLP.forward: relu2 (non-gated) and silu_mul (gated SiLU) where layers.use_inference_kernel holds,
    the references elsewhere (the CPU engine's numbers do not change); same values either way."""
    import runners.engine.models.layers as layers_mod
    from runners.engine.models.layers import MLP

    calls = []
    for name in ("relu2", "silu_mul"):
        fn = getattr(layers_mod, name)
        monkeypatch.setattr(layers_mod, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    torch.manual_seed(0)
    plain, gated = MLP(16, 24, act="relu2").to(DEV), MLP(16, 24, act="silu", gated=True).to(DEV)
    x = torch.randn(2, 3, 16, device=DEV)
    with torch.no_grad():
        ref = (plain(x), gated(x))
        assert calls == ([] if DEV == "cpu" else ["relu2", "silu_mul"])
        monkeypatch.setattr(layers_mod, "use_inference_kernel", lambda t: True)
        calls.clear()
        got = (plain(x), gated(x))
    assert calls == ["relu2", "silu_mul"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_release_widths_and_cuda_graph_capture():
    """The released shared experts' widths at batch 64 x T 4 in bf16 (Qwen3-Next's SwiGLU, intermediate 512;
    Super V3's relu2, 5376) against the references; captured in a CUDA graph and replayed on new inputs equal
    to eager bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bf = torch.bfloat16
    g, u, h = _r(256, 512, dtype=bf, seed=6), _r(256, 512, dtype=bf, seed=7), _r(256, 5376, dtype=bf, seed=8)
    assert torch.equal(relu2(h), relu2_ref(h))
    bound = 2 * ULP[bf] * (torch.nn.functional.silu(g.float()).abs() * u.float().abs()) + 1e-6
    assert ((silu_mul(g, u).float() - silu_mul_ref(g, u).float()).abs() <= bound).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, b = relu2(h), silu_mul(g, u)
    for t in (g, u, h):
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, relu2(h)) and torch.equal(b, silu_mul(g, u))



@pytest.mark.parametrize("fn", ["relu2", "silu_mul"])
def test_activation_quantizes_its_output_for_an_fp8_down_projection(fn):
    """With quant_scale the launch also returns float8_e4m3fn codes bitwise kernels.quant.fp8's rule on the
    output it returns (the FP8 down projection's input quantized in the activation's launch), the output
    unchanged, codes clamped at +-448 where the scale is small; a bad scale is refused."""
    from kernels.quant.fp8 import quantize_fp8_ref

    x, u = _r(3, BLOCK + 9, dtype=torch.bfloat16, seed=5), _r(3, BLOCK + 9, dtype=torch.bfloat16, seed=6)
    call = (lambda **kw: relu2(x, **kw)) if fn == "relu2" else (lambda **kw: silu_mul(x, u, **kw))
    for scale in (0.05, 1e-3):
        s = torch.tensor(scale, device=DEV)
        out, q = call(quant_scale=s)
        assert torch.equal(out, call())
        assert q.dtype == torch.float8_e4m3fn and q.shape == out.shape
        assert torch.equal(q.view(torch.uint8), quantize_fp8_ref(out, s).view(torch.uint8))
    assert (q.float().abs() == 448).any()
    with pytest.raises(ValueError, match="quant_scale must be a one-element float32 tensor"):
        call(quant_scale=torch.tensor(0.1, dtype=torch.float64, device=DEV))
    ref = relu2_ref(x, s) if fn == "relu2" else silu_mul_ref(x, u, s)  # the references meet the same contract
    assert torch.equal(ref[1].view(torch.uint8), quantize_fp8_ref(ref[0], s).view(torch.uint8))


class _FakeFP8Down(torch.nn.Linear):
    """A down projection that asks for its input's FP8 codes, as FP8Linear does on its scaled_mm path, and
    records what it was given."""

    def __init__(self, *a, scale=0.05, **kw):
        super().__init__(*a, **kw)
        self.scale, self.seen = torch.tensor(scale, device=DEV), []

    def prequant_scale(self, x):
        return self.scale

    def forward(self, x, xq=None):
        self.seen.append(xq)
        return super().forward(x)


@pytest.mark.parametrize("gated", [False, True])
def test_mlp_hands_an_fp8_down_projection_the_codes_of_the_activations_launch(gated, monkeypatch):
    """MLP.forward, kernel path, before a down projection that asks for its input codes
    (layers.consumer_quant_scale): the activation's launch writes them and the projection receives them,
    bitwise kernels.quant.fp8's rule on the activation it receives; the output is the plain path's."""
    import runners.engine.models.layers as layers_mod
    from kernels.quant.fp8 import quantize_fp8_ref
    from runners.engine.models.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(16, 24, act="silu" if gated else "relu2", gated=gated).to(DEV)
    x = torch.randn(2, 3, 16, device=DEV).bfloat16()
    mlp = mlp.bfloat16()
    monkeypatch.setattr(layers_mod, "use_inference_kernel", lambda t: True)
    with torch.no_grad():
        plain = mlp(x)
        down = _FakeFP8Down(24, 16, bias=False).to(DEV).bfloat16()
        down.weight.copy_(mlp.down_proj.weight)
        mlp.down_proj = down
        got = mlp(x)
        h = mlp.up_proj(x)
        a = silu_mul(mlp.gate_proj(x), h) if gated else relu2(h)
    assert torch.equal(got, plain)
    (q,) = down.seen
    assert q is not None and q.dtype == torch.float8_e4m3fn and q.shape == a.shape
    assert torch.equal(q.view(torch.uint8), quantize_fp8_ref(a, down.scale).view(torch.uint8))
