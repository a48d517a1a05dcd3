"""Input checks and small math shared by the Gated DeltaNet kernels (gdn_recurrent, gdn_replay).

Shape vocabulary (flash-linear-attention): B batch rows, T tokens per row, H key heads, HV value heads
(HV = r * H, the key head of value head hv is hv // r), K key head dim, V value head dim, S cache slots.
"""

from __future__ import annotations

import torch

PAD_SLOT_ID = -1
# Epsilon of the in-kernel L2 norm, x * rsqrt(sum(x^2) + eps); the value HF Qwen3-Next and fla use.
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2, -1) + eps) in float32 (the reference of the in-kernel normalisation)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def check_gdn_inputs(q, k, v, g, beta, slot_ids) -> tuple[int, int, int, int, int, int]:
    """Validate the per-token inputs of a GDN step and return (B, T, H, HV, K, V).

    q, k: (B, T, H, K); v: (B, T, HV, V); g, beta: (B, T, HV); slot_ids: (B,) int32 with PAD = -1.
    Raises ValueError naming the offending argument and what it should be.
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
    if slot_ids.shape != (B,) or slot_ids.dtype != torch.int32:
        raise ValueError(
            f"slot_ids must be (B={B},) int32 (PAD = {PAD_SLOT_ID}); got {tuple(slot_ids.shape)} {slot_ids.dtype}"
        )
    devices = {t.device for t in (q, k, v, g, beta, slot_ids)}
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
