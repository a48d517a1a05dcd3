"""Tensor parallelism at the releases' dimensions: world size 2 (NCCL, two GPUs) against world size 1 on
synthetic Nemotron 3 Super and Qwen3-Next checkpoints cut to a quarter of their depth.

    python3 tests/gpu/tp_bench.py --workdir /tmp/tp --out $OUT/tp_bench.json [--family nemotron_h ...]
        [--world-sizes 1 2] [--num-experts 128] [--batch 16 ...] [--graphs on off] [--prompt-len 256]
        [--new-tokens 64] [--time-budget 330] [--share-gpu] [--dtype bfloat16] [--compute-dtype float32]

For each family, one at a time: write the checkpoint with ``runners.tools.synth`` on GPU 0 (bf16, 5 GB
shards; a
quarter of the layers, ``--num-experts`` routed experts), then for each world size run one
``runners.engine.launch.launch`` (world size 1 is one rank on cuda:0; world size 2 two ranks with NCCL, each
loading
and reading only its shard, ``runners.engine.tp``). The ranks load the model once and build an engine per
arm on it
(``runners.engine.launch.build_engine`` / ``rebuild_engine``) -- plain greedy (draft_len 0), MTP draft_len 3
with
rewind, MTP draft_len 3 with replay --, for each ``--graphs`` mode (on: the decode step replayed as CUDA
graphs, captured ahead at the batch size, with the NCCL all-reduces inside them; off: eager) and each
``--batch`` size; each is warmed up (Triton JIT) and generates ``--new-tokens`` greedy tokens (stop tokens
off) for that many prompts of ``--prompt-len`` GSM8K-text ids. No overlap_steps (engines under
``runners.engine.launch`` do not use it). A run's key in the JSON is ``<arm>/b<batch>/graphs_<on|off>``;
with ``--share-gpu`` graphs stay off (gloo's all-reduces cannot be captured) and each run records why
(``cuda_graphs_off_reason``).
Reported per world size and run: load report, decode tokens/s (total and per GPU), prefill tokens/s,
acceptance, device peak, the graphs captured; and the comparisons: world size 2 against 1 (requests with
identical tokens, the mean fraction of each request's tokens before the first difference, the last-position
logits of two prompts: max |difference| and top-1 agreement), replay against rewind and plain, and graphs
on against off, within each world size; ``speedup`` lists decode tokens/s ratios (graphs on / off; world
size 2 / 1). In bf16 the ranks'
partial sums round differently from one GPU's matmul, so random-weight models (flat logits, near ties) may
drift apart after a while: the fractions say how far they agree. The JSON is rewritten after every step
(partial results survive a timeout); progress lines are flushed as they happen. ``--time-budget`` seconds:
families that would start after it are skipped (reported as such).

``--share-gpu`` runs every rank on cuda:0 with gloo (``runners.engine.launch.launch(share_device=True)``)
for a
machine with one GPU: it checks world size 2's tokens, acceptance and logits against world size 1 at the
releases' dimensions, but its tokens/s measure nothing about NCCL tensor parallelism (two ranks on one GPU,
each all-reduce through host memory); the JSON says so ("backend"). Each rank budgets 1 / world size of the
GPU's free memory (``runners.engine.tp.TensorParallel.ranks_per_device``).

Defaults (bf16, NCCL) fit the two-GPU machine (128 GB disk) and a few minutes: Super V3 at 22 of its 88 layers
with 128 of its 512 experts (21.3 GB), Qwen3-Next at 12 of 48 layers with 128 experts (12.6 GB). Not run on
two GPUs yet (only one-GPU machines were lent so far). Argument errors exit with status 2 before anything is
written. NVLink multicast stays off in the ranks (runners.engine.launch).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

DEFAULT_LAYERS = {"nemotron_h": 22, "qwen3_next": 12}
ARMS = ((0, False), (3, False), (3, True))  # (draft_len, ssm_replay)
GRAPH_MODES = {"on": True, "off": False}


def _arm_name(draft_len: int, replay: bool) -> str:
    return "plain" if draft_len == 0 else ("replay" if replay else "rewind")


def _run_key(arm: str, batch: int, graphs: str) -> str:
    return f"{arm}/b{batch}/graphs_{graphs}"


def bench_rank0(ckpt: str, prompts: list[list[int]], opts: dict) -> dict:
    """Rank 0 of a launch: for every graph mode, batch size and arm, the engine (built on every rank),
    its graphs captured ahead (graphs on), warm-up, timed generate."""
    import torch

    from runners.engine.launch import build_engine, current, rebuild_engine
    from runners.engine.options import EngineOptions

    ctx = current()
    dtype = getattr(torch, opts["dtype"])
    cuda = ctx.device.type == "cuda"
    out: dict = {"world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device), "arms": {}}
    eng = None
    max_seq_len = opts["prompt_len"] + opts["new_tokens"] + 8
    for graphs in opts["graphs"]:
        for batch in opts["batches"]:
            for draft_len, replay in ARMS:
                arm = _arm_name(draft_len, replay)
                t0 = time.perf_counter()
                options = EngineOptions(dtype=dtype, draft_len=draft_len, ssm_replay=replay,
                                        max_batch_size=batch, max_seq_len=max_seq_len,
                                        cuda_graphs=GRAPH_MODES[graphs], cuda_graph_batch_sizes=(batch,))
                if eng is None:  # the first run loads the model (MTP included); the others reuse it
                    eng = build_engine(ckpt, options)
                    out["load"] = eng.load_report.to_dict()
                    ids = torch.tensor([p[:64] for p in prompts[:2]])
                    out["logits"] = eng.logits(ids)[:, -1].float().cpu()
                else:
                    eng = rebuild_engine(eng, options)
                load_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                captured = eng.capture_graphs(max_kv_len=max_seq_len)  # every rank, ahead of the timing
                capture_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                eng.generate(prompts[:batch], 4, stop_token_ids=[])  # warm-up: Triton JIT, allocator
                warm_s = time.perf_counter() - t0
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                t0 = time.perf_counter()
                res = eng.generate(prompts[:batch], opts["new_tokens"], stop_token_ids=[])
                wall = time.perf_counter() - t0
                s = res.stats
                decode_tps = s.generated_tokens / s.decode_seconds
                run = {
                    "arm": arm, "draft_len": draft_len, "ssm_replay": replay, "batch": batch,
                    "graphs": graphs, "cuda_graphs": eng.step.cuda_graphs,
                    "cuda_graphs_off_reason": eng.cuda_graphs_off_reason,
                    "graphs_captured": sorted(k for k, g in eng.graphs.graphs.items() if g is not None),
                    "graphs_captured_ahead": captured, "capture_seconds": capture_s,
                    "engine_build_seconds": load_s, "warmup_seconds": warm_s, "wall_seconds": wall,
                    "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
                    "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
                    "steps": s.steps,
                    "prefill_tokens_per_s": s.prompt_tokens / s.prefill_seconds,
                    "decode_tokens_per_s": decode_tps,
                    "decode_tokens_per_s_per_gpu": decode_tps / ctx.world_size,
                    "acceptance_rate": s.acceptance_rate, "acceptance_length": s.acceptance_length,
                    "cache_bytes_per_rank": sum(eng.cache_memory().values()),
                    "device_peak_bytes_rank0": torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
                    "tokens": res.tokens,
                }
                print(json.dumps({k: v for k, v in run.items() if k != "tokens"}), flush=True)
                out["arms"][_run_key(arm, batch, graphs)] = run
                del res
    return out


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests with identical tokens, and the mean fraction of a request's tokens before the first
    difference."""
    def prefix(x, y):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        return n / max(len(x), 1)
    return {"identical_requests": sum(x == y for x, y in zip(a, b)) / len(a),
            "mean_prefix_fraction": sum(prefix(x, y) for x, y in zip(a, b)) / len(a)}


