"""Continuous batching for one ``Engine.generate`` call: admission, decode steps, token appends, finishes.

:class:`Generation` holds what one call keeps on the host -- the waiting requests, the slot each active
request holds, the launched steps not read yet, the outputs, the call's :class:`GenerationStats` -- and runs
the loop: admit waiting requests into every free slot and prefill them together (``engine._prefill``), else
queue a decode step over the active slots (``engine._launch``) and read the oldest queued one
(``engine._step_tokens``). With ``overlap_steps`` the next step is queued before this one's bookkeeping. The
engine methods it calls are the ones the tensor-parallel launcher mirrors on every rank
(runners.engine.launch.LOCKSTEP_METHODS). :class:`SlotCounters` keeps each request's own counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from runners.engine.stats import GenerationStats

if TYPE_CHECKING:
    from runners.engine.engine import Engine
    from runners.engine.step import LaunchedStep


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
        self.draft_len = draft_len
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
        K = self.draft_len
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
            "drafted_tokens": self.draft_len * steps,
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


class Generation:
    """The host-side state and loop of one ``generate`` call (module docstring). Arguments as
    ``Engine.generate``'s, already checked; ``report(finished)`` is the progress callback."""

    def __init__(self, engine: Engine, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                 stop_checker: Callable[[int, list[int]], bool] | None,
                 on_finish: Callable[[int, list[int], str, dict], None] | None,
                 report: Callable[[int], None]):
        self.engine, self.prompts, self.max_new_tokens = engine, prompts, max_new_tokens
        self.stop_ids, self.stop_checker = stop_ids, stop_checker
        self.on_finish, self.report = on_finish, report
        n, S = len(prompts), engine.max_batch_size
        self.stats = GenerationStats(num_requests=n, prompt_tokens=sum(map(len, prompts)))
        if engine.draft_len > 0:
            self.stats.record_step([], engine.draft_len)  # sizes the per-position counters
        self.out_tokens: list[list[int]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.finished = 0
        self.waiting = deque(range(n))
        self.free_slots = list(range(S - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_request = [-1] * S
        self.slot_len = [0] * S  # tokens of the slot's request in the cache, as last read back
        self.active: list[int] = []  # slots decoding, in admission order
        self.inflight: deque[LaunchedStep] = deque()  # launched steps not read yet, oldest first
        self.counters = engine._slot_counters

    def run(self) -> None:
        """Until every request finished: admit into free slots, else step (with overlap: queue the next step
        before reading this one)."""
        while self.waiting or self.active or self.inflight:
            if self.waiting and self.free_slots:
                self.admit()
            else:
                self.step()

    def admit(self) -> None:
        """Read every queued step first (its requests may finish, its slots free), then take a waiting
        request into every free slot and prefill the newcomers together."""
        t0 = time.perf_counter()
        while self.inflight:
            self.read(self.inflight.popleft())
        self.stats.decode_seconds += time.perf_counter() - t0
        requests = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self.free_slots)))]
        if self.engine.prefix_cache is not None:  # prompts sharing an uncached prefix: one prefills it first
            take, defer = self.engine._split_admission([self.prompts[r] for r in requests])
            self.waiting.extendleft(requests[j] for j in reversed(defer))
            requests = [requests[j] for j in take]
        admitted = []
        for request in requests:
            slot = self.free_slots.pop()
            self.slot_request[slot] = request
            admitted.append(slot)
        self.counters.reset(admitted)
        t0 = time.perf_counter()
        first = self.engine._prefill([self.prompts[self.slot_request[s]] for s in admitted], admitted)
        for slot in admitted:
            self.slot_len[slot] = len(self.prompts[self.slot_request[slot]])
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.active.extend(admitted)
        for slot, token in zip(admitted, first):
            _, reason = self.append(slot, [token])
            if reason is not None:
                self.finish(slot, reason)

    def step(self) -> None:
        """Queue a decode step over the active slots when allowed, and read the oldest queued one unless it
        may still overlap with the one just queued."""
        t0 = time.perf_counter()
        engine, T, inflight = self.engine, self.engine.draft_len + 1, self.inflight
        # Every row's KV reads stay below its length before the step + T, and each queued step unread may
        # add up to T tokens: an upper bound the host knows without waiting for the device.
        bound = max((self.slot_len[s] for s in self.active), default=0) + T * (len(inflight) + 1)
        ahead = engine.overlap_steps and bound <= engine.max_seq_len  # a run-ahead step stays in the cache
        launch = bool(self.active) and (not inflight or ahead)
        if launch:
            slots = sorted(self.active)
            inflight.append(engine._launch(slots, bound, [self.slot_request[s] for s in slots]))
        if inflight and (not launch or not engine.overlap_steps or len(inflight) > 1):
            self.read(inflight.popleft())  # with overlap: the previous step, while this one runs
        self.stats.decode_seconds += time.perf_counter() - t0

    def read(self, step: LaunchedStep) -> None:
        """The host bookkeeping of a launched step: its tokens go to the requests that still hold their
        slots (a step queued before the previous one was read may carry rows of requests that finished
        there; those rows are dropped)."""
        t0 = time.perf_counter()
        new_tokens = self.engine._step_tokens(step)
        t1 = time.perf_counter()
        rows = zip(step.slots, step.requests, new_tokens)
        kept = [(s, toks) for s, i, toks in rows if self.slot_request[s] == i]
        if kept:
            self.stats.steps += 1
            outcomes = []
            for s, toks in kept:
                self.slot_len[s] += len(toks)  # the cache holds them all; the output may stop earlier
                outcomes.append(self.append(s, toks))
            if self.engine.draft_len > 0:  # count what was committed: a step cut by a stop keeps j - 1 drafts
                self.count_acceptance([s for s, _ in kept], [j - 1 for j, _ in outcomes])
            for (s, _), (_, reason) in zip(kept, outcomes):
                if reason is not None:
                    self.finish(s, reason)
        timer = self.engine.step.phase_timer
        if timer is not None:
            timer.add_host("wait", t1 - t0)
            timer.add_host("bookkeeping", time.perf_counter() - t1)

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
        self.stats.record_step(accepted, self.engine.draft_len)
        long = dict(dtype=torch.long)
        self.counters.record(torch.tensor(slots, **long), torch.tensor(accepted, **long))
