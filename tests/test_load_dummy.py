"""model.load_format=dummy (runners.engine.dummy) and the fit check before allocation (runners.engine.memory):
dummy weights equal the loaded synthetic checkpoint of the same format, the app runs them end to end and says
so, the released configuration stands in for a missing checkpoint folder, and a model that cannot fit is
refused in seconds with its numbers."""

from __future__ import annotations

import json

import pytest
import torch

from evals.verdict import DUMMY_NOTE, NO_REFERENCE, PASS
from registry.compose import compose_config
from registry.errors import UserError
from registry.releases import release_hybrid_config
from registry.resolve import resolve
from registry.schema import validate_entry
from runners.app import main as app
from runners.engine.dummy import materialize_dummy, plan_dummy
from runners.engine.engine import Engine
from runners.engine.loader import load_model, read_config
from runners.engine.memory import (
    ACTIVATION_HEADROOM_FRACTION,
    GIB,
    MIN_PREFILL_CHUNK_TOKENS,
    InsufficientMemoryError,
    check_memory_fits,
    fit_headroom_bytes,
    fit_prefill_chunk_tokens,
    largest_fitting_batch,
    min_prefill_bytes,
    prefix_cache_cap,
)
from runners.engine.options import EngineOptions
from runners.tools.synth import write_synthetic_checkpoint

# CPU-test widths of the releases' layouts (as tests/test_synth.py)
SMALL = {
    "nemotron_h": dict(hidden_size=128, vocab_size=4096, mamba_num_heads=16, moe_latent_size=64,
                       moe_intermediate_size=96, moe_shared_expert_intermediate_size=192,
                       num_attention_heads=8, head_dim=32),
    "qwen3_next": dict(hidden_size=128, vocab_size=4096, linear_key_head_dim=32, linear_value_head_dim=48,
                       head_dim=64, num_attention_heads=4, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64),
}


@pytest.mark.parametrize("family,fmt", [("nemotron_h", "bf16"), ("nemotron_h", "fp8"),
                                        ("nemotron_h", "nvfp4"), ("qwen3_next", "block_fp8")])
def test_dummy_model_is_the_loaded_synthetic_checkpoint(family, fmt, tmp_path):
    """Built on the device without files, the dummy model holds bit for bit what the loader makes of the
    synthetic checkpoint of the same format, seed and dtype (one initialisation and quantization rule)."""
    layers = 4 if family == "nemotron_h" else 2
    write_synthetic_checkpoint(tmp_path, family, num_layers=layers, num_experts=8, overrides=SMALL[family],
                               dtype=torch.float32, fmt=fmt, check_disk=False)
    loaded = load_model(tmp_path, dtype=torch.float32, load_mtp=True)
    plan = plan_dummy(read_config(tmp_path), dtype=torch.float32, with_mtp=True)
    assert plan.weight_bytes == sum(t.numel() * t.element_size() for t in
                                    {id(t): t for t in [*loaded.parameters(), *loaded.buffers()]}.values())
    lines: list[str] = []
    built = materialize_dummy(plan, "cpu", log=lines.append)
    n = len(plan.specs)
    assert lines[-1].startswith(f"dummy weights: {n}/{n} tensors")  # the progress ends at all of them
    want, got = loaded.state_dict(), built.state_dict()
    assert sorted(want) == sorted(got)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name].view(torch.uint8) if t.element_size() == 1 else got[name],
                           t.view(torch.uint8) if t.element_size() == 1 else t), name
    if fmt != "bf16":
        assert getattr(built, "quant_report", None) == getattr(loaded, "quant_report", None)


def test_dummy_run_end_to_end_says_dummy_and_judges_no_accuracy(tmp_path):
    """A tiny FP8 entry with dummy weights through the app: results.json and summary.md say dummy, the
    verdict judges no accuracy (only finiteness), a projection of the full GSM8K run is written."""
    out = tmp_path / "out"
    cfg = compose_config(["model=tiny_nemotron_h_mtp_fp8", "model.load_format=dummy", f"out_dir={out}",
                          "eval.limit=2", "eval.max_gen_toks=8", "ssm_replay=true"])
    results = app.run(cfg)
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["config"]["load_format"] == "dummy"
    assert on_disk["config"]["model"]["load_format"] == "dummy"
    checks = {c["name"]: c for c in on_disk["verdict"]["checks"]}
    assert checks["gsm8k.mean"]["status"] == NO_REFERENCE and checks["gsm8k.mean"]["note"] == DUMMY_NOTE
    assert checks["health.finite"]["status"] == PASS
    assert all(c["status"] == NO_REFERENCE for n, c in checks.items() if n != "health.finite")
    assert on_disk["verdict"]["passed"] is None and app.exit_code(results) == 0
    proj = on_disk["projection"]
    assert proj["questions"] == 1319 and proj["measured_questions"] == 2 and proj["max_gen_toks"] == 8
    assert 0 < proj["projected_seconds"] <= proj["upper_bound_seconds"]
    assert proj["measured_batch"] == 2 and proj["full_run_batch"] == on_disk["config"]["max_batch_size"] > 2
    summary = (out / "summary.md").read_text()
    assert "Dummy weights" in summary and "Full GSM8K projection" in summary
    batches = f"measured at batch 2, the full run batches {proj['full_run_batch']}: a rough upper bound"
    assert batches in summary


