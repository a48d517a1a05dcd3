"""The engine's prefill: newly admitted prompts into their (reset) cache slots, their first tokens out.

With the prefix cache (runners.engine.prefix_cache) each prompt first restores the longest cached prefix of
itself into its slot (``PrefixCache.lookup`` / ``restore``: target KV, MTP KV, recurrent states) and only the
rest is prefilled; a prompt that is entirely a cached prefix needs no target forward
(:meth:`Prefill._cached`). The prefill stops at the save points ``PrefixCache.save_points`` names (the
prompt's end, the junctions it shares with other prompts) and stores the slot's state there.

Requests are grouped so that a group's padded size (rows x longest remainder, capped at
``prefill_chunk_tokens`` per forward) stays within budget; a group runs in forwards of at most
``prefill_chunk_tokens / rows`` columns, right-padded, each row continuing from its own cached state at its
own position and ending a forward early at its next save point (:meth:`Prefill._group`). With drafts the MTP
module runs over the same positions (:meth:`Prefill._mtp`) and leaves each slot's first draft in the decode
step's slot state (``runners.engine.step.DecodeStep.store_first_draft``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runners.engine.cache import HybridCache
from runners.engine.models.hybrid import HybridLM
from runners.engine.options import EngineOptions
from runners.engine.prefix_cache import PrefixCache
from runners.engine.state import BatchMeta
from runners.engine.step import DecodeStep, mtp_forward


def drafts_rows_only(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a prefill runs the MTP blocks after its attention on the drafts' positions alone
    (``MTPModule.forward``'s ``keep``): on the CPU in float32, where that gives the same bits."""
    return device.type == "cpu" and dtype == torch.float32


@dataclass
class Prefilled:
    """What the prefill of one admission did (host values; ``runners.engine.runner.ModelRunner.prefill``).

    taken: indices of the prompts prefilled, in order; the others share an uncached prefix with one of
        them and wait for the next admission (``PrefixCache.split_admission``); all without a prefix cache;
    tokens: the first generated token of each taken prompt;
    hit_tokens: each taken prompt's cached prefix length, tokens (None: no prefix cache);
    stores, evictions: prefix-cache entries stored / evicted meanwhile.
    """

    taken: list[int]
    tokens: list[int]
    hit_tokens: list[int] | None = None
    stores: int = 0
    evictions: int = 0


@dataclass
class PrefillRow:
    """One prompt of a prefill: ``key`` its index among the admitted prompts, ``pos`` its tokens in the
    slot's cache (the cache hit, then advancing), ``hit`` the cached prefix length, ``carry`` the target
    hidden [D] at ``pos - 1`` restored from the prefix cache (its MTP position is still to run),
    ``save_points`` {position: shared} where the prefix cache stores the slot's state."""

    key: int
    prompt: list[int]
    slot: int
    pos: int = 0
    carry: torch.Tensor | None = None
    save_points: dict[int, bool] = field(default_factory=dict)
    hit: int = 0

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.pos

    def next_stop(self) -> int:
        """The next save point after ``pos``, else the prompt's end."""
        return min((p for p in self.save_points if p > self.pos), default=len(self.prompt))


