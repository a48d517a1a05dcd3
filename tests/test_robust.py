"""Issue 12's cases, each with the value it must give: a broken model never gets a green verdict, every user
mistake is one error / fix pair, runs never mix or lose results, state precision is part of a reference,
reports carry their context. (Ctrl-C and a weights change under resume=true run through run.py in
tests/test_run_resume.py; Hydra-level mistakes through run.py at the end of this file.)
"""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from evals.compare import (
    AcceptanceDiff,
    Comparison,
    DivergenceSummary,
    acceptance_line,
    comparison_checks,
    divergence_line,
)
from evals.evaluate import output_health, repeats_one_token
from evals.outdir import (
    claim_dir,
    claim_fresh_dir,
    claim_out_dir,
    ensure_writable_dir,
    note_new_dirs,
    remove_unused_run_dir,
    save_hydra_files,
    write_atomic,
)
from evals.report import format_console, plot_title
from evals.results import environment, git_commit
from evals.tasks.gsm8k import GSM8KDataError, check_gsm8k_file, gsm8k_files
from evals.verdict import (
    FAIL,
    MAX_EMPTY_FRACTION,
    PASS,
    check_health,
    evaluate_verdict,
    headline,
)
from registry.baselines import BaselineError, find_acceptance_reference, find_accuracy_reference
from registry.checkpoint import CheckpointError
from registry.compose import compose_config
from registry.errors import UserError
from registry.resolve import resolve
from registry.schema import REPO_ROOT
from runners.engine import Engine
from runners.engine.loader import load_model
from runners.engine.options import EngineOptions

