"""The host side of one ``Engine.generate`` call: its arguments checked, and the scheduler that decides what
the model runner runs.

:class:`Scheduler` holds what one call keeps on the host -- the waiting requests, the slot each active
request holds, the launched steps not read yet, the outputs, the call's :class:`GenerationStats`, each
request's counters (:class:`SlotCounters`) -- and decides, step by step, what runs next
(:meth:`Scheduler.schedule` -> :class:`Plan`): admit waiting requests into every free slot (once every
queued step is read), else queue a decode step over the active slots and read the oldest queued one (with
``overlap_steps`` the next step is queued before this one is read). The engine hands the plan to the model
runner (``runners.engine.runner.ModelRunner``: ``prefill``, ``launch``, ``read``) and gives the results back
(:meth:`Scheduler.admitted`, :meth:`Scheduler.launched`, :meth:`Scheduler.read`): tokens appended, stop
checks, callbacks, finished requests freeing their slots. It never touches the device, nor imports the
engine. The shape of the loop is nano-vllm's ``step() = schedule -> run -> postprocess``; the plan plays
vLLM v1's ``SchedulerOutput`` (no code of either is used).
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runners.engine.stats import GenerationStats

if TYPE_CHECKING:
    from runners.engine.models.config import HybridConfig
    from runners.engine.options import EngineOptions
    from runners.engine.prefill import Prefilled


# ------------------------------------------------------------------ the call's arguments

def token_id(value, where: str) -> int:
    """One token id as a Python int. Raises TypeError for anything but an integer (bools, floats -- even 2.0
    -- strings, floating tensors), naming ``where`` (e.g. "prompts[0][3]")."""
    if isinstance(value, torch.Tensor):
        if (
            value.numel() != 1
            or value.dtype.is_floating_point
            or value.dtype.is_complex
            or value.dtype == torch.bool
        ):
            raise TypeError(
                f"{where} must be an integer token id, got a tensor of dtype {value.dtype} and "
                f"shape {list(value.shape)}"
            )
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} must be an integer token id, got {type(value).__name__} {value!r}")
    return int(value)


def token_list(values, where: str) -> list[int]:
    """A sequence of token ids as a list of ints (see :func:`token_id`); a string is refused."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | torch.Tensor):
        raise TypeError(
            f"{where} must be a sequence of integer token ids, got {type(values).__name__} {values!r}"
        )
    if isinstance(values, torch.Tensor) and values.dim() != 1:
        raise TypeError(
            f"{where} must be a 1-D sequence of token ids, got a tensor of shape {list(values.shape)}"
        )
    if isinstance(values, list) and all(type(v) is int for v in values):  # the usual case, checked at once
        return list(values)
    return [token_id(v, f"{where}[{j}]") for j, v in enumerate(values)]


def token_rows(rows, where: str) -> list[list[int]]:
    """Token-id rows (a sequence of sequences, or a 2-D integer tensor) as lists of ints. Raises TypeError."""
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence | torch.Tensor):
        raise TypeError(f"{where} must be a list of token-id lists, got {type(rows).__name__}")
    return [token_list(row, f"{where}[{i}]") for i, row in enumerate(rows)]

