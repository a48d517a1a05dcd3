"""Hydra composition: every registry entry composes with each sweep setting, from any cwd, and --cfg job."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from registry.compose import CONFIG_DIR
from registry.errors import UserError
from registry.resolve import resolve
from registry.schema import REPO_ROOT, entry_names

ENTRIES = entry_names()


def test_entries_exist():
    expected = {"super_v3_mtp", "super_v3_mtp_ws2", "super_v3_mtp_ws4", "qwen3_next_mtp",
                "qwen3_next_mtp_ws2", "qwen3_next_mtp_ws4", "tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp"}
    assert expected <= set(ENTRIES)


@pytest.fixture(autouse=True)
def _no_models_root(monkeypatch):
    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)


def _divides_heads(arch, world_size: int) -> bool:
    # expert counts need not divide: experts are split along their intermediate size (runners/engine/tp.py)
    heads = [arch.num_attention_heads]
    heads += [arch.mamba.num_heads] if arch.mamba else []
    heads += [arch.gdn.num_key_heads, arch.gdn.num_value_heads] if arch.gdn else []
    return all(h % world_size == 0 for h in heads)


@pytest.mark.parametrize("name", ENTRIES)
def test_entry_composes_with_sweep(name):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        own = resolve(compose("config", overrides=[f"model={name}"]), entry_name=name, check_checkpoint=False)
        assert own.entry.name == name
        assert own.ssm_replay == own.entry.ssm.replay and own.world_size == own.entry.world_size
        for ssm_replay in (True, False):
            for world_size in (1, 4):
                cfg = compose("config", overrides=[f"model={name}", f"ssm_replay={ssm_replay}",
                                                   f"world_size={world_size}"])
                if world_size > 1 and not _divides_heads(own.arch, world_size):
                    # e.g. the tiny checkpoints (6 attention heads): refused with the divisibility message.
                    with pytest.raises(UserError, match=f"world_size={world_size} does not divide"):
                        resolve(cfg, entry_name=name, check_checkpoint=False)
                    continue
                rr = resolve(cfg, entry_name=name, check_checkpoint=False)
                # Top-level settings override the entry's; the entry itself is unchanged.
                assert (rr.ssm_replay, rr.world_size) == (ssm_replay, world_size)
                assert rr.entry.world_size == own.entry.world_size


def test_variant_reuses_base_entry():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        base = compose("config", overrides=["model=super_v3_mtp"]).model
        ws4 = compose("config", overrides=["model=super_v3_mtp_ws4"]).model
    diff = {k for k in base if base[k] != ws4[k]}
    assert diff == {"name", "world_size"}
    assert ws4.world_size == 4
    # The variant file holds only what differs (composition, not a copy).
    text = (REPO_ROOT / "registry" / "model" / "super_v3_mtp_ws4.yaml").read_text()
    assert "arch:" not in text and "super_v3_mtp" in text


def test_default_config_and_top_level_overrides():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["eval.limit=7", "model.checkpoint=/abs/ckpt", "ssm_replay=true"])
    assert cfg.model.name == "tiny_nemotron_h_mtp"
    assert cfg.eval.limit == 7 and cfg.eval.num_fewshot == 5 and cfg.eval.max_gen_toks == 256
    assert cfg.runtime.device == "cpu"
    assert cfg.models_root is None  # ${oc.env:LLM_MODELS_ROOT,null} with the variable unset
    rr = resolve(cfg, check_checkpoint=False)
    assert rr.ssm_replay is True and rr.draft_len == 3 and str(rr.checkpoint_dir) == "/abs/ckpt"
    assert rr.dtype == "float32" and rr.max_batch_size == cfg.model.max_batch_size


def test_models_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_MODELS_ROOT", str(tmp_path))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=qwen3_next_mtp"])
    rr = resolve(cfg, check_checkpoint=False)
    assert rr.checkpoint_dir == tmp_path / "Qwen3-Next-80B-A3B-Instruct"


@pytest.mark.parametrize("overrides, captured", [
    (["world_size=2", "runtime=gpu"], True),  # the ws2 run on CUDA: every rank captures the entry's graphs
    (["world_size=2", "runtime=gpu", "runtime.cuda_graphs=false"], False),  # asked for none
    (["world_size=2"], False),  # the CPU captures none
    (["runtime=gpu"], True),  # world_size 1 captures them
])
def test_graph_batch_sizes_at_every_world_size(overrides, captured):
    """A run captures the entry's CUDA graph batch sizes on a GPU whatever its world size (tensor-parallel
    ranks capture them with their NCCL all-reduces inside, runners.engine.launch); none on the CPU or when
    runtime.cuda_graphs is false."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=super_v3_mtp", *overrides])
    rr = resolve(cfg, check_checkpoint=False)
    want = sorted(b for b in set(rr.entry.cuda_graph_batch_sizes) if b <= rr.max_batch_size)
    assert want  # the entry lists sizes: the test can tell on from off
    assert rr.cuda_graph_batch_sizes == (want if captured else [])


@pytest.mark.parametrize("overrides, graphs_reason, compile_reason", [
    (["runtime.cuda_graphs=true"], "need a CUDA device", None),  # the CPU: graphs asked for, none
    (["runtime.compile=true"], None, "captures none"),
    (["runtime=gpu", "runtime.compile=true"], None, None),  # graphs captured, compiled at their sizes
    (["runtime=gpu", "runtime.cuda_graphs=false", "runtime.compile=true"], None, "captures none"),
    ([], None, None),  # asked for neither on the CPU: nothing to say
])
def test_runtime_settings_that_cannot_apply_are_named(overrides, graphs_reason, compile_reason):
    """runtime.cuda_graphs / runtime.compile asked for where they cannot apply are named (run.py prints them
    as warnings and records them in results.json), never dropped silently."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_nemotron_h_mtp", *overrides])
    rr = resolve(cfg, check_checkpoint=False)
    for got, want in ((rr.cuda_graphs_off_reason, graphs_reason), (rr.compile_off_reason, compile_reason)):
        assert (got is None) if want is None else (want in got), (got, want)


def _run_py(*args, cwd):
    return subprocess.run([sys.executable, str(REPO_ROOT / "run.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_cfg_job_from_another_cwd(tmp_path):
    args = ["model=qwen3_next_mtp_ws4", "ssm_replay=true", "eval.limit=3", "--cfg", "job"]
    proc = _run_py(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.model.name == "qwen3_next_mtp_ws4" and cfg.model.world_size == 4
    assert cfg.ssm_replay is True and cfg.eval.limit == 3
    assert not list(tmp_path.iterdir())  # --cfg job runs nothing and writes nothing


def _code_blocks(markdown: str) -> list[str]:
    parts = markdown.split("```")
    return [p.split("\n", 1)[1].strip() for p in parts[1::2]]


def test_readme_setup_commands():
    """The README opens with exactly the two set-up commands; the second is CI's test command (.ci/run), whose
    first and last steps it is (CI also runs the registry pull-request check in between)."""
    blocks = _code_blocks((REPO_ROOT / "README.md").read_text())
    assert blocks[:2] == ["pip install . && python run.py",
                          'pip install ".[test]" && python -m pytest -n auto --dist loadgroup']
    ci = [line.replace(" -q", "") for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith(("pip ", "python "))]
    assert " && ".join([ci[0], ci[-1]]) == blocks[1]
    pr_check = 'python -m registry pr-check --if-base-exists --base "${REGISTRY_PR_BASE:-origin/main}"'
    assert ci[1:-1] == [pr_check]
