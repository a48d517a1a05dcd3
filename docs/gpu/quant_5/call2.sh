#!/bin/bash
# Issue 43, the per-pair GEMVs' launch settings: benchmarks/sweep_pair_gemv.py over num_warps x the widest
# output tile (x NVFP4's weights per step), Super V3 NVFP4 and Qwen3-Next block-FP8 experts, 1 and 8
# tokens, each configuration's whole three-launch call against the floor of the same run's copy bandwidth.
# Carry .device/bundle_fi.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1
t0=$SECONDS
timeout ${SWEEP_TIMEOUT:-200} python3 -u -m benchmarks.sweep_pair_gemv --out $OUT/sweep_pair_gemv.json \
  --batches 1 8 --budget-s ${SWEEP_BUDGET_S:-150} > $OUT/sweep.log 2>&1
echo "sweep rc=$? $((SECONDS-t0))s"
python3 - $OUT/sweep_pair_gemv.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    c = r["config"]
    print(r["format"], r["batch"], c["num_warps"], c["num_stages"], c["max_block_n"], c.get("tile_weights", ""),
          r.get("us"), r.get("x_floor"), r.get("max_rel_err"), r.get("error", ""))
print("best", json.dumps(d.get("best")), "skipped", len(d.get("skipped", [])))
PY
tail -2 $OUT/sweep.log | cut -c1-300