def test_dummy_resume_projection_and_compare_judge_nothing(tmp_path):
    """Resuming a dummy run from 2 to 4 questions projects from the 4 requests the timing covers (at most
    max_gen_toks generated per question, under the upper bound); compare=replay on dummy weights is NO
    REFERENCE, not PASS."""
    out = tmp_path / "out"
    base = ["model=tiny_nemotron_h_mtp", "model.load_format=dummy", f"out_dir={out}", "eval.max_gen_toks=8"]
    app.run(compose_config([*base, "eval.limit=2"]))
    app.run(compose_config([*base, "eval.limit=4", "resume=true"]))
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["resumed"]["num_resumed"] == 2 and on_disk["resumed"]["num_generated"] == 2
    proj = on_disk["projection"]
    assert proj["measured_questions"] == 4 and proj["generated_tokens_per_question"] <= 8
    assert proj["projected_seconds"] <= proj["upper_bound_seconds"]
    cmp_out = tmp_path / "cmp"
    results = app.run(compose_config([*base[:2], "compare=replay", f"out_dir={cmp_out}", "eval.limit=2",
                                      "eval.max_gen_toks=8"]))
    verdict = json.loads((cmp_out / "results.json").read_text())["verdict"]
    assert verdict["status"] == NO_REFERENCE and verdict["passed"] is None, verdict["headline"]
    assert all(c["status"] == NO_REFERENCE for c in verdict["checks"] if c["name"].startswith("comparison."))
    assert app.exit_code(results) == 0


def test_dummy_without_checkpoint_folder_uses_the_released_config(monkeypatch):
    """No checkpoint folder (a release entry, models_root unset): the entry's released configuration (all 88
    layers, 512 experts, the release's quantization) resolves."""
    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    cfg = compose_config(["model=super_v3_mtp_fp8", "model.load_format=dummy", "models_root=null"])
    rr = resolve(cfg)
    c = rr.checkpoint_config
    assert rr.dummy and "released" in c.source and len(c.layer_types) == 88 and c.n_routed_experts == 512
    assert c.quantization.algo == "FP8" and c.quantization.is_excluded("mtp.layers.0.mixer.q_proj")
    assert rr.arch.num_experts == 512
    q = release_hybrid_config("qwen3_next", "fp8", "fp8")
    assert q.quantization.weight_block_size == (128, 128)
    assert len(q.layer_types) == 2 * 48  # 48 decoder layers, each a mixer (GDN / attention) and an MoE
    nvfp4 = compose_config(["model=qwen3_next_mtp_nvfp4", "model.load_format=dummy", "models_root=null"])
    with pytest.raises(UserError, match="no nvfp4 release of qwen3_next"):
        resolve(nvfp4)


@pytest.mark.parametrize("overrides,embedded", [
    (["model=tiny_nemotron_h_mtp", "model.checkpoint={tmp}/typo"], True),  # absolute: never the release
    (["model=super_v3_mtp_fp8", "models_root={tmp}"], False),  # under a set models_root
    (["model=super_v3_mtp_fp8", "model.checkpoint={tmp}"], False),  # a folder without config.json
])
def test_dummy_named_checkpoint_folder_must_hold_config(overrides, embedded, tmp_path):
    """A checkpoint folder the run names but that does not exist (or has no config.json) is an error naming
    it -- a typo must not silently build the full-size release under the entry's name."""
    cfg = compose_config([o.format(tmp=tmp_path) for o in overrides] + ["model.load_format=dummy"])
    with pytest.raises(UserError) as e:
        resolve(cfg)
    assert str(tmp_path) in e.value.problem and "model.checkpoint" in e.value.fix
    assert ("registry/checkpoints" in e.value.fix) == embedded
    assert ("released configuration" in e.value.fix) == (not embedded)


