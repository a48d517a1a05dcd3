"""The GPU memory ledger that lets several pytest-xdist workers share one card (tests/gpu_memory.py), checked
on the CPU: reservations never exceed the capacity, a waiting worker gets its share once another releases,
a dead worker's entry is dropped, and the marker's argument is validated."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import gpu_memory
import pytest
from gpu_memory import GIB, Ledger, capacity_gib, declared_gib


def test_capacity_leaves_contexts_and_margin():
    # an 80 GB H100 shared by 8 workers: 79.2 GiB * 0.95 - 8 * 1 GiB
    assert capacity_gib(int(79.2 * GIB), 8) == pytest.approx(79.2 * 0.95 - 8)
    assert capacity_gib(int(139.8 * GIB), 8) > capacity_gib(int(79.2 * GIB), 8)
    assert capacity_gib(int(79.2 * GIB), 0) == capacity_gib(int(79.2 * GIB), 1)


def test_reservations_never_exceed_capacity(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json", capacity=10.0)
    assert ledger.try_reserve(os.getpid(), 6.0)
    other = os.getppid()  # a live process other than this one
    assert not ledger.try_reserve(other, 5.0)
    assert ledger.try_reserve(other, 4.0)
    ledger.set(os.getpid(), 0.5)  # the test ended: what this process still holds
    assert ledger.try_reserve(other, 9.5)
    assert not ledger.try_reserve(other, 9.6)
    with pytest.raises(TimeoutError, match="waited 0 s for 9.6 GiB"):
        ledger.reserve(other, 9.6, timeout_s=0.2, poll_s=0.05)


def test_dead_process_entry_is_dropped(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    ledger = Ledger(tmp_path / "ledger.json", capacity=10.0)
    ledger.set(proc.pid, 9.0)  # a worker that crashed while it held memory
    assert ledger.try_reserve(os.getpid(), 9.0)


def _hold(path, start, seconds):
    ledger = Ledger(path, capacity=10.0)
    assert ledger.try_reserve(os.getpid(), 8.0)
    start.set()
    time.sleep(seconds)
    ledger.set(os.getpid(), 0.0)


def test_waiting_worker_gets_memory_once_another_releases(tmp_path):
    path = tmp_path / "ledger.json"
    start = mp.get_context("spawn").Event()
    holder = mp.get_context("spawn").Process(target=_hold, args=(path, start, 1.0))
    holder.start()
    try:
        assert start.wait(60)
        waited = Ledger(path, capacity=10.0).reserve(os.getpid(), 5.0, timeout_s=60, poll_s=0.05)
    finally:
        holder.join(60)
    assert holder.exitcode == 0
    assert waited > 0.2  # it had to wait for the holder's release


@pytest.mark.parametrize("args, want", [((), gpu_memory.DEFAULT_GIB), ((12,), 12.0), ((2.5,), 2.5)])
def test_declared_gib(args, want):
    class Item:
        nodeid = "t"

        def get_closest_marker(self, name):
            return pytest.mark.gpu_memory(*args).mark if args else None

    assert declared_gib(Item()) == want


@pytest.mark.parametrize("args", [(0,), (-1,), ("8",), (1, 2)])
def test_declared_gib_refuses_bad_marker(args):
    class Item:
        nodeid = "tests/x.py::t"

        def get_closest_marker(self, name):
            return pytest.mark.gpu_memory(*args).mark

    with pytest.raises(ValueError, match="tests/x.py::t: @pytest.mark.gpu_memory takes one positive number"):
        declared_gib(Item())


def test_no_ledger_outside_xdist(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    assert gpu_memory.ledger_path() is None
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "abc")
    assert gpu_memory.ledger_path().name == "hybrid-eval-gpu-memory-abc.json"


def test_random_quantized_experts_chunks_the_draws():
    import torch

    calls = []

    def quantize(w):  # stands for nvfp4_quantize / block_fp8_quantize: per-expert outputs
        calls.append(w.shape[0])
        return w * 2, w.amax(dim=(1, 2))

    gen = torch.Generator().manual_seed(0)
    q, amax = gpu_memory.random_quantized_experts(quantize, 5, 3, 16, gen, chunk=2)
    assert calls == [2, 2, 1]
    gen.manual_seed(0)
    want = torch.cat([torch.randn(n, 3, 16, generator=gen) for n in (2, 2, 1)]) / 4
    assert torch.equal(q, want * 2) and torch.equal(amax, want.amax(dim=(1, 2)))


def test_a_failed_tests_frames_are_released():
    import sys
    import weakref

    class Big:
        pass

    def fail():
        big = Big()  # noqa: F841 - held by the frame of the traceback below
        raise RuntimeError

    try:
        fail()
    except RuntimeError as e:
        sys.last_value, sys.last_traceback = e, e.__traceback__
    ref = weakref.ref(sys.last_traceback.tb_next.tb_frame.f_locals["big"])
    assert ref() is not None
    gpu_memory.release_failure_frames()
    assert ref() is None and sys.last_traceback is None
