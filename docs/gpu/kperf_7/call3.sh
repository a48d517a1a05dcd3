#!/bin/bash
# Session 15 (issue 28), third call (an H100: no H200 could be started for an hour; the device time left fits
# only this): the code of 4b1b5b9 (the fp16 rule as bf16's add-and-truncate on 13 bits of x 2^-112; only the
# key's loads and hash hoisted out of the chunk loops). The rule on the GPU first (bit for bit against the
# reference, the kernels' stochastic-rounding tests), then Nsight Compute of the rn / sr pairs of each
# operator's bf16 best (kperf_6's set) with this code, then with the kernels of 29767fd (the floor form),
# carried as .device/kernels_29767fd.tgz, so before / after come from one machine.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_stochastic_rounding.py > $OUT/tests3.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/tests3.log | cut -c1-300
ncu_pairs() {  # $1: output name
  timeout 130 python3 -u -m benchmarks.sweep_replay --ncu --no-flashinfer --ncu-sr --ncu-sr-only \
    --sweep docs/gpu/kperf_5/sweep/sweep_replay.json --dtypes bfloat16 --out $OUT/$1 > $OUT/$1.log 2>&1
  echo "$1 rc=$? at $((SECONDS-t0)) s"; grep -E ":(rn|sr):" $OUT/$1.log | cut -c1-120
  (cd $OUT && tar czf $1.tgz $1 && rm -rf $1)
}
ncu_pairs ncu_sr3
rm -rf kernels && tar xzf .device/kernels_29767fd.tgz && ncu_pairs ncu_sr3_29767fd
