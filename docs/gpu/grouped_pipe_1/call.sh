#!/bin/bash
# Issue 43: the grouped CUDA kernel's pipelined form (kernels/quant/pair_cuda.py GROUPED_FORM "pipelined": the
# wide grid, the next two chunks' codes in flight while the current two are multiplied, passes of up to 16
# rows with every group's x loaded before the decode) against the split and wide forms and the Triton grouped
# GEMM, at 32 / 64 / 128 / 256 tokens (Super V3 top-22 of 512: ~1.4 / 2.75 / 5.5 / 11 rows per expert; Qwen3-
# Next top-10 of 512: ~0.6 / 1.25 / 2.5 / 5): the rows-per-expert bound for NVFP4's GROUPED_KERNEL. First the
# GPU tests of the grouped forms (each form at the released shapes, the pipelined form == the wide form's
# bits), then bench_moe_gemv per release format, then the router / MoE / norm GPU tests (session 28's review
# changes, CPU-tested only so far). Either card; carry .gpu-bundle (or run after a call that did).
#   bash docs/gpu/grouped_pipe_1/call.sh OUT        about 300 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py -k grouped \
  >$OUT/tests_grouped.log 2>&1
echo "grouped GPU tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_grouped.log | cut -c1-220 | tail -12
for part in nvfp4 block_fp8; do
  model=super_v3; [ $part = block_fp8 ] && model=qwen3_next
  timeout ${BENCH_TIMEOUT:-200} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_$part.json \
    --models $model --formats $part --batches ${BATCHES:-32 64 128 256} >$OUT/bench_$part.log 2>&1
  echo "bench $part rc=$? at $((SECONDS-t0)) s"
  python3 - $OUT/bench_moe_gemv_$part.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "grouped" in r.get("name", ""):
        print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("fraction_of_copy_bw"),
              r.get("scheme", ""), r.get("error", "")[:160])
PY
done
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_kernels_router.py \
  tests/test_moe.py tests/test_kernels_norm.py >$OUT/router_tests.log 2>&1
echo "router / moe / norm GPU tests rc=$? at $((SECONDS-t0)) s"
grep -E "FAILED|ERROR|passed|failed" $OUT/router_tests.log | cut -c1-200 | tail -8
echo "done at $((SECONDS-t0)) s"
