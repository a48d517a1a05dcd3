"""A settings mistake is refused before anything heavy is imported, and a refused run leaves nothing behind.

Each case runs `python -X importtime run.py <bad setting>` in a fresh process from an empty folder: the
refusal must be the project's two lines with exit status 2, the import log must hold none of torch, lm-eval,
datasets, transformers and triton (runners.app.preflight runs before runners.app.main is imported), and the
folder must be empty again afterwards (no outputs/<entry>/, no .hydra/). `--cfg job` of the nightly sweep,
which runs nothing, must create nothing either. A folder that existed stays byte for byte as it was (Hydra's
.hydra/ files are written only once a run is accepted), and Ctrl-C before that leaves nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evals.outdir import claim_out_dir
from registry.schema import REPO_ROOT

HEAVY = ("torch", "lm_eval", "datasets", "transformers", "triton")
# lm-eval's few-shot sampler (pure Python; lm-eval's package __init__ imports nothing heavy): the preflight
# draws the prompts of lm-eval's gsm8k task with it (evals.tasks.gsm8k.gsm8k_prompts)
LM_EVAL_SAMPLER = {"lm_eval", "lm_eval.api", "lm_eval.api.samplers"}

# (overrides, the start of the error line): settings errors that need no model
REFUSALS = [
    (["eval.limit=-1"], "error: eval.limit must be >= 1 or null, got -1"),
    (["draft_len=-1"], "error: draft_len must be >= 0 or null, got -1"),
    (["runtime=gpu"], "error: runtime.device is cuda but CUDA is not available here"),
    (["model.checkpoint=/nonexistent"], "error: checkpoint directory /nonexistent does not exist"),
    (["model=super_v3_mtp"], "error: entry super_v3_mtp needs models_root"),
    (["eval.max_gen_toks=0"], "error: eval.max_gen_toks=0 must be >= 1"),
    (["ssm_replay=true", "draft_len=0"], "error: ssm_replay requires speculative decoding"),
    (["eval.max_gen_toks=5000"], "error: eval.max_gen_toks=5000 leaves no room for a prompt"),
    (["draft_len=7"], "error: no acceptance reference for 'tiny_nemotron_h_mtp'"),
    (["eval=gsm8k_cot", "eval.num_fewshot=9"],
     "error: eval.num_fewshot=9 is more than the 8 exemplars gsm8k_cot has"),
    (["eval.num_fewshot=20", "eval.limit=2"], "error: eval.num_fewshot=20 makes a prompt too long: the "
     "prompt of test question 0 has 4296 tokens, and with eval.max_gen_toks=256 and draft_len=3 it needs "
     "4555 positions, more than model.max_seq_len=4096"),
]


def _run_py(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("LLM_MODELS_ROOT", "HYBRID_EVAL_HISTORY")},
           **(env or {})}
    return subprocess.run([sys.executable, "-X", "importtime", str(REPO_ROOT / "run.py"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def _imported(stderr: str) -> set[str]:
    """Modules of a `-X importtime` log (its lines `import time: <self> | <cumulative> | <module>`)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _heavy(proc: subprocess.CompletedProcess) -> list[str]:
    """The heavy modules a `-X importtime` run loaded (lm-eval's pure-Python sampler aside)."""
    loaded = _imported(proc.stderr)
    assert "runners.app.preflight" in loaded  # the log is read right: the check's own module is in it
    return sorted(m for m in loaded - LM_EVAL_SAMPLER if m.split(".")[0] in HEAVY)


def _cuda_here() -> bool:
    from runners.app.support import cuda_available

    return cuda_available()


