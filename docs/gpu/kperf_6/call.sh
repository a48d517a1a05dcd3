#!/bin/bash
# Session 14 call K (issue 28): Nsight Compute of the stochastic-rounding rows against round-to-nearest (bf16
# state; write, flush and GDN kernels), from kperf_5's sweep choices, no FlashInfer.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 440 python3 -u -m benchmarks.sweep_replay --ncu --no-flashinfer --ncu-sr --sweep docs/gpu/kperf_5/sweep/sweep_replay.json \
  --dtypes bfloat16 --ncu-configs fma --out $OUT/ncu_sr > $OUT/ncu_sr.log 2>&1
echo "ncu rc=$? at $((SECONDS-t0)) s"; grep -vE "^\s*$" $OUT/ncu_sr.log | tail -40 | cut -c1-300
(cd $OUT && tar czf ncu_sr.tgz ncu_sr && rm -rf ncu_sr)
