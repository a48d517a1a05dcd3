"""kernels/moe_combine.py: the gated shared expert's combine kernel against its PyTorch reference, in the
Triton interpreter on the CPU and at Qwen3-Next's width on a GPU.

Sizes: D and L not powers of two (48, 80) and above one block (D = 5000 -> two passes of the dot product),
rows strided (a slice of a wider buffer), bf16 / fp16 / fp32, a bf16 or fp32 gate weight. The sum and the
product are rounded as the reference rounds them (to x's dtype), so only the dot product's order differs:
elements are compared at 2 ulps of their dtype, relative. The MoE block takes the kernel exactly where
``use_inference_kernel`` says; on the CPU it is the reference, bitwise.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.moe_combine import shared_gate_combine, shared_gate_combine_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 2**-21, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _case(N, D, L, dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = rn(N, D).to(DEV, dtype)
    w = (rn(1, D) / D**0.5).to(DEV, w_dtype)
    shared, routed = rn(N, L).to(DEV, dtype), rn(N, L).to(DEV, dtype)
    return x, w, shared, routed


def _close(got, want, shared, routed):
    """2 ulps of the terms, not of the sum: a gate differing in its last bit moves the rounded product
    ``gate * shared`` by up to one ulp of |shared|, and ``routed + product`` may cancel to near zero (seen
    on the H200 at Qwen3-Next's width: 0.0078 off on an element whose sum was far smaller than its terms)."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    err = (got.float() - want.float()).abs()
    scale = shared.float().abs() + routed.float().abs()
    assert (err <= 2 * ULP[want.dtype] * scale + 1e-6).all(), err.max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N, D, L", [(1, 48, 80), (3, 64, 64), (2, 5000, 48)])
@pytest.mark.parametrize("w_dtype", [None, torch.float32])
def test_kernel_matches_reference(dtype, N, D, L, w_dtype):
    args = _case(N, D, L, dtype, w_dtype or dtype, seed=N + D + L)
    _close(shared_gate_combine(*args), shared_gate_combine_ref(*args), *args[2:])


def test_strided_rows():
    x, w, shared, routed = _case(3, 48, 80, torch.bfloat16, torch.bfloat16)
    wide = torch.zeros(3, 100, device=DEV, dtype=torch.bfloat16)
    wide[:, 10:90] = shared
    args = (x, w, wide[:, 10:90], routed)
    _close(shared_gate_combine(*args), shared_gate_combine_ref(*args), *args[2:])


def test_bad_inputs_are_refused_with_the_problem_named():
    x, w, shared, routed = _case(2, 16, 8, torch.float32, torch.float32)
    for args, says in (((x, w, shared, routed[:1]), "x must be \\[N, D\\]"),
                       ((x, w[:, :8], shared, routed), "gate_weight must have D = 16"),
                       ((x, w, shared.double(), routed), "in its dtype")):
        with pytest.raises(ValueError, match=says):
            shared_gate_combine(*args)


@pytest.mark.gpu
def test_gpu_qwen3_next_width_and_cuda_graph_capture():
    """Qwen3-Next (hidden 2048) at 256 tokens (batch 64 x T 4), bf16, bf16 gate weight: against the reference,
    then captured in a CUDA graph and replayed on new inputs equal to eager bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = _case(256, 2048, 2048, torch.bfloat16, torch.bfloat16)
    _close(shared_gate_combine(*args), shared_gate_combine_ref(*args), *args[2:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = shared_gate_combine(*args)
    for t in (args[0], args[2], args[3]):
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, shared_gate_combine(*args))
