"""Shared pytest fixtures and the `gpu` marker's skip rule.

Tests run from the repository root (pyproject sets pythonpath = ["."]); nothing is installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evals.tasks.gsm8k import gsm8k_dir as _gsm8k_dir

# GSM8K: $GSM8K_DIR, else ../shared/data/gsm8k beside the checkout (never copied into the repository).
GSM8K_DIR, _GSM8K_ORIGIN = _gsm8k_dir()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _has_cuda_driver() -> bool:
    # Decided before torch or triton is imported (importing torch here would be slow for every test run).
    return any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version"))


# Without a GPU, Triton kernels run in its interpreter; the switch is read when triton is first imported, so
# it is set here, before any test module imports a kernel (test modules also set it; import order varies).
if not _has_cuda_driver():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # The tests' models are tiny: one intra-op thread avoids OpenMP spin on the shared 2-core CI machine
    # (configs/runtime/cpu.yaml makes the same choice for runs).
    import torch

    torch.set_num_threads(1)
    # transformers (the oracle) beside a PyPI `kernels` it would import: stop with the fix, not with dozens of
    # "cannot import name ... from 'kernels'" errors
    from runners.tools.tiny import TRANSFORMERS_CLASH_FIX, transformers_clash

    problem = transformers_clash()
    if problem:
        raise pytest.UsageError(f"{problem}\n  fix: {TRANSFORMERS_CLASH_FIX}")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is an install error reported elsewhere
        return False


# The GPU stage (tests/gpu/run_checks.sh engine) runs under pytest-xdist, which hands tests to its workers in
# collection order: these, minutes each on the H200 (docs/gpu/robust_3's --durations), go first so that none
# starts last and leaves the other workers idle.
GPU_LONG_FIRST = ("tests/test_tp.py", "tests/test_formats.py", "tests/test_compile.py",
                  "tests/test_prefill_kernels_gpu.py", "tests/test_prefix_cache.py")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        if config.getoption("markexpr", "") == "gpu":
            def rank(item):
                path = item.nodeid.split("::")[0]
                return GPU_LONG_FIRST.index(path) if path in GPU_LONG_FIRST else len(GPU_LONG_FIRST)
            items.sort(key=rank)  # stable: the order within each module is kept
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_GPU_MEMORY = pytest.StashKey()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A `gpu` test on CUDA first reserves the GPU memory it declares (tests/gpu_memory.py), before any of its
    fixtures allocate; it may wait for other workers' tests, or skip when the card is too small for it."""
    if "gpu" in item.keywords and _cuda_available():
        import gpu_memory

        hold = gpu_memory.reservation(item)
        hold.__enter__()  # may skip the test
        item.stash[_GPU_MEMORY] = hold


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # after every finalizer, module fixtures' included: what they freed goes back to the ledger
    hold = item.stash.get(_GPU_MEMORY, None)
    if hold is not None:
        hold.__exit__(None, None, None)


def pytest_runtest_logreport(report):
    """$PYTEST_FAILURE_LOG (the device scripts set it): each failing phase's traceback appended to that file
    as it happens, so a run cut at its time limit keeps the reasons pytest would only print at the end.
    Under xdist the controller writes it (a worker's report reaches it too), once per failure."""
    path = os.environ.get("PYTEST_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(scope="session", autouse=True)
def _transformers_qwen3_next_torch_path():
    """transformers' Qwen3-Next (the test oracle) calls fla-core's kernels whenever fla imports, also with CPU
    tensors, where they cannot run. Where fla-core is installed (the `gpu` extra), pin the oracle to its own
    PyTorch path (the function its kernel decorator wraps)."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        yield
        return
    import inspect

    from transformers.models.qwen3_next import modeling_qwen3_next as hf_q

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = {name: getattr(hf_q, name) for name in names}
    for name, fn in saved.items():
        setattr(hf_q, name, inspect.unwrap(fn))
    yield
    for name, fn in saved.items():
        setattr(hf_q, name, fn)


@pytest.fixture(autouse=True, scope="session")
def _throwaway_history_db(tmp_path_factory) -> None:
    """Runs made by tests (in process or through run.py) record into a throwaway history database, never
    into the one $HYBRID_EVAL_HISTORY names or outputs/history.db of the checkout."""
    os.environ["HYBRID_EVAL_HISTORY"] = str(tmp_path_factory.mktemp("history") / "history.db")


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    if GSM8K_DIR is None or not (GSM8K_DIR / "test.jsonl").exists():
        pytest.fail(
            f"GSM8K data not found ({GSM8K_DIR}, from {_GSM8K_ORIGIN}); set GSM8K_DIR or place ../shared "
            "beside the checkout"
        )
    return GSM8K_DIR
