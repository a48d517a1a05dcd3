"""fp32-accurate matrix products on bf16 tensor cores, by splitting operands into bf16 pieces (Triton helpers).

A float32 value a is the exact sum of three bf16 values a0 + a1 + a2 (a0 = bf16(a), a1 = bf16(a - a0),
a2 = a - a0 - a1: 8 + 8 + 8 significant bits; bf16 has fp32's exponent range); an fp16 value is the exact sum
of two, a bf16 value is one. A product a @ b with `SA` pieces of a and `SB` of b is the sum of the piece
products a_i @ b_j with i + j < max(SA, SB) (each a bf16 x bf16 tensor-core product accumulated in fp32); the
dropped terms are below 2^-(8 max(SA, SB)) of the result's scale: with three pieces the fp32 rounding
itself, with two about 2^-17 relative. This is the "bf16x3" / "bf16x9" family of emulations of fp32 GEMMs on
bf16 tensor cores (Henry, Tang, Heinecke, "Leveraging the bfloat16 artificial intelligence datatype for
higher-precision computations", ARITH 2019); written from that description.

Why here: the replay kernels reduce a state tile against a few token vectors (C_t . h, S k_t, S q_t). As
CUDA-core FMAs with tl.sum these are shuffle chains (the H200 profile of the FMA kernels: most issued
instructions were SHFL + FADD); as tensor-core products they are a handful of mma instructions.

Interpreter: Triton's CPU interpreter computes a bf16 tl.dot wrongly, so with INTERP the same bf16-exact
pieces go through an fp32 (ieee) dot: the CPU tests check the splitting arithmetic of the GPU path; only
the tensor cores' own accumulation order differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# bf16 pieces needed to hold a value of each dtype exactly
PIECES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@triton.jit
def _mma(a, b, acc, INTERP: tl.constexpr):
    if INTERP:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        res = tl.dot(a, b, acc)
    return res


@triton.jit
def split_dot(a, b, acc, SA: tl.constexpr, SB: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b for fp32 tensors a (M, K), b (K, N) (M, N, K >= 16), with a split into SA bf16 pieces and b
    into SB (1 to 3 each; pass the pieces that hold the operand exactly, see the module docstring)."""
    a0 = a.to(tl.bfloat16)
    b0 = b.to(tl.bfloat16)
    acc = _mma(a0, b0, acc, INTERP)
    if SA >= 2:
        ra = a - a0.to(tl.float32)
        a1 = ra.to(tl.bfloat16)
        acc = _mma(a1, b0, acc, INTERP)
        if SA >= 3:
            a2 = (ra - a1.to(tl.float32)).to(tl.bfloat16)
            acc = _mma(a2, b0, acc, INTERP)
    if SB >= 2:
        rb = b - b0.to(tl.float32)
        b1 = rb.to(tl.bfloat16)
        acc = _mma(a0, b1, acc, INTERP)
        if SB >= 3:
            b2 = (rb - b1.to(tl.float32)).to(tl.bfloat16)
            acc = _mma(a0, b2, acc, INTERP)
        if SA >= 2:
            if SA >= 3 or SB >= 3:
                acc = _mma(a1, b1, acc, INTERP)
    return acc
