#!/usr/bin/env bash
# GPU checks for the device machine (one H100 80 GB or H200 141 GB; Python 3.12, torch and triton of its image, no package index).
# Run from the repository root, carrying .gpu-bundle (../shared/tools/gpu-bundle.sh) and .device/gsm8k:
#
#   bash tests/gpu/run_checks.sh OUTDIR STAGE [STAGE ...]
#
# Stages:
#   kernels   every kernel test module compiled for real (CPU-interpreter tests included: they run on CUDA
#             when it is present), the GDN rules, and the engine's replay / rewind tests, whose
#             ssm_backend=triton cases run the engine on CUDA with the Triton kernels it launches (decode,
#             verify, commit, advance) against the torch backend
#   sanitize  compute-sanitizer memcheck over the GPU kernel tests, 12 tests per process (CUDA-graph tests
#             excluded: the sanitizer does not support graph capture of Triton launches well and they are
#             covered by `kernels`)
#   bench     benchmarks/bench_mamba2.py, bench_gdn.py and bench_prefill.py at the Super V3 / Qwen3-Next shapes
#   sweep     benchmarks/sweep_replay.py: every replay kernel variant vs the copy-bandwidth floor and
#             FlashInfer (its checkpointing JIT started in the background by the script), ~6 min;
#             SWEEP_ARGS adds options (SWEEP_ARGS=--quick: a ~3-4 min first look)
#   ncu       Nsight Compute of the sweep's chosen kernels (needs the sweep stage's JSON in OUTDIR/sweep);
#             NCU_ARGS adds options (NCU_ARGS=--quick: bf16 state only, ~1-2 min)
#   engine    every `gpu`-marked test of the suite (engine on CUDA, FlashInfer where importable)
#   e2e       issue 14 in about 6 minutes: the CUDA-graph tests (tests/test_engine_graphs.py, `gpu`-marked:
#             graph replay == eager bitwise in fp32 and bf16, no host sync while queuing a step), then
#             benchmarks/bench_e2e.py on quarter-depth synthetic Super V3 (bf16, graphs on: plain / rewind /
#             replay at batch 1, 8, 64 -- the speed goals) and on the tiny entries + HF generate (graphs on and
#             off at batch 1 and 64), then `python run.py runtime=gpu` over all 1319 GSM8K questions of the tiny
#             entry (goal: under 60 s); JSON + plots under OUTDIR/e2e_super_v3 and OUTDIR/e2e_tiny
#   e2e_full  bench_e2e's whole default grid (both synthetic families, graphs on and off, batch 1, 8, 64;
#             about 10 minutes) under OUTDIR/e2e_full
#   flashinfer  FlashInfer beside ours: which Mamba2 sizes its selective_state_update builds at and whether
#             it agrees with our reference there (tests/gpu/flashinfer_sizes.py), the engine's GPU tests
#             with ssm_backend=flashinfer importable, and benchmarks/bench_mamba2.py with --flashinfer (and
#             checkpointing_ssu for a bf16 state, whose minutes-long JIT is started first, in the background;
#             FLASHINFER_CKPT=float32,bfloat16 picks its state dtypes, FLASHINFER_CKPT= skips it)
#   fp8       the FP8 GPU tests (torch._scaled_mm / _scaled_grouped_mm against the dequantizing references,
#             no host sync, the FP8 tiny engine on CUDA vs the CPU) and a short benchmarks/bench_fp8.py: the
#             FP8 tiny entry through run.py (32 questions, rewind + replay) and an 8-layer, 32-expert
#             synthetic Super V3 in BF16 then FP8 (decode tokens/s of each, which FP8 GEMMs ran, a 2-question
#             run.py of the FP8 checkpoint); FP8_BENCH_ARGS replaces the bench's size arguments
#   tp        tensor parallelism, world size 2 against 1: the gpu tests of tests/test_tp.py (tiny checkpoints,
#             float32) and tests/gpu/tp_bench.py on bf16 synthetic Super V3 / Qwen3-Next at their widths
#             (quarter depth, 32 experts) computed in float32. On one GPU both ranks share it over gloo (--share-gpu): results
#             only, not NCCL speed, and eager (gloo cannot be captured); on two or more GPUs NCCL (tp_bench
#             in bf16 at batch 1, 8, 64, CUDA graphs on and off)
#   quant     issue 25: the NVFP4 / block-FP8 GEMM tests (kernels/quant, interpreter tests included: they run
#             on CUDA here) and benchmarks/bench_quant_gemm.py against BF16 at Super V3's / Qwen3-Next's shapes
#             (w8a8 and w8a16 block FP8, per-tensor FP8 w8a16 vs scaled_mm: issue 43; ~2 min; QUANT_ARGS adds
#             options, e.g. --batches 1 2 4 8 16 64); the formats end to end: bash tests/gpu/formats_run.sh OUTDIR
#   moe       issue 27: the routed-experts GEMV kernels (kernels/moe_gemv.py, and kernels/quant/moe_gemv.py for
#             NVFP4 / block-FP8 experts: GPU tests at the released expert shapes, CUDA-graph capture) and
#             benchmarks/bench_moe_gemv.py (GEMV vs the grouped-GEMM path vs the weight-read floor at batch
#             1-8, bf16, nvfp4 and block_fp8; sets runners.engine.models.moe.MOE_GEMV_MAX_PAIRS), ~3 min
#   prefix    issue 16: the prefix cache on CUDA (tests/test_prefix_cache.py, `gpu`-marked: decode / verify as
#             CUDA graphs, float32, both families, draft_len 0 / 3 rewind / 3 replay: the same tokens and
#             acceptance with and without the cache, the hits expected) and the CUDA-graph engine tests
#             (tests/test_engine_graphs.py: graph == eager bitwise, with the fresh-prefill attention); ~3 min
# Every stage writes <stage>.log (and JSON for bench) under OUTDIR; the script keeps going after a failing
# stage and exits non-zero at the end if any failed. The logs we commit live in docs/gpu/.
set -uo pipefail
stages="kernels sanitize bench sweep ncu engine e2e e2e_full flashinfer fp8 tp prefix quant moe"
usage="usage: bash tests/gpu/run_checks.sh OUTDIR STAGE [STAGE ...]  (stages: $stages)"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
out=$1; shift
for s in "$@"; do
  case " $stages " in *" $s "*) ;; *) echo "unknown stage '$s'; $usage" >&2; exit 2 ;; esac
