"""runners.app.lm_adapter.evaluate_engine (evals.evaluate.evaluate_lm) on real GSM8K questions with a scripted
fake engine: exact scores for known answers, both filters, lm-eval's stock task settings, data-directory
errors, and kill-and-resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from test_gsm8k_fakes import (
    FAKE_DRAFT_LEN,
    FakeEngine,
    answer_policy,
    last_question,
    read_jsonl,
    train_tiny_tokenizer,
)
from tokenizers import Tokenizer

import evals.tasks.gsm8k
from evals.evaluate import scored_stats
from evals.report import _projection_note
from evals.results import full_run_projection
from evals.tasks.gsm8k import GSM8KDataError
from runners.app.lm_adapter import evaluate_engine
from runners.engine.stats import GenerationStats

REPO_ROOT = Path(__file__).resolve().parents[1]
LIMIT = 8
# per-request counters and the acceptance derived from them: must not depend on how the run was split
COUNTER_KEYS = ("num_requests", "prompt_tokens", "generated_tokens", "request_steps", "drafted_tokens",
                "accepted_drafts", "accepted_per_position", "num_accepted_hist", "acceptance_rate",
                "acceptance_length", "acceptance_per_position")


def _counters(stats: dict) -> dict:
    return {k: stats[k] for k in COUNTER_KEYS}


def _check_nontrivial(stats: dict, n: int) -> None:
    """The fake engine's acceptance is neither 0 nor 1 and its counters cover n requests."""
    assert stats["num_requests"] == n and stats["requests_without_stats"] == 0
    assert 0 < stats["accepted_drafts"] < stats["drafted_tokens"] == FAKE_DRAFT_LEN * stats["request_steps"]
    assert 0 < stats["acceptance_rate"] < 1 and len(stats["acceptance_per_position"]) == FAKE_DRAFT_LEN


@pytest.fixture(scope="module")
def tokenizer_path(gsm8k_dir, tmp_path_factory) -> Path:
    return train_tiny_tokenizer(gsm8k_dir, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _engine(tokenizer_path: Path, gsm8k_dir: Path, policy: str, **kw) -> FakeEngine:
    complete = answer_policy(policy, gsm8k_dir)
    return FakeEngine(Tokenizer.from_file(str(tokenizer_path)), lambda p: complete(last_question(p)), **kw)


def _run(engine, tokenizer_path, gsm8k_dir, out_dir, **kw):
    kw.setdefault("limit", LIMIT)
    kw.setdefault("progress", False)
    return evaluate_engine(engine, tokenizer_path, data_dir=gsm8k_dir, out_dir=out_dir, **kw)


def test_all_right_scores_one_and_writes_samples(tokenizer_path, gsm8k_dir, tmp_path, monkeypatch, capsys):
    import lm_eval.api.task
    import lm_eval.evaluator
    import torch.utils.collect_env
    import tqdm

    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir))  # data_dir=None falls back to $GSM8K_DIR
    env_reports = []  # lm-eval's environment report (seconds of `pip list` and probes) is not collected
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: env_reports.append(1) or "")
    add_env_info = lm_eval.evaluator.add_env_info
    engine = _engine(tokenizer_path, gsm8k_dir, "right", tokens_per_step=3)
    res = evaluate_engine(engine, tokenizer_path, data_dir=None, limit=LIMIT, out_dir=tmp_path, progress=True)
    assert env_reports == [] and lm_eval.evaluator.add_env_info is add_env_info  # skipped, then restored
    assert res.scores == {"strict_match": 1.0, "flexible_extract": 1.0, "n": LIMIT}
    # lm-eval's prompt-building pass has a label, not a bare "0/8" bar, and comes before the generate
    # progress; off a terminal both are plain lines that reach the end
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["build prompts", "generate"], lines
    assert all(f": {LIMIT}/{LIMIT} requests (100.0%)" in line for line in lines), lines
    assert lm_eval.api.task.tqdm is tqdm.tqdm  # lm-eval's own name restored

    # lm-eval's stock task as configured: v3.0, 5 shots from train, one generate call for all requests
    assert res.task["version"] == 3.0 and res.task["num_fewshot"] == 5
    assert res.task["data_source"] == str(gsm8k_dir.resolve())
    assert len(engine.calls) == 1 and len(engine.calls[0]) == LIMIT
    assert all(p.count("Question: ") == 6 and p.endswith("\nAnswer:") for p in engine.calls[0])
    assert engine.max_new_tokens_seen == [256]  # lm-eval's default max_gen_toks; the task sets none

    samples = read_jsonl(res.samples_path)
    assert res.samples_path == tmp_path / "samples.jsonl"
    assert [s["doc_id"] for s in samples] == list(range(LIMIT))
    test_rows = read_jsonl(gsm8k_dir / "test.jsonl")
    for s, row in zip(samples, test_rows):
        assert s["question"] == row["question"] and s["target"] == row["answer"]
        assert s["generated_text"] == f" {row['answer']}\n\n"  # cut before the next "Question:"
        assert s["finish_reason"] == "stop_string" and s["stop_string"] == "Question:"
        assert s["extracted"] == {"strict_match": s["target_answer"], "flexible_extract": s["target_answer"]}
        assert s["correct"] == {"strict_match": True, "flexible_extract": True}
        assert len(s["prompt_sha256"]) == 64 and len(s["request_key"]) == 64
    assert len(read_jsonl(tmp_path / "generations.jsonl")) == LIMIT
    assert res.stats["generated_tokens"] == sum(s["num_generated_tokens"] for s in samples)
    assert res.stats["num_parts"] == 1 and res.stats["num_requests"] == LIMIT and res.wall_seconds > 0
    assert res.stats["requests_without_stats"] == 0 and res.stats["wall_seconds"] > 0


