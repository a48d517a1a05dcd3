#!/usr/bin/env bash
# Issue 25's done-criterion on the device machine (one H200, 64 GB disk, ~8 minutes): for each release format,
# write a quarter-depth synthetic checkpoint in that exact format (released widths and expert counts, random
# weights: runners.tools.synth --format) and run it end to end through run.py with MTP drafting and SSM replay:
#
#   bash tests/gpu/formats_run.sh OUTDIR [FORMAT ...]     (formats: fp8 nvfp4 block_fp8; default all three)
#
#   fp8        Nemotron 3 Super FP8 (ModelOpt FP8, MTP / attention / latent projections BF16), entry
#              super_v3_mtp_fp8, 22 of 88 layers (~31 GB)
#   nvfp4      Nemotron 3 Super NVFP4 (ModelOpt MIXED_PRECISION, run W4A16), entry super_v3_mtp_nvfp4,
#              22 of 88 layers (~19 GB)
#   block_fp8  Qwen3-Next-80B-A3B-Instruct-FP8 (128 x 128 blocks), entry qwen3_next_mtp_fp8, 12 of 48 layers
#              (~21 GB)
#
# FORMATS_LAYERS=N writes N layers instead (issue 26's file-load path at the largest depth the 64 GB disk
# holds: FORMATS_LAYERS=44 bash tests/gpu/formats_run.sh OUTDIR nvfp4 writes half of Super V3, ~38 GB, and
# its summary's load line gives the read seconds, GB/s and the device and host peaks).
# One checkpoint at a time under WORK (default /tmp/formats), deleted after its run, so the disk holds at most
# one (< 32 GB). Per format: synth_<fmt>.log (the writer's log and the model.arch.* overrides the cut needs),
# run_<fmt>.log (run.py's output) and run_<fmt>/ (its results.json, summary.md) under OUTDIR. Each run is
#   python run.py model=<entry> model.checkpoint=<dir> runtime=gpu ssm_replay=true eval.limit=32 \
#       verdict.require_reference=false <model.arch.* overrides of the cut>
# with GSM8K from $GSM8K_DIR (default .device/gsm8k, as tests/gpu/run_checks.sh). Random weights answer
# nothing correctly: what the runs show is that each format loads (which GEMMs ran: results.json
# config.fp8_gemms) and generates through MTP + replay on the GPU (run.py's exit status 1, a verdict health
# check failing on random text, counts as a completed run). The script keeps going after a failing format and
# exits non-zero at the end if any failed.
set -uo pipefail
out=${1:?usage: bash tests/gpu/formats_run.sh OUTDIR [fp8 nvfp4 block_fp8]}
shift
formats=${*:-fp8 nvfp4 block_fp8}
work=${WORK:-/tmp/formats}
source tests/gpu/env.sh
gpu_outdir "$out" || exit 2
gpu_env || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; df -h /tmp; python3 -c \
  'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$out/machine.txt" 2>&1
failed=()
for fmt in $formats; do
  case $fmt in
    fp8) family=nemotron_h; layers=${FORMATS_LAYERS:-22}; entry=super_v3_mtp_fp8 ;;
    nvfp4) family=nemotron_h; layers=${FORMATS_LAYERS:-22}; entry=super_v3_mtp_nvfp4 ;;
    block_fp8) family=qwen3_next; layers=${FORMATS_LAYERS:-12}; entry=qwen3_next_mtp_fp8 ;;
    *) echo "unknown format '$fmt' (fp8 nvfp4 block_fp8)" >&2; exit 2 ;;
  esac
  ckpt=$work/$fmt
  rm -rf "$work"
  t0=$SECONDS
  echo "=== synth $fmt: $family, $layers layers -> $ckpt" | tee "$out/synth_$fmt.log"
  timeout 300 python3 -m runners.tools.synth --family "$family" --format "$fmt" --num-layers "$layers" \
    --device cuda --out "$ckpt" >>"$out/synth_$fmt.log" 2>&1
  rc=$?
  echo "=== synth $fmt: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/synth_$fmt.log"
  if [ $rc -ne 0 ]; then tail -n 5 "$out/synth_$fmt.log"; failed+=("synth_$fmt"); continue; fi
  du -sh "$ckpt" >>"$out/synth_$fmt.log"
  # the model.arch.* overrides a registry entry of the release needs for the cut checkpoint (synth.json)
  mapfile -t arch < <(python3 -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["arch_overrides"]))' \
    "$ckpt/synth.json")
  t0=$SECONDS
  cmd=(python3 run.py "model=$entry" "model.checkpoint=$ckpt" runtime=gpu ssm_replay=true eval.limit=32
       verdict.require_reference=false "hydra.run.dir=$out/run_$fmt" "${arch[@]}")
  echo "=== run $fmt: ${cmd[*]}" | tee "$out/run_$fmt.log"
  timeout 420 "${cmd[@]}" >>"$out/run_$fmt.log" 2>&1
  rc=$?
  echo "=== run $fmt: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/run_$fmt.log"
  tail -n 8 "$out/run_$fmt.log"
  # exit 1 is a failed verdict check: random weights may fail the health checks (repeated tokens, no
  # answers) after a complete run; anything else (2: refused, 124: timeout, a crash) is a failure
  [ $rc -le 1 ] && [ -f "$out/run_$fmt/results.json" ] || failed+=("run_$fmt")
  rm -rf "$work"
done
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
