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
- GenerationStats keeps raw sums and derives rate / length / per-position acceptance;
- the per-request counters passed to on_finish (``request_stats``) match each request's realized acceptances
  and sum to the call's GenerationStats (continuous batching: 3 slots, 6 requests, K = 1, 3, 7).
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import OracleDraftEngine, make_hf_model, write_checkpoint

from runners.engine import Engine, GenerationStats
from runners.engine.models.attention import KVCache
from runners.engine.models.mamba2 import Mamba2State
from runners.engine.options import EngineOptions
from runners.engine.state import BatchMeta
from runners.engine.step import mtp_forward

MAX_NEW = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = make_hf_model(seed=2, vocab_size=5)
    path = write_checkpoint(tmp_path_factory.mktemp("mtp"), hf, with_mtp=True)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 5, (n,)).tolist() for n in (5, 17, 9, 30, 1, 12)]
    plain = Engine.from_pretrained(path, EngineOptions(max_batch_size=3, max_seq_len=64))
    return path, prompts, plain.generate(prompts, MAX_NEW, stop_token_ids=[]).tokens


@torch.inference_mode()
def test_drafts_match_cache_free_mtp_reference(ckpt):
    path, prompts, _ = ckpt
    K = 3
    engine = Engine.from_pretrained(path, EngineOptions(draft_len=K, max_batch_size=2, max_seq_len=64))
    model, prompt = engine.model, prompts[3]
    first = engine.runner.prefill([prompt], [1]).tokens[0]
    drafts = engine.step.draft(torch.tensor([1]), torch.tensor([len(prompt)]))[0].tolist()
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


def test_every_num_accepted_value_keeps_plain_greedy_output(ckpt):
    path, prompts, plain = ckpt
    K = 3
    engine = OracleDraftEngine.from_pretrained(path, EngineOptions(draft_len=K, max_batch_size=5,
                                                                   max_seq_len=64))
    engine.set_oracle(prompts, plain)
    out = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert out.tokens == plain
    hist = out.stats.num_accepted_hist
    assert hist[0] == 0 and all(h > 0 for h in hist[1:])  # 1 .. K + 1 accepted tokens all occurred
    assert out.stats.steps < MAX_NEW - 1  # speculation saved target forwards


def test_stop_token_inside_an_accepted_run(ckpt):
    """A stop token among several accepted tokens truncates the output right after it."""
    path, prompts, plain = ckpt
    engine = OracleDraftEngine.from_pretrained(path, EngineOptions(draft_len=3, max_batch_size=2,
                                                                   max_seq_len=64))
    engine.set_oracle(prompts[1:3], plain[1:3])
    stop = plain[1][6]
    out = engine.generate(prompts[1:3], MAX_NEW, stop_token_ids=[stop])
    for toks, full, reason in zip(out.tokens, plain[1:3], out.finish_reasons):
        want = full[: full.index(stop) + 1] if stop in full else full
        assert toks == want
        assert reason == ("stop_token" if stop in full else "length")


