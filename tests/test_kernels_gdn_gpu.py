"""GPU-only checks of the Gated DeltaNet verify kernels: the Qwen3-Next shape in bf16 compiled for real, and
CUDA-graph capture of the replay verify with poisoned metadata (TensorRT-LLM #15565: metadata read during
capture before it was filled).

Run on the device machine: python -m pytest tests/test_kernels_gdn_gpu.py -m gpu. Skips without CUDA.
Tolerances: bf16 outputs 1.6e-2 (two bf16 ulps, see tests/test_kernels_gdn.py); fp32 states and histories
1e-4 absolute / relative (state entries are O(1); kernel and reference differ only in fp32 summation order
over K = 128 and, in replay, the fast-forward's ieee tl.dot vs cuBLAS-free einsum).
"""

from __future__ import annotations

import pytest
import torch

from kernels.commit import (
    allocate_replay_slots,
    replay_advance,
    replay_advance_ref,
    rewind_commit,
    rewind_commit_ref,
)
from kernels.gdn import (
    ReplayHistory,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_ref,
    replay_verify,
    replay_verify_ref,
)
from kernels.gdn import replay as gdn_replay

pytestmark = pytest.mark.gpu

# Qwen3-Next GDN layer, MTP verify with 3 drafts.
B, T, H, HV, K, V = 64, 4, 16, 32, 128, 128
S = 80  # more slots than rows: some slots stay out of the batch and must stay untouched
POISON = 0x7BADBEEF
VARIANTS = tuple(gdn_replay.VARIANTS)  # every kernel variant of the replay verify


def _inputs(step, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(step)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    g = -r(HV).mul(0.5).exp() * torch.nn.functional.softplus(r(B, T, HV))
    beta = r(B, T, HV).sigmoid()
    return [x.cuda().to(dtype) for x in (q, k, v)] + [g.cuda(), beta.cuda().to(dtype)]


def _batch(step):
    """Shuffled distinct slots with 4 PAD rows; slot 0 always live; ragged num_accepted in [1, T]."""
    gen = torch.Generator().manual_seed(100 + step)
    slots = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(S - 1, generator=gen)[: B - 5],
                       torch.full((4,), -1)])
    slots = slots[torch.randperm(B, generator=gen)]
    n = torch.randint(1, T + 1, (B,), generator=gen)
    return slots.to(torch.int32).cuda(), n.to(torch.int32).cuda()


def _close(a, b, tol, msg):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=msg)


@pytest.mark.parametrize("variant", VARIANTS)
def test_qwen3_next_shape_bf16_rewind_and_replay_match_references(variant):
    state0 = torch.randn(S, HV, V, K, device="cuda") * 0.1
    st = {name: state0.clone() for name in ("rew_k", "rew_r", "rep_k", "rep_r")}
    hist = {name: ReplayHistory.allocate(S, T, H, HV, K, V, device="cuda") for name in ("k", "r")}
    meta = {name: allocate_replay_slots(S, device="cuda") for name in ("k", "r")}
    inter_k = torch.empty(B, T, HV, V, K, device="cuda")
    inter_r = torch.empty_like(inter_k)
    for step in range(3):
        q, k, v, g, beta = _inputs(step)
        slot_ids, n = _batch(step)
        o_k = fused_recurrent_gated_delta_rule(q, k, v, g, beta, st["rew_k"], slot_ids, update_state=False,
                                               intermediate_states=inter_k)
        o_r = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, st["rew_r"], slot_ids,
                                                   update_state=False, intermediate_states=inter_r)
        _close(o_k, o_r, 1.6e-2, f"rewind outputs, step {step}")
        rewind_commit(st["rew_k"], inter_k, slot_ids, n)
        rewind_commit_ref(st["rew_r"], inter_r, slot_ids, n)
        _close(st["rew_k"], st["rew_r"], 1e-4, f"rewind state, step {step}")

        p_k = replay_verify(q, k, v, g, beta, st["rep_k"], hist["k"], slot_ids, *meta["k"], variant=variant)
        p_r = replay_verify_ref(q, k, v, g, beta, st["rep_r"], hist["r"], slot_ids, *meta["r"])
        _close(p_k, p_r, 1.6e-2, f"replay outputs, step {step}")
        _close(p_k, o_k, 1.6e-2, f"replay vs rewind outputs, step {step}")
        _close(st["rep_k"], st["rep_r"], 1e-4, f"replay state, step {step}")
        for name in ("u", "k", "g"):
            _close(getattr(hist["k"], name), getattr(hist["r"], name), 1e-4, f"history.{name}, step {step}")
        replay_advance(*meta["k"], slot_ids, n, T)
        replay_advance_ref(*meta["r"], slot_ids, n, T)
        assert all(torch.equal(a, b) for a, b in zip(meta["k"], meta["r"]))


