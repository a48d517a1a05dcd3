"""Mamba2 MTP verify by "SSM replay": fast-forward the committed state from a short input history.

Scope: the verify step of one Mamba2 layer when the engine runs with `ssm_replay=true`: the Triton kernel
`replay_verify`, its plain-PyTorch reference `replay_verify_ref` (same signature, vectorised over the batch:
what the engine runs for ssm_backend="torch") and the history layout `ReplayHistory`. Tests hold kernel and
reference to a token-by-token oracle (tests/replay_oracles.py). The per-slot bookkeeping after acceptance is
family-agnostic (`kernels.commit.replay_advance`, metadata from `kernels.commit.allocate_replay_slots`). The
gate silu(z) is not here (NemotronH's gated RMSNorm applies it).

Instead of T intermediate states per slot (rewind, `kernels.mamba2.recurrent`), each slot keeps the committed
state plus the inputs of the last verify, double-buffered (the layout of TensorRT-LLM's SSM replay and
FlashInfer's `checkpointing_ssu`: x, B, processed dt' and the running sum of A dt' of the history tokens):

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
Then, after acceptance, `kernels.commit.replay_advance` sets PNAT[s] = num_accepted (clamped to [0, T]) and
flips buffer_index[s], with the same liveness predicate (slot id >= 0) as the kernel: PAD rows never advance.
It runs once per step for all layers (the bookkeeping is per slot, not per layer).

Design decisions:
- No tl.dot: all state math is fp32 FMAs on CUDA cores, so accuracy matches the token-by-token reference to
  fp32 rounding and the interpreter's bf16 dot defect cannot arise. The state work per verify is 1 FMA per
  element and old token (closed-form fast-forward) plus one C_t . h reduction per new token; the (T, T)
  intra-verify term (C_t . B_j) exp(cum_t - cum_j) dt'_j runs on small vectors. History x and B are stored
  in the input dtype (exact copies of the inputs), dt' and the cumsum in fp32.
- One program per (P block, row, head) holds a (BLOCK_P, next_pow2(N)) fp32 state tile in registers: the
  state is read once and written at most once. Default BLOCK_P = 16 with 2 warps (4 for checkpointing), the
  fastest of the H200 sweep (docs/kernel_performance.md); `--compile-check` of benchmarks.bench_mamba2 shows
  no spills at these tiles. An earlier tl.dot version (tf32x3, d_state walked in chunks) ran at 0.4-0.8 TB/s.
- PAD rows (slot id < 0) read and write no cache buffer; their output rows are zeros. Slot 0 is live.
- PNAT values outside [0, L] (garbage metadata) are clamped; buffer_index is read modulo 2.
- No autotune (the kernel updates state in place). Strided views of every cache are supported.
- A new request: after prefill writes its state, set its PNAT to 0 (nothing to replay).

Kernel variants (`variant=`, one launcher; `VARIANTS` holds their default tiles). Without `variant=` (the
engine) the launcher runs the configuration that `python -m benchmarks.sweep_replay` measured fastest for the
launch's (history layout, state dtype, shape class, batch bucket): the committed table read by
`kernels.replay_defaults` (an fp16 state takes the bf16 rows), `FALLBACK_VARIANT` where it has no row
(docs/kernel_performance.md):
- "fma": the kernel described above (CUDA-core FMAs, C_t . h as tl.sum reductions).
- "mma": the same math with every reduction over d_state or tokens as a tensor-core product of bf16 pieces
  (`kernels._mma.split_dot`: an fp32 operand as 2 or 3 bf16 pieces, `split=`; a bf16 state or bf16 inputs
  as one). Each program walks its (block_p, N) tile in (block_p, chunk_n) chunks whose loads Triton
  software-pipelines (cp.async). Writing rows (per-step with PNAT > 0, checkpointing flush): per chunk
  S = exp(c_{k-1}) h + (X_old^T diag(w)) @ B_old (one mma), stored (rounded), then C . S_stored accumulated.
  Reading rows (PNAT = 0, checkpointing without flush) never form S: C . S = exp(c_{k-1}) (C . h) +
  ((C B_old^T) diag(w)) @ X_old, the state read once (the no-write path of FlashInfer's checkpointing_ssu).
  Accuracy: products of bf16 pieces are exact and accumulate in fp32; 2 pieces leave ~2^-17 of each fp32
  operand (tests hold it to the fp32 tolerances).
- "mma_pre": "mma" split into two kernels as FlashInfer's checkpointing_ssu splits its work: a precompute
  kernel, one program per (row, group), forms C B^T (new tokens) and C B_old^T (pending tokens) once and
  writes the B history; the main "mma" kernel reads those (TP, TP) / (TP, LP) fp32 blocks instead of
  loading B (and, without a write, B_old) and recomputing the products in each of its heads_per_group x
  P-block programs. Same math and tolerances; two launches and a small fp32 scratch per call.
- "mma_pre_pdl": "mma_pre" with the main kernel launched as a programmatic dependent of the precompute
  kernel (PDL, sm_90+: Triton's `launch_pdl` option; the precompute kernel signals `gdc_launch_dependents` at
  its start): the main kernel's state pass (state loads, fast-forward, state store) overlaps the precompute
  kernel, and it waits (`gdc_wait`) only before reading C B^T / C B_old^T, as FlashInfer's checkpointing_ssu
  waits (`cudaGridDependencySynchronize`) only before its output phase. Same results as "mma_pre".
- "cuda" (checkpointing histories on a GPU only; `CUDA_VARIANT`, not in `VARIANTS`): the "fma" arithmetic as
  a CUDA kernel compiled with nvcc at first use (kernels/mamba2/replay_cuda.py, kernels/mamba2/replay_ckpt.cu):
  one 128-thread CTA per (row, head) with the state tile cp.async-staged in shared memory and the head's C, B,
  x, dt' and pending tokens staged once (FlashInfer checkpointing_ssu's work split, which Triton cannot
  express); `maxnreg=` is its nvcc register cap. Round to nearest only; one input dtype; P <= 128, N <= 256.
- `maxnreg=` (any variant): Triton's register cap of the main kernel (PTX .maxnreg), trading spills for
  resident warps (FlashInfer's checkpointing_ssu caps at 80); the results do not depend on it.
- `persistent=` (mma variants): a persistent grid of about `persistent` programs per SM walking the (P block,
  row, head) units with a grid stride, head fastest (checkpointing_ssu's persistent work loop); same results.
- All take `stochastic_rounding=` (kernels/rounding.py) for a 16-bit state's write.

Checkpointing variant (`ReplayHistory.allocate(..., checkpointing=True)`, `replay_advance(..., hist_len=L)`):
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

Source: the closed form of the Mamba2 SSD recurrence (Dao & Gu, "Transformers are SSMs", 2024;
state-spaces/mamba); the replay scheme of TensorRT-LLM's SSM replay and FlashInfer's `checkpointing_ssu`
(flashinfer.mamba; include/flashinfer/mamba/kernel_checkpointing_ssu_main.cuh for its tensor-core,
no-write-path design); written from the math above.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import replay_defaults
from kernels._common import INPUT_DTYPES, check_dtype, check_launchable, check_shape, interpreter_active
from kernels._mma import PIECES, split_dot
from kernels.mamba2 import replay_cuda
from kernels.mamba2.recurrent import _NO_LIMIT, _check_inputs, _process_dt, ssm_recurrent_scan
from kernels.rounding import (
    StochasticRounding,
    launch_args,
    round_to_state,
    round_to_state_keyed,
    sr_tile_keys,
    stochastic_round_ref,
)

# Kernel variants of `replay_verify` and their default (block_p, num_warps) per history layout. "fma": the
# block_p 16 tile of the H200 sweep of docs/kernel_performance.md (2 warps per-step, 4 checkpointing); "mma"
# and "mma_pre": one 16-row mma tile per warp.
VARIANTS = {
    "fma": {"per_step": (16, 2), "checkpointing": (16, 4)},
    "mma": {"per_step": (16, 1, 32, 2), "checkpointing": (16, 1, 32, 2)},  # + (chunk_n, num_stages)
    "mma_pre": {"per_step": (16, 1, 32, 2), "checkpointing": (16, 1, 32, 2)},
    "mma_pre_pdl": {"per_step": (16, 1, 32, 2), "checkpointing": (16, 1, 32, 2)},
}
# The variants launched as two kernels (a precompute kernel, then the "mma" kernel), and those of them whose
# main kernel is a programmatic dependent launch of the precompute kernel (`_check_launch_features`).
_PRE_VARIANTS = ("mma_pre", "mma_pre_pdl")
_PDL_VARIANTS = ("mma_pre_pdl",)
# `maxnreg=` bounds: PTX's .maxnreg is at most 255 on sm_90; below 32 registers a thread holds too little of
# a 16-row mma tile to be worth the spills.
MAXNREG_RANGE = (32, 255)
# The variant of a launch without `variant=` whose (operation, state dtype, shape class, batch) has no row (nor,
# for an fp16 state, a bf16 row: `replay_defaults.ROW_SIBLING`) in the measured table kernels/replay_defaults.json
# (`kernels.replay_defaults`, written by `python -m benchmarks.sweep_replay --write-defaults`): the variant every
# test covers.
FALLBACK_VARIANT = "fma"
# The CUDA kernel of kernels/mamba2/replay_cuda.py (checkpointing histories on a GPU only, compiled with nvcc at
# first use): not in VARIANTS, whose entries every interpreter test runs; a candidate of the defaults table
# (`ALL_VARIANTS`), which a launch it cannot take (CPU tensors, stochastic rounding, ...) replaces by
# FALLBACK_VARIANT.
CUDA_VARIANT = "cuda"
ALL_VARIANTS = (*VARIANTS, CUDA_VARIANT)

# ---------------------------------------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ReplayHistory:
    """The replay history of one Mamba2 layer (zero-initialised by `ReplayHistory.allocate`).

    x: (S, XB, L, H, P) input dtype, XB = 2 (per-step replay) or 1 (checkpointing); B: (S, 2, L, G, N) input
    dtype; dt: (S, 2, H, L) fp32 processed dt'; dA_cumsum: (S, 2, H, L) fp32 cumulative A * dt' since the
    last state write. Any strides (e.g. per-layer views of one allocation).
    """

    x: torch.Tensor
    B: torch.Tensor
    dt: torch.Tensor
    dA_cumsum: torch.Tensor

    @staticmethod
    def shapes(num_slots: int, hist_len: int, nheads: int, head_dim: int, ngroups: int, d_state: int, *,
               dtype: torch.dtype, checkpointing: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{field: (shape, dtype)} of a layer's history (the class docstring's layout): the one declaration
        that :meth:`allocate` and the engine's memory plan (runners/engine/cache.py) both read."""
        S, L, H, P, G, N = num_slots, hist_len, nheads, head_dim, ngroups, d_state
        return {"x": ((S, 1 if checkpointing else 2, L, H, P), dtype), "B": ((S, 2, L, G, N), dtype),
                "dt": ((S, 2, H, L), torch.float32), "dA_cumsum": ((S, 2, H, L), torch.float32)}

    @classmethod
    def allocate(
        cls, num_slots: int, hist_len: int, nheads: int, head_dim: int, ngroups: int, d_state: int,
        *, dtype: torch.dtype, device: torch.device | str, checkpointing: bool = False,
    ) -> ReplayHistory:
        """Zero-initialised history of one layer for S = `num_slots` slots, x and B in `dtype` (the input dtype).

        `hist_len` (L): per-step replay: the largest T verified with; checkpointing: the window of tokens kept
        before the state is written (max(16, T) is the natural choice: the dots pad the token axis to 16 anyway).

        Raises:
            ValueError: hist_len < 1 or a dtype that is not an input dtype.
        """
        if hist_len < 1:
            raise ValueError(f"ReplayHistory.allocate: hist_len must be >= 1 (the verify width T), got {hist_len}")
        check_dtype(torch.empty(0, dtype=dtype), INPUT_DTYPES, "history", "ReplayHistory.allocate")
        shapes = cls.shapes(num_slots, hist_len, nheads, head_dim, ngroups, d_state, dtype=dtype,
                            checkpointing=checkpointing)
        return cls(**{k: torch.zeros(shape, dtype=dt, device=device) for k, (shape, dt) in shapes.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.B, self.dt, self.dA_cumsum))

    @property
    def checkpointing(self) -> bool:
        """True for the checkpointing layout (single-buffered x): the state is written only on a flush."""
        return self.x.shape[1] == 1


