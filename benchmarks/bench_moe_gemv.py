"""Routed experts of one MoE layer at decode batch sizes on the GPU: the per-pair GEMV kernels
(kernels/moe_gemv.py; kernels/quant/moe_gemv.py for quantized experts) vs the grouped-GEMM path vs the
weight-read floor, released expert shapes, bf16 and the quantized release formats.

    python -m benchmarks.bench_moe_gemv --out OUT.json [--batches 1 8] [--models super_v3 qwen3_next]
        [--formats bf16 nvfp4 block_fp8] [--kernels]

Models (benchmarks/bench_quant_gemm.py's SUPER / QWEN shapes): ``super_v3`` Nemotron 3 Super (latent
L = 1024 -> I = 2688, relu2, top-22 of 512 experts), ``qwen3_next`` Qwen3-Next (hidden L = 2048 -> I = 512,
gated SiLU, top-10 of 512). Per model and batch (tokens routed to random distinct experts, router-like combine
weights), one row each:
- ``moe_gemv``: kernels.moe_gemv.moe_gemv (gate / up with the activation, down, combine: three launches);
- ``grouped_mm``: runners/engine/models/moe.py's moe_experts_fused with the GEMV path off (no activation
  name, MOE_GEMV_MAX_PAIRS = 0): sort, offsets, torch._grouped_mm per projection, inverse gather, combine;
- for each quantized ``--formats`` entry (experts quantized from the same bf16 weights; ``nvfp4`` run W4A16,
  ``block_fp8`` in the scheme the engine runs at each path, its rows' ``scheme``: the format's decode scheme,
  w8a16, at decode sizes): ``moe_gemv_<fmt>`` (kernels.quant.moe_gemv's per-pair GEMVs: three launches, what
  NVFP4MoE / BlockFP8MoE take at decode sizes on CUDA) and ``grouped_mm_<fmt>`` (runners/engine/models/
  moe.py's moe_experts_grouped over the format's grouped GEMM: the quantized MoE's path before); for
  ``block_fp8`` also the per-pair GEMVs on the CUDA kernel of kernels/quant/pair_gemv.cu (w8a16,
  ``moe_gemv_block_fp8_cuda``), on the Triton kernel (``moe_gemv_block_fp8_triton``, and
  ``grouped_mm_block_fp8_triton`` for the grouped form: the default rows take the CUDA kernels within the
  format's size bounds, CUDA_BOUNDS) and in the other scheme (``moe_gemv_block_fp8_w8a8``: activations
  quantized per token and 128-column group), for ``nvfp4`` the per-pair GEMVs with kernels/quant/nvfp4.py's
  other choices: ``_cuda``, PAIR_KERNEL "cuda" (the CUDA kernel of kernels/quant/pair_gemv.cu, the
  default; ``_cuda_prefetch``, ``_cuda_pdl``, ``_cuda_prefetch_pdl``: with kernels/quant/pair_cuda.py's
  PREFETCH / PDL, ``_cuda_persistent`` with its PAIR_FORM "persistent", bench_moe_gemv.CUDA_LAUNCH), and the
  Triton per-pair kernel (PAIR_KERNEL "triton") with its default decode and load
  (``_triton``), DECODE["pair"] "direct" (fp32 bit patterns with no convert, ``_direct``), PAIR_X_LOAD
  "vector" (``_xvec``), both (``_direct_xvec``), and its grouped path on the Triton kernel
  (``grouped_mm_nvfp4_triton``). Their floor counts the stored bytes of the format
  (runners.engine.dummy.stored_nbytes: codes and scales). ``grouped_mm_<fmt>_cuda``: the grouped path with
  the format's GROUPED_KERNEL "cuda" (the grouped form of kernels/quant/pair_gemv.cu: each expert's rows as
  the MMA's N, its weights read once for up to 32 rows) and kernels/quant/pair_cuda.py's GROUPED_FORM
  "split" (16 output rows per CTA, its warps splitting K), ``grouped_mm_<fmt>_cuda_wide`` and
  ``_cuda_pipelined`` the same with kernels/quant/pair_cuda.py's GROUPED_FORM "wide" (64 output rows per
  CTA, a warp per 16 over all of K) and "pipelined" (the wide grid, the next chunks' codes in flight),
  ``_cuda_persistent`` with "persistent" (3 CTAs per SM walking the pipelined form's tiles, the next pass's
  codes in flight across tiles);
  ``grouped_mm_nvfp4_cuda_pipelined_xperm`` and ``_cuda_m32_xperm`` the pipelined and m32 forms with
  pair_cuda.X_PERM (x copied with its columns permuted before each grouped product, the copy timed with it);
  ``grouped_mm_nvfp4_cuda_m32_prefetch`` the m32 form with pair_cuda.GROUPED_PREFETCH (a rolling L2 prefetch); ``moe_gemv_<fmt>_cuda_repacked`` and
  ``grouped_mm_<fmt>_cuda_repacked`` the per-pair kernel and the grouped pipelined form (block FP8: w8a16;
  ``moe_gemv_<fmt>_cuda_repacked_persistent`` and ``grouped_mm_<fmt>_cuda_repacked_persistent`` the
  persistent forms) on the same experts with their codes
  repacked (kernels.quant.<fmt>.repack_codes; pair_cuda's
  "<fmt>_repacked" formats).
  A row whose call raises carries "error" instead of a time.
Each row carries ``floor_us``: the bytes of the distinct chosen experts' weights (every projection of every
expert some token chose, read once) over the device copy bandwidth measured in the same run (bench_quant_gemm's
``copy`` part), and ``x_floor`` = us / floor_us. Every row runs under torch.inference_mode, as the engine's
step does (the grouped path's glue then takes its kernels: runners.engine.models.layers.use_inference_kernel).
Times come from bench_quant_gemm's ``_bench``: CUDA-graph
replays with L2 flushed before each call (weights from HBM, no launch cost: the engine's captured decode
step), plus "us_eager" (launched from Python). The summary holds both paths' times and x_floor per point.
``--kernels`` adds "kernels_us" to each row of the CUDA kernels (names with ``_cuda``): device microseconds
of each launch of one call, in launch order (bench_quant_gemm.kernel_us: "0:<gate / up kernel>", "1:<down>",
"2:<combine>"), which says whether the time is in the projections or around them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from functools import partial
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_quant_gemm import (  # noqa: E402
    QWEN,
    SUPER,
    _bench,
    _with,
    gpu_report,
    kernel_us,
    part_copy,
    routed_indices,
    row,
    write_report,
)

MODELS = {  # model: (L, I, E, top_k, activation, gated)
    "super_v3": (SUPER["L"], SUPER["I"], SUPER["E"], SUPER["top_k"], "relu2", False),
    "qwen3_next": (QWEN["D"], QWEN["I"], QWEN["E"], QWEN["top_k"], "silu", True),
}
BYTES_PER_WEIGHT = 2  # bf16
FORMATS = ("bf16", "nvfp4", "block_fp8")


def expert_bytes(L: int, I: int, gated: bool) -> int:
    """Weight bytes of one bf16 expert: up [I, L] and down [L, I], plus gate [I, L] when gated."""
    return (3 if gated else 2) * I * L * BYTES_PER_WEIGHT


def floor_us(active: int, L: int, I: int, gated: bool, copy_gbps: float) -> float:
    """Microseconds to read ``active`` experts' weights once at ``copy_gbps`` (1e9 bytes / s)."""
    return active * expert_bytes(L, I, gated) / (copy_gbps * 1e9) * 1e6


