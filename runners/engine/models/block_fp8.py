"""Block FP8 weights in the engine (transformers' fine-grained FP8, Qwen's and DeepSeek's FP8 releases):
``weight`` float8_e4m3fn [N, K] with ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] (a multiplier per
128 x 128 block: ``W = weight * weight_scale_inv[n // 128, k // 128]``), activations quantized at run time
per token and 128-column group (``activation_scheme: dynamic``), the w8a8 block GEMM of DeepSeek-V3's
inference code as vLLM (fp8_utils ``w8a8_block_fp8_matmul``) and SGLang run it. The GEMMs are
kernels.quant.block_fp8's (Triton, or block-scaled ``torch._scaled_mm`` where the device's torch runs it;
each beside its PyTorch reference); :func:`block_fp8_path` says which runs on a device.
"""

from __future__ import annotations

import torch

from runners.engine.quant_formats import BLOCK_FP8_BLOCK  # the block the kernels run


def block_fp8_path(device: torch.device, shape: tuple[int, int] | None = None) -> str:
    """Which GEMMs a block-FP8 weight of ``shape`` (N, K; None for routed experts) runs on ``device``:
    "reference" off CUDA; "triton+scaled_mm" where kernels.quant.block_fp8.block_scaled_mm_supported holds
    and N, K are whole blocks (its ``block_fp8_linear`` picks block-scaled ``torch._scaled_mm`` for larger row
    counts and the Triton kernels at decode sizes), else "triton". Runs that function's one-time probe on the
    device (call at load time, never inside a captured step)."""
    if device.type != "cuda":
        return "reference"
    if shape is None:
        return "triton"
    from kernels.quant.block_fp8 import block_scaled_mm_supported

    whole = shape[0] % BLOCK_FP8_BLOCK[0] == 0 and shape[1] % BLOCK_FP8_BLOCK[1] == 0
    return "triton+scaled_mm" if whole and block_scaled_mm_supported(device) else "triton"


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times block-FP8 ``weight`` [N, K] (``weight_scale_inv`` [ceil(N/128), ceil(K/128)] float32)
    plus bias [N] -> [..., N] in x's dtype; the kernel on CUDA, the reference elsewhere."""
    from kernels.quant import block_fp8

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = block_fp8.block_fp8_linear if x.is_cuda else block_fp8.block_fp8_linear_ref

    x2 = x.reshape(-1, x.shape[-1])
    return kernel(x2, weight, weight_scale_inv, bias).reshape(*x.shape[:-1], weight.shape[0])


def block_fp8_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Grouped block-FP8 GEMM of the routed experts: x [P, K] sorted by expert, weight fp8 [E, N, K],
    weight_scale_inv [E, ceil(N/128), ceil(K/128)] float32, offsets [E] int32 cumulative ends -> [P, N] in
    x's dtype (kernels.quant.block_fp8; the reference off CUDA)."""
    from kernels.quant import block_fp8

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = block_fp8.block_fp8_grouped_mm if x.is_cuda else block_fp8.block_fp8_grouped_mm_ref

    return kernel(x, weight, weight_scale_inv, offsets)
