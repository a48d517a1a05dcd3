"""MTP speculative decoding (greedy, rewind commit): drafts, acceptance, state invariants, stats, memory.

- drafts equal a cache-free reference of the MTP module (target hidden for prompt positions, then its own
  output recursively);
- an oracle drafter with errors injected at chosen positions drives every num_accepted_tokens value
  1 .. K + 1, and the output still equals plain greedy;
- for K = 1, 3, 7, with the real (random) MTP weights on a 5-token vocab (so some drafts are accepted) and
  with forced per-row acceptance patterns (rows accepting different counts in one step, a row accepting 0
  right after K, requests joining and leaving), speculative output equals plain greedy and, after every
  verify + commit, each slot's whole cache (recurrent state, conv window, target and MTP KV below its
  length, next first draft) equals a reference engine that decoded only the accepted tokens one by one;
- PAD rows of a verify + commit never touch a live slot; counts outside [1, T] are rejected;
- speculative buffers exist only with speculation (memory report by kind, exact byte counts);
- GenerationStats keeps raw sums and derives rate / length / per-position acceptance.
"""

from __future__ import annotations

import logging

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint

from runners import Engine, GenerationStats
from runners.cache import BatchMeta, KVCache, Mamba2State

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


# ---------------------------------------------------------------------------- state invariants after commit

# Tensors a verify step uses as scratch (the rewind buffers): not part of a slot's committed state.
SPEC_SCRATCH = {"conv_steps", "ssm_steps"}
# Per-request output lengths (finish at different steps; 16 = MAX_NEW), for the 6 prompts of the fixture.
LIMITS = (16, 5, 11, 2, 16, 9)


class CheckedEngine(Engine):
    """An engine that, after every speculative step, compares each stepped slot's cache with a reference
    engine that saw only the accepted tokens, one token per forward.

    Compared per slot: every recurrent layer's committed tensors (SSM state, conv window; any state kind a
    family adds, except the rewind scratch buffers), target and MTP KV entries below the slot's length,
    and the MTP hidden / first draft that start the next step. With ``force_schedule`` the drafter is an
    oracle made right for exactly ``schedule[request][step % len]`` drafts of each request-step.
    """

    def attach(self, ref: Engine, prompts, greedy, schedules=None):
        self.ref, self.prompts, self.schedules = ref, [list(p) for p in prompts], schedules
        self.sequences = [list(p) + list(g) for p, g in zip(prompts, greedy)]
        self.slot_request, self.history, self.ref_len = {}, {}, {}
        self.request_step = [0] * len(prompts)
        self.expected_accepts, self.realized_accepts, self.checked = {}, [], 0

    def _prefill(self, prompts, slots):
        first = super()._prefill(prompts, slots)
        self.ref._prefill(prompts, slots)  # the reference uses the same slot ids
        for p, s, f in zip(prompts, slots, first):
            self.slot_request[s] = self.prompts.index(list(p))
            self.history[s], self.ref_len[s] = list(p) + [f], len(p)
        return first

    def _draft(self, slot_ids, slot_len, slot_start):
        if self.schedules is None:
            return super()._draft(slot_ids, slot_len, slot_start)
        K, V = self.draft_len, self.config.vocab_size
        rows = []
        for s, n in zip(slot_ids.tolist(), slot_len.tolist()):
            i = self.slot_request[s]
            seq, sched = self.sequences[i], self.schedules[i]
            m = sched[self.request_step[i] % len(sched)]
            self.request_step[i] += 1
            row = [seq[n + 1 + j] if n + 1 + j < len(seq) else 0 for j in range(K)]
            if m < K:
                row[m] = (row[m] + 1) % V  # the target's greedy token there is seq[n + 1 + m]
            self.expected_accepts[s] = m if n + K < len(seq) else None
            rows.append(row)
        return torch.tensor(rows, device=self.device)

    def _spec_step(self, slots, slot_len, last_token, stats):
        new = super()._spec_step(slots, slot_len, last_token, stats)
        for s, toks in zip(slots, new):
            self.history[s] += toks
            self.realized_accepts.append(len(toks) - 1)
            if self.schedules is not None and self.expected_accepts[s] is not None:
                assert len(toks) - 1 == self.expected_accepts[s], f"slot {s}: forced acceptance not realized"
            self._check_slot(s, int(slot_len[s]))
        self.checked += 1
        return new

    def _check_slot(self, slot: int, length: int) -> None:
        ref, hist, one = self.ref, self.history[slot], torch.tensor([slot])
        assert length == len(hist) - 1  # every token but the bonus is in the cache
        for p in range(self.ref_len[slot], length):  # the accepted tokens, one per forward
            meta = BatchMeta.decode(one, torch.tensor([p]))
            h = ref.model(torch.tensor([[hist[p]]]), ref.cache, meta)
            mtp_out = ref._mtp(torch.tensor([[hist[p + 1]]]), h, meta)[0, -1]  # MTP pos p: token p + 1
        self.ref_len[slot] = length
        tol = dict(atol=2e-5, rtol=1e-4)
        for idx, layer in self.cache.layers.items():
            ref_layer = ref.cache[idx]
            for name, buf in vars(layer).items():
                if buf is None or name in SPEC_SCRATCH:
                    continue
                got, want = buf[slot], getattr(ref_layer, name)[slot]
                if isinstance(layer, KVCache):
                    got, want = got[:length], want[:length]
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"layer {idx} {name}: {m}")
        torch.testing.assert_close(self._mtp_hidden[slot], mtp_out, **tol)
        assert int(self._draft1[slot]) == int(ref.model.lm_logits(mtp_out).argmax())


