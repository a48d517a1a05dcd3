#!/bin/bash
# Issue 43, after call 1 on the same warm machine: bench_moe_gemv's per-pair NVFP4 variants for Super V3 at
# 1 / 2 / 4 / 8 / 16 tokens (about 17 s). Carry .device/bundle_fi.
set -u
OUT=${1:?OUT}
mkdir -p $OUT/q5
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -u -m benchmarks.bench_moe_gemv --models super_v3 --formats nvfp4 --batches 1 2 4 8 16 \
  --out $OUT/q5/bench_moe_gemv_nvfp4.json > $OUT/q5/bench_moe.log 2>&1
echo "moe rc=$?"
python3 - $OUT/q5/bench_moe_gemv_nvfp4.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r["name"].startswith("moe_gemv"): print(r["name"], r["batch"], r["us"], r.get("x_floor"))
PY
