"""Synthetic checkpoints at the released layouts (runners.tools.synth): config.json as the release writes
it, names
and shapes the loader and transformers read, proportional layer cuts, shards, tokenizer, finite activations.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from tokenizers import Tokenizer

from registry.arch import arch_from_config
from runners.engine.loader import load_model
from runners.engine.models.config import HybridConfig
from runners.tools.synth import (
    MIN_EXPERTS,
    RELEASE_CONFIGS,
    SUPER_V3_PATTERN,
    SynthError,
    arch_overrides,
    cut_pattern,
    num_layers_range,
    parse_size,
    synth_config,
    synthetic_model,
    tensor_specs,
    write_synthetic_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
ENTRIES = {"nemotron_h": "super_v3_mtp", "qwen3_next": "qwen3_next_mtp"}
# CPU-test widths: the releases' layouts and head structure, smaller hidden / expert sizes and vocab
SMALL = {
    "nemotron_h": dict(hidden_size=128, vocab_size=4096, mamba_num_heads=16, moe_latent_size=64,
                       moe_intermediate_size=96, moe_shared_expert_intermediate_size=192,
                       num_attention_heads=8, head_dim=32),
    "qwen3_next": dict(hidden_size=128, vocab_size=4096, linear_key_head_dim=32, linear_value_head_dim=48,
                       head_dim=64, num_attention_heads=4, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64),
}


@pytest.mark.parametrize("family", sorted(ENTRIES))
def test_release_config_agrees_with_the_registry_entry(family):
    """The full-size synthetic config.json is the release's: the registry entry's arch: block equals it."""
    entry = yaml.safe_load((REPO / "registry" / "model" / f"{ENTRIES[family]}.yaml").read_text())
    arch = asdict(arch_from_config(HybridConfig.from_dict(synth_config(family))))
    assert {k: arch[k] for k in entry["arch"]} == entry["arch"]
    assert all(not arch[k] for k in set(arch) - set(entry["arch"]))  # fields the entry leaves at 0 / null
    hc = HybridConfig.from_dict(synth_config(family))
    params = sum(math.prod(s.shape) for s in tensor_specs(synth_config(family)))
    if family == "nemotron_h":  # 120B-A12B: 40 M, 40 E, 8 * and a "*E" MTP module
        assert hc.layer_types.count("moe") == 40 and hc.mtp_layer_types == ("attention", "moe")
        assert 120e9 < params < 125e9
    else:  # 80B-A3B: 36 GDN + 12 attention layers, each with an MoE, and one MTP decoder layer
        assert hc.layer_types.count("gdn") == 36 and hc.num_nextn_predict_layers == 1
        assert 79e9 < params < 83e9


def test_cut_pattern_keeps_proportions_and_order():
    p = cut_pattern(SUPER_V3_PATTERN, 22)
    assert (p.count("M"), p.count("E"), p.count("*")) == (10, 10, 2)
    assert cut_pattern(SUPER_V3_PATTERN, 88) == SUPER_V3_PATTERN
    assert sorted(cut_pattern(SUPER_V3_PATTERN, 3)) == sorted("ME*")
    assert "EE" not in p and "**" not in p  # still interleaved like the release
    with pytest.raises(SynthError, match="between 3"):
        cut_pattern(SUPER_V3_PATTERN, 2)


def test_layer_and_expert_cuts():
    q = HybridConfig.from_dict(synth_config("qwen3_next", num_layers=12, num_experts=64))
    assert q.layer_types[0::2].count("attention") == 3 and q.n_routed_experts == 64
    q2 = HybridConfig.from_dict(synth_config("qwen3_next", num_layers=2))
    assert q2.layer_types[0::2] == ("gdn", "attention")
    n = synth_config("nemotron_h", num_layers=22, num_experts=16)
    assert n["num_hidden_layers"] == 22 and n["num_experts_per_tok"] == 16  # top-22 capped at 16 experts
    with pytest.raises(SynthError, match=">= 2 layers"):
        synth_config("qwen3_next", num_layers=1)
    with pytest.raises(SynthError, match="family"):
        synth_config("llama")
    overrides = arch_overrides(synth_config("nemotron_h", num_layers=22, num_experts=256), "nemotron_h")
    assert sorted(overrides) == sorted(["model.arch.num_experts=256", "model.arch.num_attention_layers=2",
                                        "model.arch.num_mamba_layers=10", "model.arch.num_moe_layers=10"])
    assert arch_overrides(synth_config("qwen3_next"), "qwen3_next") == []


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_num_layers_range_is_what_synth_config_accepts(family):
    """num_layers_range (the limits other CLIs check under their own option names) agrees with synth_config:
    its ends pass, one layer outside them is refused."""
    least, most = num_layers_range(family)
    assert synth_config(family, num_layers=least)["num_hidden_layers"] == least
    with pytest.raises(SynthError, match=f"--num-layers {least - 1}"):
        synth_config(family, num_layers=least - 1)
    if most is not None:
        assert synth_config(family, num_layers=most)["num_hidden_layers"] == most
        with pytest.raises(SynthError, match=f"--num-layers {most + 1}"):
            synth_config(family, num_layers=most + 1)
    with pytest.raises(SynthError, match=f"--num-experts {MIN_EXPERTS - 1}"):
        synth_config(family, num_experts=MIN_EXPERTS - 1)


@pytest.fixture(scope="module", params=sorted(ENTRIES))
def small_ckpt(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(f"synth_{family}")
    result = write_synthetic_checkpoint(path, family, num_layers=4, num_experts=16, overrides=SMALL[family],
                                        dtype=torch.float32, shard_bytes=2 * 10**6)
    return family, path, result


def test_layout_is_the_releases(small_ckpt):
    family, path, result = small_ckpt
    cfg_text = (path / "config.json").read_text()
    cfg = json.loads(cfg_text)
    release_keys = set(RELEASE_CONFIGS[family])
    assert set(cfg) == release_keys
    if family == "nemotron_h":
        assert "hybrid_override_pattern" in cfg and cfg["mtp_hybrid_override_pattern"] == "*E"
        assert "Infinity" in cfg_text  # time_step_limit as released configs write it
    else:
        assert cfg["full_attention_interval"] == 4 and "layer_types" not in cfg
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == result.num_shards > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
                t = f.get_slice(k)
                total += math.prod(t.get_shape()) * (4 if t.get_dtype() == "F32" else 2)
    assert total == index["metadata"]["total_size"] == result.total_bytes
    assert any(k.startswith("mtp.") for k in index["weight_map"])
    recipe = json.loads((path / "synth.json").read_text())
    assert recipe["num_layers"] == 4 and recipe["num_params"] == result.num_params


def test_tokenizer_covers_the_vocab_and_encodes_gsm8k(small_ckpt, gsm8k_dir):
    family, path, _ = small_ckpt
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    base = Tokenizer.from_file(str(REPO / "registry/checkpoints/tiny_nemotron_h_mtp/tokenizer.json"))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    assert tok.get_vocab_size() == vocab
    question = json.loads((gsm8k_dir / "test.jsonl").read_text().splitlines()[0])["question"]
    text = f"Question: {question}\nAnswer:"
    assert tok.encode(text).ids == base.encode(text).ids and max(tok.encode(text).ids) < vocab
    assert tok.decode([vocab - 1]) == f"<|synth_{vocab - 1}|>"  # every id the model can emit decodes
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))


def test_transformers_reads_the_checkpoint_like_our_loader(small_ckpt):
    """transformers (which ignores mtp.*) loads the same files and computes the same logits."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    family, path, _ = small_ckpt
    if family == "nemotron_h":  # transformers clamps dt at time_step_min in prefill; compare without clamp
        cfg = json.loads((path / "config.json").read_text())
        cfg["time_step_min"] = 0.0
        hf_dir = path.parent / f"{path.name}_hf"
        hf_dir.mkdir(exist_ok=True)
        for f in path.iterdir():
            if f.name != "config.json" and not (hf_dir / f.name).exists():
                (hf_dir / f.name).symlink_to(f)
        (hf_dir / "config.json").write_text(json.dumps(cfg))
    else:
        hf_dir = path
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(level)
    ours = load_model(path)
    assert ours.mtp is not None
    ids = torch.randint(0, 4096, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.lm_logits(ours(ids)), hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_synthetic_model_is_the_loaded_checkpoint(small_ckpt, dtype, tmp_path):
    """synthetic_model (no files; benchmarks/bench_e2e.py) gives bit for bit the model the loader makes of the
    checkpoint written with the same options, in the loader's dtypes (the router in float32)."""
    family, path, _ = small_ckpt
    if dtype != torch.float32:  # the on-disk dtype matters: a bf16 file holds the router rounded to bf16
        path = tmp_path
        write_synthetic_checkpoint(path, family, num_layers=4, num_experts=16,
                                   overrides=SMALL[family], dtype=dtype)
    loaded = load_model(path, dtype=dtype, load_mtp=True).state_dict()
    built, config = synthetic_model(family, num_layers=4, num_experts=16, overrides=SMALL[family],
                                    dtype=dtype)
    assert config == json.loads((path / "config.json").read_text())
    assert built.mtp is not None and not built.training
    got = built.state_dict()
    assert sorted(got) == sorted(loaded)
    differ = [n for n in loaded if got[n].dtype != loaded[n].dtype or not torch.equal(got[n], loaded[n])]
    assert not differ, differ[:5]
    assert any(t.dtype == torch.float32 for t in got.values()) and any(t.dtype == dtype for t in got.values())


@pytest.mark.parametrize("family", sorted(ENTRIES))
def test_activations_stay_finite_through_all_release_layers(family, tmp_path):
    """All 88 / 48 layers (release depth; small widths): the residual stream grows slowly and the logits
    are finite with about unit spread in bf16."""
    small = {**SMALL[family], "vocab_size": 2048}
    path = write_synthetic_checkpoint(tmp_path, family, num_experts=8, overrides=small,
                                      shard_bytes=10**8).path
    model = load_model(path, dtype=torch.bfloat16)
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(1))
    rms = []
    with torch.no_grad():
        x = model.embeddings(ids)
        for block in model.layers:
            x = block(x, None, None)
            rms.append(x.float().pow(2).mean().sqrt().item())
        logits = model.lm_logits(model.norm_f(x))
    assert len(rms) == (88 if family == "nemotron_h" else 96)
    assert all(math.isfinite(r) for r in rms) and max(rms) < 50
    assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 3 and logits.abs().max() < 30


