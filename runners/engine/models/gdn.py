"""Gated DeltaNet (Qwen3-Next linear attention): the mixer layer, with the checkpoint's parameter names.

Scope: `GatedDeltaNet`, the Qwen3-Next mixer (projections, causal conv, gates, the gated delta rule, gated
RMSNorm), cache-agnostic: the caller passes the recurrent state and the conv window of each row and gets the
new ones back; and `GDNMixer` (the hybrid decoder's ``gdn`` block), the engine's caller, which reads and
writes the per-slot `GDNState` / `GDNReplayState` (declared here: the kind's states, their shapes and dtypes
from the config's GDN dims, ``registry.schema.GDNDims``; ``GDNMixer.state_class`` hands them to the cache).
The rule itself lives in kernels/gdn/:
`chunk_gated_delta_rule` (chunked form, prefill: fla-core's kernels on CUDA) and its reference
`chunk_gated_delta_rule_ref`, `recurrent_gated_delta_rule` (token by token, the
specification), `fused_recurrent_gated_delta_rule` (the Triton decode / rewind-verify kernel and its
reference) and `replay_verify`.

Shape vocabulary: B batch, T tokens per row, H key heads, HV value heads (HV = r * H, value head j reads key
head j // r), K key head dim, V value head dim, D hidden size, W conv kernel width, C conv channels
(2 * H * K + HV * V).

Recurrent state layout: (B, HV, V, K), K contiguous (both S k_t and S q_t then reduce along contiguous
memory). transformers' torch fallback uses (B, HV, K, V): transpose the last two dims to convert. Per token t
and value head (k_t, q_t repeated to value heads and L2-normalised):

    alpha_t = exp(g_t)
    S_t = alpha_t * S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
        = alpha_t * S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - alpha_t S_{t-1} k_t)
    o_t = S_t (scale * q_t),               scale = K^-0.5

Source of the algorithm: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(ICLR 2025); layer layout as in transformers' Qwen3NextGatedDeltaNet (the test oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from kernels.gdn import (
    ReplayHistory,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_ref,
    l2norm,
    recurrent_gated_delta_rule,
    replay_verify,
    replay_verify_ref,
)
from kernels.gdn.prologue import MAX_T as PROLOGUE_MAX_T
from kernels.gdn.prologue import gdn_prologue, gdn_prologue_ref
from kernels.norm import gated_rms_norm, gated_rms_norm_ref
from runners.engine.models.layers import use_inference_kernel
from runners.engine.shard import Rule, Shard, part
from runners.engine.state import (
    CacheSpec,
    LayerState,
    RecurrentReplayState,
    RecurrentState,
    kernel_or_reference,
)

if TYPE_CHECKING:  # type hints only
    from runners.engine.models.config import HybridConfig
    from runners.engine.state import BatchMeta

__all__ = ["GDNMixer", "GDNOutput", "GDNReplayState", "GDNRuleInputs", "GDNState", "GatedDeltaNet",
           "GatedRMSNorm"]


# ----------------------------------------------------------------------------------------------------------
# The kind's per-slot states
# ----------------------------------------------------------------------------------------------------------


def gdn_state_shapes(c: HybridConfig) -> tuple[int, tuple[int, ...]]:
    """(conv channels C = 2 H K + HV V, the per-slot delta-rule state's shape [HV, V, K])."""
    HV, V, K = c.gdn_num_value_heads, c.gdn_value_head_dim, c.gdn_key_head_dim
    return 2 * c.gdn_num_key_heads * K + HV * V, (HV, V, K)


@dataclass
class GDNState(RecurrentState):
    """Recurrent state of one Gated DeltaNet layer, committed by rewind (``runners.engine.state.
    RecurrentState``), with GDN shapes (HV value heads, V / K value / key head dims, C = 2 H K + HV V conv
    channels [Q | K | V], W = conv_kernel):

    conv: [S + 1, C, W - 1], model dtype; the last W - 1 conv inputs, oldest first.
    ssm:  [S + 1, HV, V, K], ``ssm_state_dtype``; the delta-rule state S with K contiguous (o = S q;
          transformers keeps [.., K, V], the transpose).
    conv_steps: [S + 1, C, W - 1 + T] and ssm_steps: [S + 1, T, HV, V, K] (rewind buffers, only with
          ``spec_tokens = T > 0``): the conv window and the state after each token of the last verify.
    """

    state_shapes = staticmethod(gdn_state_shapes)


@dataclass
class GDNReplayState(RecurrentReplayState):
    """Recurrent state of one Gated DeltaNet layer under SSM replay (``runners.engine.state.
    RecurrentReplayState``: committed state lagging by PNAT tokens, conv window of W - 1 + K columns read at
    offset PNAT - 1):

    ssm:  [S + 1, HV, V, K], ``ssm_state_dtype``; conv: [S + 1, C, W - 1 + K], model dtype.
    history: ``kernels.gdn.ReplayHistory`` with S + 1 slots and T tokens, float32: u (S + 1, 2, T, HV, V)
          solved update vectors, k (S + 1, 2, T, H, K) normalised keys, g (S + 1, 2, T, HV) cumulative log
          decay of the last verify. No checkpointing variant.
    """

    history_type: ClassVar[type] = ReplayHistory
    state_shapes = staticmethod(gdn_state_shapes)

    @property
    def history_len(self) -> int:
        return self.history.u.shape[2]

    @staticmethod
    def history_shapes(c: HybridConfig, spec: CacheSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return ReplayHistory.shapes(spec.rows, spec.spec_tokens, c.gdn_num_key_heads, c.gdn_num_value_heads,
                                    c.gdn_key_head_dim, c.gdn_value_head_dim, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# The mixer layer
# ----------------------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """RMSNorm then SiLU gate, per value head: weight * x_hat * silu(z) (Qwen3-Next `linear_attn.norm`).

    The weight is a plain scale (not 1 + w as in Qwen3-Next's other norms). x, z: (..., V); output in x's
    dtype; statistics in float32 (as transformers' Qwen3NextRMSNormGated).
    ``kernels.norm.gated_rms_norm_ref``, or its one-launch kernel where ``layers.use_inference_kernel``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        if use_inference_kernel(x):
            return gated_rms_norm(x, z, self.weight, self.eps)
        return gated_rms_norm_ref(x, z, self.weight, self.eps)


class GDNOutput(NamedTuple):
    """What `GatedDeltaNet.prefill` / `.decode` return.

    y: (B, T, D) in x's dtype (zeros at right-padded positions).
    recurrent_state: (B, HV, V, K), K contiguous, state after each row's last valid token.
    conv_state: (B, C, W - 1), the conv inputs of each row's last W - 1 valid tokens, oldest first.
    intermediate_states: (B, T, HV, V, K) state after each of the T tokens (decode with
        output_intermediate_states=True), else None.
    intermediate_conv_states: (B, T, C, W - 1) conv window after each of the T tokens (a strided view of one
        (B, C, W - 1 + T) buffer: copy before the next forward if kept), else None.
    """

    y: Tensor
    recurrent_state: Tensor
    conv_state: Tensor
    intermediate_states: Tensor | None = None
    intermediate_conv_states: Tensor | None = None


class GDNRuleInputs(NamedTuple):
    """Per-token inputs of the gated delta rule for T new tokens (`GatedDeltaNet.rule_inputs`).

    q, k: (B, T, H, K) float32, L2-normalised, not scaled (raw, in x's dtype, from ``normalize_qk=False``).
    v: (B, T, HV, V) in x's dtype.
    g, beta: (B, T, HV) float32 (log decay <= 0, write strength in (0, 1)). z: (B, T, HV, V) output gate.
    conv_in: (B, C, W - 1 + T) the previous conv window followed by the T new conv inputs; the window after
        n tokens is conv_in[:, :, n : n + W - 1] (`GatedDeltaNet.conv_state_after`).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    z: Tensor
    conv_in: Tensor


class GatedDeltaNet(nn.Module):
    """Qwen3-Next Gated DeltaNet mixer (`model.layers.N.linear_attn.*`), cache-agnostic.

    Parameters (checkpoint names and shapes; load a state_dict of transformers' Qwen3NextGatedDeltaNet as is):
        in_proj_qkvz.weight (2 H K + 2 HV V, D): per key head h, rows [q_h (K), k_h (K), v_h (r V), z_h (r V)]
        in_proj_ba.weight (2 HV, D): per key head h, rows [b_h (r), a_h (r)]
        conv1d.weight (C, 1, W), no bias, channels [Q (H K) | K (H K) | V (HV V)] (de-interleaved)
        dt_bias (HV,), A_log (HV,), norm.weight (V,), out_proj.weight (D, HV V)
    with r = HV / H. Forward per token: causal depthwise conv + SiLU over [Q, K, V]; q, k L2-normalised (q
    scaled by K^-0.5 in the rule); g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b); gated delta rule;
    GatedRMSNorm(o, z) per value head; out_proj.

    State the caller owns (per row; the engine gathers slots into the batch and scatters results back):
        recurrent_state (B, HV, V, K), K contiguous, float32 recommended (any float dtype is accepted; the
            math is float32 and new states come back in the given dtype, float32 when none is given);
        conv_state (B, C, W - 1), x's dtype, oldest column first, channels as conv1d.
    Inputs are never modified: the new states come back in `GDNOutput`.
    """

    # dummy / synthetic weights (runners.engine.dummy): A_log and dt_bias as Mamba2's; the output norm is a
    # plain scale (not Qwen3-Next's 1 + w), so its identity is 1
    dummy_init: ClassVar[dict[str, str]] = {"A_log": "A_log", "dt_bias": "dt_bias", "norm.weight": "ones"}

    def shard_rules(self, c: HybridConfig, W: int, r: int) -> dict[str, Rule]:
        """Tensor parallelism: key heads split with their value heads. in_proj_qkvz ([q_h, k_h, v_h, z_h])
        and in_proj_ba ([b_h, a_h]) are grouped per key head (one contiguous block per rank); the conv over
        the de-interleaved [Q | K | V] by part; A_log / dt_bias by value head; out_proj by columns; the
        output norm replicated.
        ``{parameter name below this module: what rank r of W reads}`` (``runners.engine.shard``) from the
        full (unsharded) config ``c``; names absent are replicated."""
        H, HV, K, V = c.gdn_num_key_heads, c.gdn_num_value_heads, c.gdn_key_head_dim, c.gdn_value_head_dim
        ratio = HV // H
        per_key_head = 2 * K + 2 * ratio * V  # in_proj_qkvz rows of one key head: [q_h, k_h, v_h, z_h]
        return {
            "in_proj_qkvz.weight": Shard(0, (part(H * per_key_head, W, r),)),
            "in_proj_ba.weight": Shard(0, (part(H * 2 * ratio, W, r),)),  # [b_h, a_h] per key head
            # conv channels de-interleaved: Q (H K) | K (H K) | V (HV V)
            "conv1d.weight": Shard(0, (part(H * K, W, r), part(H * K, W, r, H * K),
                                       part(HV * V, W, r, 2 * H * K))),
            "dt_bias": Shard(0, (part(HV, W, r),)),
            "A_log": Shard(0, (part(HV, W, r),)),
            "out_proj.weight": Shard(1, (part(HV * V, W, r),)),
        }

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        rms_norm_eps: float = 1e-6,
        chunk_size: int = 64,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2; got {conv_kernel}")
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        f = {"device": device, "dtype": dtype}
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **f)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **f)
        # Depthwise causal conv; only its weight is used (applied by hand over [conv_state, new inputs]).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False,
                                padding=conv_kernel - 1, **f)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **f))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **f).uniform_(1.0, 16.0).log())
        self.norm = GatedRMSNorm(head_v_dim, eps=rms_norm_eps, **f)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)

    # -- shapes of the caller-owned state ------------------------------------------------------------------

    def recurrent_state_shape(self, batch: int) -> tuple[int, int, int, int]:
        """(B, HV, V, K)."""
        return (batch, self.num_v_heads, self.head_v_dim, self.head_k_dim)

    def conv_state_shape(self, batch: int) -> tuple[int, int, int]:
        """(B, C, W - 1)."""
        return (batch, self.conv_dim, self.conv_kernel - 1)

    # -- entry points --------------------------------------------------------------------------------------

    def prefill(
        self,
        x: Tensor,
        lengths: Tensor | None = None,
        recurrent_state: Tensor | None = None,
        conv_state: Tensor | None = None,
    ) -> GDNOutput:
        """Prompt (or prompt chunk) forward over a right-padded batch, chunked rule.

        x: (B, T, D); lengths: (B,) integer valid lengths in [0, T] (None: all T valid); recurrent_state
        (B, HV, V, K) / conv_state (B, C, W - 1): the state before these tokens (None: zeros, a fresh
        request; pass both to continue a chunked prefill). Returns GDNOutput with the states after each row's
        last valid token (a row of length 0 keeps its state) and y zero at padded positions.
        """
        return self._forward(x, recurrent_state, conv_state, lengths, chunked=True, intermediates=False)

    def decode(
        self,
        x: Tensor,
        recurrent_state: Tensor,
        conv_state: Tensor,
        *,
        output_intermediate_states: bool = False,
    ) -> GDNOutput:
        """T new tokens per row from the given state (T = 1: decode; T = K + 1: MTP verify), recurrent rule.

        x: (B, T, D); recurrent_state (B, HV, V, K); conv_state (B, C, W - 1). With output_intermediate_states
        the output also holds the state and conv window after each token (rewind commit: keep index
        num_accepted_tokens - 1).
        """
        if recurrent_state is None or conv_state is None:
            raise ValueError("decode needs recurrent_state and conv_state (use prefill for a fresh request)")
        return self._forward(x, recurrent_state, conv_state, None, chunked=False,
                             intermediates=output_intermediate_states)

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Full causal forward from a zero state (no cache): (B, T, D) -> (B, T, D)."""
        return self.prefill(x, lengths).y

    # -- stages (for callers that run the rule with their own kernel, e.g. Triton or replay) ---------------

    def rule_inputs(self, x: Tensor, conv_state: Tensor | None = None,
                    normalize_qk: bool = True, conv_rows: Tensor | None = None) -> GDNRuleInputs:
        """Projections, causal conv + SiLU, L2 norm, gates: everything before the gated delta rule.

        x: (B, T, D); conv_state: (B, C, W - 1) or None (zeros); with ``conv_rows`` (B,) the cache (S, C,
        W - 1) and each row's index in it (read in place by the fused prologue). Pure function of its
        inputs (float32 conv math). Returns GDNRuleInputs; q, k are L2-normalised (float32) but not scaled
        (the rule applies K^-0.5); with ``normalize_qk=False`` they are returned raw in x's dtype, for a rule
        that normalises them itself (``use_qk_l2norm_in_kernel=True``: the same ``l2norm`` of the same
        values, in its registers on CUDA, two to four kernels fewer per decode block and half the q / k
        bytes).
        """
        B, T, _ = x.shape
        H, r, K, V = self.num_k_heads, self.num_v_heads // self.num_k_heads, self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(B, T, H, 2 * K + 2 * r * V)
        ba = self.in_proj_ba(x).view(B, T, H, 2 * r)
        # de-interleave, causal conv + SiLU over [window, new inputs], gates: one kernel on CUDA at step sizes
        fused = use_inference_kernel(x) and T <= PROLOGUE_MAX_T
        prologue = gdn_prologue if fused else gdn_prologue_ref
        q, k, v, g, beta, conv_in = prologue(qkvz, ba, conv_state, self.conv1d.weight, self.A_log,
                                             self.dt_bias, V, conv_rows)
        z = qkvz[..., 2 * K + r * V:].reshape(B, T, H * r, V)
        if normalize_qk:
            q, k = l2norm(q), l2norm(k)
        return GDNRuleInputs(q, k, v, g, beta, z, conv_in)

    def output(self, o: Tensor, z: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Everything after the rule: GatedRMSNorm(o, z) per value head, then out_proj.

        o, z: (B, T, HV, V); lengths: (B,) or None. Returns y (B, T, D) in o's dtype, exactly zero at
        positions >= lengths (even where the padded input held NaN).
        """
        B, T = o.shape[:2]
        y = self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))
        if lengths is not None:
            valid = torch.arange(T, device=y.device)[None, :] < lengths.to(y.device)[:, None]
            y = torch.where(valid[:, :, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
        return y

    def conv_state_after(self, conv_in: Tensor, num_tokens: Tensor | int) -> Tensor:
        """Conv window after the first `num_tokens` new tokens of each row: conv_in[b, :, n_b : n_b + W - 1].

        conv_in: (B, C, W - 1 + T) from `rule_inputs`; num_tokens: int or (B,) integer tensor in [0, T] (the
        valid length after a prefill, num_accepted_tokens after a verify). Returns a new (B, C, W - 1) tensor.
        """
        B, C, L = conv_in.shape
        Wm1 = self.conv_kernel - 1
        if isinstance(num_tokens, int):
            if not 0 <= num_tokens <= L - Wm1:
                raise ValueError(f"num_tokens must lie in [0, T={L - Wm1}]; got {num_tokens}")
            return conv_in[:, :, num_tokens:num_tokens + Wm1].contiguous()
        n = num_tokens.to(conv_in.device)
        if n.shape != (B,) or bool((n < 0).any()) or bool((n > L - Wm1).any()):
            raise ValueError(f"num_tokens must be (B,) = ({B},) with values in [0, T={L - Wm1}]; "
                             f"got {n.tolist()}")
        idx = n[:, None] + torch.arange(Wm1, device=conv_in.device)[None, :]  # (B, W - 1)
        return conv_in.gather(2, idx[:, None, :].expand(B, C, Wm1))

    # -- internals -----------------------------------------------------------------------------------------

    def _check_state(self, name: str, t: Tensor | None, shape: tuple[int, ...]) -> None:
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}; got {tuple(t.shape)}"
                             + (" (recurrent state layout is (B, HV, V, K), K contiguous)"
                                if name == "recurrent_state" else " (conv state layout is (B, C, W - 1))"))

    def _forward(
        self,
        x: Tensor,
        recurrent_state: Tensor | None,
        conv_state: Tensor | None,
        lengths: Tensor | None,
        *,
        chunked: bool,
        intermediates: bool,
    ) -> GDNOutput:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be (B, T, D={self.hidden_size}); got {tuple(x.shape)}")
        B, T, _ = x.shape
        self._check_state("recurrent_state", recurrent_state, self.recurrent_state_shape(B))
        self._check_state("conv_state", conv_state, self.conv_state_shape(B))
        Wm1 = self.conv_kernel - 1
        if T == 0:  # nothing to do: the state passes through (as a copy)
            s = recurrent_state if recurrent_state is not None else x.new_zeros(self.recurrent_state_shape(B),
                                                                                  dtype=torch.float32)
            c = conv_state if conv_state is not None else x.new_zeros(self.conv_state_shape(B))
            empty = s.new_empty(B, 0, *s.shape[1:]) if intermediates else None
            empty_c = x.new_empty(B, 0, *c.shape[1:]) if intermediates else None
            return GDNOutput(x.new_zeros(B, 0, self.hidden_size), s.clone(), c.clone(), empty, empty_c)

        q, k, v, g, beta, z, conv_in = self.rule_inputs(x, conv_state)
        if chunked:
            o, new_state = chunk_gated_delta_rule_ref(q, k, v, g, beta, recurrent_state, self.chunk_size,
                                                      lengths=lengths)
            inter = None
        else:
            o, new_state, inter = recurrent_gated_delta_rule(
                q, k, v, g, beta, recurrent_state, lengths=lengths, output_intermediate_states=intermediates
            )
        y = self.output(o, z, lengths)
        new_conv = self.conv_state_after(conv_in, lengths if lengths is not None else T)
        inter_conv = conv_in.unfold(2, Wm1, 1)[:, :, 1:].transpose(1, 2) if intermediates else None

        state_dtype = torch.float32 if recurrent_state is None else recurrent_state.dtype
        new_state = new_state.to(state_dtype)
        if inter is not None:
            inter = inter.to(state_dtype)
        return GDNOutput(y, new_state, new_conv, inter, inter_conv)


# ----------------------------------------------------------------------------------------------------------
# The engine's block: the mixer on the per-slot cache
# ----------------------------------------------------------------------------------------------------------


class GDNMixer(GatedDeltaNet):
    """The ``gdn`` block kind of the hybrid decoder: `GatedDeltaNet` reading and writing the engine's per-slot
    cache (`GDNState`, or `GDNReplayState` under ssm_replay), the counterpart of
    `runners.engine.models.mamba2.Mamba2Mixer`.

    forward(hidden (B, T, D), state, meta) -> (B, T, D). Without a cache: a full causal forward from a zero
    state. With ``state`` and ``meta`` (`runners.engine.state.BatchMeta`) each row continues from its slot's
    conv
    window and recurrent state; the state's ``ssm_backend`` picks the recurrent operators ("triton": the
    Triton kernels, "torch": their PyTorch references; FlashInfer has no GDN kernel, so "flashinfer" runs
    Triton, ``runners.engine.state.kernel_or_reference``):
    - prefill (T > 1 or right-padded rows, lengths ``meta.lengths``): ``chunk_gated_delta_rule`` (fla-core's
      Triton kernels on CUDA; the reference on the CPU, for "torch", and, with one log line, when fla-core is
      missing) from the slots' gathered states; the state after each row's last valid token is written back
      (a row of length 0 keeps its state);
    - decode (T = 1): ``fused_recurrent_gated_delta_rule``, the slots' states updated in place;
    - rewind verify (``meta.verify``, T = K + 1, a `GDNState`): ``fused_recurrent_gated_delta_rule`` from the
      committed state, which is left alone; the state after each token goes to ``state.ssm_steps`` (by slot)
      and the conv input window (C, W - 1 + T) to ``state.conv_steps``, so ``HybridCache.commit`` can keep the
      state after the accepted tokens;
    - replay verify (a `GDNReplayState`): ``replay_verify`` (the previous step's accepted tokens folded into
      the state, then the new ones), the conv window read at the slot's offset and stored after its first
      column.
    Raises ValueError for a verify of T tokens when the cache keeps a different number of per-token states,
    RuntimeError for a non-verify forward on a replay row whose state lags by pending accepted tokens.
    """

    @staticmethod
    def state_class(replay: bool) -> type[LayerState]:
        """The per-slot state this kind keeps in the cache: `GDNReplayState` under ssm_replay, else
        `GDNState`."""
        return GDNReplayState if replay else GDNState

    def __init__(self, config: HybridConfig) -> None:
        c = config
        super().__init__(
            hidden_size=c.hidden_size,
            num_k_heads=c.gdn_num_key_heads,
            num_v_heads=c.gdn_num_value_heads,
            head_k_dim=c.gdn_key_head_dim,
            head_v_dim=c.gdn_value_head_dim,
            conv_kernel=c.conv_kernel,
            rms_norm_eps=c.norm_eps,
            chunk_size=c.gdn_chunk_size,
        )

    def forward(
        self, x: Tensor, state: GDNState | GDNReplayState | None = None, meta: BatchMeta | None = None
    ) -> Tensor:
        if state is None:
            return self.prefill(x).y
        replay = state.replay
        state.check_forward(meta, x.shape[1])
        if meta.verify:
            return self._verify_replay(x, state, meta) if replay else self._verify_rewind(x, state, meta)
        B, T, _ = x.shape
        rows = meta.row_index(state.ssm.shape[0])  # PAD (-1) -> the scratch row
        # the committed conv window: replay keeps it in the first W - 1 of its columns at PNAT = 0
        conv = state.committed_conv
        lengths = None if meta.all_valid else meta.lengths
        decode = T == 1 and lengths is None  # else the chunked rule, which takes q, k normalised
        conv_rows = meta.row_index(conv.shape[0])  # the prologue reads the windows in place: no gather
        q, k, v, g, beta, z, conv_in = self.rule_inputs(x, conv, normalize_qk=not decode, conv_rows=conv_rows)
        if decode:  # the slots' states updated in place
            rule = kernel_or_reference(state.ssm_backend, fused_recurrent_gated_delta_rule,
                                       fused_recurrent_gated_delta_rule_ref)
            o = rule(q, k, v, g, beta, state.ssm, meta.slot_ids, use_qk_l2norm_in_kernel=True,
                     stochastic_rounding=state.rounding)
        else:
            rule = kernel_or_reference(state.ssm_backend, chunk_gated_delta_rule, chunk_gated_delta_rule_ref)
            o, h = rule(q, k, v, g, beta, meta.rows(state.ssm), self.chunk_size, lengths=lengths)
            state.ssm.index_copy_(0, rows, h.to(state.ssm.dtype))
        W1 = self.conv_kernel - 1  # all valid: the last W - 1 columns, written from the view (no copy)
        new_conv = conv_in[:, :, T:T + W1] if lengths is None else self.conv_state_after(conv_in, lengths)
        conv.index_copy_(0, rows, new_conv.to(conv.dtype))
        return self.output(o, z, lengths)

    def _verify_rewind(self, x: Tensor, state: GDNState, meta: BatchMeta) -> Tensor:
        q, k, v, g, beta, z, conv_in = self.rule_inputs(x, state.conv, normalize_qk=False,
                                                        conv_rows=meta.row_index(state.conv.shape[0]))
        rule = kernel_or_reference(state.ssm_backend, fused_recurrent_gated_delta_rule,
                                   fused_recurrent_gated_delta_rule_ref)
        o = rule(q, k, v, g, beta, state.ssm, meta.slot_ids, use_qk_l2norm_in_kernel=True,
                 update_state=False, intermediate_states=state.ssm_steps,
                 intermediate_state_indices=meta.slot_ids, stochastic_rounding=state.rounding)
        state.conv_steps.index_copy_(0, meta.row_index(state.ssm.shape[0]), conv_in.to(state.conv.dtype))
        return self.output(o, z)

    def _verify_replay(self, x: Tensor, state: GDNReplayState, meta: BatchMeta) -> Tensor:
        B, T, _ = x.shape
        W1 = self.conv_kernel - 1
        rows = meta.row_index(state.ssm.shape[0])  # PAD (-1) -> the scratch row
        slots = state.slots
        conv0 = state.conv[slots.conv_window_index(meta, W1, state.conv.shape[1])]  # (B, C, W - 1)
        q, k, v, g, beta, z, conv_in = self.rule_inputs(x, conv0, normalize_qk=False)
        verify = kernel_or_reference(state.ssm_backend, replay_verify, replay_verify_ref)
        o = verify(q, k, v, g, beta, state.ssm, state.history, meta.slot_ids, slots.prev_num_accepted,
                   slots.buffer_index, use_qk_l2norm_in_kernel=True, stochastic_rounding=state.rounding)
        slots.verified = True
        state.conv.index_copy_(0, rows, conv_in[:, :, 1:].to(state.conv.dtype))
        return self.output(o, z)
