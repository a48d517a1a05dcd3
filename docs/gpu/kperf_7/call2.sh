#!/bin/bash
# Session 15 (issue 28), second call: after call.sh's profile, the fp16 rule as bf16's add-and-truncate on 13
# bits of x 2^-112 (kernels/rounding.py), and only the key's loads and hash hoisted out of the column-chunk
# loops (call.sh's per-row hashes cost the per-step write 28 registers and a warp per scheduler). The rule on
# the GPU first, then Nsight Compute of call.sh's rn / sr pairs less GDN's fma_bv8 (the device time left).
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_stochastic_rounding.py > $OUT/tests2.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/tests2.log | cut -c1-300
timeout 270 python3 -u -m benchmarks.sweep_replay --ncu --no-flashinfer --ncu-sr --ncu-sr-configs mma_c16_r80 --ncu-sr-only \
  --sweep docs/gpu/kperf_5/sweep/sweep_replay.json --dtypes bfloat16 --out $OUT/ncu_sr2 > $OUT/ncu_sr2.log 2>&1
echo "ncu_sr2 rc=$? at $((SECONDS-t0)) s"; grep -E ":(rn|sr):" $OUT/ncu_sr2.log | cut -c1-160
(cd $OUT && tar czf ncu_sr2.tgz ncu_sr2 && rm -rf ncu_sr2)
