"""benchmarks/bench_quant_gemm.py (quantized GEMMs vs BF16, for the GPU machine): its argument checks, the
bytes each row counts and the row arithmetic, on the CPU (the timed parts need CUDA)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_quant_gemm as bench
from kernels.quant.block_fp8 import block_fp8_quantize
from kernels.quant.nvfp4 import nvfp4_quantize


def test_byte_counts_are_the_stored_tensors():
    q, s, s2 = nvfp4_quantize(torch.randn(40, 272))
    assert bench.nvfp4_weight_bytes(40, 272) == q.nbytes + s.nbytes + s2.nbytes
    w, ws = block_fp8_quantize(torch.randn(200, 300))
    assert bench.block_fp8_weight_bytes(200, 300, scale_bytes=4) == w.nbytes + ws.nbytes


def test_row_and_speedups():
    r = bench.row("nvfp4_grouped", 10.0, 48_000_000, 4000.0, proj="up", batch=1)
    assert r["gb_per_s"] == 4800.0 and r["fraction_of_copy_bw"] == 1.2
    rows = [r, bench.row("bf16_grouped", 25.0, 1, None, proj="up", batch=1)]
    assert rows[1]["fraction_of_copy_bw"] is None
    assert bench.speedups(rows, "nvfp4_grouped", "bf16_grouped") == {"up_b1": 2.5}


@pytest.mark.parametrize("argv, says", [([], "--out"), (["--out", "o.json", "--batches", "0"], ">= 1"),
                                        (["--out", "o.json", "--parts", "int4"], "invalid choice")])
def test_refuses_bad_arguments(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_needs_cuda(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "o.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "o.json").exists()


def test_the_two_launch_rows_time_the_same_call_with_the_split_summed_apart():
    """_two_launch_split runs the call with no scheme summing its K split in the launch, and puts the
    setting back afterwards, also when the call raises."""
    from kernels.quant import block_fp8

    before = block_fp8.SERIAL_SPLIT_SCHEMES
    assert "w8a16" in before
    assert bench._two_launch_split(lambda: block_fp8.SERIAL_SPLIT_SCHEMES) == ()
    with pytest.raises(ZeroDivisionError):
        bench._two_launch_split(lambda: 1 / 0)
    assert block_fp8.SERIAL_SPLIT_SCHEMES == before


def test_the_row_load_rows_time_the_same_call_with_the_other_load():
    """_x_load runs the call with the GEMV's activation-row load forced on both paths and puts each path's
    default back afterwards, also when the call raises."""
    from kernels.quant import block_fp8

    defaults = dict(block_fp8.GEMV_X_LOAD)
    assert defaults == {"dense": "tile", "grouped": "vector"}
    for load in block_fp8.GEMV_X_LOADS:
        assert bench._x_load(load, lambda: dict(block_fp8.GEMV_X_LOAD)) == {"dense": load, "grouped": load}
    with pytest.raises(ZeroDivisionError):
        bench._x_load("vector", lambda: 1 / 0)
    assert block_fp8.GEMV_X_LOAD == defaults


def test_the_torchcast_rows_time_fp8_linear_with_the_reference_cast():
    """_torch_cast runs the call with FP8Linear's quantization as the reference's torch ops and puts the
    kernel back afterwards, also when the call raises."""
    from kernels.quant.fp8 import quantize_fp8, quantize_fp8_ref
    from runners.engine.models import fp8

    assert bench._torch_cast(lambda: fp8.quantize_fp8) is quantize_fp8_ref
    with pytest.raises(ZeroDivisionError):
        bench._torch_cast(lambda: 1 / 0)
    assert fp8.quantize_fp8 is quantize_fp8


def test_a_peer_that_is_not_installed_is_a_row_with_the_reason():
    """gemlite is no dependency: without it the peer is the reason (a str), its rows say why, and the
    speed-up tables leave them out instead of failing."""
    import importlib.util

    if importlib.util.find_spec("gemlite") is None:
        peer = bench.gemlite_fp8_linear(None)
        assert isinstance(peer, str) and "pip install gemlite" in peer
    out = bench._peer_row("gemlite_a16w8_fp8", "not here", None, 1, 1.0, proj="q", batch=1)
    assert out == {"name": "gemlite_a16w8_fp8", "error": "not here", "proj": "q", "batch": 1}
    rows = [out, {"name": "ours", "proj": "q", "batch": 1, "us": 2.0}]
    assert bench.speedups(rows, "ours", "gemlite_a16w8_fp8") == {}
    assert bench.speedups(rows, "gemlite_a16w8_fp8", "ours") == {}


def test_the_nvfp4_peer_says_why_it_is_absent_and_errors_are_relative():
    """The NVFP4 peer follows the FP8 peer's rule when gemlite is absent; max_rel_err is the largest
    difference over the reference's largest magnitude, infinite for a result of another shape."""
    import importlib.util

    import torch

    if importlib.util.find_spec("gemlite") is None:
        peer = bench.gemlite_nvfp4_linear(None, None, torch.tensor(0.5))
        assert isinstance(peer, str) and "pip install gemlite" in peer
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    assert bench.max_rel_err(ref, ref) == 0.0
    assert bench.max_rel_err(ref + torch.tensor([[0.0, 1.0], [0.0, 0.0]]), ref) == 0.25
    assert bench.max_rel_err(ref[:1], ref) == float("inf")