def expert_bytes_in(fmt: str, L: int, I: int, gated: bool) -> int:
    """Stored bytes of one expert in ``fmt`` ("bf16", "nvfp4", "block_fp8"): codes and scales of each
    projection (runners.engine.dummy.stored_nbytes)."""
    from runners.engine.dummy import stored_nbytes

    return (2 if gated else 1) * stored_nbytes(fmt, (I, L)) + stored_nbytes(fmt, (L, I))


def _quantized(fmt: str, w, chunk: int = 32):
    """(the format's expert tuple for kernels.quant.moe_gemv, the engine's grouped GEMM of it); ``w`` [E, N, K]
    quantized ``chunk`` experts at a time (the quantizer's temporaries of 512 released experts at once did not
    fit an 80 GB H100)."""
    from kernels.quant.moe_gemv import quantize_experts

    chunks = (w[i:i + chunk] for i in range(0, w.shape[0], chunk))
    if fmt == "nvfp4":
        from kernels.quant.nvfp4 import nvfp4_quantize
        from runners.engine.models.nvfp4 import nvfp4_grouped_mm

        mats = quantize_experts(nvfp4_quantize, chunks)
        return mats, lambda x, offsets: nvfp4_grouped_mm(x, *mats, offsets)
    from kernels.quant.block_fp8 import block_fp8_quantize
    from runners.engine.models.block_fp8 import block_fp8_grouped_mm

    q, s = quantize_experts(block_fp8_quantize, chunks)
    mats = (q, s.float())
    return mats, lambda x, offsets: block_fp8_grouped_mm(x, *mats, offsets)


