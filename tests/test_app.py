"""runners.app.main.run with fake engine / evaluation, every user error's message, and run.py's error
output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from evals.evaluate import EvalResult
from evals.results import RESULTS_SCHEMA_VERSION
from evals.task import TASKS
from registry.checkpoint import checkpoint_fingerprint
from registry.compose import compose_config
from registry.errors import UserError
from registry.schema import REPO_ROOT
from runners.app import main as app
from runners.engine.memory import LoadReport
from runners.engine.options import EngineOptions
from runners.engine.prefix_cache import prefix_cache_off_reason

TINY_NEMOTRON_H_CONFIG = {
    "model_type": "nemotron_h", "hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hybrid_override_pattern": "M*EM", "mamba_num_heads": 8,
    "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "num_nextn_predict_layers": 1,
}


def make_checkpoint(path: Path, *, sharded: bool = False, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or TINY_NEMOTRON_H_CONFIG))
    shutil.copy(REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp" / "tokenizer.json", path)
    if sharded:
        weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        for shard in set(weight_map.values()):
            (path / shard).write_bytes(b"")
    else:
        (path / "model.safetensors").write_bytes(b"")
    return path


@dataclass
class FakeStats:
    num_requests: int = 4
    prompt_tokens: int = 4000
    generated_tokens: int = 600
    prefill_seconds: float = 2.0
    decode_seconds: float = 3.0
    steps: int = 200
    drafted_tokens: int = 600
    accepted_drafts: int = 300
    request_steps: int = 200
    accepted_per_position: list = field(default_factory=lambda: [150, 100, 50])
    num_accepted_hist: list = field(default_factory=lambda: [0, 50, 50, 50, 50])

    def to_dict(self):
        return asdict(self)


class FakeEngine:
    """Stands in for runners.Engine: records how the application builds it."""

    built: list[tuple[str, dict]] = []

    def __init__(self, ssm_backend: str, options: EngineOptions):
        self.ssm_backend = ssm_backend  # the backend that runs (runners.Engine resolves it)
        self.load_report = LoadReport(
            seconds=1.5, weights_seconds=1.0, device="cpu", dtype="float32", weight_bytes=3 * 2**30,
            cache_bytes=2**21, budget_bytes=None, host_peak_rss_bytes=2**31, host_peak_reset=True,
            device_peak_bytes=None, device_allocated_bytes=None)
        # the prefix cache as runners.Engine keeps it (its policy decides): None when off, else an object
        # with its limit
        self.prefix_cache_off_reason = prefix_cache_off_reason(options)
        on = self.prefix_cache_off_reason is None
        self.prefix_cache = SimpleNamespace(max_bytes=options.prefix_cache_bytes or 2**29) if on else None

    @classmethod
    def from_pretrained(cls, path, options, *, device="cpu"):
        cls.built.append((path, dict(device=device, **asdict(options))))
        return cls(options.ssm_backend, options)

    def capture_graphs(self, batch_sizes=None, max_kv_len=None):
        """The app captures the step's graphs ahead of the evaluation on a GPU (timings.capture_seconds)."""
        return 0

    def cache_memory(self):
        return {"ssm_state_bytes": 2**20, "conv_state_bytes": 1024, "kv_cache_bytes": 2**21,
                "spec_buffers_bytes": 0}


def fake_result(scores: dict, samples_path, stats: dict | None = None, *, num_fewshot: int = 5,
                max_gen_toks: int = 256) -> EvalResult:
    """What runners.app.lm_adapter.evaluate_engine returns, with FakeStats' counters (every request generated
    now, so the generate calls' token sums are the counters' own) and the protocol it ran (task section)."""
    if stats is None:
        fake = FakeStats()
        stats = {**fake.to_dict(), "timing_prompt_tokens": fake.prompt_tokens,
                 "timing_generated_tokens": fake.generated_tokens}
    return EvalResult(scores=scores, stats=stats, samples_path=Path(samples_path),
                       wall_seconds=1.0, num_resumed=0, num_generated=scores["n"],
                       task={"task": "gsm8k", "version": 3.0, "num_fewshot": num_fewshot,
                             "max_gen_toks": max_gen_toks})


