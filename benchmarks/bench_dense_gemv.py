"""The bf16 dense projections of a decode step at 1-4 rows on the GPU: ``F.linear`` (what nn.Linear runs; cuBLAS
picks a split-K GEMM plus its reduce launch at one row) against the same product through cuBLAS's other
entry points, beside the weight-read floor.

    python -m benchmarks.bench_dense_gemv --out OUT.json [--rows 1 4]

Shapes: Nemotron 3 Super's bf16 projections in the NVFP4 / FP8 releases: the MoE latent projections
``fc1_latent_proj`` 4096 -> 1024 and ``fc2_latent_proj`` 1024 -> 4096 (40 calls per half-depth step), and
attention's q / o 4096 -> 4096 and k / v 4096 -> 256. Rows per shape and row count: ``linear``
(``F.linear(x, W)``), ``mm_t`` (``torch.mm(x, W.t())``), ``gemv`` (``torch.mm(W, x.t()).t()``: the weight as
the GEMM's left operand, which cuBLAS may run as a GEMV) and, at one row, ``mv`` (``torch.mv(W, x[0])``); each
with ``max_abs_diff`` against ``linear`` (float32 accumulation in every form: differences of bf16 rounding
only). Times: bench_quant_gemm's ``_bench`` (CUDA-graph replays, L2 flushed before each call); floor_us: the
weight's bytes over the device copy bandwidth measured in the same run. What would change the engine: a form
faster than ``linear`` at every shape of a row count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_quant_gemm import _bench, gpu_report, part_copy, row, write_report  # noqa: E402

SHAPES = {"fc1_latent": (4096, 1024), "fc2_latent": (1024, 4096), "attn_qo": (4096, 4096), "attn_kv": (4096, 256)}


def forms(x, w, rows: int) -> dict:
    """{row name: the call it times} (module docstring)."""
    import torch
    import torch.nn.functional as F

    out = {"linear": lambda: F.linear(x, w), "mm_t": lambda: torch.mm(x, w.t()),
           "gemv": lambda: torch.mm(w, x.t()).t()}
    if rows == 1:
        out["mv"] = lambda: torch.mv(w, x[0])[None]
    return out


def part_shapes(rows_list: list[int], copy_gbps: float) -> list[dict]:
    """Every shape x row count x form (module docstring), printed as timed."""
    import torch

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (K, N) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        for rows in rows_list:
            x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
            floor = w.numel() * 2 / (copy_gbps * 1e3)
            fs = forms(x, w, rows)
            want = fs["linear"]().float()
            for form, fn in fs.items():
                r = row(form, _bench(fn), w.numel() * 2, copy_gbps, shape=name, K=K, N=N, rows=rows,
                        floor_us=round(floor, 2))
                r["x_floor"] = round(r["us"] / floor, 2)
                r["max_abs_diff"] = float((fn().float() - want).abs().max())
                out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    """Time every form (module docstring) into ``--out``; 2 without CUDA, SystemExit 2 on bad arguments."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_dense_gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    args = p.parse_args(argv)
    if any(r < 1 for r in args.rows):
        p.error(f"--rows {args.rows}: each at least 1")
    report = gpu_report("python -m benchmarks.bench_dense_gemv", argv)
    if report is None:
        return 2
    copy = part_copy()
    report["copy"] = copy
    report["rows"] = part_shapes(args.rows, copy["gb_per_s"])
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
