"""kernels/norm.py: the three RMSNorm kernels against their PyTorch references (the math the engine's norm
modules run on the CPU), in the Triton interpreter on the CPU and at the releases' shapes on a GPU.

Shapes: row lengths that are not powers of two (48, 80), Qwen3-Next's (1 + w) offset, the GDN output norm
with z a strided head slice of a projection output (two strided row dims), Mamba2's per-group norm with the
weight over the whole row, and rows whose leading dims need a copy. float32 agrees to float32 rounding
(the sum of squares is reduced in another order); 16-bit outputs may differ in their last bit (Triton's exp /
rsqrt are the hardware approximations), so elements are compared at 2 ulps of their dtype, relative.
Outputs are fresh ``torch.empty`` buffers and every element is compared. The engine's modules take the kernel
exactly where ``use_inference_kernel`` says (CUDA, no autograd, not compiling).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.norm import (  # noqa: E402
    gated_group_rms_norm,
    gated_group_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 2**-22, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # relative


def _close(got, want):
    """Elementwise: within 2 ulps of the output dtype, relative (a last-bit flip of an intermediate rounded
    to 16 bits, e.g. the GDN norm's x_hat, carries into the product at that relative size), plus 1e-6."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).abs()
    bound = 2 * ULP[want.dtype] * want.float().abs() + 1e-6
    excess = (err - bound).max().item()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst excess {excess:.3g}"


def _r(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 48), (5, 80)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_reference(dtype, shape, offset):
    x = _r(*shape, dtype=dtype, seed=1, scale=3.0)
    w = _r(shape[-1], dtype=dtype, seed=2, scale=0.5)
    _close(rms_norm(x, w, 1e-6, offset), rms_norm_ref(x, w, 1e-6, offset))


def test_rms_norm_strided_and_copied_rows():
    """A transposed middle dim (two strided row dims) and a 3-level non-mergeable layout (copied)."""
    base = _r(4, 3, 2, 40, dtype=torch.bfloat16, seed=3)
    w = _r(40, dtype=torch.float32, seed=4)  # a float32 weight on a bf16 input: promotes to float32
    for x in (base.transpose(0, 1), base.permute(2, 0, 1, 3), base[:, ::2]):
        _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])  # None: the input's dtype (as the engine)
def test_gated_rms_norm_matches_reference_with_a_strided_gate(dtype, weight_dtype):
    """Qwen3-Next's GDN output norm: o (B, T, HV, V) contiguous, z a slice of the (B, T, H, 2K + 2rV) qkvz
    projection output viewed per value head (H, r, V): two strided row dims."""
    B, T, H, r, K, V = 2, 3, 2, 2, 8, 16
    qkvz = _r(B, T, H, 2 * K + 2 * r * V, dtype=dtype, seed=5)
    z = qkvz[..., 2 * K + r * V:].unflatten(-1, (r, V))  # (B, T, H, r, V), a view
    o = _r(B, T, H, r, V, dtype=dtype, seed=6, scale=2.0)
    w = _r(V, dtype=weight_dtype or dtype, seed=7)
    _close(gated_rms_norm(o, z, w, 1e-6), gated_rms_norm_ref(o, z, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 48])
def test_gated_group_rms_norm_matches_reference(dtype, group):
    y = _r(3, 2, 4 * group, dtype=dtype, seed=8, scale=2.0)
    z = _r(3, 2, 4 * group, dtype=dtype, seed=9)
    w = _r(4 * group, dtype=dtype, seed=10)
    _close(gated_group_rms_norm(y, z, w, group, 1e-5), gated_group_rms_norm_ref(y, z, w, group, 1e-5))
    # the model dtype out (the Mamba2 mixer's, before out_proj): the float32 result rounded in the kernel
    got = gated_group_rms_norm(y, z, w, group, 1e-5, torch.bfloat16)
    _close(got, gated_group_rms_norm_ref(y, z, w, group, 1e-5, torch.bfloat16))
    assert torch.equal(got, gated_group_rms_norm(y, z, w, group, 1e-5).to(torch.bfloat16))


