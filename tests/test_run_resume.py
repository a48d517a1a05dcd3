"""Kill-and-resume through the command line: `python run.py ...` SIGKILLed after some samples are on disk,
then `python run.py ... resume=true` into the same folder ends with the results of an uninterrupted run.

The engine is test_gsm8k_fakes.FakeEngine (scripted answers over real GSM8K questions, a tokenizer trained on
GSM8K train), installed into the run.py subprocesses by a sitecustomize; everything else (Hydra, the app,
lm-eval's gsm8k task, the resume store, the report) is the real code.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_app import _cfg, make_checkpoint
from test_gsm8k_fakes import FakeEngine, answer_policy, last_question, read_jsonl, train_tiny_tokenizer
from tokenizers import Tokenizer

from evals.outdir import LOCK_FILE, claim_out_dir
from registry.errors import UserError
from registry.schema import REPO_ROOT
from runners.app import main as app

LIMIT = 6
KILL_AFTER = 3  # samples on disk when the run is killed

SITECUSTOMIZE = '''
import os, signal, sys
# Ctrl-C's handler restored: a suite started as a background job (`cmd &` in a script) ignores SIGINT, and
# its children inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
import test_run_resume
from runners.app import main as app
app.Engine = test_run_resume.ScriptedEngine
'''


class ScriptedEngine(FakeEngine):
    """FakeEngine behind runners.Engine's from_pretrained / cache_memory; answers every other question right.

    $SCRIPTED_HANG_AFTER (if set): hang after that many requests have finished (a run to be killed).
    """

    @classmethod
    def from_pretrained(cls, path, options, **placement):
        complete = answer_policy("alternate", Path(os.environ["GSM8K_DIR"]))
        hang = os.environ.get("SCRIPTED_HANG_AFTER")
        engine = cls(Tokenizer.from_file(str(Path(path) / "tokenizer.json")),
                     lambda p: complete(last_question(p)), max_batch_size=2, step_delay=0.002,
                     hang_after=int(hang) if hang else None)
        engine.config = SimpleNamespace(eos_token_id=2)
        engine.ssm_backend = options.ssm_backend
        engine.load_report = None  # as an Engine built without from_pretrained
        engine.prefix_cache = None  # as an Engine with runtime.prefix_cache=false (the fake reuses nothing)
        engine.prefix_cache_off_reason = "runtime.prefix_cache=false"
        return engine

    def cache_memory(self):
        return {"ssm_state_bytes": 1, "conv_state_bytes": 2, "kv_cache_bytes": 3, "spec_buffers_bytes": 0}


@pytest.fixture(scope="module")
def checkpoint(gsm8k_dir, tmp_path_factory) -> Path:
    ckpt = make_checkpoint(tmp_path_factory.mktemp("resume") / "ckpt")
    train_tiny_tokenizer(gsm8k_dir, ckpt / "tokenizer.json")
    return ckpt


def _run_py(tmp_path, gsm8k_dir, *args, hang_after=None, popen=False, timeout=120):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)]),
           "GSM8K_DIR": str(gsm8k_dir), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("SCRIPTED_HANG_AFTER", None)
    if hang_after is not None:
        env["SCRIPTED_HANG_AFTER"] = str(hang_after)
    cmd = [sys.executable, str(REPO_ROOT / "run.py"), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _signal_mid_run(tmp_path, gsm8k_dir, out: Path, sig: int, *args: str) -> tuple[int, str]:
    """Start run.py (scripted engine, hangs after KILL_AFTER requests), send `sig` once KILL_AFTER generations
    are in out/generations.jsonl; returns (exit status, stderr). While the run goes, its folder is refused to
    another run (evals.outdir.claim_out_dir)."""
    proc = _run_py(tmp_path, gsm8k_dir, *args, hang_after=KILL_AFTER, popen=True)
    gen_file, deadline = out / "generations.jsonl", time.monotonic() + 300
    try:
        while not (gen_file.exists() and gen_file.read_text().count("\n") >= KILL_AFTER):
            assert proc.poll() is None, f"the run ended before the signal: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "no generations appeared within 300 s"
            time.sleep(0.02)
        assert (out / LOCK_FILE).is_file()
        with pytest.raises(UserError, match="is in use by a run that is still going"):
            claim_out_dir(out)
        proc.send_signal(sig)
        stderr = proc.communicate(timeout=120)[1].decode()
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, stderr


def test_sigkill_then_resume_true_equals_uninterrupted(checkpoint, gsm8k_dir, tmp_path, monkeypatch,
                                                       capsys):
    common = [f"model.checkpoint={checkpoint}", f"eval.limit={LIMIT}", f"eval.data_dir={gsm8k_dir}",
              "eval.max_gen_toks=200"]
    # The uninterrupted reference, in process (same fake engine, same app code).
    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir))
    monkeypatch.delenv("SCRIPTED_HANG_AFTER", raising=False)
    monkeypatch.setattr(app, "Engine", ScriptedEngine)
    ref = app.run(_cfg(*common, f"out_dir={tmp_path / 'ref'}"))
    assert ref["gsm8k"]["strict_match"] == 0.5 and ref["gsm8k"]["n"] == LIMIT  # every other one right

    out = tmp_path / "killed"
    proc = _run_py(tmp_path, gsm8k_dir, *common, f"hydra.run.dir={out}", hang_after=KILL_AFTER, popen=True)
    gen_file, deadline = out / "generations.jsonl", time.monotonic() + 90
    try:
        while not (gen_file.exists() and gen_file.read_text().count("\n") >= KILL_AFTER):
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "no generations appeared within 90 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert len(read_jsonl(gen_file)) == KILL_AFTER and not (out / "results.json").exists()
    assert (out / LOCK_FILE).is_file()  # a killed process leaves its lock file (the kernel freed the lock)

    # The resume, in process (the command line's resume is run by the Ctrl-C test below)
    capsys.readouterr()
    app.run(_cfg(*common, f"out_dir={out}", "resume=true"))
    assert f"resumed                  {KILL_AFTER} samples from disk, {LIMIT - KILL_AFTER} generated now" \
        in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["gsm8k"] == ref["gsm8k"]
    assert results["resumed"]["num_resumed"] == KILL_AFTER
    assert results["resumed"]["num_generated"] == LIMIT - KILL_AFTER
    assert read_jsonl(out / "samples.jsonl") == read_jsonl(tmp_path / "ref" / "samples.jsonl")
    gen = {r["key"]: r["generated_ids"] for r in read_jsonl(gen_file)}
    assert gen == {r["key"]: r["generated_ids"] for r in read_jsonl(tmp_path / "ref" / "generations.jsonl")}
    assert (out / "summary.md").exists() and (out / "gsm8k_accuracy.png").exists()
    assert not (out / LOCK_FILE).exists() and not (tmp_path / "ref" / LOCK_FILE).exists()  # finished runs

    # acceptance: the killed part's requests count through their per-request counters, as uninterrupted
    acc, ref_acc = results["acceptance"], json.loads(json.dumps(ref["acceptance"]))
    assert acc["requests_without_stats"] == 0 and 0 < acc["accepted"] < acc["drafted"]
    assert acc == ref_acc
    for k in ("num_requests", "request_steps", "drafted_tokens", "accepted_drafts", "accepted_per_position",
              "num_accepted_hist", "acceptance_rate", "acceptance_length", "acceptance_per_position"):
        assert results["generation"][k] == ref["generation"][k], k

    # a resume with other eval settings than the stored generations' is refused before anything runs
    for changed in ("eval.num_fewshot=0", "eval.max_gen_toks=100"):
        with pytest.raises(UserError, match="cannot resume") as e:
            app.run(_cfg(*common, changed, f"out_dir={out}", "resume=true"))
        assert changed.split(".")[1].split("=")[0] in str(e.value)


def test_ctrl_c_exits_130_with_the_command_that_resumes(checkpoint, gsm8k_dir, tmp_path, monkeypatch):
    """Ctrl-C (SIGINT) during a run: no traceback, exit 130, an error line saying what is saved and a fix
    line with the exact command; that command finishes the run. Then a resume after the checkpoint's weights
    changed at the same path is refused (the fingerprint covers the weight files)."""
    common = [f"model.checkpoint={checkpoint}", f"eval.limit={LIMIT}", f"eval.data_dir={gsm8k_dir}",
              "eval.max_gen_toks=200"]
    out = tmp_path / "interrupted"
    code, stderr = _signal_mid_run(tmp_path, gsm8k_dir, out, signal.SIGINT, *common, f"hydra.run.dir={out}")
    assert code == 130, stderr
    assert "Traceback" not in stderr
    error, fix = stderr.strip().splitlines()[-2:]
    assert error == f"error: interrupted (Ctrl-C); {KILL_AFTER} finished generations are saved in {out}"
    command = shlex.join(["python", "run.py", *common, "resume=true", f"hydra.run.dir={out}"])
    assert fix == f"  fix: continue with: {command}"
    assert not (out / LOCK_FILE).exists()  # an interrupted run removes its lock file as it ends

    resumed = _run_py(tmp_path, gsm8k_dir, *shlex.split(command)[2:], timeout=600)  # a loaded CI machine
    assert resumed.returncode == 0, resumed.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["resumed"]["num_resumed"] == KILL_AFTER and results["gsm8k"]["n"] == LIMIT
    assert not (out / LOCK_FILE).exists()  # nor does a finished run keep it

    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir))
    monkeypatch.delenv("SCRIPTED_HANG_AFTER", raising=False)
    monkeypatch.setattr(app, "Engine", ScriptedEngine)
    weights = checkpoint / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place, same size
    try:
        with pytest.raises(UserError, match="cannot resume") as e:
            app.run(_cfg(*common, f"out_dir={out}", "resume=true"))
        assert "weights_sha256" in str(e.value)
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sigterm_exits_143_with_the_command_that_resumes(checkpoint, gsm8k_dir, tmp_path):
    """SIGTERM (kill, a scheduler's time limit) stops a run as Ctrl-C does: no traceback, exit 143 (128 +
    SIGTERM), an error line naming the signal and what is saved, a fix line with the exact resume command."""
    common = [f"model.checkpoint={checkpoint}", f"eval.limit={LIMIT}", f"eval.data_dir={gsm8k_dir}"]
    out = tmp_path / "terminated"
    code, stderr = _signal_mid_run(tmp_path, gsm8k_dir, out, signal.SIGTERM, *common, f"out_dir={out}")
    assert code == 143, stderr
    assert "Traceback" not in stderr
    error, fix = stderr.strip().splitlines()[-2:]
    assert error == f"error: stopped by SIGTERM; {KILL_AFTER} finished generations are saved in {out}"
    # out_dir= names the folder, so the command keeps it (no hydra.run.dir), and Hydra's files went there too
    command = shlex.join(["python", "run.py", *common, f"out_dir={out}", "resume=true"])
    assert fix == f"  fix: continue with: {command}"
    assert (out / ".hydra" / "config.yaml").is_file()
    assert not (tmp_path / "outputs").exists()  # no empty default run folder beside out_dir
