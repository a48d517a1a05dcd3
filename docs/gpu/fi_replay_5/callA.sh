#!/bin/bash
# First call on a fresh machine (carry .gpu-bundle and .device/flashinfer-aot.tgz; FlashInfer itself comes in
# callB: the three together pass what one call carries). Issue 43's two steps that need no FlashInfer:
# benchmarks/bench_dense_gemv.py (docs/gpu/dense_gemv_1/call.sh, ~40 s) and the router / MoE / norm GPU tests
# after session 28's review changed the router code (~100 s).
#   bash docs/gpu/fi_replay_5/callA.sh OUT
set -u
OUT=${1:?OUT}
t0=$SECONDS
bash docs/gpu/dense_gemv_1/call.sh "$OUT"
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_kernels_router.py \
  tests/test_moe.py tests/test_kernels_norm.py >$OUT/router_tests.log 2>&1
echo "router / moe / norm GPU tests rc=$? at $((SECONDS-t0)) s"
grep -E "FAILED|ERROR|passed|failed" $OUT/router_tests.log | cut -c1-200 | tail -8