def test_dummy_embedded_entry_uses_its_own_config():
    """An embedded entry's dummy run reads its own config.json (registry/checkpoints/), never the release."""
    rr = resolve(compose_config(["model=tiny_nemotron_h_mtp", "model.load_format=dummy"]))
    source = rr.checkpoint_config.source
    assert source.endswith("config.json") and "released" not in source
    assert app.fingerprint(rr)["load_format"] == "dummy"
    assert app.fingerprint(resolve(compose_config(["model=tiny_nemotron_h_mtp"])))["load_format"] == "auto"


@pytest.mark.parametrize("overrides", [["model=tiny_nemotron_h_mtp", "world_size=2"],
                                       ["model=super_v3_mtp_ws2", "models_root=null"]])
def test_dummy_over_ranks_is_refused_in_resolve(overrides, monkeypatch):
    """world_size > 1 with dummy weights is refused when the run resolves, before any rank is spawned."""
    monkeypatch.delenv("LLM_MODELS_ROOT", raising=False)
    with pytest.raises(UserError, match=r"load_format=dummy with world_size=2") as e:
        resolve(compose_config([*overrides, "model.load_format=dummy"]))
    assert "world_size=1" in e.value.fix


def test_entry_file_setting_dummy_is_refused(tmp_path):
    """load_format: dummy is a run override: an entry file that sets it is refused with the command-line fix
    (the raw-file guard every composition, `python -m registry validate` and the PR check run)."""
    from registry.schema import MODEL_DIR, entry_file_problems

    text = (MODEL_DIR / "tiny_nemotron_h_mtp.yaml").read_text()
    (tmp_path / "tiny_nemotron_h_mtp.yaml").write_text(text + "load_format: dummy\n")
    problems = entry_file_problems("tiny_nemotron_h_mtp", tmp_path)
    assert [p for p in problems if "load_format: dummy" in p.problem
            and "model.load_format=dummy on the command line" in p.fix]
    (tmp_path / "tiny_nemotron_h_mtp.yaml").write_text(text + "load_format: auto\n")
    assert entry_file_problems("tiny_nemotron_h_mtp", tmp_path) == []


@pytest.mark.parametrize("device,quant,can_shard,want,not_want", [
    ("cuda", "none", True, ["world_size", "FP8 or NVFP4"], []),
    ("cuda", "fp8", True, ["world_size", "NVFP4 entry"], ["FP8 or"]),
    ("cuda", "nvfp4", True, ["world_size"], ["NVFP4", "FP8"]),
    ("cuda", "fp8", False, ["NVFP4 entry"], ["world_size"]),  # dummy weights: one device
    ("cpu", "nvfp4", True, [], ["world_size", "NVFP4", "FP8"]),
])
def test_fit_refusal_advice_is_what_can_help(device, quant, can_shard, want, not_want):
    """More GPUs only on CUDA where the load can be sharded; a smaller format only where one exists."""
    with pytest.raises(InsufficientMemoryError) as e:
        check_memory_fits(100 * GIB, 640 * GIB, device, budget_bytes=200 * GIB, max_batch_size=64,
                          cache_bytes_at=lambda b: b * 10 * GIB, quant=quant, can_shard=can_shard)
    for w in want:
        assert w in e.value.fix, (w, e.value.fix)
    for w in not_want:
        assert w not in e.value.fix, (w, e.value.fix)
    with pytest.raises(InsufficientMemoryError) as e:  # the weights alone exceed: still a fix line
        check_memory_fits(300 * GIB, 0, device, budget_bytes=200 * GIB, quant=quant, can_shard=can_shard)
    assert "weights alone" in e.value.fix and len(e.value.fix) > len("the weights alone exceed it")


def test_suggested_batch_leaves_headroom():
    """The suggested batch leaves the prefix cache's budget plus room for activations free
    (fit_headroom_bytes), and the load then grants the prefix cache its whole budget (prefix_cache_cap)."""
    budget, weights, prefix = 100 * GIB, 60 * GIB, 2 * GIB

    def cache(b):
        return b * GIB

    with pytest.raises(InsufficientMemoryError) as e:
        check_memory_fits(weights, cache(64), "cuda", budget_bytes=budget, max_batch_size=64,
                          cache_bytes_at=cache, prefix_cache_bytes=prefix)
    fit = int(e.value.fix.split("eval.batch_size=")[1].split()[0])
    headroom = fit_headroom_bytes(budget, prefix)
    assert headroom >= 2 * prefix and headroom >= ACTIVATION_HEADROOM_FRACTION * budget
    assert weights + cache(fit) + headroom <= budget < weights + cache(fit + 1) + headroom
    assert fit < 40  # all of the 40 GiB left would have been the answer without headroom
    assert prefix_cache_cap(budget, weights, cache(fit)) >= prefix