# ------------------------------------------------------------------ a broken model never passes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("robust") / "ck", make_hf_model(seed=3), with_mtp=True)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _data_span(file: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor `name`'s data in a safetensors file (the format's header layout)."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def test_random_bytes_behind_an_intact_header_are_refused_naming_the_tensors(ckpt, tmp_path):
    """The issue's broken checkpoint: tensor bytes overwritten with random data, header intact. It used to
    load and decode token 0 forever with acceptance 100 %; now loading names the tensors."""
    bad = _copy(ckpt, tmp_path / "random")
    f = bad / "model.safetensors"
    raw = bytearray(f.read_bytes())
    name = "backbone.layers.0.mixer.in_proj.weight"
    lo, hi = _data_span(f, name)
    gen = torch.Generator().manual_seed(0)
    raw[lo:hi] = torch.randint(0, 256, (hi - lo,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    f.write_bytes(bytes(raw))
    with safe_open(str(f), framework="pt") as h:  # the header still reads: only the bytes are wrong
        assert not torch.isfinite(h.get_tensor(name)).all()
    with pytest.raises(CheckpointError, match=r"hold NaN or infinite values: .*in_proj\.weight") as e:
        load_model(bad)
    assert "re-download" in e.value.fix


def test_all_zero_weight_matrix_is_refused_but_a_zero_bias_is_not(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "zero")
    f = bad / "model.safetensors"
    raw = bytearray(f.read_bytes())
    name = "backbone.layers.1.mixer.o_proj.weight"
    lo, hi = _data_span(f, name)
    raw[lo:hi] = bytes(hi - lo)
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"1 weight matrices are all zeros: backbone\.layers\.1\.mixer"
                                              r"\.o_proj\.weight"):
        load_model(bad)
    ok = _copy(ckpt, tmp_path / "zero_bias")
    f = ok / "model.safetensors"
    raw = bytearray(f.read_bytes())
    lo, hi = _data_span(f, "backbone.layers.0.mixer.D")  # a vector may be zero
    raw[lo:hi] = bytes(hi - lo)
    f.write_bytes(bytes(raw))
    load_model(ok)


def test_tied_checkpoint_storing_lm_head_loads(tmp_path):
    """tie_word_embeddings: true with lm_head.weight also stored (transformers' save_pretrained writes it)."""
    hf = make_hf_model(seed=4, tie_word_embeddings=True)
    path = write_checkpoint(tmp_path / "tied", hf, with_mtp=False)
    with torch.no_grad():  # the oracle's head is its embeddings, as transformers' tie_weights() makes it
        hf.lm_head.weight.copy_(hf.get_input_embeddings().weight)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["backbone.embeddings.weight"].clone()  # stored as well
    save_file(tensors, str(path / "model.safetensors"))
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=2, max_seq_len=32))
    assert engine.model.lm_head.weight.data_ptr() == engine.model.embeddings.weight.data_ptr()
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(engine.logits(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_nonfinite_outputs_are_flagged_with_the_first_layer(ckpt, compile_):
    """The health flags name the first non-finite layer, eagerly and with the compiled step (where each
    block's peak reduction is traced into its compiled call)."""
    engine = Engine.from_pretrained(ckpt, EngineOptions(draft_len=2, max_batch_size=2, max_seq_len=64,
                                                        compile=compile_))
    out = engine.generate([[3, 4, 5]], 4)
    assert out.nonfinite == []
    with torch.no_grad():
        engine.model.layers[1].mixer.o_proj.weight.fill_(float("nan"))  # layer 1 is attention ("M*EM-E")
    out = engine.generate([[3, 4, 5]], 4)
    assert out.nonfinite[0] == "layers.1.attention", out.nonfinite
    assert "lm_head" in out.nonfinite and "embeddings" not in out.nonfinite and "layers.0.mamba" not in \
        out.nonfinite


@pytest.mark.parametrize(
    "ids, exc, match",
    [
        ([[3, 1.9]], TypeError, r"prompts\[0\]\[1\] must be an integer token id"),
        ([[3, "5"]], TypeError, r"prompts\[0\]\[1\]"),
        ([[3, True]], TypeError, r"prompts\[0\]\[1\]"),
        ([[3, -1]], ValueError, r"-1"),
        ([[3, 61]], ValueError, r"61"),  # vocab_size 61
        ([[3], []], ValueError, r"prompts\[1\]"),
    ],
)
def test_generate_refuses_bad_ids_before_any_compute(ckpt, ids, exc, match):
    engine = Engine.from_pretrained(ckpt, EngineOptions(max_batch_size=2, max_seq_len=32))
    calls = []
    engine.model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(exc, match=match):
        engine.generate(ids, 3)
    assert calls == []


@pytest.mark.parametrize(
    "ids, exc",
    [
        (torch.tensor([[3.0, 4.0]]), TypeError),
        (torch.tensor([[3, -2]]), ValueError),
        (torch.tensor([[3, 61]]), ValueError),
        (torch.zeros(1, 0, dtype=torch.long), ValueError),
        ([[3, 4]], TypeError),
    ],
)
def test_logits_refuses_bad_ids(ckpt, ids, exc):
    engine = Engine.from_pretrained(ckpt, EngineOptions(max_batch_size=2, max_seq_len=32))
    with pytest.raises(exc, match="input_ids"):
        engine.logits(ids)


def test_16bit_mamba2_state_is_warned_about(ckpt, caplog):
    with caplog.at_level("WARNING", logger="runners.engine.runner"):
        Engine.from_pretrained(ckpt, EngineOptions(max_batch_size=2, max_seq_len=32,
                                                   ssm_state_dtype=torch.bfloat16))
    assert "16-bit recurrent state drifts" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="runners.engine.runner"):
        Engine.from_pretrained(ckpt, EngineOptions(max_batch_size=2, max_seq_len=32))
    assert "16-bit" not in caplog.text


# ------------------------------------------------------------------ degenerate outputs and health checks


def test_repeats_one_token():
    assert repeats_one_token([0, 0, 0, 0])
    assert repeats_one_token([7, 7, 7, 7, 2], {2})  # the stop token at the end does not count
    assert not repeats_one_token([7, 7, 7, 2], {2})  # 3 tokens: too short to call
    assert not repeats_one_token([7, 7, 8, 7])


def _sample(text, ids, flexible, finish="stop_token"):
    return {"empty_output": not text.strip(), "repeats_one_token": repeats_one_token(ids),
            "extracted": {"strict_match": "[invalid]", "flexible_extract": flexible}, "finish_reason": finish}


def test_output_health_counts():
    samples = [_sample("", [2], "[invalid]"), _sample("a a a a", [9, 9, 9, 9], "[invalid]", "length"),
               _sample("so 12", [4, 5, 6], "12")]
    assert output_health(samples) == {"n": 3, "empty": 1, "repeated_token": 1, "no_answer": 2, "ended": 2,
                                      "ended_no_answer": 1}


def test_answers_are_judged_on_generations_that_ended():
    """A budget too short for any answer (eval.max_gen_toks=8: every generation cut) is not a broken model;
    a model whose finished generations hold no number is."""
    cut = {"n": 2, "empty": 0, "repeated_token": 0, "no_answer": 2, "ended": 0, "ended_no_answer": 0}
    assert [c.name for c in check_health({"outputs": cut})] == ["health.empty", "health.repeated_token"]
    ended = {**cut, "ended": 1, "ended_no_answer": 1}
    assert check_health({"outputs": ended})[-1].status == FAIL


def _results(n, empty=0, repeated=0, no_answer=0, nonfinite=(), strict=0.0):
    return {
        "gsm8k": {"strict_match": strict, "flexible_extract": strict, "n": n},
        "health": {"nonfinite": list(nonfinite),
                   "outputs": {"n": n, "empty": empty, "repeated_token": repeated, "no_answer": no_answer}},
        "task": {"num_fewshot": 5, "max_gen_toks": 256},
    }


def _verdict(results):
    return evaluate_verdict(results, model_key="tiny_nemotron_h_mtp", entry="tiny_nemotron_h_mtp",
                            dtype="float32", spec_dec="none")


def test_a_healthy_short_run_passes_and_says_what_had_no_reference():
    v = _verdict(_results(3, no_answer=1))
    gsm = next(c for c in v.checks if c.name == "gsm8k.mean")
    assert gsm.threshold < 0  # at n = 3 the GSM8K check cannot fail ...
    assert v.status == PASS and v.headline == "PASS"
    v = evaluate_verdict({**_results(3), "acceptance": {"rate": 0.5, "length": 2.5}},
                         model_key="tiny_nemotron_h_mtp", entry="x", dtype="float32", spec_dec="mtp",
                         draft_len=2, require_reference=False)
    assert v.headline == "PASS (acceptance: no reference)"  # K = 2 has no acceptance row


@pytest.mark.parametrize(
    "kw, failed",
    [
        ({"empty": 3}, "health.empty"),  # every generation empty (the NaN checkpoint decoding to EOS)
        ({"repeated": 2}, "health.repeated_token"),  # 2 of 3 > 50 %
        ({"no_answer": 3}, "health.answers"),  # no number anywhere
        ({"nonfinite": ["layers.3.mamba", "norm_f", "lm_head"]}, "health.finite"),
    ],
)
def test_a_broken_model_fails_where_gsm8k_cannot(kw, failed):
    """... but the health checks can: the issue's random-weights model (token 0 forever) fails at any n."""
    v = _verdict(_results(3, **kw))
    assert v.passed is False and v.status == FAIL
    assert [c.name for c in v.checks if c.status == FAIL] == [failed]
    assert v.headline == f"FAIL: {failed}"


def test_health_thresholds_and_notes():
    (finite, empty, rep, ans) = check_health(_results(4, empty=2, repeated=3, no_answer=4,
                                                      nonfinite=["layers.3.mamba", "norm_f"])["health"])
    assert (empty.status, empty.value, empty.threshold) == (PASS, 0.5, MAX_EMPTY_FRACTION)  # at the limit
    assert rep.status == FAIL and rep.value == 0.75
    assert ans.status == FAIL and ans.value == 0.0
    assert finite.status == FAIL and finite.note.startswith("NaN / infinite values first in layers.3.mamba, "
                                                            "then norm_f")
    assert check_health(None) == []
    assert headline("fail", [("gsm8k.mean", "pass"), ("health.empty", "fail"), ("acceptance.rate",
                                                                               "no_reference")]) == \
        "FAIL: health.empty (acceptance: no reference)"


# ------------------------------------------------------------------ GSM8K files


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"question": "q", "answer": "#### 1"', "not valid JSON"),
        ('{"question": "a\tb", "answer": "#### 1"}',
         "not valid JSON (Invalid control character at column 16)"),
        ('["q", "a"]', "a JSON list, not an object"),
        ('{"question": "q"}', '"answer" is missing'),
        ('{"question": "q", "answer": null}', '"answer" is None'),
        ('{"answer": "#### 1", "question": ""}', "\"question\" is ''"),
        ('{"question": "what", "answer": "no final marker"}', "the answer has no final '#### <number>'"),
        ('{"question": "what", "answer": "2 + 2 = 4\\n#### "}', "the answer has no final '#### <number>'"),
    ],
)
def test_gsm8k_file_with_a_bad_line_names_file_and_line(tmp_path, line, problem):
    good = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"})
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(f"{good}\n\n{good}\n")
    gsm8k_files(tmp_path)
    (tmp_path / "test.jsonl").write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(GSM8KDataError) as e:
        gsm8k_files(tmp_path)
    assert e.value.problem.startswith(f"{tmp_path / 'test.jsonl'}:3: ") and problem in e.value.problem
    assert "question" in e.value.fix and "answer" in e.value.fix
    with pytest.raises(GSM8KDataError, match=":3: "):
        check_gsm8k_file(tmp_path / "test.jsonl")
    assert " at at " not in e.value.problem