def test_decode_bf16_state_compiled():
    q, k, v, g, beta = (x[:, :1].contiguous() for x in _inputs(5))
    slot_ids, _ = _batch(5)
    state0 = (torch.randn(S, HV, V, K, device="cuda") * 0.1).to(torch.bfloat16)
    st_k, st_r = state0.clone(), state0.clone()
    o_k = fused_recurrent_gated_delta_rule(q, k, v, g, beta, st_k, slot_ids)
    o_r = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, st_r, slot_ids)
    _close(o_k, o_r, 1.6e-2, "decode outputs")
    _close(st_k, st_r, 1.6e-2, "bf16 state")


@pytest.mark.parametrize("variant", VARIANTS)
def test_replay_cuda_graph_with_poisoned_metadata_matches_eager_bitwise(variant):
    """Capture verify + bookkeeping while pnat / buf_idx hold 0x7BADBEEF and the history NaN, replay it once
    before the first fill (clamping must keep it in bounds), then fill and compare every step bitwise with
    eager calls."""
    state0 = torch.randn(S, HV, V, K, device="cuda") * 0.1
    nan_hist = lambda: ReplayHistory(*(t.fill_(float("nan")) for t in vars(
        ReplayHistory.allocate(S, T, H, HV, K, V, device="cuda")).values()))
    # Eager side: correctly zero-initialised metadata.
    st_e, hist_e, (pnat_e, buf_e) = state0.clone(), nan_hist(), allocate_replay_slots(S, device="cuda")
    # Graph side: torch.empty metadata filled with garbage before capture.
    st_g, hist_g = torch.empty_like(state0).fill_(float("nan")), nan_hist()
    pnat_g = torch.empty(S, dtype=torch.int32, device="cuda").fill_(POISON)
    buf_g = torch.empty(S, dtype=torch.int32, device="cuda").fill_(POISON)
    static = [torch.empty_like(x) for x in _inputs(0)]
    slot_s = torch.full((B,), -1, dtype=torch.int32, device="cuda")
    n_s = torch.empty(B, dtype=torch.int32, device="cuda").fill_(POISON)
    out_g = torch.full((B, T, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")

    # Compile outside capture on scratch buffers of the same shapes and dtypes.
    scratch = (torch.zeros_like(state0), ReplayHistory.allocate(S, T, H, HV, K, V, device="cuda"),
               *allocate_replay_slots(S, device="cuda"))
    replay_verify(*_inputs(0), scratch[0], scratch[1], _batch(0)[0], scratch[2], scratch[3],
                  out=torch.empty_like(out_g), variant=variant)
    replay_advance(scratch[2], scratch[3], *_batch(0), T)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay_verify(*static, st_g, hist_g, slot_s, pnat_g, buf_g, out=out_g, variant=variant)
        replay_advance(pnat_g, buf_g, slot_s, n_s, T)
    slot_s.copy_(_batch(0)[0])
    graph.replay()  # before the first fill: garbage metadata must neither fault nor index out of range
    torch.cuda.synchronize()

    pnat_g.zero_()
    buf_g.zero_()
    st_g.copy_(state0)
    for t in vars(hist_g).values():
        t.fill_(float("nan"))
    for step in range(4):
        inputs = _inputs(step)
        slot_ids, n = _batch(step)
        for s, x in zip(static, inputs):
            s.copy_(x)
        slot_s.copy_(slot_ids)
        n_s.copy_(n)
        graph.replay()
        o_e = replay_verify(*inputs, st_e, hist_e, slot_ids, pnat_e, buf_e, variant=variant)
        replay_advance(pnat_e, buf_e, slot_ids, n, T)
        torch.cuda.synchronize()
        assert torch.equal(out_g, o_e), f"outputs differ from eager at step {step}"
        assert torch.equal(st_g, st_e), f"state differs from eager at step {step}"
        assert torch.equal(pnat_g, pnat_e) and torch.equal(buf_g, buf_e), f"metadata differs at step {step}"
        for name in ("u", "k", "g"):
            a, b = getattr(hist_g, name), getattr(hist_e, name)
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"history.{name} differs, step {step}"
