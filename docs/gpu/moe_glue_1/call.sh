#!/bin/bash
# Issue 43, the MoE glue cuts of session 30 and the repacked NVFP4 codes on their first GPU: bench_moe_gemv
# for Super V3 NVFP4 at 8 / 64 / 256 tokens: pair_cuda.X_PERM (docs/gpu/grouped_pipe_1/call3.sh's bench, now
# captured in a CUDA graph) and the repacked codes ("nvfp4_repacked": the per-pair kernel and the grouped
# pipelined form); bench_moe_gemv runs under inference_mode, so its grouped rows include the glue kernels.
# Then the GPU tests of the grouped MoE path (the expert grouping, the activation and the combine as one
# launch each) and of the quantized expert kernels (the repacked format's included). Either card; carry
# .gpu-bundle.
#   bash docs/gpu/moe_glue_1/call.sh OUT       about 300 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
timeout ${BENCH_TIMEOUT:-200} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_nvfp4.json --models super_v3 \
  --formats nvfp4 --batches ${BATCHES:-8 64 256} >$OUT/bench_nvfp4.log 2>&1
echo "bench rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/bench_nvfp4.log
python3 - $OUT/bench_moe_gemv_nvfp4.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("fraction_of_copy_bw"), r.get("error", "")[:160])
PY
timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_moe_sort.py tests/test_moe.py \
  tests/test_kernels_moe_gemv_gpu.py tests/test_kernels_quant_moe_gemv_gpu.py >$OUT/tests_glue.log 2>&1
echo "glue GPU tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_glue.log | cut -c1-220 | tail -12
echo "done at $((SECONDS-t0)) s"