# ---------------------------------------------------------------------------- state invariants after commit

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
        self.realized_by_request = [[] for _ in prompts]
        if schedules is not None:  # the drafter of the step: an oracle made right for the scheduled drafts
            self.step.draft = self._scheduled_draft
        self.runner.prefill, self.runner.read = self._prefill, self._read  # the runner's commands, checked

    def _prefill(self, prompts, slots):
        out = type(self.runner).prefill(self.runner, prompts, slots)
        taken = [prompts[j] for j in out.taken]
        self.ref.runner.prefill(taken, slots[: len(taken)])  # the reference uses the same slot ids
        for p, s, f in zip(taken, slots, out.tokens):
            self.slot_request[s] = self.prompts.index(list(p))
            self.history[s], self.ref_len[s] = list(p) + [f], len(p)
        return out

    def _scheduled_draft(self, slot_ids, start_pos, max_kv_len=None):
        K, V = self.options.draft_len, self.config.vocab_size
        rows = []
        for s, n in zip(slot_ids.tolist(), start_pos.tolist()):
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

    def _read(self, step):
        new = type(self.runner).read(self.runner, step)
        for s, toks in zip(step.slots, new):
            self.history[s] += toks
            self.realized_accepts.append(len(toks) - 1)
            self.realized_by_request[self.slot_request[s]].append(len(toks) - 1)
            if self.schedules is not None and self.expected_accepts[s] is not None:
                assert len(toks) - 1 == self.expected_accepts[s], f"slot {s}: forced acceptance not realized"
            self._check_slot(s, int(self.step.slots.length[s]))
        self.checked += 1
        return new

    def _check_slot(self, slot: int, length: int) -> None:
        ref, hist, one = self.ref, self.history[slot], torch.tensor([slot])
        assert length == len(hist) - 1  # every token but the bonus is in the cache
        for p in range(self.ref_len[slot], length):  # the accepted tokens, one per forward
            meta = BatchMeta.decode(one, torch.tensor([p]))
            h = ref.model(torch.tensor([[hist[p]]]), ref.cache, meta)
            nxt = torch.tensor([[hist[p + 1]]])  # MTP pos p: token p + 1
            mtp_out = mtp_forward(ref.model, ref.cache, nxt, h, meta)[0, -1]
        self.ref_len[slot] = length
        tol = dict(atol=2e-5, rtol=1e-4)
        for idx, layer in self.cache.layers.items():
            ref_layer = ref.cache[idx]
            for name, buf in vars(layer).items():
                if not isinstance(buf, torch.Tensor) or name in layer.spec_buffers:  # scratch, not state
                    continue
                got, want = buf[slot], getattr(ref_layer, name)[slot]
                if isinstance(layer, KVCache):
                    got, want = got[:length], want[:length]
                where = f"slot {slot}, cache layer {idx}, {name}"
                torch.testing.assert_close(got, want, **tol, msg=lambda m, where=where: f"{where}: {m}")
        torch.testing.assert_close(self.step.slots.mtp_hidden[slot], mtp_out, **tol)
        assert int(self.step.slots.draft1[slot]) == int(ref.model.lm_logits(mtp_out).argmax())


def _checked_run(path, prompts, plain, K, schedules=None, prefill_chunk_tokens=8192):
    kw = dict(draft_len=K, max_batch_size=3, max_seq_len=64)
    # prompts prefilled together (padded rows) as on a GPU: the CPU's default prefills one per forward
    engine = CheckedEngine.from_pretrained(path, EngineOptions(prefill_chunk_tokens=prefill_chunk_tokens,
                                                               prefill_max_rows=3, **kw))
    engine.attach(Engine.from_pretrained(path, EngineOptions(**kw)), prompts, plain, schedules)
    finished, request_stats = [], {}

    def on_finish(i, toks, reason, stats):
        finished.append(i)
        request_stats[i] = stats

    out = engine.generate(
        prompts,
        MAX_NEW,
        stop_token_ids=[],
        stop_checker=lambda i, toks: len(toks) >= LIMITS[i],
        on_finish=on_finish,
    )
    assert out.tokens == [g[:n] for g, n in zip(plain, LIMITS)]
    assert sorted(finished) == list(range(len(prompts))) and engine.checked == out.stats.steps > 0
    _check_request_stats(engine, prompts, out, request_stats, K)
    engine.committed = [a for i, r in enumerate(engine.realized_by_request)
                        for a in committed_accepts(r, len(out.tokens[i]))]
    return engine, out.stats


def committed_accepts(realized: list[int], generated: int) -> list[int]:
    """Accepted drafts per request-step counted as committed to the output: the prefill emits one token, a
    step with a accepted drafts a + 1 more, and the step the request finishes in only those appended before
    the stop (j tokens: j - 1 accepted drafts)."""
    out, total = [], 1
    for a in realized:
        take = min(a + 1, generated - total)
        assert take >= 1, "a step ran after the request had finished"
        out.append(take - 1)
        total += take
    assert total == generated
    return out


def _check_request_stats(engine, prompts, out, request_stats: dict[int, dict], K: int) -> None:
    """Each request's on_finish counters equal its own committed acceptances, hold 1 + request_steps +
    accepted_drafts == generated_tokens, and summed over the requests equal the call's GenerationStats (the
    global counters are exactly the per-request ones added up)."""
    total = GenerationStats(accepted_per_position=[0] * K, num_accepted_hist=[0] * (K + 2))
    for i, rs in request_stats.items():
        committed = committed_accepts(engine.realized_by_request[i], len(out.tokens[i]))
        want = GenerationStats(
            num_requests=1, prompt_tokens=len(prompts[i]), generated_tokens=len(out.tokens[i])
        )
        want.record_step(committed, K)
        # the prefix cache is looked up once per request (these prompts may share a prefix by chance)
        hit = rs["prefix_cache_hit_tokens"]
        assert 0 <= hit <= len(prompts[i]) and rs["prefix_cache_hits"] == int(hit > 0)
        want.prefix_cache_queries, want.prefix_cache_query_tokens = 1, len(prompts[i])
        want.prefix_cache_hits, want.prefix_cache_hit_tokens = int(hit > 0), hit
        got = GenerationStats(num_requests=1, **rs)
        assert got == want, f"request {i}"
        assert 1 + rs["request_steps"] + rs["accepted_drafts"] == rs["generated_tokens"] == len(out.tokens[i])
        total = total + got
    assert total.num_requests == len(prompts)
    for name in ("num_requests", "prompt_tokens", "generated_tokens", "request_steps", "drafted_tokens",
                 "accepted_drafts", "accepted_per_position", "num_accepted_hist", "prefix_cache_queries",
                 "prefix_cache_query_tokens", "prefix_cache_hits", "prefix_cache_hit_tokens"):
        assert getattr(total, name) == getattr(out.stats, name), name


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
    chunk = 7 if K == 3 else 8192  # once with chunked prefill (the MTP catches up chunk by chunk)
    engine, s = _checked_run(path, prompts, plain, K, prefill_chunk_tokens=chunk)
    assert s.accepted_drafts > 0  # the 5-token vocab makes some random drafts right
    _check_counters(s, K, engine.committed)