@pytest.mark.parametrize("policy, strict, flexible", [
    ("wrong", 0.0, 0.0),
    ("no_hash", 0.0, 1.0),  # no "#### N": strict-match finds nothing, flexible-extract takes the last number
    ("alternate", 0.5, 0.5),
])
def test_exact_scores_for_scripted_answers(tokenizer_path, gsm8k_dir, tmp_path, policy, strict, flexible,
                                          capsys):
    res = _run(_engine(tokenizer_path, gsm8k_dir, policy), tokenizer_path, gsm8k_dir, tmp_path)
    assert res.scores == {"strict_match": strict, "flexible_extract": flexible, "n": LIMIT}
    assert capsys.readouterr().err == ""  # progress=False: no progress at all, lm-eval's bar included
    samples = read_jsonl(res.samples_path)
    if policy == "no_hash":
        assert all(s["extracted"]["strict_match"] == "[invalid]" for s in samples)
        assert all(s["extracted"]["flexible_extract"] == s["target_answer"] + "." for s in samples)
    if policy == "alternate":
        assert [s["correct"]["strict_match"] for s in samples] == [i % 2 == 0 for i in range(LIMIT)]


def test_each_jinja_template_is_compiled_once_and_the_prompts_stay(tokenizer_path, gsm8k_dir, tmp_path,
                                                                  monkeypatch):
    """lm-eval compiles a document field's template at every render (12 renders per 5-shot prompt); the run
    compiles each template string once, sends the very prompts the stock path builds, and puts lm-eval's
    function back."""
    import contextlib

    import lm_eval.utils

    import evals.evaluate

    stock = lm_eval.utils.apply_template
    compiles = []
    from_string = lm_eval.utils.env.from_string
    monkeypatch.setattr(lm_eval.utils.env, "from_string", lambda t: compiles.append(t) or from_string(t))
    kept = _engine(tokenizer_path, gsm8k_dir, "right")
    _run(kept, tokenizer_path, gsm8k_dir, tmp_path / "kept")
    assert lm_eval.utils.apply_template is stock
    # each template once inside the evaluation (the task's loading renders a document of its own before)
    assert 0 < len(compiles) <= 2 * len(set(compiles)) < 12 * LIMIT
    compiles.clear()
    monkeypatch.setattr(evals.evaluate, "_compiled_templates_kept", contextlib.nullcontext)
    plain = _engine(tokenizer_path, gsm8k_dir, "right")
    _run(plain, tokenizer_path, gsm8k_dir, tmp_path / "plain")
    assert len(compiles) >= 12 * LIMIT  # the stock path: a compile per render
    assert kept.calls == plain.calls and len(kept.calls[0]) == LIMIT


