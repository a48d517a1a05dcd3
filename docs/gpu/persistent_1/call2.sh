#!/bin/bash
# Issue 43, after call.sh (on the same warm machine): bench_e2e at half depth (Super V3 NVFP4 44 of 88 layers,
# Qwen3-Next block FP8 24 of 48; dummy weights, all 512 experts, CUDA graphs, forced acceptance length 3.0),
# plain and MTP + replay at batch 1 and 64, with the routed experts' CUDA kernels in their default forms
# (FORM=default: per pair "split", grouped "pipelined") or in the persistent forms (FORM=persistent:
# --kernel-setting kernels.quant.pair_cuda.PAIR_FORM=persistent and GROUPED_FORM=persistent). Run it twice on one
# machine, default first. Either card.
#   bash docs/gpu/persistent_1/call2.sh OUT default       about 200 s on an H100
#   bash docs/gpu/persistent_1/call2.sh OUT persistent
set -u
OUT=${1:?OUT}
FORM=${2:?FORM: default or persistent}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start >/dev/null 2>&1 || exit 1
settings=()
[ "$FORM" = persistent ] && settings=(--kernel-setting kernels.quant.pair_cuda.PAIR_FORM=persistent
  --kernel-setting kernels.quant.pair_cuda.GROUPED_FORM=persistent)
timeout ${E2E_TIMEOUT:-280} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_$FORM --parts super_v3_nvfp4,qwen3_next_fp8 \
  --full-layers 44 24 --graphs on --compile off --batch-sizes 1 64 --arms plain replay --accept-length 3.0 --steps 16 \
  --time-budget-s ${E2E_BUDGET_S:-220} "${settings[@]}" >$OUT/e2e_$FORM.log 2>&1
echo "e2e form=$FORM rc=$? at $((SECONDS-t0)) s"
cp $OUT/e2e_$FORM/bench_e2e.json $OUT/bench_e2e_$FORM.json 2>/dev/null
python3 - $OUT/bench_e2e_$FORM.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("model"), r.get("arm"), r.get("batch"), r.get("step_ms") and round(r["step_ms"], 3),
          r.get("floor_ms") and round(r["floor_ms"], 3), r.get("kernels_per_step"), r.get("error", "")[:200])
PY
