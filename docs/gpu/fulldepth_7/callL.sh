#!/bin/bash
# Session 14 call L (issue 26): torch.profiler traces of the full-depth plain batch-1 steps in the release
# formats (Qwen3-Next block FP8, then Super V3 NVFP4), CUDA graphs, compile off: where the time goes where
# issue 26's plain goals are missed.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
for m in qwen3_next_fp8 super_v3_nvfp4; do
  timeout 105 python3 -u -m benchmarks.bench_e2e --out $OUT/prof_$m --parts $m --compile off \
    --profile $m:plain:1:graphs --steps 8 > $OUT/prof_$m.log 2>&1
  echo "$m rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/prof_$m.log | cut -c1-300
  (cd $OUT && rm -f prof_$m/*.txt.gz; tar czf prof_$m.tgz prof_$m && rm -rf prof_$m)
done