def test_num_fewshot_and_max_gen_toks(tokenizer_path, gsm8k_dir, tmp_path):
    engine = _engine(tokenizer_path, gsm8k_dir, "right")
    res = _run(engine, tokenizer_path, gsm8k_dir, tmp_path, limit=3, num_fewshot=0, max_gen_toks=10)
    assert res.task["num_fewshot"] == 0
    assert all(p.startswith("Question: ") and p.count("Question: ") == 1 for p in engine.calls[0])
    samples = read_jsonl(res.samples_path)
    assert all(s["num_generated_tokens"] == 10 and s["finish_reason"] == "length" for s in samples)
    assert res.scores["strict_match"] == 0.0  # 10 tokens never reach "####"


def test_resume_with_everything_on_disk_sends_nothing(tokenizer_path, gsm8k_dir, tmp_path):
    first = _run(_engine(tokenizer_path, gsm8k_dir, "alternate"), tokenizer_path, gsm8k_dir, tmp_path)
    samples = read_jsonl(first.samples_path)
    engine = _engine(tokenizer_path, gsm8k_dir, "right")  # would score 1.0 if it were asked
    again = _run(engine, tokenizer_path, gsm8k_dir, tmp_path, resume=True)
    assert engine.calls == [] and again.num_resumed == LIMIT and again.num_generated == 0
    assert again.scores == first.scores and read_jsonl(again.samples_path) == samples
    # resume=False starts afresh
    fresh = _run(engine, tokenizer_path, gsm8k_dir, tmp_path, resume=False)
    assert fresh.scores["strict_match"] == 1.0 and len(engine.calls) == 1


def test_resume_grows_limit_and_merges_stats(tokenizer_path, gsm8k_dir, tmp_path):
    ref = _run(_engine(tokenizer_path, gsm8k_dir, "alternate"), tokenizer_path, gsm8k_dir, tmp_path / "ref")
    out = tmp_path / "parts"
    _run(_engine(tokenizer_path, gsm8k_dir, "alternate"), tokenizer_path, gsm8k_dir, out, limit=3)
    engine = _engine(tokenizer_path, gsm8k_dir, "alternate")
    res = _run(engine, tokenizer_path, gsm8k_dir, out, resume=True)
    assert len(engine.calls[0]) == LIMIT - 3  # the first documents' prompts did not change with the limit
    assert res.scores == ref.scores and read_jsonl(res.samples_path) == read_jsonl(ref.samples_path)
    assert res.stats["num_parts"] == 2 and res.stats["num_requests"] == LIMIT
    assert res.stats["generated_tokens"] == ref.stats["generated_tokens"]
    _check_nontrivial(ref.stats, LIMIT)
    assert _counters(res.stats) == _counters(ref.stats)


def test_resume_with_smaller_limit_reports_only_the_scored_requests(tokenizer_path, gsm8k_dir, tmp_path):
    ref = _run(_engine(tokenizer_path, gsm8k_dir, "alternate"), tokenizer_path, gsm8k_dir, tmp_path / "ref",
               limit=3)
    out = tmp_path / "full"
    full = _run(_engine(tokenizer_path, gsm8k_dir, "alternate"), tokenizer_path, gsm8k_dir, out)
    engine = _engine(tokenizer_path, gsm8k_dir, "alternate")
    res = _run(engine, tokenizer_path, gsm8k_dir, out, resume=True, limit=3)
    assert engine.calls == [] and res.scores["n"] == 3
    _check_nontrivial(res.stats, 3)
    assert _counters(res.stats) == _counters(ref.stats) != _counters(full.stats)
    # the timing fields still cover the folder's one generate call, of all LIMIT requests
    assert res.stats["num_parts"] == 1
    assert res.stats["timing_generated_tokens"] == full.stats["generated_tokens"]


