#!/bin/bash
# Session 16 (issue 28), fourth call: call 3's sanitize stage ran out of device memory (79 GiB allocated by
# PyTorch after 18 tests of tests/test_kernels_mamba2_gpu.py in one process on the 80 GB H100; no invalid
# access was reported). (1) Device memory still allocated after each test of that module, in one process,
# without the sanitizer: does it grow? (2) compute-sanitizer memcheck over the kernels whose rounding changed
# in sessions 15-16 (tests/test_stochastic_rounding.py) and the GDN GPU tests, each module in its own process.
set -u
OUT=${1:?OUT}
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
t0=$SECONDS
mkdir -p /tmp/plug && cat > /tmp/plug/memtrace.py <<'PY'
import torch
def pytest_runtest_teardown(item, nextitem):
    torch.cuda.synchronize()
    print(f"\nMEM {item.nodeid} allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
PY
PYTHONPATH=/tmp/plug:${PYTHONPATH-} timeout 120 python3 -m pytest -q -s -p no:cacheprovider -p memtrace \
  -k "not graph" tests/test_kernels_mamba2_gpu.py > $OUT/memtrace.log 2>&1
echo "memtrace rc=$? at $((SECONDS-t0)) s"; grep "^MEM" $OUT/memtrace.log | awk '{print $4}' | tr '\n' ' '; echo
tail -1 $OUT/memtrace.log
for m in test_stochastic_rounding test_kernels_gdn_gpu; do
  timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider -k "not graph" tests/$m.py > $OUT/sanitize_$m.log 2>&1
  echo "sanitize $m rc=$? at $((SECONDS-t0)) s"; grep -E "ERROR SUMMARY|passed|failed" $OUT/sanitize_$m.log | tail -2
done
