"""Mamba2 MTP verify by "SSM replay": fast-forward the committed state from a short input history.

Scope: the verify step of one Mamba2 layer when the engine runs with `ssm_replay=true`, plus the per-slot
bookkeeping after acceptance. Each operation has a Triton kernel + launcher and a plain-PyTorch reference with
the same signature (`*_ref`). The gate silu(z) is not here (NemotronH's gated RMSNorm applies it).

Instead of T intermediate states per slot (rewind, `kernels.mamba2_ssu`), each slot keeps the committed
state plus the inputs of the last verify, double-buffered (BRIEF section 4):

    per layer:  x_hist (S, 2, L, H, P) input dtype   B_hist (S, 2, L, G, N) input dtype
                dt_hist (S, 2, H, L) fp32 dt'       dA_cumsum_hist (S, 2, H, L) fp32 cumsum_t(A dt'_t)
    per slot, shared by all layers:  prev_num_accepted (S,) int32 (PNAT)   buffer_index (S,) int32

L >= T is the history length (the largest T the engine verifies with). `buffer_index[s]` names the buffer
holding the last verify's inputs; the verify writes the new tokens into the other one, so a kernel never
reads what another program of the same launch writes.

Verify for a live row b with slot s, k = PNAT[s], r = buffer_index[s] (`replay_verify`):
1. Fast-forward by the k accepted old tokens, in closed form (c_j = dA_cumsum_hist[s, r, h, j]):
       h <- exp(c_{k-1}) h + X_old^T @ (w[:, None] * B_old),   w_j = exp(c_{k-1} - c_j) dt'_j for j < k
   and store h as the committed state (k = 0 leaves the state untouched: nothing to replay).
2. Outputs of the T new tokens from h, with cum_t = sum_{i<=t} A dt'_i:
       Y = exp(cum)[:, None] * (C @ h^T) + ((C @ B^T) * L) @ X + D X,  L_tj = [j <= t] exp(cum_t - cum_j) dt'_j
3. Write x, B, dt', cum of the new tokens into buffer 1 - r.
Then, after acceptance, `replay_advance` sets PNAT[s] = num_accepted (clamped to [1, T]) and flips
buffer_index[s], with the same liveness predicate (slot id >= 0) as the kernel: PAD rows never advance.
`replay_advance` runs once per step for all layers (the bookkeeping is per slot, not per layer).

Design decisions:
- tl.dot needs >= 16 along each dimension: the token axis is padded to BLOCK_T = max(16, next_pow2(L)),
  and P, N blocks are >= 16. All dot operands are fp32 in registers (bf16 inputs are upcast on load), so
  the interpreter's bf16 dot defect cannot arise; the dot precision is a constexpr (`dot_precision`):
  'ieee' in the interpreter, 'tf32x3' on the GPU (fp32-level accuracy on tensor cores; 'tf32' is faster but
  biases the state by ~1e-3 relative per step). History x and B are stored in the input dtype (exact copies
  of the inputs), dt' and the cumsum in fp32, so replay differs from rewind only by rounding order.
- One program per (P block, row, head) walks d_state in BLOCK_N chunks: fast-forward and store one state
  chunk, accumulate C h^T and C B^T, next chunk; the outputs are formed after the walk. Defaults
  (BLOCK_P, BLOCK_N, warps) = (32, 32, 8) come from the sm_90 register report of
  `python -m kernels.bench_mamba2 --compile-check` (larger tiles spill); the GPU benchmark sweeps them.
- PAD rows (slot id < 0) read and write no cache buffer; their output rows are zeros. Slot 0 is live.
- PNAT values outside [0, L] (garbage metadata) are clamped; buffer_index is read modulo 2.
- No autotune (the kernel updates state in place). Strided views of every cache are supported.
- A new request: after prefill writes its state, call `replay_reset_slots` (PNAT = 0, nothing to replay).

Checkpointing variant (`allocate_replay_history(..., checkpointing=True)`, `replay_advance(..., hist_len=L)`):
the history keeps a window of L tokens (L = max(16, T): the dots pad to 16 anyway) and PNAT counts every
accepted token not yet folded into the state ("pending"), possibly from several verifies. A verify always
fast-forwards in registers by the k = PNAT pending tokens and computes the outputs from there, but writes the
state only on a flush, when the new tokens do not fit behind the pending ones (k + T > L); then the new
tokens go to window position 0 and their dA_cumsum starts at 0. Without a flush they go to positions k..k+T-1
and their dA_cumsum continues from c_{k-1}, so the closed form spans several verifies. Layout changes: x has
one buffer (S, 1, L, H, P) (each program reads and writes only its own (head, P block) of it, reads first),
while B, dt', dA_cumsum stay double-buffered because programs of other heads / P blocks read them: without
a flush the pending tokens' B, dt', dA_cumsum are copied into the buffer written. `replay_advance` applies
the same predicate: PNAT <- num_accepted after a flush, PNAT + num_accepted otherwise. Trade: a state write
every ~(L - T) / (accepted per step) steps instead of every step, for up to L - T more tokens of dot work
and L instead of 2T tokens of x history.

Source: the closed form of the Mamba2 SSD recurrence (state-spaces/mamba, "Transformers are SSMs");
the replay scheme as described for TensorRT-LLM / FlashInfer `checkpointing_ssu`; written from the math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import (
    INPUT_DTYPES,
    check_dtype,
    check_launchable,
    check_shape,
    default_dot_precision,
)
from kernels.mamba2_ssu import _NO_LIMIT, _check_inputs, _process_dt

# ---------------------------------------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ReplayHistory:
    """The per-layer replay history of one Mamba2 layer (all zero-initialised by `allocate_replay_history`).

    x: (S, XB, L, H, P) input dtype, XB = 2 (per-step replay) or 1 (checkpointing); B: (S, 2, L, G, N) input
    dtype; dt: (S, 2, H, L) fp32 processed dt'; dA_cumsum: (S, 2, H, L) fp32 cumulative A * dt' since the
    last state write.
    """

    x: torch.Tensor
    B: torch.Tensor
    dt: torch.Tensor
    dA_cumsum: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.B, self.dt, self.dA_cumsum))

    @property
    def checkpointing(self) -> bool:
        """True for the checkpointing layout (single-buffered x): the state is written only on a flush."""
        return self.x.shape[1] == 1


def allocate_replay_history(
    num_slots: int, hist_len: int, nheads: int, head_dim: int, ngroups: int, d_state: int,
    *, dtype: torch.dtype, device: torch.device | str, checkpointing: bool = False,
) -> ReplayHistory:
    """Zero-initialised history buffers of one layer.

    `hist_len` (L): per-step replay: the largest T verified with; checkpointing: the window of tokens kept
    before the state is written (max(16, T) is the natural choice: the dots pad the token axis to 16 anyway).
    """
    if hist_len < 1:
        raise ValueError(f"allocate_replay_history: hist_len must be >= 1 (the verify width T), got {hist_len}")
    check_dtype(torch.empty(0, dtype=dtype), INPUT_DTYPES, "history", "allocate_replay_history")
    S, L, H, P, G, N = num_slots, hist_len, nheads, head_dim, ngroups, d_state
    return ReplayHistory(
        x=torch.zeros(S, 1 if checkpointing else 2, L, H, P, dtype=dtype, device=device),
        B=torch.zeros(S, 2, L, G, N, dtype=dtype, device=device),
        dt=torch.zeros(S, 2, H, L, dtype=torch.float32, device=device),
        dA_cumsum=torch.zeros(S, 2, H, L, dtype=torch.float32, device=device),
    )


def allocate_replay_slot_state(num_slots: int, *, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-initialised per-slot metadata shared by all layers: (prev_num_accepted, buffer_index), (S,) int32.

    Zeros are a valid state (nothing to replay, buffer 0), so a graph captured before the first fill reads
    defined values.
    """
    return (torch.zeros(num_slots, dtype=torch.int32, device=device),
            torch.zeros(num_slots, dtype=torch.int32, device=device))


