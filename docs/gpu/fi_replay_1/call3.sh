#!/bin/bash
# After calls 1-2 and the H100 suite (docs/gpu/h100_suite_1/call4): the fixed tests again on a fresh H100.
#  - FlashInfer's replay in the engine at bf16 activations (FlashInfer builds no float32 ones: call 1's
#    "Ninja build failed"), the float32 fallback that now says why without trying the build, and its
#    stochastic rounding of a float16 state (rand_seed per layer and step);
#  - beside it (its JIT builds are CPU-bound), the quantized routed-expert GPU tests that failed in call4 / the
#    moe stage; then benchmarks/bench_moe_gemv.py, which ran out of memory quantizing 512 experts at once.
# Carry .device/flashinfer-trimmed.tgz and .device/bundle_fi.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
timeout ${FI_TIMEOUT:-330} python3 -m pytest -v -p no:cacheprovider -m gpu -n 4 --durations=8 \
  tests/test_flashinfer_replay_gpu.py tests/test_replay_engine.py -k "flashinfer and not kernel_equals" >$OUT/fi_tests.log 2>&1 &
fi=$!
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_quant_moe_gemv_gpu.py tests/test_kernels_quant_moe_gemv.py \
  >$OUT/moe_tests.log 2>&1
echo "moe tests rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/moe_tests.log
wait $fi; echo "flashinfer tests rc=$? at $((SECONDS-t0)) s"
grep -E "(PASSED|FAILED|ERROR) |passed|failed|^E " $OUT/fi_tests.log | cut -c1-300 | tail -25
timeout ${BENCH_TIMEOUT:-150} python3 -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv.json --batches 1 2 4 8 \
  >$OUT/bench_moe_gemv.log 2>&1
echo "bench_moe_gemv rc=$? at $((SECONDS-t0)) s"; tail -4 $OUT/bench_moe_gemv.log | cut -c1-300
