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
]


def _run_py(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("LLM_MODELS_ROOT", "HYBRID_EVAL_HISTORY")},
           **(env or {})}
    return subprocess.run([sys.executable, "-X", "importtime", str(REPO_ROOT / "run.py"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def _imported(stderr: str) -> set[str]:
    """Modules of a `-X importtime` log (its lines `import time: <self> | <cumulative> | <module>`)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


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
    loaded = _imported(proc.stderr)
    assert "runners.app.preflight" in loaded  # the log is read right: the check's own module is in it
    assert not {m.split(".")[0] for m in loaded} & set(HEAVY), sorted(m for m in loaded
                                                                    if m.split(".")[0] in HEAVY)
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
    it was when a later command into it is refused: a settings error, resume=true with other settings, and
    while a live run holds it ("in use"). Hydra writes no .hydra/ at job start (hydra.output_subdir: null);
    run.py writes it once the run holds its folder and every check passed."""
    folder = tmp_path / "run"
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text(f"# the finished run's {name}\n")
    (folder / "generations.jsonl").write_text('{"key": "k", "text": "t"}\n')
    (folder / "generations.meta.json").write_text('{"fingerprint": {"entry": "another"}}\n')
    (folder / "results.json").write_text("{}\n")
    before = _tree(folder)
    for args, error in ((["eval.limit=-1"], "error: eval.limit must be >= 1"),
                        (["resume=true", "eval.limit=4"], f"error: cannot resume the run in {folder}")):
        proc = _run_py(f"hydra.run.dir={folder}", "history.db=null", *args, cwd=tmp_path)
        assert proc.returncode == 2 and error in proc.stderr, proc.stderr[-3000:]
        assert _tree(folder) == before, args
    claim = claim_out_dir(folder)  # a live run holds it
    try:
        proc = _run_py(f"hydra.run.dir={folder}", "history.db=null", "eval.limit=4", cwd=tmp_path)
    finally:
        claim.release()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is in use by a run that is still going" in proc.stderr, proc.stderr[-3000:]
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
