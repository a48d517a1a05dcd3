"""runners.app.main.run's verdict, exit status, draft_len override and resume policy, with a fake engine and
evaluation and baseline files written by the test (hand-computed thresholds)."""
# ruff: noqa: F811  (the `fakes` fixture is imported from test_app and named as an argument)

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_app import FAKE_SITECUSTOMIZE, FakeEngine, _cfg, fakes, make_checkpoint  # noqa: F401

import evals.task
import registry.baselines
from registry.errors import UserError
from registry.resolve import resolve
from registry.schema import REPO_ROOT
from runners.app import main as app

# Reference 50 % with a per-row sigma of 10 points; the fake run scores n = 4 samples. By hand:
#   scale     = sqrt(2 * 10^2 / 4)                        = 7.0710678
#   threshold = 50 + Phi^-1(0.05) * scale = 50 - 1.6448536 * 7.0710678 = 38.3691285
#   theta     = (1.6448536 + 0.8416212) * 7.0710678        = 17.5820324
GSM8K_YAML = """
schema_version: 1
metric: mean
protocol: {num_fewshot: 5, max_gen_toks: 256}
models:
  tiny_nemotron_h_mtp:
    rows:
      - {dtype: float32, quant: none, kv_cache_quant: none, spec_dec: mtp, accuracy: 50.0, num_samples: 1319,
         sigma: 10.0}
      - {dtype: float32, quant: none, kv_cache_quant: none, spec_dec: none, accuracy: 50.0, num_samples: 1319,
         sigma: 10.0}
"""
ACCEPTANCE_YAML = """
schema_version: 1
protocol: {num_fewshot: 5, max_gen_toks: 256}
models:
  tiny_nemotron_h_mtp:
    rows:
      - {quant: none, draft_len: 3, acceptance_rate_floor: RATE_FLOOR,
         acceptance_length: {reference: 2.6, floor: 2.4}}
"""


@pytest.fixture
def baselines(tmp_path, monkeypatch):
    """Point registry.baselines at test-owned files; returns a function that rewrites the rate floor."""

    def write(rate_floor: float = 0.4) -> None:
        (tmp_path / "gsm8k.yaml").write_text(GSM8K_YAML)
        (tmp_path / "acceptance.yaml").write_text(ACCEPTANCE_YAML.replace("RATE_FLOOR", str(rate_floor)))

    write()
    monkeypatch.setattr(registry.baselines, "GSM8K_BASELINES", tmp_path / "gsm8k.yaml")
    monkeypatch.setattr(registry.baselines, "ACCEPTANCE_BASELINES", tmp_path / "acceptance.yaml")
    monkeypatch.setattr(evals.task, "BASELINES_DIR", tmp_path)  # the task rows' files: the same two
    return write


def _scores(monkeypatch, strict: float, flexible: float) -> None:
    """Make the fake evaluation of test_app report these fractions (n = 4)."""
    inner = app.evaluate_engine

    def evaluate(*args, **kw):
        result = inner(*args, **kw)
        result.scores = {"strict_match": strict, "flexible_extract": flexible, "n": 4}
        return result

    monkeypatch.setattr(app, "evaluate_engine", evaluate)


def _run(tmp_path, *overrides):
    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        make_checkpoint(ckpt)
    return app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={tmp_path / 'out'}", *overrides))


def _checks(results) -> dict[str, dict]:
    return {c["name"]: c for c in results["verdict"]["checks"]}


def test_matched_reference_fails_below_the_hand_computed_threshold(fakes, baselines, tmp_path, monkeypatch,
                                                                    capsys):
    _scores(monkeypatch, 0.25, 0.5)  # mean 37.5 % < 38.3691
    results = _run(tmp_path)
    gsm8k = _checks(results)["gsm8k.mean"]
    assert gsm8k["value"] == pytest.approx(37.5)
    assert gsm8k["reference"] == 50.0 and gsm8k["threshold"] == pytest.approx(38.3691285, abs=1e-6)
    assert gsm8k["details"]["scale"] == pytest.approx(7.0710678, abs=1e-6)
    assert gsm8k["details"]["theta"] == pytest.approx(17.5820324, abs=1e-6)
    assert gsm8k["details"]["n"] == 4 and gsm8k["status"] == "fail" and gsm8k["passed"] is False
    # FakeStats: rate 300 / 600 = 0.5 >= 0.4, length 1 + 300 / 200 = 2.5 >= 2.4
    assert _checks(results)["acceptance.rate"]["status"] == "pass"
    assert _checks(results)["acceptance.length"]["status"] == "pass"
    assert results["verdict"]["passed"] is False and results["verdict"]["status"] == "fail"
    assert app.exit_code(results) == 1
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["verdict"] == results["verdict"]
    assert "**Verdict: FAIL: gsm8k.mean**" in (tmp_path / "out" / "summary.md").read_text()
    printed = capsys.readouterr().out
    assert "verdict                  FAIL" in printed
    assert "gsm8k.mean             37.50 vs threshold 38.37, reference 50.00: FAIL" in printed