def random_experts(model: str):
    """(gen, up, gate, down) of ``model`` (MODELS): up / gate [E, I, L] and down [E, L, I] bf16 on CUDA, normal
    values over sqrt(fan-in), gate None unless gated; ``gen`` the CUDA generator (seed 0) they came from, which
    :func:`decode_point` draws on next."""
    import math

    import torch

    L, I, E, _, _, gated = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: (torch.randn(*s, device="cuda", generator=gen) / math.sqrt(s[-1])).to(torch.bfloat16)
    return gen, r(E, I, L), (r(E, I, L) if gated else None), r(E, L, I)


def decode_point(model: str, B: int, gen):
    """(h, weights, indices, active) of ``B`` decode tokens of ``model``: h [B, L] bf16, router-like combine
    weights [B, k] float32 (softmax of uniform), indices [B, k] int64 (random distinct experts per token,
    seeded by B), and the number of distinct experts chosen."""
    import torch

    L, _, E, k, _, _ = MODELS[model]
    indices = routed_indices(B, k, E, seed=B)
    weights = torch.softmax(torch.rand(B, k, device="cuda", generator=gen), dim=1)
    h = torch.randn(B, L, device="cuda", generator=gen).to(torch.bfloat16)
    return h, weights, indices, int(indices.unique().numel())


def pair_call(fmt: str, h, weights, indices, up, gate, down, act: str):
    """(the per-pair call, its block-FP8 scheme or None): kernels.quant's ``moe_gemv_<fmt>`` on the format's
    expert tuples (``_quantized``'s first item; gate None unless gated), block FP8 in the scheme the engine runs
    at one row per expert (the format's rule, runners.engine.formats)."""
    from kernels.quant.block_fp8 import moe_gemv_block_fp8
    from kernels.quant.nvfp4 import moe_gemv_nvfp4

    if fmt == "nvfp4":
        return partial(moe_gemv_nvfp4, h, weights, indices, up, gate, down, act), None
    from runners.engine.formats import get_format

    scheme = get_format(fmt).scheme(1)
    return partial(moe_gemv_block_fp8, h, weights, indices, up, gate, down, act, scheme=scheme), scheme


