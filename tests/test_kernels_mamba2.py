"""Mamba2 kernels (rewind: kernels.mamba2.recurrent + kernels.commit.rewind_commit, replay:
kernels.mamba2.replay + kernels.commit.replay_advance) against their references.

On a machine without CUDA the kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 is set here, before
the first import of a kernel module (Triton picks interpreted vs compiled when a kernel is decorated). The
setting is process-wide; it is only set when there is no GPU, where compiled Triton could not run anyway.
Shapes stay tiny: the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from replay_oracles import mamba2_materialized_state, mamba2_replay_verify_oracle  # noqa: E402

from benchmarks.replay_configs import M2_CONFIGS  # noqa: E402
from kernels import _common  # noqa: E402
from kernels.commit import (  # noqa: E402
    allocate_replay_slots,
    replay_advance,
    replay_advance_ref,
    rewind_commit,
    rewind_commit_ref,
)
from kernels.mamba2 import (  # noqa: E402
    ReplayHistory,
    replay,
    replay_verify,
    replay_verify_ref,
    selective_state_update,
    selective_state_update_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

if DEV == "cpu" and not _common.interpreter_active():  # pragma: no cover - depends on test import order
    raise RuntimeError(
        "triton was imported in compiled mode before this module set TRITON_INTERPRET=1; set "
        "TRITON_INTERPRET=1 in the environment (or in tests/conftest.py) on machines without CUDA"
    )

# Tolerances (atol = rtol) for kernel vs reference, keyed by the dtype the compared tensor is stored in.
# Both sides compute in fp32 and differ only in summation order / exp implementation: a few fp32 ulps on
# values of order 1-10 after <= 8 steps (fp32: 1e-4 leaves ~100x margin). A 16-bit store rounds both sides'
# fp32 values, which can land one ulp apart: bf16 ulp 2^-8 = 3.9e-3 relative -> 1.6e-2 (4 ulps);
# fp16 ulp 2^-11 = 4.9e-4 relative -> 2e-3 (4 ulps).
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# Replay vs rewind: a closed form against a sequential recurrence. fp32: as above. A 16-bit state is rounded
# once per step by both schemes, at the same point, but the fp32 values rounded can sit one ulp apart.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Kernel variants of the replay verify (kernels.mamba2.replay.VARIANTS): each is held to the same tolerances.
# "mma" splits an fp32 operand into 2 bf16 pieces (about 2^-17 relative per product, kernels/_mma.py): on
# O(1-10) values that is ~1e-5, inside the fp32 tolerance with a margin of ~5. "mma_pre": "mma" with the
# C B^T products and the B history writes in a precompute kernel (same tolerances); "mma_pre_pdl": "mma_pre"
# with PDL, which the interpreter runs as "mma_pre" (its launches run one after the other; the PDL ordering is
# covered by the `gpu` tests of tests/test_kernels_mamba2_gpu.py, which iterate over the same table).
VARIANTS = tuple(replay.VARIANTS)


def assert_close(a, b, dtype=None, what=""):
    tol = TOL[dtype or a.dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def loosest(*dtypes):
    """The dtype with the widest tolerance: replay outputs are computed from a state rounded to its dtype."""
    return max(dtypes, key=TOL.__getitem__)


def make_params(H, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(H, generator=g) * 2 - 1)  # A = -exp(A_log), A_log in [-1, 1]
    D = torch.randn(H, generator=g)
    dt_bias = torch.rand(H, generator=g) - 0.5
    return A.to(DEV), D.to(DEV), dt_bias.to(DEV)


def make_inputs(Bsz, T, H, P, G, N, dtype, seed):
    """x, dt, B, C of one verify; dt raw ~ N(-1, 0.5) so softplus(dt + dt_bias) is about 0.1 - 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(Bsz, T, H, P, generator=g)
    dt = torch.randn(Bsz, T, H, generator=g) * 0.5 - 1.0
    B = torch.randn(Bsz, T, G, N, generator=g) / N**0.5
    C = torch.randn(Bsz, T, G, N, generator=g) / N**0.5
    return [t.to(DEV, dtype) for t in (x, dt, B, C)]


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def clone_history(h: ReplayHistory) -> ReplayHistory:
    return ReplayHistory(*(t.clone() for t in (h.x, h.B, h.dt, h.dA_cumsum)))


def random_history(S, L, H, P, G, N, dtype, A, seed, checkpointing=False) -> ReplayHistory:
    """A history as a previous verify would have left it (cumsum consistent with dt), in both buffers."""
    g = torch.Generator().manual_seed(seed)
    hist = ReplayHistory.allocate(S, L, H, P, G, N, dtype=dtype, device=DEV, checkpointing=checkpointing)
    hist.x.copy_(torch.randn(hist.x.shape, generator=g))
    hist.B.copy_(torch.randn(hist.B.shape, generator=g) / N**0.5)
    hist.dt.copy_(torch.rand(hist.dt.shape, generator=g) * 0.9 + 0.1)
    hist.dA_cumsum.copy_(torch.cumsum(A.cpu()[:, None] * hist.dt.cpu(), dim=-1))
    return hist


# ---------------------------------------------------------------------------------------------------------
# Rewind: selective_state_update + rewind_commit
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state_dtype,in_dtype",
    [(s, i) for s in DTYPES for i in DTYPES],
)
def test_ssu_rewind_matches_reference_all_dtypes(state_dtype, in_dtype):
    S, H, P, N, G, T = 4, 2, 16, 16, 1, 3
    slot_ids = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)  # PAD row in the middle, slot 0 live
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_inputs(3, T, H, P, G, N, in_dtype, seed=1)
    state = torch.randn(S, H, P, N, device=DEV).to(state_dtype)
    results = []
    for fn in (selective_state_update, selective_state_update_ref):
        st = state.clone()
        inter = nan_like((3, T, H, P, N), state_dtype)
        out = nan_like((3, T, H, P), in_dtype)
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, intermediate_states=inter, out=out)
        results.append((st, inter, out))
    (st_k, inter_k, out_k), (st_r, inter_r, out_r) = results
    assert torch.equal(st_k, state), "rewind verify must not touch the stored state"
    assert_close(out_k, out_r, what="out")
    assert_close(inter_k, inter_r, what="intermediate_states")
    assert torch.isnan(inter_k[1]).all(), "PAD row wrote intermediate states"
    assert (out_k[1] == 0).all(), "PAD row output must be zero"
    assert not torch.isnan(out_k).any() and not torch.isnan(inter_k[[0, 2]]).any(), "unwritten element"


