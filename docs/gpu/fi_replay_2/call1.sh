#!/bin/bash
# Issue 45 after docs/gpu/fi_replay_1: the FlashInfer engine tests with each failure's traceback kept as it
# happens ($PYTEST_FAILURE_LOG), and beside them bench_e2e's modules for the one-launch wrapper (dt and D /
# dt_bias in bf16, int64 slot ids: new JIT modules, about 4 minutes each to build) probed as the engine
# probes them, into gpu_env's JIT cache for call 2 on the same warm machine. About 9 modules build at once
# (the contract test's 4, the engine tests' 2, stochastic rounding's 1, bench_e2e's 2), each about 4 minutes
# of one core's nvcc: 8 test workers beside the warm-up. Carry
# .device/flashinfer-trimmed.tgz and .device/bundle_fi.
set -u
OUT=${1:?OUT}
t0=$SECONDS
# The checkout (40 MB since 2026-12-07), FlashInfer (23 MB) and .device/bundle_fi (4 MB) together pass the 64 MiB
# a call carries: carry .gpu-bundle in an earlier call on the same warm machine (it stays there) and then only
# FlashInfer here, or .device/bundle_fi where the checkout is small enough.
[ -d .gpu-bundle ] || [ -d .device/bundle_fi ] || {
  echo "no .gpu-bundle or .device/bundle_fi on this machine: carry .gpu-bundle in a call before this one"; exit 3; }
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
export PYTEST_FAILURE_LOG=$OUT/failures.log
timeout ${WARM_TIMEOUT:-500} python3 -c 'import torch
from registry.releases import release_hybrid_config
from runners.engine.options import EngineOptions
from runners.engine.runner import _probe_flashinfer_replay
c = release_hybrid_config("nemotron_h", "nvfp4", "fp8"); T = EngineOptions(draft_len=3, ssm_replay=True).spec_tokens
for ck in (False, True): print("e2e checkpointing", ck, _probe_flashinfer_replay(c, T, ck, torch.bfloat16,
    torch.float32, torch.device("cuda"), param_dtype=torch.bfloat16), flush=True)' >$OUT/warm_e2e.log 2>&1 &
warm=$!
timeout ${FI_TIMEOUT:-500} python3 -m pytest -v -p no:cacheprovider -m gpu -n ${TEST_WORKERS:-8} --durations=8 \
  tests/test_flashinfer_replay_gpu.py tests/test_replay_engine.py -k "flashinfer" >$OUT/fi_tests.log 2>&1
echo "flashinfer tests rc=$? at $((SECONDS-t0)) s"
grep -E "(PASSED|FAILED|ERROR) |passed|failed" $OUT/fi_tests.log | cut -c1-300 | tail -20
[ -f $OUT/failures.log ] && head -c 6000 $OUT/failures.log
wait $warm; echo "e2e warm-up rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/warm_e2e.log | cut -c1-300
