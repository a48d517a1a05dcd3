#!/bin/bash
# Issue 43: the fused router's launch shapes (kernels.router.FUSED_CANDIDATES) on the GPU, after
# docs/gpu/router_1 found the first form (4 experts x 512 columns x 4 warps per program, the last program
# routing one token at a time) slower than the three launches at 1, 4 and 8 tokens:
#   - the router's GPU tests (every candidate at the release shapes, router_logits, graph replays) and the
#     MoE block's decode forms (moe.ROUTER_FORMS "fused" and "logits", eager and replayed);
#   - benchmarks/bench_router.py: three launches against fused:C and logits:C for each candidate C at 1-8
#     tokens on both release routers; its summary sets moe.ROUTER_FORMS and kernels.router.ROUTER_FUSED_CONFIGS.
# Either card; carry .gpu-bundle.
#   bash docs/gpu/router_2/call.sh OUT        about 300 s
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_kernels_router.py tests/test_moe.py \
  tests/test_kernels_norm.py >$OUT/tests_gpu.log 2>&1
echo "gpu tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu.log | cut -c1-200 | tail -8
timeout ${BENCH_TIMEOUT:-300} python3 -u -m benchmarks.bench_router --out $OUT/bench_router.json >$OUT/bench_router.log 2>&1
echo "bench_router rc=$? at $((SECONDS-t0)) s"
grep -E "tokens: best" $OUT/bench_router.log
python3 - $OUT/bench_router.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for m in sorted({r["model"] for r in rows}):
    for n in sorted({r["tokens"] for r in rows}):
        at = sorted((r for r in rows if r["model"] == m and r["tokens"] == n and "us" in r), key=lambda r: r["us"])
        print(m, n, " ".join(f"{r['name']}={r['us']}{'' if r.get('match', True) else '(X)'}" for r in at[:6]))
        err = [r["name"] for r in rows if r["model"] == m and r["tokens"] == n and "error" in r]
        if err: print("  errors:", err)
PY
echo "done at $((SECONDS-t0)) s"
