"""The routed experts' (token, choice) pairs grouped by expert at decode sizes in one Triton launch, and the
PyTorch reference.

The grouped MoE path (runners/engine/models/moe.py's ``moe_experts_grouped``) sorts the P = N * k pairs by
expert (stable), takes each expert's cumulative row end (the grouped GEMM's ``offsets``) and, after the down
projection, each pair's row in the sorted order (the combine's ``inverse``). In torch that is a stable
argsort (a radix sort: about eight launches on CUDA), a gather and a searchsorted, then an arange and a
scatter: a dozen launches a layer, each on a few thousand integers. Here one program does all three:

    key[p] = expert[p] * BLOCK + p       (unique; padding pairs get expert E, after every real pair)
    sorted = tl.sort(key)                (a bitonic sort in registers and shared memory)
    order[i] = sorted[i] % BLOCK,  inverse[order[i]] = i
    offsets = cumsum(histogram(expert))  (tl.histogram over E + 1 bins and more)

Sorting the unique keys is a stable sort by expert, so the three tensors are the reference's, bit for bit.
One program of up to 32 warps holds BLOCK = next_power_of_2(P) keys, so the engine runs it up to
SORT_KERNEL_MAX_PAIRS pairs (decode and verify steps: 5,632 at the batch-64 verify of a top-22 model) and
the reference above (prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable

# Pairs up to which the engine groups by this kernel (runners/engine/models/moe.py): one program sorts
# next_power_of_2(P) keys; past the bound (prefill) the reference's radix sort over all SMs.
SORT_KERNEL_MAX_PAIRS = 8192


def sort_pairs_supported(pairs: int, num_experts: int) -> bool:
    """Whether :func:`sort_pairs` takes ``pairs`` pairs over ``num_experts`` experts: at most
    SORT_KERNEL_MAX_PAIRS pairs, and every key (expert * BLOCK + pair) an int32."""
    block = max(16, triton.next_power_of_2(pairs))
    return pairs <= SORT_KERNEL_MAX_PAIRS and num_experts >= 1 and (num_experts + 1) * block < 2**31


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
def _sort_pairs_kernel(expert_ptr, order_ptr, inverse_ptr, offsets_ptr, P, E, BLOCK: tl.constexpr,
                       SHIFT: tl.constexpr, BINS: tl.constexpr):
    i = tl.arange(0, BLOCK)
    real = i < P
    expert = tl.load(expert_ptr + i, mask=real, other=E).to(tl.int32)
    ordered = tl.sort((expert << SHIFT) | i)
    pair = ordered & (BLOCK - 1)
    tl.store(order_ptr + i, pair.to(tl.int64), mask=real)  # the P real pairs sort before the padding
    tl.store(inverse_ptr + pair, i.to(tl.int64), mask=real)
    ends = tl.cumsum(tl.histogram(expert, BINS), 0)  # padding in bin E, past every stored end
    bins = tl.arange(0, BINS)
    tl.store(offsets_ptr + bins, ends.to(tl.int32), mask=bins < E)


def sort_pairs(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sort_pairs_ref` in one Triton launch (module docstring): the same three tensors, bit for bit.

    Args:
        indices: [N, k] int64 expert ids in [0, num_experts) (not checked: reading them would synchronise),
            on CUDA (or on the CPU under TRITON_INTERPRET=1).
        num_experts: E >= 1.

    Returns:
        (order int64 [N * k], inverse int64 [N * k], offsets int32 [E]), new tensors. Mutates nothing.

    Raises:
        ValueError: indices not 2-D int64, num_experts < 1, more pairs or experts than
            :func:`sort_pairs_supported` takes, CPU tensors without the interpreter.
    """
    name = "sort_pairs"
    if indices.dim() != 2 or indices.dtype != torch.int64:
        raise ValueError(f"{name}: indices must be [N, k] int64, got {indices.dtype} {tuple(indices.shape)}")
    if num_experts < 1:
        raise ValueError(f"{name}: num_experts must be >= 1, got {num_experts}")
    P = indices.numel()
    if not sort_pairs_supported(P, num_experts):
        raise ValueError(f"{name}: {P} pairs over {num_experts} experts is past what one program sorts (at most "
                         f"{SORT_KERNEL_MAX_PAIRS} pairs, int32 keys); use sort_pairs_ref")
    check_launchable(indices, name=name)
    expert = indices.contiguous().view(-1)
    order = torch.empty(P, dtype=torch.int64, device=indices.device)
    inverse = torch.empty_like(order)
    offsets = torch.zeros(num_experts, dtype=torch.int32, device=indices.device)
    if P == 0:
        return order, inverse, offsets
    block = max(16, triton.next_power_of_2(P))
    _sort_pairs_kernel[(1,)](expert, order, inverse, offsets, P, num_experts, BLOCK=block,
                             SHIFT=block.bit_length() - 1, BINS=max(16, triton.next_power_of_2(num_experts + 1)),
                             num_warps=min(32, max(4, block // 256)))
    return order, inverse, offsets