def test_an_empty_gsm8k_file_is_our_error(tmp_path):
    good = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"})
    (tmp_path / "train.jsonl").write_text(f"{good}\n")
    (tmp_path / "test.jsonl").write_text("\n")
    with pytest.raises(GSM8KDataError) as e:
        gsm8k_files(tmp_path)
    assert e.value.problem == f"{tmp_path / 'test.jsonl'} holds no rows (it is empty)"
    assert "restore the file" in e.value.fix


def test_eval_settings_are_refused_before_the_model_loads_naming_key_and_range(tmp_path):
    """eval.num_fewshot outside [0, 7473] (the train split lm-eval draws from) and eval.max_gen_toks < 1 are
    refused by the config check; a count whose prompts cannot fit max_seq_len is refused before the model
    loads (evals.tasks.gsm8k.check_prompt_room), with the largest count that can."""
    from evals.tasks.gsm8k import check_prompt_room

    for override, problem in (("eval.num_fewshot=-1", "eval.num_fewshot=-1 is outside [0, 7473]"),
                              ("eval.num_fewshot=8000", "eval.num_fewshot=8000 is outside [0, 7473]"),
                              ("eval.max_gen_toks=0", "eval.max_gen_toks=0 must be >= 1")):
        with pytest.raises(UserError) as e:
            resolve(compose_config([override]), check_checkpoint=False)
        assert e.value.problem.startswith(problem), e.value.problem
    tokenizer = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp" / "tokenizer.json"
    row = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for _ in range(100)) + "\n")
    check_prompt_room(tokenizer, tmp_path, 5, 256, 4096)
    check_prompt_room(tokenizer, None, 1000, 256, 4096)  # the hub dataset: not read here
    with pytest.raises(UserError) as e:
        check_prompt_room(tokenizer, tmp_path, 90, 256, 512)
    assert e.value.problem.startswith("eval.num_fewshot=90 cannot fit a prompt"), e.value.problem
    fits = int(e.value.problem.rsplit("[0, ", 1)[1].rstrip("])"))
    assert 0 < fits < 90
    check_prompt_room(tokenizer, tmp_path, fits, 256, 512)  # the largest allowed passes
    with pytest.raises(UserError, match=r"^eval.max_gen_toks=256 leaves no room for a prompt"):
        check_prompt_room(tokenizer, None, 0, 256, 8)
    # through run.py: exit 2, the key named, nothing generated (the model was not used)
    # (eval.limit above the test split's 1319 questions is noted, not silently clamped)
    proc = _run_py("eval.num_fewshot=1000", "eval.limit=5000", f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: eval.num_fewshot=1000 cannot fit a prompt" in proc.stderr, proc.stderr
    assert "one position is kept for the question" in proc.stderr, proc.stderr
    assert "generate:" not in proc.stdout + proc.stderr
    assert "note: eval.limit=5000 is more than GSM8K's 1319 test questions: all 1319 run" in proc.stdout
    assert not (tmp_path / "run").exists()  # the refused run's empty folder (only .hydra) is removed


def test_a_safetensors_file_as_checkpoint_names_its_folder():
    from registry.checkpoint import check_checkpoint_dir

    file = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp" / "model.safetensors"
    with pytest.raises(CheckpointError) as e:
        check_checkpoint_dir(file, "model.checkpoint")
    assert e.value.problem.startswith(f"checkpoint {file} is a file (set by model.checkpoint)")
    assert e.value.fix == f"point model.checkpoint at the directory holding it: {file.parent}"


# ------------------------------------------------------------------ output folders


def test_output_folder_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="a path component is a file, not a folder") as e:
        ensure_writable_dir(tmp_path / "afile" / "run")
    assert "out_dir=" in e.value.fix
    with pytest.raises(UserError, match="exists and is not a folder"):
        ensure_writable_dir(tmp_path / "afile")


@pytest.mark.parametrize("code, reason", [(errno.EACCES, "permission denied"),
                                          (errno.EROFS, "read-only file system"),
                                          (errno.ENOSPC, "no space left on the device")])
