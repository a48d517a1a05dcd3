#!/bin/bash
# Session 15 (issue 28): the fp16 stochastic-rounding rule in its kernel form (a dither, then the hardware's
# convert toward zero: no exponent, grid spacing or floor per element). First the rule on the GPU (bit for bit
# against the reference; the kernels' stochastic-rounding tests), then Nsight Compute of the rn / sr pairs as
# kperf_6 plus the pairs of mma_c16_r80 (Mamba2) and fma_bv8 (GDN); then the same pairs with the kernels
# before this session (kernels/ of commit 29767fd: the floor form, the random bits' per-row keys computed in
# every column chunk), carried as .device/kernels_29767fd.tgz, in the same call.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stochastic_rounding.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"; tail -4 $OUT/tests.log | cut -c1-300
ncu_pairs() {  # $1: output name
  timeout 260 python3 -u -m benchmarks.sweep_replay --ncu --no-flashinfer --ncu-sr --ncu-sr-configs mma_c16_r80,fma_bv8 --ncu-sr-only \
    --sweep docs/gpu/kperf_5/sweep/sweep_replay.json --dtypes bfloat16 --out $OUT/$1 > $OUT/$1.log 2>&1
  echo "$1 rc=$? at $((SECONDS-t0)) s"; grep -E ":(rn|sr):" $OUT/$1.log | cut -c1-300
  (cd $OUT && tar czf $1.tgz $1 && rm -rf $1)
}
ncu_pairs ncu_sr
if [ -f .device/kernels_29767fd.tgz ]; then
  rm -rf kernels && tar xzf .device/kernels_29767fd.tgz && ncu_pairs ncu_sr_29767fd
fi
