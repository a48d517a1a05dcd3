#!/bin/bash
# Session 10 call C: PDL replay variant bitwise test, then full depth at batch 1 with the quantized experts'
# per-pair path (QUANT_MOE_GEMV_MAX_PAIRS per format), three arms, compile off.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_mamba2_gpu.py -k pdl > $OUT/pdl_test.log 2>&1
echo "pdl test rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/pdl_test.log
left=$(( 300 - (SECONDS - t0) ))
timeout $left python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_full --parts qwen3_next_fp8,super_v3_nvfp4 --graphs on \
  --compile off --batch-sizes 1 --arms plain rewind replay --accept-length 3.0 --steps 24 --time-budget-s $((left - 25)) \
  > $OUT/e2e_full.log 2>&1
echo "e2e rc=$? at $((SECONDS-t0)) s"; grep -v "^ " $OUT/e2e_full.log | tail -30
