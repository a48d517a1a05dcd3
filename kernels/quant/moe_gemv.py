"""Routed experts at decode sizes with quantized expert weights (NVFP4 run W4A16, block FP8) as CUDA-core
GEMVs over the chosen experts only, beside the plain-PyTorch references they are tested against: the
quantized counterpart of kernels/moe_gemv.py (same launches, same rounding points, same combine kernel).

For tokens ``h`` [N, L] each routed to k experts (``indices`` [N, k] int64, ``weights`` [N, k] float32)::

    out[n] = sum_j weights[n, j] * down_e(a),   e = indices[n, j],
    a = act(up_e h[n])  or, gated,  a = act(gate_e h[n]) * up_e h[n]

where each projection is the format's product, as the grouped path of runners/engine/models/moe.py's
``moe_experts_grouped`` computes it with kernels/quant's grouped GEMMs:

- NVFP4 (W4A16): ``W = e2m1 * weight_scale * weight_scale_2`` (kernels/quant/nvfp4.py's format), the
  activation in its own dtype, the product summed in float32;
- block FP8: the input row quantized per 128-column group with kernels/quant/block_fp8.py's rule (scale =
  max(amax, 1e-10) / 448, codes rounded to e4m3), each group's fp32 product times the row's group scale and
  the weight's 128 x 128 block ``weight_scale_inv``, summed over groups in float32.

Each projection's fp32 sum is rounded to h's dtype, the activation and the gated product likewise (the
grouped path's rounding points), and the k outputs are weighted and summed in float32 (kernels/moe_gemv.py's
``_combine_kernel``). Kernel and reference differ only in the fp32 summation order.

Launches (one program per (token, expert) pair and output tile; the expert id read from ``indices``, no
sort, no pass over all E experts, no host synchronisation, every grid from N, k and the weight shapes, so
CUDA-graph capturable): gate / up with the activation fused, down, combine: three (plus a torch sum and the
activation where K is split, as kernels/moe_gemv.py). The NVFP4 codes are read as int32 words and decoded by
kernels/quant/nvfp4.py's ``e2m1_word`` (two elements per 32-bit operation, the 2^14 folded into the final
scale; the K step sized as kernels/quant/nvfp4.py's GEMV: 4 KB of codes per program and step); block FP8
quantizes each 128-column group of its input row in the program that needs it
(kernels/quant/block_fp8.py's ``group_scale_quant``: 128 values, recomputed per output tile, instead of a
separate launch). Tile sizes and the K split: kernels/moe_gemv.py's ``pair_gemv_config``.

Shapes: N tokens, k choices, P = N * k pairs (pair p = n * k + j), E experts, L the MoE width, I the expert
intermediate size. NVFP4 experts: ``(weight uint8 [E, out, in / 2], weight_scale float8_e4m3fn [E, out,
in / 16], weight_scale_2 float32 [E])`` with in % 8 == 0 (whole int32 words); block-FP8 experts: ``(weight
float8_e4m3fn [E, out, in], weight_scale_inv float32 [E, ceil(out / 128), ceil(in / 128)])``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INPUT_DTYPES, check_dtype, check_launchable, interpreter_active, round_rne
from kernels.moe_gemv import ACT_CODES, act_ref, apply_activation, pair_gemv_config, run_pair_launches
from kernels.quant._common import FP8_DTYPE, use_kernel
from kernels.quant.block_fp8 import BLOCK, group_scale_quant, quantize_activation_per_token_group_ref
from kernels.quant.nvfp4 import GEMV_BLOCK_K as NVFP4_GEMV_BLOCK_K
from kernels.quant.nvfp4 import NVFP4_BLOCK, e2m1_word, nvfp4_dequantize

NVFP4Experts = tuple  # (weight, weight_scale, weight_scale_2)
BlockFP8Experts = tuple  # (weight, weight_scale_inv)


# ---------------------------------------------------------------------------------------------------------
# checks and references
# ---------------------------------------------------------------------------------------------------------


def _check_common(h, weights, indices, activation, name) -> None:
    if activation not in ACT_CODES:
        raise ValueError(f"{name}: activation must be one of {tuple(ACT_CODES)}, got {activation!r}")
    if h.dim() != 2:
        raise ValueError(f"{name}: h must be [N, L], got shape {tuple(h.shape)}")
    check_dtype(h, INPUT_DTYPES, "h", name)
    N = h.shape[0]
    if indices.dim() != 2 or indices.shape[0] != N or indices.dtype != torch.int64:
        raise ValueError(f"{name}: indices must be int64 [N = {N}, k], got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if tuple(weights.shape) != tuple(indices.shape) or weights.dtype != torch.float32:
        raise ValueError(f"{name}: weights must be float32 {tuple(indices.shape)} (like indices), got "
                         f"{weights.dtype} {tuple(weights.shape)}")


def _check_shapes(L, logical, name) -> tuple[int, int]:
    """logical: {kind: (E, out, in) or None}; returns (E, I)."""
    E, I, inp = logical["up"]
    if inp != L:
        raise ValueError(f"{name}: up must be [E, I, L = {L}] (logical), got {logical['up']}")
    if logical["gate"] is not None and logical["gate"] != (E, I, L):
        raise ValueError(f"{name}: gate must be [E, I, L] = {(E, I, L)} like up, got {logical['gate']}")
    if logical["down"] != (E, L, I):
        raise ValueError(f"{name}: down must be [E, L, I] = {(E, L, I)}, got {logical['down']}")
    return E, I


def _check_nvfp4(h, weights, indices, up, gate, down, activation, name) -> None:
    """Raise ValueError unless the arguments fit :func:`moe_gemv_nvfp4_ref`'s contract (values not read)."""
    _check_common(h, weights, indices, activation, name)
    logical = {}
    for kind, t in (("up", up), ("gate", gate), ("down", down)):
        if t is None:
            if kind != "gate":
                raise ValueError(f"{name}: {kind} is required")
            logical[kind] = None
            continue
        w, s, s2 = t
        if w.dtype != torch.uint8 or w.dim() != 3 or s.dtype != FP8_DTYPE or s2.dtype != torch.float32:
            raise ValueError(f"{name}: {kind} must be (uint8 [E, out, in / 2], float8_e4m3fn scales, float32 "
                             f"[E]), got {w.dtype} {tuple(w.shape)}, {s.dtype}, {s2.dtype}")
        E, out, half = w.shape
        if tuple(s.shape) != (E, out, triton.cdiv(2 * half, NVFP4_BLOCK)) or tuple(s2.shape) != (E,):
            raise ValueError(f"{name}: {kind} scales must be [E, out, in / 16] and [E] = "
                             f"{(E, out, triton.cdiv(2 * half, NVFP4_BLOCK))}, ({E},); got "
                             f"{tuple(s.shape)}, {tuple(s2.shape)}")
        logical[kind] = (E, out, 2 * half)
    _check_shapes(h.shape[1], logical, name)


