"""Model-level invariants of the engine against transformers' NemotronHForCausalLM (the oracle).

- full-forward logits match the oracle on tiny configs with every block kind (awkward sizes, n_groups > 1,
  GQA, latent and plain MoE, group-limited routing);
- the chunked SSD scan equals the token-by-token recurrence;
- chunked prefill (right-padded batch of different lengths) + step-by-step decode equals one full forward;
- PAD rows (slot -1) never touch a live slot;
- the cached attention (GQA heads folded for few queries) equals plain attention; a fresh prefill (every
  row from position 0) equals the general cached path.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint

from kernels.mamba2 import ssd_chunked_scan, ssm_recurrent_scan
from runners.engine.cache import HybridCache
from runners.engine.loader import load_model
from runners.engine.models.config import HybridConfig
from runners.engine.models.mamba2 import Mamba2State
from runners.engine.state import BatchMeta

VARIANTS = {
    "latent_moe": dict(pattern="M*EM-E"),
    "plain_moe_grouped_router": dict(
        pattern="ME*-M",
        moe_latent_size=None,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_groups=3,
        mamba_num_heads=6,
        chunk_size=5,
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(transformers model, our model) with the same weights, loaded through a checkpoint on disk."""
    kw = dict(VARIANTS[request.param])
    hf = make_hf_model(seed=3, **kw)
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), hf, with_mtp=False)
    return hf, load_model(path)


