#!/bin/bash
# Issue 43 (and 46's last GPU item), one call on an H100 or H200: the quant and moe stages' tests (the
# released-shapes test fixed after docs/gpu/quant_2/call2, the w8a16 tensor-core kernel's GPU test), then
# bench_quant_gemm's FP8 parts at 1-64 rows with the `*_w8a16_dot` rows beside the GEMV, scaled_mm, bf16 and
# gemlite, to set block_fp8.W8A16_DOT_MIN_ROWS per path. Carry .gpu-bundle (gemlite's wheel in it), or
# .device/bundle_fi (gemlite's wheel copied there too) where the call also carries FlashInfer.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
export PYTEST_FAILURE_LOG=$OUT/failures.log  # tracebacks as they fail (tests/conftest.py)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -n ${TEST_WORKERS:-4} --dist loadgroup \
  tests/test_kernels_moe_gemv_gpu.py tests/test_kernels_moe_gemv.py tests/test_moe.py \
  tests/test_kernels_quant_moe_gemv_gpu.py tests/test_kernels_quant_moe_gemv.py tests/test_kernels_quant_gpu.py \
  tests/test_kernels_quant.py >$OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/tests.log
timeout ${QUANT_TIMEOUT:-330} python3 -m benchmarks.bench_quant_gemm --parts copy fp8 fp8_tensor \
  --batches 1 2 4 8 16 64 --out $OUT/bench_quant_gemm.json >$OUT/bench_quant.log 2>&1
echo "bench_quant rc=$? at $((SECONDS-t0)) s"
grep -E "dot_vs|gemlite|speedup_vs_scaled_mm" $OUT/bench_quant.log | cut -c1-600
