"""Routed experts of an MoE block: the fused path (grouped GEMMs, no host synchronisation) and its reference.

Both functions compute, for tokens ``h`` [N, L] each routed to k experts (``indices`` [N, k] int64,
``weights`` [N, k] float32, from :class:`runners.engine.models.layers.TopkRouter`)::

    out[n] = sum_j weights[n, j] * expert_{indices[n, j]}(h[n])

with ``expert_e(x) = down_e(act(up_e x))`` or, gated, ``down_e(act(gate_e x) * up_e x)``. Expert weights
are stacked in nn.Linear layout (out x in): ``up`` / ``gate`` [E, I, L], ``down`` [E, L, I]. L is the MoE
width (the latent size for NemotronH's latent MoE, the hidden size otherwise), I the expert intermediate size.

- :func:`moe_experts_ref`: a Python loop over experts with the per-expert token counts read on the host
  (``.tolist()``); the specification the tests hold the fused path to.
- :func:`moe_experts_fused`: the N * k (token, expert) pairs are sorted by expert on the device (a stable
  ``torch.argsort``), each expert's group end is found with ``torch.searchsorted`` over the sorted ids (int32
  offsets; ``torch.bincount`` would size its output from the data), and each projection is one
  ``torch._grouped_mm`` over the sorted rows, the layout torchtitan's MoE uses (tokens sorted by expert,
  offsets on the device; torchtitan/models/moe). The results return to pair order through a gather with the
  inverse permutation and are summed over the k choices in float32. Nothing reads a device value on the host
  and every shape follows from N, k and the weights, so the step can be captured in a CUDA graph.

At decode sizes (N * k <= :data:`MOE_GEMV_MAX_PAIRS` pairs, CUDA, an activation kernels/moe_gemv.py fuses,
named by the caller)
:func:`moe_experts_fused` runs kernels/moe_gemv.py's ``moe_gemv`` instead: one program per (token, expert)
pair and output tile reads its expert id straight from ``indices`` (no sort, no pass over all E experts, no
tensor-core tile padded around a few rows), three launches in all. The CPU keeps the grouped path.

``torch._grouped_mm`` needs 16-byte-aligned row strides (L and I multiples of 8 in 16-bit dtypes, of 4 in
float32); on CUDA only bf16 on sm90+ runs its CUTLASS kernel (other dtypes take a fallback that copies the
offsets to the host). Where those do not hold (:func:`grouped_mm_supported`), the fused path multiplies each
pair by its own gathered expert matrix (``torch.bmm`` in chunks of a size fixed by the shapes): still no
host synchronisation, more memory traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.moe_gemv import ACT_CODES, moe_gemv

# Bytes of gathered expert weights per chunk of the bmm path (each pair gathers an I x L matrix).
GATHER_CHUNK_BYTES = 256 * 2**20
# (token, expert) pairs up to which moe_experts_fused takes the per-pair GEMV kernels (kernels/moe_gemv.py) on
# CUDA: 8 decode tokens at Nemotron 3 Super's top-22 (the largest top-k of the released models; 17 tokens at
# Qwen3-Next's top-10): the GEMV is faster than the grouped GEMM at every point measured up to it
# (docs/kernel_performance.md, "Quantized formats: where each path takes over").
MOE_GEMV_MAX_PAIRS = 8 * 22
# The routed experts' projections, in the order of the MoE block's experts_<kind> parameters (gate: gated
# activations only).
EXPERT_KINDS = ("up", "gate", "down")


def _dense_expert_linear(x: torch.Tensor, w: torch.Tensor, e: int) -> torch.Tensor:
    return x @ w[e].T


def moe_experts_ref(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    up: torch.Tensor,
    gate: torch.Tensor | None,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    linear: Callable[[torch.Tensor, Any, int], torch.Tensor] | None = None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Reference routed experts: one matmul chain per expert that received tokens (host-synchronising).

    Args:
        h: [N, L] expert inputs. weights: [N, k] float32 combine weights. indices: [N, k] int64 expert ids.
        up, gate: [E, I, L] (gate None for non-gated experts); down: [E, L, I]. act: the activation.
        linear: ``linear(x, W, e)`` is x times expert e's matrix of W transposed; default ``x @ W[e].T`` for
            dense [E, out, in] tensors (runners.engine.models.fp8 passes its dequantizing reference and
            FP8Weights).
        num_experts: E; default ``up.shape[0]`` (needed when up is not a tensor).

    Returns:
        [N, L] in h's dtype; each token's k expert outputs are weighted and summed in float32, in expert
        order.
    """
    n, k = indices.shape
    expert = indices.flatten()
    order = torch.argsort(expert, stable=True)
    token = order // k  # token of each (token, choice) pair in expert order
    w = weights.flatten()[order]
    lin = linear or _dense_expert_linear
    counts = torch.bincount(expert, minlength=up.shape[0] if num_experts is None else num_experts).tolist()
    out = torch.zeros(n, h.shape[-1], dtype=torch.float32, device=h.device)
    start = 0
    for e, cnt in enumerate(counts):
        if cnt == 0:
            continue
        tok = token[start : start + cnt]
        x = h[tok]
        if gate is None:
            a = act(lin(x, up, e))
        else:
            a = act(lin(x, gate, e)) * lin(x, up, e)
        y = lin(a, down, e)
        out.index_add_(0, tok, y.float() * w[start : start + cnt, None])
        start += cnt
    return out.to(h.dtype)


