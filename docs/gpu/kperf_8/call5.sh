#!/bin/bash
# Session 16 (issue 28), fifth call: compute-sanitizer memcheck over tests/test_kernels_mamba2_gpu.py alone,
# with PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), to see whether call 3's
# out-of-memory under the sanitizer came from cached blocks (call 4: without the sanitizer every test ends at
# 0.03 GiB allocated).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 230 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -k "not graph" tests/test_kernels_mamba2_gpu.py \
  > $OUT/sanitize_mamba2_nocache.log 2>&1
echo "sanitize mamba2 rc=$? at $((SECONDS-t0)) s"; grep -cE "Invalid (__global__|__shared__)" $OUT/sanitize_mamba2_nocache.log
grep -E "ERROR SUMMARY|passed|failed" $OUT/sanitize_mamba2_nocache.log | tail -3
