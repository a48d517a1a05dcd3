#!/bin/bash
# Issue 43: bench_quant_gemm's NVFP4 part (Super V3's released expert shapes, grouped) at 1 / 4 / 16 / 64
# tokens beside the copy bandwidth, the baseline the NVFP4 W4A16 rework is measured against (about 20 s).
# Carry .gpu-bundle or .device/bundle_fi.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
timeout ${QUANT_TIMEOUT:-230} python3 -u -m benchmarks.bench_quant_gemm --parts copy nvfp4 --batches 1 4 16 64 \
  --out $OUT/bench_quant_gemm_nvfp4.json >$OUT/bench.log 2>&1
echo rc=$?
grep -vE '^\{' $OUT/bench.log | tail -30 | cut -c1-400
