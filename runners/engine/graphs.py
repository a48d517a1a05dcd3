"""CUDA graphs of the engine's decode step: static buffers, capture per (batch size, KV bound), replay.

The engine's decode step (runners/engine/step.py, ``DecodeStep``) is a fixed sequence of *phases*, each a
function ``phase(B, L)`` of the padded batch size B and the KV bound L that reads and writes only device
tensors: the static step buffers of :class:`StepIO`, the per-slot decode state the step keeps on the device
and the caches. Plain decoding has one phase (``decode``); an MTP speculative step has four (``draft``: the
K - 1 recursive MTP drafts; ``verify``: the target forward over T = K + 1 tokens and its greedy tokens;
``commit``: acceptance, the recurrent-state commit (rewind copy or replay bookkeeping) and the per-slot
lengths; ``catchup``: the MTP module over the accepted positions, which prepares the next step's first draft).
Nothing in a phase reads a device value on the host, and every shape follows from (B, L), so each phase is
captured once per (B, L) and replayed (vLLM / SGLang's scheme: one graph per padded batch size over static
input buffers).

- Batch sizes: the engine's graph batch sizes (``EngineOptions``). A step of n live rows runs the graphs of
  the smallest captured size B >= n; rows n .. B - 1 are PAD rows (slot id -1,
  ``kernels._common.PAD_SLOT_ID``), which read and write only the caches' scratch row. A step larger than the
  largest size runs the same phases eagerly at B = n.
- KV bound L: attention reads each slot's first L cached positions (masked by position). A graph bakes L
  in, so L is rounded up to a power of two (at least :data:`KV_BUCKET_MIN`, at most max_seq_len):
  :func:`kv_bucket`. Eager steps use the exact bound the host knows.
- Capture (:meth:`StepGraphs.capture`, on first use of a (B, L) or ahead of time): the slot ids of the
  static batch are set to PAD first (whatever the buffers held before -- NaN, 0x7BADBEEF -- capture never
  reads them), every phase runs once eagerly on a side stream (Triton JIT, cuBLAS workspaces; PAD rows touch
  no live slot, so this is safe in the middle of a generation), then each phase is captured into its own
  graph from one memory pool shared by all graphs (they replay one at a time on one stream; every value
  that crosses phases lives in :class:`StepIO`, outside the pool). A capture that fails (an operator that
  synchronises) is logged and that (B, L) runs eagerly -- or, with ``strict`` (tensor-parallel ranks, whose
  graphs hold the all-reduces and must be replayed by every rank alike: runners.engine.launch), raises.
- Results: :class:`HostRing` copies the step's output tokens to pinned host memory with ``non_blocking``
  and records an event, so the host waits only when it reads them (and can do the previous step's
  bookkeeping meanwhile).
- Profiling: with a :class:`PhaseTimer` the phases are bracketed by CUDA events (perf_counter on the CPU).

On the CPU graphs are off and the same phases run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from kernels._common import PAD_SLOT_ID

log = logging.getLogger(__name__)

KV_BUCKET_MIN = 256
POISON_INT = 0x7BADBEEF  # what tests fill integer buffers with before capture (floats: NaN)

Phase = Callable[[int, int], None]


def kv_bucket(bound: int, max_seq_len: int) -> int:
    """The KV bound a graph is captured for: the next power of two >= ``bound``, at least KV_BUCKET_MIN and
    at most ``max_seq_len``."""
    L = KV_BUCKET_MIN
    while L < bound:
        L *= 2
    return min(L, max_seq_len)


def default_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch_size``, and ``max_batch_size`` itself (the released entries' list)."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


@dataclass
class StepIO:
    """Static device buffers of one decode step; rows = the largest batch the engine runs (max_batch_size).

    slot_ids:     [rows] int64, the batch's slot per row (PAD -1 past the live rows); the host writes it
                  before each step (the only per-step input).
    start_pos:    [rows] int64, tokens of each row's request in the cache at the start of the step.
    drafts:       [rows, K] int64, the step's draft tokens (speculative steps only, else None).
    hidden:       [rows, T, D] model dtype, the verify's target hidden states (speculative only).
    greedy:       [rows, T] int64, the target's greedy token after each verify position (speculative only).
    tokens:       [rows, T] int64, output: the step's new tokens (row b: its first num_accepted[b]).
    num_accepted: [rows] int64, output: num_accepted_tokens (accepted drafts + 1; 1 without drafts).
    Allocated zeroed; :meth:`poison` fills them with garbage (tests).
    """

    slot_ids: torch.Tensor
    start_pos: torch.Tensor
    tokens: torch.Tensor
    num_accepted: torch.Tensor
    drafts: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    greedy: torch.Tensor | None = None

    @classmethod
    def allocate(cls, rows: int, draft_len: int, hidden_size: int, dtype: torch.dtype, device) -> StepIO:
        K, T = draft_len, draft_len + 1
        ints = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)
        io = cls(slot_ids=torch.full((rows,), PAD_SLOT_ID, dtype=torch.long, device=device),
                 start_pos=ints(rows), tokens=ints(rows, T), num_accepted=ints(rows))
        if K > 0:
            io.drafts, io.greedy = ints(rows, K), ints(rows, T)
            io.hidden = torch.zeros(rows, T, hidden_size, dtype=dtype, device=device)
        return io

    def poison(self) -> None:
        """Fill every buffer with garbage: NaN (floats), 0x7BADBEEF (integers). Test hook: a capture that
        reads a buffer before the step filled it then fails or gives different results."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                t.fill_(float("nan") if t.is_floating_point() else POISON_INT)


