#!/bin/bash
# Issue 43, after call.sh (on the same warm machine): bench_e2e at half depth (Super V3 NVFP4 44 of 88 layers,
# Qwen3-Next block FP8 24 of 48; dummy weights, all 512 experts, CUDA graphs, forced acceptance length 3.0),
# batch-64 MTP + replay, with the grouped experts in the pipelined form (the default) and then in the persistent
# form (--kernel-setting kernels.quant.pair_cuda.GROUPED_FORM=persistent), one machine. Either card.
#   bash docs/gpu/persistent_1/call2.sh OUT       about 200 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start >/dev/null 2>&1 || exit 1
for form in pipelined persistent; do
  timeout ${E2E_TIMEOUT:-150} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_$form --parts super_v3_nvfp4,qwen3_next_fp8 \
    --full-layers 44 24 --graphs on --compile off --batch-sizes 64 --arms replay --accept-length 3.0 --steps 16 \
    --time-budget-s ${E2E_BUDGET_S:-120} --kernel-setting kernels.quant.pair_cuda.GROUPED_FORM=$form >$OUT/e2e_$form.log 2>&1
  echo "e2e form=$form rc=$? at $((SECONDS-t0)) s"
  cp $OUT/e2e_$form/bench_e2e.json $OUT/bench_e2e_$form.json 2>/dev/null
  python3 - $OUT/bench_e2e_$form.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("model"), r.get("arm"), r.get("batch"), r.get("step_ms") and round(r["step_ms"], 3),
          r.get("floor_ms") and round(r["floor_ms"], 3), r.get("kernels_per_step"), r.get("error", "")[:200])
PY
done
