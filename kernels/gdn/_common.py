"""Input checks and small math shared by the Gated DeltaNet operators (chunk, recurrent, replay).

Shape vocabulary (flash-linear-attention): B batch rows, T tokens per row, H key heads, HV value heads
(HV = r * H, the key head of value head hv is hv // r), K key head dim, V value head dim, S cache slots.
Recurrent state layout: (.., HV, V, K), K contiguous: both S k_t and S q_t then reduce along contiguous memory.
transformers' Qwen3-Next torch fallback keeps (.., HV, K, V), the transpose.
"""

from __future__ import annotations

import torch

from kernels._common import INDEX_DTYPES, PAD_SLOT_ID

# Epsilon of the L2 norm of q and k, x * rsqrt(sum(x^2) + eps); the value of HF Qwen3-Next and fla.
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2, -1) + eps) in float32 (the reference of the in-kernel normalisation)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def check_gdn_inputs(q, k, v, g, beta, slot_ids=None) -> tuple[int, int, int, int, int, int]:
    """Validate the per-token inputs of a GDN step and return (B, T, H, HV, K, V).

    q, k: (B, T, H, K); v: (B, T, HV, V); g, beta: (B, T, HV); slot_ids (slot-indexed operators only): (B,)
    int32 / int64 with PAD = -1. Raises ValueError naming the offending argument and what it should be.
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (B, T, H, K); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be (B={B}, T={T}, HV, V); got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H} (GQA-style grouping)")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"{name} must be (B={B}, T={T}, HV={HV}); got {tuple(t.shape)}")
    tensors = [q, k, v, g, beta]
    if slot_ids is not None:
        if slot_ids.shape != (B,) or slot_ids.dtype not in INDEX_DTYPES:
            raise ValueError(f"slot_ids must be (B={B},) int32 / int64 (PAD = {PAD_SLOT_ID}); got "
                             f"{tuple(slot_ids.shape)} {slot_ids.dtype}")
        tensors.append(slot_ids)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    return B, T, H, HV, K, V


def check_state(state: torch.Tensor, HV: int, V: int, K: int, name: str = "state") -> None:
    """state: (S, HV, V, K) float with K contiguous (stride 1); other strides are free (cache views)."""
    if state.dim() != 4 or tuple(state.shape[1:]) != (HV, V, K):
        raise ValueError(
            f"{name} must be (S, HV={HV}, V={V}, K={K}) (value rows, key columns); got {tuple(state.shape)}. "
            "A (S, HV, K, V) state is the transposed layout: store S as [V, K] per head."
        )
    if state.stride(-1) != 1:
        raise ValueError(f"{name} must have its last (K) dimension contiguous; got strides {state.stride()}")
    if not state.is_floating_point():
        raise ValueError(f"{name} must be a float tensor (float32 recommended); got {state.dtype}")


def key_head_dims(K: int, V: int, block_v: int, min_block: int = 1) -> tuple[int, int]:
    """Power-of-two tile sizes (BK, BV): BK covers K, BV tiles V (at least min_block, e.g. 16 for tl.dot)."""
    import triton

    BK = max(triton.next_power_of_2(K), min_block)
    BV = max(min(triton.next_power_of_2(V), block_v), min_block)
    return BK, BV


def mask_right_padding(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Make the columns t >= lengths[b] of a right-padded batch no-ops of the gated delta rule.

    q, k: (B, T, H, K); v: (B, T, HV, V); g, beta: (B, T, HV); lengths: (B,) integer in [0, T]. Returns new
    q, k, v, g, beta (same shapes and dtypes) that are zero at padded columns: g = 0 (alpha = 1), beta = 0 and
    k = 0 make a padded step the identity on the state in the recurrent and the chunked forms alike, and
    q = 0 makes its output exactly 0. torch.where (not a product) also clears NaN in padded inputs.
    Raises ValueError for lengths of the wrong shape / dtype or outside [0, T] (a host sync).
    """
    B, T = q.shape[:2]
    if lengths.shape != (B,) or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be an integer tensor of shape (B,) = ({B},); got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > T).any()):
        raise ValueError(f"lengths must lie in [0, T={T}]; got {lengths.tolist()}")
    valid = torch.arange(T, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # (B, T)
    q, k, v = (torch.where(valid[:, :, None, None], t, torch.zeros((), dtype=t.dtype, device=t.device))
               for t in (q, k, v))
    g, beta = (torch.where(valid[:, :, None], t, torch.zeros((), dtype=t.dtype, device=t.device))
               for t in (g, beta))
    return q, k, v, g, beta


def prepare_rule_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    lengths: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    """For the batched (not slot-indexed) rules: validate, mask right padding, repeat q / k to value heads,
    move heads before time, upcast.

    Returns float32 q (scaled), k: (B, HV, T, K); v: (B, HV, T, V); g, beta: (B, HV, T); state (B, HV, V, K)
    (a fresh tensor: the caller's initial_state is never written).

    Raises:
        ValueError: shapes that do not fit, a transposed initial_state, lengths outside [0, T].
    """
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta)
    if initial_state is not None and initial_state.shape != (B, HV, V, K):
        hint = ""
        if initial_state.shape == (B, HV, K, V):
            hint = " (it looks transposed: transformers keeps (B, HV, K, V); use state.transpose(-1, -2))"
        raise ValueError(
            f"initial_state must be (B, HV, V, K) = {(B, HV, V, K)}, K contiguous; "
            f"got {tuple(initial_state.shape)}{hint}"
        )

    if lengths is not None:
        q, k, v, g, beta = mask_right_padding(q, k, v, g, beta, lengths)

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
