"""benchmarks/ncu_grouped.py (Nsight Compute profiles of the grouped CUDA kernel) and benchmarks/ncu.py on the
CPU: the specs, the ncu command, the parsing of both report pages and the refusals; the profiles themselves
run on the GPU (docs/gpu/persistent_1)."""

from __future__ import annotations

import pytest

from benchmarks import ncu, ncu_grouped
from kernels.quant import pair_cuda
from registry.errors import UserError

DETAILS = """  persistent_kernel<nvp::Nvfp4Codes<false>, false>(nvp::Params) (396, 1, 1)x(128, 1, 1)
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                       %        61.20
    Duration                        usecond       412.35
    Memory Throughput                     %        63.02
    Compute (SM) Throughput               %        48.11
    Section: Memory Workload Analysis
    Memory Throughput          Gbyte/second     2,052.11
    Mem Busy                              %        40.37
    Max Bandwidth                         %        63.02
    L1/TEX Hit Rate                       %        71.52
    L2 Hit Rate                           %        12.80
    Section: Scheduler Statistics
    One or More Eligible                  %        35.70
    Issued Warp Per Scheduler                       0.36
    No Eligible                           %        64.30
    Active Warps Per Scheduler         warp         2.93
    Eligible Warps Per Scheduler       warp         0.52
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction cycle         8.21
    Section: Launch Statistics
    Registers Per Thread    register/thread     163
"""

RAW = """  persistent_kernel<nvp::Nvfp4Codes<false>, false>(nvp::Params)
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio   inst   4.10
    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio              inst   0.90
    smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio inst  1.25
    smsp__average_warps_issue_stalled_long_scoreboard                          warp   9.99
    smsp__inst_executed.sum                                                    inst   1,234,567
"""


def test_specs_are_checked_and_the_repacked_layout_kept_to_its_forms():
    assert ncu_grouped.parse_spec("super_v3:up:256:persistent:repacked") == (
        "super_v3", "up", 256, "persistent", "repacked")
    for bad in ("super_v3:up:256:persistent", "llama:up:8:pipelined:natural",
                "super_v3:mid:8:pipelined:natural",
                "super_v3:up:0:pipelined:natural", "super_v3:up:x:pipelined:natural",
                "super_v3:up:8:tall:natural", "super_v3:up:8:pipelined:zigzag"):
        with pytest.raises(UserError, match="ncu_grouped: spec"):
            ncu_grouped.parse_spec(bad)
    with pytest.raises(UserError, match="repacked codes run only in the forms"):
        ncu_grouped.parse_spec("qwen3_next:down:8:wide:repacked")
    args = ncu_grouped.parse_args(["--out", "x", "--tokens", "8", "--models", "qwen3_next", "--projs", "down",
                                   "--forms", "wide", "persistent"])
    assert ncu_grouped.specs_of(args) == ["qwen3_next:down:8:wide:natural",
                                          "qwen3_next:down:8:persistent:natural",
                                          "qwen3_next:down:8:persistent:repacked"]
    assert set(ncu_grouped.parse_args(["--out", "x"]).forms) == set(pair_cuda.REPACKED_FORMS)


def test_the_ncu_command_profiles_one_grouped_launch_of_the_worker_into_the_report():
    cmd = ncu_grouped.ncu_command("/opt/ncu", "super_v3:up:8:pipelined:natural", "/tmp/r.ncu-rep")
    assert cmd[0] == "/opt/ncu" and cmd[cmd.index("-k") + 1] == "regex:grouped_|persistent_kernel"
    assert cmd[cmd.index("--launch-count") + 1] == "1" and cmd[cmd.index("--export") + 1] == "/tmp/r.ncu-rep"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"] == list(ncu_grouped.SECTIONS)
    assert cmd[-4:] == ["-m", "benchmarks.ncu_grouped", "--worker", "super_v3:up:8:pipelined:natural"]
    assert "--profile-from-start" in cmd and cmd[cmd.index("--clock-control") + 1] == "none"


def test_summary_reads_both_pages_and_the_read_rate():
    worker_out = 'build...\n{"spec": "s", "P": 176, "active_experts": 150, "weight_bytes": 825000000}\n'
    got = ncu_grouped.summarize("s", 0, worker_out, DETAILS, RAW)
    assert got["exit"] == 0 and got["P"] == 176
    assert got["duration"] == {"value": 412.35, "unit": "usecond"}
    assert got["memory_throughput_pct"]["value"] == 63.02  # the SpeedOfLight line, not the Gbyte/s one
    assert got["l2_hit_rate_pct"]["value"] == 12.8 and got["no_eligible_pct"]["value"] == 64.3
    assert got["issued_warp_per_scheduler"]["value"] == 0.36
    assert got["warp_cycles_per_issued_instruction"]["value"] == 8.21
    assert got["registers_per_thread"]["value"] == 163
    assert got["read_gbps"] == round(825e6 / 412.35e-6 / 1e9, 1)
    assert list(got["stalls"].items()) == [("long_scoreboard", 4.1), ("math_pipe_throttle", 1.25),
                                           ("wait", 0.9)]
    assert "long_scoreboard 4.10" in ncu_grouped.table({"s": got})
    failed = ncu_grouped.summarize("s", 1, "", "==ERROR== no kernels were profiled", "")
    assert failed == {"exit": 1, "stalls": {}}
    assert "nan" in ncu_grouped.table({"s": failed})


def test_parse_raw_keeps_the_first_value_of_each_prefixed_name():
    got = ncu.parse_raw(RAW + RAW.replace("4.10", "7.00"), "smsp__average_warps_issue_stalled_")
    assert got["long_scoreboard_per_issue_active.ratio"] == 4.1 and got["long_scoreboard"] == 9.99
    assert ncu.parse_raw(RAW, "smsp__inst_executed") == {".sum": 1234567.0}


def test_without_ncu_or_a_gpu_the_command_says_what_is_missing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(ncu.shutil, "which", lambda name: None)
    monkeypatch.setattr(ncu.os.path, "exists", lambda p: False)
    with pytest.raises(UserError, match=r"ncu_grouped: Nsight Compute \(ncu\) is neither on PATH"):
        ncu.find_ncu("ncu_grouped")
    monkeypatch.undo()
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert ncu_grouped.main(["--out", str(tmp_path)]) == 2
    assert "error: ncu_grouped needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu_grouped.main([])  # --out is required