def bench_family(family: str, args: argparse.Namespace, report: dict, save) -> dict:
    import torch

    from benchmarks.prompts import gsm8k_prompt_ids
    from runners.engine.launch import launch
    from runners.tools.synth import DTYPES, write_synthetic_checkpoint

    layers = args.num_layers or DEFAULT_LAYERS[family]
    ckpt = Path(args.workdir) / family
    if ckpt.exists():
        shutil.rmtree(ckpt)
    out: dict = {"family": family, "num_layers": layers, "num_experts": args.num_experts, "runs": {}}
    report["families"].append(out)
    print(f"== {family}: writing {ckpt} ({time.perf_counter() - args.t0:.0f} s)", flush=True)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    synth = write_synthetic_checkpoint(ckpt, family, num_layers=layers, num_experts=args.num_experts,
                                       overrides=args.overrides, dtype=DTYPES[args.dtype], device=device,
                                       shard_bytes=args.shard_bytes, log=lambda m: print(m, flush=True))
    out["synth"] = {k: v for k, v in vars(synth).items()}
    if args.device == "cuda":
        torch.cuda.empty_cache()
    save()
    try:
        prompts, source = gsm8k_prompt_ids(ckpt / "tokenizer.json", max(args.batch), args.prompt_len)
        out["prompts"] = {"source": source, "batch": args.batch, "prompt_len": args.prompt_len,
                          "new_tokens": args.new_tokens, "graphs": args.graphs}
        compute = args.compute_dtype or args.dtype
        out["compute_dtype"] = compute
        opts = {"dtype": compute, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "batches": args.batch, "graphs": args.graphs}
        logits = {}  # world size -> rank 0's last-position logits of two prompts (compared, not saved)
        for ws in args.world_sizes:
            print(f"== {family}: world size {ws} ({time.perf_counter() - args.t0:.0f} s)", flush=True)
            t0 = time.perf_counter()
            res = launch(bench_rank0, (str(ckpt), prompts, opts), world_size=ws, device=args.device,
                         timeout_s=600, share_device=args.share_gpu and ws > 1)
            res["launch_seconds"] = time.perf_counter() - t0
            logits[ws] = res.pop("logits")
            out["runs"][str(ws)] = res
            print(json.dumps({"world_size": ws, "load": res["load"], "seconds": res["launch_seconds"]}),
                  flush=True)
            save()
        out["compare"] = {}
        base = out["runs"][str(args.world_sizes[0])]
        for ws in args.world_sizes:
            run = out["runs"][str(ws)]
            tokens = {key: r["tokens"] for key, r in run["arms"].items()}
            cmp, speedup = {}, {}
            for graphs in args.graphs:
                for b in args.batch:
                    key = functools.partial(_run_key, batch=b, graphs=graphs)
                    cmp[key("replay_vs_rewind")] = _agreement(tokens[key("replay")], tokens[key("rewind")])
                    cmp[key("rewind_vs_plain")] = _agreement(tokens[key("rewind")], tokens[key("plain")])
            for key, r in run["arms"].items():
                tps = r["decode_tokens_per_s"]
                if r["graphs"] == "on" and "off" in args.graphs:
                    eager = key.replace("/graphs_on", "/graphs_off")
                    cmp[f"{key}_vs_graphs_off"] = _agreement(tokens[key], tokens[eager])
                    speedup[f"{key}_vs_graphs_off"] = tps / run["arms"][eager]["decode_tokens_per_s"]
                if run is not base:
                    cmp[f"{key}_vs_world_size_{base['world_size']}"] = _agreement(
                        tokens[key], base["arms"][key]["tokens"])
                    speedup[f"{key}_vs_world_size_{base['world_size']}"] = (
                        tps / base["arms"][key]["decode_tokens_per_s"])
                a, b = logits[ws], logits[args.world_sizes[0]]
                cmp["last_logits"] = {"max_abs_difference": float((a - b).abs().max()),
                                      "max_abs_logit": float(b.abs().max()),
                                      "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}
            out["compare"][str(ws)] = cmp
            out.setdefault("speedup", {})[str(ws)] = speedup
            print(json.dumps({"world_size": ws, "compare": cmp, "speedup": speedup}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="local folder for the checkpoints (one family at a time)")
    p.add_argument("--out", required=True, help="JSON file to write (rewritten as results come)")
    p.add_argument("--family", nargs="+", default=sorted(DEFAULT_LAYERS), choices=sorted(DEFAULT_LAYERS))
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-layers", type=int, default=None, help="default: a quarter of the release's")
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[16], help="batch sizes (each a run per arm)")
    p.add_argument("--graphs", nargs="+", default=["on", "off"], choices=sorted(GRAPH_MODES),
                   help="decode steps as CUDA graphs (on) and / or eagerly (off)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--compute-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="the engine's dtype (default: --dtype, the checkpoint's); float32 over a bf16 "
                        "checkpoint compares world sizes without bf16 rounding flipping near-tie tokens")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shard-size", default="5GB")
    p.add_argument("--time-budget", type=float, default=330.0,
                   help="seconds: families that would start later are skipped")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config.json field for every family (runners.tools.synth --set; CPU smoke tests)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: deleted after use)")
    p.add_argument("--share-gpu", action="store_true",
                   help="every rank on cuda:0 over gloo (one GPU: checks results, not NCCL speed)")
    args = p.parse_args(argv)
    from runners.tools.synth import _parse_set, parse_size

    try:
        args.shard_bytes = parse_size(args.shard_size)
        args.overrides = _parse_set(args.set)
    except ValueError as e:
        p.error(str(e))
    args.graphs = list(dict.fromkeys(args.graphs))
    if min(args.world_sizes) < 1 or min(args.batch) < 1 or args.prompt_len < 64 or args.new_tokens < 1:
        p.error("--world-sizes, --batch and --new-tokens must be >= 1 and --prompt-len >= 64")
    import torch

    if args.share_gpu and args.device != "cuda":
        p.error("--share-gpu puts every rank on cuda:0; it needs --device cuda")
    need = 1 if args.share_gpu else max(args.world_sizes)
    if args.device == "cuda" and torch.cuda.device_count() < need:
        p.error(f"--world-sizes {max(args.world_sizes)} needs {need} GPU(s); {torch.cuda.device_count()} "
                "visible (this script is for the GPU machine; --share-gpu runs every rank on one GPU; "
                "--device cpu with small --set sizes runs it on the CPU)")
    work = Path(args.workdir).resolve()
    if work.is_relative_to(REPO) or Path(args.out).resolve().is_relative_to(work):
        p.error(f"--workdir {args.workdir}: give a scratch folder outside the repository that does not hold "
                "--out (its checkpoints are deleted after use)")
    work.mkdir(parents=True, exist_ok=True)
    args.t0 = time.perf_counter()
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                    if args.device == "cuda" else ["cpu"]},
        "families": [],
    }
    if args.share_gpu:
        report["note"] = ("--share-gpu: world sizes > 1 ran every rank on cuda:0 with gloo all-reduces "
                          "through host memory; tokens/s are not NCCL tensor-parallel throughput")

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    from runners.tools.synth import SynthError

    status = 0
    for family in args.family:
        elapsed = time.perf_counter() - args.t0
        if elapsed > args.time_budget:
            print(f"== {family}: skipped, {elapsed:.0f} s > --time-budget {args.time_budget:.0f} s",
                  flush=True)
            report["families"].append({"family": family, "skipped": f"time budget ({elapsed:.0f} s elapsed)"})
            continue
        try:
            bench_family(family, args, report, save)
        except SynthError as e:
            print(f"error: {family}: {e}", file=sys.stderr)
            report["families"].append({"family": family, "error": str(e)})
            status = 2
        save()
    report["seconds"] = time.perf_counter() - args.t0
    save()
    print(f"wrote {args.out} ({report['seconds']:.0f} s)", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
