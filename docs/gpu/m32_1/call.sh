#!/bin/bash
# Issue 43, session 33: the m32 grouped form (kernels/quant/pair_gemv.cu grouped_m32_kernel: 32 output rows per
# warp, each x fragment feeding two MMA tiles) on its first GPU. Its GPU tests (the m32 form against the
# pipelined form's bits, eager and from a CUDA graph), bench_moe_gemv for Super V3 NVFP4 at 8 / 64 / 256 tokens
# (rows grouped_mm_nvfp4_cuda_m32, _cuda_m32_xperm, _cuda_m32_prefetch and _cuda_repacked_m32 beside
# _cuda_pipelined, all in the same process) and
# Nsight Compute of the pipelined and m32 forms at 256 tokens. Either card; carry .gpu-bundle.
#   bash docs/gpu/m32_1/call.sh OUT       about 250 s on an H100 (SKIP_NCU=1: about 120 s; BATCHES: the token counts)
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start >/dev/null 2>&1 || { echo "gpu_start failed"; exit 1; }
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py \
  -k "m32" >$OUT/tests_m32.log 2>&1
echo "m32 GPU tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_m32.log | cut -c1-220 | tail -12
timeout ${BENCH_TIMEOUT:-150} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_nvfp4.json --models super_v3 \
  --formats nvfp4 --batches ${BATCHES:-8 64 256} >$OUT/bench_nvfp4.log 2>&1
echo "bench rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/bench_nvfp4.log | cut -c1-300
python3 - $OUT/bench_moe_gemv_nvfp4.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r.get("name", "").startswith("grouped_mm_") or "_cuda" in r.get("name", ""):
        print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("error", "")[:160])
PY
if [ -z "${SKIP_NCU:-}" ]; then
  timeout ${NCU_TIMEOUT:-200} python3 -u -m benchmarks.ncu_grouped --out $OUT/ncu --models super_v3 --forms pipelined m32 \
    --tokens 256 >$OUT/ncu.log 2>&1
  echo "ncu_grouped rc=$? at $((SECONDS-t0)) s"; tail -14 $OUT/ncu.log | cut -c1-220
  cp $OUT/ncu/ncu_grouped.json $OUT/ 2>/dev/null
fi
echo "done at $((SECONDS-t0)) s"
