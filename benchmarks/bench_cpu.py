"""CPU throughput of the engine beside HF transformers ``generate`` on the same GSM8K prompts (one process).

The default run's workload, cut to ``--prompts`` requests: the first GSM8K test questions as lm-eval's 5-shot
gsm8k task builds them (what ``python run.py`` sends), tokenized with the checkpoint's tokenizer, each
generating exactly ``--new-tokens`` greedy tokens (stop tokens off in both engines, so both produce the same
number of tokens). Arms, each timed ``--repeats`` times (the best is reported, the others kept):

- ``hf``: transformers' ``generate`` on the checkpoint (``AutoModelForCausalLM``, float32, the prompts
  left-padded into one batch, its own KV / Mamba cache; transformers ignores the ``mtp.*`` weights);
- ``engine_k0``: our engine without speculation; ``engine_k3_rewind`` / ``engine_k3_replay``: MTP with
  K = 3 drafts and the rewind / replay commit. The engine runs ``--slots`` concurrent requests (the
  registry entry's max_batch_size, 16 for the tiny entries) with continuous batching.

Every arm runs with one intra-op thread (``torch.set_num_threads(--threads)``) in this process, one after
the other. Wall seconds and the process's CPU seconds (``time.process_time``: what one core would need,
insensitive to other processes taking the core) are both recorded, with the machine's load average before
and after, since the CPU machines are shared. The engine arms also report prefill / decode seconds, steps and
the acceptance of the drafts, and the CPU seconds split into the prefills' and the rest (decode and
host bookkeeping).

    python -m benchmarks.bench_cpu --out /tmp/bench.json                # 64 prompts x 256 tokens, 2 repeats
    python -m benchmarks.bench_cpu --prompts 32 --new-tokens 128 --repeats 1   # docs/cpu_bench/ (a loaded machine)
    python -m benchmarks.bench_cpu --prompts 8 --new-tokens 32 --repeats 1 --no-hf   # a quick look

Speed figures are measurements of this machine at that moment, not assertions: no test checks them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from registry.checkpoint import TOKENIZER_FILE
from registry.schema import REPO_ROOT

DEFAULT_CHECKPOINT = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp"
ENGINE_ARMS = {"engine_k0": (0, False), "engine_k3_rewind": (3, False), "engine_k3_replay": (3, True)}


def gsm8k_prompts(checkpoint: Path, n: int, data_dir: str | None = None) -> list[list[int]]:
    """The token ids of the first ``n`` GSM8K test prompts as ``python run.py`` builds them: lm-eval's gsm8k
    task (5-shot, few-shot seed 1234) on the local GSM8K files, encoded with the checkpoint's tokenizer."""
    from tokenizers import Tokenizer

    from evals.evaluate import load_task
    from evals.tasks.gsm8k import FEWSHOT_SEED, gsm8k_dir

    folder, _ = gsm8k_dir(data_dir)
    task, _, _ = load_task(folder)
    task.set_config(key="num_fewshot", value=5)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)
    task.build_all_requests(limit=n, rank=0, world_size=1)
    tok = Tokenizer.from_file(str(checkpoint / TOKENIZER_FILE))
    return [tok.encode(inst.args[0]).ids for inst in task.instances[:n]]


