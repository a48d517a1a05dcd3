#!/bin/bash
# Session 11 call A (issue 28): the replay sweep with FlashInfer rows (grid budget, confirmation pass after the
# FlashInfer JIT builds), then Nsight Compute of the best kernels and FlashInfer's checkpointing_ssu, bf16 state.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
  'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/machine.txt 2>&1
timeout 430 python3 -u -m benchmarks.sweep_replay --out $OUT/sweep --budget-s 350 --flashinfer-extra-s 30 \
  > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS-t0)) s"; tail -50 $OUT/sweep.log | cut -c1-300
left=$(( 565 - (SECONDS - t0) ))
if [ $left -gt 40 ]; then
  timeout $left python3 -u -m benchmarks.sweep_replay --ncu --sweep $OUT/sweep/sweep_replay.json --dtypes bfloat16 \
    --out $OUT/ncu > $OUT/ncu.log 2>&1
  echo "ncu rc=$? at $((SECONDS-t0)) s"; cut -c1-330 $OUT/ncu.log | tail -14
fi
cd $OUT && tar czf ncu.tgz ncu && rm -rf ncu