def _check_block_fp8(h, weights, indices, up, gate, down, activation, name) -> None:
    """Raise ValueError unless the arguments fit :func:`moe_gemv_block_fp8_ref`'s contract."""
    _check_common(h, weights, indices, activation, name)
    logical = {}
    for kind, t in (("up", up), ("gate", gate), ("down", down)):
        if t is None:
            if kind != "gate":
                raise ValueError(f"{name}: {kind} is required")
            logical[kind] = None
            continue
        w, ws = t
        if w.dtype != FP8_DTYPE or w.dim() != 3:
            raise ValueError(f"{name}: {kind} must be float8_e4m3fn [E, out, in], got {w.dtype} "
                             f"{tuple(w.shape)}")
        E, out, inp = w.shape
        want = (E, triton.cdiv(out, BLOCK), triton.cdiv(inp, BLOCK))
        if tuple(ws.shape) != want or ws.dtype != torch.float32:
            raise ValueError(f"{name}: {kind} weight_scale_inv must be float32 {want}, got {ws.dtype} "
                             f"{tuple(ws.shape)}")
        logical[kind] = (E, out, inp)
    _check_shapes(h.shape[1], logical, name)


def _pairs_ref(h, weights, indices, linear, gated: bool, activation: str) -> torch.Tensor:
    """The pair-by-pair specification: ``linear(x [P, in] in h's dtype, kind, expert [P]) -> fp32 [P, out]``;
    each projection rounded to h's dtype, the activation and gated product in h's dtype, the k outputs
    weighted and summed in float32, then rounded to h's dtype."""
    n, k = indices.shape
    expert = indices.flatten()
    x = h.repeat_interleave(k, dim=0)  # [P, L]: pair p = n * k + j holds token n
    u = linear(x, "up", expert).to(h.dtype)
    if gated:
        a = act_ref(linear(x, "gate", expert).to(h.dtype), activation) * u
    else:
        a = act_ref(u, activation)
    y = linear(a, "down", expert).to(h.dtype).view(n, k, -1)
    return (y.float() * weights[..., None]).sum(dim=1).to(h.dtype)