@pytest.fixture
def fakes(monkeypatch):
    """Fake Engine and evaluate_engine; returns the list of evaluate calls."""
    FakeEngine.built = []
    calls = []

    def fake_evaluate(engine, tokenizer_path, *, data_dir, limit=None, num_fewshot=5, max_gen_toks=256,
                      out_dir, resume=False, progress=True, fingerprint=None, task=None):
        calls.append(dict(engine=engine, tokenizer_path=tokenizer_path, data_dir=data_dir, limit=limit,
                          num_fewshot=num_fewshot, max_gen_toks=max_gen_toks, out_dir=out_dir, resume=resume,
                          fingerprint=fingerprint, task=task))
        samples = Path(out_dir) / "samples.jsonl"
        samples.write_text('{"doc_id": 0}\n')
        return fake_result({"strict_match": 0.25, "flexible_extract": 0.5, "n": 4}, samples,
                           num_fewshot=num_fewshot, max_gen_toks=max_gen_toks)

    monkeypatch.setattr(app, "Engine", FakeEngine)
    monkeypatch.setattr(app, "evaluate_engine", fake_evaluate)
    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    return calls


def make_gsm8k_dir(path: Path, rows: int = 2) -> Path:
    """A GSM8K folder whose files pass evals.tasks.gsm8k's checks (the fakes never read it further): `rows`
    test questions, and train examples enough for the tasks' default few-shot counts."""
    path.mkdir(parents=True)
    for split, n in (("train", max(rows, 8)), ("test", rows)):
        (path / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
            for i in range(n)))
    return path


def _cfg(*overrides):
    return compose_config(list(overrides))


