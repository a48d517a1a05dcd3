#!/bin/bash
# Session 10 call A: quantized per-pair MoE GEMV (tests + benchmark per format), replay-kernel and compile GPU
# tests, tp_bench with both ranks on one GPU (graphs off and on), quarter-depth bench_e2e b1/8/64 three arms.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env || exit 1
t0=$SECONDS
bash tests/gpu/run_checks.sh $OUT/moe moe > $OUT/moe_stage.out 2>&1
echo "moe stage done at $((SECONDS-t0)) s"; tail -3 $OUT/moe/moe.log; tail -40 $OUT/moe/bench_moe_gemv.log | head -60
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_mamba2_gpu.py tests/test_compile.py \
  > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/gpu_tests.log
timeout 120 python3 tests/gpu/tp_bench.py --share-gpu --compute-dtype float32 --num-experts 32 --batch 4 \
  --graphs off on --prompt-len 128 --new-tokens 16 --time-budget 100 --workdir /tmp/tp_bench \
  --out $OUT/tp_bench_shared.json > $OUT/tp_bench_shared.log 2>&1
echo "tp_bench rc=$? at $((SECONDS-t0)) s"; tail -8 $OUT/tp_bench_shared.log
left=$(( 560 - (SECONDS - t0) ))
echo "bench_e2e budget ${left} s"
timeout $((left)) python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_q --parts super_v3,qwen3_next --graphs on \
  --compile off --batch-sizes 1 8 64 --arms plain rewind replay --accept-length 2.6 --steps 24 \
  --time-budget-s $((left - 40)) > $OUT/e2e_q.log 2>&1
echo "e2e rc=$? at $((SECONDS-t0)) s"; tail -30 $OUT/e2e_q.log