@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_ssu_awkward_sizes(T):
    # P = 60, N = 24 (not powers of two), H = 6 heads in G = 3 groups (not a multiple of 8)
    S, H, P, N, G = 3, 6, 60, 24, 3
    slot_ids = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    A, D, dt_bias = make_params(H, seed=T)
    x, dt, B, C = make_inputs(2, T, H, P, G, N, torch.float32, seed=T)
    state = torch.randn(S, H, P, N, device=DEV)
    outs, states = [], []
    for fn in (selective_state_update, selective_state_update_ref):
        st = state.clone()
        out = nan_like((2, T, H, P), torch.float32)
        # decode-style in-place update (T = 1 is plain decode) with a dt clamp
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, out=out, time_step_limit=(0.2, 0.8))
        outs.append(out)
        states.append(st)
    assert_close(outs[0], outs[1], what="out")
    assert_close(states[0], states[1], what="state")
    assert torch.equal(states[0][1], state[1]), "slot 1 is not in the batch"
    assert not torch.equal(states[0][0], state[0]), "slot 0 is live and must be updated"


def test_ssu_decode_equals_one_token_steps_of_rewind():
    """T sequential T=1 decodes give the same states as one rewind verify's intermediate states."""
    S, H, P, N, G, T = 2, 2, 16, 16, 2, 4
    slot_ids = torch.tensor([1], dtype=torch.int32, device=DEV)
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_inputs(1, T, H, P, G, N, torch.float32, seed=3)
    state = torch.randn(S, H, P, N, device=DEV)
    inter = nan_like((1, T, H, P, N), torch.float32)
    out = selective_state_update(state.clone(), x, dt, A, B, C, D, dt_bias, slot_ids,
                                 intermediate_states=inter)
    st = state.clone()
    for t in range(T):
        sl = slice(t, t + 1)
        y = selective_state_update(st, x[:, sl], dt[:, sl], A, B[:, sl], C[:, sl], D, dt_bias, slot_ids)
        assert_close(y[:, 0], out[:, t], what=f"out[{t}]")
        assert_close(st[1], inter[0, t], what=f"state after token {t}")


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_commit_matches_reference_and_clamps(state_dtype):
    S, H, P, N, T = 5, 2, 12, 20, 4
    inter = torch.randn(6, T, H, P, N, device=DEV).to(state_dtype)  # buffer larger than the batch
    state = torch.randn(S, H, P, N, device=DEV).to(state_dtype)
    slot_ids = torch.tensor([3, -1, 0, 1, 4], dtype=torch.int32, device=DEV)
    nat = torch.tensor([2, 3, 0, 9, -5], dtype=torch.int32, device=DEV)  # > T: clamped to T; <= 0: nothing
    st_k, st_r = state.clone(), state.clone()
    rewind_commit(st_k, inter, slot_ids, nat)
    rewind_commit_ref(st_r, inter, slot_ids, nat)
    assert torch.equal(st_k, st_r)
    assert torch.equal(st_k[3], inter[0, 1]) and torch.equal(st_k[1], inter[3, T - 1])
    assert torch.equal(st_k[0], state[0]) and torch.equal(st_k[4], state[4]), "0 or less accepts nothing"
    assert torch.equal(st_k[2], state[2]), "slot 2 is only named by the PAD row's neighbours"


def test_rewind_buffer_indexed_by_slot():
    """The engine's layout: one rewind-buffer row per slot (intermediate_state_indices = the slot ids, int64,
    PAD -1), written by the verify and read by the commit; PAD rows and slots outside the batch keep NaN."""
    S, H, P, N, G, T = 5, 2, 16, 16, 1, 3
    slot_ids = torch.tensor([3, -1, 0], dtype=torch.int64, device=DEV)
    nat = torch.tensor([2, 3, 3], dtype=torch.int64, device=DEV)
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_inputs(3, T, H, P, G, N, torch.float32, seed=11)
    state = torch.randn(S, H, P, N, device=DEV)
    by_row = nan_like((3, T, H, P, N), torch.float32)
    selective_state_update(state.clone(), x, dt, A, B, C, D, dt_bias, slot_ids, intermediate_states=by_row)
    res = []
    for fn, commit in ((selective_state_update, rewind_commit),
                       (selective_state_update_ref, rewind_commit_ref)):
        st, inter = state.clone(), nan_like((S, T, H, P, N), torch.float32)
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, intermediate_states=inter,
           intermediate_state_indices=slot_ids)
        assert torch.equal(st, state), "rewind verify must not touch the stored state"
        commit(st, inter, slot_ids, nat, intermediate_state_indices=slot_ids)
        res.append((st, inter))
    (st_k, inter_k), (st_r, inter_r) = res
    assert_close(inter_k, inter_r, what="intermediate_states by slot")
    assert torch.equal(inter_k[3], by_row[0]) and torch.equal(inter_k[0], by_row[2]), "row b went to its slot"
    assert torch.isnan(inter_k[[1, 2, 4]]).all(), "a PAD row or a slot outside the batch was written"
    assert_close(st_k, st_r, what="committed state")
    assert torch.equal(st_k[3], inter_k[3, 1]) and torch.equal(st_k[0], inter_k[0, 2])
    assert torch.equal(st_k[[1, 2, 4]], state[[1, 2, 4]])


