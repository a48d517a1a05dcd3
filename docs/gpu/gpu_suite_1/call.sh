#!/bin/bash
# Session 12 call C (issue 27): every gpu-marked test of the suite on the H200, two workers (one H200; the
# memory-heavy quantized tests OOM with 8), log committed. Carry .device/gsm8k too.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 570 python3 -m pytest -q -p no:cacheprovider -m gpu -n 2 --dist loadgroup tests > $OUT/gpu_suite.log 2>&1
echo "gpu suite rc=$? at $((SECONDS-t0)) s"; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite.log | head -30; tail -3 $OUT/gpu_suite.log
