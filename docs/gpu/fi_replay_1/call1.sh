#!/bin/bash
# Issue 45 on the GPU, call 1: FlashInfer's checkpointing_ssu as the engine's replay kernel.
# Carry .device/flashinfer-trimmed.tgz and .device/bundle_fi (hydra-core, omegaconf, antlr4, einops,
# apache-tvm-ffi, cuda-tile: what the tests and FlashInfer import; the whole bundle, FlashInfer and the checkout
# exceed what one call carries). Steps:
#  1. the sweep headline's FlashInfer JIT modules built in the background (float32 and bf16 state);
#  2. tests/test_flashinfer_replay_gpu.py and the replay engine tests (6 xdist workers: each builds its own
#     JIT modules, CPU-bound);
#  3. benchmarks/sweep_replay.py --quick: the headline rows with `default` beside `flashinfer`.
set -u
OUT=${1:?OUT}
t0=$SECONDS
[ -d .gpu-bundle ] || cp -r .device/bundle_fi .gpu-bundle
source tests/gpu/env.sh
gpu_env || exit 1
python3 -c 'import flashinfer, torch, triton; print("flashinfer", flashinfer.__version__, "torch", torch.__version__,
"triton", triton.__version__, torch.cuda.get_device_name())' | tee $OUT/machine.txt
timeout 300 python3 -c 'import torch; from benchmarks.bench_mamba2 import bench_flashinfer as b
for d in (torch.float32, torch.bfloat16): print(d, b(64, 4, d, checkpointing=True), flush=True)' >$OUT/warm.log 2>&1 &
warm=$!
timeout ${TESTS_TIMEOUT:-290} python3 -m pytest -v -p no:cacheprovider -m gpu -n ${TEST_WORKERS:-6} --durations=12 \
  tests/test_flashinfer_replay_gpu.py tests/test_replay_engine.py >$OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-t0)) s"
grep -E "(FAILED|ERROR) |passed|failed" $OUT/tests.log | cut -c1-300 | tail -20
wait $warm; echo "warm-up done at $((SECONDS-t0)) s"; tail -3 $OUT/warm.log | cut -c1-400
timeout ${SWEEP_TIMEOUT:-250} python3 -u -m benchmarks.sweep_replay --quick --flashinfer-extra-s 30 --out $OUT/sweep \
  >$OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS-t0)) s"
grep -iE "headline|default|flashinfer" $OUT/sweep.log | tail -30 | cut -c1-250
