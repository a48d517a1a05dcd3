#!/usr/bin/env bash
# Issue 26: the mission's command at full depth on one H200 with dummy weights (model.load_format=dummy:
# random weights at the entry's released configuration -- all 88 / 48 layers, all 512 experts -- in its
# checkpoint format, built straight on the GPU; no checkpoint is read). Run from the repository root on the
# device machine, carrying .gpu-bundle and .device/gsm8k (as tests/gpu/run_checks.sh):
#
#   bash tests/gpu/fulldepth_run.sh OUTDIR [ENTRY ...]
#
# ENTRY defaults to super_v3_mtp_nvfp4 super_v3_mtp_fp8 qwen3_next_mtp_fp8; one entry fits one 10-minute
# device call (FULLDEPTH_TIMEOUT seconds each, default 570). Each runs
#   python3 run.py model=ENTRY model.load_format=dummy runtime=gpu ssm_replay=true eval.limit=64 \
#     hydra.run.dir=OUTDIR/ENTRY $FULLDEPTH_ARGS
# logging (unbuffered: the dummy build's progress, the load's memory by kind, the CUDA-graph capture, the
# generate progress) to OUTDIR/ENTRY.log; results.json / summary.md land in OUTDIR/ENTRY/ (memory by kind,
# load report with the device peak, timings.capture_seconds, prefill / decode tokens/s, the full-GSM8K
# projection). An entry whose weights + caches do not fit is refused in seconds by the fit check, naming
# weights, caches, free memory and the largest eval.batch_size that fits: rerun it with
# FULLDEPTH_ARGS="eval.batch_size=N". Random MTP heads accept nothing: FULLDEPTH_ARGS=
# "runtime.forced_acceptance_length=3.0" times MTP + replay at acceptance length 3 (decode rate and the
# full-GSM8K projection of a speculative run). The script keeps going after a failing entry and exits non-zero at the
# end if any failed (their names in OUTDIR/failed_entries.txt).
set -uo pipefail
usage="usage: bash tests/gpu/fulldepth_run.sh OUTDIR [ENTRY ...]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
out=$1; shift
entries=${*:-super_v3_mtp_nvfp4 super_v3_mtp_fp8 qwen3_next_mtp_fp8}
source tests/gpu/env.sh
gpu_outdir "$out" || exit 2
gpu_env || exit 1
rm -f "$out/failed_entries.txt"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv; python3 -c \
  'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$out/machine.txt" 2>&1
for entry in $entries; do
  # FULLDEPTH_ARGS: extra overrides, split on spaces on purpose
  # models_root=null: the released configuration even where $LLM_MODELS_ROOT is set without the checkpoints
  cmd=(timeout "${FULLDEPTH_TIMEOUT:-570}" python3 -u run.py "model=$entry" model.load_format=dummy models_root=null runtime=gpu
       ssm_replay=true eval.limit=64 "hydra.run.dir=$out/$entry" ${FULLDEPTH_ARGS-})
  echo "=== $entry: ${cmd[*]}" | tee "$out/$entry.log"
  t0=$SECONDS
  "${cmd[@]}" >>"$out/$entry.log" 2>&1; rc=$?
  echo "=== $entry: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/$entry.log"
  tail -n 30 "$out/$entry.log"
  [ $rc -eq 0 ] || echo "$entry" >>"$out/failed_entries.txt"
done
[ ! -s "$out/failed_entries.txt" ]
