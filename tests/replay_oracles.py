"""Token-by-token oracles of the replay verify steps, one Python iteration per batch row, and the
"materialised" state a replay slot stands for (its pending tokens fast-forwarded), for comparing replay with
rewind between steps.

The kernels' PyTorch references (`kernels.mamba2.replay_verify_ref`, `kernels.gdn.replay_verify_ref`) are
vectorised over the batch, because the CPU engine runs them every decode step. These slower oracles are
written differently (host reads of PNAT per row, the old tokens replayed one at a time instead of the closed
form) and the tests hold both the references and the Triton kernels to them.
"""

from __future__ import annotations

import torch

from kernels.gdn._common import check_gdn_inputs, check_state, l2norm
from kernels.gdn.replay import _check_replay_buffers
from kernels.mamba2.recurrent import _NO_LIMIT, _check_inputs, _process_dt
from kernels.mamba2.replay import ReplayHistory, _check_history


def mamba2_fast_forward(hs, history, s, r, k, A):
    """hs (H, P, N) fp32 advanced one token at a time by the first k history tokens of slot s, buffer r."""
    hpg = hs.shape[0] // history.B.shape[3]
    xr = 0 if history.checkpointing else r
    for j in range(k):
        dtj = history.dt[s, r, :, j]  # (H,)
        Bj = history.B[s, r, j].float().repeat_interleave(hpg, dim=0)  # (H, N)
        xj = history.x[s, xr, j].float()  # (H, P)
        hs = hs * torch.exp(A.float() * dtj)[:, None, None] + (dtj[:, None] * xj)[..., None] * Bj[:, None, :]
    return hs


def mamba2_materialized_state(state, history, prev_num_accepted, buffer_index, A) -> torch.Tensor:
    """float32 (S, H, P, N): every slot's Mamba2 state advanced by its first PNAT[s] history tokens of buffer
    buffer_index[s], one token at a time, without mutating anything (what rewind would hold)."""
    L = history.x.shape[2]
    res = state.float().clone()
    for s in range(state.shape[0]):
        k = min(max(int(prev_num_accepted[s]), 0), L)
        res[s] = mamba2_fast_forward(res[s], history, s, int(buffer_index[s]) & 1, k, A)
    return res