def test_rewind_strided_views():
    """Caches that are views into larger buffers (layer-stacked, padded) are read and written in place."""
    S, H, P, N, G, T, layers = 3, 2, 16, 24, 1, 3, 2
    big_state = torch.randn(S, layers, H, P + 4, N + 8, device=DEV)
    state = big_state[:, 1, :, 2 : 2 + P, :N]  # non-contiguous in every dim but N
    big_inter = nan_like((2, T, H, N, P), torch.float32)
    inter = big_inter.transpose(-1, -2)  # (B, T, H, P, N) with N strided
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_inputs(2, T, H, P, G, N, torch.float32, seed=4)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # (B, T, H, P) with a head-major layout
    slot_ids = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    nat = torch.tensor([3, 1], dtype=torch.int32, device=DEV)
    before = big_state.clone()
    ref_state = state.contiguous()
    ref_inter = nan_like((2, T, H, P, N), torch.float32)
    out = selective_state_update(state, x, dt, A, B, C, D, dt_bias, slot_ids, intermediate_states=inter)
    out_r = selective_state_update_ref(ref_state, x, dt, A, B, C, D, dt_bias, slot_ids,
                                       intermediate_states=ref_inter)
    assert_close(out, out_r, what="out")
    assert_close(inter, ref_inter, what="intermediate_states")
    rewind_commit(state, inter, slot_ids, nat)
    rewind_commit_ref(ref_state, ref_inter, slot_ids, nat)
    assert_close(state, ref_state, what="committed state")
    mask = torch.ones_like(big_state, dtype=torch.bool)
    mask[:, 1, :, 2 : 2 + P, :N] = False
    assert torch.equal(big_state[mask], before[mask]), "wrote outside the state view"


# ---------------------------------------------------------------------------------------------------------
# Replay: replay_verify + replay_advance
# ---------------------------------------------------------------------------------------------------------


def _replay_case(S, H, P, N, G, T, L, state_dtype, in_dtype, *, slot_ids, pnat, bufidx, seed=0):
    A, D, dt_bias = make_params(H, seed)
    hist = random_history(S, L, H, P, G, N, in_dtype, A, seed + 1)
    x, dt, B, C = make_inputs(len(slot_ids), T, H, P, G, N, in_dtype, seed + 2)
    state = torch.randn(S, H, P, N, device=DEV).to(state_dtype)
    slot_ids = torch.tensor(slot_ids, dtype=torch.int32, device=DEV)
    pnat = torch.tensor(pnat, dtype=torch.int32, device=DEV)
    bufidx = torch.tensor(bufidx, dtype=torch.int32, device=DEV)
    return A, D, dt_bias, hist, x, dt, B, C, state, slot_ids, pnat, bufidx


def _run_replay_both(case, T, **kernel_kw):
    """(state, history, out) after the kernel (with `kernel_kw`: variant, ...) and after its vectorised
    reference; the reference is also checked here against the token-by-token oracle (tests/replay_oracles.py),
    which shares no code path."""
    A, D, dt_bias, hist, x, dt, B, C, state, slot_ids, pnat, bufidx = case
    res = []
    for fn, kw in ((replay_verify, kernel_kw), (replay_verify_ref, {}), (mamba2_replay_verify_oracle, {})):
        st, h = state.clone(), clone_history(hist)
        p, bi = pnat.clone(), bufidx.clone()
        out = nan_like((len(slot_ids), T, *state.shape[1:3]), x.dtype)
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, h, p, bi, out=out, **kw)
        assert torch.equal(p, pnat) and torch.equal(bi, bufidx), "verify must not touch the per-slot metadata"
        res.append((st, h, out))
    (st_r, h_r, out_r), (st_o, h_o, out_o) = res[1:]
    assert_close(out_r, out_o, loosest(state.dtype, x.dtype), what="reference vs oracle: out")
    assert_close(st_r, st_o, what="reference vs oracle: state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert_close(getattr(h_r, f), getattr(h_o, f), what=f"reference vs oracle: history.{f}")
    return res[:2]


# every dtype pair for the "fma" kernel; for "mma" the pairs whose operands take 1, 2 and 3 bf16 pieces
MMA_DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                   (torch.float16, torch.bfloat16), (torch.float32, torch.float16)]


