"""Quantized-weight GEMMs of the release checkpoint formats, one file per weight format (import from it), each
Triton launcher beside its plain-PyTorch reference (`*_ref`, same arguments and result) and the quantize /
dequantize rules that define the format:

- `nvfp4`: NVIDIA ModelOpt NVFP4 weights run weight-only on Hopper (W4A16: packed e2m1 codes decoded in
  registers inside the GEMM): `nvfp4_linear`, `nvfp4_grouped_mm` (routed experts), `moe_gemv_nvfp4` (routed
  experts at decode sizes, per pair), `nvfp4_quantize`, `nvfp4_dequantize`;
- `block_fp8`: DeepSeek-V3 / Qwen3-Next block-FP8 weights (128 x 128 blocks, `weight_scale_inv`) with
  activations quantized per token and 128-column group at run time (w8a8): `block_fp8_linear`,
  `block_fp8_grouped_mm`, `moe_gemv_block_fp8`, `quantize_activation_per_token_group`, `block_fp8_quantize`,
  `block_fp8_dequantize`, `block_scaled_mm_supported` (the torch._scaled_mm block-scale probe);
- `moe_gemv`: what every format's per-pair GEMVs of the routed experts share (one program per (token, expert)
  pair, the expert id read from the routing; kernels/moe_gemv.py's quantized counterpart): input checks, the
  pair-by-pair reference, output buffers;
- `_common`: input checks, the grouped-GEMM row-tile map (expert of each tile found from the offsets on the
  device), fp8 rounding and tensor-core helpers, the decode-GEMV policy.
Grouped GEMMs take torch._grouped_mm's convention (rows sorted by expert, int32 cumulative `offsets`), never
synchronise with the host and can be captured in a CUDA graph. The engine's side of each format (its rules and
modules) is runners/engine/formats/ and runners/engine/models/.
"""
