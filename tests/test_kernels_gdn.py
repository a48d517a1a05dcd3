"""Gated DeltaNet verify kernels (rewind and replay) against their PyTorch references.

On a machine without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1 is set here, before
anything imports triton) on tiny awkward shapes: K != V (K = 32, V = 48, so a transposed state cannot pass),
HV = 2H, PAD rows, slot 0 live, strided cache views, NaN-filled outputs. On a CUDA machine the same tests run
compiled on the GPU (tests/test_kernels_gdn_gpu.py holds the Qwen3-Next-shape and CUDA-graph checks).

Tolerances (atol = rtol) per input dtype, kernel vs reference (measured maxima in brackets, interpreter):
  float32  2e-5: both compute in fp32 and differ only in the order of the K- and V-reductions and, in
           replay, the fast-forward's tl.dot vs einsum [outputs 3e-8, states 1.2e-7, history 2.4e-7].
  float16  2e-3: outputs rounded to fp16 (ulp 2^-10 ~ 1e-3 relative) from fp32 values that agree to ~1e-7,
           so at most one ulp apart [4.8e-7]; states and history stay fp32 and use 10x the fp32 tolerance.
  bfloat16 1.6e-2: as fp16 with bf16's ulp (2^-7 = 7.8e-3 relative), two ulps [9.8e-4 = one ulp at 0.25].
A 16-bit *state* or history (rounded on every store) is checked with the bf16 tolerance: kernel and reference
round the same fp32 value, so they differ by at most one ulp per store.
The long-run test compares replay, rewind and one-token-at-a-time decoding (all fp32) with 2e-5: the decay
(g < 0) keeps the state bounded, so errors do not compound [1.2e-7 after 400 steps of the references].
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402
from replay_oracles import gdn_replay_verify_oracle  # noqa: E402

from kernels.commit import (  # noqa: E402
    allocate_replay_slots,
    replay_advance,
    replay_advance_ref,
    rewind_commit,
    rewind_commit_ref,
)
from kernels.gdn import (  # noqa: E402
    ReplayHistory,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_ref,
    replay_verify,
    replay_verify_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Kernel variants of the replay verify (kernels.gdn.replay.VARIANTS), held to the same tolerances: "mma" with
# 2 bf16 pieces per fp32 operand (kernels/_mma.py) measured <= 8e-6 on the fp32 outputs here.
VARIANTS = ("fma", "mma")
# Small awkward shape: K != V, HV = 2H, 6 slots of which the batch uses a few.
B, H, HV, K, V, S = 4, 2, 4, 32, 48, 6


def make_inputs(B, T, H, HV, K, V, dtype=torch.float32, device=DEVICE, seed=0):
    """Random GDN step inputs; g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) as in Qwen3-Next."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    a, b, A_log, dt_bias = r(B, T, HV), r(B, T, HV), r(HV) * 0.5, r(HV) * 0.5
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = b.sigmoid()
    q, k, v, beta = (x.to(device=device, dtype=dtype) for x in (q, k, v, beta))
    return [q, k, v, g.to(device), beta]  # g (log decay) stays fp32, as the model computes it


def layer_stacked(t: torch.Tensor, layer: int = 1, num_layers: int = 3) -> torch.Tensor:
    """A strided view of t inside a (num_layers, *t.shape) allocation, filled with the same values."""
    big = torch.full((num_layers, *t.shape), float("nan"), dtype=t.dtype, device=t.device)
    big[layer] = t
    return big[layer]


