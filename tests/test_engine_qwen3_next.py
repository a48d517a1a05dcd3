"""Qwen3-Next through the shared engine, against transformers' Qwen3NextForCausalLM (the oracle), float32.

- config: both config.json dialects give the same layout (GDN / gated attention blocks + MoE / SwiGLU FFNs);
- full-forward logits within 1e-4 of the oracle (chunked GDN prefill, chunk sizes that do not divide T);
- the cached GDN state is the oracle's transposed ([HV, V, K] vs [HV, K, V], with K != V) and its conv window
  the oracle's last W - 1 inputs;
- chunked, right-padded prefill + step-by-step decode equals one full forward;
- a verify step then a rewind commit leaves the GDN state (and the next outputs) of decoding only the
  accepted tokens;
- greedy generation (continuous batching, chunked prefill) equals the oracle's greedy tokens;
- the `mtp.*` weights load under the released names and one MTP step equals a reference assembled from
  transformers' own Qwen3-Next layers; MTP speculative greedy (K = 1, 3) equals plain greedy;
- loader and config errors name the problem.
"""

from __future__ import annotations

import json
import shutil

import pytest
import test_engine_mtp as mtp_tests
import torch
from qwen_ckpt import QWEN_TINY, load_hf, write_qwen_checkpoint
from safetensors.torch import load_file, save_file

from runners.engine import Engine
from runners.engine.cache import HybridCache
from runners.engine.loader import CheckpointError, load_model
from runners.engine.models.config import HybridConfig
from runners.engine.models.gdn import GDNMixer, GDNState
from runners.engine.options import EngineOptions
from runners.engine.state import BatchMeta