@pytest.mark.parametrize(
    "variant,state_dtype,in_dtype",
    [("fma", s, i) for s in DTYPES for i in DTYPES]
    + [(v, s, i) for v in VARIANTS if v != "fma" for s, i in MMA_DTYPE_PAIRS],
)
def test_replay_verify_matches_reference_all_dtypes(variant, state_dtype, in_dtype):
    S, H, P, N, G, T, L = 5, 2, 16, 16, 1, 3, 3
    # rows: slot 3 (PNAT 2, buffer 1), PAD, slot 0 (PNAT 3 = T, buffer 0), slot 1 (PNAT 0: nothing to replay)
    case = _replay_case(S, H, P, N, G, T, L, state_dtype, in_dtype,
                        slot_ids=[3, -1, 0, 1], pnat=[3, 0, 0, 2, 1], bufidx=[0, 1, 1, 1, 0])
    hist0, state0 = clone_history(case[3]), case[8].clone()
    (st_k, h_k, out_k), (st_r, h_r, out_r) = _run_replay_both(case, T, variant=variant)
    assert_close(out_k, out_r, loosest(state_dtype, in_dtype), what="out")
    assert_close(st_k, st_r, what="state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert_close(getattr(h_k, f), getattr(h_r, f), what=f"history.{f}")
    for s in (1, 2, 4):  # PNAT 0, not in the batch, not in the batch
        assert torch.equal(st_k[s], state0[s]), f"state of slot {s} touched"
    assert not torch.equal(st_k[0], state0[0]) and not torch.equal(st_k[3], state0[3])
    assert (out_k[1] == 0).all() and not torch.isnan(out_k).any()
    # the read buffer (buffer_index) of every slot and every slot outside the batch are untouched
    for s, r in ((3, 1), (0, 0), (1, 1), (2, 1), (2, 0), (4, 0), (4, 1)):
        for f in ("x", "B", "dt", "dA_cumsum"):
            same = torch.equal(getattr(h_k, f)[s, r], getattr(hist0, f)[s, r])
            assert same, f"history.{f}[{s}, {r}] touched"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pnat", [0, 1, 2, 3, 4])
def test_replay_equals_rewind_for_every_pnat(pnat, variant):
    """Replay's output and state equal rewind's from the materialised state, for PNAT = 0..T."""
    S, H, P, N, G, T, L = 3, 2, 16, 24, 2, 4, 4
    case = _replay_case(S, H, P, N, G, T, L, torch.float32, torch.float32,
                        slot_ids=[2, 0], pnat=[pnat, 1, pnat], bufidx=[1, 0, 0])
    A, D, dt_bias, hist, x, dt, B, C, state, slot_ids, p, bi = case
    materialised = mamba2_materialized_state(state, hist, p, bi, A)
    slot1 = state[1].clone()
    out = replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, p, bi, variant=variant)
    assert_close(state[[2, 0]], materialised[[2, 0]], what="fast-forwarded state")
    assert torch.equal(state[1], slot1), "slot 1 (PNAT 1) is not in the batch and must not advance"
    rew_state = materialised.clone()
    inter = nan_like((2, T, H, P, N), torch.float32)
    out_rew = selective_state_update(rew_state, x, dt, A, B, C, D, dt_bias, slot_ids,
                                     intermediate_states=inter)
    assert_close(out, out_rew, what="replay out vs rewind out")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_replay_awkward_sizes(T, variant):
    S, H, P, N, G, L = 3, 6, 60, 24, 3, 8
    pn = min(2, T)
    case = _replay_case(S, H, P, N, G, T, L, torch.float32, torch.float32,
                        slot_ids=[1, 0], pnat=[T, 3, pn], bufidx=[0, 1, 0], seed=T)
    (st_k, h_k, out_k), (st_r, h_r, out_r) = _run_replay_both(case, T, variant=variant)
    assert_close(out_k, out_r, what="out")
    assert_close(st_k, st_r, what="state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert_close(getattr(h_k, f), getattr(h_r, f), what=f"history.{f}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_replay_walks_d_state_in_chunks(checkpointing, variant):
    """N = 40 (tile 64; "mma" walks it in chunks of 16: one ragged, one empty), P = 20 in blocks of 16: every
    tile is visited once."""
    S, H, P, N, G, T = 3, 2, 20, 40, 1, 3
    L = 8 if checkpointing else T
    A, D, dt_bias = make_params(H)
    hist = random_history(S, L, H, P, G, N, torch.float32, A, seed=9, checkpointing=checkpointing)
    slot_ids = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    pnat = torch.tensor([3, 0, 2 if checkpointing else 3], dtype=torch.int32, device=DEV)  # ckpt: no flush
    if checkpointing:
        pnat[0] = 7  # slot 0: 7 + 3 > 8, flush
    bufidx = torch.tensor([1, 0, 0], dtype=torch.int32, device=DEV)
    x, dt, B, C = make_inputs(2, T, H, P, G, N, torch.float32, seed=10)
    state = torch.randn(S, H, P, N, device=DEV)
    res = []
    for fn in (replay_verify, replay_verify_ref):
        st, h = state.clone(), clone_history(hist)
        out = nan_like((2, T, H, P), torch.float32)
        kw = dict(variant=variant, chunk_n=16) if fn is replay_verify else {}
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, h, pnat, bufidx, out=out, block_p=16, **kw)
        res.append((st, h, out))
    (st_k, h_k, out_k), (st_r, h_r, out_r) = res
    assert_close(out_k, out_r, what="out")
    assert_close(st_k, st_r, what="state")
    assert not torch.equal(st_k[0], state[0]), "slot 0 must have been fast-forwarded"
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert_close(getattr(h_k, f), getattr(h_r, f), what=f"history.{f}")


@pytest.mark.parametrize("variant", ["mma", "mma_pre"])
def test_replay_persistent_grid_walks_every_unit(variant):
    """persistent=: 3 programs (the interpreter counts 1 SM) walk the 2 P blocks x 3 rows x 3 heads with a
    grid stride: per-step replay with a write, PNAT 0 and a PAD row, as without it."""
    S, H, P, N, G, T, L = 4, 3, 20, 16, 1, 3, 3
    case = _replay_case(S, H, P, N, G, T, L, torch.float32, torch.float32,
                        slot_ids=[3, -1, 1], pnat=[0, 0, 1, 3], bufidx=[0, 1, 0, 1])
    (st_k, h_k, out_k), (st_r, h_r, out_r) = _run_replay_both(case, T, variant=variant, persistent=3)
    assert_close(out_k, out_r, what="out")
    assert_close(st_k, st_r, what="state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert_close(getattr(h_k, f), getattr(h_r, f), what=f"history.{f}")
    assert (out_k[1] == 0).all() and not torch.isnan(out_k).any()
    A, D, dt_bias, hist, x, dt, B, C, state, slot_ids, pnat, bufidx = case
    with pytest.raises(ValueError, match="persistent must be a non-negative int"):
        replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx, variant="fma",
                      persistent=2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_replay_garbage_metadata_is_clamped(variant):
    """PNAT outside [0, L] and buffer indices other than 0/1 never index out of range."""
    S, H, P, N, G, T, L = 3, 2, 16, 16, 1, 2, 4
    case = _replay_case(S, H, P, N, G, T, L, torch.float32, torch.float32,
                        slot_ids=[0, 2, 1], pnat=[99, -7, 0x7BADBEEF], bufidx=[5, -3, 0x7BADBEEF])
    (st_k, h_k, out_k), (st_r, h_r, out_r) = _run_replay_both(case, T, variant=variant)
    assert_close(out_k, out_r, what="out")
    assert_close(st_k, st_r, what="state")


def test_replay_advance_matches_reference():
    pnat = torch.tensor([1, 2, 3, 4, 0, 2], dtype=torch.int32, device=DEV)
    bufidx = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.int32, device=DEV)
    slot_ids = torch.tensor([4, -1, 0, 2, 5], dtype=torch.int32, device=DEV)
    nat = torch.tensor([3, 2, 0, 9, 1], dtype=torch.int64, device=DEV)  # 0 and 9 clamp to [0, T]
    pk, bk, pr, br = pnat.clone(), bufidx.clone(), pnat.clone(), bufidx.clone()
    replay_advance(pk, bk, slot_ids, nat, 4)
    replay_advance_ref(pr, br, slot_ids, nat, 4)
    assert torch.equal(pk, pr) and torch.equal(bk, br)
    assert pk.tolist() == [0, 2, 4, 4, 3, 1]
    assert bk.tolist() == [1, 1, 1, 1, 0, 1]


