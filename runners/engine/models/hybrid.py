"""The family-agnostic hybrid decoder: embedding -> residual blocks -> final norm -> LM head (+ MTP module).

Every block is ``x + mixer(norm(x))`` with a mixer chosen by kind from ``runners.engine.models.kinds.MIXERS``
(a later family registers more kinds there). Blocks that keep per-request state (``mamba2``, ``gdn``,
``attention``: their mixer declares a ``state_class``) get a
``cache_index`` that addresses their entry in :class:`runners.engine.cache.HybridCache`; the MTP module's
blocks
take indices after the backbone's, so one cache object serves target and draft. The model knows nothing of
checkpoint names (see ``runners/engine/models/<model_type>.py``) or of the generate loop
(``runners/engine/engine.py``).

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

from kernels.health import flag_nonfinite, residual_add
from runners.engine.compile import compiled_block_call, eager_block_call
from runners.engine.models.config import HybridConfig
from runners.engine.models.kinds import build_mixer, stateful
from runners.engine.models.layers import RMSNorm, use_inference_kernel
from runners.engine.onednn import MIN_ROWS
from runners.engine.state import BatchMeta

if TYPE_CHECKING:  # type hints only (the cache allocates from the kinds this module builds)
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
        launch for both; the eager inference step's health path, :meth:`HybridLM.forward`)."""
        h = self.norm(x)
        if self.cache_index is None:
            y = self.mixer(h)
        else:
            y = self.mixer(h, None if cache is None else cache[self.cache_index], meta)
        if flag is None or y.shape != x.shape or y.dtype != x.dtype:
            out = x + y
            if flag is not None:
                flag_nonfinite(out, *flag)
            return out
        return residual_add(x, y, *flag)


def _build_blocks(config: HybridConfig, kinds: tuple[str, ...], first_cache_index: int) -> nn.ModuleList:
    blocks, idx = [], first_cache_index
    for kind in kinds:
        keeps = stateful(kind)
        blocks.append(Block(config, kind, idx if keeps else None))
        idx += keeps
    return nn.ModuleList(blocks)


# rows each kept position runs as in MTPModule.forward(keep=...): every GEMM (and each routed expert's group)
# then has at least MIN_ROWS rows, from which a row's result does not depend on the row count
KEEP_ROWS = MIN_ROWS