# ---------------------------------------------------------------------------------------------------------
# Verify
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _replay_verify_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr,
    xh_ptr, Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr,
    T, L, P, N, heads_per_group, dt_min, dt_max,
    s_ss, s_sh, s_sp, s_sn,
    s_xb, s_xt, s_xh, s_xp,
    s_dtb, s_dtt, s_dth,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_Cb, s_Ct, s_Cg, s_Cn,
    s_ob, s_ot, s_oh, s_op,
    s_xhs, s_xhi, s_xht, s_xhh, s_xhp,
    s_Bhs, s_Bhi, s_Bht, s_Bhg, s_Bhn,
    s_dths, s_dthi, s_dthh, s_dtht,
    s_chs, s_chi, s_chh, s_cht,
    HAS_D: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, DOT_PRECISION: tl.constexpr, CHECKPOINT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (P block, batch row, head). d_state is walked in BLOCK_N chunks so that only one
    # (BLOCK_P, BLOCK_N) state tile is live at a time (a whole (P, 128) tile plus the dot operands spills).
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0
    s = tl.where(live, slot, 0)  # pad rows never dereference this: every cache access is masked below

    offs_t = tl.arange(0, BLOCK_T)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    # Liveness as vectors: the interpreter rejects a scalar bool broadcast into a mask.
    live_t = (tl.zeros([BLOCK_T], tl.int64) + slot) >= 0
    live_p = (tl.zeros([BLOCK_P], tl.int64) + slot) >= 0

    k = tl.load(pnat_ptr + s, mask=live, other=0).to(tl.int64)
    k = tl.minimum(tl.maximum(k, 0), L)
    rb = (tl.load(bufidx_ptr + s, mask=live, other=0) & 1).to(tl.int64)
    wb = 1 - rb
    if CHECKPOINT:
        # x has one buffer (each program reads and writes only its own (head, P block) of it); the state is
        # written only when the new tokens do not fit after the k pending ones, and then they go to 0.
        rbx = 0
        wbx = 0
        flush = k + T > L
        base = tl.where(flush, 0, k)
    else:
        rbx = rb
        wbx = wb
        flush = k >= 0  # always: every verify folds the accepted tokens into the state
        base = 0
    flush_t = (tl.zeros([BLOCK_T], tl.int32) + flush.to(tl.int32)) != 0
    flush_p = (tl.zeros([BLOCK_P], tl.int32) + flush.to(tl.int32)) != 0
    store_state_p = mask_p & live_p & flush_p & ((tl.zeros([BLOCK_P], tl.int64) + k) > 0)  # k = 0: nothing new
    first_p = (tl.zeros([BLOCK_T], tl.int32) + pid_p) == 0  # one program per (row, head) writes dt', cumsum
    first_h = (tl.zeros([BLOCK_T], tl.int64) + h % heads_per_group) == 0  # ... and per (row, group) B

    # ---- per-token quantities: old tokens (fast-forward weights), new tokens (dt', cumsum) ----
    mask_old = (offs_t < k) & live_t
    c_old = tl.load(cumh_ptr + s * s_chs + rb * s_chi + h * s_chh + offs_t * s_cht, mask=mask_old, other=0.0)
    dt_old = tl.load(dth_ptr + s * s_dths + rb * s_dthi + h * s_dthh + offs_t * s_dtht, mask=mask_old, other=0.0)
    c_last = tl.sum(tl.where(offs_t == k - 1, c_old, 0.0), axis=0)  # 0 when k == 0
    w = tl.where(mask_old, tl.exp(c_last - c_old) * dt_old, 0.0)  # (BLOCK_T,)
    x_old = tl.load(xh_ptr + s * s_xhs + rbx * s_xhi + offs_t[:, None] * s_xht + h * s_xhh + offs_p[None, :] * s_xhp,
                    mask=mask_old[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_P)
    xw_old = x_old * w[:, None]

    mask_t = offs_t < T
    A = tl.load(A_ptr + h).to(tl.float32)
    dt = tl.load(dt_ptr + b * s_dtb + offs_t * s_dtt + h * s_dth, mask=mask_t, other=0.0).to(tl.float32)
    dt = dt + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # softplus, torch's threshold of 20
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(mask_t, dt, 0.0)
    cum = tl.cumsum(A * dt, axis=0)  # (BLOCK_T,)
    x = tl.load(x_ptr + b * s_xb + offs_t[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                mask=mask_t[:, None] & mask_p[None, :], other=0.0)  # (BLOCK_T, BLOCK_P) input dtype

    # ---- the new tokens' x, dt', cumsum become history (checkpointing: after the pending ones) ----
    mask_tl = mask_t & live_t
    pos = base + offs_t
    tl.store(xh_ptr + s * s_xhs + wbx * s_xhi + pos[:, None] * s_xht + h * s_xhh + offs_p[None, :] * s_xhp,
             x.to(xh_ptr.dtype.element_ty), mask=mask_tl[:, None] & mask_p[None, :])
    mask_th = mask_tl & first_p
    cum_base = tl.where(flush, 0.0, c_last)  # checkpointing without a flush: the cumsum continues
    tl.store(dth_ptr + s * s_dths + wb * s_dthi + h * s_dthh + pos * s_dtht, dt, mask=mask_th)
    tl.store(cumh_ptr + s * s_chs + wb * s_chi + h * s_chh + pos * s_cht, cum + cum_base, mask=mask_th)
    if CHECKPOINT:
        # no flush: the pending tokens stay in the history, so the buffer written gets a copy of them
        keep = mask_old & (~flush_t) & first_p
        tl.store(dth_ptr + s * s_dths + wb * s_dthi + h * s_dthh + offs_t * s_dtht, dt_old, mask=keep)
        tl.store(cumh_ptr + s * s_chs + wb * s_chi + h * s_chh + offs_t * s_cht, c_old, mask=keep)

    # ---- walk d_state: 1. fast-forward the state chunk, 2. accumulate C h^T and C B^T ----
    decay_old = tl.exp(c_last)
    CH = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    CB = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        state_ptrs = state_ptr + s * s_ss + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
        hs = tl.load(state_ptrs, mask=(mask_p & live_p)[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        B_old = tl.load(Bh_ptr + s * s_Bhs + rb * s_Bhi + offs_t[:, None] * s_Bht + g * s_Bhg + offs_n[None, :] * s_Bhn,
                        mask=mask_old[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_T, BLOCK_N) history dtype
        # h <- exp(c_{k-1}) h + X_old^T (w B_old)
        hs = tl.dot(tl.trans(xw_old), B_old.to(tl.float32), acc=hs * decay_old, input_precision=DOT_PRECISION)
        tl.store(state_ptrs, hs.to(state_ptr.dtype.element_ty), mask=store_state_p[:, None] & mask_n[None, :])
        # later dots read the state as stored: replay rounds the state exactly where rewind's commit does
        hs = tl.where(flush, hs.to(state_ptr.dtype.element_ty).to(tl.float32), hs)
        Bn = tl.load(B_ptr + b * s_Bb + offs_t[:, None] * s_Bt + g * s_Bg + offs_n[None, :] * s_Bn,
                     mask=mask_t[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_T, BLOCK_N) input dtype
        Cn = tl.load(C_ptr + b * s_Cb + offs_t[:, None] * s_Ct + g * s_Cg + offs_n[None, :] * s_Cn,
                     mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        CH = tl.dot(Cn, tl.trans(hs), acc=CH, input_precision=DOT_PRECISION)  # (BLOCK_T, BLOCK_P)
        CB = tl.dot(Cn, tl.trans(Bn.to(tl.float32)), acc=CB, input_precision=DOT_PRECISION)  # (BLOCK_T, BLOCK_T)
        mask_tg = mask_th & first_h
        tl.store(Bh_ptr + s * s_Bhs + wb * s_Bhi + pos[:, None] * s_Bht + g * s_Bhg + offs_n[None, :] * s_Bhn,
                 Bn.to(Bh_ptr.dtype.element_ty), mask=mask_tg[:, None] & mask_n[None, :])
        if CHECKPOINT:
            tl.store(Bh_ptr + s * s_Bhs + wb * s_Bhi + offs_t[:, None] * s_Bht + g * s_Bhg + offs_n[None, :] * s_Bhn,
                     B_old, mask=(keep & first_h)[:, None] & mask_n[None, :])

    # ---- outputs: Y = exp(cum) * (C h^T) + ((C B^T) * L) X + D X ----
    xf = x.to(tl.float32)
    causal = offs_t[:, None] >= offs_t[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))  # masked before exp: no overflow
    y = tl.dot(tl.where(causal, CB * decay * dt[None, :], 0.0), xf, acc=CH * tl.exp(cum)[:, None],
               input_precision=DOT_PRECISION)
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * xf
    y = tl.where(live_t[:, None], y, 0.0)
    tl.store(out_ptr + b * s_ob + offs_t[:, None] * s_ot + h * s_oh + offs_p[None, :] * s_op,
             y.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_p[None, :])


def _check_history(state, x, B, history, prev_num_accepted, buffer_index, name):
    S, H, P, N = state.shape
    T, G = x.shape[1], B.shape[2]
    if history.x.dim() != 5 or history.x.shape[1] not in (1, 2):
        raise ValueError(f"{name}: history.x must be (S, 2 or 1, L, H, P), got shape {tuple(history.x.shape)}")
    L = history.x.shape[2]
    if L < T:
        raise ValueError(f"{name}: history length L = {L} < T = {T}; allocate the history with hist_len >= "
                         f"the largest verify width")
    check_shape(history.x, (S, history.x.shape[1], L, H, P), "history.x", name)
    check_shape(history.B, (S, 2, L, G, N), "history.B", name)
    check_shape(history.dt, (S, 2, H, L), "history.dt", name)
    check_shape(history.dA_cumsum, (S, 2, H, L), "history.dA_cumsum", name)
    check_dtype(history.x, INPUT_DTYPES, "history.x", name)
    check_dtype(history.B, INPUT_DTYPES, "history.B", name)
    check_dtype(history.dt, (torch.float32,), "history.dt", name)
    check_dtype(history.dA_cumsum, (torch.float32,), "history.dA_cumsum", name)
    check_shape(prev_num_accepted, (S,), "prev_num_accepted", name)
    check_shape(buffer_index, (S,), "buffer_index", name)
    check_dtype(prev_num_accepted, (torch.int32,), "prev_num_accepted", name)
    check_dtype(buffer_index, (torch.int32,), "buffer_index", name)
    return L


def replay_verify(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    slot_ids: torch.Tensor,
    history: ReplayHistory,
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    *,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
    block_n: int | None = None,
    dot_precision: str | None = None,
    num_warps: int = 8,
) -> torch.Tensor:
    """Replay verify of one Mamba2 layer (Triton): fast-forward by PNAT old tokens, outputs of T new ones.

    Args:
        state: (S, H, P, N) float32 / bfloat16 / float16 committed state cache; mutated for live rows with
            PNAT > 0 (it becomes the state after the accepted tokens of the previous verify); with a
            checkpointing history only on a flush (PNAT + T > L).
        x: (B, T, H, P); dt: (B, T, H) raw; A: (H,) fp32 = -exp(A_log); B, C: (B, T, G, N); D: (H,) or None;
            dt_bias: (H,): as in `kernels.mamba2_ssu.selective_state_update`.
        slot_ids: (B,) int32 / int64; negative = PAD (no cache buffer read or written, output row zero).
            Rows must name distinct slots.
        history: this layer's `ReplayHistory` (L >= T). Reads buffer buffer_index[s] (its first PNAT[s]
            tokens), writes the first T tokens of buffer 1 - buffer_index[s]; the rest is untouched.
            A checkpointing history (x with one buffer) works as in the module docstring.
        prev_num_accepted: (S,) int32 PNAT, tokens of the last verify that were accepted (0 = none to replay);
            read only here (clamped to [0, L]); `replay_advance` updates it once per step.
        buffer_index: (S,) int32, read only here (taken modulo 2); `replay_advance` flips it.
        time_step_limit: (min, max) clamp of dt after softplus.
        out: optional (B, T, H, P) output buffer; allocated like x when None.
        block_p: head_dim rows per program (power of two >= 16); default 32 capped by next_pow2(P).
        block_n: d_state chunk walked per iteration (power of two >= 16); default 32 capped by next_pow2(N).
        num_warps: warps per program (default 8).
        dot_precision: tl.dot input precision for the fp32 operands: 'ieee' | 'tf32x3' | 'tf32'; default
            'ieee' in the interpreter, 'tf32x3' on a GPU.

    Returns:
        out: (B, T, H, P), equal to the rewind verify's output from the state after PNAT accepted tokens.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, or history length L < T.
    """
    name = "replay_verify"
    S, H, P, N, Bsz, T, G = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    L = _check_history(state, x, B, history, prev_num_accepted, buffer_index, name)
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    check_shape(out, (Bsz, T, H, P), "out", name)
    tensors = [state, x, dt, A, B, C, dt_bias, slot_ids, out, history.x, history.B, history.dt,
               history.dA_cumsum, prev_num_accepted, buffer_index] + ([D] if D is not None else [])
    check_launchable(*tensors, name=name)
    dot_precision = dot_precision or default_dot_precision()
    if dot_precision not in ("ieee", "tf32x3", "tf32"):
        raise ValueError(f"{name}: dot_precision must be 'ieee', 'tf32x3' or 'tf32', got {dot_precision!r}")
    if Bsz == 0:
        return out

    BLOCK_T = max(16, triton.next_power_of_2(L))
    # Defaults from the register report of the sm_90 compile (cuobjdump -res-usage): (32, 32) with 8 warps
    # keeps the tf32x3 variant at 255 registers with a 16-byte stack; larger tiles spill hundreds of bytes.
    BLOCK_P = block_p or max(16, min(32, triton.next_power_of_2(P)))
    BLOCK_N = block_n or max(16, min(32, triton.next_power_of_2(N)))
    for blk, what in ((BLOCK_P, "block_p"), (BLOCK_N, "block_n")):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name}: {what} must be a power of two >= 16 (tl.dot minimum), got {blk}")
    lo, hi = time_step_limit
    has_limit = lo > 0.0 or hi < math.inf
    grid = (triton.cdiv(P, BLOCK_P), Bsz, H)
    _replay_verify_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else A, dt_bias, slot_ids, out,
        history.x, history.B, history.dt, history.dA_cumsum, prev_num_accepted, buffer_index,
        T, L, P, N, H // G, float(lo), float(hi) if hi < math.inf else 3.0e38,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *out.stride(),
        *history.x.stride(), *history.B.stride(), *history.dt.stride(), *history.dA_cumsum.stride(),
        HAS_D=D is not None, HAS_DT_LIMIT=has_limit, DOT_PRECISION=dot_precision,
        CHECKPOINT=history.checkpointing, BLOCK_T=BLOCK_T, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N,
        num_warps=num_warps,
    )
    return out


def _fast_forward_ref(hs, history, s, r, k, A):
    """hs (H, P, N) fp32 advanced one token at a time by the first k history tokens of slot s, buffer r."""
    hpg = hs.shape[0] // history.B.shape[3]
    xr = 0 if history.checkpointing else r
    for j in range(k):
        dtj = history.dt[s, r, :, j]  # (H,)
        Bj = history.B[s, r, j].float().repeat_interleave(hpg, dim=0)  # (H, N)
        xj = history.x[s, xr, j].float()  # (H, P)
        hs = hs * torch.exp(A.float() * dtj)[:, None, None] + (dtj[:, None] * xj)[..., None] * Bj[:, None, :]
    return hs


def replay_verify_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    slot_ids: torch.Tensor,
    history: ReplayHistory,
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    *,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
    block_n: int | None = None,
    dot_precision: str | None = None,
    num_warps: int = 8,
) -> torch.Tensor:
    """PyTorch reference of `replay_verify` (same arguments and effects; block sizes, dot_precision ignored).

    Independent of the kernel's closed form: the fast-forward replays the old tokens one at a time with
    exp(A dt'_j) from `history.dt`, and the outputs run the recurrence token by token.
    """
    del block_p, block_n, dot_precision, num_warps
    name = "replay_verify_ref"
    S, H, P, N, Bsz, T, G = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    L = _check_history(state, x, B, history, prev_num_accepted, buffer_index, name)
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    out.zero_()
    hpg = H // G
    A = A.float()
    ckpt = history.checkpointing
    for b in (slot_ids >= 0).nonzero().squeeze(1).tolist():
        s = int(slot_ids[b])
        k = min(max(int(prev_num_accepted[s]), 0), L)
        r = int(buffer_index[s]) & 1
        w = 1 - r
        flush = not ckpt or k + T > L  # per-step replay always folds the accepted tokens into the state
        hs = _fast_forward_ref(state[s].float(), history, s, r, k, A)
        if flush and k > 0:
            state[s] = hs.to(state.dtype)
            hs = state[s].float()
        dtp = _process_dt(dt[b], dt_bias, time_step_limit)  # (T, H)
        Bh = B[b].float().repeat_interleave(hpg, dim=1)  # (T, H, N)
        Ch = C[b].float().repeat_interleave(hpg, dim=1)
        xb = x[b].float()
        for t in range(T):
            hs = hs * torch.exp(A * dtp[t])[:, None, None] + (dtp[t][:, None] * xb[t])[..., None] * Bh[t][:, None, :]
            y = (hs * Ch[t][:, None, :]).sum(-1)
            if D is not None:
                y = y + D.float()[:, None] * xb[t]
            out[b, t] = y.to(out.dtype)
        base, cum_base = (0, 0.0) if flush else (k, history.dA_cumsum[s, r, :, k - 1 : k] if k else 0.0)
        if ckpt and not flush:  # the pending tokens stay: copy them into the buffer written now
            history.B[s, w, :k] = history.B[s, r, :k]
            history.dt[s, w, :, :k] = history.dt[s, r, :, :k]
            history.dA_cumsum[s, w, :, :k] = history.dA_cumsum[s, r, :, :k]
        pos = slice(base, base + T)
        history.x[s, 0 if ckpt else w, pos] = x[b].to(history.x.dtype)
        history.B[s, w, pos] = B[b].to(history.B.dtype)
        history.dt[s, w, :, pos] = dtp.T
        history.dA_cumsum[s, w, :, pos] = cum_base + torch.cumsum(A[:, None] * dtp.T, dim=1)
    return out


# ---------------------------------------------------------------------------------------------------------
# Bookkeeping after acceptance (once per step, shared by all layers)
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _replay_advance_kernel(pnat_ptr, bufidx_ptr, slot_ptr, nat_ptr, Bsz, T, L,
                           CHECKPOINT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = offs < Bsz
    slot = tl.load(slot_ptr + offs, mask=in_batch, other=-1).to(tl.int64)
    live = in_batch & (slot >= 0)  # the same predicate as the verify kernel: PAD rows never advance
    s = tl.where(live, slot, 0)
    nat = tl.load(nat_ptr + offs, mask=live, other=1)
    nat = tl.minimum(tl.maximum(nat, 1), T)
    r = tl.load(bufidx_ptr + s, mask=live, other=0)
    if CHECKPOINT:  # the verify kernel's flush predicate: pending tokens stay unless k + T > L
        k = tl.load(pnat_ptr + s, mask=live, other=0)
        k = tl.minimum(tl.maximum(k, 0), L)
        nat = tl.where(k + T > L, nat, nat + k)
    tl.store(pnat_ptr + s, nat.to(tl.int32), mask=live)
    tl.store(bufidx_ptr + s, (1 - (r & 1)).to(tl.int32), mask=live)


def _check_advance(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, T, hist_len, name):
    if hist_len is not None and hist_len < T:
        raise ValueError(f"{name}: hist_len {hist_len} < T = {T}: pass the L the history was allocated with")
    check_dtype(prev_num_accepted, (torch.int32,), "prev_num_accepted", name)
    check_dtype(buffer_index, (torch.int32,), "buffer_index", name)
    check_shape(buffer_index, tuple(prev_num_accepted.shape), "buffer_index", name)
    if slot_ids.dim() != 1:
        raise ValueError(f"{name}: slot_ids must be (B,), got {tuple(slot_ids.shape)}")
    check_shape(num_accepted_tokens, tuple(slot_ids.shape), "num_accepted_tokens", name)
    for t, what in ((slot_ids, "slot_ids"), (num_accepted_tokens, "num_accepted_tokens")):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {what} must be int32 or int64, got {t.dtype}")
    if T < 1:
        raise ValueError(f"{name}: T (tokens per verify) must be >= 1, got {T}")


def replay_advance(
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    T: int,
    *,
    hist_len: int | None = None,
) -> None:
    """Per-slot bookkeeping after acceptance (Triton): PNAT[s] = num_accepted, flip buffer_index[s].

    Call exactly once per verify step, after every layer's `replay_verify` (the metadata is shared by all
    layers; advancing twice replays the wrong buffer).

    Args:
        prev_num_accepted, buffer_index: (S,) int32, mutated for live rows.
        slot_ids: (B,) int32 / int64; negative = PAD, never advances.
        num_accepted_tokens: (B,) int32 / int64, clamped to [1, T].
        T: tokens per row of the verify that just ran.
        hist_len: checkpointing histories only: their L. Then PNAT counts all pending tokens: it becomes
            num_accepted after a flush (old PNAT + T > L) and old PNAT + num_accepted otherwise.

    Graph-capturable: no host synchronisation.
    """
    name = "replay_advance"
    _check_advance(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, T, hist_len, name)
    check_launchable(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, name=name)
    Bsz = slot_ids.shape[0]
    if Bsz == 0:
        return
    BLOCK = min(1024, triton.next_power_of_2(Bsz))
    _replay_advance_kernel[(triton.cdiv(Bsz, BLOCK),)](
        prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, Bsz, T, hist_len or T,
        CHECKPOINT=hist_len is not None, BLOCK=BLOCK)


def replay_advance_ref(
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    T: int,
    *,
    hist_len: int | None = None,
) -> None:
    """PyTorch reference of `replay_advance` (same arguments and effects)."""
    name = "replay_advance_ref"
    _check_advance(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, T, hist_len, name)
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    slots = slot_ids[rows].long()
    nat = num_accepted_tokens[rows].clamp(1, T).to(torch.int32)
    if hist_len is not None:
        k = prev_num_accepted[slots].clamp(0, hist_len)
        nat = torch.where(k + T > hist_len, nat, nat + k)
    prev_num_accepted[slots] = nat
    buffer_index[slots] = 1 - (buffer_index[slots] & 1)


def replay_reset_slots(prev_num_accepted: torch.Tensor, slot_ids: torch.Tensor) -> None:
    """Mark slots whose state was just written by prefill as having nothing to replay (PNAT = 0).

    Args:
        prev_num_accepted: (S,) int32, mutated.
        slot_ids: (B,) int slot ids of the admitted requests; negative entries (PAD) are ignored.
    """
    live = slot_ids[slot_ids >= 0].long()
    prev_num_accepted.index_fill_(0, live, 0)


def replay_materialized_state_ref(
    state: torch.Tensor,
    history: ReplayHistory,
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    A: torch.Tensor,
) -> torch.Tensor:
    """The state every slot would have after its pending fast-forward, without mutating anything.

    Returns a float32 (S, H, P, N) copy: state[s] advanced by the first PNAT[s] tokens of buffer
    buffer_index[s], one token at a time. Used to compare replay against rewind between steps.
    """
    L = history.x.shape[2]
    res = state.float().clone()
    for s in range(state.shape[0]):
        k = min(max(int(prev_num_accepted[s]), 0), L)
        res[s] = _fast_forward_ref(res[s], history, s, int(buffer_index[s]) & 1, k, A)
    return res
