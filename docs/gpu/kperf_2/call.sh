#!/bin/bash
# Session 10 call B (issue 28): replay sweep with FlashInfer rows, Nsight Compute of the best kernels and of
# FlashInfer's checkpointing_ssu (bf16 state), then the replay-kernel GPU tests with what time is left.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
  'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/machine.txt 2>&1
timeout 400 python3 -u -m benchmarks.sweep_replay --out $OUT/sweep --budget-s 300 --flashinfer-extra-s 230 \
  > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS-t0)) s"; tail -45 $OUT/sweep.log
left=$(( 545 - (SECONDS - t0) ))
if [ $left -gt 60 ]; then
  timeout $left python3 -u -m benchmarks.sweep_replay --ncu --sweep $OUT/sweep/sweep_replay.json --dtypes bfloat16 \
    --out $OUT/ncu > $OUT/ncu.log 2>&1
  echo "ncu rc=$? at $((SECONDS-t0)) s"; cat $OUT/ncu.log | cut -c1-400
fi
left=$(( 560 - (SECONDS - t0) ))
if [ $left -gt 45 ]; then
  timeout $left python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/test_kernels_mamba2_gpu.py \
    > $OUT/kernels_mamba2_gpu.log 2>&1; echo "mamba2 gpu tests rc=$? at $((SECONDS-t0)) s"; tail -5 $OUT/kernels_mamba2_gpu.log
fi
cd $OUT && tar czf ncu.tgz ncu && rm -rf ncu