def quantized_rows(fmt: str, h, weights, indices, up, gate, down, act: str, meta: dict, active: int,
                   copy_gbps: float, kernels: bool = False) -> list[dict]:
    """The ``moe_gemv_<fmt>`` and ``grouped_mm_<fmt>`` rows of one point (module docstring); with ``kernels``
    each timed row of a CUDA kernel also carries "kernels_us" (bench_quant_gemm.kernel_us)."""
    from kernels.quant import pair_cuda
    from runners.engine.models.layers import ACTIVATIONS
    from runners.engine.models.moe import moe_experts_grouped

    L, I = up.shape[2], up.shape[1]
    q = {k: _quantized(fmt, w) for k, w in (("up", up), ("gate", gate), ("down", down)) if w is not None}
    kinds = tuple(q)
    mm = lambda x, kind, offsets: q[kind][1](x, offsets)
    weight_bytes = active * expert_bytes_in(fmt, L, I, gate is not None)
    fl = weight_bytes / (copy_gbps * 1e9) * 1e6
    io = 2 * h.shape[0] * L * BYTES_PER_WEIGHT
    rows = []
    gemv, pair_scheme = pair_call(fmt, h, weights, indices, q["up"][0], q["gate"][0] if "gate" in q else None,
                                  q["down"][0], act)
    grouped = partial(moe_experts_grouped, h, weights, indices, kinds, mm, ACTIVATIONS[act], up.shape[0])
    # block FP8: each row in the scheme the engine runs there (the per-pair path: the format's rule for one row;
    # the grouped path: its rule per expert, runners.engine.models.block_fp8.grouped_scheme), the per-pair
    # kernel in the other scheme beside it
    grouped_rows_scheme = None
    if fmt == "block_fp8":
        from runners.engine.models.block_fp8 import grouped_scheme

        grouped_rows_scheme = grouped_scheme(indices.numel(), up.shape[0])
    paths = [(f"moe_gemv_{fmt}", gemv, pair_scheme), (f"grouped_mm_{fmt}", grouped, grouped_rows_scheme)]
    if fmt == "block_fp8":
        other = "w8a8" if pair_scheme == "w8a16" else "w8a16"
        paths.append((f"moe_gemv_{fmt}_{other}", partial(gemv, scheme=other), other))
        paths += [(f"moe_gemv_{fmt}_triton", partial(_triton, fmt, gemv), pair_scheme),
                  (f"grouped_mm_{fmt}_triton", partial(_triton, fmt, grouped, "grouped"), grouped_rows_scheme)]
        paths += [(f"moe_gemv_{fmt}_cuda{suffix}", partial(_cuda, fmt, partial(gemv, scheme="w8a16"), **launch),
                   "w8a16") for suffix, launch in CUDA_LAUNCH.items()]
    if fmt == "nvfp4":
        from kernels.quant import nvfp4

        for suffix, decode, load in (("triton", nvfp4.DECODE["pair"], nvfp4.PAIR_X_LOAD),
                                     ("direct", "direct", "tile"), ("xvec", "convert", "vector"),
                                     ("direct_xvec", "direct", "vector")):
            paths.append((f"moe_gemv_{fmt}_{suffix}", partial(_nvfp4_pair, decode, load, gemv), None))
        paths += [(f"moe_gemv_{fmt}_cuda{suffix}", partial(_cuda, fmt, gemv, **launch), None)
                  for suffix, launch in CUDA_LAUNCH.items()]
        paths.append((f"grouped_mm_{fmt}_triton", partial(_triton, fmt, grouped, "grouped"), None))
    for form in pair_cuda.GROUPED_FORMS:  # the split form's row keeps its first name
        paths.append((f"grouped_mm_{fmt}_cuda" + ("" if form == "split" else f"_{form}"),
                      partial(_cuda, fmt, grouped, "grouped", GROUPED_FORM=form), grouped_rows_scheme))
    if fmt == "nvfp4":
        paths += [(f"grouped_mm_{fmt}_cuda_{form}_xperm",
                   partial(_cuda, fmt, grouped, "grouped", GROUPED_FORM=form, X_PERM=True), None)
                  for form in pair_cuda.X_PERM_FORMS]
        paths.append((f"grouped_mm_{fmt}_cuda_m32_prefetch",
                      partial(_cuda, fmt, grouped, "grouped", GROUPED_FORM="m32", GROUPED_PREFETCH=True), None))
    # the same experts with their codes repacked (kernels.quant.<fmt>.repack_codes), run as pair_cuda's
    # "<fmt>_repacked" format: the per-pair kernel (block FP8: w8a16) and the grouped pipelined form
    import importlib

    from kernels.quant.block_fp8 import block_fp8_grouped_mm
    from runners.engine.models.nvfp4 import nvfp4_grouped_mm

    module = importlib.import_module(f"kernels.quant.{fmt}")
    rq = {kind: (module.repack_codes(m[0][0]), *m[0][1:]) for kind, m in q.items()}
    gemv_r, _ = pair_call(fmt, h, weights, indices, rq["up"], rq.get("gate"), rq["down"], act)
    if fmt == "block_fp8":
        gemv_r = partial(gemv_r, scheme="w8a16")
        rmm = lambda x, kind, offsets: block_fp8_grouped_mm(x, *rq[kind], offsets, scheme="w8a16")
    else:
        rmm = lambda x, kind, offsets: nvfp4_grouped_mm(x, *rq[kind], offsets)
    grouped_r = partial(moe_experts_grouped, h, weights, indices, kinds, rmm, ACTIVATIONS[act], up.shape[0])
    a16 = "w8a16" if fmt == "block_fp8" else None
    paths += [(f"moe_gemv_{fmt}_cuda_repacked" + ("" if suffix == "" else suffix),
               partial(_repacked, fmt, partial(_cuda, fmt, gemv_r, **CUDA_LAUNCH[suffix])), a16)
              for suffix in ("", "_persistent")]
    paths += [(f"grouped_mm_{fmt}_cuda_repacked" + ("" if form == "pipelined" else f"_{form}"),
               partial(_repacked, fmt, partial(_cuda, fmt, grouped_r, "grouped", GROUPED_FORM=form)), a16)
              for form in pair_cuda.REPACKED_FORMS]
    for name, fn, scheme in paths:
        extra = {**meta, "floor_us": round(fl, 2), "format": fmt, **({"scheme": scheme} if scheme else {})}
        try:
            timing = _bench(fn)
        except Exception as e:  # noqa: BLE001 - a row that says why it has no time
            print(json.dumps({"name": name, **extra, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            rows.append({"name": name, **extra, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        out = row(name, timing, weight_bytes + io, copy_gbps, **extra)
        out["x_floor"] = round(out["us"] / fl, 2) if fl > 0 else None
        if kernels and "_cuda" in name:
            try:
                out["kernels_us"] = kernel_us(fn)
            except Exception as e:  # noqa: BLE001 - the row keeps its time and says why it has no split
                out["kernels_us_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(out)
    return rows


def _nvfp4_pair(decode: str, load: str, fn):
    """fn() on the Triton per-pair kernel (PAIR_KERNEL "triton") with kernels/quant/nvfp4.py's choices
    DECODE["pair"] = decode and PAIR_X_LOAD = load, all put back afterwards (bench_quant_gemm's ``_with``)."""
    from kernels.quant import nvfp4

    return _with(nvfp4, fn, (), {}, DECODE={**nvfp4.DECODE, "pair": decode}, PAIR_X_LOAD=load,
                 PAIR_KERNEL="triton")


# the CUDA kernels' settings in kernels/quant/<fmt>.py and the Triton launcher each one replaces
CUDA_SETTINGS = {"pair": ("PAIR_KERNEL", "_launch_pair"), "grouped": ("GROUPED_KERNEL", "_launch")}
# the size bounds a format puts on its CUDA kernels by default, per form, and the values that lift them (so a
# ``_cuda`` row times the CUDA kernel at every point, a ``_triton`` row the Triton kernel)
CUDA_BOUNDS = {"block_fp8": {"pair": {"PAIR_CUDA_MAX_PAIRS": None},
                             "grouped": {"GROUPED_CUDA_MIN_ROWS_PER_EXPERT": 0.0}}}
# the per-pair CUDA rows: row suffix -> kernels/quant/pair_cuda.py's launch settings (PREFETCH, PDL, PAIR_FORM)
CUDA_LAUNCH = {"": {"PREFETCH": False, "PDL": False, "PAIR_FORM": "split"},
               "_prefetch": {"PREFETCH": True, "PDL": False, "PAIR_FORM": "split"},
               "_pdl": {"PREFETCH": False, "PDL": True, "PAIR_FORM": "split"},
               "_prefetch_pdl": {"PREFETCH": True, "PDL": True, "PAIR_FORM": "split"},
               "_persistent": {"PREFETCH": False, "PDL": False, "PAIR_FORM": "persistent"}}


def _cuda(fmt: str, fn, form: str = "pair", **launch):
    """fn() with kernels/quant/<fmt>.py's setting for `form` (CUDA_SETTINGS: the per-pair or the grouped form
    of kernels/quant/pair_gemv.cu) = "cuda", its Triton launcher refusing, and kernels/quant/pair_cuda.py's
    ``launch`` settings (CUDA_LAUNCH's values, or GROUPED_FORM), the format's size bounds lifted (CUDA_BOUNDS),
    all put back afterwards: the row times the CUDA kernel or fails with RuntimeError (e.g. block FP8 grouped at a row count whose scheme is w8a8, which the CUDA kernel does
    not run)."""
    import importlib

    from kernels.quant import pair_cuda

    module = importlib.import_module(f"kernels.quant.{fmt}")
    setting, launcher = CUDA_SETTINGS[form]
    bounds = CUDA_BOUNDS.get(fmt, {}).get(form, {})
    with mock.patch.multiple(pair_cuda, **launch) if launch else contextlib.nullcontext():
        return _with(module, fn, (), {}, **{setting: "cuda", launcher: _refuse_triton, **bounds})


def _repacked(fmt: str, fn):
    """fn() with kernels/quant/pair_cuda.py's launches of format `fmt` sent as "<fmt>_repacked" (fn's experts
    hold repacked codes): the per-pair kernel and the grouped pipelined form on the repacked layout."""
    from kernels.quant import pair_cuda

    def swap(real):
        return lambda f, *a, **k: real(f"{f}_repacked" if f == fmt else f, *a, **k)

    with mock.patch.multiple(pair_cuda, launch_pair=swap(pair_cuda.launch_pair),
                             grouped_mm=swap(pair_cuda.grouped_mm)):
        return fn()


def _triton(fmt: str, fn, form: str = "pair"):
    """fn() with kernels/quant/<fmt>.py's setting for `form` (CUDA_SETTINGS) = "triton", put back afterwards:
    the Triton kernel at every point, beside the default row (which may take the CUDA kernel within the
    format's CUDA_BOUNDS)."""
    import importlib

    module = importlib.import_module(f"kernels.quant.{fmt}")
    return _with(module, fn, (), {}, **{CUDA_SETTINGS[form][0]: "triton"})


def _refuse_triton(*args, **kwargs):
    raise RuntimeError("PAIR_KERNEL 'cuda' fell back to the Triton kernel (kernels.quant.pair_cuda.unsupported)")


def _grouped_path(*args):
    """moe_experts_fused without an activation name: its grouped-GEMM path at any size (MOE_GEMV_MAX_PAIRS
    set to 0 as well, so the row stays the grouped path whatever the engine's default)."""
    from runners.engine.models import moe

    keep = moe.MOE_GEMV_MAX_PAIRS
    moe.MOE_GEMV_MAX_PAIRS = 0
    try:
        return moe.moe_experts_fused(*args)
    finally:
        moe.MOE_GEMV_MAX_PAIRS = keep


def part_model(model: str, batches: list[int], copy_gbps: float, formats: tuple[str, ...] = ("bf16",),
               kernels: bool = False) -> list[dict]:
    from kernels.moe_gemv import moe_gemv
    from runners.engine.models.layers import ACTIVATIONS

    L, I, E, k, act, gated = MODELS[model]
    gen, up, gate, down = random_experts(model)
    rows = []
    for B in batches:
        h, weights, indices, active = decode_point(model, B, gen)
        fl = floor_us(active, L, I, gated, copy_gbps)
        io = 2 * B * L * BYTES_PER_WEIGHT
        meta = {"model": model, "batch": B, "pairs": B * k, "active_experts": active, "floor_us": round(fl, 2)}
        weight_bytes = active * expert_bytes(L, I, gated)
        paths = (("moe_gemv", partial(moe_gemv, h, weights, indices, up, gate, down, act)),
                 ("grouped_mm", partial(_grouped_path, h, weights, indices, up, gate, down, ACTIVATIONS[act])))
        for name, fn in paths if "bf16" in formats else ():
            out = row(name, _bench(fn), weight_bytes + io, copy_gbps, **meta)
            out["x_floor"] = round(out["us"] / fl, 2) if fl > 0 else None
            rows.append(out)
        for fmt in (f for f in formats if f != "bf16"):
            rows += quantized_rows(fmt, h, weights, indices, up, gate, down, act, meta, active, copy_gbps,
                                   kernels)
    return rows


def summary(rows: list[dict]) -> dict:
    """{"<model>_b<batch>": {"<name>_us", "<name>_x_floor" per path, "floor_us" (bf16's),
    "floor_us_<fmt>", "gemv_speedup" (bf16), "gemv_speedup_<fmt>" (quantized formats)}}."""
    out: dict = {}
    for r in rows:
        s = out.setdefault(f"{r['model']}_b{r['batch']}", {})
        fmt = r.get("format", "bf16")
        suffix = "" if fmt == "bf16" else f"_{fmt}"
        s[f"floor_us{suffix}"] = r["floor_us"]
        s[f"{r['name']}_us"], s[f"{r['name']}_x_floor"] = r["us"], r["x_floor"]
        gemv, grouped = s.get(f"moe_gemv{suffix}_us"), s.get(f"grouped_mm{suffix}_us")
        if gemv and grouped:
            s[f"gemv_speedup{suffix}"] = round(grouped / gemv, 2)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe_gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode tokens per step")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS),
                   help="expert weight formats timed (bf16: moe_gemv vs grouped_mm; quantized: kernels.quant."
                        "moe_gemv vs the format's grouped GEMM)")
    p.add_argument("--kernels", action="store_true",
                   help="also profile each CUDA-kernel row's graph: device microseconds per kernel "
                        "(\"kernels_us\"), to see which launch of a path holds its time")
    args = p.parse_args(argv)
    if min(args.batches) < 1:
        p.error("--batches must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    report = gpu_report("python -m benchmarks.bench_moe_gemv", argv)
    if report is None:
        return 2
    copy = part_copy()  # every row's floor and fraction refer to it
    report["copy"] = copy
    import torch

    with torch.inference_mode():  # as the engine's step: the MoE path's glue kernels (use_inference_kernel)
        rows = [r for model in args.models
                for r in part_model(model, args.batches, copy["gb_per_s"], tuple(args.formats), args.kernels)]
    report["rows"] = rows
    report["summary"] = summary(rows)
    for key, s in report["summary"].items():
        print(f"{key}: {json.dumps(s)}")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