@pytest.mark.parametrize("overrides, error", REFUSALS, ids=[" ".join(o) for o, _ in REFUSALS])
def test_settings_errors_are_refused_before_heavy_imports_and_leave_nothing(tmp_path, overrides, error):
    if overrides == ["runtime=gpu"] and _cuda_here():
        pytest.skip("CUDA is available here: runtime=gpu is no mistake")
    proc = _run_py(*overrides, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    # error / fix (a missing baseline row lists the file's rows between them)
    assert lines[0].startswith(error) and lines[-1].startswith("  fix: "), lines
    assert not any("Traceback" in line or line.startswith("  fix: ") for line in lines[:-1]), lines
    assert not _heavy(proc), _heavy(proc)
    assert list(tmp_path.iterdir()) == []  # no outputs/<entry>/<time>/, no empty outputs/<entry>/


def test_a_refused_run_keeps_a_folder_that_existed_and_drops_one_it_created(tmp_path):
    """out_dir= naming a folder that exists: it stays as it was (no .hydra/ is written into it); one that did
    not exist goes with the parents created for it."""
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine\n")
    for out_dir in ("existing", "new/deeper"):
        proc = _run_py(f"out_dir={tmp_path / out_dir}", "eval.limit=-1", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["existing",
                                                                                 "existing/notes.txt"]



def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


def test_a_refused_run_changes_nothing_in_a_folder_that_existed(tmp_path):
    """A finished run's folder (Hydra's three files, generations and their fingerprint) stays byte for byte as
    it was when a later command into it is refused: a settings error, a new run into it without resume,
    resume=true with other settings, and while a live run holds it ("in use"). Hydra writes no .hydra/ at
    job start (hydra.output_subdir: null); run.py writes it once the run holds its folder and every check
    passed. The folder's refusals, too, come before torch and lm-eval are imported (runners.app.rundir)."""
    folder = tmp_path / "run"
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text(f"# the finished run's {name}\n")
    (folder / "generations.jsonl").write_text('{"key": "k", "text": "t"}\n')
    (folder / "generations.meta.json").write_text('{"fingerprint": {"entry": "another"}}\n')
    (folder / "results.json").write_text("{}\n")
    before = _tree(folder)
    for args, error in ((["eval.limit=-1"], "error: eval.limit must be >= 1"),
                        (["eval.limit=4"], f"error: {folder} already holds generations of an earlier run"),
                        (["resume=true", "eval.limit=4"], f"error: cannot resume the run in {folder}")):
        proc = _run_py(f"hydra.run.dir={folder}", "history.db=null", *args, cwd=tmp_path)
        assert proc.returncode == 2 and error in proc.stderr, proc.stderr[-3000:]
        assert not _heavy(proc), (args, _heavy(proc))
        assert _tree(folder) == before, args
    claim = claim_out_dir(folder)  # a live run holds it
    try:
        proc = _run_py(f"hydra.run.dir={folder}", "history.db=null", "eval.limit=4", cwd=tmp_path)
    finally:
        claim.release()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is in use by a run that is still going" in proc.stderr, proc.stderr[-3000:]
    assert not _heavy(proc), _heavy(proc)
    assert _tree(folder) == before


@pytest.mark.parametrize("module, function", [("runners.app.preflight", "check_run"),
                                              ("runners.app.main", "_build_engine")])
def test_ctrl_c_before_anything_is_kept_leaves_nothing(tmp_path, module, function):
    """Ctrl-C while the settings are checked, or after the run was accepted but before any generation
    (raised there through a sitecustomize): exit 130, the two lines, and no outputs/<entry>/<time>/ (nor its
    .hydra/) left behind."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import {module} as target\n"
        "def interrupted(*args, **kwargs):\n"
        "    raise KeyboardInterrupt\n"
        f"target.{function} = interrupted\n")
    work = tmp_path / "work"
    work.mkdir()
    proc = _run_py("eval.limit=4", "history.db=null", cwd=work,
                   env={"PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)])})
    assert proc.returncode == 130, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert lines == ["error: interrupted (Ctrl-C) before the run wrote anything", "  fix: rerun the command"]
    assert list(work.iterdir()) == []


def test_the_prompts_checked_before_loading_are_lm_evals(gsm8k_dir):
    """evals.tasks.gsm8k.gsm8k_prompts rebuilds, without lm-eval's task machinery, exactly the contexts
    lm-eval's gsm8k task builds for the run (its seeded few-shot draw, one per question in order), so the
    preflight's token counts are the engine's."""
    import lm_eval
    from lm_eval.api.model import LM

    from evals.evaluate import load_task
    from evals.tasks.gsm8k import FEWSHOT_SEED, gsm8k_prompts

    class Contexts(LM):
        def __init__(self):
            super().__init__()
            self.contexts = []

        def generate_until(self, requests, disable_tqdm=False):
            self.contexts += [r.args[0] for r in requests]
            return ["" for _ in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    for num_fewshot, limit in ((5, 3), (20, 2), (0, 2)):
        task, manager, _ = load_task(gsm8k_dir)
        lm = Contexts()
        lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, num_fewshot=num_fewshot,
                                limit=limit, bootstrap_iters=0, fewshot_random_seed=FEWSHOT_SEED)
        assert lm.contexts == gsm8k_prompts(gsm8k_dir, num_fewshot, limit), (num_fewshot, limit)


def test_the_largest_few_shot_count_named_fits(gsm8k_dir):
    """The count the fix line names fits every prompt of the run (the next one up did not), and the token
    count of the error is the prompt's as the engine's tokenizer encodes it."""
    import re

    from tokenizers import Tokenizer

    from evals.tasks.gsm8k import check_prompt_room, gsm8k_prompts
    from registry.errors import UserError

    tokenizer = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp" / "tokenizer.json"
    check = {"draft_len": 3, "limit": 3, "exact": True}
    with pytest.raises(UserError) as e:
        check_prompt_room(tokenizer, gsm8k_dir, 20, 256, 4096, **check)
    tokens = len(Tokenizer.from_file(str(tokenizer)).encode(gsm8k_prompts(gsm8k_dir, 20, 3)[0]).ids)
    assert f"the prompt of test question 0 has {tokens} tokens" in e.value.problem, e.value.problem
    fits = int(re.search(r"^lower eval.num_fewshot to (\d+) ", e.value.fix)[1])
    assert "eval.max_gen_toks" in e.value.fix and "model.max_seq_len" in e.value.fix
    check_prompt_room(tokenizer, gsm8k_dir, fits, 256, 4096, **check)
    with pytest.raises(UserError, match=f"^eval.num_fewshot={fits + 1} makes a prompt too long"):
        check_prompt_room(tokenizer, gsm8k_dir, fits + 1, 256, 4096, **check)
    with pytest.raises(UserError, match="too long even without few-shot examples") as e:  # the question alone
        check_prompt_room(tokenizer, gsm8k_dir, 0, 8, 24, limit=3, exact=True)
    assert e.value.fix == "lower eval.max_gen_toks or raise model.max_seq_len (no few-shot count fits)"


def test_more_shots_than_train_examples_are_refused_before_loading(gsm8k_dir, tmp_path):
    """A train split shorter than eval.num_fewshot (a cut copy): lm-eval's draw would fail deep inside the
    evaluation; the check before loading names the file and the most it allows."""
    from evals.tasks.gsm8k import check_prompt_room
    from registry.errors import UserError

    tokenizer = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp" / "tokenizer.json"
    for split, n in (("train", 3), ("test", 2)):
        lines = (gsm8k_dir / f"{split}.jsonl").read_text().splitlines(keepends=True)
        (tmp_path / f"{split}.jsonl").write_text("".join(lines[:n]))
    check_prompt_room(tokenizer, tmp_path, 3, 256, 4096, exact=True)
    with pytest.raises(UserError) as e:
        check_prompt_room(tokenizer, tmp_path, 5, 256, 4096, exact=True)
    train = tmp_path / "train.jsonl"
    assert e.value.problem.startswith(f"eval.num_fewshot=5 is more than the 3 examples of {train}")
    assert e.value.fix.startswith("lower eval.num_fewshot to at most 3")


def test_a_run_of_another_protocol_is_warned_before_loading(capsys):
    """eval.num_fewshot / eval.max_gen_toks other than the baselines' protocol: the run goes on (its figures
    are reported, not judged), and the check before loading says so once per baselines file, naming the
    setting and what would be judged; the default protocol prints nothing."""
    from registry.compose import compose_config
    from registry.errors import UserError
    from registry.resolve import resolve
    from runners.app.preflight import check_references

    check_references(resolve(compose_config([])))
    assert "warning" not in capsys.readouterr().out
    for extra in ([], ["verdict.require_reference=false"]):  # the warning does not depend on the flag
        check_references(resolve(compose_config(["eval.num_fewshot=0", "eval.max_gen_toks=64", *extra])))
        assert capsys.readouterr().out.splitlines() == [
            "warning: the tiny_nemotron_h_mtp references in registry/baselines/gsm8k.yaml and "
            "registry/baselines/acceptance.yaml were measured 5-shot with at most 256 generated tokens and "
            "this run sets eval.num_fewshot=0, eval.max_gen_toks=64: another benchmark, so its figures are "
            "reported, not judged (set eval.num_fewshot=5 eval.max_gen_toks=256 to judge them)"]
    # references of another protocol judge nothing: a draft length without an acceptance row is no refusal
    with pytest.raises(UserError, match="no acceptance reference"):
        check_references(resolve(compose_config(["draft_len=2"])))
    check_references(resolve(compose_config(["draft_len=2", "eval.num_fewshot=0"])))
    assert "acceptance.yaml were measured 5-shot" in capsys.readouterr().out
