#!/bin/bash
# Session 14 call I (issue 26): the file-load path at half depth (Super V3 NVFP4, 44 of 88 layers, written in the
# release format on the GPU, loaded by run.py), then the mission's command at full depth with dummy weights and
# MTP + replay forced to acceptance length 3.0 (decode rate and full-GSM8K projection of a speculative run).
set -u
OUT=${1:?OUT}
t0=$SECONDS
FORMATS_LAYERS=44 timeout 330 bash tests/gpu/formats_run.sh $OUT/formats_half nvfp4 > $OUT/formats_half.out 2>&1
echo "formats rc=$? at $((SECONDS-t0)) s"; tail -12 $OUT/formats_half.out | cut -c1-250
left=$(( 585 - (SECONDS - t0) ))
FULLDEPTH_TIMEOUT=$(( left - 10 )) FULLDEPTH_ARGS="runtime.forced_acceptance_length=3.0" \
  bash tests/gpu/fulldepth_run.sh $OUT/full_forced super_v3_mtp_nvfp4 > $OUT/full_forced.out 2>&1
echo "fulldepth rc=$? at $((SECONDS-t0)) s"; tail -30 $OUT/full_forced.out | cut -c1-250