def test_resume_tolerates_a_cut_last_line(tokenizer_path, gsm8k_dir, tmp_path):
    ref = _run(_engine(tokenizer_path, gsm8k_dir, "alternate"), tokenizer_path, gsm8k_dir, tmp_path / "ref")
    lines = (tmp_path / "ref" / "generations.jsonl").read_text().splitlines(keepends=True)
    out = tmp_path / "cut"
    out.mkdir()
    (out / "generations.jsonl").write_text("".join(lines[:3]) + lines[3][:40])  # a write killed midway
    engine = _engine(tokenizer_path, gsm8k_dir, "alternate")
    res = _run(engine, tokenizer_path, gsm8k_dir, out, resume=True)
    assert len(engine.calls[0]) == LIMIT - 3 and res.num_resumed == 3
    assert res.scores == ref.scores and read_jsonl(res.samples_path) == read_jsonl(ref.samples_path)
    assert len(read_jsonl(out / "generations.jsonl")) == LIMIT


KILLED_RUN = """
import sys
from pathlib import Path
from tokenizers import Tokenizer
from test_gsm8k_fakes import FakeEngine, answer_policy, last_question
from runners.app.lm_adapter import evaluate_engine
tok_path, data_dir, out_dir, limit = sys.argv[1:5]
complete = answer_policy("alternate", Path(data_dir))
engine = FakeEngine(Tokenizer.from_file(tok_path), lambda p: complete(last_question(p)), max_batch_size=2,
                    step_delay=0.01, hang_after=3)  # slow, then stuck: killed midway on every machine
evaluate_engine(engine, tok_path, data_dir=data_dir, limit=int(limit), out_dir=out_dir, progress=False)
"""


def test_sigkill_midway_then_resume_equals_uninterrupted(tokenizer_path, gsm8k_dir, tmp_path):
    ref = _run(_engine(tokenizer_path, gsm8k_dir, "alternate"), tokenizer_path, gsm8k_dir, tmp_path / "ref")
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(tokenizer_path), str(gsm8k_dir), str(out),
                             str(LIMIT)], env=env, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    gen_file, deadline = out / "generations.jsonl", time.monotonic() + 60
    try:
        while not (gen_file.exists() and gen_file.read_text().count("\n") >= 3):
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "no generations appeared within 60 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    done = len(read_jsonl(gen_file))
    assert done == 3 and not (out / "samples.jsonl").exists()  # killed midway, before scoring

    engine = _engine(tokenizer_path, gsm8k_dir, "alternate")
    res = _run(engine, tokenizer_path, gsm8k_dir, out, resume=True)
    assert len(engine.calls) == 1 and len(engine.calls[0]) == LIMIT - done  # nothing on disk is redone
    assert res.num_resumed == done and res.num_generated == LIMIT - done
    assert res.scores == ref.scores == {"strict_match": 0.5, "flexible_extract": 0.5, "n": LIMIT}
    assert read_jsonl(res.samples_path) == read_jsonl(ref.samples_path)
    # the killed call returned no GenerationStats, but each finished request's counters are on disk
    assert res.stats["num_parts"] == 1 and res.stats["requests_without_stats"] == 0
    _check_nontrivial(ref.stats, LIMIT)
    assert _counters(res.stats) == _counters(ref.stats)


