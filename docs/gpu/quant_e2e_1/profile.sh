#!/bin/bash
# Issue 43: where the device time of a half-depth release step goes (bench_e2e --profile, then
# benchmarks.profile_breakdown on its trace), for the points whose step / floor goals call.sh found unmet:
# Super V3 NVFP4 and Qwen3-Next block FP8, plain batch 1 and MTP + replay batch 64. Either card; carry
# .gpu-bundle (or run after a call that did, on the same warm machine).
#   bash docs/gpu/quant_e2e_1/profile.sh OUT         about 300 s
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for point in ${POINTS:-super_v3_nvfp4:plain:1 qwen3_next_fp8:plain:1 super_v3_nvfp4:replay:64 qwen3_next_fp8:replay:64}; do
  name=$(echo $point | tr ':' '_')
  model=${point%%:*}
  timeout ${PROFILE_TIMEOUT:-150} python3 -u -m benchmarks.bench_e2e --out $OUT/$name --parts $model \
    --full-layers ${FULL_LAYERS:-44 24} --graphs on --compile off --batch-sizes ${point##*:} --accept-length 3.0 --steps 8 \
    --profile $point:graphs >$OUT/$name.log 2>&1
  echo "$point rc=$? at $((SECONDS-t0)) s"
  for trace in $OUT/$name/profile_*.json; do
    [ -f "$trace" ] || continue
    python3 -m benchmarks.profile_breakdown $trace --top 15 >$OUT/$name.breakdown.txt 2>&1
    gzip -f $trace
    head -60 $OUT/$name.breakdown.txt | cut -c1-200
  done
done
