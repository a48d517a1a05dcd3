"""Gated DeltaNet "replay" verify for MTP speculative decoding: fast-forward, verify, record history.

Scope: the replay commit scheme (TensorRT-LLM's "SSM replay", FlashInfer's `checkpointing_ssu`, written
there for Mamba2) carried over to a Qwen3-Next Gated DeltaNet layer: the Triton kernel `replay_verify`, its
plain-PyTorch reference `replay_verify_ref` (same signature, vectorised over the batch: the engine's path for
ssm_backend="torch") and the history layout `ReplayHistory`. Instead of T intermediate states per row (rewind,
kernels/gdn/recurrent.py), each slot keeps its committed state plus the history of its last verify,
double-buffered, and the number of tokens accepted from it (PNAT):

    u_hist (S, 2, TH, HV, V)  solved update vectors u_t = beta_t (v_t - alpha_t S_{t-1} k_t)
    k_hist (S, 2, TH, H, K)   the L2-normalised keys (per key head)
    g_hist (S, 2, TH, HV)     cumulative log decay G_t = g_0 + ... + g_t of that verify (fp32)
    prev_num_accepted (S,) int32, buffer_index (S,) int32   per slot, shared by all layers; zero-initialised
                              (`kernels.commit.allocate_replay_slots`)

With the recurrence S_t = alpha_t S_{t-1} + u_t k_t^T (see kernels/gdn/recurrent.py) and S_{-1} = S_0 the committed
state, unrolling gives, exactly and in the [V, K] layout,

    S_t = exp(G_t) S_0 + sum_{j <= t} exp(G_t - G_j) u_j k_j^T,

and u_t depends only on S_0 and tokens <= t, never on which later tokens get accepted. One verify per
(slot, value head) then does:
  1. fast-forward by p = prev_num_accepted[slot] old tokens read from buffer buffer_index[slot]:
     S <- exp(G_{p-1}) S + sum_{j<p} c_j u_j k_j^T with c_j = exp(G_{p-1} - G_j): p rank-1 FMA passes
     over the register tile (no tl.dot: padding the history to 16 rows made that version compute-bound);
     written back to the slot when p > 0 (that is the commit of the previous step).
  2. the T new tokens by the sequential recurrence (T <= 8: T rank-1 updates in registers are cheaper
     than a triangular solve and exact), giving o_t and u_t;
  3. u_t, k_t and G_t of the new tokens go to buffer 1 - buffer_index[slot], so the buffer being read is never
     written (value heads of one key head share k_hist, written by the first of them).
`kernels.commit.replay_advance` then sets prev_num_accepted[slot] = num_accepted and flips
buffer_index[slot], for the rows the kernel processed (slot >= 0). Tests hold kernel and reference to a
token-by-token oracle (tests/replay_oracles.py). Memory per slot and layer: 2 * TH * (HV * V + H * K + HV)
values instead of T * HV * V * K.

Performance: one state read and (p > 0) one state write per verify, no intermediate states, all math in
fp32 registers; all global loads are issued before the first store. At the Qwen3-Next shape it takes about
half the rewind time, ~1.7x the state read+write floor (docs/kernel_performance.md).

Kernel variants (`variant=`; `VARIANTS` holds their default tiles; without `variant=`, the engine's call, the
configuration measured fastest by `python -m benchmarks.sweep_replay` for the launch's state dtype, shape class
and batch bucket, from the committed table of `kernels.replay_defaults` (an fp16 state takes the bf16 rows),
else `FALLBACK_VARIANT`;
docs/kernel_performance.md): "fma" is the kernel above; "mma" runs the
new tokens in closed form from S0 (the stored state after step 1): the only products with the state are
P_k = S0 K^T and P_q = S0 Q^T (split-bf16 tensor-core products, `kernels._mma.split_dot`, accumulated over K in
software-pipelined chunks), then the (T, T) delta-rule recursion u_t = beta_t (v_t - e^{G_t} P_k[:, t] -
sum_{j<t} e^{G_t - G_j} (k_j . k_t) u_j) on [BV] vectors and o = e^G P_q + U M^T,
M_tj = [j <= t] e^{G_t - G_j} (k_j . q_t). Both take `stochastic_rounding=` for a 16-bit state's write.

Sources: TensorRT-LLM's SSM replay and FlashInfer's checkpointing_ssu (flashinfer.mamba) for Mamba2; the
closed form of the gated delta rule (Yang et al., "Gated Delta Networks", ICLR 2025) is unrolled above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import replay_defaults
from kernels._common import interpreter_active
from kernels._mma import PIECES, split_dot
from kernels.gdn._common import check_gdn_inputs, check_state, key_head_dims, l2norm
from kernels.rounding import (
    StochasticRounding,
    launch_args,
    round_to_state,
    round_to_state_keyed,
    sr_tile_keys,
    stochastic_round_ref,
)

# Kernel variants of `replay_verify` and their default (block_v, num_warps, chunk_k, num_stages): "fma" the
# block_v 16 / 1 warp tile of the H200 sweep (docs/kernel_performance.md), "mma" one 16-row mma tile per warp.
VARIANTS = {"fma": (16, 1, None, None), "mma": (16, 1, 32, 2)}
# The variant of a launch without `variant=` whose (state dtype, shape class, batch) has no row (nor, for an fp16
# state, a bf16 row: `replay_defaults.ROW_SIBLING`) in the measured table kernels/replay_defaults.json
# (`kernels.replay_defaults`, written by `python -m benchmarks.sweep_replay --write-defaults`): the variant every
# test covers.
FALLBACK_VARIANT = "fma"


@dataclass
class ReplayHistory:
    """Double-buffered per-slot history of one GDN layer's last verify (see the module docstring).

    u: (S, 2, TH, HV, V); k: (S, 2, TH, H, K); g: (S, 2, TH, HV) float32. The last dimension of each must be
    contiguous; other strides are free (e.g. per-layer views of one allocation).
    """

    u: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor

    @staticmethod
    def shapes(num_slots: int, hist_len: int, H: int, HV: int, K: int, V: int, *,
               dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{field: (shape, dtype)} of a layer's history (the class docstring's layout): the one declaration
        that :meth:`allocate` and the engine's memory plan (runners/engine/cache.py) both read."""
        lead = (num_slots, 2, hist_len)
        return {"u": ((*lead, HV, V), dtype), "k": ((*lead, H, K), dtype), "g": ((*lead, HV), torch.float32)}

    @classmethod
    def allocate(cls, num_slots: int, hist_len: int, H: int, HV: int, K: int, V: int, *,
                 device: torch.device | str, dtype: torch.dtype = torch.float32) -> ReplayHistory:
        """Zero-filled history of one layer for T <= hist_len (TH) tokens per verify; u and k in `dtype` (fp32
        recommended), g in fp32."""
        shapes = cls.shapes(num_slots, hist_len, H, HV, K, V, dtype=dtype)
        return cls(**{n: torch.zeros(shape, dtype=dt, device=device) for n, (shape, dt) in shapes.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.u, self.k, self.g))


