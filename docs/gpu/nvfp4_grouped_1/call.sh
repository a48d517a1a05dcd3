#!/bin/bash
# Issue 43, the grouped NVFP4 tensor-core GEMM's launch settings at Super V3's batch-64 MTP verify (256 tokens x
# top-22 = 5632 rows over 512 experts, about 11 per expert; up 1024 -> 2688, down 2688 -> 1024), where it took
# 28.8 of the 42 ms step at about 2.8x its weight-read floor: benchmarks/sweep_nvfp4_grouped.py times the
# default (tile_config: BLOCK_M 16, BLOCK_N 64, 4 warps, BLOCK_K 128, 3 stages), the CUDA grouped kernel
# (GROUPED_KERNEL "cuda") and the grid BLOCK_N {32..256} x warps {4, 8} x stages {1..4} x BLOCK_K {64, 128,
# 256} x BLOCK_M {16, 32} through nvfp4.MMA_TILE / MMA_BLOCK_K / MMA_NUM_STAGES, every output checked against
# the default's; the grid compiled first in 8 processes, then timed in order of promise until the budget.
# Either card (H100 expected); carry .gpu-bundle.
#   bash docs/gpu/nvfp4_grouped_1/call.sh OUT        about 170 s (BUDGET_S=130 of sweep, its setup included)
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_outdir "$OUT" || exit 2
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "env ready at $((SECONDS-t0)) s"
BUDGET_S=${BUDGET_S:-130}
timeout $((BUDGET_S + 40)) python3 -u -m benchmarks.sweep_nvfp4_grouped --out $OUT/sweep.json \
  --budget-s $BUDGET_S --precompile ${JOBS:-8} ${SWEEP_ARGS:-} >$OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS-t0)) s"
grep -E '"precompile"|^error|Traceback' $OUT/sweep.log | cut -c1-200 | head -5
sed -n '/^point /,$p' $OUT/sweep.log
python3 - $OUT/sweep.json <<'PY'
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
except Exception as e:  # a run cut short before its first save
    sys.exit(f"no JSON: {e}")
rows = [r for r in rep["rows"] if r["kind"] == "config"]
print("copy GB/s", rep["copy"]["gb_per_s"], "| config rows", len(rows), "ok", sum(bool(r.get("ok")) for r in rows),
      "| errors", sum(bool(r.get("error")) for r in rows), "| skipped", len(rep["skipped"]), "of", rep["grid_size"])
bad = [r for r in rows if r.get("error") is None and r.get("ok") is False]
print("wrong outputs (never chosen):", [(r["proj"], r["config"], r.get("max_rel_err")) for r in bad][:5])
for p in sorted({r["proj"] for r in rows}):
    top = sorted((r for r in rows if r["proj"] == p and r.get("ok") and "us" in r), key=lambda r: r["us"])[:5]
    for r in top:
        c = r["config"]
        print(p, "m%(block_m)d n%(block_n)d w%(num_warps)d s%(num_stages)d k%(block_k)d" % c, r["us"], r["x_floor"])
for r in rep.get("confirm", []):
    print("confirm", r["proj"], r.get("role"), r.get("us"), r.get("x_floor"), r.get("ok"))
PY
echo "done at $((SECONDS-t0)) s"
