#!/bin/bash
# Issue 43, after call.sh on the same warm machine: bench_e2e at half depth (docs/gpu/quant_e2e_1/call.sh:
# Super V3 NVFP4 44 of 88 layers, Qwen3-Next block FP8 24 of 48, plain and MTP + replay, batch 1 and 64) twice:
# with the committed kernel choices, then with NVFP4's grouped experts on the CUDA kernel in the pipelined form
# (and block FP8's grouped form pipelined too): --kernel-setting kernels.quant.nvfp4.GROUPED_KERNEL=cuda
# kernels.quant.pair_cuda.GROUPED_FORM=pipelined. Either card.
#   bash docs/gpu/grouped_pipe_1/call2.sh OUT       about 360 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
for variant in default pipelined; do
  set=""
  [ $variant = pipelined ] && set="--kernel-setting kernels.quant.nvfp4.GROUPED_KERNEL=cuda --kernel-setting kernels.quant.pair_cuda.GROUPED_FORM=pipelined"
  timeout ${E2E_TIMEOUT:-240} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_$variant \
    --parts super_v3_nvfp4,qwen3_next_fp8 --full-layers ${FULL_LAYERS:-44 24} --graphs on --compile off \
    --batch-sizes 1 64 --arms plain replay --accept-length 3.0 --steps 16 --time-budget-s ${E2E_BUDGET_S:-200} \
    $set >$OUT/e2e_$variant.log 2>&1
  echo "bench_e2e $variant rc=$? at $((SECONDS-t0)) s"
  cp $OUT/e2e_$variant/bench_e2e.json $OUT/bench_e2e_$variant.json 2>/dev/null
  python3 - $OUT/bench_e2e_$variant.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r.get("model"), r.get("arm"), r.get("batch"), r.get("step_ms") and round(r["step_ms"], 3),
          r.get("floor_ms") and round(r["floor_ms"], 3), r.get("kernels_per_step"), r.get("error", "")[:200])
PY
done
echo "done at $((SECONDS-t0)) s"
