#!/bin/bash
# Issue 43, the CUDA per-pair NVFP4 kernel (kernels/quant/nvfp4_pair.cu) on its first GPU: its GPU tests (vs the
# reference and the Triton kernel at Super V3's released expert shapes, gated at Qwen3-Next's widths, CUDA-graph
# capture == eager), the CPU tests of its host emulation and sm_90 build, then bench_moe_gemv's nvfp4 rows at
# 1-8 tokens (moe_gemv_nvfp4 = Triton default vs moe_gemv_nvfp4_cuda vs the weight-read floor of the same
# run's copy bandwidth). Either card; carry .device/bundle_fi. About 150 s.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py \
  -k "nvfp4_cuda or nvfp4_pair_variants or released_expert_shapes" >$OUT/tests_gpu.log 2>&1
echo "gpu tests rc=$? at $((SECONDS-t0)) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests_gpu.log | cut -c1-220 | tail -14
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_nvfp4_cuda.py >$OUT/tests_cpu.log 2>&1
echo "cpu tests rc=$?"; tail -2 $OUT/tests_cpu.log
timeout ${BENCH_TIMEOUT:-200} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv.json --models super_v3 \
  --formats nvfp4 --batches 1 2 4 8 >$OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS-t0)) s"
python3 - $OUT/bench_moe_gemv.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("fraction_of_copy_bw"), r.get("error", ""))
PY
tail -3 $OUT/bench.log | cut -c1-300
