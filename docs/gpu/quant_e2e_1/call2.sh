#!/bin/bash
# Issue 43, after the first run's profiles (run1, profile1): the new defaults measured.
#   - the router kernel (one max per round, one warp): its GPU tests (release shapes, graph capture);
#   - block FP8's size bounds on its CUDA kernels (per pair up to 20 pairs, grouped from 5 rows per expert):
#     bench_moe_gemv at Qwen3-Next's experts between the first run's points (16-256 tokens), the default rows
#     beside the forced _cuda / _triton ones;
#   - call.sh again (bench_e2e at half depth, plain and MTP + replay at batch 1 and 64, step / floor goals).
# Either card; carry .gpu-bundle.   bash docs/gpu/quant_e2e_1/call2.sh OUT     about 300 s, 380 with the profiles
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p $OUT/router $OUT/bench $OUT/e2e_run
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_router.py >$OUT/router/tests_gpu.log 2>&1
echo "router gpu tests rc=$? at $((SECONDS-t0)) s"; tail -1 $OUT/router/tests_gpu.log
BATCHES=${BATCHES:-"16 32 96 128 192 256"} BENCH_TIMEOUT=150 bash docs/gpu/pair_cuda_2/call.sh $OUT/bench block_fp8 \
  | grep -v kernels_us
echo "bench at $((SECONDS-t0)) s"
bash docs/gpu/quant_e2e_1/call.sh $OUT/e2e_run
# where the batch-1 steps' time goes now (the router's share among it), while the call has time left
if [ $((SECONDS-t0)) -lt ${PROFILE_IF_BEFORE_S:-380} ]; then
  mkdir -p $OUT/profile
  POINTS=${POINTS:-"super_v3_nvfp4:plain:1 qwen3_next_fp8:plain:1"} bash docs/gpu/quant_e2e_1/profile.sh $OUT/profile \
    | grep -E "rc=|router|G1  |pattern"
fi
echo "done at $((SECONDS-t0)) s"
