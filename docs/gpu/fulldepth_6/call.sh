#!/bin/bash
# Session 13 (issue 26): the first command of call B (full depth, batch 1, rewind vs replay with token digests, forced length 3.0), in the budget left. Carry gsm8k.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 290 python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_full --parts qwen3_next_fp8,super_v3_nvfp4 --graphs on \
  --compile off --batch-sizes 1 --arms rewind replay --accept-length 3.0 --steps 24 --time-budget-s 260 > $OUT/e2e_full.log 2>&1
echo "e2e rc=$? at $((SECONDS-t0)) s"; grep -A12 tokens_equal $OUT/e2e_full.log | head -20
left=$(( 575 - (SECONDS - t0) ))
