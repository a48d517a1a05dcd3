#!/bin/bash
# Session 16 (issue 28), third call: the correctness checks the issue keeps, on the kernels as committed after
# sessions 15-16 changed the stochastic-rounding rule and where its key is read: the replay kernels' GPU tests
# (bitwise CUDA-graph replays with poisoned buffers, token-by-token oracles, every variant against the
# reference), then run_checks.sh's `sanitize` stage (compute-sanitizer memcheck over the GPU kernel tests and
# tests/test_stochastic_rounding.py).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/test_kernels_mamba2_gpu.py \
  tests/test_kernels_gdn_gpu.py > $OUT/replay_kernels_gpu.log 2>&1
echo "replay kernel GPU tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/replay_kernels_gpu.log | cut -c1-300
timeout 380 bash tests/gpu/run_checks.sh $OUT/checks sanitize > $OUT/checks.log 2>&1
echo "sanitize rc=$? at $((SECONDS-t0)) s"; tail -4 $OUT/checks/sanitize.log | cut -c1-300
