"""The routed experts' (token, choice) pairs grouped by expert at decode sizes in one Triton launch, and the
PyTorch reference.

The grouped MoE path (runners/engine/models/moe.py's ``moe_experts_grouped``) sorts the P = N * k pairs by
expert (stable), takes each expert's cumulative row end (the grouped GEMM's ``offsets``) and, after the down
projection, each pair's row in the sorted order (the combine's ``inverse``). In torch that is a stable
argsort (a radix sort: about eight launches on CUDA), a gather and a searchsorted, then an arange and a
scatter: a dozen launches a layer, each on a few thousand integers. Here one launch computes all three by
counting, with no sort and no atomics:

    inverse[p] = #{q : expert[q] < expert[p]} + #{q < p : expert[q] = expert[p]}    (stable rank)
    order[inverse[p]] = p
    offsets[e] = #{q : expert[q] <= e}

Programs below ``pair_blocks`` each rank BLOCK pairs against all P (P^2 comparisons in all: 32 M at the
batch-64 verify of a top-22 model, P = 5,632), the others each count BLOCK_E experts' row ends. The results
are integers, exact and independent of the order of the work: the same as the reference, bit for bit. The
cost grows as P^2, so the engine runs it up to SORT_KERNEL_MAX_PAIRS pairs and the reference above (prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable

# Pairs up to which the engine groups by this kernel (runners/engine/models/moe.py): the batch-64 verify of a
# top-22 model is 5,632 pairs; past the bound (prefill) the reference's radix sort, whose cost grows as P.
SORT_KERNEL_MAX_PAIRS = 8192
BLOCK = 128  # pairs per program, and per step of every program's loop over all pairs
BLOCK_E = 64  # experts per offsets program


def sort_pairs_ref(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of ``indices`` [N, k] (int64 expert ids in [0, num_experts)) grouped by expert, in torch.

    Returns:
        ``order`` int64 [N * k]: pair ids ``n * k + j`` sorted by expert, stable (one expert's pairs keep their
        order); ``inverse`` int64 [N * k]: each pair's position in ``order``; ``offsets`` int32 [E]: the number
        of pairs routed to experts <= e. Pure function, no host synchronisation.
    """
    expert = indices.flatten()
    order = torch.argsort(expert, stable=True)
    bounds = torch.arange(num_experts, device=indices.device, dtype=expert.dtype)
    offsets = torch.searchsorted(expert[order], bounds, right=True).to(torch.int32)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inverse, offsets


@triton.jit
def _sort_pairs_kernel(expert_ptr, order_ptr, inverse_ptr, offsets_ptr, P, E, pair_blocks,
                       BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    if pid < pair_blocks:
        p = pid * BLOCK + tl.arange(0, BLOCK)
        pmask = p < P
        e = tl.load(expert_ptr + p, mask=pmask, other=0)
        rank = tl.zeros((BLOCK,), dtype=tl.int32)
        for q0 in range(0, P, BLOCK):
            q = q0 + tl.arange(0, BLOCK)
            eq = tl.load(expert_ptr + q, mask=q < P, other=0)
            before = (eq[None, :] < e[:, None]) | ((eq[None, :] == e[:, None]) & (q[None, :] < p[:, None]))
            rank += tl.sum((before & (q < P)[None, :]).to(tl.int32), axis=1)
        tl.store(inverse_ptr + p, rank.to(tl.int64), mask=pmask)
        tl.store(order_ptr + rank, p.to(tl.int64), mask=pmask)
    else:
        ex = (pid - pair_blocks) * BLOCK_E + tl.arange(0, BLOCK_E)
        count = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for q0 in range(0, P, BLOCK):
            q = q0 + tl.arange(0, BLOCK)
            eq = tl.load(expert_ptr + q, mask=q < P, other=0)
            count += tl.sum(((eq[None, :] <= ex[:, None]) & (q < P)[None, :]).to(tl.int32), axis=1)
        tl.store(offsets_ptr + ex, count, mask=ex < E)


def sort_pairs(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sort_pairs_ref` in one Triton launch (module docstring): the same three tensors, bit for bit.

    Args:
        indices: [N, k] int64 expert ids in [0, num_experts) (not checked: reading them would synchronise),
            on CUDA (or on the CPU under TRITON_INTERPRET=1), N * k < 2^31.
        num_experts: E >= 1.

    Returns:
        (order int64 [N * k], inverse int64 [N * k], offsets int32 [E]), new tensors. Mutates nothing.

    Raises:
        ValueError: indices not 2-D int64, num_experts < 1, too many pairs, CPU tensors without the
            interpreter.
    """
    name = "sort_pairs"
    if indices.dim() != 2 or indices.dtype != torch.int64:
        raise ValueError(f"{name}: indices must be [N, k] int64, got {indices.dtype} {tuple(indices.shape)}")
    if num_experts < 1:
        raise ValueError(f"{name}: num_experts must be >= 1, got {num_experts}")
    P = indices.numel()
    if P >= 2**31:
        raise ValueError(f"{name}: {P} pairs exceed int32 ranks; use sort_pairs_ref")
    check_launchable(indices, name=name)
    expert = indices.contiguous().view(-1)
    order = torch.empty(P, dtype=torch.int64, device=indices.device)
    inverse = torch.empty_like(order)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=indices.device)
    pair_blocks = triton.cdiv(P, BLOCK)
    grid = (pair_blocks + triton.cdiv(num_experts, BLOCK_E),)
    _sort_pairs_kernel[grid](expert, order, inverse, offsets, P, num_experts, pair_blocks, BLOCK=BLOCK,
                             BLOCK_E=BLOCK_E, num_warps=4)
    return order, inverse, offsets
