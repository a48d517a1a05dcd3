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
sequential. Final state E_{nchunks} goes back to the slot. Four Triton kernels, following the public design of
mamba_ssm's ssd_chunk_cumsum / ssd_chunk_state / ssd_state_passing / ssd_chunk_scan (state-spaces/mamba,
mamba_ssm/ops/triton/ssd_*.py), written from the math above: (1) dt' and cum per chunk, (2) S_c per chunk,
(3) the pass over chunks, which reads h0 at the row's slot and writes the final state there, (4) the outputs,
flash-attention style over blocks of output rows and causal blocks of source tokens. Unlike mamba_ssm, C.B is
computed per head (no per-group bmm kernel) and the states are read and written at the rows' cache slots.

Design decisions (as `kernels.mamba2.recurrent`):
- PAD rows (slot id < 0) read no state (zeros), write no cache row, and get zero output rows. Slot 0 is live.
- Right padding: columns t >= lengths[b] get dt' = 0, and the state and output kernels skip columns with
  dt' = 0 (which contribute nothing), so padding is a no-op on the state even where it holds NaN; a chunk
  of padding scales the state by exp(0) = 1 and adds exact zeros, so a padded row ends in the same state, bit
  for bit, as the row alone, and a row of length 0 keeps its state. Outputs at padded columns are written 0.
- Products run on tensor cores in the input dtype (bf16 / fp16) with fp32 accumulation, or in fp32 with IEEE
  precision (`dot_fp32`: the default for fp32 inputs, and in Triton's CPU interpreter, whose bf16 tl.dot is
  wrong); decays, dt and the state pass are fp32; the state is rounded to the cache dtype once, at the end.
- Scratch: the per-chunk states, fp32 (B, nchunks, H, P, N) (4 B nchunks H P N bytes: 268 MB at B = 8,
  T = 1024, Super V3 shapes), dt' and cum (B, H, nchunks, L) fp32.
- Tiles (`ChunkScanTiles`): picked by compiling for sm_90 without register spills; a launch argument, so the
  benchmark can time alternatives.
- No autotune: the state pass writes the cache in place.

Shapes: B batch, T tokens, H heads, P head_dim, N d_state, G ngroups, L chunk_size, S slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import INDEX_DTYPES, check_launchable, check_shape, interpreter_active
from kernels.mamba2.recurrent import _check_inputs, _process_dt

_NO_LIMIT = (0.0, math.inf)


@dataclass(frozen=True)
class ChunkScanTiles:
    """Tile sizes (powers of two >= 16, clamped to the problem) and warps of the chunk-state and chunk-output
    kernels. `for_dot(fp32)` gives the defaults, chosen by compiling for sm_90 without register spills at
    Nemotron 3 Super's shapes (head_dim 64, d_state 128, chunk 128): `python -m benchmarks.bench_prefill
    --compile-check` prints registers / stack per thread; the benchmark times a few alternatives.

    state_*: the chunk-state kernel's P block, tokens per product and N block; scan_*: the chunk-output kernel's
    P block, output rows (M), source tokens per product (K) and d_state block (N)."""

    state_p: int = 64
    state_k: int = 64
    state_n: int = 128
    state_warps: int = 8
    scan_p: int = 64
    scan_m: int = 64
    scan_k: int = 32
    scan_n: int = 64
    scan_warps: int = 8

    @classmethod
    def for_dot(cls, fp32: bool) -> ChunkScanTiles:
        """16-bit tensor-core products (the defaults above), or smaller tiles for fp32 IEEE products (FMA
        units: fewer registers per product)."""
        return cls(state_k=32, state_n=32, scan_m=32, scan_n=32) if fp32 else cls()


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
def _ssd_chunk_cumsum_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, len_ptr, dtp_ptr, cum_ptr,
    T, L, H, dt_min, dt_max,
    s_dtb, s_dtt, s_dth,
    s_cb, s_ch, s_cc, s_cl,
    HAS_LENGTHS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, BLOCK_L: tl.constexpr,
):
    # One program per (chunk, batch row x head): dt' = clamp(softplus(dt + dt_bias)), 0 past the row's length
    # and past the chunk, and cum_l = sum_{i <= l} A dt'_i, written for all BLOCK_L positions (constant past
    # the last valid one, so cum[BLOCK_L - 1] is the chunk's total log decay).
    c = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs = tl.arange(0, BLOCK_L)
    t = c * L + offs
    length = T
    if HAS_LENGTHS:
        length = tl.minimum(tl.load(len_ptr + b), T).to(tl.int32)
    valid = (offs < L) & (t < length)
    dt = tl.load(dt_ptr + b * s_dtb + t * s_dtt + h * s_dth, mask=valid, other=0.0).to(tl.float32)
    dt = dt + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # softplus, torch's threshold of 20
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(valid, dt, 0.0)
    cum = tl.cumsum(dt * tl.load(A_ptr + h).to(tl.float32), axis=0)
    base = b * s_cb + h * s_ch + c * s_cc + offs * s_cl
    tl.store(dtp_ptr + base, dt)
    tl.store(cum_ptr + base, cum)


