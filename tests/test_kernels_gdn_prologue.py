"""kernels/gdn/prologue.py: GDN's prologue kernel (de-interleave, causal conv + SiLU over [window, new
tokens], gates) against its PyTorch reference, in the Triton interpreter on the CPU and at Qwen3-Next's
shapes on a GPU.

Cases: with and without a conv window (a fresh request), T = 1 (decode) and T = 4 (a K = 3 verify), r = 1
and 2 value heads per key head, a strided (gathered) window and a strided projection, bf16 and fp32; the
mixer's `rule_inputs` on the CPU equals the reference composed with its projections. 16-bit outputs may
differ from the reference in the last bit (the conv's products are summed in another order; Triton's exp is
the hardware one on the GPU): elements are compared at 2 ulps of their dtype, relative; conv_in is a copy
and must be equal.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.gdn.prologue import MAX_T, gdn_prologue, gdn_prologue_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 2**-21, torch.bfloat16: 2**-7}
NAMES = ("q", "k", "v", "g", "beta", "conv_in")


def _case(B, T, H, r, K, V, W, dtype, window=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    C = 2 * H * K + H * r * V
    qkvz = rn(B, T, H, 2 * K + 2 * r * V).to(DEV, dtype)
    ba = (rn(B, T, H, 2 * r) * 4).to(DEV, dtype)  # wide enough to reach softplus's branches
    state = rn(B + 2, C, W - 1).to(DEV, dtype)[torch.tensor([2, 0, 3, 1][:B])] if window else None
    w = (rn(C, 1, W) * 0.5).to(DEV, dtype)
    A_log, dt_bias = rn(H * r).to(DEV), rn(H * r).to(DEV)
    return qkvz, ba, state, w, A_log, dt_bias, V


def _compare(got, want):
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert torch.isfinite(a).all(), name
        if name == "conv_in":
            assert torch.equal(a, b), name
            continue
        err = (a.float() - b.float()).abs()
        bound = 2 * ULP[b.dtype] * b.float().abs() + 1e-6
        assert (err <= bound).all(), f"{name}: max error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("window", [True, False])
def test_kernel_matches_reference(dtype, T, r, window):
    args = _case(B=3, T=T, H=2, r=r, K=16, V=8, W=4, dtype=dtype, window=window, seed=T * 10 + r)
    _compare(gdn_prologue(*args), gdn_prologue_ref(*args))


def test_strided_projection_and_conv_kernel_width_2():
    """qkvz as a slice of a wider buffer (row strides not its width) and W = 2 (a one-column window)."""
    qkvz, ba, state, w, A_log, dt_bias, V = _case(B=2, T=3, H=2, r=2, K=8, V=4, W=2, dtype=torch.float32)
    wide = torch.zeros(2, 3, 2, qkvz.shape[-1] + 5, device=DEV)
    wide[..., 5:] = qkvz
    args = (wide[..., 5:], ba, state, w, A_log, dt_bias, V)
    _compare(gdn_prologue(*args), gdn_prologue_ref(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 4])
def test_windows_read_in_place_by_row_equal_the_gathered_windows(dtype, T):
    """conv_rows: the kernel reads row b's window at cache row conv_rows[b] (two rows sharing the scratch
    row, as PAD rows do; the cache a column slice of a wider buffer, as replay's), equal to the reference
    given the gathered windows, and to the reference given the rows."""
    qkvz, ba, _, w, A_log, dt_bias, V = _case(B=4, T=T, H=2, r=2, K=8, V=4, W=4, dtype=dtype, seed=T)
    C = qkvz.shape[2] * (2 * 8 + 2 * 4)
    wide = torch.randn(6, C, 3 + 5, generator=torch.Generator().manual_seed(9)).to(DEV, dtype)
    cache = wide[..., :3]  # (S = 6, C, W - 1), rows strided by 8 columns
    rows = torch.tensor([4, 0, 5, 5], device=DEV)
    got = gdn_prologue(qkvz, ba, cache, w, A_log, dt_bias, V, rows)
    _compare(got, gdn_prologue_ref(qkvz, ba, cache[rows], w, A_log, dt_bias, V))
    _compare(got, gdn_prologue_ref(qkvz, ba, cache, w, A_log, dt_bias, V, rows))
    with pytest.raises(ValueError, match="conv_rows must be"):
        gdn_prologue(qkvz, ba, cache, w, A_log, dt_bias, V, rows[:3])
    with pytest.raises(ValueError, match="conv_rows must be"):
        gdn_prologue(qkvz, ba, None, w, A_log, dt_bias, V, rows)
    with pytest.raises(ValueError, match="conv_state must be"):
        gdn_prologue(qkvz, ba, wide, w, A_log, dt_bias, V, rows)


def test_rows_strided_or_negative_read_the_rows_torch_indexing_reads():
    """conv_rows as a strided view (rows 0, 2, 4 of a longer index) and with -1 (the engine's PAD id before
    it is mapped: torch indexes it as the last, scratch, row): the kernel reads the rows the reference reads
    (review: it read conv_rows[b] at offset b of the storage, and a negative row before the cache)."""
    qkvz, ba, _, w, A_log, dt_bias, V = _case(B=3, T=1, H=2, r=2, K=8, V=4, W=4, dtype=torch.float32, seed=5)
    C = qkvz.shape[2] * (2 * 8 + 2 * 4)
    cache = torch.randn(6, C, 3, generator=torch.Generator().manual_seed(11)).to(DEV)
    for rows in (torch.arange(10, device=DEV)[::2][:3], torch.tensor([0, -1, 2], device=DEV)):
        got = gdn_prologue(qkvz, ba, cache, w, A_log, dt_bias, V, rows)
        _compare(got, gdn_prologue_ref(qkvz, ba, cache[rows], w, A_log, dt_bias, V))


def test_bad_inputs_are_refused_with_the_problem_named():
    qkvz, ba, state, w, A_log, dt_bias, V = _case(B=2, T=1, H=2, r=1, K=8, V=8, W=4, dtype=torch.float32)
    cases = [
        (lambda: gdn_prologue(qkvz, ba[:1], state, w, A_log, dt_bias, V), "qkvz must be"),
        (lambda: gdn_prologue(qkvz, ba, state, w, A_log, dt_bias, 16), "not 2K \\+ 2rV"),  # K would be 0
        (lambda: gdn_prologue(qkvz, ba, state[:, :-1], w, A_log, dt_bias, V), "conv_state must be"),
        (lambda: gdn_prologue(qkvz, ba, state, w[:-1], A_log, dt_bias, V), "conv_weight must be"),
        (lambda: gdn_prologue(qkvz, ba, state, w, A_log[:1], dt_bias, V), "A_log and dt_bias"),
        (lambda: gdn_prologue(qkvz.expand(2, MAX_T + 1, *qkvz.shape[2:]),
                              ba.expand(2, MAX_T + 1, *ba.shape[2:]), state, w, A_log, dt_bias, V),
         "decode / verify sizes"),
    ]
    for call, says in cases:
        with pytest.raises(ValueError, match=says):
            call()


def test_mixer_rule_inputs_is_the_reference_composed_with_the_projections():
    """On the CPU the mixer runs the reference: its q / k (normalised or not), v, g, beta, conv_in are the
    reference's of its own projections, bitwise."""
    from kernels.gdn import l2norm
    from runners.engine.models.gdn import GatedDeltaNet

    torch.manual_seed(0)
    m = GatedDeltaNet(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    x = torch.randn(2, 3, 32)
    state = torch.randn(2, m.conv_dim, 3)
    with torch.no_grad():
        got = m.rule_inputs(x, state, normalize_qk=False)
        qkvz = m.in_proj_qkvz(x).view(2, 3, 2, -1)
        want = gdn_prologue_ref(qkvz, m.in_proj_ba(x).view(2, 3, 2, -1), state, m.conv1d.weight, m.A_log,
                                m.dt_bias, 8)
        for a, b in zip((got.q, got.k, got.v, got.g, got.beta, got.conv_in), want):
            assert torch.equal(a, b)
        normed = m.rule_inputs(x, state)
        assert torch.equal(normed.q, l2norm(want[0])) and torch.equal(normed.k, l2norm(want[1]))


@pytest.mark.gpu
def test_gpu_qwen3_next_shapes_and_cuda_graph_capture():
    """Qwen3-Next's layer (16 key heads x 128, 32 value heads x 128, W = 4) at batch 64, T = 4, bf16, with a
    window gathered by slot: against the reference; then captured in a CUDA graph and replayed on new inputs
    equal to eager bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = list(_case(B=4, T=4, H=16, r=2, K=128, V=128, W=4, dtype=torch.bfloat16))
    big = _case(B=64, T=4, H=16, r=2, K=128, V=128, W=4, dtype=torch.bfloat16, window=False, seed=1)
    args[0], args[1] = big[0], big[1]
    C = 2 * 16 * 128 + 32 * 128
    args[2] = torch.randn(70, C, 3, device="cuda").to(torch.bfloat16)[torch.randperm(70, device="cuda")[:64]]
    _compare(gdn_prologue(*args), gdn_prologue_ref(*args))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gdn_prologue(*args)
    for t in (args[0], args[1], args[2]):
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, gdn_prologue(*args)):
        assert torch.equal(a, b)
    # the windows read in place from a 70-row cache by row (conv_rows), as the engine's decode step does
    cache = torch.randn(70, C, 3, device="cuda").to(torch.bfloat16)
    rows = torch.randperm(70, device="cuda")[:64]
    by_row = gdn_prologue(*args[:2], cache, *args[3:], rows)
    for a, b in zip(by_row, gdn_prologue(*args[:2], cache[rows], *args[3:])):
        assert torch.equal(a, b)
