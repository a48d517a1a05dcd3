"""The last step of a MoE block with a gated shared expert (Qwen3-Next): the shared expert's output scaled by
its sigmoid gate, added to the routed experts' output, in one Triton launch; and the PyTorch reference.

    scale[n] = sigmoid(x[n] . w)                      (float32; w the shared_expert_gate weight, [D])
    out[n]   = routed[n] + to_x(scale[n] * shared[n])  (in x's dtype, as the 16-bit sum of two tensors)

(transformers' ``Qwen3NextSparseMoeBlock.forward``: ``shared_expert_output = sigmoid(shared_expert_gate(h)) *
shared_expert_output``, then ``final_hidden_states + shared_expert_output``; the gate is read in float32 as the
router is, ``runners.engine.models.moe.MoE``.) In the eager decode step the reference is seven launches
(three casts, the one-column GEMM, sigmoid, the product, the sum); the kernel is one program per token that
reduces x . w in registers and writes the row. It agrees with the reference to float32 rounding (the dot
product is reduced in another order, Triton's exp is the hardware one), so a 16-bit element may differ in
its last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, round_rne

COMBINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shared_gate_combine_ref(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor,
                            routed: torch.Tensor) -> torch.Tensor:
    """``routed + (sigmoid(x . w) * shared)`` (module docstring). Pure function.

    Args:
        x: [N, D] the block's (normed) input; gate_weight: [1, D] or [D]; shared, routed: [N, L] in x's dtype.

    Returns:
        [N, L] in x's dtype.
    """
    scale = torch.sigmoid(torch.nn.functional.linear(x.float(), gate_weight.reshape(1, -1).float()))
    return routed + (scale * shared.float()).to(x.dtype)


@triton.jit
def _combine_kernel(x_ptr, w_ptr, s_ptr, r_ptr, out_ptr, D, L, sx, ss, sr,
                    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        acc += (tl.load(x_ptr + n * sx + d, mask=dm, other=0.0).to(tl.float32)
                * tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32))
    z = tl.sum(acc, axis=0)
    scale = 1.0 / (1.0 + tl.exp(-z))
    dt = out_ptr.dtype.element_ty
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        lm = cols < L
        sh = tl.load(s_ptr + n * ss + cols, mask=lm, other=0.0).to(tl.float32)
        ro = tl.load(r_ptr + n * sr + cols, mask=lm, other=0.0).to(tl.float32)
        y = ro + round_rne(scale * sh, dt)
        tl.store(out_ptr + n * L + cols, round_rne(y, dt).to(dt), mask=lm)


def shared_gate_combine(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor,
                        routed: torch.Tensor) -> torch.Tensor:
    """:func:`shared_gate_combine_ref` in one Triton launch (one program per token). Same arguments (rows may
    be strided, the last dim contiguous) and result (a new contiguous tensor); mutates nothing.

    Raises:
        ValueError: CPU tensors without the Triton interpreter, shapes that do not fit, dtypes outside
            COMBINE_DTYPES or shared / routed not in x's dtype.
    """
    name = "shared_gate_combine"
    check_launchable(x, gate_weight, shared, routed, name=name)
    if x.dim() != 2 or shared.dim() != 2 or shared.shape != routed.shape or shared.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: x must be [N, D] and shared, routed [N, L]; got {tuple(x.shape)}, "
                         f"{tuple(shared.shape)}, {tuple(routed.shape)}")
    if gate_weight.numel() != x.shape[1]:
        raise ValueError(f"{name}: gate_weight must have D = {x.shape[1]} elements, got {tuple(gate_weight.shape)}")
    if x.dtype not in COMBINE_DTYPES or shared.dtype != x.dtype or routed.dtype != x.dtype:
        raise ValueError(f"{name}: x must be one of {COMBINE_DTYPES} with shared and routed in its dtype; got "
                         f"{x.dtype}, {shared.dtype}, {routed.dtype}")
    x, shared, routed = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, shared, routed))
    N, D = x.shape
    L = shared.shape[1]
    out = torch.empty(N, L, device=x.device, dtype=x.dtype)
    if N == 0 or L == 0:
        return out
    _combine_kernel[(N,)](x, gate_weight.reshape(-1).contiguous(), shared, routed, out, D, L, x.stride(0),
                          shared.stride(0), routed.stride(0),
                          BLOCK_D=min(4096, triton.next_power_of_2(D)), BLOCK_L=min(4096, triton.next_power_of_2(L)),
                          num_warps=4)
    return out
