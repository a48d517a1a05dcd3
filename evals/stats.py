"""What evals reads of the engine's generation statistics: a small protocol; evals imports no runners.

The application passes the engine's statistics type (runners.engine.stats.GenerationStats satisfies
`GenerationCounters`); evals adds up the per-request and per-call counter dicts with it and reads the derived
metrics (acceptance rate / length / per position, prefix-cache hit rate) from it, so they keep one
definition. Torch-free.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol


class GenerationCounters(Protocol):
    """Counters of generate calls kept as raw sums (a no-argument constructor gives zeros).

    PER_CALL: the fields only a whole generate call has (seconds, batch steps, cache stores / evictions).
    from_dict(d): the counters of a `to_dict()` dict (derived keys ignored; an unknown key raises TypeError).
    a + b: element-wise sums (lists padded to the longer).
    to_dict(): the raw sums plus the derived metrics (plain JSON data).
    acceptance() / prefix_cache(): results.json's `acceptance` / `prefix_cache` statistics
        (docs/results_schema.md).
    """

    PER_CALL: ClassVar[tuple[str, ...]]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationCounters: ...

    def __add__(self, other: GenerationCounters) -> GenerationCounters: ...

    def to_dict(self) -> dict[str, Any]: ...

    def acceptance(self) -> dict[str, Any]: ...

    def prefix_cache(self) -> dict[str, Any]: ...


def counters_of(stats: dict[str, Any], counters: type[GenerationCounters]) -> GenerationCounters:
    """The counters of a generation-stats dict that may hold other keys too (results.json's `generation`
    section: the counters' to_dict() plus the evaluation's timing keys): only the counters' own keys are
    read."""
    names = set(counters().to_dict())
    return counters.from_dict({k: v for k, v in stats.items() if k in names})
