"""Mamba2 rewind / replay kernels compiled for real on a GPU, at the Nemotron 3 Super mixer shape.

Every test here is `gpu` (skipped without CUDA). They check what the CPU interpreter cannot: compiled code
(bf16 loads, register tiles at real size), the Super V3 shape (batch 64, T = 4, 128 heads x head_dim 64 x
d_state 128, 8 groups, bf16 inputs), and CUDA-graph capture with poisoned metadata buffers.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # keep the interpreter setting consistent with test_kernels_mamba2.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from replay_oracles import mamba2_materialized_state  # noqa: E402

from benchmarks.replay_configs import M2_CONFIGS  # noqa: E402
from kernels.commit import allocate_replay_slots, replay_advance, rewind_commit, rewind_commit_ref  # noqa: E402
from kernels.mamba2 import (  # noqa: E402
    ReplayHistory,
    replay,  # noqa: E402
    replay_verify,
    replay_verify_ref,
    selective_state_update,
    selective_state_update_ref,
)

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_memory(7)]  # Super V3-shape replay: up to 5.2 GiB

# Super V3 mixer shape
BATCH, T, H, P, N, G = 64, 4, 128, 64, 128, 8
SLOTS = 80
POISON = 0x7BADBEEF

# Kernel vs reference on the GPU: all state math is fp32 FMAs (~1e-6 relative); outputs are bf16 (ulp
# 2^-8 relative: 1.6e-2 = 4 ulps); a bf16 state adds one state ulp of the same size.
TOL = {torch.float32: 1e-3, torch.bfloat16: 1.6e-2}
VARIANTS = tuple(replay.VARIANTS)  # every kernel variant of the replay verify
# the sweep's register-capped and persistent configurations
TUNED = tuple(k for k, c in M2_CONFIGS.items()  # the Triton ones: "cuda" has tests/test_replay_cuda*.py
              if ("maxnreg" in c or "persistent" in c) and c["variant"] in replay.VARIANTS)


def close(a, b, tol, what):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(H, generator=g) * 2 - 1)
    D = torch.randn(H, generator=g)
    dt_bias = torch.rand(H, generator=g) - 0.5
    return A.cuda(), D.cuda(), dt_bias.cuda()


def inputs(seed, Bsz=BATCH, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(Bsz, T, H, P, generator=g)
    dt = torch.randn(Bsz, T, H, generator=g) * 0.5 - 1.0
    B = torch.randn(Bsz, T, G, N, generator=g) / N**0.5
    C = torch.randn(Bsz, T, G, N, generator=g) / N**0.5
    return [t.to("cuda", dtype) for t in (x, dt, B, C)]


def slots_with_pad(seed):
    g = torch.Generator().manual_seed(seed)
    slot_ids = (1 + torch.randperm(SLOTS - 1, generator=g)[:BATCH]).to(torch.int32)  # distinct slots
    slot_ids[5] = -1
    slot_ids[17] = 0  # slot 0 is live (and named once)
    return slot_ids.cuda()


@pytest.mark.gpu_memory(12)  # 9.5 GiB at the peak
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gpu_rewind_super_v3_shape(state_dtype):
    A, D, dt_bias = params()
    x, dt, B, C = inputs(1)
    slot_ids = slots_with_pad(2)
    state = torch.randn(SLOTS, H, P, N, device="cuda").to(state_dtype)
    nat = torch.randint(1, T + 1, (BATCH,), device="cuda", dtype=torch.int32)
    res = []
    pairs = ((selective_state_update, rewind_commit), (selective_state_update_ref, rewind_commit_ref))
    for fn, commit in pairs:
        st = state.clone()
        inter = torch.full((BATCH, T, H, P, N), float("nan"), device="cuda", dtype=state_dtype)
        out = torch.full((BATCH, T, H, P), float("nan"), device="cuda", dtype=torch.bfloat16)
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, intermediate_states=inter, out=out)
        assert torch.equal(st, state)
        commit(st, inter, slot_ids, nat)
        res.append((st, inter, out))
    (st_k, inter_k, out_k), (st_r, inter_r, out_r) = res
    close(out_k, out_r, TOL[torch.bfloat16], "out")
    close(inter_k[slot_ids >= 0], inter_r[slot_ids >= 0], TOL[state_dtype], "intermediate_states")
    close(st_k, st_r, TOL[state_dtype], "committed state")
    assert torch.isnan(inter_k[5]).all() and (out_k[5] == 0).all()


def _history(seed, A, dtype=torch.bfloat16, hist_len=T, checkpointing=False):
    g = torch.Generator().manual_seed(seed)
    hist = ReplayHistory.allocate(SLOTS, hist_len, H, P, G, N, dtype=dtype, device="cuda",
                                   checkpointing=checkpointing)
    hist.x.copy_(torch.randn(hist.x.shape, generator=g))
    hist.B.copy_(torch.randn(hist.B.shape, generator=g) / N**0.5)
    hist.dt.copy_(torch.rand(hist.dt.shape, generator=g) * 0.9 + 0.1)
    hist.dA_cumsum.copy_(torch.cumsum(A[:, None] * hist.dt, dim=-1))
    return hist


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_replay_super_v3_shape(state_dtype, checkpointing, variant):
    _super_v3_case(state_dtype, checkpointing, variant=variant)


@pytest.mark.parametrize("config", TUNED)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_replay_register_capped_and_persistent_configs(state_dtype, checkpointing, config):
    """The sweep's maxnreg configurations compiled with their caps (spilling ones included) and its persistent
    grids (12-24 programs per SM walking 4 x 64 x 128 units): same results."""
    _super_v3_case(state_dtype, checkpointing, **M2_CONFIGS[config])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_pdl_variant_equals_mma_pre_bitwise(state_dtype, checkpointing):
    """"mma_pre_pdl" runs the kernels of "mma_pre" (same arithmetic) with the main kernel's state pass before
    its wait for the precompute kernel: any read of cb / cbo or a B history row ahead of the precompute's
    writes would show as a difference. Eight back-to-back steps on one stream, with flushes."""
    A, D, dt_bias = params()
    L = 16 if checkpointing else T
    state0 = torch.randn(SLOTS, H, P, N, device="cuda").to(state_dtype)
    steps = [(inputs(40 + i), slots_with_pad(50 + i),
              torch.randint(1, T + 1, (BATCH,), device="cuda", dtype=torch.int32)) for i in range(8)]
    res = []
    for variant in ("mma_pre", "mma_pre_pdl"):
        st = state0.clone()
        hist = ReplayHistory.allocate(SLOTS, L, H, P, G, N, dtype=torch.bfloat16, device="cuda",
                                      checkpointing=checkpointing)
        pnat, bufidx = allocate_replay_slots(SLOTS, device="cuda")
        outs = []
        for (x, dt, B, C), slot_ids, nat in steps:
            outs.append(replay_verify(st, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx,
                                      variant=variant))
            replay_advance(pnat, bufidx, slot_ids, nat, T, hist_len=L if checkpointing else None)
        torch.cuda.synchronize()
        res.append((st, hist, outs))
    (st_a, h_a, outs_a), (st_b, h_b, outs_b) = res
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert torch.equal(a, b), f"out of step {i} differs"
    assert torch.equal(st_a, st_b), "state differs"
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert torch.equal(getattr(h_a, f), getattr(h_b, f)), f"history.{f} differs"


def _super_v3_case(state_dtype, checkpointing, **kernel_kw):
    """Kernel (launcher arguments `kernel_kw`) vs reference, replayed state vs materialised, replay vs rewind
    outputs, at the Super V3 shape with random PNAT (checkpointing: with and without flushes) and PAD rows."""
    A, D, dt_bias = params()
    x, dt, B, C = inputs(3)
    slot_ids = slots_with_pad(4)
    L = 16 if checkpointing else T  # checkpointing: PNAT 0..16, flush when PNAT + T > 16
    hist = _history(5, A, hist_len=L, checkpointing=checkpointing)
    pnat = torch.randint(0, L + 1, (SLOTS,), device="cuda", dtype=torch.int32)
    bufidx = torch.randint(0, 2, (SLOTS,), device="cuda", dtype=torch.int32)
    state = torch.randn(SLOTS, H, P, N, device="cuda").to(state_dtype)
    materialised = mamba2_materialized_state(state, hist, pnat, bufidx, A)
    res = []
    for fn in (replay_verify, replay_verify_ref):
        st, h = state.clone(), ReplayHistory(*(t.clone() for t in (hist.x, hist.B, hist.dt, hist.dA_cumsum)))
        out = torch.full((BATCH, T, H, P), float("nan"), device="cuda", dtype=torch.bfloat16)
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, h, pnat, bufidx, out=out, **kernel_kw)
        res.append((st, h, out))
    (st_k, h_k, out_k), (st_r, h_r, out_r) = res
    tol = max(TOL[state_dtype], TOL[torch.bfloat16])
    close(out_k, out_r, tol, "out")
    close(st_k, st_r, TOL[state_dtype], "state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        close(getattr(h_k, f), getattr(h_r, f), TOL[torch.float32], f"history.{f}")
    live = slot_ids[slot_ids >= 0].long()
    written = live[pnat[live] + T > L] if checkpointing else live  # checkpointing: only flushed slots
    kept = live[pnat[live] + T <= L] if checkpointing else live[:0]
    close(st_k[written], materialised[written], TOL[state_dtype], "replayed state vs materialised")
    assert torch.equal(st_k[kept], state[kept]), "checkpointing wrote the state without a flush"
    # replay out == rewind out from the materialised state
    inter = torch.empty(BATCH, T, H, P, N, device="cuda", dtype=torch.float32)
    out_rew = selective_state_update(materialised.clone(), x, dt, A, B, C, D, dt_bias, slot_ids,
                                     intermediate_states=inter)
    close(out_k, out_rew, tol, "replay vs rewind out")


def _poisoned_like(t):
    p = torch.empty_like(t)
    if p.dtype.is_floating_point:
        p.fill_(float("nan"))
    else:
        p.fill_(POISON)
    return p


@pytest.mark.parametrize("variant", replay.ALL_VARIANTS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_cuda_graph_replay_verify_matches_eager_bitwise(state_dtype, checkpointing, variant):
    """Capture verify + advance with every metadata / input buffer poisoned, fill, replay: output, state and
    history equal eager bitwise (the CUDA variant, checkpointing histories only, launches on the capturing
    stream)."""
    if variant == replay.CUDA_VARIANT and not checkpointing:
        pytest.skip("the cuda variant takes checkpointing histories only")
    A, D, dt_bias = params()
    state0 = torch.randn(SLOTS, H, P, N, device="cuda").to(state_dtype)
    steps = [(inputs(10 + i), slots_with_pad(20 + i),
              torch.randint(1, T + 1, (BATCH,), device="cuda", dtype=torch.int32)) for i in range(6)]
    L = 16 if checkpointing else T  # checkpointing: six steps of up to 4 accepted tokens, some slots flush
    hist_len = L if checkpointing else None

    def new_history():
        return ReplayHistory.allocate(SLOTS, L, H, P, G, N, dtype=torch.bfloat16, device="cuda",
                                       checkpointing=checkpointing)

    def run_eager():
        st = state0.clone()
        hist = new_history()
        pnat, bufidx = allocate_replay_slots(SLOTS, device="cuda")
        outs = []
        for (x, dt, B, C), slot_ids, nat in steps:
            outs.append(replay_verify(st, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx,
                                      variant=variant).clone())
            replay_advance(pnat, bufidx, slot_ids, nat, T, hist_len=hist_len)
        return st, outs, hist

    st_eager, outs_eager, hist_eager = run_eager()  # also compiles every kernel before capture

    (x0, dt0, B0, C0), slot0, nat0 = steps[0]
    # static buffers of a captured engine step, poisoned before the first fill
    sx, sdt, sB, sC = (_poisoned_like(t) for t in (x0, dt0, B0, C0))
    s_slots = torch.full_like(slot0, -1)  # a slot id must be PAD or live even in a poisoned buffer
    s_nat = _poisoned_like(nat0)
    s_out = _poisoned_like(torch.empty(BATCH, T, H, P, device="cuda", dtype=torch.bfloat16))
    st = state0.clone()
    hist = new_history()
    pnat = _poisoned_like(torch.zeros(SLOTS, dtype=torch.int32, device="cuda"))
    bufidx = _poisoned_like(pnat)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        replay_verify(st, sx, sdt, A, sB, sC, D, dt_bias, s_slots, hist, pnat, bufidx, out=s_out,
                      variant=variant)
        replay_advance(pnat, bufidx, s_slots, s_nat, T, hist_len=hist_len)
    torch.cuda.synchronize()
    pnat.zero_()  # the allocator's contract: metadata starts at zero
    bufidx.zero_()
    assert torch.equal(st, state0), "capture must not run the kernels"
    for i, ((x, dt, B, C), slot_ids, nat) in enumerate(steps):
        for dst, src in ((sx, x), (sdt, dt), (sB, B), (sC, C), (s_slots, slot_ids), (s_nat, nat)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(s_out, outs_eager[i]), f"graph output differs from eager at step {i}"
    assert torch.equal(st, st_eager), "graph state differs from eager"
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert torch.equal(getattr(hist, f), getattr(hist_eager, f)), f"graph history.{f} differs from eager"