def test_output_folder_that_cannot_be_written(tmp_path, monkeypatch, code, reason):
    """Root ignores permissions and tests cannot mount read-only: the OS errors are injected."""
    import tempfile

    def refuse(*a, **kw):
        raise OSError(code, os.strerror(code), str(tmp_path))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(UserError, match=f"cannot be written: {reason}"):
        ensure_writable_dir(tmp_path / "o")
    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(UserError, match=f"cannot be created: {reason}"):
        ensure_writable_dir(tmp_path / "p")


def test_default_folders_are_claimed_exclusively(tmp_path):
    first = claim_dir(str(tmp_path / "out" / "2026-12-01_03-00-00"))
    assert claim_dir(str(tmp_path / "out" / "2026-12-01_03-00-00")) == first  # Hydra resolves it again
    # another process asking for the same second's folder (its own cache is empty) gets the next one
    code = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); from evals.outdir import claim_dir; "
            f"print(claim_dir({str(tmp_path / 'out' / '2026-12-01_03-00-00')!r}))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           check=True).stdout.strip()
    assert (first, other) == (str(tmp_path / "out" / "2026-12-01_03-00-00"),
                              str(tmp_path / "out" / "2026-12-01_03-00-00-2"))


def test_a_folder_in_use_is_refused(tmp_path):
    claim = claim_out_dir(tmp_path / "run")
    with pytest.raises(UserError, match="is in use by a run that is still going") as e:
        claim_out_dir(tmp_path / "run")
    assert f"pid {os.getpid()}" in e.value.problem
    claim.release()
    claim_out_dir(tmp_path / "run").release()  # free again once the run ended


def test_a_run_that_ends_removes_its_lock_file_and_a_run_racing_it_still_holds_the_folder(tmp_path,
                                                                                             monkeypatch):
    """A finished folder keeps no .run.lock (issue 46). Removing it is safe against a run that opened the old
    file just before it went: that run then locks the folder's current file, so a third run is refused."""
    import fcntl
    from types import SimpleNamespace

    import evals.outdir as outdir

    folder = tmp_path / "run"
    first = claim_out_dir(folder)
    assert (folder / outdir.LOCK_FILE).is_file()
    first.release()
    first.release()  # idempotent
    assert not (folder / outdir.LOCK_FILE).exists()

    first = claim_out_dir(folder)
    ended = []

    def flock(fd, op):  # the first run ends between this run's open and its flock of the same file
        if not ended:
            ended.append(True)
            first.release()
        return fcntl.flock(fd, op)

    monkeypatch.setattr(outdir, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX,
                                                         LOCK_NB=fcntl.LOCK_NB))
    second = claim_out_dir(folder)
    assert ended and (folder / outdir.LOCK_FILE).is_file()
    with pytest.raises(UserError, match="is in use by a run that is still going"):
        claim_out_dir(folder)  # the second run holds the folder's lock file, not the removed one
    second.release()
    assert not (folder / outdir.LOCK_FILE).exists()


def test_a_refused_runs_folder_is_removed_unless_a_live_run_holds_it(tmp_path):
    """run.py removes the folder Hydra made for a refused run (only .hydra and the lock inside), but never one
    whose lock a live run holds: the refusal may be "in use by a run that is still going", before that run
    wrote anything."""
    folder = Path(claim_fresh_dir(str(tmp_path / "run")))
    claim = claim_out_dir(folder)
    (folder / ".hydra").mkdir()
    remove_unused_run_dir(folder)
    assert (folder / ".hydra").is_dir()  # the live run keeps its folder
    claim.release()
    (folder / "generations.jsonl").write_text("{}\n")
    remove_unused_run_dir(folder)
    assert folder.is_dir()  # something of a run's inside: kept
    (folder / "generations.jsonl").unlink()
    remove_unused_run_dir(folder)
    assert not folder.exists()


def test_a_run_refused_before_any_generation_leaves_no_folder(tmp_path):
    """What a run writes before its first generation finishes (its fingerprint in generations.meta.json, an
    empty generations.jsonl and generations.stats.jsonl, the same in a compare=replay arm's sub-folder) does
    not keep a refused run's folder; one finished generation, or any other file, does."""
    folder = Path(claim_fresh_dir(str(tmp_path / "outputs" / "run")))
    for d in (folder, folder / "rewind"):
        d.mkdir(exist_ok=True)
        (d / "generations.meta.json").write_text('{"fingerprint": {}}\n')
        (d / "generations.jsonl").write_text("")
        (d / "generations.stats.jsonl").write_text("")
    (folder / ".hydra").mkdir()
    for kept in ("rewind/generations.jsonl", "generations.stats.jsonl", "notes.txt"):
        (folder / kept).write_text("{}\n")
        remove_unused_run_dir(folder)
        assert folder.is_dir(), kept
        (folder / kept).write_text("")  # empty again: unused
    (folder / "notes.txt").unlink()
    remove_unused_run_dir(folder)
    assert list(tmp_path.iterdir()) == []


def test_a_refused_run_removes_only_the_folders_it_created(tmp_path):
    """The parents created for a refused run's folder go with it, up to the first that existed before; a
    folder that existed before stays (only the .hydra/ the run added goes), as does a parent that another
    run's folder appeared in."""
    folder = Path(claim_fresh_dir(str(tmp_path / "outputs" / "entry" / "2026-12-06_10-00-00")))
    (folder / ".hydra").mkdir()
    remove_unused_run_dir(folder)
    assert list(tmp_path.iterdir()) == []  # outputs/entry/ were created for it: gone too

    existing = tmp_path / "mine"
    (existing / "sub").mkdir(parents=True)
    note_new_dirs(existing / "sub")  # before Hydra: it exists
    save_hydra_files(existing / "sub", {"overrides.yaml": OmegaConf.create(["eval.limit=4"])})  # accepted
    assert (existing / "sub" / ".hydra" / "overrides.yaml").read_text() == "- eval.limit=4\n"
    remove_unused_run_dir(existing / "sub")  # refused after all (say, its model did not load)
    assert sorted(p.relative_to(tmp_path) for p in existing.rglob("*")) == [Path("mine/sub")]

    note_new_dirs(tmp_path / "new" / "run")  # out_dir= / hydra.run.dir= that does not exist yet
    (tmp_path / "new" / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "new" / "other").mkdir()  # another run's folder in the created parent
    remove_unused_run_dir(tmp_path / "new" / "run")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["other"]


