"""benchmarks/sweep_pair_gemv.py (the per-pair GEMVs' launch settings swept on the GPU): the configuration
grid, that each configuration reaches the launchers' settings and is put back, the choice of the best, and its
argument checks. The timings themselves run on the GPU machine."""

from __future__ import annotations

import pytest

from benchmarks import sweep_pair_gemv as sweep
from kernels import moe_gemv
from kernels.quant import nvfp4


@pytest.mark.parametrize("fmt", ["nvfp4", "block_fp8"])
def test_the_grid_starts_at_the_defaults_and_has_no_repeats(fmt):
    grid = sweep.configs(fmt)
    default = {**moe_gemv.PAIR_LAUNCH, "max_block_n": moe_gemv.GEMV_MAX_BLOCK_N}
    if fmt == "nvfp4":
        default["tile_weights"] = nvfp4.PAIR_TILE_WEIGHTS
    assert grid[0] == default
    assert len({tuple(sorted(c.items())) for c in grid}) == len(grid)
    per_tile = len(sweep.NVFP4_TILE_WEIGHTS) if fmt == "nvfp4" else 1
    assert len(grid) == len(sweep.WARPS) * len(sweep.MAX_BLOCK_N) * per_tile


def test_a_configuration_is_seen_by_the_call_and_put_back():
    keep = (dict(moe_gemv.PAIR_LAUNCH), moe_gemv.GEMV_MAX_BLOCK_N, nvfp4.PAIR_TILE_WEIGHTS, nvfp4.PAIR_KERNEL)
    seen = lambda: (dict(moe_gemv.PAIR_LAUNCH), moe_gemv.GEMV_MAX_BLOCK_N, nvfp4.PAIR_TILE_WEIGHTS,
                    nvfp4.PAIR_KERNEL)
    c = {"num_warps": 8, "num_stages": 3, "max_block_n": 64, "tile_weights": 16384}
    # NVFP4 configurations are the Triton kernel's: the CUDA default is set aside while they run
    assert sweep.run_with(c, seen) == ({"num_warps": 8, "num_stages": 3}, 64, 16384, "triton")
    assert seen() == keep
    assert sweep.run_with({"num_warps": 4, "num_stages": 2, "max_block_n": 32}, seen)[2] == keep[2]

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        sweep.run_with(c, boom)
    assert seen() == keep


def test_best_is_the_fastest_matching_row_against_the_default():
    pt = {"format": "nvfp4", "batch": 1}
    d = {**pt, "config": {"num_warps": 4}, "default": True}
    rows = [{**d, "us": 10.0, "x_floor": 5.0, "max_rel_err": 0.0},
            {**pt, "config": {"a": 1}, "us": 4.0, "x_floor": 2.0, "max_rel_err": 0.5},  # a wrong result
            {**pt, "config": {"n": 1}, "us": 3.0, "x_floor": 1.5, "max_rel_err": float("nan")},
            {**pt, "config": {"b": 1}, "us": 8.0, "x_floor": 4.0, "max_rel_err": 1e-4},
            {**pt, "config": {"c": 1}, "error": "boom"}]
    assert sweep.best(rows) == {"nvfp4_b1": {"default_us": 10.0, "config": {"b": 1}, "us": 8.0,
                                             "x_floor": 4.0, "speedup_vs_default": 1.25}}
    # a failed default: no other row stands in for it
    failed = [{**pt, "config": {"num_warps": 4}, "default": True, "error": "boom"},
              {**pt, "config": {"b": 1}, "us": 8.0, "x_floor": 4.0, "max_rel_err": None}]
    assert sweep.best(failed) == {"nvfp4_b1": {"default_failed": True}}


def test_max_rel_err_of_a_non_finite_result_is_infinite():
    import torch

    from benchmarks.bench_quant_gemm import max_rel_err

    ref = torch.tensor([1.0, 2.0])
    assert max_rel_err(torch.tensor([1.0, float("nan")]), ref) == float("inf")
    assert max_rel_err(torch.tensor([float("inf"), 2.0]), ref) == float("inf")


