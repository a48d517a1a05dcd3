#!/bin/bash
# Issue 43, session 27's CPU work on the GPU (either card; carry .gpu-bundle):
#   - the router kernels' GPU tests (tests/test_kernels_router.py: topk_route and router_fused at the release
#     shapes, graph capture) and the MoE block's (tests/test_moe.py: ROUTER_FUSED on routes as off, eager and
#     replayed);
#   - the engine's CUDA-graph tests (tests/test_engine_graphs.py, tests/test_replay_engine.py): graph == eager
#     now that the captured step reads Mamba2's decay rate and the RoPE frequencies stored by the eager
#     warm-up instead of computing them in the graph;
#   - the norm / activation kernels with their FP8 codes output and the FP8 engine tests (tests/test_kernels_
#     norm.py, tests/test_kernels_activation.py, tests/test_fp8.py, tests/test_kernels_quant_gpu.py): Mamba2's
#     out_proj and the MLPs' down projection take the codes their producer's launch wrote;
#   - add_rms_norm (a block's residual add and the next norm in one launch) bitwise against the two launches,
#     and the engine's health path through it (tests/test_kernels_norm.py, tests/test_kernels_health.py);
#   - benchmarks/bench_router.py: the three launches against router_fused at 1-8 tokens, both release routers
#     (ROUTER_FUSED becomes the default where the fused row is faster at every point);
#   - the half-depth Super V3 NVFP4 batch-1 profile again (docs/gpu/quant_e2e_1/profile.sh): the launches per
#     step without the decay rate's cast / exp / neg, the FP8 quantization launches and the separate residual
#     adds (compare docs/gpu/quant_e2e_1/profile2: 703 kernels per step).
#   bash docs/gpu/router_1/call.sh OUT        about 300 s
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_kernels_router.py tests/test_moe.py \
  tests/test_engine_graphs.py tests/test_replay_engine.py tests/test_kernels_norm.py tests/test_kernels_activation.py \
  tests/test_fp8.py tests/test_kernels_quant_gpu.py tests/test_kernels_health.py -k "not flashinfer" \
  >$OUT/tests_gpu.log 2>&1
echo "gpu tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu.log | cut -c1-200 | tail -12
timeout 120 python3 -u -m benchmarks.bench_router --out $OUT/bench_router.json >$OUT/bench_router.log 2>&1
echo "bench_router rc=$? at $((SECONDS-t0)) s"
python3 - $OUT/bench_router.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["model"], r["tokens"], r["name"], r["us"], r["x_floor"], r.get("match", ""))
PY
mkdir -p $OUT/profile
POINTS=${POINTS:-"super_v3_nvfp4:plain:1"} bash docs/gpu/quant_e2e_1/profile.sh $OUT/profile | grep -E "rc=|G1  |router"
echo "done at $((SECONDS-t0)) s"