def slot_major_view(t: torch.Tensor) -> torch.Tensor:
    """A view of t (S, ...) whose slot stride is doubled: (S, 2, ...)[:, 0], as in an interleaved cache."""
    big = torch.full((t.shape[0], 2, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
    big[:, 0] = t
    return big[:, 0]


def assert_close(a, b, tol, msg=""):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, equal_nan=False, msg=msg or None)


# --------------------------------------------------------------------------------------------------- rewind


# T = 1..8 and every input dtype are covered without the full cross product (interpreter time).
@pytest.mark.parametrize(
    ("T", "dtype"), [(1, torch.float32), (3, torch.float16), (5, torch.float32), (8, torch.bfloat16)]
)
def test_recurrent_verify_and_commit_match_reference(T, dtype):
    q, k, v, g, beta = make_inputs(B, T, H, HV, K, V, dtype)
    slot_ids = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=DEVICE)  # PAD row, slot 0 live
    state0 = torch.randn(S, HV, V, K, device=DEVICE) * 0.3
    st_k, st_r = layer_stacked(state0.clone()), state0.clone()
    inter_r = torch.full((B, T, HV, V, K), float("nan"), device=DEVICE)
    inter_k = layer_stacked(inter_r.clone())  # a strided view, NaN until written
    out = torch.full((B, T, HV, V), float("nan"), dtype=dtype, device=DEVICE)

    # block_v = 16 tiles V = 48 in three programs; 64 covers it in one masked tile.
    o_k = fused_recurrent_gated_delta_rule(q, k, v, g, beta, st_k, slot_ids, update_state=False,
                                           intermediate_states=inter_k, out=out, block_v=16 if T < 4 else 64)
    o_r = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, st_r, slot_ids, update_state=False,
                                               intermediate_states=inter_r)
    assert o_k is out and not out.isnan().any(), "an output element was not written"
    assert (out[1] == 0).all(), "PAD row outputs must be zero"
    assert_close(o_k, o_r, TOL[dtype])
    assert torch.equal(st_k, state0), "verify with update_state=False must not touch the stored state"
    assert inter_k[1].isnan().all(), "PAD row must leave its intermediate states untouched"
    live = [0, 2, 3]
    assert_close(inter_k[live], inter_r[live], TOL[torch.float32] * 10)

    # Commit: ragged acceptance, plus stale values (0 = accept nothing, > T clamped) on the PAD row.
    num_accepted = torch.tensor([T, 7, 1, max(T - 1, 1)], dtype=torch.int32, device=DEVICE)
    rewind_commit(st_k, inter_k, slot_ids, num_accepted)
    rewind_commit_ref(st_r, inter_r, slot_ids, num_accepted)
    assert_close(st_k, st_r, TOL[torch.float32] * 10)
    untouched = [1, 2, 4]
    assert torch.equal(st_k[untouched], state0[untouched]), "only the live rows' slots may change"
    for b, n in ((0, T), (2, 1), (3, max(T - 1, 1))):
        assert torch.equal(st_k[int(slot_ids[b])], inter_k[b, n - 1])


def test_rewind_commit_clamps_bad_num_accepted():
    T = 3
    inter = torch.randn(3, T, HV, V, K, device=DEVICE)
    state0 = torch.randn(S, HV, V, K, device=DEVICE)
    st = slot_major_view(state0.clone())
    slot_ids = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    num_accepted = torch.tensor([0, -5, 99], dtype=torch.int32, device=DEVICE)
    rewind_commit(st, inter, slot_ids, num_accepted)
    assert torch.equal(st[:2], state0[:2]), "num_accepted <= 0 accepts nothing"
    assert torch.equal(st[2], inter[2, T - 1]), "num_accepted > T is clamped to T"


