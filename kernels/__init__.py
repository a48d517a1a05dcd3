"""Triton kernels of the recurrent layers, one folder per operator family (as flash-linear-attention):
kernels/mamba2/ and kernels/gdn/, each file a kernel + launcher + plain-PyTorch reference; kernels/commit.py
holds the family-agnostic commit after an MTP verify (rewind copy, replay bookkeeping); kernels/quant/ the
quantized-weight GEMMs of the release formats (NVFP4 W4A16, block FP8); kernels/moe_gemv.py the routed experts
at decode sizes as per-pair GEMVs over the chosen experts (16-bit / fp32 weights). See
docs/architecture.md ("Kernels").
"""