@pytest.mark.parametrize("hist_len", [None, 16])
def test_replay_advance_moves_conv_offset_and_ring_in_the_same_launch(hist_len):
    """``last_accepted=`` and ``ring_start=`` (the engine's conv offset and FlashInfer's ring start) move in
    the kernel's one launch exactly as the reference moves them: the ring by the PNAT before this update
    (flushed live rows only, modulo the ring: slot 0 wraps), the offset to num_accepted_tokens as given; PAD
    rows and slots outside the batch keep every value; garbage PNAT clamps to the window."""
    T, W = 4, (16 if hist_len else 4)
    R = W + T
    pnat = torch.tensor([13, 2, 40, 0, 3, -5], dtype=torch.int32, device=DEV)
    bufidx = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.int32, device=DEV)
    last = torch.tensor([7, 7, 7, 7, 7, 7], dtype=torch.int32, device=DEV)
    ring = torch.tensor([R - 2, 5, 1, 3, 0, 2], dtype=torch.int32, device=DEV)
    slot_ids = torch.tensor([0, -1, 2, 4, 5, 3], dtype=torch.int64, device=DEV)
    nat = torch.tensor([3, 2, 4, 9, 1, 0], dtype=torch.int32, device=DEV)
    k, r = ([t.clone() for t in (pnat, bufidx, last, ring)] for _ in range(2))
    kw = dict(hist_len=hist_len, ring_window=W, ring_len=R)
    replay_advance(k[0], k[1], slot_ids, nat, T, last_accepted=k[2], ring_start=k[3], **kw)
    replay_advance_ref(r[0], r[1], slot_ids, nat, T, last_accepted=r[2], ring_start=r[3], **kw)
    for a, b, what in zip(k, r, ("pnat", "buffer_index", "last_accepted", "ring_start")):
        assert torch.equal(a, b), (what, a.tolist(), b.tolist())
    assert k[2].tolist() == [3, 7, 4, 0, 9, 1]  # slot 1 is in no live row: unchanged
    # slot 0: k = 13 (or 4 in the per-step window) flushes, (R - 2 + k) % R; slot 2: k = 40 clamps to W
    k0 = min(13, W)
    assert k[3][0].item() == (R - 2 + k0) % R and k[3][2].item() == (1 + W) % R
    assert k[3][1].item() == 5 and k[3][3].item() == 3  # not in the batch / PNAT 0: no flush
    # slot 4: k = 3 flushes the per-step window (3 + T > 4) and fits the checkpointing one (3 + T <= 16)
    assert k[3][4].item() == (3 if W == T else 0)
    # ring_start without a window the ring can hold is refused
    with pytest.raises(ValueError, match="ring_window"):
        replay_advance(k[0], k[1], slot_ids, nat, T, ring_start=k[3], ring_window=T - 1, ring_len=R)
    with pytest.raises(ValueError, match="ring_window"):
        replay_advance_ref(r[0], r[1], slot_ids, nat, T, ring_start=r[3])


