#!/bin/bash
# Issue 43, NVFP4 decode variants (kernels/quant/nvfp4.py DECODE, PAIR_X_LOAD), one short call: bench_quant_gemm's
# NVFP4 part with the `*_direct` rows (the grouped GEMV and tensor-core kernel on fp32 bit patterns, no
# convert) at 1 / 4 / 16 / 64 tokens, the direct decode's GPU tests (bit-equal to the convert decode), then
# bench_moe_gemv's per-pair rows for Super V3 (`moe_gemv_nvfp4_direct`, `_xvec`, `_direct_xvec` beside the
# default) at 1 and 8 tokens. Each row against the copy bandwidth of its own run. Carry .device/bundle_fi.
set -u
OUT=${1:?OUT}
mkdir -p $OUT/q4
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1
t0=$SECONDS
timeout 60 python3 -u -m benchmarks.bench_quant_gemm --parts copy nvfp4 --batches 1 4 16 64 \
  --out $OUT/q4/bench_quant_gemm_nvfp4.json > $OUT/q4/bench_quant.log 2>&1
echo "bq rc=$? $((SECONDS-t0))s"
grep -E "direct_vs_convert|speedup_vs_bf16" $OUT/q4/bench_quant.log | cut -c1-300
timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_gpu.py -k direct > $OUT/q4/tests.log 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; tail -2 $OUT/q4/tests.log
timeout 80 python3 -u -m benchmarks.bench_moe_gemv --models super_v3 --formats nvfp4 --batches 1 8 \
  --out $OUT/q4/bench_moe_gemv_nvfp4.json > $OUT/q4/bench_moe.log 2>&1
echo "moe rc=$? $((SECONDS-t0))s"
grep -E '"name": "moe_gemv' $OUT/q4/bench_moe.log | cut -c1-200 | head -12
