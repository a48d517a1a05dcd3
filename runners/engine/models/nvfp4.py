"""NVFP4 weights in the engine, run weight-only (W4A16) as the peers run them on Hopper (vLLM's and SGLang's
Marlin paths, TensorRT-LLM #14775): the packed weights stay in device memory and are dequantized inside the
GEMM (kernels.quant.nvfp4: a Triton W4A16 GEMM and a grouped one for the routed experts, each beside its
dequantize-then-matmul PyTorch reference).

The layout is NVIDIA ModelOpt's NVFP4 export (Model-Optimizer ``unified_export_hf``; vLLM modelopt.py
``ModelOptNvFp4LinearMethod`` reads the same): ``weight`` uint8 [N, K / 2], two e2m1 values per byte with
element 2j in the low nibble; ``weight_scale`` float8_e4m3fn [N, K / 16] (one scale per 16 consecutive
values of a row); ``weight_scale_2`` float32 global, ``W = e2m1 * weight_scale * weight_scale_2``;
``input_scale`` float32, the activation scale of the W4A4 path (unused here: activations stay in the compute
dtype). Per-expert tensors are stacked along a leading E.

:func:`nvfp4_path`: "triton" on CUDA (the kernels), "reference" elsewhere (the CPU runs the references:
correct, slow), the same rule as the FP8 path's dequantizing fallback (runners.engine.models.fp8).
"""

from __future__ import annotations

import torch

NVFP4_PACKED_DTYPE = torch.uint8
NVFP4_SCALE_DTYPE = torch.float8_e4m3fn


def nvfp4_path(device: torch.device) -> str:
    """"triton" (kernels.quant.nvfp4's GEMMs) on a CUDA device, else "reference"."""
    return "triton" if device.type == "cuda" else "reference"


def nvfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 ``x W^T + b``: x [..., K] (bf16 / fp16 / fp32), weight uint8 [N, K / 2], weight_scale fp8 [N, K /
    16], weight_scale_2 0-dim float32, bias [N] or None -> [..., N] in x's dtype; the kernel on CUDA, the
    reference elsewhere (kernels.quant.nvfp4). No host synchronisation on CUDA."""
    from kernels.quant import nvfp4

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = nvfp4.nvfp4_linear if x.is_cuda else nvfp4.nvfp4_linear_ref

    x2 = x.reshape(-1, x.shape[-1])
    return kernel(x2, weight, weight_scale, weight_scale_2, bias).reshape(*x.shape[:-1], weight.shape[0])


def nvfp4_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Grouped W4A16 GEMM of the routed experts: x [P, K] sorted by expert, weight uint8 [E, N, K / 2],
    weight_scale fp8 [E, N, K / 16], weight_scale_2 [E] float32, offsets [E] int32 cumulative ends -> [P, N]
    in x's dtype (kernels.quant.nvfp4; the reference off CUDA)."""
    from kernels.quant import nvfp4

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = nvfp4.nvfp4_grouped_mm if x.is_cuda else nvfp4.nvfp4_grouped_mm_ref

    return kernel(x, weight, weight_scale, weight_scale_2, offsets)