@dataclass
class HostBlock:
    """Pinned host copies of one launched step: its slot ids (in) and output tokens / num_accepted (out),
    with the event recorded after the output copies (None on the CPU, where copies are synchronous)."""

    slot_ids: torch.Tensor
    tokens: torch.Tensor
    num_accepted: torch.Tensor
    event: torch.cuda.Event | None
    busy: bool = False


class HostRing:
    """A few :class:`HostBlock` used in turn by consecutive steps (at most ``size - 1`` steps in flight).

    A block is reused only after its step's results were read (:meth:`release`), so its pinned input copy
    and output copies have completed: launching never waits for the device.
    """

    def __init__(self, rows: int, T: int, device: torch.device, size: int = 3):
        cuda = device.type == "cuda"
        host = lambda *shape: torch.zeros(*shape, dtype=torch.long, pin_memory=cuda)
        self.blocks = [
            HostBlock(host(rows), host(rows, T), host(rows), torch.cuda.Event() if cuda else None)
            for _ in range(size)
        ]
        self._next = 0

    def acquire(self) -> HostBlock:
        block = self.blocks[self._next]
        if block.busy:
            raise RuntimeError("HostRing: every block holds an unread step; read (release) one first")
        block.busy = True
        self._next = (self._next + 1) % len(self.blocks)
        return block

    @staticmethod
    def read(block: HostBlock, n: int) -> tuple[list[list[int]], list[int]]:
        """Wait for the block's step and return its first n rows: (tokens [n][T], num_accepted [n])."""
        if block.event is not None:
            block.event.synchronize()
        return block.tokens[:n].tolist(), block.num_accepted[:n].tolist()

    @staticmethod
    def release(block: HostBlock) -> None:
        block.busy = False


@dataclass
class PhaseTimer:
    """Summed time of decode steps by phase (profiling mode): device milliseconds per phase from CUDA events
    around each phase (``time.perf_counter`` on the CPU, where phases run synchronously), and host
    milliseconds by activity (``launch``: queuing a step; ``wait``: blocked on its results; ``bookkeeping``:
    appending tokens, stop checks, callbacks), plus the number of steps timed."""

    device_ms: dict[str, float] = field(default_factory=dict)
    host_ms: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    def add_host(self, what: str, seconds: float) -> None:
        self.host_ms[what] = self.host_ms.get(what, 0.0) + 1e3 * seconds

    def add_device(self, marks: list[tuple[str, object, object]]) -> None:
        """Add one step's phase marks ((phase, start, end) CUDA events or perf_counter floats); the events
        must have completed (the step's results were read)."""
        for name, start, end in marks:
            ms = start.elapsed_time(end) if hasattr(start, "elapsed_time") else 1e3 * (end - start)
            self.device_ms[name] = self.device_ms.get(name, 0.0) + ms
        self.steps += 1

    def per_step(self) -> dict[str, dict[str, float]]:
        """Mean milliseconds per step: {"device": {phase: ms}, "host": {activity: ms}}."""
        n = max(self.steps, 1)
        return {"device": {k: v / n for k, v in self.device_ms.items()},
                "host": {k: v / n for k, v in self.host_ms.items()}}


def release_generator_after_failed_capture(device: torch.device) -> None:
    """Take the device's default CUDA generator out of capture mode after a capture that failed.

    ``CUDAGraph.capture_begin`` puts the default generator in capture mode and ``capture_end`` takes it out,
    but only after ``cudaStreamEndCapture`` succeeded: a capture invalidated by an illegal call (a host
    synchronisation, say) leaves it in capture mode, and every later random draw on that device raises
    "Offset increment outside graph capture encountered unexpectedly" (PyTorch:
    aten/src/ATen/cuda/CUDAGeneratorImpl.cpp, ``CUDAGeneratorState::increase``). A successful one-kernel
    capture on a fresh graph runs the generator's capture prologue and epilogue and leaves it out of capture
    mode; its graph and memory are dropped at once. Mutates only the generator's capture flag (its seed and
    offset are unchanged). Never raises: a failure here is logged (the capture's own error is reported).
    """
    try:
        scratch = torch.zeros(1, device=device)
        with torch.cuda.device(device):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                scratch.add_(1)
        del g
    except Exception as e:  # noqa: BLE001 - best effort after a failure that is already being reported
        log.warning("could not take the CUDA generator out of capture mode after a failed capture "
                    "(%s: %s); random draws on %s may fail", type(e).__name__, e, device)


