#!/bin/bash
# The three device commands of session 32's run1, as typed into the device tool (one H100, one warm machine;
# OUT the tool's output folder). The first asked for an H200 (needs_h200 false) and got an H100.
# 1. (carry .gpu-bundle and .device/flashinfer-aot.tgz, 72 s) the bf16 dense projections (dense_gemv_1) and the
#    GPU tests of the grouped forms, the repacked formats and the per-pair persistent form:
bash docs/gpu/fi_replay_5/callH0.sh $OUT
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py \
  -k "grouped_kernel_vs or repacked or pair_persistent" > $OUT/tests_persistent.log 2>&1
# 2. (111 s) bench_moe_gemv at 1 / 8 / 64 / 256 tokens, both release formats (call.sh's bench loop):
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1
for mf in super_v3:nvfp4 qwen3_next:block_fp8; do
  m=${mf%%:*}; f=${mf##*:}
  timeout 230 python3 -u -m benchmarks.bench_moe_gemv --out $OUT/bench_moe_gemv_$f.json --models $m --formats $f \
    --batches 1 8 64 256 >$OUT/bench_$f.log 2>&1
done
# 3. (231 s) Nsight Compute, the grouped kernel's pipelined and persistent forms at 256 and 8 tokens:
timeout 470 python3 -u -m benchmarks.ncu_grouped --out $OUT/ncu --tokens 256 8 --layouts natural >$OUT/ncu.log 2>&1
