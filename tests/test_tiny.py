"""Tests of runners.tools.tiny and of the checkpoints it shipped in registry/checkpoints/: the tokenizer,
the names,
shapes and dtypes on disk, loading in transformers, and bit-for-bit determinism of the build."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from runners.tools import tiny

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED = REPO_ROOT / "registry" / "checkpoints"
FAMILIES = sorted(tiny.CHECKPOINT_NAMES)
# Small sizes for builds inside tests (a few hundred KB, well under a second each).
SMALL = {
    "nemotron_h": dict(
        hidden_size=64,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        head_dim=16,
        num_attention_heads=4,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        moe_latent_size=32,
        moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=64,
        intermediate_size=96,
        n_routed_experts=4,
    ),
    "qwen3_next": dict(
        hidden_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
}


def _tensor_meta(path: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_and_gsm8k_round_trip(gsm8k_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = SHIPPED / tiny.CHECKPOINT_NAMES["nemotron_h"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    assert tok.get_vocab_size() == tiny.DEFAULT_VOCAB_SIZE

    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()]
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows]
    encodings = tok.encode_batch(texts)
    assert all(0 not in e.ids and 1 not in e.ids and 2 not in e.ids for e in encodings)  # no specials added
    decoded = tok.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
    mismatches = [i for i, (a, b) in enumerate(zip(texts, decoded)) if a != b]
    assert not mismatches, f"{len(mismatches)} GSM8K test rows do not round-trip, first: {mismatches[:3]}"

    # Numbers become one token per digit (a leading space may ride on the first digit).
    assert tok.encode("Answer: 1234 and 5.75").tokens == [
        "Answer",
        ":",
        "Ġ1",
        "2",
        "3",
        "4",
        "Ġand",
        "Ġ5",
        ".",
        "7",
        "5",
    ]
    multi_digit = [t for t in tok.get_vocab() if len(re.findall(r"\d", t)) > 1]
    assert not multi_digit, multi_digit[:10]

    hf = AutoTokenizer.from_pretrained(path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf(texts[0]).input_ids == encodings[0].ids


def test_train_tokenizer_rejects_too_small_vocab(gsm8k_dir):
    with pytest.raises(ValueError, match="too small"):
        tiny.train_tokenizer(gsm8k_dir / "train.jsonl", vocab_size=100)
    with pytest.raises(FileNotFoundError, match="GSM8K_DIR"):
        tiny.train_tokenizer(gsm8k_dir / "missing.jsonl", vocab_size=300)


# ---------------------------------------------------------------- shipped checkpoints


@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_checkpoint_loads_in_transformers(family):
    from transformers import AutoModelForCausalLM

    path = SHIPPED / tiny.CHECKPOINT_NAMES[family]
    assert (path / "model.safetensors").stat().st_size < 10 * 2**20
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert model.config.model_type == family
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # transformers ignores mtp.* by rule (_keys_to_ignore_on_load_unexpected); nothing else may be left over.
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    input_ids = torch.tensor([[1, 300, 17, 45, 900, 12, 2000, 5]])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, 8, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.float().std() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_checkpoint_names_shapes_dtypes(family):
    path = SHIPPED / tiny.CHECKPOINT_NAMES[family]
    cfg = _config(path)
    meta = _tensor_meta(path)
    H = cfg["hidden_size"]
    E = cfg["n_routed_experts"] if family == "nemotron_h" else cfg["num_experts"]

    # No fused expert tensors; every MoE layer (backbone and MTP) has E per-expert tensors of each projection.
    assert not [k for k in meta if re.search(r"(^|\.)experts\.(up|down|gate_up|gate)_proj", k)]
    expert_keys = [k for k in meta if ".experts." in k]
    moe_layers = {re.sub(r"\.experts\.\d+\..*", "", k) for k in expert_keys}
    projs = ("up", "down") if family == "nemotron_h" else ("gate", "up", "down")
    for layer in moe_layers:
        for e in range(E):
            for p in projs:
                assert f"{layer}.experts.{e}.{p}_proj.weight" in meta, (layer, e, p)

    if family == "nemotron_h":
        kinds = cfg["layers_block_type"]
        assert cfg["hybrid_override_pattern"] == "".join(
            {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}[k] for k in kinds
        )
        assert set(kinds) == {"linear_attention", "moe", "full_attention", "mlp"}
        assert cfg["num_nextn_predict_layers"] == 1 and cfg["mtp_hybrid_override_pattern"] == "*E"
        moe_idx, attn_idx = kinds.index("moe"), kinds.index("full_attention")
        assert meta["mtp.layers.0.eh_proj.weight"][0] == [H, 2 * H]
        for name in ("enorm", "hnorm", "norm"):
            assert meta[f"mtp.layers.0.{name}.weight"][0] == [H]
        assert meta["mtp.layers.1.final_layernorm.weight"][0] == [H]
        block_of = {0: f"backbone.layers.{attn_idx}.", 1: f"backbone.layers.{moe_idx}."}
        for j, prefix in block_of.items():  # MTP block j is named and shaped exactly as a backbone block
            backbone = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
            mtp = {
                k[len(f"mtp.layers.{j}.") :]: v for k, v in meta.items() if k.startswith(f"mtp.layers.{j}.")
            }
            extra = (
                {"enorm.weight", "hnorm.weight", "eh_proj.weight"} if j == 0 else {"final_layernorm.weight"}
            )
            assert {k: v for k, v in mtp.items() if k not in extra} == backbone
        fp32 = {k for k, (_, dt) in meta.items() if dt == "F32"}
        assert fp32 == {k for k in meta if re.search(r"mixer\.gate\.(weight|e_score_correction_bias)$", k)}
        assert "mtp.layers.1.mixer.gate.e_score_correction_bias" in fp32
    else:
        kinds = cfg["layer_types"]
        assert set(kinds) == {"linear_attention", "full_attention"}
        assert cfg["linear_num_value_heads"] == 2 * cfg["linear_num_key_heads"]
        assert cfg["linear_key_head_dim"] != cfg["linear_value_head_dim"]
        assert meta["mtp.fc.weight"][0] == [H, 2 * H]
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            assert meta[f"mtp.{name}.weight"][0] == [H]
        prefix = f"model.layers.{kinds.index('full_attention')}."
        backbone = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
        mtp = {k[len("mtp.layers.0.") :]: v for k, v in meta.items() if k.startswith("mtp.layers.0.")}
        assert mtp == backbone and "self_attn.q_norm.weight" in mtp and "mlp.shared_expert_gate.weight" in mtp
        assert {dt for _, dt in meta.values()} == {"BF16"}
    assert not [
        k for k in meta if k.startswith("mtp.") and not re.match(r"mtp\.(layers\.\d+\.|fc|pre_fc|norm)", k)
    ]


def test_constant_init_tensors_are_perturbed():
    """Norm weights and biases must not be exact ones / zeros, or a loader that ignores them still passes."""
    for family in FAMILIES:
        path = SHIPPED / tiny.CHECKPOINT_NAMES[family]
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for key in f.keys():
                if key.endswith(("norm.weight", "norm_f.weight", "bias", "mixer.D", "dt_bias")):
                    t = f.get_tensor(key).float()
                    assert t.numel() == 1 or t.std() > 0, key


# ---------------------------------------------------------------- the builder


@pytest.mark.slow
def test_cli_rebuilds_the_shipped_checkpoints_bit_for_bit(tmp_path):
    """The README's step-1 command, run in this process, reproduces every shipped file that training does not
    change (tokenizer, configs) byte for byte, and random weights with the shipped names, shapes and dtypes;
    the shipped model.safetensors holds the trained weights of step 2 (runners.tools.train, recipe.json)."""
    from safetensors import safe_open

    tiny.main(["--out", str(tmp_path), "--seed", "0", "--vocab-size", str(tiny.DEFAULT_VOCAB_SIZE)])
    trained_only = {"model.safetensors", "train_log.jsonl", "recipe.json"}
    for name in tiny.CHECKPOINT_NAMES.values():
        shipped = sorted(p.name for p in (SHIPPED / name).iterdir())
        built = sorted(p.name for p in (tmp_path / name).iterdir())
        assert sorted(set(shipped) - trained_only) == sorted(set(built) - {"model.safetensors"})
        for file in set(built) - {"model.safetensors"}:
            assert _sha256(tmp_path / name / file) == _sha256(SHIPPED / name / file), (
                f"{name}/{file} differs from a fresh build; rerun the command in "
                "registry/checkpoints/README.md"
            )
        with safe_open(SHIPPED / name / "model.safetensors", "pt") as a, \
                safe_open(tmp_path / name / "model.safetensors", "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for key in a.keys():
                ta, tb = a.get_slice(key), b.get_slice(key)
                assert (ta.get_shape(), ta.get_dtype()) == (tb.get_shape(), tb.get_dtype()), key


@pytest.mark.parametrize("family", FAMILIES)
def test_write_random_checkpoint_custom_sizes_deterministic(tmp_path, family):
    from transformers import AutoModelForCausalLM

    overrides = dict(SMALL[family], vocab_size=320)
    a = tiny.write_random_checkpoint(tmp_path / "a", family, overrides, seed=3)
    b = tiny.write_random_checkpoint(tmp_path / "b", family, overrides, seed=3)
    c = tiny.write_random_checkpoint(tmp_path / "c", family, overrides, seed=4)
    for file in ("model.safetensors", "config.json", "generation_config.json"):
        assert _sha256(a / file) == _sha256(b / file), file
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")

    cfg = _config(a)
    assert cfg["hidden_size"] == 64 and cfg["vocab_size"] == 320 and cfg["dtype"] == "bfloat16"
    assert (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1, 2)
    model, info = AutoModelForCausalLM.from_pretrained(a, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 300]])).logits).all()
    meta = _tensor_meta(a)
    mtp_in = "mtp.layers.0.eh_proj.weight" if family == "nemotron_h" else "mtp.fc.weight"
    assert meta[mtp_in][0] == [64, 128]


def test_write_random_checkpoint_float32_and_tokenizer_copy(tmp_path, gsm8k_dir):
    tok_dir = tiny.save_tokenizer(tiny.train_tokenizer(gsm8k_dir / "train.jsonl", 300), tmp_path / "tok")
    out = tiny.write_random_checkpoint(
        tmp_path / "q", "qwen3_next", SMALL["qwen3_next"], dtype=torch.float32, tokenizer_dir=tok_dir
    )
    assert _config(out)["vocab_size"] == 300  # taken from the tokenizer
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert {dt for _, dt in _tensor_meta(out).values()} == {"F32"}
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        tiny.write_random_checkpoint(
            tmp_path / "x", "qwen3_next", dict(SMALL["qwen3_next"], vocab_size=299), tokenizer_dir=tok_dir
        )
    with pytest.raises(ValueError, match="unknown family"):
        tiny.write_random_checkpoint(tmp_path / "y", "llama")


def test_write_random_checkpoint_layer_layout_spellings(tmp_path):
    """A legacy pattern or an attention interval in the overrides sets the layout (not the default list)."""
    small = {k: v for k, v in SMALL["nemotron_h"].items() if k != "layers_block_type"}
    out = tiny.write_random_checkpoint(
        tmp_path / "n", "nemotron_h", dict(small, hybrid_override_pattern="EM*")
    )
    cfg = _config(out)
    assert cfg["layers_block_type"] == ["moe", "linear_attention", "full_attention"]
    assert cfg["hybrid_override_pattern"] == "EM*"
    assert "backbone.layers.2.mixer.q_proj.weight" in _tensor_meta(out)

    small = {k: v for k, v in SMALL["qwen3_next"].items() if k not in ("layer_types", "num_hidden_layers")}
    overrides = dict(small, num_hidden_layers=4, full_attention_interval=2)
    cfg = _config(tiny.write_random_checkpoint(tmp_path / "q", "qwen3_next", overrides))
    assert cfg["layer_types"] == ["linear_attention", "full_attention"] * 2


def test_transformers_beside_a_pypi_kernels_it_would_import_is_refused_with_the_fix(monkeypatch):
    """transformers imports the PyPI `kernels` whenever its probe finds a version it accepts (5.25 depends
    on it); this checkout's kernels/ shadows that package, so the builder refuses with the pin, before any
    transformers model import fails with "cannot import name ... from 'kernels'"."""
    from transformers.utils import import_utils

    from registry.errors import UserError

    assert tiny.transformers_clash() is None  # the pinned environment the suite runs in
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda *a, **k: True)
    versions = {"transformers": "5.25.0", "kernels": "0.19.1"}
    monkeypatch.setattr("importlib.metadata.version", lambda name: versions[name])
    assert tiny.transformers_clash() == (
        "transformers 5.25.0 imports the PyPI package `kernels` 0.19.1, which this checkout's kernels/ "
        "shadows (the project runs from the checkout, so both cannot be imported)")
    with pytest.raises(UserError, match="transformers>=5.0,<5.25"):
        tiny._model_classes("nemotron_h")
