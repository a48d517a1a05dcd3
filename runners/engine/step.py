"""The engine's decode step: per-slot device state, static step buffers, the phases, CUDA graphs hookup.

:class:`DecodeStep` owns everything one decode step touches besides the model and its caches: the per-slot
decode state on the device (:class:`SlotState`: each slot's length, last token and, with drafts, the MTP
hidden and greedy token that start its next drafts), the static step buffers
(``runners.engine.graphs.StepIO``), the pinned host ring the new tokens come back through, and the phases
``phase(B, L)`` that ``runners.engine.graphs.StepGraphs`` runs eagerly or as CUDA graphs.
:meth:`DecodeStep.launch` queues a step without waiting for the device; :meth:`DecodeStep.read` waits for it
and returns the tokens.

The phases, in this order:

- plain decoding (K = 0): ``decode`` feeds each slot's last token at its length and takes the greedy token;
- an MTP speculative step (K > 0):
  1. ``draft``: K tokens per slot with the MTP module (:meth:`DecodeStep.draft`);
  2. ``verify``: one target forward over T = K + 1 tokens [last token, d_1 .. d_K] (``BatchMeta.verify``:
     recurrent layers keep every intermediate state, or record their inputs for replay), greedy tokens;
  3. ``commit``: accepted drafts = the longest draft prefix equal to the target's greedy tokens,
     num_accepted_tokens = accepted + 1 (with the bonus target token); recurrent state <- the state after
     num_accepted_tokens tokens (``cache.commit``: rewind copy, or replay bookkeeping); the KV caches
     (target and MTP) roll back by length: the slot length advances by num_accepted_tokens only, so entries
     of rejected positions are never read and later writes overwrite them;
  4. ``catchup``: the MTP module re-runs the accepted positions n .. n + a with the target's hidden states
     (overwriting its draft-time KV entries); position n + a pairs the target hidden at index a (the last
     accepted position) with the bonus token, and its output gives the next step's first draft.

The output equals plain greedy decoding. The step is family-agnostic: it needs only the model forward,
``BatchMeta.verify`` support in the recurrent mixers and ``cache.commit``. No phase reads a device value on
the host, so each can be captured (runners/engine/graphs.py). Contract: docs/architecture.md ("Engine API").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels._common import PAD_SLOT_ID
from registry.schema import acceptance_length_in_range
from runners.engine.cache import HybridCache
from runners.engine.compile import COMPILE_WARN_SECONDS, compiled_graphs
from runners.engine.graphs import (
    HostBlock,
    HostRing,
    PhaseTimer,
    StepGraphs,
    StepIO,
    default_graph_batch_sizes,
    kv_bucket,
)
from runners.engine.models.hybrid import HybridLM
from runners.engine.options import EngineOptions
from runners.engine.state import BatchMeta

log = logging.getLogger(__name__)


class ForcedAcceptance:
    """Accepted drafts per verify step from a fixed schedule instead of the greedy comparison: a benchmark
    hook for random-weight checkpoints (:meth:`DecodeStep.force_acceptance`).

    Step c (counted on the device, only for steps with a live row) accepts floor((c + 1) m) - floor(c m)
    drafts in every row, m = acceptance_length - 1: the integers around m whose running mean is m (e.g.
    1, 2, 2, 1, 2, ... for m = 1.6), so the acceptance length over any run is acceptance_length to within
    1 / steps. No host synchronisation (CUDA-graph capturable).
    """

    def __init__(self, acceptance_length: float, draft_len: int, device: torch.device):
        if draft_len < 1:
            raise ValueError("forced acceptance needs speculative decoding (draft_len >= 1)")
        if not acceptance_length_in_range(acceptance_length, draft_len):
            raise ValueError(
                f"acceptance_length={acceptance_length} must lie in [1, K + 1 = {draft_len + 1}]"
            )
        self.mean_accepted = acceptance_length - 1.0
        self.step = torch.zeros((), dtype=torch.float64, device=device)

    def next(self, live: torch.Tensor, draft_len: int) -> torch.Tensor:
        """Accepted drafts [B] int64 in [0, ``draft_len``] for this step (live [B] bool: a step of PAD rows
        only -- a graph's warm-up -- does not advance the schedule)."""
        c, m = self.step, self.mean_accepted
        a = (torch.floor((c + 1) * m) - torch.floor(c * m)).long().clamp(0, draft_len)
        self.step += live.any()
        return a.expand(live.shape[0])


@dataclass
class SlotState:
    """Per-slot decode state on the device, R = S + 1 rows like the caches (PAD rows -> the scratch row S).

    length:     [R] int64, tokens of the slot's request in the cache;
    last_token: [R] int64, the token the next step feeds (its first generated token after the prefill);
    mtp_hidden: [R, D] model dtype, the MTP hidden that starts the next step's drafts (drafts only, else
                None);
    draft1:     [R] int64, its greedy token: the next step's first draft (drafts only, else None).
    Steps read and advance them without the host; :meth:`buffers` declares them once (allocation and the
    memory plan read it).
    """

    length: torch.Tensor
    last_token: torch.Tensor
    mtp_hidden: torch.Tensor | None = None
    draft1: torch.Tensor | None = None

    @staticmethod
    def buffers(max_batch_size: int, hidden_size: int, dtype: torch.dtype, draft_len: int
                ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{field: (shape, dtype)} of every buffer (the drafts' two only with ``draft_len`` > 0)."""
        R = max_batch_size + 1
        out = {"length": ((R,), torch.long), "last_token": ((R,), torch.long)}
        if draft_len > 0:
            out.update(mtp_hidden=((R, hidden_size), dtype), draft1=((R,), torch.long))
        return out

    @classmethod
    def allocate(cls, max_batch_size: int, hidden_size: int, dtype: torch.dtype, draft_len: int,
                 device: torch.device) -> SlotState:
        decl = cls.buffers(max_batch_size, hidden_size, dtype, draft_len)
        return cls(**{name: torch.zeros(shape, dtype=dt, device=device)
                      for name, (shape, dt) in decl.items()})

    @classmethod
    def spec_bytes(cls, max_batch_size: int, hidden_size: int, dtype: torch.dtype, draft_len: int) -> int:
        """Bytes of the buffers only drafting allocates (``cache_memory()["spec_buffers_bytes"]``' share)."""
        decl = cls.buffers(max_batch_size, hidden_size, dtype, draft_len)
        return sum(dt.itemsize * _numel(shape) for name, (shape, dt) in decl.items()
                   if name in ("mtp_hidden", "draft1"))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mtp_forward(model: HybridLM, cache: HybridCache, next_ids: torch.Tensor, hidden: torch.Tensor,
                meta: BatchMeta, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The MTP module at MTP positions ``meta.start_pos + t``: next_ids [B, T] (the token after each
    position), hidden [B, T, D] (target hidden after the final norm, or the MTP's own output when drafting
    recursively) -> MTP hidden [B, T, D] (with ``keep``, the kept positions' [n, D]:
    ``runners.engine.models.mtp.MTPModule.forward``). Writes the MTP attention's KV cache."""
    return model.mtp(model.embeddings(next_ids), hidden, cache, meta, keep=keep)


@dataclass
class LaunchedStep:
    """A launched decode step (:meth:`DecodeStep.launch`): its live slots, the pinned host block its tokens
    arrive in, and its phase timing marks (profiling only)."""

    slots: list[int]
    block: HostBlock
    marks: list = field(default_factory=list)


class DecodeStep:
    """The decode step of an engine: its per-slot state, static buffers, phases and CUDA graphs.

    Args:
        model, cache: the engine's model and caches (the phases run them).
        options: the engine's ``EngineOptions``: draft_len K (0: the one ``decode`` phase; else draft,
            verify, commit, catchup), max_batch_size, max_seq_len, dtype, and whether / at which padded batch
            sizes the step is captured as CUDA graphs.
        device: the engine's.
        ssm_backend: the resolved recurrent backend ("torch" runs host-synchronising references: no graphs).

    Attributes:
        options: the engine's options (read where used, never copied); slots: the :class:`SlotState`;
        io: the ``StepIO`` buffers; graphs: the ``StepGraphs``;
        cuda_graphs: whether steps replay CUDA graphs; phase_timer: a ``PhaseTimer`` (None: off);
        row_start: ``BatchMeta.row_start`` of the eager step running (set by :meth:`launch`).
        compile: whether the phases run the model's blocks through torch.compile (``EngineOptions.compile``,
            runners.engine.compile); compile_seconds: wall seconds spent compiling so far (all sizes);
            compile_times: {(B, L): seconds} per padded batch size and KV bound compiled; compile_graphs:
            the graphs dynamo compiled meanwhile, in all (with a dynamic batch, sizes after the second
            find theirs compiled: 0 more).

    Raises:
        ValueError: a graph batch size outside [1, max_batch_size].
    """

    def __init__(self, model: HybridLM, cache: HybridCache, options: EngineOptions, *, device: torch.device,
                 ssm_backend: str):
        self.model, self.cache, self.device, self.options = model, cache, device, options
        draft_len, max_batch_size = options.draft_len, options.max_batch_size
        D, dtype = model.config.hidden_size, options.torch_dtype
        self.slots = SlotState.allocate(max_batch_size, D, dtype, draft_len, device)
        cuda_graphs, batch_sizes = options.cuda_graphs, options.cuda_graph_batch_sizes
        cuda = device.type == "cuda"
        if cuda_graphs and not cuda:
            log.warning("cuda_graphs=True is ignored on %s: the same step runs eagerly", device)
        if cuda_graphs is None or not cuda:
            cuda_graphs = cuda
        if cuda_graphs and ssm_backend == "torch":
            log.warning("cuda_graphs: ssm_backend='torch' runs the PyTorch references, which synchronise "
                        "with the host (nonzero); decode steps run eagerly (use ssm_backend='triton')")
            cuda_graphs = False
        sizes = default_graph_batch_sizes(max_batch_size) if batch_sizes is None else list(batch_sizes)
        if any(not 1 <= b <= max_batch_size for b in sizes):
            raise ValueError(
                f"cuda_graph_batch_sizes {sizes} must lie in [1, max_batch_size={max_batch_size}]")
        self.cuda_graphs = bool(cuda_graphs and sizes)
        # compiled code is specialised on the shapes: it runs the padded steps at the graph batch sizes;
        # larger batches run the eager model
        self.compile = bool(options.compile and sizes)
        if options.compile and not sizes:  # (world_size > 1 and graphs off: runtime=gpu's default, quiet)
            (log.info if cuda else log.warning)(
                "compile=True is ignored: the step compiles at its CUDA-graph batch sizes and this engine "
                "captures none (the CPU, or CUDA graphs off); the step runs eagerly")
        K = draft_len
        self.io = StepIO.allocate(max_batch_size, K, D, dtype, device)
        self.host = HostRing(max_batch_size, K + 1, device)
        if K > 0:
            phases = {"draft": self.phase_draft, "verify": self.phase_verify, "commit": self.phase_commit,
                      "catchup": self.phase_catchup}
        else:
            phases = {"decode": self.phase_decode}
        self.compile_seconds, self.compile_times, self.compile_graphs = 0.0, {}, 0
        if self.compile:  # graphs capture (and eager padded steps run) the compiled phases
            phases = {name: self._compiled_phase(fn) for name, fn in phases.items()}
        padded = self.cuda_graphs or self.compile
        self.graphs = StepGraphs(phases, self.io, sizes if padded else (), options.max_seq_len, device)
        if not self.cuda_graphs:  # compiled without graphs: the same padded steps, run eagerly
            self.graphs.mode = "eager_padded"
        self.forced: ForcedAcceptance | None = None
        self.phase_timer: PhaseTimer | None = None
        self.row_start: int | None = None

    @property
    def rows(self) -> int:
        """R = S + 1 rows of the per-slot state and caches (the scratch row S takes the PAD rows' writes)."""
        return self.options.max_batch_size + 1

    # ------------------------------------------------------------------ host side: launch, read

    def launch(self, slots: list[int], kv_bound: int) -> LaunchedStep:
        """Queue one decode step over ``slots`` (live slot ids, sorted) on the device; nothing waits for it.

        The host writes only the batch's slot ids (through a pinned buffer); positions, input tokens and
        drafts come from :attr:`slots`, which the step advances itself. The step runs padded to a captured
        batch size as CUDA graphs, or eagerly (``StepGraphs``); its new tokens are copied to pinned host
        memory behind an event. ``kv_bound``: an upper bound of every row's cached length after the step (its
        length before + T). Read the result with :meth:`read`, in launch order.
        """
        t0 = time.perf_counter()
        n = len(slots)
        B, L, graphed = self.graphs.plan(n, kv_bound)
        if graphed:
            self.compile_for(B, L)  # compile, then capture: both leave the static slot ids all PAD
        self.graphs.ensure(B, L, graphed)
        block = self.host.acquire()
        block.slot_ids[:B] = PAD_SLOT_ID
        block.slot_ids[:n] = torch.tensor(slots, dtype=torch.long)
        io = self.io
        io.slot_ids[:B].copy_(block.slot_ids[:B], non_blocking=True)
        # an eager step over consecutive slots reads their KV rows as views, not gathered copies (exact: the
        # same values); a captured graph reads through the slot ids, whatever they are at replay
        eager = not graphed or self.graphs.mode != "graph"
        consecutive = B == n and slots == list(range(slots[0], slots[0] + n))
        # (not when compiled: the code would be specialised on each start row)
        self.row_start = slots[0] if eager and consecutive and not (self.compile and graphed) else None
        try:
            marks = self.graphs.run(B, L, graphed, timed=self.phase_timer is not None)
        finally:
            self.row_start = None
        block.tokens[:B].copy_(io.tokens[:B], non_blocking=True)
        block.num_accepted[:B].copy_(io.num_accepted[:B], non_blocking=True)
        if block.event is not None:
            block.event.record()
        if self.phase_timer is not None:
            self.phase_timer.add_host("launch", time.perf_counter() - t0)
        return LaunchedStep(list(slots), block, marks)

    def read(self, step: LaunchedStep) -> list[list[int]]:
        """Wait for a launched step and return each row's new tokens (1 .. K + 1: the accepted drafts and
        the bonus token; 1 without drafts), in the order of ``step.slots``. The wait is the phase timer's
        host "wait"."""
        t0 = time.perf_counter()
        tokens, num_accepted = HostRing.read(step.block, len(step.slots))
        HostRing.release(step.block)
        if self.phase_timer is not None:
            if step.marks:
                self.phase_timer.add_device(step.marks)
            self.phase_timer.add_host("wait", time.perf_counter() - t0)
        return [t[:a] for t, a in zip(tokens, num_accepted)]

    def force_acceptance(self, acceptance_length: float | None) -> None:
        """From now on each verify accepts a fixed schedule of drafts (:class:`ForcedAcceptance`); None
        restores the greedy comparison. Captured graphs are dropped (the commit phase changes).

        Raises:
            ValueError: without drafts, or an acceptance length outside [1, K + 1].
        """
        if acceptance_length is None:
            self.forced = None
        else:
            self.forced = ForcedAcceptance(acceptance_length, self.options.draft_len, self.device)
        self.graphs.reset()

    def capture_graphs(self, batch_sizes: Sequence[int] | None = None, max_kv_len: int | None = None) -> int:
        """Capture the CUDA graphs of ``batch_sizes`` (default: every captured size) at every KV bucket up to
        the one of ``max_kv_len`` (default max_seq_len); returns the (batch size, KV bound) pairs captured
        now (0 when graphs are off).

        Raises:
            ValueError: a batch size that is not one of the captured sizes.
        """
        graphs = self.graphs
        if not self.cuda_graphs:
            return 0
        sizes = graphs.batch_sizes if batch_sizes is None else list(batch_sizes)
        if set(sizes) - set(graphs.batch_sizes):
            raise ValueError(f"batch sizes {sorted(set(sizes) - set(graphs.batch_sizes))} are not among "
                             f"cuda_graph_batch_sizes {graphs.batch_sizes}")
        max_seq_len = self.options.max_seq_len
        top = kv_bucket(max_kv_len or max_seq_len, max_seq_len)
        buckets = [kv_bucket(1, max_seq_len)]
        while buckets[-1] < top:
            buckets.append(kv_bucket(buckets[-1] + 1, max_seq_len))
        done = 0
        for B in sizes:
            for L in buckets:
                if (B, L) not in graphs.graphs:
                    self.compile_for(B, L)
                    graphs.capture(B, L)
                    done += 1
        return done

    # ------------------------------------------------------------------ torch.compile (engine/compile.py)

    def _compiled_phase(self, phase):
        """``phase`` running the model's blocks compiled at the graph batch sizes, eagerly at other B."""
        def run(B: int, L: int) -> None:
            with self.model.compiled_blocks(B in self.graphs.batch_sizes):
                phase(B, L)
        run.__name__ = phase.__name__
        return run

    def compile_for(self, B: int, L: int) -> float:
        """Compile the phases at padded batch size B and KV bound L if :attr:`compile` is on and they are not
        yet: every phase runs twice over PAD rows only (as a capture's warm-up: no live slot is touched), so
        dynamo traces, inductor compiles and autotunes here, never inside a capture. Returns the seconds
        spent (0 when nothing was compiled); adds them to :attr:`compile_seconds`, the graphs dynamo compiled
        meanwhile to :attr:`compile_graphs`, and warns once when the total passes
        ``runners.engine.compile.COMPILE_WARN_SECONDS``. Leaves ``io.slot_ids[:B]`` all PAD."""
        if not self.compile or (B, L) in self.compile_times or B not in self.graphs.batch_sizes:
            return 0.0
        t0, graphs0 = time.perf_counter(), compiled_graphs()
        self.io.slot_ids[:B].fill_(PAD_SLOT_ID)
        with torch.inference_mode():
            for _ in range(2):  # the second pass: any recompile a first run's side effects cause
                for phase in self.graphs.phases.values():
                    phase(B, L)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds, graphs = time.perf_counter() - t0, compiled_graphs() - graphs0
        self.compile_graphs += graphs
        before = self.compile_seconds
        self.compile_times[(B, L)] = seconds
        self.compile_seconds += seconds
        if before <= COMPILE_WARN_SECONDS < self.compile_seconds:
            log.warning("torch.compile of the decode step has taken %.0f s (batch sizes and KV bounds %s), "
                        "more than %.0f s; set runtime.compile=false (EngineOptions.compile=False) for the "
                        "eager step, or capture fewer batch sizes", self.compile_seconds,
                        sorted(self.compile_times), COMPILE_WARN_SECONDS)
        log.info("compiled the decode step at batch %d, KV bound %d in %.1f s (%d graphs)", B, L, seconds,
                 graphs)
        return seconds

    # ------------------------------------------------------------------ slot state written by the prefill

    def start_slots(self, slot_ids: torch.Tensor, lengths: list[int], first_tokens: list[int]) -> None:
        """The decode state a prefill leaves: slots ``slot_ids`` [n] hold their prompts (``lengths``) and feed
        their first tokens next."""
        long = dict(dtype=torch.long, device=self.device)
        self.slots.length[slot_ids] = torch.tensor(lengths, **long)
        self.slots.last_token[slot_ids] = torch.tensor(first_tokens, **long)

    def store_first_draft(self, slot_ids: torch.Tensor, mtp_hidden: torch.Tensor,
                          rows: torch.Tensor | None = None) -> None:
        """Keep each slot's MTP hidden [n, D] and its greedy token: the first draft of the next step (PAD
        rows, slot id -1, write the scratch row). ``rows``: the slots' cache rows when the caller has them
        (None: computed)."""
        if rows is None:
            rows = slot_ids % (self.rows)
        self.slots.mtp_hidden[rows] = mtp_hidden
        self.slots.draft1[rows] = self.model.lm_logits(mtp_hidden).argmax(-1)

    # ------------------------------------------------------------------ the phases (device only)

    def _batch_rows(self, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's slot ids [B] (PAD -1 past the live rows), live mask [B] and cache rows [B] (PAD -> the
        scratch row S)."""
        slot_ids = self.io.slot_ids[:B]
        return slot_ids, slot_ids >= 0, slot_ids % (self.rows)

    def _advance_slots(self, rows: torch.Tensor, live: torch.Tensor, length: torch.Tensor,
                       last: torch.Tensor) -> None:
        """Per-slot device state after a step: live rows' slot length and last token become ``length`` /
        ``last`` [B]; PAD rows (the scratch row) keep theirs."""
        s = self.slots
        s.length.index_copy_(0, rows, torch.where(live, length, s.length[rows]))
        s.last_token.index_copy_(0, rows, torch.where(live, last, s.last_token[rows]))

    def phase_decode(self, B: int, L: int) -> None:
        """Plain greedy decode (K = 0): feed each slot's last token at its length, greedy next token. PAD
        rows read position 0 / token 0 (whatever the scratch row holds) and write only the scratch row."""
        io = self.io
        slot_ids, live, rows = self._batch_rows(B)
        n = torch.where(live, self.slots.length[rows], 0)
        last = torch.where(live, self.slots.last_token[rows], 0)
        meta = BatchMeta.decode(slot_ids, n, max_kv_len=L, row_start=self.row_start, cache_rows=rows,
                                num_rows=self.rows)
        hidden = self.model(last[:, None], self.cache, meta)
        self.cache.advance_rounding()  # in-place on the device: graph-safe
        nxt = self.model.lm_logits(hidden[:, -1]).argmax(-1)
        io.tokens[:B, 0] = nxt
        io.num_accepted[:B] = 1
        self._advance_slots(rows, live, n + 1, nxt)

    def phase_draft(self, B: int, L: int) -> None:
        io = self.io
        slot_ids, live, rows = self._batch_rows(B)
        n = torch.where(live, self.slots.length[rows], 0)
        io.start_pos[:B] = n
        io.drafts[:B] = self.draft(slot_ids, n, L)

    def draft(self, slot_ids: torch.Tensor, start_pos: torch.Tensor, max_kv_len: int | None = None
              ) -> torch.Tensor:
        """K draft tokens per row: [B, K] int64 on the device. The first was prepared by the previous step
        (or the prefill); each further one applies the MTP module to its own last output and draft, at MTP
        position start_pos - 1 + j. Writes the MTP KV cache there (the catch-up overwrites it). PAD rows
        start from token 0 and a zero hidden. ``max_kv_len``: the step's KV bound (None: computed)."""
        live, rows = slot_ids >= 0, slot_ids % (self.rows)
        drafts = [torch.where(live, self.slots.draft1[rows], 0)]
        h = torch.where(live[:, None], self.slots.mtp_hidden[rows], 0.0)
        for j in range(1, self.options.draft_len):
            # start_pos + (j - 1): one add (the same int64 values as start_pos - 1 + j)
            meta = BatchMeta.decode(slot_ids, start_pos + (j - 1), max_kv_len=max_kv_len,
                                    row_start=self.row_start, cache_rows=rows,
                                    num_rows=self.rows)
            h = mtp_forward(self.model, self.cache, drafts[-1][:, None], h[:, None], meta)[:, 0]
            drafts.append(self.model.lm_logits(h).argmax(-1))
        return torch.stack(drafts, dim=1)

    def phase_verify(self, B: int, L: int) -> None:
        io = self.io
        slot_ids, live, rows = self._batch_rows(B)
        last = torch.where(live, self.slots.last_token[rows], 0)
        tokens = torch.cat([last[:, None], io.drafts[:B]], dim=1)  # [B, T]
        T = self.options.draft_len + 1
        meta = BatchMeta.decode(slot_ids, io.start_pos[:B], T, verify=True, max_kv_len=L,
                                row_start=self.row_start, cache_rows=rows, num_rows=self.rows)
        hidden = self.model(tokens, self.cache, meta)  # [B, T, D]
        self.cache.advance_rounding()
        io.hidden[:B] = hidden
        io.greedy[:B] = self.model.lm_logits(hidden).argmax(-1)

    def phase_commit(self, B: int, L: int) -> None:
        io = self.io
        K = self.options.draft_len
        T = K + 1
        slot_ids, live, rows = self._batch_rows(B)
        drafts, greedy = io.drafts[:B], io.greedy[:B]
        if self.forced is None:
            accepted = (drafts == greedy[:, :K]).long().cumprod(dim=1).sum(dim=1)  # [B] in [0, K]
        else:
            accepted = self.forced.next(live, K)
        num_accepted = accepted + 1
        # no range checks on the host: num_accepted is in [1, T] by construction (the kernels clamp anyway)
        self.cache.commit(slot_ids, num_accepted, check=False)
        bonus = greedy.gather(1, accepted[:, None])[:, 0]
        # the new tokens, d_1 .. d_a then the bonus; column j is also what MTP position n + j pairs with
        cols = torch.arange(T, device=drafts.device)[None, :]
        io.tokens[:B] = torch.where(cols < accepted[:, None], torch.cat([drafts, drafts[:, :1]], dim=1),
                                    bonus[:, None])
        io.num_accepted[:B] = num_accepted
        self._advance_slots(rows, live, io.start_pos[:B] + num_accepted, bonus)

    def phase_catchup(self, B: int, L: int) -> None:
        io = self.io
        slot_ids, num_accepted = io.slot_ids[:B], io.num_accepted[:B]
        catch_up = BatchMeta(slot_ids, io.start_pos[:B], num_accepted, max_kv_len=L, row_start=self.row_start,
                             num_rows=self.rows)
        out = mtp_forward(self.model, self.cache, io.tokens[:B], io.hidden[:B], catch_up)
        self.store_first_draft(slot_ids, out[torch.arange(B, device=out.device), num_accepted - 1],
                               rows=catch_up.cache_rows)
