#!/bin/bash
# Issue 45 at full depth, on an H200 (needs_h200), after docs/gpu/fi_replay_2/call1.sh (FlashInfer's JIT modules
# in gpu_env's cache) and call3.sh (the sweep on this machine kind; its table left in
# .device/replay_defaults.sweep.json) on the same warm machine: bench_e2e in one run at quarter depth (synthetic
# Super V3, bf16) and full depth (the Super V3 NVFP4 release, all 88 layers and 512 experts, dummy weights),
# batch 1 / 8 / 64, rewind and replay with each backend, per-step and checkpointing, with the sweep's table as
# the engine's defaults. Carry as call 1.
#   bash docs/gpu/fi_replay_4/call_full.sh OUT        about 450 s (E2E_BUDGET_S bounds the timed points)
#   FULL_LAYERS="44 24" bash docs/gpu/fi_replay_4/call_full.sh OUT     on an H100: the release at half depth
set -u
OUT=${1:?OUT}
t0=$SECONDS
[ -d .gpu-bundle ] || [ -d .device/bundle_fi ] || {
  echo "no .gpu-bundle or .device/bundle_fi on this machine: carry .gpu-bundle in a call before this one"; exit 3; }
if [ -f .device/replay_defaults.sweep.json ]; then
  cp .device/replay_defaults.sweep.json kernels/replay_defaults.json || exit 1
else
  echo "no .device/replay_defaults.sweep.json: the committed table stays (run call3.sh first on this machine)"
fi
source tests/gpu/env.sh
gpu_start || exit 1
python3 -c "import json; print(json.load(open('kernels/replay_defaults.json'))['backends'])"
timeout ${E2E_TIMEOUT:-520} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e --parts super_v3,super_v3_nvfp4 \
  --full-layers ${FULL_LAYERS:-0 0} --graphs on --compile off --batch-sizes 1 8 64 --steps 16 \
  --time-budget-s ${E2E_BUDGET_S:-440} \
  --arms rewind replay replay_triton replay_flashinfer replay_ckpt_triton replay_ckpt_flashinfer >$OUT/e2e.log 2>&1
echo "bench_e2e rc=$? at $((SECONDS-t0)) s"
grep -E "^== |error|Error" $OUT/e2e.log | cut -c1-240 | tail -20
python3 - $OUT/e2e/bench_e2e.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, i in d["models"].items(): print(m, i.get("depth"))
for r in d["rows"]:
    print(r.get("model"), r.get("arm"), r.get("batch"), round(r.get("step_ms") or 0, 3), r.get("kernels_per_step"),
          r.get("ssm_kernels"), r.get("error", "")[:160])
print(json.dumps({k: v for k, v in d["targets"].items() if "replay" in k}, indent=0)[:3000])
PY
cp $OUT/e2e/bench_e2e.json $OUT/bench_e2e.json 2>/dev/null  # one level up: the device tool brings back shallow files
echo "done at $((SECONDS-t0)) s"
