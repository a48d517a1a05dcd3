"""Per-slot inference caches: one layer state per stateful block, allocated from what its kind declares.

A *slot* is one row of every cache, owned by one request from admission until it finishes. Every buffer has
``S + 1`` rows: rows ``0 .. S-1`` are the live slots, row ``S`` is a scratch row. The PAD slot id is ``-1``;
because PyTorch indexes ``-1`` as the last row, a PAD row of a batch reads and writes only the scratch row,
never a live slot (slot 0 is a live slot). Callers never need to special-case padding rows.

This module is generic: it knows no kind. Each block kind's mixer declares the state it keeps
(``state_class(replay)``, ``runners/engine/models/kinds.py``): Mamba2 and Gated DeltaNet their conv window
and recurrent state (``runners/engine/models/mamba2.py``, ``gdn.py``), attention its KV cache
(``runners/engine/models/attention.py``); the contract they implement and the machinery the recurrent kinds
share (rewind commit, replay bookkeeping, :class:`runners.engine.state.BatchMeta`) is
``runners/engine/state.py``.

The KV cache is written by position (gpt-fast style): a later write to the same position overwrites a
rejected speculative token, so it needs no rollback. Recurrent state has no positions: after a verify step it
is committed to the state after the accepted tokens, by one of two schemes (``ssm_replay``):
- rewind (default; SGLang / TensorRT-LLM / FlashInfer's scheme): a verify keeps every per-token state
  (T full states per slot) and :meth:`HybridCache.commit` copies the accepted one back;
- replay (TensorRT-LLM's "SSM replay", FlashInfer's ``checkpointing_ssu``): a layer keeps its committed
  state plus the inputs of the last verify; the next verify fast-forwards the state by the tokens accepted
  last step (PNAT) before computing its own, and :meth:`HybridCache.commit` only advances the per-slot
  bookkeeping (``runners.engine.state.ReplaySlots``, one object for all layers). The checkpointing variant
  (``replay_checkpointing``, Mamba2 only) keeps max(16, T) tokens and writes the state only when they are
  full; per-step replay is the default because it measured faster and smaller with our kernels
  (docs/kernel_performance.md says by how much, and when to revisit).
``ssm_backend`` picks who runs the recurrent-state operators of every layer state
(``runners.engine.state.kernel_or_reference``).
Each state class declares its tensors once (``buffers(config, spec)``: shape, dtype and the memory kind its
bytes count under): ``allocate`` builds exactly those tensors and ``planned_memory`` adds up their bytes, so
:func:`cache_memory_bytes` (the bytes of every buffer from the config alone, no allocation: the engine's
memory plan and report) cannot drift from what is allocated; tests check the plan against every tensor a
cache holds.
"""

from __future__ import annotations

import math

import torch

from kernels._common import PAD_SLOT_ID
from kernels.mamba2.flashinfer_replay import SR_STATE_DTYPES
from kernels.rounding import SR_DTYPES, StochasticRounding
from runners.engine.models.config import HybridConfig
from runners.engine.models.kinds import state_class
from runners.engine.state import (
    MEMORY_KEYS,
    SSM_BACKENDS,
    CacheSpec,
    LayerState,
    ReplaySlots,
)

__all__ = ["SSM_BACKENDS", "MEMORY_KEYS", "HybridCache", "cache_memory_bytes", "layer_state_class"]


def layer_state_class(kind: str, replay: bool = False, cache_index: int | None = None) -> type[LayerState]:
    """The :class:`LayerState` class a block of ``kind`` keeps (its mixer's ``state_class``), under ssm_replay
    when ``replay``. Raises ValueError for a kind without a mixer or without per-slot state (naming
    ``cache_index`` when given)."""
    where = "" if cache_index is None else f" (cache_index {cache_index})"
    try:
        cls = state_class(kind, replay)
    except ValueError as e:
        raise ValueError(f"no cache layout for block kind {kind!r}{where}: {e}") from None
    if cls is None:
        raise ValueError(f"block kind {kind!r}{where} keeps no per-slot state: it has no cache layout")
    return cls


def _replay_classes(cache_kinds: dict[int, str]) -> dict[str, type[LayerState]]:
    """{kind: replay state class} of the recurrent kinds of ``cache_kinds`` (those committed by replay)."""
    out = {k: layer_state_class(k, True, i) for i, k in sorted(cache_kinds.items())}
    out = {k: cls for k, cls in out.items() if cls.replay}
    if not out:
        raise ValueError(
            f"ssm_replay needs a recurrent block kind with a replay state; this model's kinds "
            f"({sorted(set(cache_kinds.values()))}) have none: set ssm_replay=False"
        )
    return out


