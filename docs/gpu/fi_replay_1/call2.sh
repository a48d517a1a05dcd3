#!/bin/bash
# Issue 45 on the GPU, call 2 (same machine as calls 3-4, FlashInfer's JIT cache warm): bench_e2e on
# quarter-depth synthetic Super V3, bf16, CUDA graphs, batch 1 / 8 / 64, rewind and replay with each backend
# (per-step and checkpointing) and with the engine's default backend. Carry as call 1.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env || exit 1
# the defaults table call 4's sweep wrote on this machine, so that "replay" runs the backend it chose
if [ -f .device/replay_defaults.sweep.json ]; then cp .device/replay_defaults.sweep.json kernels/replay_defaults.json \
  && echo "kernels/replay_defaults.json: call 4's sweep table"; fi
timeout ${E2E_TIMEOUT:-500} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e --parts super_v3 --graphs on \
  --batch-sizes 1 8 64 --steps 24 --time-budget-s ${E2E_BUDGET_S:-420} \
  --arms rewind replay replay_triton replay_flashinfer replay_ckpt_triton replay_ckpt_flashinfer >$OUT/e2e.log 2>&1
echo "bench_e2e rc=$? at $((SECONDS-t0)) s"
tail -40 $OUT/e2e.log | cut -c1-250