def test_matched_reference_passes_at_the_reference(fakes, baselines, tmp_path, monkeypatch):
    _scores(monkeypatch, 0.5, 0.5)
    results = _run(tmp_path)
    assert _checks(results)["gsm8k.mean"]["status"] == "pass"
    assert results["verdict"]["passed"] is True and results["verdict"]["complete"] is True
    assert app.exit_code(results) == 0


def test_a_run_of_another_protocol_is_reported_not_judged(fakes, baselines, tmp_path, monkeypatch, capsys):
    """The same failing scores and acceptance (below a 0.55 floor), 0-shot: the evaluation runs with
    num_fewshot=0, the references (5-shot) judge nothing, the run exits 0 with NO REFERENCE, and the warning
    before loading names the setting."""
    _scores(monkeypatch, 0.25, 0.5)
    baselines(rate_floor=0.55)
    results = _run(tmp_path, "eval.num_fewshot=0")
    assert fakes[-1]["num_fewshot"] == 0 and results["task"]["num_fewshot"] == 0
    checks = _checks(results)
    assert [checks[n]["status"] for n in ("gsm8k.mean", "acceptance.rate", "acceptance.length")] == \
        ["no_reference"] * 3
    assert "this run sets eval.num_fewshot=0" in checks["gsm8k.mean"]["note"]
    assert results["verdict"]["status"] == "no_reference" and app.exit_code(results) == 0
    out = capsys.readouterr().out
    assert out.count("warning: ") == 1  # one line for gsm8k.yaml and acceptance.yaml: one protocol


def test_acceptance_floor_failure(fakes, baselines, tmp_path, monkeypatch):
    _scores(monkeypatch, 0.5, 0.5)
    baselines(rate_floor=0.55)
    results = _run(tmp_path)
    rate = _checks(results)["acceptance.rate"]
    assert (rate["value"], rate["threshold"], rate["status"]) == (0.5, 0.55, "fail")
    assert app.exit_code(results) == 1


def test_unmatched_reference_is_an_error_before_loading(fakes, baselines, tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UserError) as e:
        _run(tmp_path, "runtime.dtype=bfloat16")  # the test file has float32 rows only
    assert not FakeEngine.built and not fakes
    assert "no GSM8K reference for 'tiny_nemotron_h_mtp' with dtype=bfloat16" in e.value.problem
    assert "verdict.require_reference=false" in e.value.fix
    with pytest.raises(UserError) as e:
        _run(tmp_path, "draft_len=5")  # acceptance rows exist for draft_len 3 only
    assert "no acceptance reference" in e.value.problem and "draft_len=5" in e.value.problem


def test_unmatched_reference_allowed_reports_no_reference(fakes, baselines, tmp_path):
    results = _run(tmp_path, "runtime.dtype=bfloat16", "verdict.require_reference=false")
    gsm8k = _checks(results)["gsm8k.mean"]
    assert gsm8k["status"] == "no_reference" and "no GSM8K reference" in gsm8k["note"]
    # Acceptance rows are keyed on (quant, draft_len), not dtype: those checks still have their floors.
    assert _checks(results)["acceptance.rate"]["status"] == "pass"
    assert results["verdict"]["complete"] is False and app.exit_code(results) == 0
    results = _run(tmp_path, "runtime.dtype=bfloat16", "verdict.require_reference=false", "draft_len=0",
                   "resume=true")
    assert results["verdict"]["passed"] is None and results["verdict"]["status"] == "no_reference"
    assert app.exit_code(results) == 0


def test_entry_without_baseline_key(fakes, baselines, tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UserError) as e:
        _run(tmp_path, "model.baseline=null")
    assert "has no `baseline` key" in e.value.problem


def test_draft_len_override(fakes, baselines, tmp_path, monkeypatch):
    _scores(monkeypatch, 0.5, 0.5)
    results = _run(tmp_path, "draft_len=0")
    (_, kwargs), = FakeEngine.built
    assert kwargs["draft_len"] == 0 and kwargs["ssm_replay"] is False
    assert results["acceptance"] is None and results["config"]["draft_len"] == 0
    # spec_dec none: the GSM8K row without MTP judges it, and no acceptance checks are made
    assert list(_checks(results)) == ["gsm8k.mean"]
    assert _checks(results)["gsm8k.mean"]["details"]["reference_row"]["spec_dec"] == "none"


@pytest.mark.parametrize(
    "overrides, problem, fix",
    [
        (["draft_len=0", "ssm_replay=true"], "ssm_replay requires speculative decoding, but draft_len=0",
         "drop ssm_replay=true"),
        (["draft_len=0", "model.ssm.replay=true"], "ssm_replay requires speculative decoding",
         "add ssm_replay=false"),
        (["draft_len=-1"], "draft_len must be >= 0", "draft_len=0"),
        (["draft_len=2", "model.speculative.algorithm=none", "model.speculative.draft_len=0"],
         "draft_len=2 needs MTP speculative decoding", "*_mtp entry"),
        (["compare=rewind"], "compare=rewind is not a comparison", "compare=replay"),
        (["compare=replay", "draft_len=0"], "compare=replay needs speculative decoding", "drop draft_len=0"),
        (["compare=replay", "ssm_replay=true"], "runs both ssm_replay=false and ssm_replay=true",
         "drop the ssm_replay override"),
    ],
)
def test_speculation_and_compare_errors(fakes, tmp_path, overrides, problem, fix):
    make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UserError) as e:
        _run(tmp_path, *overrides)
    assert not FakeEngine.built
    assert problem in e.value.problem and fix in e.value.fix


