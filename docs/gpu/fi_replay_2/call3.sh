#!/bin/bash
# Issue 45, call 3 (same warm machine as calls 1-2, FlashInfer's modules in gpu_env's JIT cache): the replay
# sweep over the whole grid with FlashInfer timed at the headline, per-step and checkpointing, and the
# engine's defaults table written from it. docs/gpu/fi_replay_1/call4.sh with a longer budget. Carry as call 1.
set -u
OUT=${1:?OUT}
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-360} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-520} bash docs/gpu/fi_replay_1/call4.sh "$OUT"