def sort_pairs_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, choice) pairs by expert, on the device.

    Args:
        indices: [N, k] int64 expert ids in [0, num_experts).

    Returns:
        ``order`` [N * k] int64: pair ids (``n * k + j``) sorted by expert (stable: pairs of one expert keep
        token order); ``offsets`` [E] int32: ``offsets[e]`` = number of pairs routed to experts <= e (the end
        of expert e's group in ``order``; ``torch._grouped_mm``'s ``offs``). No host synchronisation.
    """
    expert = indices.flatten()
    order = torch.argsort(expert, stable=True)
    bounds = torch.arange(num_experts, device=indices.device, dtype=expert.dtype)
    offsets = torch.searchsorted(expert[order], bounds, right=True).to(torch.int32)
    return order, offsets


def grouped_mm_supported(x: torch.Tensor, *stacked: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x`` [P, L] against the transposed stacked weights ``[E, I, L]``
    without a host synchronisation: every row stride 16-byte aligned, and on CUDA bf16 on sm90+ (its CUTLASS
    kernel); on the CPU any of float32 / bfloat16 / float16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    align = 16 // x.element_size()
    for w in stacked:
        if w.dtype != x.dtype or w.shape[-1] % align or w.shape[-2] % align or not w.is_contiguous():
            return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x [P, in] sorted by group times their group's w [E, out, in] transposed -> [P, out]."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)


def _gathered_linear(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Row p of x [P, in] times w[expert[p]] [out, in] transposed -> [P, out], by gathered bmm in chunks of a
    size fixed by the shapes (no host synchronisation)."""
    P = x.shape[0]
    per_pair = w.shape[1] * w.shape[2] * w.element_size()
    chunk = max(1, GATHER_CHUNK_BYTES // per_pair)
    parts = [
        torch.bmm(w[expert[s : s + chunk]], x[s : s + chunk, :, None])[..., 0] for s in range(0, P, chunk)
    ]
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def use_moe_gemv(h: torch.Tensor, indices: torch.Tensor, *stacked: torch.Tensor) -> bool:
    """Whether :func:`moe_experts_fused` takes the per-pair GEMV kernels: h on CUDA, at most
    :data:`MOE_GEMV_MAX_PAIRS` (token, expert) pairs with int64 expert ids, the expert weights ``stacked`` in
    h's dtype (16-bit or float32). Reads only shapes and dtypes (no synchronisation)."""
    return (h.is_cuda and indices.numel() <= MOE_GEMV_MAX_PAIRS and indices.dtype == torch.int64
            and h.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(w.dtype == h.dtype for w in stacked))


def expert_kinds(moe: Any) -> tuple[str, ...]:
    """The :data:`EXPERT_KINDS` an MoE block holds (``experts_gate`` is None without a gated activation)."""
    return tuple(k for k in EXPERT_KINDS if getattr(moe, f"experts_{k}") is not None)


def moe_experts_fused(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    up: torch.Tensor,
    gate: torch.Tensor | None,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Routed experts as grouped GEMMs over expert-sorted pairs; same arguments and result as
    :func:`moe_experts_ref` (float32 combine; the k choices are summed in choice order, so results agree
    with the reference to float rounding). No per-expert Python loop, no host synchronisation, shapes fixed
    by N, k and the weights (CUDA-graph capturable). Where ``activation`` names ``act`` and
    :func:`use_moe_gemv` holds (CUDA, at most :data:`MOE_GEMV_MAX_PAIRS` pairs), the per-pair GEMV kernels of
    kernels/moe_gemv.py compute the same result instead.

    Args:
        h: [N, L]. weights: [N, k] float32. indices: [N, k] int64. up, gate: [E, I, L] (gate may be None);
            down: [E, L, I]; all in h's dtype.
        activation: the name ``act`` has in kernels.moe_gemv.ACT_CODES ("relu2" / "silu": the keys of
            runners.engine.models.layers.ACTIVATIONS, which MoE passes), so the GEMV kernels can fuse it; None
            (a caller's own callable) keeps the grouped path.

    Returns:
        [N, L] in h's dtype.
    """
    stacked = (up, down) if gate is None else (up, gate, down)
    if activation in ACT_CODES and use_moe_gemv(h, indices, *stacked):
        return moe_gemv(h, weights, indices, up, gate, down, activation)
    n, k = indices.shape
    E = up.shape[0]
    order, offsets = sort_pairs_by_expert(indices, E)
    x = h.index_select(0, order // k)  # [P, L]: each pair's token, in expert order
    if grouped_mm_supported(x, *stacked):
        linear = lambda inp, w: _grouped_linear(inp, w, offsets)
    else:
        expert_sorted = indices.flatten().index_select(0, order)
        linear = lambda inp, w: _gathered_linear(inp, w, expert_sorted)
    if gate is None:
        a = act(linear(x, up))
    else:
        a = act(linear(x, gate)) * linear(x, up)
    y = linear(a, down)  # [P, L] in expert order
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y = y.index_select(0, inverse).view(n, k, -1)  # back to pair order n * k + j
    return (y.float() * weights[..., None]).sum(dim=1).to(h.dtype)


def moe_experts_grouped(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    kinds: tuple[str, ...],
    grouped_mm: Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
    num_experts: int,
) -> torch.Tensor:
    """Routed experts over expert-sorted pairs with a caller's grouped GEMM (the quantized experts of
    runners/engine/models/<format>.py): the pairs are sorted by expert (:func:`sort_pairs_by_expert`),
    each projection is ``grouped_mm(x [P, in] sorted by expert, kind, offsets [E] int32 cumulative ends) ->
    [P, out]``, the results return to pair order and are summed over the k choices in float32 (as
    :func:`moe_experts_fused`: no host synchronisation when ``grouped_mm`` has none).

    Args:
        h: [N, L]. weights: [N, k] float32. indices: [N, k] int64. kinds: ("up", "down") or ("up", "gate",
            "down"). act: the activation. num_experts: E.

    Returns:
        [N, L] in h's dtype.
    """
    n, k = indices.shape
    order, offsets = sort_pairs_by_expert(indices, num_experts)
    x = h.index_select(0, order // k)  # [P, L]
    if "gate" in kinds:
        a = act(grouped_mm(x, "gate", offsets)) * grouped_mm(x, "up", offsets)
    else:
        a = act(grouped_mm(x, "up", offsets))
    y = grouped_mm(a.to(h.dtype), "down", offsets)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y = y.index_select(0, inverse).view(n, k, -1)
    return (y.float() * weights[..., None]).sum(dim=1).to(h.dtype)
