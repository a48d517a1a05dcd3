"""Generation statistics: the counters of one ``Engine.generate`` call, kept as raw sums, and the one
definition of acceptance rate, acceptance length and per-position acceptance (TensorRT-LLM's definitions).

Torch-free on purpose: evals (results.json, GSM8K scoring) import it without importing the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counters of one ``generate`` call, kept as raw sums so runs can be merged (``a + b``). Seconds are
    wall time: ``prefill_seconds`` of the admissions' prefills, ``decode_seconds`` of the decode loop (the
    steps and the host's bookkeeping of their tokens: appends, stop checks, callbacks, which overlap the
    next step's device work when steps run ahead); ``steps`` counts decode steps.

    Speculative decoding (MTP, draft length K) adds, per (request, verify step) pair -- a *request-step*:
    ``request_steps`` counts them; ``drafted_tokens`` = K per request-step; ``accepted_drafts`` sums the
    accepted draft tokens; ``accepted_per_position`` [K] counts request-steps whose draft i (1..K) was
    accepted; ``num_accepted_hist`` [K + 2] counts request-steps by num_accepted_tokens (index 0 stays 0).
    These stay zero / empty without speculation.

    Prefix caching (:mod:`runners.engine.prefix_cache`; zero when it is off), per request:
    ``prefix_cache_queries``
    counts requests looked up, ``prefix_cache_query_tokens`` their prompt tokens, ``prefix_cache_hits`` the
    requests that reused a cached prefix and ``prefix_cache_hit_tokens`` the prompt tokens restored from the
    cache instead of prefilled (the saved prefill tokens); per ``generate`` call (:data:`PER_CALL`):
    ``prefix_cache_stores`` entries saved, ``prefix_cache_evictions`` entries evicted.

    Only what reaches the output counts. A request-step commits num_accepted_tokens = n tokens to the output
    (the accepted drafts and the bonus token, n - 1 accepted drafts); when the request finishes inside the
    step (a stop token, a stop string, max_new_tokens), only the j <= n tokens appended before the stop are
    committed, and the step counts as num_accepted_tokens = j (j - 1 accepted drafts). So for every request
    (and summed over requests, with one prefill token each)::

        generated_tokens == num_requests + request_steps + accepted_drafts

    which is how TensorRT-LLM's benchmark derives its counts from the output
    (tensorrt_llm/bench/dataclasses/reporting.py, StatsKeeper.generate_statistics_summary: accepted drafts
    = output tokens - iterations, iterations counting the context step; acceptance length = output tokens /
    iterations). The step that emits the first token (the prefill) drafts nothing and is no request-step.

    Derived metrics (None without drafts), in :meth:`to_dict` next to the sums: ``acceptance_rate`` =
    accepted_drafts / drafted_tokens; ``acceptance_length`` = 1 + accepted_drafts / request_steps (tokens per
    request-step; TensorRT-LLM's benchmark divides by iterations including the context step instead:
    generated_tokens / (request_steps + num_requests)); ``acceptance_per_position`` [K] =
    accepted_per_position / request_steps.
    """

    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_accepted_hist: list[int] = field(default_factory=list)
    request_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_stores: int = 0
    prefix_cache_evictions: int = 0
    compile_seconds: float = 0.0  # torch.compile of the decode step during the call (EngineOptions.compile)
    compile_graphs: int = 0  # graphs dynamo compiled for it meanwhile (runners/engine/compile.py)

    DERIVED = ("acceptance_rate", "acceptance_length", "acceptance_per_position", "prefix_cache_hit_rate")
    # fields only a whole generate call has (not per request): evaluation sums them over the calls
    PER_CALL = ("prefill_seconds", "decode_seconds", "steps", "prefix_cache_stores", "prefix_cache_evictions",
                "compile_seconds", "compile_graphs")

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens, or None when nothing was drafted."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens a request advances per verify step: 1 + accepted drafts / request-steps."""
        return 1 + self.accepted_drafts / self.request_steps if self.request_steps else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """[K] fraction of request-steps whose draft i (1..K) was accepted (non-increasing in i)."""
        if not self.request_steps:
            return [0.0] * len(self.accepted_per_position)
        return [a / self.request_steps for a in self.accepted_per_position]

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens restored from the prefix cache / prompt tokens looked up (vLLM's prefix cache hit
        rate), or None when nothing was looked up."""
        if not self.prefix_cache_query_tokens:
            return None
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens

    def prefix_cache(self) -> dict:
        """The prefix-cache statistics of results.json (docs/results_schema.md): ``queries``,
        ``query_tokens``, ``hits``, ``hit_tokens``, ``hit_rate`` (None without queries),
        ``saved_prefill_tokens`` (= hit_tokens: a restored token is never prefilled), ``stores``,
        ``evictions``."""
        return {
            "queries": self.prefix_cache_queries,
            "query_tokens": self.prefix_cache_query_tokens,
            "hits": self.prefix_cache_hits,
            "hit_tokens": self.prefix_cache_hit_tokens,
            "hit_rate": self.prefix_cache_hit_rate,
            "saved_prefill_tokens": self.prefix_cache_hit_tokens,
            "stores": self.prefix_cache_stores,
            "evictions": self.prefix_cache_evictions,
        }

    def record_step(self, accepted_drafts: Sequence[int], draft_len: int) -> None:
        """Count one verify step: ``accepted_drafts`` [B] accepted drafts per request, each in [0, K]."""
        if not self.num_accepted_hist:
            self.accepted_per_position, self.num_accepted_hist = [0] * draft_len, [0] * (draft_len + 2)
        if len(self.accepted_per_position) != draft_len:
            have = len(self.accepted_per_position)
            raise ValueError(f"draft_len={draft_len}, but these stats count K={have} positions")
        if any(not 0 <= a <= draft_len for a in accepted_drafts):
            raise ValueError(f"accepted drafts {list(accepted_drafts)} must lie in [0, K={draft_len}]")
        self.request_steps += len(accepted_drafts)
        self.drafted_tokens += draft_len * len(accepted_drafts)
        for a in accepted_drafts:
            self.accepted_drafts += a
            self.num_accepted_hist[a + 1] += 1
            for i in range(a):
                self.accepted_per_position[i] += 1

    def acceptance(self) -> dict:
        """The acceptance statistics of results.json (docs/results_schema.md): ``rate``, ``length``,
        ``per_position`` (the derived metrics; rate and length None without drafts) and the raw sums behind
        them, ``drafted``, ``accepted``, ``request_steps``, ``accepted_per_position``,
        ``num_accepted_hist``."""
        return {
            "rate": self.acceptance_rate,
            "length": self.acceptance_length,
            "per_position": self.acceptance_per_position,
            "drafted": self.drafted_tokens,
            "accepted": self.accepted_drafts,
            "request_steps": self.request_steps,
            "accepted_per_position": list(self.accepted_per_position),
            "num_accepted_hist": list(self.num_accepted_hist),
        }

    def to_dict(self) -> dict:
        """The raw sums (the dataclass fields) plus the derived metrics of :data:`DERIVED`."""
        d = asdict(self)
        d.update((k, getattr(self, k)) for k in self.DERIVED)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> GenerationStats:
        """Inverse of :meth:`to_dict`: derived keys are recomputed, not read; unknown keys raise TypeError."""
        return cls(**{k: v for k, v in d.items() if k not in cls.DERIVED})

    def __add__(self, other: GenerationStats) -> GenerationStats:
        """Element-wise sum of two runs' counters (lists padded to the longer: runs of different K)."""

        def add(a, b):
            if isinstance(a, list):
                n = max(len(a), len(b))
                return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]
            return a + b

        return GenerationStats(**{k: add(v, getattr(other, k)) for k, v in asdict(self).items()})
