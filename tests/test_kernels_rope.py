"""kernels/rope.py: the fused head norm + rotary embedding kernel against its PyTorch reference (the attention
layer's q_norm / k_norm then rope_rotate), in the Triton interpreter on the CPU and at Qwen3-Next's attention
shape on a GPU.

Cases: q as the per-head half of the gated q projection (a strided view), angles per row ([B, T, 1, rd /
2], decode) and shared ([1, T, 1, rd / 2], a cache-free forward), partial (rd < hd) and full rotary, head_dim
not a power of two, the (1 + w) and plain weight conventions, bf16 and fp32. 16-bit outputs may differ from
the reference in the last bit (the rotation's products may fuse into FMAs on the GPU): elements are compared
at 2 ulps of their dtype, relative.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.rope import norm_rope, norm_rope_ref, rope_rotate  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 2**-21, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _angles(B, T, rd, per_row=True, start=(0, 7, 3)):
    pos = torch.arange(T)[None] + torch.tensor(start[:B])[:, None] if per_row else torch.arange(T)[None]
    inv = 1.0 / 10000 ** (torch.arange(0, rd, 2).float() / rd)
    ang = pos.float()[..., None] * inv
    return ang.cos()[:, :, None].to(DEV), ang.sin()[:, :, None].to(DEV)


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    err = (got.float() - want.float()).abs()
    assert (err <= 2 * ULP[want.dtype] * want.float().abs() + 1e-6).all(), err.max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hd, rd", [(16, 8), (16, 16), (24, 8)])
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_kernel_matches_reference_on_a_gated_q_view(dtype, hd, rd, per_row, offset):
    g = torch.Generator().manual_seed(hd + rd)
    B, T, H = 3, 2, 4
    qg = (torch.randn(B, T, H, 2 * hd, generator=g) * 2).to(DEV, dtype)
    q = qg[..., :hd]  # [q_h, gate_h] per head: a strided view, as the attention layer's chunk
    w = (torch.randn(hd, generator=g) * 0.3).to(DEV, dtype)
    cos, sin = _angles(B, T, rd, per_row)
    _close(norm_rope(q, w, 1e-6, offset, cos, sin), norm_rope_ref(q, w, 1e-6, offset, cos, sin))


@pytest.mark.parametrize("layout", ["bhtd", "expanded", "head_slice"])
@pytest.mark.parametrize("dtype, wdtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("B, T, H", [(1, 1, 1), (2, 4, 1), (1, 3, 2)])
def test_kernel_matches_reference_on_other_layouts_dtypes_and_sizes(layout, dtype, wdtype, B, T, H):
    """x as [B, H, T, hd] transposed (three strided row dims: copied), expanded over the batch (stride 0),
    a head slice of a wider tensor; float16, a float32 weight with bf16 x; H = 1, B = 1, T > 1 per-row
    angles."""
    g = torch.Generator().manual_seed(B * 100 + T * 10 + H)
    hd, rd = 12, 6
    if layout == "bhtd":
        x = (torch.randn(B, H, T, hd, generator=g) * 2).to(DEV, dtype).transpose(1, 2)
    elif layout == "expanded":
        x = (torch.randn(1, T, H, hd, generator=g) * 2).to(DEV, dtype).expand(B, T, H, hd)
    else:
        x = (torch.randn(B, T, H + 2, hd, generator=g) * 2).to(DEV, dtype)[:, :, 1:H + 1]
    w = (torch.randn(hd, generator=g) * 0.3).to(DEV, wdtype)
    cos, sin = _angles(B, T, rd, per_row=True)
    _close(norm_rope(x, w, 1e-6, 1.0, cos, sin), norm_rope_ref(x, w, 1e-6, 1.0, cos, sin))


def test_reference_is_the_norm_then_the_rotation():
    """norm_rope_ref composes the engine's two references: RMSNorm (kernels.norm) then rope_rotate."""
    from kernels.norm import rms_norm_ref

    x = torch.randn(2, 3, 2, 8)
    w = torch.randn(8)
    cos, sin = _angles(2, 3, 4)
    cos, sin = cos.cpu(), sin.cpu()
    want = rope_rotate(rms_norm_ref(x, w, 1e-6, 1.0), cos, sin)
    assert torch.equal(norm_rope_ref(x, w, 1e-6, 1.0, cos, sin), want)
    # rotation by angle 0 is the identity
    zero = torch.zeros_like(cos)
    assert torch.equal(rope_rotate(x, zero + 1, zero), x)


def test_bad_inputs_are_refused_with_the_problem_named():
    x = torch.randn(2, 3, 2, 8, device=DEV)
    w = torch.ones(8, device=DEV)
    cos, sin = _angles(2, 3, 4)
    for args, says in (((x[0], w, 1e-6, 1.0, cos, sin), "x must be \\[B, T, H, hd\\]"),
                       ((x, w[:4], 1e-6, 1.0, cos, sin), "weight must be \\(8,\\)"),
                       ((x, w, 1e-6, 1.0, cos.double(), sin), "cos / sin must be float32"),
                       ((x, w, 1e-6, 1.0, *_angles(2, 3, 10)), "rd <= 8")):
        with pytest.raises(ValueError, match=says):
            norm_rope(*args)


@pytest.mark.gpu
def test_gpu_qwen3_next_attention_shape_and_cuda_graph_capture():
    """Qwen3-Next's attention (16 q heads with output gates, 2 kv heads, head_dim 256, rotary 64) at batch 64
    x T 4 in bf16: q and k against the reference; then captured in a CUDA graph and replayed on new inputs
    equal to eager bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    B, T = 64, 4
    qg = torch.randn(B, T, 16, 512, device="cuda").to(torch.bfloat16)
    k = torch.randn(B, T, 2, 256, device="cuda").to(torch.bfloat16)
    w = (torch.randn(256, device="cuda") * 0.1).to(torch.bfloat16)
    cos, sin = _angles(3, T, 64)
    cos, sin = cos.repeat(22, 1, 1, 1)[:B].contiguous(), sin.repeat(22, 1, 1, 1)[:B].contiguous()
    q = qg[..., :256]
    for x in (q, k):
        _close(norm_rope(x, w, 1e-6, 1.0, cos, sin), norm_rope_ref(x, w, 1e-6, 1.0, cos, sin))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cq, ck = norm_rope(q, w, 1e-6, 1.0, cos, sin), norm_rope(k, w, 1e-6, 1.0, cos, sin)
    for t in (qg, k, cos, sin):
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cq, norm_rope(q, w, 1e-6, 1.0, cos, sin))
    assert torch.equal(ck, norm_rope(k, w, 1e-6, 1.0, cos, sin))
