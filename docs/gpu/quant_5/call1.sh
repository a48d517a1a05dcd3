#!/bin/bash
# Issue 43, the NVFP4 library peer: bench_quant_gemm's nvfp4_dense part, Super V3's expert matrices (up 1024 ->
# 2688, down 2688 -> 1024) as dense NVFP4 linears at 1-16 rows: nvfp4_linear vs gemlite's A16W4_NVFP (the
# same packed codes and scales; each peer row carries its error against nvfp4_linear_ref) vs BF16, each row
# against the copy bandwidth of its own run. Carry .device/bundle_fi (it holds gemlite's wheel).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1
t0=$SECONDS
timeout ${Q5_TIMEOUT:-200} python3 -u -m benchmarks.bench_quant_gemm --parts copy nvfp4_dense --batches 1 2 4 8 16 \
  --out $OUT/bench_quant_gemm_nvfp4_dense.json > $OUT/bench_quant.log 2>&1
echo "bq rc=$? $((SECONDS-t0))s"
grep -E '"name"' $OUT/bench_quant.log | python3 -c 'import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["name"], r.get("proj"), r.get("batch"), r.get("us"), r.get("fraction_of_copy_bw"),
                             r.get("max_rel_err", r.get("peer_max_rel_err", "")), r.get("error", ""))'
grep -E "speedup" $OUT/bench_quant.log | cut -c1-300
tail -3 $OUT/bench_quant.log | cut -c1-300
