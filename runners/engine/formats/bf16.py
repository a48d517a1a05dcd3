"""Unquantized weights (the BF16 releases): the models' own ``nn.Linear`` and MoE modules, two bytes a stored
value; nothing to swap, no scales."""

from __future__ import annotations

from registry.hf_config import FORMAT_BF16
from runners.engine.formats import WeightFormat


class BF16Format(WeightFormat):
    name = FORMAT_BF16
    label = "BF16"

    def stored_nbytes(self, n: int, k: int) -> int:
        return 2 * n * k


FORMAT = BF16Format()
