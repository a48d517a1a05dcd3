"""runners.app.lm_adapter.EngineLM: requests -> one engine.generate call; stop strings, EOS, limits,
resume."""

from __future__ import annotations

import json
import sys

import lm_eval.api.registry
import pytest
import torch
from lm_eval.api.instance import Instance
from test_gsm8k_fakes import EOS_ID, FakeEngine, read_jsonl, train_tiny_tokenizer
from tokenizers import Tokenizer

from registry.checkpoint import CheckpointError
from registry.errors import UserError
from runners.app.lm_adapter import MODEL_NAME, EngineLM, GenerationStore, first_stop, request_key, sha256_text

GSM8K_UNTIL = ["Question:", "</s>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer(gsm8k_dir, tmp_path_factory) -> Tokenizer:
    path = train_tiny_tokenizer(gsm8k_dir, tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return Tokenizer.from_file(str(path))


def _req(context: str, idx: int = 0, **gen_kwargs) -> Instance:
    gen_kwargs.setdefault("until", GSM8K_UNTIL)
    return Instance("generate_until", doc={}, arguments=(context, gen_kwargs), idx=idx,
                    metadata=("t", idx, 1))


def _engine(tokenizer, scripts: dict[str, str], **kw) -> FakeEngine:
    return FakeEngine(tokenizer, lambda prompt: scripts[prompt], **kw)


def test_registered_without_hiding_builtin_models():
    assert lm_eval.api.registry.get_model(MODEL_NAME) is EngineLM
    names = set(lm_eval.api.registry.model_registry)
    assert {"hf", "vllm", "dummy"} <= names  # the built-ins are still registered beside ours


def test_loglikelihood_is_not_implemented(tokenizer):
    lm = EngineLM(_engine(tokenizer, {}), tokenizer)
    ll = Instance("loglikelihood", doc={}, arguments=("Question: 1+1?\nAnswer:", " 2"), idx=0)
    with pytest.raises(NotImplementedError, match="generate_until only.*loglikelihood"):
        lm.loglikelihood([ll])
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", doc={}, arguments=("text",), idx=0)])


@pytest.mark.parametrize("tokens_per_step", [1, 3, 7])
def test_stop_string_truncates_and_stops_early(tokenizer, tokens_per_step):
    prompts = {f"Question: q{i}\nAnswer:": f" step {i} #### {i}\n\nQuestion: next one{' la' * 40}"
               for i in range(5)}
    engine = _engine(tokenizer, prompts, tokens_per_step=tokens_per_step, max_batch_size=2)
    lm = EngineLM(engine, tokenizer, progress=False)
    out = lm.generate_until([_req(p, i) for i, p in enumerate(prompts)])
    assert out == [f" step {i} #### {i}\n\n" for i in range(5)]
    assert len(engine.calls) == 1 and engine.calls[0] == list(prompts)  # one call, all requests
    completion_of = {sha256_text(p): c for p, c in prompts.items()}
    for rec in lm.records.values():
        full = len(tokenizer.encode(completion_of[rec["prompt_sha256"]], add_special_tokens=False).ids)
        assert rec["finish_reason"] == "stop_string" and rec["stop_string"] == "Question:"
        assert rec["engine_finish_reason"] == "stop_checker"
        # stopped within one step of the stop string, long before the 40 filler words
        assert rec["num_generated_tokens"] < full - 30


def test_eos_ends_request_and_is_not_in_text(tokenizer):
    engine = _engine(tokenizer, {"Question: a\nAnswer:": " #### 5"}, append_eos=True)
    lm = EngineLM(engine, tokenizer, progress=False)
    assert lm.generate_until([_req("Question: a\nAnswer:", until=["Question:"])]) == [" #### 5"]
    (rec,) = lm.records.values()
    assert rec["finish_reason"] == "stop_token" and rec["generated_ids"][-1] == EOS_ID
    assert rec["num_generated_tokens"] == len(tokenizer.encode(" #### 5", add_special_tokens=False).ids) + 1


def test_max_gen_toks_per_request_and_default(tokenizer):
    long = " la" * 100
    engine = _engine(tokenizer, {"A:": long, "B:": long, "C:": long}, tokens_per_step=4)
    lm = EngineLM(engine, tokenizer, max_gen_toks=7, progress=False)
    lm.generate_until([_req("A:", 0, max_gen_toks=5), _req("B:", 1, max_gen_toks=9), _req("C:", 2)])
    assert engine.max_new_tokens_seen == [9]  # one call, the largest limit; smaller ones via stop_checker
    lens = {rec["prompt_sha256"]: rec["num_generated_tokens"] for rec in lm.records.values()}
    assert [lens[sha256_text(p)] for p in ("A:", "B:", "C:")] == [5, 9, 7]
    assert all(rec["finish_reason"] == "length" for rec in lm.records.values())


def test_sampling_is_rejected(tokenizer):
    lm = EngineLM(_engine(tokenizer, {}), tokenizer, progress=False)
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([_req("x", do_sample=True, temperature=0.7)])


def test_first_stop_picks_earliest():
    assert first_stop("ab Question: c </s>", ["</s>", "Question:"]) == (3, "Question:")
    assert first_stop("no stop here", ["Question:"]) == (12, None)


def test_store_resume_skips_done_requests_and_tolerates_cut_last_line(tokenizer, tmp_path):
    prompts = {f"P{i}:": f" answer {i}\n\nQuestion: more" for i in range(4)}
    reqs = [_req(p, i) for i, p in enumerate(prompts)]
    path = tmp_path / "gen.jsonl"
    first = EngineLM(_engine(tokenizer, prompts), tokenizer, store=GenerationStore(path, resume=False),
                     progress=False)
    expected = first.generate_until(reqs)
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 4 and all(json.loads(line)["key"] for line in lines)
    path.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # killed mid-write of record 3

    engine = _engine(tokenizer, prompts)
    lm = EngineLM(engine, tokenizer, store=GenerationStore(path, resume=True), progress=False)
    assert lm.generate_until(reqs) == expected
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 2  # only the two not fully on disk
    assert lm.num_resumed == 2 and lm.num_generated == 2
    assert len(read_jsonl(path)) == 4  # the cut line was dropped, the two new ones appended cleanly

    again = _engine(tokenizer, prompts)
    lm = EngineLM(again, tokenizer, store=GenerationStore(path, resume=True), progress=False)
    assert lm.generate_until(reqs) == expected and again.calls == []


def test_store_resume_sets_a_damaged_middle_line_aside(tokenizer, tmp_path, capsys):
    """A record damaged in the middle of the file (not a cut last line): resume keeps the readable ones, runs
    that request again, and rewrites the file without the damaged line (later readers, such as
    evals.compare, need every line to parse); the file as it was is kept beside it, and a warning names the
    line and the copy."""
    prompts = {f"P{i}:": f" answer {i}\n\nQuestion: more" for i in range(4)}
    reqs = [_req(p, i) for i, p in enumerate(prompts)]
    path = tmp_path / "gen.jsonl"
    expected = EngineLM(_engine(tokenizer, prompts), tokenizer, store=GenerationStore(path, resume=False),
                        progress=False).generate_until(reqs)
    lines = path.read_text().splitlines(keepends=True)
    damaged_text = "".join(lines[:1]) + "garbage{\n" + "".join(lines[2:])
    path.write_text(damaged_text)
    engine = _engine(tokenizer, prompts)
    lm = EngineLM(engine, tokenizer, store=GenerationStore(path, resume=True), progress=False)
    err = capsys.readouterr().err
    assert f"warning: {path}: 1 unreadable record(s) (line 2) set aside" in err, err
    assert lm.generate_until(reqs) == expected
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 1  # only the damaged one runs again
    assert len(read_jsonl(path)) == 4  # every line parses again
    copies = list(tmp_path.glob("gen.jsonl.damaged-*"))
    assert len(copies) == 1 and copies[0].read_text() == damaged_text and str(copies[0]) in err


def test_request_key_depends_on_prompt_and_settings(tokenizer):
    lm = EngineLM(_engine(tokenizer, {}), tokenizer, progress=False)
    base = lm.request_key_for("Q:", {"until": ["Question:"]})
    assert base == request_key("Q:", lm._settings({"until": ["Question:"]}))
    assert base != lm.request_key_for("Q: ", {"until": ["Question:"]})
    assert base != lm.request_key_for("Q:", {"until": ["Question:"], "max_gen_toks": 9})
    assert base != lm.request_key_for("Q:", {"until": ["Question:", "</s>"]})


def test_line_progress_for_logs():
    """Off a terminal the progress is plain lines (throttled; always one at the end), not tqdm redraws."""
    import io

    from evals.progress import LineProgress

    buf = io.StringIO()
    with LineProgress(4, 1, desc="generate", interval=3600, file=buf) as bar:
        bar.update(1)
        bar.update(2)
    assert buf.getvalue().splitlines() == ["generate: 4/4 requests (100.0%), 0 s"]  # throttled: the end only
    buf = io.StringIO()
    with LineProgress(3, desc="generate", interval=0, file=buf) as bar:
        bar.update(1)
    assert buf.getvalue().splitlines()[0].startswith("generate: 1/3 requests (33.3%)")
    assert "\r" not in buf.getvalue()


def test_cache_hook_fed_as_requests_finish(tokenizer, tmp_path):
    """lm-eval's response cache (CachingLM, `use_cache=`) gets every response through the adapter's cache
    hook as the request finishes; a second run answers from the cache without calling the engine."""
    from lm_eval.api.model import CachingLM

    prompts = {f"P{i}:": f" answer {i}\n\nQuestion: more" for i in range(3)}
    reqs = [_req(p, i) for i, p in enumerate(prompts)]
    engine = _engine(tokenizer, prompts)
    first = CachingLM(EngineLM(engine, tokenizer, progress=False), str(tmp_path / "cache.db"))
    expected = first.generate_until(reqs)
    assert expected == [f" answer {i}\n\n" for i in range(3)] and len(engine.calls) == 1
    again = _engine(tokenizer, prompts)
    second = CachingLM(EngineLM(again, tokenizer, progress=False), str(tmp_path / "cache.db"))
    assert second.generate_until(reqs) == expected and again.calls == []


SHIPPED = "registry/checkpoints/tiny_nemotron_h_mtp"


def test_simple_evaluate_builds_the_model_from_model_args(gsm8k_dir):
    """The registered model, built by lm-eval from a model_args string, on the gsm8k_local task found by
    TaskManager(include_path=...): 2 GSM8K questions with the shipped tiny checkpoint and MTP drafting."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evals.evaluate import STOCK_GSM8K_DIR, TASKS_DIR

    manager = TaskManager(include_path=[str(STOCK_GSM8K_DIR), str(TASKS_DIR)], include_defaults=False,
                          metadata={"gsm8k_dir": str(gsm8k_dir)})
    out = lm_eval.simple_evaluate(model=MODEL_NAME, model_args=f"pretrained={SHIPPED},draft_len=3",
                                  tasks=["gsm8k_local"], task_manager=manager, limit=2, device="cpu",
                                  batch_size=2, bootstrap_iters=0)
    assert out["n-samples"]["gsm8k"]["effective"] == 2 and out["versions"]["gsm8k"] == 3.0
    assert set(out["results"]["gsm8k"]) >= {"exact_match,strict-match", "exact_match,flexible-extract"}
    (first, _), = [s["arguments"][0] for s in out["samples"]["gsm8k"][:1]]
    assert first.startswith("Question: ") and first.count("Question: ") == 6  # the stock task: 5-shot


def test_model_args_naming_a_missing_checkpoint():
    with pytest.raises(CheckpointError, match="/no/such/checkpoint does not exist"):
        EngineLM.create_from_arg_string("pretrained=/no/such/checkpoint", {"device": "cpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_model_args_cuda_device_without_cuda():
    with pytest.raises(UserError, match="CUDA is not available here; pass device=cpu"):
        EngineLM.create_from_arg_string(f"pretrained={SHIPPED}", {"device": "cuda:0"})


def test_model_args_the_engine_does_not_take_or_refuses_are_error_and_fix_lines(capsys, monkeypatch):
    """The lm-eval CLI with a --model_args key from_checkpoint does not take, or a value it refuses: error /
    fix lines naming it (and the arguments it takes), status 2, no traceback."""
    from runners.app.lm_eval_cli import main as lm_eval_main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main sets lm-eval's argv: put pytest's back after
    for args, first, fix in (
            (f"pretrained={SHIPPED},bogus=1", "error: --model_args bogus: not an argument of hybrid-engine",
             "  fix: use pretrained, device, dtype, draft_len, "),
            (f"pretrained={SHIPPED},draft_len=-1", "error: --model_args: draft_len=-1 must be",
             "  fix: change that argument in --model_args")):
        with pytest.raises(SystemExit) as stop:
            lm_eval_main(["--model", "hybrid-engine", "--model_args", args, "--tasks", "gsm8k_local",
                          "--device", "cpu", "--limit", "1"])
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error:", "  fix:"))]
        assert stop.value.code == 2 and err[0].startswith(first) and err[1].startswith(fix), err


@pytest.mark.slow
def test_documented_lm_eval_cli_runs_the_tiny_checkpoint(gsm8k_dir, tmp_path):
    """The invocation in runners/app/lm_eval_cli.py's docstring (with --limit 2 and a results file)."""
    import os
    import subprocess
    import sys

    from registry.schema import REPO_ROOT

    env = {**os.environ, "GSM8K_DIR": str(gsm8k_dir), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "runners.app.lm_eval_cli", "--model", MODEL_NAME, "--model_args",
         f"pretrained={SHIPPED},draft_len=3,num_threads=1", "--tasks", "gsm8k_local", "--device", "cpu",
         "--batch_size", "16", "--limit", "2", "--output_path", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gsm8k" in proc.stdout and "exact_match" in proc.stdout
    (results,) = list(tmp_path.rglob("results_*.json"))
    assert json.loads(results.read_text())["n-samples"]["gsm8k"]["effective"] == 2
