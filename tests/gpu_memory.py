"""GPU memory reservations for `gpu`-marked tests that share one card under pytest-xdist.

The GPU stage (tests/gpu/run_checks.sh engine) runs several xdist workers on one GPU. Each test declares the
device memory it needs with ``@pytest.mark.gpu_memory(GiB)`` (unmarked `gpu` tests take
:data:`DEFAULT_GIB`); before it starts, its worker reserves that much in a ledger that every worker of the
run shares (a JSON file under an ``fcntl`` lock), and waits while the reservations of the other workers
leave too little of the card. So the tests that run at once never need more than the card has, whatever its
size: an 80 GB H100 runs fewer of them side by side than a 141 GB H200, and a test that needs more than the
card holds is skipped, saying so.

A worker's ledger entry is what its PyTorch caching allocator still holds (``torch.cuda.memory_reserved``
after ``empty_cache``: a module's cached tensors, say) plus the declared need of the test it is running;
each test ends with ``empty_cache`` so that memory a worker no longer uses goes back to the others.
Memory that processes a test starts (tensor-parallel ranks, run.py) use is covered by the test's declared
need alone.

With ``HYBRID_EVAL_GPU_MEM_LOG=FILE`` each gpu test appends one JSON line to FILE: its declared need and the
peak its process reserved above what it held at the start (``torch.cuda.max_memory_reserved``), the numbers
from which the markers are set.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

GIB = 2**30
# The need of a gpu test that declares none (GiB): the tiny entries' engines and kernel tests at the
# released mixer shapes stay below it.
DEFAULT_GIB = 4.0
# What the card keeps apart from the ledger: each worker's CUDA context and the libraries' workspaces (cuBLAS,
# Triton), which the caching allocator does not count, and a margin for fragmentation.
CONTEXT_GIB_PER_WORKER = 1.0
MARGIN_FRACTION = 0.05
# How long a test waits for memory before it fails (s): longer than the longest gpu test;
# $HYBRID_EVAL_GPU_MEM_WAIT_S overrides it.
WAIT_TIMEOUT_S = float(os.environ.get("HYBRID_EVAL_GPU_MEM_WAIT_S", 900))
POLL_S = 0.5


def declared_gib(item) -> float:
    """The need a test declares (GiB): its ``gpu_memory`` marker's argument, else :data:`DEFAULT_GIB`.

    Raises:
        ValueError: the marker has no positive number as its one argument.
    """
    mark = item.get_closest_marker("gpu_memory")
    if mark is None:
        return DEFAULT_GIB
    if len(mark.args) != 1 or not isinstance(mark.args[0], int | float) or mark.args[0] <= 0:
        raise ValueError(f"{item.nodeid}: @pytest.mark.gpu_memory takes one positive number of GiB, "
                         f"got {mark.args!r}")
    return float(mark.args[0])


def capacity_gib(total_bytes: int, workers: int) -> float:
    """GiB the ledger may hand out on a card of ``total_bytes`` shared by ``workers`` processes: the total
    less :data:`MARGIN_FRACTION` and each worker's :data:`CONTEXT_GIB_PER_WORKER`."""
    return total_bytes / GIB * (1 - MARGIN_FRACTION) - CONTEXT_GIB_PER_WORKER * max(1, workers)