done
source tests/gpu/env.sh
gpu_outdir "$out" || exit 2
gpu_env || exit 1
rm -f "$out/failed_stages.txt"
# every failing test's traceback as it fails (tests/conftest.py), kept when a stage is cut at its limit
export PYTEST_FAILURE_LOG=${PYTEST_FAILURE_LOG:-$out/failures.log}
stage() {  # stage NAME CMD...: run, tee to OUTDIR/NAME.log, remember failures
  local name=$1; shift
  echo "=== $name: $*" | tee "$out/$name.log"
  local t0=$SECONDS
  "$@" >>"$out/$name.log" 2>&1; local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
  tail -n 5 "$out/$name.log"
  [ $rc -eq 0 ] || echo "$name" >>"$out/failed_stages.txt"  # a file: stages may run in the background
}
sanitize_tests() {  # compute-sanitizer memcheck over the tests of "$@", SANITIZE_CHUNK (12) tests per process:
  # one process over all of them ran out of the H100's 80 GB after 18 Super V3-shape tests, PyTorch counting
  # 78 GiB allocated, with or without its caching allocator, where without the sanitizer each test ends at
  # 0.03 GiB allocated (docs/gpu/kperf_8; what keeps the memory under the sanitizer is not established)
  local rc=0 i out n=${SANITIZE_CHUNK:-12} ids=()
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "SANITIZE_CHUNK must be a positive integer, got '$n'"; return 1; }
  # a module that fails to collect fails the stage (pytest exits non-zero even when others collected)
  out=$(python3 -m pytest -q --collect-only -p no:cacheprovider -k "not graph" "$@") || {
    echo "$out"; echo "collection failed"; return 1; }
  mapfile -t ids < <(grep -E '^[^ ]+\.py::[^ ]+$' <<<"$out")
  [ ${#ids[@]} -gt 0 ] || { echo "$out"; echo "no tests collected"; return 1; }
  for ((i = 0; i < ${#ids[@]}; i += n)); do
    echo "--- tests $((i + 1))-$((i + n < ${#ids[@]} ? i + n : ${#ids[@]})) of ${#ids[@]}: ${ids[$i]} ..."
    /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider "${ids[@]:$i:$n}" || rc=1
  done
  return $rc
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
  'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$out/machine.txt" 2>&1
for s in "$@"; do
  case $s in
    kernels) stage kernels python3 -m pytest -q -p no:cacheprovider tests/test_kernels_mamba2.py \
               tests/test_kernels_mamba2_gpu.py tests/test_kernels_gdn.py tests/test_kernels_gdn_gpu.py \
               tests/test_stochastic_rounding.py tests/test_gdn.py tests/test_replay_cache.py \
               tests/test_replay_engine.py tests/test_prefill_kernels.py tests/test_prefill_kernels_gpu.py \
               tests/test_replay_cuda.py tests/test_replay_cuda_gpu.py ;;
    sanitize) stage sanitize sanitize_tests tests/test_kernels_mamba2_gpu.py tests/test_kernels_gdn_gpu.py \
               tests/test_stochastic_rounding.py tests/test_replay_cuda_gpu.py ;;
    bench) stage bench_mamba2 python3 -m benchmarks.bench_mamba2 --out "$out/bench_mamba2.json"
           stage bench_gdn_fp32 python3 -m benchmarks.bench_gdn --out "$out/bench_gdn_fp32.json"
           stage bench_gdn_bf16 python3 -m benchmarks.bench_gdn --state-dtype bf16 --out "$out/bench_gdn_bf16.json"
           stage bench_prefill python3 -m benchmarks.bench_prefill --tile-sweep --out "$out/bench_prefill.json" ;;
    # SWEEP_ARGS / NCU_ARGS: extra options, split on spaces on purpose
    sweep) stage sweep python3 -m benchmarks.sweep_replay --out "$out/sweep" ${SWEEP_ARGS-} ;;
    ncu) stage ncu python3 -m benchmarks.sweep_replay --ncu --sweep "$out/sweep/sweep_replay.json" --out "$out/ncu" \
           ${NCU_ARGS-} ;;
    moe) stage moe python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_gemv_gpu.py \
           tests/test_kernels_moe_gemv.py tests/test_moe.py tests/test_kernels_quant_moe_gemv_gpu.py \
           tests/test_kernels_quant_moe_gemv.py
         stage bench_moe_gemv python3 -m benchmarks.bench_moe_gemv --out "$out/bench_moe_gemv.json" \
           --batches 1 2 4 8 ;;
    quant) stage quant python3 -m pytest -q -p no:cacheprovider tests/test_kernels_quant_gpu.py \
             tests/test_kernels_quant.py
           # shellcheck disable=SC2086  # QUANT_ARGS is a list of arguments (e.g. --batches 1 2 4 8 16 64)
           stage bench_quant python3 -m benchmarks.bench_quant_gemm --out "$out/bench_quant_gemm.json" ${QUANT_ARGS-} ;;
    # pytest-xdist (in the device image) spreads the tests over ENGINE_WORKERS processes sharing the GPU; each
    # test reserves the memory it declares (@pytest.mark.gpu_memory, tests/gpu_memory.py) in a ledger sized
    # from the card, so the same 8 workers fit an 80 GB H100 (tests wait for room) and a 141 GB H200;
    # HYBRID_EVAL_GPU_MEM_LOG=FILE records each test's measured peak. Several workers because
    # Triton's compiles are CPU-bound (16 cores) and one process needed more than one 10-minute device call.
    # Tests are dealt one by one (--dist loadgroup: an xdist_group such as the disk-heavy format tests stays
    # in one worker, in turn), so the TP test also runs after other CUDA tests in the same
    # process: the order in which launched ranks once stalled (the launcher now spawns them:
    # runners/engine/launch.py). --durations names the slowest tests in the log.
    # -v: every test's outcome is a line as it finishes, so a run cut short by the device call's limit still
    # names its failures. ENGINE_TESTS (default: tests) narrows the stage, e.g. to split it over two calls.
    engine) stage engine python3 -m pytest -v -p no:cacheprovider -m gpu -n "${ENGINE_WORKERS:-8}" --dist loadgroup \
              --durations=25 ${ENGINE_TESTS:-tests} ;;
    e2e) stage graphs python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_engine_graphs.py
         stage e2e_super_v3 timeout 240 python3 -m benchmarks.bench_e2e --out "$out/e2e_super_v3" \
           --parts super_v3 --graphs on --batch-sizes 1 8 64 --steps 24 --time-budget-s 180
         stage e2e_tiny timeout 150 python3 -m benchmarks.bench_e2e --out "$out/e2e_tiny" --parts tiny,hf \
           --batch-sizes 1 64 --steps 32 --time-budget-s 110
         stage run_tiny_gpu timeout 150 python3 run.py runtime=gpu hydra.run.dir="$out/run_tiny_gpu" ;;
    e2e_full) stage e2e_full python3 -m benchmarks.bench_e2e --out "$out/e2e_full" --time-budget-s 540 ;;
    flashinfer)
      ckpt=${FLASHINFER_CKPT-bfloat16}  # state dtypes for checkpointing_ssu; FLASHINFER_CKPT= skips it
      warm=
      if [ -n "$ckpt" ]; then
        FLASHINFER_CKPT=$ckpt timeout 420 python3 -c 'import os, torch; from benchmarks.bench_mamba2 import \
bench_flashinfer as b; [print(b(2, 4, getattr(torch, d), checkpointing=True)) for d in \
os.environ["FLASHINFER_CKPT"].split(",")]' >"$out/flashinfer_warm.log" 2>&1 &
        warm=$!
      fi
      stage flashinfer_sizes python3 tests/gpu/flashinfer_sizes.py --out "$out/flashinfer_sizes.json"
      stage engine_flashinfer python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_replay_engine.py \
        tests/test_flashinfer_replay_gpu.py
      [ -z "$warm" ] || wait $warm
      stage bench_mamba2_flashinfer python3 -m benchmarks.bench_mamba2 --flashinfer --flashinfer-checkpointing \
        "$ckpt" --out "$out/bench_mamba2_flashinfer.json" ;;
    fp8) stage fp8_tests python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_fp8.py
         # shellcheck disable=SC2086  # FP8_BENCH_ARGS is a list of arguments
         stage bench_fp8 python3 -m benchmarks.bench_fp8 --workdir /tmp/bench_fp8 --out "$out/bench_fp8.json" \
           --runs "$out/bench_fp8_runs" ${FP8_BENCH_ARGS:---tiny-limit 32 --num-layers 8 --num-experts 32 \
           --batch-sizes 1 16 --prompt-len 256 --new-tokens 32 --eval-limit 2 --max-gen-toks 32} ;;
    prefix) stage prefix_tests python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_prefix_cache.py \
              tests/test_engine_graphs.py ;;
    tp) stage tp_tests python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/test_tp.py
        if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
          stage tp_bench python3 tests/gpu/tp_bench.py --workdir /tmp/tp_bench --out "$out/tp_bench.json" \
            --batch 1 8 64 --graphs on off
        else
          stage tp_bench_shared python3 tests/gpu/tp_bench.py --share-gpu --compute-dtype float32 --num-experts 32 \
            --batch 4 --graphs off --prompt-len 128 --new-tokens 16 --time-budget 120 --workdir /tmp/tp_bench \
            --out "$out/tp_bench_shared.json"
        fi ;;
  esac
done
[ ! -s "$out/failed_stages.txt" ] || { echo "failed stages: $(tr '\n' ' ' <"$out/failed_stages.txt")"; exit 1; }
