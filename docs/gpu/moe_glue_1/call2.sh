#!/bin/bash
# Issue 43, run2 (after call.sh on the same warm machine): the fixed block-FP8 per-pair GPU test, then bench_e2e
# for Super V3 NVFP4 at half depth (44 of 88 layers), batch-64 MTP + replay, forced acceptance length 3.0, with
# the MoE glue kernels off (runners.engine.models.moe.GLUE_KERNELS=false: the references) and then on (the
# default). Either card.
#   bash docs/gpu/moe_glue_1/call2.sh OUT       about 130 s on an H100
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_start >/dev/null 2>&1 || exit 1
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py \
  -k "block_fp8_cuda_pair_kernel" >$OUT/tests_fix.log 2>&1
echo "fix test rc=$? at $((SECONDS-t0)) s"; tail -1 $OUT/tests_fix.log
for glue in false true; do
  timeout 110 python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_glue_$glue --parts super_v3_nvfp4 --full-layers 44 24 \
    --graphs on --compile off --batch-sizes 64 --arms replay --accept-length 3.0 --steps 16 --time-budget-s 80 \
    --kernel-setting runners.engine.models.moe.GLUE_KERNELS=$glue >$OUT/e2e_glue_$glue.log 2>&1
  echo "e2e glue=$glue rc=$? at $((SECONDS-t0)) s"
  cp $OUT/e2e_glue_$glue/bench_e2e.json $OUT/bench_e2e_glue_$glue.json 2>/dev/null
done
