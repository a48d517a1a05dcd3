"""The residual block of the hybrid decoders, ``x + mixer(norm(x))`` with a mixer of one kind
(``runners.engine.models.kinds.MIXERS``): what the backbone (``runners.engine.models.hybrid.HybridLM``) and
the MTP module (``runners.engine.models.mtp.MTPModule``) are built of, with the numbering of their cache
indices; and the max |x| reduction of the health flags' reference path (:func:`abs_peak`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.health import flag_nonfinite, residual_add
from runners.engine.models.config import HybridConfig
from runners.engine.models.kinds import build_mixer, stateful
from runners.engine.models.layers import RMSNorm, consumer_quant_scale, use_inference_kernel
from runners.engine.state import BatchMeta

if TYPE_CHECKING:  # type hints only (the cache allocates from the kinds the blocks are built of)
    from runners.engine.cache import HybridCache


class Block(nn.Module):
    """One residual block: ``x + mixer(norm(x))``. ``cache_index`` is None for stateless kinds."""

    def __init__(self, config: HybridConfig, kind: str, cache_index: int | None):
        super().__init__()
        self.kind, self.cache_index = kind, cache_index
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, config.norm_weight_offset)
        self.mixer = build_mixer(kind, config)

    def forward(self, x: torch.Tensor, cache: HybridCache | None, meta: BatchMeta | None,
                flag: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """x [B, T, D] -> x + mixer(norm(x)). ``flag`` (flags, index): the residual add also sets
        ``flags[index]`` where its output holds a NaN or an infinity (``kernels.health.residual_add``, one
        launch for both; the eager inference step's health path,
        ``runners.engine.models.hybrid.HybridLM.forward``)."""
        h, kw = self._normed(x)
        if self.cache_index is None:
            y = self.mixer(h, **kw)
        else:
            y = self.mixer(h, None if cache is None else cache[self.cache_index], meta, **kw)
        if flag is None or y.shape != x.shape or y.dtype != x.dtype:
            out = x + y
            if flag is not None:
                flag_nonfinite(out, *flag)
            return out
        return residual_add(x, y, *flag)

    def _normed(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(norm(x), the mixer's extra arguments): where the kernels run and the mixer's
        ``input_linear()`` is an FP8 linear that asks for its input's codes (layers.consumer_quant_scale),
        the norm's launch writes them and the mixer gets them as ``xq`` (no quantization launch of its
        own)."""
        ask = getattr(self.mixer, "input_linear", None)
        lin = ask() if ask is not None and use_inference_kernel(x) else None
        scale = None if lin is None else consumer_quant_scale(lin, x)
        if scale is None:
            return self.norm(x), {}
        h, q = self.norm(x, quant_scale=scale)
        return h, {"xq": q}


def build_blocks(config: HybridConfig, kinds: tuple[str, ...], first_cache_index: int) -> nn.ModuleList:
    """One :class:`Block` per kind of ``kinds``, in order; the stateful ones get consecutive cache indices
    from ``first_cache_index``."""
    blocks, idx = [], first_cache_index
    for kind in kinds:
        keeps = stateful(kind)
        blocks.append(Block(config, kind, idx if keeps else None))
        idx += keeps
    return nn.ModuleList(blocks)


def abs_peak(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim tensor in x's dtype (0 for an empty x): finite exactly when every value of x is (a
    NaN propagates through the max reduction, an infinity is its own peak, and a max of finite values cannot
    overflow). Cheaper than ``isfinite(x).all()``, and ``HybridLM.forward`` tests the stacked peaks of all
    its layers at once. ``abs().amax()``, not ``linalg.vector_norm(x, inf)`` (the same value): on the CPU
    the norm's reduction is about 20x slower."""
    if x.numel() == 0:
        return x.new_zeros(())
    return x.abs().amax()
