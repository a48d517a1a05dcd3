#!/bin/bash
# Issue 46 item 10: every gpu-marked test (tests/gpu/run_checks.sh engine: 8 xdist workers on one card) on an
# 80 GB H100, with the GPU memory ledger of tests/gpu_memory.py; each test's declared need and measured peak
# go to gpu_memory.jsonl, and the card's used memory is sampled every second (smi_used_mib.csv).
# Carry .gpu-bundle (without FlashInfer: the checkout and the whole bundle exceed what one call carries) and
# .device/gsm8k.
set -u
OUT=${1:?OUT}
t0=$SECONDS
export HYBRID_EVAL_GPU_MEM_LOG=$OUT/gpu_memory.jsonl HYBRID_EVAL_GPU_MEM_WAIT_S=${HYBRID_EVAL_GPU_MEM_WAIT_S:-300}
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -l 1 > $OUT/smi_used_mib.csv 2>&1 &
smi=$!
timeout ${STAGE_TIMEOUT:-540} bash tests/gpu/run_checks.sh $OUT/engine engine > $OUT/stage.out 2>&1
echo "engine stage rc=$? at $((SECONDS-t0)) s"; kill $smi
grep -E "(FAILED|ERROR) " $OUT/engine/engine.log | head -40 | cut -c1-250
grep -E "passed|failed" $OUT/engine/engine.log | tail -2; grep -A14 "slowest" $OUT/engine/engine.log | head -16
sort -t, -k2 -n $OUT/smi_used_mib.csv | tail -1 | sed 's/^/peak used MiB: /'