def test_run_builds_engine_evaluates_and_writes_results(fakes, tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    data = make_gsm8k_dir(tmp_path / "gsm8k")
    cfg = _cfg("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={out}", "ssm_replay=true",
               "eval.limit=4", f"eval.data_dir={data}")
    results = app.run(cfg)

    (path, kwargs), = FakeEngine.built
    assert path == str(ckpt)
    want = EngineOptions(dtype="float32", draft_len=3, ssm_replay=True, max_batch_size=64, max_seq_len=4096,
                         ssm_state_dtype="float32", ssm_backend="torch", ssm_replay_checkpointing=False,
                         kv_cache_quant="none", cuda_graphs=False, cuda_graph_batch_sizes=[],
                         ssm_stochastic_rounding=False, prefix_cache=True, prefix_cache_bytes=None,
                         compile=False)  # configs/runtime/cpu.yaml: runtime.compile false
    assert kwargs == dict(device="cpu", **asdict(want))
    (call,) = fakes
    assert call["tokenizer_path"] == str(ckpt / "tokenizer.json")
    assert (call["limit"], call["num_fewshot"], call["max_gen_toks"]) == (4, 5, 256)
    assert call["data_dir"] == str(data) and call["out_dir"] == str(out) and call["resume"] is False
    assert call["task"] is TASKS["gsm8k"]  # eval.name's row of the task table
    assert call["fingerprint"] == {
        "entry": "tiny_nemotron_h_mtp", "checkpoint_dir": str(ckpt), "load_format": "auto",
        **checkpoint_fingerprint(ckpt), "device": "cpu", "dtype": "float32",
        "ssm_state_dtype": "float32", "draft_len": 3, "ssm_replay": True, "ssm_backend": "torch",
        "ssm_replay_checkpointing": False, "quant": "none", "kv_cache_quant": "none",
        "max_seq_len": 4096, "num_threads": 1,
        "max_batch_size": 64, "world_size": 1, "num_fewshot": 5, "max_gen_toks": 256,
        "data_dir": str(data)}
    assert set(checkpoint_fingerprint(ckpt)) == {"weights_sha256", "config_sha256",
                                                 "generation_config_sha256", "tokenizer_sha256"}

    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results, default=str))
    assert results["schema_version"] == RESULTS_SCHEMA_VERSION and results["entry"] == "tiny_nemotron_h_mtp"
    # the backend that ran, not the entry's GPU one (auto): on the CPU the PyTorch references run
    assert results["config"]["model"]["ssm"]["backend"] == "auto"
    assert results["config"]["ssm_backend"] == "torch"
    assert results["gsm8k"] == {"strict_match": 0.25, "flexible_extract": 0.5, "n": 4,
                                "stderr": {"strict_match": None, "flexible_extract": None}}  # fakes give none
    assert results["config"]["ssm_state_dtype"] == "float32"
    assert results["config"]["ssm_replay"] is True and results["config"]["world_size"] == 1
    assert results["config"]["arch"]["mamba"]["d_state"] == 16  # read from the checkpoint's config.json
    assert results["timings"]["prefill_tokens_per_s"] == pytest.approx(2000.0)
    assert results["timings"]["decode_tokens_per_s"] == pytest.approx(200.0)
    acc = results["acceptance"]
    assert (acc["draft_len"], acc["drafted"], acc["accepted"], acc["request_steps"]) == (3, 600, 300, 200)
    assert acc["rate"] == 0.5 and acc["length"] == 2.5  # 300 / 600 and 1 + 300 / 200
    assert acc["per_position"] == [0.75, 0.5, 0.25]  # accepted_per_position [150, 100, 50] / 200 steps
    assert acc["num_accepted_hist"] == [0, 50, 50, 50, 50]
    assert results["generation"]["generated_tokens"] == 600
    assert results["memory"]["kv_cache_bytes"] == 2**21
    assert results["load"]["weight_bytes"] == 3 * 2**30 and results["load"]["seconds"] == 1.5
    assert results["config"]["prefix_cache"] is True and results["config"]["prefix_cache_bytes"] == 2**29
    assert results["prefix_cache"] == {  # FakeStats has no prefix-cache counters: nothing looked up
        "enabled": True, "max_bytes": 2**29, "off_reason": None, "queries": 0, "query_tokens": 0, "hits": 0,
        "hit_tokens": 0, "hit_rate": None, "saved_prefill_tokens": 0, "stores": 0, "evictions": 0}
    assert results["git_commit"] is None or len(results["git_commit"]) == 40
    # Against the tiny entry's measured rows (registry/baselines/): 37.5 % >= 1.895 - 0.87, rate 0.5 >= 0.42,
    # length 2.5 >= 2.587 * 0.8.
    assert results["verdict"]["status"] == "pass" and app.exit_code(results) == 0
    assert [c["name"] for c in results["verdict"]["checks"]] == [
        "gsm8k.mean", "acceptance.rate", "acceptance.length"]
    assert {p.name for p in out.iterdir()} >= {"results.json", "summary.md", "gsm8k_accuracy.png",
                                                "acceptance_per_position.png", "accepted_length_hist.png"}
    printed = capsys.readouterr().out
    assert "GSM8K strict-match" in printed and "25.00% (n=4)" in printed
    assert "acceptance rate          50.00%" in printed and "acceptance length        2.50" in printed
    assert "verdict                  PASS" in printed
    assert "load                     1.5 s, weights 3.00 GiB at 3.22 GB/s, host RSS peak 2.00 GiB" in printed
    assert ("ssm backend / state      torch (entry: auto; the CPU runs the PyTorch references) / float32 "
            "state") in printed
    # at n = 4 the GSM8K threshold is below 0 %: the verdict line and summary.md say so, no negative number
    gsm8k_line = next(line for line in printed.splitlines() if line.startswith("  gsm8k.mean"))
    assert "37.50 vs no lower bound at this n, reference 1.90: pass" in gsm8k_line, gsm8k_line
    summary = (out / "summary.md").read_text()
    assert "| gsm8k.mean | 37.50 | 1.90 | no lower bound at this n | pass |" in summary
    assert ", SSM state float32, draft length K = 3," in summary and "float32 state" not in summary


