"""The engine at the releases' dimensions on one GPU: synthetic Nemotron 3 Super / Qwen3-Next checkpoints (cut
in depth), loaded straight to the GPU, timed at batch 1 and 8 with draft_len 0 and 3 (rewind and replay).

    python3 tests/gpu/realdim.py --workdir /tmp/realdim --out $OUT/realdim.json [--family nemotron_h ...]
        [--run-eval $OUT/runs]

For each family, one at a time (the device machine's disk holds one): write the checkpoint with
``runners.tools.synth`` on the GPU into ``--workdir/<family>`` (bf16, 5 GB shards), load it with
``Engine.from_pretrained`` (the load report: seconds, weight / cache bytes, host peak RSS, device peak), check
that the logits of a prompt are finite, then for every batch size and (draft_len, ssm_replay) in (0, -),
(3, rewind), (3, replay) build an engine on the loaded model, warm it up (Triton JIT) and generate
``--new-tokens`` greedy tokens after ``--prompt-len``-token GSM8K prompts (stop tokens off): prefill and
decode tokens/s from the engine's GenerationStats, the device's peak memory, acceptance, and whether replay,
rewind and plain greedy gave the same tokens. With ``--run-eval DIR`` it then runs the evaluation command of
the issue on the same checkpoint (``python3 run.py model=<entry> model.checkpoint=<dir> runtime=gpu
eval.limit=32 verdict.require_reference=false compare=replay`` plus the ``model.arch.*`` overrides of the cut
layout; both arms: rewind and replay), and deletes the checkpoint unless ``--keep``. Writes one JSON file;
prints progress.

Defaults fit the device machine's 64 GB disk: Super V3 at a quarter of its layers (22: 10 M, 10 E, 2 *) with
256 of its 512 experts (36.8 GB; all 512 would be 67.9 GB), Qwen3-Next at a quarter (12 layers) with all
512 experts (44.1 GB). Argument errors exit with status 2 before anything is written.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.prompts import gsm8k_prompt_ids  # noqa: E402  (REPO on sys.path first)

ENTRIES = {"nemotron_h": "super_v3_mtp", "qwen3_next": "qwen3_next_mtp"}
DEFAULT_CUT = {"nemotron_h": (22, 256), "qwen3_next": (12, None)}  # (num_layers, num_experts)
ARMS = ((0, False), (3, False), (3, True))  # (draft_len, ssm_replay)


def _eval_command(family: str, ckpt: Path, overrides: list[str], run_dir: Path,
                  compute_dtype: str | None = None) -> list[str]:
    dtype = [f"runtime.dtype={compute_dtype}"] if compute_dtype else []
    return [sys.executable, "run.py", f"model={ENTRIES[family]}", f"model.checkpoint={ckpt}", "runtime=gpu",
            "eval.limit=32", "verdict.require_reference=false",
            "compare=replay", *dtype, *overrides, f"hydra.run.dir={run_dir}"]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first generated token where two greedy outputs differ; None when they are identical
    (a length difference counts as a difference at the shorter length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_family(family: str, args: argparse.Namespace) -> dict:
    import torch

    from runners.engine import Engine
    from runners.engine.options import EngineOptions
    from runners.tools.synth import DTYPES, write_synthetic_checkpoint

    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]  # the checkpoint's
    compute = DTYPES[args.compute_dtype or args.dtype]  # the engine's
    layers, experts = DEFAULT_CUT[family]
    layers = args.num_layers or layers
    experts = args.num_experts if args.num_experts is not None else experts
    ckpt = Path(args.workdir) / family
    if ckpt.exists():
        shutil.rmtree(ckpt)
    out: dict = {"family": family, "entry": ENTRIES[family], "num_layers": layers, "num_experts": experts}
    print(f"== {family}: writing {ckpt}", flush=True)
    synth = write_synthetic_checkpoint(ckpt, family, num_layers=layers, num_experts=experts,
                                       overrides=args.overrides, dtype=dtype, device=dev,
                                       shard_bytes=args.shard_bytes, log=print)
    out["synth"] = {k: v for k, v in vars(synth).items()}
    try:
        max_b = max(args.batch_sizes)
        max_seq = args.prompt_len + args.new_tokens + 8
        print(f"== {family}: loading", flush=True)
        engine = Engine.from_pretrained(ckpt, EngineOptions(dtype=compute, draft_len=3, max_batch_size=max_b,
                                                            max_seq_len=max_seq), device=dev)
        out["load"] = engine.load_report.to_dict()
        print(json.dumps(out["load"]), flush=True)
        model = engine.model
        prompts, source = gsm8k_prompt_ids(ckpt / "tokenizer.json", max_b, args.prompt_len)
        out["prompts"] = {"source": source, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        logits = engine.logits(torch.tensor(prompts[:1])[:, :64])
        out["logits_check"] = {"finite": bool(torch.isfinite(logits).all()), "std": float(logits.std()),
                               "max_abs": float(logits.abs().max())}
        del engine, logits
        runs, tokens = [], {}
        for B in args.batch_sizes:
            for K, replay in ARMS:
                eng = Engine(model, EngineOptions(dtype=compute, draft_len=K, ssm_replay=replay,
                                                  max_batch_size=B, max_seq_len=max_seq), device=dev)
                eng.generate(prompts[:B], 4, stop_token_ids=[])  # warm-up: Triton JIT, allocator
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                res = eng.generate(prompts[:B], args.new_tokens, stop_token_ids=[])
                wall = time.perf_counter() - t0
                s = res.stats
                arm = "plain" if K == 0 else ("replay" if replay else "rewind")
                run = {
                    "batch": B, "draft_len": K, "ssm_replay": replay, "arm": arm,
                    "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
                    "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
                    "steps": s.steps, "wall_seconds": wall,
                    "prefill_tokens_per_s": s.prompt_tokens / s.prefill_seconds,
                    "decode_tokens_per_s": s.generated_tokens / s.decode_seconds,
                    "acceptance_rate": s.acceptance_rate, "acceptance_length": s.acceptance_length,
                    "cache_bytes": sum(eng.cache_memory().values()),
                    "device_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                }
                runs.append(run)
                tokens[(B, arm)] = res.tokens
                print(json.dumps(run), flush=True)
                del eng, res
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        out["runs"] = runs
        def same(B: int, x: str, y: str) -> dict:
            # per request: identical greedy outputs, else the index of the first differing token
            div = [first_divergence(a, b) for a, b in zip(tokens[(B, x)], tokens[(B, y)])]
            return {"fraction_identical": sum(d is None for d in div) / B, "first_divergence": div}

        out["same_tokens"] = {
            f"batch{B}": {"replay_vs_rewind": same(B, "replay", "rewind"),
                          "rewind_vs_plain": same(B, "rewind", "plain")}
            for B in args.batch_sizes
        }
        print(json.dumps(out["same_tokens"]), flush=True)
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if args.run_eval:
            run_dir = Path(args.run_eval) / family
            eval_dtype = args.compute_dtype if args.compute_dtype != args.dtype else None
            cmd = _eval_command(family, ckpt, synth.arch_overrides, run_dir, compute_dtype=eval_dtype)
            print("== " + " ".join(cmd), flush=True)
            t0 = time.perf_counter()
            log_path = Path(args.run_eval) / f"run_{family}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "w") as log:
                rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
            out["eval"] = {"command": " ".join(cmd[1:]), "exit_code": rc, "seconds": time.perf_counter() - t0,
                           "log": str(log_path)}
            print(json.dumps(out["eval"]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="local folder for the checkpoints (one family at a time)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--family", nargs="+", default=sorted(ENTRIES), choices=sorted(ENTRIES))
    p.add_argument("--num-layers", type=int, default=None, help="default: a quarter of the release's")
    p.add_argument("--num-experts", type=int, default=None, help="default: 256 (Super V3), 512 (Qwen3-Next)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the synthetic checkpoint's dtype")
    p.add_argument("--compute-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="the engine's dtype (default: --dtype); float32 isolates the algorithms from "
                        "rounding: replay and rewind then give the same greedy tokens (run.py gets "
                        "runtime.dtype=...)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shard-size", default="5GB")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config.json field for every family (runners.tools.synth --set; CPU smoke tests)")
    p.add_argument("--run-eval", default=None, metavar="DIR",
                   help="also run the GSM8K evaluation (run.py ... compare=replay) per checkpoint into DIR")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: deleted after use)")
    args = p.parse_args(argv)
    from runners.tools.synth import _parse_set, parse_size

    try:
        args.shard_bytes = parse_size(args.shard_size)
        args.overrides = _parse_set(args.set)
    except ValueError as e:
        p.error(str(e))
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        p.error("--batch-sizes, --prompt-len and --new-tokens must be >= 1")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (this script is for the GPU machine; "
                "--device cpu with small --set sizes runs it on the CPU)")
    work = Path(args.workdir).resolve()
    if work.is_relative_to(REPO) or Path(args.out).resolve().is_relative_to(work):
        p.error(f"--workdir {args.workdir}: give a scratch folder outside the repository that does not hold "
                "--out (its checkpoints are deleted after use)")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"},
        "families": [],
    }
    from runners.tools.synth import SynthError

    status = 0
    for family in args.family:
        try:
            report["families"].append(bench_family(family, args))
        except SynthError as e:
            print(f"error: {family}: {e}", file=sys.stderr)
            report["families"].append({"family": family, "error": str(e)})
            status = 2
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
