#!/bin/bash
# Issue 45, call 2 (same warm machine as call 1, its JIT cache holding bench_e2e's modules): bench_e2e on
# quarter-depth Super V3 with the one-launch FlashInfer wrapper, batch 1 / 8 / 64, rewind and replay with
# each backend, per-step and checkpointing (the committed defaults table: Triton per-step, FlashInfer
# checkpointing). Carry as call 1.
set -u
OUT=${1:?OUT}
t0=$SECONDS
# The checkout (40 MB since 2026-12-07), FlashInfer (23 MB) and .device/bundle_fi (4 MB) together pass the 64 MiB
# a call carries: carry .gpu-bundle in an earlier call on the same warm machine (it stays there) and then only
# FlashInfer here, or .device/bundle_fi where the checkout is small enough.
[ -d .gpu-bundle ] || [ -d .device/bundle_fi ] || {
  echo "no .gpu-bundle or .device/bundle_fi on this machine: carry .gpu-bundle in a call before this one"; exit 3; }
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
timeout ${E2E_TIMEOUT:-470} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e --parts super_v3 --graphs on \
  --batch-sizes 1 8 64 --steps 24 --time-budget-s ${E2E_BUDGET_S:-400} \
  --arms rewind replay replay_triton replay_flashinfer replay_ckpt_triton replay_ckpt_flashinfer >$OUT/e2e.log 2>&1
echo "bench_e2e rc=$? at $((SECONDS-t0)) s"
python3 - $OUT/e2e/bench_e2e.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("arm"), r.get("batch"), round(r.get("step_ms") or 0, 3), r.get("kernels_per_step"), r.get("ssm_kernels"))
PY
