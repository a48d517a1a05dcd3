#!/bin/bash
# First call on a fresh H200 (carry .gpu-bundle and .device/flashinfer-aot.tgz, so that the next calls carry
# only FlashInfer): the bf16 decode projections on this card (docs/gpu/dense_gemv_1/call.sh, ~40 s). Then, on
# the same warm machine: docs/gpu/fi_replay_2/call3.sh (the sweep; carry .device/flashinfer-trimmed.tgz),
# docs/gpu/fi_replay_4/call_full.sh (bench_e2e at quarter and full depth with the sweep's table), and
# callB.sh (the FlashInfer GPU tests) as the budget allows.
#   bash docs/gpu/fi_replay_5/callH0.sh OUT
set -u
bash docs/gpu/dense_gemv_1/call.sh "${1:?OUT}"
