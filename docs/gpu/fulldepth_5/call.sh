#!/bin/bash
# Session 11 call B (issue 26): full depth in the release formats (dummy weights), Qwen3-Next FP8 first (its
# block-FP8 per-pair path was never reached), then Super V3 NVFP4; batch 1 / 8 / 64, plain / rewind / replay at
# forced acceptance length 3.0, CUDA graphs, compile off.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 560 python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_full --parts qwen3_next_fp8,super_v3_nvfp4 --graphs on \
  --compile off --batch-sizes 1 8 64 --arms plain rewind replay --accept-length 3.0 --steps 24 --time-budget-s 500 \
  > $OUT/e2e_full.log 2>&1
echo "e2e rc=$? at $((SECONDS-t0)) s"; grep -v "^ " $OUT/e2e_full.log | tail -40 | cut -c1-300
