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
from kernels.norm import add_rms_norm
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
                flag: tuple[torch.Tensor, int] | None = None, defer: bool = False):
        """x [B, T, D] -> x + mixer(norm(x)). ``flag`` (flags, index): the residual add also sets
        ``flags[index]`` where its output holds a NaN or an infinity (``kernels.health.residual_add``, one
        launch for both; the eager inference step's health path,
        ``runners.engine.models.hybrid.HybridLM.forward``).

        With ``defer`` (the eager step's fused pass, :func:`forward_blocks_fused`): x is a two-item list,
        [the residual stream before the previous block's output is added, that output or None for the first
        block], which the block empties (so both are freed once added, not held while its mixer runs); the
        add, with ``flag`` as its flag, and this block's norm run as one launch (kernels.norm.add_rms_norm),
        and the block returns (the sum, its mixer's output), its own add left to the next block."""
        if defer:
            return self._deferred(x, cache, meta, flag)
        scale = self.input_quant_scale(x)
        if scale is None:
            y = self.mix(self.norm(x), cache, meta)
        else:
            h, q = self.norm(x, quant_scale=scale)
            y = self.mix(h, cache, meta, q)
        return _add_flagged(x, y, flag)

    def _deferred(self, holder: list, cache, meta, flag):
        """Block.forward with ``defer``: holder [x, pending] (emptied) -> (x + pending, mixer output)."""
        x, pending = holder
        holder.clear()
        if pending is not None and isinstance(self.norm, RMSNorm) and pending.shape == x.shape \
                and pending.dtype == x.dtype and flag is not None:
            norm, scale = self.norm, self.input_quant_scale(x)
            x, h, *q = add_rms_norm(x, pending, norm.weight, norm.eps, norm.offset, *flag, scale)
        else:
            if pending is not None:
                x = _add_flagged(x, pending, flag)
            scale = self.input_quant_scale(x)
            h, *q = (self.norm(x),) if scale is None else self.norm(x, quant_scale=scale)
        pending = None  # the previous output, added: not held while the mixer runs
        return x, self.mix(h, cache, meta, q[0] if q else None)

    def input_quant_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The static FP8 scale with which this block's norm should also write its output's codes for x [B, T,
        D]: where the kernels run and the mixer's ``input_linear()`` is an FP8 linear that asks for them
        (layers.consumer_quant_scale); None elsewhere. The mixer then gets them as ``xq`` (:meth:`mix`) and
        runs no quantization launch of its own."""
        ask = getattr(self.mixer, "input_linear", None)
        lin = ask() if ask is not None and use_inference_kernel(x) else None
        return None if lin is None else consumer_quant_scale(lin, x)

    def mix(self, h: torch.Tensor, cache: HybridCache | None, meta: BatchMeta | None,
            xq: torch.Tensor | None = None) -> torch.Tensor:
        """The mixer on the normed input h [B, T, D] (its cache entry when stateful); ``xq``: h's codes for
        the mixer's input linear (only where :meth:`input_quant_scale` asked for them)."""
        kw = {} if xq is None else {"xq": xq}
        if self.cache_index is None:
            return self.mixer(h, **kw)
        return self.mixer(h, None if cache is None else cache[self.cache_index], meta, **kw)


def forward_blocks_fused(blocks, x: torch.Tensor, cache: HybridCache | None, meta: BatchMeta | None,
                         flags: torch.Tensor, first_flag: int, final_norm: RMSNorm) -> torch.Tensor:
    """The eager inference step's pass over ``blocks`` (each ``x + mixer(norm(x))``) and ``final_norm``, with
    each block's residual add fused with the next norm (kernels.norm.add_rms_norm: one launch where
    :meth:`Block.forward` runs residual_add, then the next block's rms_norm; the same bits; each block
    called with ``defer``): x [B, T, D] -> final_norm(last block's output). Block i's output sets
    ``flags[first_flag + i]`` where it holds a NaN or an infinity, as Block.forward's ``flag``. The norms also
    write the codes of each mixer's FP8 input linear (:meth:`Block.input_quant_scale`). Updates the cache
    in place as the blocks do; mutates ``flags``."""
    pending = None
    for i, block in enumerate(blocks):
        holder, x, pending = [x, pending], None, None  # the block empties the holder: nothing else holds them
        x, pending = block(holder, cache, meta, flag=(flags, first_flag + i - 1), defer=True)
    if pending is None:
        return final_norm(x)
    flag = (flags, first_flag + len(blocks) - 1)
    if isinstance(final_norm, RMSNorm) and pending.shape == x.shape and pending.dtype == x.dtype:
        _, out = add_rms_norm(x, pending, final_norm.weight, final_norm.eps, final_norm.offset, *flag)
        return out
    return final_norm(_add_flagged(x, pending, flag))


def _add_flagged(x: torch.Tensor, y: torch.Tensor, flag: tuple[torch.Tensor, int] | None) -> torch.Tensor:
    """x + y; with ``flag`` (flags, index), flags[index] set where the sum holds a NaN or an infinity: one
    launch for both (kernels.health.residual_add) where x and y share a shape and dtype, else the add and
    flag_nonfinite."""
    if flag is None or y.shape != x.shape or y.dtype != x.dtype:
        out = x + y
        if flag is not None:
            flag_nonfinite(out, *flag)
        return out
    return residual_add(x, y, *flag)


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