def test_write_atomic_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_atomic(path, '{"old": 1}\n')

    def boom(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, '{"new": 2}\n')
    assert path.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary file left


# ------------------------------------------------------------------ state precision


def test_baseline_rows_hold_for_their_state_dtype(tmp_path):
    rows = [
        {"dtype": "float32", "quant": "none", "kv_cache_quant": "none", "spec_dec": "none", "accuracy": 10.0,
         "num_samples": 1319, "sigma": 13.6},
        {"dtype": "float32", "quant": "none", "kv_cache_quant": "none", "spec_dec": "none", "accuracy": 9.0,
         "num_samples": 1319, "sigma": 13.6, "ssm_state_dtype": ["bfloat16"]}]
    base = {"schema_version": 1, "metric": "mean", "protocol": {"num_fewshot": 5, "max_gen_toks": 256},
            "models": {"tiny": {"description": "d", "source": "s", "rows": rows}}}
    import yaml

    path = tmp_path / "gsm8k.yaml"
    path.write_text(yaml.safe_dump(base))
    assert find_accuracy_reference("tiny", "float32", "none", "none", "none", path=path).accuracy == 10.0
    assert find_accuracy_reference("tiny", "float32", "none", "none", "none",
                                   state={"ssm_state_dtype": "bf16"}, path=path).accuracy == 9.0
    with pytest.raises(BaselineError, match="ssm_state_dtype=float16"):
        find_accuracy_reference("tiny", "float32", "none", "none", "none",
                                state={"ssm_state_dtype": "float16"}, path=path)
    # the shipped acceptance rows are float32-state references: a bfloat16 state finds none
    with pytest.raises(BaselineError, match="ssm_state_dtype=bfloat16"):
        find_acceptance_reference("tiny_nemotron_h_mtp", "none", 3, state={"ssm_state_dtype": "bfloat16"})
    assert find_acceptance_reference("tiny_nemotron_h_mtp", "none", 3).acceptance_rate_floor > 0


def test_run_state_dtype_reaches_the_baseline_lookup():
    rr = resolve(compose_config(["model=tiny_nemotron_h_mtp", "model.ssm.state_dtype=bfloat16"]),
                 check_checkpoint=False)
    assert rr.baseline_state == {"ssm_state_dtype": "bfloat16"}
    assert rr.to_dict()["ssm_state_dtype"] == "bfloat16"  # results.json config


# ------------------------------------------------------------------ reports carry their context


def test_environment_and_git_dirty(tmp_path):
    env = environment("cpu")
    assert env["timestamp_utc"].endswith("+00:00") and env["host"] and env["device_name"].startswith("cpu")
    assert env["torch"] == torch.__version__
    assert set(env) >= {"torch", "triton", "lm_eval", "flashinfer", "python"}
    repo = tmp_path / "repo"
    (repo / "registry").mkdir(parents=True)
    (repo / "outputs").mkdir()

    def git(*a):
        subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)

    git("init", "-q")
    (repo / "README").write_text("x")
    git("add", "README")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    assert git_commit(repo)[1] is False
    (repo / "outputs" / "scratch.json").write_text("{}")  # untracked elsewhere: clean
    assert git_commit(repo)[1] is False
    (repo / "registry" / "new_entry.yaml").write_text("a: 1")  # untracked under registry/: dirty
    assert git_commit(repo)[1] is True


def test_gsm8k_standard_error_is_lm_evals():
    from lm_eval.api.metrics import mean_stderr

    assert mean_stderr([1.0, 0.0, 0.0, 1.0]) == pytest.approx(math.sqrt(0.25 / 3))


def test_plot_titles_and_comparison_lines():
    results = {"entry": "tiny_nemotron_h_mtp", "config": {"ssm_replay": True, "draft_len": 3},
               "environment": {"timestamp_utc": "2026-12-01T03:00:00+00:00"}}
    assert plot_title(results, "Accepted length") == \
        "Accepted length\ntiny_nemotron_h_mtp, ssm_replay=true, K=3, 2026-12-01"
    same = DivergenceSummary(n=5, num_identical=5, num_diverged=0, min_first_divergence=None,
                             median_first_divergence=None)
    assert divergence_line(same) == "tokens: 5 of 5 identical, no divergence"
    assert divergence_line(DivergenceSummary(5, 4, 1, 17, 17.0)) == \
        "tokens: 4 of 5 identical, first divergence at token 17"
    acc = AcceptanceDiff(rate_a=0.5, rate_b=0.5, rate_delta=0.0, length_a=2.5, length_b=2.5, length_delta=0.0,
                         per_position_a=[0.5], per_position_b=[0.5], per_position_delta=[0.0],
                         num_accepted_hist_a=[0, 1, 1], num_accepted_hist_b=[0, 2, 0], draft_len_a=1,
                         draft_len_b=1)
    assert acceptance_line(acc, "rewind", "replay") == (
        "acceptance (rewind -> replay): rate 50.00% -> 50.00% (+0.00 points), length 2.500 -> 2.500 (+0.000)")
    comp = Comparison("rewind", "replay", 5, {}, None, acc)
    checks = {c.name: c for c in comparison_checks(comp, exact=True)}
    assert checks["comparison.acceptance"].status == FAIL  # same rates, but the histograms differ


# ------------------------------------------------------------------ Hydra-level mistakes through run.py


