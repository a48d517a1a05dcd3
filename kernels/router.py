"""MoE router scoring + top-k in one Triton kernel, without a sort, and its PyTorch reference.

For router logits ``x W^T`` [N, E] (float32) each token's experts are chosen and weighted as in DeepSeek-V3 /
NemotronH (sigmoid scores, a selection-only ``e_score_correction_bias``) or Qwen3-Next (softmax scores):

    scores  = sigmoid(logits) | softmax(logits)        (float32, over the E experts)
    choice  = scores + bias (sigmoid only)             (bias moves the selection, not the weights)
    indices = the k largest choices, largest first
    weights = scores[indices], / (sum + 1e-20) when norm_topk_prob, * routed_scaling_factor

(transformers' ``modeling_nemotron_h.py`` NemotronHTopkRouter and ``modeling_qwen3_next.py``
Qwen3NextSparseMoeBlock). :func:`topk_route_ref` is that computation in PyTorch (``torch.topk``; also the
group-limited selection, n_group > 1, of DeepSeek-V3) and is what ``runners.engine.models.moe.TopkRouter``
runs; :func:`topk_route` is the Triton kernel for n_group = 1: one program per token holds its E scores in
registers and takes the k largest by k rounds of one max over packed (choice, lane) keys, so the decode
step's top-k costs one small kernel instead of the sort kernels torch.topk launches (gatherTopK, radix /
bitonic sorts; issue 27's profile). Ties between equal choices go to the lower expert index (torch.topk
leaves their order unspecified). The chosen weights are recomputed from their k logits. One warp per
program up to 512 experts (:func:`warps_for`): the rounds' reductions stay in warp shuffles. At the half-depth
release steps the earlier kernel (three reductions per round over four warps) took 9.5 us per call at Super
V3's top-22 of 512 on an H100 (benchmarks/profile_breakdown of bench_e2e --profile; docs/kernel_performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable


def topk_route_ref(logits: torch.Tensor, top_k: int, *, softmax: bool, bias: torch.Tensor | None = None,
                   norm_topk_prob: bool = True, scaling: float = 1.0, n_group: int = 1, topk_group: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router weights and expert ids from logits (see the module docstring).

    Args:
        logits: [N, E] router logits (computed in float32; any float dtype is cast).
        top_k: experts per token, k <= E.
        softmax: softmax scores (Qwen3-Next) instead of sigmoid (NemotronH, DeepSeek-V3).
        bias: [E] float32 selection-only correction, sigmoid only (None: none).
        norm_topk_prob: renormalise the k chosen scores to sum 1.
        scaling: routed_scaling_factor, multiplies the weights.
        n_group, topk_group: sigmoid only: with n_group > 1 only the ``topk_group`` groups (of E / n_group
            consecutive experts) with the largest sums of their top-2 choices are eligible.

    Returns:
        (weights [N, k] float32, indices [N, k] int64), largest choice first.
    """
    logits = logits.float()
    if softmax:
        scores = choice = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores if bias is None else scores + bias.float()
    if n_group > 1 and not softmax:
        E = logits.shape[-1]
        grouped = choice.view(-1, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, n_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


@triton.jit
def _route_row(logits_ptr, bias_ptr, w_ptr, idx_ptr, row, E, stride_row, scaling,
               SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BYPASS_L1: tl.constexpr):
    """Scores, top-k and weights of logits row ``row`` (an integer; int32 where N * E fits it), stored at
    w_ptr / idx_ptr + row * K. With BYPASS_L1 the logits are loaded past L1 (.cg): written by other programs
    of the same launch."""
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    if BYPASS_L1:
        x = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=0.0)
    x = x.to(tl.float32)
    if SOFTMAX:
        x = tl.where(valid, x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(valid, p, 0.0)
        scores = p / tl.sum(p, axis=0)
    else:
        scores = tl.sigmoid(x)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    # NaN (a poisoned PAD row) counts as the largest choice, as torch.topk orders it: every round then finds
    # an index in [0, E) (NaN == NaN is false, so a NaN left in place would match no lane). No choice is -0.0
    # (scores are >= +0.0 and s + (-s) rounds to +0.0), so equal floats have equal keys below.
    choice = tl.where(choice != choice, float("inf"), choice)
    choice = tl.where(valid, choice, float("-inf"))
    # One max per round: each lane's key packs the choice's float32 bits mapped to an int32 of the same order
    # (negative floats have their magnitude bits flipped) in the high word and the lane reversed in the low
    # word, so the largest key is the largest choice and, among equal choices, the lowest index. Keys are
    # distinct (one lane each); a chosen lane drops below every key.
    bits = choice.to(tl.int32, bitcast=True)
    key = (bits ^ tl.where(bits < 0, 0x7FFFFFFF, 0)).to(tl.int64)
    packed = (key << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
    kofs = tl.arange(0, BLOCK_K)
    indices = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):  # k rounds of one max each: no sort
        best = tl.max(packed, axis=0)
        indices = tl.where(kofs == j, BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32), indices)
        packed = tl.where(packed == best, -9223372036854775807, packed)
    # the chosen scores, recomputed from their logits with the arithmetic above (the same bits)
    if BYPASS_L1:
        xk = tl.load(logits_ptr + row * stride_row + indices, mask=kofs < K, other=0.0, cache_modifier=".cg")
    else:
        xk = tl.load(logits_ptr + row * stride_row + indices, mask=kofs < K, other=0.0)
    xk = xk.to(tl.float32)
    if SOFTMAX:
        weights = tl.exp(xk - tl.max(x, axis=0)) / tl.sum(p, axis=0)
    else:
        weights = tl.sigmoid(xk)
    weights = tl.where(kofs < K, weights, 0.0)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    tl.store(w_ptr + row * K + kofs, weights, mask=kofs < K)
    tl.store(idx_ptr + row * K + kofs, indices.to(tl.int64), mask=kofs < K)


