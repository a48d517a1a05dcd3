"""Logit drift of a 16-bit SSM state over a long teacher-forced decode, with and without stochastic rounding.

    python -m benchmarks.state_drift --out docs/state_drift.json [--tokens 2000] [--checkpoints tiny_nemotron_h_mtp,...]

For each checkpoint (registry/checkpoints/<name>), one sequence of `--tokens` tokens (GSM8K training text
through the checkpoint's tokenizer; random ids when the data is not beside the checkout) is fed one token per
decode step (teacher forcing: the next input is the text's token, never the model's), from a one-token
prefill, on the CPU with the PyTorch references (ssm_backend "torch"). Runs: float32 state (the reference),
bfloat16 and float16 state rounded to nearest, and both with stochastic rounding (kernels/rounding.py;
Engine option ssm_stochastic_rounding). Per position t the drift is max |logits_t - logits_t(fp32 state)|
over the vocabulary. Reported per run: the mean drift over the first and the last window of positions
(`--window`), their ratio ("growth"), and a coarse curve (means over 10 equal spans).

Why: with round-to-nearest a state write loses the part of an update below half an ulp, every step, with
the same sign (a head whose per-token decay exp(A dt') rounds back to 1 never decays): the error accumulates
linearly. Stochastic rounding makes each write unbiased, so the accumulated error grows like sqrt(steps).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from runners.engine.engine import Engine
from runners.engine.options import EngineOptions
from runners.engine.state import BatchMeta

REPO = Path(__file__).resolve().parents[1]
CHECKPOINTS = ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp")
RUNS = (("float32", False), ("bfloat16", False), ("bfloat16", True), ("float16", False), ("float16", True))


def text_tokens(checkpoint: Path, n: int, seed: int = 0) -> list[int]:
    """n token ids: GSM8K training text (../shared/data/gsm8k or $GSM8K_DIR) through the checkpoint's
    tokenizer, or seeded random ids below the vocabulary size when the data or tokenizer is missing."""
    data = Path(os.environ.get("GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k")) / "train.jsonl"
    tok_path = checkpoint / "tokenizer.json"
    if data.exists() and tok_path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        ids: list[int] = []
        with open(data) as f:
            for line in f:
                rec = json.loads(line)
                ids += tok.encode(rec["question"] + "\n" + rec["answer"] + "\n\n").ids
                if len(ids) >= n:
                    return ids[:n]
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def teacher_forced_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), vocab]: logits after each token, fed one per decode step into slot 0."""
    cache, model = engine.cache, engine.model
    slot = torch.zeros(1, dtype=torch.long)
    cache.reset(slot)
    x = torch.tensor([ids], dtype=torch.long)
    meta = BatchMeta(slot, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), all_valid=True)
    out = [model.lm_logits(model(x[:, :1], cache, meta)[:, -1]).float()]
    cache.advance_rounding()
    for t in range(1, len(ids)):
        meta = BatchMeta.decode(slot, torch.tensor([t]), max_kv_len=t + 1)
        out.append(model.lm_logits(model(x[:, t : t + 1], cache, meta)[:, -1]).float())
        cache.advance_rounding()
    return torch.cat(out)


def drift_stats(drift: torch.Tensor, window: int) -> dict:
    """Mean drift over the first and last `window` positions, their ratio, and means over 10 spans."""
    first, last = drift[:window].mean().item(), drift[-window:].mean().item()
    spans = [round(c.mean().item(), 6) for c in drift.chunk(10)]
    return {"first_window_mean": round(first, 6), "last_window_mean": round(last, 6),
            "growth": round(last / first, 2) if first > 0 else None, "span_means": spans}


def measure(checkpoint: str, tokens: int, window: int, runs=RUNS) -> dict:
    """{run name: drift statistics} for one checkpoint (see the module docstring)."""
    path = REPO / "registry" / "checkpoints" / checkpoint
    ids = text_tokens(path, tokens)
    res, ref = {}, None
    for state_dtype, sr in runs:
        t0 = time.perf_counter()
        engine = Engine.from_pretrained(path, EngineOptions(dtype=torch.float32, max_batch_size=1,
                                                            max_seq_len=tokens + 1, ssm_state_dtype=state_dtype, ssm_backend="torch", ssm_stochastic_rounding=sr), device="cpu")
        logits = teacher_forced_logits(engine, ids)
        name = state_dtype + ("_sr" if sr else "")
        if ref is None:
            ref = logits
            res[name] = {"reference": True, "seconds": round(time.perf_counter() - t0, 1)}
            continue
        drift = (logits - ref).abs().amax(-1)
        res[name] = {**drift_stats(drift, window), "seconds": round(time.perf_counter() - t0, 1)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--window", type=int, default=200, help="positions averaged at the start and at the end")
    ap.add_argument("--checkpoints", default=",".join(CHECKPOINTS))
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.tokens < 2 * args.window:
        ap.error(f"--tokens {args.tokens} must be at least twice --window {args.window}")
    torch.set_num_threads(1)
    res = {"tokens": args.tokens, "window": args.window, "metric": "max over vocab |logits - logits(fp32 state)|",
           "torch": torch.__version__}
    for name in args.checkpoints.split(","):
        res[name] = measure(name, args.tokens, args.window)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
