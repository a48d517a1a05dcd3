"""tests/conftest.py's $PYTEST_FAILURE_LOG: a failing test's traceback written as it fails (the device scripts
read it when a run is cut at its time limit), once per failure, also under xdist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_failure_is_logged_once_as_it_happens(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_fails():\n    assert 1 == 2, 'boom'\n\n"
                                          "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    env = {**os.environ, "PYTEST_FAILURE_LOG": str(log), "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "-n", "2", "--rootdir", str(tmp_path), "-c", os.devnull,
                           str(tmp_path / "test_two.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = log.read_text()
    assert text.count("==== test_two.py::test_fails (call)") == 1, text
    assert "AssertionError: boom" in text and "test_passes" not in text
