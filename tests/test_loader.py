"""Checkpoint loading: both config.json dialects, sharded index, MTP weights, and every error path."""

from __future__ import annotations

import json
import math

import pytest
import torch
from ckpt_factory import make_hf_model, mtp_tensors, write_checkpoint
from safetensors.torch import load_file, save_file

from runners.engine.loader import CheckpointError, load_model
from runners.engine.models.config import HybridConfig


@pytest.fixture(scope="module")
def hf():
    return make_hf_model(seed=1)


@pytest.fixture()
def ckpt(hf, tmp_path):
    return write_checkpoint(tmp_path / "ckpt", hf, with_mtp=True)


def _logits(model, ids):
    with torch.inference_mode():
        return model.lm_logits(model(ids))


def test_both_dialects_parse_to_the_same_config(hf, tmp_path):
    a = HybridConfig.from_pretrained(write_checkpoint(tmp_path / "a", hf, dialect="hf5"))
    b = HybridConfig.from_pretrained(write_checkpoint(tmp_path / "b", hf, dialect="pattern"))
    assert "hybrid_override_pattern" in json.loads((tmp_path / "b" / "config.json").read_text())
    assert a == b
    assert a.layer_types == ("mamba2", "attention", "moe", "mamba2", "mlp", "moe")
    assert a.mtp_layer_types == ("attention", "moe") and a.num_nextn_predict_layers == 1
    assert a.time_step_limit == (0.0, math.inf)  # {"__float__": "Infinity"} decoded
    assert a.n_groups == 2 and a.moe_latent_size == 24 and a.eos_token_id == (2,)


def test_mtp_weights_load_with_checkpoint_names(hf, ckpt):
    model = load_model(ckpt)
    assert model.mtp is not None
    want = mtp_tensors(hf.config)
    mtp = model.mtp
    torch.testing.assert_close(mtp.eh_proj.weight, want["mtp.layers.0.eh_proj.weight"])
    torch.testing.assert_close(mtp.enorm.weight, want["mtp.layers.0.enorm.weight"])
    torch.testing.assert_close(mtp.blocks[0].mixer.q_proj.weight, want["mtp.layers.0.mixer.q_proj.weight"])
    torch.testing.assert_close(mtp.blocks[1].norm.weight, want["mtp.layers.1.norm.weight"])
    torch.testing.assert_close(mtp.final_norm.weight, want["mtp.layers.1.final_layernorm.weight"])
    torch.testing.assert_close(
        mtp.blocks[1].mixer.experts_down[4], want["mtp.layers.1.mixer.experts.4.down_proj.weight"]
    )
    torch.testing.assert_close(
        mtp.blocks[1].mixer.gate.e_score_correction_bias,
        want["mtp.layers.1.mixer.gate.e_score_correction_bias"],
    )
    # an MTP draft step runs with the loaded weights: [B, T, D] in, [B, T, D] out
    D = hf.config.hidden_size
    out = mtp(torch.randn(2, 3, D), torch.randn(2, 3, D))
    assert out.shape == (2, 3, D) and torch.isfinite(out).all()
    assert load_model(ckpt, load_mtp=False).mtp is None


def test_checkpoint_without_mtp_loads_for_plain_decoding(hf, tmp_path):
    path = write_checkpoint(tmp_path / "nomtp", hf, with_mtp=False)
    model = load_model(path)
    assert model.mtp is None
    with pytest.raises(CheckpointError, match="no mtp"):
        load_model(path, load_mtp=True)


def test_sharded_and_pattern_dialect_load_identically(hf, ckpt, tmp_path):
    sharded = write_checkpoint(tmp_path / "sharded", hf, num_shards=3, dialect="pattern")
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    ids = torch.randint(0, hf.config.vocab_size, (2, 9))
    torch.testing.assert_close(
        _logits(load_model(sharded), ids), _logits(load_model(ckpt), ids), rtol=0, atol=0
    )


def test_bfloat16_load_keeps_router_in_float32(ckpt):
    model = load_model(ckpt, dtype=torch.bfloat16)
    moe = model.layers[2].mixer
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts_up.dtype == torch.bfloat16 and model.embeddings.weight.dtype == torch.bfloat16


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("backbone.layers.3.mixer.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensors backbone\.layers\.3\.mixer\.A_log"):
        load_model(ckpt)


def test_partial_mtp_group_is_missing_tensors(ckpt):
    _rewrite(ckpt, lambda t: t.pop("mtp.layers.1.mixer.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors mtp\.layers\.1\.mixer\.experts\.2\.up_proj"):
        load_model(ckpt)


def test_unknown_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("backbone.layers.0.mixer.extra", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unknown tensors backbone\.layers\.0\.mixer\.extra"):
        load_model(ckpt)


def test_shape_mismatch(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("backbone.norm_f.weight", torch.ones(7)))
    with pytest.raises(CheckpointError, match=r"backbone\.norm_f\.weight has shape \[7\].*\[40\]"):
        load_model(ckpt)


def test_corrupt_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        load_model(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(ckpt)


def test_missing_files(hf, ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nowhere")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(ckpt)
    sharded = write_checkpoint(tmp_path / "sharded", hf, num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: shard listed"):
        load_model(sharded)
    (sharded / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="weight_map"):
        load_model(sharded)
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_model(sharded)


def test_index_naming_a_tensor_its_shard_lacks(hf, tmp_path):
    sharded = write_checkpoint(tmp_path / "sharded", hf, num_shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["backbone.ghost.weight"] = "model-00001-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"does not hold: backbone\.ghost\.weight"):
        load_model(sharded)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: c.update(model_type="llama"), "model_type 'llama' is not supported"),
        (lambda c: c.update(layers_block_type=["linear_attention", "conv"]), "unknown layer types"),
        (lambda c: (c.pop("layers_block_type"), c.update(hybrid_override_pattern="MX")), "unknown letters"),
        (lambda c: c.pop("layers_block_type"), "neither layers_block_type nor hybrid_override_pattern"),
        (lambda c: c.update(hybrid_override_pattern="MMMMMM"), "disagrees with layers_block_type"),
        (lambda c: c.update(n_routed_experts=7, num_experts_per_tok=9), r"num_experts_per_tok=9 must be in"),
    ],
)
def test_bad_config(ckpt, edit, match):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_model(ckpt)


def test_mtp_tensors_without_mtp_config_are_unknown(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="set num_nextn_predict_layers"):
        load_model(ckpt)