def test_rewind_buffer_indexed_by_slot():
    """The engine's layout: one rewind-buffer row per slot (intermediate_state_indices = the slot ids, int64,
    PAD -1), written by the verify and read by the commit; PAD rows and slots outside the batch keep NaN."""
    T = 3
    q, k, v, g, beta = make_inputs(B, T, H, HV, K, V, seed=4)
    slot_ids = torch.tensor([3, -1, 0, 5], dtype=torch.int64, device=DEVICE)
    num_accepted = torch.tensor([2, 3, 3, 1], dtype=torch.int64, device=DEVICE)
    state0 = torch.randn(S, HV, V, K, device=DEVICE) * 0.3
    by_row = torch.full((B, T, HV, V, K), float("nan"), device=DEVICE)
    fused_recurrent_gated_delta_rule(q, k, v, g, beta, state0.clone(), slot_ids, update_state=False,
                                     intermediate_states=by_row)
    res = []
    for rule, commit in ((fused_recurrent_gated_delta_rule, rewind_commit),
                         (fused_recurrent_gated_delta_rule_ref, rewind_commit_ref)):
        st, inter = state0.clone(), torch.full((S, T, HV, V, K), float("nan"), device=DEVICE)
        rule(q, k, v, g, beta, st, slot_ids, update_state=False, intermediate_states=inter,
             intermediate_state_indices=slot_ids)
        assert torch.equal(st, state0), "rewind verify must not touch the stored state"
        commit(st, inter, slot_ids, num_accepted, intermediate_state_indices=slot_ids)
        res.append((st, inter))
    (st_k, inter_k), (st_r, inter_r) = res
    live = [3, 0, 5]
    assert_close(inter_k[live], inter_r[live], TOL[torch.float32] * 10)
    for b, slot in ((0, 3), (2, 0), (3, 5)):
        assert torch.equal(inter_k[slot], by_row[b]), f"row {b} must go to slot {slot}"
    assert inter_k[[1, 2, 4]].isnan().all(), "a PAD row or a slot outside the batch was written"
    assert_close(st_k, st_r, TOL[torch.float32] * 10)
    assert torch.equal(st_k[3], inter_k[3, 1]) and torch.equal(st_k[0], inter_k[0, 2])
    assert torch.equal(st_k[5], inter_k[5, 0]) and torch.equal(st_k[[1, 2, 4]], state0[[1, 2, 4]])


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_recurrent_decode_16bit_state(state_dtype):
    q, k, v, g, beta = make_inputs(B, 1, H, HV, K, V, torch.float32, seed=1)
    slot_ids = torch.tensor([0, 2, -1, 4], dtype=torch.int32, device=DEVICE)
    state0 = (torch.randn(S, HV, V, K, device=DEVICE) * 0.3).to(state_dtype)
    st_k, st_r = state0.clone(), state0.clone()
    o_k = fused_recurrent_gated_delta_rule(q, k, v, g, beta, st_k, slot_ids)
    o_r = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, st_r, slot_ids)
    assert_close(o_k, o_r, TOL[torch.float32])
    assert_close(st_k, st_r, TOL[torch.bfloat16])
    assert torch.equal(st_k[[1, 3, 5]], state0[[1, 3, 5]])


def test_transposed_state_and_bad_shapes_are_rejected():
    q, k, v, g, beta = make_inputs(2, 2, H, HV, K, V)
    slot_ids = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="transposed"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, torch.zeros(S, HV, K, V, device=DEVICE), slot_ids)
    hist = ReplayHistory.allocate(S, 2, H, HV, K, V, device=DEVICE)
    pnat, buf = allocate_replay_slots(S, device=DEVICE)
    transposed = torch.zeros(S, HV, K, V, device=DEVICE)
    with pytest.raises(ValueError, match="transposed"):
        replay_verify(q, k, v, g, beta, transposed, hist, slot_ids, pnat, buf)
    with pytest.raises(ValueError, match="K\\) dimension contiguous"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, torch.zeros(S, HV, K, V, device=DEVICE).mT,
                                         slot_ids)
    with pytest.raises(ValueError, match="slot_ids"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, torch.zeros(S, HV, V, K, device=DEVICE),
                                         slot_ids.float())
    with pytest.raises(ValueError, match="history length"):
        small = ReplayHistory.allocate(S, 1, H, HV, K, V, device=DEVICE)
        good = torch.zeros(S, HV, V, K, device=DEVICE)
        replay_verify(q, k, v, g, beta, good, small, slot_ids, pnat, buf)


# --------------------------------------------------------------------------------------------------- replay


def _poisoned_history(TH, dtype=torch.float32, device=DEVICE):
    """History as torch.empty would leave it, made loud: NaN everywhere."""
    hist = ReplayHistory.allocate(S, TH, H, HV, K, V, device=device, dtype=dtype)
    for t in (hist.u, hist.k, hist.g):
        t.fill_(float("nan"))
    return hist


