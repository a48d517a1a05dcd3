#!/bin/bash
# Session 14 call G (issues 27, 28): every gpu-marked test (8 workers, --dist loadgroup), the first GPU run of
# session 13's kernels (health, activation, conv step, conv rows, out_dtype norms). Carry .gpu-bundle (no
# FlashInfer) and .device/gsm8k.
set -u
OUT=${1:?OUT}
t0=$SECONDS
timeout 560 bash tests/gpu/run_checks.sh $OUT/engine engine > $OUT/stage.out 2>&1
echo "engine stage rc=$? at $((SECONDS-t0)) s"; grep -E "(FAILED|ERROR) " $OUT/engine/engine.log | head -40 | cut -c1-250
grep -E "passed|failed" $OUT/engine/engine.log | tail -2; grep -A14 "slowest" $OUT/engine/engine.log | head -16
