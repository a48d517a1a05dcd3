"""Shared blocks of the hybrid decoders: norms, attention with a by-position KV cache, relu2 MLP, latent MoE.

Each module's math is checked against transformers 5's ``modeling_nemotron_h.py`` (the test oracle);
parameter names equal the checkpoint's names below ``mixer.`` so the weight map stays a plain rename.
Shapes: B batch, T tokens, D hidden, Hq query heads, KVH key/value heads, E routed experts, k top-k,
L latent size (= D without a latent projection), I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runners.cache import BatchMeta, KVCache
from runners.models.config import HybridConfig


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32, returned in the input dtype:
    ``(offset + w) * x / rms(x)``; ``offset`` is 0 for NemotronH and 1 for Qwen3-Next's ``(1 + w)`` norms."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (scale * xf).to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """Mamba2 output norm: ``w * groupnorm_rms(y * silu(z))`` (gate before the norm), RMS taken per group of
    ``group_size`` channels (d_inner / n_groups). y, z: [..., d_inner]; returns float32 [..., d_inner]."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y.float() * F.silu(z.float())
        g = y.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * g.flatten(-2)


class Attention(nn.Module):
    """Causal GQA self-attention without positional encoding (NemotronH applies no RoPE: transformers'
    NemotronHAttention defines apply_rotary_pos_emb but never calls it). Scale head_dim^-0.5.

    forward(hidden [B, T, D], kv, meta) -> [B, T, D]. With ``kv`` (a :class:`KVCache`) and ``meta``, the keys
    and values of valid columns are written at positions ``start_pos + t`` of their slot (padding columns go
    to the scratch row) and every query attends to its request's cached positions ``<= start_pos + t``.
    Without a cache it is a plain causal forward over the T columns.
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(self, hidden: torch.Tensor, kv: KVCache | None = None, meta: BatchMeta | None = None):
        b, T, _ = hidden.shape
        q = self.q_proj(hidden).view(b, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(b, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(b, T, self.num_kv_heads, self.head_dim)
        if kv is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        else:
            rows = kv.k.shape[0]
            offs = torch.arange(T, device=hidden.device)
            pos = meta.start_pos[:, None] + offs  # (B, T) absolute positions
            slot_rows = (meta.slot_ids % rows)[:, None].expand(b, T)
            if meta.all_valid:
                w_rows, w_pos = slot_rows, pos
            else:
                valid = meta.valid(T)
                w_rows = torch.where(valid, slot_rows, rows - 1)  # padding columns -> scratch row
                w_pos = torch.where(valid, pos, 0)
            kv.k[w_rows, w_pos] = k.to(kv.k.dtype)
            kv.v[w_rows, w_pos] = v.to(kv.v.dtype)
            kv_len = meta.max_kv_len or int((meta.start_pos + meta.lengths).max())
            keys = meta.rows(kv.k)[:, :kv_len].transpose(1, 2)  # (B, KVH, S_k, hd)
            values = meta.rows(kv.v)[:, :kv_len].transpose(1, 2)
            mask = torch.arange(kv_len, device=hidden.device)[None, None, :] <= pos[:, :, None]  # (B, T, S_k)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys.to(q.dtype),
                values.to(q.dtype),
                attn_mask=mask[:, None],
                enable_gqa=True,
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))


class MLP(nn.Module):
    """Non-gated MLP ``down(relu(up(x))^2)`` (NemotronH ``mlp`` blocks and shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class TopkRouter(nn.Module):
    """Sigmoid top-k router with a selection-only score correction (DeepSeek-V3 style, as NemotronH).

    forward(x [N, D]) -> (weights [N, k] float32, indices [N, k] int64). Scores are sigmoid(x W^T) in
    float32; ``e_score_correction_bias`` is added for choosing experts only; with n_group > 1 only the
    ``topk_group`` groups with the best top-2 score sums are eligible; the chosen raw scores are renormalised
    (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``. ``weight`` and the bias stay float32.
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        self.top_k, self.num_experts = c.num_experts_per_tok, c.n_routed_experts
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = c.norm_topk_prob, c.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, n_group)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices


class MoE(nn.Module):
    """NemotronH latent MoE: routed relu2 experts run in the latent space between ``fc1_latent_proj``
    (D -> L) and ``fc2_latent_proj`` (L -> D); the shared expert acts on the un-projected input.

    Expert weights are stacked: ``experts_up`` [E, I, L], ``experts_down`` [E, L, I] (the checkpoint holds
    them per expert as ``experts.{e}.up_proj.weight`` / ``down_proj.weight``; the loader stacks them).
    forward(x [B, T, D]) -> [B, T, D].
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        latent = c.moe_latent_size if c.moe_latent_size is not None else c.hidden_size
        self.gate = TopkRouter(c)
        self.experts_up = nn.Parameter(torch.zeros(c.n_routed_experts, c.moe_intermediate_size, latent))
        self.experts_down = nn.Parameter(torch.zeros(c.n_routed_experts, latent, c.moe_intermediate_size))
        self.shared_experts = MLP(c.hidden_size, c.moe_shared_expert_intermediate_size, c.mlp_bias)
        if c.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(c.hidden_size, latent, bias=c.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, c.hidden_size, bias=c.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        h = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = self._experts(h, weights, indices)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return (routed + self.shared_experts(flat)).view(shape)

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * down(relu(up(h))^2); h [N, L] -> [N, L]."""
        n, k = indices.shape
        expert = indices.flatten()
        order = torch.argsort(expert, stable=True)
        token = order // k  # token of each (token, choice) pair in expert order
        w = weights.flatten()[order]
        counts = torch.bincount(expert, minlength=self.experts_up.shape[0]).tolist()
        out = torch.zeros(n, h.shape[-1], dtype=torch.float32, device=h.device)
        start = 0
        for e, cnt in enumerate(counts):
            if cnt == 0:
                continue
            tok = token[start : start + cnt]
            y = torch.square(F.relu(h[tok] @ self.experts_up[e].T)) @ self.experts_down[e].T
            out.index_add_(0, tok, y.float() * w[start : start + cnt, None])
            start += cnt
        return out.to(h.dtype)
