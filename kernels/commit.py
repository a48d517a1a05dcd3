"""What runs after acceptance, the same for every recurrent family (Mamba2, Gated DeltaNet).

Scope: the two commit schemes of an MTP verify step on a slot-indexed recurrent-state cache, each as a Triton
kernel + launcher and a plain-PyTorch reference with the same signature (`*_ref`), plus the allocator of the
per-slot replay metadata:

- rewind (`rewind_commit`): the verify kept the state after each of its T tokens in a buffer
  (`intermediate_states`, written by `kernels.mamba2.selective_state_update` or
  `kernels.gdn.fused_recurrent_gated_delta_rule`); the commit copies the one after num_accepted_tokens tokens
  into the slot. As in SGLang / TensorRT-LLM / FlashInfer (`selective_state_update` with
  `intermediate_states_buffer`); the state is any (S, D1, D2, D3) tensor: Mamba2 (H, P, N), GDN (HV, V, K).
- replay (`replay_advance`): the verify (`kernels.mamba2.replay_verify`, `kernels.gdn.replay_verify`) already
  folded the previous step's accepted tokens into the state and recorded its own tokens' inputs; the commit only
  records, per slot, how many of them were accepted (prev_num_accepted, PNAT) and flips which of the two
  history buffers the next verify reads (buffer_index). The scheme of TensorRT-LLM's "SSM replay" and
  FlashInfer's `checkpointing_ssu` (whose `prev_num_accepted_tokens` is our PNAT). The same launch also moves
  the other per-slot metadata a step changes where the caller holds it: the conv window offset
  (`last_accepted` = num_accepted_tokens) and FlashInfer's ring start (`ring_advance`'s rule), so the whole
  per-step bookkeeping is one launch instead of one plus about twenty small PyTorch ops.

num_accepted_tokens (accepted drafts + the bonus token, in [1, T] for a real step) is clamped to [0, T] by
both: 0, or a negative value from stale or garbage metadata, accepts nothing (rewind leaves the state as it
was before the verify; replay records PNAT = 0, nothing to fast-forward), so rewind and replay stay equal even
on garbage, and nothing ever indexes out of range. PAD rows (slot id < 0) read and write nothing. Both
kernels are graph-capturable (no host synchronisation) and called once per verify step: `replay_advance` once
for all layers (the metadata is shared), `rewind_commit` once per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INDEX_DTYPES, check_dtype, check_launchable, check_rows, check_shape


def allocate_replay_slots(num_slots: int, *, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-initialised per-slot replay metadata shared by all layers of a model: (prev_num_accepted,
    buffer_index), each (S,) int32.

    Zeros are a valid state (nothing to replay, buffer 0), so a CUDA graph captured before the first fill
    reads defined values (the bug class of TensorRT-LLM issue #15565: metadata read before it was written).
    A slot that starts a new request needs prev_num_accepted[slot] = 0 once its prefill wrote the state.
    """
    return (torch.zeros(num_slots, dtype=torch.int32, device=device),
            torch.zeros(num_slots, dtype=torch.int32, device=device))


