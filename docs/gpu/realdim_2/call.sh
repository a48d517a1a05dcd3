#!/usr/bin/env bash
# Device call 2: the gpu-marked engine tests (fused MoE, real-dimension engine, replay engine, GDN, train) and,
# beside them on the same GPU, the float32 real-dimension runs (replay == rewind token for token).
set -u
W=$OUT/w; mkdir -p $W
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-bundle/*.whl && tar xzf .gpu-bundle/flashinfer-trimmed.tgz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
tar xzf .device/gsm8k.tgz -C .device && export GSM8K_DIR=$PWD/.device/gsm8k
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > $W/machine.txt
echo "setup done at $((SECONDS-T0)) s"
( timeout 420 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_moe.py tests/test_realdim_engine.py tests/test_replay_engine.py tests/test_gdn.py tests/test_train.py > $W/engine_gpu.log 2>&1; echo "engine tests rc=$? at $((SECONDS-T0)) s" >> $W/engine_gpu.log ) &
( R="python3 tests/gpu/realdim.py --workdir /tmp/realdim --compute-dtype float32 --batch-sizes 1 --new-tokens 64 --run-eval $W/runs"; timeout 545 bash -c "$R --out $W/realdim_fp32_qwen3_next.json --family qwen3_next --num-experts 256 && $R --out $W/realdim_fp32_nemotron_h.json --family nemotron_h --num-experts 128" > $W/realdim_fp32.log 2>&1; echo "realdim rc=$? at $((SECONDS-T0)) s" >> $W/realdim_fp32.log ) &
while [ -n "$(jobs -r)" ]; do sleep 30; echo "t=$((SECONDS-T0)) s: $(tail -c 300 $W/realdim_fp32.log | tail -1 | cut -c1-150) | $(tail -1 $W/engine_gpu.log | cut -c1-120)"; done
wait
tail -25 $W/realdim_fp32.log; tail -25 $W/engine_gpu.log
find $W/runs -name "*.png" -delete 2>/dev/null
tar czf $OUT/call2.tgz -C $OUT w && rm -rf $W
echo "end at $((SECONDS-T0)) s"
