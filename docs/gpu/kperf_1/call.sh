#!/usr/bin/env bash
# Device call 5: issue 15's sweep (replay kernel variants vs the copy floor and FlashInfer) and Nsight Compute
# pass, then the gpu-marked kernel tests (variants, stochastic rounding).
set -u
W=$OUT/w; mkdir -p $W; T0=$SECONDS
SWEEP_ARGS=--quick NCU_ARGS=--quick timeout 360 bash tests/gpu/run_checks.sh $W sweep ncu > $W/run_checks_kperf.out 2>&1; echo "sweep+ncu rc=$? at $((SECONDS-T0)) s" | tee -a $W/run_checks_kperf.out
tail -12 $W/run_checks_kperf.out
PYTHONPATH=/tmp/site:$PWD timeout $((500-SECONDS+T0)) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_mamba2_gpu.py tests/test_kernels_gdn_gpu.py tests/test_stochastic_rounding.py > $W/kernels_gpu.log 2>&1; echo "kernel tests rc=$? at $((SECONDS-T0)) s" | tee -a $W/kernels_gpu.log
tail -5 $W/kernels_gpu.log
tar czf $OUT/call5.tgz -C $OUT w && rm -rf $W
echo "end at $((SECONDS-T0)) s"
