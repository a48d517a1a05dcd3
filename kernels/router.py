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

from dataclasses import dataclass

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
def _route_rows(logits_ptr, bias_ptr, w_ptr, idx_ptr, row0, N, E, stride_row, scaling,
                SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr, BYPASS_L1: tl.constexpr):
    """Scores, top-k and weights of the ROWS logits rows from ``row0`` (those below N), stored at
    w_ptr / idx_ptr + row * K: one [ROWS, BLOCK_E] tile, each round's max taken along the experts of every row
    at once. With BYPASS_L1 the logits are loaded past L1 (.cg): written by other programs of the same
    launch."""
    rows = row0 + tl.arange(0, ROWS).to(tl.int64)
    rmask = rows < N
    offs = tl.arange(0, BLOCK_E)
    valid = (offs < E)[None, :]
    lptr = logits_ptr + rows[:, None] * stride_row + offs[None, :]
    if BYPASS_L1:
        x = tl.load(lptr, mask=valid & rmask[:, None], other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(lptr, mask=valid & rmask[:, None], other=0.0)
    x = x.to(tl.float32)
    if SOFTMAX:
        x = tl.where(valid, x, float("-inf"))
        xmax = tl.max(x, axis=1)
        p = tl.exp(x - xmax[:, None])
        p = tl.where(valid, p, 0.0)
        psum = tl.sum(p, axis=1)
        scores = p / psum[:, None]
    else:
        scores = tl.sigmoid(x)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs, mask=offs < E, other=0.0).to(tl.float32)[None, :]
    # NaN (a poisoned PAD row) counts as the largest choice, as torch.topk orders it: every round then finds
    # an index in [0, E) (NaN == NaN is false, so a NaN left in place would match no lane). No choice is -0.0
    # (scores are >= +0.0 and s + (-s) rounds to +0.0), so equal floats have equal keys below.
    choice = tl.where(choice != choice, float("inf"), choice)
    choice = tl.where(valid, choice, float("-inf"))
    # One max per round and row: each lane's key packs the choice's float32 bits mapped to an int32 of the
    # same order (negative floats have their magnitude bits flipped) in the high word and the lane reversed in
    # the low word, so the largest key is the largest choice and, among equal choices, the lowest index. Keys
    # are distinct within a row (one lane each); a chosen lane drops below every key.
    bits = choice.to(tl.int32, bitcast=True)
    key = (bits ^ tl.where(bits < 0, 0x7FFFFFFF, 0)).to(tl.int64)
    packed = (key << 32) | (BLOCK_E - 1 - offs).to(tl.int64)[None, :]
    kofs = tl.arange(0, BLOCK_K)[None, :]
    indices = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):  # k rounds of one max each: no sort
        best = tl.max(packed, axis=1)
        indices = tl.where(kofs == j, (BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32))[:, None], indices)
        packed = tl.where(packed == best[:, None], -9223372036854775807, packed)
    # the chosen scores, recomputed from their logits with the arithmetic above (the same bits)
    kmask = (kofs < K) & rmask[:, None]
    kptr = logits_ptr + rows[:, None] * stride_row + indices
    if BYPASS_L1:
        xk = tl.load(kptr, mask=kmask, other=0.0, cache_modifier=".cg")
    else:
        xk = tl.load(kptr, mask=kmask, other=0.0)
    xk = xk.to(tl.float32)
    if SOFTMAX:
        weights = tl.exp(xk - xmax[:, None]) / psum[:, None]
    else:
        weights = tl.sigmoid(xk)
    weights = tl.where(kofs < K, weights, 0.0)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling
    tl.store(w_ptr + rows[:, None] * K + kofs, weights, mask=kmask)
    tl.store(idx_ptr + rows[:, None] * K + kofs, indices.to(tl.int64), mask=kmask)


@triton.jit(do_not_specialize=["N"])
def _topk_route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, N, E, stride_row, scaling,
                       SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    _route_rows(logits_ptr, bias_ptr, w_ptr, idx_ptr, tl.program_id(0).to(tl.int64), N, E, stride_row, scaling,
                SOFTMAX, HAS_BIAS, NORM, K, BLOCK_K, BLOCK_E, 1, False)