@pytest.mark.parametrize("dtype, out_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32),
    (torch.float16, torch.float16)])
def test_gated_group_rms_norm_quantizes_its_output_for_an_fp8_linear(dtype, out_dtype):
    """With quant_scale the launch also returns float8_e4m3fn codes that are bitwise
    kernels.quant.fp8.quantize_fp8 of the very output it returns (the FP8 out_proj's input quantized in the
    norm's launch), the output unchanged; values beyond +-448 scales clamp, as the rule does."""
    from kernels.quant.fp8 import quantize_fp8_ref

    g = torch.Generator().manual_seed(4)
    y = (torch.randn(3, 96, generator=g) * 4).to(DEV, dtype)
    z = torch.randn(3, 96, generator=g).to(DEV, dtype)
    w = (torch.rand(96, generator=g) * 40).to(DEV, dtype)
    for scale in (0.02, 1e-3):  # the second drives many codes into the clamp
        s = torch.tensor(scale, device=DEV)
        out, q = gated_group_rms_norm(y, z, w, 48, 1e-5, out_dtype=out_dtype, quant_scale=s)
        assert torch.equal(out, gated_group_rms_norm(y, z, w, 48, 1e-5, out_dtype=out_dtype))
        assert q.dtype == torch.float8_e4m3fn and q.shape == out.shape
        want = quantize_fp8_ref(out, s)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert (q.float().abs() == 448).any()
    with pytest.raises(ValueError, match="quant_scale must be a one-element float32 tensor"):
        gated_group_rms_norm(y, z, w, 48, 1e-5, quant_scale=torch.tensor([0.1, 0.2], device=DEV))


def test_mamba2_output_hands_an_fp8_out_proj_the_codes_of_the_norms_launch(monkeypatch):
    """Mamba2Mixer.output, kernel path, before an out_proj that asks for its input codes
    (layers.consumer_quant_scale, as FP8Linear on its scaled_mm path): the norm's launch writes them, the
    projection receives them (bitwise kernels.quant.fp8's rule on the norm output it receives) and the output
    is the plain path's; off the kernel path nothing is asked (the reference norm gives codes when asked)."""
    import runners.engine.models.layers as layers_mod
    import runners.engine.models.mamba2 as mamba2_mod
    from kernels.quant.fp8 import quantize_fp8_ref
    from runners.engine.models.config import HybridConfig
    from runners.engine.models.mamba2 import Mamba2Mixer

    c = HybridConfig(family="nemotron_h", vocab_size=7, hidden_size=32, layer_types=("mamba2",),
                     mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
                     chunk_size=8)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(c).to(DEV).bfloat16()
    y = torch.randn(1, 2, mixer.d_inner, device=DEV)
    z = torch.randn(1, 2, mixer.d_inner, device=DEV).bfloat16()
    seen = []

    class Down(torch.nn.Linear):
        def prequant_scale(self, x):
            return torch.tensor(0.01, device=DEV)

        def forward(self, x, xq=None):
            seen.append((x, xq))
            return super().forward(x)

    for mod in (layers_mod, mamba2_mod):
        monkeypatch.setattr(mod, "use_inference_kernel", lambda t: True)
    with torch.no_grad():
        plain = mixer.output(y, z, torch.bfloat16)
        down = Down(mixer.d_inner, 32, bias=False).to(DEV).bfloat16()
        down.weight.copy_(mixer.out_proj.weight)
        mixer.out_proj = down
        got = mixer.output(y, z, torch.bfloat16)
    assert torch.equal(got, plain)
    ((h, q),) = seen
    assert torch.equal(q.view(torch.uint8), quantize_fp8_ref(h, torch.tensor(0.01)).view(torch.uint8))
    # another norm (the tensor-parallel SpanningGroupRMSNorm of a group spread over ranks, which has no codes
    # output): nothing is asked of it
    norm = mixer.norm

    class OtherNorm(torch.nn.Module):
        def forward(self, yy, zz, out_dtype=torch.float32):
            return gated_group_rms_norm_ref(yy, zz, norm.weight, norm.group_size, norm.eps, out_dtype)

    mixer.norm = OtherNorm()
    seen.clear()
    with torch.no_grad():
        mixer.output(y, z, torch.bfloat16)
    assert seen[0][1] is None
    mixer.norm = norm
    for mod in (layers_mod, mamba2_mod):
        monkeypatch.setattr(mod, "use_inference_kernel", lambda t: False)
    seen.clear()
    with torch.no_grad():
        mixer.output(y, z, torch.bfloat16)
        out, q = mixer.norm(y, z, torch.bfloat16, quant_scale=torch.tensor(0.01))  # the reference's codes
    assert torch.equal(q.view(torch.uint8), quantize_fp8_ref(out, torch.tensor(0.01)).view(torch.uint8))
    assert seen[0][1] is None


