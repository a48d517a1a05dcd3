"""MTP speculative decoding (greedy, rewind commit): drafts, acceptance, and equality with plain greedy.

- drafts equal a cache-free reference of the MTP module (target hidden for prompt positions, then its own
  output recursively);
- an oracle drafter with errors injected at chosen positions drives every num_accepted_tokens value
  1 .. K + 1, and the output still equals plain greedy;
- with the real (random) MTP weights on a 5-token vocab (so some drafts are accepted), speculative output
  equals plain greedy under continuous batching and chunked prefill, and the counters are consistent.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint

from runners import Engine

MAX_NEW = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = make_hf_model(seed=2, vocab_size=5)
    path = write_checkpoint(tmp_path_factory.mktemp("mtp"), hf, with_mtp=True)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 5, (n,)).tolist() for n in (5, 17, 9, 30, 1, 12)]
    plain = Engine.from_pretrained(path, max_batch_size=3, max_seq_len=64)
    return path, prompts, plain.generate(prompts, MAX_NEW, stop_token_ids=[]).tokens


@torch.inference_mode()
def test_drafts_match_cache_free_mtp_reference(ckpt):
    path, prompts, _ = ckpt
    K = 3
    engine = Engine.from_pretrained(path, draft_len=K, max_batch_size=2, max_seq_len=64)
    model, prompt = engine.model, prompts[3]
    first = engine._prefill([prompt], [1])[0]
    drafts = engine._draft(torch.tensor([1]), torch.tensor([len(prompt)]), None)[0].tolist()
    # reference: MTP position i pairs the target hidden at i with token i + 1, then its own outputs
    hidden = model(torch.tensor([prompt]))[0]
    assert first == int(model.lm_logits(hidden[-1]).argmax())
    after = prompt[1:] + [first]
    want = []
    for _ in range(K):
        out = model.mtp(model.embeddings(torch.tensor([after])), hidden[None])[0, -1]
        want.append(int(model.lm_logits(out).argmax()))
        after.append(want[-1])
        hidden = torch.cat([hidden, out[None]])
    assert drafts == want


class OracleDraftEngine(Engine):
    """Drafts the true greedy continuation, with draft ``step % (K + 1)`` corrupted at each step (none when
    that index is K), so num_accepted_tokens cycles through 1 .. K + 1."""

    def set_oracle(self, prompts, greedy):
        self.prompts = [list(p) for p in prompts]
        self.sequences = [p + g for p, g in zip(prompts, greedy)]
        self.slot_request, self.step = {}, 0

    def _prefill(self, prompts, slots):
        for p, s in zip(prompts, slots):
            self.slot_request[s] = self.prompts.index(list(p))
        return super()._prefill(prompts, slots)

    def _draft(self, slot_ids, slot_len, slot_start):
        K, V = self.draft_len, self.config.vocab_size
        wrong = self.step % (K + 1)
        self.step += 1
        rows = []
        for s, n in zip(slot_ids.tolist(), slot_len.tolist()):
            seq = self.sequences[self.slot_request[s]]
            row = [seq[n + 1 + j] if n + 1 + j < len(seq) else 0 for j in range(K)]
            if wrong < K:
                row[wrong] = (row[wrong] + 1) % V
            rows.append(row)
        return torch.tensor(rows, device=self.device)


def test_every_num_accepted_value_keeps_plain_greedy_output(ckpt):
    path, prompts, plain = ckpt
    K = 3
    engine = OracleDraftEngine.from_pretrained(path, draft_len=K, max_batch_size=5, max_seq_len=64)
    engine.set_oracle(prompts, plain)
    out = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert out.tokens == plain
    hist = out.stats.num_accepted_hist
    assert hist[0] == 0 and all(h > 0 for h in hist[1:])  # 1 .. K + 1 accepted tokens all occurred
    assert out.stats.steps < MAX_NEW - 1  # speculation saved target forwards


@pytest.mark.parametrize("K", [1, 3])
def test_speculative_equals_plain_greedy_with_mtp_weights(ckpt, K):
    path, prompts, plain = ckpt
    engine = Engine.from_pretrained(
        path, draft_len=K, max_batch_size=3, max_seq_len=64, prefill_chunk_tokens=7
    )
    finished = []
    out = engine.generate(prompts, MAX_NEW, stop_token_ids=[], on_finish=lambda i, t, r: finished.append(i))
    assert out.tokens == plain and sorted(finished) == list(range(len(prompts)))
    s = out.stats
    assert s.accepted_drafts > 0  # the 5-token vocab makes some random drafts right
    assert sum(s.num_accepted_hist) == s.request_steps and s.num_accepted_hist[0] == 0
    assert s.drafted_tokens == K * s.request_steps
    assert s.accepted_drafts == sum((i - 1) * h for i, h in enumerate(s.num_accepted_hist) if i)
    assert s.accepted_per_position[0] == s.request_steps - s.num_accepted_hist[1]
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    assert engine.cache_memory()["spec_buffers_bytes"] > 0


def test_stop_token_inside_an_accepted_run(ckpt):
    """A stop token among several accepted tokens truncates the output right after it."""
    path, prompts, plain = ckpt
    engine = OracleDraftEngine.from_pretrained(path, draft_len=3, max_batch_size=2, max_seq_len=64)
    engine.set_oracle(prompts[1:3], plain[1:3])
    stop = plain[1][6]
    out = engine.generate(prompts[1:3], MAX_NEW, stop_token_ids=[stop])
    for toks, full, reason in zip(out.tokens, plain[1:3], out.finish_reasons):
        want = full[: full.index(stop) + 1] if stop in full else full
        assert toks == want
        assert reason == ("stop_token" if stop in full else "length")
