#!/bin/bash
# Issue 45, the sweep with FlashInfer timed at the headline (its checkpointing_ssu modules built by call 3 into
# gpu_env's FLASHINFER_WORKSPACE_BASE on the same warm machine, so its warm-ups load instead of building): every
# configuration at the headline, the grid for the time left, and the engine's defaults table written from it
# (backend column included). The table is also left in .device/ for call 2 (bench_e2e), whose "replay" arm
# then runs the backend this sweep chose. Carry as call 3.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${SWEEP_TIMEOUT:-500} python3 -u -m benchmarks.sweep_replay --budget-s ${SWEEP_BUDGET_S:-300} \
  --flashinfer-extra-s ${FI_EXTRA_S:-60} --out $OUT --write-defaults $OUT/replay_defaults.json >$OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS-t0)) s"
[ -f $OUT/replay_defaults.json ] && cp $OUT/replay_defaults.json .device/replay_defaults.sweep.json
grep -iE "headline|default|flashinfer|backend" $OUT/sweep.log | tail -30 | cut -c1-300
