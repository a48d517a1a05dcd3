"""The checkpoint's quantization config (registry.hf_config.QuantConfig), the entry-vs-checkpoint quant rule
(registry.resolve) and what runners.app.support refuses (NVFP4 on the wrong hardware, block-wise FP8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from registry.checkpoint import CheckpointError
from registry.compose import compose_config
from registry.errors import UserError
from registry.hf_config import HybridConfig, QuantConfig, parse_quantization
from registry.schema import REPO_ROOT
from runners.app import main as app
from runners.engine.quant import check_runnable

TINY = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp"
TINY_FP8 = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp_fp8"
EXCLUDE = ["lm_head", "*.mixer.q_proj", "mtp*"]


def test_modelopt_legacy_file():
    q = parse_quantization(None, {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": EXCLUDE}})
    assert (q.method, q.format, q.algo, q.kv_cache_quant, q.activation_scheme) == (
        "fp8", "modelopt", "FP8", "fp8", "static")
    assert q.exclude_modules == tuple(EXCLUDE) and q.weight_block_size is None


def test_modelopt_config_json_forms():
    flat = parse_quantization({"quant_method": "modelopt", "quant_algo": "fp8", "ignore": EXCLUDE,
                               "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}})
    nested = parse_quantization({"quant_method": "modelopt", "quantization": {
        "quant_algo": "FP8", "exclude_modules": EXCLUDE}})
    assert flat.algo == "FP8" and flat.kv_cache_quant == "fp8" and flat.exclude_modules == tuple(EXCLUDE)
    assert nested.kv_cache_quant is None and nested.exclude_modules == tuple(EXCLUDE)
    nvfp4 = parse_quantization({"quant_method": "modelopt", "quant_algo": "NVFP4",
                                "kv_cache_quant_algo": "FP8"})
    assert nvfp4.method == "nvfp4"


def test_hf_fp8_forms():
    static = parse_quantization({"quant_method": "fp8", "activation_scheme": "static",
                                 "ignored_layers": ["lm_head"]})
    assert (static.format, static.activation_scheme) == ("fp8", "static")
    assert static.exclude_modules == ("lm_head",)
    block = parse_quantization({"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})
    assert block.weight_block_size == (128, 128) and block.algo == "FP8_BLOCK"
    with pytest.raises(CheckpointError, match="block-wise FP8"):
        check_runnable(block)
    with pytest.raises(CheckpointError, match="activation_scheme dynamic"):
        check_runnable(parse_quantization({"quant_method": "fp8", "activation_scheme": "dynamic"}))
    check_runnable(static)


@pytest.mark.parametrize("qc, hf, match", [
    ({"quant_method": "gptq", "bits": 4}, None, "quant_method 'gptq' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}, None,
     "quant_algo 'FP8_PER_CHANNEL_PER_TOKEN' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, None,
     "kv_cache_quant_algo 'NVFP4' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": "lm_head"}, None, "must be a list"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, {"quantization": {"quant_algo": "NVFP4"}},
     "quantization_config says FP8 but hf_quant_config.json says NVFP4"),
    (None, {"producer": {}}, 'no "quantization" object'),
])
def test_bad_quantization_configs(qc, hf, match):
    with pytest.raises(CheckpointError, match=match):
        parse_quantization(qc, hf)


def test_kv_cache_setting_of_either_file():
    q = parse_quantization({"quant_method": "modelopt", "quant_algo": "FP8"},
                           {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}})
    assert q.kv_cache_quant == "fp8"


@pytest.mark.parametrize("module, excluded", [
    ("lm_head", True),
    ("lm_head.sub", True),  # below an excluded module
    ("backbone.layers.3.mixer.q_proj", True),  # wildcard
    ("backbone.layers.3.mixer.q_proj_x", False),
    ("mtp.layers.0.mixer.k_proj", True),
    ("backbone.layers.3.mixer.in_proj", False),
])
def test_exclusion_rule(module, excluded):
    q = QuantConfig(method="fp8", format="modelopt", algo="FP8", exclude_modules=tuple(EXCLUDE))
    assert q.is_excluded(module) is excluded


def test_shipped_fp8_checkpoint_declares_its_quantization():
    c = HybridConfig.from_pretrained(TINY_FP8)
    q = c.quantization
    assert q is not None and (q.method, q.format, q.kv_cache_quant) == ("fp8", "modelopt", "fp8")
    assert HybridConfig.from_pretrained(TINY).quantization is None
    assert q.is_excluded("backbone.layers.1.mixer.q_proj")
    assert not q.is_excluded("backbone.layers.0.mixer.in_proj")


def _error(*overrides) -> UserError:
    with pytest.raises(UserError) as e:
        app.run(compose_config(list(overrides)))
    return e.value


def test_entry_quant_must_match_the_checkpoint():
    err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={TINY_FP8}")
    assert "sets quant: none, but the checkpoint is quant fp8" in err.problem
    assert "model.quant=fp8" in err.fix and "an unquantized checkpoint" in err.fix
    err = _error("model=tiny_nemotron_h_mtp_fp8", f"model.checkpoint={TINY}")
    assert "sets quant: fp8, but the checkpoint is quant none" in err.problem
    assert "python -m runners.tools.quantize --fp8" in err.fix


def test_nvfp4_refused_before_loading_naming_the_hardware(monkeypatch):
    """No models_root, no weights: the nvfp4 entry is refused for the hardware before the checkpoint is asked
    for; on the CPU the message names the CPU and Blackwell."""
    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    for model in ("super_v3_mtp", "qwen3_next_mtp"):
        err = _error(f"model={model}_nvfp4", "model.cuda_graph_batch_sizes=[]")
        assert "quant=nvfp4" in err.problem and "Blackwell" in err.problem and "the CPU" in err.problem
        # the fix names this model's own runnable entries, never another model's
        assert f"use model={model}_fp8 (FP8) or model={model} (bf16);" in err.fix, err.fix


def test_nvfp4_refused_on_pre_blackwell_gpu(monkeypatch):
    """The same check on a (faked) Hopper GPU names it and its compute capability."""
    import runners.app.support as support

    monkeypatch.setattr(support.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(support.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(support.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    hw, cap = support._hardware("cuda")
    assert hw == "NVIDIA H200 (sm_90)" and cap < support.FP4_MIN_CAPABILITY


def test_block_wise_fp8_checkpoint_refused(tmp_path):
    ckpt = tmp_path / "blockwise"
    shutil.copytree(TINY, ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(raw))
    err = _error("model=tiny_nemotron_h_mtp_fp8", f"model.checkpoint={ckpt}")
    assert "block-wise FP8" in err.problem and "runners.tools.quantize" in err.fix


def test_fp8_entries_compose_with_arch_unchanged():
    for base in ("super_v3_mtp", "qwen3_next_mtp"):
        a, b = compose_config([f"model={base}"]), compose_config([f"model={base}_fp8"])
        assert a.model.arch == b.model.arch and b.model.quant == "fp8" and b.model.kv_cache_quant == "fp8"
    assert Path(REPO_ROOT / "registry" / "checkpoints" / "tiny_qwen3_next_mtp_fp8" / "config.json").is_file()


def test_qwen3_next_fp8_entry_has_no_reference_to_be_judged_by(monkeypatch):
    """No FP8 Qwen3-Next number exists: the entry has no baseline key, so a run is refused before loading
    (the fix names verdict.require_reference=false), not judged against a placeholder."""
    from registry.resolve import resolve

    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    rr = resolve(compose_config(["model=qwen3_next_mtp_fp8"]), check_checkpoint=False)
    assert rr.entry.baseline is None
    with pytest.raises(UserError) as err:
        app.check_references(rr)
    assert "no `baseline` key" in err.value.problem and "verdict.require_reference=false" in err.value.fix
