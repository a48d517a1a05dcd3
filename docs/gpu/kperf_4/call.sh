#!/bin/bash
# Session 12 call A (issue 28): the replay sweep with the fixed grid (confirmation first, group bests on the grid)
# and FlashInfer rows, then ncu, in one call (the CUDA kernel's GPU tests run in call C's GPU suite).
# Carry: .gpu-bundle with the trimmed FlashInfer archive (flashinfer-trimmed.tgz) copied into it.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
  'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/machine.txt 2>&1
timeout 465 python3 -u -m benchmarks.sweep_replay --out $OUT/sweep --budget-s 425 --flashinfer-extra-s 20 \
  > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS-t0)) s"; tail -40 $OUT/sweep.log | cut -c1-300
left=$(( 570 - (SECONDS - t0) ))
if [ $left -gt 40 ]; then
  timeout $left python3 -u -m benchmarks.sweep_replay --ncu --sweep $OUT/sweep/sweep_replay.json --dtypes bfloat16 \
    --out $OUT/ncu > $OUT/ncu.log 2>&1
  echo "ncu rc=$? at $((SECONDS-t0)) s"; cut -c1-250 $OUT/ncu.log | tail -14
fi
cd $OUT && tar czf ncu.tgz ncu && rm -rf ncu