def test_prefix_cache_off_and_its_size_reach_the_engine(fakes, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    results = app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'off'}", "eval.limit=4",
                           "runtime.prefix_cache=false"))
    assert FakeEngine.built[-1][1]["prefix_cache"] is False
    assert results["config"]["prefix_cache"] is False and results["prefix_cache"]["enabled"] is False
    assert results["prefix_cache"]["off_reason"] == "runtime.prefix_cache=false"
    app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'small'}", "eval.limit=4",
                 "runtime.prefix_cache_bytes=1000"))
    assert FakeEngine.built[-1][1]["prefix_cache_bytes"] == 1000


def test_run_entry_without_speculation_and_sharded_checkpoint(fakes, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", sharded=True)
    cfg = _cfg(f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'out'}", "model.speculative.algorithm=none",
               "model.speculative.draft_len=0", "eval.batch_size=3", "runtime.dtype=bfloat16")
    results = app.run(cfg)
    (_, kwargs), = FakeEngine.built
    assert kwargs["draft_len"] == 0 and kwargs["ssm_replay"] is False
    assert kwargs["max_batch_size"] == 3 and kwargs["dtype"] == "bfloat16"
    # bf16 compute: the prefix cache is off, and results.json says why and how to turn it on
    assert "runtime.dtype=float32" in results["prefix_cache"]["off_reason"]
    assert results["config"]["draft_len"] == 0 and results["acceptance"] is None


@pytest.mark.parametrize("replay, expect", [("true", True), ("false", False)])
def test_replay_checkpointing_from_the_registry(fakes, tmp_path, capsys, replay, expect):
    """model.ssm.replay_checkpointing reaches the engine when the run replays, is off otherwise (a sweep over
    ssm_replay must not fail on it), and shows in results.json, the fingerprint and the summary."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    cfg = _cfg(f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'out'}",
               "model.ssm.replay_checkpointing=true", f"ssm_replay={replay}")
    results = app.run(cfg)
    (_, kwargs), = FakeEngine.built
    assert kwargs["ssm_replay"] is expect and kwargs["ssm_replay_checkpointing"] is expect
    assert results["config"]["ssm_replay_checkpointing"] is expect
    assert fakes[0]["fingerprint"]["ssm_replay_checkpointing"] is expect
    assert ("ssm_replay / world_size  True (checkpointing) / 1" in capsys.readouterr().out) is expect


def _error(*overrides) -> UserError:
    """The UserError of composing and running `python run.py <overrides>` (Hydra reports a key or a value of
    the wrong type while it composes; the application the rest)."""
    with pytest.raises(UserError) as e:
        app.run(_cfg(*overrides))
    assert not FakeEngine.built  # every user error is raised before the engine is built
    return e.value


def test_ssm_replay_requires_speculation(fakes, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    err = _error(f"model.checkpoint={ckpt}", "model.speculative.algorithm=none",
                      "model.speculative.draft_len=0", "ssm_replay=true")
    assert "ssm_replay requires speculative decoding" in err.problem
    assert "ssm_replay=true" in err.fix


def test_world_size_must_divide_heads(fakes):
    err = _error("model=super_v3_mtp", "world_size=3")
    assert "world_size=3 does not divide" in err.problem and "attention heads=32" in err.problem
    assert "[1, 2, 4, 8]" in err.fix


def test_world_size_from_checkpoint_config(fakes, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")  # 4 attention heads, 8 mamba heads, 4 experts
    err = _error(f"model.checkpoint={ckpt}", "world_size=8")
    assert "attention heads=4" in err.problem and "experts" not in err.problem  # experts split by size
    config = dict(TINY_NEMOTRON_H_CONFIG, moe_intermediate_size=20)  # config.json's sizes are checked too
    err = _error(f"model.checkpoint={make_checkpoint(tmp_path / 'ckpt2', config=config)}", "world_size=8")
    assert "moe_intermediate_size=20" in err.problem


def test_world_size_devices(fakes, tmp_path, monkeypatch):
    """world_size > 1 on GPUs: one GPU per rank (rank r on cuda:r), so a named GPU or too few are refused."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _error(f"model.checkpoint={ckpt}", "world_size=2", "runtime=gpu")
    assert "needs 2 GPUs" in err.problem and "1 are visible" in err.problem
    err = _error(f"model.checkpoint={ckpt}", "world_size=2", "runtime=gpu", "runtime.device=cuda:1")
    assert "rank r runs on cuda:r" in err.problem and "runtime.device=cuda" in err.fix
    err = _error(f"model.checkpoint={ckpt}", "world_size=2", "runtime.collective_timeout_s=0")
    assert "runtime.collective_timeout_s=0 must be >= 1" in err.problem