@triton.jit
def _gdn_replay_verify_kernel(
    q, k, v, g, beta, o, state, slot_ids, pnat, buf_idx, u_hist, k_hist, g_hist, sr_seed_ptr, sr_step_ptr, sr_salt,
    scale,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_u_slot, stride_u_buf, stride_u_t, stride_u_h,
    stride_k_slot, stride_k_buf, stride_k_t, stride_k_h,
    stride_g_slot, stride_g_buf, stride_g_t,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TH: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, SR: tl.constexpr, SR_ROUNDS: tl.constexpr,
):
    # The "fma" variant.
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)

    slot = tl.load(slot_ids + i_b).to(tl.int64)
    live = slot >= 0  # PAD rows: no cache, history or metadata access; zero outputs
    slot = tl.maximum(slot, 0)
    # Clamped so that garbage metadata can never index outside the history.
    n_old = tl.minimum(tl.maximum(tl.load(pnat + slot), 0), TH)
    n_old = tl.where(live, n_old, 0)
    old = (tl.load(buf_idx + slot) & 1).to(tl.int64)
    new = 1 - old

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, TP)
    m_k = o_k < K
    m_v = o_v < V
    # Predicates folded into block masks through their extents (scalar-bool masks trip the interpreter).
    m_sl = (o_v[:, None] < tl.where(live, V, 0)) & m_k[None, :]
    m_ff = (o_v[:, None] < tl.where(n_old > 0, V, 0)) & m_k[None, :]

    p_s = state + slot * stride_s_slot + i_hv * stride_s_h + o_v[:, None] * stride_s_v + o_k[None, :]
    b_s = tl.load(p_s, mask=m_sl, other=0.0).to(tl.float32)

    # Every global load is issued before the first store (stores may alias later loads, so the compiler could
    # not hoist them), the state first: its latency overlaps the small-vector work below.
    # The T new tokens' q, k (normalised), v, g, beta as (TP, .) register blocks.
    i_tok = (i_b * T + o_t).to(tl.int64)
    m_tt = o_t < T
    b_Q = tl.load(q + (i_tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tt[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_Kn = tl.load(k + (i_tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tt[:, None] & m_k[None, :],
                   other=0.0).to(tl.float32)
    b_Vn = tl.load(v + (i_tok[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_tt[:, None] & m_v[None, :],
                   other=0.0).to(tl.float32)
    b_gv = tl.load(g + i_tok * HV + i_hv, mask=m_tt, other=0.0).to(tl.float32)
    b_betav = tl.load(beta + i_tok * HV + i_hv, mask=m_tt, other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        b_Q = b_Q * tl.rsqrt(tl.sum(b_Q * b_Q, axis=1) + 1e-6)[:, None]
        b_Kn = b_Kn * tl.rsqrt(tl.sum(b_Kn * b_Kn, axis=1) + 1e-6)[:, None]
    b_Q = b_Q * scale

    # 1. fast-forward by the n_old accepted tokens of the previous verify, closed form with CUDA-core FMAs:
    #    S <- exp(G_last) S + sum_j exp(G_last - G_j) u_j k_j^T (one FMA per state element and token; a
    #    tl.dot over a history padded to 16 rows made this kernel compute-bound). Unrolled over the TH
    #    history slots; masked ones add exact zeros.
    p_g = g_hist + slot * stride_g_slot + old * stride_g_buf + i_hv
    b_Glast = tl.load(p_g + (n_old - 1) * stride_g_t, mask=n_old > 0, other=0.0).to(tl.float32)
    b_s = b_s * tl.exp(b_Glast)
    for j in tl.static_range(TH):
        use = j < n_old
        b_c = tl.where(use, tl.exp(b_Glast - tl.load(p_g + j * stride_g_t, mask=use, other=0.0)), 0.0)
        b_uj = tl.load(u_hist + slot * stride_u_slot + old * stride_u_buf + j * stride_u_t + i_hv * stride_u_h
                       + o_v, mask=o_v < tl.where(use, V, 0), other=0.0).to(tl.float32)
        b_kj = tl.load(k_hist + slot * stride_k_slot + old * stride_k_buf + j * stride_k_t + i_h * stride_k_h
                       + o_k, mask=o_k < tl.where(use, K, 0), other=0.0).to(tl.float32)
        b_s += (b_c * b_uj)[:, None] * b_kj[None, :]
    b_s = round_to_state(b_s, state, (slot * HV + i_hv) * V + o_v, 0, sr_seed_ptr, sr_step_ptr, sr_salt, BV, BK, BK,
                         SR, SR_ROUNDS)
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_ff)  # the new tokens start from the stored value

    # 2. + 3. the T new tokens (rows taken from the register blocks), recording u_t, k_t, G_t into the other
    # buffer.
    write_k = live & (i_v == 0) & (i_hv % (HV // H) == 0)
    m_kw = o_k < tl.where(write_k, K, 0)
    m_vw = o_v < tl.where(live, V, 0)
    for t in tl.static_range(T):
        sel = o_t == t
        b_q = tl.sum(tl.where(sel[:, None], b_Q, 0.0), axis=0)
        b_k = tl.sum(tl.where(sel[:, None], b_Kn, 0.0), axis=0)
        b_v = tl.sum(tl.where(sel[:, None], b_Vn, 0.0), axis=0)
        b_g = tl.sum(tl.where(sel, b_gv, 0.0))
        b_beta = tl.sum(tl.where(sel, b_betav, 0.0))

        b_s = b_s * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], axis=1))
        b_s = b_s + b_u[:, None] * b_k[None, :]
        b_o = tl.where(live, tl.sum(b_s * b_q[None, :], axis=1), 0.0)
        i_t = i_b.to(tl.int64) * T + t
        tl.store(o + (i_t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        p_un = u_hist + slot * stride_u_slot + new * stride_u_buf + t * stride_u_t + i_hv * stride_u_h + o_v
        tl.store(p_un, b_u.to(p_un.dtype.element_ty), mask=m_vw)
        p_kn = k_hist + slot * stride_k_slot + new * stride_k_buf + t * stride_k_t + i_h * stride_k_h + o_k
        tl.store(p_kn, b_k.to(p_kn.dtype.element_ty), mask=m_kw)

    b_gnew = tl.where(m_tt, b_gv, 0.0)
    m_gw = o_t < tl.where(live & (i_v == 0), T, 0)
    b_Gnew = tl.cumsum(b_gnew, axis=0)
    tl.store(g_hist + slot * stride_g_slot + new * stride_g_buf + o_t * stride_g_t + i_hv, b_Gnew, mask=m_gw)


@triton.jit
def _gdn_replay_verify_mma_kernel(
    q, k, v, g, beta, o, state, slot_ids, pnat, buf_idx, u_hist, k_hist, g_hist, sr_seed_ptr, sr_step_ptr, sr_salt,
    scale,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_u_slot, stride_u_buf, stride_u_t, stride_u_h,
    stride_k_slot, stride_k_buf, stride_k_t, stride_k_h,
    stride_g_slot, stride_g_buf, stride_g_t,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TH: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHUNK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    S_IN: tl.constexpr, S_STATE: tl.constexpr, SPLIT: tl.constexpr,
    SR: tl.constexpr, SR_ROUNDS: tl.constexpr, INTERP: tl.constexpr,
):
    # The "mma" variant: the T new tokens in closed form from S0 (the stored state after the previous
    # verify's accepted tokens). With G_t = g_0 + .. + g_t, raw q / k rows and their L2 factors r_q, r_k:
    #   P_k = S0 K^T diag(r_k), P_q = S0 Q^T diag(scale r_q)   (BV, TP): the only products with the state;
    #   u_t = beta_t (v_t - e^{G_t} P_k[:, t] - sum_{j<t} e^{G_t - G_j} (k_j . k_t) u_j)  (a T x T recursion);
    #   o_t = e^{G_t} P_q[:, t] + sum_{j<=t} e^{G_t - G_j} (k_j . q_t) u_j                  (U @ M^T).
    # The state products and the (T, T) Gram matrices are split-bf16 tensor-core products (kernels/_mma.py)
    # accumulated over K in (BV, CHUNK_K) chunks of the state tile (software-pipelined loads); the fast-forward
    # by the previous verify's n_old <= TH tokens stays rank-1 FMAs per chunk.
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)

    slot = tl.load(slot_ids + i_b).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    n_old = tl.minimum(tl.maximum(tl.load(pnat + slot), 0), TH)
    n_old = tl.where(live, n_old, 0)
    old = (tl.load(buf_idx + slot) & 1).to(tl.int64)
    new = 1 - old

    o_c = tl.arange(0, CHUNK_K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, TP)
    m_v = o_v < V
    m_vl = o_v < tl.where(live, V, 0)
    m_tt = o_t < T
    m_ff = o_v < tl.where(n_old > 0, V, 0)  # rows whose state is written (the commit of the previous step)

    p_g = g_hist + slot * stride_g_slot + old * stride_g_buf + i_hv
    b_Glast = tl.load(p_g + (n_old - 1) * stride_g_t, mask=n_old > 0, other=0.0).to(tl.float32)
    decay = tl.exp(b_Glast)
    p_uo = u_hist + slot * stride_u_slot + old * stride_u_buf + i_hv * stride_u_h + o_v
    p_ko = k_hist + slot * stride_k_slot + old * stride_k_buf + i_h * stride_k_h

    i_tok = (i_b * T + o_t).to(tl.int64)
    b_VT = tl.load(v + (i_tok[None, :] * HV + i_hv) * V + o_v[:, None], mask=m_v[:, None] & m_tt[None, :],
                   other=0.0).to(tl.float32)  # (BV, TP)
    b_g = tl.load(g + i_tok * HV + i_hv, mask=m_tt, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_tok * HV + i_hv, mask=m_tt, other=0.0).to(tl.float32)
    p_q = q + (i_tok[:, None] * H + i_h) * K
    p_k = k + (i_tok[:, None] * H + i_h) * K
    p_s = state + slot * stride_s_slot + i_hv * stride_s_h + o_v[:, None] * stride_s_v
    row = (slot * HV + i_hv) * V + o_v  # global state rows of this tile (stochastic rounding counters)

    Pk = tl.zeros([BV, TP], tl.float32)  # S0 k_raw_t
    Pq = tl.zeros([BV, TP], tl.float32)  # S0 q_raw_t
    KK = tl.zeros([TP, TP], tl.float32)  # k_raw_t . k_raw_j
    QK = tl.zeros([TP, TP], tl.float32)  # q_raw_t . k_raw_j
    kss = tl.zeros([TP], tl.float32)  # sum of squares of the raw k rows
    qss = tl.zeros([TP], tl.float32)
    sr_k, sr_kk = sr_tile_keys(sr_seed_ptr, sr_step_ptr, sr_salt, SR)
    for k0 in tl.range(0, BK, CHUNK_K, num_stages=NUM_STAGES):
        cols = k0 + o_c
        m_c = cols < K
        b_s = tl.load(p_s + cols[None, :], mask=m_vl[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        b_Qc = tl.load(p_q + cols[None, :], mask=m_tt[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        b_Kc = tl.load(p_k + cols[None, :], mask=m_tt[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        # fast-forward: S <- exp(G_last) S + sum_{j < n_old} exp(G_last - G_j) u_j k_j^T
        b_s = b_s * decay
        for j in tl.static_range(TH):
            use = j < n_old
            b_cj = tl.where(use, tl.exp(b_Glast - tl.load(p_g + j * stride_g_t, mask=use, other=0.0)), 0.0)
            b_uj = tl.load(p_uo + j * stride_u_t, mask=o_v < tl.where(use, V, 0), other=0.0).to(tl.float32)
            b_kj = tl.load(p_ko + j * stride_k_t + cols, mask=cols < tl.where(use, K, 0), other=0.0).to(tl.float32)
            b_s += (b_cj * b_uj)[:, None] * b_kj[None, :]
        b_s = round_to_state_keyed(b_s, state, row, k0, sr_k, sr_kk, BV, CHUNK_K, BK, SR, SR_ROUNDS)
        tl.store(p_s + cols[None, :], b_s.to(state.dtype.element_ty), mask=m_ff[:, None] & m_c[None, :])
        # the new tokens start from the stored (dtype-rounded) state
        Pk = split_dot(b_s, tl.trans(b_Kc), Pk, S_STATE, S_IN, INTERP)
        Pq = split_dot(b_s, tl.trans(b_Qc), Pq, S_STATE, S_IN, INTERP)
        KK = split_dot(b_Kc, tl.trans(b_Kc), KK, S_IN, S_IN, INTERP)
        QK = split_dot(b_Qc, tl.trans(b_Kc), QK, S_IN, S_IN, INTERP)
        kss += tl.sum(b_Kc * b_Kc, axis=1)
        qss += tl.sum(b_Qc * b_Qc, axis=1)

    if USE_QK_L2NORM:
        r_k = tl.rsqrt(kss + 1e-6)
        r_q = tl.rsqrt(qss + 1e-6) * scale
    else:
        r_k = tl.full([TP], 1.0, tl.float32)
        r_q = tl.full([TP], 1.0, tl.float32) * scale
    G = tl.cumsum(tl.where(m_tt, b_g, 0.0), axis=0)  # (TP,)
    past = o_t[None, :] < o_t[:, None]  # j < t
    upto = o_t[None, :] <= o_t[:, None]  # j <= t
    dG = tl.where(upto, G[:, None] - G[None, :], 0.0)
    # u recursion: U = R - (strictly lower) Coef applied column by column
    R = b_beta[None, :] * (b_VT - (tl.exp(G) * r_k)[None, :] * Pk)  # (BV, TP)
    Coef = tl.where(past, b_beta[:, None] * tl.exp(dG) * KK * r_k[:, None] * r_k[None, :], 0.0)
    U = R
    for t in tl.static_range(1, T):
        crow = tl.sum(tl.where(o_t[:, None] == t, Coef, 0.0), axis=0)  # row t of Coef, indexed by j
        corr = tl.sum(U * crow[None, :], axis=1)  # (BV,)
        U = tl.where(o_t[None, :] == t, U - corr[:, None], U)
    Mq = tl.where(upto, tl.exp(dG) * QK * r_q[:, None] * r_k[None, :], 0.0)  # (TP, TP) [t, j]
    O = split_dot(U, tl.trans(Mq), (tl.exp(G) * r_q)[None, :] * Pq, SPLIT, SPLIT, INTERP)
    O = tl.where(live, O, 0.0)
    tl.store(o + (i_tok[None, :] * HV + i_hv) * V + o_v[:, None], O.to(o.dtype.element_ty),
             mask=m_v[:, None] & m_tt[None, :])

    # history of this verify: u_t, the normalised k_t, G_t into buffer `new`
    tl.store(u_hist + slot * stride_u_slot + new * stride_u_buf + o_t[None, :] * stride_u_t + i_hv * stride_u_h
             + o_v[:, None], U.to(u_hist.dtype.element_ty), mask=m_vl[:, None] & m_tt[None, :])
    write_k = live & (i_v == 0) & (i_hv % (HV // H) == 0)
    if write_k:
        for k0 in tl.range(0, BK, CHUNK_K):
            cols = k0 + o_c
            m_kc = m_tt[:, None] & (cols < K)[None, :]
            b_Kc = tl.load(p_k + cols[None, :], mask=m_kc, other=0.0).to(tl.float32)
            tl.store(k_hist + slot * stride_k_slot + new * stride_k_buf + o_t[:, None] * stride_k_t
                     + i_h * stride_k_h + cols[None, :], (b_Kc * r_k[:, None]).to(k_hist.dtype.element_ty),
                     mask=m_kc)
    m_gw = o_t < tl.where(live & (i_v == 0), T, 0)
    tl.store(g_hist + slot * stride_g_slot + new * stride_g_buf + o_t * stride_g_t + i_hv, G, mask=m_gw)


def _check_replay_buffers(hist: ReplayHistory, prev_num_accepted, buffer_index, T, H, HV, K, V):
    S, _, TH = hist.u.shape[:3]
    expect = (("u", hist.u, (S, 2, TH, HV, V)), ("k", hist.k, (S, 2, TH, H, K)), ("g", hist.g, (S, 2, TH, HV)))
    for name, t, shape in expect:
        if tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"history.{name} must be {shape} with a contiguous last dim (slots, double buffer, "
                             f"history tokens, heads, dim); got {tuple(t.shape)} strides {t.stride()}")
    if hist.g.dtype != torch.float32:
        raise ValueError(f"history.g (cumulative log decay) must be float32; got {hist.g.dtype}")
    if T > TH:
        raise ValueError(f"T={T} tokens exceed the history length TH={TH}; allocate it with hist_len >= T")
    for name, t in (("prev_num_accepted", prev_num_accepted), ("buffer_index", buffer_index)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < S:
            raise ValueError(f"{name} must be (S >= {S},) int32 per-slot metadata; got {tuple(t.shape)} {t.dtype}")
    return TH


def replay_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    history: ReplayHistory,
    slot_ids: torch.Tensor,
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    variant: str | None = None,
    split: int | None = None,
    chunk_k: int | None = None,
    num_stages: int | None = None,
    stochastic_rounding: StochasticRounding | None = None,
) -> torch.Tensor:
    """Replay verify of one GDN layer: commit the previous step's accepted tokens, run T new tokens.

    Args:
        q, k: (B, T, H, K); v: (B, T, HV, V); g: (B, T, HV) log decay; beta: (B, T, HV) -- as in
            kernels.gdn.fused_recurrent_gated_delta_rule (g, beta computed by the caller).
        state: (S, HV, V, K) committed state (fp32 recommended), K contiguous, strides free. Mutated: for a
            live row with prev_num_accepted[slot] > 0 it becomes the state after the previous verify's
            accepted tokens.
        history: this layer's ReplayHistory. Reads buffer buffer_index[slot], writes the first T tokens of
            buffer 1 - buffer_index[slot].
        slot_ids: (B,) int32 / int64, PAD = -1 rows touch no buffer and get zero outputs; slot 0 is live.
        prev_num_accepted, buffer_index: (S,) int32 per-slot metadata (shared by all layers), read only here;
            prev_num_accepted is clamped to [0, TH] so garbage can never index out of range. Update them with
            kernels.commit.replay_advance once per step, after every layer's verify.
        scale, use_qk_l2norm_in_kernel: as in fused_recurrent_gated_delta_rule.
        out: optional contiguous (B, T, HV, V) output.
        block_v: rows of S per program (power of two; >= 16 for "mma"); default per variant (`VARIANTS`; 16,
            the fastest of the H200 sweep for "fma"). No autotune (in-place kernel).
        num_warps: warps per program; default per variant ("fma": 1 for tiles of <= 2048 elements, else 4).
        variant: "fma" (token-by-token rank-1 updates and tl.sum reductions on CUDA cores) or "mma" (the closed
            form of the kernel comment, state products as split-bf16 tensor-core products, kernels/_mma.py);
            None: the measured default of `kernels.replay_defaults` (operation "gdn", this state dtype, shape
            class (HV, V, K), batch), whose tiles also fill every tuning argument left at None
            (an fp16 state takes the bf16 rows; `FALLBACK_VARIANT` without a row). Same results to the
            tolerances of tests/test_kernels_gdn.py.
        split: "mma" only: bf16 pieces of a general fp32 operand (the fp32 state, u, the (T, T) mixing
            matrix): 2 (about 2^-17 relative; the default) or 3 (fp32 rounding).
        chunk_k, num_stages: "mma" only: state columns per step of the program's loop over its tile and the
            software-pipelining depth of that loop; defaults in `VARIANTS`.
        stochastic_rounding: a `kernels.rounding.StochasticRounding` to round the state write stochastically
            (bf16 / fp16 states only); None rounds to nearest.

    Returns:
        o: (B, T, HV, V), o_t = S_t q_t from the fast-forwarded state.

    Raises:
        ValueError on inconsistent shapes, a transposed state, T > TH or bad metadata.
    """
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta, slot_ids)
    check_state(state, HV, V, K)
    TH = _check_replay_buffers(history, prev_num_accepted, buffer_index, T, H, HV, K, V)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    elif out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(v.shape)} tensor; got {tuple(out.shape)}")
    scale = K**-0.5 if scale is None else scale
    tuning = replay_defaults.resolve(
        dict(variant=variant, block_v=block_v, num_warps=num_warps, split=split, chunk_k=chunk_k,
             num_stages=num_stages),
        "gdn", state.dtype, replay_defaults.gdn_shape_class(HV, V, K), B, fallback=FALLBACK_VARIANT,
        variants=VARIANTS)
    variant, block_v, num_warps, chunk_k, num_stages = (
        tuning[k] for k in ("variant", "block_v", "num_warps", "chunk_k", "num_stages"))
    split = 2 if tuning["split"] is None else tuning["split"]
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if split not in (2, 3):
        raise ValueError(f"split must be 2 or 3 (bf16 pieces of an fp32 operand), got {split}")
    cfg = VARIANTS[variant]
    mma = variant == "mma"
    BK, BV = key_head_dims(K, V, block_v or cfg[0], min_block=16 if mma else 1)
    if (block_v and block_v & (block_v - 1)) or (mma and block_v and block_v < 16):
        raise ValueError(f"block_v must be a power of two (>= 16 for variant 'mma'), got {block_v}")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    u, kh, gh = history.u, history.k, history.g
    sr = launch_args(stochastic_rounding, state, "replay_verify")
    args = (q, k, v, g, beta, out, state, slot_ids, prev_num_accepted, buffer_index, u, kh, gh,
            sr.pop("sr_seed_ptr"), sr.pop("sr_step_ptr"), sr.pop("sr_salt"), scale,
            state.stride(0), state.stride(1), state.stride(2),
            u.stride(0), u.stride(1), u.stride(2), u.stride(3),
            kh.stride(0), kh.stride(1), kh.stride(2), kh.stride(3),
            gh.stride(0), gh.stride(1), gh.stride(2))
    grid = (triton.cdiv(V, BV), B * HV)
    common = dict(T=T, H=H, HV=HV, K=K, V=V, TH=TH, BK=BK, BV=BV, USE_QK_L2NORM=use_qk_l2norm_in_kernel, **sr)
    if mma:
        _gdn_replay_verify_mma_kernel[grid](
            *args, TP=max(16, triton.next_power_of_2(T)), CHUNK_K=min(chunk_k or cfg[2], BK),
            NUM_STAGES=num_stages or cfg[3], S_IN=max(PIECES[q.dtype], PIECES[k.dtype]),
            S_STATE=PIECES[state.dtype] if state.dtype != torch.float32 else split, SPLIT=split,
            INTERP=interpreter_active(), num_warps=num_warps or cfg[1], **common)
    else:
        _gdn_replay_verify_kernel[grid](*args, TP=triton.next_power_of_2(TH),
                                        num_warps=num_warps or (1 if BV * BK <= 2048 else 4), **common)
    return out


def replay_verify_ref(
    q, k, v, g, beta, state, history, slot_ids, prev_num_accepted, buffer_index, *, scale=None,
    use_qk_l2norm_in_kernel=True, out=None, block_v=None, num_warps=None, variant=None, split=None, chunk_k=None,
    num_stages=None, stochastic_rounding=None,
):
    """PyTorch reference of replay_verify, vectorised over the batch: the engine's path for ssm_backend="torch".

    Same signature and mutations as the kernel (block_v, num_warps, variant, split, chunk_k, num_stages: the
    kernel's tuning, ignored). `stochastic_rounding` rounds the stored state with
    `kernels.rounding.stochastic_round_ref` (torch random bits: the same rule, not the kernel's bits). For the live rows (slot s =
    slot_ids[b] >= 0, p = prev_num_accepted[s] clamped to [0, TH], r = buffer_index[s] % 2):
    1. fast-forward: S <- exp(G_{p-1}) S + sum_{j<p} exp(G_{p-1} - G_j) u_j k_j^T from history buffer r,
       stored as the slot's committed state (unchanged for p = 0); the new tokens start from the stored
       (dtype-rounded) value;
    2. the T new tokens by the recurrence S_t = alpha_t S_{t-1} + u_t k_t^T, u_t = beta_t (v_t - alpha_t
       S_{t-1} k_t), o_t = S_t (scale q_t), batched over rows;
    3. u_t, the normalised k_t and G_t = g_0 + .. + g_t of the new tokens into buffer 1 - r.
    PAD rows (slot id < 0) read and write no buffer; their outputs are zero. All arithmetic in fp32.

    Shapes: q, k (B, T, H, K); v (B, T, HV, V); g, beta (B, T, HV); state (S, HV, V, K); history u (S, 2, TH,
    HV, V), k (S, 2, TH, H, K), g (S, 2, TH, HV). Returns out (B, T, HV, V) in v's dtype (or `out`).
    Raises ValueError as the kernel does. Source: the closed form of the module docstring; tested against the
    kernel and a token-by-token oracle (tests/replay_oracles.py).
    """
    del block_v, num_warps, variant, split, chunk_k, num_stages
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta, slot_ids)
    if stochastic_rounding is not None:
        stochastic_rounding.check(state, "replay_verify_ref")
    check_state(state, HV, V, K)
    TH = _check_replay_buffers(history, prev_num_accepted, buffer_index, T, H, HV, K, V)
    out = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
    out.zero_()
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    scale = K**-0.5 if scale is None else scale
    r = HV // H
    s = slot_ids[rows].long()
    n_old, old = prev_num_accepted[s].long().clamp(0, TH), buffer_index[s].long() & 1
    # 1. fast-forward by the accepted tokens of the previous verify
    G = history.g[s, old].float()  # (n, TH, HV)
    G_last = G.gather(1, (n_old - 1).clamp(min=0)[:, None, None].expand(-1, 1, HV))[:, 0]
    G_last = torch.where(n_old[:, None] > 0, G_last, 0.0)  # (n, HV)
    pending = torch.arange(TH, device=G.device)[None, :, None] < n_old[:, None, None]
    # positions j >= p are never read (the kernel masks them): where(), not a product with 0, so garbage or NaN
    # there cannot leak in
    c = torch.where(pending, torch.exp(G_last[:, None, :] - G), 0.0)  # (n, TH, HV)
    U = torch.where(pending[..., None], history.u[s, old].float() * c[..., None], 0.0)  # (n, TH, HV, V)
    Kh = torch.where(pending[..., None], history.k[s, old].float().repeat_interleave(r, dim=2), 0.0)
    S = state[s].float() * torch.exp(G_last)[..., None, None] + torch.einsum("bjhv,bjhk->bhvk", U, Kh)
    S = stochastic_round_ref(S, state.dtype, stochastic_rounding)
    state.index_copy_(0, s, S)  # p = 0 rows store their unchanged state
    S = S.float()
    # 2. the new tokens
    kn = l2norm(k[rows]) if use_qk_l2norm_in_kernel else k[rows].float()  # (n, T, H, K)
    qn = l2norm(q[rows]) if use_qk_l2norm_in_kernel else q[rows].float()
    qh, kh = qn.repeat_interleave(r, dim=2) * scale, kn.repeat_interleave(r, dim=2)  # (n, T, HV, K)
    gf, bf, vf = g[rows].float(), beta[rows].float(), v[rows].float()
    us, os_ = [], []
    for t in range(T):
        S = S * gf[:, t].exp()[..., None, None]
        u = bf[:, t, :, None] * (vf[:, t] - torch.einsum("bhvk,bhk->bhv", S, kh[:, t]))
        S = S + u[..., None] * kh[:, t, :, None, :]
        os_.append(torch.einsum("bhvk,bhk->bhv", S, qh[:, t]))
        us.append(u)
    out[rows] = torch.stack(os_, dim=1).to(out.dtype)
    # 3. their update vectors become the history read by the next verify
    new, tt = 1 - old, slice(0, T)
    history.u[s, new, tt] = torch.stack(us, dim=1).to(history.u.dtype)
    history.k[s, new, tt] = kn.to(history.k.dtype)
    history.g[s, new, tt] = torch.cumsum(gf, dim=1).to(history.g.dtype)
    return out
