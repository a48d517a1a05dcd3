"""Mamba2 selective state update for decode (T = 1) and for the MTP verify step by "rewind" (T = K + 1).

Scope: the recurrent SSM step of a Mamba2 mixer after the causal conv, on a slot-indexed state cache.
The gate is not here: NemotronH applies y * silu(z) inside its grouped RMSNorm (gate before norm, BRIEF 2b),
so the engine's gated norm owns it. Each operation has a Triton kernel + launcher and a plain-PyTorch
reference with the same signature (`*_ref`), which is the specification the tests hold the kernel to.

Math (per batch row b, head h, group g = h // (H / G), BRIEF section 4):
    dt'_t = softplus(dt_t + dt_bias_h), clamped to time_step_limit
    h_t   = exp(A_h dt'_t) h_{t-1} + dt'_t x_t (outer) B_t          h: (P, N), fp32 in registers
    y_t   = h_t C_t + D_h x_t

Rewind (the baseline scheme of SGLang / TensorRT-LLM / FlashInfer): the verify runs T steps from the stored
state without touching it and writes every intermediate state h_t to `intermediate_states[b, t]`; after
acceptance `commit_intermediate_state` copies h_{num_accepted - 1} of each row into its slot.

Design decisions:
- `intermediate_states` is indexed by batch row (B, T, H, P, N), not by slot: the buffer is sized by the
  largest verify batch, and commit reads row b for slot slot_ids[b].
- PAD rows (slot id < 0) read and write no cache buffer (state, intermediate states); their output rows are
  written with zeros so a CUDA-graph-captured batch never carries stale memory forward. Slot 0 is live.
- All arithmetic is fp32 whatever the state / input dtype; the state is rounded to its dtype once per store.
- No autotune: the kernel updates state in place, and autotune would run it several times on one state.
- Strided (non-contiguous) views of the caches and inputs are supported: every stride is passed.
- Source: the recurrence as in mamba_ssm's `selective_state_update` (state-spaces/mamba) and FlashInfer's
  multi-token variant; written from the math above.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import (
    INPUT_DTYPES,
    STATE_DTYPES,
    check_dtype,
    check_launchable,
    check_shape,
)

_NO_LIMIT = (0.0, math.inf)


def _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name):
    """Validate the shared argument set; returns (S, H, P, N, Bsz, T, G)."""
    if state.dim() != 4:
        raise ValueError(f"{name}: state must be (S, H, P, N), got shape {tuple(state.shape)}")
    S, H, P, N = state.shape
    if x.dim() != 4:
        raise ValueError(f"{name}: x must be (B, T, H, P), got shape {tuple(x.shape)}")
    Bsz, T = x.shape[:2]
    check_shape(x, (Bsz, T, H, P), "x", name)
    check_shape(dt, (Bsz, T, H), "dt", name)
    if B.dim() != 4:
        raise ValueError(f"{name}: B must be (B, T, G, N), got shape {tuple(B.shape)}")
    G = B.shape[2]
    check_shape(B, (Bsz, T, G, N), "B", name)
    check_shape(C, (Bsz, T, G, N), "C", name)
    if G == 0 or H % G != 0:
        raise ValueError(f"{name}: nheads {H} must be a multiple of ngroups {G}")
    check_shape(A, (H,), "A", name)
    check_shape(dt_bias, (H,), "dt_bias", name)
    if D is not None:
        check_shape(D, (H,), "D", name)
    check_shape(slot_ids, (Bsz,), "slot_ids", name)
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: slot_ids must be int32 or int64, got {slot_ids.dtype}")
    check_dtype(state, STATE_DTYPES, "state", name)
    for t, what in ((x, "x"), (B, "B"), (C, "C"), (dt, "dt")):
        check_dtype(t, INPUT_DTYPES, what, name)
    if T < 1:
        raise ValueError(f"{name}: need at least one token per row (T >= 1), got T = {T}")
    return S, H, P, N, Bsz, T, G


def _process_dt(dt, dt_bias, time_step_limit):
    """dt' = clamp(softplus(dt + dt_bias), *time_step_limit) in fp32; dt (..., H), dt_bias (H,)."""
    dtp = F.softplus(dt.float() + dt_bias.float())
    lo, hi = time_step_limit
    return dtp.clamp(min=lo, max=hi)


