"""The per-slot layer-state contract every stateful layer kind implements, and the machinery the recurrent
kinds share; the kinds' own states live in their modules (``runners/engine/models/mamba2.py``, ``gdn.py``,
``attention.py``) and :class:`runners.engine.cache.HybridCache` allocates them from what each kind
declares (``runners/engine/models/kinds.py``).

Rows: every buffer has ``S + 1`` rows, rows ``0 .. S-1`` the live slots and row ``S`` a scratch row; the PAD
slot id ``-1`` indexes the scratch row, never a live slot (slot 0 is a live slot). Shapes use the project
vocabulary: S slots, W conv_kernel, C conv channels, K draft length, T = K + 1.

- :class:`LayerState`: the contract (``buffers`` declares every tensor once: shape, dtype, memory kind; then
  ``allocate``, ``reset_rows``, ``commit``, ``memory`` / ``planned_memory``).
- :class:`RecurrentState` / :class:`RecurrentReplayState`: a conv window plus a recurrent state per slot under
  the two commit schemes (rewind: per-token buffers copied back at commit, ``kernels.commit.rewind_commit``;
  replay: the committed state plus the last verify's inputs, fast-forwarded by the next verify). A recurrent
  kind subclasses them and declares its shapes (``state_shapes``) and, for replay, its history
  (``history_type``, ``history_shapes``). The rewind / replay math: docs/architecture.md and the kernels'
  docstrings (kernels/commit.py, kernels/*/replay.py).
- :class:`ReplaySlots`: the per-slot replay bookkeeping shared by every replay layer of a model.
- :class:`BatchMeta`: where the rows of one cached forward go.
- :func:`kernel_or_reference`: who runs a recurrent-state operator (``ssm_backend``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from kernels.commit import (
    replay_advance,
    replay_advance_ref,
    rewind_commit,
    rewind_commit_ref,
)
from kernels.rounding import StochasticRounding
from runners.engine.compile import eager_op
from runners.engine.models.config import HybridConfig

SSM_BACKENDS = ("triton", "flashinfer", "torch")
MEMORY_KEYS = ("ssm_state_bytes", "conv_state_bytes", "kv_cache_bytes", "spec_buffers_bytes")

Op = TypeVar("Op", bound=Callable)


def kernel_or_reference(ssm_backend: str, kernel: Op, reference: Op) -> Op:
    """The implementation of a recurrent-state operator under ``ssm_backend``: its Triton ``kernel`` for
    "triton" and "flashinfer" (FlashInfer's own kernels replace only the Mamba2 verify, in the mixer),
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
    replay_ring: bool = False  # Mamba2 histories as FlashInfer rings (kernels.mamba2.flashinfer_replay)


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



def zeros(layout: dict[str, Buffer], device) -> dict[str, torch.Tensor]:
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

    Class flags the callers read instead of testing a state's class: ``positional`` (rows indexed by token
    position: the prefix cache keeps only a prefix's positions) and ``replay`` (committed by replay).

    :meth:`memory` measures the allocated tensors the declaration names (kept as ``layout``).
    ``spec_buffers`` names the attributes that only speculative decoding allocates (None when the cache is
    built with ``spec_tokens = 0``); they are a verify step's scratch, not a slot's committed state.
    """

    spec_buffers: ClassVar[tuple[str, ...]] = ()
    positional: ClassVar[bool] = False  # rows indexed by token position (a KV cache): a prefix is a slice
    replay: ClassVar[bool] = False  # committed by replay (the next verify fast-forwards), not by commit()
    layout: dict[str, Buffer]

    @classmethod
    def buffers(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, Buffer]:
        raise NotImplementedError

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> LayerState:
        """The state with exactly the tensors of :meth:`buffers`, zeroed, on ``spec.device``."""
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
class RecurrentState(LayerState):
    """Conv window and recurrent state of one recurrent layer, committed by rewind; a kind subclasses it and
    declares ``state_shapes(config) -> (C, state)`` (conv channels, the per-slot state's shape).

    conv: [S + 1, C, W - 1], model dtype; the last W - 1 inputs of the causal conv (oldest first).
    ssm:  [S + 1, *state], ``ssm_state_dtype`` (float32 by default); the recurrent state.

    Speculative (rewind) buffers, allocated only when the cache is built with ``spec_tokens = T > 0``:
    conv_steps: [S + 1, C, W - 1 + T], the conv input window of the last verify (old W - 1 + T new).
    ssm_steps:  [S + 1, T, *state], the state after each of the T verify tokens.
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
        """(conv channels C, the per-slot recurrent state's shape), read from the config's dims."""
        raise NotImplementedError

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
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> RecurrentState:
        layout = cls.buffers(c, spec)
        return cls(**zeros(layout, spec.device), ssm_backend=spec.ssm_backend, layout=layout)

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.conv.index_fill_(0, rows, 0)
        self.ssm.index_fill_(0, rows, 0)

    @property
    def committed_conv(self) -> torch.Tensor:
        """[S + 1, C, W - 1], the committed conv windows (``conv`` itself: a non-verify forward reads and
        writes it in place)."""
        return self.conv

    def check_forward(self, meta: BatchMeta, T: int) -> None:
        """Raise ValueError when a verify of T tokens (``meta.verify``) finds rewind buffers of another
        number of per-token states (none: the cache was built with ``spec_tokens = 0``). Reads nothing on the
        device."""
        if meta.verify and (self.ssm_steps is None or self.ssm_steps.shape[1] != T):
            have = 0 if self.ssm_steps is None else self.ssm_steps.shape[1]
            raise ValueError(
                f"verify step of T={T} tokens but the cache keeps {have} per-token states; "
                "build the HybridCache with spec_tokens = T"
            )

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        n = num_accepted_tokens
        commit = kernel_or_reference(self.ssm_backend, rewind_commit, rewind_commit_ref)
        commit(self.ssm, self.ssm_steps, slot_ids, n, intermediate_state_indices=slot_ids)
        rows = slot_ids % self.conv.shape[0]  # PAD (-1) -> the scratch row
        W1 = self.conv.shape[-1]
        cols = n[:, None] + torch.arange(W1, device=n.device)  # the W - 1 conv inputs before token n
        window = self.conv_steps[rows]
        self.conv.index_copy_(0, rows, window.gather(2, cols[:, None, :].expand(-1, window.shape[1], -1)))


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
    ring_start: [S + 1] int32 or None; with ``ssm_backend="flashinfer"`` the oldest live row of each slot's
        FlashInfer ring history (``kernels.mamba2.flashinfer_replay``), moved on a flush by the pending
        tokens (``kernels.commit.ring_advance``'s rule); ``window`` is that ring's replay window W (the
        history length L).
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
    ring_start: torch.Tensor | None = None
    window: int | None = None
    verified: bool = False

    @staticmethod
    def buffers(rows: int, ring: bool = False) -> dict[str, Buffer]:
        """The [rows] int32 tensors (speculative-only bytes), declared once for allocation and plan (zeros:
        ``kernels.commit.allocate_replay_slots``' contract, "nothing to replay, buffer 0"); ``ring``: also
        FlashInfer's ring_start."""
        names = ("prev_num_accepted", "buffer_index", "last_accepted") + (("ring_start",) if ring else ())
        return {name: Buffer((rows,), torch.int32, SPEC) for name in names}

    @classmethod
    def allocate(
        cls, rows: int, spec_tokens: int, ssm_backend: str, device, checkpointing: bool = False,
        ring: bool = False,
    ) -> ReplaySlots:
        """Zeroed bookkeeping for ``rows`` cache rows; ``ring``: the histories are FlashInfer's rings (with
        their ring_start and window)."""
        hist_len = replay_hist_len(spec_tokens, checkpointing) if checkpointing else None
        return cls(**zeros(cls.buffers(rows, ring), device), spec_tokens=spec_tokens, ssm_backend=ssm_backend,
                   hist_len=hist_len, window=replay_hist_len(spec_tokens, checkpointing) if ring else None)

    @classmethod
    def planned_bytes(cls, rows: int, ring: bool = False) -> int:
        return sum(b.nbytes for b in cls.buffers(rows, ring).values())

    def nbytes(self) -> int:
        return _nbytes(self.prev_num_accepted, self.buffer_index, self.last_accepted, self.ring_start)

    def reset(self, rows: torch.Tensor) -> None:
        """Cache rows ``rows`` [n] (int64, PAD already mapped to the scratch row) start over: PNAT = 0 (and
        the ring at row 0)."""
        for t in (self.prev_num_accepted, self.buffer_index, self.last_accepted, self.ring_start):
            if t is not None:
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
        # one launch for all of it (kernels.commit.replay_advance): PNAT and buffer_index, the conv offset
        # (last_accepted) and, before PNAT moves, FlashInfer's ring start (a flush folds the k pending tokens
        # in); live rows only (PAD rows keep the scratch row's values; no host sync)
        advance = kernel_or_reference(self.ssm_backend, replay_advance, replay_advance_ref)
        ring = {} if self.ring_start is None else {"ring_start": self.ring_start, "ring_window": self.window,
                                                   "ring_len": self.window + self.spec_tokens}
        advance(self.prev_num_accepted, self.buffer_index, slot_ids, num_accepted_tokens, self.spec_tokens,
                hist_len=self.hist_len, last_accepted=self.last_accepted, **ring)



@dataclass
class RecurrentReplayState(LayerState):
    """Conv window and recurrent state of one recurrent layer under SSM replay (``ssm_replay=True``; needs
    speculation, K > 0); a kind subclasses it and declares ``state_shapes`` (as :class:`RecurrentState`),
    ``history_type`` (its ``kernels.<family>.ReplayHistory``), ``history_shapes(config, spec)`` and whether
    it has the checkpointing variant (``checkpointing``).

    ssm:  [S + 1, *state], ``ssm_state_dtype``; the committed state. It lags the sequence by the PNAT tokens
          accepted in the slot's last verify: the next verify fast-forwards it (and writes it back).
    conv: [S + 1, C, W - 1 + K], model dtype; the conv inputs of the last verify window after its first
          column. The committed window (the W - 1 inputs before the next token) is columns
          ``off .. off + W - 2`` with ``off = slots.conv_offset`` (PNAT - 1; 0 after prefill, which writes
          columns 0 .. W - 2), so acceptance needs no copy.
    history: the kind's ``ReplayHistory`` (the inputs of the last verify, double-buffered).
    slots: the model's shared :class:`ReplaySlots`.
    ssm_backend: who runs the replay verify (:func:`kernel_or_reference`).
    Speculative-only bytes: the K extra conv columns and the history (vs. rewind's T full states).
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    history: object
    slots: ReplaySlots
    ssm_backend: str = "torch"
    rounding: StochasticRounding | None = None  # set by HybridCache (ssm_stochastic_rounding)
    layout: dict[str, Buffer] = field(default_factory=dict, repr=False)
    replay: ClassVar[bool] = True
    checkpointing: ClassVar[bool] = False  # has the checkpointing variant (CacheSpec.replay_checkpointing)
    history_type: ClassVar[type]

    @staticmethod
    def state_shapes(c: HybridConfig) -> tuple[int, tuple[int, ...]]:
        """(conv channels C, the per-slot recurrent state's shape), as :meth:`RecurrentState.state_shapes`."""
        raise NotImplementedError

    @staticmethod
    def history_shapes(c: HybridConfig, spec: CacheSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{field: (shape, dtype)} of the history (the kind's ``ReplayHistory.shapes`` at S + 1 slots)."""
        raise NotImplementedError

    @classmethod
    def history_class(cls, spec: CacheSpec) -> type:
        """The history's class for this cache (``history_type``; a kind whose backend keeps another layout
        overrides it, as Mamba2 under FlashInfer)."""
        return cls.history_type

    @classmethod
    def buffers(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, Buffer]:
        (C, state), R, W1, T = cls.state_shapes(c), spec.rows, c.conv_kernel - 1, spec.spec_tokens
        out = {"conv": Buffer((R, C, W1 + T - 1), spec.dtype, CONV, spec_cols=T - 1),
               "ssm": Buffer((R, *state), spec.ssm_state_dtype, SSM)}
        for name, (shape, dtype) in cls.history_shapes(c, spec).items():
            out[f"history.{name}"] = Buffer(shape, dtype, SPEC)
        return out

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> RecurrentReplayState:
        if spec.replay is None or spec.spec_tokens < 2:
            raise ValueError(f"{cls.__name__} needs speculative decoding (T = K + 1 >= 2) and ReplaySlots")
        layout = cls.buffers(c, spec)
        t = zeros(layout, spec.device)
        history = cls.history_class(spec)(**{n.removeprefix("history."): v for n, v in t.items() if "." in n})
        return cls(conv=t["conv"], ssm=t["ssm"], history=history, slots=spec.replay,
                   ssm_backend=spec.ssm_backend, layout=layout)

    @property
    def committed_conv(self) -> torch.Tensor:
        """[S + 1, C, W - 1], a view of ``conv``'s first W - 1 columns: the committed windows of a
        non-verify forward, which runs only at PNAT = 0 (prefill: offset 0, :meth:`check_forward`)."""
        return self.conv[..., : self.conv.shape[-1] - self.slots.spec_tokens + 1]

    @property
    def history_len(self) -> int:
        """L, the tokens of one verify the history keeps (the kind's ``ReplayHistory`` layout)."""
        raise NotImplementedError

    def check_forward(self, meta: BatchMeta, T: int) -> None:
        """Raise ValueError for a verify of more tokens than the history keeps, RuntimeError for a non-verify
        forward on a row whose committed state lags by pending accepted tokens (with ssm_replay every step
        after prefill is a verify). A verify reads PNAT in its kernel: only a non-verify forward checks it,
        on the host (a synchronisation)."""
        if meta.verify:
            if T > self.history_len:
                raise ValueError(
                    f"verify step of T={T} tokens but the replay history keeps {self.history_len}; "
                    "build the HybridCache with spec_tokens = T"
                )
        elif bool(self.slots.prev_num_accepted[meta.row_index(self.ssm.shape[0])].any()):
            raise RuntimeError(
                "a non-verify forward on a replay cache row whose state lags by pending accepted tokens; "
                "with ssm_replay every step after prefill must be a verify (T = K + 1)"
            )

    def reset_rows(self, rows: torch.Tensor) -> None:
        # the history needs no clearing: PNAT = 0 (ReplaySlots.reset) means none of it is read
        self.conv.index_fill_(0, rows, 0)
        self.ssm.index_fill_(0, rows, 0)

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        pass  # replay commits lazily: the next verify fast-forwards; ReplaySlots.advance is per model


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
