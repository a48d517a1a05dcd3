#!/bin/bash
# Issue 43, the CUDA per-pair kernels of kernels/quant/pair_gemv.cu after they gained a block-FP8 form: their GPU
# tests (NVFP4 vs its reference and Triton at Super V3's released expert shapes, gated at Qwen3-Next's widths;
# block FP8 w8a16 vs its reference and Triton at Qwen3-Next's; both inside a CUDA graph == eager), the CPU tests
# of the host emulation and sm_90 build, then bench_moe_gemv at 1-8 tokens: Super V3 NVFP4 (moe_gemv_nvfp4 =
# the CUDA default, _triton = the Triton kernel) and Qwen3-Next block FP8 (moe_gemv_block_fp8 = Triton w8a16,
# the default; _cuda = the CUDA kernel), each against the weight-read floor of the same run's copy bandwidth.
# Either card; carry .gpu-bundle. About 150 s.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py >$OUT/tests_gpu.log 2>&1
echo "gpu tests rc=$? at $((SECONDS-t0)) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests_gpu.log | cut -c1-220 | tail -24
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_pair_cuda.py >$OUT/tests_cpu.log 2>&1
echo "cpu tests rc=$?"; tail -2 $OUT/tests_cpu.log
for m in "super_v3 nvfp4" "qwen3_next block_fp8"; do
  set -- $m
  timeout ${BENCH_TIMEOUT:-150} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_$2.json --models $1 \
    --formats $2 --batches 1 2 4 8 >$OUT/bench_$2.log 2>&1
  echo "bench $2 rc=$? at $((SECONDS-t0)) s"
  python3 - $OUT/bench_moe_gemv_$2.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("fraction_of_copy_bw"), r.get("error", ""))
PY
done
