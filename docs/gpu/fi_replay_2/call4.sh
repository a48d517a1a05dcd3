#!/bin/bash
# Issue 45, call 4 (after call 3 on the same warm machine): bench_e2e as call 2, with the table call 3 wrote
# (left in .device/replay_defaults.sweep.json) as the engine's defaults, so the "replay" arm runs the backend
# and configurations that sweep chose. Carry as call 1.
set -u
OUT=${1:?OUT}
cp .device/replay_defaults.sweep.json kernels/replay_defaults.json || exit 1
python3 -c "import json; print(json.load(open('kernels/replay_defaults.json'))['backends'])"
bash docs/gpu/fi_replay_2/call2.sh "$OUT"