def test_data_dir_errors(tokenizer_path, gsm8k_dir, tmp_path, monkeypatch):
    engine = _engine(tokenizer_path, gsm8k_dir, "right")
    with pytest.raises(GSM8KDataError, match=r"does not exist.*\n  fix: point eval.data_dir"):
        _run(engine, tokenizer_path, tmp_path / "missing", tmp_path / "o1")
    (tmp_path / "a_file").write_text("x\n")
    with pytest.raises(GSM8KDataError, match=r"a_file \(from eval.data_dir\) is a file, not a directory"):
        _run(engine, tokenizer_path, tmp_path / "a_file", tmp_path / "o1")

    only_test = tmp_path / "only_test"
    only_test.mkdir()
    (only_test / "test.jsonl").symlink_to(gsm8k_dir / "test.jsonl")
    with pytest.raises(GSM8KDataError, match="lacks train.jsonl"):
        _run(engine, tokenizer_path, only_test, tmp_path / "o2")

    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(GSM8KDataError, match=r"from \$GSM8K_DIR"):
        _run(engine, tokenizer_path, None, tmp_path / "o3")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.jsonl").write_text("this is not json\n")
    (broken / "test.jsonl").symlink_to(gsm8k_dir / "test.jsonl")
    with pytest.raises(GSM8KDataError, match=r"broken/train\.jsonl:1: not valid JSON"):  # file and line
        _run(engine, tokenizer_path, broken, tmp_path / "o4")
    assert engine.calls == []


def test_no_data_dir_offline_names_the_env_var(tokenizer_path, gsm8k_dir, tmp_path, monkeypatch):
    if not datasets.config.HF_DATASETS_OFFLINE:
        pytest.skip("HF_DATASETS_OFFLINE was not set before datasets was imported; the hub would be tried")
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    monkeypatch.setattr(evals.tasks.gsm8k, "SIBLING_DIR", tmp_path / "no_shared_here")  # no local copy at all
    with pytest.raises(GSM8KDataError, match=r"openai/gsm8k could not be loaded(.|\n)*fix: set GSM8K_DIR="):
        _run(_engine(tokenizer_path, gsm8k_dir, "right"), tokenizer_path, None, tmp_path)


def test_resume_refuses_generations_of_another_engine_setting(tokenizer_path, gsm8k_dir, tmp_path):
    _run(_engine(tokenizer_path, gsm8k_dir, "right"), tokenizer_path, gsm8k_dir, tmp_path, limit=2,
         fingerprint={"draft_len": 3, "ssm_replay": True})
    engine = _engine(tokenizer_path, gsm8k_dir, "right")
    with pytest.raises(ValueError, match=r"different run \(differs in \['fingerprint'\]"):
        _run(engine, tokenizer_path, gsm8k_dir, tmp_path, limit=2, resume=True,
             fingerprint={"draft_len": 3, "ssm_replay": False})
    res = _run(engine, tokenizer_path, gsm8k_dir, tmp_path, limit=2, resume=True,
               fingerprint={"draft_len": 3, "ssm_replay": True})
    assert res.num_resumed == 2 and engine.calls == []


def test_scored_stats_sums_counts_and_lists_and_recomputes_rates():
    """Counters are the sums of the scored requests' own counters (runners.engine.stats.GenerationStats),
    their
    ratios recomputed from the sums; timing comes from the generate calls."""
    records = [
        {"key": "a", "request_stats": {
            "generated_tokens": 10, "prompt_tokens": 7, "drafted_tokens": 6, "accepted_drafts": 3,
            "request_steps": 4, "accepted_per_position": [2, 1], "num_accepted_hist": [0, 1, 2, 1]}},
        {"key": "b", "request_stats": {
            "generated_tokens": 5, "prompt_tokens": 3, "drafted_tokens": 4, "accepted_drafts": 4,
            "request_steps": 2, "accepted_per_position": [2, 2], "num_accepted_hist": [0, 0, 0, 2]}},
        {"key": "c", "request_stats": None},
    ]
    parts = [{"wall_seconds": 1.0, "num_requests": 2, "engine_stats": {
                  "generated_tokens": 12, "prompt_tokens": 9, "prefill_seconds": 0.5, "decode_seconds": 2.0,
                  "steps": 7, "acceptance_rate": 0.5}},
             {"wall_seconds": 2.0, "num_requests": 1, "engine_stats": {
                  "generated_tokens": 5, "prompt_tokens": 3, "prefill_seconds": 0.25, "decode_seconds": 1.0,
                  "steps": 2}}]
    m = scored_stats(records, parts, GenerationStats)
    assert m["num_requests"] == 2 and m["requests_without_stats"] == 1
    assert m["generated_tokens"] == 15 and m["drafted_tokens"] == 10 and m["accepted_drafts"] == 7
    assert m["accepted_per_position"] == [4, 3] and m["num_accepted_hist"] == [0, 1, 2, 3]
    assert m["acceptance_rate"] == 0.7 and m["acceptance_length"] == 1 + 7 / 6
    assert m["acceptance_per_position"] == [4 / 6, 3 / 6]  # from the summed counts, not a sum of fractions
    assert (m["prefill_seconds"], m["decode_seconds"], m["steps"]) == (0.75, 3.0, 9)
    assert (m["timing_prompt_tokens"], m["timing_generated_tokens"]) == (12, 17)
    assert m["wall_seconds"] == 3.0 and m["num_parts"] == 2
    assert (m["timing_requests"], m["timing_largest_call"]) == (3, 2)
    empty = scored_stats([], [], GenerationStats)
    assert empty["num_requests"] == 0 and empty["acceptance_rate"] is None and empty["num_parts"] == 0


