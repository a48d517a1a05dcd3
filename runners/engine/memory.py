"""Memory accounting of a model load: the fit check before anything is allocated, and the load report.

- :func:`check_memory_fits` compares the bytes a load will allocate (weights at their load dtypes, known from
  the safetensors headers; caches at max_batch_size / max_seq_len, from
  ``runners.engine.cache.cache_memory_bytes``)
  with the device's free memory (``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of /proc/meminfo on
  the CPU) and raises :class:`InsufficientMemoryError` naming both numbers and the fixes.
- :class:`LoadReport` is what ``Engine.from_pretrained`` measured: wall time, bytes by kind, the host's peak
  resident set (``VmHWM`` of /proc/self/status, reset at the start of the load through /proc/self/clear_refs
  where the kernel allows) and the device's peak allocation (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from registry.errors import UserError

log = logging.getLogger(__name__)

GIB = 2**30


class InsufficientMemoryError(UserError):
    """Weights + caches do not fit the device's free memory (raised before any allocation)."""


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def free_device_memory(device: torch.device) -> tuple[int | None, str]:
    """(free bytes, where they come from) of ``device``; (None, reason) when it cannot be known.

    CUDA: ``torch.cuda.mem_get_info`` (free bytes of the whole GPU, other processes included) plus what this
    process's caching allocator holds reserved but unallocated (``memory_reserved - memory_allocated``): a
    model freed earlier in the process (the first arm of compare=replay) leaves its blocks reserved, invisible
    to the driver's count yet reusable by the next load. CPU: ``MemAvailable`` of /proc/meminfo (Linux; what
    the kernel can hand out without swapping).
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached), (f"free memory of {device} (torch.cuda.mem_get_info, plus this process's "
                                    "reserved but unallocated blocks)")
    if device.type == "cpu":
        try:
            m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        except OSError as e:
            return None, f"/proc/meminfo is not readable ({e})"
        if m is None:
            return None, "/proc/meminfo has no MemAvailable line"
        return int(m.group(1)) * 1024, "available host memory (MemAvailable of /proc/meminfo)"
    return None, f"no free-memory query for device type {device.type!r}"


def check_memory_fits(
    weight_bytes: int,
    cache_bytes: int,
    device: torch.device | str,
    *,
    budget_bytes: int | None = None,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    cache_bytes_at: Callable[[int], int] | None = None,
) -> int | None:
    """Raise when the weights and caches of a load cannot fit; call it before allocating anything.

    Args:
        weight_bytes: bytes of the parameters and buffers at their load dtypes.
        cache_bytes: bytes of the per-slot caches (``Engine.cache_memory()`` summed).
        device: where they would be allocated.
        budget_bytes: the bytes available; None (default) asks the device (:func:`free_device_memory`).
        max_batch_size, max_seq_len: named in the message (the settings the cache size follows).
        cache_bytes_at: ``f(batch) -> cache bytes`` at another max_batch_size (monotone in batch): with it a
            refusal names the largest batch below ``max_batch_size`` that fits
            (:func:`largest_fitting_batch`).

    Returns:
        The budget compared against, or None when it could not be determined (the check is skipped and a
        log line says why).

    Raises:
        InsufficientMemoryError: weight_bytes + cache_bytes > budget; the message names both numbers, the
            budget and the fixes (smaller max_batch_size / max_seq_len, more GPUs, a quantized checkpoint).
    """
    device = torch.device(device)
    where = "the given memory budget"
    if budget_bytes is None:
        budget_bytes, where = free_device_memory(device)
        if budget_bytes is None:
            log.info("memory fit check skipped: %s", where)
            return None
    need = weight_bytes + cache_bytes
    if need > budget_bytes:
        sizes = ", ".join(
            f"{k}={v}" for k, v in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)) if v
        )
        fit = None
        if cache_bytes_at is not None and max_batch_size:
            fit = largest_fitting_batch(weight_bytes, budget_bytes, cache_bytes_at, max_batch_size - 1)
        if fit is not None:
            first = (f"lower max_batch_size: eval.batch_size={fit} is the largest that fits (weights + "
                     f"{_gib(cache_bytes_at(fit))} of caches), or lower max_seq_len (model.max_seq_len=N)")
        elif weight_bytes >= budget_bytes:
            first = "the weights alone exceed it, so no smaller max_batch_size or max_seq_len helps"
        elif cache_bytes_at is not None:
            first = "not even max_batch_size 1 fits: lower max_seq_len (model.max_seq_len=N)"
        else:
            first = ("lower max_batch_size or max_seq_len (run.py: eval.batch_size=N, model.max_seq_len=N) "
                     "to shrink the caches")
        raise InsufficientMemoryError(
            f"the model needs {_gib(weight_bytes)} of weights + {_gib(cache_bytes)} of caches"
            f"{f' ({sizes})' if sizes else ''} = {_gib(need)}, more than the {_gib(budget_bytes)} of {where} "
            f"on {device}",
            f"{first}; or spread the model over more GPUs (world_size), or use a quantized entry (smaller "
            "weights)",
        )
    return budget_bytes


def largest_fitting_batch(weight_bytes: int, budget_bytes: int, cache_bytes_at: Callable[[int], int],
                          upper: int) -> int | None:
    """The largest batch b in [1, upper] with weight_bytes + cache_bytes_at(b) <= budget_bytes (binary
    search; cache_bytes_at must not decrease with b), or None when not even b = 1 fits."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if weight_bytes + cache_bytes_at(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def host_peak_rss_reset() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where it is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def host_peak_rss_bytes() -> int | None:
    """Peak resident set of this process (VmHWM; file-backed pages such as memory-mapped safetensors
    included), or None off Linux."""
    try:
        m = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


@dataclass
class LoadReport:
    """What one ``Engine.from_pretrained`` measured (bytes; seconds of wall time).

    ``weight_bytes`` / ``cache_bytes``: parameters and buffers, and per-slot caches, as allocated.
    ``budget_bytes``: the free memory the fit check compared against (None: not determinable, skipped).
    ``host_peak_rss_bytes``: VmHWM after the load; it is the load's own peak when ``host_peak_reset`` (the
    counter was reset at the start), else the process's peak so far. ``device_peak_bytes`` /
    ``device_allocated_bytes``: ``torch.cuda.max_memory_allocated`` since the start of the load and
    ``memory_allocated`` after it (None off CUDA).
    """

    seconds: float
    weights_seconds: float
    device: str
    dtype: str
    weight_bytes: int
    cache_bytes: int
    budget_bytes: int | None
    host_peak_rss_bytes: int | None
    host_peak_reset: bool
    device_peak_bytes: int | None
    device_allocated_bytes: int | None

    def to_dict(self) -> dict:
        return asdict(self)
