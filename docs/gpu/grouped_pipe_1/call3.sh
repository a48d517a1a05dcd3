#!/bin/bash
# Issue 43: pair_cuda.X_PERM (x copied with its columns permuted so that the NVFP4 pipelined kernel takes each x
# word as an MMA B register, with no byte permute: 144 fewer instructions in the kernel's static count) against
# the pipelined form, Super V3 NVFP4's routed experts at 64 and 256 tokens; first the grouped GPU tests (the
# permuted layout gives the same bits). Either card; carry .gpu-bundle.
#   bash docs/gpu/grouped_pipe_1/call3.sh OUT       about 120 s
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start || exit 1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py -k "grouped and pipelined" \
  >$OUT/tests_xperm.log 2>&1
echo "grouped pipelined GPU tests rc=$? at $((SECONDS-t0)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests_xperm.log | cut -c1-220 | tail -8
timeout 150 python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_nvfp4_xperm.json --models super_v3 \
  --formats nvfp4 --batches ${BATCHES:-64 256} >$OUT/bench_nvfp4_xperm.log 2>&1
echo "bench rc=$? at $((SECONDS-t0)) s"
python3 - $OUT/bench_moe_gemv_nvfp4_xperm.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "pipelined" in r.get("name", "") or r.get("name") == "grouped_mm_nvfp4":
        print(r.get("name"), r.get("batch"), r.get("us"), r.get("x_floor"), r.get("fraction_of_copy_bw"), r.get("error", "")[:160])
PY
echo "done at $((SECONDS-t0)) s"