def test_models_root_needed(fakes):
    err = _error("model=qwen3_next_mtp")
    assert "needs models_root" in err.problem
    assert "$LLM_MODELS_ROOT" in err.fix and "models_root=" in err.fix and "model.checkpoint=" in err.fix


@pytest.mark.parametrize(
    "remove, problem",
    [
        (None, "does not exist"),
        ("config.json", "has no config.json"),
        ("tokenizer.json", "has no tokenizer.json"),
        ("model.safetensors", "has no weights"),
        ("model-00002-of-00002.safetensors", "1 of 2 weight shards"),
    ],
)
def test_incomplete_checkpoint(fakes, tmp_path, remove, problem):
    sharded = remove is not None and remove.startswith("model-")
    root = tmp_path / "models"
    ckpt = root / "Qwen3-Next-80B-A3B-Instruct"
    if remove is not None:
        qwen = {"model_type": "qwen3_next", "hidden_size": 2048, "vocab_size": 151936,
                "num_attention_heads": 16,
                "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
                "num_hidden_layers": 48,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128}
        make_checkpoint(ckpt, sharded=sharded, config=qwen)
        (ckpt / remove).unlink()
    err = _error("model=qwen3_next_mtp", f"models_root={root}")
    assert str(ckpt) in err.problem and problem in err.problem
    assert "models_root / $LLM_MODELS_ROOT" in err.problem  # which setting points there


def test_embedded_checkpoint_missing(fakes, tmp_path):
    err = _error("model=tiny_qwen3_next_mtp", "model.checkpoint=not_built_yet")
    assert "registry/checkpoints/not_built_yet does not exist" in err.problem
    assert "python -m runners.tools.tiny" in err.fix


