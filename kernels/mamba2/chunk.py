"""Mamba2 chunked SSD scan: the prefill of a Mamba2 mixer after its causal conv.

Scope: `mamba_chunk_scan_combined`, the Triton prefill on a slot-indexed state cache (dt processing, D skip,
right-padded rows, the cache's states read and written in the kernels), its plain-PyTorch reference
`mamba_chunk_scan_combined_ref` (same signature and effects: the engine's path for ssm_backend="torch"), and
`ssd_chunked_scan`, the chunked math on gathered states that the reference is built on (the specification of the
chunked form; `kernels.mamba2.recurrent.ssm_recurrent_scan`, one step per token, is the specification of both,
and tests hold the three together).

Algorithm: the state-space dual (SSD) form of Mamba2 (Dao & Gu, "Transformers are SSMs", ICML 2024). Per row,
head h (group g = h // (H / G)), chunk of L tokens, with dt'_t = clamp(softplus(dt_t + dt_bias_h)) (0 on right
padding) and the in-chunk cumulative log decay cum_l = sum_{i <= l} A_h dt'_i:

    chunk state   S_c  = sum_s exp(cum_last - cum_s) dt'_s x_s (outer) B_s                 (P, N), per chunk
    state passing E_0  = h0 (the slot's state),  E_{c+1} = exp(cum_last_c) E_c + S_c        sequential in c
    chunk output  y_l  = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt'_s x_s
                         + exp(cum_l) C_l . E_c + D_h x_l

The first and last are matrix products over a chunk (tensor cores); only the elementwise state pass is
sequential. Final state E_{nchunks} goes back to the slot. The three Triton kernels follow the public design of
mamba_ssm's ssd_chunk_state / ssd_state_passing / ssd_chunk_scan (state-spaces/mamba,
mamba_ssm/ops/triton/ssd_*.py); written from the math above. Differences: dt processing and the chunk's cumsum
are recomputed in each kernel from dt (no dA_cumsum buffer), C.B is computed per head (no per-group bmm), and
the initial / final states are read and written at the rows' cache slots.

Design decisions (as `kernels.mamba2.recurrent`):
- PAD rows (slot id < 0) read no state (zeros), write no cache row, and get zero output rows. Slot 0 is live.
- Right padding: columns t >= lengths[b] get dt' = 0 and x = 0 (a no-op on the state even where the padded
  input holds NaN); their output is written as 0. A row of length 0 keeps its state exactly.
- Products run on tensor cores in the input dtype (bf16 / fp16) with fp32 accumulation, or in fp32 with IEEE
  precision (`dot_fp32`: the default for fp32 inputs, and in Triton's CPU interpreter, whose bf16 tl.dot is
  wrong); decays, dt and the state pass are fp32; the state is rounded to the cache dtype once, at the end.
- Scratch: the per-chunk states, fp32 (B, nchunks, H, P, N) (4 B nchunks H P N bytes: 268 MB at B = 8,
  T = 1024, Super V3 shapes) and the chunk decays (B, H, nchunks).
- No autotune: the state pass writes the cache in place.

Shapes: B batch, T tokens, H heads, P head_dim, N d_state, G ngroups, L chunk_size, S slots.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import INDEX_DTYPES, check_launchable, check_shape, interpreter_active
from kernels.mamba2.recurrent import _check_inputs, _process_dt

_NO_LIMIT = (0.0, math.inf)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _mm(a, b, FP32: tl.constexpr):
    """a @ b with an fp32 accumulator: fp32 operands at IEEE precision, or the operands' own 16-bit dtype."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _chunk_dt(dt_ptr, A_ptr, dt_bias_ptr, b, h, c0, offs, L, T, length, dt_min, dt_max, s_dtb, s_dtt, s_dth,
              HAS_DT_LIMIT: tl.constexpr):
    """dt' (0 outside [0, length) and outside the chunk) and A dt' at chunk positions `offs`; fp32."""
    t = c0 + offs
    valid = (offs < L) & (t < length)
    dt = tl.load(dt_ptr + b * s_dtb + t * s_dtt + h * s_dth, mask=valid, other=0.0).to(tl.float32)
    dt = dt + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # softplus, torch's threshold of 20
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(valid, dt, 0.0)
    return dt, dt * tl.load(A_ptr + h).to(tl.float32), valid


