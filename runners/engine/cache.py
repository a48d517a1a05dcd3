"""Per-slot inference caches: recurrent state (Mamba2, Gated DeltaNet) and attention KV, by slot id.

A *slot* is one row of every cache, owned by one request from admission until it finishes. Every buffer has
``S + 1`` rows: rows ``0 .. S-1`` are the live slots, row ``S`` is a scratch row. The PAD slot id is ``-1``;
because PyTorch indexes ``-1`` as the last row, a PAD row of a batch reads and writes only the scratch row,
never a live slot (slot 0 is a live slot). Callers never need to special-case padding rows.

The KV cache is written by position (gpt-fast style): a token at position ``p`` of a request goes to
``k[slot, p]``; a later write to the same position overwrites it, so rejected speculative tokens need no
rollback. Recurrent state (conv window, SSM state) has no positions: after a verify step it is committed to
the state after the accepted tokens (rewind or replay, below). Shapes use the project vocabulary: S slots,
H mamba heads, P mamba head_dim, N d_state, W conv_kernel, KVH key/value heads, K draft length, T = K + 1.

Two commit schemes for the recurrent layers of a speculative (MTP) engine:
- rewind (default; SGLang / TensorRT-LLM / FlashInfer's scheme): a verify keeps every per-token state
  (``ssm_steps``, T full states per slot) and :meth:`HybridCache.commit` copies the accepted one back
  (``kernels.commit.rewind_commit``);
- replay (``ssm_replay=True``; TensorRT-LLM's "SSM replay", FlashInfer's ``checkpointing_ssu``): the layer
  keeps its committed state plus the inputs of the last verify (:class:`Mamba2ReplayState`,
  :class:`GDNReplayState`); the next verify fast-forwards the state by the tokens accepted last step (PNAT)
  before computing its own tokens, and :meth:`HybridCache.commit` only advances the per-slot bookkeeping
  (:class:`ReplaySlots`, one object for all layers; ``kernels.commit.replay_advance``). Conv windows keep K
  extra columns and are read at offset (accepted - 1) instead of being copied at commit. The Mamba2
  checkpointing variant (``replay_checkpointing``) keeps max(16, T) tokens and writes the state only when
  they are full; per-step replay is the default because with our kernels it measured faster and smaller on
  the H200 (docs/kernel_performance.md, Super V3 mixer, batch 64, T = 4, fp32 state: 201 us per verify
  with the state written vs 216 us (3 pending) to 354 us (12 pending) without a write and 391 us on a
  flush; history 156 vs 360 KB per slot and layer). FlashInfer's checkpointing_ssu (91 us) shows the
  variant can win with a better kernel: revisit then.
``ssm_backend`` picks who runs the recurrent-state operators of every layer state (the mixers read it from
the state they are given): "triton" the Triton kernels of kernels/, "torch" their PyTorch references,
"flashinfer" FlashInfer's ``selective_state_update`` for the Mamba2 rewind verify and Triton for the rest
(:func:`kernel_or_reference`).
Each state class declares its tensors once (``buffers(config, spec)``: {name: :class:`Buffer`}, shape,
dtype and the memory kind its bytes count under): ``allocate`` builds exactly those tensors and
``planned_memory`` adds up their bytes, so :func:`cache_memory_bytes` (the bytes of every buffer from the
config alone, no allocation: the engine's memory plan and report) cannot drift from what is allocated; tests
check the plan against every tensor a cache holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from kernels import gdn, mamba2
from kernels._common import PAD_SLOT_ID
from kernels.commit import (
    replay_advance,
    replay_advance_ref,
    rewind_commit,
    rewind_commit_ref,
)
from kernels.rounding import SR_DTYPES, StochasticRounding
from runners.engine.compile import eager_op
from runners.engine.models.config import HybridConfig
from runners.engine.models.fp8 import FP8_DTYPE, quantize_fp8

log = logging.getLogger(__name__)

SSM_BACKENDS = ("triton", "flashinfer", "torch")
MEMORY_KEYS = ("ssm_state_bytes", "conv_state_bytes", "kv_cache_bytes", "spec_buffers_bytes")

Op = TypeVar("Op", bound=Callable)


def kernel_or_reference(ssm_backend: str, kernel: Op, reference: Op) -> Op:
    """The implementation of a recurrent-state operator under ``ssm_backend``: its Triton ``kernel`` for
    "triton" and "flashinfer" (FlashInfer's own kernel replaces only the Mamba2 rewind verify, in the mixer),
    its PyTorch ``reference`` (same signature, the ``*_ref`` beside it in kernels/) for "torch". Under
    torch.compile (``EngineOptions.compile``) either runs outside the compiled region
    (``runners.engine.compile.eager_op``)."""
    return eager_op(reference if ssm_backend == "torch" else kernel)


@dataclass
class CacheSpec:
    """What a layer-state allocator needs: R = S + 1 rows (the scratch row included), dtypes, device,
    T = ``spec_tokens`` (K + 1 tokens of a verify step; 0 = no speculative buffers), the commit scheme
    (``replay``: the shared :class:`ReplaySlots`, None = rewind) and the ``ssm_backend`` of its operators."""

    rows: int
    max_seq_len: int
    dtype: torch.dtype
    ssm_state_dtype: torch.dtype
    device: torch.device | str
    spec_tokens: int
    replay: ReplaySlots | None = None
    replay_checkpointing: bool = False
    ssm_backend: str = "torch"
    kv_cache_dtype: torch.dtype | None = None  # KV cache storage dtype (None: ``dtype``; float8_e4m3fn)


@dataclass(frozen=True)
class Buffer:
    """One tensor of a layer state, declared once (``LayerState.buffers``): its ``shape``, ``dtype`` and the
    memory kind (a key of :data:`MEMORY_KEYS`) its bytes count under; ``spec_cols`` trailing columns of its
    last axis are speculative-only and count as ``spec_buffers_bytes`` (a replay conv window's K extra
    columns)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    spec_cols: int = 0

    @property
    def nbytes(self) -> int:
        return _bytes(self.dtype, *self.shape)


def _split_bytes(out: dict[str, int], buf: Buffer, nbytes: int, cols: int) -> None:
    """Add ``nbytes`` of a tensor declared as ``buf`` (``cols`` columns in its last axis) to ``out``, by
    kind."""
    spec = nbytes * buf.spec_cols // cols if buf.spec_cols else 0
    out[buf.kind] = out.get(buf.kind, 0) + nbytes - spec
    if spec:
        out["spec_buffers_bytes"] = out.get("spec_buffers_bytes", 0) + spec


def _zeros(layout: dict[str, Buffer], device) -> dict[str, torch.Tensor]:
    """The declared tensors, zeroed (never ``torch.empty``: a stale read must not see garbage)."""
    return {name: torch.zeros(b.shape, dtype=b.dtype, device=device) for name, b in layout.items()}


class LayerState:
    """Per-slot state of one block. Subclasses hold buffers of R = S + 1 rows and implement:

    - ``buffers(config, spec)``: {attribute: :class:`Buffer`} of every tensor the state holds under ``spec``
      (a dotted name reaches into a member, e.g. ``history.x``): the one declaration of its shapes, read
      by ``allocate`` (the tensors) and :meth:`planned_memory` (their bytes);
    - ``reset_rows(rows)``: zero the state of cache rows ``rows`` [n] (a request is admitted);
    - ``commit(slot_ids, num_accepted_tokens)``: after a verify step, make the state of slots ``slot_ids``
      [n] (PAD -1 rows: nothing) the one after their first ``num_accepted_tokens`` [n] tokens (rewind);
      replay and stateless-by-position kinds do nothing.

    :meth:`memory` measures the allocated tensors the declaration names (kept as ``layout``).
    ``spec_buffers`` names the attributes that only speculative decoding allocates (None when the cache is
    built with ``spec_tokens = 0``); they are a verify step's scratch, not a slot's committed state.
    """

    spec_buffers: ClassVar[tuple[str, ...]] = ()
    layout: dict[str, Buffer]

    @classmethod
    def buffers(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, Buffer]:
        raise NotImplementedError

    def reset_rows(self, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        raise NotImplementedError

    def memory(self) -> dict[str, int]:
        """Bytes of the allocated tensors by kind: ``{"ssm_state_bytes" | "conv_state_bytes" |
        "kv_cache_bytes" | "spec_buffers_bytes": n}``."""
        out: dict[str, int] = {}
        for name, buf in self.layout.items():
            t = self
            for part in name.split("."):
                t = getattr(t, part)
            _split_bytes(out, buf, _nbytes(t), t.shape[-1])
        return out

    @classmethod
    def planned_memory(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, int]:
        """The bytes :meth:`memory` reports after ``allocate(c, spec)``, from :meth:`buffers` alone."""
        out: dict[str, int] = {}
        for buf in cls.buffers(c, spec).values():
            _split_bytes(out, buf, buf.nbytes, buf.shape[-1])
        return out


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _bytes(dtype: torch.dtype, *shape: int) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


SSM, CONV, KV, SPEC = MEMORY_KEYS


@dataclass
class Mamba2State(LayerState):
    """Recurrent state of one Mamba2 layer.

    conv: [S + 1, conv_dim, W - 1], model dtype; the last W - 1 inputs of the causal conv (oldest first).
    ssm:  [S + 1, H, P, N], ``ssm_state_dtype`` (float32 by default); the SSM state h.

    Speculative (rewind) buffers, allocated only when the cache is built with ``spec_tokens = T > 0``:
    conv_steps: [S + 1, conv_dim, W - 1 + T], the conv input window of the last verify (old W - 1 + T new).
    ssm_steps:  [S + 1, T, H, P, N], the SSM state after each of the T verify tokens.
    Both are indexed by slot like ``conv`` / ``ssm`` (the kernels' ``intermediate_state_indices`` = slot ids).
    A verify forward fills these and leaves ``conv`` / ``ssm`` alone; :meth:`commit` then copies the state
    after the accepted tokens back. ``ssm_backend``: who runs the operators (:func:`kernel_or_reference`).
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    conv_steps: torch.Tensor | None = None
    ssm_steps: torch.Tensor | None = None
    ssm_backend: str = "torch"
    rounding: StochasticRounding | None = None  # set by HybridCache (ssm_stochastic_rounding)
    layout: dict[str, Buffer] = field(default_factory=dict, repr=False)
    spec_buffers: ClassVar[tuple[str, ...]] = ("conv_steps", "ssm_steps")

    @staticmethod
    def state_shapes(c: HybridConfig) -> tuple[int, tuple[int, ...]]:
        """(conv channels C, the per-slot SSM state's shape [H, P, N])."""
        return c.mamba_conv_dim, (c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size)

    @classmethod
    def buffers(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, Buffer]:
        (C, state), R, W1, T = cls.state_shapes(c), spec.rows, c.conv_kernel - 1, spec.spec_tokens
        out = {"conv": Buffer((R, C, W1), spec.dtype, CONV),
               "ssm": Buffer((R, *state), spec.ssm_state_dtype, SSM)}
        if T:
            out["conv_steps"] = Buffer((R, C, W1 + T), spec.dtype, SPEC)
            out["ssm_steps"] = Buffer((R, T, *state), spec.ssm_state_dtype, SPEC)
        return out

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> Mamba2State:
        layout = cls.buffers(c, spec)
        return cls(**_zeros(layout, spec.device), ssm_backend=spec.ssm_backend, layout=layout)

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.conv.index_fill_(0, rows, 0)
        self.ssm.index_fill_(0, rows, 0)

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        n = num_accepted_tokens
        commit = kernel_or_reference(self.ssm_backend, rewind_commit, rewind_commit_ref)
        commit(self.ssm, self.ssm_steps, slot_ids, n, intermediate_state_indices=slot_ids)
        rows = slot_ids % self.conv.shape[0]  # PAD (-1) -> the scratch row
        W1 = self.conv.shape[-1]
        cols = n[:, None] + torch.arange(W1, device=n.device)  # the W - 1 conv inputs before token n
        window = self.conv_steps[rows]
        self.conv.index_copy_(0, rows, window.gather(2, cols[:, None, :].expand(-1, window.shape[1], -1)))


@dataclass
class GDNState(Mamba2State):
    """Recurrent state of one Gated DeltaNet layer (Qwen3-Next ``linear_attn``): Mamba2State's buffers and
    its reset / rewind commit / memory API, with GDN shapes (HV value heads, V / K value / key head dims,
    C = 2 H K + HV V conv channels [Q | K | V], W = conv_kernel):

    conv: [S + 1, C, W - 1], model dtype; the last W - 1 conv inputs, oldest first.
    ssm:  [S + 1, HV, V, K], ``ssm_state_dtype``; the delta-rule state S with K contiguous (as
          runners/engine/models/gdn.py: o = S q; transformers keeps [.., K, V], the transpose).
    conv_steps: [S + 1, C, W - 1 + T] and ssm_steps: [S + 1, T, HV, V, K] (rewind buffers, only with
          ``spec_tokens = T > 0``): the conv window and the state after each token of the last verify.
    """

    @staticmethod
    def state_shapes(c: HybridConfig) -> tuple[int, tuple[int, ...]]:
        """(conv channels C = 2 H K + HV V, the per-slot delta-rule state's shape [HV, V, K])."""
        HV, V, K = c.gdn_num_value_heads, c.gdn_value_head_dim, c.gdn_key_head_dim
        return 2 * c.gdn_num_key_heads * K + HV * V, (HV, V, K)


def replay_hist_len(spec_tokens: int, checkpointing: bool) -> int:
    """History length L of a replay layer: T (per-step replay) or max(16, T) (checkpointing: the dots pad
    the token axis to 16 anyway, so the window costs no extra compute up to 16 tokens)."""
    return max(16, spec_tokens) if checkpointing else spec_tokens


@dataclass
class ReplaySlots:
    """Per-slot replay bookkeeping shared by every recurrent layer of a model (the one owner of it).

    prev_num_accepted: [S + 1] int32, PNAT: tokens of the slot's last verify that were accepted (0 = nothing
        to replay: a fresh slot, or the step after prefill).
    buffer_index: [S + 1] int32, which of the two history buffers holds the last verify's inputs.
    last_accepted: [S + 1] int32, num_accepted_tokens of the slot's last verify (0 after prefill): the conv
        window offset. Equal to PNAT in per-step replay; in the checkpointing variant (``hist_len`` set,
        Mamba2 only) PNAT counts every accepted token not yet folded into the state, over several verifies.
    All start zeroed (``kernels.commit.allocate_replay_slots``: a graph or kernel that reads them before the
    first fill sees "nothing to replay").

    Lifecycle (the kernels' contract, ``kernels/commit.py``): :meth:`reset` at admission (prefill writes the
    state, PNAT = 0); every verify of every layer reads PNAT / buffer_index and fast-forwards; :meth:`advance`
    runs exactly once per verify step, after all layers (``kernels.commit.replay_advance``, the same for both
    families, with the verify kernels' liveness predicate: PAD rows, slot id -1, never advance). ``verified``
    guards the "advance twice in one step" bug: a verify sets it, advance requires and clears it.
    """

    prev_num_accepted: torch.Tensor
    buffer_index: torch.Tensor
    last_accepted: torch.Tensor
    spec_tokens: int
    ssm_backend: str = "torch"
    hist_len: int | None = None  # checkpointing variant: the history window L = max(16, T); None: per-step
    verified: bool = False

    @staticmethod
    def buffers(rows: int) -> dict[str, Buffer]:
        """The three [rows] int32 tensors (speculative-only bytes), declared once for allocation and plan
        (zeros: ``kernels.commit.allocate_replay_slots``' contract, "nothing to replay, buffer 0")."""
        return {name: Buffer((rows,), torch.int32, SPEC)
                for name in ("prev_num_accepted", "buffer_index", "last_accepted")}

    @classmethod
    def allocate(
        cls, rows: int, spec_tokens: int, ssm_backend: str, device, checkpointing: bool = False
    ) -> ReplaySlots:
        hist_len = replay_hist_len(spec_tokens, checkpointing) if checkpointing else None
        return cls(**_zeros(cls.buffers(rows), device), spec_tokens=spec_tokens, ssm_backend=ssm_backend,
                   hist_len=hist_len)

    @classmethod
    def planned_bytes(cls, rows: int) -> int:
        return sum(b.nbytes for b in cls.buffers(rows).values())

    def nbytes(self) -> int:
        return _nbytes(self.prev_num_accepted, self.buffer_index, self.last_accepted)

    def reset(self, rows: torch.Tensor) -> None:
        """Cache rows ``rows`` [n] (int64, PAD already mapped to the scratch row) start over: PNAT = 0."""
        for t in (self.prev_num_accepted, self.buffer_index, self.last_accepted):
            t.index_fill_(0, rows, 0)

    def conv_offset(self, rows: torch.Tensor) -> torch.Tensor:
        """[n] int64 column where the committed conv window of cache rows ``rows`` starts: a - 1 after a
        verify that accepted a tokens (the window after them), 0 after prefill. Clamped to [0, T - 1], like
        the kernels clamp num_accepted_tokens, so a PAD row reading a garbage scratch row indexes in range."""
        return (self.last_accepted[rows].long() - 1).clamp(0, self.spec_tokens - 1)

    def conv_window_start(self, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [B], cols [B]) int64 of a verify batch's committed conv windows: row b's window starts at
        column ``cols[b]`` (:meth:`conv_offset`) of cache row ``rows[b]`` (``meta.row_index``); what a kernel
        that reads the windows in place takes (``kernels.mamba2.conv.causal_conv_step``'s src_rows /
        src_cols). Computed once per step (``BatchMeta.shared``)."""
        def make():
            rows = meta.row_index(self.last_accepted.shape[0])
            return rows, self.conv_offset(rows)
        return meta.shared(("replay_conv_start", id(self)), make)

    def conv_window_index(self, meta: BatchMeta, width: int, channels: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Advanced index of the committed conv windows of a verify batch: ``conv[index]`` is [B, channels,
        width], row b = ``conv[rows[b], :, off_b : off_b + width]`` (``off`` = :meth:`conv_offset`, rows =
        ``meta.row_index``) of a replay conv buffer [S + 1, channels, width + K]. One gather instead of a row
        gather then a column gather; the index is the same for every layer of the step
        (``BatchMeta.shared``: computed once)."""
        def make():
            rows = meta.row_index(self.last_accepted.shape[0])
            cols = self.conv_offset(rows)[:, None] + torch.arange(width, device=rows.device)  # [B, width]
            chan = torch.arange(channels, device=rows.device)
            return rows[:, None, None], chan[None, :, None], cols[:, None, :]
        return meta.shared(("replay_conv_window", id(self), width, channels), make)

    def advance(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        """After a verify step: PNAT[s] = num_accepted_tokens, flip buffer_index[s] for live rows (slot id
        >= 0); PAD rows (-1) change nothing. slot_ids, num_accepted_tokens: [B] int64 on the cache device.

        Raises:
            RuntimeError: no verify ran since the last advance (advancing twice replays the wrong buffer).
        """
        if not self.verified:
            raise RuntimeError(
                "replay advance without a verify since the last one: the replay bookkeeping must advance "
                "exactly once per verify step (after all layers' verifies)"
            )
        self.verified = False
        # the conv offset: live rows only (PAD rows keep the scratch row's value; no host sync)
        live = slot_ids >= 0
        R = self.last_accepted.shape[0]
        self.last_accepted.index_copy_(
            0,
            torch.where(live, slot_ids, R - 1),
            torch.where(live, num_accepted_tokens.to(torch.int32), self.last_accepted[R - 1]),
        )
        advance = kernel_or_reference(self.ssm_backend, replay_advance, replay_advance_ref)
        advance(self.prev_num_accepted, self.buffer_index, slot_ids, num_accepted_tokens, self.spec_tokens,
                hist_len=self.hist_len)


@dataclass
class Mamba2ReplayState(LayerState):
    """Recurrent state of one Mamba2 layer under SSM replay (``ssm_replay=True``; needs speculation, K > 0).

    ssm:  [S + 1, H, P, N], ``ssm_state_dtype``; the committed state. It lags the sequence by the PNAT tokens
          accepted in the slot's last verify: the next verify fast-forwards it (and writes it back).
    conv: [S + 1, C, W - 1 + K], model dtype; the conv inputs of the last verify window after its first
          column. The committed window (the W - 1 inputs before the next token) is columns
          ``off .. off + W - 2`` with ``off = slots.conv_offset`` (PNAT - 1; 0 after prefill, which writes
          columns 0 .. W - 2), so acceptance needs no copy.
    history: ``kernels.mamba2.ReplayHistory`` with S + 1 slots and L = T: x (S + 1, 2, T, H, P) and
          B (S + 1, 2, T, G, N) in the model dtype, dt' and dA_cumsum (S + 1, 2, H, T) float32.
    slots: the model's shared :class:`ReplaySlots`.
    ssm_backend: who runs the replay verify (:func:`kernel_or_reference`).
    Speculative-only bytes: the K extra conv columns and the history (vs. rewind's T full states).
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    history: mamba2.ReplayHistory | gdn.ReplayHistory
    slots: ReplaySlots
    ssm_backend: str = "torch"
    rounding: StochasticRounding | None = None  # set by HybridCache (ssm_stochastic_rounding)
    layout: dict[str, Buffer] = field(default_factory=dict, repr=False)
    history_type: ClassVar[type] = mamba2.ReplayHistory
    state_shapes = staticmethod(Mamba2State.state_shapes)

    @staticmethod
    def history_shapes(c: HybridConfig, spec: CacheSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The history's tensors (``kernels.mamba2.ReplayHistory.shapes``: S + 1 slots, L = T, or
        max(16, T) in the checkpointing variant, x and B in the model dtype)."""
        L = replay_hist_len(spec.spec_tokens, spec.replay_checkpointing)
        return mamba2.ReplayHistory.shapes(spec.rows, L, c.mamba_num_heads, c.mamba_head_dim, c.n_groups,
                                           c.ssm_state_size, dtype=spec.dtype,
                                           checkpointing=spec.replay_checkpointing)

    @classmethod
    def buffers(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, Buffer]:
        (C, state), R, W1, T = cls.state_shapes(c), spec.rows, c.conv_kernel - 1, spec.spec_tokens
        out = {"conv": Buffer((R, C, W1 + T - 1), spec.dtype, CONV, spec_cols=T - 1),
               "ssm": Buffer((R, *state), spec.ssm_state_dtype, SSM)}
        for name, (shape, dtype) in cls.history_shapes(c, spec).items():
            out[f"history.{name}"] = Buffer(shape, dtype, SPEC)
        return out

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> Mamba2ReplayState:
        if spec.replay is None or spec.spec_tokens < 2:
            raise ValueError(f"{cls.__name__} needs speculative decoding (T = K + 1 >= 2) and ReplaySlots")
        layout = cls.buffers(c, spec)
        t = _zeros(layout, spec.device)
        history = cls.history_type(**{n.removeprefix("history."): v for n, v in t.items() if "." in n})
        return cls(conv=t["conv"], ssm=t["ssm"], history=history, slots=spec.replay,
                   ssm_backend=spec.ssm_backend, layout=layout)

    def reset_rows(self, rows: torch.Tensor) -> None:
        # the history needs no clearing: PNAT = 0 (ReplaySlots.reset) means none of it is read
        self.conv.index_fill_(0, rows, 0)
        self.ssm.index_fill_(0, rows, 0)

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        pass  # replay commits lazily: the next verify fast-forwards; ReplaySlots.advance is per model


@dataclass
class GDNReplayState(Mamba2ReplayState):
    """Recurrent state of one Gated DeltaNet layer under SSM replay: :class:`Mamba2ReplayState`'s scheme
    (committed state lagging by PNAT tokens, conv window of W - 1 + K columns read at offset PNAT - 1) with
    GDN shapes (H key heads, HV value heads, K / V key / value head dims, C = 2 H K + HV V):

    ssm:  [S + 1, HV, V, K], ``ssm_state_dtype``; conv: [S + 1, C, W - 1 + K], model dtype.
    history: ``kernels.gdn.ReplayHistory`` with S + 1 slots and T tokens, float32: u (S + 1, 2, T, HV, V)
          solved update vectors, k (S + 1, 2, T, H, K) normalised keys, g (S + 1, 2, T, HV) cumulative log
          decay of the last verify.
    """

    history_type: ClassVar[type] = gdn.ReplayHistory
    state_shapes = staticmethod(GDNState.state_shapes)

    @staticmethod
    def history_shapes(c: HybridConfig, spec: CacheSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The history's tensors (``kernels.gdn.ReplayHistory.shapes``: S + 1 slots, T tokens, float32)."""
        return gdn.ReplayHistory.shapes(spec.rows, spec.spec_tokens, c.gdn_num_key_heads,
                                        c.gdn_num_value_heads, c.gdn_key_head_dim, c.gdn_value_head_dim,
                                        dtype=torch.float32)


@dataclass
class KVCache(LayerState):
    """Keys and values of one attention layer, written by position.

    k, v: [S + 1, max_seq_len, KVH, head_dim], the model dtype, or float8_e4m3fn for an FP8 KV cache
    (``CacheSpec.kv_cache_dtype``; half the bytes of bf16). FP8 entries are ``clamp(k / k_scale, -448, 448)``
    with the layer's per-tensor ``k_scale`` / ``v_scale`` (0-dim float32: the checkpoint's calibrated
    ``k_proj.k_scale`` / ``v_proj.v_scale``, set by the engine; None reads as 1.0), as NVIDIA ModelOpt's FP8
    KV cache; :meth:`read` dequantizes (``k_fp8 * k_scale``). :meth:`reset_rows` zeroes an admitted slot's
    rows (positions past a request's length are read, masked: they must be finite); commit is a no-op: a
    later write to a position overwrites a rejected token's entry.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    layout: dict[str, Buffer] = field(default_factory=dict, repr=False)

    @classmethod
    def buffers(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, Buffer]:
        shape = (spec.rows, spec.max_seq_len, c.num_key_value_heads, c.head_dim)
        return {name: Buffer(shape, spec.kv_cache_dtype or spec.dtype, KV) for name in ("k", "v")}

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> KVCache:
        layout = cls.buffers(c, spec)
        return cls(**_zeros(layout, spec.device), layout=layout)

    @property
    def fp8(self) -> bool:
        return self.k.dtype == FP8_DTYPE

    def write(self, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys / values [B, T, KVH, head_dim] at (rows, pos) [B, T] (quantized in an FP8 cache; the
        FP8 buffers are indexed through uint8 views, which every backend indexes)."""
        if not self.fp8:
            self.k[rows, pos] = k.to(self.k.dtype)
            self.v[rows, pos] = v.to(self.v.dtype)
            return
        for buf, x, scale in ((self.k, k, self.k_scale), (self.v, v, self.v_scale)):
            q = quantize_fp8(x, 1.0 if scale is None else scale)
            buf.view(torch.uint8)[rows, pos] = q.view(torch.uint8)

    def read(
        self, rows: Callable[[torch.Tensor], torch.Tensor], kv_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [B, kv_len, KVH, head_dim] in ``dtype`` of the batch's cache rows (``rows``:
        ``BatchMeta.rows``, or ``BatchMeta.view_rows``: then, unquantized, a view of the cache -- read it
        only), dequantized in an FP8 cache. The first kv_len positions are sliced before the rows are
        gathered, so the gather copies only those."""
        if not self.fp8:
            return rows(self.k[:, :kv_len]).to(dtype), rows(self.v[:, :kv_len]).to(dtype)
        out = []
        for buf, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = rows(buf.view(torch.uint8)[:, :kv_len]).view(FP8_DTYPE)
            out.append(q.to(dtype) if scale is None else q.to(dtype) * scale.to(dtype))
        return out[0], out[1]

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Zero keys and values at every position of cache rows ``rows`` [n] (int64; a request is admitted).

        Attention reads each row up to the batch's KV bound (``BatchMeta.max_kv_len``: the longest row, a CUDA
        graph's bucket) and masks the positions past the row's own: a masked weight is exactly 0, but NaN +
        -inf in the scores and 0 x NaN in weights @ values are NaN, so a non-finite entry a previous occupant
        left there (a float16 overflow, say) would reach the new request. Zeroed, masked positions add exact
        zeros: bit for bit a fresh cache's result. (A request's own entries past its length, rejected drafts,
        are rewritten by its next step before any read.) Zeroing once per request rather than masking every
        read: on one CPU thread a select over the keys and values read takes ~3 ms per layer and step at 16
        rows x 1,000 positions, this reset ~0.1 ms per slot of the tiny NemotronH (3 layers, 4,096
        positions, 6 MiB); Super V3's 9 attention layers hold 36 MiB per slot at 4,096 positions, ~11 us at
        an H100's 3.35 TB/s. (vLLM's and SGLang's paged attention read no position past a sequence's
        length; this dense cache does.) On the CPU rows are zeroed as slices (``index_fill_`` over dim 0
        measured ~7x slower there)."""
        for buf in (self.k, self.v):
            flat = buf.view(torch.uint8) if self.fp8 else buf  # FP8: zero bytes are e4m3fn's 0.0
            if rows.device.type == "cpu":
                for r in rows.tolist():
                    flat[r].zero_()
            else:
                flat.index_fill_(0, rows, 0)

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        pass


# block kind -> its LayerState class (``buffers`` / ``allocate(config, CacheSpec)``, ``planned_memory``). A
# family adds its kinds here (e.g. "gdn"); REPLAY_LAYOUTS replaces the recurrent kinds when the engine runs
# SSM replay.
CACHE_LAYOUTS: dict[str, type[LayerState]] = {
    "mamba2": Mamba2State,
    "gdn": GDNState,
    "attention": KVCache,
}
REPLAY_LAYOUTS: dict[str, type[LayerState]] = {
    "mamba2": Mamba2ReplayState,
    "gdn": GDNReplayState,
}


def _layout(kind: str, idx: int, replay: bool) -> type[LayerState]:
    if replay and kind in REPLAY_LAYOUTS:
        return REPLAY_LAYOUTS[kind]
    if kind not in CACHE_LAYOUTS:
        raise ValueError(
            f"no cache layout for block kind {kind!r} (cache_index {idx}); known: {sorted(CACHE_LAYOUTS)}"
        )
    return CACHE_LAYOUTS[kind]


def _replay_kinds(cache_kinds: dict[int, str]) -> list[str]:
    kinds = sorted(set(cache_kinds.values()) & set(REPLAY_LAYOUTS))
    if not kinds:
        raise ValueError(
            f"ssm_replay needs a recurrent block kind with a replay layout ({sorted(REPLAY_LAYOUTS)}); this "
            "model has none: set ssm_replay=False"
        )
    return kinds


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
    if ssm_replay:
        _replay_kinds(cache_kinds)
    if ssm_replay and checkpointing and _replay_kinds(cache_kinds) != ["mamba2"]:
        raise ValueError(
            "the checkpointing replay variant exists for mamba2 layers only (kernels/mamba2/replay.py); "
            "set ssm_replay_checkpointing=False (registry: ssm.replay_checkpointing: false) for this model"
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
) -> dict[str, int]:
    """Bytes a :class:`HybridCache` with these arguments allocates, by kind, computed from the architecture
    alone (nothing is allocated; usable for released shapes without weights). Same arguments and keys as
    :class:`HybridCache` / :meth:`HybridCache.memory` (the S + 1 scratch row included; an FP8
    ``kv_cache_dtype`` halves ``kv_cache_bytes`` against a 16-bit model dtype).

    Raises:
        ValueError: ssm_replay without speculation, or a block kind without a cache layout.
    """
    _check_replay_args(ssm_replay, spec_tokens, replay_checkpointing, cache_kinds)
    rows = max_batch_size + 1
    spec = CacheSpec(rows, max_seq_len, dtype, ssm_state_dtype, "meta", spec_tokens)
    spec.replay_checkpointing = replay_checkpointing
    spec.kv_cache_dtype = kv_cache_dtype
    out = dict.fromkeys(MEMORY_KEYS, 0)
    for idx, kind in sorted(cache_kinds.items()):
        for key, n in _layout(kind, idx, ssm_replay).planned_memory(config, spec).items():
            out[key] += n
    if ssm_replay:
        out["spec_buffers_bytes"] += ReplaySlots.planned_bytes(rows)
    return out


class HybridCache:
    """All per-slot caches of a model: one :class:`LayerState` per stateful block, keyed by ``cache_index``.

    Args:
        config: the model's :class:`HybridConfig`.
        cache_kinds: ``{cache_index: kind}`` for every block that keeps state (a key of
            :data:`CACHE_LAYOUTS`; the MTP module's blocks take indices after the backbone's).
        max_batch_size: S, the number of live slots.
        max_seq_len: positions per slot in the KV cache (prompt + generated tokens).
        dtype: dtype of conv state and KV cache (the model dtype).
        ssm_state_dtype: dtype of the SSM state (float32 is the safe default: a 16-bit state is rounded on
            every store and loses accuracy over long outputs).
        device: where the buffers live.
        spec_tokens: T = K + 1 tokens of a speculative verify step; > 0 allocates the rewind buffers of
            every recurrent layer (see :class:`Mamba2State`); 0 (default) allocates none.
        ssm_replay: commit recurrent state by replay (:class:`Mamba2ReplayState` layers and one
            :class:`ReplaySlots`, ``self.replay``) instead of rewind; needs ``spec_tokens >= 2``.
        ssm_backend: "torch" | "triton" | "flashinfer": who runs the recurrent-state operators of every layer
            state (decode, verify, commit, advance; :func:`kernel_or_reference`); the mixers read it from the
            state they are given.
        replay_checkpointing: the checkpointing replay variant (Mamba2 only): a history window of
            L = max(16, T) tokens, the state written only when the pending tokens and the new ones do not fit
            (``kernels/mamba2/replay.py``).
        kv_cache_dtype: storage dtype of the attention KV caches (None: ``dtype``; ``torch.float8_e4m3fn``
            stores keys and values in FP8 with per-layer scales, :class:`KVCache`).
        stochastic_rounding: round every write of a 16-bit SSM state (decode, rewind verify, replay verify)
            stochastically (``kernels/rounding.py``) instead of to nearest; needs a bfloat16 / float16
            ``ssm_state_dtype``. ``self.rounding`` holds the Philox seed (``rounding_seed``) and step counter
            on the device, each recurrent layer state its own salt (its cache index); call
            :meth:`advance_rounding` once after every cached forward so consecutive writes draw new bits.
            Prefill (the chunked scans) stores its final state rounded to nearest.

    All buffers start zeroed (never ``torch.empty``: a stale read must not see garbage).

    Raises:
        ValueError: bad sizes, an unknown block kind or backend, or ssm_replay without speculation.
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
        if ssm_replay:
            self.replay = ReplaySlots.allocate(R, spec_tokens, ssm_backend, device, replay_checkpointing)
        spec = CacheSpec(
            R, max_seq_len, dtype, ssm_state_dtype, device, spec_tokens, self.replay, replay_checkpointing,
            ssm_backend, kv_cache_dtype,
        )
        self.layers: dict[int, LayerState] = {}
        for idx, kind in sorted(cache_kinds.items()):
            self.layers[idx] = _layout(kind, idx, ssm_replay).allocate(config, spec)
        self.rounding = None
        if stochastic_rounding:
            if ssm_state_dtype not in SR_DTYPES:
                raise ValueError(
                    f"stochastic rounding of the SSM state needs a 16-bit ssm_state_dtype (bfloat16 or "
                    f"float16), got {ssm_state_dtype}: a float32 state is never rounded"
                )
            if ssm_backend == "flashinfer":
                raise ValueError("stochastic rounding runs in our kernels and references, not FlashInfer's; "
                                 "use ssm_backend 'triton' (or 'torch')")
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
        reads past the request's length must see finite values, :meth:`KVCache.reset_rows`). PAD ids (-1)
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


@dataclass
class BatchMeta:
    """Where the rows of one cached forward go. Tensors are int64 on the model device.

    slot_ids:  [B] cache slot of each row; PAD_SLOT_ID (-1) for a padding row.
    start_pos: [B] tokens of the request already in the cache (the position of input column 0).
    lengths:   [B] valid input columns of each row (<= T); columns t >= lengths[b] are right padding and are
               no-ops: they leave the recurrent state unchanged and write no KV entry of a live slot.
    all_valid: True when every row uses all T columns (lets layers skip the padding logic; e.g. decode).
    max_kv_len: an upper bound of max(start_pos + lengths) known on the host: attention reads each row's
        first max_kv_len cached positions (masked by position), so any bound >= the true one gives the same
        result; a CUDA-graph step passes its captured bucket. None computes the exact value (a host
        synchronisation per attention layer).
    verify: a speculative verify step (needs all_valid): rewind layers keep every intermediate state in the
        rewind buffers and leave the committed state unchanged; replay layers fast-forward the committed
        state by the slot's PNAT and record the new tokens' inputs (see :meth:`HybridCache.commit`).
    fresh: every row starts at position 0 (start_pos all 0; a prompt's first prefill chunk): attention then
        needs only this forward's keys, with a plain causal mask.
    row_start: the slot ids are known on the host to be ``row_start, row_start + 1, ...`` (no PAD row): then
        :meth:`view_rows` slices the cache rows instead of gathering a copy. An eager step's hint only (a CUDA
        graph would bake the value in); None: unknown.
    cache_rows, num_rows: the cache row of each slot, ``slot_ids % num_rows`` [B] int64 (PAD -1 -> the
        scratch row ``num_rows - 1``), computed once per forward and shared by every layer
        (:meth:`row_index`); ``num_rows`` alone computes it here, neither leaves each layer to compute it.
    """

    slot_ids: torch.Tensor
    start_pos: torch.Tensor
    lengths: torch.Tensor
    all_valid: bool = False
    max_kv_len: int | None = None
    verify: bool = False
    fresh: bool = False
    row_start: int | None = None
    cache_rows: torch.Tensor | None = None
    num_rows: int | None = None
    _shared: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.verify and not self.all_valid:
            raise ValueError("a verify step needs T tokens in every row (all_valid=True)")
        if (self.cache_rows is not None) and self.num_rows is None:
            raise ValueError("cache_rows needs num_rows (the rows of the buffers it indexes)")
        if self.num_rows is not None and self.cache_rows is None:
            self.cache_rows = self.slot_ids % self.num_rows

    def shared(self, key: tuple, make: Callable[[], torch.Tensor | tuple]) -> torch.Tensor | tuple:
        """``make()``, computed once per forward and shared by every layer that asks with the same ``key``:
        metadata that is the same in every layer of a step (positions, masks, RoPE angles, index tensors).
        ``key`` must name everything ``make`` depends on besides this batch's tensors, which do not change
        during a forward. Inside torch.compile's tracing it is not memoised (no side effect in the compiled
        code: each block computes its own, which the compiler fuses)."""
        if torch.compiler.is_compiling():
            return make()
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def row_index(self, num_rows: int) -> torch.Tensor:
        """[B] int64 row of each slot in a buffer of ``num_rows`` rows: ``slot_ids % num_rows`` (PAD -1 -> the
        last, scratch, row); the shared :attr:`cache_rows` when it was made for ``num_rows``."""
        if self.cache_rows is not None and num_rows == self.num_rows:
            return self.cache_rows
        return self.slot_ids % num_rows

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """This batch's cache rows, ``buffer[slot_ids]`` (a gather copy; PAD -1 reads the scratch row, the
        last row of ``buffer``)."""
        return buffer[self.row_index(buffer.shape[0])]

    def view_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """This batch's cache rows for reading only: a view of ``buffer`` (no copy) when ``row_start`` says
        they are consecutive, else :meth:`rows`' gather copy. The values are the same; never write to it."""
        if self.row_start is None:
            return self.rows(buffer)
        return buffer[self.row_start : self.row_start + self.slot_ids.shape[0]]

    @classmethod
    def decode(
        cls,
        slot_ids: torch.Tensor,
        start_pos: torch.Tensor,
        T: int = 1,
        *,
        verify: bool = False,
        max_kv_len: int | None = None,
        row_start: int | None = None,
        cache_rows: torch.Tensor | None = None,
        num_rows: int | None = None,
    ) -> BatchMeta:
        """T tokens for every row (T = 1 for plain decode, T = K + 1 for a verify step)."""
        return cls(
            slot_ids,
            start_pos,
            torch.full_like(slot_ids, T),
            all_valid=True,
            max_kv_len=max_kv_len,
            verify=verify,
            row_start=row_start,
            cache_rows=cache_rows,
            num_rows=num_rows,
        )

    def valid(self, T: int) -> torch.Tensor:
        """[B, T] bool: column t of row b is a real token."""
        return torch.arange(T, device=self.lengths.device)[None, :] < self.lengths[:, None]