class Prefill:
    """The prefill of an engine (module docstring).

    Args:
        model, cache: the engine's model and caches; step: its :class:`DecodeStep` (the slot state a prefill
            leaves: lengths, first tokens, first drafts); prefix_cache: the engine's (None: off);
        options: the engine's options, read here: draft_len (K), prefill_chunk_tokens (padded tokens per
            forward), prefill_max_rows (prompts per forward at most; None: as many as the token budget
            holds); device: the engine's.
    """

    def __init__(self, model: HybridLM, cache: HybridCache, step: DecodeStep,
                 prefix_cache: PrefixCache | None, options: EngineOptions, *, device: torch.device):
        self.model, self.cache, self.step, self.prefix_cache = model, cache, step, prefix_cache
        self.options, self.device = options, device

    def run(self, prompts: list[list[int]], slots: list[int]) -> Prefilled:
        """Prefill ``prompts`` into ``slots`` (reset first): every prompt is taken (``Prefilled.taken``),
        ``Prefilled.tokens`` holds each one's first token. Leaves the slots' decode state (length, last
        token, first draft) in the step's slot state; restores from and saves into the prefix cache.
        """
        slot_ids = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.cache.reset(slot_ids)
        rows = [PrefillRow(j, p, s) for j, (p, s) in enumerate(zip(prompts, slots))]
        pc = self.prefix_cache
        if pc is not None:
            stores, evictions = pc.stores, pc.evictions
            self._restore(rows, prompts)
        first: dict[int, int] = {}
        full = [r for r in rows if r.pos == len(r.prompt)]
        if full:
            first.update(self._cached(full))
        for group in self._groups([r for r in rows if r.pos < len(r.prompt)]):
            first.update(self._group(group))
        first_tokens = [first[j] for j in range(len(prompts))]
        # the decode state the steps start from: the prompt is in the cache, its first token is fed next
        self.step.start_slots(slot_ids, [len(p) for p in prompts], first_tokens)
        out = Prefilled(list(range(len(prompts))), first_tokens)
        if pc is not None:
            out.hit_tokens = [r.hit for r in rows]
            out.stores, out.evictions = pc.stores - stores, pc.evictions - evictions
        return out

    def _restore(self, rows: list[PrefillRow], prompts: list[list[int]]) -> None:
        """Restore each row's longest cached prefix into its slot and name its save points."""
        pc = self.prefix_cache
        for r in rows:
            entry = pc.lookup(r.prompt)
            if entry is not None:
                pc.restore(self.cache, r.slot, entry)
                r.pos = r.hit = len(entry.tokens)
                r.carry = entry.hidden
        for r, points in zip(rows, pc.save_points(prompts, [r.pos for r in rows])):
            r.save_points = points

    def _groups(self, todo: list[PrefillRow]) -> list[list[PrefillRow]]:
        """Rows sorted by what remains, cut into groups whose padded size fits ``prefill_chunk_tokens`` and
        of at most ``prefill_max_rows`` rows."""
        budget, most = self.options.prefill_chunk_tokens, self.options.prefill_max_rows or len(todo)
        groups: list[list[PrefillRow]] = []
        group: list[PrefillRow] = []
        for r in sorted(todo, key=lambda r: r.remaining) + [None]:
            if r is not None and (not group or len(group) < most
                                  and (len(group) + 1) * min(r.remaining, budget) <= budget):
                group.append(r)
                continue
            if group:
                groups.append(group)
            group = [r] if r is not None else []
        return groups

    def _cached(self, rows: list[PrefillRow]) -> dict[int, int]:
        """First tokens of prompts that are entirely a cached prefix: the greedy token of the restored hidden
        of the last position; with drafts, the MTP module at the last prompt position (that hidden paired
        with the first token) gives the first draft."""
        hidden = torch.stack([r.carry for r in rows])  # [n, D]
        tokens = self.model.lm_logits(hidden).argmax(-1)
        if self.options.draft_len > 0:
            slot_ids = torch.tensor([r.slot for r in rows], dtype=torch.long, device=self.device)
            start = torch.tensor([r.pos - 1 for r in rows], dtype=torch.long, device=self.device)
            meta = BatchMeta.decode(slot_ids, start, max_kv_len=max(r.pos for r in rows))
            out = mtp_forward(self.model, self.cache, tokens[:, None], hidden[:, None], meta)
            self.step.store_first_draft(slot_ids, out[:, 0])
        for r in rows:
            r.carry = None
        return dict(zip([r.key for r in rows], tokens.tolist()))

    def _group(self, rows: list[PrefillRow]) -> dict[int, int]:
        """Prefill ``rows`` to their prompts' ends in forwards of at most ``prefill_chunk_tokens / len(rows)``
        columns; returns {row key: first token}.

        Each forward takes from every unfinished row the tokens up to its next save point (at most the
        chunk width), right-padded, at the row's own start position. Rows whose prompt ends in a forward get
        their first token; with drafts the MTP module runs over the same positions (:meth:`_mtp`). A row that
        reaches a save point stores its slot's state in the prefix cache.
        """
        chunk = max(1, min(max(r.remaining for r in rows), self.options.prefill_chunk_tokens // len(rows)))
        first: dict[int, int] = {}
        dev, pc = self.device, self.prefix_cache
        while True:
            active = sorted((r for r in rows if r.remaining), key=lambda r: r.slot)
            if not active:
                return first
            n = [min(chunk, r.next_stop() - r.pos) for r in active]
            slot_ids, meta = self._forward_meta(active, n)
            W = max(n)
            ids = torch.zeros(len(active), W, dtype=torch.long)
            for b, r in enumerate(active):
                ids[b, : n[b]] = torch.tensor(r.prompt[r.pos : r.pos + n[b]], dtype=torch.long)
            hidden = self.model(ids.to(dev), self.cache, meta)  # [B, W, D]
            self.cache.advance_rounding()
            ending = [b for b, r in enumerate(active) if r.pos + n[b] == len(r.prompt)]
            tokens = None
            if ending:
                rows_e = torch.tensor(ending, dtype=torch.long, device=dev)
                cols_e = torch.tensor([n[b] - 1 for b in ending], dtype=torch.long, device=dev)
                tokens = self.model.lm_logits(hidden[rows_e, cols_e]).argmax(-1)
                first.update(zip([active[b].key for b in ending], tokens.tolist()))
            if self.options.draft_len > 0:
                self._mtp(active, n, hidden, slot_ids, ending, tokens, meta.row_start)
            for b, r in enumerate(active):
                r.pos += n[b]
                r.carry = None
                if pc is not None and r.pos in r.save_points:
                    pc.save(self.cache, r.slot, r.prompt[: r.pos], hidden[b, n[b] - 1], r.save_points[r.pos])

    def _forward_meta(self, active: list[PrefillRow], n: list[int]) -> tuple[torch.Tensor, BatchMeta]:
        """The slot ids [B] and :class:`BatchMeta` of one prefill forward: ``n[b]`` tokens of row b at its
        position (rows over consecutive slots read their KV rows as views: ``row_start``)."""
        dev = self.device
        slot_list = [r.slot for r in active]
        slot_ids = torch.tensor(slot_list, dtype=torch.long, device=dev)
        consecutive = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
        meta = BatchMeta(
            slot_ids,
            torch.tensor([r.pos for r in active], dtype=torch.long, device=dev),
            torch.tensor(n, dtype=torch.long, device=dev),
            all_valid=min(n) == max(n),
            max_kv_len=max(r.pos + m for r, m in zip(active, n)),
            fresh=all(r.pos == 0 for r in active),
            row_start=slot_list[0] if consecutive else None,
        )
        return slot_ids, meta

    def _mtp(self, active: list[PrefillRow], n: list[int], hidden: torch.Tensor, slot_ids: torch.Tensor,
             ending: list[int], first_tokens: torch.Tensor | None, row_start: int | None = None) -> None:
        """The MTP module over one prefill forward's positions (see :meth:`_group`). MTP position i pairs the
        target hidden at i with token i + 1; the prompt's last position pairs with the first generated
        token, and its output there gives the first draft. A row with a restored hidden (``carry``, after a
        cache hit) starts one position earlier: the restored hidden pairs with its first uncached token.
        Writes the MTP KV cache; stores the first draft of the rows in ``ending`` (indices into ``active``;
        their first tokens ``first_tokens``). On the CPU in float32 the blocks after the MTP attention run
        on those rows' last positions alone (``MTPModule.forward``'s ``keep``: the same bits, a tenth less
        work per prefill)."""
        dev, D = self.device, hidden.shape[-1]
        shift = [int(r.carry is not None) for r in active]
        m = [k + s for k, s in zip(n, shift)]  # MTP positions of each row
        Wm = max(m)
        if any(shift):  # column 0: the restored hidden; rows without one read from column 1
            carry = torch.stack([r.carry if r.carry is not None else hidden.new_zeros(D) for r in active])
            h = torch.cat([carry[:, None], hidden], dim=1)  # [B, W + 1, D]
            col = torch.arange(Wm, device=dev)[None, :] + 1 - torch.tensor(shift, device=dev)[:, None]
            h = h.gather(1, col.clamp(max=h.shape[1] - 1)[..., None].expand(-1, -1, D))
        else:
            h = hidden[:, :Wm]
        nxt = torch.zeros(len(active), Wm, dtype=torch.long)
        for b, r in enumerate(active):
            start = r.pos - shift[b]
            after = r.prompt[start + 1 : start + 1 + m[b]]  # the prompt's last position pairs with token 1
            nxt[b, : len(after)] = torch.tensor(after, dtype=torch.long)
        nxt = nxt.to(dev)
        if ending:
            rows_e = torch.tensor(ending, dtype=torch.long, device=dev)
            cols_e = torch.tensor([m[b] - 1 for b in ending], dtype=torch.long, device=dev)
            nxt[rows_e, cols_e] = first_tokens
        meta = BatchMeta(
            slot_ids,
            torch.tensor([r.pos - s for r, s in zip(active, shift)], dtype=torch.long, device=dev),
            torch.tensor(m, dtype=torch.long, device=dev),
            all_valid=min(m) == Wm,
            max_kv_len=max(r.pos + k for r, k in zip(active, n)),
            fresh=all(r.pos - s == 0 for r, s in zip(active, shift)),
            row_start=row_start,
        )
        if drafts_rows_only(dev, h.dtype):
            keep = rows_e * Wm + cols_e if ending else torch.zeros(0, dtype=torch.long)
            out = mtp_forward(self.model, self.cache, nxt, h, meta, keep=keep)
        else:
            out = mtp_forward(self.model, self.cache, nxt, h, meta)
            out = out[rows_e, cols_e] if ending else None
        if ending:
            self.step.store_first_draft(slot_ids[rows_e], out)