@pytest.mark.parametrize("argv, says", [(["--out", "x.json", "--batches", "0"], "--batches"),
                                        (["--out", "x.json", "--budget-s", "0"], "--budget-s"),
                                        (["--out", "x.json", "--formats", "int4"], "invalid choice")])
def test_refuses_bad_arguments(argv, says, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(argv)
    assert says in capsys.readouterr().err


def test_needs_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert sweep.main(["--out", str(tmp_path / "s.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_compile_report_classes_count_each_opcode_once():
    """benchmarks/compile_report.py --pair-gemv's per-class counts (its instructions per weight are the
    difference of two compiles' classes): by the mnemonic before the first ".", each in at most one class
    (SHFL is no SHF, F2FP no F2F)."""
    from benchmarks import compile_report

    ops = {"LOP3.LUT": 5, "IMAD.SHL.U32": 2, "FFMA": 3, "HADD2.F32": 1, "LDG.E.128": 2, "SHFL.BFLY": 1,
           "BRA": 4, "F2FP.BF16.F32.PACK_AB": 2, "HMUL2.BF16_V2": 2, "HMMA.16816.F32.BF16": 1, "STS.U16": 3,
           "LDSM.16.MT88.4": 1}
    got = compile_report._classes(ops)
    assert got == {"int": 7, "fp32": 3, "fp16x2": 2, "convert": 3, "mma": 1, "global_load": 2, "shared": 4,
                   "shuffle": 1}
    names = [n for ns in compile_report.OPCODE_CLASSES.values() for n in ns]
    assert len(names) == len(set(names))


def test_the_loop_body_is_the_span_of_the_widest_backward_branch():
    from benchmarks import compile_report

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA 0x0060 ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LOP3.LUT R5, R4, 0x7, RZ, 0xc0, !PT ;
        /*0040*/                   FFMA R6, R5, R7, R6 ;
        /*0050*/              @!P1 BRA 0x20 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
"""
    body = compile_report.loop_body(sass)
    assert body == {"instructions": 4, "opcodes": {"LDG.E.128": 1, "LOP3.LUT": 1, "FFMA": 1, "BRA": 1}}
    assert compile_report.loop_body(sass.replace("@!P1 BRA 0x20", "NOP")) is None


def test_inner_loops_lists_every_loop_but_the_widest():
    """compile_report.inner_loops: the bodies of every backward branch but the widest, widest first (the
    grouped kernels' K loops inside their pass loop), with the full counts of the tracked opcodes (a spill's
    STL.64 counted as STL)."""
    from benchmarks import compile_report

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LOP3.LUT R5, R4, 0x7, RZ, 0xc0, !PT ;
        /*0030*/              @!P1 BRA 0x20 ;
        /*0040*/                   FFMA R6, R5, R7, R6 ;
        /*0050*/                   IADD3 R6, R5, R7, R6 ;
        /*0060*/                   HMUL2 R6, R5, R7 ;
        /*0070*/              @!P2 BRA 0x40 ;
        /*0080*/              @!P0 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""
    loops = compile_report.inner_loops(sass)
    assert [lp["instructions"] for lp in loops] == [4, 2]
    assert loops[0]["opcodes"] == {"FFMA": 1, "IADD3": 1, "HMUL2": 1, "BRA": 1}
    assert loops[0]["tracked"] == {"PRMT": 0, "LDL": 0, "STL": 0}
    spilled = sass.replace("FFMA R6, R5, R7, R6", "STL.64 [R1+0x8], R6").replace("HMUL2 R6, R5, R7",
                                                                                "PRMT R6, R5, 0x5410, R7")
    assert compile_report.inner_loops(spilled)[0]["tracked"] == {"PRMT": 1, "LDL": 0, "STL": 1}
    one_loop = sass.replace("@!P2 BRA 0x40", "NOP").replace("@!P1 BRA 0x20", "NOP")
    assert compile_report.inner_loops(one_loop) == []


def test_the_cuda_report_reads_each_kernel_by_its_own_symbol():
    """compile_report.cuda_pair_report (nvcc's sm_90 build of kernels/quant/pair_gemv.cu): each per-pair
    entry is pair_gemv_kernel's (its loop a few instructions per weight: an entry that matched the grouped
    kernel's symbol read 17.34), the repacked formats' loops are shorter than the natural ones', the
    pipelined grouped entries carry their two K loops, the two-group one the longer, and the persistent form's
    walk across tiles spills nothing and adds nothing to its K loops (each within 5 % of the pipelined
    form's); the per-pair persistent form, gated or not, spills nothing, its loop a few instructions per
    weight; NVFP4's m32 forms (natural, X_PERM, repacked, and both layouts prefetching) spill nothing inside
    their two K loops (full LDL / STL counts), and X_PERM drops x's byte permutes from its two-group loop
    (full PRMT counts)."""
    from benchmarks import compile_report
    from kernels import _nvcc

    if _nvcc.find_nvcc() is None:
        pytest.skip("nvcc is not installed here")
    report = compile_report.cuda_pair_report()
    for fmt in ("nvfp4", "block_fp8", "nvfp4_repacked", "block_fp8_repacked"):
        for gated in ("", "_gated", "_persistent", "_persistent_gated"):
            assert 1.5 < report[f"{fmt}_cuda{gated}"]["loop_per_weight"]["instructions"] < 5
        assert report[f"{fmt}_cuda_persistent"]["STACK"] == 0
        assert report[f"{fmt}_cuda_persistent_gated"]["STACK"] == 0
        loops = [lp["instructions"] for lp in report[f"{fmt}_cuda_grouped_pipelined"]["k_loops"]]
        assert len(loops) == 2 and loops[0] > loops[1]
        persistent = report[f"{fmt}_cuda_grouped_persistent"]
        assert persistent["STACK"] == 0
        walk = [lp["instructions"] for lp in persistent["k_loops"]]
        assert len(walk) == 2 and all(w <= 1.05 * n for w, n in zip(walk, loops))
    for name in ("nvfp4_cuda_grouped_m32", "nvfp4_cuda_grouped_m32_xperm", "nvfp4_repacked_cuda_grouped_m32",
                 "nvfp4_cuda_grouped_m32_prefetch", "nvfp4_repacked_cuda_grouped_m32_prefetch"):
        m32 = report[name]["k_loops"]  # the form built for NVFP4: no spill inside its K loops
        assert len(m32) == 2 and all(lp["tracked"]["LDL"] == lp["tracked"]["STL"] == 0 for lp in m32)
    # X_PERM's point: x's byte permutes leave the loop (two per MMA: 32 in the two-group loop); the PRMTs left
    # are the decode's, as many as the repacked codes' loop has
    natural, xperm, repacked = (report[f"{name}_cuda_grouped_m32"]["k_loops"][0]["tracked"]["PRMT"]
                                for name in ("nvfp4", "nvfp4", "nvfp4_repacked"))
    xperm = report["nvfp4_cuda_grouped_m32_xperm"]["k_loops"][0]["tracked"]["PRMT"]
    assert xperm <= natural - 32 and xperm == repacked
    for fmt in ("nvfp4", "block_fp8"):
        assert (report[f"{fmt}_repacked_cuda"]["loop_per_weight"]["instructions"]
                < report[f"{fmt}_cuda"]["loop_per_weight"]["instructions"])
        assert (report[f"{fmt}_repacked_cuda_grouped_pipelined"]["k_loops"][0]["instructions"]
                < report[f"{fmt}_cuda_grouped_pipelined"]["k_loops"][0]["instructions"])
