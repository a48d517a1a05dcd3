"""Exact prefix caching for hybrid models: per-slot state saved at prompt positions, restored on admission.

A request whose prompt starts with tokens an earlier prefill already passed through can skip them: the engine
copies what the cache holds at that position into the request's slot and prefills only the rest. For a
hybrid model "what the cache holds" at position L is the whole per-slot state after L tokens:

- the attention KV of positions [0, L) of every target attention layer;
- the MTP module's own attention KV of positions [0, L - 1): MTP position i pairs the target hidden at i
  with token i + 1, so position L - 1 depends on the token after the prefix and is recomputed from the
  stored hidden (restoring only the target's cache makes drafts attend to missing entries: vLLM issue
  #43559 reports acceptance and accuracy falling when MTP and prefix caching were combined);
- every recurrent layer's committed state (Mamba2 SSM state + conv window, Gated DeltaNet state + conv
  window; under SSM replay the committed state at PNAT = 0, the replay bookkeeping being reset by the
  engine's ``HybridCache.reset``);
- the target's hidden state at position L - 1 (after the final norm): it gives the first generated token of
  a prompt that is entirely a cached prefix, and pairs with the next token as that MTP position's input.

Recurrent states exist only at positions a prefill stopped at, so the engine cuts its prefill chunks at the
positions :meth:`PrefixCache.save_points` names: the end of each prompt and the *junctions*, the longest
prefix a prompt shares with another prompt admitted with it or with a recently admitted one (vLLM's
"shared-prefix checkpoint" of hybrid prefix caching stores a Mamba state at the same kind of junction;
SGLang's MambaRadixCache keeps one state per radix-tree node). Attention-only engines cache KV by block;
here every entry is a complete state and is found at token granularity.

Lookup (as vLLM's automatic prefix caching hashes blocks): a prompt is cut into ``block_tokens`` blocks with
chained hashes (hash of the previous block's hash and the block's token ids), and an entry of length L is
keyed by the chain hash of its ``L // block_tokens`` full blocks plus the tuple of its remaining tail
tokens. :meth:`PrefixCache.lookup` walks the prompt's chain from its last full block back to the root and,
under each block hash, tries the stored tail lengths longest first; the first match is the longest cached
prefix. A match is confirmed on the token ids themselves, so a hash collision can never restore a wrong state.

Memory is bounded by ``max_bytes`` (the tensors of every entry). Eviction is LRU with two classes (segmented
LRU, Karedla, Love and Wherry 1994): *speculative* entries (prompt ends that no later request has used yet)
go before *shared* ones (junctions, which at least two prompts have in common, and any entry that served a
hit). A new speculative entry may evict only speculative ones; if that does not free enough room it is not
stored, so a stream of unique prompts never pushes out the prefix they all share.

When it is exact (:func:`prefix_cache_off_reason`, the one owner of the on / off decision): a restored state
is bit for bit the state the prefill left there, but a cache hit, or a prefill cut at a save point, changes
where the prefill's forwards start and end. In float32 compute with a float32 SSM state that moves results by
float32 rounding only, and the tokens and acceptance statistics equal a run without the cache
(tests/test_prefix_cache.py). In 16-bit compute (bfloat16 / float16) the tokens and the acceptance depend on
where a prefill is cut (seen on the H200: the same tokens, 73 vs 74 accepted drafts), as they do with the
cache off and another ``prefill_chunk_tokens``; a 16-bit SSM state is rounded where a prefill stops. So the
cache is on only in float32 compute with a float32 SSM state, and off with a reason everywhere else; also off
with stochastic rounding (the rounding bits follow the number of forwards).

Tensor parallelism (runners.engine.launch): every rank keeps its own cache of its own heads' states, and the
ranks' caches stay in lockstep, so every rank hits, saves, evicts and cuts its prefill at the same positions
and the ranks' all-reduces pair up: each decision here is a function of the token ids, the entry sizes (the
same on every rank: the ranks' shards are equal) and ``max_bytes``; the engine makes ``max_bytes`` the same
on every rank (the smallest rank's memory cap, ``Engine.from_pretrained``), and :meth:`split_admission`,
which records the deferred prompts, runs on every rank (inside ``ModelRunner.prefill``, a lockstep command).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runners.engine.cache import HybridCache

if TYPE_CHECKING:
    from runners.engine.options import EngineOptions

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 64
DEFAULT_PREFIX_CACHE_BYTES = 512 * 2**20
RECENT_PROMPTS = 64  # prompts of earlier admissions a new prompt is compared with for junctions
_ROOT_HASH = hash("hybrid-mtp-eval prefix cache")


def prefix_cache_off_reason(options: EngineOptions, *, ssm_state_dtype: str | None = None) -> str | None:
    """Whether an engine with ``options`` keeps a prefix cache: None when it does, else why not, naming the
    run.py setting (results.json's ``prefix_cache.off_reason``). The one owner of this decision: the engine
    asks it, and the application reports what the engine decided.

    Off when asked (``prefix_cache`` false, ``prefix_cache_bytes`` 0), with stochastic rounding, and where it
    would not be exact (module docstring): a 16-bit compute ``dtype`` or a 16-bit SSM state
    (``ssm_state_dtype``: the resolved one when ``options.ssm_state_dtype`` is None, the checkpoint's).
    """
    state = options.ssm_state_dtype or ssm_state_dtype or "float32"
    if not options.prefix_cache:
        return "runtime.prefix_cache=false"
    if options.prefix_cache_bytes == 0:
        return "runtime.prefix_cache_bytes=0: no room for any entry"
    if options.ssm_stochastic_rounding:
        return ("model.ssm.stochastic_rounding=true: the rounding bits depend on the number of forwards, "
                "which a cache hit changes (not exact)")
    if options.dtype != "float32":
        return (f"runtime.dtype={options.dtype}: in 16-bit compute the tokens and acceptance depend on where "
                "a prefill is cut, and a cache hit cuts it where prompts diverge (not exact); run with "
                "runtime.dtype=float32 to use the prefix cache")
    if state != "float32":
        return (f"model.ssm.state_dtype={state}: a 16-bit SSM state is rounded where a prefill stops, and a "
                "cache hit stops it where prompts diverge (not exact); set model.ssm.state_dtype=float32 to "
                "use the prefix cache")
    return None


def chain_hashes(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``: [root, h_1, .., h_m] with m = len // block_tokens
    and h_i = hash((h_{i-1}, tokens of block i)); h_i identifies the prefix ``tokens[: i * block_tokens]``."""
    out = [_ROOT_HASH]
    for i in range(len(tokens) // block_tokens):
        out.append(hash((out[-1], tuple(tokens[i * block_tokens : (i + 1) * block_tokens]))))
    return out


@dataclass
class PrefixEntry:
    """The per-slot state after the prefix ``tokens`` (L = len(tokens) >= 1).

    states: ``{cache_index: {field: tensor}}``, clones of the slot's rows of every layer state: the
        committed buffers of recurrent layers (a row each), the KV of attention layers (positions [0, L) of
        the target's, [0, L - 1) of the MTP module's).
    hidden: [D] the target's hidden state at position L - 1 after the final norm, model dtype.
    shared: True for junctions and entries that served a hit (the second eviction class).
    """

    tokens: tuple[int, ...]
    states: dict[int, dict[str, torch.Tensor]]
    hidden: torch.Tensor
    shared: bool = False
    hits: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self):
        tensors = [t for s in self.states.values() for t in s.values()] + [self.hidden]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)


def _row_fields(layer) -> list[str]:
    """Tensor fields of a layer state that hold per-slot committed state (first dim = cache rows), i.e. every
    tensor field but the speculative scratch buffers (``spec_buffers``) and per-layer scalars (an FP8 KV
    cache's 0-dim ``k_scale`` / ``v_scale``, the same for every slot)."""
    names = []
    for f in dataclasses.fields(layer):
        if f.name in layer.spec_buffers:
            continue
        t = getattr(layer, f.name)
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            names.append(f.name)
    return names


class PrefixCache:
    """Bounded, exact prefix cache of per-slot engine state (see the module docstring).

    Args:
        max_bytes: upper bound of the bytes all entries' tensors take (default 512 MiB); an entry larger than
            this is never stored. 0 stores nothing (lookups then always miss).
        block_tokens: block size of the chained hashes (default 64); also the least number of tokens a
            junction must add to the longest cached prefix of its prompt to be saved.

    Counters (cumulative; the engine reports their increase per ``generate`` call): ``stores``, ``evictions``.
    The engine calls :meth:`configure` once with its cache layout before the first use.

    Raises:
        ValueError: max_bytes < 0 or block_tokens < 1.
    """

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        if max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes={max_bytes} must be >= 0 (0 stores nothing)")
        if block_tokens < 1:
            raise ValueError(f"prefix cache block_tokens={block_tokens} must be >= 1")
        self.max_bytes, self.block_tokens = int(max_bytes), int(block_tokens)
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], PrefixEntry] = OrderedDict()  # LRU first
        self._tails: dict[int, Counter[int]] = {}  # block chain hash -> {tail length: entries}
        self._recent: deque[tuple[tuple[int, ...], list[int]]] = deque(maxlen=RECENT_PROMPTS)
        self.nbytes = 0
        self.stores = 0
        self.evictions = 0
        self._mtp_kv: frozenset[int] = frozenset()

    def configure(self, mtp_cache_indices: Iterable[int]) -> None:
        """Name the cache indices of the MTP module's attention layers (their KV lags the target's by one
        position, see the module docstring)."""
        self._mtp_kv = frozenset(mtp_cache_indices)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._entries.clear()
        self._tails.clear()
        self._recent.clear()
        self.nbytes = 0

    # ------------------------------------------------------------------ lookup

    def _key(self, tokens: Sequence[int], hashes: list[int] | None = None) -> tuple[int, tuple[int, ...]]:
        f = len(tokens) // self.block_tokens
        h = hashes[f] if hashes is not None else chain_hashes(tokens[: f * self.block_tokens],
                                                              self.block_tokens)[-1]
        return h, tuple(tokens[f * self.block_tokens :])

    def lookup(self, tokens: Sequence[int]) -> PrefixEntry | None:
        """The entry of the longest cached prefix of ``tokens`` (possibly all of them), or None. A hit moves
        the entry to the most recently used end and marks it shared."""
        found = self._find(tokens)
        if found is None:
            return None
        key, entry = found
        self._entries.move_to_end(key)
        entry.shared, entry.hits = True, entry.hits + 1
        return entry

    def _find(self, tokens: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]], PrefixEntry] | None:
        """(key, entry) of the longest stored prefix of ``tokens``, or None; changes nothing."""
        B = self.block_tokens
        hashes = chain_hashes(tokens, B)
        for f in range(len(hashes) - 1, -1, -1):
            for t in sorted(self._tails.get(hashes[f], ()), reverse=True):
                L = f * B + t
                if L == 0 or L > len(tokens):
                    continue
                key = (hashes[f], tuple(tokens[f * B : L]))
                entry = self._entries.get(key)
                if entry is not None and entry.tokens == tuple(tokens[:L]):  # collision-proof
                    return key, entry
        return None

    def contains(self, tokens: Sequence[int]) -> bool:
        """Whether an entry for exactly ``tokens`` is stored (no LRU update)."""
        entry = self._entries.get(self._key(tokens))
        return entry is not None and entry.tokens == tuple(tokens)

    # ------------------------------------------------------------------ who is admitted together

    def split_admission(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
        """Split the prompts about to be admitted together into those to prefill now and those to defer to
        the next admission, so that prompts sharing a long uncached prefix prefill it once.

        Prompts admitted together cannot reuse each other's prefix (every one is prefilled from what the
        cache held before the admission). Prompt j is deferred when an earlier prompt i taken now shares
        with it a prefix of at least ``block_tokens`` tokens that is not stored yet; the deferred prompts
        are remembered as upcoming (:meth:`save_points` then saves that junction while prompt i prefills),
        so their own admission, right after this one, restores it. lm-eval's fixed-exemplar tasks
        (gsm8k_cot: every prompt opens with the same eight worked examples) are the case this is for;
        prompts with short common prefixes are never deferred. The first prompt is always taken.

        Args:
            prompts: the candidates' token ids, in admission order.

        Returns:
            (take, defer): indices into ``prompts``, each in order; ``take`` is never empty when prompts is
            not.
        """
        B = self.block_tokens
        hashes = [chain_hashes(p, B) for p in prompts]
        take: list[int] = []
        defer: list[int] = []
        for j, p in enumerate(prompts):
            shared = max((self._lcp(p, hashes[j], prompts[i], hashes[i]) for i in take), default=0)
            if shared >= B and not self.contains(p[:shared]) and self._stored_length(p) + B <= shared:
                defer.append(j)
            else:
                take.append(j)
        self._recent.extend((tuple(prompts[j]), hashes[j]) for j in defer)
        return take, defer

    def _stored_length(self, tokens: Sequence[int]) -> int:
        """Length of the longest stored prefix of ``tokens`` (0: none), without the LRU update of a lookup."""
        found = self._find(tokens)
        return 0 if found is None else len(found[1].tokens)

    # ------------------------------------------------------------------ where a prefill should stop

    def _lcp(self, a: Sequence[int], ha: list[int], b: Sequence[int], hb: list[int]) -> int:
        """Length of the common prefix of a and b (their chain hashes ha, hb narrow it to one block)."""
        f = 0
        while f + 1 < len(ha) and f + 1 < len(hb) and ha[f + 1] == hb[f + 1]:
            f += 1
        n = f * self.block_tokens
        for x, y in zip(a[n : n + self.block_tokens], b[n : n + self.block_tokens]):
            if x != y:
                break
            n += 1
        return n

    def save_points(self, prompts: Sequence[Sequence[int]], cached: Sequence[int]) -> list[dict[int, bool]]:
        """Where the prefill of newly admitted ``prompts`` should save entries: per prompt ``{position:
        shared}`` with positions in (cached[j], len(prompt j)].

        The prompt's end is always a save point (speculative: only a repeat or an extension of the prompt
        reuses it), unless it is already stored. A junction -- the longest prefix the prompt shares with
        another of ``prompts`` or with one of the last :data:`RECENT_PROMPTS` admitted -- is a shared save
        point when it adds at least ``block_tokens`` tokens to ``cached[j]`` (the prompt's cache hit) and is
        not stored yet. Records ``prompts`` as the most recent ones.
        """
        hashes = [chain_hashes(p, self.block_tokens) for p in prompts]
        out: list[dict[int, bool]] = []
        for j, p in enumerate(prompts):
            points: dict[int, bool] = {}
            if cached[j] < len(p) and not self.contains(p):
                points[len(p)] = False
            others = [(q, hashes[i]) for i, q in enumerate(prompts) if i != j] + list(self._recent)
            junction = max((self._lcp(p, hashes[j], q, hq) for q, hq in others), default=0)
            if cached[j] + self.block_tokens <= junction < len(p) and not self.contains(p[:junction]):
                points[junction] = True
            out.append(points)
        self._recent.extend((tuple(p), h) for p, h in zip(prompts, hashes))
        return out

    # ------------------------------------------------------------------ save / restore slot state

    def save(
        self, cache: HybridCache, slot: int, tokens: Sequence[int], hidden: torch.Tensor, shared: bool
    ) -> bool:
        """Store the state of cache row ``slot`` after the prefix ``tokens`` (the prefill has just reached
        position len(tokens) in that slot) with the target hidden [D] at its last position. Returns whether
        it was stored (False: already stored, too large, or no room without evicting what ``shared`` may not
        evict)."""
        L = len(tokens)
        if L == 0 or self.contains(tokens):
            return False
        states: dict[int, dict[str, torch.Tensor]] = {}
        for idx, layer in cache.layers.items():
            rows = {}
            for name in _row_fields(layer):
                t = getattr(layer, name)
                if layer.positional:  # a KV cache: only the prefix's positions
                    t = t[slot, : L - 1 if idx in self._mtp_kv else L]
                else:
                    t = t[slot]
                rows[name] = t.clone()
            states[idx] = rows
        entry = PrefixEntry(tuple(tokens), states, hidden.detach().clone(), shared=shared)
        if not self._make_room(entry.nbytes, shared):
            return False
        key = self._key(tokens)
        self._entries[key] = entry
        self._tails.setdefault(key[0], Counter())[len(key[1])] += 1
        self.nbytes += entry.nbytes
        self.stores += 1
        return True

    def restore(self, cache: HybridCache, slot: int, entry: PrefixEntry) -> None:
        """Copy ``entry``'s state into cache row ``slot`` (reset beforehand by the engine: the replay
        bookkeeping at PNAT = 0, so the restored committed state is what the next forward reads)."""
        for idx, rows in entry.states.items():
            layer = cache.layers[idx]
            for name, saved in rows.items():
                t = getattr(layer, name)
                if layer.positional:
                    t[slot, : saved.shape[0]] = saved
                else:
                    t[slot] = saved

    # ------------------------------------------------------------------ eviction

    def _make_room(self, nbytes: int, shared: bool) -> bool:
        """Evict (speculative entries first, LRU; shared ones only for a shared newcomer) until ``nbytes``
        more fit in ``max_bytes``; evicts nothing and returns False when that is impossible."""
        if nbytes > self.max_bytes:
            return False
        need = self.nbytes + nbytes - self.max_bytes
        if need <= 0:
            return True
        classes = (False, True) if shared else (False,)
        victims, freed = [], 0
        for cls in classes:
            for key, e in self._entries.items():
                if freed >= need:
                    break
                if e.shared == cls:
                    victims.append(key)
                    freed += e.nbytes
        if freed < need:
            return False
        for key in victims:
            self._evict(key)
        return True

    def _evict(self, key: tuple[int, tuple[int, ...]]) -> None:
        entry = self._entries.pop(key)
        tails = self._tails[key[0]]
        tails[len(key[1])] -= 1
        if tails[len(key[1])] == 0:
            del tails[len(key[1])]
            if not tails:
                del self._tails[key[0]]
        self.nbytes -= entry.nbytes
        self.evictions += 1
