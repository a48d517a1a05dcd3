#!/bin/bash
# Session 16 (issue 28), second call: the same pairs after the per-step write hoists the key for an fp16 state
# (SR_HOIST in kernels/mamba2/replay.py; call 1 measured df84e3d's per-chunk key read there, call 3 of kperf_7
# the hoisted form). The same tests and Nsight Compute pairs as call.sh, so the operators the change does not
# touch (flush, GDN) are measured twice.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_stochastic_rounding.py > $OUT/tests2.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/tests2.log | cut -c1-300
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_replay_defaults.py tests/test_kernels_mamba2.py \
  -k "defaults or replay_verify_matches_reference or checkpointing_verify_matches" > $OUT/tests2_m2.log 2>&1
echo "mamba2 tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/tests2_m2.log | cut -c1-300
timeout 450 python3 -u -m benchmarks.sweep_replay --ncu --no-flashinfer --ncu-sr --ncu-sr-only \
  --ncu-sr-configs mma_split3,mma_c16_r80,fma_bv8 \
  --sweep docs/gpu/kperf_5/sweep/sweep_replay.json --dtypes bfloat16 --out $OUT/ncu_sr2 > $OUT/ncu_sr2.log 2>&1
echo "ncu_sr2 rc=$? at $((SECONDS-t0)) s"; grep -E ":(rn|sr):" $OUT/ncu_sr2.log | cut -c1-110
(cd $OUT && tar czf ncu_sr2.tgz ncu_sr2 && rm -rf ncu_sr2)
