"""Routed experts at decode sizes as CUDA-core GEMVs over the chosen experts only (16-bit and fp32 weights),
beside the plain-PyTorch reference they are tested against.

For tokens ``h`` [N, L] each routed to k experts (``indices`` [N, k] int64, ``weights`` [N, k] float32, from
runners.engine.models.moe.TopkRouter) and expert weights stacked in nn.Linear layout (``up`` / ``gate``
[E, I, L], ``down`` [E, L, I])::

    out[n] = sum_j weights[n, j] * down_e(a),   e = indices[n, j],
    a = act(up_e h[n])  or, gated,  a = act(gate_e h[n]) * up_e h[n]

the same result as runners/engine/models/moe.py's ``moe_experts_ref`` / ``moe_experts_fused``. Activations:
"relu2" (relu(x)^2, NemotronH) and "silu" (x * sigmoid(x), Qwen3-Next's gated SwiGLU experts).

The grouped-GEMM path (sort the N * k (token, expert) pairs by expert, then ``torch._grouped_mm``) costs a
preparation pass over all E experts per projection and pads each expert's few rows to a tensor-core tile; at
decode sizes (a few pairs per expert) both dominate. Here each program owns one (token, expert) pair and one
tile of output features: it reads its expert id straight from ``indices`` (no sort, no offsets scan over E),
streams that expert's weight rows once and reduces over the input features on CUDA cores (``tl.sum``), as the
decode GEMV kernels of kernels/quant/ do. So the work follows the pairs present, nothing is read on the host
and every launch's grid follows from N, k and the weight shapes (CUDA-graph capturable). Three launches:

1. gate / up with the activation fused: grid (I tiles, pairs, K splits) -> ``a`` [P, I] in h's dtype;
2. down: grid (L tiles, pairs, K splits) -> per-pair outputs [S, P, L] (h's dtype unsplit, fp32 partial
   sums split);
3. combine: out[n] = sum_j weights[n, j] * y[n * k + j] in float32, in choice order, cast to h's dtype
   (split partials summed and rounded to h's dtype first).

Where the output tiles alone give too few programs to keep the GPU's SMs streaming, K is split into ranges
whose fp32 partial sums a later launch adds (tile sizes and split from kernels/quant/_common.py's
``gemv_config``; for gate / up, torch adds the partials and runs the activation, since kernels/quant's
``splitk_sum`` casts to bf16 with the interpreter's truncating cast; the combine kernel adds down's). Rounding
mirrors the reference: each projection's fp32 sum is rounded to h's dtype before the activation, the
activation's result and the gated product are rounded likewise, so the kernels and the reference differ only
in the fp32 summation order. The design is that of the fused-MoE decode kernels of vLLM and SGLang (one
program per routed token and weight tile, expert id read from the routing), written here as GEMVs.

Shapes: N tokens, k choices per token, P = N * k pairs (pair p = n * k + j), E experts, L the MoE width
(latent size for NemotronH's latent MoE), I the expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import INPUT_DTYPES, check_dtype, check_launchable, round_rne
from kernels.quant._common import gemv_config, use_kernel

# Activation names this module fuses, and the kernel's code for each (0: none, the down projection).
ACT_CODES = {"relu2": 1, "silu": 2}
# Tile of one loop iteration of a pair-GEMV program (4 warps): at most GEMV_MAX_BLOCK_N output rows per weight
# matrix it streams (32 for up / down, 16 for gate and up together) and about GEMV_TILE_WEIGHTS weights over
# its matrices, in slices of at least GEMV_BLOCK_K input features (kernels/quant's 128-column K step).
# ptxas for sm_90 (Triton 3.9, bf16): 32 x 128 one matrix 108 registers, 16 x 256 56, 16 x 128 two
# matrices 119, none spilled; 64-row tiles or 8192 weights per iteration reach 255 registers and spill.
GEMV_BLOCK_K = 128
GEMV_MAX_BLOCK_N = 32
GEMV_TILE_WEIGHTS = 4096
# Launch settings of every per-pair GEMV launcher (this file's, kernels/quant/nvfp4.py's and block_fp8.py's):
# warps per program and Triton's software-pipelining depth of the K loop (num_stages 1: each tile's loads wait
# for the previous tile's products). Read at call time (benchmarks/sweep_pair_gemv.py times the alternatives).
PAIR_LAUNCH = {"num_warps": 4, "num_stages": 1}


# ---------------------------------------------------------------------------------------------------------
# checks and reference
# ---------------------------------------------------------------------------------------------------------


def _check(h, weights, indices, up, gate, down, activation, name) -> None:
    """Raise ValueError unless the arguments fit :func:`moe_gemv_ref`'s contract (values are not read)."""
    if activation not in ACT_CODES:
        raise ValueError(f"{name}: activation must be one of {tuple(ACT_CODES)}, got {activation!r}")
    if h.dim() != 2:
        raise ValueError(f"{name}: h must be [N, L], got shape {tuple(h.shape)}")
    check_dtype(h, INPUT_DTYPES, "h", name)
    N, L = h.shape
    if indices.dim() != 2 or indices.shape[0] != N or indices.dtype != torch.int64:
        raise ValueError(f"{name}: indices must be int64 [N = {N}, k], got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if tuple(weights.shape) != tuple(indices.shape) or weights.dtype != torch.float32:
        raise ValueError(f"{name}: weights must be float32 {tuple(indices.shape)} (like indices), got "
                         f"{weights.dtype} {tuple(weights.shape)}")
    if up.dim() != 3 or up.shape[2] != L:
        raise ValueError(f"{name}: up must be [E, I, L = {L}], got shape {tuple(up.shape)}")
    E, I, _ = up.shape
    if gate is not None and tuple(gate.shape) != (E, I, L):
        raise ValueError(f"{name}: gate must be [E, I, L] = {(E, I, L)} like up, got {tuple(gate.shape)}")
    if tuple(down.shape) != (E, L, I):
        raise ValueError(f"{name}: down must be [E, L, I] = {(E, L, I)}, got {tuple(down.shape)}")
    for what, t in (("up", up), ("gate", gate), ("down", down)):
        if t is not None and t.dtype != h.dtype:
            raise ValueError(f"{name}: {what} is {t.dtype} but h is {h.dtype}; give the experts h's dtype")
    devices = {t.device for t in (h, weights, indices, up, down, *(() if gate is None else (gate,)))}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")


def act_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    """relu(x)^2 or silu(x) in x's dtype (torch's ops: fp32 internally for 16-bit x, one final rounding)."""
    return torch.square(F.relu(x)) if activation == "relu2" else F.silu(x)


def _pair_linear_ref(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Row p of x [P, in] times w[expert[p]] [out, in] transposed, summed in float32, rounded to x's dtype."""
    return torch.einsum("poi,pi->po", w[expert].float(), x.float()).to(x.dtype)


def moe_gemv_ref(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: torch.Tensor,
                 gate: torch.Tensor | None, down: torch.Tensor, activation: str) -> torch.Tensor:
    """Reference routed experts, pair by pair (the specification of :func:`moe_gemv`): each pair's expert
    matrices are gathered, every projection is summed in float32 and rounded to h's dtype, the activation
    (and the gated product) in h's dtype as torch computes it, and the k outputs of a token are weighted and
    summed in float32, then rounded to h's dtype. Gathers P full expert matrices: small inputs only.

    Args:
        h: [N, L] float32 / bfloat16 / float16. weights: [N, k] float32. indices: [N, k] int64 in [0, E).
        up, gate: [E, I, L] (gate None for non-gated experts); down: [E, L, I]; all in h's dtype.
        activation: "relu2" or "silu".

    Returns:
        [N, L] in h's dtype. Mutates nothing.

    Raises:
        ValueError: shapes, dtypes, devices or an activation that do not fit.
    """
    _check(h, weights, indices, up, gate, down, activation, "moe_gemv_ref")
    n, k = indices.shape
    expert = indices.flatten()
    x = h.repeat_interleave(k, dim=0)  # [P, L]: pair p = n * k + j holds token n
    u = _pair_linear_ref(x, up, expert)
    if gate is None:
        a = act_ref(u, activation)
    else:
        a = act_ref(_pair_linear_ref(x, gate, expert), activation) * u
    y = _pair_linear_ref(a, down, expert).view(n, k, -1)
    return (y.float() * weights[..., None]).sum(dim=1).to(h.dtype)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def apply_activation(v, ACT: tl.constexpr, dtype: tl.constexpr):
    """relu2 (ACT 1) or silu (ACT 2) of fp32 v (already on ``dtype``'s grid), rounded to ``dtype``."""
    if ACT == 1:
        r = tl.maximum(v, 0.0)
        res = round_rne(r * r, dtype)
    else:
        res = round_rne(v / (1.0 + tl.exp(-v)), dtype)
    return res


@triton.jit
def store_pair_rows(out_ptr, out2_ptr, acc, acc2, p, pid_k, offs_n, mask_n, stride_om, stride_os,
                    GATED: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr):
    """The epilogue every per-pair GEMV shares (this file's bf16 one, kernels/quant/nvfp4.py's and
    block_fp8.py's): split-K (SPLIT) stores the fp32 partials acc [BLOCK_N] (and the gate's acc2) of pair p
    at split pid_k; otherwise acc is rounded to out's dtype, the activation (ACT: 0 none, 1 relu2, 2 silu)
    applied, a gated pair multiplied by its rounded gate, and the row stored: the rounding order of
    :func:`act_ref` on a bf16 / fp16 / fp32 product."""
    if SPLIT:
        o = pid_k.to(tl.int64) * stride_os + p.to(tl.int64) * stride_om + offs_n
        tl.store(out_ptr + o, acc, mask=mask_n)
        if GATED:
            tl.store(out2_ptr + o, acc2, mask=mask_n)
    else:
        dt: tl.constexpr = out_ptr.dtype.element_ty
        v = round_rne(acc, dt)
        if ACT != 0:
            v = apply_activation(v, ACT, dt)
        if GATED:
            v = round_rne(v * round_rne(acc2, dt), dt)
        tl.store(out_ptr + p.to(tl.int64) * stride_om + offs_n, v.to(dt), mask=mask_n)  # v: on dt's grid


@triton.jit
def _pair_gemv_kernel(
    x_ptr, idx_ptr, w_ptr, w2_ptr, out_ptr, out2_ptr,
    NOUT, K, TOPK, STEPS,
    stride_xm, stride_we, stride_wn, stride_om, stride_os,
    GATED: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (pair, output tile, K range) per program: grid (NOUT tiles, pairs, K splits).

    Pair p's expert is ``idx_ptr[p]``; its input row is row ``p // TOPK`` of x (TOPK = k for gate / up, whose
    input is the token's h; 1 for down, whose input is the pair's own activation row). The program streams
    rows [pid_n * BLOCK_N, +BLOCK_N) of the expert's w (and w2 = up when GATED; w is then gate), input
    features [pid_k * STEPS * BLOCK_K, +STEPS * BLOCK_K), loading the input row straight into the weight
    tile's layout (each thread its own columns; L1 hits) and reducing each BLOCK_K slice with tl.sum in fp32.
    Unsplit (SPLIT False): the sum is rounded to out's dtype and, with ACT != 0, the activation (and the
    gated product with w2's sum) applied in that dtype's rounding, then stored to out [P, NOUT]. Split: the
    fp32 partial sums go to out (and out2 for w2) [S, P, NOUT] at split pid_k (stride_os)."""
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(idx_ptr + p)
    row = p // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NOUT
    w_off = expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_lo = pid_k * STEPS * BLOCK_K
    k_hi = tl.minimum(k_lo + STEPS * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k[None, :] + offs_n[:, None] * 0  # [BLOCK_N, BLOCK_K] column index
        mk = mask_n[:, None] & (kk < k_hi)
        w = tl.load(w_ptr + w_off + kk, mask=mk, other=0.0)
        if GATED:
            w2 = tl.load(w2_ptr + w_off + kk, mask=mk, other=0.0)
        x = tl.load(x_row + kk, mask=mk, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x, 1)
        if GATED:
            acc2 += tl.sum(w2.to(tl.float32) * x, 1)
    store_pair_rows(out_ptr, out2_ptr, acc, acc2, p, pid_k, offs_n, mask_n, stride_om, stride_os, GATED, ACT,
                    SPLIT)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, rows_ptr, L, TOPK, S, stride_ys, stride_ym, stride_wn, stride_om,
                    BLOCK_L: tl.constexpr, HAS_ROWS: tl.constexpr):
    """out[n, c] = sum_j w[n, j] * y[row(n * TOPK + j), c] in fp32, choice order, cast to out's dtype, with
    row(p) = rows[p] (HAS_ROWS: y sorted by expert, the grouped path) or p; y's S split partials (fp32, S > 1)
    are summed first and rounded to out's dtype (the down projection's result as the reference rounds it);
    with S == 1, y holds that result. Grid (N, L tiles)."""
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask = cols < L
    dt: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for j in range(TOPK):
        pair = (n * TOPK + j).to(tl.int64)
        if HAS_ROWS:
            pair = tl.load(rows_ptr + pair).to(tl.int64)
        y = tl.zeros((BLOCK_L,), dtype=tl.float32)
        for s in range(S):
            y += tl.load(y_ptr + s * stride_ys + pair * stride_ym + cols, mask=mask, other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + n.to(tl.int64) * stride_wn + j)
        acc += round_rne(y, dt) * wj
    tl.store(out_ptr + n.to(tl.int64) * stride_om + cols, round_rne(acc, dt).to(dt), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------------------


def pair_gemv_config(pairs: int, n_out: int, K: int, matrices: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, split, steps per split) of one pair-GEMV launch: ``pairs`` (token, expert) pairs,
    ``n_out`` output features, K input features, ``matrices`` weight matrices streamed together (2 for gate
    and up). The split comes from kernels/quant/_common.py's ``gemv_config`` for one row per weight matrix
    and ``pairs`` matrices (K counted in GEMV_BLOCK_K-column steps); BLOCK_N is its choice capped at
    GEMV_MAX_BLOCK_N / matrices (register budget: more output tiles only add programs). Split, BLOCK_K is
    GEMV_BLOCK_K and each split covers ``steps`` of them; unsplit, BLOCK_K widens to GEMV_TILE_WEIGHTS /
    (BLOCK_N x matrices) (at most K rounded up to a power of two), so narrow tiles request as many weights
    per iteration as wide ones."""
    k_steps = triton.cdiv(K, GEMV_BLOCK_K)
    _, bn, split, per = gemv_config(1, n_out, pairs, k_steps)
    bn = min(bn, max(16, GEMV_MAX_BLOCK_N // matrices))
    if split > 1:
        return bn, GEMV_BLOCK_K, split, per
    bk = max(GEMV_BLOCK_K, min(GEMV_TILE_WEIGHTS // (bn * matrices), triton.next_power_of_2(K)))
    return bn, bk, 1, triton.cdiv(K, bk)


def _launch_pair_gemv(x, indices, w, w2, out_dtype, topk, act_code, dependent: bool = False):
    """One pair-GEMV launch (see :func:`_pair_gemv_kernel`): x [rows, K], w (and w2) [E, NOUT, K], pair p's
    input row p // topk. Returns [P, NOUT] in ``out_dtype`` when unsplit, else the fp32 partial sums
    [S, P, NOUT] (and w2's). ``dependent`` is ignored (a plain Triton launch)."""
    P = indices.numel()
    NOUT, K = w.shape[1], w.shape[2]
    bn, bk, split, steps = pair_gemv_config(P, NOUT, K, 1 if w2 is None else 2)
    if split == 1:
        out = torch.empty(P, NOUT, dtype=out_dtype, device=x.device)
        out2 = out
    else:
        out = torch.empty(split, P, NOUT, dtype=torch.float32, device=x.device)
        out2 = torch.empty_like(out) if w2 is not None else out
    _pair_gemv_kernel[(triton.cdiv(NOUT, bn), P, split)](
        x, indices, w, w2 if w2 is not None else w, out, out2,
        NOUT, K, topk, steps,
        x.stride(0), w.stride(0), w.stride(1), out.stride(-2), out.stride(0) if split > 1 else 0,
        GATED=w2 is not None, ACT=act_code if split == 1 else 0, SPLIT=split > 1,
        BLOCK_N=bn, BLOCK_K=bk, **PAIR_LAUNCH,
    )
    return out, (out2 if w2 is not None else None), split


def moe_gemv(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: torch.Tensor,
             gate: torch.Tensor | None, down: torch.Tensor, activation: str) -> torch.Tensor:
    """Routed experts as per-pair GEMVs over the chosen experts (module docstring): same arguments, result and
    errors as :func:`moe_gemv_ref`, equal to it up to the fp32 summation order. No sort, no pass over all E
    experts, no host synchronisation; shapes fixed by N, k and the weights (CUDA-graph capturable). Meant for
    decode sizes (a few pairs per expert: each pair re-reads its expert's weights, from L2 when repeated);
    runners/engine/models/moe.py takes it below its MOE_GEMV_MAX_PAIRS. Triton on CUDA and under
    TRITON_INTERPRET=1, the reference on a plain CPU run. Expert ids are not range-checked (that would read
    them on the host): an id outside [0, E) reads out of bounds.

    Args:
        h: [N, L] float32 / bfloat16 / float16 (any row stride). weights: [N, k] float32. indices: [N, k]
            int64 in [0, E). up, gate: [E, I, L] (gate None for non-gated experts); down: [E, L, I]; in h's
            dtype (copied when not contiguous). activation: "relu2" or "silu".

    Returns:
        [N, L] in h's dtype. Mutates nothing.

    Raises:
        ValueError: shapes, dtypes, devices or an activation that do not fit (CPU tensors without the
            interpreter are not an error: the reference computes them).
    """
    name = "moe_gemv"
    _check(h, weights, indices, up, gate, down, activation, name)
    if not use_kernel(h):
        return moe_gemv_ref(h, weights, indices, up, gate, down, activation)
    check_launchable(h, weights, indices, up, down, *(() if gate is None else (gate,)), name=name)
    up, down = up.contiguous(), down.contiguous()
    gate = gate.contiguous() if gate is not None else None
    return run_pair_launches(h, weights, indices, up, gate, down, activation, _launch_pair_gemv, up.shape[1])


def run_pair_launches(h, weights, indices, up, gate, down, activation: str, launch, intermediate: int):
    """The three launches of the per-pair path, shared by every weight format (this module's 16-bit /
    float32 experts, each quantized format's in kernels/quant/<format>.py): gate / up with the activation fused,
    down, the float32 combine. ``launch(x, indices, w, w2, out_dtype, topk, act_code, dependent=False) ->
    (out, out2, split)`` runs one projection in the weights' format (``w`` / ``w2``: that format's weight
    objects, e.g. tensors or (codes, scales) tuples; out [split, P, NOUT] float32 partials when split > 1, else
    [P, NOUT] in out_dtype with the activation applied); ``dependent`` True (the down projection) says the
    previous kernel on the stream wrote x and nothing else the launch reads, which lets a launcher overlap
    that kernel's end (kernels/quant/pair_cuda.py's PDL); a launcher may ignore it. ``intermediate``: the
    experts' I (0: nothing to compute).
    h [N, L] (any row stride), weights [N, k] float32, indices [N, k] int64 as :func:`moe_gemv`; returns
    [N, L] in h's dtype, mutates nothing. The split partials are summed in fp32 and rounded to h's dtype
    before the activation, as :func:`moe_gemv_ref` rounds."""
    N, k = indices.shape
    L = h.shape[1]
    out = torch.empty(N, L, dtype=h.dtype, device=h.device)
    if N == 0 or k == 0 or L == 0 or intermediate == 0:  # nothing routed, or experts without features
        return out.zero_()
    if h.stride(1) != 1:
        h = h.contiguous()
    idx = indices.contiguous()
    weights = weights.contiguous()
    act = ACT_CODES[activation]
    # gate / up: w is gate (activation side) and w2 up when gated; w is up otherwise
    first, second = (gate, up) if gate is not None else (up, None)
    a, a2, split = launch(h, idx, first, second, h.dtype, k, act)
    if split > 1:  # partials summed in fp32 and rounded to h's dtype, then the activation as the reference
        a = act_ref(a.sum(0).to(h.dtype), activation)
        if a2 is not None:
            a = a * a2.sum(0).to(h.dtype)
    y, _, split = launch(a, idx, down, None, h.dtype, 1, 0, dependent=True)
    if split == 1:
        y = y[None]
    _launch_combine(y, weights, out, None)
    return out


def _launch_combine(y: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None) -> None:
    """_combine_kernel over y [S, P, L] (rows contiguous), weights [N, k] float32 (rows contiguous), out [N, L]
    (columns contiguous), rows int64 [P] or None."""
    N, k = weights.shape
    L = out.shape[1]
    block_l = min(256, triton.next_power_of_2(L))
    _combine_kernel[(N, triton.cdiv(L, block_l))](
        y, weights, out, rows if rows is not None else y, L, k, y.shape[0], y.stride(0), y.stride(1),
        weights.stride(0), out.stride(0), BLOCK_L=block_l, HAS_ROWS=rows is not None, num_warps=4)


def combine_sorted_ref(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' output from the grouped path's expert-sorted rows: out[n] = sum_j weights[n, j] *
    y[rows[n * k + j]] in float32, cast to y's dtype (runners/engine/models/moe.py's moe_experts_grouped).

    Args:
        y: [P, L] (P = N * k), the down projection's rows sorted by expert. rows: int64 [P], the row of y
            holding pair p = n * k + j. weights: [N, k] float32.

    Returns:
        [N, L] in y's dtype. Pure function.
    """
    N, k = weights.shape
    return (y.index_select(0, rows).view(N, k, y.shape[1]).float() * weights[..., None]).sum(dim=1).to(y.dtype)


def combine_sorted(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """:func:`combine_sorted_ref` in one Triton launch (this module's combine kernel, reading y's rows through
    ``rows``): the weighted sum in float32 in choice order (the reference's torch.sum may add in another order,
    so an element may differ in its last bit), cast to y's dtype. Replaces the reference's gather, float32 copy,
    product and sum (four passes over [P, L]) with one read of y. No host synchronisation.

    Args:
        y: [P, L] float32 / bfloat16 / float16 on CUDA (or under TRITON_INTERPRET=1), columns contiguous.
        rows: int64 [P] with values in [0, P) (not checked: reading them would synchronise).
        weights: [N, k] float32 with N * k = P.

    Returns:
        [N, L] in y's dtype, a new tensor. Mutates nothing.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit.
    """
    if y.dim() != 2 or rows.dim() != 1 or weights.dim() != 2 or rows.numel() != y.shape[0] \
            or weights.numel() != y.shape[0]:
        raise ValueError(f"combine_sorted: y [P, L], rows [P], weights [N, k] with N * k = P; got y "
                         f"{tuple(y.shape)}, rows {tuple(rows.shape)}, weights {tuple(weights.shape)}")
    if rows.dtype != torch.int64 or weights.dtype != torch.float32:
        raise ValueError(f"combine_sorted: rows must be int64 and weights float32, got {rows.dtype} and "
                         f"{weights.dtype}")
    if y.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"combine_sorted: y must be float32, bfloat16 or float16, got {y.dtype}")
    if not (y.device == rows.device == weights.device):
        raise ValueError(f"combine_sorted: y, rows and weights must share a device, got {y.device}, "
                         f"{rows.device}, {weights.device}")
    N = weights.shape[0]
    out = torch.empty(N, y.shape[1], dtype=y.dtype, device=y.device)
    if N == 0 or y.shape[1] == 0:
        return out.zero_()
    if y.stride(1) != 1:
        y = y.contiguous()
    _launch_combine(y[None], weights.contiguous(), out, rows.contiguous())
    return out
