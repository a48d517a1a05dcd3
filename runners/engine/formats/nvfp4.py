"""NVFP4 weights (NVIDIA ModelOpt ``quant_algo: NVFP4``, or its modules of a MIXED_PRECISION checkpoint:
Nemotron 3 Super NVFP4), run weight-only (W4A16) as the peers run them on Hopper (vLLM's and SGLang's Marlin
paths): ``weight`` uint8 [N, K / 2] (two e2m1 values per byte, element 2j in the low nibble),
``weight_scale`` float8_e4m3fn [N, K / 16] (one scale per :data:`GROUP_SIZE` values of a row), float32 0-dim
``weight_scale_2`` (global; ``W = e2m1 * weight_scale * weight_scale_2``) and ``input_scale`` (the W4A4
activation scale, loaded and unused). Layout: Model-Optimizer ``unified_export_hf``, as vLLM modelopt.py
``ModelOptNvFp4LinearMethod`` reads it. Its modules and GEMMs: runners.engine.models.nvfp4
(kernels/quant/nvfp4.py: Triton kernels that decode the codes in registers and need the fp8 type of sm_89+;
the CPU runs their references)."""

from __future__ import annotations

from typing import Any

from registry.hf_config import FORMAT_NVFP4, NVFP4_GROUP_SIZE
from registry.schema import Quant
from runners.engine.formats import WeightFormat

GROUP_SIZE = NVFP4_GROUP_SIZE  # values per e4m3 block scale (ModelOpt's group_size; others are refused)


class NVFP4Format(WeightFormat):
    name = FORMAT_NVFP4
    method = Quant.nvfp4.value
    label = "NVFP4 (W4A16)"
    min_capability = (8, 9)  # Triton's fp8e4nv type (the e4m3 scales): Ada, Hopper and newer
    tensor_suffixes = (".weight_scale", ".weight_scale_2", ".input_scale")
    moe_gemv = True
    # The per-pair GEMVs decode each pair's codes, the grouped GEMM each chosen expert's once for all its
    # tokens: the Triton GEMVs are faster up to 44 pairs and slower beyond (docs/kernel_performance.md,
    # "Quantized formats").
    moe_gemv_max_pairs = 44
    # The CUDA per-pair kernel (kernels.quant.nvfp4.PAIR_KERNEL "cuda") is 1.6-2.0x faster than Triton's, and
    # faster than the grouped path (then on Triton) at every point measured, up to 176 pairs (8 tokens at
    # top-22: 261.1 against 434.7 us on an H100, docs/kernel_performance.md "Quantized formats"): it takes the
    # unquantized experts' bound (None: MOE_GEMV_MAX_PAIRS, 176), so a 4-token verify step (88 pairs) stays on
    # it. Against the grouped path's CUDA kernel (GROUPED_KERNEL "cuda", the pipelined form) the bound still
    # holds: per pair 139.3 / 258.4 us at 4 / 8 tokens against 189.9 / 310.9 grouped, and grouped ahead at 16
    # tokens, 453.2 against 498.5 (docs/kernel_performance.md, "The grouped CUDA kernel's pipelined form").
    moe_gemv_max_pairs_by_kernel = {"cuda": None}

    def pair_kernel(self) -> str:
        from kernels.quant import nvfp4

        return nvfp4.PAIR_KERNEL

    def linear(self, in_features: int, out_features: int, bias: bool, *, device: Any, bias_dtype: Any) -> Any:
        from runners.engine.models.nvfp4 import NVFP4Linear

        return NVFP4Linear(in_features, out_features, bias, device=device, bias_dtype=bias_dtype)

    def to_moe(self, moe: Any) -> None:
        from runners.engine.models.nvfp4 import to_nvfp4_moe

        to_nvfp4_moe(moe)

    def quantize_weight(self, module: str, w: Any, input_amax: Any) -> dict[str, Any]:
        """``weight`` uint8 [N, K / 2], ``weight_scale`` float8_e4m3fn [N, K / 16], ``weight_scale_2`` float32
        0-dim (kernels.quant.nvfp4.nvfp4_quantize: ModelOpt's scale recipe), ``input_scale`` = input_amax /
        (448 * 6) (ModelOpt's convention)."""
        from kernels.quant.fp8 import FP8_MAX
        from kernels.quant.nvfp4 import E2M1_MAX, nvfp4_quantize

        q, scale, scale_2 = nvfp4_quantize(w.detach())
        return {f"{module}.weight": q, f"{module}.weight_scale": scale,
                f"{module}.weight_scale_2": scale_2.float().reshape(()),
                f"{module}.input_scale": input_amax / (FP8_MAX * E2M1_MAX)}

    def stored_nbytes(self, n: int, k: int) -> int:
        # two e2m1 values a byte, one e4m3 scale per 16 values, two float32 scales
        return n * k // 2 + n * -(-k // GROUP_SIZE) + 2 * 4


FORMAT = NVFP4Format()
