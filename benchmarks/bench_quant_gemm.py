"""Quantized GEMMs on the GPU vs BF16, at the released models' decode shapes (kernels/quant/).

    python -m benchmarks.bench_quant_gemm --out OUT.json [--batches 1 2 4 8] [--parts copy nvfp4 fp8]

Parts (each row: microseconds, bytes read, achieved GB/s and the fraction of the device copy bandwidth
measured in the same run):
- ``copy``: a 1 GiB device-to-device torch copy (bytes read + written / time): the reference bandwidth.
- ``nvfp4``: Nemotron 3 Super's routed experts (latent 1024 -> moe_intermediate 2688 "up" and back "down",
  512 experts, top-22): tokens x 22 (token, expert) pairs routed to random distinct experts, sorted by expert,
  at each batch; ``nvfp4_grouped_mm`` vs the BF16 grouped GEMM (``torch._grouped_mm``, as
  runners/engine/models/moe.py runs it) vs dequantize-then-BF16 (every expert's NVFP4 weight dequantized by
  the PyTorch reference, then the BF16 grouped GEMM: what a runtime without the fused kernel does, since it
  cannot learn which experts are active without synchronising).
- ``nvfp4_dense``: one of those experts' matrices as a dense layer at M = batch: ``nvfp4_linear`` vs
  gemlite's weight-only NVFP4 linear (``gemlite_a16w4_nvfp4``: the same packed codes, block scales and global
  scale, so the same bytes; each gemlite row carries ``peer_max_rel_err``, the peer's largest difference from
  ``nvfp4_linear_ref`` over the output's largest magnitude, so a peer that computes something else shows) vs a
  BF16 ``F.linear``.
- ``fp8_tensor``: Nemotron 3 Super's dense projections in per-tensor FP8 (SUPER_DENSE) at M = batch:
  ``fp8_linear`` (the activation cast with its static scale in one launch, kernels.quant.fp8, then
  ``torch._scaled_mm``: what FP8Linear runs; "_torchcast" rows: the cast as three torch launches)
  vs ``fp8_linear_w8a16`` (the activation kept, one GEMV launch) vs a BF16 ``F.linear``.
- ``fp8``: Qwen3-Next in block FP8: the dense projections (q with its gate 2048 -> 8192, k / v 2048 -> 512,
  o 4096 -> 2048, GDN in_proj_qkvz 2048 -> 12288) at M = batch, ``block_fp8_linear`` (Triton, and
  torch._scaled_mm when ``block_scaled_mm_supported``) vs a BF16 ``F.linear``; the routed experts (hidden
  2048 -> moe_intermediate 512 and back, 512 experts, top-10) ``block_fp8_grouped_mm`` vs BF16
  ``torch._grouped_mm``.
Rows named "..._w8a16" time ``scheme="w8a16"`` (the activation kept in bf16: the GEMV kernel alone, its K split
summed inside the launch), "..._w8a16_2launch" the same with the split summed by the splitk_sum launch
(kernels/quant/block_fp8.py SERIAL_SPLIT_SCHEMES emptied), so one run says what the activation quantization
launch and the second launch cost at each shape; dense "..._w8a16_xvec" the GEMV loading each activation row's
128-column group once, broadcast over the weight tile ("vector"), beside the dense default load in the tile's
layout, and grouped "..._w8a16_xtile" the reverse (block_fp8.GEMV_X_LOAD: each path's measured faster load);
"..._w8a16_dot" the w8a16 tensor-core kernel (16-row MMA tiles, K split; block_fp8.W8A16_DOT_MIN_ROWS, off by
default until these rows said where it leads: dense from 1 row, docs/kernel_performance.md). NVFP4 rows named
"..._direct" time kernels/quant/nvfp4.py's "direct" decode (DECODE: fp32 bit patterns, no fp16 -> fp32
convert per element) in that row's kernel. "gemlite_a16w8_fp8" rows (both FP8 parts) time a peer from PyPI where it is
importable (gemlite's weight-only FP8 linear, one fp8 scale per output channel: the same weight bytes), or say
why not.
Rows named "..._tc" time the same launcher with the decode GEMV path off (kernels/quant/_common.py
GEMV_MAX_ROWS = 0): the tensor-core kernel at decode sizes, so one run compares both paths; grouped rows named
"..._gemv" time it with the grouped-rows bound lifted (GROUPED_GEMV_MAX_ROWS = inf): the GEMV wherever the rows
per expert allow, the rule that bound replaced, so a run at larger batches (--batches 8 16 32 64 128 256) says
where it belongs.
Bytes read count what the product must read once: the weights (and scales) of the experts that received rows
(all of them for dense layers), the activations, and the output written; the dequantize path also counts its
full-size BF16 weight write and re-read. Times ("us"): GPU time per call from CUDA-graph replays with L2
flushed before each call (weights come from HBM; no host launch cost, as in the engine's captured decode
step), after a warm-up that compiles the Triton kernels; "us_eager" is triton.testing.do_bench's median of
Python launches (at decode sizes it includes the launch cost). Rows whose function cannot be captured are
timed eagerly and say so in "timing".
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from functools import partial
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUPER = {"L": 1024, "I": 2688, "E": 512, "top_k": 22}
QWEN = {"D": 2048, "I": 512, "E": 512, "top_k": 10}
QWEN_DENSE = {"q_gate": (8192, 2048), "kv": (512, 2048), "o": (2048, 4096), "gdn_qkvz": (12288, 2048)}
# Nemotron 3 Super's dense projections (N, K) in its per-tensor FP8 release: Mamba2 in_proj (z, xBC, dt:
# 2 * 8192 + 2 * 8 * 128 + 128) and out_proj, attention q / k+v / o
SUPER_DENSE = {"mamba_in": (18560, 4096), "mamba_out": (4096, 8192), "q": (4096, 4096), "kv": (512, 4096),
               "o": (4096, 4096)}
PARTS = ("copy", "nvfp4", "nvfp4_dense", "fp8", "fp8_tensor")
COPY_BYTES = 1 << 30


def nvfp4_weight_bytes(N: int, K: int) -> int:
    """Bytes of one NVFP4 matrix: K/2 code bytes and K/16 e4m3 scales per row, and the fp32 global scale."""
    return N * (K // 2) + N * -(-K // 16) + 4


def block_fp8_weight_bytes(N: int, K: int, scale_bytes: int = 2) -> int:
    """Bytes of one block-FP8 matrix: one byte per weight and one scale per 128 x 128 block."""
    return N * K + -(-N // 128) * -(-K // 128) * scale_bytes


def row(name: str, timing: float | dict, bytes_read: int, copy_gbps: float | None, **meta) -> dict:
    """One JSON row: microseconds (``timing``: a number, or :func:`_bench`'s dict whose "us" is used), bytes,
    GB/s (1e9 bytes per second) and the fraction of the copy bandwidth."""
    t = timing if isinstance(timing, dict) else {"us": timing}
    us = t["us"]
    gbps = bytes_read / (us * 1e-6) / 1e9 if us > 0 else None
    frac = gbps / copy_gbps if gbps is not None and copy_gbps else None
    out = {"name": name, **meta, "us": round(us, 2), "bytes_read": int(bytes_read),
           "gb_per_s": None if gbps is None else round(gbps, 1),
           "fraction_of_copy_bw": None if frac is None else round(frac, 3),
           **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items() if k != "us"}}
    print(json.dumps(out), flush=True)
    return out


FLUSH_BYTES = 256 << 20  # written between runs so weights come from HBM, not the 50 MB L2


def _flushed_graphs(fn, reps: int):
    """([graph of ``reps`` x (L2 flush, fn()), graph of ``reps`` flushes alone], the flush buffer), captured
    after a warm-up call of fn() on the capture stream (what :func:`_graph_us` times and :func:`kernel_us`
    profiles). The flush writes FLUSH_BYTES so that weights come from HBM; the caller keeps the buffer alive
    while it replays the graphs (they write into it)."""
    import torch

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    return graphs, flush


def _graph_us(fn, reps: int = 20, trials: int = 7) -> float:
    """Median GPU microseconds of fn() replayed from a CUDA graph (no launch overhead), L2 flushed before
    each call: a graph of ``reps`` x (flush, fn) minus a graph of ``reps`` flushes, over ``trials``."""
    import torch

    graphs, _flush = _flushed_graphs(fn, reps)  # _flush: alive while the graphs replay
    times = []
    for _ in range(trials):
        pair = []
        for g in graphs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            pair.append(start.elapsed_time(end))
        times.append((pair[0] - pair[1]) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def kernel_us(fn, reps: int = 20) -> dict[str, float]:
    """{"<i>:<kernel name>": device microseconds of the i-th kernel of one fn() call}: where a row's time goes,
    launch by launch (two launches of one kernel, e.g. an ungated expert's up and down projections, stay
    apart). fn() is captured ``reps`` times in one CUDA graph with the L2 flush before each call (as
    :func:`_graph_us`) and the graph replayed once under torch.profiler; the device events, in start order,
    minus the flush's kernels (the names a flush-only graph runs), are reps equal calls. Device durations only:
    the gaps between kernels are not in them, and a kernel launched as a programmatic dependent (PDL) counts
    the time it waits for its predecessor, so with PDL the sum may exceed the row's ``us``.

    Raises:
        RuntimeError: the kernels left after the flush's are not ``reps`` equal calls.
    """
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    runs = []
    graphs, _flush = _flushed_graphs(fn, reps)  # _flush: alive while the graphs replay
    for g in graphs:
        g.replay()  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        runs.append(sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                           key=lambda e: e.time_range.start))
    return per_call_us([(e.name, e.time_range.elapsed_us()) for e in runs[0]], {e.name for e in runs[1]}, reps)


def per_call_us(events: list[tuple[str, float]], flush_names: set[str], reps: int) -> dict[str, float]:
    """:func:`kernel_us`'s split: ``events`` (kernel name, device us) in start order of ``reps`` calls, each
    after a flush whose kernels are named in ``flush_names``, -> {"<i>:<name>": mean us of the call's i-th
    kernel}.

    Raises:
        RuntimeError: the events left after the flush's are not ``reps`` repeats of one sequence.
    """
    events = [(n, us) for n, us in events if n not in flush_names]
    per_call = len(events) // reps
    names = [n for n, _ in events[:per_call]]
    if per_call == 0 or len(events) != per_call * reps or any(
            n != names[i % per_call] for i, (n, _) in enumerate(events)):
        raise RuntimeError(f"kernel_us: {len(events)} kernels in {reps} calls do not repeat one sequence")
    total = [0.0] * per_call
    for i, (_, us) in enumerate(events):
        total[i % per_call] += us
    return {f"{i}:{name}": round(us / reps, 2) for i, (name, us) in enumerate(zip(names, total))}


def _bench(fn, *, graph: bool = True) -> dict:
    """{"us": GPU microseconds per call, "us_eager": the same launched from Python, "timing": how "us" was
    taken}. "us" comes from CUDA-graph replays (:func:`_graph_us`: what a captured decode step pays); with
    ``graph`` False (the dequantize reference: it copies a table to the device, and 20 captured copies of
    its temporaries would not fit) or when capture fails, it is the eager time. Eager: triton.testing.do_bench median, L2 flushed between runs; at decode sizes it includes the
    host's launch cost."""
    from triton.testing import do_bench

    fn()  # compile the Triton kernels, plan cuBLAS
    eager = 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")
    if not graph:
        return {"us": eager, "us_eager": eager, "timing": "eager"}
    try:
        return {"us": _graph_us(fn), "us_eager": eager, "timing": "cuda_graph"}
    except Exception as e:  # noqa: BLE001  (not capturable: report the eager time and why)
        return {"us": eager, "us_eager": eager, "timing": f"eager ({type(e).__name__})"}


def routed_indices(tokens: int, top_k: int, E: int, seed: int):
    """int64 [tokens, top_k] expert ids of random top-k routing on the GPU (distinct experts per token: the
    top-k of uniform random scores)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(tokens, E, device="cuda", generator=gen).topk(top_k, dim=1).indices


def _routing(tokens: int, top_k: int, E: int, seed: int):
    """(P, offsets int32 [E], active experts) of random top-k routing of ``tokens`` tokens (distinct experts
    per token), as MoE routing sorts them."""
    import torch

    idx = routed_indices(tokens, top_k, E, seed)
    counts = torch.bincount(idx.flatten(), minlength=E)
    return idx.numel(), counts.cumsum(0).to(torch.int32), int((counts > 0).sum())


def _bf16_grouped(x, w, offs):
    """The BF16 grouped GEMM of runners/engine/models/moe.py: x [P, K] @ w[e]^T per expert group."""
    import torch

    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def _dequant_then_bf16(x, w, s, s2, offs):
    """Every expert's NVFP4 weight dequantized to BF16 by the reference, then the BF16 grouped GEMM."""
    import torch

    from kernels.quant.nvfp4 import nvfp4_dequantize

    return _bf16_grouped(x, nvfp4_dequantize(w, s, s2, torch.bfloat16), offs)


def _with(module, fn, args, kwargs, **settings):
    """fn(*args, **kwargs) with ``module``'s attributes set to ``settings`` (unittest.mock.patch.multiple),
    put back afterwards, also when fn raises: how the rows below time one kernel choice beside the default."""
    with mock.patch.multiple(module, **settings):
        return fn(*args, **kwargs)


def _tensor_core(fn, *args, **kwargs):
    """Call a kernels/quant launcher with the decode GEMV path off (GEMV_MAX_ROWS = 0): its tensor-core
    kernel at decode sizes, the "_tc" rows beside the default path's (the GEMV), so one run shows both."""
    from kernels.quant import _common

    return _with(_common, fn, args, kwargs, GEMV_MAX_ROWS=0)


def _two_launch_split(fn, *args, **kwargs):
    """fn with every scheme's K split summed by the splitk_sum launch (block_fp8.SERIAL_SPLIT_SCHEMES empty)."""
    from kernels.quant import block_fp8

    return _with(block_fp8, fn, args, kwargs, SERIAL_SPLIT_SCHEMES=())


def _x_load(load, fn, *args, **kwargs):
    """fn with the GEMV kernel loading each activation row's 128-column group as ``load`` ("tile" / "vector")
    on both paths (kernels/quant/block_fp8.py GEMV_X_LOAD; the defaults: dense "tile", grouped "vector"), the
    defaults put back afterwards."""
    from kernels.quant import block_fp8

    return _with(block_fp8, fn, args, kwargs, GEMV_X_LOAD=dict.fromkeys(block_fp8.GEMV_X_LOAD, load))


def _w8a16_dot(fn, *args, **kwargs):
    """fn with every w8a16 product on the tensor-core kernel (kernels/quant/block_fp8.py W8A16_DOT_MIN_ROWS
    set to 1 row on both paths; the defaults, dense from 1 row and grouped never, put back afterwards)."""
    from kernels.quant import block_fp8

    return _with(block_fp8, fn, args, kwargs, W8A16_DOT_MIN_ROWS=dict.fromkeys(block_fp8.W8A16_DOT_MIN_ROWS, 1))


def _nvfp4_direct(fn, *args, **kwargs):
    """fn with kernels/quant/nvfp4.py's "direct" decode in every kernel (DECODE), put back afterwards."""
    from kernels.quant import nvfp4

    return _with(nvfp4, fn, args, kwargs, DECODE=dict.fromkeys(nvfp4.DECODE, "direct"))


def _torch_cast(fn, *args, **kwargs):
    """fn with FP8Linear's activation quantization as the reference's torch ops (a division, a clamp and a
    cast: three launches) instead of kernels.quant.fp8's one launch."""
    from kernels.quant.fp8 import quantize_fp8_ref
    from runners.engine.models import fp8

    return _with(fp8, fn, args, kwargs, quantize_fp8=quantize_fp8_ref)


def gemlite_fp8_linear(w16):
    """A peer from PyPI: gemlite's weight-only FP8 linear (``gemlite.helper.A16W8_FP8``: fp8 weights with one
    scale per output channel against bf16 activations, its Triton GEMV / GEMM chosen and autotuned per batch
    size by gemlite) built from the bf16 weight ``w16`` [N, K] on CUDA: the same weight bytes as ours, a
    coarser scale. Returns the callable module, or the reason it is not there (gemlite not importable: it is
    no dependency of this project; or its build failed) as a str."""
    try:
        from gemlite.helper import A16W8_FP8
    except Exception as e:  # noqa: BLE001 - optional peer: a row that says why
        return f"gemlite not importable ({type(e).__name__}: {e}); pip install gemlite to time it"
    try:
        return A16W8_FP8(device=str(w16.device), dtype=w16.dtype).from_weights(w16)
    except Exception as e:  # noqa: BLE001
        return f"gemlite A16W8_FP8 failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _peer_row(name: str, peer, x, nbytes: int, copy_gbps: float, **meta) -> dict:
    """The row of a peer's call ``peer(x)`` (timed like ours), or {"name", "error", meta} where ``peer`` is the
    reason it cannot run (a str) or its call raises."""
    if isinstance(peer, str):
        out = {"name": name, "error": peer, **meta}
    else:
        try:
            return row(name, _bench(lambda: peer(x)), nbytes, copy_gbps, **meta)
        except Exception as e:  # noqa: BLE001 - a peer's failure is a row, not a crash
            out = {"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                   **meta}
    print(json.dumps(out), flush=True)  # as row() prints: the log says why the peer is missing
    return out


def _rows_rule(fn, *args, **kwargs):
    """Call a grouped kernels/quant launcher with the grouped-rows bound lifted (GROUPED_GEMV_MAX_ROWS of
    every format's kernel file = inf): the GEMV wherever the rows per expert allow it (<= GEMV_MAX_ROWS), the
    rule before that bound, the "_gemv" rows beside the default's and the "_tc" ones."""
    from kernels.quant import block_fp8, nvfp4

    with mock.patch.object(nvfp4, "GROUPED_GEMV_MAX_ROWS", float("inf")):
        return _with(block_fp8, fn, args, kwargs, GROUPED_GEMV_MAX_ROWS=float("inf"))


def part_copy() -> dict:
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    from triton.testing import do_bench

    us = 1e3 * do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    gbps = 2 * COPY_BYTES / (us * 1e-6) / 1e9
    out = {"name": "device_copy", "bytes": 2 * COPY_BYTES, "us": round(us, 2), "gb_per_s": round(gbps, 1)}
    print(json.dumps(out), flush=True)
    return out


def part_nvfp4(batches: list[int], copy_gbps: float) -> list[dict]:
    import torch

    from kernels.quant.nvfp4 import nvfp4_grouped_mm

    E, top_k = SUPER["E"], SUPER["top_k"]
    rows = []
    for proj, (N, K) in {"up": (SUPER["I"], SUPER["L"]), "down": (SUPER["L"], SUPER["I"])}.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = (torch.rand(E, N, K // 16, device="cuda", generator=gen) * 1.5 + 0.25).to(torch.float8_e4m3fn)
        s2 = torch.rand(E, device="cuda", generator=gen) * 0.01 + 0.005
        w_bf16 = torch.randn(E, N, K, device="cuda", generator=gen, dtype=torch.bfloat16)
        for B in batches:
            P, offs, active = _routing(B, top_k, E, seed=B)
            x = torch.randn(P, K, device="cuda", dtype=torch.bfloat16)
            io = (P * K + P * N) * 2
            meta = {"proj": proj, "N": N, "K": K, "batch": B, "pairs": P, "active_experts": active}
            rows.append(row("nvfp4_grouped", _bench(partial(nvfp4_grouped_mm, x, w, s, s2, offs)),
                            active * nvfp4_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("nvfp4_grouped_tc",
                            _bench(partial(_tensor_core, nvfp4_grouped_mm, x, w, s, s2, offs)),
                            active * nvfp4_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("nvfp4_grouped_gemv",
                            _bench(partial(_rows_rule, nvfp4_grouped_mm, x, w, s, s2, offs)),
                            active * nvfp4_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("nvfp4_grouped_tc_direct",
                            _bench(partial(_nvfp4_direct, _tensor_core, nvfp4_grouped_mm, x, w, s, s2, offs)),
                            active * nvfp4_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("nvfp4_grouped_gemv_direct",
                            _bench(partial(_nvfp4_direct, _rows_rule, nvfp4_grouped_mm, x, w, s, s2, offs)),
                            active * nvfp4_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("bf16_grouped", _bench(partial(_bf16_grouped, x, w_bf16, offs)),
                            active * N * K * 2 + io, copy_gbps, **meta))
            rows.append(row("nvfp4_dequant_then_bf16_grouped",
                            _bench(partial(_dequant_then_bf16, x, w, s, s2, offs), graph=False),
                            E * nvfp4_weight_bytes(N, K) + 2 * E * N * K * 2 + io, copy_gbps, **meta))
    return rows


def gemlite_nvfp4_linear(w, s, s2):
    """A peer from PyPI: gemlite's weight-only NVFP4 linear (``gemlite.helper.A16W4_NVFP``, bf16 activations)
    built from one ModelOpt NVFP4 triple (w uint8 [N, K/2], s float8_e4m3fn [N, K/16], s2 float32 0-dim) on
    CUDA, its packed codes taken as they are. gemlite multiplies its accumulator by 1 / ``meta_scale``, so
    meta_scale = 1 / s2. Returns the callable module, or why it is not there (a str), as
    :func:`gemlite_fp8_linear`."""
    import torch

    try:
        from gemlite.helper import A16W4_NVFP
    except Exception as e:  # noqa: BLE001 - optional peer: a row that says why
        return f"gemlite not importable ({type(e).__name__}: {e}); pip install gemlite to time it"
    try:
        return A16W4_NVFP(device=str(w.device), dtype=torch.bfloat16).from_packed_weights(
            w, scales=s, meta_scale=(1.0 / s2.float()).reshape(()))
    except Exception as e:  # noqa: BLE001
        return f"gemlite A16W4_NVFP failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def max_rel_err(y, ref) -> float:
    """max |y - ref| / max |ref| in float32 (inf where y has a non-finite value or another shape)."""
    import torch

    if tuple(y.shape) != tuple(ref.shape) or not bool(torch.isfinite(y).all()):
        return float("inf")
    d = (y.float() - ref.float()).abs().max()
    return float(d / ref.float().abs().max().clamp_min(1e-30))


def part_nvfp4_dense(batches: list[int], copy_gbps: float) -> list[dict]:
    """The ``nvfp4_dense`` rows (module docstring): Super V3's expert matrices (up, down) as dense NVFP4
    linears at M = batch, ours vs gemlite's vs BF16, with the bytes each must read and its share of the copy
    bandwidth ``copy_gbps`` (GB/s) measured in the same run. Needs CUDA."""
    import torch
    import torch.nn.functional as F

    from kernels.quant.nvfp4 import nvfp4_linear, nvfp4_linear_ref, nvfp4_quantize

    rows = []
    for proj, (N, K) in {"up": (SUPER["I"], SUPER["L"]), "down": (SUPER["L"], SUPER["I"])}.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        w16 = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        w, s, s2 = nvfp4_quantize(w16.float())
        peer = gemlite_nvfp4_linear(w, s, s2)
        for B in batches:
            x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
            io = (B * K + B * N) * 2
            meta = {"proj": proj, "N": N, "K": K, "batch": B}
            ref = nvfp4_linear_ref(x, w, s, s2)
            rows.append(row("nvfp4_linear", _bench(partial(nvfp4_linear, x, w, s, s2)),
                            nvfp4_weight_bytes(N, K) + io, copy_gbps,
                            max_rel_err=round(max_rel_err(nvfp4_linear(x, w, s, s2), ref), 5), **meta))
            if not isinstance(peer, str):
                try:
                    meta["peer_max_rel_err"] = round(max_rel_err(peer(x), ref), 5)
                except Exception as e:  # noqa: BLE001 - _peer_row reports the failure
                    meta["peer_max_rel_err"] = f"{type(e).__name__}"
            rows.append(_peer_row("gemlite_a16w4_nvfp4", peer, x, nvfp4_weight_bytes(N, K) + io, copy_gbps,
                                  **meta))
            meta.pop("peer_max_rel_err", None)
            rows.append(row("bf16_linear", _bench(partial(F.linear, x, w16)), N * K * 2 + io, copy_gbps,
                            **meta))
    return rows


def part_fp8(batches: list[int], copy_gbps: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels.quant.block_fp8 import (
        block_fp8_grouped_mm,
        block_fp8_linear,
        block_fp8_quantize,
        block_scaled_mm_supported,
    )

    rows = []
    scaled_mm = block_scaled_mm_supported("cuda")
    for proj, (N, K) in QWEN_DENSE.items():
        w, ws = block_fp8_quantize(torch.randn(N, K, device="cuda"))
        ws = ws.to(torch.bfloat16)
        w_bf16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        peer = gemlite_fp8_linear(w_bf16)
        for B in batches:
            x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
            io = (B * K + B * N) * 2
            meta = {"proj": proj, "N": N, "K": K, "batch": B}
            rows.append(_peer_row("gemlite_a16w8_fp8", peer, x, N * K + N * 4 + io, copy_gbps, **meta))
            rows.append(row("block_fp8_linear_triton", _bench(partial(block_fp8_linear, x, w, ws, impl="triton")),
                            block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_linear_tc",
                            _bench(partial(_tensor_core, block_fp8_linear, x, w, ws, impl="triton")),
                            block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_linear_w8a16", _bench(partial(block_fp8_linear, x, w, ws, scheme="w8a16")),
                            block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_linear_w8a16_xvec",
                            _bench(partial(_x_load, "vector", block_fp8_linear, x, w, ws, scheme="w8a16")),
                            block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_linear_w8a16_dot",
                            _bench(partial(_w8a16_dot, block_fp8_linear, x, w, ws, scheme="w8a16")),
                            block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_linear_w8a16_2launch",
                            _bench(partial(_two_launch_split, block_fp8_linear, x, w, ws, scheme="w8a16")),
                            block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            if scaled_mm:
                rows.append(row("block_fp8_linear_scaled_mm",
                                _bench(partial(block_fp8_linear, x, w, ws, impl="scaled_mm")),
                                block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("bf16_linear", _bench(partial(F.linear, x, w_bf16)), N * K * 2 + io, copy_gbps,
                            **meta))
    E, top_k = QWEN["E"], QWEN["top_k"]
    for proj, (N, K) in {"up": (QWEN["I"], QWEN["D"]), "down": (QWEN["D"], QWEN["I"])}.items():
        w, ws = block_fp8_quantize(torch.randn(E, N, K, device="cuda"))
        ws = ws.to(torch.bfloat16)
        w_bf16 = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
        for B in batches:
            P, offs, active = _routing(B, top_k, E, seed=B)
            x = torch.randn(P, K, device="cuda", dtype=torch.bfloat16)
            io = (P * K + P * N) * 2
            meta = {"proj": proj, "N": N, "K": K, "batch": B, "pairs": P, "active_experts": active}
            rows.append(row("block_fp8_grouped", _bench(partial(block_fp8_grouped_mm, x, w, ws, offs)),
                            active * block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_grouped_tc",
                            _bench(partial(_tensor_core, block_fp8_grouped_mm, x, w, ws, offs)),
                            active * block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_grouped_gemv",
                            _bench(partial(_rows_rule, block_fp8_grouped_mm, x, w, ws, offs)),
                            active * block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_grouped_w8a16",
                            _bench(partial(block_fp8_grouped_mm, x, w, ws, offs, scheme="w8a16")),
                            active * block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_grouped_w8a16_dot",
                            _bench(partial(_w8a16_dot, block_fp8_grouped_mm, x, w, ws, offs, scheme="w8a16")),
                            active * block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("block_fp8_grouped_w8a16_xtile",
                            _bench(partial(_x_load, "tile", block_fp8_grouped_mm, x, w, ws, offs, scheme="w8a16")),
                            active * block_fp8_weight_bytes(N, K) + io, copy_gbps, **meta))
            rows.append(row("bf16_grouped", _bench(partial(_bf16_grouped, x, w_bf16, offs)),
                            active * N * K * 2 + io, copy_gbps, **meta))
    return rows


def part_fp8_tensor(batches: list[int], copy_gbps: float) -> list[dict]:
    """The ``fp8_tensor`` rows (module docstring): per SUPER_DENSE shape and batch, ``fp8_linear`` (scaled_mm),
    ``fp8_linear_w8a16`` and BF16 ``F.linear``, each with the bytes it must read and its share of the copy
    bandwidth ``copy_gbps`` (GB/s) measured in the same run. Needs CUDA."""
    import torch
    import torch.nn.functional as F

    from runners.engine.models.fp8 import fp8_linear, fp8_linear_w8a16

    rows = []
    for proj, (N, K) in SUPER_DENSE.items():
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        scale = (w16.float().abs().max() / 448).reshape(())
        w8 = (w16.float() / scale).to(torch.float8_e4m3fn)
        input_scale = torch.tensor(0.05, device="cuda")
        peer = gemlite_fp8_linear(w16)
        for B in batches:
            x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
            io = (B * K + B * N) * 2
            meta = {"proj": proj, "N": N, "K": K, "batch": B}
            rows.append(row("fp8_linear_scaled_mm", _bench(partial(fp8_linear, x, w8, scale, input_scale)),
                            N * K + io, copy_gbps, **meta))
            rows.append(_peer_row("gemlite_a16w8_fp8", peer, x, N * K + N * 4 + io, copy_gbps, **meta))
            rows.append(row("fp8_linear_scaled_mm_torchcast",
                            _bench(partial(_torch_cast, fp8_linear, x, w8, scale, input_scale)),
                            N * K + io, copy_gbps, **meta))
            rows.append(row("fp8_linear_w8a16", _bench(partial(fp8_linear_w8a16, x, w8, scale)), N * K + io,
                            copy_gbps, **meta))
            rows.append(row("fp8_linear_w8a16_xvec",
                            _bench(partial(_x_load, "vector", fp8_linear_w8a16, x, w8, scale)),
                            N * K + io, copy_gbps, **meta))
            rows.append(row("fp8_linear_w8a16_dot", _bench(partial(_w8a16_dot, fp8_linear_w8a16, x, w8, scale)),
                            N * K + io, copy_gbps, **meta))
            rows.append(row("bf16_linear", _bench(partial(F.linear, x, w16)), N * K * 2 + io, copy_gbps,
                            **meta))
    return rows


def speedups(rows: list[dict], fast: str, base: str) -> dict:
    """{"<proj>_b<batch>": base us / fast us} for rows of the same proj and batch (rows that hold an error
    instead of a time, as a peer's that is not installed, are left out)."""
    key = lambda r: f"{r['proj']}_b{r['batch']}"
    b = {key(r): r["us"] for r in rows if r["name"] == base and "us" in r}
    return {key(r): round(b[key(r)] / r["us"], 2) for r in rows
            if r["name"] == fast and "us" in r and key(r) in b}


def write_report(report: dict, out: str | Path) -> None:
    """Write a benchmark's JSON ``report`` to ``out`` (its folder created; indent 2, a final newline) and say
    where: the last step of every GPU benchmark's main."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def gpu_report(prog: str, argv: list[str] | None) -> dict | None:
    """The head of a GPU benchmark's JSON (the command and the machine), or None after printing an error /
    fix pair when no CUDA device is present (the caller exits 2)."""
    import torch

    if not torch.cuda.is_available():
        print(f"error: no CUDA device here; {prog} times GPU kernels\n  fix: run it on the GPU machine "
              "(tests/gpu/run_checks.sh)", file=sys.stderr)
        return None
    return {"command": " ".join([prog, *(argv or sys.argv[1:])]),
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "device": torch.cuda.get_device_name(0),
                        "capability": list(torch.cuda.get_device_capability(0))}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_quant_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8], help="decode tokens per step")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    args = p.parse_args(argv)
    if min(args.batches) < 1:
        p.error("--batches must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    report = gpu_report("python -m benchmarks.bench_quant_gemm", argv)
    if report is None:
        return 2
    copy = part_copy()  # always: every row's fraction refers to it
    report["copy"] = copy
    bw = copy["gb_per_s"]
    if "nvfp4" in args.parts:
        rows = part_nvfp4(args.batches, bw)
        report["nvfp4"] = {"rows": rows,
                           "speedup_vs_bf16_grouped": speedups(rows, "nvfp4_grouped", "bf16_grouped"),
                           "tc_speedup_vs_bf16_grouped": speedups(rows, "nvfp4_grouped_tc", "bf16_grouped"),
                           "tc_direct_vs_convert": speedups(rows, "nvfp4_grouped_tc_direct", "nvfp4_grouped_tc"),
                           "gemv_direct_vs_convert": speedups(rows, "nvfp4_grouped_gemv_direct",
                                                              "nvfp4_grouped_gemv"),
                           "speedup_vs_dequant_then_bf16": speedups(rows, "nvfp4_grouped",
                                                                    "nvfp4_dequant_then_bf16_grouped")}
    if "nvfp4_dense" in args.parts:
        rows = part_nvfp4_dense(args.batches, bw)
        report["nvfp4_dense"] = {"rows": rows,
                                 "speedup_vs_gemlite": speedups(rows, "nvfp4_linear", "gemlite_a16w4_nvfp4"),
                                 "speedup_vs_bf16": speedups(rows, "nvfp4_linear", "bf16_linear")}
    if "fp8" in args.parts:
        from kernels.quant.block_fp8 import block_scaled_mm_supported

        rows = part_fp8(args.batches, bw)
        report["fp8"] = {"rows": rows, "block_scaled_mm_supported": block_scaled_mm_supported("cuda"),
                         "dense_speedup_vs_bf16": speedups(rows, "block_fp8_linear_triton", "bf16_linear"),
                         "grouped_speedup_vs_bf16": speedups(rows, "block_fp8_grouped", "bf16_grouped"),
                         "tc_dense_speedup_vs_bf16": speedups(rows, "block_fp8_linear_tc", "bf16_linear"),
                         "tc_grouped_speedup_vs_bf16": speedups(rows, "block_fp8_grouped_tc", "bf16_grouped"),
                         "w8a16_dense_speedup_vs_bf16": speedups(rows, "block_fp8_linear_w8a16", "bf16_linear"),
                         "w8a16_dense_speedup_vs_w8a8": speedups(rows, "block_fp8_linear_w8a16",
                                                                 "block_fp8_linear_triton"),
                         "w8a16_serial_vs_2launch": speedups(rows, "block_fp8_linear_w8a16",
                                                             "block_fp8_linear_w8a16_2launch"),
                         "w8a16_grouped_speedup_vs_bf16": speedups(rows, "block_fp8_grouped_w8a16", "bf16_grouped"),
                         "w8a16_xvec_vs_tile": speedups(rows, "block_fp8_linear_w8a16_xvec",
                                                        "block_fp8_linear_w8a16"),
                         "w8a16_grouped_xvec_vs_tile": speedups(rows, "block_fp8_grouped_w8a16",
                                                                "block_fp8_grouped_w8a16_xtile"),
                         "w8a16_vs_gemlite": speedups(rows, "block_fp8_linear_w8a16", "gemlite_a16w8_fp8"),
                         "w8a16_dot_vs_gemv": speedups(rows, "block_fp8_linear_w8a16_dot", "block_fp8_linear_w8a16"),
                         "w8a16_grouped_dot_vs_gemv": speedups(rows, "block_fp8_grouped_w8a16_dot",
                                                               "block_fp8_grouped_w8a16")}
    if "fp8_tensor" in args.parts:
        rows = part_fp8_tensor(args.batches, bw)
        report["fp8_tensor"] = {"rows": rows,
                                "w8a16_speedup_vs_scaled_mm": speedups(rows, "fp8_linear_w8a16",
                                                                       "fp8_linear_scaled_mm"),
                                "w8a16_speedup_vs_bf16": speedups(rows, "fp8_linear_w8a16", "bf16_linear"),
                                "w8a16_xvec_vs_tile": speedups(rows, "fp8_linear_w8a16_xvec", "fp8_linear_w8a16"),
                                "w8a16_dot_vs_gemv": speedups(rows, "fp8_linear_w8a16_dot", "fp8_linear_w8a16"),
                                "w8a16_dot_vs_scaled_mm": speedups(rows, "fp8_linear_w8a16_dot",
                                                                   "fp8_linear_scaled_mm"),
                                "quant_kernel_vs_torch_cast": speedups(rows, "fp8_linear_scaled_mm",
                                                                       "fp8_linear_scaled_mm_torchcast"),
                                "scaled_mm_vs_gemlite": speedups(rows, "fp8_linear_scaled_mm",
                                                                 "gemlite_a16w8_fp8"),
                                "scaled_mm_speedup_vs_bf16": speedups(rows, "fp8_linear_scaled_mm",
                                                                      "bf16_linear")}
    for part in ("nvfp4", "nvfp4_dense", "fp8", "fp8_tensor"):
        for k, v in report.get(part, {}).items():
            if k != "rows":
                print(f"{part} {k}: {json.dumps(v)}")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
