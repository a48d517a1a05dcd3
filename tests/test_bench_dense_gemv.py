"""benchmarks/bench_dense_gemv.py on the CPU: its arguments, its forms computing the same product, and the
message a machine without CUDA gets (the timings run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_dense_gemv as bench


def test_refuses_bad_rows(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", "o.json", "--rows", "0"])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [1, 4])
def test_every_form_is_the_same_product(rows):
    """Each timed form computes x W^T [rows, N] (float32 here: equal up to summation order)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 64, generator=g), torch.randn(48, 64, generator=g)
    fs = bench.forms(x, w, rows)
    assert ("mv" in fs) == (rows == 1)
    for name, fn in fs.items():
        torch.testing.assert_close(fn(), x @ w.t(), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_needs_cuda(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "o.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
