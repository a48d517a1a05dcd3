"""The repository passes `ruff check` (configured in pyproject.toml), so lint failures show up in CI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install '.[test]'")
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_suites_temporary_folders_are_removed_when_it_passes(tmp_path):
    """pyproject's pytest settings delete a passing run's temporary folders (the suite writes ~1.3 GB of
    checkpoints and run folders there) and keep a failed test's: checked on a two-test session run with
    them."""
    import os
    import sys

    (tmp_path / "test_t.py").write_text(
        "def test_pass(tmp_path):\n    (tmp_path / 'big').write_bytes(bytes(1 << 20))\n\n"
        "def test_fail(tmp_path):\n    (tmp_path / 'kept').write_text('x')\n    assert False\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           "-c", str(root / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_t.py")]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "TMPDIR": str(temp)}, capture_output=True,
                          text=True, timeout=120)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    left = sorted(p.name for p in temp.rglob("*") if p.is_file())
    assert left == ["kept"], left


SOURCE_DIRS = ("runners", "evals", "registry", "kernels")


def _source_files() -> list[Path]:
    return [REPO_ROOT / "run.py", *(p for d in SOURCE_DIRS for p in sorted((REPO_ROOT / d).rglob("*.py")))]


def test_source_does_not_cite_measurement_runs():
    """Code says the decision; the history of measurements (docs/gpu/<run>/) lives in docs/. A run folder's
    name (``kperf_7``, ``fulldepth_5`` ...) in a source file is a citation that belongs in docs/."""
    import re

    runs = sorted(p.name for p in (REPO_ROOT / "docs/gpu").iterdir() if p.is_dir())
    assert "kperf_7" in runs  # the run folders this check knows
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, runs)) + r")\b")
    found = [f"{p.relative_to(REPO_ROOT)}:{i}: {m.group(0)}" for p in _source_files()
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in [pattern.search(line)] if m]
    assert not found, "\n".join(found)