def test_suggested_batch_leaves_room_for_the_smallest_prefill():
    """On a small device, where ACTIVATION_HEADROOM_FRACTION of the budget is less than the smallest prefill
    the load accepts, the suggested batch still leaves that prefill's room: the fix a refusal names is not
    refused by the prefill check (fit_prefill_chunk_tokens) in turn."""
    budget, weights, per_token = 20 * GIB, 10 * GIB, 10 * 2**20

    def cache(b):
        return b * GIB // 4

    assert ACTIVATION_HEADROOM_FRACTION * budget < min_prefill_bytes(per_token)  # the case in question
    with pytest.raises(InsufficientMemoryError) as e:
        check_memory_fits(weights, cache(64), "cpu", budget_bytes=budget, max_batch_size=64,
                          cache_bytes_at=cache, prefill_bytes_per_token=per_token)
    fit = int(e.value.fix.split("eval.batch_size=")[1].split()[0])
    left = budget - weights - cache(fit)
    assert fit_prefill_chunk_tokens(left, per_token, 8192) >= MIN_PREFILL_CHUNK_TOKENS
    assert weights + cache(fit + 1) + min_prefill_bytes(per_token) > budget  # the largest that leaves it


def test_full_depth_fit_refusal_in_seconds():
    """Super V3 FP8 at full depth (~128 GB of weights) is refused before anything is allocated, naming
    weights, caches, the budget and the largest batch that fits."""
    config = release_hybrid_config("nemotron_h", "fp8", "fp8")
    options = EngineOptions(dtype="bfloat16", draft_len=3, max_batch_size=64, max_seq_len=4096,
                            ssm_backend="torch", memory_budget_bytes=140 * 10**9)
    with pytest.raises(InsufficientMemoryError) as e:  # raised from the meta-device plan: nothing allocated
        Engine.from_dummy(config, options, device="cpu")
    msg = str(e.value)
    assert "119.68 GiB of weights" in msg and "GiB of caches" in msg
    assert "130.39 GiB of the given memory budget" in msg
    assert "eval.batch_size=" in msg and "fits" in msg
    fit = int(msg.split("eval.batch_size=")[1].split()[0])
    assert 1 <= fit < 64
    # on this machine's own host memory, too (the default budget): a full-depth FP8 model never fits a
    # machine with less than its 128 GB of weights
    with pytest.raises(InsufficientMemoryError, match="available host memory"):
        if _host_available() < 128 * 10**9:
            Engine.from_dummy(config, EngineOptions(dtype="bfloat16", ssm_backend="torch"), device="cpu")
        else:
            raise InsufficientMemoryError("available host memory is large here", "skip")


def _host_available() -> int:
    from runners.engine.memory import free_device_memory

    free, _ = free_device_memory(torch.device("cpu"))
    return free or 0


def test_largest_fitting_batch():
    def cache(b):
        return 10 * b

    assert largest_fitting_batch(100, 200, cache, 63) == 10
    assert largest_fitting_batch(100, 105, cache, 63) is None
    assert largest_fitting_batch(0, 10**6, cache, 63) == 63
    assert largest_fitting_batch(100, 200, cache, 63, headroom_bytes=30) == 7


def test_bad_load_format_is_refused():
    """On the command line (composition) and in an entry file (schema validation), naming the values."""
    with pytest.raises(UserError, match=r"load_format.*auto, dummy"):
        compose_config(["model=tiny_nemotron_h_mtp", "model.load_format=dumy"])
    entry = dict(compose_config(["model=tiny_nemotron_h_mtp"]).model)
    entry["load_format"] = "dumy"
    with pytest.raises(UserError, match=r"load_format.*\[auto, dummy\]"):
        validate_entry(entry, name="tiny_nemotron_h_mtp")


@pytest.mark.gpu
@pytest.mark.gpu_memory(9)  # 6.9 GiB at the peak
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("family,quant", [("nemotron_h", "nvfp4"), ("nemotron_h", "fp8"),
                                          ("qwen3_next", "fp8")])
