#!/bin/bash
# Session 14 call J (issue 26): Qwen3-Next FP8 at full depth with dummy weights, MTP + replay forced to acceptance
# length 3.0 (decode rate, full-GSM8K projection); then bench_e2e at full depth, batch 1, rewind and replay, for
# the index where the arms' tokens part (targets ..._replay_rewind_first_divergence).
set -u
OUT=${1:?OUT}
t0=$SECONDS
FULLDEPTH_TIMEOUT=260 FULLDEPTH_ARGS="runtime.forced_acceptance_length=3.0" \
  bash tests/gpu/fulldepth_run.sh $OUT/full_forced qwen3_next_mtp_fp8 > $OUT/full_forced_qwen.out 2>&1
echo "fulldepth rc=$? at $((SECONDS-t0)) s"; tail -28 $OUT/full_forced_qwen.out | cut -c1-250
(cd $OUT && tar czf full_forced.tgz --exclude='*.jsonl' full_forced && rm -rf full_forced)
source tests/gpu/env.sh; gpu_env >/dev/null 2>&1 || exit 1
left=$(( 580 - (SECONDS - t0) ))
timeout $left python3 -u -m benchmarks.bench_e2e --out $OUT/e2e_div --parts qwen3_next_fp8,super_v3_nvfp4 --graphs on \
  --compile off --batch-sizes 1 --arms rewind replay --accept-length 3.0 --steps 24 --time-budget-s $(( left - 25 )) \
  > $OUT/e2e_div.log 2>&1
echo "div rc=$? at $((SECONDS-t0)) s"; grep -E "decode_tokens_per_s|first_divergence" $OUT/e2e_div.log | tail -8 | cut -c1-300
python3 -c "import json,sys; d=json.load(open('$OUT/e2e_div/bench_e2e.json')); print({k:v for k,v in d.get('targets',{}).items() if 'diverg' in k or 'same' in k})" 2>&1 | cut -c1-600
