"""`python -m registry pr-check` (registry/pr_check.py) in a throwaway clone of this checkout: what a change
touches, validation, the smoke evaluation, the missing base ref; and the template entry."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from registry import pr_check
from registry.schema import MODEL_DIR, REPO_ROOT, entry_names, validate_entry

GIT_ID = ["-c", "user.name=pr-check test", "-c", "user.email=pr-check@example.invalid"]


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *GIT_ID, *args], cwd=repo, check=True, capture_output=True, text=True)
    return proc.stdout


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Path:
    """A git repository holding this checkout's files (tracked and new, not ignored) as one commit on main."""
    root = tmp_path_factory.mktemp("upstream")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for rel in files:
        src = REPO_ROOT / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "base")
    return root


@pytest.fixture
def clone(upstream, tmp_path) -> Path:
    """A clone as CI has it: HEAD on main, origin/main the base."""
    subprocess.run(["git", "clone", "-q", str(upstream), str(tmp_path / "clone")], check=True)
    return tmp_path / "clone"


def _pr_check(repo: Path, gsm8k_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GSM8K_DIR": str(gsm8k_dir)}
    return subprocess.run([sys.executable, "-m", "registry", "pr-check", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def test_without_base_ref_or_change_nothing_is_checked(clone, gsm8k_dir):
    proc = _pr_check(clone, gsm8k_dir, "--base", "origin/no-such-branch")  # a typo: a bad invocation
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error, fix = proc.stderr.strip().splitlines()
    assert error == ("error: the base ref 'origin/no-such-branch' names no commit in this clone (or this is "
                     "no git clone)")
    assert fix.startswith("  fix: fetch it") and "--base <ref>" in fix
    proc = _pr_check(clone, gsm8k_dir, "--if-base-exists", "--base", "origin/no-such-branch")  # as CI runs it
    assert proc.returncode == 0 and "no base ref 'origin/no-such-branch'" in proc.stdout
    assert "nothing checked" in proc.stdout
    proc = _pr_check(clone, gsm8k_dir)  # default --base origin/main: the clone is main itself
    assert proc.returncode == 0 and "no file under registry/ changed: nothing to check" in proc.stdout


def test_a_new_entry_is_validated_with_its_baseline_rows(clone, gsm8k_dir):
    """An entry from the template plus its GSM8K row, but no acceptance row: the validation fails and names
    it; with the acceptance row added (and committed) the check passes. Nothing embedded: no smoke run."""
    model_dir = clone / "registry" / "model"
    shutil.copy(model_dir / "_template.yaml.example", model_dir / "my_model_mtp.yaml")
    gsm8k = clone / "registry" / "baselines" / "gsm8k.yaml"
    gsm8k.write_text(gsm8k.read_text().rstrip() + "\n\n  my_model:\n    description: test\n    source: test\n"
                     "    rows:\n      - {dtype: bfloat16, quant: none, kv_cache_quant: none, spec_dec: mtp, "
                     "accuracy: 50.0, num_samples: 1319}\n")
    proc = _pr_check(clone, gsm8k_dir)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "A registry/model/my_model_mtp.yaml" in out and "M registry/baselines/gsm8k.yaml" in out
    assert "baseline gsm8k.yaml 'my_model': new model key, 1 rows" in out
    assert "entry my_model_mtp: changed" in out
    assert "== python -m registry validate (every entry)" in out  # a baseline file changed
    assert "FAIL  my_model_mtp" in out and "no acceptance baselines for model key 'my_model'" in out
    assert "pr-check: FAILED (validate)" in out
    acceptance = clone / "registry" / "baselines" / "acceptance.yaml"
    acceptance.write_text(acceptance.read_text().rstrip() + "\n  my_model:\n    description: test\n"
                          "    rows:\n      - {quant: none, draft_len: 3, acceptance_rate_floor: 0.45}\n")
    _git(clone, "add", "-A")
    _git(clone, "commit", "-qm", "add my_model_mtp")
    proc = _pr_check(clone, gsm8k_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "baseline acceptance.yaml 'my_model': new model key, 1 rows" in proc.stdout
    assert "pr-check: ok" in proc.stdout and "smoke" not in proc.stdout


def test_a_changed_base_touches_its_variants_and_a_deleted_base_breaks_them(clone, gsm8k_dir):
    _edit(clone / "registry" / "model" / "super_v3_mtp.yaml", "max_seq_len: 4096", "max_seq_len: 8192")
    proc = _pr_check(clone, gsm8k_dir, "--no-smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "entry super_v3_mtp: changed" in proc.stdout
    assert "entry super_v3_mtp_ws4: variant of super_v3_mtp" in proc.stdout
    assert "entry super_v3_mtp_fp8: variant of super_v3_mtp" in proc.stdout
    variants = sorted(path.stem for path in (clone / "registry" / "model").glob("super_v3_mtp*.yaml"))
    assert len(variants) >= 4  # the base, fp8, nvfp4 and world-size entries
    assert f"== python -m registry validate ({', '.join(variants)})" in proc.stdout
    (clone / "registry" / "model" / "qwen3_next_mtp.yaml").unlink()
    proc = _pr_check(clone, gsm8k_dir, "--no-smoke")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "removed entry: qwen3_next_mtp" in proc.stdout
    assert "entry qwen3_next_mtp_ws4: variant of qwen3_next_mtp" in proc.stdout
    assert "FAIL  qwen3_next_mtp_ws4" in proc.stdout


def test_an_embedded_entry_gets_a_smoke_evaluation(clone, gsm8k_dir):
    _edit(clone / "registry" / "model" / "tiny_qwen3_next_mtp.yaml", "max_seq_len: 4096",
          "max_seq_len: 2048")  # a valid change (max_batch_size is tied to cuda_graph_batch_sizes)
    proc = _pr_check(clone, gsm8k_dir)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "== smoke evaluation of tiny_qwen3_next_mtp (embedded), 2 GSM8K questions on the CPU" in out
    assert "model=tiny_qwen3_next_mtp eval.limit=2 runtime=cpu" in out and "compare=replay  (exit 0)" in out
    assert "== smoke evaluation of tiny_qwen3_next_mtp_fp8 (embedded)" in out  # its variant, with it
    assert "(n=2)" in out and "replay == rewind" in out and "pr-check: ok (2 entries checked)" in out


def test_a_smoke_run_that_does_not_complete_fails(tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\necho 'error: the checkpoint is broken' >&2\n"
                    "echo '  fix: rebuild it' >&2\nexit 2\n")
    fake.chmod(0o755)
    res = pr_check.smoke("tiny_nemotron_h_mtp", tmp_path, python=str(fake))
    assert not res.ok and "(exit 2)" in res.lines[0]
    assert "  | error: the checkpoint is broken" in res.lines and "  |   fix: rebuild it" in res.lines


def test_template_is_a_valid_entry_but_not_listed(clone, gsm8k_dir):
    raw = yaml.safe_load((MODEL_DIR / "_template.yaml.example").read_text())
    entry = validate_entry(raw, name=raw["name"])
    assert entry.name == "my_model_mtp" and entry.nightly is False and entry.arch is not None
    assert "_template" not in entry_names() and not any(n.startswith("_") for n in entry_names())
    _edit(clone / "registry" / "model" / "_template.yaml.example", "max_seq_len: 4096",
          "max_seq_length: 4096")
    proc = _pr_check(clone, gsm8k_dir)
    assert proc.returncode == 1 and "FAIL template registry/model/_template.yaml.example" in proc.stdout
    assert "unknown key 'max_seq_length'" in proc.stdout


def test_baseline_changes_per_model_key(clone):
    path = "registry/baselines/acceptance.yaml"
    _edit(clone / path, "acceptance_rate_floor: 0.42, acceptance_length: {reference: 2.587",
          "acceptance_rate_floor: 0.40, acceptance_length: {reference: 2.587")  # the float32 row only
    _edit(clone / path, "description: tiny Qwen3-Next with an MTP module", "description: the tiny Qwen3-Next")
    head = _git(clone, "rev-parse", "HEAD").strip()
    assert pr_check.baseline_changes(path, head, clone) == {
        "tiny_nemotron_h_mtp": "1 rows added or changed, 1 rows removed or changed",
        "tiny_qwen3_next_mtp": "description / source / metric changed"}


@pytest.mark.parametrize("text, problem", [
    ("name: broken\nfamily: [unclosed\n", "not valid YAML"),
    ("name: evil\nhf_id: !!python/object/apply:os.system [echo hi]\n", "python/object/apply:os.system"),
])
def test_an_unreadable_entry_fails_validation_without_a_traceback(clone, gsm8k_dir, text, problem):
    """An entry that is not valid YAML, or carries a !!python/... tag: pr-check reports it as the entry's
    validation failure (it crashed in registry/selection.py with a yaml traceback)."""
    (clone / "registry" / "model" / "broken.yaml").write_text(text)
    proc = _pr_check(clone, gsm8k_dir)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert "FAIL  broken" in proc.stdout and problem in proc.stdout, out
