#!/bin/bash
# Session 16 (issue 28): the committed stochastic-rounding code (df84e3d: the fp16 rule as bf16's add-and-truncate
# on 13 bits of x 2^-112; the key hoisted on the checkpointing path only) on the device (an H200 asked for, the
# issue's machine; an H100 came: the run's first line). The kernels' stochastic-rounding tests on the GPU first,
# then Nsight Compute of the rn / sr pairs of every state-writing operator for kperf_5's bf16 best (mma_st3 /
# fma) and the engine's defaults at batch 64 (kernels/replay_defaults.json: per-step mma_split3, checkpointing
# mma_c16_r80), plus GDN's fma_bv8 (GDN_CONFIGS also has mma_split3, so GDN gets that pair too).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_stochastic_rounding.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/tests.log | cut -c1-300
timeout 450 python3 -u -m benchmarks.sweep_replay --ncu --no-flashinfer --ncu-sr --ncu-sr-only \
  --ncu-sr-configs mma_split3,mma_c16_r80,fma_bv8 \
  --sweep docs/gpu/kperf_5/sweep/sweep_replay.json --dtypes bfloat16 --out $OUT/ncu_sr > $OUT/ncu_sr.log 2>&1
echo "ncu_sr rc=$? at $((SECONDS-t0)) s"; grep -E ":(rn|sr):" $OUT/ncu_sr.log | cut -c1-110
(cd $OUT && tar czf ncu_sr.tgz ncu_sr && rm -rf ncu_sr)
