"""The attention kind: causal GQA self-attention (``Attention``, the ``attention`` block's mixer) and its
per-slot state, the by-position KV cache (:class:`KVCache`), with RoPE helpers and the cached-attention
reference.

Variants are config options of the one module: plain (NemotronH: no RoPE) or gated (Qwen3-Next: q_proj also
yields a per-head output gate, q / k RMSNorm, NeoX RoPE on the first ``partial_rotary_factor`` of each head).
The math is checked against transformers 5's ``modeling_nemotron_h.py`` and ``modeling_qwen3_next.py`` (the
test oracles). Shapes: B batch, T tokens, D hidden, Hq query heads, KVH key/value heads, hd head_dim, S slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.quant.fp8 import FP8_DTYPE, quantize_fp8_ref
from kernels.rope import norm_rope, rope_rotate
from runners.engine.models.config import HybridConfig
from runners.engine.models.layers import RMSNorm, cacheable_now, use_inference_kernel
from runners.engine.shard import FirstRankOnly, Rule, Shard, part
from runners.engine.state import KV, BatchMeta, Buffer, CacheSpec, LayerState, zeros


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """RoPE inverse frequencies theta^(-2i / rotary_dim), i < rotary_dim / 2: float32 [rotary_dim / 2]."""
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX-style (rotate-half) rotary embedding on the first ``rotary_dim = 2 * len(inv_freq)`` dims of
    each head; the rest pass through (partial rotary). x [B, T, H, hd]; positions [B, T] or [T] int64
    (absolute token positions). Computed in float32, returned in x's dtype; pure function."""
    return rope_rotate(x, *rope_cos_sin(positions, inv_freq))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The angles of :func:`apply_rope`: positions [B, T] or [T] int64, inv_freq [rd / 2] float32 -> (cos,
    sin), each float32 [B or 1, T, 1, rd / 2] (broadcast over heads). The same for every layer of a step
    with the same rotary dim and theta, so a step computes them once (``BatchMeta.shared``)."""
    ang = positions.float()[..., None] * inv_freq  # (B, T, rd / 2) or (T, rd / 2)
    if ang.dim() == 2:
        ang = ang[None]
    return ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]


@dataclass
class KVCache(LayerState):
    """Keys and values of one attention layer, written by position.

    k, v: [S + 1, max_seq_len, KVH, head_dim], the model dtype, or float8_e4m3fn for an FP8 KV cache
    (``CacheSpec.kv_cache_dtype``; half the bytes of bf16). FP8 entries are ``clamp(k / k_scale, -448, 448)``
    with the layer's per-tensor ``k_scale`` / ``v_scale`` (0-dim float32: the checkpoint's calibrated
    ``k_proj.k_scale`` / ``v_proj.v_scale``, set by the engine; None reads as 1.0), as NVIDIA ModelOpt's FP8
    KV cache; :meth:`read` dequantizes (``k_fp8 * k_scale``). :meth:`reset_rows` zeroes an admitted slot's
    rows (positions past a request's length are read, masked: they must be finite); commit is a no-op: a
    later write to a position overwrites a rejected token's entry.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    layout: dict[str, Buffer] = field(default_factory=dict, repr=False)
    positional: ClassVar[bool] = True

    @classmethod
    def buffers(cls, c: HybridConfig, spec: CacheSpec) -> dict[str, Buffer]:
        shape = (spec.rows, spec.max_seq_len, c.num_key_value_heads, c.head_dim)
        return {name: Buffer(shape, spec.kv_cache_dtype or spec.dtype, KV) for name in ("k", "v")}

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> KVCache:
        layout = cls.buffers(c, spec)
        return cls(**zeros(layout, spec.device), layout=layout)

    @property
    def fp8(self) -> bool:
        return self.k.dtype == FP8_DTYPE

    def write(self, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys / values [B, T, KVH, head_dim] at (rows, pos) [B, T] (quantized in an FP8 cache; the
        FP8 buffers are indexed through uint8 views, which every backend indexes)."""
        if not self.fp8:
            self.k[rows, pos] = k.to(self.k.dtype)
            self.v[rows, pos] = v.to(self.v.dtype)
            return
        for buf, x, scale in ((self.k, k, self.k_scale), (self.v, v, self.v_scale)):
            # torch ops (inductor fuses them where the block is compiled; kernels.quant.fp8's one-launch
            # kernel serves the FP8 linears, which leave compiled code anyway)
            q = quantize_fp8_ref(x, 1.0 if scale is None else scale)
            buf.view(torch.uint8)[rows, pos] = q.view(torch.uint8)

    def read(
        self, rows: Callable[[torch.Tensor], torch.Tensor], kv_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [B, kv_len, KVH, head_dim] in ``dtype`` of the batch's cache rows (``rows``:
        ``BatchMeta.rows``, or ``BatchMeta.view_rows``: then, unquantized, a view of the cache -- read it
        only), dequantized in an FP8 cache. The first kv_len positions are sliced before the rows are
        gathered, so the gather copies only those."""
        if not self.fp8:
            return rows(self.k[:, :kv_len]).to(dtype), rows(self.v[:, :kv_len]).to(dtype)
        out = []
        for buf, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = rows(buf.view(torch.uint8)[:, :kv_len]).view(FP8_DTYPE)
            out.append(q.to(dtype) if scale is None else q.to(dtype) * scale.to(dtype))
        return out[0], out[1]

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Zero keys and values at every position of cache rows ``rows`` [n] (int64; a request is admitted).

        Attention reads each row up to the batch's KV bound (``BatchMeta.max_kv_len``: the longest row, a CUDA
        graph's bucket) and masks the positions past the row's own: a masked weight is exactly 0, but NaN +
        -inf in the scores and 0 x NaN in weights @ values are NaN, so a non-finite entry a previous occupant
        left there (a float16 overflow, say) would reach the new request. Zeroed, masked positions add exact
        zeros: bit for bit a fresh cache's result. (A request's own entries past its length, rejected drafts,
        are rewritten by its next step before any read.) Zeroing once per request rather than masking every
        read: on one CPU thread a select over the keys and values read takes ~3 ms per layer and step at 16
        rows x 1,000 positions, this reset ~0.1 ms per slot of the tiny NemotronH (3 layers, 4,096
        positions, 6 MiB); Super V3's 9 attention layers hold 36 MiB per slot at 4,096 positions, ~11 us at
        an H100's 3.35 TB/s. (vLLM's and SGLang's paged attention read no position past a sequence's
        length; this dense cache does.) On the CPU rows are zeroed as slices (``index_fill_`` over dim 0
        measured ~7x slower there)."""
        for buf in (self.k, self.v):
            flat = buf.view(torch.uint8) if self.fp8 else buf  # FP8: zero bytes are e4m3fn's 0.0
            if rows.device.type == "cpu":
                for r in rows.tolist():
                    flat[r].zero_()
            else:
                flat.index_fill_(0, rows, 0)

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        pass


class Attention(nn.Module):
    """Causal GQA self-attention, scale head_dim^-0.5, with the options of ``HybridConfig``:

    - plain (NemotronH): no positional encoding (transformers' NemotronHAttention defines
      apply_rotary_pos_emb but never calls it);
    - gated (Qwen3-Next, ``attn_output_gate``, ``qk_norm``, ``rope_theta``, ``partial_rotary_factor``):
      q_proj gives per head [q_h, gate_h] (2 hd rows per head); q and k get an RMSNorm over head_dim (scale
      ``norm_weight_offset + w``), then NeoX RoPE on their first int(hd * partial_rotary_factor) dims at the
      tokens' absolute positions; the output is ``o_proj(attn * sigmoid(gate))``.

    forward(hidden [B, T, D], kv, meta) -> [B, T, D]. With ``kv`` (a :class:`KVCache`) and ``meta``, the keys
    (after norm and RoPE) and values of valid columns are written at positions ``start_pos + t`` of their
    slot (padding columns go to the scratch row) and every query attends to its request's cached positions
    ``<= start_pos + t``. Without a cache it is a plain causal forward over the T columns (positions 0..T-1).
    """

    @staticmethod
    def state_class(replay: bool) -> type[LayerState]:
        """The per-slot state this kind keeps in the cache: :class:`KVCache` (written by position, so the
        same under rewind and replay)."""
        return KVCache

    def shard_rules(self, c: HybridConfig, W: int, r: int) -> dict[str, Rule]:
        """Tensor parallelism: query heads split (gated: [q_h, gate_h] rows per head); KV heads split or,
        fewer than ranks, the one its query heads read (held by W / KVH ranks); o_proj by columns, its bias on
        rank 0; q / k norms replicated.
        ``{parameter name below this module: what rank r of W reads}`` (``runners.engine.shard``) from the
        full (unsharded) config ``c``; names absent are replicated."""
        H, KVH, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        rows_per_head = hd * (2 if c.attn_output_gate else 1)  # gated: [q_h, gate_h] per head
        q = Shard(0, (part(H * rows_per_head, W, r),))
        if KVH % W == 0:
            kv = Shard(0, (part(KVH * hd, W, r),))
        else:  # fewer KV heads than ranks: the KV head of this rank's query heads, held by W / KVH ranks
            j = r // (W // KVH)
            kv = Shard(0, ((j * hd, (j + 1) * hd),))
        return {
            "q_proj.weight": q, "q_proj.bias": q,
            "k_proj.weight": kv, "k_proj.bias": kv,
            "v_proj.weight": kv, "v_proj.bias": kv,
            "o_proj.weight": Shard(1, (part(H * hd, W, r),)), "o_proj.bias": FirstRankOnly(r),
        }

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.output_gate = c.attn_output_gate
        q_rows = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(c.hidden_size, q_rows, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.norm_eps, c.norm_weight_offset)
            self.k_norm = RMSNorm(self.head_dim, c.norm_eps, c.norm_weight_offset)
        else:
            self.q_norm = self.k_norm = None
        self.rope_theta = c.rope_theta
        self.rotary_dim = int(self.head_dim * c.partial_rotary_factor) if c.rope_theta is not None else 0
        if self.rotary_dim % 2:
            raise ValueError(
                f"{c.source}: rotary dim int(head_dim={self.head_dim} * partial_rotary_factor="
                f"{c.partial_rotary_factor}) = {self.rotary_dim} must be even"
            )

    def _inv_freq(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`rope_inv_freq` of this layer on x's device (float32 [rotary_dim / 2]); where the fused
        inference stages run (:func:`use_inference_kernel` of x) computed once per device and reused (five
        launches fewer per forward): stored in the eager step (:func:`cacheable_now`), read in a CUDA-graph
        capture too (the captured step reads what its eager warm-up stored); elsewhere at each call
        (autograd; torch.compile folds it)."""
        cache = self.__dict__.setdefault("_inv_freq_cache", {})
        if use_inference_kernel(x) and x.device in cache:
            return cache[x.device]
        inv_freq = rope_inv_freq(self.rotary_dim, self.rope_theta, x.device)
        if cacheable_now(x):
            cache[x.device] = inv_freq
        return inv_freq

    def forward(self, hidden: torch.Tensor, kv: KVCache | None = None, meta: BatchMeta | None = None,
                last_rows: int | None = None):
        if last_rows is not None:  # the last columns' output only, where forward_last can give it
            out = self.forward_last(hidden, kv, meta, last_rows)
            if out is not None:
                return out
        b, T, _ = hidden.shape
        if self.output_gate:  # per head [q_h, gate_h]
            q, gate = self.q_proj(hidden).view(b, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q, gate = self.q_proj(hidden).view(b, T, self.num_heads, self.head_dim), None
        k = self.k_proj(hidden).view(b, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(b, T, self.num_kv_heads, self.head_dim)
        dev = hidden.device
        # [T] or [B, T] absolute positions; what derives from the batch alone (positions, RoPE angles, write
        # rows, mask) is computed once per forward and shared by the attention layers (BatchMeta.shared)
        if kv is None:
            pos = torch.arange(T, device=dev)
        else:
            pos = meta.shared(("positions", T), lambda: meta.start_pos[:, None] + torch.arange(T, device=dev))
        if self.rotary_dim:
            def angles():
                return rope_cos_sin(pos, self._inv_freq(hidden))
            cos, sin = angles() if kv is None else meta.shared(("rope", T, self.rotary_dim, self.rope_theta),
                                                                 angles)
        if self.q_norm is not None and self.rotary_dim and use_inference_kernel(q):
            # the head norms and the rotation in one launch per tensor (kernels/rope.py)
            q = norm_rope(q, self.q_norm.weight, self.q_norm.eps, self.q_norm.offset, cos, sin)
            k = norm_rope(k, self.k_norm.weight, self.k_norm.eps, self.k_norm.offset, cos, sin)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary_dim:
                q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
        if kv is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        else:
            rows = kv.k.shape[0]

            def write_index():
                slot_rows = meta.row_index(rows)[:, None].expand(b, T)
                if meta.all_valid:
                    return slot_rows, pos
                valid = meta.valid(T)
                # padding columns -> scratch row
                return torch.where(valid, slot_rows, rows - 1), torch.where(valid, pos, 0)
            w_rows, w_pos = meta.shared(("kv_write", T, rows), write_index)
            kv.write(w_rows, w_pos, k, v)  # an FP8 KV cache quantizes here and dequantizes in read()
            if meta.fresh and not kv.fp8:  # every row starts at 0: its keys are this forward's, plain causal
                k, v = k.to(kv.k.dtype).to(q.dtype), v.to(kv.v.dtype).to(q.dtype)  # as the cache holds them
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
                )
            else:
                kv_len = meta.max_kv_len or int((meta.start_pos + meta.lengths).max())
                keys, values = kv.read(meta.view_rows, kv_len, q.dtype)  # (B, S_k, KVH, hd), read only
                S = keys.shape[1]
                mask = meta.shared(("kv_mask", T, S), lambda: causal_cache_mask(pos, S))
                return self._finish(_cached_attention(q, keys, values, pos, mask), gate)
        return self._finish(out.transpose(1, 2), gate)

    def forward_last(self, hidden: torch.Tensor, kv: KVCache, meta: BatchMeta,
                     rows: int) -> torch.Tensor | None:
        """:meth:`forward`'s output at the last ``rows`` columns only, [B, rows, D], bit for bit, with every
        column's keys and values written to ``kv`` as forward writes them (``forward(..., last_rows=rows)``
        returns it, through the module's hooks, e.g. a tensor-parallel all-reduce); or None (nothing
        written) where that is not known to hold: it covers a fresh prefill forward (``meta.fresh``) of full
        rows (``meta.all_valid``) on the CPU in float32, unquantized KV, plain attention (NemotronH: no gate,
        head norms or RoPE), ``rows`` >= 4 and a width T whose remainder modulo 32 is 0 or >= ``rows``.

        Why it is exact: the CPU flash kernel of forward's causal call computes queries in blocks of 32, 64
        or 256 rows (by T) against the same key blocks, and from 4 query rows of a block on, a row's result
        does not depend on the others; the last block then has at least ``rows`` rows, as this call's
        one block has (tests/test_cpu_fast_paths.py compares the two over many widths)."""
        b, T, _ = hidden.shape
        if (self.output_gate or self.q_norm is not None or self.rotary_dim or kv is None or kv.fp8
                or not meta.fresh or not meta.all_valid or hidden.device.type != "cpu"
                or hidden.dtype != torch.float32 or rows < 4 or T < rows or 0 < T % 32 < rows):
            return None
        k = self.k_proj(hidden).view(b, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(b, T, self.num_kv_heads, self.head_dim)
        pos = meta.shared(("positions", T), lambda: meta.start_pos[:, None] + torch.arange(T))
        kv.write(meta.row_index(kv.k.shape[0])[:, None].expand(b, T), pos, k, v)
        q = self.q_proj(hidden[:, T - rows:]).view(b, rows, self.num_heads, self.head_dim)
        mask = torch.arange(T)[None, :] <= torch.arange(T - rows, T)[:, None]  # [rows, T]: causal
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True)
        return self._finish(out.transpose(1, 2), None)

    def _finish(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """out [B, T, Hq, hd] -> o_proj(out * sigmoid(gate)) [B, T, D] (no gate: o_proj(out))."""
        b, T = out.shape[:2]
        out = out.reshape(b, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, T, -1))
        return self.o_proj(out)


# Decode and verify steps (few queries per row) fold the query heads of a KV head into the query axis: one
# attention over G * T queries per KV head reads each key once (enable_gqa reads it G times); FlashAttention's
# decode path swaps the GQA group into the query-length axis the same way (csrc/flash_attn/flash_api.cpp,
# seqlenq_ngroups_swapped). Measured 1.2x (T = 4) to 1.5x (T = 1) faster on the CPU for the tiny NemotronH
# at 1,500 cached positions; CPU only (on CUDA the enable_gqa path runs, unmeasured against the fold).
# Equality with plain attention: tests/test_engine_model.py.
_FOLD_GQA_MAX_T = 16


def causal_cache_mask(pos: torch.Tensor, S: int) -> torch.Tensor:
    """[B, T, S] bool: the query at absolute position pos [B, T] attends cache positions 0 .. pos."""
    return torch.arange(S, device=pos.device)[None, None, :] <= pos[:, :, None]


def _cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries over a request's cached positions.

    q: [B, T, Hq, hd]; keys, values: [B, S_k, KVH, hd] (cache positions 0 .. S_k - 1, KVH divides Hq; query
    head h reads KV head h // (Hq / KVH)); pos: [B, T] int64 absolute position of each query, which attends
    the keys at positions <= pos; mask: :func:`causal_cache_mask` ``(pos, S_k)`` when the caller has it
    (None: computed here). Returns [B, T, Hq, hd], scale hd^-0.5.
    """
    B, T, Hq, hd = q.shape
    S, KVH = keys.shape[1], keys.shape[2]
    G = Hq // KVH
    if mask is None:
        mask = causal_cache_mask(pos, S)  # (B, T, S_k)
    if T > _FOLD_GQA_MAX_T or G == 1 or q.device.type != "cpu":
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None],
            enable_gqa=True,
        )
        return out.transpose(1, 2)
    qf = q.reshape(B, T, KVH, G, hd).transpose(1, 2).reshape(B, KVH, T * G, hd)  # query (t, g) of KV head j
    mask = mask[:, None, :, None, :].expand(B, 1, T, G, S).reshape(B, 1, T * G, S)
    out = F.scaled_dot_product_attention(qf, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
    return out.reshape(B, KVH, T, G, hd).transpose(1, 2).reshape(B, T, Hq, hd)