def test_allocators_zero_initialise():
    hist = ReplayHistory.allocate(3, 4, 2, 8, 1, 16, dtype=torch.bfloat16, device=DEV)
    pnat, bufidx = allocate_replay_slots(3, device=DEV)
    for t in (hist.x, hist.B, hist.dt, hist.dA_cumsum, pnat, bufidx):
        assert (t == 0).all()
    assert pnat.dtype == bufidx.dtype == torch.int32
    # history is T (H P + G N) values per slot instead of T H P N: the point of replay
    assert hist.nbytes() < 3 * 2 * 4 * 2 * 8 * 16 * 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_replay_strided_views(variant):
    """State and history as views of layer-stacked buffers (the engine allocates all layers at once)."""
    S, H, P, N, G, T, L, layers = 3, 2, 16, 16, 2, 3, 4, 2
    A, D, dt_bias = make_params(H)
    # one (S, layers, 2, ...) tensor per field; the layer-1 slice is the history of this layer
    g = torch.Generator().manual_seed(7)
    stack = {"x": torch.randn(S, layers, 2, L, H, P, generator=g).to(DEV),
             "B": torch.randn(S, layers, 2, L, G, N, generator=g).to(DEV)}
    stack["dt"] = (torch.rand(S, layers, 2, H, L, generator=g) * 0.9 + 0.1).to(DEV)
    stack["dA_cumsum"] = torch.cumsum(A[:, None] * stack["dt"], dim=-1)
    hist = ReplayHistory(*(stack[f][:, 1] for f in ("x", "B", "dt", "dA_cumsum")))
    big_state = torch.randn(layers, S, H, P, N + 8, device=DEV)
    state = big_state[1, :, :, :, :N]
    before = {f: t.clone() for f, t in stack.items()}
    big_before = big_state.clone()
    x, dt, B, C = make_inputs(2, T, H, P, G, N, torch.float32, seed=8)
    slot_ids = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    meta = torch.tensor([[0, 3, 2], [1, 0, 1]], dtype=torch.int32, device=DEV)  # rows: pnat, bufidx
    pnat, bufidx = meta[0], meta[1]  # pnat is a strided-by-1 view; bufidx likewise
    ref_state, ref_hist = state.clone(), clone_history(hist)
    out = replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx, variant=variant)
    out_r = replay_verify_ref(ref_state, x, dt, A, B, C, D, dt_bias, slot_ids, ref_hist, pnat, bufidx)
    assert_close(out, out_r, what="out")
    assert_close(state, ref_state, what="state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert_close(getattr(hist, f), getattr(ref_hist, f), what=f"history.{f}")
        assert torch.equal(stack[f][:, 0], before[f][:, 0]), f"layer 0 history.{f} touched"
    assert torch.equal(big_state[0], big_before[0]), "layer 0 state touched"
    assert torch.equal(big_state[..., N:], big_before[..., N:]), "wrote outside the state view"


@pytest.mark.parametrize("variant", VARIANTS)
def test_replay_step_without_drafts_after_multi_accept(variant):
    """T = 1 (no drafts) after a T = 4 step that accepted 3: the fast-forward reads the right tokens."""
    S, H, P, N, G, L = 2, 2, 16, 16, 1, 4
    A, D, dt_bias = make_params(H)
    hist = ReplayHistory.allocate(S, L, H, P, G, N, dtype=torch.float32, device=DEV)
    pnat, bufidx = allocate_replay_slots(S, device=DEV)
    state = torch.randn(S, H, P, N, device=DEV)
    seq_state = state.clone()
    slot_ids = torch.tensor([1], dtype=torch.int32, device=DEV)
    for step, (T, nat) in enumerate(((4, 3), (1, 1), (4, 4), (2, 1))):
        x, dt, B, C = make_inputs(1, T, H, P, G, N, torch.float32, seed=10 + step)
        out = replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx, variant=variant)
        seq_out = selective_state_update_ref(seq_state.clone(), x, dt, A, B, C, D, dt_bias, slot_ids)
        assert_close(out, seq_out, what=f"step {step} out")
        a = slice(0, nat)
        selective_state_update_ref(seq_state, x[:, a], dt[:, a], A, B[:, a], C[:, a], D, dt_bias, slot_ids)
        replay_advance(pnat, bufidx, slot_ids, torch.tensor([nat], device=DEV), T)
    final = mamba2_materialized_state(state, hist, pnat, bufidx, A)
    assert_close(final, seq_state.float(), torch.float32, what="final state")