@triton.jit
def _router_fused_kernel(x_ptr, wt_ptr, logits_ptr, bias_ptr, w_ptr, idx_ptr, counter_ptr, N, E, D, stride_x,
                         scaling, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                         EXPERTS: tl.constexpr, BLOCK_D: tl.constexpr, ROUTE: tl.constexpr,
                         ROUTE_ROWS: tl.constexpr):
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
    if ROUTE:
        # the last program to finish routes every token, ROUTE_ROWS at a time (CUTLASS's serial split-K with a
        # counter, as kernels/quant/block_fp8.py's _serial_split_sum): the barrier orders this program's
        # stores before its count; the count's acquire-release makes every program's stores visible to the
        # last one, whose loads bypass L1; it sets the counter back to 0 for the next launch or graph replay
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            for r0 in range(0, N, ROUTE_ROWS):
                _route_rows(logits_ptr, bias_ptr, w_ptr, idx_ptr, r0, N, E, E, scaling,
                            SOFTMAX, HAS_BIAS, NORM, K, BLOCK_K, BLOCK_E, ROUTE_ROWS, True)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


# Routing keys one lane holds: a warp takes 512 experts' int64 keys (each round's max then stays in warp
# shuffles, with no shared-memory round trip between warps). warps_for and route_rows_per_pass keep to it.
KEYS_PER_LANE = 16


def warps_for(block_e: int) -> int:
    """Warps per program for BLOCK_E experts: one up to 32 x KEYS_PER_LANE = 512, one more per 512 above, at
    most 8 (so a lane holds KEYS_PER_LANE keys up to 4096 experts)."""
    return max(1, min(8, block_e // (32 * KEYS_PER_LANE)))


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
        logits, bias_arg, weights, indices, N, E, logits.stride(0), float(scaling),
        SOFTMAX=softmax, HAS_BIAS=bias is not None, NORM=norm_topk_prob, K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e, num_warps=warps_for(block_e),
    )
    return weights, indices


# The fused router (:func:`router_fused`): at most this many tokens (the last program routes them
# ROUTE_ROWS at a time, so its tail grows with the tokens; decode at batch 1, plain or an MTP verify of 4,
# fits). Where the engine takes it (or router_logits): runners.engine.models.moe.ROUTER_FORMS.
ROUTER_FUSED_MAX_TOKENS = 8
ROUTER_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the activations it reads in place
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class FusedConfig:
    """The launch shape of the fused router's GEMV: ``experts`` per program (a power of two), ``block_d``
    columns per weight tile (a power of two; 0: the whole row, next_power_of_2(D), in one tile) and
    ``num_warps`` per program, which also route (one warp holds a 512-expert row's keys in shuffles, more
    warps route more rows at once through shared memory: :func:`route_rows_per_pass`).

    Raises:
        ValueError: experts or num_warps not a power of two >= 1, block_d neither 0 nor a power of two.
    """

    experts: int
    block_d: int
    num_warps: int

    def __post_init__(self):
        for name in ("experts", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"FusedConfig: {name} must be a power of two >= 1, got {v}")
        if self.block_d < 0 or self.block_d & (self.block_d - 1):
            raise ValueError(f"FusedConfig: block_d must be 0 or a power of two, got {self.block_d}")

    @property
    def name(self) -> str:
        """A short label, e.g. "e2_drow_w4" (2 experts, the whole row, 4 warps): bench_router's row names."""
        return f"e{self.experts}_d{self.block_d or 'row'}_w{self.num_warps}"


# The config per token count: the first entry whose bound is >= N (bounds increasing, the last
# ROUTER_FUSED_MAX_TOKENS). benchmarks/bench_router.py timed the candidates on an H100 at 1, 2, 4 and 8 tokens
# (docs/kernel_performance.md, "The fused router"): 2 experts per program, the whole row in one tile, 4 warps
# was the fastest summed over both release routers in both forms at every count, and within 2 % of each
# router's fastest shape.
ROUTER_FUSED_CONFIGS: tuple[tuple[int, FusedConfig], ...] = ((ROUTER_FUSED_MAX_TOKENS, FusedConfig(2, 0, 4)),)


# The launch shapes benchmarks/bench_router.py times for the table (and the GPU tests run at the release
# shapes): the first form, one or two experts per program with the whole row or 1024 columns per tile, on one
# to four warps.
FUSED_CANDIDATES = (FusedConfig(4, 512, 4), FusedConfig(1, 0, 1), FusedConfig(1, 1024, 1), FusedConfig(1, 0, 2),
                    FusedConfig(1, 0, 4), FusedConfig(2, 0, 4), FusedConfig(2, 1024, 2), FusedConfig(4, 1024, 4))


_CHECKED_TABLES: set = set()  # (name, table) pairs check_bounds_table has passed: checked once, not per call


def check_bounds_table(name: str, table, allowed) -> None:
    """Raise ValueError unless ``table`` is (bound, value) pairs with bounds strictly increasing in [1,
    ROUTER_FUSED_MAX_TOKENS] and every value ``allowed(value)``: the rule of the token-count tables
    (:data:`ROUTER_FUSED_CONFIGS`, runners.engine.models.moe.ROUTER_FORMS), checked whole before a lookup.
    A table that passed is remembered (tables are tuples: hashable, immutable), so the router's eager calls
    pay the check once per table."""
    try:
        if (name, table) in _CHECKED_TABLES:
            return
    except TypeError:  # an unhashable table (a list): checked every time, and refused below if malformed
        pass
    last = 0
    for entry in table:
        ok = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], int)
        if not ok or not last < entry[0] <= ROUTER_FUSED_MAX_TOKENS or not allowed(entry[1]):
            raise ValueError(f"{name} entry {entry!r}: expected (bound, value) with bounds strictly increasing "
                             f"in [1, ROUTER_FUSED_MAX_TOKENS={ROUTER_FUSED_MAX_TOKENS}] and a valid value")
        last = entry[0]
    try:
        _CHECKED_TABLES.add((name, table))
    except TypeError:
        pass


