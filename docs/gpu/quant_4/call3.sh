#!/bin/bash
# Issue 43, after call 2: the per-pair variants' GPU bit-equality test and the released-shapes test at Super
# V3's expert shapes (about 15 s). Carry .device/bundle_fi.
set -u
OUT=${1:?OUT}
mkdir -p $OUT/q6
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_moe_gemv_gpu.py \
  -k "variants or released_expert_shapes and super" > $OUT/q6/tests.log 2>&1
echo rc=$?; tail -3 $OUT/q6/tests.log