MAX_NEW = 8
PROMPT_LENS = (7, 1, 19, 12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_qwen_checkpoint(tmp_path_factory.mktemp("qwen") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt)


def _close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def _gdn_layers(model) -> dict[int, int]:
    """{cache_index: transformers layer index} of the GDN blocks (block 2i is layer i's mixer)."""
    return {b.cache_index: i // 2 for i, b in enumerate(model.layers) if b.kind == "gdn"}


def test_both_config_dialects_parse_to_the_same_layout(ckpt):
    cfg = HybridConfig.from_pretrained(ckpt)
    assert cfg.family == "qwen3_next" and cfg.norm_weight_offset == 1.0
    assert cfg.layer_types == ("gdn", "moe", "attention", "moe", "gdn", "mlp", "gdn", "moe")
    assert cfg.mtp_layer_types == ("attention", "moe") and cfg.num_nextn_predict_layers == 1
    assert (cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim) == (
        2, 4, 12, 20,
    )
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (1e4, 0.25) and cfg.attn_output_gate and cfg.qk_norm
    # released dialect: no layer_types (full_attention_interval), top-level RoPE fields, no MTP field
    raw = json.loads((ckpt / "config.json").read_text())
    raw.pop("layer_types")
    rope = raw.pop("rope_parameters")
    raw.update(full_attention_interval=2, rope_theta=rope["rope_theta"], partial_rotary_factor=0.25)
    released = HybridConfig.from_dict(raw)
    assert released.layer_types == ("gdn", "moe", "attention", "moe", "gdn", "mlp", "attention", "moe")
    assert (released.rope_theta, released.partial_rotary_factor, released.mtp_layer_types) == (
        1e4, 0.25, ("attention", "moe"),
    )


@torch.inference_mode()
def test_full_forward_logits_match_transformers(ckpt, hf, model):
    torch.manual_seed(0)
    ids = torch.randint(0, QWEN_TINY["vocab_size"], (3, 37))
    ref = hf(ids).logits
    assert ref.abs().max() > 1.0  # informative logits, not ~0
    _close(model.lm_logits(model(ids)), ref)
    gdn = [m for m in model.modules() if isinstance(m, GDNMixer)]
    try:
        for m in gdn:
            m.chunk_size = 16  # does not divide T = 37
        _close(model.lm_logits(model(ids)), ref)
    finally:
        for m in gdn:
            m.chunk_size = model.config.gdn_chunk_size
    engine = Engine.from_pretrained(ckpt, EngineOptions(max_batch_size=2, max_seq_len=64))
    _close(engine.logits(ids[:2, :20]), ref[:2, :20])


@torch.inference_mode()
def test_cached_gdn_state_is_transformers_state_transposed(hf, model):
    """Our state is [HV, V, K] (K contiguous), transformers' [HV, K, V]; K = 12 != V = 20, so a transposed
    state cannot pass. The conv window keeps the last W - 1 inputs (transformers keeps W)."""
    cfg = model.config
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    ref_cache = hf(ids, use_cache=True).past_key_values
    cache = HybridCache(cfg, model.cache_kinds(), max_batch_size=3, max_seq_len=32, dtype=torch.float32)
    slots = torch.tensor([2, 0])
    cache.reset(slots)
    model(ids, cache, BatchMeta.decode(slots, torch.zeros(2, dtype=torch.long), 23))
    for idx, layer in _gdn_layers(model).items():
        state = cache[idx]
        assert isinstance(state, GDNState)
        assert state.ssm.shape == (4, cfg.gdn_num_value_heads, cfg.gdn_value_head_dim, cfg.gdn_key_head_dim)
        _close(state.ssm[slots], ref_cache.get_recurrent_state(layer, state_idx=0).transpose(-1, -2))
        _close(state.conv[slots], ref_cache.get_conv_state(layer, state_idx=0)[..., 1:])


@torch.inference_mode()
def test_chunked_prefill_then_decode_equals_full_forward(model):
    cfg = model.config
    torch.manual_seed(2)
    lengths, total = [11, 4, 8], 17
    seqs = torch.randint(0, cfg.vocab_size, (len(lengths), total))
    full = model.lm_logits(model(seqs))
    cache = HybridCache(cfg, model.cache_kinds(), max_batch_size=4, max_seq_len=32, dtype=torch.float32)
    slots = torch.tensor([2, 0, 3])
    cache.reset(slots)
    plen = torch.tensor(lengths)
    for c0 in range(0, max(lengths), 5):  # right-padded column chunks of 5, rows continue from their state
        width = min(5, max(lengths) - c0)
        meta = BatchMeta(slots, torch.full_like(slots, c0), (plen - c0).clamp(0, width))
        hidden = model(seqs[:, c0 : c0 + width], cache, meta)
        for b, n in enumerate(lengths):
            if c0 < n <= c0 + width:
                _close(model.lm_logits(hidden[b, n - 1 - c0]), full[b, n - 1])
    pos = plen.clone()
    while int(pos.min()) < total:
        rows = (pos < total).nonzero().flatten()
        hidden = model(seqs[rows, pos[rows]][:, None], cache, BatchMeta.decode(slots[rows], pos[rows]))
        _close(model.lm_logits(hidden[:, 0]), full[rows, pos[rows]])
        pos[rows] += 1


@torch.inference_mode()
def test_verify_then_rewind_commit_equals_decoding_only_accepted_tokens(model):
    cfg = model.config
    T, S = 4, 3
    torch.manual_seed(4)
    prompt = torch.randint(0, cfg.vocab_size, (S, 6))
    drafts = torch.randint(0, cfg.vocab_size, (S, T))
    nxt = torch.randint(0, cfg.vocab_size, (S, 1))
    slots, zeros = torch.arange(S), torch.zeros(S, dtype=torch.long)
    num_accepted = torch.tensor([1, 4, 2])
    kinds = model.cache_kinds()
    spec = HybridCache(cfg, kinds, max_batch_size=S, max_seq_len=16, dtype=torch.float32, spec_tokens=T)
    model(prompt, spec, BatchMeta(slots, zeros, torch.full((S,), 6)))
    gdn = _gdn_layers(model)
    committed = {i: (spec[i].ssm.clone(), spec[i].conv.clone()) for i in gdn}
    verify_hidden = model(drafts, spec, BatchMeta.decode(slots, torch.full((S,), 6), T, verify=True))
    for i, (ssm, conv) in committed.items():  # a verify step leaves the committed state alone
        assert torch.equal(spec[i].ssm, ssm) and torch.equal(spec[i].conv, conv)
    spec.commit(slots, num_accepted)
    committed = {i: (spec[i].ssm.clone(), spec[i].conv.clone()) for i in gdn}
    after_spec = model(nxt, spec, BatchMeta.decode(slots, 6 + num_accepted))
    for b in range(S):  # reference: a cache that only ever saw the accepted tokens
        n, one = int(num_accepted[b]), torch.tensor([0])
        ref = HybridCache(cfg, kinds, max_batch_size=1, max_seq_len=16, dtype=torch.float32)
        model(prompt[b : b + 1], ref, BatchMeta(one, torch.tensor([0]), torch.tensor([6])))
        acc = model(drafts[b : b + 1, :n], ref, BatchMeta(one, torch.tensor([6]), torch.tensor([n])))
        _close(verify_hidden[b, :n], acc[0])
        for i, (ssm, conv) in committed.items():
            _close(ssm[b], ref[i].ssm[0], tol=1e-5)
            _close(conv[b], ref[i].conv[0], tol=1e-5)
        _close(after_spec[b], model(nxt[b : b + 1], ref, BatchMeta.decode(one, torch.tensor([6 + n])))[0])
    with pytest.raises(ValueError, match="spec_tokens = T"):
        model(drafts[:, :2], spec, BatchMeta.decode(slots, torch.full((S,), 6), 2, verify=True))


def _oracle_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        out.append(int(hf(ids).logits[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


@torch.inference_mode()
def test_greedy_generate_matches_transformers(ckpt, hf):
    torch.manual_seed(11)
    prompts = [torch.randint(3, QWEN_TINY["vocab_size"], (n,)).tolist() for n in PROMPT_LENS]
    expected = [_oracle_greedy(hf, p, MAX_NEW) for p in prompts]
    ref = hf.generate(torch.tensor([prompts[2]]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    assert ref[0, len(prompts[2]) :].tolist() == expected[2]
    # 2 slots for 4 prompts (requests join as others leave) and prefill chunks of 6 tokens
    engine = Engine.from_pretrained(ckpt, EngineOptions(max_batch_size=2, max_seq_len=64,
                                                        prefill_chunk_tokens=6, prefill_max_rows=2))
    out = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert out.tokens == expected and out.finish_reasons == ["length"] * len(prompts)
    mem = engine.cache_memory()
    assert mem["ssm_state_bytes"] == 3 * 3 * 4 * 20 * 12 * 4  # 3 GDN layers x (S + 1) rows x HV V K fp32
    assert mem["spec_buffers_bytes"] == 0


# ------------------------------------------------------------------------------------------------ MTP


def test_mtp_weights_load_with_checkpoint_names(ckpt, model):
    want = load_file(str(ckpt / "model.safetensors"))
    mtp = model.mtp
    pairs = {
        "mtp.fc.weight": mtp.eh_proj.weight,
        "mtp.pre_fc_norm_embedding.weight": mtp.enorm.weight,
        "mtp.pre_fc_norm_hidden.weight": mtp.hnorm.weight,
        "mtp.norm.weight": mtp.final_norm.weight,
        "mtp.layers.0.input_layernorm.weight": mtp.blocks[0].norm.weight,
        "mtp.layers.0.self_attn.q_proj.weight": mtp.blocks[0].mixer.q_proj.weight,
        "mtp.layers.0.self_attn.k_norm.weight": mtp.blocks[0].mixer.k_norm.weight,
        "mtp.layers.0.post_attention_layernorm.weight": mtp.blocks[1].norm.weight,
        "mtp.layers.0.mlp.gate.weight": mtp.blocks[1].mixer.gate.weight,
        "mtp.layers.0.mlp.experts.3.gate_proj.weight": mtp.blocks[1].mixer.experts_gate[3],
        "mtp.layers.0.mlp.experts.5.down_proj.weight": mtp.blocks[1].mixer.experts_down[5],
        "mtp.layers.0.mlp.shared_expert.up_proj.weight": mtp.blocks[1].mixer.shared_experts.up_proj.weight,
        "mtp.layers.0.mlp.shared_expert_gate.weight": mtp.blocks[1].mixer.shared_expert_gate.weight,
    }
    assert mtp.eh_proj.weight.shape == (48, 96)
    for name, got in pairs.items():
        assert torch.equal(got, want[name]), name
    assert load_model(ckpt, load_mtp=False).mtp is None


@torch.inference_mode()
def test_mtp_step_matches_a_reference_built_from_transformers_layers(ckpt, hf, model):
    """x = fc(cat[norm_e(embed(tok)), norm_h(h)]); x = decoder_layer(x); out = norm(x) -- with transformers'
    own Qwen3NextDecoderLayer / RMSNorm / rotary modules holding the checkpoint's mtp.* weights."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_q

    one_layer = {"num_hidden_layers": 1, "layer_types": ["full_attention"], "mlp_only_layers": []}
    config = hf.config.__class__.from_dict({**hf.config.to_dict(), **one_layer})
    config._attn_implementation = "eager"
    t = load_file(str(ckpt / "model.safetensors"))
    layer = hf_q.Qwen3NextDecoderLayer(config, 0).eval()
    prefix, E = "mtp.layers.0.", config.num_experts
    state = {k[len(prefix) :]: v for k, v in t.items() if k.startswith(prefix) and ".experts." not in k}
    expert = lambda e, w: t[f"{prefix}mlp.experts.{e}.{w}_proj.weight"]  # noqa: E731
    # transformers fuses the per-expert checkpoint tensors: gate_up_proj [E, 2I, D], down_proj [E, D, I]
    gate_up = [torch.cat([expert(e, "gate"), expert(e, "up")]) for e in range(E)]
    state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["mlp.experts.down_proj"] = torch.stack([expert(e, "down") for e in range(E)])
    layer.load_state_dict(state)
    D, eps = config.hidden_size, config.rms_norm_eps
    norm_e, norm_h, norm = (hf_q.Qwen3NextRMSNorm(D, eps) for _ in range(3))
    norm_e.weight.copy_(t["mtp.pre_fc_norm_embedding.weight"])
    norm_h.weight.copy_(t["mtp.pre_fc_norm_hidden.weight"])
    norm.weight.copy_(t["mtp.norm.weight"])
    rotary = hf_q.Qwen3NextRotaryEmbedding(config)
    torch.manual_seed(5)
    T = 9
    tok = torch.randint(0, config.vocab_size, (2, T))
    h_prev = torch.randn(2, T, D)
    x = torch.cat([norm_e(hf.model.embed_tokens(tok)), norm_h(h_prev)], dim=-1) @ t["mtp.fc.weight"].T
    pos = torch.arange(T)[None].expand(2, T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    ref = norm(layer(x, position_embeddings=rotary(x, pos), attention_mask=causal, position_ids=pos))
    _close(model.mtp(model.embeddings(tok), h_prev), ref)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A 5-token vocab (random MTP drafts are sometimes right), the prompts of test_engine_mtp and their
    plain greedy outputs."""
    path = write_qwen_checkpoint(tmp_path_factory.mktemp("qwen_v5") / "ckpt", seed=2, vocab_size=5)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 5, (n,)).tolist() for n in (5, 17, 9, 30, 1, 12)]
    plain = Engine.from_pretrained(path, EngineOptions(max_batch_size=3, max_seq_len=64))
    return path, prompts, plain.generate(prompts, mtp_tests.MAX_NEW, stop_token_ids=[]).tokens


@torch.inference_mode()
def test_drafts_match_cache_free_mtp_reference(small_vocab):
    path, prompts, _ = small_vocab
    K = 3
    engine = Engine.from_pretrained(path, EngineOptions(draft_len=K, max_batch_size=2, max_seq_len=64))
    model, prompt = engine.model, prompts[3]
    first = engine.runner.prefill([prompt], [1]).tokens[0]
    drafts = engine.step.draft(torch.tensor([1]), torch.tensor([len(prompt)]))[0].tolist()
    hidden = model(torch.tensor([prompt]))[0]  # MTP position i: target hidden i with token i + 1
    after, want = prompt[1:] + [first], []
    for _ in range(K):
        out = model.mtp(model.embeddings(torch.tensor([after])), hidden[None])[0, -1]
        want.append(int(model.lm_logits(out).argmax()))
        after.append(want[-1])
        hidden = torch.cat([hidden, out[None]])
    assert drafts == want


# The family-agnostic MTP checks of test_engine_mtp, run on Qwen3-Next: after every verify + commit each
# slot's cache (GDN state and conv window, target and MTP KV) equals a reference that decoded only the
# accepted tokens, and the output equals plain greedy.


@pytest.mark.parametrize("K", [1, 3, 7])
def test_speculative_equals_plain_greedy_and_commit_equals_accepted_only(small_vocab, K):
    path, prompts, plain = small_vocab
    chunk = 7 if K == 3 else 8192  # once with chunked prefill
    engine, s = mtp_tests._checked_run(path, prompts, plain, K, prefill_chunk_tokens=chunk)
    assert s.accepted_drafts > 0  # the 5-token vocab makes some random drafts right
    mtp_tests._check_counters(s, K, engine.committed)  # counted as committed to the output
    assert engine.cache_memory()["spec_buffers_bytes"] > 0  # GDN rewind buffers (T states per slot)


@pytest.mark.parametrize("K", [1, 3, 7])
def test_ragged_forced_acceptance_keeps_each_rows_gdn_state(small_vocab, K):
    path, prompts, plain = small_vocab
    schedules = [[K, 0], [0, K], [min(2, K), K, 0, 0], [K, K, 0], [0], [K, 1, K]]
    engine, s = mtp_tests._checked_run(path, prompts, plain, K, schedules)
    mtp_tests._check_counters(s, K, engine.committed)  # counted as committed to the output
    assert s.num_accepted_hist[1] > 0 and s.num_accepted_hist[K + 1] > 0


def test_pad_rows_of_verify_and_commit_never_touch_a_live_gdn_slot(small_vocab):
    mtp_tests.test_pad_rows_of_verify_and_commit_never_touch_a_live_slot(small_vocab)


# --------------------------------------------------------------------------------------- loader errors


@pytest.fixture()
def copy(ckpt, tmp_path):
    return shutil.copytree(ckpt, tmp_path / "ckpt")


def _edit_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.pop("model.layers.0.linear_attn.A_log"), r"missing tensors model\.layers\.0\.linear"),
        (lambda t: t.pop("mtp.layers.0.mlp.experts.1.gate_proj.weight"), r"missing tensors mtp\.layers\.0"),
        (lambda t: t.__setitem__("model.layers.1.self_attn.x", torch.ones(2)), r"unknown tensors model\."),
        (
            lambda t: t.__setitem__("model.layers.0.linear_attn.conv1d.weight", torch.zeros(128, 1, 3)),
            r"conv1d\.weight has shape \[128, 1, 3\].*\[128, 1, 4\]",
        ),
    ],
)
def test_bad_tensors(copy, edit, match):
    _edit_tensors(copy, edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(copy)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: c.update(layer_types=["linear_attention", "conv", "full_attention", "linear_attention"]),
         "layer_types must be a list of"),
        (lambda c: c.update(num_hidden_layers=5), "num_hidden_layers=5 but layer_types lists 4"),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "RoPE type 'yarn'"),
        (lambda c: c.update(linear_num_value_heads=3), r"value heads \(3\) must be a positive multiple"),
        (lambda c: c.update(num_nextn_predict_layers=2), "only 1 MTP module"),
        (lambda c: c.update(hidden_act="gelu"), "activation 'gelu' is not supported"),
        (lambda c: c.pop("hidden_size"), "hidden_size is missing"),
        (lambda c: c.update(num_nextn_predict_layers=0), "set num_nextn_predict_layers"),
    ],
)
def test_bad_config(copy, edit, match):
    _edit_config(copy, edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(copy)


def test_checkpoint_without_mtp_loads_for_plain_decoding(copy):
    _edit_tensors(copy, lambda t: [t.pop(n) for n in [n for n in t if n.startswith("mtp.")]])
    assert load_model(copy).mtp is None
    with pytest.raises(CheckpointError, match="no mtp"):
        load_model(copy, load_mtp=True)
    with pytest.raises(ValueError, match="no mtp"):
        Engine.from_pretrained(copy, EngineOptions(draft_len=2))