# ---------------------------------------------------------------------------------------------------------
# Verify
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _replay_verify_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr,
    xh_ptr, Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr, sr_seed_ptr, sr_step_ptr, sr_salt,
    H, P, N, heads_per_group, dt_min, dt_max,
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
    T: tl.constexpr, L: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, CHECKPOINT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SR: tl.constexpr, SR_ROUNDS: tl.constexpr,
):
    # The "fma" variant. One program per (P block, batch row, head) holding its (BLOCK_P, N) state tile in registers: the state
    # is read once, advanced token by token (k old, then T new ones) with CUDA-core FMAs, written at most
    # once. The per-token work is a few FMAs per state element, far under the memory time, so the kernel is
    # bound by the one state read (+ write) like the rewind kernel, without its T intermediate writes.
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0
    s = tl.where(live, slot, 0)  # pad rows never dereference this: every cache access is masked below

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    # Predicates as vectors (the interpreter rejects a scalar bool broadcast into a mask), folded through
    # extents: `offs < where(pred, extent, 0)`.
    mask_pl = offs_p < tl.where(live, P, 0)

    k = tl.load(pnat_ptr + s, mask=live, other=0).to(tl.int32)
    k = tl.where(live, tl.minimum(tl.maximum(k, 0), L), 0)
    rb = (tl.load(bufidx_ptr + s, mask=live, other=0) & 1).to(tl.int64)
    wb = 1 - rb
    if CHECKPOINT:
        # x has one buffer (each program reads and writes only its own (head, P block) of it, reads first);
        # the state is written only when the new tokens do not fit after the k pending ones.
        rbx = rb * 0
        wbx = rb * 0
        flush = k + T > L
        base = tl.where(flush, 0, k)
    else:
        rbx = rb
        wbx = wb
        flush = k >= 0  # always: every verify folds the accepted tokens into the state
        base = k * 0
    first_p = pid_p == 0  # one program per (row, head) writes dt', cumsum ...
    first_h = (h % heads_per_group) == 0  # ... and one per (row, group) writes B
    # checkpointing without a flush: the pending tokens stay, so they are copied into the buffer written
    keep_th = (~flush) & first_p & live
    mask_keep_B = offs_n < tl.where(keep_th & first_h, N, 0)

    A = tl.load(A_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    # ---- 0. the new tokens' small quantities, before the state load: dt', cumsum, x, B, C ----
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    dtv = tl.load(dt_ptr + b * s_dtb + offs_t * s_dtt + h * s_dth, mask=mask_t, other=0.0).to(tl.float32)
    dtv = dtv + dt_bias
    dtv = tl.where(dtv <= 20.0, tl.log(1.0 + tl.exp(dtv)), dtv)  # softplus, torch's threshold of 20
    if HAS_DT_LIMIT:
        dtv = tl.minimum(tl.maximum(dtv, dt_min), dt_max)
    dtv = tl.where(mask_t, dtv, 0.0)
    cum = tl.cumsum(A * dtv, axis=0)  # (BLOCK_T,) cum_t = sum_{i <= t} A dt'_i within this verify
    x_raw = tl.load(x_ptr + b * s_xb + offs_t[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                    mask=mask_t[:, None] & mask_p[None, :], other=0.0)  # (BLOCK_T, BLOCK_P)
    xv = x_raw.to(tl.float32)
    B_raw = tl.load(B_ptr + b * s_Bb + offs_t[:, None] * s_Bt + g * s_Bg + offs_n[None, :] * s_Bn,
                    mask=mask_t[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_T, BLOCK_N)
    Cv = tl.load(C_ptr + b * s_Cb + offs_t[:, None] * s_Ct + g * s_Cg + offs_n[None, :] * s_Cn,
                 mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    # intra-verify term: sum_{j <= t} (C_t . B_j) exp(cum_t - cum_j) dt'_j x_j, on (T, T) and (T, P) blocks
    CB = tl.sum(Cv[:, None, :] * B_raw.to(tl.float32)[None, :, :], axis=2)  # (BLOCK_T, BLOCK_T)
    causal = offs_t[:, None] >= offs_t[None, :]
    Mtj = tl.where(causal, CB * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)) * dtv[None, :], 0.0)
    intra = tl.sum(Mtj[:, :, None] * xv[None, :, :], axis=1)  # (BLOCK_T, BLOCK_P)

    state_ptrs = state_ptr + s * s_ss + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    hs = tl.load(state_ptrs, mask=mask_pl[:, None] & mask_n[None, :], other=0.0).to(tl.float32)

    # ---- 1. fast-forward by the k accepted (pending) old tokens, closed form with fp32 FMAs ----
    #   h <- exp(c_{k-1}) h + sum_{j<k} (w_j x_j) B_j^T,  w_j = exp(c_{k-1} - c_j) dt'_j  (c: dA_cumsum)
    p_c = cumh_ptr + s * s_chs + rb * s_chi + h * s_chh
    c_last = tl.load(p_c + (k - 1) * s_cht, mask=live & (k > 0), other=0.0)
    hs = hs * tl.exp(c_last)
    if L <= 8:  # short history (per-step replay): unrolled, masked tokens add exact zeros
        for j in tl.static_range(L):
            use = live & (j < k)
            wj = tl.load(dth_ptr + s * s_dths + rb * s_dthi + h * s_dthh + j * s_dtht, mask=use, other=0.0)
            wj = wj * tl.exp(c_last - tl.load(p_c + j * s_cht, mask=use, other=0.0))
            xj = tl.load(xh_ptr + s * s_xhs + rbx * s_xhi + j * s_xht + h * s_xhh + offs_p * s_xhp,
                         mask=mask_p & (offs_p < tl.where(use, P, 0)), other=0.0).to(tl.float32)
            Bj = tl.load(Bh_ptr + s * s_Bhs + rb * s_Bhi + j * s_Bht + g * s_Bhg + offs_n * s_Bhn,
                         mask=offs_n < tl.where(use, N, 0), other=0.0)
            hs += (wj * xj)[:, None] * Bj.to(tl.float32)[None, :]
            if CHECKPOINT:
                cj = tl.load(p_c + j * s_cht, mask=use, other=0.0)
                dtj = tl.load(dth_ptr + s * s_dths + rb * s_dthi + h * s_dthh + j * s_dtht, mask=use, other=0.0)
                tl.store(dth_ptr + s * s_dths + wb * s_dthi + h * s_dthh + j * s_dtht, dtj, mask=keep_th & use)
                tl.store(cumh_ptr + s * s_chs + wb * s_chi + h * s_chh + j * s_cht, cj, mask=keep_th & use)
                tl.store(Bh_ptr + s * s_Bhs + wb * s_Bhi + j * s_Bht + g * s_Bhg + offs_n * s_Bhn, Bj,
                         mask=mask_keep_B & (offs_n < tl.where(use, N, 0)))
    else:  # long checkpointing window: loop over the pending tokens only
        for j in range(0, k):
            dtj = tl.load(dth_ptr + s * s_dths + rb * s_dthi + h * s_dthh + j * s_dtht)
            cj = tl.load(p_c + j * s_cht)
            xj = tl.load(xh_ptr + s * s_xhs + rbx * s_xhi + j * s_xht + h * s_xhh + offs_p * s_xhp,
                         mask=mask_p, other=0.0).to(tl.float32)
            Bj = tl.load(Bh_ptr + s * s_Bhs + rb * s_Bhi + j * s_Bht + g * s_Bhg + offs_n * s_Bhn,
                         mask=mask_n, other=0.0)
            hs += ((dtj * tl.exp(c_last - cj)) * xj)[:, None] * Bj.to(tl.float32)[None, :]
            if CHECKPOINT:
                tl.store(dth_ptr + s * s_dths + wb * s_dthi + h * s_dthh + j * s_dtht, dtj, mask=keep_th)
                tl.store(cumh_ptr + s * s_chs + wb * s_chi + h * s_chh + j * s_cht, cj, mask=keep_th)
                tl.store(Bh_ptr + s * s_Bhs + wb * s_Bhi + j * s_Bht + g * s_Bhg + offs_n * s_Bhn, Bj,
                         mask=mask_keep_B)
    store_p = offs_p < tl.where(live & flush & (k > 0), P, 0)  # k = 0: nothing new to store
    hr = round_to_state(hs, state_ptr, (s * H + h) * P + offs_p, 0, sr_seed_ptr, sr_step_ptr, sr_salt,
                        BLOCK_P, BLOCK_N, BLOCK_N, SR, SR_ROUNDS)
    tl.store(state_ptrs, hr.to(state_ptr.dtype.element_ty), mask=store_p[:, None] & mask_n[None, :])
    # the new tokens start from the state as stored: replay rounds it exactly where rewind's commit does
    hs = tl.where(flush, hr, hs)

    # ---- 2. outputs: y_t = exp(cum_t) (C_t . h) + intra_t + D x_t: one pass over the state tile ----
    CH = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    for t in tl.static_range(T):
        Ct = tl.load(C_ptr + b * s_Cb + t * s_Ct + g * s_Cg + offs_n * s_Cn, mask=mask_n, other=0.0)
        ch = tl.sum(hs * Ct.to(tl.float32)[None, :], axis=1)  # (BLOCK_P,)
        CH = tl.where(offs_t[:, None] == t, ch[None, :], CH)
    y = tl.exp(cum)[:, None] * CH + intra
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * xv
    y = tl.where(offs_t[:, None] < tl.where(live, T, 0), y, 0.0)
    tl.store(out_ptr + b * s_ob + offs_t[:, None] * s_ot + h * s_oh + offs_p[None, :] * s_op,
             y.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_p[None, :])

    # ---- 3. the new tokens' x, B, dt', cumsum become history (checkpointing: after the pending ones) ----
    if CHECKPOINT:
        tl.debug_barrier()  # x history is single-buffered: every thread's reads of it come before the writes
    pos = base + offs_t
    mask_tl = offs_t < tl.where(live, T, 0)
    tl.store(xh_ptr + s * s_xhs + wbx * s_xhi + pos[:, None] * s_xht + h * s_xhh + offs_p[None, :] * s_xhp,
             x_raw.to(xh_ptr.dtype.element_ty), mask=mask_tl[:, None] & mask_p[None, :])
    mask_th = offs_t < tl.where(live & first_p, T, 0)
    cum_base = tl.where(flush, 0.0, c_last)  # checkpointing without a flush: the cumsum continues
    tl.store(dth_ptr + s * s_dths + wb * s_dthi + h * s_dthh + pos * s_dtht, dtv, mask=mask_th)
    tl.store(cumh_ptr + s * s_chs + wb * s_chi + h * s_chh + pos * s_cht, cum + cum_base, mask=mask_th)
    mask_tg = offs_t < tl.where(live & first_p & first_h, T, 0)
    tl.store(Bh_ptr + s * s_Bhs + wb * s_Bhi + pos[:, None] * s_Bht + g * s_Bhg + offs_n[None, :] * s_Bhn,
             B_raw.to(Bh_ptr.dtype.element_ty), mask=mask_tg[:, None] & mask_n[None, :])


@triton.jit
def _replay_mma_unit(
    pid_p, b, h,
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr,
    xh_ptr, Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr, sr_seed_ptr, sr_step_ptr, sr_salt,
    H, P, N, heads_per_group, dt_min, dt_max,
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
    cb_ptr, cbo_ptr,
    T: tl.constexpr, L: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, CHECKPOINT: tl.constexpr,
    TP: tl.constexpr, LP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    S_IN: tl.constexpr, S_HIST: tl.constexpr, S_STATE: tl.constexpr, SPLIT: tl.constexpr,
    SR: tl.constexpr, SR_ROUNDS: tl.constexpr, INTERP: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
):
    # The "mma" variant: every reduction over d_state or tokens is a tensor-core product of bf16 pieces
    # (kernels/_mma.py) instead of CUDA-core FMAs + tl.sum shuffle chains. One program per (P block, row,
    # head) walks its (BLOCK_P, N) state tile in (BLOCK_P, CHUNK_N) chunks (software-pipelined loads, few
    # registers per chunk); token axes are padded to TP / LP >= 16 (the mma minimum).
    #   write (per-step replay with k > 0, checkpointing flush): per chunk S = exp(c_{k-1}) h + (X_old^T w) @
    #       B_old, stored (rounded to the state dtype); the outputs from C . S_stored;
    #   no write (k = 0, checkpointing without flush): the state is only read, and
    #       C . S = exp(c_{k-1}) (C . h) + ((C B_old^T) w) @ X_old  (FlashInfer's no-write path).
    # PRE ("mma_pre"): C B^T and C B_old^T of this (row, group) come from `_replay_precompute_kernel` (cb_ptr,
    # cbo_ptr), which also writes the B history: the program loads no B (and no B_old without a write). They
    # are loaded after the pass over the state, which needs nothing of the precompute kernel.
    # PDL ("mma_pre_pdl", with PRE): launched as a programmatic dependent of the precompute kernel, the
    # program runs its state pass (loads, fast-forward, state store) while the precompute may still run and
    # waits for it (gdc_wait) only before the first read of cb / cbo. Nothing read before the wait is written
    # by the precompute (it writes cb, cbo and history B buffer wb; this pass reads buffer rb), and nothing
    # written here is read by it.
    # One work unit: (P block pid_p, batch row b, head h), b and h int64 (`_replay_verify_mma_kernel`).
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0
    s = tl.where(live, slot, 0)  # pad rows never dereference this: every cache access is masked below

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.arange(0, CHUNK_N)
    offs_t = tl.arange(0, TP)
    offs_l = tl.arange(0, LP)
    mask_p = offs_p < P
    mask_t = offs_t < T
    mask_pl = offs_p < tl.where(live, P, 0)

    k = tl.load(pnat_ptr + s, mask=live, other=0).to(tl.int32)
    k = tl.where(live, tl.minimum(tl.maximum(k, 0), L), 0)
    rb = (tl.load(bufidx_ptr + s, mask=live, other=0) & 1).to(tl.int64)
    wb = 1 - rb
    if CHECKPOINT:
        rbx = rb * 0
        wbx = rb * 0
        flush = k + T > L
        base = tl.where(flush, 0, k)
    else:
        rbx = rb
        wbx = wb
        flush = k >= 0  # always
        base = k * 0
    write = live & flush & (k > 0)
    first_p = pid_p == 0
    first_h = (h % heads_per_group) == 0
    keep_th = (~flush) & first_p & live
    mask_tg = offs_t < tl.where(live & first_p & first_h, T, 0)  # the rows of B written to the history
    keep_B = offs_l < tl.where(keep_th & first_h, k, 0)  # pending B rows copied (checkpointing, no flush)

    A = tl.load(A_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    # ---- the new tokens' dt', cumsum and x^T (BLOCK_P, TP) ----
    dtv = tl.load(dt_ptr + b * s_dtb + offs_t * s_dtt + h * s_dth, mask=mask_t, other=0.0).to(tl.float32)
    dtv = dtv + dt_bias
    dtv = tl.where(dtv <= 20.0, tl.log(1.0 + tl.exp(dtv)), dtv)  # softplus, torch's threshold of 20
    if HAS_DT_LIMIT:
        dtv = tl.minimum(tl.maximum(dtv, dt_min), dt_max)
    dtv = tl.where(mask_t, dtv, 0.0)
    cum = tl.cumsum(A * dtv, axis=0)  # (TP,)
    xT_raw = tl.load(x_ptr + b * s_xb + offs_t[None, :] * s_xt + h * s_xh + offs_p[:, None] * s_xp,
                     mask=mask_p[:, None] & mask_t[None, :], other=0.0)  # (BLOCK_P, TP)
    xT = xT_raw.to(tl.float32)

    # ---- the k pending old tokens of buffer rb: w_j = exp(c_{k-1} - c_j) dt'_j and X_old^T (BLOCK_P, LP) ----
    use_l = offs_l < k
    p_c = cumh_ptr + s * s_chs + rb * s_chi + h * s_chh
    p_dt = dth_ptr + s * s_dths + rb * s_dthi + h * s_dthh
    c_old = tl.load(p_c + offs_l * s_cht, mask=use_l, other=0.0)
    dt_old = tl.load(p_dt + offs_l * s_dtht, mask=use_l, other=0.0)
    c_last = tl.load(p_c + (k - 1) * s_cht, mask=live & (k > 0), other=0.0)
    w = tl.where(use_l, tl.exp(c_last - c_old) * dt_old, 0.0)  # (LP,)
    XoT = tl.load(xh_ptr + s * s_xhs + rbx * s_xhi + offs_l[None, :] * s_xht + h * s_xhh + offs_p[:, None] * s_xhp,
                  mask=mask_p[:, None] & use_l[None, :], other=0.0).to(tl.float32)  # (BLOCK_P, LP)
    decay = tl.exp(c_last)

    # chunk pointers (column offset added per chunk)
    p_state = state_ptr + s * s_ss + h * s_sh + offs_p[:, None] * s_sp
    p_C = C_ptr + b * s_Cb + offs_t[:, None] * s_Ct + g * s_Cg
    p_B = B_ptr + b * s_Bb + offs_t[:, None] * s_Bt + g * s_Bg
    p_Bo = Bh_ptr + s * s_Bhs + rb * s_Bhi + offs_l[:, None] * s_Bht + g * s_Bhg
    pos = base + offs_t
    p_Bw = Bh_ptr + s * s_Bhs + wb * s_Bhi + g * s_Bhg
    row = (s * H + h) * P + offs_p  # global state rows of this tile (stochastic rounding counters)

    CB = tl.zeros([TP, TP], tl.float32)  # C_t . B_j of the new tokens (PRE: loaded after the state pass)
    p_cb = (b * (H // heads_per_group) + g) * TP  # PRE: this (row, group)'s rows of cb / cbo
    CS = tl.zeros([BLOCK_P, TP], tl.float32)  # C_t . S (the state after the pending tokens)
    if write:
        Aff = XoT * w[None, :]
        # stochastic rounding's key is read and hashed once per program, before the chunk loop, on the
        # checkpointing path and for an fp16 state, where that is faster; a bf16 per-step write reads it in
        # each chunk, since hoisted it costs registers and a warp per scheduler (docs/kernel_performance.md,
        # "the key hoisted")
        SR_HOIST: tl.constexpr = CHECKPOINT or state_ptr.dtype.element_ty == tl.float16
        sr_k, sr_kk = sr_tile_keys(sr_seed_ptr, sr_step_ptr, sr_salt, SR and SR_HOIST)
        for n0 in tl.range(0, BLOCK_N, CHUNK_N, num_stages=NUM_STAGES):
            cols = n0 + offs_c
            mcol = cols < N
            m_pn = mask_pl[:, None] & mcol[None, :]
            Cc = tl.load(p_C + cols[None, :] * s_Cn, mask=mask_t[:, None] & mcol[None, :], other=0.0).to(tl.float32)
            Boc = tl.load(p_Bo + cols[None, :] * s_Bhn, mask=use_l[:, None] & mcol[None, :], other=0.0)
            hc = tl.load(p_state + cols[None, :] * s_sn, mask=m_pn, other=0.0).to(tl.float32)
            if not PRE:
                Bc = tl.load(p_B + cols[None, :] * s_Bn, mask=mask_t[:, None] & mcol[None, :], other=0.0)
                CB = split_dot(Cc, tl.trans(Bc.to(tl.float32)), CB, S_IN, S_IN, INTERP)
                tl.store(p_Bw + pos[:, None] * s_Bht + cols[None, :] * s_Bhn, Bc.to(Bh_ptr.dtype.element_ty),
                         mask=mask_tg[:, None] & mcol[None, :])
            Sc = split_dot(Aff, Boc.to(tl.float32), hc * decay, SPLIT, S_HIST, INTERP)
            if SR_HOIST:
                Sc = round_to_state_keyed(Sc, state_ptr, row, n0, sr_k, sr_kk, BLOCK_P, CHUNK_N, BLOCK_N, SR,
                                          SR_ROUNDS)
            else:
                Sc = round_to_state(Sc, state_ptr, row, n0, sr_seed_ptr, sr_step_ptr, sr_salt, BLOCK_P, CHUNK_N,
                                    BLOCK_N, SR, SR_ROUNDS)
            tl.store(p_state + cols[None, :] * s_sn, Sc.to(state_ptr.dtype.element_ty), mask=m_pn)
            # the new tokens start from the state as stored: replay rounds exactly where rewind's commit does
            CS = split_dot(Sc, tl.trans(Cc), CS, S_STATE, S_IN, INTERP)
        if PDL:
            tl.extra.cuda.gdc_wait()  # the precompute kernel's cb is complete and visible after this
    else:
        CBo = tl.zeros([TP, LP], tl.float32)  # C_t . B_j of the pending old tokens
        for n0 in tl.range(0, BLOCK_N, CHUNK_N, num_stages=NUM_STAGES):
            cols = n0 + offs_c
            mcol = cols < N
            Cc = tl.load(p_C + cols[None, :] * s_Cn, mask=mask_t[:, None] & mcol[None, :], other=0.0).to(tl.float32)
            hc = tl.load(p_state + cols[None, :] * s_sn, mask=mask_pl[:, None] & mcol[None, :],
                         other=0.0).to(tl.float32)
            CS = split_dot(hc, tl.trans(Cc), CS, S_STATE, S_IN, INTERP)
            if not PRE:
                Bc = tl.load(p_B + cols[None, :] * s_Bn, mask=mask_t[:, None] & mcol[None, :], other=0.0)
                Boc = tl.load(p_Bo + cols[None, :] * s_Bhn, mask=use_l[:, None] & mcol[None, :], other=0.0)
                CB = split_dot(Cc, tl.trans(Bc.to(tl.float32)), CB, S_IN, S_IN, INTERP)
                CBo = split_dot(Cc, tl.trans(Boc.to(tl.float32)), CBo, S_IN, S_HIST, INTERP)
                tl.store(p_Bw + pos[:, None] * s_Bht + cols[None, :] * s_Bhn, Bc.to(Bh_ptr.dtype.element_ty),
                         mask=mask_tg[:, None] & mcol[None, :])
                if CHECKPOINT:  # the pending tokens stay: copy their B into the buffer written now
                    tl.store(p_Bw + offs_l[:, None] * s_Bht + cols[None, :] * s_Bhn, Boc,
                             mask=keep_B[:, None] & mcol[None, :])
        if PRE:  # C_t . B_j of the pending old tokens, from the precompute kernel
            if PDL:
                tl.extra.cuda.gdc_wait()  # the precompute kernel's cb, cbo are complete and visible after this
            CBo = tl.load(cbo_ptr + (p_cb + offs_t[:, None]) * LP + offs_l[None, :])
        CS = split_dot(XoT, tl.trans(CBo * w[None, :]), CS * decay, S_HIST, SPLIT, INTERP)
    if PRE:  # C_t . B_j of the new tokens, from the precompute kernel (after the wait of either branch)
        CB = tl.load(cb_ptr + (p_cb + offs_t[:, None]) * TP + offs_t[None, :])

    # ---- outputs: y = exp(cum_t) C_t . S + sum_{j <= t} (C_t . B_j) exp(cum_t - cum_j) dt'_j x_j + D x_t ----
    causal = offs_t[:, None] >= offs_t[None, :]
    M = tl.where(causal, CB * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)) * dtv[None, :], 0.0)
    y = split_dot(xT, tl.trans(M), tl.exp(cum)[None, :] * CS, S_IN, SPLIT, INTERP)
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * xT
    y = tl.where(offs_t[None, :] < tl.where(live, T, 0), y, 0.0)
    tl.store(out_ptr + b * s_ob + offs_t[None, :] * s_ot + h * s_oh + offs_p[:, None] * s_op,
             y.to(out_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_t[None, :])

    # ---- history: x, dt', cumsum of the new tokens (B went with the chunks); checkpointing without a flush
    # keeps the pending tokens' dt', cumsum (copied into buffer wb) ----
    if CHECKPOINT:
        tl.debug_barrier()  # x history is single-buffered: every thread's reads of it come before the writes
        keep_l = offs_l < tl.where(keep_th, k, 0)
        tl.store(dth_ptr + s * s_dths + wb * s_dthi + h * s_dthh + offs_l * s_dtht, dt_old, mask=keep_l)
        tl.store(cumh_ptr + s * s_chs + wb * s_chi + h * s_chh + offs_l * s_cht, c_old, mask=keep_l)
    mask_tl = offs_t < tl.where(live, T, 0)
    tl.store(xh_ptr + s * s_xhs + wbx * s_xhi + pos[None, :] * s_xht + h * s_xhh + offs_p[:, None] * s_xhp,
             xT_raw.to(xh_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_tl[None, :])
    mask_th = offs_t < tl.where(live & first_p, T, 0)
    cum_base = tl.where(flush, 0.0, c_last)
    tl.store(dth_ptr + s * s_dths + wb * s_dthi + h * s_dthh + pos * s_dtht, dtv, mask=mask_th)
    tl.store(cumh_ptr + s * s_chs + wb * s_chi + h * s_chh + pos * s_cht, cum + cum_base, mask=mask_th)


@triton.jit(noinline=True)
def _replay_mma_unit_call(
    pid_p, b, h,
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr,
    xh_ptr, Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr, sr_seed_ptr, sr_step_ptr, sr_salt,
    H, P, N, heads_per_group, dt_min, dt_max,
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
    cb_ptr, cbo_ptr,
    T: tl.constexpr, L: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, CHECKPOINT: tl.constexpr,
    TP: tl.constexpr, LP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    S_IN: tl.constexpr, S_HIST: tl.constexpr, S_STATE: tl.constexpr, SPLIT: tl.constexpr,
    SR: tl.constexpr, SR_ROUNDS: tl.constexpr, INTERP: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
):
    # `_replay_mma_unit` as a called (not inlined) function: the persistent loop's body. Inlined into the
    # loop, the compiler keeps values across units (sm_90, Triton 3.6: 168-218 registers instead of
    # 84-140); called, 120-155.
    _replay_mma_unit(pid_p, b, h, state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr,
                     slot_ptr, out_ptr, xh_ptr, Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr,
                     sr_seed_ptr, sr_step_ptr, sr_salt, H, P, N, heads_per_group, dt_min, dt_max, s_ss,
                     s_sh, s_sp, s_sn, s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn,
                     s_Cb, s_Ct, s_Cg, s_Cn, s_ob, s_ot, s_oh, s_op, s_xhs, s_xhi, s_xht, s_xhh, s_xhp,
                     s_Bhs, s_Bhi, s_Bht, s_Bhg, s_Bhn, s_dths, s_dthi, s_dthh, s_dtht, s_chs, s_chi,
                     s_chh, s_cht, cb_ptr, cbo_ptr, T, L, HAS_D, HAS_DT_LIMIT, CHECKPOINT, TP, LP, BLOCK_P,
                     BLOCK_N, CHUNK_N, NUM_STAGES, S_IN, S_HIST, S_STATE, SPLIT, SR, SR_ROUNDS, INTERP,
                     PRE, PDL)


@triton.jit
def _replay_verify_mma_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr,
    xh_ptr, Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr, sr_seed_ptr, sr_step_ptr, sr_salt,
    H, P, N, heads_per_group, dt_min, dt_max,
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
    cb_ptr, cbo_ptr, n_rows,
    T: tl.constexpr, L: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, CHECKPOINT: tl.constexpr,
    TP: tl.constexpr, LP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    S_IN: tl.constexpr, S_HIST: tl.constexpr, S_STATE: tl.constexpr, SPLIT: tl.constexpr,
    SR: tl.constexpr, SR_ROUNDS: tl.constexpr, INTERP: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
    PERSIST: tl.constexpr,
):
    # The "mma" variant's kernel (`_replay_mma_unit` holds the work of one unit). Grid (P blocks, rows, heads):
    # one program per unit. PERSIST (`persistent=` of the launcher): a 1-D grid of fewer programs, each walking
    # the units u = program id, + number of programs, ... with the head fastest (u = (pid_p * n_rows + b) * H +
    # h), so programs running at the same time share a row's C, B_old (and cb / cbo) in L2, as FlashInfer's
    # persistent checkpointing_ssu walks its (row, head) units.
    if PERSIST:
        n_units = tl.cdiv(P, BLOCK_P) * n_rows * H
        for u in range(tl.program_id(0), n_units, tl.num_programs(0)):
            h = u % H
            r = u // H
            _replay_mma_unit_call(r // n_rows, (r % n_rows).to(tl.int64), h.to(tl.int64), state_ptr, x_ptr,
                                  dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr, xh_ptr,
                                  Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr, sr_seed_ptr, sr_step_ptr,
                                  sr_salt, H, P, N, heads_per_group, dt_min, dt_max, s_ss, s_sh, s_sp, s_sn,
                                  s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn, s_Cb,
                                  s_Ct, s_Cg, s_Cn, s_ob, s_ot, s_oh, s_op, s_xhs, s_xhi, s_xht, s_xhh, s_xhp,
                                  s_Bhs, s_Bhi, s_Bht, s_Bhg, s_Bhn, s_dths, s_dthi, s_dthh, s_dtht, s_chs,
                                  s_chi, s_chh, s_cht, cb_ptr, cbo_ptr, T, L, HAS_D, HAS_DT_LIMIT, CHECKPOINT,
                                  TP, LP, BLOCK_P, BLOCK_N, CHUNK_N, NUM_STAGES, S_IN, S_HIST, S_STATE, SPLIT,
                                  SR, SR_ROUNDS, INTERP, PRE, PDL)
    else:
        _replay_mma_unit(tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64),
                         state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr,
                         out_ptr, xh_ptr, Bh_ptr, dth_ptr, cumh_ptr, pnat_ptr, bufidx_ptr, sr_seed_ptr,
                         sr_step_ptr, sr_salt, H, P, N, heads_per_group, dt_min, dt_max, s_ss, s_sh, s_sp,
                         s_sn, s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn, s_Cb,
                         s_Ct, s_Cg, s_Cn, s_ob, s_ot, s_oh, s_op, s_xhs, s_xhi, s_xht, s_xhh, s_xhp,
                         s_Bhs, s_Bhi, s_Bht, s_Bhg, s_Bhn, s_dths, s_dthi, s_dthh, s_dtht, s_chs, s_chi,
                         s_chh, s_cht, cb_ptr, cbo_ptr, T, L, HAS_D, HAS_DT_LIMIT, CHECKPOINT, TP, LP,
                         BLOCK_P, BLOCK_N, CHUNK_N, NUM_STAGES, S_IN, S_HIST, S_STATE, SPLIT, SR,
                         SR_ROUNDS, INTERP, PRE, PDL)


@triton.jit
def _replay_precompute_kernel(
    B_ptr, C_ptr, slot_ptr, Bh_ptr, pnat_ptr, bufidx_ptr, cb_ptr, cbo_ptr, N,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_Cb, s_Ct, s_Cg, s_Cn,
    s_Bhs, s_Bhi, s_Bht, s_Bhg, s_Bhn,
    T: tl.constexpr, L: tl.constexpr, CHECKPOINT: tl.constexpr, TP: tl.constexpr, LP: tl.constexpr,
    KN: tl.constexpr, S_IN: tl.constexpr, S_HIST: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):
    # The "mma_pre" variant's first kernel, one program per (batch row, group): the (TP, TP) C_t . B_j of the
    # new tokens and the (TP, LP) C_t . B_j of the k pending ones (split-bf16 mma over the whole d_state, fp32
    # out), computed once for the heads_per_group heads and P blocks that share them, and the B history
    # writes of the main kernel (the new tokens' B into buffer wb; checkpointing without a flush: the pending
    # tokens' B copied from rb). FlashInfer's checkpointing_ssu splits the same way (a precompute kernel
    # for the per-group C B^T products before its main kernel).
    if PDL:  # "mma_pre_pdl": the main kernel may launch now; it waits (gdc_wait) for this grid before cb / cbo
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    G = tl.num_programs(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0
    s = tl.where(live, slot, 0)
    k = tl.load(pnat_ptr + s, mask=live, other=0).to(tl.int32)
    k = tl.where(live, tl.minimum(tl.maximum(k, 0), L), 0)
    rb = (tl.load(bufidx_ptr + s, mask=live, other=0) & 1).to(tl.int64)
    wb = 1 - rb
    if CHECKPOINT:
        flush = k + T > L
        base = tl.where(flush, 0, k)
    else:
        flush = k >= 0
        base = k * 0
    offs_t = tl.arange(0, TP)
    offs_l = tl.arange(0, LP)
    offs_n = tl.arange(0, KN)
    mask_n = offs_n < N
    mask_t = offs_t < T
    use_l = offs_l < k
    Cc = tl.load(C_ptr + b * s_Cb + offs_t[:, None] * s_Ct + g * s_Cg + offs_n[None, :] * s_Cn,
                 mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    Bc = tl.load(B_ptr + b * s_Bb + offs_t[:, None] * s_Bt + g * s_Bg + offs_n[None, :] * s_Bn,
                 mask=mask_t[:, None] & mask_n[None, :], other=0.0)
    p_Bh = Bh_ptr + s * s_Bhs + g * s_Bhg + offs_n[None, :] * s_Bhn
    Boc = tl.load(p_Bh + rb * s_Bhi + offs_l[:, None] * s_Bht, mask=use_l[:, None] & mask_n[None, :], other=0.0)
    CB = split_dot(Cc, tl.trans(Bc.to(tl.float32)), tl.zeros([TP, TP], tl.float32), S_IN, S_IN, INTERP)
    CBo = split_dot(Cc, tl.trans(Boc.to(tl.float32)), tl.zeros([TP, LP], tl.float32), S_IN, S_HIST, INTERP)
    row = (b * G + g) * TP + offs_t
    tl.store(cb_ptr + row[:, None] * TP + offs_t[None, :], CB)
    tl.store(cbo_ptr + row[:, None] * LP + offs_l[None, :], CBo)
    if CHECKPOINT:  # the pending tokens stay: their B goes into the buffer written now
        keep = offs_l < tl.where((~flush) & live, k, 0)
        tl.store(p_Bh + wb * s_Bhi + offs_l[:, None] * s_Bht, Boc, mask=keep[:, None] & mask_n[None, :])
    mask_tw = offs_t < tl.where(live, T, 0)
    tl.store(p_Bh + wb * s_Bhi + (base + offs_t)[:, None] * s_Bht, Bc.to(Bh_ptr.dtype.element_ty),
             mask=mask_tw[:, None] & mask_n[None, :])


@functools.cache
def _launch_options() -> frozenset[str]:
    """The optional launch options of this Triton's NVIDIA backend that the launcher can use: a subset of
    {"launch_pdl", "maxnreg"} ("launch_pdl" only together with `tl.extra.cuda.gdc_wait` /
    `gdc_launch_dependents`). Triton 3.6.0 (the H200 image's) and 3.9.0 have both."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return frozenset()
    fields = {f.name for f in dataclasses.fields(CUDAOptions)}
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    gdc = all(hasattr(cuda, f) for f in ("gdc_wait", "gdc_launch_dependents"))
    return frozenset({o for o in ("launch_pdl", "maxnreg") if o in fields} - (set() if gdc else {"launch_pdl"}))


def _check_launch_features(variant: str, maxnreg: int | None, device: torch.device, name: str) -> bool:
    """Refuse a launch feature this Triton or GPU lacks; returns whether to launch with PDL.

    PDL ("mma_pre_pdl") needs Triton's `launch_pdl` option with `gdc_wait` and an sm_90+ GPU (griddepcontrol);
    in the interpreter the kernels run one after the other, so the variant runs without PDL (the wait would
    be satisfied anyway: the same results). `maxnreg` needs Triton's `maxnreg` option; the interpreter
    ignores it.

    Raises:
        ValueError: maxnreg out of `MAXNREG_RANGE`, or a feature that this Triton / GPU does not have.
    """
    if maxnreg is not None:
        lo, hi = MAXNREG_RANGE
        if isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or not lo <= maxnreg <= hi:
            raise ValueError(f"{name}: maxnreg must be an int in [{lo}, {hi}] (registers per thread), got {maxnreg!r}")
        if "maxnreg" not in _launch_options():
            raise ValueError(f"{name}: this Triton ({triton.__version__}) has no `maxnreg` launch option; leave "
                             f"maxnreg=None (Triton 3.6 and later have it)")
    if variant not in _PDL_VARIANTS or interpreter_active():
        return False
    if "launch_pdl" not in _launch_options():
        raise ValueError(f"{name}: variant {variant!r} needs programmatic dependent launch (Triton's `launch_pdl` "
                         f"option and tl.extra.cuda.gdc_wait), which this Triton ({triton.__version__}) lacks; "
                         f"use variant='mma_pre' (the same kernels, launched one after the other)")
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        raise ValueError(f"{name}: variant {variant!r} needs an sm_90+ GPU (programmatic dependent launch), got "
                         f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}; use variant='mma_pre'")
    return True


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
    num_warps: int | None = None,
    variant: str | None = None,
    split: int | None = None,
    chunk_n: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    persistent: int | None = None,
    stochastic_rounding: StochasticRounding | None = None,
) -> torch.Tensor:
    """Replay verify of one Mamba2 layer (Triton): fast-forward by PNAT old tokens, outputs of T new ones.

    Args:
        state: (S, H, P, N) float32 / bfloat16 / float16 committed state cache; mutated for live rows with
            PNAT > 0 (it becomes the state after the accepted tokens of the previous verify); with a
            checkpointing history only on a flush (PNAT + T > L).
        x: (B, T, H, P); dt: (B, T, H) raw; A: (H,) fp32 = -exp(A_log); B, C: (B, T, G, N); D: (H,) or None;
            dt_bias: (H,): as in `kernels.mamba2.selective_state_update`.
        slot_ids: (B,) int32 / int64; negative = PAD (no cache buffer read or written, output row zero).
            Rows must name distinct slots.
        history: this layer's `ReplayHistory` (L >= T). Reads buffer buffer_index[s] (its first PNAT[s]
            tokens), writes the first T tokens of buffer 1 - buffer_index[s]; the rest is untouched.
            A checkpointing history (x with one buffer) works as in the module docstring.
        prev_num_accepted: (S,) int32 PNAT, tokens of the last verify that were accepted (0 = none to replay);
            read only here (clamped to [0, L]); `kernels.commit.replay_advance` updates it once per step.
        buffer_index: (S,) int32, read only here (taken modulo 2); `kernels.commit.replay_advance` flips it.
        time_step_limit: (min, max) clamp of dt after softplus.
        out: optional (B, T, H, P) output buffer; allocated like x when None.
        block_p: head_dim rows per program (power of two); default per variant (`VARIANTS`), capped by
            next_pow2(P) (at least 16 for "mma"). Each program holds a (block_p, next_pow2(N)) fp32 state tile.
        num_warps: warps per program; default per variant (`VARIANTS`).
        variant: "fma" (CUDA-core FMAs and tl.sum reductions), "mma" (reductions as split-bf16 tensor-core
            products, kernels/_mma.py), "mma_pre" ("mma" with the per-group C B^T products and the B
            history writes in a precompute kernel launched first) or "mma_pre_pdl" ("mma_pre" with the main
            kernel a programmatic dependent launch of the precompute kernel: sm_90+), "cuda" (checkpointing
            history, CUDA tensors: the CUDA kernel of kernels/mamba2/replay_cuda.py, built with nvcc at first
            use; takes no Triton tile, `maxnreg` is its register cap; refuses what it cannot run, see
            Raises); None: the measured default of `kernels.replay_defaults` for operation "mamba2_per_step" /
            "mamba2_checkpointing", this state dtype, shape class (H, P, N) and batch, whose tiles also fill
            every tuning argument left at None (an fp16 state takes the bf16 rows; `FALLBACK_VARIANT` without a
            row, and where the row names "cuda" for a launch the CUDA kernel does not take: CPU tensors,
            stochastic rounding, a Triton tile given, ...; `replay_cuda.unsupported`).
            Same results to the tolerances of tests/test_kernels_mamba2.py.
        split: "mma" only: bf16 pieces of a general fp32 operand (the fp32 state, dt'-weighted terms): 2
            (about 2^-17 relative; the default) or 3 (fp32 rounding).
        chunk_n, num_stages: "mma" only: d_state columns per step of the program's loop over its tile (power
            of two, >= 16) and the software-pipelining depth of that loop; defaults in `VARIANTS`.
        maxnreg: registers per thread the main kernel may use (Triton's `maxnreg` launch option, PTX
            .maxnreg; `MAXNREG_RANGE`), trading spills for resident warps; None: the compiler's choice.
            Ignored by the interpreter; the results do not depend on it.
        persistent: mma variants only: launch min(units, persistent x SMs) programs that walk the (P block,
            row, head) units with a grid stride, head fastest, instead of one program per unit (choose about
            the CTAs per SM the kernel's registers leave resident; the interpreter counts 1 SM); None or 0:
            one program per unit. Same results.
        stochastic_rounding: a `kernels.rounding.StochasticRounding` to round the state write stochastically
            (bf16 / fp16 states only); None rounds to nearest.

    Returns:
        out: (B, T, H, P), equal to the rewind verify's output from the state after PNAT accepted tokens.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, history length L < T, maxnreg out of range, or
            a variant / maxnreg that this Triton or GPU cannot launch (`_check_launch_features`); variant
            "cuda" with a per-step history, stochastic rounding, Triton tiles, CPU tensors, a shape or dtype it
            does not take, or no working nvcc (`replay_cuda.check_supported`, `replay_cuda.build`).
        RuntimeError: variant "cuda": the CUDA launch failed.
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
    if Bsz == 0:
        return out

    explicit = variant
    tuning = replay_defaults.resolve(
        dict(variant=variant, block_p=block_p, num_warps=num_warps, split=split, chunk_n=chunk_n,
             num_stages=num_stages, maxnreg=maxnreg, persistent=persistent),
        "mamba2_checkpointing" if history.checkpointing else "mamba2_per_step", state.dtype,
        replay_defaults.mamba2_shape_class(H, P, N), Bsz, fallback=FALLBACK_VARIANT,
        variants=ALL_VARIANTS)
    variant, block_p, num_warps, chunk_n, num_stages, maxnreg, persistent = (
        tuning[k] for k in ("variant", "block_p", "num_warps", "chunk_n", "num_stages", "maxnreg", "persistent"))
    if variant == CUDA_VARIANT:
        cuda_args = (state, x, dt, A, B, C, D, dt_bias, history, out, stochastic_rounding, name)
        if explicit is None and (_triton_tiles_given(tuning) or replay_cuda.unsupported(*cuda_args)):
            # the table's pick for this (operation, dtype, shape) is one the CUDA kernel does not take here
            # (e.g. stochastic rounding, CPU tensors, a caller's Triton tile): the fallback variant, as for a
            # table row naming a variant this module lacks (kernels.replay_defaults)
            variant, block_p, num_warps, chunk_n, num_stages, maxnreg, persistent = (
                FALLBACK_VARIANT, None, None, None, None, None, None)
            tuning = {**{k: None for k in tuning}, "variant": FALLBACK_VARIANT}
        else:
            return _launch_cuda(state, x, dt, A, B, C, D, dt_bias, slot_ids, history, prev_num_accepted,
                                buffer_index, tuning, time_step_limit, out, stochastic_rounding, name)
    split = 2 if tuning["split"] is None else tuning["split"]
    if variant not in VARIANTS:
        raise ValueError(f"{name}: variant must be one of {sorted(ALL_VARIANTS)}, got {variant!r}")
    if split not in (2, 3):
        raise ValueError(f"{name}: split must be 2 or 3 (bf16 pieces of an fp32 operand), got {split}")
    pdl = _check_launch_features(variant, maxnreg, x.device, name)
    cfg = VARIANTS[variant]["checkpointing" if history.checkpointing else "per_step"]
    BLOCK_N = triton.next_power_of_2(N)
    mma = variant.startswith("mma")
    if mma:
        num_warps = num_warps or cfg[1]
        BLOCK_P = block_p or max(16, min(cfg[0], triton.next_power_of_2(P)))
    else:
        BLOCK_P = block_p or min(cfg[0], triton.next_power_of_2(P))
        num_warps = num_warps or (cfg[1] if BLOCK_P * BLOCK_N <= 2048 else 4)
    if BLOCK_P & (BLOCK_P - 1) or (mma and BLOCK_P < 16):
        raise ValueError(f"{name}: block_p must be a power of two (>= 16 for the mma variants), got {BLOCK_P}")
    if persistent and (not mma or isinstance(persistent, bool) or not isinstance(persistent, int)
                       or persistent < 0):
        raise ValueError(f"{name}: persistent must be a non-negative int (programs per SM) and is for the mma "
                         f"variants only, got {persistent!r} with variant {variant!r}")
    sr = launch_args(stochastic_rounding, state, name)
    lo, hi = time_step_limit
    has_limit = lo > 0.0 or hi < math.inf
    grid = (triton.cdiv(P, BLOCK_P), Bsz, H)
    args = (
        state, x, dt, A, B, C, D if D is not None else A, dt_bias, slot_ids, out,
        history.x, history.B, history.dt, history.dA_cumsum, prev_num_accepted, buffer_index,
        sr.pop("sr_seed_ptr"), sr.pop("sr_step_ptr"), sr.pop("sr_salt"),
        H, P, N, H // G, float(lo), float(hi) if hi < math.inf else 3.0e38,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *out.stride(),
        *history.x.stride(), *history.B.stride(), *history.dt.stride(), *history.dA_cumsum.stride(),
    )
    common = dict(T=T, L=L, HAS_D=D is not None, HAS_DT_LIMIT=has_limit, CHECKPOINT=history.checkpointing,
                  BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=num_warps, **sr)
    if maxnreg is not None:  # the main kernel's register cap (a compile option: part of Triton's cache key)
        common["maxnreg"] = maxnreg
    if mma:
        pieces = PIECES[state.dtype] if state.dtype != torch.float32 else split
        TP, LP = max(16, triton.next_power_of_2(T)), max(16, triton.next_power_of_2(L))
        S_IN = max(PIECES[t.dtype] for t in (x, B, C))
        S_HIST = max(PIECES[t.dtype] for t in (history.x, history.B))
        pre = variant in _PRE_VARIANTS
        if pre:  # scratch of the precompute kernel: C B^T, C B_old^T per (row, group), fp32
            cb = torch.empty(Bsz, G, TP, TP, device=x.device, dtype=torch.float32)
            cbo = torch.empty(Bsz, G, TP, LP, device=x.device, dtype=torch.float32)
            _replay_precompute_kernel[(Bsz, G)](
                B, C, slot_ids, history.B, prev_num_accepted, buffer_index, cb, cbo, N,
                *B.stride(), *C.stride(), *history.B.stride(), T=T, L=L, CHECKPOINT=history.checkpointing,
                TP=TP, LP=LP, KN=max(16, BLOCK_N), S_IN=S_IN, S_HIST=S_HIST, INTERP=interpreter_active(),
                PDL=pdl, num_warps=4)
        else:
            cb = cbo = A  # not read
        if persistent:
            sms = 1 if x.device.type != "cuda" else torch.cuda.get_device_properties(x.device).multi_processor_count
            grid = (min(grid[0] * grid[1] * grid[2], persistent * sms),)
        _replay_verify_mma_kernel[grid](
            *args, cb, cbo, Bsz, TP=TP, LP=LP, PERSIST=bool(persistent),
            CHUNK_N=min(chunk_n, BLOCK_N) if chunk_n else min(cfg[2], BLOCK_N), NUM_STAGES=num_stages or cfg[3],
            S_IN=S_IN, S_HIST=S_HIST, S_STATE=pieces, SPLIT=split, INTERP=interpreter_active(), PRE=pre,
            PDL=pdl, **({"launch_pdl": True} if pdl else {}), **common)
    else:
        _replay_verify_kernel[grid](*args, BLOCK_T=triton.next_power_of_2(T), **common)
    return out


def _triton_tiles_given(tuning: dict) -> list[str]:
    """The Triton tuning arguments set in `tuning` (variant "cuda" takes none of them)."""
    return sorted(k for k in ("block_p", "num_warps", "split", "chunk_n", "num_stages", "persistent")
                  if tuning.get(k) is not None)


def _launch_cuda(state, x, dt, A, B, C, D, dt_bias, slot_ids, history, prev_num_accepted, buffer_index, tuning,
                 time_step_limit, out, stochastic_rounding, name):
    """variant "cuda": refuse the Triton tiles and what the CUDA kernel does not take, then launch it
    (kernels/mamba2/replay_cuda.py). `maxnreg` is its register cap (__maxnreg__, one build per value)."""
    given = _triton_tiles_given(tuning)
    if given:
        raise ValueError(f"{name}: variant 'cuda' has a fixed launch (one 128-thread CTA per head and row) and takes "
                         f"none of the Triton tiles {given}; leave them None (maxnreg caps its registers)")
    maxnreg = tuning.get("maxnreg")
    if maxnreg is not None:
        lo, hi = MAXNREG_RANGE
        if isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or not lo <= maxnreg <= hi:
            raise ValueError(f"{name}: maxnreg must be an int in [{lo}, {hi}] (registers per thread), got {maxnreg!r}")
    replay_cuda.check_supported(state, x, dt, A, B, C, D, dt_bias, history, out, stochastic_rounding, name)
    return replay_cuda.replay_verify_cuda(state, x, dt, A, B, C, D, dt_bias, slot_ids, history, prev_num_accepted,
                                          buffer_index, time_step_limit=time_step_limit, out=out, maxnreg=maxnreg,
                                          name=name)


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
    num_warps: int | None = None,
    variant: str | None = None,
    split: int | None = None,
    chunk_n: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    persistent: int | None = None,
    stochastic_rounding: StochasticRounding | None = None,
) -> torch.Tensor:
    """PyTorch reference of `replay_verify`, vectorised over the batch: the engine's CPU path.

    Same arguments, effects and result as the kernel (block_p, num_warps, variant, split, chunk_n, num_stages,
    maxnreg, persistent: the kernel's tuning, ignored), both history layouts. `stochastic_rounding` rounds the stored state with
    `kernels.rounding.stochastic_round_ref` (torch random bits: the same rule, not the kernel's bits). For the live rows (slot s = slot_ids[b] >= 0, k = PNAT[s] clamped to [0, L],
    r = buffer_index[s] % 2, w = 1 - r; flush = per-step history, or k + T > L):
    1. fast-forward in closed form, h = exp(c_{k-1}) h_s + sum_{j<k} exp(c_{k-1} - c_j) dt'_j x_j (outer) B_j
       (c = history.dA_cumsum[s, r]); flush rows store h in the state (rounded to its dtype, and continue from
       the rounded value); the others keep the state and continue from h in fp32;
    2. the T new tokens by the recurrence from h, y_t = C_t . h_t + D x_t;
    3. their x, B, dt', dA_cumsum into buffer w at positions 0..T-1 (flush) or k..k+T-1 after a copy of the
       k pending tokens from buffer r (checkpointing without flush; dA_cumsum then continues from c_{k-1}).
    PAD rows read and write no cache buffer; their output rows are zeros. Host syncs: none beyond the
    nonzero() that selects the live rows. All arithmetic in fp32.

    Raises:
        ValueError: as `replay_verify` (shapes, dtypes, a history shorter than T).
    Source: the SSD closed form of the module docstring; tested against the kernel and a token-by-token
    oracle (tests/replay_oracles.py).
    """
    del block_p, num_warps, variant, split, chunk_n, num_stages, maxnreg, persistent
    name = "replay_verify_ref"
    S, H, P, N, Bsz, T, G = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    L = _check_history(state, x, B, history, prev_num_accepted, buffer_index, name)
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    out.zero_()
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    ckpt = history.checkpointing
    s = slot_ids[rows].long()
    k = prev_num_accepted[s].long().clamp(0, L)  # (n,)
    r = buffer_index[s].long() & 1
    w = 1 - r
    flush = (k + T > L) if ckpt else torch.ones_like(k, dtype=torch.bool)
    A = A.float()
    hpg = H // G
    # 1. fast-forward by the k pending tokens
    c_old = history.dA_cumsum[s, r].float()  # (n, H, L)
    pending = torch.arange(L, device=x.device)[None, :] < k[:, None]  # (n, L)
    c_last = c_old.gather(2, (k - 1).clamp(min=0)[:, None, None].expand(-1, H, 1))[..., 0]
    c_last = torch.where(k[:, None] > 0, c_last, 0.0)  # (n, H)
    # positions j >= k are never read (the kernel masks them): where(), not a product with 0, so garbage or NaN
    # there cannot leak in
    pend = pending[:, None, :]  # (n, 1, L)
    wgt = torch.where(pend, torch.exp(c_last[..., None] - c_old) * history.dt[s, r].float(), 0.0)  # (n, H, L)
    x_old = history.x[s, torch.zeros_like(r) if ckpt else r].float()  # (n, L, H, P)
    x_old = torch.where(pending[:, :, None, None], x_old, 0.0)
    B_old = torch.where(pending[:, :, None, None], history.B[s, r].float(), 0.0).repeat_interleave(hpg, dim=2)
    h = state[s].float() * torch.exp(c_last)[..., None, None]
    h = h + torch.einsum("bhl,blhp,blhn->bhpn", wgt, x_old, B_old)
    if stochastic_rounding is not None:
        stochastic_rounding.check(state, name)
    stored = torch.where(flush[:, None, None, None], stochastic_round_ref(h, state.dtype, stochastic_rounding),
                         state[s])
    state.index_copy_(0, s, stored)  # rows without a flush (and k = 0 rows) store what they had
    h = torch.where(flush[:, None, None, None], stored.float(), h)
    # 2. the new tokens: the recurrence of the rewind reference, from h
    dtp = _process_dt(dt[rows], dt_bias, time_step_limit)  # (n, T, H)
    y, _, _ = ssm_recurrent_scan(x[rows], dtp, A, B[rows], C[rows], h)  # (n, T, H, P)
    if D is not None:
        y = y + x[rows].float() * D.float()[:, None]
    out[rows] = y.to(out.dtype)
    # 3. the history read by the next verify
    if ckpt:  # the pending tokens stay (rows without a flush): copy them into the buffer written now
        keep = (~flush)[:, None] & pending  # (n, L)
        for buf, m in ((history.B, keep[:, :, None, None]), (history.dt, keep[:, None, :]),
                       (history.dA_cumsum, keep[:, None, :])):
            buf[s, w] = torch.where(m, buf[s, r], buf[s, w])
    base = torch.where(flush, 0, k)  # (n,)
    pos = base[:, None] + torch.arange(T, device=x.device)  # (n, T)
    cum_base = torch.where(flush[:, None], 0.0, c_last)  # (n, H)
    s2, w2 = s[:, None], w[:, None]
    history.x[s2, torch.zeros_like(w2) if ckpt else w2, pos] = x[rows].to(history.x.dtype)
    history.B[s2, w2, pos] = B[rows].to(history.B.dtype)
    history.dt[s2, w2, :, pos] = dtp.to(history.dt.dtype)  # advanced indices first: (n, T, H)
    history.dA_cumsum[s2, w2, :, pos] = (cum_base[:, None] + torch.cumsum(A * dtp, dim=1)).to(history.dA_cumsum.dtype)
    return out
