"""The MTP kind: the multi-token-prediction draft module (NemotronH / DeepSeek-V3 style, Qwen3-Next's MTP
layer), residual blocks of the backbone's kinds (``runners.engine.models.block``) between the fusion of a
token's embedding with the previous hidden state and a final norm. It keeps no state of its own: its blocks'
cache indices follow the backbone's, so one :class:`runners.engine.cache.HybridCache` serves target and draft
(``runners.engine.models.hybrid.HybridLM`` builds it with ``with_mtp``). Shapes: B batch, T tokens, D hidden.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.health import flag_nonfinite
from runners.engine.compile import eager_block_call
from runners.engine.models.block import abs_peak, build_blocks
from runners.engine.models.config import HybridConfig
from runners.engine.models.layers import RMSNorm, use_inference_kernel
from runners.engine.onednn import MIN_ROWS
from runners.engine.state import BatchMeta

if TYPE_CHECKING:  # type hints only (the cache allocates from the kinds the blocks are built of)
    from runners.engine.cache import HybridCache


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
        self.blocks = build_blocks(config, config.mtp_layer_types, first_cache_index)
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
                self.nonfinite[-1] |= ~torch.isfinite(abs_peak(out))
        return out