def _check_replay_args(
    ssm_replay: bool, spec_tokens: int, checkpointing: bool, cache_kinds: dict[int, str]
) -> None:
    if ssm_replay and spec_tokens < 2:
        raise ValueError(
            "ssm_replay requires speculative decoding: build the cache with spec_tokens = K + 1 >= 2 "
            "(draft_len K >= 1), or set ssm_replay=False"
        )
    if checkpointing and not ssm_replay:
        raise ValueError(
            "ssm_replay_checkpointing is a variant of ssm_replay; set ssm_replay=True or drop it"
        )
    if not ssm_replay:
        return
    classes = _replay_classes(cache_kinds)
    without = sorted(k for k, cls in classes.items() if not cls.checkpointing)
    if checkpointing and without:
        raise ValueError(
            f"the checkpointing replay variant exists for mamba2 layers only (kernels/mamba2/replay.py), not "
            f"{without}; set ssm_replay_checkpointing=False (registry: ssm.replay_checkpointing: false) for "
            "this model"
        )


def cache_memory_bytes(
    config: HybridConfig,
    cache_kinds: dict[int, str],
    *,
    max_batch_size: int,
    max_seq_len: int,
    dtype: torch.dtype,
    ssm_state_dtype: torch.dtype = torch.float32,
    spec_tokens: int = 0,
    ssm_replay: bool = False,
    replay_checkpointing: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
    ssm_backend: str = "torch",
    replay_ring: bool | None = None,
) -> dict[str, int]:
    """Bytes a :class:`HybridCache` with these arguments allocates, by kind, computed from the architecture
    alone (nothing is allocated; usable for released shapes without weights). Same arguments and keys as
    :class:`HybridCache` / :meth:`HybridCache.memory` (the S + 1 scratch row included; an FP8
    ``kv_cache_dtype`` halves ``kv_cache_bytes`` against a 16-bit model dtype; ``replay_ring``, by default
    ``ssm_backend="flashinfer"``, plans FlashInfer's ring history for the Mamba2 layers).

    Raises:
        ValueError: ssm_replay without speculation, or a block kind without a cache layout.
    """
    _check_replay_args(ssm_replay, spec_tokens, replay_checkpointing, cache_kinds)
    rows = max_batch_size + 1
    ring = ssm_backend == "flashinfer" if replay_ring is None else replay_ring
    spec = CacheSpec(rows, max_seq_len, dtype, ssm_state_dtype, "meta", spec_tokens, ssm_backend=ssm_backend,
                     replay_ring=ring)
    spec.replay_checkpointing = replay_checkpointing
    spec.kv_cache_dtype = kv_cache_dtype
    out = dict.fromkeys(MEMORY_KEYS, 0)
    for idx, kind in sorted(cache_kinds.items()):
        for key, n in layer_state_class(kind, ssm_replay, idx).planned_memory(config, spec).items():
            out[key] += n
    if ssm_replay:
        out["spec_buffers_bytes"] += ReplaySlots.planned_bytes(rows, ring)
    return out