@torch.inference_mode()
def test_full_forward_logits_match_transformers(pair):
    hf, ours = pair
    torch.manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (3, 23))
    ref = hf(ids).logits
    got = ours.lm_logits(ours(ids))
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ref.abs().max() > 1.0  # the random weights give informative logits, not ~0
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (16, 8), (29, 7)])
def test_chunked_scan_equals_recurrence(T, chunk):
    torch.manual_seed(T)
    b, H, P, G, N = 2, 6, 5, 3, 7
    x = torch.randn(b, T, H, P)
    dt = torch.rand(b, T, H)
    dt[1, T // 2 :] = 0.0  # right padding: the state must pass through unchanged
    A = -torch.rand(H) * 3
    B, C = torch.randn(b, T, G, N), torch.randn(b, T, G, N)
    h0 = torch.randn(b, H, P, N)
    y_ref, h_ref, states = ssm_recurrent_scan(x, dt, A, B, C, h0, return_intermediate=True)
    y, h = ssd_chunked_scan(x, dt, A, B, C, chunk, h0)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[:, -1], h_ref)
    if T > 1:
        torch.testing.assert_close(h_ref[1], states[1, T // 2 - 1])  # padded columns left the state alone


@torch.inference_mode()
def test_chunked_prefill_then_decode_equals_full_forward(pair):
    _, model = pair
    cfg = model.config
    torch.manual_seed(1)
    lengths, total = [11, 4, 8], 17  # prompt lengths; each row then decodes up to `total` tokens
    seqs = torch.randint(0, cfg.vocab_size, (len(lengths), total))
    full = model.lm_logits(model(seqs))
    cache = HybridCache(cfg, model.cache_kinds(), max_batch_size=4, max_seq_len=32, dtype=torch.float32)
    slots = torch.tensor([2, 0, 3])  # slot 0 is a live slot like any other
    cache.reset(slots)
    plen = torch.tensor(lengths)
    # Prefill in column chunks of 5: rows are right-padded and continue from their cached state.
    for c0 in range(0, max(lengths), 5):
        width = min(5, max(lengths) - c0)
        meta = BatchMeta(slots, torch.full_like(slots, c0), (plen - c0).clamp(0, width))
        hidden = model(seqs[:, c0 : c0 + width], cache, meta)
        for b, n in enumerate(lengths):
            if c0 < n <= c0 + width:
                torch.testing.assert_close(
                    model.lm_logits(hidden[b, n - 1 - c0]), full[b, n - 1], atol=1e-4, rtol=1e-4
                )
    # Decode one token per step for every row (rows sit at different positions).
    pos = plen.clone()
    while int(pos.min()) < total:
        live = pos < total
        rows = live.nonzero().flatten()
        meta = BatchMeta.decode(slots[rows], pos[rows])
        hidden = model(seqs[rows, pos[rows]][:, None], cache, meta)
        torch.testing.assert_close(model.lm_logits(hidden[:, 0]), full[rows, pos[rows]], atol=1e-4, rtol=1e-4)
        pos[rows] += 1


def _buffers(layer) -> list[torch.Tensor]:
    return [t.clone() for t in vars(layer).values() if isinstance(t, torch.Tensor)]


@torch.inference_mode()
def test_pad_rows_never_touch_live_slots(pair):
    _, model = pair
    cfg = model.config
    cache = HybridCache(cfg, model.cache_kinds(), max_batch_size=2, max_seq_len=16, dtype=torch.float32)
    torch.manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    model(ids, cache, BatchMeta(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.tensor([6, 6])))
    snapshot = {i: _buffers(layer) for i, layer in cache.layers.items()}
    tok = torch.randint(0, cfg.vocab_size, (3, 1))
    # Row 0 and 2 are PAD; only row 1 (slot 1) is real.
    out = model(tok, cache, BatchMeta.decode(torch.tensor([-1, 1, -1]), torch.tensor([0, 6, 3])))
    for i, layer in cache.layers.items():
        for before, after in zip(snapshot[i], _buffers(layer)):
            torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)  # slot 0 untouched
    # Slot 1 got exactly what a batch of only that row produces.
    cache2 = HybridCache(cfg, model.cache_kinds(), max_batch_size=2, max_seq_len=16, dtype=torch.float32)
    model(
        ids, cache2, BatchMeta(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.tensor([6, 6]))
    )
    alone = model(tok[1:2], cache2, BatchMeta.decode(torch.tensor([1]), torch.tensor([6])))
    torch.testing.assert_close(out[1], alone[0], atol=1e-5, rtol=1e-5)


def test_cache_rejects_bad_slot_ids_and_reports_memory():
    hf = make_hf_model(seed=0)
    cfg = HybridConfig.from_dict(hf.config.to_dict())
    kinds = {0: "mamba2", 1: "attention"}
    cache = HybridCache(
        cfg, kinds, max_batch_size=3, max_seq_len=10, dtype=torch.float32, ssm_state_dtype=torch.bfloat16
    )
    with pytest.raises(ValueError, match="out of range"):
        cache.reset(torch.tensor([3]))
    with pytest.raises(ValueError, match="out of range"):
        cache.reset(torch.tensor([-2]))
    mem = cache.memory()
    state = cache[0]
    assert isinstance(state, Mamba2State) and state.ssm.dtype == torch.bfloat16
    assert mem["ssm_state_bytes"] == 4 * cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * 2
    assert mem["conv_state_bytes"] == 4 * cfg.mamba_conv_dim * (cfg.conv_kernel - 1) * 4
    assert mem["kv_cache_bytes"] == 2 * 4 * 10 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert mem["spec_buffers_bytes"] == 0


@torch.inference_mode()
def test_verify_then_rewind_commit_equals_decoding_only_accepted_tokens(pair):
    """A T-token verify keeps per-token states; commit(n) must equal having decoded only n tokens."""
    _, model = pair
    cfg = model.config
    T, S = 4, 3
    torch.manual_seed(4)
    prompt = torch.randint(0, cfg.vocab_size, (S, 6))
    drafts = torch.randint(0, cfg.vocab_size, (S, T))
    nxt = torch.randint(0, cfg.vocab_size, (S, 1))
    slots, zeros = torch.arange(S), torch.zeros(S, dtype=torch.long)
    num_accepted = torch.tensor([1, 4, 2])  # 1 (only the bonus position) .. T

    spec = HybridCache(
        cfg, model.cache_kinds(), max_batch_size=S, max_seq_len=16, dtype=torch.float32, spec_tokens=T
    )
    model(prompt, spec, BatchMeta(slots, zeros, torch.full((S,), 6)))
    committed = {i: l.ssm.clone() for i, l in spec.layers.items() if isinstance(l, Mamba2State)}
    verify_hidden = model(drafts, spec, BatchMeta.decode(slots, torch.full((S,), 6), T, verify=True))
    for i, ssm in committed.items():  # a verify step leaves the committed state alone
        torch.testing.assert_close(spec[i].ssm, ssm, rtol=0, atol=0)
    spec.commit(slots, num_accepted)
    after_spec = model(nxt, spec, BatchMeta.decode(slots, 6 + num_accepted))

    for b in range(S):  # reference: a fresh cache that only ever saw the accepted tokens
        n = int(num_accepted[b])
        ref = HybridCache(cfg, model.cache_kinds(), max_batch_size=1, max_seq_len=16, dtype=torch.float32)
        one = torch.tensor([0])
        model(prompt[b : b + 1], ref, BatchMeta(one, torch.tensor([0]), torch.tensor([6])))
        acc_hidden = model(drafts[b : b + 1, :n], ref, BatchMeta(one, torch.tensor([6]), torch.tensor([n])))
        torch.testing.assert_close(verify_hidden[b, :n], acc_hidden[0], atol=1e-4, rtol=1e-4)
        out = model(nxt[b : b + 1], ref, BatchMeta.decode(one, torch.tensor([6 + n])))
        torch.testing.assert_close(after_spec[b], out[0], atol=1e-4, rtol=1e-4)

    with pytest.raises(ValueError, match=r"\[1, T=4\]"):
        spec.commit(slots, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"\[1, T=4\]"):
        spec.commit(slots, torch.tensor([5, 1, 1]))
    with pytest.raises(ValueError, match="spec_tokens = T"):  # a verify of T != spec_tokens
        model(drafts[:, :2], spec, BatchMeta.decode(slots, torch.full((S,), 6), 2, verify=True))
    with pytest.raises(ValueError, match="spec_tokens"):
        HybridCache(cfg, model.cache_kinds(), max_batch_size=1, max_seq_len=4, dtype=torch.float32).commit(
            torch.tensor([0]), torch.tensor([1])
        )


@torch.inference_mode()
def test_kv_bound_above_the_true_length_gives_the_same_step(pair):
    """BatchMeta.max_kv_len is an upper bound (a CUDA-graph step passes its captured bucket): reading more
    cached positions, masked by position, gives what the exact length gives (None: computed)."""
    _, model = pair
    cfg = model.config
    torch.manual_seed(6)
    ids = torch.randint(0, cfg.vocab_size, (3, 5))
    tok = torch.randint(0, cfg.vocab_size, (2, 1))
    outs = []
    for bound in (None, 5, 8):
        cache = HybridCache(cfg, model.cache_kinds(), max_batch_size=3, max_seq_len=8, dtype=torch.float32)
        slots = torch.arange(3)
        model(ids, cache, BatchMeta(slots, torch.zeros(3, dtype=torch.long), torch.tensor([5, 3, 4])))
        meta = BatchMeta.decode(slots[1:], torch.tensor([3, 4]), max_kv_len=bound)
        outs.append((model(tok, cache, meta), [b.clone() for b in _buffers(cache[0])]))
    for out, bufs in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=1e-6, atol=1e-6)
        for a, b in zip(bufs, outs[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@torch.inference_mode()
def test_consecutive_rows_read_as_views_give_the_same_step(pair):
    """BatchMeta.row_start (an eager step over consecutive slots: attention reads the KV rows as views of the
    cache instead of gathered copies) gives bit for bit the hidden states and cache of the gather."""
    _, model = pair
    cfg = model.config
    torch.manual_seed(8)
    ids = torch.randint(0, cfg.vocab_size, (3, 6))
    tok = torch.randint(0, cfg.vocab_size, (2, 3))
    outs = []
    for row_start in (None, 1):
        cache = HybridCache(cfg, model.cache_kinds(), max_batch_size=3, max_seq_len=12, dtype=torch.float32)
        slots = torch.arange(3)
        model(ids, cache, BatchMeta(slots, torch.zeros(3, dtype=torch.long), torch.tensor([6, 3, 5])))
        meta = BatchMeta.decode(slots[1:], torch.tensor([3, 5]), 3, max_kv_len=9, row_start=row_start)
        outs.append((model(tok, cache, meta), [_buffers(layer) for layer in cache.layers.values()]))
    assert torch.equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _reference_attention(q, keys, values, pos):
    """Plain softmax attention, each query head over its KV head (h // G), keys at positions <= pos."""
    G = q.shape[2] // keys.shape[2]
    k = keys.repeat_interleave(G, dim=2).transpose(1, 2)  # (B, Hq, S, hd)
    v = values.repeat_interleave(G, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, Hq, T, S)
    allowed = torch.arange(keys.shape[1])[None, None, :] <= pos[:, :, None]  # (B, T, S)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, T, Hq, hd)


@pytest.mark.parametrize("T", [1, 4, 17])  # 17 > _FOLD_GQA_MAX_T: the enable_gqa path
@pytest.mark.parametrize("Hq,KVH", [(6, 2), (4, 4), (8, 1)])
def test_cached_attention_equals_reference(T, Hq, KVH):
    """The decode / verify attention (GQA heads folded into the query axis for few queries) equals plain
    per-head attention, rows at different positions."""
    from runners.engine.models.attention import _cached_attention

    torch.manual_seed(T * 10 + Hq)
    B, S, hd = 3, 40, 8
    q = torch.randn(B, T, Hq, hd)
    keys, values = torch.randn(B, S, KVH, hd), torch.randn(B, S, KVH, hd)
    pos = torch.tensor([0, 9, S - T])[:, None] + torch.arange(T)  # row 0 sees 1..T keys, row 2 all S
    got = _cached_attention(q, keys, values, pos)
    assert got.shape == (B, T, Hq, hd)
    torch.testing.assert_close(got, _reference_attention(q, keys, values, pos), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_fresh_prefill_equals_the_cached_path(pair):
    """BatchMeta.fresh (every row from position 0: attention over this forward's keys, plain causal mask)
    gives the same hidden states and cache as the general path, right-padded rows included."""
    _, model = pair
    cfg = model.config
    torch.manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    slots, lengths = torch.tensor([2, 0, 1]), torch.tensor([9, 4, 7])
    outs = []
    for fresh in (False, True):
        cache = HybridCache(cfg, model.cache_kinds(), max_batch_size=3, max_seq_len=12, dtype=torch.float32)
        meta = BatchMeta(slots, torch.zeros(3, dtype=torch.long), lengths, fresh=fresh)
        hidden = model(ids, cache, meta)
        outs.append(([hidden[b, :n] for b, n in enumerate(lengths.tolist())], cache))
    for a, b in zip(outs[0][0], outs[1][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for i, layer in outs[0][1].layers.items():
        for a, b in zip(_buffers(layer), _buffers(outs[1][1].layers[i])):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the same keys / states were written