class StepGraphs:
    """The phases of the engine's step, run eagerly or as CUDA graphs captured per (batch size, KV bound).

    Args:
        phases: ``{name: phase(B, L)}`` in execution order (see the module docstring).
        io: the static buffers the phases read and write (``io.slot_ids`` is the step's input).
        batch_sizes: the padded batch sizes to capture (empty: every step runs eagerly).
        max_seq_len: the largest KV bound.
        device: the engine's device; graphs need CUDA.

    ``mode``: "graph" (the default on CUDA), or "eager_padded" (the same padding and KV buckets, phases run
    eagerly: tests compare graph replay with eager execution of exactly the same step, and exercise the
    padded step on the CPU, where it is the only mode). ``strict``: a failed capture raises instead of
    running that (B, L) eagerly (default False; runners.engine.launch sets it at world size > 1).
    """

    def __init__(self, phases: dict[str, Phase], io: StepIO, batch_sizes, max_seq_len: int,
                 device: torch.device):
        self.phases, self.io = phases, io
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_seq_len, self.device = max_seq_len, device
        self.mode = "graph" if device.type == "cuda" else "eager_padded"
        self.graphs: dict[tuple[int, int], dict[str, torch.cuda.CUDAGraph] | None] = {}
        self._pool = None
        self.strict = False

    @property
    def enabled(self) -> bool:
        return bool(self.batch_sizes)

    def plan(self, n: int, kv_bound: int) -> tuple[int, int, bool]:
        """(B, L, graphed) for a step of ``n`` live rows whose KV reads stay below ``kv_bound``: the smallest
        captured size >= n and the bucketed bound, or (n, the exact bound, False) when no size fits."""
        fits = [b for b in self.batch_sizes if b >= n]
        if not fits:
            return n, min(kv_bound, self.max_seq_len), False
        return fits[0], kv_bucket(kv_bound, self.max_seq_len), True

    def run(self, B: int, L: int, graphed: bool, timed: bool = False) -> list[tuple[str, object, object]]:
        """Run every phase at (B, L): replay its graphs when ``graphed`` and captured (:meth:`ensure` first),
        else eagerly. The caller has written ``io.slot_ids[:B]``. Returns the phase marks when ``timed``."""
        graphs = self.graphs.get((B, L)) if graphed and self.mode == "graph" else None
        marks = []
        for name, phase in self.phases.items():
            start = self._mark() if timed else None
            if graphs is not None:
                graphs[name].replay()
            else:
                phase(B, L)
            if timed:
                marks.append((name, start, self._mark()))
        return marks

    def ensure(self, B: int, L: int, graphed: bool) -> None:
        """Capture the graphs of (B, L) if they are needed and missing. Call before writing the step's slot
        ids: capture leaves ``io.slot_ids[:B]`` all PAD."""
        if graphed and self.mode == "graph" and (B, L) not in self.graphs:
            self.capture(B, L)

    def capture(self, B: int, L: int) -> None:
        """Capture every phase at (B, L) (see the module docstring); on failure log it and run (B, L)
        eagerly from then on.

        Raises:
            RuntimeError: the capture failed and ``strict`` is set (naming (B, L) and the failure).
        """
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        io = self.io
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        io.slot_ids[:B].fill_(PAD_SLOT_ID)  # the batch's only input: defined before anything reads it
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for phase in self.phases.values():  # warm-up: PAD rows only, in order (each reads the last)
                    phase(B, L)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graphs = {}
            for name, phase in self.phases.items():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                    phase(B, L)
                graphs[name] = g
        except Exception as e:  # noqa: BLE001 - any capture failure: this size runs eagerly, said once
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001, S110 - the capture's own error is the one to report
                pass
            release_generator_after_failed_capture(self.device)
            if self.strict:
                raise RuntimeError(
                    f"CUDA graph capture of the decode step at batch {B}, KV bound {L} failed "
                    f"({type(e).__name__}: {e}); tensor-parallel ranks must all replay the same graphs, so "
                    "the run stops (runtime.cuda_graphs=false / cuda_graphs=False steps eagerly)") from e
            log.warning("CUDA graph capture of the decode step at batch %d, KV bound %d failed (%s: %s); "
                        "this size runs eagerly", B, L, type(e).__name__, e)
            self.graphs[(B, L)] = None
            io.slot_ids[:B].fill_(PAD_SLOT_ID)
            return
        self.graphs[(B, L)] = graphs
        log.debug("captured %d graphs at batch %d, KV bound %d in %.2f s", len(graphs), B, L,
                  time.perf_counter() - t0)

    def reset(self) -> None:
        """Drop every captured graph (e.g. after a phase changed); they are captured again on use."""
        self.graphs.clear()

    def _mark(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()
