"""Gated DeltaNet fused recurrent step over T tokens, and the rewind commit of an MTP verify.

Scope: the recurrent (decode / verify) path of a Qwen3-Next Gated DeltaNet layer on a slot-indexed state
cache. Each op has a Triton kernel, its launcher and a plain-PyTorch reference with the same signature.

Recurrence (Yang et al., "Gated Delta Networks", 2024; as in flash-linear-attention's
fused_recurrent_gated_delta_rule and HF Qwen3-Next), per slot and value head, state S of shape [V, K]:

    alpha_t = exp(g_t)                      g_t <= 0 is the log decay, computed by the caller:
                                            g = -exp(A_log) * softplus(a + dt_bias)
    u_t     = beta_t (v_t - alpha_t S_{t-1} k_t)          beta = sigmoid(b), computed by the caller
    S_t     = alpha_t S_{t-1} + u_t k_t^T    (= alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T)
    o_t     = S_t q_t

q and k are L2-normalised inside the kernel when use_qk_l2norm_in_kernel=True (the default; eps 1e-6), and
q is then multiplied by scale (default K ** -0.5). The key head of value head hv is hv // (HV // H).

Rewind (the baseline commit scheme): the verify runs T tokens from the stored state without changing it and
writes every intermediate state to a per-row buffer (B, T, HV, V, K); after acceptance gdn_rewind_commit
copies the state after the num_accepted-th token back into the slot.

Interpreter note: these kernels use no tl.dot, so bf16 inputs are exact under TRITON_INTERPRET=1 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._gdn_common import L2NORM_EPS, check_gdn_inputs, check_state, key_head_dims, l2norm


@triton.jit
def _fused_recurrent_gdn_kernel(
    q, k, v, g, beta, o, state, slot_ids, inter,
    scale,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_i_b, stride_i_t, stride_i_h, stride_i_v,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, STORE_INTERMEDIATE: tl.constexpr, UPDATE_STATE: tl.constexpr,
):
    # One program per (V tile, batch row, value head): the rows of S are independent in this recurrence.
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)

    slot = tl.load(slot_ids + i_b).to(tl.int64)
    live = slot >= 0  # PAD rows read and write no cache entry; their outputs are zero
    slot = tl.maximum(slot, 0)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    # The live predicate folded into a block mask (a scalar-bool & block mask trips the interpreter).
    m_sl = (o_v[:, None] < tl.where(live, V, 0)) & m_k[None, :]

    p_s = state + slot * stride_s_slot + i_hv * stride_s_h + o_v[:, None] * stride_s_v + o_k[None, :]
    b_s = tl.load(p_s, mask=m_sl, other=0.0).to(tl.float32)

    for t in range(T):
        i_tok = (i_b * T + t).to(tl.int64)
        b_q = tl.load(q + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + i_tok * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + i_tok * HV + i_hv).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale

        b_s = b_s * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], axis=1))
        b_s = b_s + b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * b_q[None, :], axis=1)
        b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (i_tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_INTERMEDIATE:
            p_i = (inter + i_b.to(tl.int64) * stride_i_b + t * stride_i_t + i_hv * stride_i_h
                   + o_v[:, None] * stride_i_v + o_k[None, :])
            tl.store(p_i, b_s.to(p_i.dtype.element_ty), mask=m_sl)

    if UPDATE_STATE:
        tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_sl)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    update_state: bool = True,
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_v: int = 16,
) -> torch.Tensor:
    """Run T recurrent gated delta rule steps per row from the slot's state (decode and rewind verify).

    Args:
        q, k: (B, T, H, K) bf16 / fp16 / fp32 queries and keys (raw when use_qk_l2norm_in_kernel).
        v: (B, T, HV, V) values, HV a multiple of H.
        g: (B, T, HV) log decay (<= 0), fp32 recommended; alpha = exp(g).
        beta: (B, T, HV) write strength in [0, 1] (already sigmoid-ed).
        state: (S, HV, V, K) fp32 (or bf16 / fp16) cache, K contiguous; any slot / head / row strides
            (e.g. a per-layer view of a bigger cache). Mutated in place iff update_state.
        slot_ids: (B,) int32 slot of each row; PAD = -1 reads and writes no cache entry (its output rows are
            zero); slot 0 is a live slot. Live rows must have distinct slots.
        scale: multiplier of q after normalisation; default K ** -0.5.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head inside the kernel (eps 1e-6).
        update_state: write the state after the T-th token back to state[slot] (decode: T = 1, True;
            rewind verify: False).
        intermediate_states: optional (B, T, HV, V, K) buffer (any float dtype, V / K strides free, K
            contiguous) receiving the state after each token of each live row (rewind verify); PAD rows
            leave it untouched.
        out: optional (B, T, HV, V) output tensor (default: a new one of v's dtype).
        block_v: rows of S per program (power of two); no autotune because the kernel updates in place.

    Returns:
        o: (B, T, HV, V) in out's dtype (v's dtype by default).

    Raises:
        ValueError on inconsistent shapes, a transposed (S, HV, K, V) state, or a bad buffer.

    Example:
        >>> o = fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, slot_ids)  # T = 1 decode
    """
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta, slot_ids)
    check_state(state, HV, V, K)
    if intermediate_states is not None:
        if tuple(intermediate_states.shape) != (B, T, HV, V, K) or intermediate_states.stride(-1) != 1:
            raise ValueError(
                f"intermediate_states must be (B={B}, T={T}, HV={HV}, V={V}, K={K}) with K contiguous; got "
                f"{tuple(intermediate_states.shape)} strides {intermediate_states.stride()}"
            )
    out = _check_out(out, v)
    scale = K**-0.5 if scale is None else scale
    BK, BV = key_head_dims(K, V, block_v)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    inter = intermediate_states if intermediate_states is not None else state  # dummy pointer when unused
    si = inter.stride() if intermediate_states is not None else (0, 0, 0, 0, 1)
    grid = (triton.cdiv(V, BV), B * HV)
    _fused_recurrent_gdn_kernel[grid](
        q, k, v, g, beta, out, state, slot_ids, inter,
        scale,
        state.stride(0), state.stride(1), state.stride(2),
        si[0], si[1], si[2], si[3],
        T=T, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel,
        STORE_INTERMEDIATE=intermediate_states is not None,
        UPDATE_STATE=update_state,
        num_warps=1 if BV * BK <= 2048 else 4,
    )
    return out


def fused_recurrent_gated_delta_rule_ref(
    q, k, v, g, beta, state, slot_ids, *, scale=None, use_qk_l2norm_in_kernel=True, update_state=True,
    intermediate_states=None, out=None, block_v=16,
):
    """Plain-PyTorch reference of fused_recurrent_gated_delta_rule (same signature, same mutations)."""
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta, slot_ids)
    check_state(state, HV, V, K)
    out = _check_out(out, v)
    scale = K**-0.5 if scale is None else scale
    r = HV // H
    qf = (l2norm(q) if use_qk_l2norm_in_kernel else q.float()).repeat_interleave(r, dim=2) * scale
    kf = (l2norm(k) if use_qk_l2norm_in_kernel else k.float()).repeat_interleave(r, dim=2)
    for b in range(B):
        slot = int(slot_ids[b])
        if slot < 0:
            out[b] = 0
            continue
        s = state[slot].float()  # (HV, V, K)
        for t in range(T):
            s = s * g[b, t].float().exp()[:, None, None]
            u = beta[b, t].float()[:, None] * (v[b, t].float() - torch.einsum("hvk,hk->hv", s, kf[b, t]))
            s = s + u[:, :, None] * kf[b, t][:, None, :]
            out[b, t] = torch.einsum("hvk,hk->hv", s, qf[b, t]).to(out.dtype)
            if intermediate_states is not None:
                intermediate_states[b, t] = s.to(intermediate_states.dtype)
        if update_state:
            state[slot] = s.to(state.dtype)
    return out


@triton.jit
def _rewind_commit_kernel(
    state, inter, slot_ids, num_accepted,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_i_b, stride_i_t, stride_i_h, stride_i_v,
    T: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    n = tl.load(num_accepted + i_b)
    # Same predicate as gdn_replay_commit: live row, at least one token accepted; n > T is clamped to T.
    commit = (slot >= 0) & (n >= 1)
    n = tl.minimum(tl.maximum(n, 1), T)
    slot = tl.maximum(slot, 0)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m = (o_v[:, None] < tl.where(commit, V, 0)) & (o_k[None, :] < K)
    p_i = (inter + i_b.to(tl.int64) * stride_i_b + (n - 1) * stride_i_t + i_hv * stride_i_h
           + o_v[:, None] * stride_i_v + o_k[None, :])
    b_s = tl.load(p_i, mask=m, other=0.0)
    p_s = state + slot * stride_s_slot + i_hv * stride_s_h + o_v[:, None] * stride_s_v + o_k[None, :]
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m)


def gdn_rewind_commit(
    state: torch.Tensor,
    intermediate_states: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    block_v: int = 32,
) -> None:
    """Commit a rewind verify: state[slot_ids[b]] = intermediate_states[b, num_accepted[b] - 1].

    Args:
        state: (S, HV, V, K) cache, K contiguous; mutated in place.
        intermediate_states: (B, T, HV, V, K) written by fused_recurrent_gated_delta_rule for the same rows.
        slot_ids: (B,) int32; PAD = -1 rows write nothing.
        num_accepted: (B,) int32 num_accepted_tokens in [1, T] (last accepted token + bonus count as in BRIEF 3).
            A value <= 0 (padding, stale row) commits nothing, i.e. accepts no token; a value > T is clamped
            to T. Never indexes out of range; safe under CUDA-graph capture with garbage metadata.

    Raises:
        ValueError on shape mismatches.
    """
    B, T = intermediate_states.shape[:2]
    HV, V, K = intermediate_states.shape[2:]
    check_state(state, HV, V, K)
    if intermediate_states.stride(-1) != 1:
        raise ValueError("intermediate_states must have its last (K) dimension contiguous")
    for name, t in (("slot_ids", slot_ids), ("num_accepted", num_accepted)):
        if t.shape != (B,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be (B={B},) int32; got {tuple(t.shape)} {t.dtype}")
    BK, BV = key_head_dims(K, V, block_v)
    si = intermediate_states.stride()
    _rewind_commit_kernel[(triton.cdiv(V, BV), B * HV)](
        state, intermediate_states, slot_ids, num_accepted,
        state.stride(0), state.stride(1), state.stride(2),
        si[0], si[1], si[2], si[3],
        T=T, HV=HV, K=K, V=V, BK=BK, BV=BV,
        num_warps=4,
    )


def gdn_rewind_commit_ref(state, intermediate_states, slot_ids, num_accepted, *, block_v=32):
    """Plain-PyTorch reference of gdn_rewind_commit (same signature and mutation)."""
    T = intermediate_states.shape[1]
    for b in range(intermediate_states.shape[0]):
        slot, n = int(slot_ids[b]), int(num_accepted[b])
        if slot >= 0 and n >= 1:
            state[slot] = intermediate_states[b, min(n, T) - 1].to(state.dtype)


def _check_out(out: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(v, memory_format=torch.contiguous_format)
    if out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(v.shape)} tensor; got {tuple(out.shape)}")
    return out


__all__ = [
    "L2NORM_EPS",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_ref",
    "gdn_rewind_commit",
    "gdn_rewind_commit_ref",
]