def test_bad_inputs_are_refused_with_the_problem_named():
    x = _r(2, 32, dtype=torch.float32, seed=11)
    cases = [
        (lambda: rms_norm(x, _r(16, dtype=torch.float32, seed=0), 1e-6), "weight must be (32,)"),
        (lambda: rms_norm(x.to(torch.int32), x[0], 1e-6), "x dtype must be one of"),
        (lambda: gated_rms_norm(x, x[:1], x[0], 1e-6), "z must have x's shape"),
        (lambda: gated_group_rms_norm(x, x, x[0], 12, 1e-6), "multiple of the group size"),
        (lambda: gated_group_rms_norm(x, x, x[0], 16, 1e-6, torch.int32), "out_dtype must be one of"),
        (lambda: gated_group_rms_norm(x, x, x[0, :16], 16, 1e-6), "weight must be (32,)"),
        (lambda: gated_group_rms_norm(x, x, x[0], 0, 1e-6), "multiple of the group size 0 (>= 1)"),
        (lambda: gated_group_rms_norm(x, x, x[0], -16, 1e-6), "multiple of the group size -16 (>= 1)"),
        (lambda: rms_norm(x[0, 0], x[0, :1], 1e-6), "x must have at least one dim"),
        (lambda: rms_norm(torch.ones(1, 2**14 + 1, device=DEV), torch.ones(2**14 + 1, device=DEV), 1e-6),
         "more than one program holds"),
    ]
    for call, says in cases:
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            call()


def test_empty_rows_return_an_empty_tensor():
    """No rows, or rows of length 0: an empty result of the reference's shape and dtype (no launch)."""
    for shape in ((0, 3, 32), (3, 0)):
        x, w = torch.empty(shape, device=DEV), torch.ones(shape[-1], device=DEV)
        pairs = ((rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)),
                 (gated_rms_norm(x, x, w, 1e-6), gated_rms_norm_ref(x, x, w, 1e-6)),
                 (gated_group_rms_norm(x, x, w, 16, 1e-6), gated_group_rms_norm_ref(x, x, w, 16, 1e-6)))
        for got, want in pairs:
            assert got.shape == want.shape == shape and got.dtype == want.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_input_and_weight_dtypes_follow_the_references_promotion(dtype, weight_dtype):
    """fp16 activations with a bf16 weight (their product promotes to float32), float32 weights on 16-bit
    inputs, and a gate of another dtype than x: each norm as its reference."""
    x, z = _r(3, 40, dtype=dtype, seed=20, scale=3.0), _r(3, 40, dtype=torch.bfloat16, seed=21)
    w = _r(40, dtype=weight_dtype, seed=22)
    _close(rms_norm(x, w, 1e-6, 1.0), rms_norm_ref(x, w, 1e-6, 1.0))
    _close(gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6))
    _close(gated_group_rms_norm(x, z, w, 8, 1e-6), gated_group_rms_norm_ref(x, z, w, 8, 1e-6))


