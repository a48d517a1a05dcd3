#!/bin/bash
# Issue 43, the MoE glue cuts of session 30 and the repacked codes on their first GPU: bench_moe_gemv for
# Super V3 NVFP4 and Qwen3-Next block FP8 at 8 / 64 / 256 tokens: pair_cuda.X_PERM (grouped_pipe_1/call3.sh's
# bench, now captured in a CUDA graph) and the repacked codes ("<fmt>_repacked": the per-pair kernel and the grouped
# pipelined form); bench_moe_gemv runs under inference_mode, so its grouped rows include the glue kernels.
# Then the GPU tests of the grouped MoE path (the expert grouping, the activation and the combine as one
# launch each) and of the quantized expert kernels (the repacked formats' included). Either card; carry
# .gpu-bundle.
#   bash docs/gpu/moe_glue_1/call.sh OUT       about 300 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
for mf in super_v3:nvfp4 qwen3_next:block_fp8; do
  m=${mf%%:*}; f=${mf##*:}
  timeout ${BENCH_TIMEOUT:-150} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_$f.json --models $m \
    --formats $f --batches ${BATCHES:-8 64 256} >$OUT/bench_$f.log 2>&1
  echo "bench $m $f rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/bench_$f.log | cut -c1-300
  python3 - $OUT/bench_moe_gemv_$f.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "_cuda" in r.get("name", "") or r.get("name", "").startswith("grouped_mm_"):
        print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("error", "")[:160])
PY
done
timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_moe_sort.py tests/test_moe.py \
  tests/test_kernels_moe_gemv_gpu.py tests/test_kernels_quant_moe_gemv_gpu.py >$OUT/tests_glue.log 2>&1
echo "glue GPU tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_glue.log | cut -c1-220 | tail -12
echo "done at $((SECONDS-t0)) s"
