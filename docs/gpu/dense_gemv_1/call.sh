#!/bin/bash
# Issue 43: the bf16 projections of Super V3's batch-1 step (the MoE latent projections, attention) through
# cuBLAS's entry points: benchmarks/bench_dense_gemv.py. Either card; carry .gpu-bundle.
#   bash docs/gpu/dense_gemv_1/call.sh OUT        about 40 s
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
timeout 120 python3 -u -m benchmarks.bench_dense_gemv --out $OUT/bench_dense_gemv.json >$OUT/bench_dense_gemv.log 2>&1
echo "bench rc=$? at $((SECONDS-t0)) s"
python3 - $OUT/bench_dense_gemv.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], r["rows"], r["name"], r["us"], r["x_floor"], r["max_abs_diff"])
PY
