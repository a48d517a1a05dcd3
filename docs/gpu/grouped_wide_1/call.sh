#!/bin/bash
# Issue 43: the grouped CUDA kernel's wide form (kernels/quant/pair_cuda.py GROUPED_FORM "wide": 64 output rows
# per CTA, a warp per 16 rows over all of K, the warps sharing x through L1) against the split form and the
# Triton grouped GEMM, at the batch-64 verify (256 tokens: ~11 rows per expert for Super V3, 5 for Qwen3-Next)
# and at 64 tokens. First the GPU tests of the grouped forms (both, at the released shapes, 1 / 11 / 40 rows per
# expert), then bench_moe_gemv for each release format (its grouped rows printed). Either card; carry
# .gpu-bundle (or run after a call that did, on the same warm machine).
#   bash docs/gpu/grouped_wide_1/call.sh OUT        about 300 s
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py -k grouped \
  >$OUT/tests_gpu.log 2>&1
echo "grouped GPU tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu.log | cut -c1-220 | tail -12
for part in nvfp4 block_fp8; do
  model=super_v3; [ $part = block_fp8 ] && model=qwen3_next
  timeout ${BENCH_TIMEOUT:-200} python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_$part.json \
    --models $model --formats $part --batches ${BATCHES:-64 256} >$OUT/bench_$part.log 2>&1
  echo "bench $part rc=$? at $((SECONDS-t0)) s"
  python3 - $OUT/bench_moe_gemv_$part.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "grouped" in r.get("name", "") or r.get("name", "").endswith("_cuda"):
        print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("fraction_of_copy_bw"),
              r.get("scheme", ""), r.get("error", "")[:160])
PY
done
echo "done at $((SECONDS-t0)) s"