def fused_config(n_tokens: int) -> FusedConfig:
    """The :data:`ROUTER_FUSED_CONFIGS` entry for ``n_tokens`` (<= ROUTER_FUSED_MAX_TOKENS).

    Raises:
        ValueError: a table :func:`check_bounds_table` refuses, or no entry for ``n_tokens``.
    """
    check_bounds_table("ROUTER_FUSED_CONFIGS", ROUTER_FUSED_CONFIGS, lambda c: isinstance(c, FusedConfig))
    for bound, config in ROUTER_FUSED_CONFIGS:
        if n_tokens <= bound:
            return config
    raise ValueError(f"fused_config: no entry for {n_tokens} tokens (ROUTER_FUSED_MAX_TOKENS="
                     f"{ROUTER_FUSED_MAX_TOKENS})")


def route_rows_per_pass(block_n: int, block_e: int, num_warps: int) -> int:
    """Rows the fused router's last program routes per pass: the most (a power of two, at most block_n) whose
    [rows, block_e] int64 keys leave each lane at most KEYS_PER_LANE, as :func:`warps_for` gives topk_route's
    one row."""
    rows = 1
    while rows * 2 <= block_n and rows * 2 * block_e <= KEYS_PER_LANE * 32 * num_warps:
        rows *= 2
    return rows


