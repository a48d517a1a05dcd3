"""The checkpoint's quantization config (registry.hf_config.QuantConfig: ModelOpt FP8 / NVFP4 /
MIXED_PRECISION in both spellings, HF fp8 per-tensor and block), the entry-vs-checkpoint quant rule
(registry.resolve) and what runners.app.support refuses (NVFP4 / block FP8 on GPUs older than sm_89, block
sizes other than 128 x 128)."""

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
from runners.app.preflight import check_references
from runners.engine.formats import check_runnable

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
    assert static.module_format("model.layers.0.mlp.up_proj") == "fp8"
    # Qwen's release: block FP8 with dynamic activations, runnable; modules_to_not_convert honoured
    block = parse_quantization({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128],
                                "modules_to_not_convert": ["lm_head", "mtp.fc", "model.layers.0.mlp.gate"]})
    assert block.weight_block_size == (128, 128) and block.algo == "FP8_BLOCK"
    assert block.module_format("mtp.layers.0.self_attn.q_proj") == "block_fp8"
    assert block.module_format("mtp.fc") is None and block.module_format("lm_head") is None
    check_runnable(block)
    with pytest.raises(CheckpointError, match=r"weight_block_size \[64, 64\] is not supported"):
        check_runnable(parse_quantization({"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": [64, 64]}))
    with pytest.raises(CheckpointError, match="block FP8 with activation_scheme static"):
        check_runnable(parse_quantization({"quant_method": "fp8", "activation_scheme": "static",
                                           "weight_block_size": [128, 128]}))
    with pytest.raises(CheckpointError, match="activation_scheme dynamic"):
        check_runnable(parse_quantization({"quant_method": "fp8", "activation_scheme": "dynamic"}))
    check_runnable(static)


NVFP4 = {"quant_algo": "NVFP4", "group_size": 16}
LAYERS = {"backbone.layers.1.mixer.experts.0.up_proj": NVFP4,
          "backbone.layers.1.mixer.experts.0.down_proj": NVFP4,
          "backbone.layers.0.mixer.in_proj": {"quant_algo": "FP8"},
          "backbone.layers.3.mixer.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}


def test_mixed_precision_per_module():
    """ModelOpt MIXED_PRECISION (Super NVFP4's hf_quant_config.json): quantized_layers gives each module
    its format, a module below a listed one (fused experts) takes its format, an unlisted module is
    unquantized, the exclude list wins."""
    q = parse_quantization(None, {"quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", "mtp*"],
        "quantized_layers": {**LAYERS, "mtp.layers.0.x": NVFP4}}})
    assert (q.method, q.algo, q.group_size, q.kv_cache_quant) == ("nvfp4", "MIXED_PRECISION", 16, "fp8")
    assert q.module_format("backbone.layers.1.mixer.experts.0.up_proj") == "nvfp4"
    assert q.module_format("backbone.layers.0.mixer.in_proj") == "fp8"
    assert q.module_format("backbone.layers.3.mixer.experts.7.down_proj") == "nvfp4"  # below a listed module
    assert q.module_format("backbone.layers.0.mixer.out_proj") is None  # not listed: unquantized
    assert q.module_format("backbone.layers.5.mixer.q_proj") is None
    assert q.module_format("mtp.layers.0.x") is None  # excluded wins
    fp8_only = parse_quantization(None, {"quantization": {
        "quant_algo": "MIXED_PRECISION", "quantized_layers": {"a.b": {"quant_algo": "FP8"}}}})
    assert fp8_only.method == "fp8" and fp8_only.module_format("a.b") == "fp8"


def test_mixed_precision_config_json_groups_and_both_files():
    """config.json's converted form lists the modules as config_groups targets (4-bit float with group_size
    16: NVFP4; 8-bit float: FP8); with hf_quant_config.json beside it both must say MIXED_PRECISION."""
    groups = {"group_0": {"weights": {"num_bits": 8, "type": "float"},
                          "targets": ["backbone.layers.0.mixer.in_proj"]},
              "group_1": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                          "input_activations": {"num_bits": 4, "type": "float", "group_size": 16},
                          "targets": ["backbone.layers.1.mixer.experts.0.up_proj"]}}
    flat = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": ["mtp*"],
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}, "config_groups": groups}
    q = parse_quantization(flat)
    assert q.method == "nvfp4" and q.kv_cache_quant == "fp8"
    assert q.module_format("backbone.layers.1.mixer.experts.0.up_proj") == "nvfp4"
    assert q.module_format("backbone.layers.0.mixer.in_proj") == "fp8"
    # config.json without modules, hf_quant_config.json with them: the modules come from the latter
    bare = {k: v for k, v in flat.items() if k != "config_groups"}
    both = parse_quantization(bare, {"quantization": {"quant_algo": "MIXED_PRECISION",
                                                      "quantized_layers": LAYERS}})
    assert both.method == "nvfp4" and both.module_format("backbone.layers.0.mixer.in_proj") == "fp8"


@pytest.mark.parametrize("hf, match", [
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"m": {"quant_algo": "INT4_AWQ"}}},
     r"quantized_layers\['m'\].*per-module quant_algo must be one of"),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"m": {"quant_algo": "NVFP4", "group_size": 32}}},
     "NVFP4 group_size 32 is not supported"),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": ["m"]}, "quantized_layers must be an object"),
    ({"quant_algo": "NVFP4", "group_size": 8}, "NVFP4 group_size 8"),
])
def test_bad_mixed_precision_configs(hf, match):
    with pytest.raises(CheckpointError, match=match):
        parse_quantization(None, {"quantization": hf})


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


def _fake_gpu(monkeypatch, name, cap):
    import torch

    import runners.app.support as support

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torch is loaded: cuda_available asks it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return support