class HybridCache:
    """All per-slot caches of a model: one :class:`LayerState` per stateful block, keyed by ``cache_index``.

    Args:
        config: the model's :class:`HybridConfig`.
        cache_kinds: ``{cache_index: kind}`` for every block that keeps state (a kind of
            ``runners.engine.models.kinds`` whose mixer declares a ``state_class``; the MTP module's blocks
            take indices after the backbone's).
        max_batch_size: S, the number of live slots.
        max_seq_len: positions per slot in the KV cache (prompt + generated tokens).
        dtype: dtype of conv state and KV cache (the model dtype).
        ssm_state_dtype: dtype of the SSM state (float32 is the safe default: a 16-bit state is rounded on
            every store and loses accuracy over long outputs).
        device: where the buffers live.
        spec_tokens: T = K + 1 tokens of a speculative verify step; > 0 allocates the rewind buffers of
            every recurrent layer (``runners.engine.state.RecurrentState``); 0 (default) allocates none.
        ssm_replay: commit recurrent state by replay (the kinds' replay states,
            ``runners.engine.state.RecurrentReplayState``, and one :class:`ReplaySlots`, ``self.replay``)
            instead of rewind; needs ``spec_tokens >= 2``.
        ssm_backend: "torch" | "triton" | "flashinfer": who runs the recurrent-state operators of every layer
            state (decode, verify, commit, advance; ``runners.engine.state.kernel_or_reference``); the mixers
            read it from the state they are given.
        replay_checkpointing: the checkpointing replay variant (Mamba2 only): a history window of
            L = max(16, T) tokens, the state written only when the pending tokens and the new ones do not fit
            (``kernels/mamba2/replay.py``).
        replay_ring: the Mamba2 replay histories in FlashInfer's ring layout, replayed by its
            ``checkpointing_ssu`` under ``ssm_backend="flashinfer"`` and by that contract's PyTorch reference
            otherwise (``kernels.mamba2.flashinfer_replay``); None: exactly with ``ssm_backend="flashinfer"``.
            Refused for a model that clamps dt (``time_step_limit``): the contract has no clamp.
        kv_cache_dtype: storage dtype of the attention KV caches (None: ``dtype``; ``torch.float8_e4m3fn``
            stores keys and values in FP8 with per-layer scales, ``runners.engine.models.attention.KVCache``).
        stochastic_rounding: round every write of a 16-bit SSM state (decode, rewind verify, replay verify)
            stochastically (``kernels/rounding.py``) instead of to nearest; needs a bfloat16 / float16
            ``ssm_state_dtype``. ``self.rounding`` holds the Philox seed (``rounding_seed``) and step counter
            on the device, each recurrent layer state its own salt (its cache index); call
            :meth:`advance_rounding` once after every cached forward so consecutive writes draw new bits.
            Prefill (the chunked scans) stores its final state rounded to nearest. Under
            ``ssm_backend="flashinfer"`` only its replay kernel takes it, into a float16 state, with its own
            Philox bits (``kernels.mamba2.flashinfer_replay.SR_STATE_DTYPES``); else refused.

    All buffers start zeroed (never ``torch.empty``: a stale read must not see garbage).

    Raises:
        ValueError: bad sizes, an unknown block kind or backend, ssm_replay without speculation, or
            replay_ring for a model that clamps dt.
    """

    def __init__(
        self,
        config: HybridConfig,
        cache_kinds: dict[int, str],
        *,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        ssm_state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        spec_tokens: int = 0,
        ssm_replay: bool = False,
        ssm_backend: str = "torch",
        replay_checkpointing: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
        stochastic_rounding: bool = False,
        rounding_seed: int = 0,
        replay_ring: bool | None = None,
    ):
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"max_batch_size={max_batch_size} and max_seq_len={max_seq_len} must be >= 1")
        if ssm_backend not in SSM_BACKENDS:
            raise ValueError(f"ssm_backend={ssm_backend!r} is not one of {SSM_BACKENDS}")
        _check_replay_args(ssm_replay, spec_tokens, replay_checkpointing, cache_kinds)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.spec_tokens = spec_tokens
        self.ssm_replay, self.ssm_backend = ssm_replay, ssm_backend
        R = max_batch_size + 1
        self.replay = None
        ring = ssm_backend == "flashinfer" if replay_ring is None else replay_ring
        limit = tuple(getattr(config, "time_step_limit", (0.0, math.inf)))
        if ssm_replay and ring and config.mamba_num_heads and limit != (0.0, math.inf):
            raise ValueError(
                "replay_ring: FlashInfer's checkpointing_ssu contract has no dt clamp, and this model "
                f"clamps dt (time_step_limit={limit}); use replay_ring=False (our replay history) for it")
        if ssm_replay:
            self.replay = ReplaySlots.allocate(R, spec_tokens, ssm_backend, device, replay_checkpointing,
                                               ring)
        spec = CacheSpec(
            R, max_seq_len, dtype, ssm_state_dtype, device, spec_tokens, self.replay, replay_checkpointing,
            ssm_backend, kv_cache_dtype, ring,
        )
        self.layers: dict[int, LayerState] = {}
        for idx, kind in sorted(cache_kinds.items()):
            self.layers[idx] = layer_state_class(kind, ssm_replay, idx).allocate(config, spec)
        self.rounding = None
        if stochastic_rounding:
            if ssm_state_dtype not in SR_DTYPES:
                raise ValueError(
                    f"stochastic rounding of the SSM state needs a 16-bit ssm_state_dtype (bfloat16 or "
                    f"float16), got {ssm_state_dtype}: a float32 state is never rounded"
                )
            if ssm_replay and ring and config.mamba_num_heads and ssm_state_dtype not in SR_STATE_DTYPES:
                raise ValueError(
                    f"stochastic rounding over FlashInfer's ring histories (replay_ring) rounds into a "
                    f"float16 state only, got {ssm_state_dtype}: use ssm_state_dtype=float16, or the "
                    f"engine's own replay histories (replay_ring=False, ssm_backend 'triton' or 'torch')"
                )
            if ssm_backend == "flashinfer" and not (ssm_replay and ring):
                raise ValueError(
                    f"stochastic rounding with ssm_backend 'flashinfer' runs in its replay kernel into a "
                    f"float16 state only (ssm_replay, ssm_state_dtype=float16; this cache: ssm_replay="
                    f"{ssm_replay}, {ssm_state_dtype}); use ssm_backend 'triton' (or 'torch')"
                )
            self.rounding = StochasticRounding.create(rounding_seed, device=device)
            for idx, layer in self.layers.items():
                if hasattr(layer, "rounding"):
                    layer.rounding = self.rounding.for_layer(idx)

    def advance_rounding(self) -> None:
        """Advance the stochastic-rounding step counter on the device (no-op without stochastic rounding).
        Call once after every forward that uses this cache: every state write of the next forward then
        draws new random bits (graph-capturable: an in-place add)."""
        if self.rounding is not None:
            self.rounding.advance()

    def __getitem__(self, cache_index: int) -> LayerState:
        return self.layers[cache_index]

    def _rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Validated cache rows of ``slot_ids`` (PAD -1 -> the scratch row S)."""
        self.check_slots(slot_ids)
        return slot_ids % (self.max_batch_size + 1)

    def check_slots(self, slot_ids: torch.Tensor) -> None:
        """Raise ValueError unless every slot id is PAD (-1) or a live slot in [0, S)."""
        if slot_ids.numel() and (
            int(slot_ids.min()) < PAD_SLOT_ID or int(slot_ids.max()) >= self.max_batch_size
        ):
            raise ValueError(
                f"slot ids {slot_ids.tolist()} out of range: use -1 (PAD) or 0..{self.max_batch_size - 1}"
            )

    def reset(self, slot_ids: torch.Tensor) -> None:
        """Zero the state of ``slot_ids`` [n] (int64) in place: conv window, SSM state, replay bookkeeping.

        Called when a request is admitted to a slot; zeroes the slot's KV rows too (every position: masked
        reads past the request's length must see finite values, ``KVCache.reset_rows``). PAD ids (-1)
        reset only the scratch row.
        """
        rows = self._rows(slot_ids)
        for layer in self.layers.values():
            layer.reset_rows(rows)
        if self.replay is not None:
            self.replay.reset(rows)

    def commit(
        self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor, *, check: bool = True
    ) -> None:
        """Commit after a verify step: each slot's recurrent state becomes the state after its first
        ``num_accepted_tokens`` verify tokens. Rewind copies that state from the per-token buffers; replay
        advances the per-slot bookkeeping once (:meth:`ReplaySlots.advance`; the next verify fast-forwards).
        The KV cache needs nothing (written by position). Call exactly once per verify step.

        Args:
            slot_ids: [B] int64 slots of the verify batch (PAD -1 rows commit nothing).
            num_accepted_tokens: [B] int64 in [1, T]; anything else raises (a 0 or > T from a stale or padding
                row must never index a neighbouring column).
            check: validate both on the host (the default; it reads them back, a host synchronisation).
                The engine's CUDA-graph step passes False: its values are in range by construction, and the
                commit kernels clamp num_accepted_tokens to [0, T] and skip PAD rows anyway.

        Raises:
            ValueError: no spec buffers (cache built with spec_tokens=0), or num_accepted_tokens out of range.
            RuntimeError: replay commit without a verify since the last commit.
        """
        T = self.spec_tokens
        if T == 0:
            raise ValueError("commit() needs the rewind buffers: build the cache with spec_tokens = K + 1")
        n = num_accepted_tokens.to(torch.long)
        if check and n.numel() and (int(n.min()) < 1 or int(n.max()) > T):
            raise ValueError(f"num_accepted_tokens {n.tolist()} must lie in [1, T={T}]")
        if check:
            self.check_slots(slot_ids)
        if self.replay is not None:
            self.replay.advance(slot_ids, n)
        for layer in self.layers.values():
            layer.commit(slot_ids, n)

    def memory(self) -> dict[str, int]:
        """Bytes allocated by kind (including the scratch row); keys as in docs/architecture.md."""
        out = dict.fromkeys(MEMORY_KEYS, 0)
        for layer in self.layers.values():
            for key, n in layer.memory().items():
                out[key] += n
        if self.replay is not None:
            out["spec_buffers_bytes"] += self.replay.nbytes()
        return out
