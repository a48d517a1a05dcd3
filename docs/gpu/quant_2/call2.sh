#!/bin/bash
# After call 1 (this folder's logs): the quant and moe stages' tests again (the fixed ones among them), bench_quant_gemm's FP8 parts with the
# GEMV's "vector" row-load rows (*_xvec) beside the default, and bench_moe_gemv (quantizing 32 experts at a
# time). Carry .gpu-bundle, with gemlite's wheel added to time the PyPI peer (`python3 -m pip wheel --no-deps
# gemlite -w .gpu-bundle`: pure Python + Triton; without it its rows say so).
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
export PYTEST_FAILURE_LOG=$OUT/failures.log  # tracebacks as they fail (tests/conftest.py)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -n ${TEST_WORKERS:-4} --dist loadgroup tests/test_kernels_moe_gemv_gpu.py \
  tests/test_kernels_moe_gemv.py tests/test_moe.py tests/test_kernels_quant_moe_gemv_gpu.py \
  tests/test_kernels_quant_moe_gemv.py tests/test_kernels_quant_gpu.py tests/test_kernels_quant.py \
  >$OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/tests.log
timeout ${QUANT_TIMEOUT:-80} python3 -m benchmarks.bench_quant_gemm --parts copy fp8 fp8_tensor --batches 1 2 4 8 \
  --out $OUT/bench_quant_gemm.json >$OUT/bench_quant.log 2>&1
echo "bench_quant rc=$? at $((SECONDS-t0)) s"; grep -E "xvec|w8a16_dense_speedup_vs_w8a8|quant_kernel|gemlite" $OUT/bench_quant.log | cut -c1-400
timeout ${MOE_TIMEOUT:-100} python3 -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv.json --batches 1 2 4 8 \
  >$OUT/bench_moe_gemv.log 2>&1
echo "bench_moe_gemv rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/bench_moe_gemv.log | cut -c1-300
