"""Routed experts at decode sizes with quantized expert weights as CUDA-core GEMVs over the chosen experts
only: the pieces every format's per-pair launcher shares (input checks, the pair-by-pair reference, output
buffers). The quantized counterpart of kernels/moe_gemv.py (same launches, same rounding points, same combine
kernel); each format's kernels, launcher (``moe_gemv_<format>``) and reference (``moe_gemv_<format>_ref``)
live in its own file, kernels/quant/<format>.py, beside its GEMMs.

For tokens ``h`` [N, L] each routed to k experts (``indices`` [N, k] int64, ``weights`` [N, k] float32)::

    out[n] = sum_j weights[n, j] * down_e(a),   e = indices[n, j],
    a = act(up_e h[n])  or, gated,  a = act(gate_e h[n]) * up_e h[n]

where each projection is the format's product, as the grouped path of runners/engine/models/moe.py's
``moe_experts_grouped`` computes it with the format's grouped GEMM. Each projection's fp32 sum is rounded to
h's dtype, the activation and the gated product likewise (the grouped path's rounding points), and the k
outputs are weighted and summed in float32 (kernels/moe_gemv.py's ``_combine_kernel``). Kernel and reference
differ only in the fp32 summation order.

Launches (one program per (token, expert) pair and output tile; the expert id read from ``indices``, no
sort, no pass over all E experts, no host synchronisation, every grid from N, k and the weight shapes, so
CUDA-graph capturable): gate / up with the activation fused, down, combine: three (plus a torch sum and the
activation where K is split, as kernels/moe_gemv.py; tile sizes and the K split: its ``pair_gemv_config``).

Shapes: N tokens, k choices, P = N * k pairs (pair p = n * k + j), E experts, L the MoE width, I the expert
intermediate size.
"""

from __future__ import annotations

import torch

from kernels._common import INPUT_DTYPES, check_dtype
from kernels.moe_gemv import ACT_CODES, act_ref


def check_pair_inputs(h, weights, indices, activation, name) -> None:
    """Raise ValueError unless h [N, L] (float32 / bfloat16 / float16), indices [N, k] int64, weights [N, k]
    float32 and the activation (kernels.moe_gemv.ACT_CODES) fit; ``name`` prefixes the message."""
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


def check_expert_shapes(L, logical, name) -> tuple[int, int]:
    """Raise ValueError unless the experts' logical shapes fit the MoE width L: ``logical`` {kind: (E, out,
    in) or None (gate, ungated)}, up / gate [E, I, L], down [E, L, I]. Returns (E, I)."""
    E, I, inp = logical["up"]
    if inp != L:
        raise ValueError(f"{name}: up must be [E, I, L = {L}] (logical), got {logical['up']}")
    if logical["gate"] is not None and logical["gate"] != (E, I, L):
        raise ValueError(f"{name}: gate must be [E, I, L] = {(E, I, L)} like up, got {logical['gate']}")
    if logical["down"] != (E, L, I):
        raise ValueError(f"{name}: down must be [E, L, I] = {(E, L, I)}, got {logical['down']}")
    return E, I


def pairs_ref(h, weights, indices, linear, gated: bool, activation: str) -> torch.Tensor:
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


def pair_outputs(P, NOUT, split, gated, dtype, device):
    """(out, out2) of a pair launch: [P, NOUT] in ``dtype`` (out2 = out) unsplit, else float32 partial sums
    [split, P, NOUT] (out2 its own buffer when gated)."""
    if split == 1:
        out = torch.empty(P, NOUT, dtype=dtype, device=device)
        return out, out
    out = torch.empty(split, P, NOUT, dtype=torch.float32, device=device)
    return out, (torch.empty_like(out) if gated else out)


def contiguous_experts(t):
    """An expert stack's tensors made contiguous (None stays None)."""
    return None if t is None else tuple(x.contiguous() for x in t)


def quantize_experts(quantize, chunks) -> tuple[torch.Tensor, ...]:
    """A format's quantizer over experts given a few at a time, so that a released expert stack (512 experts
    of Nemotron 3 Super) and the quantizer's float32 temporaries never exist at once.

    Args:
        quantize: maps [e, N, K] float weights to a tuple of tensors whose leading dim is e, quantizing each
            expert on its own (``nvfp4_quantize``, ``block_fp8_quantize``).
        chunks: an iterable of [e_i, N, K] weight tensors (slices of a stack, or drawn chunk by chunk).

    Returns:
        the quantizer's tuple for all experts, each part concatenated along dim 0 (the same tensors as one call
        over the whole stack). Mutates nothing.
    """
    parts = [quantize(w) for w in chunks]
    return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))