def test_cli_writes_and_refuses(tmp_path):
    out = tmp_path / "q"
    cmd = [sys.executable, "-m", "runners.tools.synth", "--family", "qwen3_next", "--out", str(out),
           "--num-layers", "2", "--num-experts", "4", "--shard-size", "1MB", "--dtype", "float32"]
    cmd += [f"--set={k}={v}" for k, v in SMALL["qwen3_next"].items()]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "model.arch.num_gdn_layers=1" in proc.stdout and (out / "model.safetensors.index.json").is_file()
    assert load_model(out).config.n_routed_experts == 4
    for bad, says in ((["--num-layers", "1"], ">= 2 layers"), (["--shard-size", "lots"], "size 'lots'"),
                      (["--set", "hidden_size"], "KEY=VALUE")):
        base = [sys.executable, "-m", "runners.tools.synth", "--family", "qwen3_next",
                "--out", str(tmp_path / "x")]
        proc = subprocess.run(base + bad, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "x" / "model.safetensors.index.json").exists()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("123") == 123
    with pytest.raises(ValueError):
        parse_size("0.1B")


def _cli_error(capsys, argv: list[str]) -> str:
    """synth.main(argv) exits 2 with an `error:` and a `fix:` line (no traceback); returns its stderr."""
    from runners.tools import synth

    assert synth.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "\n  fix: " in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("setting, says", [
    ("hidden_size=abc", "hidden_size takes an integer"),
    ("hidden_size=-5", "must be a finite number >= 1"),
    ("hidden_size=0", "must be a finite number >= 1"),
    ("hidden_size=2.5", "hidden_size takes an integer"),
    ("use_bias=1", "use_bias takes true or false"),
    ("norm_eps=NaN", "finite"),
    ("bogus_key=5", "bogus_key is not a config.json field of nemotron_h"),
    ("linear_key_head_dim=32", "linear_key_head_dim is not a config.json field of nemotron_h"),
])
def test_cli_refuses_bad_set_before_writing(tmp_path, capsys, setting, says):
    out = tmp_path / "x"
    err = _cli_error(capsys, ["--family", "nemotron_h", "--num-layers", "3", "--set", setting,
                              "--out", str(out)])
    assert says in err
    assert not out.exists()