# ---------------------------------------------------------------------------------------------------------
# Selective state update (decode T = 1, rewind verify T = K + 1)
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr, inter_ptr,
    T, P, N, heads_per_group, dt_min, dt_max,
    s_ss, s_sh, s_sp, s_sn,
    s_xb, s_xt, s_xh, s_xp,
    s_dtb, s_dtt, s_dth,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_Cb, s_Ct, s_Cg, s_Cn,
    s_ob, s_ot, s_oh, s_op,
    s_ib, s_it, s_ih, s_ip, s_in,
    HAS_D: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    WRITE_INTERMEDIATE: tl.constexpr, UPDATE_STATE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (P block, batch row, head); the state tile (BLOCK_P, N) stays in registers over T.
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0
    s = tl.where(live, slot, 0)  # pad rows never dereference this: every cache access is masked by `live`

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    # A vector copy of the row's liveness: the interpreter rejects a scalar bool broadcast into a mask.
    live_p = (tl.zeros([BLOCK_P], tl.int64) + slot) >= 0
    mask_live = mask_pn & live_p[:, None]

    state_ptrs = state_ptr + s * s_ss + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    hs = tl.load(state_ptrs, mask=mask_live, other=0.0).to(tl.float32)

    A = tl.load(A_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + h).to(tl.float32)

    for t in range(T):
        x = tl.load(x_ptr + b * s_xb + t * s_xt + h * s_xh + offs_p * s_xp, mask=mask_p, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + b * s_dtb + t * s_dtt + h * s_dth).to(tl.float32) + dt_bias
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # softplus, torch's threshold of 20
        if HAS_DT_LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        Bv = tl.load(B_ptr + b * s_Bb + t * s_Bt + g * s_Bg + offs_n * s_Bn, mask=mask_n, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + b * s_Cb + t * s_Ct + g * s_Cg + offs_n * s_Cn, mask=mask_n, other=0.0).to(tl.float32)
        hs = hs * tl.exp(A * dt) + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(hs * Cv[None, :], axis=1)
        if HAS_D:
            y += D * x
        y = tl.where(live, y, 0.0)
        tl.store(out_ptr + b * s_ob + t * s_ot + h * s_oh + offs_p * s_op, y.to(out_ptr.dtype.element_ty), mask=mask_p)
        if WRITE_INTERMEDIATE:
            inter_ptrs = inter_ptr + b * s_ib + t * s_it + h * s_ih + offs_p[:, None] * s_ip + offs_n[None, :] * s_in
            tl.store(inter_ptrs, hs.to(inter_ptr.dtype.element_ty), mask=mask_live)

    if UPDATE_STATE:
        tl.store(state_ptrs, hs.to(state_ptr.dtype.element_ty), mask=mask_live)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    intermediate_states: torch.Tensor | None = None,
    update_state: bool | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
) -> torch.Tensor:
    """T steps of the Mamba2 recurrence per batch row on a slot-indexed state cache (Triton).

    Args:
        state: (S, H, P, N) float32 / bfloat16 / float16 state cache; updated in place only if `update_state`.
        x: (B, T, H, P) SSM input (after conv + SiLU), float32 / bfloat16 / float16.
        dt: (B, T, H) raw time step (before dt_bias and softplus).
        A: (H,) float32, A = -exp(A_log).
        B, C: (B, T, G, N) input / output projections; head h uses group h // (H / G).
        D: (H,) skip coefficient or None.
        dt_bias: (H,) added to dt before softplus.
        slot_ids: (B,) int32 / int64 slot of each row; negative = PAD (reads and writes no cache buffer,
            output row is zero). Rows must name distinct slots.
        intermediate_states: optional (B, T, H, P, N) buffer in any state dtype; row b, position t receives
            the state after token t (rewind). PAD rows are left untouched.
        update_state: write the state after the last token back into `state[slot_ids[b]]`. Defaults to True
            without `intermediate_states` (decode) and False with it (rewind verify: the stored state stays
            as it was until `commit_intermediate_state`).
        time_step_limit: (min, max) clamp applied to dt after softplus; (0, inf) means none.
        out: optional (B, T, H, P) output buffer (any input dtype); allocated like x when None.
        block_p: rows of head_dim per program (power of two); default min(16, next_pow2(P)).

    Returns:
        out: (B, T, H, P), y_t = C_t . h_t + D x_t (no gate: the gated RMSNorm applies silu(z)).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (the message names the argument).
    """
    name = "selective_state_update"
    S, H, P, N, Bsz, T, G = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    if update_state is None:
        update_state = intermediate_states is None
    if intermediate_states is not None:
        check_shape(intermediate_states, (Bsz, T, H, P, N), "intermediate_states", name)
        check_dtype(intermediate_states, STATE_DTYPES, "intermediate_states", name)
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    check_shape(out, (Bsz, T, H, P), "out", name)
    tensors = [state, x, dt, A, B, C, dt_bias, slot_ids, out]
    tensors += [t for t in (D, intermediate_states) if t is not None]
    check_launchable(*tensors, name=name)
    if Bsz == 0:
        return out

    BLOCK_P = block_p or min(16, triton.next_power_of_2(P))
    BLOCK_N = triton.next_power_of_2(N)
    inter = intermediate_states if intermediate_states is not None else out  # placeholder, never touched
    inter_strides = intermediate_states.stride() if intermediate_states is not None else (0,) * 5
    lo, hi = time_step_limit
    has_limit = lo > 0.0 or hi < math.inf
    grid = (triton.cdiv(P, BLOCK_P), Bsz, H)
    _ssu_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else A, dt_bias, slot_ids, out, inter,
        T, P, N, H // G, float(lo), float(hi) if hi < math.inf else 3.0e38,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *out.stride(), *inter_strides,
        HAS_D=D is not None, HAS_DT_LIMIT=has_limit,
        WRITE_INTERMEDIATE=intermediate_states is not None, UPDATE_STATE=bool(update_state),
        BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N,
        num_warps=4 if BLOCK_P * BLOCK_N >= 2048 else 2,
    )
    return out


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    intermediate_states: torch.Tensor | None = None,
    update_state: bool | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
) -> torch.Tensor:
    """PyTorch reference of `selective_state_update` (same arguments, same effects; `block_p` ignored).

    Runs the recurrence one token at a time in float32 on the gathered live rows.
    """
    del block_p
    name = "selective_state_update_ref"
    S, H, P, N, Bsz, T, G = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    if update_state is None:
        update_state = intermediate_states is None
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    live = slot_ids >= 0
    rows = live.nonzero().squeeze(1)
    slots = slot_ids[rows].long()
    out.zero_()
    hpg = H // G
    hs = state[slots].float()  # (R, H, P, N)
    dtp = _process_dt(dt[rows], dt_bias, time_step_limit)  # (R, T, H)
    Bh = B[rows].float().repeat_interleave(hpg, dim=2)  # (R, T, H, N)
    Ch = C[rows].float().repeat_interleave(hpg, dim=2)
    xr = x[rows].float()  # (R, T, H, P)
    for t in range(T):
        dA = torch.exp(A.float() * dtp[:, t])  # (R, H)
        hs = hs * dA[..., None, None] + (dtp[:, t, :, None] * xr[:, t])[..., None] * Bh[:, t, :, None, :]
        y = (hs * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + D.float()[:, None] * xr[:, t]
        out[rows, t] = y.to(out.dtype)
        if intermediate_states is not None:
            intermediate_states[rows, t] = hs.to(intermediate_states.dtype)
    if update_state:
        state[slots] = hs.to(state.dtype)
    return out


def allocate_intermediate_states(
    max_batch: int, T: int, nheads: int, head_dim: int, d_state: int, *, dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Zero-initialised rewind buffer (max_batch, T, H, P, N) for `selective_state_update` and commit.

    Only speculative decoding needs it: allocate it only when the draft length is > 0 (it is T full states
    per row per layer).
    """
    check_dtype(torch.empty(0, dtype=dtype), STATE_DTYPES, "intermediate_states", "allocate_intermediate_states")
    return torch.zeros(max_batch, T, nheads, head_dim, d_state, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------------------
# Rewind commit: state[slot_ids[b]] <- intermediate_states[b, num_accepted_tokens[b] - 1]
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _commit_kernel(
    state_ptr, inter_ptr, slot_ptr, nat_ptr,
    T, P, N,
    s_ss, s_sh, s_sp, s_sn,
    s_ib, s_it, s_ih, s_ip, s_in,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0
    s = tl.where(live, slot, 0)
    nat = tl.load(nat_ptr + b).to(tl.int64)
    col = tl.minimum(tl.maximum(nat, 1), T) - 1  # num_accepted_tokens clamped to [1, T]
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    live_p = (tl.zeros([BLOCK_P], tl.int64) + slot) >= 0  # vector: the interpreter rejects a scalar mask
    mask = ((offs_p < P) & live_p)[:, None] & (offs_n[None, :] < N)
    v = tl.load(inter_ptr + b * s_ib + col * s_it + h * s_ih + offs_p[:, None] * s_ip + offs_n[None, :] * s_in, mask=mask)
    tl.store(state_ptr + s * s_ss + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn,
             v.to(state_ptr.dtype.element_ty), mask=mask)


def _check_commit(state, intermediate_states, slot_ids, num_accepted_tokens, name):
    if state.dim() != 4 or intermediate_states.dim() != 5:
        raise ValueError(f"{name}: state must be (S, H, P, N) and intermediate_states (B, T, H, P, N), "
                         f"got {tuple(state.shape)} and {tuple(intermediate_states.shape)}")
    Bsz, T = intermediate_states.shape[:2]
    check_shape(intermediate_states, (Bsz, T, *state.shape[1:]), "intermediate_states", name)
    if slot_ids.dim() != 1 or slot_ids.shape[0] > Bsz:
        raise ValueError(f"{name}: slot_ids must be (B,) with B <= {Bsz} rows of intermediate_states, "
                         f"got {tuple(slot_ids.shape)}")
    check_shape(num_accepted_tokens, tuple(slot_ids.shape), "num_accepted_tokens", name)
    for t, what in ((slot_ids, "slot_ids"), (num_accepted_tokens, "num_accepted_tokens")):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {what} must be int32 or int64, got {t.dtype}")
    return Bsz, T


def commit_intermediate_state(
    state: torch.Tensor,
    intermediate_states: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    """Rewind commit (Triton): state[slot_ids[b]] <- intermediate_states[b, num_accepted_tokens[b] - 1].

    Args:
        state: (S, H, P, N) state cache; mutated for live rows only.
        intermediate_states: (B', T, H, P, N) written by `selective_state_update(..., intermediate_states=)`;
            B' >= B (a buffer sized for the largest batch).
        slot_ids: (B,) int32 / int64; negative = PAD (nothing read or written).
        num_accepted_tokens: (B,) int32 / int64 tokens that advance each row, in [1, T]. Values outside are
            clamped to [1, T] (stale or padding rows must never index out of range); validate upstream if
            such values should be an error.

    Graph-capturable: no host synchronisation.
    """
    name = "commit_intermediate_state"
    _, T = _check_commit(state, intermediate_states, slot_ids, num_accepted_tokens, name)
    check_launchable(state, intermediate_states, slot_ids, num_accepted_tokens, name=name)
    Bsz = slot_ids.shape[0]
    if Bsz == 0:
        return
    _, H, P, N = state.shape
    BLOCK_P = min(32, triton.next_power_of_2(P))
    BLOCK_N = triton.next_power_of_2(N)
    grid = (triton.cdiv(P, BLOCK_P), Bsz, H)
    _commit_kernel[grid](
        state, intermediate_states, slot_ids, num_accepted_tokens, T, P, N,
        *state.stride(), *intermediate_states.stride(), BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N,
    )


def commit_intermediate_state_ref(
    state: torch.Tensor,
    intermediate_states: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    """PyTorch reference of `commit_intermediate_state` (same arguments and effects)."""
    _, T = _check_commit(state, intermediate_states, slot_ids, num_accepted_tokens, "commit_intermediate_state_ref")
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    col = num_accepted_tokens[rows].long().clamp(1, T) - 1
    state[slot_ids[rows].long()] = intermediate_states[rows, col].to(state.dtype)
