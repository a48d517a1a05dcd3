#!/bin/bash
# Issue 45 on a machine where an earlier call carried .gpu-bundle and .device/flashinfer-aot.tgz (carry
# .device/flashinfer-trimmed.tgz here): FlashInfer's GPU tests and the engine's probe of bench_e2e's modules
# (docs/gpu/fi_replay_2/call1.sh), with the modules built ahead on a CPU machine (tests/gpu/flashinfer_aot.py,
# unpacked by gpu_env into FlashInfer's data/aot); then which modules the device still had to build (they
# belong in flashinfer_aot.MODULES).
#   bash docs/gpu/fi_replay_5/callB.sh OUT
set -u
OUT=${1:?OUT}
t0=$SECONDS
bash docs/gpu/fi_replay_2/call1.sh "$OUT"
echo "prebuilt modules: $(ls /tmp/site/flashinfer/data/aot 2>/dev/null | wc -l)"
echo "modules built on this machine (JIT):"
find .device/fi_ws -name "*.so" -printf "%f\n" 2>/dev/null | sort
echo "done at $((SECONDS-t0)) s"