def _run_py(*args, cwd, env=None):
    return subprocess.run([sys.executable, str(REPO_ROOT / "run.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    "args, problem, fix",
    [
        (["model.checkpoint=/data/ck,v2"],
         "error: the override 'model.checkpoint=/data/ck,v2' holds a comma",
         "  fix: quote the value to keep the comma: \"model.checkpoint='/data/ck,v2'\""),
        (["eval.num_fewshot=???"], "error: no value for eval.num_fewshot (the override eval.num_fewshot=???)",
         "  fix: give it a value (e.g. eval.num_fewshot=<value>)"),
        (["eval.limit=???"], "error: no value for eval.limit", "  fix: give it a value"),
        (["out_dir=elsewhere"], "error: out_dir=elsewhere and hydra.run.dir=", "  fix: give one of them"),
        (["runtime.dtype=???"], "error: no value for runtime.dtype", "  fix: give it a value"),
        (["model.checkpoint=${oc.env:ROBUST_UNSET_VARIABLE}"],
         "error: the value of 'model.checkpoint' (the override "
         "'model.checkpoint=${oc.env:ROBUST_UNSET_VARIABLE}') cannot be resolved",
         "  fix: set the environment variable ROBUST_UNSET_VARIABLE"),
    ],
)
def test_hydra_level_mistakes_are_one_error_and_one_fix(tmp_path, args, problem, fix):
    proc = _run_py(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line.split(":")[0] for line in lines[-2:]] == ["error", "  fix"], proc.stderr
    assert lines[-2].startswith(problem), proc.stderr
    assert lines[-1].startswith(fix), proc.stderr


# ------------------------------------------------------------------ registry validate


def test_validate_fails_an_embedded_entry_without_its_checkpoint(tmp_path, monkeypatch):
    import registry.validate as registry_validate

    shipped = registry_validate.EMBEDDED_CHECKPOINTS_DIR / "tiny_nemotron_h_mtp"
    command = registry_validate.restore_command(shipped)
    rel = shipped.relative_to(REPO_ROOT)
    assert command == f"git -C {REPO_ROOT} checkout HEAD -- {rel}"
    tracked = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "--", str(rel)], capture_output=True,
                             text=True, check=True).stdout.split()
    assert {Path(t).name for t in tracked} >= {"config.json", "tokenizer.json", "model.safetensors"}

    monkeypatch.setattr(registry_validate, "EMBEDDED_CHECKPOINTS_DIR", tmp_path / "checkpoints")
    report = registry_validate.validate_one("tiny_nemotron_h_mtp")
    (error,) = [e for e in report.errors if "does not exist" in e]
    assert error.startswith(f"embedded checkpoint {tmp_path / 'checkpoints' / 'tiny_nemotron_h_mtp'} does "
                            "not exist")
    # not tracked by git there: how to build it
    assert "fix: build it with python -m runners.tools.tiny" in error
    assert not any("not built yet" in n for n in report.notes)