def _part(n: int, max_gen_toks: int) -> dict:
    """One generate call of n requests, each with a 10-token prompt and max_gen_toks generated tokens."""
    return {"wall_seconds": 1.0, "num_requests": n, "engine_stats": {
        "generated_tokens": n * max_gen_toks, "prompt_tokens": n * 10, "prefill_seconds": 0.1 * n,
        "decode_seconds": 0.5 * n}}


def test_projection_after_resume_divides_the_tokens_by_the_requests_they_cover():
    """A run resumed from 2 to 4 questions: the token sums cover both generate calls (4 requests), so the
    per-question means are over 4 (never above max_gen_toks) and the projection stays under its upper
    bound; a resume that generates nothing new still projects from the earlier calls."""
    records = [{"key": str(i), "request_stats": None} for i in range(4)]
    for parts in ([_part(2, 16), _part(2, 16)], [_part(2, 16), _part(2, 16), _part(0, 16)]):
        stats = scored_stats(records, parts, GenerationStats)
        timings = {"prefill_tokens_per_s": stats["timing_prompt_tokens"] / stats["prefill_seconds"],
                   "decode_tokens_per_s": stats["timing_generated_tokens"] / stats["decode_seconds"]}
        proj = full_run_projection(timings, stats, max_gen_toks=16, max_batch_size=16)
        assert proj["measured_questions"] == 4
        assert proj["generated_tokens_per_question"] == 16.0 and proj["prompt_tokens_per_question"] == 10.0
        assert proj["projected_seconds"] <= proj["upper_bound_seconds"]
        assert proj["projected_seconds"] == pytest.approx(1319 * (10 / 100 + 16 / 32))
    assert full_run_projection(timings, scored_stats(records, [], GenerationStats), max_gen_toks=16,
                               max_batch_size=16) is None


def test_projection_names_the_measured_and_full_run_batch():
    """limit=2 measures at batch 2 while the full run batches max_batch_size: the projection records both
    and its printed note calls it a rough upper bound; equal batches print no such clause."""
    timings = {"prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 32.0}
    small = full_run_projection(timings, scored_stats([], [_part(2, 16)], GenerationStats), max_gen_toks=16,
                                max_batch_size=16)
    assert (small["measured_batch"], small["full_run_batch"], small["batch_differs"]) == (2, 16, True)
    assert "measured at batch 2, the full run batches 16: a rough upper bound" in _projection_note(small)
    full = full_run_projection(timings, scored_stats([], [_part(40, 16)], GenerationStats), max_gen_toks=16,
                               max_batch_size=16)
    assert (full["measured_batch"], full["full_run_batch"], full["batch_differs"]) == (16, 16, False)
    assert "rough upper bound" not in _projection_note(full)