def test_the_dot_rows_force_the_tensor_core_kernel_and_put_the_thresholds_back():
    """_w8a16_dot runs the call with W8A16_DOT_MIN_ROWS at 1 row on both paths (the tensor-core kernel for
    every w8a16 product) and restores the defaults afterwards, also when the call raises."""
    from kernels.quant import block_fp8

    defaults = dict(block_fp8.W8A16_DOT_MIN_ROWS)
    assert bench._w8a16_dot(lambda: dict(block_fp8.W8A16_DOT_MIN_ROWS)) == {"dense": 1, "grouped": 1}
    with pytest.raises(ZeroDivisionError):
        bench._w8a16_dot(lambda: 1 / 0)
    assert block_fp8.W8A16_DOT_MIN_ROWS == defaults


def test_the_direct_rows_switch_the_nvfp4_decode_and_put_it_back():
    """_nvfp4_direct runs the call with kernels/quant/nvfp4.py's DECODE "direct" in both kernels and restores
    the defaults afterwards, also when the call raises."""
    from kernels.quant import nvfp4

    defaults = dict(nvfp4.DECODE)
    assert bench._nvfp4_direct(lambda: dict(nvfp4.DECODE)) == dict.fromkeys(defaults, "direct")
    assert set(defaults) == {"gemv", "mma", "pair"}
    with pytest.raises(ZeroDivisionError):
        bench._nvfp4_direct(lambda: 1 / 0)
    assert nvfp4.DECODE == defaults


def test_per_call_us_keeps_two_launches_of_one_kernel_apart_and_drops_the_flush():
    from benchmarks.bench_quant_gemm import per_call_us

    call = [("fill", 9.0), ("pair<nvfp4>", 10.0), ("pair<nvfp4>", 20.0), ("combine", 2.0)]
    events = call + [(n, us + 1.0) for n, us in call]  # two calls, the second 1 us slower per kernel
    got = per_call_us(events, {"fill"}, 2)
    assert got == {"0:pair<nvfp4>": 10.5, "1:pair<nvfp4>": 20.5, "2:combine": 2.5}
    with pytest.raises(RuntimeError, match="do not repeat"):
        per_call_us(events[:-1], {"fill"}, 2)
    with pytest.raises(RuntimeError, match="do not repeat"):
        per_call_us([("a", 1.0), ("b", 1.0), ("b", 1.0), ("a", 1.0)], set(), 2)