def test_console_labels_both_arms_alike():
    comparison = {"label_a": "rewind", "label_b": "replay",
                  "filters": {f: {"accuracy_a": 2.0, "accuracy_b": 2.0} for f in ("strict_match",
                                                                                    "flexible_extract")},
                  "acceptance": {"rate_a": 0.5, "rate_b": 0.5, "length_a": 2.5, "length_b": 2.5}}
    results = {"entry": "tiny_nemotron_h_mtp", "comparison": comparison,
               "config": {"model": {"family": "nemotron_h", "ssm": {"backend": "torch"}}, "dtype": "float32",
                          "device": "cpu",
                          "ssm_replay": True, "world_size": 1, "draft_len": 3, "ssm_backend": "torch",
                          "ssm_state_dtype": "float32"},
               "gsm8k": {"strict_match": 0.02, "flexible_extract": 0.02, "n": 10}, "acceptance": {},
               "timings": {"prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0, "wall_seconds": 1.0},
               "memory": {"kv": 1}}
    text = format_console(results)
    rows = [line for line in text.splitlines() if "rewind" in line and "replay" in line]
    assert rows and all(line.index("rewind") < line.index("replay") for line in rows), text
    assert "ssm_replay / world_size both arms (compare=replay) / 1" in " ".join(text.split())
    # speed and memory are the replay arm's (the combined results.json is that arm's): the lines say so
    for line in ("prefill (replay arm)", "decode (replay arm)", "wall time (replay arm)",
                 "cache memory (replay arm)"):
        assert line in text, text
    assert "prefill (replay arm)" not in format_console({**results, "comparison": None})


def test_readme_error_examples_are_what_run_py_prints(tmp_path):
    """Each README block that starts with `$ python run.py ...` and shows error / fix lines: run.py prints
    those lines (a line ending in '...' is a prefix)."""
    import re
    import shlex

    blocks = re.findall(r"```\n(\$ python run\.py[^\n]*)\n(error:[^\n]*)\n(  fix:[^\n]*)\n```",
                        (REPO_ROOT / "README.md").read_text())
    assert len(blocks) >= 3
    for command, *lines in blocks:
        proc = _run_py(*shlex.split(command)[3:], f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        got = proc.stderr.strip().splitlines()[-2:]
        for want, line in zip(lines, got):
            assert line.startswith(want.removesuffix("...")) if want.endswith("...") else line == want, \
                (command, want, line)


def test_weight_check_reads_fp8_tensors():
    """FP8 checkpoints (e4m3fn weights) are checked too: torch has no isfinite for float8."""
    from runners.engine.loader import check_weights

    check_weights({"w": torch.randn(4, 4).to(torch.float8_e4m3fn)}, "ck")
    with pytest.raises(CheckpointError, match="all zeros: w"):
        check_weights({"w": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, "ck")
    with pytest.raises(CheckpointError, match="NaN or infinite values: w"):
        check_weights({"w": torch.full((4, 4), float("nan")).to(torch.float8_e4m3fn)}, "ck")


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_uncreatable_hydra_run_dir_is_one_error_and_fix_line(tmp_path, where):
    """Hydra creates hydra.run.dir before the job starts; a folder it cannot create is a user error (exit 2,
    error / fix lines, no traceback), as out_dir= is."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    run_dir = blocker / "run" if where == "under_a_file" else Path("/proc/no_such_run_dir")
    proc = subprocess.run([sys.executable, "run.py", "eval.limit=1", f"hydra.run.dir={run_dir}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith("error: cannot create the run folder") and lines[-1].startswith("  fix:")


def test_resume_on_a_folder_without_generations_says_so(tmp_path, capsys):
    """resume=true on an empty (e.g. mistyped) folder starts from the first question, and says so."""
    from runners.app.rundir import check_resume

    check_resume(tmp_path / "fresh", True, {"draft_len": 3})
    assert "resume=true, but" in capsys.readouterr().err
    check_resume(tmp_path / "fresh2", False, {"draft_len": 3})
    assert capsys.readouterr().err == ""


def test_a_run_in_a_fresh_environment_does_not_start_with_matplotlibs_font_cache_line(tmp_path):
    """A fresh MPLCONFIGDIR makes matplotlib build its font cache and log "generated new fontManager": the
    run's output must not carry it (evals/mpl.py quiets that logger before matplotlib is imported)."""
    mpl = tmp_path / "mplconfig"
    mpl.mkdir()
    proc = _run_py("eval.limit=1", "verdict.require_reference=false", f"hydra.run.dir={tmp_path / 'run'}",
                   "history.db=null", cwd=tmp_path, env={"MPLCONFIGDIR": str(mpl)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(mpl.glob("fontlist-*.json")), "no new font cache was built: the test would prove nothing"
    for stream in (proc.stdout, proc.stderr):
        assert "generated new fontManager" not in stream, stream[:500]


# ------------------------------------------------------------------ a key given twice in a YAML file


def test_a_key_given_twice_is_refused_by_the_registry_reader_naming_file_and_line(tmp_path):
    """PyYAML's safe loader keeps the last of two equal keys silently (a baseline row or an entry's dtype
    would change unseen); Hydra's loader refuses them with a traceback. registry.yamlfile refuses them, for
    entries and baseline files alike, with the line of the second."""
    import yaml

    from registry.baselines import load_accuracy_baselines
    from registry.yamlfile import RegistryYAMLError, load

    assert yaml.safe_load("a: 1\na: 2\n") == {"a": 2}  # what the plain safe loader does
    with pytest.raises(RegistryYAMLError) as e:
        load("name: x\ndtype: float32\nquant: none\ndtype: float16\n", "registry/model/x.yaml")
    assert e.value.problem == ("registry/model/x.yaml: not valid YAML for the registry (line 4, column 1): "
                               "found the duplicate key 'dtype' (first at line 2)")
    assert e.value.fix == "remove one of the two `dtype:` (a YAML mapping holds each key once)"
    with pytest.raises(RegistryYAMLError, match=r"\(line 2, column 13\): found the duplicate key 'b'"):
        load("name: x\nssm: {b: 1, b: 2}\n", "x.yaml")
    assert load("1: a\n'1': b\nc: {d: 1}\ne: {d: 2}\n", "x.yaml") == {1: "a", "1": "b", "c": {"d": 1},
                                                                       "e": {"d": 2}}
    baselines = (REPO_ROOT / "registry/baselines/gsm8k.yaml").read_text()
    assert "\nmetric: mean\n" in baselines
    (tmp_path / "gsm8k.yaml").write_text(baselines.replace("\nmetric: mean\n", "\nmetric: mean\nmetric: x\n"))
    with pytest.raises(BaselineError, match="found the duplicate key 'metric'"):
        load_accuracy_baselines(tmp_path / "gsm8k.yaml")


def test_a_yaml_error_in_configs_is_one_error_naming_file_and_line(tmp_path):
    """configs/ is read by Hydra's (OmegaConf's) loader only: its duplicate-key and syntax errors become the
    same error / fix pair (registry.compose.config_error), naming the file and the line."""
    from omegaconf import OmegaConf

    from registry.compose import config_error

    bad = tmp_path / "gsm8k.yaml"
    for text, problem, fix in [
        ("name: gsm8k\nnum_fewshot: 5\nnum_fewshot: 3\n",
         "(line 3, column 1): found duplicate key num_fewshot", "remove one of the two `num_fewshot:`"),
        ("name: [gsm8k\n", "(line 2, column 1): expected ',' or ']'", "fix the YAML syntax"),
    ]:
        bad.write_text(text)
        with pytest.raises(Exception) as raised:
            OmegaConf.load(bad)  # what Hydra calls for each config file
        err = config_error(raised.value, [])
        assert err is not None, raised.value
        assert err.problem.startswith(f"{bad}: not valid YAML for Hydra's run config {problem}"), err.problem
        assert err.fix.startswith(fix), err.fix


@pytest.fixture(scope="module")
def repo_with_a_duplicate_key(tmp_path_factory):
    """A copy of the checkout's entry points whose registry/model/tiny_qwen3_next_mtp.yaml has `dtype:`
    twice (registry/ and configs/ copied: the registry finds its files from its own location; the code and
    the checkpoints linked)."""
    import shutil

    root = tmp_path_factory.mktemp("dupkey") / "repo"
    root.mkdir()
    shutil.copy(REPO_ROOT / "run.py", root / "run.py")
    shutil.copytree(REPO_ROOT / "configs", root / "configs")
    shutil.copytree(REPO_ROOT / "registry", root / "registry",
                    ignore=shutil.ignore_patterns("checkpoints", "__pycache__"))
    (root / "registry/checkpoints").symlink_to(REPO_ROOT / "registry/checkpoints")
    for package in ("evals", "runners", "kernels"):
        (root / package).symlink_to(REPO_ROOT / package)
    entry = root / "registry/model/tiny_qwen3_next_mtp.yaml"
    text = entry.read_text()
    assert "\ndtype: float32\n" in text
    entry.write_text(text.replace("\ndtype: float32\n", "\ndtype: float32\ndtype: bfloat16\n"))
    return root


@pytest.mark.parametrize("args", [
    ["run.py", "model=tiny_qwen3_next_mtp", "eval.limit=1"],
    ["run.py", "+experiment=nightly", "eval.limit=1"],  # the nightly entries are read by its sweep resolver
    ["-m", "registry", "validate"],
    ["-m", "registry", "list"],
])
def test_a_key_given_twice_in_an_entry_is_refused_by_every_entry_point(repo_with_a_duplicate_key, args):
    """Issue 46: `dtype:` twice in an entry gave a 90-line traceback from run.py, the nightly sweep and
    `python -m registry validate|list`. run.py refuses with error / fix lines and exit 2; validate and list
    report the entry as invalid (exit 1, as for a YAML syntax error), naming the file and line."""
    root = repo_with_a_duplicate_key
    folder = [f"hydra.run.dir={root / 'out'}"] if args[0] == "run.py" else []
    proc = subprocess.run([sys.executable, *args, *folder], cwd=root, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    problem = ("registry/model/tiny_qwen3_next_mtp.yaml: not valid YAML for the registry (line 8, column 1): "
               "found the duplicate key 'dtype' (first at line 7)")
    if args[0] == "run.py":
        assert proc.returncode == 2, out[-3000:]
        assert proc.stderr.strip().splitlines() == [
            f"error: {problem}", "  fix: remove one of the two `dtype:` (a YAML mapping holds each key once)"]
    elif args[-1] == "validate":
        assert proc.returncode == 1, out[-3000:]
        assert f"FAIL  tiny_qwen3_next_mtp\n      error: {problem} -- fix: remove one" in proc.stdout
        assert "ok    tiny_nemotron_h_mtp" in proc.stdout
    else:
        import re

        assert proc.returncode == 1, out[-3000:]
        assert re.search(r"\ntiny_qwen3_next_mtp +\(invalid: python -m registry validate\)\n", proc.stdout)


# ------------------------------------------------------------------ a run folder whose files were cut short


def test_a_results_json_cut_short_is_one_error_for_compare_report_and_history(tmp_path, capsys):
    """evals.compare, evals.report and evals.history import read a saved results.json through one helper
    (evals.results.read_results): a truncated one is the same error / fix pair and exit 2 from each (compare
    gave a JSONDecodeError traceback), and the refused import leaves no new database behind (issue 46)."""
    from history_factory import make_results, write_run

    from evals import history
    from evals.compare import main as compare_main
    from evals.report import main as report_main

    good = write_run(tmp_path / "good", make_results(), correct=[1, 0, 1, 1])
    bad = write_run(tmp_path / "bad", make_results(), correct=[1, 0, 1, 1])
    text = (bad / "results.json").read_text()
    (bad / "results.json").write_text(text[: len(text) // 2])
    db = tmp_path / "new.db"
    for main, argv in ((compare_main, [str(good), str(bad)]), (report_main, [str(bad)]),
                       (history.main, ["--db", str(db), "import", str(good), str(bad)])):
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2, lines
        assert lines[0].startswith(f"error: {bad / 'results.json'} is not JSON, or cannot be read ("), lines
        assert lines[1].startswith("  fix: restore it, or rewrite it by resuming its run"), lines
    assert not db.exists() and not list(tmp_path.glob("new.db*"))  # nothing recorded, no empty database
    # a results.json that is not a run's: refused before the database is created, too
    (bad / "results.json").write_text(json.dumps({"schema_version": 2}))
    assert history.main(["--db", str(db), "import", str(bad)]) == 2
    assert "not a results.json of run.py" in capsys.readouterr().err and not db.exists()
    assert history.main(["--db", str(db), "import", str(good)]) == 0 and db.is_file()


@pytest.mark.parametrize("name", ["samples.jsonl", "generations.jsonl"])
def test_a_jsonl_file_cut_short_is_named_with_its_line_by_compare(tmp_path, capsys, name):
    from history_factory import make_results, write_run

    from evals.compare import main as compare_main

    good = write_run(tmp_path / "good", make_results(), correct=[1, 0, 1, 1])
    bad = write_run(tmp_path / "bad", make_results(), correct=[1, 0, 1, 1])
    text = (bad / name).read_text()
    (bad / name).write_text(text[: len(text) - 12])  # the last line cut short
    assert compare_main([str(good), str(bad)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: {bad / name}:4: not JSON ("), lines
    assert lines[1].startswith("  fix: "), lines


def test_the_documented_output_folders_are_ignored_by_git():
    """What the README's and docs' commands write inside the checkout (run and sweep folders, the history
    database, `evals.history report --out report/`) is ignored by git, so it never shows as a change."""
    import re
    import shutil

    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    docs = (REPO_ROOT / "README.md").read_text() + (REPO_ROOT / "docs" / "nightly.md").read_text()
    reports = set(re.findall(r"python -m evals\.history report --out ([^\s/][^\s]*)", docs))
    assert "report/" in reports, reports
    paths = [f"{r.rstrip('/')}/index.html" for r in reports if not r.startswith("/")]
    paths += ["outputs/tiny_nemotron_h_mtp/2026-12-06_10-00-00/results.json", "outputs/history.db",
              "multirun/nightly/2026-12-06_10-00-00/0/results.json"]
    proc = subprocess.run(["git", "-C", str(REPO_ROOT), "check-ignore", "--no-index", *paths],
                          capture_output=True, text=True, timeout=60)
    assert sorted(proc.stdout.split()) == sorted(paths), proc.stdout + proc.stderr