def _checked_run(path, prompts, plain, K, schedules=None):
    kw = dict(draft_len=K, max_batch_size=3, max_seq_len=64)
    engine = CheckedEngine.from_pretrained(path, prefill_chunk_tokens=7, **kw)
    engine.attach(Engine.from_pretrained(path, **kw), prompts, plain, schedules)
    finished = []
    out = engine.generate(
        prompts,
        MAX_NEW,
        stop_token_ids=[],
        stop_checker=lambda i, toks: len(toks) >= LIMITS[i],
        on_finish=lambda i, t, r: finished.append(i),
    )
    assert out.tokens == [g[:n] for g, n in zip(plain, LIMITS)]
    assert sorted(finished) == list(range(len(prompts))) and engine.checked == out.stats.steps > 0
    return engine, out.stats


def _check_counters(s: GenerationStats, K: int, realized: list[int]) -> None:
    assert s.request_steps == len(realized) and s.drafted_tokens == K * len(realized)
    assert s.accepted_drafts == sum(realized)
    assert s.num_accepted_hist == [0] + [realized.count(a) for a in range(K + 1)]
    assert s.accepted_per_position == [sum(a > i for a in realized) for i in range(K)]


@pytest.mark.parametrize("K", [1, 3, 7])
def test_speculative_equals_plain_greedy_and_commit_equals_accepted_only(ckpt, K):
    """Real MTP weights: equal output, and after every verify + commit each slot's cache equals the
    reference that decoded only the accepted tokens (requests of different lengths join and leave)."""
    path, prompts, plain = ckpt
    engine, s = _checked_run(path, prompts, plain, K)
    assert s.accepted_drafts > 0  # the 5-token vocab makes some random drafts right
    _check_counters(s, K, engine.realized_accepts)


@pytest.mark.parametrize("K", [1, 3, 7])
def test_ragged_forced_acceptance_keeps_each_rows_state(ckpt, K):
    """Rows accept different counts in one step; a row accepts 0 right after K (and K after 0); rows join
    and leave (3 slots, 6 requests, different lengths): every row's state stays its own."""
    path, prompts, plain = ckpt
    mid = K // 2 + 1 if K > 1 else 1
    schedules = [[K, 0], [0, K], [mid, K, 0, 0], [K, K, 0], [0], [K, mid - 1, K]]
    engine, s = _checked_run(path, prompts, plain, K, schedules)
    _check_counters(s, K, engine.realized_accepts)
    assert s.num_accepted_hist[1] > 0 and s.num_accepted_hist[K + 1] > 0