def test_arch_block_disagreeing_with_checkpoint(fakes, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    err = _error("model=super_v3_mtp", f"model.checkpoint={ckpt}")
    assert "arch: block disagrees" in err.problem
    assert "arch.hidden_size: entry 4096, config.json 64" in err.problem


@pytest.mark.parametrize(
    "override, problem",
    [
        ("world_size=abc", "bad value for 'world_size'"),
        ("model.max_batch_size=lots", "bad value for 'max_batch_size'"),
        ("model.ssm.backend=cuda", "bad value for 'ssm.backend'"),
        ("eval.limit=0", "eval.limit must be >= 1"),
        ("+model._target_=os.system", "'_target_' is not allowed"),
        ("+model.arch_override=1", "unknown key 'arch_override'"),
        ("runtime.device=tpu", "runtime.device must be cpu or cuda"),
        ("runtime.prefix_cache_bytes=-1", "runtime.prefix_cache_bytes=-1 must be >= 0"),
        ("model.ssm.backend=flashinfer", "ssm.backend=flashinfer, which runs only on CUDA GPUs"),
    ],
)
def test_bad_values(fakes, tmp_path, override, problem):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    err = _error(f"model.checkpoint={ckpt}", override)
    assert problem in err.problem and err.fix


SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
# config.json of the released Nemotron 3 Super (the sizes of registry/model/super_v3_mtp.yaml)
SUPER_CONFIG = {
    "model_type": "nemotron_h", "hidden_size": 4096, "vocab_size": 131072, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "hybrid_override_pattern": SUPER_PATTERN,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "n_routed_experts": 512, "num_experts_per_tok": 22, "num_nextn_predict_layers": 1,
}


@pytest.mark.parametrize(
    "overrides, problem, fix",
    [
        (["model.quant=fp8"], "sets quant: fp8, but the checkpoint is quant none", "quant: none"),
        (["model.quant=nvfp4"], "sets quant: nvfp4, but the checkpoint is quant none", "quant: none"),
        (["model.speculative.num_nextn_predict_layers=2"],
         "speculative.num_nextn_predict_layers is 2, but", "num_nextn_predict_layers: 1"),
    ],
)
def test_registry_fields_the_engine_cannot_honour_are_refused(fakes, tmp_path, overrides, problem, fix):
    """A run stops with the field's name where the engine cannot honour it, or where the entry disagrees with
    the checkpoint (an fp8 entry on a bf16 checkpoint would run bf16 weights judged against fp8 rows);
    num_nextn_predict_layers must be the checkpoint's MTP count."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    err = _error(f"model.checkpoint={ckpt}", *overrides)
    assert problem in err.problem and fix in err.fix


def test_cuda_graph_batch_sizes_reach_the_engine_on_a_gpu_only(fakes, tmp_path, monkeypatch):
    """cuda_graph_batch_sizes is honoured: on a GPU the engine captures the entry's sizes up to the run's
    max_batch_size (eval.batch_size lowers it), runtime.cuda_graphs=false turns them off, and on the CPU the
    same step runs eagerly (no sizes); results.json records what was asked of the engine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # check_supported's CUDA check
    ckpt = make_checkpoint(tmp_path / "ckpt")
    runs = [
        (["runtime=gpu", "eval.batch_size=8"], [1, 2, 4, 8]),
        (["runtime=gpu", "runtime.cuda_graphs=false"], []),
        (["runtime=cpu"], []),
        (["runtime=cpu", "runtime.cuda_graphs=true"], []),
    ]
    for i, (overrides, sizes) in enumerate(runs):
        FakeEngine.built = []
        results = app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={tmp_path / str(i)}", *overrides))
        (_, kwargs), = FakeEngine.built
        assert list(kwargs["cuda_graph_batch_sizes"]) == sizes, overrides
        assert kwargs["cuda_graphs"] == bool(sizes), overrides
        assert results["config"]["cuda_graph_batch_sizes"] == sizes
        assert (results["timings"]["capture_seconds"] is not None) == bool(sizes), overrides
    # the released entries list sizes up to their max_batch_size; a run no longer stops on them
    root = tmp_path / "models"
    make_checkpoint(root / "NVIDIA-Nemotron-3-Super-120B-A12B-BF16", config=SUPER_CONFIG)
    FakeEngine.built = []
    app.run(_cfg("model=super_v3_mtp", f"models_root={root}", "runtime=gpu",
                 "verdict.require_reference=false", f"out_dir={tmp_path / 'super'}"))
    (_, kwargs), = FakeEngine.built
    assert list(kwargs["cuda_graph_batch_sizes"]) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize(
    "overrides, problem, fix",
    [
        (["model.foo=1"], "unknown config key 'model.foo'", "known keys of model: name, family"),
        (["eval.limt=3"], "unknown config key 'eval.limt'", "did you mean eval.limit?"),
        (["model.ssm.bakend=torch"], "unknown config key 'model.ssm.bakend'",
         "did you mean model.ssm.backend?"),
        (["model.speculative.draftlen=2"], "'model.speculative.draftlen'",
         "known keys of model.speculative: algorithm"),
        (["runtime=gpux"], "unknown runtime option runtime=gpux", "did you mean runtime=gpu?"),
        (["model=qwen3_next"], "unknown registry entry model='qwen3_next'", "qwen3_next_mtp"),
        (["model=qwen3_next_mtp", "hydra.run.dir=/tmp/x"], None, None),
    ],
)
def test_composition_errors(overrides, problem, fix):
    """Unknown keys / options / entries, found by Hydra against the structured schema while it composes
    (registry.compose translates them), with the closest valid names."""
    if problem is None:
        compose_config(overrides)
        return
    with pytest.raises(UserError) as e:
        compose_config(overrides)
    assert problem in e.value.problem and fix in e.value.fix


def _run_py(*args, cwd):
    return subprocess.run([sys.executable, str(REPO_ROOT / "run.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(
    "args, lines",
    [
        (["model=super_v3"], ["error: unknown registry entry model='super_v3'",
                              "  fix: did you mean super_v3_mtp or super_v3_mtp_ws4 or super_v3_mtp_ws2?"]),
        (["foo=1"], ["error: unknown config key 'foo' in the override 'foo=1'", "  fix: known keys: model"]),
        (["eval.limit=4", "eval.limit=abc"],  # a key set twice: the override holding the bad value is named
         ["error: bad value for 'eval.limit' in the override 'eval.limit=abc'"]),
        (["model.checkpoint=/nonexistent/ckpt"],
         ["error: checkpoint directory /nonexistent/ckpt does not exist",
          "  fix: point model.checkpoint at"]),
        (["model=tiny_qwen3_next_mtp", "model.ssm.replay_checkpointing=true"],  # the override, not the file
         ["error: registry/model/tiny_qwen3_next_mtp.yaml: ssm.replay_checkpointing exists for Mamba2 layers "
          "only (nemotron_h), not qwen3_next (the entry as changed by the override(s) "
          "model.ssm.replay_checkpointing=true)",
          "  fix: set ssm.replay_checkpointing: false; or change the"]),
    ],
)
def test_run_py_prints_user_errors(tmp_path, args, lines):
    proc = _run_py(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for line in lines:
        assert any(got.startswith(line) for got in proc.stderr.splitlines()), (line, proc.stderr)


FAKE_SITECUSTOMIZE = '''
import sys
sys.path.insert(0, {tests!r})
import test_app
from runners.app import main as app
app.Engine = test_app.FakeEngine
def evaluate(engine, tokenizer_path, **kw):
    return test_app.fake_result({{"strict_match": 1.0, "flexible_extract": 1.0, "n": 1}},
                                kw["out_dir"] + "/samples.jsonl", num_fewshot=kw["num_fewshot"],
                                max_gen_toks=kw["max_gen_toks"])
app.evaluate_engine = evaluate
'''


def test_run_py_success_writes_results_to_hydra_run_dir(tmp_path):
    """The whole Hydra path (run.py -> runners.app.main.run), with the fakes installed by a sitecustomize."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_SITECUSTOMIZE.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "run.py"), f"model.checkpoint={ckpt}",
                           f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((run_dir / "results.json").read_text())
    assert results["entry"] == "tiny_nemotron_h_mtp" and results["gsm8k"]["n"] == 1
    assert "GSM8K strict-match" in proc.stdout and str(run_dir / "results.json") in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_runtime_without_cuda(fakes, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    err = _error(f"model.checkpoint={ckpt}", "runtime=gpu")
    assert "CUDA is not available" in err.problem and "runtime=cpu" in err.fix


def test_broken_config_json_and_tokenizer_are_user_errors(fakes, tmp_path):
    """Found by a newcomer's attack: these used to end in a JSONDecodeError / tokenizers traceback."""
    ckpt = make_checkpoint(tmp_path / "bad_json")
    (ckpt / "config.json").write_text("{not json")
    err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'o1'}")
    assert "config.json cannot be read as JSON" in err.problem and "config.json" in err.fix
    (ckpt / "config.json").write_text("[1, 2]")
    err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'o2'}")
    assert "is not a JSON object (got list)" in err.problem
    ckpt = make_checkpoint(tmp_path / "bad_tok")
    (ckpt / "tokenizer.json").write_text('{"model": 5}')
    err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'o3'}")
    assert "tokenizer.json cannot be loaded" in err.problem


def test_out_dir_that_is_a_file_or_holds_the_other_kind_of_run(fakes, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={afile}")
    assert "is not a folder" in err.problem
    # a history database under a file is refused before the run, not found after it (a newcomer's find)
    err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'o'}",
                 f"history.db={afile / 'h.db'}")
    assert str(afile) in err.problem and "history.db=null" in err.fix
    compare_dir = tmp_path / "cmp"
    (compare_dir / "replay").mkdir(parents=True)
    (compare_dir / "replay" / "generations.jsonl").write_text("{}\n")
    for extra in ([], ["resume=true"]):
        err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={compare_dir}",
                          *extra)
        assert "holds a compare=replay run" in err.problem
    single = tmp_path / "single"
    single.mkdir()
    (single / "generations.jsonl").write_text("{}\n")
    err = _error("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={single}",
                      "compare=replay", "resume=true")
    assert "holds a single run" in err.problem


