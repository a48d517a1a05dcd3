"""Exact prefix caching (runners/engine/prefix_cache.py): with and without the cache, the same tokens and
the same
acceptance statistics, while the cache really serves the prefixes it should.

End to end, for both families (NemotronH: Mamba2, Qwen3-Next: Gated DeltaNet), float32, draft_len 0 and 3,
rewind and replay, with fewer slots than prompts (continuous batching, slot reuse), over three generate calls
on one engine (the cache outlives a call):
1. prompts X and Y sharing a block-aligned prefix of 96 tokens, and two prompts sharing nothing: Y waits for
   the admission after X's (PrefixCache.split_admission), whose prefill saves the junction, and hits 96;
2. a prompt with that block-aligned prefix (hit 96), and a prompt sharing 115 tokens (mid-block) with X
   (hit 96; its junction with X is saved at 115);
3. a prompt sharing those 115 tokens (hit 115, ending mid-block), a prompt that is entirely the cached
   prefix (hit 115 = the whole prompt), X again (the same prompt twice: hit = all of X), a prompt sharing
   nothing, each checked per request through on_finish's counters.
Then eviction under a tiny byte budget, and the cache's own rules (lookup, save points, eviction classes).
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint
from qwen_ckpt import write_qwen_checkpoint

from runners.engine import Engine
from runners.engine.options import EngineOptions
from runners.engine.prefix_cache import PrefixCache

V, BLOCK, SLOTS, MAX_NEW = 5, 16, 2, 8


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def ckpt(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "nemotron_h":
        return write_checkpoint(folder, make_hf_model(seed=3, vocab_size=V, pattern="M*MEM"), with_mtp=True)
    return write_qwen_checkpoint(folder / "ckpt", seed=3, vocab_size=V)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    base = rand(97)
    b96 = base[96]  # X, Y and "aligned" leave the shared 96 tokens with three different tokens
    x = base[:96] + [(b96 + 1) % V] + rand(23)
    return {
        "X": x,
        "Y": base[:96] + [(b96 + 2) % V] + rand(14),
        "N1": [(base[0] + 1) % V] + rand(60),
        "N2": [(base[0] + 2) % V] + rand(33),
        "aligned": base[:96] + [(b96 + 3) % V] + rand(9),
        "mid": x[:115] + [(x[115] + 1) % V] + rand(12),
        "mid2": x[:115] + [(x[115] + 2) % V] + rand(7),
        "entire": x[:115],
        "N3": [(base[0] + 3) % V] + rand(20),
    }


PHASES = [["X", "Y", "N1", "N2"], ["aligned", "mid"], ["mid2", "entire", "X", "N3"]]
EXPECTED_HITS = {  # prompt -> cached prefix length reused, per phase
    0: {"X": 0, "Y": 96, "N1": 0, "N2": 0},  # Y deferred behind X, which shares 96 uncached tokens
    1: {"aligned": 96, "mid": 96},
    2: {"mid2": 115, "entire": 115, "X": 120, "N3": 0},
}


def _engine(path, K, replay, prefix_cache):
    """replay: False (rewind), True (per-step replay) or "checkpointing" (Mamba2's checkpointing variant)."""
    options = EngineOptions(draft_len=K, ssm_replay=bool(replay), max_batch_size=SLOTS, max_seq_len=160,
                            prefix_cache=prefix_cache is not False,
                            ssm_replay_checkpointing=replay == "checkpointing")
    store = prefix_cache if isinstance(prefix_cache, PrefixCache) else None
    return Engine.from_pretrained(path, options, prefix_store=store)


def _acceptance(s):
    return (s.request_steps, s.drafted_tokens, s.accepted_drafts, s.accepted_per_position,
            s.num_accepted_hist)


@pytest.mark.parametrize("K, replay", [(0, False), (3, False), (3, True), (3, "checkpointing")])
def test_same_tokens_and_acceptance_with_and_without_the_cache(ckpt, K, replay):
    if replay == "checkpointing" and "qwen" in str(ckpt):
        pytest.skip("the checkpointing replay variant exists for Mamba2 only")
    prompts = _prompts()
    assert len(prompts["X"]) == 120 and len(prompts["entire"]) == 115
    cached = _engine(ckpt, K, replay, PrefixCache(block_tokens=BLOCK))
    plain = _engine(ckpt, K, replay, False)
    assert plain.prefix_cache is None
    for phase, names in enumerate(PHASES):
        batch = [prompts[n] for n in names]
        hits = {}

        def on_finish(i, toks, reason, rs, names=names, hits=hits):
            hits[names[i]] = rs

        out = cached.generate(batch, MAX_NEW, stop_token_ids=[], on_finish=on_finish)
        ref = plain.generate(batch, MAX_NEW, stop_token_ids=[])
        assert out.tokens == ref.tokens, f"phase {phase}"
        assert _acceptance(out.stats) == _acceptance(ref.stats), f"phase {phase}"
        assert {n: rs["prefix_cache_hit_tokens"] for n, rs in hits.items()} == EXPECTED_HITS[phase]
        s = out.stats
        assert s.prefix_cache_queries == len(batch) and s.prefix_cache_query_tokens == s.prompt_tokens
        assert s.prefix_cache_hit_tokens == sum(EXPECTED_HITS[phase].values())
        assert s.prefix_cache_hits == sum(v > 0 for v in EXPECTED_HITS[phase].values())
        assert ref.stats.prefix_cache_queries == 0 and ref.stats.prefix_cache_hit_rate is None
    if K:
        assert out.stats.accepted_drafts > 0  # drafting works off restored MTP caches
    # junctions: X / Y at 96 (block-aligned), mid / X at 115 (mid-block); prompt ends of every prompt
    pc = cached.prefix_cache
    assert pc.contains(prompts["X"][:96]) and pc.contains(prompts["X"][:115])
    assert pc.evictions == 0


@pytest.mark.parametrize("name, hit", [("X", 120), ("aligned", 96)])
def test_the_mtp_cache_of_the_prefix_is_restored(ckpt, name, hit):
    """After a hit (the whole prompt, or its first 96 tokens), the slot's MTP KV of the prompt (positions
    < hit - 1 restored, hit - 1 recomputed from the restored hidden), its target KV, first token, first draft
    and MTP hidden equal those of a full prefill."""
    prompts = _prompts()
    cached = _engine(ckpt, 3, False, PrefixCache(block_tokens=BLOCK))
    plain = _engine(ckpt, 3, False, False)
    cached.generate([prompts["X"], prompts["Y"]], 2, stop_token_ids=[])  # X's end, the X / Y junction
    p, L = prompts[name], len(prompts[name])
    assert len(cached.prefix_cache.lookup(p).tokens) == hit
    assert cached.runner.prefill([p], [1]).tokens == plain.runner.prefill([p], [1]).tokens
    attn = [i for i, layer in cached.cache.layers.items() if hasattr(layer, "k")]
    mtp = {b.cache_index for b in cached.model.mtp.blocks if b.kind == "attention"}
    assert mtp and mtp < set(attn)
    for idx in attn:
        got, want = cached.cache[idx], plain.cache[idx]
        torch.testing.assert_close(got.k[1, :L], want.k[1, :L], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.v[1, :L], want.v[1, :L], rtol=1e-5, atol=1e-5)
    assert torch.equal(cached.step.slots.draft1[1], plain.step.slots.draft1[1])
    torch.testing.assert_close(cached.step.slots.mtp_hidden[1], plain.step.slots.mtp_hidden[1], rtol=1e-5,
                               atol=1e-5)


def test_eviction_under_a_tiny_cache(ckpt):
    prompts = list(_prompts().values())
    probe = _engine(ckpt, 3, True, PrefixCache(block_tokens=BLOCK))
    probe.generate(prompts[:1], 1, stop_token_ids=[])
    entry_bytes = probe.prefix_cache.nbytes  # one prompt-end entry of X
    budget = 2 * entry_bytes
    cache = PrefixCache(max_bytes=budget, block_tokens=BLOCK)
    cached = _engine(ckpt, 3, True, cache)
    plain = _engine(ckpt, 3, True, False)
    out = cached.generate(prompts + prompts[:3], MAX_NEW, stop_token_ids=[])
    ref = plain.generate(prompts + prompts[:3], MAX_NEW, stop_token_ids=[])
    assert out.tokens == ref.tokens and _acceptance(out.stats) == _acceptance(ref.stats)
    assert out.stats.prefix_cache_evictions == cache.evictions > 0
    assert out.stats.prefix_cache_stores == cache.stores
    assert 0 < cache.nbytes <= budget and len(cache) >= 1
    # a budget of zero stores nothing and still generates the same tokens
    none = _engine(ckpt, 3, True, PrefixCache(max_bytes=0, block_tokens=BLOCK))
    assert none.generate(prompts, MAX_NEW, stop_token_ids=[]).tokens == ref.tokens[: len(prompts)]
    assert len(none.prefix_cache) == 0


def test_fp8_kv_cache_with_the_prefix_cache(ckpt, caplog):
    """An FP8 KV cache (float8 k / v, per-layer 0-dim scales that are no slot state) is saved and restored
    byte for byte: the same tokens and acceptance as without the cache, with the hits expected."""
    prompts = _prompts()
    kw = dict(draft_len=3, max_batch_size=SLOTS, max_seq_len=160, kv_cache_quant="fp8")
    cached = Engine.from_pretrained(ckpt, EngineOptions(**kw), prefix_store=PrefixCache(block_tokens=BLOCK))
    plain = Engine.from_pretrained(ckpt, EngineOptions(prefix_cache=False, **kw))
    assert cached.options.kv_cache_quant == "fp8"
    for eng in (cached, plain):  # per-tensor scales as a calibrated checkpoint brings them
        for layer in eng.cache.layers.values():
            if hasattr(layer, "k_scale"):
                layer.k_scale, layer.v_scale = torch.tensor(0.05), torch.tensor(0.04)
    for names in (["X", "Y"], ["aligned", "X"]):
        batch = [prompts[n] for n in names]
        out = cached.generate(batch, MAX_NEW, stop_token_ids=[])
        ref = plain.generate(batch, MAX_NEW, stop_token_ids=[])
        assert out.tokens == ref.tokens and _acceptance(out.stats) == _acceptance(ref.stats)
    assert out.stats.prefix_cache_hit_tokens == 96 + 120  # aligned: the X / Y junction; X: all of X


@pytest.mark.gpu
@pytest.mark.parametrize("K, replay", [(0, False), (3, False), (3, True)])
def test_gpu_cuda_graphs_same_tokens_with_and_without_the_cache(ckpt, K, replay):
    """On CUDA (Triton kernels, decode / verify as CUDA graphs, float32): the same tokens and acceptance with
    and without the cache over the three phases, with the hits expected."""
    prompts = _prompts()
    options = EngineOptions(draft_len=K, ssm_replay=replay, max_batch_size=SLOTS, max_seq_len=160,
                            cuda_graphs=True)
    store = PrefixCache(block_tokens=BLOCK)
    cached = Engine.from_pretrained(ckpt, options, device="cuda", prefix_store=store)
    plain = Engine.from_pretrained(ckpt, options.replace(prefix_cache=False), device="cuda")
    assert cached.step.cuda_graphs and plain.step.cuda_graphs
    for phase, names in enumerate(PHASES):
        batch = [prompts[n] for n in names]
        out = cached.generate(batch, MAX_NEW, stop_token_ids=[])
        ref = plain.generate(batch, MAX_NEW, stop_token_ids=[])
        assert out.tokens == ref.tokens, f"phase {phase}"
        assert _acceptance(out.stats) == _acceptance(ref.stats), f"phase {phase}"
        assert out.stats.prefix_cache_hit_tokens == sum(EXPECTED_HITS[phase].values())
    assert cached.graphs.graphs and all(cached.graphs.graphs.values())  # the steps ran as graphs


def test_off_where_not_exact_and_when_asked(ckpt):
    """Stochastic rounding of a 16-bit SSM state draws its bits per forward, which a cache hit skips: the
    engine turns the cache off and says why; prefix_cache=False and prefix_cache_bytes=0 say so too."""
    kw = dict(max_batch_size=SLOTS, max_seq_len=160)
    sr = Engine.from_pretrained(ckpt, EngineOptions(ssm_state_dtype="bfloat16", ssm_stochastic_rounding=True,
                                                    **kw))
    assert sr.prefix_cache is None and "stochastic_rounding" in sr.prefix_cache_off_reason
    off = Engine.from_pretrained(ckpt, EngineOptions(prefix_cache=False, **kw))
    assert off.prefix_cache is None and off.prefix_cache_off_reason == "runtime.prefix_cache=false"
    zero = Engine.from_pretrained(ckpt, EngineOptions(prefix_cache_bytes=0, **kw))  # could never store
    assert zero.prefix_cache is None
    assert zero.prefix_cache_off_reason.startswith("runtime.prefix_cache_bytes=0")
    on = Engine.from_pretrained(ckpt, EngineOptions(prefix_cache_bytes=4096, **kw))
    assert on.prefix_cache.max_bytes == 4096 and on.prefix_cache_off_reason is None
    with pytest.raises(ValueError, match="prefix_cache_bytes only without prefix_store"):
        Engine.from_pretrained(ckpt, EngineOptions(prefix_cache_bytes=4096, **kw), prefix_store=PrefixCache())


def test_exact_only_in_float32(ckpt):
    """In 16-bit compute the tokens and acceptance depend on where a prefill is cut, which a cache hit moves,
    and a 16-bit SSM state is rounded where a prefill stops: the engine keeps the cache only in float32
    compute with a float32 state, and names the dtype and the fix otherwise (issue 29)."""
    kw = dict(max_batch_size=SLOTS, max_seq_len=160)
    on = Engine.from_pretrained(ckpt, EngineOptions(dtype="float32", **kw))
    assert on.prefix_cache is not None and on.prefix_cache_off_reason is None
    for dtype in ("bfloat16", "float16"):
        off = Engine.from_pretrained(ckpt, EngineOptions(dtype=dtype, **kw))
        assert off.prefix_cache is None, dtype
        assert off.prefix_cache_off_reason.startswith(f"runtime.dtype={dtype}: in 16-bit compute"), dtype
        assert "run with runtime.dtype=float32" in off.prefix_cache_off_reason
    state = Engine.from_pretrained(ckpt, EngineOptions(ssm_state_dtype="bfloat16", **kw))
    assert state.prefix_cache is None
    assert state.prefix_cache_off_reason.startswith("model.ssm.state_dtype=bfloat16")
    assert "set model.ssm.state_dtype=float32" in state.prefix_cache_off_reason


def test_the_policy_has_one_owner():
    """prefix_cache_off_reason decides for the engine and the application alike, in a fixed order: what was
    asked, stochastic rounding, then exactness (tensor-parallel ranks keep theirs in lockstep: world size
    does not count, tests/test_tp.py)."""
    from runners.engine.prefix_cache import prefix_cache_off_reason

    assert prefix_cache_off_reason(EngineOptions()) is None
    assert prefix_cache_off_reason(EngineOptions(prefix_cache=False, dtype="bfloat16")) == \
        "runtime.prefix_cache=false"
    assert prefix_cache_off_reason(EngineOptions(dtype="bfloat16")).startswith("runtime.dtype=bfloat16")
    # the checkpoint's state dtype counts where the options leave it to the checkpoint
    assert prefix_cache_off_reason(EngineOptions(), ssm_state_dtype="float16").startswith(
        "model.ssm.state_dtype=float16")
    f32_state = EngineOptions(ssm_state_dtype="float32")
    assert prefix_cache_off_reason(f32_state, ssm_state_dtype="float16") is None


# ------------------------------------------------------------------ the cache's own rules (no model)


def _fake_entry_cache(cache: PrefixCache, tokens, nbytes: int, shared: bool) -> bool:
    """Store an entry of ``nbytes`` bytes (its hidden) for ``tokens`` through the save path of a cache with no
    layers."""

    class NoLayers:
        layers = {}

    return cache.save(NoLayers(), 0, tokens, torch.zeros(nbytes // 4), shared)


def test_lookup_finds_the_longest_cached_prefix_at_token_granularity():
    c = PrefixCache(max_bytes=10**6, block_tokens=4)
    seq = list(range(30))
    for L in (3, 8, 13):
        assert _fake_entry_cache(c, seq[:L], 16, shared=True)
    assert c.lookup(seq) is not None and len(c.lookup(seq).tokens) == 13
    assert len(c.lookup(seq[:12]).tokens) == 8  # 13 is longer than the prompt
    assert len(c.lookup(seq[:8]).tokens) == 8  # a prompt that is entirely a cached prefix
    assert len(c.lookup(seq[:5]).tokens) == 3
    assert c.lookup([1] + seq[1:]) is None  # differs at token 0
    assert len(c.lookup(seq[:10] + [99, 98, 97, 96]).tokens) == 8  # diverges at 10, mid-block


def test_prompts_sharing_an_uncached_prefix_are_not_admitted_together():
    """split_admission: a prompt sharing >= block_tokens uncached tokens with an earlier one waits for the
    next admission, and is remembered so the earlier one's prefill saves the junction; a stored junction, a
    short common prefix or a lone prompt defers nothing."""
    c = PrefixCache(block_tokens=4)
    shared = [5, 6, 7, 8, 9, 1]
    a, b, d = shared + [2, 2], shared + [3], [9, 9, 9, 9, 9]
    assert c.split_admission([a, b, d]) == ([0, 2], [1])
    assert c.save_points([a, d], [0, 0])[0] == {8: False, 6: True}  # junction with the deferred b at 6
    assert c.split_admission([[1, 2, 3, 4, 5], [1, 2, 3, 9]]) == ([0, 1], [])  # 3 < block_tokens shared
    assert c.split_admission([a]) == ([0], [])
    _fake_entry_cache(c, shared, 10, shared=True)
    assert c.split_admission([a, b]) == ([0, 1], [])  # the junction is stored: both restore it


def test_save_points_are_prompt_ends_and_junctions():
    c = PrefixCache(max_bytes=10**6, block_tokens=4)
    a, b = list(range(20)), list(range(10)) + [50, 51, 52]
    points = c.save_points([a, b], cached=[0, 0])
    assert points == [{20: False, 10: True}, {13: False, 10: True}]
    # a later prompt meets the recent ones: its junction with `a` (16 tokens) is new, but must add a block
    d = list(range(16)) + [70]
    assert c.save_points([d], cached=[0]) == [{17: False, 16: True}]
    assert c.save_points([d], cached=[13]) == [{17: False}]  # 16 < 13 + block: not worth an entry


def test_eviction_classes_keep_shared_prefixes():
    c = PrefixCache(max_bytes=100, block_tokens=4)
    assert _fake_entry_cache(c, [1, 2, 3], 40, shared=True)  # a junction
    assert _fake_entry_cache(c, [1, 2, 3, 4, 5], 40, shared=False)  # a prompt end
    assert _fake_entry_cache(c, [7, 7], 40, shared=False)  # evicts the older prompt end, not the junction
    assert c.contains([1, 2, 3]) and not c.contains([1, 2, 3, 4, 5]) and c.contains([7, 7])
    assert c.evictions == 1
    assert not _fake_entry_cache(c, [8], 80, shared=False)  # would need the junction's room: not stored
    assert c.contains([1, 2, 3]) and c.evictions == 1
    assert _fake_entry_cache(c, [9], 80, shared=True)  # a shared newcomer may evict anything, LRU first
    assert not c.contains([1, 2, 3]) and not c.contains([7, 7]) and c.contains([9]) and c.nbytes == 80
    assert not _fake_entry_cache(c, [5], 104, shared=True)  # larger than the whole budget
    c = PrefixCache(max_bytes=100, block_tokens=4)
    assert _fake_entry_cache(c, [7, 7], 40, shared=False) and _fake_entry_cache(c, [6], 40, shared=False)
    assert len(c.lookup([7, 7, 1]).tokens) == 2  # a hit promotes a prompt end to shared ...
    assert _fake_entry_cache(c, [5], 40, shared=False)  # ... so the other prompt end goes first
    assert c.contains([7, 7]) and not c.contains([6])
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)