def check_input_ids(input_ids, vocab_size: int) -> None:
    """``Engine.logits``'s argument check, before any compute. Raises TypeError when ``input_ids`` is not an
    integer torch.Tensor; ValueError when it is not [B, T] with B, T >= 1, or holds an id outside
    [0, vocab_size)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.Tensor of token ids [B, T], got {type(input_ids).__name__}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got shape {list(input_ids.shape)}")
    V = vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= V:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"input_ids holds token id {bad}, outside [0, {V}) (the vocab size); tokenizer and "
            "checkpoint disagree"
        )


def checked_requests(prompts, max_new_tokens: int, stop_token_ids, config: HybridConfig,
                     options: EngineOptions) -> tuple[list[list[int]], set[int]]:
    """``Engine.generate``'s arguments checked, before any compute: (prompts as lists of ints, the set of
    stop ids: ``stop_token_ids``, None meaning ``config.eos_token_id``).

    Raises (naming the argument and the index):
        TypeError: prompts not a list of token-id lists (or a 2-D integer tensor); an id that is not an
            integer (a float such as 1.9 or 2.0, a string, a bool); a non-int max_new_tokens or
            stop_token_ids entry.
        ValueError: an empty prompt, an id outside [0, vocab), max_new_tokens < 1, or a prompt that with
            max_new_tokens and the draft length does not fit ``options.max_seq_len``.
    """
    prompts = token_rows(prompts, "prompts")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(
            f"max_new_tokens must be an int, got {type(max_new_tokens).__name__} {max_new_tokens!r}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    V, K, max_seq_len = config.vocab_size, options.draft_len, options.max_seq_len
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}] is empty; every request needs at least one token (e.g. BOS)")
        bad = next((j for j, t in enumerate(p) if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(
                f"prompts[{i}][{bad}] = {p[bad]} is outside [0, {V}) (the vocab size); tokenizer and "
                "checkpoint disagree"
            )
        if len(p) + max_new_tokens + K > max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens + K} > max_seq_len={max_seq_len} positions "
                f"(draft_len={K} included); raise "
                "max_seq_len or shorten the prompt"
            )
    eos = config.eos_token_id
    return prompts, set(eos if stop_token_ids is None else token_list(stop_token_ids, "stop_token_ids"))


def progress_reporter(progress, total: int):
    """(tqdm bar or None, ``report(finished)``) for ``generate``'s ``progress``: True shows a tqdm bar over
    finished requests, a callable gets (finished, total), anything false reports nothing."""
    if callable(progress):
        return None, lambda done: progress(done, total)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="generate", unit="req")
        return bar, lambda done: bar.update(1)
    return None, lambda done: None


# ------------------------------------------------------------------ the scheduler

class SlotCounters:
    """Per-slot speculative counters of the request that holds each cache slot; host int64 tensors.

    ``request_steps`` [S], ``accepted_drafts`` [S], ``accepted_per_position`` [S, K] and ``num_accepted_hist``
    [S, K + 2] mirror the :class:`GenerationStats` fields of the same names for one request;
    ``prefix_queried`` [S] (0 / 1) and ``prefix_hit_tokens`` [S] its prefix-cache lookup
    (:meth:`record_prefix`). :meth:`reset` zeroes a slot's row when a request is admitted; :meth:`record`
    updates all rows of a verify step at once (no loop over requests), with the committed counts;
    :meth:`request_stats` reads one row back as the ``request_stats`` dict that ``on_finish`` receives.
    Summed over all requests of a ``generate`` call the rows equal that call's :class:`GenerationStats`.
    """

    def __init__(self, num_slots: int, draft_len: int):
        self.request_steps = torch.zeros(num_slots, dtype=torch.long)
        self.accepted_drafts = torch.zeros(num_slots, dtype=torch.long)
        self.accepted_per_position = torch.zeros(num_slots, draft_len, dtype=torch.long)
        self.num_accepted_hist = torch.zeros(num_slots, draft_len + 2 if draft_len else 0, dtype=torch.long)
        self.prefix_queried = [0] * num_slots
        self.prefix_hit_tokens = [0] * num_slots

    def reset(self, slots: Sequence[int]) -> None:
        """Zero the rows of ``slots`` (newly admitted requests)."""
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        self.request_steps[idx] = 0
        self.accepted_drafts[idx] = 0
        self.accepted_per_position[idx] = 0
        self.num_accepted_hist[idx] = 0
        for s in slots:
            self.prefix_queried[s] = self.prefix_hit_tokens[s] = 0

    def record_prefix(self, slot: int, hit_tokens: int) -> None:
        """The request in ``slot`` looked the prefix cache up and reused ``hit_tokens`` prompt tokens."""
        self.prefix_queried[slot], self.prefix_hit_tokens[slot] = 1, hit_tokens

    def record(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """Count one verify step: ``slots`` [B] distinct slot ids, ``accepted`` [B] accepted drafts in [0, K]
        (host int64)."""
        K = self.accepted_per_position.shape[1]
        self.request_steps[slots] += 1
        self.accepted_drafts[slots] += accepted
        self.accepted_per_position[slots] += (torch.arange(K)[None, :] < accepted[:, None]).long()
        self.num_accepted_hist[slots, accepted + 1] += 1

    def request_stats(self, slot: int, prompt_tokens: int, generated_tokens: int) -> dict:
        """The counters of the request in ``slot`` as a plain dict: ``request_steps``, ``drafted_tokens``
        (K per request-step), ``accepted_drafts``, ``accepted_per_position`` [K], ``num_accepted_hist``
        [K + 2] (both [] without speculation), ``generated_tokens``, ``prompt_tokens`` and the prefix-cache
        counters ``prefix_cache_queries`` / ``_query_tokens`` / ``_hits`` / ``_hit_tokens``."""
        steps = int(self.request_steps[slot])
        queried, hit = self.prefix_queried[slot], self.prefix_hit_tokens[slot]
        return {
            "request_steps": steps,
            "drafted_tokens": self.accepted_per_position.shape[1] * steps,
            "accepted_drafts": int(self.accepted_drafts[slot]),
            "accepted_per_position": self.accepted_per_position[slot].tolist(),
            "num_accepted_hist": self.num_accepted_hist[slot].tolist(),
            "generated_tokens": generated_tokens,
            "prompt_tokens": prompt_tokens,
            "prefix_cache_queries": queried,
            "prefix_cache_query_tokens": prompt_tokens if queried else 0,
            "prefix_cache_hits": int(hit > 0),
            "prefix_cache_hit_tokens": hit,
        }


@dataclass
class Plan:
    """What one iteration of ``Engine.generate`` runs, in this order (:meth:`Scheduler.schedule`).

    admit: the waiting requests to admit (indices into the call's prompts), in order; prompts: their token
        ids; slots: the free slots they take, in order (``ModelRunner.prefill`` may take fewer: the rest
        stay waiting);
    launch: the slots (sorted) of the decode step to queue; kv_bound: an upper bound of each one's cached
        length after it (``DecodeStep.launch``);
    read: whether to read the oldest queued step (after the launch).
    An admission plan holds no launch and no read.
    """

    admit: list[int] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    launch: list[int] = field(default_factory=list)
    kv_bound: int = 0
    read: bool = False


@dataclass
class Queued:
    """A launched step not read yet: its slots, the request that held each at launch, the runner's handle."""

    slots: list[int]
    requests: list[int]
    handle: object


class Scheduler:
    """The host-side state and decisions of one ``generate`` call (module docstring).

    Args:
        prompts, max_new_tokens, stop_ids, stop_checker, on_finish: as ``Engine.generate``'s, already
            checked (``stop_ids`` the set of stop token ids); report: ``report(finished)``, the progress
            callback; options: the engine's options, read here: max_batch_size (S slots), draft_len (K),
            max_seq_len, overlap_steps (resolved: ``EngineOptions.on_device``); timer: the step's
            ``PhaseTimer`` (the host's bookkeeping time of each read goes to it), or None.

    Attributes:
        stats: the call's :class:`GenerationStats`; out_tokens, reasons: per request; counters: the
        :class:`SlotCounters`; waiting, active, free_slots, inflight: the queue, the slots decoding (in
        admission order), the free slots (``pop()`` hands out slot 0 first), the launched steps not read
        (:class:`Queued`, oldest first).
    """

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                 stop_checker: Callable[[int, list[int]], bool] | None,
                 on_finish: Callable[[int, list[int], str, dict], None] | None,
                 report: Callable[[int], None], options: EngineOptions, timer=None):
        self.prompts, self.max_new_tokens = prompts, max_new_tokens
        self.stop_ids, self.stop_checker = stop_ids, stop_checker
        self.on_finish, self.report, self.options, self.timer = on_finish, report, options, timer
        n, S, K = len(prompts), options.max_batch_size, options.draft_len
        self.stats = GenerationStats(num_requests=n, prompt_tokens=sum(map(len, prompts)))
        if K > 0:
            self.stats.record_step([], K)  # sizes the per-position counters
        self.counters = SlotCounters(S, K)
        self.out_tokens: list[list[int]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.finished = 0
        self.waiting = deque(range(n))
        self.free_slots = list(range(S - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_request = [-1] * S
        self.slot_len = [0] * S  # tokens of the slot's request in the cache, as last read back
        self.active: list[int] = []  # slots decoding, in admission order
        self.inflight: deque[Queued] = deque()  # launched steps not read yet, oldest first

    @property
    def done(self) -> bool:
        """Every request finished (nothing waits, decodes or is queued)."""
        return not (self.waiting or self.active or self.inflight)

    def schedule(self) -> Plan:
        """The next :class:`Plan`. With waiting requests and a free slot: read the queued steps first, one
        per plan (their requests may finish, their slots free), then admit a waiting request into every
        free slot. Else queue a decode step over the active slots when allowed, and read the oldest queued
        one unless it may still overlap with the one just queued."""
        inflight, overlap = self.inflight, self.options.overlap_steps
        if self.waiting and self.free_slots:
            if inflight:
                return Plan(read=True)
            n = min(len(self.waiting), len(self.free_slots))
            admit = [self.waiting[j] for j in range(n)]
            prompts = [self.prompts[r] for r in admit]
            return Plan(admit=admit, prompts=prompts, slots=self.free_slots[::-1][:n])
        # Every row's KV reads stay below its length before the step + T, and each queued step unread may
        # add up to T tokens: an upper bound the host knows without waiting for the device.
        T = self.options.draft_len + 1
        bound = max((self.slot_len[s] for s in self.active), default=0) + T * (len(inflight) + 1)
        ahead = overlap and bound <= self.options.max_seq_len  # a run-ahead step stays in the cache
        launch = bool(self.active) and (not inflight or ahead)
        queued = len(inflight) + launch
        read = queued > 0 and (not launch or not overlap or queued > 1)  # with overlap: the previous step
        return Plan(launch=sorted(self.active) if launch else [], kv_bound=bound, read=read)

    def admitted(self, plan: Plan, out: Prefilled) -> None:
        """The prefill of ``plan.admit`` ran: the taken requests hold their slots and get their first tokens;
        the others go back to the front of the queue, in order."""
        for _ in plan.admit:
            self.waiting.popleft()
        deferred = sorted(set(range(len(plan.admit))) - set(out.taken))
        self.waiting.extendleft(plan.admit[j] for j in reversed(deferred))
        admitted = []
        for j in out.taken:
            slot = self.free_slots.pop()
            self.slot_request[slot] = plan.admit[j]
            self.slot_len[slot] = len(plan.prompts[j])
            admitted.append(slot)
        self.counters.reset(admitted)
        if out.hit_tokens is not None:  # the prefix cache's counters
            s = self.stats
            s.prefix_cache_queries += len(admitted)
            s.prefix_cache_query_tokens += sum(len(plan.prompts[j]) for j in out.taken)
            s.prefix_cache_hits += sum(h > 0 for h in out.hit_tokens)
            s.prefix_cache_hit_tokens += sum(out.hit_tokens)
            s.prefix_cache_stores += out.stores
            s.prefix_cache_evictions += out.evictions
            for slot, hit in zip(admitted, out.hit_tokens):
                self.counters.record_prefix(slot, hit)
        self.active.extend(admitted)
        for slot, token in zip(admitted, out.tokens):
            _, reason = self.append(slot, [token])
            if reason is not None:
                self.finish(slot, reason)

    def launched(self, plan: Plan, handle: object) -> None:
        """The step of ``plan.launch`` is queued (``handle``: the runner's, read in launch order)."""
        self.inflight.append(Queued(plan.launch, [self.slot_request[s] for s in plan.launch], handle))

    @property
    def oldest(self) -> object:
        """The runner's handle of the oldest queued step (the next to read)."""
        return self.inflight[0].handle

    def read(self, new_tokens: list[list[int]]) -> None:
        """The oldest queued step's new tokens (per row, ``ModelRunner.read``) go to the requests that still
        hold their slots (a step queued before the previous one was read may carry rows of requests that
        finished there; those rows are dropped)."""
        t0 = time.perf_counter()
        step = self.inflight.popleft()
        rows = zip(step.slots, step.requests, new_tokens)
        kept = [(s, toks) for s, i, toks in rows if self.slot_request[s] == i]
        if kept:
            self.stats.steps += 1
            outcomes = []
            for s, toks in kept:
                self.slot_len[s] += len(toks)  # the cache holds them all; the output may stop earlier
                outcomes.append(self.append(s, toks))
            if self.options.draft_len > 0:  # count what was committed: a step cut by a stop keeps j - 1
                self.count_acceptance([s for s, _ in kept], [j - 1 for j, _ in outcomes])
            for (s, _), (_, reason) in zip(kept, outcomes):
                if reason is not None:
                    self.finish(s, reason)
        if self.timer is not None:
            self.timer.add_host("bookkeeping", time.perf_counter() - t0)

    def append(self, slot: int, tokens: list[int]) -> tuple[int, str | None]:
        """Append a step's ``tokens`` to the slot's request up to the first stop condition (a speculative
        step may bring several tokens); returns (tokens appended, finish reason or None)."""
        i = self.slot_request[slot]
        toks = self.out_tokens[i]
        for j, token in enumerate(tokens, start=1):
            toks.append(token)
            if token in self.stop_ids:
                return j, "stop_token"
            if self.stop_checker is not None and self.stop_checker(i, toks):
                return j, "stop_checker"
            if len(toks) >= self.max_new_tokens:
                return j, "length"
        return len(tokens), None

    def finish(self, slot: int, reason: str) -> None:
        """Report the slot's request finished (after its counters are complete) and free the slot."""
        i = self.slot_request[slot]
        self.reasons[i] = reason
        request_stats = self.counters.request_stats(slot, len(self.prompts[i]), len(self.out_tokens[i]))
        self.active.remove(slot)
        self.slot_request[slot] = -1
        self.free_slots.append(slot)
        self.finished += 1
        if self.on_finish is not None:
            self.on_finish(i, self.out_tokens[i], reason, request_stats)
        self.report(self.finished)

    def count_acceptance(self, slots: list[int], accepted: list[int]) -> None:
        """Count one verify step: ``accepted`` drafts per row of ``slots`` in the call's stats and in the
        per-slot counters of the requests."""
        self.stats.record_step(accepted, self.options.draft_len)
        long = dict(dtype=torch.long)
        self.counters.record(torch.tensor(slots, **long), torch.tensor(accepted, **long))