class MTPModule(nn.Module):
    """Multi-token-prediction draft module (NemotronH / DeepSeek-V3 style); shares embedding and LM head.

    One draft step: ``f = eh_proj(cat[enorm(embed(tok)), hnorm(h_prev)])``, then the residual ``blocks``
    (NemotronH: attention, then MoE), then ``final_norm``; the result feeds the LM head and the next step.
    """

    def __init__(self, config: HybridConfig, first_cache_index: int):
        super().__init__()
        D = config.hidden_size
        self.enorm = RMSNorm(D, config.norm_eps, config.norm_weight_offset)
        self.hnorm = RMSNorm(D, config.norm_eps, config.norm_weight_offset)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.blocks = _build_blocks(config, config.mtp_layer_types, first_cache_index)
        self.final_norm = RMSNorm(D, config.norm_eps, config.norm_weight_offset)
        self.nonfinite: torch.Tensor | None = None  # the model's flags, shared (HybridLM.track_nonfinite)
        self.block_call = eager_block_call  # HybridLM.compiled_blocks swaps in the compiled call

    def forward(
        self,
        token_embeds: torch.Tensor,
        h_prev: torch.Tensor,
        cache: HybridCache | None = None,
        meta: BatchMeta | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """token_embeds, h_prev: [B, T, D] -> draft hidden [B, T, D] (after ``final_norm``).

        ``keep`` (int64 [n], flat indices into the B x T positions): only these positions' outputs are wanted,
        as in a prefill, which needs every position's KV entries but the draft of the last. The blocks
        after the last one that writes a cache (NemotronH: the MoE) then run on the kept positions alone,
        each taken :data:`KEEP_ROWS` times, and the result is [n, D]. On the CPU in float32 a GEMM gives a
        row the same bits whatever the row count from 4 rows on (what the oneDNN linears are checked
        against, runners.engine.onednn.MIN_ROWS), so the kept outputs equal the full forward's bit for bit;
        elsewhere the kernels chosen depend on the row count, and callers pass None. When every kept
        position is the last column of its row and that block is an attention block, its attention runs for
        the last :data:`KEEP_ROWS` columns only (``Attention.forward(last_rows=...)``, which writes every
        column's KV entries; the full block where that does not apply)."""
        f = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(h_prev)], dim=-1))
        tail = len(self.blocks)
        if keep is not None:  # the blocks from `tail` on write no cache
            tail = 1 + max((i for i, b in enumerate(self.blocks) if b.cache_index is not None), default=-1)
        last = self.blocks[tail - 1] if keep is not None and tail else None
        T = f.shape[1]
        if last is None or last.kind != "attention" or not bool(((keep + 1) % T == 0).all()):
            last = None
        for block in self.blocks[:tail - 1 if last is not None else tail]:
            f = self.block_call(block, f, cache, meta)
        if last is not None:  # kept: last columns only; their attention alone, every column's KV written
            # (through the module call: its hooks, e.g. tensor parallelism's all-reduce, see the rows)
            y = last.mixer(last.norm(f), cache[last.cache_index], meta, last_rows=KEEP_ROWS)
            if y.shape[1] == T:  # declined: every column (as the block would compute it)
                f = f + y
            else:
                f = f[:, T - KEEP_ROWS:] + y  # the block's residual add at those columns
                keep = keep // T * KEEP_ROWS + KEEP_ROWS - 1
        if keep is not None:
            f = f.reshape(-1, f.shape[-1])[keep].repeat_interleave(KEEP_ROWS, dim=0)[:, None]  # [n R, 1, D]
            for block in self.blocks[tail:] if len(keep) else ():
                f = self.block_call(block, f, None, None)
            f = f[::KEEP_ROWS, 0]
        out = self.final_norm(f)
        if self.nonfinite is not None:  # the model's flags (HybridLM.track_nonfinite); "mtp" is the last
            if use_inference_kernel(out):
                flag_nonfinite(out, self.nonfinite, -1)
            else:
                self.nonfinite[-1] |= ~torch.isfinite(_abs_peak(out))
        return out


def _abs_peak(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim tensor in x's dtype (0 for an empty x): finite exactly when every value of x is (a
    NaN propagates through the max reduction, an infinity is its own peak, and a max of finite values cannot
    overflow). Cheaper than ``isfinite(x).all()``, and the forward tests the stacked peaks of all its layers
    at once. ``abs().amax()``, not ``linalg.vector_norm(x, inf)`` (the same value): on the CPU the norm's
    reduction is about 20x slower."""
    if x.numel() == 0:
        return x.new_zeros(())
    return x.abs().amax()


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
        self.layers = _build_blocks(config, config.layer_types, 0)
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
        forward then runs one max |x| reduction per flagged output (``_abs_peak``; a block's inside its block
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
            flag_nonfinite(x, self.nonfinite, 0)
            for i, block in enumerate(self.layers):
                x = block(x, cache, meta, flag=(self.nonfinite, i + 1))
            x = self.norm_f(x)
            flag_nonfinite(x, self.nonfinite, len(self.layers) + 1)
            return x
        peaks = [_abs_peak(x)] if track else []
        for block in self.layers:
            if track:  # the block's peak inside its (compiled) call: fused into the block's last kernels
                x, peak = self.block_call(block, x, cache, meta, peak=_abs_peak)
                peaks.append(peak)
            else:
                x = self.block_call(block, x, cache, meta)
        x = self.norm_f(x)
        if track:
            peaks.append(_abs_peak(x))
            self._flag(slice(0, len(peaks)), torch.isfinite(torch.stack(peaks)))
        return x

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V]."""
        logits = self.lm_head(hidden).float()
        if self.nonfinite is not None:
            if use_inference_kernel(logits):
                flag_nonfinite(logits, self.nonfinite, len(self.layers) + 2)
            else:
                self._flag(len(self.layers) + 2, torch.isfinite(_abs_peak(logits)))
        return logits