def _timed(fn) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def run_hf(checkpoint: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """transformers generate, greedy, exactly ``new_tokens`` tokens per prompt, one left-padded batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    T = max(map(len, prompts))
    pad = model.config.pad_token_id or 0
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1

    def gen():
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)

    wall, cpu, out = _timed(gen)
    return wall, cpu, out[:, T:].tolist()


def run_engine(checkpoint: Path, prompts: list[list[int]], new_tokens: int, draft_len: int, replay: bool,
               slots: int, prefix_cache: bool) -> tuple[float, float, object, float]:
    """Our engine, exactly ``new_tokens`` tokens per prompt; returns (wall, cpu, GenerationOutput, load s).
    The output carries ``prefill_cpu_seconds``: the process's CPU seconds inside the admissions' prefills."""
    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    t0 = time.perf_counter()
    options = EngineOptions(draft_len=draft_len, ssm_replay=replay, max_batch_size=slots,
                            max_seq_len=max(map(len, prompts)) + new_tokens + 8, prefix_cache=prefix_cache)
    engine = Engine.from_pretrained(checkpoint, options)
    load = time.perf_counter() - t0
    prefill = engine.runner.prefill  # the admissions' prefills, timed in CPU seconds too
    prefill_cpu = [0.0]

    def timed_prefill(*a, **k):
        c = time.process_time()
        try:
            return prefill(*a, **k)
        finally:
            prefill_cpu[0] += time.process_time() - c

    engine.runner.prefill = timed_prefill
    wall, cpu, out = _timed(lambda: engine.generate(prompts, new_tokens, stop_token_ids=[]))
    out.prefill_cpu_seconds = prefill_cpu[0]
    return wall, cpu, out, load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--slots", type=int, default=16, help="the engine's max_batch_size")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", default="hf," + ",".join(ENGINE_ARMS), help="comma-separated subset")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (it needs the test extra)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (printed either way)")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a and not (a == "hf" and args.no_hf)]
    unknown = set(arms) - {"hf", *ENGINE_ARMS}
    if unknown or args.prompts < 1 or args.new_tokens < 1 or args.repeats < 1:
        p.error(f"unknown arms {sorted(unknown)}" if unknown else "--prompts, --new-tokens, --repeats >= 1")
    torch.set_num_threads(args.threads)
    prompts = gsm8k_prompts(args.checkpoint, args.prompts, args.data_dir)
    report: dict = {
        "command": "python -m benchmarks.bench_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "checkpoint": str(args.checkpoint.relative_to(REPO_ROOT) if args.checkpoint.is_relative_to(REPO_ROOT)
                          else args.checkpoint),
        "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "new_tokens": args.new_tokens,
        "slots": args.slots, "threads": args.threads, "prefix_cache": not args.no_prefix_cache,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "processor": platform.processor()},
        "load_average_before": os.getloadavg(),
        "arms": {},
    }
    tokens = {}
    for arm in arms:
        runs = []
        for _ in range(args.repeats):
            if arm == "hf":
                wall, cpu, toks = run_hf(args.checkpoint, prompts, args.new_tokens)
                runs.append({"wall_seconds": wall, "cpu_seconds": cpu})
            else:
                K, replay = ENGINE_ARMS[arm]
                wall, cpu, out, load = run_engine(args.checkpoint, prompts, args.new_tokens, K, replay,
                                                  args.slots, not args.no_prefix_cache)
                toks, s = out.tokens, out.stats
                runs.append({"wall_seconds": wall, "cpu_seconds": cpu, "load_seconds": load,
                             "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
                             "prefill_cpu_seconds": out.prefill_cpu_seconds,
                             "decode_cpu_seconds": cpu - out.prefill_cpu_seconds,
                             "steps": s.steps, "acceptance_rate": s.acceptance_rate,
                             "acceptance_length": s.acceptance_length,
                             "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens})
            print(f"{arm}: wall {wall:.2f} s, cpu {cpu:.2f} s", file=sys.stderr, flush=True)
        tokens[arm] = toks
        best = min(runs, key=lambda r: r["wall_seconds"])
        generated = sum(map(len, toks))
        report["arms"][arm] = {
            "best_wall_seconds": best["wall_seconds"],
            "best_cpu_seconds": min(r["cpu_seconds"] for r in runs),
            **({"best_prefill_cpu_seconds": min(r["prefill_cpu_seconds"] for r in runs),
                "best_decode_cpu_seconds": min(r["decode_cpu_seconds"] for r in runs)} if arm != "hf" else {}),
            "generated_tokens": generated,
            "tokens_per_s": generated / best["wall_seconds"],
            "runs": runs,
        }
    report["load_average_after"] = os.getloadavg()
    if "hf" in report["arms"]:
        hf = report["arms"]["hf"]
        for arm, r in report["arms"].items():
            if arm != "hf":
                r["speedup_vs_hf_wall"] = hf["best_wall_seconds"] / r["best_wall_seconds"]
                r["speedup_vs_hf_cpu"] = hf["best_cpu_seconds"] / r["best_cpu_seconds"]
                same = sum(a == b for x, y in zip(tokens[arm], tokens["hf"]) for a, b in zip(x, y))
                r["tokens_equal_to_hf"] = same / max(1, sum(map(len, tokens["hf"])))
    if "engine_k0" in report["arms"]:
        k0 = report["arms"]["engine_k0"]
        for arm in ("engine_k3_rewind", "engine_k3_replay"):
            if arm in report["arms"]:
                r = report["arms"][arm]
                r["speedup_vs_k0_wall"] = k0["best_wall_seconds"] / r["best_wall_seconds"]
                r["speedup_vs_k0_cpu"] = k0["best_cpu_seconds"] / r["best_cpu_seconds"]
                r["decode_speedup_vs_k0_cpu"] = k0["best_decode_cpu_seconds"] / r["best_decode_cpu_seconds"]
                r["tokens_equal_to_k0"] = tokens[arm] == tokens["engine_k0"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
