"""What one tensor-parallel rank reads of a checkpoint tensor: the rule types each block kind's
``shard_rules`` returns (``runners/engine/models/kinds.py``), applied by ``runners.engine.tp.shard_plan``.

A rule is a :class:`Shard` (a rank's index ranges along one dim), :class:`FirstRankOnly` (a row-parallel
bias: whole on rank 0, zeros elsewhere, so the all-reduce adds it once) or None (replicated, read whole).
W is the world size, r this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shard:
    """A rank's part of a checkpoint tensor: along ``dim``, the concatenation of the index ``ranges``
    (half-open ``(start, stop)`` pairs, in order; several when the tensor stacks parts, e.g. mamba's
    in_proj [z | x | B | C | dt])."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shard's shape, given the full tensor's."""
        out = list(full)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)

    def read(self, sl: Any) -> torch.Tensor:
        """Read the shard from a safetensors slice (``safe_open(...).get_slice(name)``): only these ranges
        are read from the memory-mapped file."""
        lead = (slice(None),) * self.dim
        parts = [sl[lead + (slice(a, b),)] for a, b in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class FirstRankOnly:
    """A row-parallel bias: rank 0 reads it whole, every other rank holds zeros (the all-reduce adds it once).
    """

    rank: int

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(full)

    def read(self, sl: Any) -> torch.Tensor:
        return sl[:] if self.rank == 0 else torch.zeros(tuple(sl.get_shape()))


Rule = Shard | FirstRankOnly | None  # None: replicated (read whole)


def part(total: int, W: int, r: int, offset: int = 0) -> tuple[int, int]:
    """Rank r's contiguous share of ``total`` (divisible by W) starting at ``offset``."""
    n = total // W
    return (offset + r * n, offset + (r + 1) * n)