# ---------------------------------------------------------------------------------------------------------
# Rewind: state[slot_ids[b]] <- intermediate_states[row_b, num_accepted_tokens[b] - 1]
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _rewind_commit_kernel(
    state_ptr, inter_ptr, slot_ptr, idx_ptr, nat_ptr,
    T, R, C,
    s_ss, s_sh, s_sr, s_sc,
    s_ib, s_it, s_ih, s_ir, s_ic,
    HAS_INDICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # One program per (row block, batch row, head): a (BLOCK_R, C) tile of one head's state.
    pid_r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    nat = tl.load(nat_ptr + b).to(tl.int64)
    commit = (slot >= 0) & (nat >= 1)  # PAD rows and "nothing accepted" write nothing
    s = tl.where(commit, slot, 0)
    if HAS_INDICES:
        row = tl.load(idx_ptr + b).to(tl.int64)
        row = tl.where(commit, row, 0)
    else:
        row = b
    col = tl.where(commit, tl.minimum(nat, T) - 1, 0)  # num_accepted_tokens > T is clamped to T
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    # The predicate folded into the row extent (the interpreter rejects a scalar bool broadcast into a mask).
    mask = (offs_r < tl.where(commit, R, 0))[:, None] & (offs_c < C)[None, :]
    v = tl.load(inter_ptr + row * s_ib + col * s_it + h * s_ih + offs_r[:, None] * s_ir + offs_c[None, :] * s_ic,
                mask=mask)
    tl.store(state_ptr + s * s_ss + h * s_sh + offs_r[:, None] * s_sr + offs_c[None, :] * s_sc,
             v.to(state_ptr.dtype.element_ty), mask=mask)


def _check_rewind_commit(state, intermediate_states, slot_ids, num_accepted_tokens, indices, name):
    if state.dim() != 4 or intermediate_states.dim() != 5:
        raise ValueError(f"{name}: state must be (S, D1, D2, D3) and intermediate_states (B', T, D1, D2, D3), "
                         f"got {tuple(state.shape)} and {tuple(intermediate_states.shape)}")
    if tuple(intermediate_states.shape[2:]) != tuple(state.shape[1:]):
        raise ValueError(f"{name}: intermediate_states must be (B', T, {', '.join(map(str, state.shape[1:]))}) "
                         f"like the state's per-slot shape, got {tuple(intermediate_states.shape)}")
    check_rows(slot_ids, indices, intermediate_states.shape[0], "intermediate_states", name)
    check_shape(num_accepted_tokens, tuple(slot_ids.shape), "num_accepted_tokens", name)
    check_dtype(num_accepted_tokens, INDEX_DTYPES, "num_accepted_tokens", name)
    return intermediate_states.shape[1]


def rewind_commit(
    state: torch.Tensor,
    intermediate_states: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    *,
    intermediate_state_indices: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> None:
    """Rewind commit (Triton): state[slot_ids[b]] <- intermediate_states[row_b, num_accepted_tokens[b] - 1].

    Args:
        state: (S, D1, D2, D3) state cache of one layer (Mamba2 (S, H, P, N), GDN (S, HV, V, K)), any float
            dtype and strides; mutated for rows that commit.
        intermediate_states: (B', T, D1, D2, D3), the state after each verify token, as written by the verify
            (`kernels.mamba2.selective_state_update` / `kernels.gdn.fused_recurrent_gated_delta_rule` with
            the same `intermediate_state_indices`); any float dtype and strides.
        slot_ids: (B,) int32 / int64; negative = PAD (nothing read or written). Live rows name distinct slots.
        num_accepted_tokens: (B,) int32 / int64; clamped to [0, T], 0 (or less) commits nothing.
        intermediate_state_indices: (B,) int32 / int64 row of `intermediate_states` holding batch row b's
            states (FlashInfer's argument of that name; the engine passes the slot ids, its buffer being
            indexed like the state cache), in [0, B'); default: row b (then B' >= B).
        block_rows: D2 rows per program (power of two); default min(32, next_pow2(D2)).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit.
    """
    name = "rewind_commit"
    idx = intermediate_state_indices
    T = _check_rewind_commit(state, intermediate_states, slot_ids, num_accepted_tokens, idx, name)
    check_launchable(state, intermediate_states, slot_ids, num_accepted_tokens,
                     *([idx] if idx is not None else []), name=name)
    Bsz = slot_ids.shape[0]
    if Bsz == 0:
        return
    _, D1, R, C = state.shape
    BLOCK_R = block_rows or min(32, triton.next_power_of_2(R))
    BLOCK_C = triton.next_power_of_2(C)
    grid = (triton.cdiv(R, BLOCK_R), Bsz, D1)
    _rewind_commit_kernel[grid](
        state, intermediate_states, slot_ids, idx if idx is not None else slot_ids, num_accepted_tokens,
        T, R, C, *state.stride(), *intermediate_states.stride(),
        HAS_INDICES=idx is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4,
    )


def rewind_commit_ref(
    state: torch.Tensor,
    intermediate_states: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    *,
    intermediate_state_indices: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> None:
    """PyTorch reference of `rewind_commit` (same arguments and effects; `block_rows` ignored), vectorised
    over the batch: the engine's path for ssm_backend="torch"."""
    del block_rows
    idx = intermediate_state_indices
    T = _check_rewind_commit(state, intermediate_states, slot_ids, num_accepted_tokens, idx,
                             "rewind_commit_ref")
    n = num_accepted_tokens.long()
    rows = ((slot_ids >= 0) & (n >= 1)).nonzero().squeeze(1)
    src = rows if idx is None else idx[rows].long()
    state[slot_ids[rows].long()] = intermediate_states[src, n[rows].clamp(max=T) - 1].to(state.dtype)


# ---------------------------------------------------------------------------------------------------------
# Replay: per-slot bookkeeping after acceptance (once per step, shared by all layers)
# ---------------------------------------------------------------------------------------------------------


def ring_advance(ring_start: torch.Tensor, prev_num_accepted: torch.Tensor, slot_ids: torch.Tensor,
                 spec_tokens: int, window: int, ring_len: int) -> None:
    """FlashInfer's ring start after a verify step, before PNAT moves (the rule of
    ``kernels.mamba2.flashinfer_replay``'s ring; the PyTorch reference of `replay_advance`'s ``ring_start=``):
    ring_start[s] = (ring_start[s] + k) mod ring_len for the live rows (slot id >= 0) whose verify flushed
    (k + T > W, k = PNAT clamped to [0, W]): their pending tokens are now in the checkpoint. PAD rows change
    nothing. Device ops only (no host sync: CUDA-graph capturable). slot_ids: (B,) int32 / int64 on the
    metadata's device; mutates ``ring_start`` ((S,) int32)."""
    R = ring_start.shape[0]
    live = slot_ids >= 0
    rows = torch.where(live, slot_ids, R - 1).long()
    k = prev_num_accepted[rows].long().clamp(0, window)
    start = ring_start[rows].long()
    moved = torch.where(live & (k + spec_tokens > window), (start + k) % ring_len, start)
    ring_start.index_copy_(0, rows, torch.where(live, moved, ring_start[R - 1].long()).to(ring_start.dtype))


@triton.jit
def _replay_advance_kernel(pnat_ptr, bufidx_ptr, slot_ptr, nat_ptr, last_ptr, ring_ptr, Bsz, T, L, W, RL,
                           CHECKPOINT: tl.constexpr, LAST: tl.constexpr, RING: tl.constexpr,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = offs < Bsz
    slot = tl.load(slot_ptr + offs, mask=in_batch, other=-1).to(tl.int64)
    live = in_batch & (slot >= 0)  # the same predicate as the verify kernels: PAD rows never advance
    s = tl.where(live, slot, 0)
    raw = tl.load(nat_ptr + offs, mask=live, other=0)
    nat = tl.minimum(tl.maximum(raw, 0), T)
    r = tl.load(bufidx_ptr + s, mask=live, other=0)
    k_old = tl.load(pnat_ptr + s, mask=live, other=0)  # PNAT before this step's update
    if RING:  # FlashInfer's ring: a flush (k + T > W) folds the k pending rows into the checkpoint
        kr = tl.minimum(tl.maximum(k_old, 0), W).to(tl.int64)
        start = tl.load(ring_ptr + s, mask=live, other=0).to(tl.int64)
        start = tl.where(kr + T > W, (start + kr) % RL, start)
        tl.store(ring_ptr + s, start.to(tl.int32), mask=live)
    if LAST:  # the conv window offset: num_accepted_tokens as given
        tl.store(last_ptr + s, raw.to(tl.int32), mask=live)
    if CHECKPOINT:  # the Mamba2 checkpointing verify's flush predicate: pending tokens stay unless k + T > L
        k = tl.minimum(tl.maximum(k_old, 0), L)
        nat = tl.where(k + T > L, nat, nat + k)
    tl.store(pnat_ptr + s, nat.to(tl.int32), mask=live)
    tl.store(bufidx_ptr + s, (1 - (r & 1)).to(tl.int32), mask=live)


def _check_advance(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, T, hist_len, name,
                   last_accepted=None, ring_start=None, ring_window=None, ring_len=None):
    if T < 1:
        raise ValueError(f"{name}: T (tokens per verify) must be >= 1, got {T}")
    if hist_len is not None and hist_len < T:
        raise ValueError(f"{name}: hist_len {hist_len} < T = {T}: pass the L the history was allocated with")
    if prev_num_accepted.dim() != 1:
        raise ValueError(f"{name}: prev_num_accepted must be (S,), got shape {tuple(prev_num_accepted.shape)}")
    check_dtype(prev_num_accepted, (torch.int32,), "prev_num_accepted", name)
    check_dtype(buffer_index, (torch.int32,), "buffer_index", name)
    check_shape(buffer_index, tuple(prev_num_accepted.shape), "buffer_index", name)
    if slot_ids.dim() != 1:
        raise ValueError(f"{name}: slot_ids must be (B,), got shape {tuple(slot_ids.shape)}")
    check_dtype(slot_ids, INDEX_DTYPES, "slot_ids", name)
    check_shape(num_accepted_tokens, tuple(slot_ids.shape), "num_accepted_tokens", name)
    check_dtype(num_accepted_tokens, INDEX_DTYPES, "num_accepted_tokens", name)
    for label, t in (("last_accepted", last_accepted), ("ring_start", ring_start)):
        if t is not None:
            check_dtype(t, (torch.int32,), label, name)
            check_shape(t, tuple(prev_num_accepted.shape), label, name)
    if ring_start is not None:
        if ring_window is None or ring_len is None or not T <= ring_window < ring_len:
            raise ValueError(f"{name}: ring_start needs ring_window W and ring_len R with T <= W < R "
                             f"(FlashInfer's ring of R = W + T rows), got T = {T}, W = {ring_window}, "
                             f"R = {ring_len}")


def replay_advance(
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    T: int,
    *,
    hist_len: int | None = None,
    last_accepted: torch.Tensor | None = None,
    ring_start: torch.Tensor | None = None,
    ring_window: int | None = None,
    ring_len: int | None = None,
) -> None:
    """Per-slot replay bookkeeping after acceptance (Triton): PNAT[s] = num_accepted, flip buffer_index[s],
    and, in the same launch, the optional per-slot metadata the caller passes.

    Call exactly once per verify step, after every layer's replay verify (the metadata is shared by all
    layers; advancing twice makes the next verify replay the wrong buffer).

    Args:
        prev_num_accepted, buffer_index: (S,) int32 (from `allocate_replay_slots`), mutated for live rows.
        slot_ids: (B,) int32 / int64, the verify's slots; negative = PAD, never advances.
        num_accepted_tokens: (B,) int32 / int64, clamped to [0, T] (0 = nothing accepted).
        T: tokens per row of the verify that just ran.
        hist_len: Mamba2 checkpointing histories only (`kernels.mamba2.ReplayHistory` with one x buffer):
            their L. PNAT then counts every pending token: it becomes num_accepted after a flush (old PNAT +
            T > L) and old PNAT + num_accepted otherwise.
        last_accepted: optional (S,) int32, mutated for live rows: = num_accepted_tokens as given (the conv
            window offset of the engine's ``ReplaySlots``).
        ring_start: optional (S,) int32, FlashInfer's ring start (``kernels.mamba2.flashinfer_replay``),
            mutated for live rows by :func:`ring_advance`'s rule from the PNAT before this update;
            ring_window: its replay window W (T <= W), ring_len: its ring's rows R = W + T.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, T < 1, hist_len < T, or ring_start without
            T <= ring_window < ring_len.
    """
    name = "replay_advance"
    _check_advance(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, T, hist_len, name,
                   last_accepted, ring_start, ring_window, ring_len)
    extras = [t for t in (last_accepted, ring_start) if t is not None]
    check_launchable(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, *extras, name=name)
    Bsz = slot_ids.shape[0]
    if Bsz == 0:
        return
    BLOCK = min(1024, triton.next_power_of_2(Bsz))
    _replay_advance_kernel[(triton.cdiv(Bsz, BLOCK),)](
        prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens,
        last_accepted if last_accepted is not None else prev_num_accepted,
        ring_start if ring_start is not None else prev_num_accepted,
        Bsz, T, hist_len or T, ring_window or T, ring_len or 1,
        CHECKPOINT=hist_len is not None, LAST=last_accepted is not None, RING=ring_start is not None,
        BLOCK=BLOCK)


def replay_advance_ref(
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    slot_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    T: int,
    *,
    hist_len: int | None = None,
    last_accepted: torch.Tensor | None = None,
    ring_start: torch.Tensor | None = None,
    ring_window: int | None = None,
    ring_len: int | None = None,
) -> None:
    """PyTorch reference of `replay_advance` (same arguments and effects), vectorised over the batch."""
    name = "replay_advance_ref"
    _check_advance(prev_num_accepted, buffer_index, slot_ids, num_accepted_tokens, T, hist_len, name,
                   last_accepted, ring_start, ring_window, ring_len)
    if ring_start is not None:  # before PNAT moves
        ring_advance(ring_start, prev_num_accepted, slot_ids, T, ring_window, ring_len)
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    if last_accepted is not None:
        last_accepted[slot_ids[rows].long()] = num_accepted_tokens[rows].to(torch.int32)
    slots = slot_ids[rows].long()
    nat = num_accepted_tokens[rows].clamp(0, T).to(torch.int32)
    if hist_len is not None:
        k = prev_num_accepted[slots].clamp(0, hist_len)
        nat = torch.where(k + T > hist_len, nat, nat + k)
    prev_num_accepted[slots] = nat
    buffer_index[slots] = 1 - (buffer_index[slots] & 1)