@triton.jit
def _topk_route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, E, stride_row, scaling,
                       SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    _route_row(logits_ptr, bias_ptr, w_ptr, idx_ptr, tl.program_id(0).to(tl.int64), E, stride_row, scaling,
               SOFTMAX, HAS_BIAS, NORM, K, BLOCK_K, BLOCK_E, False)


@triton.jit
def _router_fused_kernel(x_ptr, wt_ptr, logits_ptr, bias_ptr, w_ptr, idx_ptr, counter_ptr, N, E, D, stride_x,
                         scaling, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                         EXPERTS: tl.constexpr, BLOCK_D: tl.constexpr):
    # the logits of this program's EXPERTS experts for every token: the weight tile of each BLOCK_D columns
    # loaded once and dotted with each token's columns, in float32
    ex = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    emask = ex < E
    tok = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, EXPERTS], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(wt_ptr + ex.to(tl.int64)[:, None] * D + cols[None, :], mask=emask[:, None] & cmask[None, :],
                    other=0.0)
        for n in tl.static_range(BLOCK_N):
            xn = tl.load(x_ptr + n * stride_x + cols, mask=cmask & (cols * 0 + n < N), other=0.0).to(tl.float32)
            part = tl.sum(w * xn[None, :], axis=1)
            acc = tl.where(tok[:, None] == n, acc + part[None, :], acc)
    tl.store(logits_ptr + tok[:, None] * E + ex[None, :], acc, mask=(tok[:, None] < N) & emask[None, :])
    # the last program to finish routes every token (CUTLASS's serial split-K with a counter, as
    # kernels/quant/block_fp8.py's _serial_split_sum): the barrier orders this program's stores before its
    # count; the count's acquire-release makes every program's stores visible to the last one, whose loads
    # bypass L1; it sets the counter back to 0 for the next launch or graph replay
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        for n in range(N):
            _route_row(logits_ptr, bias_ptr, w_ptr, idx_ptr, n, E, E, scaling,
                       SOFTMAX, HAS_BIAS, NORM, K, BLOCK_K, BLOCK_E, True)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def warps_for(block_e: int) -> int:
    """Warps per program for BLOCK_E experts: one up to 512 (16 keys per lane; each round's max then stays in
    warp shuffles, with no shared-memory round trip between warps), one more per 512 above, at most 8 (so a
    lane holds 16 keys up to 4096 experts)."""
    return max(1, min(8, block_e // 512))


def _check_routing(name: str, E: int, top_k: int, softmax: bool, bias: torch.Tensor | None) -> None:
    """Raise ValueError unless top_k lies in [1, E] and a bias is [E] with sigmoid scoring."""
    if not 1 <= top_k <= E:
        raise ValueError(f"{name}: top_k={top_k} must lie in [1, E={E}]")
    if bias is not None and (softmax or tuple(bias.shape) != (E,)):
        raise ValueError(f"{name}: bias must be [E={E}] and is for sigmoid scoring only")


def topk_route(logits: torch.Tensor, top_k: int, *, softmax: bool, bias: torch.Tensor | None = None,
               norm_topk_prob: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_route_ref` with n_group = 1 as one Triton launch (one program per token, no sort, no host
    synchronisation: CUDA-graph capturable). Same arguments and result; the weights agree with the
    reference to float32 rounding (the softmax's sum is reduced in another order), the indices exactly
    unless two choices tie. NaN logits give NaN weights and in-range indices (NaN ranks first, as in
    torch.topk), never an index past E.

    Raises:
        ValueError: logits not [N, E] float32 contiguous rows, top_k outside [1, E], a bias with softmax or of
            the wrong shape, or CPU tensors without the interpreter.
    """
    name = "topk_route"
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"{name}: logits must be [N, E] float32 with unit-stride rows, got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    N, E = logits.shape
    _check_routing(name, E, top_k, softmax, bias)
    tensors = (logits,) if bias is None else (logits, bias)
    check_launchable(*tensors, name=name)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N == 0:
        return weights, indices
    bias_arg = bias.float().contiguous() if bias is not None else logits
    block_e = triton.next_power_of_2(E)
    _topk_route_kernel[(N,)](
        logits, bias_arg, weights, indices, E, logits.stride(0), float(scaling),
        SOFTMAX=softmax, HAS_BIAS=bias is not None, NORM=norm_topk_prob, K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e, num_warps=warps_for(block_e),
    )
    return weights, indices


# The fused router (:func:`router_fused`): at most this many tokens (the last program routes them one after
# another, so its tail grows with the tokens; decode at batch 1, plain or an MTP verify of 4, fits), experts
# per program and columns per weight tile. Whether the engine takes it: runners.engine.models.moe.ROUTER_FUSED.
ROUTER_FUSED_MAX_TOKENS = 8
ROUTER_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the activations it reads in place
ROUTER_FUSED_EXPERTS = 4
ROUTER_FUSED_BLOCK_D = 512
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def router_fused(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, softmax: bool,
                 bias: torch.Tensor | None = None, norm_topk_prob: bool = True, scaling: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits ``x.float() @ weight.T`` and :func:`topk_route` on them in one launch: x is read in
    its dtype and converted in registers (no float32 copy of x), each program computes the float32 logits of
    ROUTER_FUSED_EXPERTS experts for every token, and the last program to finish (a device counter) scores and
    routes each token as :func:`topk_route` does. Decode sizes: at most ROUTER_FUSED_MAX_TOKENS tokens.

    The logits are summed in another order than cuBLAS's float32 GEMM, so they agree with ``F.linear`` to
    float32 rounding, and the indices with :func:`topk_route_ref` on those logits except at near-ties.
    CUDA-graph capturable (no host synchronisation; the counter is allocated at the first call on a device,
    which must be eager, and is back at 0 after every launch). One launch at a time per device: the counter
    is shared, so two launches running at once on different streams would count into each other.

    Args:
        x: [N, D] activations (float32 / bfloat16 / float16), unit-stride rows, N <= ROUTER_FUSED_MAX_TOKENS.
        weight: [E, D] float32 router weight, contiguous.
        top_k, softmax, bias, norm_topk_prob, scaling: as :func:`topk_route`.

    Returns:
        (weights [N, k] float32, indices [N, k] int64), largest choice first.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit, N above ROUTER_FUSED_MAX_TOKENS, top_k
            outside [1, E], a bias with softmax or of the wrong shape, CPU tensors without the interpreter, or
            a first call on a device inside a CUDA-graph capture.
    """
    name = "router_fused"
    if x.dim() != 2 or x.dtype not in ROUTER_FUSED_DTYPES or x.stride(-1) != 1:
        raise ValueError(f"{name}: x must be [N, D] float32 / bfloat16 / float16 with unit-stride rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    N, D = x.shape
    if weight.dim() != 2 or weight.shape[1] != D or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"{name}: weight must be a contiguous [E, D={D}] float32 tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if N > ROUTER_FUSED_MAX_TOKENS:
        raise ValueError(f"{name}: at most ROUTER_FUSED_MAX_TOKENS={ROUTER_FUSED_MAX_TOKENS} tokens, got {N} "
                         "(larger batches: F.linear then topk_route)")
    E = weight.shape[0]
    _check_routing(name, E, top_k, softmax, bias)
    check_launchable(*((x, weight) if bias is None else (x, weight, bias)), name=name)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    indices = torch.empty(N, top_k, dtype=torch.int64, device=x.device)
    if N == 0:
        return weights, indices
    if x.device not in _COUNTERS:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{name}: the first call on {x.device} is inside a CUDA-graph capture, where the "
                             "device counter would be allocated but not zeroed; call it once eagerly before "
                             "capturing (the engine's warm-up step does)")
        _COUNTERS[x.device] = torch.zeros(1, dtype=torch.int32, device=x.device)
    logits = torch.empty(N, E, dtype=torch.float32, device=x.device)
    bias_arg = bias.float().contiguous() if bias is not None else logits
    _router_fused_kernel[(triton.cdiv(E, ROUTER_FUSED_EXPERTS),)](
        x, weight, logits, bias_arg, weights, indices, _COUNTERS[x.device], N, E, D, x.stride(0), float(scaling),
        SOFTMAX=softmax, HAS_BIAS=bias is not None, NORM=norm_topk_prob, K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
        BLOCK_N=triton.next_power_of_2(max(N, 1)), EXPERTS=ROUTER_FUSED_EXPERTS, BLOCK_D=ROUTER_FUSED_BLOCK_D,
        num_warps=4,
    )
    return weights, indices
