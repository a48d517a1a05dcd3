#!/bin/bash
# Session 14 call H (issues 27, 26): quarter depth, fused elementwise kernels (the default), compile off, CUDA
# graphs, batch 1 / 8 / 64, plain / rewind / replay at forced acceptance length 2.6, floors and kernel counts,
# one command; a torch.profiler trace of Qwen3-Next's plain batch-1 step (what is left of its distance from the
# floor); then full depth at batch 1, plain (release formats).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 300 python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_q --parts super_v3,qwen3_next --graphs on \
  --compile off --batch-sizes 1 8 64 --arms plain rewind replay --accept-length 2.6 --steps 24 --time-budget-s 270 \
  > $OUT/e2e_q.log 2>&1
echo "e2e rc=$? at $((SECONDS-t0)) s"; grep -E "decode_tokens_per_s" $OUT/e2e_q.log | tail -20 | cut -c1-260
timeout 100 python3 -u -m benchmarks.bench_e2e --out $OUT/prof --parts qwen3_next --compile off \
  --profile qwen3_next:plain:1:graphs --accept-length 2.6 --steps 8 > $OUT/prof.log 2>&1
echo "profile rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/prof.log | cut -c1-300
(cd $OUT && tar czf prof.tgz prof && rm -rf prof)
left=$(( 580 - (SECONDS - t0) ))
timeout $left python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_full --parts qwen3_next_fp8,super_v3_nvfp4 --graphs on \
  --compile off --batch-sizes 1 --arms plain --accept-length 3.0 --steps 24 --time-budget-s $(( left - 25 )) \
  > $OUT/e2e_full.log 2>&1
echo "full rc=$? at $((SECONDS-t0)) s"; grep -E "decode_tokens_per_s" $OUT/e2e_full.log | tail -6 | cut -c1-260
