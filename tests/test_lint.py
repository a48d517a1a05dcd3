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
