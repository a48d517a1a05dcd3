"""Per-slot inference caches: recurrent state (Mamba2, Gated DeltaNet) and attention KV, by slot id.

A *slot* is one row of every cache, owned by one request from admission until it finishes. Every buffer has
``S + 1`` rows: rows ``0 .. S-1`` are the live slots, row ``S`` is a scratch row. The PAD slot id is ``-1``;
because PyTorch indexes ``-1`` as the last row, a PAD row of a batch reads and writes only the scratch row,
never a live slot (slot 0 is a live slot). Callers never need to special-case padding rows.

The KV cache is written by position (gpt-fast style): a token at position ``p`` of a request goes to
``k[slot, p]``; a later write to the same position overwrites it, so rejected speculative tokens need no
rollback. Recurrent state (conv window, SSM state) has no positions; committing it after a verify step is the
caller's job (rewind or replay, see BRIEF section 4). Shapes use the project vocabulary: S slots, H mamba
heads, P mamba head_dim, N d_state, W conv_kernel, KVH key/value heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from runners.models.config import HybridConfig

PAD_SLOT_ID = -1


@dataclass
class CacheSpec:
    """What a layer-state allocator needs: R = S + 1 rows (the scratch row included), dtypes, device and
    T = ``spec_tokens`` (K + 1 tokens of a verify step; 0 = no speculative buffers)."""

    rows: int
    max_seq_len: int
    dtype: torch.dtype
    ssm_state_dtype: torch.dtype
    device: torch.device | str
    spec_tokens: int


class LayerState:
    """Per-slot state of one block. Subclasses hold buffers of R = S + 1 rows and implement:

    - ``reset_rows(rows)``: zero the state of cache rows ``rows`` [n] (a request is admitted);
    - ``commit_rows(rows, num_accepted_tokens)``: after a verify step, make the state the one after the
      first ``num_accepted_tokens`` [n] tokens (rewind); stateless-by-position kinds do nothing;
    - ``memory()``: ``{"ssm_state_bytes" | "conv_state_bytes" | "kv_cache_bytes" | "spec_buffers_bytes": n}``.

    ``spec_buffers`` names the attributes that only speculative decoding allocates (None when the cache is
    built with ``spec_tokens = 0``); they are a verify step's scratch, not a slot's committed state.
    """

    spec_buffers: ClassVar[tuple[str, ...]] = ()

    def reset_rows(self, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def commit_rows(self, rows: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        raise NotImplementedError

    def memory(self) -> dict[str, int]:
        raise NotImplementedError


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Mamba2State(LayerState):
    """Recurrent state of one Mamba2 layer.

    conv: [S + 1, conv_dim, W - 1], model dtype; the last W - 1 inputs of the causal conv (oldest first).
    ssm:  [S + 1, H, P, N], ``ssm_state_dtype`` (float32 by default); the SSM state h.

    Speculative (rewind) buffers, allocated only when the cache is built with ``spec_tokens = T > 0``:
    conv_steps: [S + 1, conv_dim, W - 1 + T], the conv input window of the last verify (old W - 1 + T new).
    ssm_steps:  [S + 1, T, H, P, N], the SSM state after each of the T verify tokens.
    A verify forward fills these and leaves ``conv`` / ``ssm`` alone; :meth:`commit_rows` then copies the
    state after the accepted tokens back.
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    conv_steps: torch.Tensor | None = None
    ssm_steps: torch.Tensor | None = None
    spec_buffers: ClassVar[tuple[str, ...]] = ("conv_steps", "ssm_steps")

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> Mamba2State:
        H, P, N, C = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_conv_dim
        R, W1, T, dev = spec.rows, c.conv_kernel - 1, spec.spec_tokens, spec.device
        return cls(
            conv=torch.zeros(R, C, W1, dtype=spec.dtype, device=dev),
            ssm=torch.zeros(R, H, P, N, dtype=spec.ssm_state_dtype, device=dev),
            conv_steps=torch.zeros(R, C, W1 + T, dtype=spec.dtype, device=dev) if T else None,
            ssm_steps=torch.zeros(R, T, H, P, N, dtype=spec.ssm_state_dtype, device=dev) if T else None,
        )

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.conv.index_fill_(0, rows, 0)
        self.ssm.index_fill_(0, rows, 0)

    def commit_rows(self, rows: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        n = num_accepted_tokens
        self.ssm.index_copy_(0, rows, self.ssm_steps[rows, n - 1])
        W1 = self.conv.shape[-1]
        cols = n[:, None] + torch.arange(W1, device=n.device)  # the W - 1 conv inputs before token n
        window = self.conv_steps[rows]
        self.conv.index_copy_(0, rows, window.gather(2, cols[:, None, :].expand(-1, window.shape[1], -1)))

    def memory(self) -> dict[str, int]:
        return {
            "ssm_state_bytes": _nbytes(self.ssm),
            "conv_state_bytes": _nbytes(self.conv),
            "spec_buffers_bytes": _nbytes(self.conv_steps, self.ssm_steps),
        }


@dataclass
class GDNState(Mamba2State):
    """Recurrent state of one Gated DeltaNet layer (Qwen3-Next ``linear_attn``): Mamba2State's buffers and
    its reset / rewind commit / memory API, with GDN shapes (HV value heads, V / K value / key head dims,
    C = 2 H K + HV V conv channels [Q | K | V], W = conv_kernel):

    conv: [S + 1, C, W - 1], model dtype; the last W - 1 conv inputs, oldest first.
    ssm:  [S + 1, HV, V, K], ``ssm_state_dtype``; the delta-rule state S with K contiguous (as
          runners/models/gdn.py: o = S q; transformers keeps [.., K, V], the transpose).
    conv_steps: [S + 1, C, W - 1 + T] and ssm_steps: [S + 1, T, HV, V, K] (rewind buffers, only with
          ``spec_tokens = T > 0``): the conv window and the state after each token of the last verify.
    """

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> GDNState:
        HV, V, K = c.gdn_num_value_heads, c.gdn_value_head_dim, c.gdn_key_head_dim
        C = 2 * c.gdn_num_key_heads * K + HV * V
        R, W1, T, dev = spec.rows, c.conv_kernel - 1, spec.spec_tokens, spec.device
        return cls(
            conv=torch.zeros(R, C, W1, dtype=spec.dtype, device=dev),
            ssm=torch.zeros(R, HV, V, K, dtype=spec.ssm_state_dtype, device=dev),
            conv_steps=torch.zeros(R, C, W1 + T, dtype=spec.dtype, device=dev) if T else None,
            ssm_steps=torch.zeros(R, T, HV, V, K, dtype=spec.ssm_state_dtype, device=dev) if T else None,
        )


@dataclass
class KVCache(LayerState):
    """Keys and values of one attention layer, written by position.

    k, v: [S + 1, max_seq_len, KVH, head_dim], model dtype. Reset and commit are no-ops: entries are read
    only below each request's length, and a later write to a position overwrites a rejected token's entry.
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, c: HybridConfig, spec: CacheSpec) -> KVCache:
        shape = (spec.rows, spec.max_seq_len, c.num_key_value_heads, c.head_dim)
        return cls(
            k=torch.zeros(shape, dtype=spec.dtype, device=spec.device),
            v=torch.zeros(shape, dtype=spec.dtype, device=spec.device),
        )

    def reset_rows(self, rows: torch.Tensor) -> None:
        pass

    def commit_rows(self, rows: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        pass

    def memory(self) -> dict[str, int]:
        return {"kv_cache_bytes": _nbytes(self.k, self.v)}


# block kind -> allocate(config, CacheSpec) -> LayerState. A family adds its kinds here.
CACHE_LAYOUTS: dict[str, Callable[[HybridConfig, CacheSpec], LayerState]] = {
    "mamba2": Mamba2State.allocate,
    "gdn": GDNState.allocate,
    "attention": KVCache.allocate,
}


class HybridCache:
    """All per-slot caches of a model: one :class:`LayerState` per stateful block, keyed by ``cache_index``.

    Args:
        config: the model's :class:`HybridConfig`.
        cache_kinds: ``{cache_index: kind}`` for every block that keeps state (a key of
            :data:`CACHE_LAYOUTS`; the MTP module's blocks take indices after the backbone's).
        max_batch_size: S, the number of live slots.
        max_seq_len: positions per slot in the KV cache (prompt + generated tokens).
        dtype: dtype of conv state and KV cache (the model dtype).
        ssm_state_dtype: dtype of the SSM state (float32 is the safe default, BRIEF section 5).
        device: where the buffers live.
        spec_tokens: T = K + 1 tokens of a speculative verify step; > 0 allocates the rewind buffers of
            every recurrent layer (see :class:`Mamba2State`); 0 (default) allocates none.

    All buffers start zeroed (never ``torch.empty``: a stale read must not see garbage).
    """

    def __init__(
        self,
        config: HybridConfig,
        cache_kinds: dict[int, str],
        *,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        ssm_state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        spec_tokens: int = 0,
    ):
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"max_batch_size={max_batch_size} and max_seq_len={max_seq_len} must be >= 1")
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.spec_tokens = spec_tokens
        spec = CacheSpec(max_batch_size + 1, max_seq_len, dtype, ssm_state_dtype, device, spec_tokens)
        self.layers: dict[int, LayerState] = {}
        for idx, kind in sorted(cache_kinds.items()):
            if kind not in CACHE_LAYOUTS:
                raise ValueError(
                    f"no cache layout for block kind {kind!r} (cache_index {idx}); "
                    f"known: {sorted(CACHE_LAYOUTS)}"
                )
            self.layers[idx] = CACHE_LAYOUTS[kind](config, spec)

    def __getitem__(self, cache_index: int) -> LayerState:
        return self.layers[cache_index]

    def _rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Validated cache rows of ``slot_ids`` (PAD -1 -> the scratch row S)."""
        self.check_slots(slot_ids)
        return slot_ids % (self.max_batch_size + 1)

    def check_slots(self, slot_ids: torch.Tensor) -> None:
        """Raise ValueError unless every slot id is PAD (-1) or a live slot in [0, S)."""
        if slot_ids.numel() and (
            int(slot_ids.min()) < PAD_SLOT_ID or int(slot_ids.max()) >= self.max_batch_size
        ):
            raise ValueError(
                f"slot ids {slot_ids.tolist()} out of range: use -1 (PAD) or 0..{self.max_batch_size - 1}"
            )

    def reset(self, slot_ids: torch.Tensor) -> None:
        """Zero the recurrent state (conv window and SSM state) of ``slot_ids`` [n] (int64) in place.

        Called when a request is admitted to a slot. The KV cache is not cleared: it is written by
        position and read only up to each request's length. PAD ids (-1) reset only the scratch row.
        """
        rows = self._rows(slot_ids)
        for layer in self.layers.values():
            layer.reset_rows(rows)

    def commit(self, slot_ids: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
        """Rewind commit after a verify step: set each slot's recurrent state to the state after its first
        ``num_accepted_tokens`` verify tokens (in place). The KV cache needs nothing (written by position).

        Args:
            slot_ids: [B] int64 slots of the verify batch (PAD -1 rows touch only the scratch row).
            num_accepted_tokens: [B] int64 in [1, T]; anything else raises (a 0 or > T from a stale or padding
                row must never index a neighbouring column).

        Raises:
            ValueError: no spec buffers (cache built with spec_tokens=0), or num_accepted_tokens out of range.
        """
        T = self.spec_tokens
        if T == 0:
            raise ValueError("commit() needs the rewind buffers: build the cache with spec_tokens = K + 1")
        n = num_accepted_tokens.to(torch.long)
        if n.numel() and (int(n.min()) < 1 or int(n.max()) > T):
            raise ValueError(f"num_accepted_tokens {n.tolist()} must lie in [1, T={T}]")
        rows = self._rows(slot_ids)
        for layer in self.layers.values():
            layer.commit_rows(rows, n)

    def memory(self) -> dict[str, int]:
        """Bytes allocated by kind (including the scratch row); keys as in docs/architecture.md."""
        out = {"ssm_state_bytes": 0, "conv_state_bytes": 0, "kv_cache_bytes": 0, "spec_buffers_bytes": 0}
        for layer in self.layers.values():
            for key, n in layer.memory().items():
                out[key] += n
        return out


@dataclass
class BatchMeta:
    """Where the rows of one cached forward go. Tensors are int64 on the model device.

    slot_ids:  [B] cache slot of each row; PAD_SLOT_ID (-1) for a padding row.
    start_pos: [B] tokens of the request already in the cache (the position of input column 0).
    lengths:   [B] valid input columns of each row (<= T); columns t >= lengths[b] are right padding and are
               no-ops: they leave the recurrent state unchanged and write no KV entry of a live slot.
    all_valid: True when every row uses all T columns (lets layers skip the padding logic; e.g. decode).
    slot_start: set when the rows are exactly the live slots ``slot_start .. slot_start + B - 1`` in order
        (no PAD): layers then read cache rows through a slice instead of a gather copy.
    max_kv_len: host-side max(start_pos + lengths) when the caller knows it (saves a device sync per
        attention layer); None computes it.
    verify: a speculative verify step: recurrent layers keep every intermediate state in the rewind buffers
        and leave the committed state unchanged (see :meth:`HybridCache.commit`); needs all_valid.
    """

    slot_ids: torch.Tensor
    start_pos: torch.Tensor
    lengths: torch.Tensor
    all_valid: bool = False
    slot_start: int | None = None
    max_kv_len: int | None = None
    verify: bool = False

    def __post_init__(self):
        if self.verify and not self.all_valid:
            raise ValueError("a verify step needs T tokens in every row (all_valid=True)")

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """This batch's cache rows, ``buffer[slot_ids]``: a view when ``slot_start`` is set, else a copy."""
        if self.slot_start is not None:
            return buffer[self.slot_start : self.slot_start + self.slot_ids.shape[0]]
        return buffer[self.slot_ids]

    @classmethod
    def decode(
        cls,
        slot_ids: torch.Tensor,
        start_pos: torch.Tensor,
        T: int = 1,
        *,
        verify: bool = False,
        slot_start: int | None = None,
        max_kv_len: int | None = None,
    ) -> BatchMeta:
        """T tokens for every row (T = 1 for plain decode, T = K + 1 for a verify step)."""
        return cls(
            slot_ids,
            start_pos,
            torch.full_like(slot_ids, T),
            all_valid=True,
            slot_start=slot_start,
            max_kv_len=max_kv_len,
            verify=verify,
        )

    def valid(self, T: int) -> torch.Tensor:
        """[B, T] bool: column t of row b is a real token."""
        return torch.arange(T, device=self.lengths.device)[None, :] < self.lengths[:, None]
