#!/bin/bash
# Session 13 call C (issues 27, 28): every gpu-marked test, the GPU stage itself (8 workers, --dist loadgroup,
# -v, --durations; the quantized modules in one xdist group). Carry .gpu-bundle (no FlashInfer) and .device/gsm8k.
set -u
OUT=${1:?OUT}
t0=$SECONDS
timeout 580 bash tests/gpu/run_checks.sh $OUT/engine engine > $OUT/stage.out 2>&1
echo "engine stage rc=$? at $((SECONDS-t0)) s"; grep -E "(FAILED|ERROR) " $OUT/engine/engine.log | head -30
grep -E "passed|failed" $OUT/engine/engine.log | tail -2; grep -A12 "slowest" $OUT/engine/engine.log | head -14