def _strided_history(hist: ReplayHistory) -> ReplayHistory:
    return ReplayHistory(u=layer_stacked(hist.u.clone()), k=layer_stacked(hist.k.clone()),
                            g=slot_major_view(hist.g.clone()))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("T", "dtype", "cache_dtype"),
    [(1, torch.float32, torch.float32), (2, torch.float16, torch.float32), (4, torch.bfloat16, torch.float32),
     (7, torch.float32, torch.float32), (3, torch.float32, torch.bfloat16)],
)
def test_replay_verify_matches_reference(T, dtype, cache_dtype, variant):
    """Two steps: the first from empty history (pnat = 0), the second with ragged pnat covering 0..T.
    cache_dtype is the dtype of the state and of the history's u and k (fp32 recommended)."""
    state0 = (torch.randn(S, HV, V, K, device=DEVICE) * 0.3).to(cache_dtype)
    st_k, st_r, st_o = layer_stacked(state0.clone()), state0.clone(), state0.clone()
    hist_k, hist_r = _strided_history(_poisoned_history(T, cache_dtype)), _poisoned_history(T, cache_dtype)
    hist_o = _poisoned_history(T, cache_dtype)  # the token-by-token oracle (tests/replay_oracles.py)
    cache_tol = TOL[torch.float32] * 10 if cache_dtype == torch.float32 else TOL[cache_dtype]
    pnat_k, buf_k = allocate_replay_slots(S, device=DEVICE)
    pnat_r, buf_r = allocate_replay_slots(S, device=DEVICE)
    pnat_o, buf_o = allocate_replay_slots(S, device=DEVICE)
    slot_ids = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=DEVICE)
    live_slots = [3, 0, 5]
    # Ragged acceptance: 0 (nothing), T (all), and something in between; the PAD row's value is garbage.
    num_accepted = torch.tensor([0, 12345, T, (T + 1) // 2], dtype=torch.int32, device=DEVICE)

    for step in range(2):
        q, k, v, g, beta = make_inputs(B, T, H, HV, K, V, dtype, seed=10 + step)
        before = [t.clone() for t in (st_k, hist_k.u, hist_k.k, hist_k.g)]
        read_buf = buf_k.clone()
        out = torch.full((B, T, HV, V), float("nan"), dtype=dtype, device=DEVICE)
        o_k = replay_verify(q, k, v, g, beta, st_k, hist_k, slot_ids, pnat_k, buf_k, out=out,
                            block_v=32 if T < 4 else 64, variant=variant, chunk_k=16)
        o_r = replay_verify_ref(q, k, v, g, beta, st_r, hist_r, slot_ids, pnat_r, buf_r)
        o_o = gdn_replay_verify_oracle(q, k, v, g, beta, st_o, hist_o, slot_ids, pnat_o, buf_o)
        out_tol = max(TOL[dtype], TOL[cache_dtype])
        assert_close(o_r, o_o, out_tol, msg=f"reference vs oracle: outputs, step {step}")
        assert_close(st_r, st_o, cache_tol, msg=f"reference vs oracle: state, step {step}")
        for name in ("u", "k", "g"):
            h_r, h_o = getattr(hist_r, name).nan_to_num(7.0), getattr(hist_o, name).nan_to_num(7.0)
            assert_close(h_r, h_o, cache_tol, msg=f"reference vs oracle: history.{name}, step {step}")
        assert not out.isnan().any() and (out[1] == 0).all()
        # A 16-bit history can round one u entry differently (values 1e-7 apart): outputs inherit its ulp.
        assert_close(o_k, o_r, max(TOL[dtype], TOL[cache_dtype]), msg=f"outputs, step {step}")
        assert_close(st_k, st_r, cache_tol, msg=f"fast-forwarded state, step {step}")
        for name in ("u", "k", "g"):
            a, r = getattr(hist_k, name), getattr(hist_r, name)
            for slot in live_slots:
                w = 1 - int(read_buf[slot])
                assert_close(a[slot, w, :T], r[slot, w, :T], cache_tol,
                             msg=f"history.{name} slot {slot} step {step}")
        # Untouched: slots not in the batch (1 via PAD, 2, 4), the read buffer of live slots, pnat / buf_idx.
        for t_now, t_before in zip((st_k, hist_k.u, hist_k.k, hist_k.g), before):
            assert torch.equal(t_now[[1, 2, 4]].nan_to_num(7.0), t_before[[1, 2, 4]].nan_to_num(7.0))
        for name, t_before in zip(("u", "k", "g"), before[1:]):
            t_now = getattr(hist_k, name)
            for slot in live_slots:
                rb = int(read_buf[slot])
                assert torch.equal(t_now[slot, rb].nan_to_num(7.0), t_before[slot, rb].nan_to_num(7.0)), (
                    f"history.{name}: the buffer being read (slot {slot}) must not be written"
                )
        assert torch.equal(buf_k, read_buf), "the verify must not change the metadata"

        replay_advance(pnat_k, buf_k, slot_ids, num_accepted, T)
        replay_advance_ref(pnat_r, buf_r, slot_ids, num_accepted, T)
        replay_advance_ref(pnat_o, buf_o, slot_ids, num_accepted, T)
        assert torch.equal(pnat_k, pnat_r) and torch.equal(buf_k, buf_r)
        assert pnat_k[live_slots].tolist() == [min(max(int(num_accepted[b]), 0), T) for b in (0, 2, 3)]
        assert (pnat_k[[1, 2, 4]] == 0).all() and (buf_k[[1, 2, 4]] == 0).all(), "PAD must never advance"
        num_accepted = torch.tensor([T, 0, (T + 1) // 2, 1], dtype=torch.int32, device=DEVICE)


def test_replay_commit_clamps_and_skips_pad():
    pnat, buf = allocate_replay_slots(S, device=DEVICE)
    buf[4] = 1
    slot_ids = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device=DEVICE)
    num_accepted = torch.tensor([-3, 5, 99, 2], dtype=torch.int32, device=DEVICE)
    replay_advance(pnat, buf, slot_ids, num_accepted, 4)
    assert pnat.tolist() == [4, 0, 2, 0, 0, 0]
    assert buf.tolist() == [1, 0, 1, 0, 0, 0]


# --------------------------------------------------------------------------------------------------- long run


KERNELS = (replay_verify, replay_advance, fused_recurrent_gated_delta_rule, rewind_commit)
REFERENCES = (replay_verify_ref, replay_advance_ref, fused_recurrent_gated_delta_rule_ref,
              rewind_commit_ref)


# The interpreter runs about 0.2 s per kernel launch here, so on the CPU the kernels get 15 steps (every slot
# joins, leaves and is reordered several times, a PAD row each step) and the references (the same algorithms
# in PyTorch) carry the hundreds-of-steps drift check; on a GPU the kernels run 400 steps.
@pytest.mark.parametrize(
    ("impl", "steps"),
    [pytest.param(KERNELS, 400 if DEVICE == "cuda" else 15, id="kernels"),
     pytest.param(REFERENCES, 400, id="references")],
)
def test_long_run_replay_rewind_and_sequential_agree(impl, steps):
    _long_run(impl, steps, variant=None)


def test_long_run_mma_variant():
    _long_run(KERNELS, 400 if DEVICE == "cuda" else 12, variant="mma")


def _long_run(impl, steps, variant):
    """Many verify steps with random acceptance, batch reordering, slots joining and leaving and a PAD row:
    replay, rewind and decoding only the accepted tokens one at a time (PyTorch reference) stay together."""
    replay_verify, replay_commit, recurrent, rewind_commit = impl
    T, nb = 3, 3
    Hs, HVs, Ks, Vs, Ss = 1, 2, 16, 24, 4
    gen = torch.Generator().manual_seed(0)
    state0 = torch.randn(Ss, HVs, Vs, Ks, generator=gen).to(DEVICE) * 0.3
    st_replay, st_rewind, st_seq = state0.clone(), state0.clone(), state0.clone()
    hist = ReplayHistory.allocate(Ss, T, Hs, HVs, Ks, Vs, device=DEVICE)
    pnat, buf = allocate_replay_slots(Ss, device=DEVICE)
    inter = torch.empty(nb, T, HVs, Vs, Ks, device=DEVICE)
    max_err = 0.0
    for step in range(steps):
        slots = torch.randperm(Ss, generator=gen)[: nb - 1].tolist() + [-1]
        order = torch.randperm(nb, generator=gen).tolist()
        slot_ids = torch.tensor([slots[i] for i in order], dtype=torch.int32, device=DEVICE)
        q, k, v, g, beta = make_inputs(nb, T, Hs, HVs, Ks, Vs, seed=1000 + step)
        n = torch.randint(1, T + 1, (nb,), generator=gen, dtype=torch.int32).to(DEVICE)

        o_rep = replay_verify(q, k, v, g, beta, st_replay, hist, slot_ids, pnat, buf,
                              **({"variant": variant} if variant else {}))
        replay_commit(pnat, buf, slot_ids, n, T)
        o_rew = recurrent(q, k, v, g, beta, st_rewind, slot_ids, update_state=False,
                          intermediate_states=inter)
        rewind_commit(st_rewind, inter, slot_ids, n)
        for b in range(nb):
            slot = int(slot_ids[b])
            if slot < 0:
                continue
            for t in range(int(n[b])):  # one token at a time, only the accepted ones
                tok = [x[b : b + 1, t : t + 1] for x in (q, k, v, g, beta)]
                o_seq = fused_recurrent_gated_delta_rule_ref(*tok, st_seq, slot_ids[b : b + 1])
                max_err = max(max_err, (o_seq[0, 0] - o_rep[b, t]).abs().max().item(),
                              (o_seq[0, 0] - o_rew[b, t]).abs().max().item())
    # Flush the replay's pending accepted tokens into the states: one more verify whose token is a no-op
    # (g = 0 keeps the state, beta = 0 writes nothing).
    q, k, v, g, beta = make_inputs(Ss, 1, Hs, HVs, Ks, Vs, seed=7)
    g, beta = torch.zeros_like(g), torch.zeros_like(beta)
    replay_verify(q, k, v, g, beta, st_replay, hist, torch.arange(Ss, dtype=torch.int32, device=DEVICE),
                  pnat, buf)
    assert max_err < 2e-5, f"outputs drifted apart: {max_err}"
    assert_close(st_rewind, st_seq, 2e-5)
    assert_close(st_replay, st_seq, 2e-5)
    assert not torch.allclose(st_seq, state0, atol=1e-2), "the run must actually have moved the states"


def test_bench_script_runs(tmp_path):
    """The H200 benchmark script end to end on tiny shapes (interpreter on the CPU; times are not checked)."""
    import json

    from benchmarks import bench_gdn

    out = tmp_path / "bench.json"
    tiny = "--batch 2 --T 2 --H 1 --HV 2 --K 16 --V 16 --slots 3".split()
    res = bench_gdn.main(["--device", DEVICE, *tiny, "--out", str(out)])
    assert json.loads(out.read_text()) == res
    mem = res["memory_per_layer_bytes"]
    assert mem["rewind_intermediate_states"] == 2 * 2 * 2 * 16 * 16 * 4  # B T HV V K, fp32
    # S, 2 buffers, T, (HV V + H K + HV) fp32 values
    assert mem["replay_history"] == 3 * 2 * 2 * (2 * 16 + 1 * 16 + 2) * 4
    for name in ("decode_T1_inplace", "rewind_verify", "rewind_commit", "replay_verify_pnat_T"):
        assert res[name]["us"] > 0 and res[name]["block_v"] in (8, 16, 32, 64)


@pytest.mark.parametrize("argv, says", [
    (["--T", "0"], "--T 0: sizes must be >= 1"),
    (["--H", "3", "--HV", "4"], "must be a multiple of --H 3"),
    (["--slots", "1", "--batch", "2"], "every row needs its own cache slot"),
])
def test_bench_script_refuses_bad_sizes(argv, says, capsys):
    from benchmarks import bench_gdn

    with pytest.raises(SystemExit) as e:
        bench_gdn.main(["--device", DEVICE, *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err