@triton.jit
def _inclusive_cumsum(a, offs_row, offs_col):
    """cum[i] = sum_{j <= i} a[j] for i in offs_row (a indexed by offs_col): a masked row sum, the same
    summation for every caller (so exp(cum_l - cum_s) is exactly 1 at l = s in every kernel)."""
    return tl.sum(tl.where(offs_col[None, :] <= offs_row[:, None], a[None, :], 0.0), axis=1)


@triton.jit
def _ssd_chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, len_ptr, states_ptr, decay_ptr,
    T, L, P, N, H, heads_per_group, dt_min, dt_max,
    s_xb, s_xt, s_xh, s_xp,
    s_dtb, s_dtt, s_dth,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_sb, s_sc, s_sh, s_sp, s_sn,
    s_db, s_dh, s_dc,
    HAS_LENGTHS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (chunk, batch row x head, P block x N block): S_c = (x dt' exp(cum_last - cum))^T B.
    c = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    pid_pn = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    g = h // heads_per_group
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    offs_p = (pid_pn // n_blocks_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (pid_pn % n_blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    c0 = c * L
    length = T
    if HAS_LENGTHS:
        length = tl.minimum(tl.load(len_ptr + b), T).to(tl.int32)

    dt, a, valid = _chunk_dt(dt_ptr, A_ptr, dt_bias_ptr, b, h, c0, offs_l, L, T, length, dt_min, dt_max,
                             s_dtb, s_dtt, s_dth, HAS_DT_LIMIT)
    cum = _inclusive_cumsum(a, offs_l, offs_l)
    cum_last = tl.sum(a, axis=0)
    w = tl.where(valid, dt * tl.exp(cum_last - cum), 0.0)  # (BLOCK_L,)

    t = c0 + offs_l
    x = tl.load(x_ptr + b * s_xb + t[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                mask=valid[:, None] & (offs_p[None, :] < P), other=0.0)
    x = tl.where(valid[:, None], x.to(tl.float32) * w[:, None], 0.0)  # where, not a product: NaN padding
    Bm = tl.load(B_ptr + b * s_Bb + t[:, None] * s_Bt + g * s_Bg + offs_n[None, :] * s_Bn,
                 mask=valid[:, None] & (offs_n[None, :] < N), other=0.0)
    Bm = tl.where(valid[:, None], Bm, 0.0).to(x_ptr.dtype.element_ty)
    S = _mm(tl.trans(x.to(x_ptr.dtype.element_ty)), Bm, DOT_FP32)  # (BLOCK_P, BLOCK_N)
    tl.store(states_ptr + b * s_sb + c * s_sc + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn,
             S, mask=(offs_p[:, None] < P) & (offs_n[None, :] < N))
    if pid_pn == 0:
        tl.store(decay_ptr + b * s_db + h * s_dh + c * s_dc, tl.exp(cum_last))


@triton.jit
def _ssd_state_passing_kernel(
    states_ptr, decay_ptr, state_ptr, slot_ptr,
    nchunks, P, N, H,
    s_sb, s_sc, s_sh, s_sp, s_sn,
    s_db, s_dh, s_dc,
    s_ss, s_sth, s_stp, s_stn,
    BLOCK: tl.constexpr,
):
    # One program per (batch row, head, block of the flattened (P, N) state): E_{c+1} = exp(cum_last) E_c + S_c,
    # E_c overwrites S_c in the scratch (what the chunk-output kernel reads); the final state goes to the slot.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P * N
    p = offs // N
    n = offs % N
    slot = tl.load(slot_ptr + b).to(tl.int64)
    # A vector copy of the row's liveness: the interpreter rejects a scalar bool broadcast into a mask.
    live = (tl.zeros([BLOCK], tl.int64) + slot) >= 0
    s = tl.where(slot >= 0, slot, 0)  # PAD rows never dereference this: every cache access is masked by live
    cache_ptrs = state_ptr + s * s_ss + h * s_sth + p * s_stp + n * s_stn
    E = tl.load(cache_ptrs, mask=mask & live, other=0.0).to(tl.float32)
    scratch = states_ptr + b * s_sb + h * s_sh + p * s_sp + n * s_sn
    for c in range(nchunks):
        S = tl.load(scratch + c * s_sc, mask=mask, other=0.0)
        tl.store(scratch + c * s_sc, E, mask=mask)
        E = E * tl.load(decay_ptr + b * s_db + h * s_dh + c * s_dc) + S
    tl.store(cache_ptrs, E.to(state_ptr.dtype.element_ty), mask=mask & live)


@triton.jit
def _ssd_chunk_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, len_ptr, slot_ptr, states_ptr, out_ptr,
    T, L, P, N, H, heads_per_group, dt_min, dt_max,
    s_xb, s_xt, s_xh, s_xp,
    s_dtb, s_dtt, s_dth,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_Cb, s_Ct, s_Cg, s_Cn,
    s_sb, s_sc, s_sh, s_sp, s_sn,
    s_ob, s_ot, s_oh, s_op,
    HAS_D: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (chunk x block of BLOCK_M output rows, batch row x head, P block):
    # y_l = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt'_s x_s + exp(cum_l) C_l . E_c + D x_l.
    m_blocks = tl.cdiv(L, BLOCK_M)
    c = (tl.program_id(0) // m_blocks).to(tl.int64)
    m0 = (tl.program_id(0) % m_blocks) * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    g = h // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_l = tl.arange(0, BLOCK_L)  # source positions in the chunk
    offs_m = m0 + tl.arange(0, BLOCK_M)  # output positions in the chunk
    offs_n = tl.arange(0, BLOCK_N)
    c0 = c * L
    length = T
    if HAS_LENGTHS:
        length = tl.minimum(tl.load(len_ptr + b), T).to(tl.int32)
    slot = tl.load(slot_ptr + b).to(tl.int64)

    dt_l, a_l, valid_l = _chunk_dt(dt_ptr, A_ptr, dt_bias_ptr, b, h, c0, offs_l, L, T, length, dt_min, dt_max,
                                   s_dtb, s_dtt, s_dth, HAS_DT_LIMIT)
    cum_l = _inclusive_cumsum(a_l, offs_l, offs_l)
    cum_m = _inclusive_cumsum(a_l, offs_m, offs_l)
    t_l = c0 + offs_l
    t_m = c0 + offs_m
    in_T_m = (offs_m < L) & (t_m < T)  # rows that exist in the output
    valid_m = (offs_m < L) & (t_m < length)  # rows that are real tokens

    # C_m . B_l (the chunk's (M, L) kernel) and C_m . E_c, over d_state in blocks.
    CB = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    CE = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + offs_n
        Cm = tl.load(C_ptr + b * s_Cb + t_m[:, None] * s_Ct + g * s_Cg + n[None, :] * s_Cn,
                     mask=valid_m[:, None] & (n[None, :] < N), other=0.0)
        Bl = tl.load(B_ptr + b * s_Bb + t_l[:, None] * s_Bt + g * s_Bg + n[None, :] * s_Bn,
                     mask=valid_l[:, None] & (n[None, :] < N), other=0.0)
        Bl = tl.where(valid_l[:, None], Bl, 0.0).to(x_ptr.dtype.element_ty)
        E = tl.load(states_ptr + b * s_sb + c * s_sc + h * s_sh + offs_p[:, None] * s_sp + n[None, :] * s_sn,
                    mask=(offs_p[:, None] < P) & (n[None, :] < N), other=0.0)
        CB += _mm(Cm.to(x_ptr.dtype.element_ty), tl.trans(Bl), DOT_FP32)
        CE += _mm(Cm.to(x_ptr.dtype.element_ty), tl.trans(E.to(x_ptr.dtype.element_ty)), DOT_FP32)

    causal = (offs_l[None, :] <= offs_m[:, None]) & valid_l[None, :]
    # masked before exp: above the diagonal cum_m - cum_l > 0 could overflow
    decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_l[None, :], float("-inf")))
    scores = CB * decay * dt_l[None, :]
    xl = tl.load(x_ptr + b * s_xb + t_l[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                 mask=valid_l[:, None] & (offs_p[None, :] < P), other=0.0)
    xl = tl.where(valid_l[:, None], xl, 0.0).to(x_ptr.dtype.element_ty)
    y = _mm(scores.to(x_ptr.dtype.element_ty), xl, DOT_FP32) + tl.exp(cum_m)[:, None] * CE
    if HAS_D:
        xm = tl.load(x_ptr + b * s_xb + t_m[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                     mask=valid_m[:, None] & (offs_p[None, :] < P), other=0.0).to(tl.float32)
        y += tl.load(D_ptr + h).to(tl.float32) * xm
    live = (tl.zeros([BLOCK_M], tl.int64) + slot) >= 0
    y = tl.where((valid_m & live)[:, None], y, 0.0)
    tl.store(out_ptr + b * s_ob + t_m[:, None] * s_ot + h * s_oh + offs_p[None, :] * s_op,
             y.to(out_ptr.dtype.element_ty), mask=in_T_m[:, None] & (offs_p[None, :] < P))


# ---------------------------------------------------------------------------------------------------------
# Launcher and reference
# ---------------------------------------------------------------------------------------------------------


def _check_scan_args(state, x, dt, A, B, C, D, dt_bias, slot_ids, chunk_size, lengths, out, name):
    """The shared checks of the launcher and the reference; returns (S, H, P, N, Bsz, T, G)."""
    dims = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    Bsz, T = dims[4], dims[5]
    if chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    if lengths is not None:
        check_shape(lengths, (Bsz,), "lengths", name)
        if lengths.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name}: lengths must be int32 or int64 (valid columns per row), got {lengths.dtype}")
    if out is not None:
        check_shape(out, (Bsz, T, *x.shape[2:]), "out", name)
    return dims


def mamba_chunk_scan_combined(
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
    chunk_size: int,
    lengths: torch.Tensor | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    dot_fp32: bool | None = None,
    block_m: int = 64,
) -> torch.Tensor:
    """Prefill of T tokens per row from each row's cached SSM state, chunked SSD form (Triton, three kernels).

    Args:
        state: (S, H, P, N) float32 / bfloat16 / float16 state cache. Row slot_ids[b] is read as the state
            before column 0 and overwritten with the state after row b's last valid column.
        x: (B, T, H, P) SSM input (after conv + SiLU), float32 / bfloat16 / float16.
        dt: (B, T, H) raw time step (before dt_bias and softplus).
        A: (H,) float32, A = -exp(A_log).
        B, C: (B, T, G, N) input / output projections; head h uses group h // (H / G). Same dtype as x.
        D: (H,) skip coefficient or None.
        dt_bias: (H,) added to dt before softplus.
        slot_ids: (B,) int32 / int64 slot of each row; negative = PAD (reads zeros, writes no state, output
            row zero). Rows must name distinct slots.
        chunk_size: tokens per chunk (L; the config's ``chunk_size``, 128 for Nemotron 3 Super); any L >= 1
            (the kernels tile it by the next power of two, at least 16). T need not be a multiple.
        lengths: (B,) int32 / int64 valid columns per row (right padding after them: dt' = 0, a no-op on the
            state, output 0); None = all T. Values above T count as T.
        time_step_limit: (min, max) clamp applied to dt after softplus; (0, inf) means none.
        out: optional (B, T, H, P) output buffer (float32 / bfloat16 / float16); allocated like x when None.
        dot_fp32: run the matrix products in fp32 at IEEE precision (default: for fp32 inputs, and always in
            Triton's CPU interpreter, whose bf16 tl.dot is wrong); else in x's dtype, fp32 accumulation.
        block_m: output rows per program of the chunk-output kernel (power of two >= 16).

    Returns:
        out: (B, T, H, P), y_t = C_t . h_t + D x_t (no gate: the gated RMSNorm applies silu(z)).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (the message names the argument).
    """
    name = "mamba_chunk_scan_combined"
    S, H, P, N, Bsz, T, G = _check_scan_args(state, x, dt, A, B, C, D, dt_bias, slot_ids, chunk_size,
                                             lengths, out, name)
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"{name}: x, B and C must share one dtype (the matrix products take them as they are); "
                         f"got {x.dtype}, {B.dtype}, {C.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"{name}: block_m must be a power of two >= 16, got {block_m}")
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    tensors = [state, x, dt, A, B, C, dt_bias, slot_ids, out] + [t for t in (D, lengths) if t is not None]
    check_launchable(*tensors, name=name)
    if Bsz == 0:
        return out
    if dot_fp32 is None:
        dot_fp32 = x.dtype == torch.float32 or interpreter_active()

    L = chunk_size
    nchunks = triton.cdiv(T, L)
    BLOCK_L = max(16, triton.next_power_of_2(L))
    BLOCK_M = min(block_m, BLOCK_L)
    BLOCK_P = min(64, max(16, triton.next_power_of_2(P)))
    BLOCK_N = min(128, max(16, triton.next_power_of_2(N)))
    lo, hi = time_step_limit
    has_limit = lo > 0.0 or hi < math.inf
    dt_lim = (float(lo), float(hi) if hi < math.inf else 3.0e38)
    len_arg = lengths if lengths is not None else slot_ids  # placeholder: never read without HAS_LENGTHS
    states = torch.empty(Bsz, nchunks, H, P, N, device=x.device, dtype=torch.float32)
    decay = torch.empty(Bsz, H, nchunks, device=x.device, dtype=torch.float32)
    big = BLOCK_L * max(BLOCK_P, BLOCK_N) >= 8192

    grid = (nchunks, Bsz * H, triton.cdiv(P, BLOCK_P) * triton.cdiv(N, BLOCK_N))
    _ssd_chunk_state_kernel[grid](
        x, dt, A, B, dt_bias, len_arg, states, decay,
        T, L, P, N, H, H // G, *dt_lim,
        *x.stride(), *dt.stride(), *B.stride(), *states.stride(), *decay.stride(),
        HAS_LENGTHS=lengths is not None, HAS_DT_LIMIT=has_limit, DOT_FP32=bool(dot_fp32),
        BLOCK_L=BLOCK_L, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=8 if big else 4,
    )
    BLOCK = min(1024, triton.next_power_of_2(P * N))
    _ssd_state_passing_kernel[(Bsz, H, triton.cdiv(P * N, BLOCK))](
        states, decay, state, slot_ids, nchunks, P, N, H,
        *states.stride(), *decay.stride(), *state.stride(),
        BLOCK=BLOCK, num_warps=4,
    )
    BLOCK_N_SCAN = min(64, BLOCK_N)
    grid = (nchunks * triton.cdiv(L, BLOCK_M), Bsz * H, triton.cdiv(P, BLOCK_P))
    _ssd_chunk_scan_kernel[grid](
        x, dt, A, B, C, D if D is not None else A, dt_bias, len_arg, slot_ids, states, out,
        T, L, P, N, H, H // G, *dt_lim,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *states.stride(), *out.stride(),
        HAS_D=D is not None, HAS_LENGTHS=lengths is not None, HAS_DT_LIMIT=has_limit, DOT_FP32=bool(dot_fp32),
        BLOCK_M=BLOCK_M, BLOCK_L=BLOCK_L, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N_SCAN,
        num_warps=8 if big else 4,
    )
    return out


def mamba_chunk_scan_combined_ref(
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
    chunk_size: int,
    lengths: torch.Tensor | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    dot_fp32: bool | None = None,
    block_m: int = 64,
) -> torch.Tensor:
    """PyTorch reference of `mamba_chunk_scan_combined` (same arguments, same effects; `dot_fp32` and
    `block_m` ignored): `ssd_chunked_scan` on the live rows' gathered states, float32 math. Host syncs: the
    nonzero() that selects the live rows."""
    del dot_fp32, block_m
    name = "mamba_chunk_scan_combined_ref"
    _, H, P, N, Bsz, T, G = _check_scan_args(state, x, dt, A, B, C, D, dt_bias, slot_ids, chunk_size, lengths,
                                             out, name)
    if out is None:
        out = torch.empty(*x.shape, device=x.device, dtype=x.dtype)
    out.zero_()
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    slots = slot_ids[rows].long()
    x, dt, B, C = x[rows], dt[rows], B[rows], C[rows]
    dtp = _process_dt(dt, dt_bias, time_step_limit)  # (R, T, H)
    if lengths is not None:
        valid = torch.arange(T, device=x.device)[None, :] < lengths[rows].to(x.device)[:, None]  # (R, T)
        zero = torch.zeros((), device=x.device)
        # where, not a product: padded inputs may hold NaN
        dtp = torch.where(valid[..., None], dtp, zero)
        x = torch.where(valid[..., None, None], x, zero.to(x.dtype))
        B = torch.where(valid[..., None, None], B, zero.to(B.dtype))
        C = torch.where(valid[..., None, None], C, zero.to(C.dtype))
    y, h = ssd_chunked_scan(x, dtp, A, B, C, chunk_size, state[slots])
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    if lengths is not None:
        y = torch.where(valid[..., None, None], y, torch.zeros((), device=y.device))
    out[rows] = y.to(out.dtype)
    state[slots] = h.to(state.dtype)
    return out


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan on gathered states (no D skip, no gate): the specification of the chunked form.
    Computes in float32.

    Args:
        x: (B, T, H, P) inputs.
        dt: (B, T, H) processed time steps dt' (after softplus, clamp and padding mask; 0 = no-op column).
        A: (H,) negative decay rates.
        B, C: (B, T, G, N) input / output projections; head h uses group h // (H / G).
        chunk_size: tokens per chunk (the config's ``chunk_size``); T need not be a multiple.
        initial_state: (B, H, P, N) state before column 0, or None for zeros. Never written.

    Returns:
        y: (B, T, H, P) float32, and final_state: (B, H, P, N) float32 after column T - 1.
    """
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    L = chunk_size
    pad = (-T) % L
    nc = (T + pad) // L
    head_group = torch.arange(H, device=x.device) // (H // G)
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))  # dt' = 0: padded columns are no-ops
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    x = x.view(b, nc, L, H, P)
    dt = dt.view(b, nc, L, H)
    B = B.view(b, nc, L, G, N)
    C = C.view(b, nc, L, G, N)
    cum = torch.cumsum(dt * A.float(), dim=2)  # (b, nc, L, H): sum_{i<=l} A dt'_i within the chunk
    xdt = x * dt[..., None]  # dt'_s x_s
    # Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt'_s x_s.
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # (b, nc, L, S, H)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    CB = torch.einsum("bclgn,bcsgn->bclsg", C, B)[..., head_group]  # (b, nc, L, S, H)
    y = torch.einsum("bclsh,bcshp->bclhp", CB * decay, xdt)
    # State contributed by each chunk alone: sum_s exp(cum_last - cum_s) dt'_s x_s (outer) B_s.
    B_h = B[:, :, :, head_group]  # (b, nc, L, H, N)
    decay_to_end = torch.exp(cum[:, :, -1:, :] - cum)  # (b, nc, L, H)
    chunk_states = torch.einsum("bclh,bclhp,bclhn->bchpn", decay_to_end, xdt, B_h)
    # Recurrence over chunks: the state entering chunk c, then its contribution to the outputs.
    state = x.new_zeros(b, H, P, N) if initial_state is None else initial_state.float()
    chunk_decay = torch.exp(cum[:, :, -1, :])  # (b, nc, H)
    entering = []
    for c in range(nc):
        entering.append(state)
        state = state * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # (b, nc, H, P, N)
    C_h = C[:, :, :, head_group]  # (b, nc, L, H, N)
    y = y + torch.einsum("bclhn,bchpn->bclhp", C_h, entering) * torch.exp(cum)[..., None]
    y = y.reshape(b, nc * L, H, P)[:, :T]
    return y, state
