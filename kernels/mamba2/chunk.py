"""Mamba2 chunked SSD scan in plain PyTorch: the prefill path of every device (no Triton kernel yet).

Algorithm: the state-space dual (SSD) form of Mamba2 (Dao & Gu, "Transformers are SSMs", ICML 2024): inside a
chunk of L tokens the outputs are a masked (L, L) matrix product, and only the chunk-to-chunk state pass is
sequential. It computes the same recurrence as `kernels.mamba2.recurrent.ssm_recurrent_scan` (one step per
token); tests hold the two together. A Triton chunked kernel (mamba_ssm's `mamba_chunk_scan_combined`) would go
beside it with this function as its reference.

Shapes: B batch, T tokens, H heads, P head_dim, N d_state, G ngroups (head h uses group h // (H / G)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan (no D skip, no gate). Computes in float32.

    Args:
        x: (B, T, H, P) inputs.
        dt: (B, T, H) processed time steps dt' (after softplus, clamp and padding mask; 0 = no-op column).
        A: (H,) negative decay rates.
        B, C: (B, T, G, N) input / output projections; head h uses group h // (H / G).
        chunk_size: tokens per chunk (the config's ``chunk_size``); T need not be a multiple.
        initial_state: (B, H, P, N) state before column 0, or None for zeros. Never written.

    Returns:
        y: (B, T, H, P) float32, and final_state: (B, H, P, N) float32 after column T - 1.
    """
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    L = chunk_size
    pad = (-T) % L
    nc = (T + pad) // L
    head_group = torch.arange(H, device=x.device) // (H // G)
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))  # dt' = 0: padded columns are no-ops
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    x = x.view(b, nc, L, H, P)
    dt = dt.view(b, nc, L, H)
    B = B.view(b, nc, L, G, N)
    C = C.view(b, nc, L, G, N)
    cum = torch.cumsum(dt * A.float(), dim=2)  # (b, nc, L, H): sum_{i<=l} A dt'_i within the chunk
    xdt = x * dt[..., None]  # dt'_s x_s
    # Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt'_s x_s.
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # (b, nc, L, S, H)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    CB = torch.einsum("bclgn,bcsgn->bclsg", C, B)[..., head_group]  # (b, nc, L, S, H)
    y = torch.einsum("bclsh,bcshp->bclhp", CB * decay, xdt)
    # State contributed by each chunk alone: sum_s exp(cum_last - cum_s) dt'_s x_s (outer) B_s.
    B_h = B[:, :, :, head_group]  # (b, nc, L, H, N)
    decay_to_end = torch.exp(cum[:, :, -1:, :] - cum)  # (b, nc, L, H)
    chunk_states = torch.einsum("bclh,bclhp,bclhn->bchpn", decay_to_end, xdt, B_h)
    # Recurrence over chunks: the state entering chunk c, then its contribution to the outputs.
    state = x.new_zeros(b, H, P, N) if initial_state is None else initial_state.float()
    chunk_decay = torch.exp(cum[:, :, -1, :])  # (b, nc, H)
    entering = []
    for c in range(nc):
        entering.append(state)
        state = state * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # (b, nc, H, P, N)
    C_h = C[:, :, :, head_group]  # (b, nc, L, H, N)
    y = y + torch.einsum("bclhn,bchpn->bclhp", C_h, entering) * torch.exp(cum)[..., None]
    y = y.reshape(b, nc * L, H, P)[:, :T]
    return y, state
