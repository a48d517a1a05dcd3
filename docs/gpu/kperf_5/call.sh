#!/bin/bash
# Session 13 call A2 (issue 28): the CUDA variant's second version (round trips cut) timed beside
# checkpointing_ssu and the Triton leaders, with Nsight Compute of it; compute-sanitizer memcheck on it first.
# Carry: .gpu-bundle with the trimmed FlashInfer bundle (flashinfer-trimmed.tgz) copied into it.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  tests/test_replay_cuda_gpu.py -k "small_n48 or n256" -x > $OUT/sanitizer_memcheck.log 2>&1
echo "memcheck rc=$? at $((SECONDS-t0)) s"; grep -E "ERROR SUMMARY|passed|failed" $OUT/sanitizer_memcheck.log | head -3
timeout 380 python3 -u -m benchmarks.sweep_replay --out $OUT/sweep \
  --configs cuda,cuda_r96,mma_c16_r80,mma_st3,mma_p32w2,mma_split3 --budget-s 300 --flashinfer-extra-s 40 \
  > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS-t0)) s"; grep -E "headline m2_(ckpt|flush)|confirm|flashinfer check|^m2_|^gdn" $OUT/sweep.log | cut -c1-400
left=$(( 560 - (SECONDS - t0) ))
if [ $left -gt 30 ]; then
  timeout $left python3 -u -m benchmarks.sweep_replay --ncu --sweep $OUT/sweep/sweep_replay.json --dtypes bfloat16 \
    --ncu-configs cuda --out $OUT/ncu > $OUT/ncu.log 2>&1
  echo "ncu rc=$? at $((SECONDS-t0)) s"; grep -E "m2_ckpt|m2_flush|fi:" $OUT/ncu.log | cut -c1-300
fi
cd $OUT && tar czf ncu.tgz ncu && rm -rf ncu
# FlashInfer's JIT products of this call (to judge carrying them as AOT modules: flashinfer/data/aot/<m>/<m>.so)
(cd ~/.cache/flashinfer 2>/dev/null && find . -name "*.so" -exec du -b {} + > $OUT/fi_jit_sizes.txt)
