"""Mamba2 selective state update: decode (T = 1) and the MTP verify step by "rewind" (T = K + 1).

Scope: the recurrent SSM step of a Mamba2 mixer after the causal conv, on a slot-indexed state cache: the Triton
kernel `selective_state_update`, its plain-PyTorch reference `selective_state_update_ref` (same signature,
vectorised over the batch: the engine's path for ssm_backend="torch"), and `ssm_recurrent_scan`, the
token-by-token recurrence on gathered states that the reference is built on (the specification; also the
reference of `kernels.mamba2.chunk.ssd_chunked_scan`). The gate is not here: NemotronH applies y * silu(z)
inside its grouped RMSNorm (gate before norm, as transformers' NemotronH mixer), so the engine's gated norm owns
it. The commit after a rewind verify is family-agnostic: `kernels.commit.rewind_commit`.

Math (per batch row b, head h, group g = h // (H / G); Mamba2, Dao & Gu, "Transformers are SSMs", 2024):
    dt'_t = softplus(dt_t + dt_bias_h), clamped to time_step_limit
    h_t   = exp(A_h dt'_t) h_{t-1} + dt'_t x_t (outer) B_t          h: (P, N), fp32 in registers
    y_t   = h_t C_t + D_h x_t

Rewind (the baseline scheme of SGLang / TensorRT-LLM / FlashInfer): the verify runs T steps from the stored
state without touching it and writes every intermediate state h_t to a buffer; after acceptance
`kernels.commit.rewind_commit` copies h_{num_accepted - 1} of each row into its slot.

Design decisions:
- `intermediate_states` is (B', T, H, P, N): row b by default, or row `intermediate_state_indices[b]`
  (FlashInfer's argument of that name; the engine passes the slot ids, so its buffer is indexed like the state).
- PAD rows (slot id < 0) read and write no cache buffer (state, intermediate states); their output rows are
  written with zeros so a CUDA-graph-captured batch never carries stale memory forward. Slot 0 is live.
- All arithmetic is fp32 whatever the state / input dtype; the state is rounded to its dtype once per store.
- No autotune: the kernel updates state in place, and autotune would run it several times on one state.
- Strided (non-contiguous) views of the caches and inputs are supported: every stride is passed.
- Source: the recurrence as in mamba_ssm's `selective_state_update` (state-spaces/mamba,
  mamba_ssm/ops/triton/selective_state_update.py) and FlashInfer's multi-token variant
  (`flashinfer.mamba.selective_state_update`); written from the math above.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import (
    INDEX_DTYPES,
    INPUT_DTYPES,
    STATE_DTYPES,
    check_dtype,
    check_launchable,
    check_rows,
    check_shape,
)
from kernels.rounding import (
    StochasticRounding,
    intermediate_rows,
    launch_args,
    round_to_state,
    stochastic_round_ref,
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
    if slot_ids.dtype not in INDEX_DTYPES:
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
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr, inter_ptr, idx_ptr,
    sr_seed_ptr, sr_step_ptr, sr_salt,
    T, H, P, N, heads_per_group, dt_min, dt_max,
    s_ss, s_sh, s_sp, s_sn,
    s_xb, s_xt, s_xh, s_xp,
    s_dtb, s_dtt, s_dth,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_Cb, s_Ct, s_Cg, s_Cn,
    s_ob, s_ot, s_oh, s_op,
    s_ib, s_it, s_ih, s_ip, s_in,
    HAS_D: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    WRITE_INTERMEDIATE: tl.constexpr, HAS_INDICES: tl.constexpr, UPDATE_STATE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, SR: tl.constexpr, SR_ROUNDS: tl.constexpr,
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
    if HAS_INDICES:  # the row of the intermediate-state buffer (PAD rows: never dereferenced)
        ib = tl.where(live, tl.load(idx_ptr + b).to(tl.int64), 0)
    else:
        ib = b

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
            inter_ptrs = inter_ptr + ib * s_ib + t * s_it + h * s_ih + offs_p[:, None] * s_ip + offs_n[None, :] * s_in
            hr = round_to_state(hs, inter_ptr, intermediate_rows(((ib * T + t) * H + h) * P + offs_p), 0,
                                sr_seed_ptr, sr_step_ptr, sr_salt, BLOCK_P, BLOCK_N, BLOCK_N, SR, SR_ROUNDS)
            tl.store(inter_ptrs, hr.to(inter_ptr.dtype.element_ty), mask=mask_live)

    if UPDATE_STATE:
        hr = round_to_state(hs, state_ptr, (s * H + h) * P + offs_p, 0, sr_seed_ptr, sr_step_ptr, sr_salt, BLOCK_P,
                            BLOCK_N, BLOCK_N, SR, SR_ROUNDS)
        tl.store(state_ptrs, hr.to(state_ptr.dtype.element_ty), mask=mask_live)


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
    intermediate_state_indices: torch.Tensor | None = None,
    update_state: bool | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
    stochastic_rounding: StochasticRounding | None = None,
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
        intermediate_states: optional (B', T, H, P, N) buffer in any state dtype; position t of row b's buffer
            row receives the state after token t (rewind). PAD rows leave it untouched.
        intermediate_state_indices: optional (B,) int32 / int64: the buffer row of batch row b, in [0, B')
            (FlashInfer's argument of that name); default row b (then B' >= B).
        update_state: write the state after the last token back into `state[slot_ids[b]]`. Defaults to True
            without `intermediate_states` (decode) and False with it (rewind verify: the stored state stays
            as it was until `kernels.commit.rewind_commit`).
        time_step_limit: (min, max) clamp applied to dt after softplus; (0, inf) means none.
        out: optional (B, T, H, P) output buffer (float32 / bfloat16 / float16); allocated like x when None.
        block_p: rows of head_dim per program (power of two); default min(16, next_pow2(P)).
        stochastic_rounding: a `kernels.rounding.StochasticRounding` to round the 16-bit writes (the state
            and / or the intermediate states) stochastically; None rounds to nearest. Each write is one
            rounding of the fp32 value held in registers (the recurrence itself stays fp32 across tokens).

    Returns:
        out: (B, T, H, P), y_t = C_t . h_t + D x_t (no gate: the gated RMSNorm applies silu(z)).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (the message names the argument).
    """
    name = "selective_state_update"
    S, H, P, N, Bsz, T, G = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    inter, idx = intermediate_states, intermediate_state_indices
    if update_state is None:
        update_state = inter is None
    _check_intermediate(inter, idx, slot_ids, (T, H, P, N), name)
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    check_shape(out, (Bsz, T, H, P), "out", name)
    tensors = [state, x, dt, A, B, C, dt_bias, slot_ids, out] + [t for t in (D, inter, idx) if t is not None]
    check_launchable(*tensors, name=name)
    if Bsz == 0:
        return out

    BLOCK_P = block_p or min(16, triton.next_power_of_2(P))
    BLOCK_N = triton.next_power_of_2(N)
    lo, hi = time_step_limit
    has_limit = lo > 0.0 or hi < math.inf
    sr = _rounding_args(stochastic_rounding, state, inter, bool(update_state), name)
    grid = (triton.cdiv(P, BLOCK_P), Bsz, H)
    _ssu_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else A, dt_bias, slot_ids, out,
        inter if inter is not None else out, idx if idx is not None else slot_ids,  # placeholders: never read
        sr.pop("sr_seed_ptr"), sr.pop("sr_step_ptr"), sr.pop("sr_salt"),
        T, H, P, N, H // G, float(lo), float(hi) if hi < math.inf else 3.0e38,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *out.stride(),
        *(inter.stride() if inter is not None else (0,) * 5),
        HAS_D=D is not None, HAS_DT_LIMIT=has_limit,
        WRITE_INTERMEDIATE=inter is not None, HAS_INDICES=idx is not None, UPDATE_STATE=bool(update_state),
        BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, **sr,
        num_warps=4 if BLOCK_P * BLOCK_N >= 2048 else 2,
    )
    return out


