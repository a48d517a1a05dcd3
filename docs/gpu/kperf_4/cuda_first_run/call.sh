#!/bin/bash
# Session 12 call 0 (issue 28): the CUDA replay variant's first run on a GPU: its tests, the shared graph test, then
# compute-sanitizer memcheck + racecheck on the small shapes (out-of-bounds on masked rows / d_state chunks).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_replay_cuda.py tests/test_replay_cuda_gpu.py > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$? at $((SECONDS-t0)) s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/cuda_tests.log | head -20
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_mamba2_gpu.py -k cuda > $OUT/cuda_graph.log 2>&1
echo "graph test rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/cuda_graph.log
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_replay_cuda_gpu.py -k "small_n48 or n256" -x > $OUT/sanitizer_$tool.log 2>&1
  echo "$tool rc=$? at $((SECONDS-t0)) s"; grep -E "ERROR SUMMARY|passed|failed|Invalid|Race" $OUT/sanitizer_$tool.log | head -8
done