@pytest.mark.parametrize("K", [1, 3, 7])
def test_ragged_forced_acceptance_keeps_each_rows_state(ckpt, K):
    """Rows accept different counts in one step; a row accepts 0 right after K (and K after 0); rows join
    and leave (3 slots, 6 requests, different lengths): every row's state stays its own."""
    path, prompts, plain = ckpt
    mid = K // 2 + 1 if K > 1 else 1
    schedules = [[K, 0], [0, K], [mid, K, 0, 0], [K, K, 0], [0], [K, mid - 1, K]]
    engine, s = _checked_run(path, prompts, plain, K, schedules)
    _check_counters(s, K, engine.committed)
    assert s.num_accepted_hist[1] > 0 and s.num_accepted_hist[K + 1] > 0


# ---------------------------------------------------------------------------- PAD rows and bad counts


def _all_rows(engine, slot):
    """{(cache index, buffer name): the slot's row} of every cache buffer (rewind buffers included)."""
    layers = engine.cache.layers.items()
    return {(i, k): t[slot].clone() for i, lay in layers for k, t in vars(lay).items()
            if isinstance(t, torch.Tensor)}


@torch.inference_mode()
def test_pad_rows_of_verify_and_commit_never_touch_a_live_slot(ckpt):
    path, prompts, _ = ckpt
    K, T = 3, 4
    engines = [Engine.from_pretrained(path, EngineOptions(draft_len=K, max_batch_size=3,
                                                          max_seq_len=64)) for _ in range(2)]
    for e in engines:
        e.runner.prefill([prompts[0], prompts[1], prompts[2]], [0, 1, 2])
    torch.manual_seed(3)
    tokens = torch.randint(0, 5, (3, T))
    lens = torch.tensor([len(prompts[0]), 7, len(prompts[2])])
    live = [_all_rows(engines[0], s) for s in range(3)]
    with_pad, without = engines
    # rows 0 and 2 are slots 0 and 2; row 1 is PAD (slot 1 is live but not in this batch)
    slots = torch.tensor([0, -1, 2])
    h_pad = with_pad.model(tokens, with_pad.cache, BatchMeta.decode(slots, lens, T, verify=True))
    for bad in ([2, 0, 4], [2, 1, 5], [-1, 1, 1]):  # a PAD row's 0 is rejected like any other
        with pytest.raises(ValueError, match=r"\[1, T=4\]"):
            with_pad.cache.commit(slots, torch.tensor(bad))
    for s in range(3):  # a verify (and a rejected commit) changes no slot's committed state
        n = len(prompts[s])  # KV entries at positions >= the slot's length are not state yet
        for key, t in _all_rows(with_pad, s).items():
            kv = isinstance(with_pad.cache[key[0]], KVCache)
            if key[1] not in with_pad.cache[key[0]].spec_buffers:
                want = live[s][key]
                torch.testing.assert_close(t[:n] if kv else t, want[:n] if kv else want, rtol=0, atol=0)
    with_pad.cache.commit(slots, torch.tensor([2, 1, 4]))
    for key, t in _all_rows(with_pad, 1).items():  # the PAD row neither read nor wrote slot 1
        torch.testing.assert_close(t, live[1][key], rtol=0, atol=0)
    real = torch.tensor([0, 2])
    h = without.model(tokens[[0, 2]], without.cache, BatchMeta.decode(real, lens[[0, 2]], T, verify=True))
    without.cache.commit(real, torch.tensor([2, 4]))
    torch.testing.assert_close(h_pad[[0, 2]], h, atol=1e-5, rtol=1e-5)
    for s in (0, 2):
        for key, t in _all_rows(with_pad, s).items():
            torch.testing.assert_close(t, _all_rows(without, s)[key], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- memory report


def test_speculative_buffers_only_with_speculation(ckpt):
    path, _, _ = ckpt
    S, L = 2, 32
    plain = Engine.from_pretrained(path, EngineOptions(max_batch_size=S, max_seq_len=L))
    m0 = plain.cache_memory()
    assert set(m0) == {"ssm_state_bytes", "conv_state_bytes", "kv_cache_bytes", "spec_buffers_bytes"}
    assert m0["spec_buffers_bytes"] == 0 and not hasattr(plain, "_mtp_hidden")
    states = [l for l in plain.cache.layers.values() if isinstance(l, Mamba2State)]
    assert states and all(l.conv_steps is None and l.ssm_steps is None for l in states)
    assert all(getattr(l, b) is None for l in plain.cache.layers.values() for b in l.spec_buffers)
    c, R = plain.config, S + 1  # R: rows, the scratch row included
    H, P, N = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size
    C, W1 = c.mamba_conv_dim, c.conv_kernel - 1
    kv_layer = 2 * R * L * c.num_key_value_heads * c.head_dim * 4  # float32 k and v
    n_mamba, n_attn = len(states), c.layer_types.count("attention")
    assert m0["ssm_state_bytes"] == n_mamba * R * H * P * N * 4
    assert m0["conv_state_bytes"] == n_mamba * R * C * W1 * 4
    assert m0["kv_cache_bytes"] == n_attn * kv_layer
    spec = {
        K: Engine.from_pretrained(path, EngineOptions(draft_len=K, ssm_replay=K == 7, max_batch_size=S,
                                                      max_seq_len=L))
        for K in (3, 7)
    }
    for K, e in spec.items():
        m, T = e.cache_memory(), K + 1
        assert {k: m[k] for k in ("ssm_state_bytes", "conv_state_bytes")} == {
            k: m0[k] for k in ("ssm_state_bytes", "conv_state_bytes")
        }
        assert m["kv_cache_bytes"] == m0["kv_cache_bytes"] + kv_layer  # + the MTP attention's own KV cache
        if e.options.ssm_replay:  # K extra conv columns; history x, B, dt', dA_cumsum (2 x T); 3 slot ints
            G = c.n_groups
            commit = n_mamba * R * (C * K + 2 * T * (H * P + G * N) + 2 * 2 * H * T) * 4 + 3 * R * 4
        else:  # rewind: the conv window and the state after each of the T tokens
            commit = n_mamba * R * (C * (W1 + T) + T * H * P * N) * 4
        assert m["spec_buffers_bytes"] == commit + R * (c.hidden_size * 4 + 8)  # + first draft, MTP hidden
    with pytest.raises(ValueError, match="ssm_replay requires speculative decoding"):
        Engine.from_pretrained(path, EngineOptions(ssm_replay=True, max_batch_size=S, max_seq_len=L))


# ---------------------------------------------------------------------------- statistics


def test_generation_stats_raw_sums_and_derived_metrics():
    s = GenerationStats()
    assert s.acceptance_rate is None and s.acceptance_length is None and s.acceptance_per_position == []
    s.record_step([3, 0, 1], 3)
    s.record_step([2], 3)
    assert (s.drafted_tokens, s.accepted_drafts, s.request_steps) == (12, 6, 4)
    assert s.accepted_per_position == [3, 2, 1] and s.num_accepted_hist == [0, 1, 1, 1, 1]
    d = s.to_dict()
    assert d["acceptance_rate"] == 0.5 and d["acceptance_length"] == 2.5
    assert d["acceptance_per_position"] == [0.75, 0.5, 0.25]
    assert GenerationStats.from_dict(d) == s
    assert s.acceptance() == {"rate": 0.5, "length": 2.5, "per_position": [0.75, 0.5, 0.25], "drafted": 12,
                              "accepted": 6, "request_steps": 4, "accepted_per_position": [3, 2, 1],
                              "num_accepted_hist": [0, 1, 1, 1, 1]}
    total = s + GenerationStats.from_dict(d)
    assert total.accepted_per_position == [6, 4, 2] and total.acceptance_rate == 0.5
    with pytest.raises(ValueError, match=r"\[0, K=3\]"):
        s.record_step([4], 3)
    with pytest.raises(ValueError, match="K=3"):
        s.record_step([1], 2)
