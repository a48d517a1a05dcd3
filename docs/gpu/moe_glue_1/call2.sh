#!/bin/bash
# Issue 43, after call.sh on the same warm machine: bench_e2e at half depth (Super V3 NVFP4 44 of 88 layers,
# Qwen3-Next block FP8 24 of 48; plain and MTP + replay; batch 1 and 64; forced acceptance length 3.0) twice:
# the MoE glue kernels off (runners.engine.models.moe.GLUE_KERNELS=false: the references, as before session
# 30), then on (the default). Either card.
#   bash docs/gpu/moe_glue_1/call2.sh OUT       about 380 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
for glue in false true; do
  timeout ${E2E_TIMEOUT:-240} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_glue_$glue \
    --parts super_v3_nvfp4,qwen3_next_fp8 --full-layers ${FULL_LAYERS:-44 24} --graphs on --compile off \
    --batch-sizes 1 64 --arms plain replay --accept-length 3.0 --steps 16 --time-budget-s ${E2E_BUDGET_S:-170} \
    --kernel-setting runners.engine.models.moe.GLUE_KERNELS=$glue ${EXTRA:-} >$OUT/e2e_glue_$glue.log 2>&1
  echo "bench_e2e glue=$glue rc=$? at $((SECONDS-t0)) s"
  cp $OUT/e2e_glue_$glue/bench_e2e.json $OUT/bench_e2e_glue_$glue.json 2>/dev/null
  python3 - $OUT/bench_e2e_glue_$glue.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r.get("model"), r.get("arm"), r.get("batch"), r.get("step_ms") and round(r["step_ms"], 3),
          r.get("floor_ms") and round(r["floor_ms"], 3), r.get("kernels_per_step"), r.get("error", "")[:200])
PY
done
echo "done at $((SECONDS-t0)) s"
