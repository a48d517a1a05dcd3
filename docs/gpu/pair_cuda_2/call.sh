#!/bin/bash
# Issue 43, the CUDA kernels of kernels/quant/pair_gemv.cu after they gained a block-FP8 form and a grouped form.
#   bash docs/gpu/pair_cuda_2/call.sh OUT tests     every GPU test of tests/test_kernels_quant_moe_gemv_gpu.py (the
#        per-pair kernels vs their references and Triton at the released expert shapes, in a CUDA graph == eager;
#        the grouped form at 1, 11 and 40 rows per expert; PREFETCH / PDL change no bit, eager and captured) and
#        the CPU tests of the host emulation; ~150 s
#   bash docs/gpu/pair_cuda_2/call.sh OUT nvfp4      bench_moe_gemv, Super V3 NVFP4, 1-8 tokens and 64 / 256 (the
#        batch-64 verify: about 11 rows per expert), every per-pair and grouped row, the CUDA rows with and
#        without PREFETCH / PDL and their time per kernel (--kernels); ~250 s
#   bash docs/gpu/pair_cuda_2/call.sh OUT block_fp8  the same for Qwen3-Next block FP8; ~200 s
# Either card; carry .gpu-bundle.
set -u
OUT=${1:?OUT}
PART=${2:?part: tests, nvfp4 or block_fp8}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $PART in
  tests)
    timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py ${TEST_K:+-k "$TEST_K"} >$OUT/tests_gpu.log 2>&1
    echo "gpu tests rc=$? at $((SECONDS-t0)) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests_gpu.log | cut -c1-220 | tail -40
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_pair_cuda.py >$OUT/tests_cpu.log 2>&1
    echo "cpu tests rc=$?"; tail -2 $OUT/tests_cpu.log ;;
  nvfp4|block_fp8)
    model=super_v3; [ $PART = block_fp8 ] && model=qwen3_next
    timeout ${BENCH_TIMEOUT:-420} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_$PART.json \
      --models $model --formats $PART --batches ${BATCHES:-1 2 4 8 64 256} --kernels >$OUT/bench_$PART.log 2>&1
    echo "bench $PART rc=$? at $((SECONDS-t0)) s"
    python3 - $OUT/bench_moe_gemv_$PART.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("fraction_of_copy_bw"), r.get("scheme", ""),
          r.get("error", ""))
    if "kernels_us" in r and r.get("batch") in (1, 8, 64):
        print("   kernels_us", json.dumps(r.get("kernels_us")))
PY
    ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
