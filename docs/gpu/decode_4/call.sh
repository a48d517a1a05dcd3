#!/bin/bash
# Session 11 call C (issue 27): quarter depth, compiled step inside CUDA graphs, batch 1 / 8 / 64, plain / rewind /
# replay at forced acceptance length 2.6, floors and kernel counts; then a torch.profiler table of Qwen3-Next's
# compiled replay step at batch 1 (what kernels are left).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 440 python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_q --parts super_v3,qwen3_next --graphs on \
  --compile on --batch-sizes 1 8 64 --arms plain rewind replay --accept-length 2.6 --steps 24 --time-budget-s 390 \
  > $OUT/e2e_q.log 2>&1
echo "e2e rc=$? at $((SECONDS-t0)) s"; grep -v "^ " $OUT/e2e_q.log | tail -40 | cut -c1-300
left=$(( 565 - (SECONDS - t0) ))
if [ $left -gt 50 ]; then
  timeout $left python3 -u -m benchmarks.bench_e2e --out $OUT/prof --parts qwen3_next --compile on \
    --profile qwen3_next:replay:1:graphs --accept-length 2.6 --steps 8 > $OUT/prof.log 2>&1
  echo "profile rc=$? at $((SECONDS-t0)) s"; tail -5 $OUT/prof.log | cut -c1-300
  cd $OUT && tar czf prof.tgz prof && rm -rf prof
fi