def _check_fused(name: str, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """(N, D, E) of a fused router launch, or ValueError naming what does not fit."""
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
    return N, D, weight.shape[0]


def _launch_fused(x, weight, logits, bias, weights, indices, counter, top_k, softmax, norm_topk_prob, scaling,
                  config: FusedConfig, route: bool) -> None:
    N, D = x.shape
    E = weight.shape[0]
    block_n = triton.next_power_of_2(max(N, 1))
    # the routing's constexprs only where it is compiled in (ROUTE): router_logits' launches share one variant
    block_e = triton.next_power_of_2(E) if route else 1
    rows = route_rows_per_pass(block_n, block_e, config.num_warps) if route else 1
    dummy = logits
    _router_fused_kernel[(triton.cdiv(E, config.experts),)](
        x, weight, logits, bias if bias is not None else dummy, weights if route else dummy,
        indices if route else dummy, counter if route else dummy, N, E, D, x.stride(0), float(scaling),
        SOFTMAX=softmax, HAS_BIAS=bias is not None, NORM=norm_topk_prob, K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e, BLOCK_N=block_n, EXPERTS=config.experts,
        BLOCK_D=config.block_d or triton.next_power_of_2(D), ROUTE=route, ROUTE_ROWS=rows,
        num_warps=config.num_warps,
    )


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`router_logits`' reference: ``F.linear(x.float(), weight)``, x [N, D], weight [E, D] float32 ->
    [N, E] float32 (a float32 copy of x, then the GEMM)."""
    return torch.nn.functional.linear(x.float(), weight)


def router_fused_ref(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, softmax: bool,
                     bias: torch.Tensor | None = None, norm_topk_prob: bool = True, scaling: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_fused`'s reference: :func:`router_logits_ref` then :func:`topk_route_ref` (n_group = 1);
    same arguments (no launch shape) and result."""
    return topk_route_ref(router_logits_ref(x, weight), top_k, softmax=softmax, bias=bias,
                          norm_topk_prob=norm_topk_prob, scaling=scaling)


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: FusedConfig | None = None) -> torch.Tensor:
    """The fused router's GEMV alone: ``x.float() @ weight.T`` [N, E] float32, x read in its dtype (no float32
    copy), ``config`` (default :func:`fused_config`) its launch shape. For :func:`topk_route` after it (two
    launches instead of the fused one's counter and serial routing tail).

    Raises:
        ValueError: as :func:`router_fused`'s shape, dtype and token checks.
    """
    N, _, E = _check_fused("router_logits", x, weight)
    check_launchable(x, weight, name="router_logits")
    logits = torch.empty(N, E, dtype=torch.float32, device=x.device)
    if N:
        _launch_fused(x, weight, logits, None, None, None, None, 1, False, False, 1.0,
                      config or fused_config(N), route=False)
    return logits


def router_fused(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, softmax: bool,
                 bias: torch.Tensor | None = None, norm_topk_prob: bool = True, scaling: float = 1.0,
                 config: FusedConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits ``x.float() @ weight.T`` and :func:`topk_route` on them in one launch: x is read in
    its dtype and converted in registers (no float32 copy of x), each program computes the float32 logits of
    ``config.experts`` experts for every token (``config``: default :func:`fused_config` of N), and the last
    program to finish (a device counter) scores and routes the tokens as :func:`topk_route` does,
    :func:`route_rows_per_pass` rows at a time. Decode sizes: at most ROUTER_FUSED_MAX_TOKENS tokens.

    The logits are summed in another order than cuBLAS's float32 GEMM, so they agree with ``F.linear`` to
    float32 rounding, and the indices with :func:`topk_route_ref` on those logits except at near-ties.
    CUDA-graph capturable (no host synchronisation; the counter is allocated at the first call on a device,
    which must be eager, and is back at 0 after every launch). One launch at a time per device: the counter
    is shared, so two launches running at once on different streams would count into each other.

    Args:
        x: [N, D] activations (float32 / bfloat16 / float16), unit-stride rows, N <= ROUTER_FUSED_MAX_TOKENS.
        weight: [E, D] float32 router weight, contiguous.
        top_k, softmax, bias, norm_topk_prob, scaling: as :func:`topk_route`.
        config: the launch shape (:class:`FusedConfig`), None for the table's.

    Returns:
        (weights [N, k] float32, indices [N, k] int64), largest choice first.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit, N above ROUTER_FUSED_MAX_TOKENS, top_k
            outside [1, E], a bias with softmax or of the wrong shape, CPU tensors without the interpreter, or
            a first call on a device inside a CUDA-graph capture.
    """
    name = "router_fused"
    N, D, E = _check_fused(name, x, weight)
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
    bias_arg = bias.float().contiguous() if bias is not None else None
    _launch_fused(x, weight, logits, bias_arg, weights, indices, _COUNTERS[x.device], top_k, softmax,
                  norm_topk_prob, scaling, config or fused_config(N), route=True)
    return weights, indices
