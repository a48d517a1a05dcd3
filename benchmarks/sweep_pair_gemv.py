"""Launch settings of the quantized per-pair GEMVs (the engine's routed experts at decode) swept on the GPU:
warps, the tile's width and weights per step.

    python -m benchmarks.sweep_pair_gemv --out OUT.json [--batches 1 8] [--formats nvfp4 block_fp8]
        [--budget-s 300]

Why: the per-pair GEMVs launch with 4 warps (kernels/moe_gemv.py PAIR_LAUNCH), so each program has one tile of
loads in flight (about 4 KB) and waits for it before the next; on an H200 they read their experts at
4.8-5.7x the weight-read floor. By Little's law the copy bandwidth needs tens of KB in flight per SM; and
the NVFP4 kernel spends about 8 SASS instructions per weight (``python -m benchmarks.compile_report
--pair-gemv``), an ALU time of its own near twice the floor. This sweep asks what more warps and wider tiles
buy before a new kernel is written. (num_stages is not swept: Triton does not pipeline this loop, the SASS is
the same at 1 and 3.)

Per format (``nvfp4``: Nemotron 3 Super's experts, ``moe_gemv_nvfp4``; ``block_fp8``: Qwen3-Next's,
``moe_gemv_block_fp8`` in the scheme the engine runs at one row per expert) and batch (tokens routed to random
distinct experts, benchmarks/bench_moe_gemv.py's set-up), one row per configuration of `configs`:
num_warps (kernels/moe_gemv.py PAIR_LAUNCH) x the widest output tile (GEMV_MAX_BLOCK_N) x, for
NVFP4, the weights decoded per program and step (kernels/quant/nvfp4.py PAIR_TILE_WEIGHTS). Each row: the
whole three-launch call's microseconds (bench_quant_gemm's ``_bench``: CUDA-graph replays, L2 flushed),
``x_floor`` against the weight-read floor of the same run's copy bandwidth, and ``max_rel_err`` against the
default configuration's output (the summation order may change with the tiles; the values must not).
"best" per (format, batch) is the fastest configuration whose output matches the default's; "speedup_vs_default"
its gain (`best`). The JSON is rewritten
after every row (a run cut short keeps what it measured); --budget-s stops starting configurations and says
so ("skipped"). A configuration may resolve to the same launch as another (a cap on the output tile that the
shape never reaches) and is timed anyway: the rows say what was asked, ``config``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_moe_gemv import (  # noqa: E402
    MODELS,
    _quantized,
    decode_point,
    expert_bytes_in,
    pair_call,
    random_experts,
)
from benchmarks.bench_quant_gemm import _bench, _with, gpu_report, max_rel_err, part_copy, row  # noqa: E402

FORMAT_MODEL = {"nvfp4": "super_v3", "block_fp8": "qwen3_next"}
WARPS = (4, 8)
MAX_BLOCK_N = (32, 64)
NVFP4_TILE_WEIGHTS = (8192, 16384)


def configs(fmt: str) -> list[dict]:
    """The swept settings of one format, the current defaults first: dicts of num_warps, num_stages,
    max_block_n and (NVFP4) tile_weights."""
    from kernels import moe_gemv
    from kernels.quant import nvfp4

    default = {**moe_gemv.PAIR_LAUNCH, "max_block_n": moe_gemv.GEMV_MAX_BLOCK_N}
    if fmt == "nvfp4":
        default["tile_weights"] = nvfp4.PAIR_TILE_WEIGHTS
    tiles = NVFP4_TILE_WEIGHTS if fmt == "nvfp4" else (None,)
    out = [default]
    for w, bn, tw in itertools.product(WARPS, MAX_BLOCK_N, tiles):
        c = {"num_warps": w, "num_stages": default["num_stages"], "max_block_n": bn,
             **({"tile_weights": tw} if tw else {})}
        if c != default:
            out.append(c)
    return out


def run_with(config: dict, fn):
    """fn() under ``config`` (kernels/moe_gemv.py PAIR_LAUNCH and GEMV_MAX_BLOCK_N, kernels/quant/nvfp4.py
    PAIR_TILE_WEIGHTS, with nvfp4's PAIR_KERNEL "triton": these are the Triton kernel's settings, not the CUDA
    kernel's), every setting put back afterwards."""
    from kernels import moe_gemv
    from kernels.quant import nvfp4

    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    inner = partial(_with, moe_gemv, fn, (), {}, PAIR_LAUNCH=launch, GEMV_MAX_BLOCK_N=config["max_block_n"])
    if "tile_weights" in config:
        return _with(nvfp4, inner, (), {}, PAIR_TILE_WEIGHTS=config["tile_weights"], PAIR_KERNEL="triton")
    return inner()


def _points(fmt: str, batches: list[int]):
    """Yield (call, meta, bytes read) per batch: the format's per-pair MoE call on its model's random experts
    (quantized once, bench_moe_gemv's set-up), bytes = the chosen experts' stored weights + h and the output."""
    model = FORMAT_MODEL[fmt]
    L, I, _, k, act, gated = MODELS[model]
    gen, *experts = random_experts(model)
    q = [None if w is None else _quantized(fmt, w)[0] for w in experts]
    for B in batches:
        h, weights, indices, active = decode_point(model, B, gen)
        call, scheme = pair_call(fmt, h, weights, indices, *q, act)
        meta = {"format": fmt, "model": model, "batch": B, "pairs": B * k, "active_experts": active,
                **({"scheme": scheme} if scheme else {})}
        yield call, meta, active * expert_bytes_in(fmt, L, I, gated) + 4 * B * L


def sweep(formats: list[str], batches: list[int], copy_gbps: float, budget_s: float, report: dict,
          save) -> None:
    """Fill report["rows"] / ["skipped"] / ["best"], calling ``save()`` after each row."""
    t0 = time.monotonic()
    for fmt in formats:
        for call, meta, nbytes in _points(fmt, batches):
            floor = nbytes / (copy_gbps * 1e9) * 1e6
            ref = None  # the default configuration's output: every other row is compared with it
            for i, c in enumerate(configs(fmt)):
                if i > 0 and time.monotonic() - t0 > budget_s:  # the default always runs
                    report["skipped"].append({**meta, "config": c})
                    continue
                try:
                    y = run_with(c, call)
                    if i == 0:
                        ref = y
                    err = max_rel_err(y, ref) if ref is not None else None
                    out = row("pair_gemv", _bench(partial(run_with, c, call)), nbytes, copy_gbps, **meta,
                              config=c, default=i == 0, floor_us=round(floor, 2),
                              max_rel_err=None if err is None else round(err, 6))
                    out["x_floor"] = round(out["us"] / floor, 2)
                except Exception as e:  # noqa: BLE001 - a configuration that fails is a row, not a crash
                    out = {"name": "pair_gemv", **meta, "config": c, "default": i == 0,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                    print(json.dumps(out), flush=True)
                report["rows"].append(out)
                save()
    report["best"] = best(report["rows"])


def best(rows: list[dict]) -> dict:
    """{"<format>_b<batch>": {"config", "us", "x_floor", "default_us", "speedup_vs_default"}}: per point, the
    fastest timed row whose result matches the default configuration's (``max_rel_err`` <= 1e-2; a NaN or a
    missing comparison does not match) against the row marked ``default``. Where the default failed there is
    nothing to compare with: the point holds {"default_failed": True} only."""
    out: dict = {}
    defaults = {f"{r['format']}_b{r['batch']}": r for r in rows if r.get("default")}
    for key, d in defaults.items():
        if "us" not in d:
            out[key] = {"default_failed": True}
        else:
            out[key] = {"default_us": d["us"], "config": d["config"], "us": d["us"], "x_floor": d["x_floor"]}
    for r in rows:
        key = f"{r['format']}_b{r['batch']}"
        b = out.get(key)
        err = r.get("max_rel_err")
        if b is None or "us" not in b or "us" not in r or not (err is not None and err <= 1e-2):
            continue
        if r["us"] < b["us"]:
            b.update(config=r["config"], us=r["us"], x_floor=r["x_floor"])
    for b in out.values():
        if "us" in b:
            b["speedup_vs_default"] = round(b["default_us"] / b["us"], 3)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_pair_gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (rewritten after every row)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode tokens per step")
    p.add_argument("--formats", nargs="+", default=list(FORMAT_MODEL), choices=list(FORMAT_MODEL))
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="seconds after which no further configuration starts (the skipped ones are listed)")
    args = p.parse_args(argv)
    if min(args.batches) < 1:
        p.error("--batches must be >= 1")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = gpu_report("python -m benchmarks.sweep_pair_gemv", argv)
    if report is None:
        return 2
    report["copy"] = part_copy()
    report.update(rows=[], skipped=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out.write_text(json.dumps(report, indent=2) + "\n")
    sweep(args.formats, args.batches, report["copy"]["gb_per_s"], args.budget_s, report, save)
    save()
    for key, b in report["best"].items():
        print(f"{key}: {json.dumps(b)}")
    print(f"skipped {len(report['skipped'])}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
