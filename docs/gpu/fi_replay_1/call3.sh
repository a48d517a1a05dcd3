#!/bin/bash
# After calls 1-2 and the H100 suite (docs/gpu/h100_suite_1/call4): FlashInfer's replay in the engine again on
# an H100, run beside docs/gpu/quant_2/call2.sh (GPU-light: FlashInfer's JIT builds are CPU-bound):
#  - the engine tests at bf16 activations (FlashInfer builds no float32 ones: call 1's "Ninja build failed"),
#    the float32 fallback that now says why without trying the build, and its stochastic rounding of a
#    float16 state (rand_seed per layer and step);
#  - the sweep headline's checkpointing_ssu modules (float32 and bf16 state) built into the JIT cache
#    (gpu_env's FLASHINFER_WORKSPACE_BASE, kept on the warm machine) for call 4's sweep, and bench_e2e's
#    (call 2) at quarter-depth Super V3.
# Carry .device/flashinfer-trimmed.tgz and .device/bundle_fi.
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
export PYTEST_FAILURE_LOG=$OUT/failures.log  # tracebacks as they fail (tests/conftest.py)
timeout ${WARM_TIMEOUT:-420} python3 -c 'import torch; from benchmarks.bench_mamba2 import bench_flashinfer as b
for d in (torch.float32, torch.bfloat16): print(d, b(64, 4, d, checkpointing=True), flush=True)' >$OUT/warm.log 2>&1 &
warm=$!
# and call 2's: bench_e2e's FlashInfer arms on quarter-depth Super V3 (bf16 activations, the float32 state the
# engine defaults to, K = 3; per-step and checkpointing windows), probed as the engine probes them
timeout ${WARM_TIMEOUT:-420} python3 -c 'import torch
from registry.releases import release_hybrid_config
from runners.engine.options import EngineOptions
from runners.engine.runner import _probe_flashinfer_replay
c = release_hybrid_config("nemotron_h", "nvfp4", "fp8"); T = EngineOptions(draft_len=3, ssm_replay=True).spec_tokens
for ck in (False, True): print("e2e checkpointing", ck, _probe_flashinfer_replay(c, T, ck, torch.bfloat16,
    torch.float32, torch.device("cuda")), flush=True)' >$OUT/warm_e2e.log 2>&1 &
warm_e2e=$!
timeout ${FI_TIMEOUT:-420} python3 -m pytest -v -p no:cacheprovider -m gpu -n ${TEST_WORKERS:-4} --durations=8 \
  tests/test_flashinfer_replay_gpu.py tests/test_replay_engine.py -k "flashinfer and not kernel_equals" \
  >$OUT/fi_tests.log 2>&1
echo "flashinfer tests rc=$? at $((SECONDS-t0)) s"
grep -E "(PASSED|FAILED|ERROR) |passed|failed|^E " $OUT/fi_tests.log | cut -c1-300 | tail -25
wait $warm; echo "warm-up rc=$? at $((SECONDS-t0)) s"; tail -2 $OUT/warm.log | cut -c1-300
wait $warm_e2e; echo "e2e warm-up rc=$? at $((SECONDS-t0)) s"; tail -3 $OUT/warm_e2e.log | cut -c1-300
