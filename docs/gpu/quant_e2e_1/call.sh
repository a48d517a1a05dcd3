#!/bin/bash
# Issue 43 on an H100: bench_e2e on the release formats at half depth (Super V3 NVFP4 44 of 88 layers, Qwen3-Next
# block FP8 24 of 48; dummy weights, all 512 experts, CUDA graphs, forced acceptance length 3.0), plain and MTP +
# replay at batch 1 and 64 (rewind too with REWIND=1), with floors and kernel counts: issue 43's step / floor
# goals (bench_e2e TARGETS "release_step_over_floor") at the depth an 80 GB card holds. Either card; carry
# .gpu-bundle (or run after a call that did, on the same warm machine).
#   bash docs/gpu/quant_e2e_1/call.sh OUT            about 170 s on an H100 (run1, run2)
#   FULL_LAYERS="0 0" bash docs/gpu/quant_e2e_1/call.sh OUT      full depth (an H200: needs_h200), where issue
#        43's tokens/s goals are evaluated too
#   E2E_EXTRA="--kernel-setting kernels.quant.pair_cuda.PAIR_FORM=persistent ..." adds bench_e2e options (session
#        32's persistent forms: docs/gpu/persistent_1)
set -u
OUT=${1:?OUT}
t0=$SECONDS
source tests/gpu/env.sh
gpu_env >/dev/null 2>&1 || { echo "gpu_env failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
arms="plain replay"; [ "${REWIND:-0}" = 1 ] && arms="plain rewind replay"
timeout ${E2E_TIMEOUT:-540} python3 -u -m benchmarks.bench_e2e --out $OUT/e2e --parts ${PARTS:-super_v3_nvfp4,qwen3_next_fp8} \
  --full-layers ${FULL_LAYERS:-44 24} --graphs on --compile off --batch-sizes ${BATCHES:-1 64} --arms $arms --accept-length 3.0 \
  --steps 16 --time-budget-s ${E2E_BUDGET_S:-480} ${E2E_EXTRA:-} >$OUT/e2e.log 2>&1
echo "bench_e2e rc=$? at $((SECONDS-t0)) s"
grep -E "^== |error|Error" $OUT/e2e.log | cut -c1-240 | tail -20
python3 - $OUT/e2e/bench_e2e.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, i in d["models"].items(): print(m, i.get("depth"), i.get("weight_bytes"), round(i.get("build_seconds", 0), 1))
for r in d["rows"]:
    print(r.get("model"), r.get("arm"), r.get("batch"), r.get("step_ms") and round(r["step_ms"], 3),
          r.get("floor_ms") and round(r["floor_ms"], 3), r.get("kernels_per_step"),
          r.get("decode_tokens_per_s") and round(r["decode_tokens_per_s"], 1), r.get("error", "")[:200], r.get("skipped", ""))
print(json.dumps({k: v for k, v in d["targets"].items() if "step_over_floor" in k}, indent=0))
PY
