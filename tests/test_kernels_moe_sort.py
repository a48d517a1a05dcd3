"""kernels/moe_sort.py: the pairs grouped by expert in one launch against the torch reference (bit for bit:
the results are integers), and the engine's choice between them (runners/engine/models/moe.py group_pairs).
Without CUDA the kernel runs in the Triton interpreter (its bitonic sort is slow there: the cases stay at up
to 2,048 keys)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels import moe_sort  # noqa: E402
from runners.engine.models import moe as engine_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _indices(N, k, E, seed, mode="random"):
    g = torch.Generator().manual_seed(seed)
    if mode == "one":
        return torch.full((N, k), E - 1, dtype=torch.long).to(DEVICE)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).reshape(N, k).to(DEVICE)


# (N, k, E, mode): the docstring example's size, a P that is not a multiple of the 128-pair block, E not a
# multiple of the 64-expert block, every pair on the last expert, a batch-16 verify of a top-22 model over 512
# experts (P = 1,408: eleven pair blocks), one pair
CASES = [(3, 2, 5, "random"), (37, 5, 100, "random"), (40, 4, 70, "one"), (64, 22, 512, "random"),
         (1, 1, 1, "random")]


@pytest.mark.parametrize("N, k, E, mode", CASES)
def test_kernel_equals_the_reference_bit_for_bit(N, k, E, mode):
    """order, inverse and offsets equal sort_pairs_ref's exactly (stable order, each pair's position, the
    cumulative ends), and inverse inverts order."""
    indices = _indices(N, k, E, seed=N * k, mode=mode)
    got = moe_sort.sort_pairs(indices, E)
    want = moe_sort.sort_pairs_ref(indices, E)
    for g, w, dtype in zip(got, want, (torch.int64, torch.int64, torch.int32)):
        assert g.dtype == w.dtype == dtype and torch.equal(g, w)
    order, inverse, offsets = got
    assert torch.equal(inverse[order], torch.arange(N * k, device=DEVICE))
    assert int(offsets[-1]) == N * k


def test_no_pairs_and_bad_arguments():
    order, inverse, offsets = moe_sort.sort_pairs(torch.zeros(0, 3, dtype=torch.long, device=DEVICE), 4)
    assert order.numel() == inverse.numel() == 0 and offsets.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"indices must be \[N, k\] int64"):
        moe_sort.sort_pairs(torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), 4)
    with pytest.raises(ValueError, match=r"indices must be \[N, k\] int64"):
        moe_sort.sort_pairs(torch.zeros(6, dtype=torch.long, device=DEVICE), 4)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        moe_sort.sort_pairs(torch.zeros(2, 3, dtype=torch.long, device=DEVICE), 0)
    too_many = moe_sort.SORT_KERNEL_MAX_PAIRS + 1
    assert moe_sort.sort_pairs_supported(too_many - 1, 512)
    assert not moe_sort.sort_pairs_supported(too_many, 512)
    assert not moe_sort.sort_pairs_supported(16, 2**27)  # keys past int32
    with pytest.raises(ValueError, match="past what one program sorts"):
        moe_sort.sort_pairs(torch.zeros(too_many, 1, dtype=torch.long, device=DEVICE), 4)


def test_engine_takes_the_kernel_at_decode_sizes_only(monkeypatch):
    """group_pairs runs the kernel where use_inference_kernel holds and sort_pairs_supported takes the size
    (P <= SORT_KERNEL_MAX_PAIRS), the reference past the bound (prefill), where the kernels are off and where
    GLUE_KERNELS is off; the same tensors either way."""
    calls = []
    real = moe_sort.sort_pairs
    monkeypatch.setattr(engine_moe, "sort_pairs", lambda *a: calls.append(a[0].numel()) or real(*a))
    monkeypatch.setattr(engine_moe, "use_inference_kernel", lambda x: True)
    monkeypatch.setattr(moe_sort, "SORT_KERNEL_MAX_PAIRS", 12)
    small, large = _indices(4, 3, 9, seed=1), _indices(5, 3, 9, seed=2)
    for indices in (small, large):
        got = engine_moe.group_pairs(indices, 9)
        assert all(torch.equal(g, w) for g, w in zip(got, moe_sort.sort_pairs_ref(indices, 9)))
    assert calls == [12]
    engine_moe.group_pairs(small.int(), 9)  # int32 ids: the reference (the kernel takes int64)
    assert calls == [12]
    monkeypatch.setattr(engine_moe, "GLUE_KERNELS", False)  # bench_e2e --kernel-setting's switch
    engine_moe.group_pairs(small, 9)
    assert calls == [12]
    monkeypatch.setattr(engine_moe, "GLUE_KERNELS", True)
    monkeypatch.setattr(engine_moe, "use_inference_kernel", lambda x: False)
    engine_moe.group_pairs(small, 9)
    assert calls == [12]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, k", [(256, 22), (256, 10), (4, 22), (64, 22)])
def test_gpu_grouping_and_combine_at_release_sizes_replay_from_a_graph(tokens, k):
    """On the GPU at the release routings (top-22 / top-10 of 512 experts, the batch-64 verify's 256 tokens
    and smaller steps): sort_pairs equals its reference bit for bit, and group_pairs + combine_pairs captured
    in a CUDA graph (no host synchronisation, no host-built tensor) replay to the eager result."""
    from kernels.moe_gemv import combine_sorted_ref

    E, L = 512, 1024
    g = torch.Generator(device="cuda").manual_seed(tokens * k)
    indices = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(tokens)])
    got = moe_sort.sort_pairs(indices, E)
    for a, b in zip(got, moe_sort.sort_pairs_ref(indices, E)):
        assert torch.equal(a, b)
    y = torch.randn(tokens * k, L, device="cuda", generator=g).bfloat16()
    weights = torch.rand(tokens, k, device="cuda", generator=g)
    with torch.no_grad():  # the engine's kernels run outside autograd (use_inference_kernel)
        assert engine_moe.use_inference_kernel(y)
        eager = engine_moe.combine_pairs(y, engine_moe.group_pairs(indices, E)[1], weights)
        want = combine_sorted_ref(y, got[1], weights).float()
        torch.testing.assert_close(eager.float(), want, rtol=1.6e-2, atol=1.6e-2 * want.abs().max().item())
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            engine_moe.combine_pairs(y, engine_moe.group_pairs(indices, E)[1], weights)  # warm-up, uncaptured
            with torch.cuda.graph(graph, stream=stream):
                captured = engine_moe.combine_pairs(y, engine_moe.group_pairs(indices, E)[1], weights)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
