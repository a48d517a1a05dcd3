"""Where the CPU time of a decode step goes: a plain step (draft_len 0) beside an MTP speculative step (K = 3).

Runs the engine on the first ``--prompts`` GSM8K prompts (as ``benchmarks.bench_cpu`` builds them), once to
warm up and fill the prefix cache (so the profiled call's prefill is a full cache hit and the profile is the
decode), then ``--new-tokens`` greedy tokens per prompt under ``torch.profiler`` with one labelled range per
engine phase (``runners.engine.graphs.StepGraphs``' phases: DECODE for a plain step; DRAFT, VERIFY, COMMIT, CATCHUP
for a speculative one), plus STEP (``ModelRunner.launch``: one whole step and its launch), TARGET_FWD (the target
model's forward), MTP_FWD (every MTP module forward: drafts, catch-up), LM_HEAD, CACHE_COMMIT
(``HybridCache.commit``), PREFILL and READ (``ModelRunner.read``: the host reading a step's tokens). Prints
per label the calls and the profiler's CPU time (the thread's wall time inside the range: on a loaded machine
it includes time the thread waited for a core, so compare the rows with each other, not with other runs),
then the top operators by self time.

    python -m benchmarks.profile_cpu                       # 16 prompts x 64 tokens, K = 0 and K = 3

``--prefill N`` profiles the prefill instead, as the default job runs it: N GSM8K prompts (5-shot, about
1,100 tokens each), each admitted alone into an engine of ``--slots`` slots with K = 3 (the MTP module runs
over the prompt too) and generating one token: the CPU milliseconds per prompt (``time.process_time``, a
first pass unprofiled; also with ``onednn_linear=False`` where the engine has that option) and the top
operators of a profiled pass over N other prompts (the prefix cache holds the first N); and whether MKL
takes this CPU for an Intel one.

    python -m benchmarks.profile_cpu --prefill 16          # docs/cpu_bench/profile_prefill_*.txt
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.bench_cpu import DEFAULT_CHECKPOINT, gsm8k_prompts


def _label(obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` (a bound method; ``obj[name]`` for a dict of them) in a profiler range ``label``."""
    f = obj[name] if isinstance(obj, dict) else getattr(obj, name)

    @functools.wraps(f)
    def g(*a, **k):
        with record_function(label):
            return f(*a, **k)

    if isinstance(obj, dict):
        obj[name] = g
    else:
        setattr(obj, name, g)


def main(argv: list[str] | None = None) -> int:
    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-lens", default="0,3", help="comma-separated")
    p.add_argument("--prefill", type=int, default=0, metavar="N", help="profile N one-prompt prefills instead")
    p.add_argument("--slots", type=int, default=64, help="the engine's max_batch_size (--prefill)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.prefill:
        return _profile_prefill(args.checkpoint, args.prefill, args.slots)
    prompts = gsm8k_prompts(args.checkpoint, args.prompts)
    max_len = max(map(len, prompts)) + args.new_tokens + 8
    for K in map(int, args.draft_lens.split(",")):
        eng = Engine.from_pretrained(args.checkpoint, EngineOptions(draft_len=K, max_batch_size=args.prompts,
                                                                    max_seq_len=max_len))
        eng.generate(prompts, 4, stop_token_ids=[])  # warm-up; the prompts are now cached prefixes
        for name, label in [("prefill", "PREFILL"), ("launch", "STEP"), ("read", "READ")]:
            _label(eng.runner, name, label)
        if eng.model.mtp is not None:  # the MTP module's forwards (drafts, catch-up, prefill)
            _label(eng.model.mtp, "forward", "MTP_FWD")
        for name in eng.graphs.phases:  # the step's phases (bound methods, held by StepGraphs)
            _label(eng.graphs.phases, name, name.upper())
        _label(eng.model, "lm_logits", "LM_HEAD")
        _label(eng.model, "forward", "TARGET_FWD")
        _label(eng.cache, "commit", "CACHE_COMMIT")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = eng.generate(prompts, args.new_tokens, stop_token_ids=[])
        s = out.stats
        print(f"K={K} steps {s.steps} acceptance_length {s.acceptance_length} "
              f"prefill {s.prefill_seconds:.2f}s decode {s.decode_seconds:.2f}s", flush=True)
        for e in prof.key_averages():
            if e.key.isupper():
                print(f"  {e.key:12s} calls {e.count:5d}  cpu total {e.cpu_time_total / 1e3:9.1f} ms  "
                      f"per call {e.cpu_time_total / e.count / 1e3:7.2f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    return 0


def _mkl_on_intel_path() -> str:
    """What MKL (inside libtorch_cpu) says of this CPU: ``mkl_serv_intel_cpu_true()`` (0: MKL runs its
    compatibility code path, as on AMD processors), or why it cannot be asked."""
    import ctypes

    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        lib.mkl_serv_intel_cpu_true.restype = ctypes.c_int
        return str(lib.mkl_serv_intel_cpu_true())
    except (OSError, AttributeError) as e:
        return f"unknown ({e})"


def _profile_prefill(checkpoint: Path, n: int, slots: int) -> int:
    import dataclasses
    import time

    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    prompts = gsm8k_prompts(checkpoint, 2 * n + 1)  # the profiled pass takes other prompts: no cache hits
    tokens = sum(map(len, prompts[:n])) / n
    print(f"prefill: {n} prompts of {tokens:.0f} tokens on average, K = 3, {slots} slots, one thread; "
          f"MKL mkl_serv_intel_cpu_true() = {_mkl_on_intel_path()}", flush=True)
    arms = {"default": {}}
    if "onednn_linear" in {f.name for f in dataclasses.fields(EngineOptions)}:
        arms["onednn_linear=False"] = {"onednn_linear": False}
    for arm, extra in arms.items():
        eng = Engine.from_pretrained(checkpoint, EngineOptions(draft_len=3, max_batch_size=slots, max_seq_len=4096,
                                                               **extra))
        eng.generate(prompts[-1:], 1)  # warm-up (a prompt not measured)
        c = time.process_time()
        for p in prompts[:n]:
            eng.generate([p], 1)
        print(f"  {arm}: {(time.process_time() - c) / n * 1e3:.1f} ms of CPU per prompt", flush=True)
        if arm == "default":
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for p in prompts[n:2 * n]:
                    eng.generate([p], 1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
