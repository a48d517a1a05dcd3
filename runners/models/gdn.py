"""Gated DeltaNet (Qwen3-Next linear attention): the recurrence and the mixer layer, in plain PyTorch.

Scope: the gated delta rule in two forms -- `chunk_gated_delta_rule` (chunked WY / UT-transform form, used for
prefill) and `recurrent_gated_delta_rule` (one step per token; the specification, and the decode / MTP-verify
path with intermediate states) -- and `GatedDeltaNet`, the Qwen3-Next mixer with the checkpoint's parameter
names. Caches are not owned here: the caller passes the recurrent state and the conv window of each row and
gets the new ones back, so any cache design (slots gathered by the engine, rewind buffers, replay) plugs in.
`GDNMixer` (the hybrid decoder's ``gdn`` block) is the engine's caller: it reads and writes the per-slot
`runners.cache.GDNState`, including the rewind buffers of an MTP verify step.

Shape vocabulary: B batch, T tokens per row, H key heads, HV value heads (HV = r * H, value head j reads key
head j // r), K key head dim, V value head dim, D hidden size, W conv kernel width, C conv channels
(2 * H * K + HV * V).

Recurrent state layout: (B, HV, V, K), K contiguous (the project's choice, BRIEF section 4: both S k_t and
S q_t then reduce along contiguous memory). transformers' torch fallback uses (B, HV, K, V): transpose the
last two dims to convert. Per token t and value head (k_t, q_t repeated to value heads and L2-normalised):

    alpha_t = exp(g_t)
    S_t = alpha_t * S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
        = alpha_t * S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - alpha_t S_{t-1} k_t)
    o_t = S_t (scale * q_t),               scale = K^-0.5

Source of the algorithm: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(ICLR 2025), with the chunked form of Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length" (NeurIPS 2024); layer layout as in transformers' Qwen3NextGatedDeltaNet (the test oracle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# x * rsqrt(sum(x^2) + 1e-6) in fp32 (FLA's and transformers' convention), shared with the kernels' references
from kernels._gdn_common import l2norm as l2_normalize

if TYPE_CHECKING:  # type hints only: the rule and GatedDeltaNet need nothing from the engine
    from runners.cache import BatchMeta, GDNReplayState, GDNState
    from runners.models.config import HybridConfig

__all__ = [
    "GDNMixer",
    "GDNOutput",
    "GDNRuleInputs",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "chunk_gated_delta_rule",
    "l2_normalize",
    "recurrent_gated_delta_rule",
]


# ----------------------------------------------------------------------------------------------------------
# Functional core
# ----------------------------------------------------------------------------------------------------------


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    lengths: Tensor | None,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Validate inputs, mask right padding, repeat q / k to value heads, move heads before time, upcast.

    Returns float32 q (scaled), k: (B, HV, T, K); v: (B, HV, T, V); g, beta: (B, HV, T); state (B, HV, V, K)
    (a fresh tensor: the caller's initial_state is never written).
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (B, T, H, K); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be (B, T, HV, V) with B={B}, T={T}; got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"{name} must be (B, T, HV) = {(B, T, HV)}; got {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape != (B, HV, V, K):
        hint = ""
        if initial_state.shape == (B, HV, K, V):
            hint = " (it looks transposed: transformers keeps (B, HV, K, V); use state.transpose(-1, -2))"
        raise ValueError(
            f"initial_state must be (B, HV, V, K) = {(B, HV, V, K)}, K contiguous; "
            f"got {tuple(initial_state.shape)}{hint}"
        )

    if lengths is not None:
        if lengths.shape != (B,) or lengths.dtype.is_floating_point:
            raise ValueError(f"lengths must be an integer tensor of shape (B,) = ({B},); got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        if bool((lengths < 0).any()) or bool((lengths > T).any()):
            raise ValueError(f"lengths must lie in [0, T={T}]; got {lengths.tolist()}")
        # Right padding: g = 0 (alpha = 1), beta = 0 and k = 0 make a padded step the identity on the state;
        # q = 0 makes its output exactly 0. torch.where (not a product) also clears NaN in padded inputs.
        valid = torch.arange(T, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # (B, T)
        q, k, v = (torch.where(valid[:, :, None, None], t, torch.zeros((), dtype=t.dtype, device=t.device))
                   for t in (q, k, v))
        g, beta = (torch.where(valid[:, :, None], t, torch.zeros((), dtype=t.dtype, device=t.device))
                   for t in (g, beta))

    r = HV // H
    if r > 1:  # value head j reads key head j // r
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    scale = K**-0.5 if scale is None else scale
    q = q.float().transpose(1, 2) * scale
    k = k.float().transpose(1, 2)
    v = v.float().transpose(1, 2)
    g = g.float().transpose(1, 2)
    beta = beta.float().transpose(1, 2)
    if initial_state is None:
        state = torch.zeros(B, HV, V, K, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(device=q.device, dtype=torch.float32, copy=True)
    return q, k, v, g, beta, state


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    *,
    scale: float | None = None,
    lengths: Tensor | None = None,
    output_final_state: bool = True,
    output_intermediate_states: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gated delta rule, one token at a time: the specification (and the decode / MTP-verify path).

    Args:
        q: (B, T, H, K) queries, already L2-normalised (not yet scaled).
        k: (B, T, H, K) keys, already L2-normalised.
        v: (B, T, HV, V) values; HV must be a multiple of H (value head j reads key head j // (HV / H)).
        g: (B, T, HV) log decay, <= 0 (alpha = exp(g)).
        beta: (B, T, HV) write strength in [0, 1].
        initial_state: (B, HV, V, K), K contiguous, any float dtype; zeros if None. Never written.
        scale: multiplies q; default K ** -0.5.
        lengths: (B,) integer valid lengths of a right-padded batch (0 <= lengths <= T). Padded positions
            leave the state unchanged and output zeros.
        output_final_state: return the state after the last (valid) token.
        output_intermediate_states: also return the state after each of the T tokens.

    Returns:
        o: (B, T, HV, V) in v's dtype (accumulated in float32).
        final_state: (B, HV, V, K) float32, or None.
        intermediate_states: (B, T, HV, V, K) float32 (index t = state after token t, so index T - 1 is the
            final state; padded positions repeat the last valid state), or None.

    Raises ValueError on shape / length mismatches (with the expected layout in the message).
    """
    B, T = q.shape[:2]
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, lengths, scale)
    HV, V, K = state.shape[1:]
    o = q.new_empty(B, HV, T, V)
    inter = q.new_empty(B, T, HV, V, K) if output_intermediate_states else None
    alpha = g.exp()
    for t in range(T):
        k_t = k[:, :, t]  # (B, HV, K)
        state = state * alpha[:, :, t, None, None]
        # u_t = beta_t (v_t - alpha_t S_{t-1} k_t); S_t = alpha_t S_{t-1} + u_t k_t^T
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhvk,bhk->bhv", state, k_t))
        state = state + u[..., :, None] * k_t[..., None, :]
        o[:, :, t] = torch.einsum("bhvk,bhk->bhv", state, q[:, :, t])
        if inter is not None:
            inter[:, t] = state
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None), inter


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    output_final_state: bool = True,
    *,
    scale: float | None = None,
    lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule in chunked (WY / UT-transform) form: the prefill path; same math as the recurrent one.

    Inside a chunk of C tokens with in-chunk cumulative log decay G_i = g_1 + ... + g_i and chunk start state
    S_0, the update vectors solve a unit lower-triangular system

        u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(G_i) S_0 k_i,

    i.e. U = W_v - W_k S_0^T with W_v = L^-1 (beta v), W_k = L^-1 (beta exp(G) k) computed for all chunks at
    once; then o_i = exp(G_i) S_0 q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j and
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) u_j k_j^T. Only the chunk-to-chunk state pass is sequential.
    All exponents are <= 0 (g <= 0), so nothing overflows. T need not be a multiple of chunk_size: the tail is
    padded with identity steps (g = beta = k = 0).

    Args: as `recurrent_gated_delta_rule` (q, k L2-normalised and unscaled; state (B, HV, V, K)), plus
        chunk_size: tokens per chunk (C), >= 1.
    Returns:
        o: (B, T, HV, V) in v's dtype (float32 accumulation); final_state: (B, HV, V, K) float32 or None.
    Raises ValueError on shape / length mismatches.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    B, T = q.shape[:2]
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, lengths, scale)
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    HV, V, K = state.shape[1:]
    N = (T + pad) // C
    q, k, v = (t.reshape(B, HV, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(B, HV, N, C) for t in (g, beta))

    G = g.cumsum(dim=-1)  # (B, HV, N, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) for j <= i, else 0 (masked before exp: the upper triangle would overflow)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # Unit lower-triangular L = I + strictly-lower(beta_i exp(G_i - G_j) k_i . k_j); the solver reads only the
    # strictly lower part (unitriangular=True), so the diagonal of the product is irrelevant.
    L = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay
    W_v = torch.linalg.solve_triangular(L, beta[..., None] * v, upper=False, unitriangular=True)
    W_k = torch.linalg.solve_triangular(L, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # (B, HV, N, C, C), causal incl. diagonal
    q_dec = q * G.exp()[..., None]  # reads of the chunk start state
    k_dec = k * (G[..., -1:] - G).exp()[..., None]  # writes, decayed to the chunk end
    chunk_decay = G[..., -1].exp()  # (B, HV, N)

    o = q.new_empty(B, HV, N, C, V)
    for n in range(N):
        u = W_v[:, :, n] - W_k[:, :, n] @ state.transpose(-1, -2)  # (B, HV, C, V)
        o[:, :, n] = q_dec[:, :, n] @ state.transpose(-1, -2) + qk[:, :, n] @ u
        state = state * chunk_decay[:, :, n, None, None] + u.transpose(-1, -2) @ k_dec[:, :, n]
    o = o.reshape(B, HV, N * C, V)[:, :, :T]
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------
# The mixer layer
# ----------------------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """RMSNorm then SiLU gate, per value head: weight * x_hat * silu(z) (Qwen3-Next `linear_attn.norm`).

    The weight is a plain scale (not 1 + w as in Qwen3-Next's other norms). x, z: (..., V); output in x's
    dtype; statistics in float32 (as transformers' Qwen3NextRMSNormGated).
    """

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        in_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(in_dtype)) * F.silu(z.float())).to(in_dtype)


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

    q, k: (B, T, H, K) float32, L2-normalised, not scaled. v: (B, T, HV, V) in x's dtype.
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
    Inputs are not modified unless `inplace=True`.
    """

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

    @classmethod
    def from_config(cls, config, **kwargs) -> GatedDeltaNet:
        """Build from any object with Qwen3NextConfig's attribute names (hidden_size, linear_num_key_heads,
        linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim,
        rms_norm_eps)."""
        return cls(
            hidden_size=config.hidden_size,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            rms_norm_eps=config.rms_norm_eps,
            **kwargs,
        )

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
        *,
        inplace: bool = False,
    ) -> GDNOutput:
        """Prompt (or prompt chunk) forward over a right-padded batch, chunked rule.

        x: (B, T, D); lengths: (B,) integer valid lengths in [0, T] (None: all T valid); recurrent_state
        (B, HV, V, K) / conv_state (B, C, W - 1): the state before these tokens (None: zeros, a fresh
        request; pass both to continue a chunked prefill). Returns GDNOutput with the states after each row's
        last valid token (a row of length 0 keeps its state) and y zero at padded positions. inplace=True
        writes the new states into the given tensors (both must be given) and returns them.
        """
        return self._forward(x, recurrent_state, conv_state, lengths, chunked=True, intermediates=False,
                             inplace=inplace)

    def decode(
        self,
        x: Tensor,
        recurrent_state: Tensor,
        conv_state: Tensor,
        *,
        output_intermediate_states: bool = False,
        inplace: bool = False,
    ) -> GDNOutput:
        """T new tokens per row from the given state (T = 1: decode; T = K + 1: MTP verify), recurrent rule.

        x: (B, T, D); recurrent_state (B, HV, V, K); conv_state (B, C, W - 1). With output_intermediate_states
        the output also holds the state and conv window after each token (rewind commit: keep index
        num_accepted_tokens - 1). inplace=True writes the states after all T tokens into the given tensors.
        """
        if recurrent_state is None or conv_state is None:
            raise ValueError("decode needs recurrent_state and conv_state (use prefill for a fresh request)")
        return self._forward(x, recurrent_state, conv_state, None, chunked=False,
                             intermediates=output_intermediate_states, inplace=inplace)

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Full causal forward from a zero state (no cache): (B, T, D) -> (B, T, D)."""
        return self.prefill(x, lengths).y

    # -- stages (for callers that run the rule with their own kernel, e.g. Triton or replay) ---------------

    def rule_inputs(self, x: Tensor, conv_state: Tensor | None = None) -> GDNRuleInputs:
        """Projections, causal conv + SiLU, L2 norm, gates: everything before the gated delta rule.

        x: (B, T, D); conv_state: (B, C, W - 1) or None (zeros). Pure function of its inputs (float32 conv
        math). Returns GDNRuleInputs; q, k are L2-normalised but not scaled (the rule applies K^-0.5).
        """
        B, T, _ = x.shape
        H, HV, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed_qkv, z, b, a = self._project(x)
        # Causal depthwise conv over [previous W - 1 inputs, T new inputs].
        if conv_state is None:
            conv_in = F.pad(mixed_qkv.transpose(1, 2), (self.conv_kernel - 1, 0))  # (B, C, W - 1 + T)
        else:
            conv_in = torch.cat([conv_state.to(mixed_qkv.dtype), mixed_qkv.transpose(1, 2)], dim=-1)
        conv_out = F.silu(F.conv1d(conv_in.float(), self.conv1d.weight.float(), groups=self.conv_dim))
        q, k, v = conv_out.to(x.dtype).transpose(1, 2).split([H * K, H * K, HV * V], dim=-1)
        q = l2_normalize(q.reshape(B, T, H, K))
        k = l2_normalize(k.reshape(B, T, H, K))
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return GDNRuleInputs(q, k, v.reshape(B, T, HV, V), g, beta, z, conv_in)

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

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (B, T, D) -> mixed_qkv (B, T, C) de-interleaved [Q | K | V], z (B, T, HV, V), b, a (B, T, HV)."""
        B, T, _ = x.shape
        H, r, K, V = self.num_k_heads, self.num_v_heads // self.num_k_heads, self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(B, T, H, 2 * K + 2 * r * V)
        q, k, v, z = qkvz.split([K, K, r * V, r * V], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, H, 2 * r).split([r, r], dim=-1)
        mixed_qkv = torch.cat([q.reshape(B, T, H * K), k.reshape(B, T, H * K), v.reshape(B, T, H * r * V)],
                              dim=-1)
        return (mixed_qkv, z.reshape(B, T, H * r, V), b.reshape(B, T, H * r), a.reshape(B, T, H * r))

    def _forward(
        self,
        x: Tensor,
        recurrent_state: Tensor | None,
        conv_state: Tensor | None,
        lengths: Tensor | None,
        *,
        chunked: bool,
        intermediates: bool,
        inplace: bool,
    ) -> GDNOutput:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be (B, T, D={self.hidden_size}); got {tuple(x.shape)}")
        B, T, _ = x.shape
        self._check_state("recurrent_state", recurrent_state, self.recurrent_state_shape(B))
        self._check_state("conv_state", conv_state, self.conv_state_shape(B))
        if inplace and (recurrent_state is None or conv_state is None):
            raise ValueError("inplace=True needs both recurrent_state and conv_state to write into")
        Wm1 = self.conv_kernel - 1
        if T == 0:  # nothing to do: the state passes through (as a copy unless inplace)
            s = recurrent_state if recurrent_state is not None else x.new_zeros(self.recurrent_state_shape(B),
                                                                                  dtype=torch.float32)
            c = conv_state if conv_state is not None else x.new_zeros(self.conv_state_shape(B))
            empty = s.new_empty(B, 0, *s.shape[1:]) if intermediates else None
            empty_c = x.new_empty(B, 0, *c.shape[1:]) if intermediates else None
            return GDNOutput(x.new_zeros(B, 0, self.hidden_size), s if inplace else s.clone(),
                             c if inplace else c.clone(), empty, empty_c)

        q, k, v, g, beta, z, conv_in = self.rule_inputs(x, conv_state)
        if chunked:
            o, new_state = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state, self.chunk_size,
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
        if inplace:
            recurrent_state.copy_(new_state)
            conv_state.copy_(new_conv)
            new_state, new_conv = recurrent_state, conv_state
        return GDNOutput(y, new_state, new_conv, inter, inter_conv)


# ----------------------------------------------------------------------------------------------------------
# The engine's block: the mixer on the per-slot cache
# ----------------------------------------------------------------------------------------------------------


class GDNMixer(GatedDeltaNet):
    """The ``gdn`` block kind of the hybrid decoder: `GatedDeltaNet` reading and writing the engine's per-slot
    cache (`runners.cache.GDNState`), the counterpart of `runners.models.mamba2.Mamba2Mixer`.

    forward(hidden (B, T, D), state, meta) -> (B, T, D). Without a cache: a full causal forward from a zero
    state. With ``state`` and ``meta`` (`runners.cache.BatchMeta`) each row continues from its slot's conv
    window and recurrent state (PAD rows use the scratch row):
    - prefill (T > 1, rows right-padded to ``meta.lengths``): chunked rule; the state after each row's last
      valid token is written back (a row of length 0 keeps its state);
    - decode (T = 1): recurrent rule, state written back;
    - verify (``meta.verify``, T = K + 1): recurrent rule from the committed state, which is left alone; the
      state after each token goes to ``state.ssm_steps`` (B, T, HV, V, K) and the conv input window
      (C, W - 1 + T) to ``state.conv_steps``, so ``HybridCache.commit`` can keep the state after the
      accepted tokens (rewind, BRIEF section 4).
    Raises ValueError for a verify of T tokens when the cache keeps a different number of per-token states.
    """

    ssm_backend = "torch"  # replay verify kernels: "torch" | "triton" | "flashinfer" (the engine sets it)

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
        if hasattr(state, "history"):  # runners.cache.GDNReplayState: replay (ssm_replay=True)
            return self._forward_replay(x, state, meta)
        B, T, _ = x.shape
        rows = meta.slot_ids % state.ssm.shape[0]  # PAD (-1) -> the scratch row
        h0, conv0 = meta.rows(state.ssm), meta.rows(state.conv)
        lengths = None if meta.all_valid else meta.lengths
        q, k, v, g, beta, z, conv_in = self.rule_inputs(x, conv0)
        if meta.verify:
            if state.ssm_steps is None or state.ssm_steps.shape[1] != T:
                have = 0 if state.ssm_steps is None else state.ssm_steps.shape[1]
                raise ValueError(
                    f"verify step of T={T} tokens but the cache keeps {have} per-token states; "
                    "build the HybridCache with spec_tokens = T"
                )
            o, _, steps = recurrent_gated_delta_rule(
                q, k, v, g, beta, h0, output_final_state=False, output_intermediate_states=True
            )
            state.ssm_steps.index_copy_(0, rows, steps.to(state.ssm.dtype))
            state.conv_steps.index_copy_(0, rows, conv_in.to(state.conv.dtype))
            return self.output(o, z)
        if T == 1 and lengths is None:
            o, h, _ = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
        else:
            o, h = chunk_gated_delta_rule(q, k, v, g, beta, h0, self.chunk_size, lengths=lengths)
        state.ssm.index_copy_(0, rows, h.to(state.ssm.dtype))
        new_conv = self.conv_state_after(conv_in, T if lengths is None else lengths)
        state.conv.index_copy_(0, rows, new_conv.to(state.conv.dtype))
        return self.output(o, z, lengths)

    def _forward_replay(self, x: Tensor, state: GDNReplayState, meta: BatchMeta) -> Tensor:
        """The cached forward on a `runners.cache.GDNReplayState`. A verify reads the committed conv window
        at the slot's offset, replays (the Triton kernel of ``kernels/gdn_replay.py``, or its vectorised
        PyTorch reference for ``ssm_backend`` "torch"; FlashInfer has no GDN kernel) and stores the new
        window after its first column; a prefill / decode (only at PNAT = 0, right after admission) works as
        the rewind layout does on the first W - 1 conv columns."""
        B, T, _ = x.shape
        W1 = self.conv_kernel - 1
        rows = meta.slot_ids % state.ssm.shape[0]  # PAD (-1) -> the scratch row
        slots = state.slots
        if not meta.verify:
            if bool(slots.prev_num_accepted[rows].any()):
                raise RuntimeError(
                    "a non-verify forward on a replay cache row whose state lags by pending accepted tokens; "
                    "with ssm_replay every step after prefill must be a verify (T = K + 1)"
                )
            conv = state.conv[..., :W1]
            lengths = None if meta.all_valid else meta.lengths
            q, k, v, g, beta, z, conv_in = self.rule_inputs(x, meta.rows(conv))
            h0 = meta.rows(state.ssm)
            if T == 1 and lengths is None:
                o, h, _ = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
            else:
                o, h = chunk_gated_delta_rule(q, k, v, g, beta, h0, self.chunk_size, lengths=lengths)
            state.ssm.index_copy_(0, rows, h.to(state.ssm.dtype))
            new_conv = self.conv_state_after(conv_in, T if lengths is None else lengths)
            conv.index_copy_(0, rows, new_conv.to(conv.dtype))
            return self.output(o, z, lengths)
        if T > state.history.u.shape[2]:
            raise ValueError(
                f"verify step of T={T} tokens but the replay history keeps {state.history.u.shape[2]}; "
                "build the HybridCache with spec_tokens = T"
            )
        cols = slots.conv_offset(rows)[:, None] + torch.arange(W1, device=x.device)
        conv0 = meta.rows(state.conv).gather(2, cols[:, None, :].expand(B, state.conv.shape[1], W1))
        q, k, v, g, beta, z, conv_in = self.rule_inputs(x, conv0)
        if self.ssm_backend == "torch":
            from kernels.gdn_replay import gdn_replay_verify_ref as fn
        else:
            from kernels.gdn_replay import gdn_replay_verify as fn
        o = fn(q, k, v, g, beta, state.ssm, state.history, meta.slot_ids.to(torch.int32),
               slots.prev_num_accepted, slots.buffer_index, use_qk_l2norm_in_kernel=False)
        slots.verified = True
        state.conv.index_copy_(0, rows, conv_in[:, :, 1:].to(state.conv.dtype))
        return self.output(o, z)