def test_a_nan_stays_nan_in_a_bf16_output():
    """A NaN with high payload bits (0x7FFFFFFF, the GPU's canonical NaN; here a gate element) reaches the
    kernels' bf16 rounding (kernels._common.round_rne), whose integer carry used to turn it into -0.0: the
    output is NaN where the reference's is, and equal elsewhere."""
    x, w = _r(2, 16, dtype=torch.bfloat16, seed=23), _r(16, dtype=torch.bfloat16, seed=24)
    z = _r(2, 16, dtype=torch.float32, seed=25)
    z.view(torch.int32)[0, 3] = 0x7FFFFFFF
    got, want = gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6)
    assert torch.isnan(want[0, 3]) and torch.equal(torch.isnan(got), torch.isnan(want))
    _close(got[1], want[1])


def test_modules_take_the_kernel_only_on_cuda_outside_autograd():
    """The engine's norm modules: the reference on the CPU and under autograd (the kernels have no
    backward), so training and the CPU engine keep the PyTorch math."""
    from runners.engine.models.layers import RMSNorm, use_inference_kernel

    x = torch.randn(2, 8)
    assert not use_inference_kernel(x)
    with torch.no_grad():
        assert not use_inference_kernel(x)  # the CPU
    norm = RMSNorm(8, 1e-6, offset=1.0)
    y = norm(x.requires_grad_())
    y.sum().backward()  # the reference path: differentiable
    assert x.grad is not None and norm.weight.grad is not None
    if torch.cuda.is_available():
        xc = torch.randn(2, 8, device="cuda")
        assert use_inference_kernel(xc) is False  # grad enabled
        with torch.no_grad():
            assert use_inference_kernel(xc)


@pytest.mark.gpu
def test_gpu_release_shapes_and_cuda_graph_capture():
    """Nemotron 3 Super (hidden 4096, Mamba2 d_inner 8192 in 8 groups of 1024) and Qwen3-Next (hidden 2048,
    32 value heads of 128) at batch 64 x T 4 in bf16, against the references; then the three launches
    captured in one CUDA graph and replayed on new inputs equal eager bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bf = torch.bfloat16
    x = _r(64, 4, 4096, dtype=bf, seed=12, scale=4.0)
    w = _r(4096, dtype=bf, seed=13)
    y, z = _r(64, 4, 8192, dtype=bf, seed=14), _r(64, 4, 8192, dtype=bf, seed=15)
    wm = _r(8192, dtype=bf, seed=16)
    qkvz = _r(64, 4, 16, 2 * 128 + 4 * 128, dtype=bf, seed=17)
    zg = qkvz[..., 2 * 128 + 2 * 128:].unflatten(-1, (2, 128))
    o = _r(64, 4, 16, 2, 128, dtype=bf, seed=18)
    wg = _r(128, dtype=bf, seed=19)

    def run():
        return (rms_norm(x, w, 1e-5, 1.0), gated_group_rms_norm(y, z, wm, 1024, 1e-5),
                gated_rms_norm(o, zg, wg, 1e-6))

    eager = run()
    refs = (rms_norm_ref(x, w, 1e-5, 1.0), gated_group_rms_norm_ref(y, z, wm, 1024, 1e-5),
            gated_rms_norm_ref(o, zg, wg, 1e-6))
    for got, want in zip(eager, refs):
        _close(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for t in (x, y, z, o, qkvz):
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, run()):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("N, offset", [(4096, 0.0), (2048, 1.0), (7168, 1.0)])
def test_gpu_rms_norm_with_codes_is_the_rule_on_its_own_output(N, offset):
    """At the releases' hidden sizes in bf16, rms_norm with quant_scale returns codes bitwise quantize_fp8 of
    the norm it returns, and that norm is within _close of the codes-free launch's (the codes' wider store
    reorders the sum of squares: kernels.norm._row_warps), the output the reference matches."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernels.quant.fp8 import quantize_fp8

    x, w = _r(64, 4, N, dtype=torch.bfloat16, seed=31, scale=4.0), _r(N, dtype=torch.bfloat16, seed=32)
    s = torch.tensor(0.02, device="cuda")
    out, q = rms_norm(x, w, 1e-5, offset, s)
    assert torch.equal(q.view(torch.uint8), quantize_fp8(out, s).view(torch.uint8))
    _close(out, rms_norm(x, w, 1e-5, offset))
    _close(out, rms_norm_ref(x, w, 1e-5, offset))


