#!/usr/bin/env bash
# Device call 3: issue 14's e2e stage (CUDA-graph GPU tests, bench_e2e on quarter-depth Super V3 and the tiny
# entries with HF generate as the floor, run.py runtime=gpu over all of GSM8K on the tiny entry).
set -u
W=$OUT/w; mkdir -p $W; T0=$SECONDS
tar xzf .device/gsm8k.tgz -C .device && export GSM8K_DIR=$PWD/.device/gsm8k
timeout 560 bash tests/gpu/run_checks.sh $W e2e > $W/run_checks_e2e.out 2>&1; echo "run_checks rc=$? at $((SECONDS-T0)) s" | tee -a $W/run_checks_e2e.out
tail -40 $W/run_checks_e2e.out
rm -rf $W/run_tiny_gpu/*.png 2>/dev/null
tar czf $OUT/call3.tgz -C $OUT w && rm -rf $W
echo "end at $((SECONDS-T0)) s"