def test_dummy_engine_on_cuda_builds_in_place_and_decodes_finite(family, quant):
    """On the GPU: the dummy build's device peak exceeds what it keeps allocated (weights, caches) by at most
    twice the largest single matrix in float32 (the embedding generated in float32 and its bf16 copy; a BF16
    copy of the model, at 4 layers and 64 experts, would be
    larger), and MTP + replay decoding yields tokens from finite
    logits. The release's widths at 4 layers and 64 experts (the full depth is tests/gpu/fulldepth_run.sh)."""
    cut = ({"hybrid_override_pattern": "ME*E", "num_hidden_layers": 4, "n_routed_experts": 64}
           if family == "nemotron_h" else {"num_hidden_layers": 4, "num_experts": 64})
    config = release_hybrid_config(family, quant, "fp8", overrides=cut)
    options = EngineOptions(dtype="bfloat16", draft_len=3, ssm_replay=True, max_batch_size=4, max_seq_len=512,
                            ssm_backend="triton", kv_cache_quant="fp8")
    torch.cuda.empty_cache()
    engine = Engine.from_dummy(config, options, device="cuda")
    r = engine.load_report
    largest = config.vocab_size * config.hidden_size * 4  # the embeddings generated in float32
    transient = r.device_peak_bytes - r.device_allocated_bytes  # what the build held beyond what it kept
    assert transient <= 2 * largest, (r.device_peak_bytes, r.device_allocated_bytes, r.weight_bytes,
                                      r.cache_bytes, largest)
    assert r.weight_bytes < r.device_allocated_bytes  # weights are in the allocation the transient excludes
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29]] * 2
    out = engine.generate(prompts, max_new_tokens=16)
    assert [len(o) for o in out.tokens] == [16, 16] and out.nonfinite == []
    assert out.tokens[0] == out.tokens[1]  # the same prompt, greedy: the same tokens in both slots
    logits = engine.logits(torch.tensor([prompts[0]], device="cuda"))
    assert torch.isfinite(logits).all()


def test_forced_acceptance_runs_mtp_at_that_length_on_dummy_weights(tmp_path):
    """runtime.forced_acceptance_length on dummy weights: every verify accepts the schedule's drafts, so the
    run's acceptance length is the forced one (random weights accept nothing on their own), results.json's
    config, the resume fingerprint and summary.md say so, and the full-GSM8K projection is MTP's."""
    out = tmp_path / "out"
    overrides = ["model=tiny_nemotron_h_mtp", "model.load_format=dummy", f"out_dir={out}", "eval.limit=2",
                 "eval.max_gen_toks=16", "ssm_replay=true", "runtime.forced_acceptance_length=3.0"]
    app.run(compose_config(overrides))
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["config"]["forced_acceptance_length"] == 3.0
    acc = on_disk["acceptance"]
    assert acc["accepted"] > 0 and abs(acc["length"] - 3.0) < 0.5, acc  # the last step may be cut short
    assert "projection" in on_disk
    assert "Acceptance forced to length 3.0" in (out / "summary.md").read_text()
    rr = resolve(compose_config(overrides))
    assert app.fingerprint(rr)["forced_acceptance_length"] == 3.0
    assert "forced_acceptance_length" not in app.fingerprint(resolve(compose_config(overrides[:-1])))


@pytest.mark.parametrize("overrides, says, fix", [
    (["model=tiny_nemotron_h_mtp"], "for dummy weights only", "model.load_format=dummy"),
    (["model=tiny_nemotron_h_mtp", "model.load_format=dummy", "draft_len=0", "ssm_replay=false"],
     "drafts nothing (draft_len=0)", "draft_len=3"),
    (["model=tiny_nemotron_h_mtp", "model.load_format=dummy", "runtime.forced_acceptance_length=4.5"],
     "outside [1, draft_len + 1 = 4]", "a value in [1, 4]"),
])
def test_forced_acceptance_is_refused_where_it_cannot_hold(overrides, says, fix):
    """Real weights (it would change the answers), no drafts, a length outside [1, K + 1]: refused when the
    run resolves, naming the setting and the fix."""
    if not any(o.startswith("runtime.forced_acceptance_length") for o in overrides):
        overrides = [*overrides, "runtime.forced_acceptance_length=3.0"]
    with pytest.raises(UserError, match="runtime.forced_acceptance_length=") as e:
        resolve(compose_config(overrides))
    assert says in str(e.value) and fix in e.value.fix, (str(e.value), e.value.fix)


def test_resume_refusal_names_a_forced_length_that_was_not_set(tmp_path):
    """Resuming an unforced dummy run with a forced acceptance length is refused, saying the setting was not
    set then (not 'None')."""
    out = tmp_path / "out"
    base = ["model=tiny_nemotron_h_mtp", "model.load_format=dummy", f"out_dir={out}", "eval.limit=2",
            "eval.max_gen_toks=8"]
    app.run(compose_config(base))
    with pytest.raises(UserError) as e:
        app.run(compose_config([*base, "resume=true", "runtime.forced_acceptance_length=2.0"]))
    assert ("forced_acceptance_length (runtime.forced_acceptance_length): not set then, 2.0 now"
            in e.value.problem), e.value.problem
