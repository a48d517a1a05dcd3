"""The engine on synthetic checkpoints with the releases' layouts and head structure at tiny depth (CPU):
Nemotron 3 Super (Mamba2 128-state heads, 32/2 x 128 attention, latent MoE top-22) and Qwen3-Next (GDN 16/32
heads, 16/2 x 256 gated attention, softmax MoE top-10 with a gated shared expert), with hidden sizes, expert
counts and vocab reduced for CPU speed. MTP drafting with K = 3: replay and rewind give the tokens of plain
greedy decoding, with real drafts and with oracle drafts that make every num_accepted_tokens value occur."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_factory import OracleDraftEngine
from tokenizers import Tokenizer

from runners.engine import Engine
from runners.engine.options import EngineOptions
from runners.tools.synth import write_synthetic_checkpoint

# Head structure of the releases; widths that keep a CPU test short.
ENGINE_SIZES = {
    "nemotron_h": dict(num_layers=4, num_experts=32, overrides=dict(
        hidden_size=256, vocab_size=4096, mamba_num_heads=32, moe_latent_size=128, moe_intermediate_size=192,
        moe_shared_expert_intermediate_size=384)),  # mamba head_dim 64, d_state 128, 8 groups; 32/2 x 128
    "qwen3_next": dict(num_layers=4, num_experts=32, overrides=dict(
        hidden_size=256, vocab_size=4096, moe_intermediate_size=64, shared_expert_intermediate_size=64)),
}
K, MAX_NEW, SLOTS = 3, 16, 3


@pytest.fixture(scope="module", params=sorted(ENGINE_SIZES))
def setup(request, tmp_path_factory, gsm8k_dir):
    family = request.param
    path = tmp_path_factory.mktemp(f"realdim_{family}")
    write_synthetic_checkpoint(path, family, dtype=torch.float32, **ENGINE_SIZES[family])
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()[:5]]
    prompts = [[1] + tok.encode(f"Question: {r['question']}\nAnswer:").ids[:48] for r in rows]
    plain = Engine.from_pretrained(path, EngineOptions(max_batch_size=SLOTS, max_seq_len=128))
    return family, path, prompts, plain.generate(prompts, MAX_NEW, stop_token_ids=[]).tokens


def _engine(path, replay, cls=Engine):
    return cls.from_pretrained(path, EngineOptions(draft_len=K, ssm_replay=replay, max_batch_size=SLOTS,
                                                   max_seq_len=128))


def test_real_head_structure(setup):
    family, path, _, _ = setup
    c = _engine(path, False).config
    if family == "nemotron_h":
        assert (c.mamba_head_dim, c.ssm_state_size, c.n_groups) == (64, 128, 8)
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 2, 128)
        assert c.num_experts_per_tok == 22 and c.moe_latent_size == 128 and c.routed_scaling_factor == 5.0
        assert c.mtp_layer_types == ("attention", "moe")
    else:
        assert (c.gdn_num_key_heads, c.gdn_num_value_heads, c.gdn_key_head_dim) == (16, 32, 128)
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)
        assert c.num_experts_per_tok == 10 and c.moe_shared_expert_gate and c.partial_rotary_factor == 0.25


def test_mtp_replay_equals_rewind_equals_greedy(setup):
    _, path, prompts, plain = setup
    rewind = _engine(path, False).generate(prompts, MAX_NEW, stop_token_ids=[])
    replay = _engine(path, True).generate(prompts, MAX_NEW, stop_token_ids=[])
    assert replay.tokens == rewind.tokens == plain
    assert replay.stats.num_accepted_hist == rewind.stats.num_accepted_hist
    assert rewind.stats.drafted_tokens > 0


def test_every_num_accepted_value_replay_equals_rewind(setup):
    """Random MTP weights rarely draft right; oracle drafts make 1 .. K + 1 accepted tokens all occur."""
    _, path, prompts, plain = setup
    outs = []
    for replay in (False, True):
        engine = _engine(path, replay, OracleDraftEngine)
        engine.set_oracle(prompts, plain)
        outs.append(engine.generate(prompts, MAX_NEW, stop_token_ids=[]))
    rewind, replay = outs
    assert replay.tokens == rewind.tokens == plain
    assert all(h > 0 for h in replay.stats.num_accepted_hist[1:])