class _AskingLinear(torch.nn.Linear):
    """A linear that asks for its input's FP8 codes (as FP8Linear on its scaled_mm path) and records what it
    was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.scale, self.seen = torch.tensor(0.02, device=DEV), []

    def prequant_scale(self, x):
        return self.scale

    def forward(self, x, xq=None):
        self.seen.append((x, xq))
        return super().forward(x)


def test_block_norm_writes_the_codes_of_its_mixers_input_linear(monkeypatch):
    """Block.forward, kernel path, with an MLP mixer whose up projection asks for its input codes: the block's
    RMSNorm launch writes them (bitwise kernels.quant.fp8's rule on the norm output the projection receives)
    and the output is the plain path's; a gated MLP (two readers) and the reference path ask nothing (the
    reference norm gives the same rule's codes when asked)."""
    import runners.engine.models.block as block_mod
    import runners.engine.models.layers as layers_mod
    from kernels.quant.fp8 import quantize_fp8_ref
    from runners.engine.models.block import Block
    from runners.engine.models.config import HybridConfig

    c = HybridConfig(family="nemotron_h", vocab_size=7, hidden_size=32, layer_types=("mlp",),
                     intermediate_size=48)
    torch.manual_seed(0)
    block = Block(c, "mlp", None).to(DEV).bfloat16()
    x = torch.randn(2, 3, 32, device=DEV).bfloat16()
    for mod in (block_mod, layers_mod):
        monkeypatch.setattr(mod, "use_inference_kernel", lambda t: True)
    with torch.no_grad():
        plain = block(x, None, None)
        up = _AskingLinear(32, 48, bias=False).to(DEV).bfloat16()
        up.weight.copy_(block.mixer.up_proj.weight)
        block.mixer.up_proj = up
        got = block(x, None, None)
    assert torch.equal(got, plain)
    ((h, q),) = up.seen
    assert q is not None and torch.equal(q.view(torch.uint8), quantize_fp8_ref(h, up.scale).view(torch.uint8))
    monkeypatch.setattr(layers_mod, "use_inference_kernel", lambda t: False)
    h_ref, q_ref = block.norm(x, quant_scale=up.scale)  # the reference path's codes: the same rule
    assert torch.equal(q_ref.view(torch.uint8), quantize_fp8_ref(h_ref, up.scale).view(torch.uint8))
    monkeypatch.setattr(block_mod, "use_inference_kernel", lambda t: False)
    up.seen.clear()
    with torch.no_grad():
        block(x, None, None)
    assert up.seen[0][1] is None
    block.mixer.gate_proj = torch.nn.Linear(32, 48, bias=False).to(DEV).bfloat16()
    assert block.mixer.input_linear() is None


def test_mamba2_and_moe_hand_the_codes_to_their_input_linear():
    """Mamba2Mixer passes ``xq`` to in_proj and MoE (reshaped to its flattened rows) to the shared expert's
    up projection, their ``input_linear``s; MoE with a gated shared expert names none."""
    from runners.engine.models.config import HybridConfig
    from runners.engine.models.mamba2 import Mamba2Mixer
    from runners.engine.models.moe import MoE

    c = HybridConfig(family="nemotron_h", vocab_size=7, hidden_size=32, layer_types=("mamba2",),
                     mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
                     chunk_size=8)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(c)
    ask = _AskingLinear(32, mixer.in_proj.out_features, bias=False)
    mixer.in_proj = ask
    assert mixer.input_linear() is ask
    x = torch.randn(1, 3, 32)
    codes = torch.zeros(1, 3, 32).to(torch.float8_e4m3fn)
    with torch.no_grad():
        mixer(x, xq=codes)
    assert ask.seen[0][1] is codes
    mc = HybridConfig(family="nemotron_h", vocab_size=7, hidden_size=32, layer_types=("moe",),
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      moe_shared_expert_intermediate_size=24)
    moe = MoE(mc)
    up = _AskingLinear(32, 24, bias=False)
    moe.shared_experts.up_proj = up
    assert moe.input_linear() is up
    with torch.no_grad():
        moe(x, xq=codes)
    assert up.seen[0][1].shape == (3, 32) and up.seen[0][1].data_ptr() == codes.data_ptr()
    moe.shared_experts.gate_proj = torch.nn.Linear(32, 24, bias=False)
    assert moe.input_linear() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, offset):
    """add_rms_norm (a block's residual add fused with the next norm) gives residual_add's sum bitwise, the
    rms_norm kernel's output on that sum bitwise (the same arithmetic), the reference's to 2 ulps, and the
    codes bitwise the quantize rule on it; a non-finite sum sets exactly its flag."""
    from kernels.health import residual_add_ref
    from kernels.norm import add_rms_norm, add_rms_norm_ref
    from kernels.quant.fp8 import quantize_fp8_ref

    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 3, 80, generator=g) * 3).to(DEV, dtype)
    d = torch.randn(2, 3, 80, generator=g).to(DEV, dtype)
    w = torch.rand(80, generator=g).to(DEV, dtype)
    flags = torch.zeros(4, dtype=torch.bool, device=DEV)
    s = torch.tensor(0.01, device=DEV)
    y, out, q = add_rms_norm(x, d, w, 1e-5, offset, flags, 2, s)
    assert not flags.any()
    assert torch.equal(y, residual_add_ref(x, d))
    assert torch.equal(out, rms_norm(y, w, 1e-5, offset))
    _close(out, rms_norm_ref(y, w, 1e-5, offset))
    assert torch.equal(q.view(torch.uint8), quantize_fp8_ref(out, s).view(torch.uint8))
    ref_flags = torch.zeros(4, dtype=torch.bool, device=DEV)
    y_ref, out_ref, q_ref = add_rms_norm_ref(x, d, w, 1e-5, offset, ref_flags, 2, s)
    assert torch.equal(y_ref, y) and not ref_flags.any()
    _close(out, out_ref)
    assert torch.equal(q_ref.view(torch.uint8), quantize_fp8_ref(out_ref, s).view(torch.uint8))
    assert len(add_rms_norm_ref(x, d, w, 1e-5, offset, ref_flags, 2)) == 2  # (y, norm) without a scale
    d[1, 2, 5] = float("nan")
    add_rms_norm(x, d, w, 1e-5, offset, flags, -2)
    assert flags.tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="share a shape"):
        add_rms_norm(x, d[:1], w, 1e-5, offset, flags, 0)
    with pytest.raises(ValueError, match="flag index 4"):
        add_rms_norm(x, d, w, 1e-5, offset, flags, 4)