def test_existing_out_dir_needs_resume(fakes, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "generations.jsonl").write_text('{"key": "k", "text": "t"}\n')
    make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UserError) as e:
        _run(tmp_path)
    assert str(out / "generations.jsonl") in e.value.problem and "resume=true" in e.value.fix
    assert not FakeEngine.built
    _run(tmp_path, "resume=true")
    (call,) = fakes
    assert call["resume"] is True and call["out_dir"] == str(out)


def test_resume_with_other_settings_is_refused_before_loading(fakes, tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    _run(tmp_path)
    stored = dict(fakes[0]["fingerprint"])
    out = tmp_path / "out"
    (out / "generations.jsonl").write_text('{"key": "k", "text": "t"}\n')
    (out / "generations.meta.json").write_text(json.dumps({"fingerprint": stored}))  # as the store writes
    FakeEngine.built.clear()
    with pytest.raises(UserError) as e:
        _run(tmp_path, "resume=true", "draft_len=0")
    assert "other settings (draft_len: 3 then, 0 now)" in e.value.problem and not FakeEngine.built
    _run(tmp_path, "resume=true")  # the same settings resume
    assert fakes[-1]["resume"] is True and fakes[-1]["fingerprint"] == stored
    # the recurrent backend is part of it (a run must not mix kernels); a fingerprint written before the key
    # existed resumes
    assert stored["ssm_backend"] == "torch"  # on the CPU, whatever the entry's GPU backend
    meta = out / "generations.meta.json"
    meta.write_text(json.dumps({"fingerprint": {**stored, "ssm_backend": "triton"}}))
    with pytest.raises(UserError) as e:
        _run(tmp_path, "resume=true")
    assert "ssm_backend (model.ssm.backend): 'triton' then, 'torch' now" in e.value.problem
    old = {k: v for k, v in stored.items() if k != "ssm_backend"}
    meta.write_text(json.dumps({"fingerprint": old}))
    _run(tmp_path, "resume=true")


def test_empty_generations_file_is_not_a_run(fakes, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "generations.jsonl").write_text("")  # a run killed before its first request finished
    _run(tmp_path)
    assert Path(fakes[0]["out_dir"]) == out and fakes[0]["resume"] is False



def test_run_py_exit_status_one_when_a_check_fails(baselines, tmp_path):
    """The whole command: a failed check (acceptance rate 0.5 below a 0.9 floor) gives exit status 1."""
    baselines(rate_floor=0.9)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    site = tmp_path / "site"
    site.mkdir()
    patch_baselines = (f"import registry.baselines, pathlib\n"
                       f"registry.baselines.GSM8K_BASELINES = pathlib.Path("
                       f"{str(tmp_path / 'gsm8k.yaml')!r})\n"
                       f"registry.baselines.ACCEPTANCE_BASELINES = pathlib.Path("
                       f"{str(tmp_path / 'acceptance.yaml')!r})\n"
                       f"import evals.task\nevals.task.BASELINES_DIR = pathlib.Path({str(tmp_path)!r})\n")
    tests_dir = str(Path(__file__).parent)
    (site / "sitecustomize.py").write_text(FAKE_SITECUSTOMIZE.format(tests=tests_dir) + patch_baselines)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "run.py"), f"model.checkpoint={ckpt}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "verdict                  FAIL" in proc.stdout
    assert "acceptance.rate        0.5000 vs threshold 0.9000: FAIL" in proc.stdout
    assert json.loads((tmp_path / "run" / "results.json").read_text())["verdict"]["passed"] is False


def test_engine_value_error_becomes_a_user_error(gsm8k_dir, tmp_path):
    """A ValueError raised inside runners / evals (here the real engine on the shipped tiny checkpoint,
    refusing prompts longer than max_seq_len) is reported as error / fix, not as a traceback."""
    # zero-shot and 8 new tokens in 16 positions; the question itself is longer. The checks before loading
    # refuse it (evals.tasks.gsm8k.check_prompt_room): passed over (`checked` given), the engine refuses it
    cfg = _cfg("model.max_seq_len=16", "eval.max_gen_toks=8", "eval.num_fewshot=0", "eval.limit=1",
               f"eval.data_dir={gsm8k_dir}", f"out_dir={tmp_path}")
    with pytest.raises(UserError) as e:
        app.run(cfg, resolve(cfg))
    assert "> max_seq_len=16" in e.value.problem
    assert all(key in e.value.fix for key in ("eval.num_fewshot", "eval.max_gen_toks", "model.max_seq_len"))
