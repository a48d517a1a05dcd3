#!/bin/bash
# Session 13 call F (issues 27, 28): the tests gpu_suite_2 failed, after their fixes (Mamba2 decay_rate on inference
# tensors; the combine test's tolerance), then the fused-vs-reference decode benchmark (call E's, shorter budget).
# Carry .gpu-bundle (no FlashInfer), .device/gsm8k and this script.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
timeout 230 python3 -m pytest -v -p no:cacheprovider -m gpu -n 8 --dist loadgroup --durations 12 \
  tests/test_engine_graphs.py tests/test_kernels_moe_combine.py tests/test_replay_cache.py tests/test_kernels_norm.py \
  tests/test_kernels_gdn_prologue.py tests/test_kernels_rope.py "tests/test_compile.py::test_gpu_compiled_graphs_equal_compiled_eager_bitwise" \
  "tests/test_compile.py::test_gpu_compiled_tokens_equal_uncompiled_greedy_fp32" -k "nemotron_h or not qwen3_next" \
  > $OUT/rerun.log 2>&1
echo "rerun rc=$? at $((SECONDS-t0)) s"; grep -E "(FAILED|ERROR) " $OUT/rerun.log | head; tail -16 $OUT/rerun.log | cut -c1-200
left=$(( 575 - (SECONDS - t0) ))
timeout $left python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_fused --parts super_v3,qwen3_next --graphs on \
  --compile off --fused both --batch-sizes 1 8 --arms plain replay --accept-length 2.6 --steps 24 \
  --time-budget-s $(( left - 30 )) > $OUT/e2e_fused.log 2>&1
echo "bench rc=$? at $((SECONDS-t0)) s"; grep -E "decode_tokens_per_s" $OUT/e2e_fused.log | tail -16 | cut -c1-260
