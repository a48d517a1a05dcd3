"""Mamba2 mixer (NemotronH ``backbone.layers.N.mixer``) and its scan ops in plain PyTorch.

Algorithm: Mamba2 / SSD (Dao & Gu 2024, "Transformers are SSMs"), as implemented by the NemotronH mixer of
transformers 5 (``modeling_nemotron_h.py``, the test oracle). Per head h (group g = h // (H / G)):
dt' = clamp(softplus(dt + dt_bias), time_step_limit); dA = exp(A_h dt'), A = -exp(A_log);
state <- state * dA + dt' x (outer) B_g; y = C_g . state + D_h x; then y = grouped_rmsnorm(y * silu(z)).

The dt clamp is the config's ``time_step_limit`` in every path (released configs and transformers 5's
default: [0, inf], a no-op). Note: transformers 5 itself clamps its chunked (prefill) path to
(time_step_min, inf) and its single-token decode path not at all, so it disagrees with itself when
softplus(dt + dt_bias) < time_step_min; we keep prefill and decode consistent (the test weights stay above).

Replay (``ssm_replay=True``, a :class:`runners.cache.Mamba2ReplayState`): a verify fast-forwards the committed
state by the tokens accepted last step and records the new tokens' inputs, with the Triton kernel of
``kernels/mamba2_replay.py`` or, for ``ssm_backend`` "torch", its vectorised PyTorch reference
``replay_verify_ref``; the conv window is read at the slot's offset instead of being copied at commit.

Two scan paths compute the same recurrence: :func:`ssd_chunked_scan` (prefill; quadratic inside chunks of
``chunk_size``, a recurrence over chunk states) and :func:`ssm_recurrent_scan` (decode / verify; one step per
token, optionally returning every intermediate state for a speculative verify). Right-padded columns are
made no-ops by setting their dt' to 0 (dA = 1 and no input), so a batch of different prompt lengths leaves
each request's state exactly where its own last token left it.

Shapes: B batch, T tokens, H heads, P head_dim, N d_state, G ngroups, W conv_kernel, C conv channels.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from runners.cache import BatchMeta, Mamba2ReplayState, Mamba2State
from runners.models.config import HybridConfig
from runners.models.layers import GatedGroupRMSNorm

log = logging.getLogger(__name__)


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
        initial_state: (B, H, P, N) state before column 0, or None for zeros.

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


def ssm_recurrent_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    return_intermediate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token-by-token SSM recurrence (no D skip, no gate); float32 math. Does not mutate ``state``.

    Args:
        x: (B, T, H, P); dt: (B, T, H) processed dt' (0 = no-op column); A: (H,);
        B, C: (B, T, G, N); state: (B, H, P, N) state before column 0 (any float dtype).
        return_intermediate: also return the state after every column (what a rewind verify keeps).

    Returns:
        y: (B, T, H, P) float32; final state (B, H, P, N) float32; intermediate states (B, T, H, P, N)
        float32 or None.
    """
    H, G = x.shape[2], B.shape[2]
    rep = H // G
    h = state.float()
    dA = torch.exp(dt.float() * A.float())  # (B, T, H)
    xdt = x.float() * dt.float()[..., None]
    Bh = B.float().repeat_interleave(rep, dim=2)  # (B, T, H, N)
    Ch = C.float().repeat_interleave(rep, dim=2)
    ys, states = [], []
    for t in range(x.shape[1]):
        h = h * dA[:, t, :, None, None] + xdt[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
        if return_intermediate:
            states.append(h)
    y = torch.stack(ys, dim=1)
    return y, h, (torch.stack(states, dim=1) if return_intermediate else None)


class Mamba2Mixer(nn.Module):
    """NemotronH Mamba2 mixer: in_proj -> causal conv + SiLU -> SSM (+ D skip) -> gated grouped RMSNorm
    -> out_proj. Parameter names and shapes equal the checkpoint's (``mixer.in_proj.weight`` etc.).

    forward(hidden [B, T, D], state, meta) -> [B, T, D]. With ``state`` (a :class:`Mamba2State`) and
    ``meta`` the layer starts from the cached conv window and SSM state of ``meta.slot_ids`` and writes the
    state after each row's last valid column back (PAD rows write the scratch row); with ``meta.verify`` it
    writes the per-token states to the rewind buffers instead and leaves the committed state alone. Without
    a cache it runs from a zero state and keeps nothing (a full forward). ``chunk_size`` (the prefill scan's
    chunk) may be changed after construction: the result is the same up to float rounding. With a
    :class:`runners.cache.Mamba2ReplayState` a verify replays instead (see the module docstring); a
    non-verify forward then requires PNAT = 0 (prefill after admission). ``ssm_backend`` ("torch" default,
    "triton", "flashinfer") picks the verify implementation (:meth:`_verify_ssm`).
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        self.num_heads, self.head_dim = c.mamba_num_heads, c.mamba_head_dim
        self.n_groups, self.d_state = c.n_groups, c.ssm_state_size
        self.d_inner, self.conv_dim, self.conv_kernel = c.mamba_d_inner, c.mamba_conv_dim, c.conv_kernel
        self.chunk_size = c.chunk_size
        self.ssm_backend = "torch"  # verify kernels: "torch" | "triton" | "flashinfer" (set by the engine)
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

    def _conv(self, xBC: torch.Tensor, state: Mamba2State | None, meta: BatchMeta | None) -> torch.Tensor:
        """Causal depthwise conv + SiLU over xBC [B, T, C] -> [B, T, C]. Updates ``state.conv`` of the batch's
        slots (or, in a rewind verify step, stores the whole window in ``state.conv_steps``; in a replay
        verify, reads the committed window at the slot's offset and stores the new one, see
        :class:`runners.cache.Mamba2ReplayState`)."""
        b, T, _ = xBC.shape
        W1 = self.conv_kernel - 1
        weight = self.conv1d.weight[:, 0, :]  # (C, W)
        replay = isinstance(state, Mamba2ReplayState)
        conv = None if state is None else state.conv[..., :W1] if replay else state.conv
        rows = None if state is None else meta.slot_ids % state.conv.shape[0]  # PAD -> the scratch row
        if state is None:
            prev = xBC.new_zeros(b, self.conv_dim, W1)
        elif replay and meta.verify:  # the W - 1 inputs before the next token: columns off .. off + W - 2
            cols = state.slots.conv_offset(rows)[:, None] + torch.arange(W1, device=xBC.device)
            prev = meta.rows(state.conv).gather(2, cols[:, None, :].expand(b, self.conv_dim, W1))
        else:
            prev = meta.rows(conv)
        window = torch.cat([prev, xBC.transpose(1, 2).to(prev.dtype)], dim=-1)  # (B, C, W - 1 + T)
        if T == 1:
            out = torch.einsum("bcw,cw->bc", window, weight)[:, None, :]
            if self.conv1d.bias is not None:
                out = out + self.conv1d.bias
        else:
            out = F.conv1d(window, weight[:, None, :], self.conv1d.bias, groups=self.conv_dim).transpose(1, 2)
        if state is not None and meta.verify and replay:
            # column 0 is never read again: after a >= 1 accepted tokens the window is columns a .. a + W - 2
            state.conv.index_copy_(0, rows, window[:, :, 1:].to(state.conv.dtype))
        elif state is not None and meta.verify:
            state.conv_steps.index_copy_(0, rows, window.to(state.conv.dtype))
        elif state is not None:
            if meta.all_valid:
                new = window[:, :, T:]
            else:  # the W - 1 inputs before each row's length: columns lengths .. lengths + W - 2 of window
                idx = meta.lengths[:, None] + torch.arange(W1, device=xBC.device)
                new = window.gather(2, idx[:, None, :].expand(b, self.conv_dim, W1))
            conv.index_copy_(0, rows, new.to(conv.dtype))
        return F.silu(out)

    def _verify_ssm(self, state, meta, x, dt, A, Bm, Cm) -> torch.Tensor:
        """The SSM of a verify step through the mixer's ``ssm_backend``; returns y (B, T, H, P) incl. D x.

        Replay: the kernel's PyTorch reference ``replay_verify_ref`` ("torch") or the Triton replay kernel
        ("triton", and "flashinfer" as in TensorRT-LLM, whose FlashInfer backend also replays with its own
        kernel). Rewind: the per-token states go to ``state.ssm_steps`` by slot: PyTorch recurrence ("torch"),
        our Triton ``selective_state_update`` ("triton") or FlashInfer's ("flashinfer").
        """
        backend = self.ssm_backend
        args = (x, dt, A, Bm, Cm, self.D, self.dt_bias)
        if isinstance(state, Mamba2ReplayState):
            slots = state.slots
            if backend == "torch":
                from kernels.mamba2_replay import replay_verify_ref as fn
            else:
                from kernels.mamba2_replay import replay_verify as fn
            y = fn(state.ssm, *args, meta.slot_ids, state.history, slots.prev_num_accepted,
                   slots.buffer_index, time_step_limit=self.time_step_limit)
            slots.verified = True
            return y.float()
        if backend == "flashinfer":
            return _flashinfer_rewind_verify(state, meta, *args, self.time_step_limit).float()
        if backend == "triton":
            from kernels.mamba2_ssu import selective_state_update

            if meta.slot_start is not None:  # the rows' per-token states as a view: written in place
                inter = state.ssm_steps[meta.slot_start : meta.slot_start + x.shape[0]]
            else:
                inter = x.new_empty(x.shape[0], *state.ssm_steps.shape[1:], dtype=state.ssm_steps.dtype)
            y = selective_state_update(state.ssm, *args, meta.slot_ids, intermediate_states=inter,
                                       update_state=False, time_step_limit=self.time_step_limit)
            if meta.slot_start is None:
                state.ssm_steps.index_copy_(0, meta.slot_ids % state.ssm.shape[0], inter)
            return y.float()
        dtp = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        y, _, steps = ssm_recurrent_scan(x, dtp, A, Bm, Cm, meta.rows(state.ssm), return_intermediate=True)
        state.ssm_steps.index_copy_(0, meta.slot_ids % state.ssm.shape[0], steps.to(state.ssm.dtype))
        return y + x.float() * self.D.float()[:, None]

    def forward(
        self, hidden: torch.Tensor, state: Mamba2State | None = None, meta: BatchMeta | None = None
    ) -> torch.Tensor:
        b, T, _ = hidden.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        z, xBC, dt = self.in_proj(hidden).split([self.d_inner, self.conv_dim, H], dim=-1)
        replay = isinstance(state, Mamba2ReplayState)
        if replay:
            if meta.verify and T > state.history.x.shape[2]:
                raise ValueError(
                    f"verify step of T={T} tokens but the replay history keeps {state.history.x.shape[2]}; "
                    "build the HybridCache with spec_tokens = T"
                )
            pnat = state.slots.prev_num_accepted[meta.slot_ids % state.ssm.shape[0]]
            if not meta.verify and bool(pnat.any()):
                raise RuntimeError(
                    "a non-verify forward on a replay cache row whose state lags by pending accepted tokens; "
                    "with ssm_replay every step after prefill must be a verify (T = K + 1)"
                )
        elif state is not None and meta.verify and (state.ssm_steps is None or state.ssm_steps.shape[1] != T):
            have = 0 if state.ssm_steps is None else state.ssm_steps.shape[1]
            raise ValueError(
                f"verify step of T={T} tokens but the cache keeps {have} per-token states; "
                "build the HybridCache with spec_tokens = T"
            )
        xBC = self._conv(xBC, state, meta)
        x, Bm, Cm = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        x, Bm, Cm = x.reshape(b, T, H, P), Bm.reshape(b, T, G, N), Cm.reshape(b, T, G, N)
        A = -torch.exp(self.A_log.float())
        if state is not None and meta.verify:
            y = self._verify_ssm(state, meta, x, dt, A, Bm, Cm)
        else:
            dt = F.softplus(dt.float() + self.dt_bias.float())
            lo, hi = self.time_step_limit
            if lo > 0.0 or hi != float("inf"):
                dt = dt.clamp(min=lo, max=hi)
            if meta is not None and not meta.all_valid:
                dt = dt * meta.valid(T)[..., None]  # dt' = 0 on right padding: the state passes unchanged
            h0 = None if state is None else meta.rows(state.ssm)
            if T == 1 and h0 is not None:
                y, h, _ = ssm_recurrent_scan(x, dt, A, Bm, Cm, h0)
            else:
                y, h = ssd_chunked_scan(x, dt, A, Bm, Cm, self.chunk_size, h0)
            if state is not None:
                state.ssm.index_copy_(0, meta.slot_ids % state.ssm.shape[0], h.to(state.ssm.dtype))
            y = y + x.float() * self.D.float()[:, None]
        y = self.norm(y.reshape(b, T, self.d_inner), z)
        return self.out_proj(y.to(hidden.dtype))


def _tied(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """FlashInfer's tie_hdim layout: a per-head value broadcast over head_dim (and d_state) by stride 0."""
    return t.reshape(*t.shape, *([1] * (len(shape) - t.dim()))).expand(shape)


def _flashinfer_rewind_verify(state, meta, x, dt, A, Bm, Cm, D, dt_bias, time_step_limit) -> torch.Tensor:
    """Rewind verify with FlashInfer's ``selective_state_update`` (multi-token, intermediate states by slot,
    stored state untouched): the GPU rewind baseline. Returns y (B, T, H, P) incl. D x."""
    import flashinfer.mamba as fim

    if time_step_limit != (0.0, math.inf):
        raise ValueError("FlashInfer's kernel does not clamp dt (time_step_limit); use ssm_backend='triton'")
    b, T, H, P = x.shape
    N = state.ssm.shape[-1]
    slots = (meta.slot_ids % state.ssm.shape[0]).to(torch.int32)  # PAD -> the scratch row (a real row)
    # Its contract (FlashInfer 0.7.2): x, B, C and out unit-stride in the last dim (x can arrive as a strided
    # view); D and dt_bias in dt's dtype, so all three go in fp32, as our kernels read them.
    x, Bm, Cm = x.contiguous(), Bm.contiguous(), Cm.contiguous()
    out = torch.empty_like(x)
    fim.selective_state_update(
        state.ssm, x, _tied(dt.float(), (b, T, H, P)), _tied(A.float(), (H, P, N)), Bm, Cm,
        _tied(D.float(), (H, P)), dt_bias=_tied(dt_bias.float(), (H, P)), dt_softplus=True,
        state_batch_indices=slots, out=out,
        disable_state_update=True, intermediate_states_buffer=state.ssm_steps,
        intermediate_state_indices=slots, cache_steps=T,
    )
    return out