def test_hybrid_eager_step_fuses_each_add_with_the_next_norm(monkeypatch):
    """HybridLM's eager inference step (kernel path, flags on) over forward_blocks_fused gives the hidden
    state and the flags of the block-by-block loop (Block.forward with its flag, then norm_f) bitwise, in
    one add_rms_norm launch per block boundary and for norm_f; a NaN put in one block's output flags that
    block's output and what follows it, as the loop does."""
    import runners.engine.models.block as block_mod
    import runners.engine.models.hybrid as hybrid_mod
    import runners.engine.models.layers as layers_mod
    from kernels.health import flag_nonfinite
    from runners.engine.models.config import HybridConfig
    from runners.engine.models.hybrid import HybridLM

    c = HybridConfig(family="nemotron_h", vocab_size=11, hidden_size=32, layer_types=("mlp", "mlp", "mlp"),
                     intermediate_size=48)
    torch.manual_seed(0)
    model = HybridLM(c).to(DEV).bfloat16()
    for mod in (block_mod, layers_mod, hybrid_mod):
        monkeypatch.setattr(mod, "use_inference_kernel", lambda t: True)
    calls = []
    fused = block_mod.add_rms_norm
    monkeypatch.setattr(block_mod, "add_rms_norm", lambda *a: calls.append(1) or fused(*a))
    ids = torch.tensor([[1, 4, 7, 2]], device=DEV)

    def loop(model):
        flags = model.nonfinite
        x = model.embeddings(ids)
        flag_nonfinite(x, flags, 0)
        for i, block in enumerate(model.layers):
            x = block(x, None, None, flag=(flags, i + 1))
        x = model.norm_f(x)
        flag_nonfinite(x, flags, len(model.layers) + 1)
        return x

    with torch.no_grad():
        model.track_nonfinite(DEV)
        got = model(ids)
        got_flags = model.nonfinite.clone()
        assert len(calls) == 3  # two block boundaries and norm_f
        model.track_nonfinite(DEV)
        want = loop(model)
        assert torch.equal(got, want) and torch.equal(got_flags, model.nonfinite) and not got_flags.any()
        model.layers[1].mixer.down_proj.bias = torch.nn.Parameter(
            torch.full((32,), float("nan"), device=DEV, dtype=torch.bfloat16))
        model.track_nonfinite(DEV)
        model(ids)
        got_flags = model.nonfinite.clone()
        model.track_nonfinite(DEV)
        loop(model)
    assert torch.equal(got_flags, model.nonfinite)
    assert got_flags.tolist() == [False, False, True, True, True, False]  # embeddings .. norm_f, lm_head


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N, offset", [(4096, 0.0), (2048, 1.0), (4480, 0.0), (7168, 1.0)])
@pytest.mark.parametrize("codes", [False, True])
def test_gpu_add_rms_norm_is_residual_add_then_rms_norm_bitwise(dtype, N, offset, codes):
    """On the GPU at the releases' hidden sizes (Super V3 4096, Qwen3-Next 2048 with its (1 + w) offset) and
    widths that are not powers of two (masked lanes; 8 warps from 4096 up), batch 64 x T 4, with and without
    FP8 codes: add_rms_norm equals residual_add then rms_norm (with the same quant_scale: the launches the
    fusion replaces) bit for bit, eager and replayed from a CUDA graph; the codes are bitwise quantize_fp8
    of the norm returned."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernels.health import residual_add
    from kernels.norm import add_rms_norm
    from kernels.quant.fp8 import quantize_fp8

    x, d = _r(64, 4, N, dtype=dtype, seed=21, scale=4.0), _r(64, 4, N, dtype=dtype, seed=22)
    w = _r(N, dtype=dtype, seed=23)
    s = torch.tensor(0.05, device="cuda") if codes else None
    flags = torch.zeros(3, dtype=torch.bool, device="cuda")

    def split():
        y = residual_add(x, d, flags, 1)
        out = rms_norm(y, w, 1e-5, offset, s)
        return (y, out) if s is None else (y, *out)

    want = split()
    got = add_rms_norm(x, d, w, 1e-5, offset, flags, 1, s)
    assert len(got) == len(want) == (3 if codes else 2)
    for g, t in zip(got, want):
        assert torch.equal(g.view(torch.uint8), t.view(torch.uint8))
    if codes:
        assert torch.equal(got[2].view(torch.uint8), quantize_fp8(got[1], s).view(torch.uint8))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = add_rms_norm(x, d, w, 1e-5, offset, flags, 1, s)
    x.normal_()
    graph.replay()
    for g, t in zip(captured, split()):
        assert torch.equal(g.view(torch.uint8), t.view(torch.uint8))
    assert not flags.any()
