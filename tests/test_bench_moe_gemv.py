"""benchmarks/bench_moe_gemv.py (routed-experts GEMV vs grouped GEMM vs the weight-read floor, for the GPU
machine): its argument checks, the bytes and floor it counts and its summary, on the CPU (the timed parts need
CUDA)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_moe_gemv as bench


def test_expert_bytes_are_the_stored_tensors():
    L, I = 40, 24
    up, gate, down = torch.zeros(I, L, dtype=torch.bfloat16), torch.zeros(I, L, dtype=torch.bfloat16), \
        torch.zeros(L, I, dtype=torch.bfloat16)
    assert bench.expert_bytes(L, I, gated=False) == up.nbytes + down.nbytes
    assert bench.expert_bytes(L, I, gated=True) == up.nbytes + gate.nbytes + down.nbytes


def test_floor_is_active_bytes_over_bandwidth():
    # 10 gated Qwen3-Next experts (3 x 512 x 2048 bf16 each = 6 MiB) at 4000 GB/s
    want = 10 * 3 * 512 * 2048 * 2 / 4000e9 * 1e6
    assert bench.floor_us(10, 2048, 512, True, 4000.0) == pytest.approx(want)
    assert bench.MODELS["super_v3"][:4] == (1024, 2688, 512, 22)
    assert bench.MODELS["qwen3_next"][:4] == (2048, 512, 512, 10)


def test_summary_pairs_the_paths():
    rows = [{"name": "moe_gemv", "model": "m", "batch": 1, "us": 10.0, "x_floor": 2.0, "floor_us": 5.0},
            {"name": "grouped_mm", "model": "m", "batch": 1, "us": 25.0, "x_floor": 5.0, "floor_us": 5.0}]
    assert bench.summary(rows) == {"m_b1": {"floor_us": 5.0, "moe_gemv_us": 10.0, "moe_gemv_x_floor": 2.0,
                                            "grouped_mm_us": 25.0, "grouped_mm_x_floor": 5.0,
                                            "gemv_speedup": 2.5}}


@pytest.mark.parametrize("argv, says", [([], "--out"), (["--out", "o.json", "--batches", "0"], ">= 1"),
                                        (["--out", "o.json", "--models", "llama"], "invalid choice")])
def test_refuses_bad_arguments(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_needs_cuda(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "o.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "o.json").exists()


def test_quantized_floor_counts_the_stored_bytes_and_summary_pairs_each_format():
    from runners.engine.dummy import stored_nbytes

    L, I = 1024, 2688  # Super V3: up [I, L], down [L, I]; NVFP4 half a byte a value plus a scale per 16
    assert bench.expert_bytes_in("nvfp4", L, I, False) == stored_nbytes("nvfp4", (I, L)) + stored_nbytes(
        "nvfp4", (L, I))
    assert bench.expert_bytes_in("nvfp4", L, I, False) < bench.expert_bytes(L, I, False) / 3
    assert bench.expert_bytes_in("bf16", L, I, True) == bench.expert_bytes(L, I, True)
    rows = [{"name": "moe_gemv_nvfp4", "format": "nvfp4", "model": "m", "batch": 1, "us": 4.0, "x_floor": 2.0,
             "floor_us": 2.0},
            {"name": "grouped_mm_nvfp4", "format": "nvfp4", "model": "m", "batch": 1, "us": 12.0,
             "x_floor": 6.0, "floor_us": 2.0}]
    assert bench.summary(rows) == {"m_b1": {"floor_us_nvfp4": 2.0, "moe_gemv_nvfp4_us": 4.0,
                                            "moe_gemv_nvfp4_x_floor": 2.0, "grouped_mm_nvfp4_us": 12.0,
                                            "grouped_mm_nvfp4_x_floor": 6.0, "gemv_speedup_nvfp4": 3.0}}


def test_nvfp4_variant_rows_set_the_pair_choices_and_put_them_back():
    """_nvfp4_pair runs the call with nvfp4.DECODE["pair"] and PAIR_X_LOAD set as asked (the other DECODE
    entries untouched) and restores both afterwards, also when the call raises."""
    import pytest

    from kernels.quant import nvfp4

    decode, load, kernel = dict(nvfp4.DECODE), nvfp4.PAIR_X_LOAD, nvfp4.PAIR_KERNEL
    seen = bench._nvfp4_pair("direct", "vector", lambda: (dict(nvfp4.DECODE), nvfp4.PAIR_X_LOAD,
                                                          nvfp4.PAIR_KERNEL))
    assert seen == ({**decode, "pair": "direct"}, "vector", "triton")
    with pytest.raises(ZeroDivisionError):
        bench._nvfp4_pair("direct", "vector", lambda: 1 / 0)
    assert nvfp4.DECODE == decode and nvfp4.PAIR_X_LOAD == load and nvfp4.PAIR_KERNEL == kernel


def test_cuda_rows_set_the_kernel_refuse_triton_and_put_both_back():
    """_cuda runs the call with the format's setting for each form (PAIR_KERNEL, GROUPED_KERNEL) = "cuda" and
    its Triton launcher replaced by one that raises (a row that fell back would time Triton under the CUDA
    kernel's name), both restored afterwards."""
    import pytest

    from kernels.quant import block_fp8, nvfp4

    for form, (setting, launcher) in bench.CUDA_SETTINGS.items():
        for fmt, module in (("nvfp4", nvfp4), ("block_fp8", block_fp8)):
            keep = getattr(module, setting), getattr(module, launcher)
            look = lambda m=module, s=setting, f=launcher: (getattr(m, s), getattr(m, f))  # noqa: E731
            seen = bench._cuda(fmt, look, form)
            assert seen == ("cuda", bench._refuse_triton)
            with pytest.raises(RuntimeError, match="fell back to the Triton kernel"):
                bench._cuda(fmt, lambda m=module, f=launcher: getattr(m, f)(), form)
            assert (getattr(module, setting), getattr(module, launcher)) == keep


def test_cuda_rows_lift_the_formats_size_bounds_and_triton_rows_force_triton():
    """A ``_cuda`` row lifts the format's CUDA_BOUNDS (block FP8 takes its CUDA kernels only within measured
    sizes by default) and a ``_triton`` row sets the form's setting to "triton"; both put everything back."""
    from kernels.quant import block_fp8

    keep = (block_fp8.PAIR_KERNEL, block_fp8.GROUPED_KERNEL, block_fp8.PAIR_CUDA_MAX_PAIRS,
            block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT)
    assert bench._cuda("block_fp8", lambda: block_fp8.PAIR_CUDA_MAX_PAIRS, "pair") is None
    assert bench._cuda("block_fp8", lambda: block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT, "grouped") == 0.0
    assert bench._triton("block_fp8", lambda: block_fp8.PAIR_KERNEL, "pair") == "triton"
    assert bench._triton("block_fp8", lambda: block_fp8.GROUPED_KERNEL, "grouped") == "triton"
    assert (block_fp8.PAIR_KERNEL, block_fp8.GROUPED_KERNEL, block_fp8.PAIR_CUDA_MAX_PAIRS,
            block_fp8.GROUPED_CUDA_MIN_ROWS_PER_EXPERT) == keep
    for form, bounds in bench.CUDA_BOUNDS["block_fp8"].items():  # every bound names a real setting
        assert all(hasattr(block_fp8, name) for name in bounds), form


def test_quantized_rows_name_every_cuda_form_and_the_repacked_ones(monkeypatch):
    """quantized_rows (tiny experts on the CPU, the timing replaced by one that raises, so every row is an
    error row with its name) carries a grouped row per pair_cuda.GROUPED_FORMS and per REPACKED_FORMS on the
    repacked codes, the split and the repacked pipelined forms under their first names, and the per-pair
    CUDA kernel in both PAIR_FORMS on natural and repacked codes; NVFP4 adds X_PERM's row per X_PERM_FORMS
    and GROUPED_PREFETCH's m32 row."""
    import torch

    from kernels.quant import pair_cuda

    def refuse(fn):
        raise RuntimeError("no timing here")

    monkeypatch.setattr(bench, "_bench", refuse)
    E, L, I = 4, 64, 64
    gen = torch.Generator().manual_seed(0)
    w = lambda *s: (torch.randn(*s, generator=gen) / 8).to(torch.bfloat16)  # noqa: E731
    h = torch.randn(2, L, generator=gen).to(torch.bfloat16)
    weights = torch.full((2, 2), 0.5)
    indices = torch.tensor([[0, 1], [2, 3]])
    for fmt in ("nvfp4", "block_fp8"):
        rows = bench.quantized_rows(fmt, h, weights, indices, w(E, I, L), None, w(E, L, I), "relu2", {}, E,
                                    1.0)
        names = {r["name"] for r in rows}
        assert all("error" in r for r in rows)
        for form in pair_cuda.GROUPED_FORMS:
            assert f"grouped_mm_{fmt}_cuda" + ("" if form == "split" else f"_{form}") in names
        assert {f"grouped_mm_{fmt}_cuda_repacked", f"grouped_mm_{fmt}_cuda_repacked_persistent",
                f"moe_gemv_{fmt}_cuda_repacked", f"moe_gemv_{fmt}_cuda_repacked_persistent",
                f"moe_gemv_{fmt}_cuda", f"moe_gemv_{fmt}_cuda_persistent"} <= names
        xperm = {f"grouped_mm_{fmt}_cuda_{form}_xperm" for form in pair_cuda.X_PERM_FORMS}
        assert (xperm <= names) if fmt == "nvfp4" else not (xperm & names)  # X_PERM is NVFP4's alone
        assert (f"grouped_mm_{fmt}_cuda_m32_prefetch" in names) == (fmt == "nvfp4")  # GROUPED_PREFETCH's row