def moe_gemv_nvfp4_ref(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: NVFP4Experts,
                       gate: NVFP4Experts | None, down: NVFP4Experts, activation: str) -> torch.Tensor:
    """Reference routed experts with NVFP4 weights, pair by pair (the specification of
    :func:`moe_gemv_nvfp4`): each pair's expert matrices are gathered and dequantized in float32
    (kernels/quant/nvfp4.py's ``nvfp4_dequantize``), each projection summed in float32 with the activation in
    its own dtype (W4A16) and rounded to h's dtype; activation, gated product and combine as
    kernels/moe_gemv.py's ``moe_gemv_ref``. Gathers P dequantized matrices: small inputs (or a GPU) only.

    Args:
        h: [N, L] float32 / bfloat16 / float16. weights: [N, k] float32. indices: [N, k] int64 in [0, E).
        up, gate, down: (weight uint8 [E, out, in / 2], weight_scale float8_e4m3fn [E, out, in / 16],
            weight_scale_2 float32 [E]); up / gate logical [E, I, L], down [E, L, I]; gate None when not
            gated. activation: "relu2" or "silu".

    Returns:
        [N, L] in h's dtype. Mutates nothing.

    Raises:
        ValueError: shapes, dtypes or an activation that do not fit.
    """
    _check_nvfp4(h, weights, indices, up, gate, down, activation, "moe_gemv_nvfp4_ref")
    mats = {"up": up, "gate": gate, "down": down}

    def linear(x, kind, expert):
        w, s, s2 = mats[kind]
        wd = nvfp4_dequantize(w[expert], s[expert], s2[expert], torch.float32)  # [P, out, in]
        return torch.einsum("poi,pi->po", wd, x.float())

    return _pairs_ref(h, weights, indices, linear, gate is not None, activation)


