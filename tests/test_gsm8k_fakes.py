"""Test doubles for the GSM8K / lm-eval adapter tests (this module holds no tests).

- `train_tiny_tokenizer`: a byte-level BPE trained on a few hundred GSM8K train rows, special tokens
  <pad>=0 <s>=1 </s>=2, BOS added by its post-processor (like the shipped tiny checkpoints' tokenizer).
- `FakeEngine`: implements `runners.Engine.generate`'s documented contract (docs/architecture.md) by playing
  back a scripted completion per prompt, with continuous batching over `max_batch_size` slots, several tokens
  per step (like MTP), `stop_checker` after each step, `on_finish(i, ids, reason, request_stats)` as each
  request finishes, with scripted speculative counters (draft length `FAKE_DRAFT_LEN`) that depend only on
  the request's own tokens, so they do not change with batching, limits or kill-and-resume.

Also imported by the kill-and-resume subprocess in test_gsm8k.py (tests/ is put on its sys.path).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FAKE_DRAFT_LEN = 3


def train_tiny_tokenizer(gsm8k_dir: Path, out_path: Path, *, num_rows: int = 300,
                         vocab_size: int = 600) -> Path:
    """Train a byte-level BPE on the first `num_rows` rows of train.jsonl and save it as tokenizer.json."""
    rows = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines()[:num_rows]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows), trainer)
    specials = (tok.token_to_id("<pad>"), tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    assert specials == (PAD_ID, BOS_ID, EOS_ID), specials
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    tok.save(str(out_path))
    return out_path


def last_question(prompt: str) -> str:
    """The question of the document being asked in an lm-eval gsm8k prompt (the last "Question: ...")."""
    return prompt.rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]


def gold_final(answer: str) -> str:
    return answer.split("####")[-1].strip()


def answer_policy(policy: str, gsm8k_dir: Path) -> Callable[[str], str]:
    """question -> completion text (what follows "Answer:") for the test documents, by policy:

    "right": the reference solution (" <steps>\\n#### N"); "wrong": a solution ending "#### N+1";
    "no_hash": the steps plus "The answer is N." without "####" (strict-match fails, flexible-extract passes);
    "alternate": right for every other test row (by file order), wrong otherwise.
    Every completion continues into a new "Question:" as a model would, unless a stop string cuts it.
    """
    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()]
    by_q = {r["question"]: (i, r["answer"]) for i, r in enumerate(rows)}

    def complete(question: str) -> str:
        i, ans = by_q[question]
        final = gold_final(ans).replace(",", "")
        steps = ans.rsplit("####", 1)[0].rstrip()
        wrong = f" {steps}\n#### {int(float(final)) + 1}"
        text = {
            "right": f" {ans}",
            "wrong": wrong,
            "no_hash": f" {steps}\nThe answer is {final}.",
            "alternate": f" {ans}" if i % 2 == 0 else wrong,
        }[policy]
        return text + "\n\nQuestion: How many eggs are left after that?\nAnswer: none"

    return complete


@dataclasses.dataclass
class FakeStats:
    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    steps: int = 0
    request_steps: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    accepted_per_position: list = dataclasses.field(default_factory=lambda: [0] * FAKE_DRAFT_LEN)
    num_accepted_hist: list = dataclasses.field(default_factory=lambda: [0] * (FAKE_DRAFT_LEN + 2))

    def count_step(self, accepted: int) -> None:
        """One request-step with `accepted` of K = FAKE_DRAFT_LEN drafts accepted."""
        self.request_steps += 1
        self.drafted_tokens += FAKE_DRAFT_LEN
        self.accepted_drafts += accepted
        self.num_accepted_hist[accepted + 1] += 1
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def request_stats(self) -> dict:
        """The engine's per-request `request_stats` dict
        (runners.engine.scheduler.SlotCounters.request_stats)."""
        keys = ("request_steps", "drafted_tokens", "accepted_drafts", "accepted_per_position",
                "num_accepted_hist", "generated_tokens", "prompt_tokens")
        return {k: getattr(self, k) for k in keys}


class FakeEngine:
    """Scripted stand-in for `runners.Engine` (generate only).

    complete(prompt_text) -> completion text; its tokens (no special tokens), then EOS if `append_eos`, then
    filler tokens forever are what the "model" emits. `tokens_per_step` tokens are appended per step to
    every active request (MTP-like); `step_delay` seconds are slept per step; after `hang_after` requests
    have finished the engine hangs (a long run to be killed). `calls` records the prompt texts of each
    generate call.
    """

    def __init__(self, tokenizer: Tokenizer, complete: Callable[[str], str], *, max_batch_size: int = 3,
                 tokens_per_step: int = 1, step_delay: float = 0.0, append_eos: bool = False,
                 hang_after: int | None = None):
        self.tokenizer = tokenizer
        self.complete = complete
        self.max_batch_size = max_batch_size
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self.append_eos = append_eos
        self.hang_after = hang_after
        self.config = SimpleNamespace(eos_token_id=EOS_ID)
        self.calls: list[list[str]] = []
        self.max_new_tokens_seen: list[int] = []
        self._filler = tokenizer.encode(" la", add_special_tokens=False).ids

    def generate(self, prompts, max_new_tokens, stop_token_ids=None, stop_checker=None, on_finish=None,
                 progress=None):
        assert all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)
        assert all(p[0] == BOS_ID for p in prompts), "the tokenizer's post-processor adds BOS"
        texts = [self.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
        self.calls.append(texts)
        self.max_new_tokens_seen.append(max_new_tokens)
        stop_ids = set(stop_token_ids or [])
        scripts = []
        for text in texts:
            ids = self.tokenizer.encode(self.complete(text), add_special_tokens=False).ids
            scripts.append(ids + ([EOS_ID] if self.append_eos else []))
        generated: list[list[int]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * len(prompts)
        stats = FakeStats(num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)))
        per_request = [FakeStats(num_requests=1, prompt_tokens=len(p)) for p in prompts]
        waiting, active, num_finished = deque(range(len(prompts))), [], 0
        t0 = time.perf_counter()
        while waiting or active:
            while waiting and len(active) < self.max_batch_size:
                active.append(waiting.popleft())
            if self.step_delay:
                time.sleep(self.step_delay)
            stats.steps += 1
            for i in list(active):
                reason = None
                n0 = len(generated[i])
                # scripted acceptance: a function of the request's own next token only
                accepted = (scripts[i][n0] if n0 < len(scripts[i]) else n0) % (FAKE_DRAFT_LEN + 1)
                stats.count_step(accepted)
                per_request[i].count_step(accepted)
                for _ in range(self.tokens_per_step):
                    n = len(generated[i])
                    tok = scripts[i][n] if n < len(scripts[i]) else self._filler[n % len(self._filler)]
                    generated[i].append(tok)
                    if tok in stop_ids:
                        reason = "stop_token"
                    elif len(generated[i]) >= max_new_tokens:
                        reason = "length"
                    if reason:
                        break
                if reason is None and stop_checker is not None and stop_checker(i, list(generated[i])):
                    reason = "stop_checker"
                if reason:
                    reasons[i] = reason
                    active.remove(i)
                    per_request[i].generated_tokens = len(generated[i])
                    if on_finish is not None:
                        on_finish(i, list(generated[i]), reason, per_request[i].request_stats())
                    num_finished += 1
                    if num_finished == self.hang_after:
                        time.sleep(3600)
        stats.generated_tokens = sum(map(len, generated))
        stats.decode_seconds = time.perf_counter() - t0
        return SimpleNamespace(tokens=generated, finish_reasons=reasons, stats=stats)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


