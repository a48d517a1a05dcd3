"""Nsight Compute (``ncu``) helpers shared by the benchmarks that profile one launch per process
(benchmarks.sweep_replay --ncu, benchmarks.ncu_grouped): where ncu is, and the named numbers of its text
report.

A text report (``ncu ... --page details``, the default) prints each section's metrics as lines of a label, a
unit and a value, e.g. ``    Memory Throughput        %        91.42``; :func:`parse_ncu` reads the labels of
a table such as NCU_METRICS. ``ncu --page raw`` prints every collected metric by its raw name (``name unit
value``); :func:`parse_raw` reads those whose name starts with a prefix (e.g. the warp-stall breakdown).
Source of the labels and metric names: the Nsight Compute Profiling Guide (docs.nvidia.com/nsight-compute),
sections SpeedOfLight, Occupancy, LaunchStats, MemoryWorkloadAnalysis, SchedulerStats, WarpStateStats.
"""

from __future__ import annotations

import os
import shutil

from registry.errors import UserError

# summary key -> the label in ncu's text report (sections SpeedOfLight, Occupancy, LaunchStats), whose unit is
# kept beside the value
NCU_METRICS = {
    "duration": "Duration",
    "memory_throughput_pct": "Memory Throughput",
    "dram_throughput_pct": "DRAM Throughput",
    "compute_throughput_pct": "Compute (SM) Throughput",
    "registers_per_thread": "Registers Per Thread",
    "theoretical_occupancy_pct": "Theoretical Occupancy",
    "achieved_occupancy_pct": "Achieved Occupancy",
    "block_limit_registers": "Block Limit Registers",
}

# the same for sections MemoryWorkloadAnalysis, SchedulerStats and WarpStateStats: where a memory-bound
# kernel's time goes (cache hits, the schedulers' issue rate, the cycles between a warp's instructions)
SCHEDULER_METRICS = {
    "l1_hit_rate_pct": "L1/TEX Hit Rate",
    "l2_hit_rate_pct": "L2 Hit Rate",
    "mem_busy_pct": "Mem Busy",
    "max_bandwidth_pct": "Max Bandwidth",
    "one_or_more_eligible_pct": "One or More Eligible",
    "no_eligible_pct": "No Eligible",
    "issued_warp_per_scheduler": "Issued Warp Per Scheduler",
    "active_warps_per_scheduler": "Active Warps Per Scheduler",
    "eligible_warps_per_scheduler": "Eligible Warps Per Scheduler",
    "warp_cycles_per_issued_instruction": "Warp Cycles Per Issued Instruction",
}

# raw metric names of the warp-stall breakdown (WarpStateStats collects them): warps stalled for each reason
# per issued instruction, <prefix><reason>_per_issue_active.ratio
STALL_PREFIX = "smsp__average_warps_issue_stalled_"


def find_ncu(what: str) -> str:
    """The ncu executable (PATH, else /usr/local/cuda/bin/ncu).

    Raises:
        UserError: neither exists; `what` names the command that needs it.
    """
    exe = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(exe):
        raise UserError(f"{what}: Nsight Compute (ncu) is neither on PATH nor at {exe}",
                        "install the CUDA toolkit's Nsight Compute, or put its ncu on PATH")
    return exe


def parse_ncu(text: str, metrics: dict[str, str] | None = None) -> dict:
    """The metrics (default NCU_METRICS: {key: label}) of one `ncu` text report (its first profiled kernel,
    each label's first line): {key: {"value": float, "unit": str}}; a label the report lacks is absent."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        for key, name in (metrics or NCU_METRICS).items():
            n = len(name.split())
            if key in out or parts[:n] != name.split() or len(parts) < n + 1:
                continue
            rest = parts[n:]
            try:
                value = float(rest[-1].replace(",", ""))
            except ValueError:
                continue
            out[key] = {"value": value, "unit": rest[0] if len(rest) > 1 else ""}
    return out


def parse_raw(text: str, prefix: str) -> dict[str, float]:
    """{metric name without `prefix`: value} of the lines of an ``ncu --page raw`` report whose metric name
    starts with `prefix` (``name [unit] value``; the first kernel's line of each name; unparsable values
    skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].startswith(prefix) or parts[0][len(prefix):] in out:
            continue
        try:
            out[parts[0][len(prefix):]] = float(parts[-1].replace(",", ""))
        except ValueError:
            continue
    return out
