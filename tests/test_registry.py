"""Registry schema, untrusted-input rules, model dimensions and the `python -m registry` CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

import registry.validate as registry_validate
from registry.__main__ import main as registry_main
from registry.arch import arch_from_config, check_world_size, world_size_problems
from registry.errors import UserError
from registry.hf_config import HybridConfig
from registry.resolve import plain
from registry.schema import (
    MODEL_DIR,
    REPO_ROOT,
    ArchConfig,
    check_entry_file,
    entry_names,
    unknown_entry_error,
    validate_entry,
)

SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"


def _raw(name: str) -> dict:
    return yaml.safe_load((MODEL_DIR / f"{name}.yaml").read_text())


def _minimal(**extra) -> dict:
    return {"name": "x", "family": "nemotron_h", "hf_id": None, "checkpoint": "x", "embedded": True, **extra}


BASE_ENTRIES = ["super_v3_mtp", "qwen3_next_mtp", "tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp"]


@pytest.mark.parametrize("name", BASE_ENTRIES)
def test_base_entries_validate(name):
    entry = validate_entry(_raw(name), name=name)
    assert entry.name == name
    assert entry.speculative.algorithm.value == "mtp" and entry.speculative.draft_len == 3
    assert entry.ssm.replay is False and entry.ssm.state_dtype.value == "float32"


@pytest.mark.parametrize(
    "bad, problem, fix",
    [
        (_minimal(ssm={"replya": True}), "unknown key 'ssm.replya' (did you mean 'replay'?)", "under ssm"),
        (_minimal(famly="qwen3_next"), "unknown key 'famly' (did you mean 'family'?)", "allowed keys"),
        (_minimal(family="mamba"), "bad value for 'family'", "registry/schema.py"),
        (_minimal(max_batch_size="lots"), "bad value for 'max_batch_size'", "max_batch_size"),
        (_minimal(ssm={"backend": "cuda"}), "bad value for 'ssm.backend'", "ssm.backend"),
        (_minimal(world_size=0), "world_size must be >= 1", "positive"),
        (_minimal(speculative={"algorithm": "mtp", "draft_len": 0}), "draft_len=0", "draft_len >= 1"),
        (_minimal(speculative={"draft_len": 3}), "algorithm is none", "algorithm: mtp"),
        (_minimal(embedded=False), "arch is null", "arch: block"),
        (_minimal(family="qwen3_next", ssm={"replay_checkpointing": True}),
         "ssm.replay_checkpointing exists for Mamba2 layers only (nemotron_h), not qwen3_next",
         "ssm.replay_checkpointing: false"),
        (_minimal(ssm={"stochastic_rounding": True}), "ssm.stochastic_rounding rounds 16-bit state writes",
         "ssm.state_dtype: bfloat16"),
        ({"name": "x", "family": "nemotron_h", "hf_id": None}, "required key 'checkpoint' is missing", "add"),
    ],
)
def test_schema_errors_name_file_key_and_fix(bad, problem, fix):
    with pytest.raises(UserError) as e:
        validate_entry(bad, name="x")
    assert "registry/model/x.yaml" in e.value.problem
    assert problem in e.value.problem
    assert fix in e.value.fix


def test_name_must_match_file():
    with pytest.raises(UserError, match="name is 'super_v3_mtp' but the file is super_v3_mtp_ws4.yaml"):
        validate_entry(_raw("super_v3_mtp"), name="super_v3_mtp_ws4")


@pytest.mark.parametrize("where", ["top", "nested"])
def test_target_rejected_and_never_instantiated(where, tmp_path):
    marker = tmp_path / "pwned"
    evil = {"_target_": "pathlib.Path.touch", "self": str(marker)}
    raw = _minimal(**({"_target_": "os.system"} if where == "top" else {"ssm": evil}))
    with pytest.raises(UserError) as e:
        validate_entry(OmegaConf.create(raw), name="x")
    assert "_target_" in e.value.problem and "data" in e.value.problem
    assert not marker.exists()


def test_unknown_entry_names_closest():
    err = unknown_entry_error("super_v3")
    assert "model='super_v3'" in err.problem
    assert "did you mean super_v3_mtp" in err.fix and "tiny_nemotron_h_mtp" in err.fix


def _super_hf_config(**overrides) -> dict:
    cfg = {
        "model_type": "nemotron_h", "hidden_size": 4096, "vocab_size": 131072, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128, "hybrid_override_pattern": SUPER_PATTERN,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
        "n_routed_experts": 512, "num_experts_per_tok": 22,
    }
    return {**cfg, **overrides}


def test_super_arch_block_matches_released_config_layout():
    entry = validate_entry(_raw("super_v3_mtp"), name="super_v3_mtp")
    assert plain(arch_from_config(HybridConfig.from_dict(_super_hf_config()))) == plain(entry.arch)
    # transformers 5 spells the same layout as a list of block types.
    kinds = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
    as_list = _super_hf_config(layers_block_type=[kinds[c] for c in SUPER_PATTERN])
    del as_list["hybrid_override_pattern"]
    assert plain(arch_from_config(HybridConfig.from_dict(as_list))) == plain(entry.arch)


def test_qwen3_next_arch_block_matches_transformers_config():
    from transformers import Qwen3NextConfig  # its defaults are Qwen3-Next-80B-A3B's dimensions

    entry = validate_entry(_raw("qwen3_next_mtp"), name="qwen3_next_mtp")
    assert plain(arch_from_config(HybridConfig.from_dict(Qwen3NextConfig().to_dict()))) == plain(entry.arch)


def test_arch_from_incomplete_config():
    """A field transformers has a default for takes it (one parser: the engine builds the same model); one the
    family has no default for is an error naming it."""
    cfg = _super_hf_config()
    del cfg["ssm_state_size"]
    assert arch_from_config(HybridConfig.from_dict(cfg)).mamba.d_state == 128  # NemotronHConfig's default
    del cfg["hidden_size"]
    with pytest.raises(UserError, match="hidden_size is missing"):
        HybridConfig.from_dict(cfg)


def test_world_size_divisibility():
    arch: ArchConfig = arch_from_config(HybridConfig.from_dict(_super_hf_config()))
    assert world_size_problems(arch, 4) == {}  # 2 KV heads are replicated over 4 ranks
    assert world_size_problems(arch, 8) == {}
    with pytest.raises(UserError) as e:
        check_world_size(arch, 3, "super_v3_mtp")
    assert "world_size=3 does not divide" in e.value.problem and "mamba heads=128" in e.value.problem
    assert "[1, 2, 4, 8]" in e.value.fix
    # routed experts are split along their intermediate size: any expert count shards, the sizes must divide
    odd = HybridConfig.from_dict(_super_hf_config(n_routed_experts=6, num_experts_per_tok=2))
    assert world_size_problems(arch_from_config(odd), 4) == {}
    assert world_size_problems(odd, 4) == {}
    odd = HybridConfig.from_dict(_super_hf_config(moe_intermediate_size=2690, num_attention_heads=30))
    assert world_size_problems(odd, 4) == {"attention heads": 30, "moe_intermediate_size": 2690}
    assert world_size_problems(odd, 2) == {}


def test_registry_list(capsys):
    assert registry_main(["list"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[:3] == ["name", "family", "checkpoint"] and "baseline" in header
    for name in entry_names():
        assert name in out
    row = next(line for line in out.splitlines() if line.startswith("super_v3_mtp_ws4 "))
    assert row.split()[1:3] == ["nemotron_h", "NVIDIA-Nemotron-3-Super-120B-A12B-BF16"] and " 4 " in row


def test_registry_validate_cli_passes():
    """CI's registry check: `python -m registry validate` exits 0 on the shipped entries."""
    proc = subprocess.run([sys.executable, "-m", "registry", "validate"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(entry_names())} registry entries valid" in proc.stdout


def test_registry_validate_reports_missing_baseline(monkeypatch, tmp_path, capsys):
    """An entry whose baseline key or matching row is missing fails validation, naming file, key and rows."""
    import registry.baselines as baselines

    gsm8k = tmp_path / "gsm8k.yaml"
    gsm8k.write_text(
        "schema_version: 1\nprotocol: {num_fewshot: 5, max_gen_toks: 256}\nmodels:\n  super_v3:\n    rows:\n"
        "      - {dtype: bfloat16, quant: none, kv_cache_quant: none, spec_dec: mtp, accuracy: 80.0,"
        " num_samples: 1319}\n"
    )
    acceptance = tmp_path / "acceptance.yaml"
    acceptance.write_text(
        "schema_version: 1\nprotocol: {num_fewshot: 5, max_gen_toks: 256}\nmodels:\n  super_v3:\n    rows:\n"
        "      - {quant: none, draft_len: 5, acceptance_rate_floor: 0.4}\n"
    )
    monkeypatch.setattr(baselines, "GSM8K_BASELINES", gsm8k)
    monkeypatch.setattr(baselines, "ACCEPTANCE_BASELINES", acceptance)
    assert registry_main(["validate", "super_v3_mtp", "qwen3_next_mtp"]) == 1
    out = capsys.readouterr()
    assert "no acceptance reference for 'super_v3' at quant=none draft_len=3" in out.out
    assert "no GSM8K baselines for model key 'qwen3_next'" in out.out
    assert "2 of 2 registry entries are invalid" in out.err


def test_registry_validate_reports_bad_entry(monkeypatch, capsys):
    real_compose = registry_validate.compose_entry

    def compose_with_typo(name, overrides=None):  # Hydra's `+` adds a key the schema does not have
        return real_compose(name, [*(overrides or []), "+model.spec_decoding.draft_len=3"])

    monkeypatch.setattr(registry_validate, "compose_entry", compose_with_typo)
    assert registry_main(["validate", "tiny_qwen3_next_mtp"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  tiny_qwen3_next_mtp" in out and "unknown key 'spec_decoding'" in out


def test_registry_validate_accepts_a_flashinfer_entry_on_the_cpu(monkeypatch, capsys):
    """ssm.backend=flashinfer is a GPU runtime matter: validate (on any machine) passes such an entry; only
    `python run.py` on the CPU refuses it (tests/test_app.py)."""
    real_compose = registry_validate.compose_entry

    def compose_flashinfer(name, overrides=None):
        cfg = real_compose(name, overrides)
        cfg.model.ssm.backend = "flashinfer"
        return cfg

    monkeypatch.setattr(registry_validate, "compose_entry", compose_flashinfer)
    assert registry_main(["validate", "super_v3_mtp", "tiny_nemotron_h_mtp"]) == 0, capsys.readouterr().out
    assert "2 registry entries valid" in capsys.readouterr().out


def test_registry_validate_unknown_name(capsys):
    assert registry_main(["validate", "nope"]) == 2
    assert "unknown registry entries" in capsys.readouterr().err
    assert registry_main(["validate", "super_v3"]) == 2  # a close name: suggested, as run.py's model= does
    assert "  fix: did you mean super_v3_mtp" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, problem",
    [
        ("# @package _global_\nname: evil\nhydra: {callbacks: {x: {_target_: os.system}}}\n", "@package"),
        ("defaults:\n  - /hydra/callbacks: log_job_return\nname: evil\n", "defaults must be a list"),
        ("defaults: [/hydra/callbacks/log_job_return]\nname: evil\n", "is not a registry entry name"),
        ("defaults: [super_v3_mtp@_global_]\nname: evil\n", "is not a registry entry name"),
        ("name: evil\nhydra:\n  callbacks: {}\n", "unknown key 'hydra'"),
        ("defaults: [evil, _self_]\nname: evil\n", "defaults form a cycle"),
        ("defaults: [no_such_entry]\nname: evil\n", "unknown registry entry model='no_such_entry'"),
        ("name: [unclosed\n", "not valid YAML"),
    ],
)
def test_entry_file_cannot_reach_outside_model_node(tmp_path, text, problem):
    (tmp_path / "evil.yaml").write_text(text)
    with pytest.raises(UserError) as e:
        check_entry_file("evil", tmp_path)
    assert problem in e.value.problem


def test_shipped_entry_files_pass_raw_check():
    for name in entry_names():
        check_entry_file(name)


def test_entry_interpolation_rejected(tmp_path):
    """`${oc.env:...}` in a PR's entry could copy secrets into published results: entries are plain data."""
    from registry.schema import check_entry_file

    (tmp_path / "leaky.yaml").write_text(
        "name: leaky\nfamily: nemotron_h\nhf_id: ${oc.env:HOME}\ncheckpoint: x\n"
    )
    with pytest.raises(UserError, match=r"key 'hf_id' holds an interpolation"):
        check_entry_file("leaky", tmp_path)
    (tmp_path / "nested.yaml").write_text("name: nested\nfamily: nemotron_h\ncheckpoint: x\n"
                                          "cuda_graph_batch_sizes: [1, '${oc.env:X}']\n")
    with pytest.raises(UserError, match=r"cuda_graph_batch_sizes\[1\]"):
        check_entry_file("nested", tmp_path)


def test_registry_validate_loads_embedded_checkpoints(monkeypatch, tmp_path, capsys):
    """A truncated shipped checkpoint fails validate (it used to pass the file-presence check)."""
    import shutil

    shipped = registry_validate.EMBEDDED_CHECKPOINTS_DIR / "tiny_nemotron_h_mtp"
    broken = tmp_path / "tiny_nemotron_h_mtp"
    shutil.copytree(shipped, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 3_000_000])
    monkeypatch.setattr(registry_validate, "EMBEDDED_CHECKPOINTS_DIR", tmp_path)
    assert registry_main(["validate", "tiny_nemotron_h_mtp"]) == 1
    assert "does not load" in capsys.readouterr().out


def test_stop_ids_from_generation_config(tmp_path):
    """generation_config.json's eos_token_id (what transformers' generate stops on; Qwen3-Next-Instruct lists
    two ids there, one in config.json) wins over config.json's; without the file, config.json's."""
    import json
    import shutil

    from registry.hf_config import HybridConfig

    shipped = REPO_ROOT / "registry" / "checkpoints" / "tiny_qwen3_next_mtp"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(shipped / "config.json", ckpt)
    assert HybridConfig.from_pretrained(ckpt).eos_token_id == (2,)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "do_sample": False}))
    assert HybridConfig.from_pretrained(ckpt).eos_token_id == (2, 7)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(UserError, match="eos_token_id must be an int or a list of ints"):
        HybridConfig.from_pretrained(ckpt)


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """The "billion laughs" shape (nine levels of nine aliases: 9**9 strings once expanded) is refused at
    its first alias, at once and naming the file and line, by every reader of registry files
    (registry/yamlfile.py); a python tag too."""
    import time

    from registry.yamlfile import RegistryYAMLError, load

    levels = ["a0: &a0 lol"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    (tmp_path / "laughs.yaml").write_text("name: laughs\n" + "\n".join(levels) + "\n")
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        check_entry_file("laughs", tmp_path)
    assert time.monotonic() - t0 < 5  # refused, not expanded (it used 4 GiB and died after 35 s)
    assert e.value.problem.startswith("registry/model/laughs.yaml: not valid YAML for the registry (line 3")
    assert "found the alias *a0: registry files may not use YAML aliases" in e.value.problem
    assert "defaults:" in e.value.fix
    with pytest.raises(RegistryYAMLError, match="could not determine a constructor for the tag"):
        load("x: !!python/object/apply:os.system [echo]\n", "x.yaml")
    assert load("a: 1\nb: [2, 3]\n", "x.yaml") == {"a": 1, "b": [2, 3]}


@pytest.mark.parametrize("checkpoint, refused", [
    ("../../../etc", True), ("tiny/../../x", True), ("/etc", True), ("~/ck", True),
    ("tiny_nemotron_h_mtp", False),
])
def test_an_embedded_checkpoint_stays_under_registry_checkpoints(tmp_path, checkpoint, refused):
    """An embedded entry's checkpoint: climbing out of registry/checkpoints/ or absolute is refused (a pull
    request must not point CI at files outside the repository), also when `embedded` comes from the base;
    a released entry may not climb out of models_root either. A run's model.checkpoint=/data/... override
    is not a file and stays allowed (tests/test_app.py runs checkpoints from temporary folders)."""
    (tmp_path / "base.yaml").write_text("name: base\nfamily: nemotron_h\nembedded: true\ncheckpoint: ok\n")
    (tmp_path / "mine.yaml").write_text(f"defaults: [base, _self_]\nname: mine\ncheckpoint: {checkpoint}\n")
    (tmp_path / "released.yaml").write_text(f"name: released\nfamily: nemotron_h\ncheckpoint: {checkpoint}\n")
    if not refused:
        check_entry_file("mine", tmp_path)
        check_entry_file("released", tmp_path)
        return
    with pytest.raises(UserError) as e:
        check_entry_file("mine", tmp_path)
    assert f"checkpoint {checkpoint!r} leaves registry/checkpoints/" in e.value.problem
    assert "model.checkpoint=/path/to/it" in e.value.fix
    if checkpoint != "/etc":
        with pytest.raises(UserError, match=r"leaves models_root"):
            check_entry_file("released", tmp_path)
    else:
        check_entry_file("released", tmp_path)


def test_registry_validate_reports_every_problem_of_a_file(monkeypatch, tmp_path, capsys):
    """Three problems in one file (an unknown key, a wrong type, an interpolation), and two range rules of a
    composed entry: validate lists them all in one run, not the first one per run."""
    from registry import schema

    (tmp_path / "many.yaml").write_text("name: many\nfamily: nemotron_h\ncheckpoint: x\nembedded: true\n"
                                        "colour: red\nmax_batch_size: lots\nhf_id: ${oc.env:HOME}\n")
    with pytest.raises(UserError) as e:
        check_entry_file("many", tmp_path)
    problems = [x.problem for x in e.value.errors]
    assert len(problems) == 3, problems
    assert any("interpolation" in p for p in problems) and any("colour" in p for p in problems)
    assert any("max_batch_size" in p for p in problems)
    assert "(and 2 more problems: python -m registry validate lists all)" in e.value.problem
    entry = schema.validate_entry(registry_validate.compose_entry("tiny_nemotron_h_mtp").model,
                                  name="tiny_nemotron_h_mtp")
    entry.max_seq_len, entry.world_size = 0, 0
    with pytest.raises(UserError) as e:
        schema.check_entry_values(entry, "x.yaml")
    assert [x.problem for x in e.value.errors] == ["x.yaml: max_seq_len must be >= 1, got 0",
                                                   "x.yaml: world_size must be >= 1, got 0"]
    # validate lists each problem on its own line (compose_entry checks the raw file first, as run.py does)
    real_compose = registry_validate.compose_entry

    def compose_from_tmp(name, overrides=None):
        check_entry_file(name, tmp_path)
        return real_compose(name, overrides)

    monkeypatch.setattr(registry_validate, "compose_entry", compose_from_tmp)
    report = registry_validate.validate_one("many")
    assert len(report.errors) == 3 and all(" -- fix: " in line for line in report.errors), report.errors
