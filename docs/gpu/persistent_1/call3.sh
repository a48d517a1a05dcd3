#!/bin/bash
# Issue 43, after call.sh (the same warm machine, or a fresh one carrying .gpu-bundle): Nsight Compute profiles of
# the grouped kernel (benchmarks/ncu_grouped.py) at the batch-64 verify's 256 tokens: Super V3 NVFP4 and
# Qwen3-Next block FP8, up and down, the pipelined and persistent forms, natural and repacked codes (16
# launches, one process each): DRAM throughput, cache hit rates, the schedulers' issue rate and the warp-stall
# breakdown, which say whether the kernel waits on memory, on issue or on its own latency. Either card.
#   bash docs/gpu/persistent_1/call3.sh OUT       about 240 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start >/dev/null 2>&1 || exit 1
timeout ${NCU_TIMEOUT:-500} python3 -u -m benchmarks.ncu_grouped --out $OUT/ncu --tokens ${TOKENS:-256} >$OUT/ncu.log 2>&1
echo "ncu_grouped rc=$? at $((SECONDS-t0)) s"
tail -20 $OUT/ncu.log | cut -c1-200
