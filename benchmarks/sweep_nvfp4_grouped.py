"""Launch settings of the grouped NVFP4 tensor-core GEMM (kernels/quant/nvfp4.py ``_nvfp4_mm_kernel``, reached
through ``nvfp4_grouped_mm``) swept on the GPU at Nemotron 3 Super's batch-64 MTP verify.

    python -m benchmarks.sweep_nvfp4_grouped --out OUT.json [--tokens 256] [--projs up down]
        [--block-m 16 32] [--budget-s 150] [--precompile 8] [--smoke]

Why (issue 43): at the batch-64 MTP verify of Super V3 in NVFP4 (256 tokens x top-22 = 5632 (token, expert)
rows over 512 experts, about 11 rows per expert) 28.8 of the 42 ms step went to this kernel, at about 2.8x its
weight-read floor; its launch was fixed by kernels/quant/_common.py ``tile_config`` (BLOCK_M 16, BLOCK_N 64,
4 warps at that size), BLOCK_K 128 and 3 pipeline stages. This sweep times other launches of the same kernel
before one is changed or a new kernel written.

Per point (``--tokens`` tokens routed uniformly at random, distinct experts per token, top-22 of 512, seed
``--seed``; rows sorted by expert as torch._grouped_mm takes them) and projection (``up``: K 1024 -> N 2688,
``down``: 2688 -> 1024; random codes, e4m3 block scales in [0.25, 1.75] and per-expert weight_scale_2: any
bytes are valid NVFP4), the rows (``kind``):
- ``default``: nvfp4_grouped_mm as the engine calls it (GROUPED_KERNEL and the GEMV bound as they are; at 256
  tokens the tensor-core kernel with tile_config's launch), checked against nvfp4_grouped_mm_ref;
- ``cuda``: GROUPED_KERNEL "cuda" (the grouped form of kernels/quant/pair_gemv.cu, pair_cuda.grouped_mm), the
  Triton launcher refused, or why it cannot run (``error``);
- ``config``: the tensor-core kernel (GEMV path off, GROUPED_KERNEL "triton") under one launch of the grid
  (nvfp4.MMA_TILE = (block_m, block_n, num_warps), MMA_BLOCK_K, MMA_NUM_STAGES): BLOCK_N {32, 64, 128, 256}
  x num_warps {4, 8} x num_stages {1, 2, 3, 4} x BLOCK_K {64, 128, 256} x ``--block-m``. BLOCK_K 64 reads the
  codes as bytes, 128 and 256 as int32 words (nvfp4.mma_config). The default's own launch is the first
  config (``is_default_launch``; its output must equal the default row's bit for bit), then the others
  ordered by how many settings differ from it and by an expected gain (:func:`configs`), so that a run the
  budget cuts short has timed every single-setting change first.
Each row: ``config``, ``us`` (CUDA-graph replays, L2 flushed before each call: bench_quant_gemm's
``_graph_us``; eager where capture fails, ``timing`` says), ``floor_us`` (the active experts' codes and scales,
x and the output, over the device copy bandwidth measured in the same run), ``x_floor`` = us / floor_us,
``gb_per_s``, ``ok`` and ``error``. ``ok``: the output is finite and every element is within one bf16 step
of the default row's (|y - ref| <= 2^-7 |ref| + 2^-10 max |ref|: the two differ only in the fp32 summation
order before the bf16 rounding), ``max_rel_err`` = max |y - ref| / max |ref|, ``bad_elements`` the count
outside; a launch that fails to compile or exceeds shared memory is a row with ``error``, never the end of
the run. A fast row that is not ``ok`` is never chosen.

Summary (printed as a table, and in the JSON): ``best`` per point and projection, the fastest ok config
against the default row; ``best_common``, the config with the least total time over every point and
projection where it was ok at all of them (the one launch a single new default would be); ``confirm``:
the default, the default's launch, each best and best_common timed once more, interleaved, at the end (what
decides: a new default is a config ok everywhere whose confirm time beats the default launch's by >= 3% at
every point, ``verdict``). The JSON is rewritten after every row; ``--budget-s`` stops starting configs and
lists the rest in ``skipped``. ``--precompile J`` compiles the grid first in J processes (same shapes, so
the same Triton specializations; they fill Triton's disk cache and exit before any timing), so that the
budget goes to timing. ``--smoke``: a tiny point (4 experts, 8 tokens x top-2, K 256 -> N 32) and two
configs, on the CPU under TRITON_INTERPRET=1 (timed with the host clock) or on a GPU: the CPU test of this
file (tests/test_sweep_nvfp4_grouped.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_quant_gemm import SUPER, nvfp4_weight_bytes, row  # noqa: E402

PROJS = {"up": (SUPER["I"], SUPER["L"]), "down": (SUPER["L"], SUPER["I"])}  # proj: (N, K)
SMOKE = {"E": 4, "top_k": 2, "tokens": 8, "projs": {"up": (32, 256)}}
BLOCK_N = (32, 64, 128, 256)
WARPS = (4, 8)
STAGES = (1, 2, 3, 4)
BLOCK_K = (64, 128, 256)
BLOCK_M = (16, 32)
KEYS = ("block_m", "block_n", "num_warps", "num_stages", "block_k")
# expected gain of changing each setting, most first (ties in configs' order): loads in flight per program
# (stages, the N tile's bytes, the K tile's) before the warps, and BLOCK_M 32 last (16 rows hold the ~11 rows
# of an expert)
AXIS_RANK = {"num_stages": 0, "block_n": 1, "block_k": 2, "num_warps": 3, "block_m": 4}
ADOPT_SPEEDUP = 1.03  # the confirm gain a new default must show at every point


def default_launch(P: int, E: int, N: int) -> dict:
    """The launch nvfp4_grouped_mm's tensor-core kernel takes by default for P rows over E experts and N output
    features (nvfp4.mma_config with MMA_TILE / MMA_BLOCK_K / MMA_NUM_STAGES unset), as a config dict."""
    from kernels.quant import nvfp4

    with mock.patch.multiple(nvfp4, MMA_TILE=None, MMA_BLOCK_K=None, MMA_NUM_STAGES=3):
        bm, bn, warps, bk, stages = nvfp4.mma_config(P / E, N, min(E, P))
    return dict(zip(KEYS, (bm, bn, warps, stages, bk)))


def configs(default: dict, block_ms=BLOCK_M) -> list[dict]:
    """The grid (BLOCK_N x WARPS x STAGES x BLOCK_K x block_ms) with ``default`` first (added if the grid lacks
    it), then the others by the number of settings that differ from the default, then by the settings changed
    (AXIS_RANK: the most promising first), then by how far each value moved (grid steps)."""
    grid = [dict(zip(KEYS, v)) for v in itertools.product(block_ms, BLOCK_N, WARPS, STAGES, BLOCK_K)]
    values = {"block_m": sorted(set(block_ms) | {default["block_m"]}), "block_n": BLOCK_N, "num_warps": WARPS,
              "num_stages": STAGES, "block_k": BLOCK_K}

    def steps(k, c):
        vals = list(values[k])
        if default[k] not in vals or c[k] not in vals:
            return 1
        return abs(vals.index(c[k]) - vals.index(default[k]))

    def key(c):
        changed = [k for k in KEYS if c[k] != default[k]]
        return (len(changed), sorted(AXIS_RANK[k] for k in changed), sum(steps(k, c) for k in changed))

    rest = sorted((c for c in grid if c != default), key=key)
    return [dict(default), *rest]


def run_with(config: dict, fn):
    """fn() with the tensor-core kernel under ``config`` (nvfp4.MMA_TILE / MMA_BLOCK_K / MMA_NUM_STAGES), the
    GEMV path off (_common.GEMV_MAX_ROWS = 0) and GROUPED_KERNEL "triton"; every setting put back afterwards,
    also when fn raises."""
    from kernels.quant import _common, nvfp4

    tile = (config["block_m"], config["block_n"], config["num_warps"])
    with mock.patch.multiple(nvfp4, MMA_TILE=tile, MMA_BLOCK_K=config["block_k"],
                             MMA_NUM_STAGES=config["num_stages"], GROUPED_KERNEL="triton"), \
            mock.patch.multiple(_common, GEMV_MAX_ROWS=0):
        return fn()


def run_cuda(fn):
    """fn() with GROUPED_KERNEL "cuda" and the Triton launcher refused (benchmarks/bench_moe_gemv.py ``_cuda``):
    the CUDA grouped kernel or a RuntimeError."""
    from benchmarks.bench_moe_gemv import _cuda

    return _cuda("nvfp4", fn, "grouped")


def build_points(tokens: list[int], projs: dict, E: int, top_k: int, seed: int, device: str) -> list[dict]:
    """One dict per (tokens, projection): x bf16 [P, K], the experts' (codes uint8 [E, N, K/2], scales
    float8_e4m3fn [E, N, K/16], weight_scale_2 float32 [E]) (one set per projection, shared by the token
    counts), int32 offsets [E], a bf16 [P, N] out buffer, and the point's meta and bytes read."""
    import torch

    from kernels.quant.nvfp4 import FP8_DTYPE

    points = []
    for i, (proj, (N, K)) in enumerate(projs.items()):
        gen = torch.Generator(device=device).manual_seed(seed + 1000 * (i + 1))
        w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=device, generator=gen)
        s = (torch.rand(E, N, K // 16, device=device, generator=gen) * 1.5 + 0.25).to(FP8_DTYPE)
        s2 = torch.rand(E, device=device, generator=gen) * 0.01 + 0.005
        for T in tokens:
            g = torch.Generator(device=device).manual_seed(seed + T)
            idx = torch.rand(T, E, device=device, generator=g).topk(top_k, dim=1).indices
            counts = torch.bincount(idx.flatten(), minlength=E)
            P, active = idx.numel(), int((counts > 0).sum())
            x = torch.randn(P, K, device=device, generator=g).to(torch.bfloat16)
            meta = {"proj": proj, "N": N, "K": K, "E": E, "tokens": T, "pairs": P, "active_experts": active,
                    "rows_per_expert": round(P / E, 2)}
            points.append({"key": f"{proj}_t{T}", "meta": meta, "x": x, "w": (w, s, s2),
                           "offsets": counts.cumsum(0).to(torch.int32),
                           "out": torch.empty(P, N, dtype=torch.bfloat16, device=device),
                           "bytes": active * nvfp4_weight_bytes(N, K) + 2 * P * (K + N),
                           "default_launch": default_launch(P, E, N)})
    return points


def _call(pt):
    """nvfp4_grouped_mm of a point into its out buffer."""
    from kernels.quant.nvfp4 import nvfp4_grouped_mm

    return nvfp4_grouped_mm(pt["x"], *pt["w"], pt["offsets"], out=pt["out"])


def time_us(fn) -> dict:
    """{"us": microseconds per fn() call, "timing": how}. CUDA: bench_quant_gemm's ``_graph_us`` (10 calls per
    graph, median of 5; L2 flushed before each call), eager do_bench where capture fails; CPU (the smoke run
    under the interpreter): the host clock, median of 2 calls."""
    import torch

    if torch.cuda.is_available():
        from triton.testing import do_bench

        from benchmarks.bench_quant_gemm import _graph_us

        try:
            return {"us": _graph_us(fn, reps=10, trials=5), "timing": "cuda_graph"}
        except Exception as e:  # noqa: BLE001 - not capturable: the eager time, and why
            return {"us": 1e3 * do_bench(fn, warmup=10, rep=50, return_mode="median"),
                    "timing": f"eager ({type(e).__name__})"}
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return {"us": sorted(times)[0], "timing": "host_clock"}


def copy_gbps() -> dict:
    """The device copy bandwidth of this run (bench_quant_gemm's ``copy`` part on CUDA: 1 GiB; on the CPU a
    64 MiB torch copy, host clock)."""
    import torch

    from benchmarks.bench_quant_gemm import part_copy

    if torch.cuda.is_available():
        return part_copy()
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    us = (time.perf_counter() - t) / 5 * 1e6
    return {"name": "host_copy", "bytes": 2 * src.numel(), "us": round(us, 2),
            "gb_per_s": round(2 * src.numel() / (us * 1e-6) / 1e9, 1)}


def compare(y, ref) -> dict:
    """{"ok", "max_rel_err", "bad_elements"} of an output y against ``ref`` (module docstring: within one bf16
    step elementwise, computed in fp32; a non-finite y or another shape is not ok)."""
    import torch

    if tuple(y.shape) != tuple(ref.shape):
        return {"ok": False, "max_rel_err": float("inf"), "bad_elements": None}
    yf, rf = y.float(), ref.float()
    scale = rf.abs().max().clamp_min(1e-30)
    d = (yf - rf).abs()
    finite = bool(torch.isfinite(yf).all())
    bad = int((~(d <= rf.abs() * 2.0**-7 + scale * 2.0**-10)).sum())
    err = float(d.max() / scale) if finite and y.numel() else (0.0 if finite else float("inf"))
    return {"ok": finite and bad == 0, "max_rel_err": round(err, 7), "bad_elements": bad}


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def measure(pt: dict, kind: str, config: dict | None, fn, ref, gbps: float, *, check_ref=None
            ) -> tuple[dict, object]:
    """One row (and the output, or None) of fn() at point ``pt``: the first call compiles and gives the output
    compared with ``ref`` (``check_ref`` instead where given: the default against the reference product), then
    the timing. A failing call is a row with ``error``."""
    import torch

    floor = pt["bytes"] / (gbps * 1e9) * 1e6
    base = {"name": "nvfp4_grouped", "kind": kind, **pt["meta"], "config": config}
    if config is not None:
        base["is_default_launch"] = config == pt["default_launch"]
    try:
        pt["out"].fill_(float("nan"))  # an element a launch forgets is caught
        y = fn().clone()
        target = check_ref if check_ref is not None else ref
        check = compare(y, target) if target is not None else {"ok": None}
        if ref is not None and check_ref is None:
            check["bitwise_equal_default"] = bool(torch.equal(y, ref))
        t = time_us(fn)
        out = row("nvfp4_grouped", t, pt["bytes"], gbps, **{k: v for k, v in base.items() if k != "name"},
                  floor_us=round(floor, 2), **check, error=None)
        out["x_floor"] = round(out["us"] / floor, 3)
        return out, y
    except Exception as e:  # noqa: BLE001 - a launch that fails is a row, not the end of the run
        out = {**base, "ok": False, "error": _error(e)}
        print(json.dumps(out), flush=True)
        return out, None


def reference_rows(points: list[dict], gbps: float, report: dict, save) -> dict:
    """The ``default`` and ``cuda`` rows of every point; returns {point key: the default's output} (None where
    the default failed: its configs are then checked against the reference product instead)."""
    from kernels.quant import pair_cuda
    from kernels.quant.nvfp4 import nvfp4_grouped_mm_ref

    refs = {}
    for pt in points:
        exact = nvfp4_grouped_mm_ref(pt["x"], *pt["w"], pt["offsets"])
        r, y = measure(pt, "default", None, partial(_call, pt), None, gbps, check_ref=exact)
        report["rows"].append(r)
        refs[pt["key"]] = y if y is not None else exact
        why = pair_cuda.grouped_unsupported("nvfp4", pt["x"], pt["w"], pt["offsets"])
        if why is None:
            r, _ = measure(pt, "cuda", None, partial(run_cuda, partial(_call, pt)), refs[pt["key"]], gbps)
        else:
            r = {"name": "nvfp4_grouped", "kind": "cuda", **pt["meta"], "config": None, "ok": False,
                 "error": f"unsupported: {why}"}
            print(json.dumps(r), flush=True)
        report["rows"].append(r)
        save()
    return refs


_WORKER_POINTS: list[dict] = []  # a precompile worker's points (_precompile_init)


def _precompile_init(spec: dict) -> None:
    global _WORKER_POINTS
    _WORKER_POINTS = build_points(**spec)


def _precompile_one(config: dict) -> None:
    for pt in _WORKER_POINTS:
        try:
            run_with(config, partial(_call, pt))
        except Exception:  # noqa: BLE001, S110 - the timing pass records the error
            pass


def precompile(spec: dict, grid: list[dict], jobs: int, seconds: float, while_waiting=None) -> dict:
    """Compile ``grid`` at every point of ``spec`` (build_points' arguments) in ``jobs`` spawned processes (one
    launch each: Triton's disk cache keeps the binaries, the timing pass then loads them), stopped after
    ``seconds``; ``while_waiting()`` runs here meanwhile (the CUDA kernel's nvcc build); the workers are ended
    before any timing. Returns {"configs", "done_in_order", "seconds"}."""
    import multiprocessing as mp

    t0 = time.monotonic()
    done = 0
    pool = mp.get_context("spawn").Pool(jobs, initializer=_precompile_init, initargs=(spec,))
    try:
        pending = pool.imap(_precompile_one, grid)
        if while_waiting is not None:
            while_waiting()
        for _ in grid:
            left = seconds - (time.monotonic() - t0)
            if left <= 0:
                break
            try:
                pending.next(timeout=left)
            except mp.TimeoutError:
                break
            done += 1
    finally:
        pool.terminate()
        pool.join()
    out = {"configs": len(grid), "done_in_order": done, "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps({"precompile": out}), flush=True)
    return out


def sweep(points: list[dict], grid: list[dict], refs: dict, gbps: float, budget_s: float, t0: float,
          report: dict, save) -> None:
    """The config rows: for each config in order, every point (a compile serves them all); configs that would
    start after ``budget_s`` seconds from ``t0`` go to report["skipped"]."""
    for i, c in enumerate(grid):
        if i > 0 and time.monotonic() - t0 > budget_s:  # the default launch always runs
            report["skipped"].append(c)
            continue
        for pt in points:
            r, _ = measure(pt, "config", c, partial(run_with, c, partial(_call, pt)), refs[pt["key"]], gbps)
            report["rows"].append(r)
        save()
        print(f"# config {i + 1}/{len(grid)} at {time.monotonic() - t0:.0f} s", flush=True)


def _ckey(c: dict) -> tuple:
    return tuple(c[k] for k in KEYS)


def summarize(rows: list[dict]) -> dict:
    """{"best": {point: {...}}, "best_common": {...} or None} from the rows (module docstring): only rows with
    ok True and a time count; the default row of each point is the comparison."""
    points = sorted({f"{r['proj']}_t{r['tokens']}" for r in rows})
    best = {}
    for p in points:
        mine = [r for r in rows if f"{r['proj']}_t{r['tokens']}" == p]
        d = next((r for r in mine if r["kind"] == "default"), None)
        cu = next((r for r in mine if r["kind"] == "cuda"), None)
        ok = [r for r in mine if r["kind"] == "config" and r.get("ok") and "us" in r]
        dl = next((r for r in ok if r.get("is_default_launch")), None)
        b = min(ok, key=lambda r: r["us"], default=None)
        entry = {"default_us": d.get("us") if d else None, "default_x_floor": d.get("x_floor") if d else None,
                 "default_launch_us": dl["us"] if dl else None,
                 "cuda_us": cu.get("us") if cu else None, "cuda_x_floor": cu.get("x_floor") if cu else None,
                 "configs_ok": len(ok), "configs_failed": sum(r["kind"] == "config" and not r.get("ok")
                                                              for r in mine)}
        if b is not None:
            entry.update(config=b["config"], us=b["us"], x_floor=b["x_floor"], gb_per_s=b["gb_per_s"])
            if entry["default_us"]:
                entry["speedup_vs_default"] = round(entry["default_us"] / b["us"], 3)
        best[p] = entry
    by_config: dict = {}
    for r in rows:
        if r["kind"] == "config":
            by_config.setdefault(_ckey(r["config"]), {})[f"{r['proj']}_t{r['tokens']}"] = r
    common = None
    for k, per in by_config.items():
        if set(per) != set(points) or not all(r.get("ok") and "us" in r for r in per.values()):
            continue
        total = sum(r["us"] for r in per.values())
        if common is None or total < common["total_us"]:
            common = {"config": dict(zip(KEYS, k)), "total_us": round(total, 2),
                      "us": {p: per[p]["us"] for p in points}}
    return {"best": best, "best_common": common}


def confirm(points: list[dict], report: dict, refs: dict, gbps: float, save) -> None:
    """Time the default, its launch, each point's best and best_common once more, interleaved
    (report["confirm"]), and decide report["verdict"] (module docstring)."""
    cands = [("default_launch", None)]
    for p, b in report["best"].items():
        if "config" in b:
            cands.append((f"best_{p}", b["config"]))
    if report["best_common"]:
        cands.append(("best_common", report["best_common"]["config"]))
    seen, rows = set(), []
    for pt in points:
        r, _ = measure(pt, "default", None, partial(_call, pt), refs[pt["key"]], gbps)
        rows.append({**r, "role": "default"})
        for role, c in cands:
            c = c if c is not None else pt["default_launch"]
            if (pt["key"], _ckey(c)) in seen:
                continue
            seen.add((pt["key"], _ckey(c)))
            r, _ = measure(pt, "config", c, partial(run_with, c, partial(_call, pt)), refs[pt["key"]], gbps)
            rows.append({**r, "role": role})
    report["confirm"] = rows
    save()
    verdict = {"adopt": False, "rule": f"ok at every point and >= {ADOPT_SPEEDUP}x the default launch's "
                                       "confirm time at every point"}
    common = report["best_common"]
    if common:
        speed = {}
        for pt in points:
            mine = [r for r in rows if f"{r['proj']}_t{r['tokens']}" == pt["key"]]
            base = next((r for r in mine if r["kind"] == "config" and r.get("config") == pt["default_launch"]
                         and "us" in r), None)
            cand = next((r for r in mine if r["kind"] == "config" and r.get("config") == common["config"]
                         and "us" in r and r.get("ok")), None)
            speed[pt["key"]] = round(base["us"] / cand["us"], 3) if base and cand else None
        verdict.update(config=common["config"], speedup_vs_default_launch=speed,
                       adopt=all(s is not None and s >= ADOPT_SPEEDUP for s in speed.values())
                       and common["config"] != points[0]["default_launch"])
    if any(r.get("timing") == "host_clock" for r in rows):
        verdict.update(adopt=False, note="host-clock times under the interpreter decide nothing")
    report["verdict"] = verdict
    save()


def print_table(report: dict) -> None:
    """Print the best-per-point table of ``report`` (default, CUDA grouped and best ok config per projection)."""
    cfg = lambda c: "-" if not c else "m{block_m} n{block_n} w{num_warps} s{num_stages} k{block_k}".format(**c)
    num = lambda v, f="{:.1f}": "-" if v is None else f.format(v)
    print(f"{'point':<12} {'default us':>10} {'x_floor':>7} {'cuda us':>9} {'best us':>9} {'x_floor':>7} "
          f"{'speedup':>7}  best config (ok/failed)")
    for p, b in report["best"].items():
        print(f"{p:<12} {num(b['default_us']):>10} {num(b['default_x_floor'], '{:.2f}'):>7} "
              f"{num(b['cuda_us']):>9} {num(b.get('us')):>9} {num(b.get('x_floor'), '{:.2f}'):>7} "
              f"{num(b.get('speedup_vs_default'), '{:.3f}'):>7}  {cfg(b.get('config'))} "
              f"({b['configs_ok']}/{b['configs_failed']})")
    c = report["best_common"]
    print(f"best_common: {cfg(c['config']) if c else '-'} {json.dumps(c['us']) if c else ''}")
    print(f"verdict: {json.dumps(report.get('verdict'))}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring), or SystemExit 2 naming a bad argument."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_nvfp4_grouped",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (rewritten after every row)")
    p.add_argument("--tokens", type=int, nargs="+", default=[256],
                   help="tokens per step, each routed to top-22 of 512 experts (256: the batch-64 MTP verify)")
    p.add_argument("--projs", nargs="+", default=list(PROJS), choices=list(PROJS))
    p.add_argument("--block-m", type=int, nargs="+", default=list(BLOCK_M), choices=(16, 32, 64),
                   help="BLOCK_M values of the grid")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="seconds (from the start of the setup) after which no further config starts")
    p.add_argument("--precompile", type=int, default=0, metavar="J",
                   help="compile the grid first in J processes (GPU only; 0: compile as the timing reaches it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny point and two configs (CPU under TRITON_INTERPRET=1, or a GPU)")
    args = p.parse_args(argv)
    if min(args.tokens) < 1:
        p.error("--tokens must be >= 1")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if args.precompile < 0:
        p.error("--precompile must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (module docstring); 0 when the JSON was written, 2 without a GPU (--smoke: without the
    Triton interpreter)."""
    args = parse_args(argv)
    t0 = time.monotonic()
    import torch

    from benchmarks.bench_quant_gemm import gpu_report
    from kernels._common import interpreter_active

    prog = "python -m benchmarks.sweep_nvfp4_grouped"
    if args.smoke and not torch.cuda.is_available():
        if not interpreter_active():
            print(f"error: --smoke without a GPU needs the Triton interpreter\n  fix: TRITON_INTERPRET=1 {prog} "
                  "--smoke --out OUT.json", file=sys.stderr)
            return 2
        report = {"command": " ".join([prog, *(argv if argv is not None else sys.argv[1:])]),
                  "machine": {"device": "cpu (TRITON_INTERPRET=1)", "torch": torch.__version__}}
    else:
        report = gpu_report(prog, argv)
        if report is None:
            return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        spec = {"tokens": [SMOKE["tokens"]], "projs": SMOKE["projs"], "E": SMOKE["E"], "top_k": SMOKE["top_k"]}
    else:
        spec = {"tokens": args.tokens, "projs": {p: PROJS[p] for p in args.projs}, "E": SUPER["E"],
                "top_k": SUPER["top_k"]}
    spec.update(seed=args.seed, device=device)
    report["copy"] = copy_gbps()
    gbps = report["copy"]["gb_per_s"]
    report.update(budget_s=args.budget_s, rows=[], skipped=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out.write_text(json.dumps(report, indent=2) + "\n")
    points = build_points(**spec)
    default = points[0]["default_launch"]
    grid = configs(default, args.block_m)
    if args.smoke:
        grid = [default, {"block_m": 32, "block_n": 32, "num_warps": 8, "num_stages": 1, "block_k": 256}]
    report["default_launch"] = {pt["key"]: pt["default_launch"] for pt in points}
    report["grid_size"] = len(grid)
    print(json.dumps({"points": [pt["meta"] for pt in points], "configs": len(grid),
                      "default_launch": default}), flush=True)
    if args.precompile and device == "cuda" and not args.smoke:
        from kernels.quant import pair_cuda

        build = lambda: pair_cuda.grouped_unsupported("nvfp4", points[0]["x"], points[0]["w"],
                                                      points[0]["offsets"])  # nvcc, once, beside the workers
        report["precompile"] = precompile(spec, grid, args.precompile, 0.5 * args.budget_s, build)
    refs = reference_rows(points, gbps, report, save)
    sweep(points, grid, refs, gbps, args.budget_s, t0, report, save)
    report.update(summarize(report["rows"]))
    save()
    confirm(points, report, refs, gbps, save)
    print_table(report)
    print(f"skipped {len(report['skipped'])} of {len(grid)} configs; {time.monotonic() - t0:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