def gdn_materialized_state(state, history, prev_num_accepted, buffer_index) -> torch.Tensor:
    """float32 (S, HV, V, K): every slot's GDN state after its first PNAT[s] history tokens, one token at a
    time (S <- exp(g_j) S + u_j k_j^T with g_j = G_j - G_{j-1}), without mutating anything."""
    TH, HV, H = history.u.shape[2], history.u.shape[3], history.k.shape[3]
    res = state.float().clone()
    for s in range(state.shape[0]):
        n, r = min(max(int(prev_num_accepted[s]), 0), TH), int(buffer_index[s]) & 1
        G_prev = torch.zeros(HV, device=state.device)
        for j in range(n):
            G = history.g[s, r, j].float()
            kj = history.k[s, r, j].float().repeat_interleave(HV // H, dim=0)  # (HV, K)
            uj = history.u[s, r, j].float()  # (HV, V)
            res[s] = res[s] * torch.exp(G - G_prev)[:, None, None] + uj[:, :, None] * kj[:, None, :]
            G_prev = G
    return res


def materialized_conv(layer_state) -> torch.Tensor:
    """(S + 1, C, W - 1): every slot's committed conv window of a replay layer state, read at its offset."""
    R, C, _ = layer_state.conv.shape
    W1 = layer_state.conv.shape[-1] - (layer_state.slots.spec_tokens - 1)
    rows = torch.arange(R, device=layer_state.conv.device)
    cols = layer_state.slots.conv_offset(rows)[:, None] + torch.arange(W1, device=layer_state.conv.device)
    return layer_state.conv.gather(2, cols[:, None, :].expand(R, C, W1))


def mamba2_replay_verify_oracle(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    slot_ids: torch.Tensor,
    history: ReplayHistory,
    prev_num_accepted: torch.Tensor,
    buffer_index: torch.Tensor,
    *,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
    block_p: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Token-by-token oracle of `replay_verify` / `replay_verify_ref` (same arguments and effects).

    Independent of their closed form: the fast-forward replays the old tokens one at a time with exp(A dt'_j)
    from `history.dt`, and the outputs run the recurrence token by token, one Python iteration per row.
    """
    del block_p, num_warps
    name = "mamba2_replay_verify_oracle"
    S, H, P, N, Bsz, T, G = _check_inputs(state, x, dt, A, B, C, D, dt_bias, slot_ids, name)
    L = _check_history(state, x, B, history, prev_num_accepted, buffer_index, name)
    if out is None:
        out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    out.zero_()
    hpg = H // G
    A = A.float()
    ckpt = history.checkpointing
    for b in (slot_ids >= 0).nonzero().squeeze(1).tolist():
        s = int(slot_ids[b])
        k = min(max(int(prev_num_accepted[s]), 0), L)
        r = int(buffer_index[s]) & 1
        w = 1 - r
        flush = not ckpt or k + T > L  # per-step replay always folds the accepted tokens into the state
        hs = mamba2_fast_forward(state[s].float(), history, s, r, k, A)
        if flush and k > 0:
            state[s] = hs.to(state.dtype)
            hs = state[s].float()
        dtp = _process_dt(dt[b], dt_bias, time_step_limit)  # (T, H)
        Bh = B[b].float().repeat_interleave(hpg, dim=1)  # (T, H, N)
        Ch = C[b].float().repeat_interleave(hpg, dim=1)
        xb = x[b].float()
        for t in range(T):
            dx = (dtp[t][:, None] * xb[t])[..., None]  # (H, P, 1)
            hs = hs * torch.exp(A * dtp[t])[:, None, None] + dx * Bh[t][:, None, :]
            y = (hs * Ch[t][:, None, :]).sum(-1)
            if D is not None:
                y = y + D.float()[:, None] * xb[t]
            out[b, t] = y.to(out.dtype)
        base, cum_base = (0, 0.0) if flush else (k, history.dA_cumsum[s, r, :, k - 1 : k] if k else 0.0)
        if ckpt and not flush:  # the pending tokens stay: copy them into the buffer written now
            history.B[s, w, :k] = history.B[s, r, :k]
            history.dt[s, w, :, :k] = history.dt[s, r, :, :k]
            history.dA_cumsum[s, w, :, :k] = history.dA_cumsum[s, r, :, :k]
        pos = slice(base, base + T)
        history.x[s, 0 if ckpt else w, pos] = x[b].to(history.x.dtype)
        history.B[s, w, pos] = B[b].to(history.B.dtype)
        history.dt[s, w, :, pos] = dtp.T
        history.dA_cumsum[s, w, :, pos] = cum_base + torch.cumsum(A[:, None] * dtp.T, dim=1)
    return out


def gdn_replay_verify_oracle(
    q, k, v, g, beta, state, history, slot_ids, pnat, buf_idx, *, scale=None, use_qk_l2norm_in_kernel=True,
    out=None, block_v=16, num_warps=None,
):
    """Token-by-token oracle of kernels.gdn.replay_verify / replay_verify_ref (same signature, same
    mutations): one Python iteration per row, the new tokens by the recurrence one at a time."""
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta, slot_ids)
    check_state(state, HV, V, K)
    TH = _check_replay_buffers(history, pnat, buf_idx, T, H, HV, K, V)
    out = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
    scale = K**-0.5 if scale is None else scale
    r = HV // H
    kn = l2norm(k) if use_qk_l2norm_in_kernel else k.float()  # (B, T, H, K)
    qf = (l2norm(q) if use_qk_l2norm_in_kernel else q.float()).repeat_interleave(r, dim=2) * scale
    kf = kn.repeat_interleave(r, dim=2)
    for b in range(B):
        slot = int(slot_ids[b])
        if slot < 0:
            out[b] = 0
            continue
        n_old, old = min(max(int(pnat[slot]), 0), TH), int(buf_idx[slot]) & 1
        new = 1 - old
        s = state[slot].float()  # (HV, V, K)
        if n_old > 0:
            G = history.g[slot, old, :n_old].float()  # (n_old, HV)
            c = torch.exp(G[-1] - G)  # (n_old, HV)
            U = history.u[slot, old, :n_old].float() * c[:, :, None]  # (n_old, HV, V)
            Kh = history.k[slot, old, :n_old].float().repeat_interleave(r, dim=1)  # (n_old, HV, K)
            s = s * torch.exp(G[-1])[:, None, None] + torch.einsum("jhv,jhk->hvk", U, Kh)
            state[slot] = s.to(state.dtype)
        G_cum = torch.zeros(HV, device=g.device)
        for t in range(T):
            s = s * g[b, t].float().exp()[:, None, None]
            u = beta[b, t].float()[:, None] * (v[b, t].float() - torch.einsum("hvk,hk->hv", s, kf[b, t]))
            s = s + u[:, :, None] * kf[b, t][:, None, :]
            out[b, t] = torch.einsum("hvk,hk->hv", s, qf[b, t]).to(out.dtype)
            G_cum = G_cum + g[b, t].float()
            history.u[slot, new, t] = u.to(history.u.dtype)
            history.k[slot, new, t] = kn[b, t].to(history.k.dtype)
            history.g[slot, new, t] = G_cum
    return out


def mamba2_checkpointing_case(shape, state_dtype, in_dtype, seed, slots_extra=3) -> list:
    """A random Mamba2 checkpointing-replay verify case on the CPU, in replay_verify's argument order
    [state, x, dt, A, B, C, D, dt_bias, slot_ids, history, pnat, buffer_index]: ``shape`` (batch, T, heads,
    head_dim, d_state, groups, L), batch + ``slots_extra`` slots, x / dt / B / C and the history in
    ``in_dtype``, the state in ``state_dtype``; one PAD row, slot 0 live, PNAT with garbage outside [0, L] and
    at least one row without and one with a flush, buffer_index any int32."""
    Bsz, T, H, P, N, G, L = shape
    S = Bsz + slots_extra
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    A = -torch.exp(torch.rand(H, generator=g) * 2 - 1)
    D, dt_bias = r(H), torch.rand(H, generator=g) - 0.5
    x, dt = r(Bsz, T, H, P).to(in_dtype), (r(Bsz, T, H) * 0.5 - 1.0).to(in_dtype)
    B, C = (r(Bsz, T, G, N) / N**0.5).to(in_dtype), (r(Bsz, T, G, N) / N**0.5).to(in_dtype)
    hist = ReplayHistory.allocate(S, L, H, P, G, N, dtype=in_dtype, device="cpu", checkpointing=True)
    hist.x.copy_(r(*hist.x.shape))
    hist.B.copy_(r(*hist.B.shape) / N**0.5)
    hist.dt.copy_(torch.rand(hist.dt.shape, generator=g) * 0.9 + 0.1)
    hist.dA_cumsum.copy_(torch.cumsum(A[:, None] * hist.dt, dim=-1))
    slot_ids = (1 + torch.randperm(S - 1, generator=g)[:Bsz]).to(torch.int32)
    slot_ids[1] = -1
    slot_ids[min(3, Bsz - 1)] = 0
    pnat = torch.randint(-3, L + 6, (S,), generator=g, dtype=torch.int32)
    bufidx = torch.randint(-2, 4, (S,), generator=g, dtype=torch.int32)
    pnat[slot_ids[0]], pnat[slot_ids[2]] = min(2, L - T), L
    state = r(S, H, P, N).to(state_dtype)
    return [state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx]