class Ledger:
    """The reservations of the workers of one test run, in ``path`` (JSON: {pid: GiB}) under ``path``.lock.

    Entries of processes that no longer exist are dropped when the ledger is read, so a worker that crashed
    frees its share.
    """

    def __init__(self, path: Path, capacity: float):
        self.path = Path(path)
        self.capacity = capacity
        self._lock = self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def _locked(self):
        with open(self._lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                entries = json.loads(self.path.read_text()) if self.path.exists() else {}
                entries = {pid: gib for pid, gib in entries.items() if _alive(int(pid))}
                yield entries
                self.path.write_text(json.dumps(entries))
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def try_reserve(self, pid: int, gib: float) -> bool:
        """Set ``pid``'s entry to ``gib`` if the other entries leave room for it; whether it was set."""
        with self._locked() as entries:
            others = sum(g for p, g in entries.items() if p != str(pid))
            if others + gib > self.capacity:
                return False
            entries[str(pid)] = gib
            return True

    def set(self, pid: int, gib: float) -> None:
        """Set ``pid``'s entry to ``gib`` unconditionally: what the process still holds after a test."""
        with self._locked() as entries:
            entries[str(pid)] = gib

    def reserve(self, pid: int, gib: float, timeout_s: float = WAIT_TIMEOUT_S,
                poll_s: float = POLL_S) -> float:
        """Wait until ``gib`` fits beside the other entries and reserve it; the seconds waited.

        Raises:
            TimeoutError: it did not fit within ``timeout_s``.
        """
        t0 = time.monotonic()
        while not self.try_reserve(pid, gib):
            if time.monotonic() - t0 > timeout_s:
                with self._locked() as entries:
                    held = dict(entries)
                raise TimeoutError(f"waited {timeout_s:.0f} s for {gib:.1f} GiB of GPU memory (ledger "
                                   f"capacity {self.capacity:.1f} GiB, held by pid: {held})")
            time.sleep(poll_s)
        return time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ledger_path() -> Path | None:
    """The ledger's file for this xdist run (shared by its workers), or None outside pytest-xdist, where
    tests run one at a time and need no ledger."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"hybrid-eval-gpu-memory-{run}.json"


def release_failure_frames() -> None:
    """Drop the last failure's traceback, which pytest keeps in ``sys.last_*`` for post-mortem debugging: its
    frames hold the failed test's tensors, which would stay allocated in this worker for the rest of the
    run."""
    import gc
    import sys

    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


@contextmanager
def reservation(item):
    """Hold ``item``'s declared GPU memory for the test's duration (see the module docstring).

    Skips the test (pytest.skip) when its need exceeds what the card can hand out at all.
    """
    import pytest
    import torch

    need = declared_gib(item)
    total = torch.cuda.mem_get_info()[1]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cap = capacity_gib(total, workers)
    if need > cap:
        pytest.skip(f"needs {need:.0f} GiB of GPU memory; this {torch.cuda.get_device_name()} "
                    f"({total / GIB:.0f} GiB, {workers} test workers) can give a test at most {cap:.0f} GiB")
    path = ledger_path()
    ledger = Ledger(path, cap) if path is not None else None
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved() / GIB
    waited = ledger.reserve(os.getpid(), held + need) if ledger is not None else 0.0
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        peak = (torch.cuda.max_memory_reserved() / GIB) - held
        release_failure_frames()
        torch.cuda.empty_cache()
        if ledger is not None:
            ledger.set(os.getpid(), torch.cuda.memory_reserved() / GIB)
        log = os.environ.get("HYBRID_EVAL_GPU_MEM_LOG")
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"test": item.nodeid, "declared_gib": need, "peak_gib": round(peak, 3),
                                    "held_before_gib": round(held, 3), "waited_s": round(waited, 1)}) + "\n")


def random_quantized_experts(quantize, E: int, N: int, K: int, generator, chunk: int = 32):
    """``quantize`` applied to random experts W [E, N, K] ~ N(0, 1 / K), built ``chunk`` experts at a time, so
    that the float32 matrices of all E released-width experts (5.6 GB for Nemotron 3 Super's 512 up
    projections) and the quantizer's temporaries never exist at once.

    ``quantize`` maps [e, N, K] float32 to a tuple of tensors whose leading dim is e (nvfp4_quantize,
    block_fp8_quantize: both quantize each expert on its own); the parts are concatenated along dim 0.
    Draws from ``generator`` (a CUDA torch.Generator) on its device.
    """
    import torch

    from kernels.quant.moe_gemv import quantize_experts

    def draw(start):
        return torch.randn(min(chunk, E - start), N, K, device=generator.device, generator=generator) / K**0.5

    return quantize_experts(quantize, (draw(start) for start in range(0, E, chunk)))