@pytest.mark.parametrize("variant", VARIANTS)
def test_pad_rows_leave_every_buffer_untouched(variant):
    """PAD rows (slot -1) next to one live row (slot 1): slots 0 and 2 keep state, history and metadata."""
    S, H, P, N, G, T, L = 3, 2, 16, 16, 1, 3, 3
    slot_ids = torch.tensor([-1, 1, -1], dtype=torch.int32, device=DEV)
    nat = torch.tensor([3, 2, 1], dtype=torch.int32, device=DEV)
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_inputs(3, T, H, P, G, N, torch.float32, seed=5)
    state0 = torch.randn(S, H, P, N, device=DEV)
    others = [0, 2]

    st = state0.clone()  # decode-style in-place update, then rewind verify + commit
    selective_state_update(st, x, dt, A, B, C, D, dt_bias, slot_ids)
    inter = torch.zeros(3, T, H, P, N, device=DEV)
    selective_state_update(st, x, dt, A, B, C, D, dt_bias, slot_ids, intermediate_states=inter)
    rewind_commit(st, inter, slot_ids, nat)
    assert torch.equal(st[others], state0[others]), "a PAD row wrote a state (rewind)"
    assert (inter[[0, 2]] == 0).all(), "a PAD row wrote intermediate states"

    hist = random_history(S, L, H, P, G, N, torch.float32, A, seed=6)
    hist0 = clone_history(hist)
    pnat = torch.tensor([2, 1, 3], dtype=torch.int32, device=DEV)
    bufidx = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEV)
    pnat0, bufidx0 = pnat.clone(), bufidx.clone()
    st = state0.clone()
    out = replay_verify(st, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx, variant=variant)
    replay_advance(pnat, bufidx, slot_ids, nat, T)
    assert torch.equal(st[others], state0[others]), "a PAD row wrote a state (replay)"
    for f in ("x", "B", "dt", "dA_cumsum"):
        same = torch.equal(getattr(hist, f)[others], getattr(hist0, f)[others])
        assert same, f"a PAD row wrote history.{f}"
    assert torch.equal(pnat[others], pnat0[others]) and torch.equal(bufidx[others], bufidx0[others])
    assert pnat[1] == 2 and bufidx[1] == 0, "the live row must advance"
    assert (out[[0, 2]] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# Long run: replay == rewind == one token at a time, over a hundred steps with random acceptance
# ---------------------------------------------------------------------------------------------------------


def _long_run(steps, S, H, P, N, G, T, rows, state_dtype, seed=0, hist_len=None, variant=None):
    """Returns max |replay - rewind| over outputs, and the three final states (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    A, D, dt_bias = make_params(H, seed)
    init = torch.randn(S, H, P, N, generator=gen).to(DEV, state_dtype)
    rew_state, rep_state, seq_state = init.clone(), init.clone(), init.float()
    inter = torch.zeros(rows, T, H, P, N, dtype=state_dtype, device=DEV)
    ckpt = hist_len is not None
    hist = ReplayHistory.allocate(S, hist_len or T, H, P, G, N, dtype=torch.float32, device=DEV,
                                   checkpointing=ckpt)
    pnat, bufidx = allocate_replay_slots(S, device=DEV)
    worst = 0.0
    for step in range(steps):
        perm = torch.randperm(S, generator=gen)[:rows]  # requests reorder across steps
        slot_ids = perm.to(torch.int32)
        if step % 7 == 3:
            slot_ids[0] = -1  # a PAD row now and then
        slot_ids = slot_ids.to(DEV)
        nat = torch.randint(1, T + 1, (rows,), generator=gen).to(DEV)
        x, dt, B, C = make_inputs(rows, T, H, P, G, N, torch.float32, seed=1000 * seed + step)
        out_rew = selective_state_update(rew_state, x, dt, A, B, C, D, dt_bias, slot_ids,
                                         intermediate_states=inter)
        rewind_commit(rew_state, inter, slot_ids, nat)
        out_rep = replay_verify(rep_state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx,
                                variant=variant)
        replay_advance(pnat, bufidx, slot_ids, nat, T, hist_len=hist_len)
        worst = max(worst, (out_rew - out_rep).abs().max().item())
        for b in range(rows):  # the sequential reference decodes only the accepted tokens
            s = int(slot_ids[b])
            if s < 0:
                continue
            k = int(nat[b])
            one = torch.tensor([s], dtype=torch.int32, device=DEV)
            for t in range(k):
                sl = slice(t, t + 1)
                r = slice(b, b + 1)
                args = (x[r, sl], dt[r, sl], A, B[r, sl], C[r, sl], D, dt_bias, one)
                selective_state_update_ref(seq_state, *args)
    rep_final = mamba2_materialized_state(rep_state, hist, pnat, bufidx, A)
    return worst, rew_state.float(), rep_final, seq_state


@pytest.mark.slow
def test_long_run_replay_rewind_sequential_agree_fp32():
    # 100 steps x 4 launches (about 200 accepted tokens per row, 14 PAD steps, every slot reordered many
    # times): the decaying recurrence does not compound errors, so more steps only repeat the check at
    # about 0.15 s each in the interpreter; one head and two rows for the same reason
    worst, rew, rep, seq = _long_run(100, S=3, H=1, P=16, N=16, G=1, T=3, rows=2, state_dtype=torch.float32)
    assert worst < 1e-4, f"replay and rewind outputs drifted apart: {worst}"
    assert_close(rep, rew, torch.float32, "replay vs rewind state")
    assert_close(rew, seq, torch.float32, "rewind vs sequential state")


def test_long_run_bf16_state_stays_close():
    # bf16 state: both schemes round once per step at the same point; they may sit one ulp apart, which the
    # decaying recurrence does not amplify. Against the fp32 sequential run, the rounding error of a bf16
    # state (2^-9 relative per step, decayed by exp(A dt') < 1) stays at the bf16 tolerance.
    worst, rew, rep, seq = _long_run(40, S=3, H=1, P=16, N=16, G=1, T=3, rows=2, state_dtype=torch.bfloat16)
    assert worst < 5e-2, f"replay and rewind outputs drifted apart: {worst}"
    assert_close(rep, rew, torch.bfloat16, "replay vs rewind state")
    assert_close(rew, seq, torch.bfloat16, "rewind vs sequential state")


# mma_pre_pdl runs mma_pre's code in the interpreter (no programmatic dependent launch there): its long run
# would repeat mma_pre's; the GPU test test_gpu_pdl_variant_equals_mma_pre_bitwise covers what differs
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "mma_pre_pdl"])
def test_long_run_checkpointing_agrees_with_rewind(variant):
    # L = 16, T = 3: a flush every 4-5 steps (6 or more in 30 steps); the fast-forward spans up to 13 tokens
    # and several verifies
    worst, rew, rep, seq = _long_run(30, S=3, H=1, P=16, N=16, G=1, T=3, rows=2, state_dtype=torch.float32,
                                     hist_len=16, variant=variant)
    assert worst < 1e-4, f"checkpointing replay and rewind outputs drifted apart: {worst}"
    assert_close(rep, rew, torch.float32, "checkpointing replay vs rewind state")
    assert_close(rew, seq, torch.float32, "rewind vs sequential state")


# ---------------------------------------------------------------------------------------------------------
# Checkpointing replay (history window L >= T, state written only on a flush)
# ---------------------------------------------------------------------------------------------------------


# launcher arguments: every variant, the sweep's register-capped and persistent configurations
# (benchmarks/replay_configs.py; the interpreter ignores maxnreg, so those check the argument's way through
# the launcher; the GPU tests run them compiled), and a persistent grid of 5 programs for the 12 units here
# (the interpreter counts 1 SM): programs walk 3, 3, 2, 2, 2 units
TUNED = tuple(k for k, c in M2_CONFIGS.items()  # the Triton ones: "cuda" has tests/test_replay_cuda*.py
              if ("maxnreg" in c or "persistent" in c) and c["variant"] in replay.VARIANTS)
CKPT_KERNEL_KW = {**{v: {"variant": v} for v in VARIANTS}, **{k: M2_CONFIGS[k] for k in TUNED},
                  "mma_pre_pdl_persistent5": {"variant": "mma_pre_pdl", "chunk_n": 16, "persistent": 5}}


@pytest.mark.parametrize("config", list(CKPT_KERNEL_KW))
@pytest.mark.parametrize(
    "state_dtype,in_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)],
)
def test_checkpointing_verify_matches_reference(state_dtype, in_dtype, config):
    S, H, P, N, G, T, L = 6, 2, 16, 24, 2, 3, 8
    A, D, dt_bias = make_params(H)
    hist = random_history(S, L, H, P, G, N, in_dtype, A, seed=3, checkpointing=True)
    # rows: no flush (2 + 3 <= 8), flush (6 + 3 > 8), PNAT 0, PAD, no flush at the edge (5 + 3 = 8), flush (L)
    slot_ids = torch.tensor([4, 1, 0, -1, 2, 5], dtype=torch.int32, device=DEV)
    pnat = torch.tensor([0, 6, 5, 7, 2, 8], dtype=torch.int32, device=DEV)  # by slot; slot 3 not in the batch
    bufidx = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int32, device=DEV)
    x, dt, B, C = make_inputs(6, T, H, P, G, N, in_dtype, seed=4)
    state = torch.randn(S, H, P, N, device=DEV).to(state_dtype)
    res = []
    for fn in (replay_verify, replay_verify_ref):
        st, h = state.clone(), clone_history(hist)
        out = nan_like((6, T, H, P), in_dtype)
        kw = CKPT_KERNEL_KW[config] if fn is replay_verify else {}
        fn(st, x, dt, A, B, C, D, dt_bias, slot_ids, h, pnat, bufidx, out=out, **kw)
        res.append((st, h, out))
    (st_k, h_k, out_k), (st_r, h_r, out_r) = res
    assert_close(out_k, out_r, loosest(state_dtype, in_dtype), what="out")
    assert_close(st_k, st_r, what="state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert_close(getattr(h_k, f), getattr(h_r, f), what=f"history.{f}")
    # state written only on a flush with something to fold in: slots 1 (6 + 3 > 8) and 5 (8 + 3 > 8)
    for s_, written in ((0, False), (1, True), (2, False), (3, False), (4, False), (5, True)):
        assert torch.equal(st_k[s_], state[s_]) != written, f"slot {s_}: state written = {not written}"
    assert (out_k[3] == 0).all() and not torch.isnan(out_k).any()
    pk, bk, pr, br = pnat.clone(), bufidx.clone(), pnat.clone(), bufidx.clone()
    nat = torch.tensor([3, 1, 2, 3, 3, 2], dtype=torch.int32, device=DEV)
    replay_advance(pk, bk, slot_ids, nat, T, hist_len=L)
    replay_advance_ref(pr, br, slot_ids, nat, T, hist_len=L)
    assert torch.equal(pk, pr) and torch.equal(bk, br)
    # pending = old + accepted, or accepted alone after a flush
    assert pk.tolist() == [0 + 2, 1, 5 + 3, 7, 2 + 3, 2]


# ---------------------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    S, H, P, N, G, T = 2, 2, 16, 16, 1, 2
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_inputs(1, T, H, P, G, N, torch.float32, seed=0)
    state = torch.zeros(S, H, P, N, device=DEV)
    slot_ids = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="dt must have shape"):
        selective_state_update(state, x, dt[:, :1], A, B, C, D, dt_bias, slot_ids)
    with pytest.raises(ValueError, match="multiple of ngroups"):
        B3, C3 = B.expand(1, T, 3, N), C.expand(1, T, 3, N)
        selective_state_update(state, x, dt, A, B3, C3, D, dt_bias, slot_ids)
    with pytest.raises(ValueError, match="slot_ids must be int32 or int64"):
        selective_state_update(state, x, dt, A, B, C, D, dt_bias, slot_ids.float())
    hist = ReplayHistory.allocate(S, 1, H, P, G, N, dtype=torch.float32, device=DEV)
    pnat, bufidx = allocate_replay_slots(S, device=DEV)
    with pytest.raises(ValueError, match="history length L = 1 < T = 2"):
        replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx)
    with pytest.raises(ValueError, match="prev_num_accepted dtype"):
        hist2 = ReplayHistory.allocate(S, 2, H, P, G, N, dtype=torch.float32, device=DEV)
        replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist2, pnat.long(), bufidx)


def test_launch_features_are_refused_clearly_where_missing(monkeypatch):
    """maxnreg out of range; a Triton without `maxnreg` / `launch_pdl`; PDL off in the interpreter."""
    S, H, P, N, G, T = 2, 2, 16, 16, 1, 2
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_inputs(1, T, H, P, G, N, torch.float32, seed=0)
    state = torch.zeros(S, H, P, N, device=DEV)
    slot_ids = torch.zeros(1, dtype=torch.int32, device=DEV)
    hist = ReplayHistory.allocate(S, T, H, P, G, N, dtype=torch.float32, device=DEV)
    pnat, bufidx = allocate_replay_slots(S, device=DEV)
    for bad in (8, 300, 80.0, True):
        with pytest.raises(ValueError, match=r"maxnreg must be an int in \[32, 255\]"):
            replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx, variant="mma",
                          maxnreg=bad)
    check = replay._check_launch_features
    assert replay._launch_options() == {"launch_pdl", "maxnreg"}  # Triton >= 3.6 (the H200 image's)
    monkeypatch.setattr(replay, "_launch_options", lambda: frozenset())
    with pytest.raises(ValueError, match="no `maxnreg` launch option"):
        replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx, variant="mma",
                      maxnreg=80)
    if DEV == "cpu":  # the interpreter runs the kernels one after the other: no PDL, no refusal
        assert check("mma_pre_pdl", None, torch.device("cpu"), "t") is False
    monkeypatch.setattr(replay, "interpreter_active", lambda: False)
    with pytest.raises(ValueError, match="needs programmatic dependent launch.*use variant='mma_pre'"):
        check("mma_pre_pdl", None, torch.device(DEV), "t")
    monkeypatch.setattr(replay, "_launch_options", lambda: frozenset({"launch_pdl", "maxnreg"}))
    assert check("mma_pre_pdl", 80, torch.device("cpu"), "t") is True
    assert check("mma_pre", 80, torch.device("cpu"), "t") is False


def test_bench_mamba2_dry_run_and_bad_arguments(capsys):
    """The H200 benchmark's dry run on tiny shapes (interpreter on the CPU) and its argument errors."""
    from benchmarks import bench_mamba2

    if DEV == "cpu":
        assert bench_mamba2.main(["--dry-run"]) == 0
        assert '"dry_run": "ok"' in capsys.readouterr().out
    for argv, says in ((["--state-dtypes", "int8"], "--state-dtypes"),
                       (["--flashinfer-checkpointing", "bf16"], "not among --state-dtypes")):
        with pytest.raises(SystemExit) as e:
            bench_mamba2.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
