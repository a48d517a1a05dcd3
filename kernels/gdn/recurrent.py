"""Gated DeltaNet recurrent step over T tokens: decode (T = 1) and the MTP verify step by "rewind" (T = K + 1).

Scope: the recurrent path of a Qwen3-Next Gated DeltaNet layer. `fused_recurrent_gated_delta_rule` is the
Triton kernel on a slot-indexed state cache (flash-linear-attention's operator of that name, with slots, PAD
rows and intermediate states added); `fused_recurrent_gated_delta_rule_ref` is its plain-PyTorch reference
(same signature, vectorised over the batch: the engine's decode and rewind-verify path for
ssm_backend="torch"), built on `recurrent_gated_delta_rule`, the token-by-token rule on gathered states (the
specification, also the reference of `kernels.gdn.chunk.chunk_gated_delta_rule`).

Recurrence (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025; as
in flash-linear-attention's fused_recurrent_gated_delta_rule and HF Qwen3-Next), per slot and value head,
state S of shape [V, K]:

    alpha_t = exp(g_t)                      g_t <= 0 is the log decay, computed by the caller:
                                            g = -exp(A_log) * softplus(a + dt_bias)
    u_t     = beta_t (v_t - alpha_t S_{t-1} k_t)          beta = sigmoid(b), computed by the caller
    S_t     = alpha_t S_{t-1} + u_t k_t^T    (= alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T)
    o_t     = S_t q_t

q and k are L2-normalised inside the kernel when use_qk_l2norm_in_kernel=True (the default; eps 1e-6), and
q is then multiplied by scale (default K ** -0.5). The key head of value head hv is hv // (HV // H).

Rewind (the baseline commit scheme): the verify runs T tokens from the stored state without changing it and
writes every intermediate state to a buffer (B', T, HV, V, K); after acceptance `kernels.commit.rewind_commit`
copies the state after the num_accepted-th token back into the slot.

Interpreter note: this kernel uses no tl.dot, so bf16 inputs are exact under TRITON_INTERPRET=1 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_rows
from kernels.gdn._common import check_gdn_inputs, check_state, key_head_dims, l2norm, prepare_rule_inputs
from kernels.rounding import (
    StochasticRounding,
    intermediate_rows,
    launch_args,
    round_to_state,
    stochastic_round_ref,
)


@triton.jit
def _fused_recurrent_gdn_kernel(
    q, k, v, g, beta, o, state, slot_ids, inter, inter_idx, sr_seed_ptr, sr_step_ptr, sr_salt,
    scale,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_i_b, stride_i_t, stride_i_h, stride_i_v,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, STORE_INTERMEDIATE: tl.constexpr, HAS_INDICES: tl.constexpr,
    UPDATE_STATE: tl.constexpr, SR: tl.constexpr, SR_ROUNDS: tl.constexpr,
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

    if HAS_INDICES:  # the row of the intermediate-state buffer (PAD rows: never dereferenced)
        i_row = tl.where(live, tl.load(inter_idx + i_b).to(tl.int64), 0)
    else:
        i_row = i_b.to(tl.int64)

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
            p_i = (inter + i_row * stride_i_b + t * stride_i_t + i_hv * stride_i_h
                   + o_v[:, None] * stride_i_v + o_k[None, :])
            b_r = round_to_state(b_s, inter, intermediate_rows(((i_row * T + t) * HV + i_hv) * V + o_v), 0,
                                 sr_seed_ptr, sr_step_ptr, sr_salt, BV, BK, BK, SR, SR_ROUNDS)
            tl.store(p_i, b_r.to(p_i.dtype.element_ty), mask=m_sl)

    if UPDATE_STATE:
        b_r = round_to_state(b_s, state, (slot * HV + i_hv) * V + o_v, 0, sr_seed_ptr, sr_step_ptr, sr_salt, BV, BK,
                             BK, SR, SR_ROUNDS)
        tl.store(p_s, b_r.to(p_s.dtype.element_ty), mask=m_sl)


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
    intermediate_state_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_v: int = 16,
    stochastic_rounding: StochasticRounding | None = None,
) -> torch.Tensor:
    """Run T recurrent gated delta rule steps per row from the slot's state (decode and rewind verify).

    Args:
        q, k: (B, T, H, K) bf16 / fp16 / fp32 queries and keys (raw when use_qk_l2norm_in_kernel).
        v: (B, T, HV, V) values, HV a multiple of H.
        g: (B, T, HV) log decay (<= 0), fp32 recommended; alpha = exp(g).
        beta: (B, T, HV) write strength in [0, 1] (already sigmoid-ed).
        state: (S, HV, V, K) fp32 (or bf16 / fp16) cache, K contiguous; any slot / head / row strides
            (e.g. a per-layer view of a bigger cache). Mutated in place iff update_state.
        slot_ids: (B,) int32 / int64 slot of each row; PAD = -1 reads and writes no cache entry (its output
            rows are zero); slot 0 is a live slot. Live rows must have distinct slots.
        scale: multiplier of q after normalisation; default K ** -0.5.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head inside the kernel (eps 1e-6).
        update_state: write the state after the T-th token back to state[slot] (decode: T = 1, True;
            rewind verify: False).
        intermediate_states: optional (B', T, HV, V, K) buffer (any float dtype, V / K strides free, K
            contiguous) receiving the state after each token of each live row (rewind verify); PAD rows
            leave it untouched.
        intermediate_state_indices: optional (B,) int32 / int64 buffer row of batch row b, in [0, B')
            (FlashInfer's argument of that name; the engine passes the slot ids); default row b (B' >= B).
        out: optional (B, T, HV, V) contiguous output tensor (default: a new one of v's dtype).
        block_v: rows of S per program (power of two); no autotune because the kernel updates in place.
        stochastic_rounding: a `kernels.rounding.StochasticRounding` to round the 16-bit writes (state and / or
            intermediate states) stochastically; None rounds to nearest.

    Returns:
        o: (B, T, HV, V) in out's dtype (v's dtype by default).

    Raises:
        ValueError on inconsistent shapes, a transposed (S, HV, K, V) state, or a bad buffer.

    Example:
        >>> o = fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, slot_ids)  # T = 1 decode
    """
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta, slot_ids)
    check_state(state, HV, V, K)
    inter, idx = intermediate_states, intermediate_state_indices
    _check_intermediate(inter, idx, slot_ids, T, HV, V, K)
    out = _check_out(out, v)
    scale = K**-0.5 if scale is None else scale
    BK, BV = key_head_dims(K, V, block_v)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    si = inter.stride() if inter is not None else (0, 0, 0, 0, 1)
    sr = _rounding_args(stochastic_rounding, state, inter, update_state)
    grid = (triton.cdiv(V, BV), B * HV)
    _fused_recurrent_gdn_kernel[grid](
        q, k, v, g, beta, out, state, slot_ids,
        inter if inter is not None else state, idx if idx is not None else slot_ids,  # placeholders: unread
        sr.pop("sr_seed_ptr"), sr.pop("sr_step_ptr"), sr.pop("sr_salt"),
        scale,
        state.stride(0), state.stride(1), state.stride(2),
        si[0], si[1], si[2], si[3],
        T=T, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel,
        STORE_INTERMEDIATE=inter is not None, HAS_INDICES=idx is not None,
        UPDATE_STATE=update_state, **sr,
        num_warps=1 if BV * BK <= 2048 else 4,
    )
    return out


def _rounding_args(rounding, state, inter, update_state):
    """Launch arguments for stochastic rounding of the 16-bit buffers this call writes (checked)."""
    name = "fused_recurrent_gated_delta_rule"
    if rounding is None:
        return launch_args(None, state, name)
    written = ([inter] if inter is not None else []) + ([state] if update_state else [])
    for t in written:
        rounding.check(t, name)
    return launch_args(rounding, written[0] if written else state, name)


def fused_recurrent_gated_delta_rule_ref(
    q, k, v, g, beta, state, slot_ids, *, scale=None, use_qk_l2norm_in_kernel=True, update_state=True,
    intermediate_states=None, intermediate_state_indices=None, out=None, block_v=16, stochastic_rounding=None,
):
    """Plain-PyTorch reference of fused_recurrent_gated_delta_rule (same signature, same mutations; block_v
    ignored): `recurrent_gated_delta_rule` on the live rows' gathered states, vectorised over the batch. Host
    syncs: the nonzero() that selects the live rows. `stochastic_rounding` rounds the 16-bit writes with
    `kernels.rounding.stochastic_round_ref` (the kernel's rule, torch's random bits)."""
    del block_v
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta, slot_ids)
    check_state(state, HV, V, K)
    inter, idx = intermediate_states, intermediate_state_indices
    _check_intermediate(inter, idx, slot_ids, T, HV, V, K)
    out = _check_out(out, v)
    out.zero_()
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    slots = slot_ids[rows].long()
    qn, kn = (l2norm(t[rows]) if use_qk_l2norm_in_kernel else t[rows] for t in (q, k))
    o, final, steps = recurrent_gated_delta_rule(
        qn, kn, v[rows], g[rows], beta[rows], state[slots], scale=scale, output_final_state=update_state,
        output_intermediate_states=inter is not None,
    )
    out[rows] = o.to(out.dtype)
    if stochastic_rounding is not None:
        _rounding_args(stochastic_rounding, state, inter, update_state)
    if inter is not None:
        inter[rows if idx is None else idx[rows].long()] = stochastic_round_ref(steps, inter.dtype,
                                                                                stochastic_rounding, stream=1)
    if update_state:
        state[slots] = stochastic_round_ref(final, state.dtype, stochastic_rounding)
    return out


def _check_intermediate(inter, idx, slot_ids, T, HV, V, K) -> None:
    if inter is None:
        if idx is not None:
            raise ValueError("intermediate_state_indices without intermediate_states")
        return
    if inter.dim() != 5 or tuple(inter.shape[1:]) != (T, HV, V, K) or inter.stride(-1) != 1:
        raise ValueError(
            f"intermediate_states must be (B', T={T}, HV={HV}, V={V}, K={K}) with K contiguous; got "
            f"{tuple(inter.shape)} strides {inter.stride()}"
        )
    check_rows(slot_ids, idx, inter.shape[0], "intermediate_states", "fused_recurrent_gated_delta_rule")


def _check_out(out: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(v, memory_format=torch.contiguous_format)
    if out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(v.shape)} tensor; got {tuple(out.shape)}")
    return out


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
    output_final_state: bool = True,
    output_intermediate_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gated delta rule, one token at a time, on gathered (not slot-indexed) states: the specification, run by
    `fused_recurrent_gated_delta_rule_ref` and by `GatedDeltaNet.decode` (runners/engine/models/gdn.py).

    Args:
        q: (B, T, H, K) queries, already L2-normalised (not yet scaled).
        k: (B, T, H, K) keys, already L2-normalised.
        v: (B, T, HV, V) values; HV must be a multiple of H (value head j reads key head j // (HV / H)).
        g: (B, T, HV) log decay, <= 0 (alpha = exp(g)).
        beta: (B, T, HV) write strength in [0, 1].
        initial_state: (B, HV, V, K), K contiguous, any float dtype; zeros if None. Never written.
        scale: multiplies q; default K ** -0.5.
        lengths: (B,) integer valid lengths of a right-padded batch (0 <= lengths <= T). Padded positions
            leave the state unchanged and output zeros.
        output_final_state: return the state after the last (valid) token.
        output_intermediate_states: also return the state after each of the T tokens.

    Returns:
        o: (B, T, HV, V) in v's dtype (accumulated in float32).
        final_state: (B, HV, V, K) float32, or None.
        intermediate_states: (B, T, HV, V, K) float32 (index t = state after token t, so index T - 1 is the
            final state; padded positions repeat the last valid state), or None.

    Raises ValueError on shape / length mismatches (with the expected layout in the message).
    """
    B, T = q.shape[:2]
    out_dtype = v.dtype
    q, k, v, g, beta, state = prepare_rule_inputs(q, k, v, g, beta, initial_state, lengths, scale)
    HV, V, K = state.shape[1:]
    o = q.new_empty(B, HV, T, V)
    inter = q.new_empty(B, T, HV, V, K) if output_intermediate_states else None
    alpha = g.exp()
    for t in range(T):
        k_t = k[:, :, t]  # (B, HV, K)
        state = state * alpha[:, :, t, None, None]
        # u_t = beta_t (v_t - alpha_t S_{t-1} k_t); S_t = alpha_t S_{t-1} + u_t k_t^T
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhvk,bhk->bhv", state, k_t))
        state = state + u[..., :, None] * k_t[..., None, :]
        o[:, :, t] = torch.einsum("bhvk,bhk->bhv", state, q[:, :, t])
        if inter is not None:
            inter[:, t] = state
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None), inter
