"""FP8 on the GPU, end to end: the shipped FP8 tiny entry through run.py, and a quarter-depth synthetic Nemotron 3
Super in BF16 and in FP8 (quantized from it by runners.tools.quantize), decode tokens/s of each, then the FP8
checkpoint through run.py.

    python3 -m benchmarks.bench_fp8 --workdir /tmp/fp8 --out $OUT/bench_fp8.json [--stages tiny super]

Stages (in this order; each writes its part of the JSON as it ends):

- ``tiny``: ``python3 run.py model=tiny_nemotron_h_mtp_fp8 runtime=gpu eval.limit=<--tiny-limit>
  compare=replay`` (FP8 weights and KV cache, rewind and replay arms) into ``<--runs>/tiny_fp8``; its verdict.
- ``super``: ``runners.tools.synth`` writes Super V3 cut to ``--num-layers`` layers (default 22: a quarter) with
  ``--num-experts`` routed experts (default 256; 36.8 GB in bf16) into ``--workdir/bf16`` on the GPU; the BF16
  engine loads it (load report) and decodes ``--new-tokens`` greedy tokens after ``--prompt-len``-token GSM8K
  prompts at each ``--batch-sizes`` with draft_len 0 and 3 (warm-up first; tokens/s from the engine's
  GenerationStats); ``runners.tools.quantize --fp8`` writes ``--workdir/fp8`` (calibration on the GPU with
  ``--calib-samples`` prompts); the BF16 checkpoint is deleted; the FP8 engine (FP8 KV cache) is measured the
  same way, with ``model.quant_report`` (which FP8 GEMMs ran: torch._scaled_mm per linear layer, the MoE's
  grouped FP8 GEMM or its dequantizing fallback); then ``run.py model=super_v3_mtp_fp8`` on the FP8
  checkpoint with the cut layout's ``model.arch.*`` overrides, ``eval.limit=<--eval-limit>``, no GSM8K
  reference (random weights: accuracy 0 and no accepted drafts, so super_v3's fp8 acceptance floor fails the
  run, exit 1: the stage shows that the pipeline runs, not a score).

The JSON has, per stage, the commands, exit codes, seconds, and for ``super`` the BF16 and FP8 runs side by side
(``decode_tokens_per_s``, ``prefill_tokens_per_s``, acceptance, weight / KV-cache bytes, device peak) and
``fp8_over_bf16`` (decode tokens/s ratios). The GPU machine's disk (64 GB) holds the BF16 and FP8 checkpoints
together at the default cut (37 + 19 GB); the script checks the free space before it writes each.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.prompts import gsm8k_prompt_ids  # noqa: E402  (REPO on sys.path first)

FP8_TINY_ENTRY, FP8_SUPER_ENTRY = "tiny_nemotron_h_mtp_fp8", "super_v3_mtp_fp8"
STAGES = ("tiny", "super")


def _run(cmd: list[str], log_path: Path) -> dict:
    """Run a command from the repository root into a log; returns command, exit code, seconds, log path."""
    print("== " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    out = {"command": " ".join(cmd[1:]), "exit_code": rc, "seconds": round(time.perf_counter() - t0, 1),
           "log": str(log_path)}
    print(json.dumps(out), flush=True)
    print("".join(log_path.read_text().splitlines(keepends=True)[-12:]), flush=True)
    return out


def _verdict(results_json: Path) -> dict | None:
    if not results_json.is_file():
        return None
    r = json.loads(results_json.read_text())
    acc = r.get("acceptance") or {}
    cmp = r.get("comparison") or {}
    return {"gsm8k": r.get("gsm8k"), "acceptance_rate": acc.get("rate"), "acceptance_length": acc.get("length"),
            "verdict": (r.get("verdict") or {}).get("status"), "memory": r.get("memory"),
            "decode_tokens_per_s": (r.get("timings") or {}).get("decode_tokens_per_s"),
            "comparison_checks": [(c.get("name"), c.get("status")) for c in cmp.get("checks", [])]}


def _runtime(args: argparse.Namespace) -> str:
    return "gpu" if args.device.startswith("cuda") else "cpu"


def stage_tiny(args: argparse.Namespace) -> dict:
    run_dir = Path(args.runs) / "tiny_fp8"
    cmd = [sys.executable, "run.py", f"model={FP8_TINY_ENTRY}", f"runtime={_runtime(args)}",
           f"eval.limit={args.tiny_limit}", "compare=replay", f"hydra.run.dir={run_dir}"]
    out = _run(cmd, Path(args.runs) / "run_tiny_fp8.log")
    out["results"] = _verdict(run_dir / "results.json")
    return out


def _measure(engine_path: Path, label: str, args, prompts, *, kv_cache_quant: str) -> dict:
    """Load ``engine_path`` on the device and time greedy decoding at each batch size, draft_len 0 and 3."""
    import torch

    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    max_b = max(args.batch_sizes)
    max_seq = args.prompt_len + args.new_tokens + 8
    print(f"== {label}: loading {engine_path}", flush=True)
    engine = Engine.from_pretrained(engine_path, EngineOptions(dtype=dtype, draft_len=3, max_batch_size=max_b,
                                                               max_seq_len=max_seq, kv_cache_quant=kv_cache_quant), device=dev)
    out = {"load": engine.load_report.to_dict(), "quant_report": getattr(engine.model, "quant_report", None)}
    print(json.dumps(out), flush=True)
    model = engine.model
    del engine
    runs = []
    for B in args.batch_sizes:
        for K in (0, 3):
            eng = Engine(model, EngineOptions(dtype=dtype, draft_len=K, max_batch_size=B, max_seq_len=max_seq,
                                              kv_cache_quant=kv_cache_quant), device=dev)
            eng.generate(prompts[:B], 4, stop_token_ids=[])  # warm-up: Triton JIT, cuBLASLt plans, allocator
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            res = eng.generate(prompts[:B], args.new_tokens, stop_token_ids=[])
            s = res.stats
            run = {"batch": B, "draft_len": K, "generated_tokens": s.generated_tokens,
                   "decode_seconds": s.decode_seconds, "prefill_seconds": s.prefill_seconds,
                   "decode_tokens_per_s": s.generated_tokens / s.decode_seconds,
                   "prefill_tokens_per_s": s.prompt_tokens / s.prefill_seconds,
                   "acceptance_rate": s.acceptance_rate, "acceptance_length": s.acceptance_length,
                   "cache_memory": eng.cache_memory(),
                   "device_peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
                   "tokens": res.tokens[0][:16]}
            runs.append(run)
            print(f"{label} " + json.dumps({k: v for k, v in run.items() if k != "cache_memory"}), flush=True)
            del eng, res
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    out["runs"] = runs
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _need_disk(path: Path, nbytes: int, what: str) -> None:
    free = shutil.disk_usage(path).free
    if free < nbytes * 1.05:
        raise SystemExit(f"error: {what} needs {nbytes / 1e9:.1f} GB but {path} has {free / 1e9:.1f} GB free; "
                         "lower --num-experts / --num-layers")


def stage_super(args: argparse.Namespace) -> dict:
    import torch

    from runners.tools.quantize import quantize_fp8_checkpoint
    from runners.tools.synth import synth_config, tensor_specs, write_synthetic_checkpoint


    work = Path(args.workdir)
    bf16, fp8 = work / "bf16", work / "fp8"
    for d in (bf16, fp8):
        shutil.rmtree(d, ignore_errors=True)
    out: dict = {"num_layers": args.num_layers, "num_experts": args.num_experts}
    config = synth_config("nemotron_h", num_layers=args.num_layers, num_experts=args.num_experts,
                          overrides=args.overrides)
    size = sum(s.nbytes for s in tensor_specs(config, torch.bfloat16))
    _need_disk(work, size, "the BF16 checkpoint")
    t0 = time.perf_counter()
    synth = write_synthetic_checkpoint(bf16, "nemotron_h", num_layers=args.num_layers,
                                       num_experts=args.num_experts, overrides=args.overrides,
                                       device=args.device, log=print)
    out["synth"] = {"total_bytes": synth.total_bytes, "seconds": round(time.perf_counter() - t0, 1),
                    "arch_overrides": synth.arch_overrides}
    prompts, source = gsm8k_prompt_ids(bf16 / "tokenizer.json", max(args.batch_sizes), args.prompt_len)
    out["prompts"] = {"source": source, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    try:
        out["bf16"] = _measure(bf16, "bf16", args, prompts, kv_cache_quant="none")
        _need_disk(work, size // 2, "the FP8 checkpoint")
        t0 = time.perf_counter()
        out["quantize"] = quantize_fp8_checkpoint(
            bf16, fp8, calib_samples=args.calib_samples, calib_tokens=args.calib_tokens, device=args.device,
            data_dir=args.data_dir)
        out["quantize"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        shutil.rmtree(bf16, ignore_errors=True)
    try:
        out["fp8"] = _measure(fp8, "fp8", args, prompts, kv_cache_quant="fp8")
        ratio = {}
        for a, b in zip(out["bf16"]["runs"], out["fp8"]["runs"]):
            ratio[f"batch{a['batch']}_k{a['draft_len']}"] = b["decode_tokens_per_s"] / a["decode_tokens_per_s"]
        out["fp8_over_bf16_decode"] = ratio
        print("fp8 / bf16 decode tokens/s: " + json.dumps(ratio), flush=True)
        if args.eval_limit > 0:
            run_dir = Path(args.runs) / "super_fp8"
            cmd = [sys.executable, "run.py", f"model={FP8_SUPER_ENTRY}", f"model.checkpoint={fp8}",
                   f"runtime={_runtime(args)}", "model.cuda_graph_batch_sizes=[]", f"eval.limit={args.eval_limit}",
                   f"eval.max_gen_toks={args.max_gen_toks}", "verdict.require_reference=false",
                   *synth.arch_overrides, f"hydra.run.dir={run_dir}"]
            out["eval"] = _run(cmd, Path(args.runs) / "run_super_fp8.log")
            out["eval"]["results"] = _verdict(run_dir / "results.json")
    finally:
        if not args.keep:
            shutil.rmtree(fp8, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="scratch folder outside the repository (checkpoints)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--runs", default=None, help="folder for the run.py outputs and logs (default: beside --out)")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--tiny-limit", type=int, default=64, help="GSM8K questions of the tiny FP8 run")
    p.add_argument("--num-layers", type=int, default=22)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-tokens", type=int, default=8)
    p.add_argument("--eval-limit", type=int, default=8, help="GSM8K questions of the FP8 Super run (0: none)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="eval.max_gen_toks of the FP8 Super run")
    p.add_argument("--data-dir", default=None, help="GSM8K folder (default: $GSM8K_DIR, ../shared/data/gsm8k)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu runs the same steps at small "
                   "--set sizes (the CPU test of this script)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config.json field of the synthetic checkpoint (runners.tools.synth --set)")
    p.add_argument("--keep", action="store_true", help="keep the FP8 checkpoint")
    args = p.parse_args(argv)
    from runners.tools.synth import _parse_set

    try:
        args.overrides = _parse_set(args.set)
    except ValueError as e:
        p.error(str(e))
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        p.error("--batch-sizes, --prompt-len and --new-tokens must be >= 1")
    work = Path(args.workdir).resolve()
    if work.is_relative_to(REPO):
        p.error(f"--workdir {args.workdir}: give a scratch folder outside the repository")
    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (this benchmark is for the GPU machine; "
                "--device cpu with small --set sizes runs it on the CPU)")
    work.mkdir(parents=True, exist_ok=True)
    args.runs = args.runs or str(Path(args.out).resolve().parent / "bench_fp8_runs")
    report = {"command": " ".join(["python3 -m benchmarks.bench_fp8", *(argv or sys.argv[1:])]),
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                          "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
                          "scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm")}}
    for stage in args.stages:
        t0 = time.perf_counter()
        report[stage] = stage_tiny(args) if stage == "tiny" else stage_super(args)
        report[stage]["stage_seconds"] = round(time.perf_counter() - t0, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
