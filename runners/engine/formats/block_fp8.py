"""Block FP8 weights (transformers' fine-grained FP8; Qwen's and DeepSeek's FP8 releases): ``weight``
float8_e4m3fn [N, K] with ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] (a multiplier per 128 x 128
block despite the name; bfloat16 in Qwen3-Next's release), activations quantized at run time per token and
128-column group (``activation_scheme: dynamic``). Its modules and GEMMs: runners.engine.models.block_fp8
(kernels/quant/block_fp8.py: Triton kernels that need the fp8 type of sm_89+, or block-scaled
``torch._scaled_mm``; the CPU runs their references)."""

from __future__ import annotations

import math
from typing import Any

from registry.checkpoint import CheckpointError
from registry.hf_config import FORMAT_BLOCK_FP8, QuantConfig
from registry.schema import Quant
from runners.engine.formats import WeightFormat

# the block the kernels run (kernels.quant.block_fp8.BLOCK; the releases' weight_block_size)
BLOCK = (128, 128)


class BlockFP8Format(WeightFormat):
    name = FORMAT_BLOCK_FP8
    method = Quant.fp8.value
    label = "block-FP8"
    min_capability = (8, 9)  # Triton's fp8e4nv type: Ada, Hopper and newer
    tensor_suffixes = (".weight_scale_inv",)
    moe_gemv = True  # up to the unquantized experts' bound: faster than the grouped GEMM there
    # (docs/kernel_performance.md, "Quantized formats")
    # up to decode_rows (8) rows per matrix the activations stay 16-bit (WeightFormat.scheme): at the
    # releases' shapes w8a16 measured faster than w8a8 there (docs/kernel_performance.md, "Quantized formats")
    decode_scheme = "w8a16"
    # dense products on the w8a16 tensor-core kernel (flat in the rows) keep w8a16 up to 64 rows: on the H100
    # it beat w8a8 at 16 rows at every Qwen3-Next shape (1.35-3.4x) and in the sum over them at 64
    # (docs/kernel_performance.md, "the w8a16 tensor-core kernel"; the rule: models.block_fp8.dense_scheme)
    dense_decode_rows = 64

    def pair_kernel(self) -> str:
        from kernels.quant import block_fp8

        return block_fp8.PAIR_KERNEL

    def check(self, quant: QuantConfig) -> None:
        """Refuses blocks other than :data:`BLOCK` and static activations."""
        src = quant.source
        if tuple(quant.weight_block_size) != BLOCK:
            raise CheckpointError(
                f"{src}: block FP8 with weight_block_size {list(quant.weight_block_size)} is not supported: "
                f"the engine's block-FP8 GEMMs run {list(BLOCK)} blocks (Qwen's and DeepSeek's releases)",
                "use a checkpoint with 128 x 128 blocks, or write a per-tensor FP8 one with "
                "python -m runners.tools.quantize --format fp8 SRC DST",
            )
        if quant.activation_scheme != "dynamic":
            raise CheckpointError(
                f"{src}: block FP8 with activation_scheme {quant.activation_scheme} is not supported: block "
                "FP8 quantizes activations at run time (activation_scheme: dynamic)",
                "restore the checkpoint's quantization_config (activation_scheme: dynamic)",
            )

    def linear(self, in_features: int, out_features: int, bias: bool, *, device: Any, bias_dtype: Any) -> Any:
        from runners.engine.models.block_fp8 import BlockFP8Linear

        return BlockFP8Linear(in_features, out_features, bias, device=device, bias_dtype=bias_dtype)

    def to_moe(self, moe: Any) -> None:
        from runners.engine.models.block_fp8 import to_block_fp8_moe

        to_block_fp8_moe(moe)

    def quantize_weight(self, module: str, w: Any, input_amax: Any) -> dict[str, Any]:
        """``weight`` float8_e4m3fn, ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] in bfloat16 (as
        Qwen's release stores it; kernels.quant.block_fp8.block_fp8_quantize); no input scale (dynamic)."""
        import torch

        from kernels.quant.block_fp8 import block_fp8_quantize

        q, scale_inv = block_fp8_quantize(w.detach())
        return {f"{module}.weight": q, f"{module}.weight_scale_inv": scale_inv.to(torch.bfloat16)}

    def stored_nbytes(self, n: int, k: int) -> int:  # bf16 scale_inv per 128 x 128 block
        return n * k + 2 * math.ceil(n / BLOCK[0]) * math.ceil(k / BLOCK[1])


FORMAT = BlockFP8Format()