def _rounding_args(rounding, state, inter, update_state, name):
    """Launch arguments for stochastic rounding of the 16-bit buffers this call writes (checked)."""
    if rounding is None:
        return launch_args(None, state, name)
    written = ([inter] if inter is not None else []) + ([state] if update_state else [])
    for t in written:
        rounding.check(t, name)
    return launch_args(rounding, written[0] if written else state, name)


def _check_intermediate(inter, idx, slot_ids, per_token, name):
    """intermediate_states (B', T, *per_token) in a state dtype, and its row map (see `check_rows`)."""
    if inter is None:
        if idx is not None:
            raise ValueError(f"{name}: intermediate_state_indices without intermediate_states")
        return
    if inter.dim() != 5 or tuple(inter.shape[1:]) != tuple(per_token):
        raise ValueError(f"{name}: intermediate_states must have shape (B', {', '.join(map(str, per_token))}), "
                         f"got {tuple(inter.shape)}")
    check_dtype(inter, STATE_DTYPES, "intermediate_states", name)
    check_rows(slot_ids, idx, inter.shape[0], "intermediate_states", name)


def ssm_recurrent_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    return_intermediate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token-by-token SSM recurrence (no D skip, no gate) on gathered states; float32 math. Does not mutate
    ``state``.

    Args:
        x: (B, T, H, P); dt: (B, T, H) processed dt' (0 = no-op column); A: (H,);
        B, C: (B, T, G, N); state: (B, H, P, N) state before column 0 (any float dtype).
        return_intermediate: also return the state after every column (what a rewind verify keeps).

    Returns:
        y: (B, T, H, P) float32; final state (B, H, P, N) float32; intermediate states (B, T, H, P, N)
        float32 or None.
    """
    H, G = x.shape[2], B.shape[2]
    rep = H // G
    h = state.float()
    dA = torch.exp(dt.float() * A.float())  # (B, T, H)
    xdt = x.float() * dt.float()[..., None]
    Bh = B.float().repeat_interleave(rep, dim=2)  # (B, T, H, N)
    Ch = C.float().repeat_interleave(rep, dim=2)
    ys, states = [], []
    for t in range(x.shape[1]):
        h = h * dA[:, t, :, None, None] + xdt[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
        if return_intermediate:
            states.append(h)
    y = torch.stack(ys, dim=1)
    return y, h, (torch.stack(states, dim=1) if return_intermediate else None)


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
    intermediate_state_indices: torch.Tensor | None = None,
    update_state: bool | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
    stochastic_rounding: StochasticRounding | None = None,
) -> torch.Tensor:
    """PyTorch reference of `selective_state_update` (same arguments, same effects; `block_p` ignored;
    `stochastic_rounding` rounds with `kernels.rounding.stochastic_round_ref`: the same rule, torch's bits).

    `ssm_recurrent_scan` on the live rows' gathered states, vectorised over the batch (the engine's decode and
    rewind-verify path for ssm_backend="torch"); all arithmetic in float32. Host syncs: the nonzero() that
    selects the live rows.
    """
    del block_p
    name = "selective_state_update_ref"
    _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    inter, idx = intermediate_states, intermediate_state_indices
    if update_state is None:
        update_state = inter is None
    _check_intermediate(inter, idx, slot_ids, (x.shape[1], *state.shape[1:]), name)
    if out is None:
        out = torch.empty(*x.shape, device=x.device, dtype=x.dtype)
    out.zero_()
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    slots = slot_ids[rows].long()
    dtp = _process_dt(dt[rows], dt_bias, time_step_limit)  # (R, T, H)
    y, h, steps = ssm_recurrent_scan(x[rows], dtp, A, B[rows], C[rows], state[slots],
                                     return_intermediate=inter is not None)
    if D is not None:
        y = y + x[rows].float() * D.float()[:, None]
    out[rows] = y.to(out.dtype)
    if stochastic_rounding is not None:
        _rounding_args(stochastic_rounding, state, inter, bool(update_state), name)
    if inter is not None:
        inter[rows if idx is None else idx[rows].long()] = stochastic_round_ref(steps, inter.dtype,
                                                                                stochastic_rounding, stream=1)
    if update_state:
        state[slots] = stochastic_round_ref(h, state.dtype, stochastic_rounding)
    return out