@triton.jit
def _ssd_chunk_state_kernel(
    x_ptr, B_ptr, dtp_ptr, cum_ptr, states_ptr,
    T, L, P, N, H, heads_per_group,
    s_xb, s_xt, s_xh, s_xp,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_cb, s_ch, s_cc, s_cl,
    s_sb, s_sc, s_sh, s_sp, s_sn,
    DOT_FP32: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (chunk, batch row x head, P block x N block):
    # S_c = sum_s (x_s dt'_s exp(cum_last - cum_s)) (outer) B_s, over the chunk in blocks of BLOCK_K tokens.
    c = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    pid_pn = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    g = h // heads_per_group
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    offs_p = (pid_pn // n_blocks_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (pid_pn % n_blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cum_base = b * s_cb + h * s_ch + c * s_cc
    cum_last = tl.load(cum_ptr + cum_base + (BLOCK_L - 1) * s_cl)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        t = c * L + offs_k
        dt = tl.load(dtp_ptr + cum_base + offs_k * s_cl, mask=offs_k < BLOCK_L, other=0.0)
        cum = tl.load(cum_ptr + cum_base + offs_k * s_cl, mask=offs_k < BLOCK_L, other=0.0)
        valid = (offs_k < L) & (t < T) & (dt > 0.0)  # dt' = 0 (padding) contributes nothing: skipped
        w = tl.where(valid, dt * tl.exp(cum_last - cum), 0.0)
        x = tl.load(x_ptr + b * s_xb + t[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                    mask=valid[:, None] & (offs_p[None, :] < P), other=0.0)
        x = tl.where(valid[:, None], x.to(tl.float32) * w[:, None], 0.0)  # where, not a product: NaN padding
        Bk = tl.load(B_ptr + b * s_Bb + t[:, None] * s_Bt + g * s_Bg + offs_n[None, :] * s_Bn,
                     mask=valid[:, None] & (offs_n[None, :] < N), other=0.0)
        Bk = tl.where(valid[:, None], Bk, 0.0).to(x_ptr.dtype.element_ty)
        acc += _mm(tl.trans(x.to(x_ptr.dtype.element_ty)), Bk, DOT_FP32)  # (BLOCK_P, BLOCK_N)
    tl.store(states_ptr + b * s_sb + c * s_sc + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn,
             acc, mask=(offs_p[:, None] < P) & (offs_n[None, :] < N))


@triton.jit
def _ssd_state_passing_kernel(
    states_ptr, cum_ptr, state_ptr, slot_ptr,
    nchunks, P, N,
    s_sb, s_sc, s_sh, s_sp, s_sn,
    s_cb, s_ch, s_cc, s_cl,
    s_ss, s_sth, s_stp, s_stn,
    BLOCK_L: tl.constexpr, BLOCK: tl.constexpr,
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
        E = E * tl.exp(tl.load(cum_ptr + b * s_cb + h * s_ch + c * s_cc + (BLOCK_L - 1) * s_cl)) + S
    tl.store(cache_ptrs, E.to(state_ptr.dtype.element_ty), mask=mask & live)


@triton.jit
def _ssd_chunk_scan_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, dtp_ptr, cum_ptr, len_ptr, slot_ptr, states_ptr, out_ptr,
    T, L, P, N, H, heads_per_group,
    s_xb, s_xt, s_xh, s_xp,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_Cb, s_Ct, s_Cg, s_Cn,
    s_cb, s_ch, s_cc, s_cl,
    s_sb, s_sc, s_sh, s_sp, s_sn,
    s_ob, s_ot, s_oh, s_op,
    HAS_D: tl.constexpr, HAS_LENGTHS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (chunk x block of BLOCK_M output rows, batch row x head, P block):
    # y_l = exp(cum_l) C_l . E_c + sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt'_s x_s + D x_l,
    # the sum over source blocks of BLOCK_K tokens up to the last output row (causal).
    m_blocks = tl.cdiv(L, BLOCK_M)
    c = (tl.program_id(0) // m_blocks).to(tl.int64)
    m0 = (tl.program_id(0) % m_blocks) * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    g = h // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # output positions in the chunk
    offs_n = tl.arange(0, BLOCK_N)
    cum_base = b * s_cb + h * s_ch + c * s_cc
    t_m = c * L + offs_m
    in_T_m = (offs_m < L) & (t_m < T)  # rows that exist in the output
    length = T
    if HAS_LENGTHS:
        length = tl.minimum(tl.load(len_ptr + b), T).to(tl.int32)
    valid_m = in_T_m & (t_m < length)  # rows that are real tokens
    cum_m = tl.load(cum_ptr + cum_base + offs_m * s_cl, mask=offs_m < BLOCK_L, other=0.0)
    slot = tl.load(slot_ptr + b).to(tl.int64)

    # The state entering the chunk, read through C: exp(cum_m) C_m . E_c.
    acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + offs_n
        Cm = tl.load(C_ptr + b * s_Cb + t_m[:, None] * s_Ct + g * s_Cg + n[None, :] * s_Cn,
                     mask=valid_m[:, None] & (n[None, :] < N), other=0.0)
        E = tl.load(states_ptr + b * s_sb + c * s_sc + h * s_sh + offs_p[:, None] * s_sp + n[None, :] * s_sn,
                    mask=(offs_p[:, None] < P) & (n[None, :] < N), other=0.0)
        acc += _mm(Cm.to(x_ptr.dtype.element_ty), tl.trans(E.to(x_ptr.dtype.element_ty)), DOT_FP32)
    acc = acc * tl.exp(cum_m)[:, None]

    # Inside the chunk: source blocks up to the last output row of this program.
    for k0 in range(0, tl.minimum(m0 + BLOCK_M, L), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        t_k = c * L + offs_k
        dt_k = tl.load(dtp_ptr + cum_base + offs_k * s_cl, mask=offs_k < BLOCK_L, other=0.0)
        cum_k = tl.load(cum_ptr + cum_base + offs_k * s_cl, mask=offs_k < BLOCK_L, other=0.0)
        valid_k = (offs_k < L) & (t_k < T) & (dt_k > 0.0)  # dt' = 0 (padding) contributes nothing
        CB = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            n = n0 + offs_n
            Cm = tl.load(C_ptr + b * s_Cb + t_m[:, None] * s_Ct + g * s_Cg + n[None, :] * s_Cn,
                         mask=valid_m[:, None] & (n[None, :] < N), other=0.0)
            Bk = tl.load(B_ptr + b * s_Bb + t_k[:, None] * s_Bt + g * s_Bg + n[None, :] * s_Bn,
                         mask=valid_k[:, None] & (n[None, :] < N), other=0.0)
            Bk = tl.where(valid_k[:, None], Bk, 0.0).to(x_ptr.dtype.element_ty)
            CB += _mm(Cm.to(x_ptr.dtype.element_ty), tl.trans(Bk), DOT_FP32)
        causal = (offs_k[None, :] <= offs_m[:, None]) & valid_k[None, :]
        # masked before exp: above the diagonal cum_m - cum_k > 0 could overflow
        decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_k[None, :], float("-inf")))
        scores = CB * decay * dt_k[None, :]
        xk = tl.load(x_ptr + b * s_xb + t_k[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                     mask=valid_k[:, None] & (offs_p[None, :] < P), other=0.0)
        xk = tl.where(valid_k[:, None], xk, 0.0).to(x_ptr.dtype.element_ty)
        acc += _mm(scores.to(x_ptr.dtype.element_ty), xk, DOT_FP32)

    if HAS_D:
        xm = tl.load(x_ptr + b * s_xb + t_m[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                     mask=valid_m[:, None] & (offs_p[None, :] < P), other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm
    live = (tl.zeros([BLOCK_M], tl.int64) + slot) >= 0
    acc = tl.where((valid_m & live)[:, None], acc, 0.0)
    tl.store(out_ptr + b * s_ob + t_m[:, None] * s_ot + h * s_oh + offs_p[None, :] * s_op,
             acc.to(out_ptr.dtype.element_ty), mask=in_T_m[:, None] & (offs_p[None, :] < P))


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
    tiles: ChunkScanTiles | None = None,
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
        tiles: tile sizes and warps (`ChunkScanTiles`); default `ChunkScanTiles.for_dot(dot_fp32)`.

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
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    tensors = [state, x, dt, A, B, C, dt_bias, slot_ids, out] + [t for t in (D, lengths) if t is not None]
    check_launchable(*tensors, name=name)
    if Bsz == 0:
        return out
    if dot_fp32 is None:
        dot_fp32 = x.dtype == torch.float32 or interpreter_active()
    tiles = tiles or ChunkScanTiles.for_dot(dot_fp32)
    bad = {k: v for k, v in vars(tiles).items() if not k.endswith("warps") and (v < 16 or v & (v - 1))}
    if bad:
        raise ValueError(f"{name}: tile sizes must be powers of two >= 16 (tl.dot's minimum), got {bad}")

    L = chunk_size
    nchunks = triton.cdiv(T, L)
    BLOCK_L = max(16, triton.next_power_of_2(L))
    fit = lambda block, n: min(block, max(16, triton.next_power_of_2(n)))  # noqa: E731
    state_p, state_k, state_n = fit(tiles.state_p, P), fit(tiles.state_k, L), fit(tiles.state_n, N)
    scan_p, scan_m, scan_k, scan_n = (fit(tiles.scan_p, P), fit(tiles.scan_m, L), fit(tiles.scan_k, L),
                                      fit(tiles.scan_n, N))
    lo, hi = time_step_limit
    has_limit = lo > 0.0 or hi < math.inf
    len_arg = lengths if lengths is not None else slot_ids  # placeholder: never read without HAS_LENGTHS
    # scratch: dt' and the in-chunk cumsum (B, H, nchunks, BLOCK_L); the per-chunk states (B, nchunks, H, P, N)
    dtp = torch.empty(Bsz, H, nchunks, BLOCK_L, device=x.device, dtype=torch.float32)
    cum = torch.empty_like(dtp)
    states = torch.empty(Bsz, nchunks, H, P, N, device=x.device, dtype=torch.float32)

    _ssd_chunk_cumsum_kernel[(nchunks, Bsz * H)](
        dt, A, dt_bias, len_arg, dtp, cum, T, L, H, float(lo), float(hi) if hi < math.inf else 3.0e38,
        *dt.stride(), *cum.stride(),
        HAS_LENGTHS=lengths is not None, HAS_DT_LIMIT=has_limit, BLOCK_L=BLOCK_L, num_warps=1,
    )
    grid = (nchunks, Bsz * H, triton.cdiv(P, state_p) * triton.cdiv(N, state_n))
    _ssd_chunk_state_kernel[grid](
        x, B, dtp, cum, states, T, L, P, N, H, H // G,
        *x.stride(), *B.stride(), *cum.stride(), *states.stride(),
        DOT_FP32=bool(dot_fp32), BLOCK_L=BLOCK_L, BLOCK_K=state_k, BLOCK_P=state_p, BLOCK_N=state_n,
        num_warps=tiles.state_warps,
    )
    BLOCK = min(1024, triton.next_power_of_2(P * N))
    _ssd_state_passing_kernel[(Bsz, H, triton.cdiv(P * N, BLOCK))](
        states, cum, state, slot_ids, nchunks, P, N,
        *states.stride(), *cum.stride(), *state.stride(),
        BLOCK_L=BLOCK_L, BLOCK=BLOCK, num_warps=4,
    )
    grid = (nchunks * triton.cdiv(L, scan_m), Bsz * H, triton.cdiv(P, scan_p))
    _ssd_chunk_scan_kernel[grid](
        x, B, C, D if D is not None else A, dtp, cum, len_arg, slot_ids, states, out,
        T, L, P, N, H, H // G,
        *x.stride(), *B.stride(), *C.stride(), *cum.stride(), *states.stride(), *out.stride(),
        HAS_D=D is not None, HAS_LENGTHS=lengths is not None, DOT_FP32=bool(dot_fp32), BLOCK_L=BLOCK_L,
        BLOCK_M=scan_m, BLOCK_K=scan_k, BLOCK_P=scan_p, BLOCK_N=scan_n, num_warps=tiles.scan_warps,
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
    tiles: ChunkScanTiles | None = None,
) -> torch.Tensor:
    """PyTorch reference of `mamba_chunk_scan_combined` (same arguments, same effects; `dot_fp32` and
    `tiles` ignored): `ssd_chunked_scan` on the live rows' gathered states, float32 math. Host syncs: the
    nonzero() that selects the live rows."""
    del dot_fp32, tiles
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
    rep = H // G
    pad = (-T) % L
    nc = (T + pad) // L
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

    def per_head(t: torch.Tensor) -> torch.Tensor:
        """(..., G, N) -> (..., H, N): head h reads group h // rep (a broadcast copy, not a gather)."""
        return t.unsqueeze(-2).expand(*t.shape[:-1], rep, t.shape[-1]).reshape(*t.shape[:-2], H, t.shape[-1])

    cum = torch.cumsum(dt * A.float(), dim=2)  # (b, nc, L, H): sum_{i<=l} A dt'_i within the chunk
    xdt = x * dt[..., None]  # dt'_s x_s
    # Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt'_s x_s. The (l, s)
    # terms are laid out head-major, (b, nc, H, L, S), the layout the contraction over s reads them in.
    cum_h = cum.transpose(2, 3).contiguous()  # (b, nc, H, L)
    seg = cum_h[..., :, None] - cum_h[..., None, :]  # (b, nc, H, L, S)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = seg.masked_fill_(~causal, float("-inf")).exp_()
    CB = torch.einsum("bclgn,bcsgn->bclsg", C, B).permute(0, 1, 4, 2, 3)  # (b, nc, G, L, S)
    # (C_l . B_s) of head h's group times the decay, elementwise (the product of a gathered copy)
    # (no out=: training differentiates through this; .contiguous() keeps the layout out= gave, a no-op when
    # the product already has it)
    CBd = (CB[:, :, :, None] * decay.view(b, nc, G, rep, L, L)).contiguous().view(b, nc, H, L, L)
    CBd = CBd.permute(0, 1, 3, 4, 2)
    y = torch.einsum("bclsh,bcshp->bclhp", CBd, xdt)
    # State contributed by each chunk alone: sum_s exp(cum_last - cum_s) dt'_s x_s (outer) B_s.
    B_h = per_head(B)  # (b, nc, L, H, N)
    decay_to_end = torch.exp(cum[:, :, -1:, :] - cum)  # (b, nc, L, H)
    chunk_states = torch.einsum("bclh,bclhp,bclhn->bchpn", decay_to_end, xdt, B_h)
    # Recurrence over chunks: the state entering chunk c, then its contribution to the outputs.
    state = x.new_zeros(b, H, P, N) if initial_state is None else initial_state.float()
    chunk_decay = torch.exp(cum[:, :, -1, :])[..., None, None]  # (b, nc, H, 1, 1)
    entering = x.new_empty(b, nc, H, P, N)
    for c in range(nc):
        entering[:, c] = state
        state = state * chunk_decay[:, c] + chunk_states[:, c]
    C_h = per_head(C)  # (b, nc, L, H, N)
    y = y + torch.einsum("bclhn,bchpn->bclhp", C_h, entering) * torch.exp(cum)[..., None]
    y = y.reshape(b, nc * L, H, P)[:, :T]
    return y, state