def test_set_takes_the_parser_only_fields_and_release_types():
    cfg = synth_config("nemotron_h", num_layers=3, overrides={
        "intermediate_size": 64, "routed_scaling_factor": 2, "pad_token_id": 0, "use_bias": True})
    assert cfg["intermediate_size"] == 64 and cfg["routed_scaling_factor"] == 2 and cfg["use_bias"] is True
    with pytest.raises(SynthError, match="bogus is not a config.json field of nemotron_h"):
        synth_config("nemotron_h", overrides={"bogus": 1})
    # one override set for both families (benchmarks/bench_e2e.py --synth-set): the other family's fields
    # pass synth_config unchecked (its parser ignores them), the CLI refuses them
    assert "linear_key_head_dim" not in synth_config("nemotron_h", num_layers=3,
                                                     overrides={"linear_key_head_dim": 32})
    with pytest.raises(SynthError, match="hidden_size takes an integer"):
        synth_config("qwen3_next", overrides={"mamba_num_heads": 8, "hidden_size": "wide"})


def test_cli_refuses_an_unwritable_out(tmp_path, capsys, monkeypatch):
    import errno
    import shutil as shutil_mod

    from runners.tools import synth

    small = ["--family", "nemotron_h", "--num-layers", "3", "--num-experts", "4",
             *[f"--set={k}={v}" for k, v in SMALL["nemotron_h"].items()]]
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "is a file" in _cli_error(capsys, [*small, "--out", str(a_file)])
    assert "cannot be created" in _cli_error(capsys, [*small, "--out", str(a_file / "sub")])

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    with monkeypatch.context() as m:
        m.setattr(Path, "mkdir", read_only)
        assert "Read-only file system" in _cli_error(capsys, [*small, "--out", str(tmp_path / "ro" / "x")])
    assert not (tmp_path / "ro").exists()

    # too little disk: refused before anything is written, and the folders it created are removed again
    full = shutil_mod.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(synth.shutil, "disk_usage", lambda _path: full)
    assert "GB free" in _cli_error(capsys, [*small, "--out", str(tmp_path / "new" / "ckpt")])
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    _cli_error(capsys, [*small, "--out", str(kept)])
    assert kept.is_dir()  # a folder it did not create stays
    monkeypatch.undo()

    # the disk fills while writing
    def disk_full(out, vocab_size):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "tokenizer.json"))

    monkeypatch.setattr(synth, "write_tokenizer", disk_full)
    err = _cli_error(capsys, [*small, "--out", str(tmp_path / "y")])
    assert "No space left on device" in err and "tokenizer.json" in err
