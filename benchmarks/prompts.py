"""Fixed-length prompts for the GPU benchmarks (benchmarks/bench_e2e.py, benchmarks/bench_fp8.py,
tests/gpu/realdim.py): GSM8K test text, so that a real tokenizer's ids and the models' routing see text rather
than noise, cut to exactly the length a timing point asks for."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def gsm8k_prompt_ids(tokenizer_path: Path | str, n: int, length: int,
                     vocab_size: int = 2048) -> tuple[list[list[int]], str]:
    """n prompts of exactly ``length`` token ids, and a line saying where they come from.

    Each prompt is BOS (id 1) then "Question: ...\\nAnswer: ...\\n\\n" runs of GSM8K test rows through the
    tokenizer at ``tokenizer_path``, prompt i starting at row i and taking every n-th row after it, cut at
    ``length``. The data folder is the project's lookup (evals.tasks.gsm8k.gsm8k_dir: eval.data_dir / $GSM8K_DIR /
    ../shared), then ``.device/gsm8k`` (the GPU machine's carried copy). Without a GSM8K copy: uniform random
    ids in [3, vocab_size) from a fixed seed.
    """
    import torch
    from tokenizers import Tokenizer

    from evals.tasks.gsm8k import gsm8k_dir

    for d in (gsm8k_dir()[0], REPO / ".device/gsm8k"):
        if d and (Path(d) / "test.jsonl").is_file():
            rows = [json.loads(x) for x in (Path(d) / "test.jsonl").read_text().splitlines() if x.strip()]
            tok = Tokenizer.from_file(str(tokenizer_path))
            prompts = []
            for i in range(n):
                ids, j = [1], i
                while len(ids) < length:
                    r = rows[j % len(rows)]
                    ids += tok.encode(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n").ids
                    j += n
                prompts.append(ids[:length])
            return prompts, f"GSM8K test text from {d}"
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (length,), generator=g).tolist() for _ in range(n)], "random ids"
