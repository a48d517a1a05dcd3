#!/bin/bash
# Issue 43, the persistent forms of session 32 on their first GPU: the GPU tests of the grouped forms, of the
# per-pair persistent form and of the repacked formats (the grouped persistent form against the pipelined
# form's bits, eager and from a CUDA graph; the merged repacked test's first GPU run), then bench_moe_gemv for
# Super V3 NVFP4 and Qwen3-Next block FP8 at 1 / 8 / 64 / 256 tokens: the rows
# `grouped_mm_<fmt>_cuda_pipelined` (its last step peeled since moe_glue_1/run1), `_cuda_persistent`,
# `_cuda_repacked` and `_cuda_repacked_persistent`, and the per-pair `moe_gemv_<fmt>_cuda` and
# `_cuda_persistent` (PAIR_FORM), beside Triton's. Either card (compare with moe_glue_1/run1 only on the same
# kind); carry .gpu-bundle.
#   bash docs/gpu/persistent_1/call.sh OUT       about 400 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py \
  -k "grouped_kernel_vs or repacked or pair_persistent" >$OUT/tests_grouped.log 2>&1
echo "grouped GPU tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_grouped.log | cut -c1-220 | tail -12
for mf in super_v3:nvfp4 qwen3_next:block_fp8; do
  m=${mf%%:*}; f=${mf##*:}
  timeout ${BENCH_TIMEOUT:-200} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_$f.json --models $m \
    --formats $f --batches ${BATCHES:-1 8 64 256} >$OUT/bench_$f.log 2>&1
  echo "bench $m $f rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/bench_$f.log | cut -c1-300
  python3 - $OUT/bench_moe_gemv_$f.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r.get("name", "").startswith("grouped_mm_") or "_cuda" in r.get("name", ""):
        print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("error", "")[:160])
PY
done
echo "done at $((SECONDS-t0)) s"