def test_nvfp4_runs_on_hopper_and_the_cpu_and_is_refused_on_older_gpus(monkeypatch):
    """No models_root, no weights: an nvfp4 entry passes the hardware check on the CPU (references) and on
    a (faked) H200 (the W4A16 Triton GEMMs); on an sm_80 GPU it is refused naming the GPU, and the fix names
    this model's own runnable entries."""
    from registry.resolve import resolve

    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    for model in ("super_v3_mtp", "qwen3_next_mtp"):
        cfg = compose_config([f"model={model}_nvfp4", "model.cuda_graph_batch_sizes=[]"])
        support = __import__("runners.app.support", fromlist=["check_quant_hardware"])
        support.check_quant_hardware(resolve(cfg, check_checkpoint=False))  # the CPU
        _fake_gpu(monkeypatch, "NVIDIA H200", (9, 0))
        rr = resolve(compose_config([f"model={model}_nvfp4", "runtime.device=cuda"]), check_checkpoint=False)
        support.check_quant_hardware(rr)
        _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
        with pytest.raises(UserError) as err:
            support.check_quant_hardware(rr)
        assert "NVFP4 (W4A16)" in err.value.problem and "A100-SXM4-80GB (sm_80)" in err.value.problem
        assert f"model={model}_fp8 (FP8) or model={model} (bf16)" in err.value.fix, err.value.fix
        monkeypatch.undo()
        monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)


def test_block_fp8_refused_on_older_gpus_only(monkeypatch):
    """The block-FP8 format comes from the checkpoint (an fp8 entry): the check takes the formats."""
    from registry.resolve import resolve

    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    support = _fake_gpu(monkeypatch, "Tesla V100", (7, 0))
    rr = resolve(compose_config(["model=qwen3_next_mtp_fp8", "runtime.device=cuda"]), check_checkpoint=False)
    support.check_quant_hardware(rr, ("fp8",))  # per-tensor FP8 has its dequantizing fallback
    with pytest.raises(UserError, match=r"block-FP8 GEMMs .* Tesla V100 \(sm_70\)"):
        support.check_quant_hardware(rr, ("block_fp8",))


def test_block_fp8_checkpoint_with_other_blocks_refused(tmp_path):
    ckpt = tmp_path / "blockwise"
    shutil.copytree(TINY, ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [64, 64]}
    (ckpt / "config.json").write_text(json.dumps(raw))
    err = _error("model=tiny_nemotron_h_mtp_fp8", f"model.checkpoint={ckpt}")
    assert "weight_block_size [64, 64] is not supported" in err.problem
    assert "runners.tools.quantize" in err.fix


def test_fp8_entries_compose_with_arch_unchanged():
    for base in ("super_v3_mtp", "qwen3_next_mtp"):
        a, b = compose_config([f"model={base}"]), compose_config([f"model={base}_fp8"])
        assert a.model.arch == b.model.arch and b.model.quant == "fp8"
        # Super FP8 ships KV-cache scales; Qwen's block-FP8 release has none (a BF16 KV cache as published)
        assert b.model.kv_cache_quant == ("fp8" if base == "super_v3_mtp" else "none")
    assert Path(REPO_ROOT / "registry" / "checkpoints" / "tiny_qwen3_next_mtp_fp8" / "config.json").is_file()


def test_qwen3_next_fp8_entry_has_no_reference_to_be_judged_by(monkeypatch):
    """No FP8 Qwen3-Next number exists: the entry has no baseline key, so a run is refused before loading
    (the fix names verdict.require_reference=false), not judged against a placeholder."""
    from registry.resolve import resolve

    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    rr = resolve(compose_config(["model=qwen3_next_mtp_fp8"]), check_checkpoint=False)
    assert rr.entry.baseline is None
    with pytest.raises(UserError) as err:
        check_references(rr)
    assert "no `baseline` key" in err.value.problem and "verdict.require_reference=false" in err.value.fix


def test_format_registry_holds_one_object_per_format_whose_rules_match_the_kernels():
    """runners.engine.formats: every name of registry.hf_config.FORMATS has its module and format object (its
    rules importable without torch); an unknown name is a KeyError naming the formats; the block and group
    sizes the formats declare are the ones the kernels run."""
    import subprocess
    import sys

    from kernels.quant.block_fp8 import BLOCK
    from kernels.quant.nvfp4 import NVFP4_BLOCK
    from registry.hf_config import FORMAT_BLOCK_FP8, FORMAT_NVFP4, FORMATS
    from runners.engine.formats import all_formats, checkpoint_formats, get_format
    from runners.engine.formats.block_fp8 import BLOCK as FORMAT_BLOCK
    from runners.engine.formats.nvfp4 import GROUP_SIZE

    assert tuple(f.name for f in all_formats()) == FORMATS
    assert FORMAT_BLOCK == (BLOCK, BLOCK) and GROUP_SIZE == NVFP4_BLOCK
    with pytest.raises(KeyError, match="formats: bf16, fp8"):
        get_format("int4")
    assert [f.runs_on((8, 0)) for f in all_formats()] == [True, True, False, False]
    assert all(f.runs_on(None) and f.runs_on((9, 0)) for f in all_formats())
    assert get_format(FORMAT_BLOCK_FP8).moe_gemv_bound() == 176
    assert get_format(FORMAT_NVFP4).moe_gemv_bound("triton") == 44
    assert get_format(FORMAT_NVFP4).moe_gemv_bound("cuda") == 176
    block = parse_quantization({"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]})
    assert checkpoint_formats(block) == (FORMAT_BLOCK_FP8,)
    code = ("import sys, runners.app.support, runners.engine.formats as f; "
            "[f.get_format(n) for n in f.FORMATS]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT).stdout
    assert out.strip() == "False"
