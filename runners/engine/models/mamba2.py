"""Mamba2 mixer (NemotronH ``backbone.layers.N.mixer``): projections, causal conv, the SSM through the
operators of kernels/mamba2/, gated grouped RMSNorm.

Algorithm: Mamba2 / SSD (Dao & Gu 2024, "Transformers are SSMs"), as implemented by the NemotronH mixer of
transformers 5 (``modeling_nemotron_h.py``, the test oracle). Per head h (group g = h // (H / G)):
dt' = clamp(softplus(dt + dt_bias), time_step_limit); dA = exp(A_h dt'), A = -exp(A_log);
state <- state * dA + dt' x (outer) B_g; y = C_g . state + D_h x; then y = grouped_rmsnorm(y * silu(z)).

The dt clamp is the config's ``time_step_limit`` in every path (released configs and transformers 5's
default: [0, inf], a no-op). Note: transformers 5 itself clamps its chunked (prefill) path to
(time_step_min, inf) and its single-token decode path not at all, so it disagrees with itself when
softplus(dt + dt_bias) < time_step_min; we keep prefill and decode consistent (the test weights stay above).

Which operator runs where (the cache state's ``ssm_backend``: "triton" the Triton kernel, "torch" its PyTorch
reference, ``runners.engine.state.kernel_or_reference``):
- prefill (T > 1 or right-padded rows): ``kernels.mamba2.mamba_chunk_scan_combined``, the chunked SSD scan
  from the slots' states, final states written back in place (its reference for "torch"); right-padded
  columns are made no-ops by setting their dt' to 0 (dA = 1 and no input), so a batch of different prompt
  lengths leaves each request's state exactly where its own last token left it. A cache-free forward runs
  the reference math ``kernels.mamba2.ssd_chunked_scan`` from a zero state;
- decode (T = 1): ``kernels.mamba2.selective_state_update``, state updated in place;
- rewind verify (T = K + 1): ``selective_state_update`` writing the per-token states to the cache's rewind
  buffer (or FlashInfer's ``selective_state_update`` for ssm_backend "flashinfer"); the commit is
  :class:`Mamba2State`'s (``runners.engine.state.RecurrentState.commit``);
- replay verify (a :class:`Mamba2ReplayState`): ``kernels.mamba2.replay_verify``, which fast-forwards the
  committed state by the tokens accepted last step and records the new tokens' inputs; the conv window is read
  at the slot's offset instead of being copied at commit.

The kind's declarations live here too: its per-slot states (:class:`Mamba2State`, :class:`Mamba2ReplayState`:
shapes and dtypes from the config's Mamba2 dims, ``registry.schema.MambaDims``), which
``Mamba2Mixer.state_class`` hands to the cache.

Shapes: B batch, T tokens, H heads, P head_dim, N d_state, G ngroups, W conv_kernel, C conv channels.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.mamba2 import (
    ReplayHistory,
    mamba_chunk_scan_combined,
    mamba_chunk_scan_combined_ref,
    replay_verify,
    replay_verify_ref,
    selective_state_update,
    selective_state_update_ref,
    ssd_chunked_scan,
)
from kernels.mamba2.conv import MAX_T as CONV_STEP_MAX_T
from kernels.mamba2.conv import causal_conv_step, causal_conv_step_ref
from kernels.mamba2.flashinfer_replay import (
    RingHistory,
    replay_verify_flashinfer,
    replay_verify_flashinfer_ref,
    tied,
)
from runners.engine.compile import eager_op
from runners.engine.models.config import HybridConfig
from runners.engine.models.layers import (
    GatedGroupRMSNorm,
    cacheable_now,
    consumer_quant_scale,
    use_inference_kernel,
)
from runners.engine.shard import FirstRankOnly, Rule, Shard, part
from runners.engine.state import (
    BatchMeta,
    CacheSpec,
    LayerState,
    RecurrentReplayState,
    RecurrentState,
    kernel_or_reference,
    replay_hist_len,
)

log = logging.getLogger(__name__)


def mamba2_state_shapes(c: HybridConfig) -> tuple[int, tuple[int, ...]]:
    """(conv channels C = d_inner + 2 G N, the per-slot SSM state's shape [H, P, N])."""
    return c.mamba_conv_dim, (c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size)


@dataclass
class Mamba2State(RecurrentState):
    """Recurrent state of one Mamba2 layer, committed by rewind (``runners.engine.state.RecurrentState``):

    conv: [S + 1, C, W - 1], model dtype; ssm: [S + 1, H, P, N], ``ssm_state_dtype`` (float32 by default);
    with ``spec_tokens = T > 0`` conv_steps [S + 1, C, W - 1 + T] and ssm_steps [S + 1, T, H, P, N].
    """

    state_shapes = staticmethod(mamba2_state_shapes)


@dataclass
class Mamba2ReplayState(RecurrentReplayState):
    """Recurrent state of one Mamba2 layer under SSM replay (``runners.engine.state.RecurrentReplayState``):

    ssm:  [S + 1, H, P, N], ``ssm_state_dtype``; conv: [S + 1, C, W - 1 + K], model dtype.
    history: ``kernels.mamba2.ReplayHistory`` with S + 1 slots and L = T (or max(16, T) in the checkpointing
          variant, ``CacheSpec.replay_checkpointing``): x (S + 1, 2, L, H, P) and B (S + 1, 2, L, G, N) in
          the model dtype, dt' and dA_cumsum (S + 1, 2, H, L) float32. With ``ssm_backend="flashinfer"``
          FlashInfer's ring (``kernels.mamba2.flashinfer_replay.RingHistory``, window W = L, L + T rows per
          slot; its ring_start lives in the shared ``ReplaySlots``): the same flush rule and committed
          states in its layout.
    """

    history_type: ClassVar[type] = ReplayHistory
    checkpointing: ClassVar[bool] = True
    state_shapes = staticmethod(mamba2_state_shapes)

    @property
    def history_len(self) -> int:
        if isinstance(self.history, RingHistory):
            return self.history.ring_len - self.slots.spec_tokens
        return self.history.x.shape[2]

    @classmethod
    def history_class(cls, spec: CacheSpec) -> type:
        return RingHistory if spec.replay_ring else ReplayHistory

    @staticmethod
    def history_shapes(c: HybridConfig, spec: CacheSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        L = replay_hist_len(spec.spec_tokens, spec.replay_checkpointing)
        if spec.replay_ring:
            return RingHistory.shapes(spec.rows, L, spec.spec_tokens, c.mamba_num_heads, c.mamba_head_dim,
                                      c.n_groups, c.ssm_state_size, dtype=spec.dtype)
        return ReplayHistory.shapes(spec.rows, L, c.mamba_num_heads, c.mamba_head_dim, c.n_groups,
                                    c.ssm_state_size, dtype=spec.dtype,
                                    checkpointing=spec.replay_checkpointing)


def mamba_groups(c: HybridConfig, W: int, r: int) -> tuple[int, int]:
    """(first group, number of groups) that rank r holds of a mamba layer: G / W groups split with the heads,
    or, when G < W, the one group its heads read."""
    G = c.n_groups
    if G % W == 0:
        return r * (G // W), G // W
    return r // (W // G), 1


class SpanningGroupRMSNorm(nn.Module):
    """Mamba2's gated grouped RMSNorm (``runners.engine.models.layers.GatedGroupRMSNorm``: ``w * rms_norm(y *
    silu(z))`` over groups of ``group_size`` channels) when one group's channels lie on several ranks: each
    rank holds ``dim`` channels of one group, and the group's sum of squares is summed over ``group`` (the
    ranks that share it) before normalising. y, z: [..., dim]; returns float32 [..., dim] (or cast to
    ``out_dtype``, as GatedGroupRMSNorm's signature), equal to the unsharded norm's channels of this rank."""

    def __init__(self, dim: int, group_size: int, eps: float, group: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps, self.group = group_size, eps, group

    def forward(self, y: torch.Tensor, z: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        y = y.float() * F.silu(z.float())
        sum_sq = y.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(sum_sq, group=self.group)
        return (self.weight.float() * (y * torch.rsqrt(sum_sq / self.group_size + self.eps))).to(out_dtype)


class Mamba2Mixer(nn.Module):
    """NemotronH Mamba2 mixer: in_proj -> causal conv + SiLU -> SSM (+ D skip) -> gated grouped RMSNorm
    -> out_proj. Parameter names and shapes equal the checkpoint's (``mixer.in_proj.weight`` etc.).

    forward(hidden [B, T, D], state, meta) -> [B, T, D]. With ``state`` (a :class:`Mamba2State`) and
    ``meta`` the layer starts from the cached conv window and SSM state of ``meta.slot_ids`` and writes the
    state after each row's last valid column back (PAD rows write the scratch row); with ``meta.verify`` it
    writes the per-token states to the rewind buffers instead and leaves the committed state alone. Without
    a cache it runs from a zero state and keeps nothing (a full forward). ``chunk_size`` (the prefill scan's
    chunk) may be changed after construction: the result is the same up to float rounding. With a
    :class:`Mamba2ReplayState` a verify replays instead (see the module docstring); a
    non-verify forward then requires PNAT = 0 (prefill after admission). The state's ``ssm_backend`` picks
    the decode / verify operators (module docstring).
    """

    # dummy / synthetic weights (runners.engine.dummy): A = -exp(A_log) in [-16, -1], softplus(dt_bias) a
    # log-uniform dt in [1e-3, 1e-1] (Dao & Gu 2024's initialisation), D = 1, the gated norm at identity
    dummy_init: ClassVar[dict[str, str]] = {"A_log": "A_log", "dt_bias": "dt_bias", "D": "ones",
                                            "norm.weight": "ones"}

    @staticmethod
    def state_class(replay: bool) -> type[LayerState]:
        """The per-slot state this kind keeps in the cache: :class:`Mamba2ReplayState` under ssm_replay, else
        :class:`Mamba2State`."""
        return Mamba2ReplayState if replay else Mamba2State

    def shard_rules(self, c: HybridConfig, W: int, r: int) -> dict[str, Rule]:
        """Tensor parallelism: heads split. in_proj's [z | x | B | C | dt] and the conv over [x | B | C] by
        this rank's heads and groups (:func:`mamba_groups`), A_log / D / dt_bias / norm weight by head,
        out_proj by columns, its bias on rank 0.
        ``{parameter name below this module: what rank r of W reads}`` (``runners.engine.shard``) from the
        full (unsharded) config ``c``; names absent are replicated."""
        H, P, G, N = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
        di = H * P
        g0, Gl = mamba_groups(c, W, r)
        z = part(di, W, r)
        heads = part(H, W, r)
        b_part = (g0 * N, (g0 + Gl) * N)

        def at(offset: int, rng: tuple[int, int]) -> tuple[int, int]:
            return (offset + rng[0], offset + rng[1])

        # in_proj rows: z (di) | x (di) | B (G N) | C (G N) | dt (H); conv channels: x | B | C
        in_proj = Shard(0, (z, at(di, z), at(2 * di, b_part), at(2 * di + G * N, b_part),
                            at(2 * di + 2 * G * N, heads)))
        conv = Shard(0, (z, at(di, b_part), at(di + G * N, b_part)))
        per_head = Shard(0, (heads,))
        return {
            "in_proj.weight": in_proj, "in_proj.bias": in_proj,
            "conv1d.weight": conv, "conv1d.bias": conv,
            "dt_bias": per_head, "A_log": per_head, "D": per_head,
            "norm.weight": Shard(0, (z,)),
            "out_proj.weight": Shard(1, (z,)), "out_proj.bias": FirstRankOnly(r),
        }

    def shard_modules(self, c: HybridConfig, W: int, subgroup: Callable[[int], Any]) -> None:
        """Tensor parallelism's module swap on this rank's mixer (built from the rank's config; ``c`` the
        full one): with fewer groups G than ranks W each group spans W / G ranks, and the gated grouped norm
        becomes a :class:`SpanningGroupRMSNorm` over them (``subgroup(span)``: the process group of this
        rank's ``span`` consecutive ranks, a collective on first use). With G >= W nothing changes. Mutates
        ``self.norm`` (on the meta device)."""
        if c.n_groups >= W:
            return
        old = self.norm
        with torch.device("meta"):  # the group's full size: d_inner / ngroups of config.json
            norm = SpanningGroupRMSNorm(old.weight.shape[0], c.mamba_d_inner // c.n_groups, old.eps,
                                        subgroup(W // c.n_groups))
        norm.weight.data = norm.weight.data.to(old.weight.dtype)
        self.norm = norm

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        self.num_heads, self.head_dim = c.mamba_num_heads, c.mamba_head_dim
        self.n_groups, self.d_state = c.n_groups, c.ssm_state_size
        self.d_inner, self.conv_dim, self.conv_kernel = c.mamba_d_inner, c.mamba_conv_dim, c.conv_kernel
        self.chunk_size = c.chunk_size
        self.time_step_limit = c.time_step_limit
        self.in_proj = nn.Linear(
            c.hidden_size, self.d_inner + self.conv_dim + self.num_heads, bias=c.mamba_proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            c.conv_kernel,
            groups=self.conv_dim,
            bias=c.use_conv_bias,
            padding=c.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedGroupRMSNorm(self.d_inner, group_size=self.d_inner // self.n_groups, eps=c.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, c.hidden_size, bias=c.mamba_proj_bias)
        self._A_cache: tuple | None = None  # ((A_log's version, data_ptr), A), see decay_rate

    def decay_rate(self) -> torch.Tensor:
        """A = -exp(A_log), float32 (H,). Where the fused inference stages run
        (``layers.use_inference_kernel``) it is computed once and reused while A_log is the same tensor at the
        same version (a load or an in-place update bumps it): up to three launches fewer per block and step
        (a cast of a 16-bit A_log, exp, neg). The value is stored only in the eager step
        (``layers.cacheable_now``: a launch captured into a CUDA graph writes nothing until the graph
        replays) and read in a capture too, so the captured step reads what its eager warm-up stored instead
        of launching the three at every replay. A captured graph therefore sees an in-place change of A_log
        only once an eager call has refreshed the kept tensor (the engine loads weights before it captures);
        the refresh writes into the kept tensor in place, so the graph then reads the new value. Elsewhere
        (CPU, autograd, torch.compile) computed at each call, and also when A_log is an inference tensor (a
        model built inside ``torch.inference_mode``): those carry no version counter, so an in-place load
        could not be seen and the cache could go stale. Mutates only the cache."""
        if not use_inference_kernel(self.A_log) or self.A_log.is_inference():
            return -torch.exp(self.A_log.float())
        key = (self.A_log._version, self.A_log.data_ptr(), self.A_log.device)
        if self._A_cache is not None and self._A_cache[0] == key:
            return self._A_cache[1]
        A = -torch.exp(self.A_log.float())
        if not cacheable_now(self.A_log):  # being captured: computed by the graph at each replay
            return A
        if self._A_cache is not None and self._A_cache[1].shape == A.shape \
                and self._A_cache[1].device == A.device:
            with torch.inference_mode():  # the kept tensor may be an inference tensor (an engine step's)
                A = self._A_cache[1].copy_(A)
        self._A_cache = (key, A)
        return A

    def _conv(self, xBC: torch.Tensor, state: Mamba2State | None, meta: BatchMeta | None) -> torch.Tensor:
        """Causal depthwise conv + SiLU over xBC [B, T, C] -> [B, T, C]. Updates ``state.conv`` of the batch's
        slots (or, in a rewind verify step, stores the whole window in ``state.conv_steps``; in a replay
        verify, reads the committed window at the slot's offset and stores the new one, see
        :class:`Mamba2ReplayState`)."""
        b, T, _ = xBC.shape
        W1 = self.conv_kernel - 1
        weight = self.conv1d.weight[:, 0, :]  # (C, W)
        bias = self.conv1d.bias
        replay = state is not None and state.replay
        if state is not None and (meta.verify or meta.all_valid):
            # the windows read from the cache, the conv + SiLU, the new windows written back: one launch
            # (kernels/mamba2/conv.py) where use_inference_kernel holds, its reference elsewhere
            rows = meta.row_index(state.conv.shape[0])  # PAD -> the scratch row
            same_dtype = (xBC.dtype == weight.dtype == state.conv.dtype
                          and (bias is None or bias.dtype == xBC.dtype))
            fused = use_inference_kernel(xBC) and T <= CONV_STEP_MAX_T and same_dtype
            step = causal_conv_step if fused else causal_conv_step_ref
            if replay and meta.verify:
                # the W - 1 inputs before the next token are columns off .. off + W - 2; column 0 is never
                # read again (after a >= 1 accepted tokens the window is columns a .. a + W - 2): kept from 1
                src_rows, src_cols = state.slots.conv_window_start(meta)
                return step(xBC, state.conv, src_rows, weight, bias, state.conv, rows, 1, src_cols)
            if meta.verify:  # rewind: the whole window of every step, to the per-step buffer
                return step(xBC, state.conv, rows, weight, bias, state.conv_steps, rows, 0)
            conv = state.committed_conv
            return step(xBC, conv, rows, weight, bias, conv, rows, T)  # the last W - 1 inputs kept
        # a cache-free forward, or a prefill batch of rows of different lengths
        prev = xBC.new_zeros(b, self.conv_dim, W1) if state is None else meta.rows(
            state.committed_conv)
        window = torch.cat([prev, xBC.transpose(1, 2).to(prev.dtype)], dim=-1)  # (B, C, W - 1 + T)
        out = F.conv1d(window, weight[:, None, :], bias, groups=self.conv_dim).transpose(1, 2)
        if state is not None:  # the W - 1 inputs before each row's length: columns lengths .. lengths + W - 2
            conv = state.committed_conv
            idx = meta.lengths[:, None] + torch.arange(W1, device=xBC.device)
            new = window.gather(2, idx[:, None, :].expand(b, self.conv_dim, W1))
            conv.index_copy_(0, meta.row_index(state.conv.shape[0]), new.to(conv.dtype))
        return F.silu(out)

    def _verify_ssm(self, state, meta, x, dt, A, Bm, Cm) -> torch.Tensor:
        """The SSM of a verify step (T = K + 1) with the state's ``ssm_backend``; returns y (B, T, H, P)
        incl. D x, float32 (FlashInfer's ring replay: in x's dtype, as its kernel writes it).

        Replay: ``replay_verify`` (fast-forward by PNAT, the new tokens, their history), or FlashInfer's
        ``checkpointing_ssu`` for "flashinfer" (its ring history). Rewind: ``selective_state_update`` writing
        the per-token states to ``state.ssm_steps`` by slot, the committed state untouched (FlashInfer's
        kernel for "flashinfer", as TensorRT-LLM's FlashInfer backend).
        """
        backend = state.ssm_backend
        args = (x, dt, A, Bm, Cm, self.D, self.dt_bias)
        if state.replay and isinstance(state.history, RingHistory):
            # FlashInfer writes y in x's dtype; the gated norm reads it as it is (it computes in float32
            # either way, so a cast here would be one more launch per layer for the same result)
            y = eager_op(_flashinfer_replay_verify)(state, meta, *args)
            state.slots.verified = True
            return y
        out = x.new_empty(x.shape, dtype=torch.float32)
        if state.replay:
            slots = state.slots
            verify = kernel_or_reference(backend, replay_verify, replay_verify_ref)
            y = verify(state.ssm, *args, meta.slot_ids, state.history, slots.prev_num_accepted,
                       slots.buffer_index, time_step_limit=self.time_step_limit, out=out,
                       stochastic_rounding=state.rounding)
            slots.verified = True
            return y
        if backend == "flashinfer":
            return eager_op(_flashinfer_rewind_verify)(state, meta, *args, self.time_step_limit).float()
        ssu = kernel_or_reference(backend, selective_state_update, selective_state_update_ref)
        return ssu(state.ssm, *args, meta.slot_ids, intermediate_states=state.ssm_steps,
                   intermediate_state_indices=meta.slot_ids, update_state=False,
                   time_step_limit=self.time_step_limit, out=out, stochastic_rounding=state.rounding)

    def input_linear(self) -> nn.Module:
        """The linear that alone reads the mixer's input first: in_proj (runners.engine.models.block.Block
        asks it for the codes its norm may write)."""
        return self.in_proj

    def forward(
        self, hidden: torch.Tensor, state: Mamba2State | None = None, meta: BatchMeta | None = None,
        xq: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [b, T, hidden] -> [b, T, hidden]; ``xq``: hidden's codes for in_proj (given only where
        :meth:`input_linear` asked for them)."""
        b, T, _ = hidden.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        proj = self.in_proj(hidden) if xq is None else self.in_proj(hidden, xq=xq)
        z, xBC, dt = proj.split([self.d_inner, self.conv_dim, H], dim=-1)
        if state is not None:
            state.check_forward(meta, T)
        xBC = self._conv(xBC, state, meta)
        x, Bm, Cm = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        x, Bm, Cm = x.reshape(b, T, H, P), Bm.reshape(b, T, G, N), Cm.reshape(b, T, G, N)
        A = self.decay_rate()
        if state is not None and meta.verify:
            y = self._verify_ssm(state, meta, x, dt, A, Bm, Cm)
        elif state is not None and T == 1 and meta.all_valid:  # decode: the slots' states updated in place
            ssu = kernel_or_reference(state.ssm_backend, selective_state_update, selective_state_update_ref)
            y = ssu(state.ssm, x, dt, A, Bm, Cm, self.D, self.dt_bias, meta.slot_ids,
                    time_step_limit=self.time_step_limit, out=x.new_empty(x.shape, dtype=torch.float32),
                    stochastic_rounding=state.rounding)
        elif state is not None:  # prefill: the chunked scan from the slots' states, written back in place
            scan = kernel_or_reference(state.ssm_backend, mamba_chunk_scan_combined,
                                       mamba_chunk_scan_combined_ref)
            y = scan(state.ssm, x, dt, A, Bm, Cm, self.D, self.dt_bias, meta.slot_ids,
                     chunk_size=self.chunk_size, lengths=None if meta.all_valid else meta.lengths,
                     time_step_limit=self.time_step_limit, out=x.new_empty(x.shape, dtype=torch.float32))
        else:  # a cache-free forward: the chunked scan from a zero state
            dt = F.softplus(dt.float() + self.dt_bias.float())
            lo, hi = self.time_step_limit
            if lo > 0.0 or hi != float("inf"):
                dt = dt.clamp(min=lo, max=hi)
            y, _ = ssd_chunked_scan(x, dt, A, Bm, Cm, self.chunk_size)
            y = y + x.float() * self.D.float()[:, None]
        return self.output(y.reshape(b, T, self.d_inner), z, hidden.dtype)

    def output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj(norm(y, z)) in ``dtype``: y, z [b, T, d_inner] -> [b, T, hidden]. Before an FP8
        out_proj on its scaled_mm path the norm's launch also writes out_proj's input codes
        (layers.consumer_quant_scale), so out_proj runs no quantization launch; not with the tensor-parallel
        :class:`SpanningGroupRMSNorm` (a group over several ranks), which has no such output."""
        fused = use_inference_kernel(y) and isinstance(self.norm, GatedGroupRMSNorm)
        scale = consumer_quant_scale(self.out_proj, y) if fused else None
        if scale is None:
            return self.out_proj(self.norm(y, z, out_dtype=dtype))
        h, q = self.norm(y, z, out_dtype=dtype, quant_scale=scale)
        return self.out_proj(h, xq=q)


def _flashinfer_replay_verify(state, meta, x, dt, A, Bm, Cm, D, dt_bias) -> torch.Tensor:
    """Replay verify over the layer's ring history: FlashInfer's ``checkpointing_ssu`` under
    ``ssm_backend="flashinfer"``, that contract's PyTorch reference otherwise (a ring cache built with
    ``replay_ring=True`` on another backend). PAD rows run on the scratch row (``BatchMeta.row_index``), as
    the rewind path; ``ReplaySlots.advance`` moves ring_start and PNAT after the step. The dt clamp was
    refused when the backend was resolved. Returns y (B, T, H, P) in x's dtype, incl. D x."""
    slots = meta.row_index(state.ssm.shape[0])
    verify = replay_verify_flashinfer if state.ssm_backend == "flashinfer" else replay_verify_flashinfer_ref
    return verify(state.ssm, x, dt, A, Bm, Cm, D, dt_bias, slots, state.history, state.slots.ring_start,
                  state.slots.prev_num_accepted, rounding=state.rounding)


def _flashinfer_rewind_verify(state, meta, x, dt, A, Bm, Cm, D, dt_bias, time_step_limit) -> torch.Tensor:
    """Rewind verify with FlashInfer's ``selective_state_update`` (multi-token, intermediate states by slot,
    stored state untouched): the GPU rewind baseline. Returns y (B, T, H, P) incl. D x."""
    import flashinfer.mamba as fim

    if time_step_limit != (0.0, math.inf):
        raise ValueError("FlashInfer's kernel does not clamp dt (time_step_limit); use ssm_backend='triton'")
    b, T, H, P = x.shape
    N = state.ssm.shape[-1]
    slots = meta.row_index(state.ssm.shape[0]).to(torch.int32)  # PAD -> the scratch row (a real row)
    # Its contract (FlashInfer 0.7.2): x, B, C and out unit-stride in the last dim (x can arrive as a strided
    # view); D and dt_bias in dt's dtype, so all three go in fp32, as our kernels read them.
    x, Bm, Cm = x.contiguous(), Bm.contiguous(), Cm.contiguous()
    out = torch.empty_like(x)
    fim.selective_state_update(
        state.ssm, x, tied(dt.float(), (b, T, H, P)), tied(A.float(), (H, P, N)), Bm, Cm,
        tied(D.float(), (H, P)), dt_bias=tied(dt_bias.float(), (H, P)), dt_softplus=True,
        state_batch_indices=slots, out=out,
        disable_state_update=True, intermediate_states_buffer=state.ssm_steps,
        intermediate_state_indices=slots, cache_steps=T,
    )
    return out