def test_sweep_runs_every_job_and_exits_with_the_worst_status(tmp_path, gsm8k_dir):
    """`python run.py -m ...` (a nightly sweep): a job's user error does not stop the others, and the
    process exits with the worst job status (20 shots make a prompt longer than the tiny entry's 4096
    positions: 2)."""
    proc = _run_py("-m", "eval.limit=1", "eval.max_gen_toks=4", f"eval.data_dir={gsm8k_dir}",
                   "eval.num_fewshot=20,5", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "eval.num_fewshot=20 makes a prompt too long" in proc.stderr
    # the job after the failing one still ran; job folders are named by their overrides (not 0..N), without
    # eval.data_dir (a path: excluded from the name)
    job = tmp_path / "eval.limit-1+eval.max_gen_toks-4+eval.num_fewshot-5"
    assert (job / "results.json").is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert "| ERROR (exit 2) |" in proc.stdout
    assert "eval.limit-1+eval.max_gen_toks-4+eval.num_fewshot-20" in proc.stdout
    proc = _run_py("-m", "model=tiny_nemotron_h_mtp,super_v3", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown registry entry model='super_v3'" in proc.stderr


def test_fp8_entry_builds_the_engine_with_its_kv_cache_quant(fakes, tmp_path):
    """An fp8 entry runs (no refusal) and the engine gets kv_cache_quant from the entry; the fingerprint of
    its generations records quant and KV-cache quant."""
    app.run(_cfg("model=tiny_nemotron_h_mtp_fp8", "eval.limit=4", "verdict.require_reference=false",
                 f"out_dir={tmp_path / 'out'}"))
    (_, opts), = FakeEngine.built
    assert opts["kv_cache_quant"] == "fp8"
    assert fakes[0]["fingerprint"]["quant"] == "fp8" and fakes[0]["fingerprint"]["kv_cache_quant"] == "fp8"


def test_out_of_device_memory_is_an_error_with_a_fix_not_a_traceback(fakes, monkeypatch, tmp_path):
    """A CUDA OOM the fit check did not foresee (docs/gpu/robust_3: Super V3 FP8 at full depth) ends the run
    with error / fix lines naming the run folder and what to lower, not a traceback."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"

    def oom(*a, **k):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.73 GiB. GPU 0 has a total capacity of 139.80 GiB of "
            "which 1.42 GiB is free. This process has 138.37 GiB memory in use.")

    monkeypatch.setattr(app, "evaluate_engine", oom)
    cfg = _cfg("model=tiny_nemotron_h_mtp", f"model.checkpoint={ckpt}", f"out_dir={out}", "eval.limit=4",
               f"eval.data_dir={make_gsm8k_dir(tmp_path / 'gsm8k')}")
    with pytest.raises(UserError) as e:
        app.run(cfg)
    want = "out of device memory while running (Tried to allocate 1.73 GiB, 1.42 GiB is free)"
    assert want in e.value.problem
    assert f"0 finished generations are saved in {out}" in e.value.problem
    assert "eval.batch_size=N" in e.value.fix and "model.max_seq_len=N" in e.value.fix
