#!/bin/bash
# Issue 43, NVFP4 decode variants (kernels/quant/nvfp4.py DECODE, PAIR_X_LOAD): bench_quant_gemm's NVFP4 part
# with the `*_direct` rows (the grouped GEMV and tensor-core kernel on fp32 bit patterns, no convert) at 1 / 4
# / 16 / 64 tokens, then bench_moe_gemv's per-pair rows for Super V3 (`moe_gemv_nvfp4_direct`, `_xvec`,
# `_direct_xvec` beside the default) at 1 and 8 tokens. Each row against the copy bandwidth of its own run.
# Carry .gpu-bundle or .device/bundle_fi.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
timeout ${QUANT_TIMEOUT:-200} python3 -u -m benchmarks.bench_quant_gemm --parts copy nvfp4 --batches 1 4 16 64 \
  --out $OUT/bench_quant_gemm_nvfp4.json >$OUT/bench_quant.log 2>&1
echo "bench_quant_gemm rc=$? at $((SECONDS-t0)) s"
grep -E "direct_vs_convert|speedup_vs_bf16" $OUT/bench_quant.log | cut -c1-400
timeout ${MOE_TIMEOUT:-240} python3 -u -m benchmarks.bench_moe_gemv --models super_v3 --formats nvfp4 \
  --batches 1 8 --out $OUT/bench_moe_gemv_nvfp4.json >$OUT/bench_moe.log 2>&1
echo "bench_moe_gemv rc=$? at $((SECONDS-t0)) s"
python3 - $OUT/bench_moe_gemv_nvfp4.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["name"], r.get("batch"), r.get("us"), r.get("x_floor"))
PY
