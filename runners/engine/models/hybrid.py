"""The family-agnostic hybrid decoder: embedding -> residual blocks -> final norm -> LM head (+ MTP module).

Every block is ``x + mixer(norm(x))`` (``runners.engine.models.block.Block``) with a mixer chosen by kind from
``runners.engine.models.kinds.MIXERS`` (a later family registers more kinds there). Blocks that keep
per-request state (``mamba2``, ``gdn``, ``attention``: their mixer declares a ``state_class``) get a
``cache_index`` that addresses their entry in :class:`runners.engine.cache.HybridCache`; the MTP module's
blocks (``runners.engine.models.mtp.MTPModule``) take indices after the backbone's, so one cache object
serves target and draft. The model knows nothing of checkpoint names (see
``runners/engine/models/<model_type>.py``) or of the generate loop (``runners/engine/engine.py``).

Health flags: after :meth:`HybridLM.track_nonfinite`, every forward ORs "this module's output holds a NaN or
an infinity" into one device tensor (:attr:`HybridLM.nonfinite`, one entry per name of
:meth:`HybridLM.health_names`), without a host synchronisation; the engine reads it once per ``generate``
call. A NaN propagates to every later layer, so the first flagged name is where it appeared.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.health import flag_nonfinite
from runners.engine.compile import compiled_block_call, eager_block_call
from runners.engine.models.block import abs_peak, build_blocks, forward_blocks_fused
from runners.engine.models.config import HybridConfig
from runners.engine.models.layers import RMSNorm, use_inference_kernel
from runners.engine.models.mtp import MTPModule
from runners.engine.state import BatchMeta

if TYPE_CHECKING:  # type hints only (the cache allocates from the kinds this module builds)
    from runners.engine.cache import HybridCache


class HybridLM(nn.Module):
    """Hybrid decoder LM. ``forward`` returns hidden states after the final norm; ``lm_logits`` maps them.

    Args:
        config: the architecture.
        with_mtp: build the MTP module (its weights must then be loaded); needs
            ``config.num_nextn_predict_layers > 0``.
    """

    def __init__(self, config: HybridConfig, with_mtp: bool = False):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = build_blocks(config, config.layer_types, 0)
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps, config.norm_weight_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight
        n_backbone = sum(b.cache_index is not None for b in self.layers)
        if with_mtp and not config.mtp_layer_types:
            raise ValueError(
                f"{config.source}: with_mtp=True but the config declares no MTP layers "
                "(num_nextn_predict_layers = 0)"
            )
        self.mtp = MTPModule(config, n_backbone) if with_mtp else None
        self.nonfinite: torch.Tensor | None = None  # set by track_nonfinite
        self.block_call = eager_block_call  # how forward runs a block (compiled_blocks swaps it)

    @contextmanager
    def compiled_blocks(self, on: bool = True) -> Iterator[None]:
        """Inside, every residual block of the backbone and the MTP module runs through the one
        torch.compile'd block call (``runners.engine.compile.compiled_block_call``; ``on=False``: eagerly, a
        no-op). The decode step's phases run inside it when ``EngineOptions.compile`` is on."""
        call = compiled_block_call() if on else eager_block_call
        mods = [self] + ([self.mtp] if self.mtp is not None else [])
        saved = [m.block_call for m in mods]
        for m in mods:
            m.block_call = call
        try:
            yield
        finally:
            for m, c in zip(mods, saved):
                m.block_call = c

    def health_names(self) -> list[str]:
        """Names of the outputs the non-finite flags cover, in forward order: ``embeddings``,
        ``layers.<i>.<kind>`` per backbone block, ``norm_f``, ``lm_head`` (logits) and ``mtp`` (the MTP
        module's output, when the model has one)."""
        names = [
            "embeddings",
            *(f"layers.{i}.{b.kind}" for i, b in enumerate(self.layers)),
            "norm_f",
            "lm_head",
        ]
        return names + (["mtp"] if self.mtp is not None else [])

    def track_nonfinite(self, device: torch.device | str) -> None:
        """Start the non-finite flags: a bool tensor [len(health_names())] on ``device``, all False. Each
        forward then runs one max |x| reduction per flagged output (``abs_peak``; a block's inside its block
        call, which the compiled step fuses into the block's kernels) and one ``isfinite`` over them all; in
        the eager inference step (``layers.use_inference_kernel``, blocks not compiled) each block's residual
        add sets its flag itself and the other outputs take one check launch each (kernels/health.py).
        Capturable in a CUDA graph: the flags are updated in place."""
        self.nonfinite = torch.zeros(len(self.health_names()), dtype=torch.bool, device=device)
        if self.mtp is not None:
            self.mtp.nonfinite = self.nonfinite

    def take_nonfinite(self) -> list[str]:
        """The names flagged since the last call, in forward order (one host synchronisation), and reset the
        flags. [] when nothing was flagged or the flags are off."""
        if self.nonfinite is None:
            return []
        flagged = self.nonfinite.nonzero().flatten().tolist()
        self.nonfinite.zero_()
        names = self.health_names()
        return [names[i] for i in flagged]

    def _flag(self, index: int | slice, finite: torch.Tensor) -> None:
        """OR ``~finite`` (bool [n]: per output, "all its values are finite") into the flags at ``index``."""
        self.nonfinite[index] |= ~finite

    def cache_kinds(self, include_mtp: bool = True) -> dict[int, str]:
        """``{cache_index: kind}`` of every stateful block (backbone, then MTP when present and asked)."""
        blocks = list(self.layers) + (list(self.mtp.blocks) if self.mtp is not None and include_mtp else [])
        return {b.cache_index: b.kind for b in blocks if b.cache_index is not None}

    def forward(
        self, input_ids: torch.Tensor, cache: HybridCache | None = None, meta: BatchMeta | None = None
    ) -> torch.Tensor:
        """input_ids [B, T] int64 -> hidden [B, T, D] in the model dtype (after ``norm_f``).

        With ``cache`` and ``meta`` this continues each row's request from its cached state and updates the
        cache in place (see :class:`runners.engine.state.BatchMeta`); without, it is a full causal forward.
        """
        if (cache is None) != (meta is None):
            raise ValueError("pass cache and meta together (or neither for a cache-free forward)")
        x = self.embeddings(input_ids)
        track = self.nonfinite is not None
        if track and self.block_call is eager_block_call and use_inference_kernel(x):
            # the eager inference step: each block's residual add tests its own output (kernels/health.py),
            # no peak reductions; the same flags and names as below
            # (each residual add fused with the next norm: block.forward_blocks_fused)
            flag_nonfinite(x, self.nonfinite, 0)
            x = forward_blocks_fused(self.layers, x, cache, meta, self.nonfinite, 1, self.norm_f)
            flag_nonfinite(x, self.nonfinite, len(self.layers) + 1)
            return x
        peaks = [abs_peak(x)] if track else []
        for block in self.layers:
            if track:  # the block's peak inside its (compiled) call: fused into the block's last kernels
                x, peak = self.block_call(block, x, cache, meta, peak=abs_peak)
                peaks.append(peak)
            else:
                x = self.block_call(block, x, cache, meta)
        x = self.norm_f(x)
        if track:
            peaks.append(abs_peak(x))
            self._flag(slice(0, len(peaks)), torch.isfinite(torch.stack(peaks)))
        return x

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V]."""
        logits = self.lm_head(hidden).float()
        if self.nonfinite is not None:
            if use_inference_kernel(logits):
                flag_nonfinite(logits, self.nonfinite, len(self.layers) + 2)
            else:
                self._flag(len(self.layers) + 2, torch.isfinite(abs_peak(logits)))
        return logits