def moe_gemv_block_fp8_ref(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: BlockFP8Experts,
                           gate: BlockFP8Experts | None, down: BlockFP8Experts, activation: str
                           ) -> torch.Tensor:
    """Reference routed experts with block-FP8 weights, pair by pair (the specification of
    :func:`moe_gemv_block_fp8`): each projection's input rows are quantized per token and 128-column group
    (kernels/quant/block_fp8.py's ``quantize_activation_per_token_group_ref``), each group's product with the
    pair's expert weight is summed in float32 and multiplied by the row's group scale and the weight block's
    ``weight_scale_inv``, the groups summed in float32 (block_fp8's ``_block_product`` rule per pair), the
    result rounded to h's dtype; activation, gated product and combine as kernels/moe_gemv.py's
    ``moe_gemv_ref``.

    Args:
        h: [N, L] float32 / bfloat16 / float16. weights: [N, k] float32. indices: [N, k] int64 in [0, E).
        up, gate, down: (weight float8_e4m3fn [E, out, in], weight_scale_inv float32 [E, ceil(out / 128),
            ceil(in / 128)]); up / gate [E, I, L], down [E, L, I]; gate None when not gated.
        activation: "relu2" or "silu".

    Returns:
        [N, L] in h's dtype. Mutates nothing.

    Raises:
        ValueError: shapes, dtypes or an activation that do not fit.
    """
    _check_block_fp8(h, weights, indices, up, gate, down, activation, "moe_gemv_block_fp8_ref")
    mats = {"up": up, "gate": gate, "down": down}

    def linear(x, kind, expert):
        w, ws = mats[kind]
        qx, xs = quantize_activation_per_token_group_ref(x, BLOCK)  # [P, K] e4m3, [P, G]
        K = x.shape[1]
        wsn = ws[expert].float().repeat_interleave(BLOCK, dim=1)[:, : w.shape[1]]  # [P, out, G]
        y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
        for g in range(triton.cdiv(K, BLOCK)):
            cols = slice(g * BLOCK, min(K, (g + 1) * BLOCK))
            part = torch.einsum("poi,pi->po", w[expert][:, :, cols].float(), qx[:, cols].float())
            y += part * xs[:, g, None] * wsn[:, :, g]
        return y

    return _pairs_ref(h, weights, indices, linear, gate is not None, activation)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _nvfp4_tile_dot(x_row, w_rows, s_rows, kw, mkw, mask_n, offs_n, KW):
    """sum over one K tile of decoded weight (BLOCK_N rows, the words kw) times the input row x (fp32 sums,
    times 2^-14 as ``e2m1_word`` decodes): [BLOCK_N]. x is loaded in the weight tile's layout (element c of
    word w at column 8 w + c; L1 hits)."""
    m2 = mask_n[:, None] & mkw[None, :]
    wd = tl.load(w_rows + kw[None, :], mask=m2, other=0)
    scw = tl.load(s_rows + (kw // 2)[None, :], mask=m2, other=0.0).to(tl.float32)  # 2 words per 16 columns
    e0, e1, e2, e3, e4, e5, e6, e7 = e2m1_word(wd)
    xc = x_row + 8 * kw[None, :] + offs_n[:, None] * 0
    t = e0 * tl.load(xc, mask=m2, other=0.0).to(tl.float32)
    t += e1 * tl.load(xc + 1, mask=m2, other=0.0).to(tl.float32)
    t += e2 * tl.load(xc + 2, mask=m2, other=0.0).to(tl.float32)
    t += e3 * tl.load(xc + 3, mask=m2, other=0.0).to(tl.float32)
    t += e4 * tl.load(xc + 4, mask=m2, other=0.0).to(tl.float32)
    t += e5 * tl.load(xc + 5, mask=m2, other=0.0).to(tl.float32)
    t += e6 * tl.load(xc + 6, mask=m2, other=0.0).to(tl.float32)
    t += e7 * tl.load(xc + 7, mask=m2, other=0.0).to(tl.float32)
    return tl.sum(t * scw, 1)


@triton.jit
def _pair_nvfp4_kernel(
    x_ptr, idx_ptr, w_ptr, s_ptr, g_ptr, w2_ptr, s2_ptr, g2_ptr, out_ptr, out2_ptr,
    NOUT, KW, TOPK, STEPS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_os,
    GATED: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (pair, output tile, K range) per program, NVFP4 weights: grid (NOUT tiles, pairs, K splits). As
    kernels/moe_gemv.py's ``_pair_gemv_kernel`` (input row p // TOPK, w = gate and w2 = up when GATED), with
    the weights read as int32 words of codes (w_ptr / w2_ptr, KW = K / 8 words per row), their block scales
    (s_ptr / s2_ptr) and global scales (g_ptr / g2_ptr, [E]); stride_we / stride_wn in words."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(idx_ptr + p)
    e64 = expert.to(tl.int64)
    row = p // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NOUT
    n64 = offs_n[:, None].to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + n64 * stride_wn
    s_rows = s_ptr + e64 * stride_se + n64 * stride_sn
    w2_rows = w2_ptr + e64 * stride_we + n64 * stride_wn
    s2_rows = s2_ptr + e64 * stride_se + n64 * stride_sn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs_w = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_lo = pid_k * STEPS * WORDS
    w_hi = tl.minimum(w_lo + STEPS * WORDS, KW)
    for w0 in range(w_lo, w_hi, WORDS):
        kw = w0 + offs_w
        mkw = kw < w_hi
        acc += _nvfp4_tile_dot(x_row, w_rows, s_rows, kw, mkw, mask_n, offs_n, KW)
        if GATED:
            acc2 += _nvfp4_tile_dot(x_row, w2_rows, s2_rows, kw, mkw, mask_n, offs_n, KW)
    acc = acc * (tl.load(g_ptr + expert) * 16384.0)  # weight_scale_2, and the 2^14 of the decode
    if GATED:
        acc2 = acc2 * (tl.load(g2_ptr + expert) * 16384.0)
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
        tl.store(out_ptr + p.to(tl.int64) * stride_om + offs_n, v.to(dt), mask=mask_n)


@triton.jit
def _fp8_tile_dot(w_rows, ws_rows, kk, mk, mask_n, q, xs, g):
    """One 128-column group: sum_k w[n, k] * q[k] (fp32) times the row's group scale xs and the weight
    block's scale of each output row: [BLOCK_N]."""
    w = tl.load(w_rows + kk, mask=mk, other=0.0).to(tl.float32)
    ws = tl.load(ws_rows + g, mask=mask_n, other=0.0)
    return tl.sum(w * q, 1) * xs * ws


@triton.jit
def _pair_block_fp8_kernel(
    x_ptr, idx_ptr, w_ptr, ws_ptr, w2_ptr, ws2_ptr, out_ptr, out2_ptr,
    NOUT, K, TOPK, STEPS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_os,
    GATED: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr,
):
    """One (pair, output tile, K range) per program, block-FP8 weights: grid (NOUT tiles, pairs, K splits);
    BLOCK_K = 128 (one activation group and one weight block column per iteration). Each group of the input
    row is quantized here with block_fp8's rule (``group_scale_quant``), then dotted with the expert's fp8
    weight tile; the rest as kernels/moe_gemv.py's ``_pair_gemv_kernel``. ws_ptr / ws2_ptr: weight_scale_inv
    [E, ceil(NOUT / 128), ceil(K / 128)] (stride_se, stride_sn; unit column stride)."""
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(idx_ptr + p)
    e64 = expert.to(tl.int64)
    row = p // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NOUT
    n64 = offs_n[:, None].to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + n64 * stride_wn
    w2_rows = w2_ptr + e64 * stride_we + n64 * stride_wn
    ws_rows = ws_ptr + e64 * stride_se + (offs_n // BLOCK_K).to(tl.int64) * stride_sn
    ws2_rows = ws2_ptr + e64 * stride_se + (offs_n // BLOCK_K).to(tl.int64) * stride_sn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    g_lo = pid_k * STEPS
    g_hi = tl.minimum(g_lo + STEPS, tl.cdiv(K, BLOCK_K))
    for g in range(g_lo, g_hi):
        cols = g * BLOCK_K + offs_k
        xt = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        q, xs = group_scale_quant(xt[None, :], INTERP)  # [1, BLOCK_K] e4m3 codes, [1] scale
        q = q.to(tl.float32)
        kk = cols[None, :] + offs_n[:, None] * 0
        mk = mask_n[:, None] & (kk < K)
        acc += _fp8_tile_dot(w_rows, ws_rows, kk, mk, mask_n, q, xs, g)
        if GATED:
            acc2 += _fp8_tile_dot(w2_rows, ws2_rows, kk, mk, mask_n, q, xs, g)
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
        tl.store(out_ptr + p.to(tl.int64) * stride_om + offs_n, v.to(dt), mask=mask_n)


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------


def _outputs(P, NOUT, split, gated, dtype, device):
    if split == 1:
        out = torch.empty(P, NOUT, dtype=dtype, device=device)
        return out, out
    out = torch.empty(split, P, NOUT, dtype=torch.float32, device=device)
    return out, (torch.empty_like(out) if gated else out)


def _launch_nvfp4(x, idx, w, w2, out_dtype, topk, act_code):
    """One NVFP4 pair-GEMV launch: x [rows, K]; w, w2: (weight, weight_scale, weight_scale_2) (w2 None
    unless gated). Returns (out, out2, split) as kernels/moe_gemv.py's ``_launch_pair_gemv``."""
    P = idx.numel()
    weight, scale, s2 = w
    NOUT, K = weight.shape[1], 2 * weight.shape[2]
    matrices = 1 if w2 is None else 2
    bn, bk, split, steps = pair_gemv_config(P, NOUT, K, matrices)
    if split == 1:  # kernels/quant/nvfp4.py's GEMV budget: 4 KB of codes per program and step (over matrices)
        bk = max(NVFP4_GEMV_BLOCK_K, min(NVFP4_GEMV_BLOCK_K * 64 // (bn * matrices), triton.next_power_of_2(K)))
        steps = triton.cdiv(K, bk)
    out, out2 = _outputs(P, NOUT, split, w2 is not None, out_dtype, x.device)
    words = weight.view(torch.int32)
    o2 = w2 if w2 is not None else w
    _pair_nvfp4_kernel[(triton.cdiv(NOUT, bn), P, split)](
        x, idx, words, scale, s2, o2[0].view(torch.int32), o2[1], o2[2], out, out2,
        NOUT, K // 8, topk, steps,
        x.stride(0), words.stride(0), words.stride(1), scale.stride(0), scale.stride(1),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        GATED=w2 is not None, ACT=act_code if split == 1 else 0, SPLIT=split > 1,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=1,
    )
    return out, (out2 if w2 is not None else None), split


def _launch_block_fp8(x, idx, w, w2, out_dtype, topk, act_code):
    """One block-FP8 pair-GEMV launch: x [rows, K]; w, w2: (weight, weight_scale_inv) (w2 None unless
    gated); K in 128-column steps (BLOCK_K = 128 always)."""
    P = idx.numel()
    weight, ws = w
    NOUT, K = weight.shape[1], weight.shape[2]
    bn, _, split, steps = pair_gemv_config(P, NOUT, K, 1 if w2 is None else 2)
    if split == 1:
        steps = triton.cdiv(K, BLOCK)
    out, out2 = _outputs(P, NOUT, split, w2 is not None, out_dtype, x.device)
    o2 = w2 if w2 is not None else w
    _pair_block_fp8_kernel[(triton.cdiv(NOUT, bn), P, split)](
        x, idx, weight, ws, o2[0], o2[1], out, out2,
        NOUT, K, topk, steps,
        x.stride(0), weight.stride(0), weight.stride(1), ws.stride(0), ws.stride(1),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        GATED=w2 is not None, ACT=act_code if split == 1 else 0, SPLIT=split > 1,
        BLOCK_N=bn, BLOCK_K=BLOCK, INTERP=interpreter_active(), num_warps=4, num_stages=1,
    )
    return out, (out2 if w2 is not None else None), split


def _contiguous(t):
    return None if t is None else tuple(x.contiguous() for x in t)


def nvfp4_words_ok(*experts: NVFP4Experts | None) -> bool:
    """Whether every NVFP4 expert stack's codes read as int32 words (in % 8 == 0, 4-byte aligned): the
    condition of :func:`moe_gemv_nvfp4` (reads only shapes and pointers)."""
    return all(e is None or (e[0].shape[-1] % 4 == 0 and e[0].data_ptr() % 4 == 0) for e in experts)


def moe_gemv_nvfp4(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: NVFP4Experts,
                   gate: NVFP4Experts | None, down: NVFP4Experts, activation: str) -> torch.Tensor:
    """Routed experts with NVFP4 weights (W4A16) as per-pair GEMVs over the chosen experts (module docstring):
    same arguments, result and errors as :func:`moe_gemv_nvfp4_ref`, equal to it up to the fp32 summation
    order. Three launches, no host synchronisation, grids from shapes only (CUDA-graph capturable). Triton on
    CUDA and under TRITON_INTERPRET=1, the reference on a plain CPU run. Expert ids are not range-checked.

    Raises:
        ValueError: as the reference, and codes that are not whole int32 words (:func:`nvfp4_words_ok`).
    """
    name = "moe_gemv_nvfp4"
    _check_nvfp4(h, weights, indices, up, gate, down, activation, name)
    if not use_kernel(h):
        return moe_gemv_nvfp4_ref(h, weights, indices, up, gate, down, activation)
    up, gate, down = _contiguous(up), _contiguous(gate), _contiguous(down)
    if not nvfp4_words_ok(up, gate, down):
        raise ValueError(f"{name}: the experts' input widths must be multiples of 8 (codes read as int32 "
                         "words); use runners.engine.models.moe.moe_experts_grouped for other widths")
    tensors = [t for e in (up, gate, down) if e is not None for t in e]
    check_launchable(h, weights, indices, *tensors, name=name)
    return run_pair_launches(h, weights, indices, up, gate, down, activation, _launch_nvfp4,
                             up[0].shape[1])


def moe_gemv_block_fp8(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, up: BlockFP8Experts,
                       gate: BlockFP8Experts | None, down: BlockFP8Experts, activation: str) -> torch.Tensor:
    """Routed experts with block-FP8 weights as per-pair GEMVs over the chosen experts (module docstring),
    activations quantized per token and 128-column group inside the kernels with block_fp8's rule: same
    arguments, result and errors as :func:`moe_gemv_block_fp8_ref`, equal to it up to the fp32 summation
    order. Three launches, no host synchronisation, grids from shapes only (CUDA-graph capturable). Triton on
    CUDA and under TRITON_INTERPRET=1, the reference on a plain CPU run. Expert ids are not range-checked.

    Raises:
        ValueError: shapes, dtypes or an activation that do not fit.
    """
    name = "moe_gemv_block_fp8"
    _check_block_fp8(h, weights, indices, up, gate, down, activation, name)
    if not use_kernel(h):
        return moe_gemv_block_fp8_ref(h, weights, indices, up, gate, down, activation)
    up, gate, down = _contiguous(up), _contiguous(gate), _contiguous(down)
    tensors = [t for e in (up, gate, down) if e is not None for t in e]
    check_launchable(h, weights, indices, *tensors, name=name)
    return run_pair_launches(h, weights, indices, up, gate, down, activation, _launch_block_fp8,
                             up[0].shape[1])

