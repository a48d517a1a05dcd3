"""Where the device time of each CUDA-graph decode step goes, read from a torch.profiler Chrome trace.

    python -m benchmarks.profile_breakdown TRACE.json [--json OUT.json] [--top 10]

Input: the Chrome trace torch.profiler writes with ``prof.export_chrome_trace`` (the format of PyTorch's
``torch/autograd/profiler_util.py`` / Kineto's ``ChromeTraceLogger``: a JSON object whose ``traceEvents``
are Trace Event Format "X" events with ``ts`` and ``dur`` in microseconds), e.g. the
DIR/profile_<point>.json of ``python -m benchmarks.bench_e2e --profile MODEL:ARM:BATCH:graphs``, which
profiles one ``engine.generate``: an eager prefill, then decode steps whose phases replay CUDA graphs.

What it measures, from the device events only (cat ``kernel``, ``gpu_memcpy``, ``gpu_memset``; all three are
called "kernels" below): per CUDA-graph replay, the number of kernels, the busy time (the summed ``dur`` of
its kernels, us) and the span (first kernel start to last kernel end, us; span - busy is the device idle
inside the replay), and the busy time per kernel category. Nothing here is a host (CPU) time.

How replays are found: each ``cudaGraphLaunch`` runtime event (cat ``cuda_runtime``) is one replay. CUPTI
gives the kernels of a replayed graph the ``args.correlation`` of their ``cudaGraphLaunch`` (checked on an
H200 trace of Qwen3-Next: every kernel and memset of the decode steps carries one), so a kernel belongs to
the replay of its correlation. A device event whose correlation matches no runtime or driver event (a trace
recorded without correlations) is ``unattributed``: it is not guessed into a replay by time, because graph
launches are asynchronous (the host can launch the next graph before the device starts the previous one), so
the last launch before a kernel is not its launch. Every other device event is eager: ``eager before the
first replay`` is the prefill (plus the setup before it), ``eager after the first replay`` is the decode
loop's host-driven work between replays (token copies).

Replays are grouped by signature, the sequence of their kernel names in start order, so identical graphs
(e.g. the MTP ``draft``, ``verify``, ``commit`` and ``catchup`` phases of runners/engine/graphs.py, one graph
each) are aggregated: groups are named G1, G2, ... in order of first replay, and the replay sequence is
reported as its shortest repeating pattern (one decode step when every step replays the same graphs).

Categories: :data:`CATEGORIES`, an ordered list of (category, regular expression) rules matched with
``re.search`` against the kernel name (memcpy / memset events are named "Memcpy ..." / "Memset ..."); the
first rule that matches wins, and a name no rule matches is "other". Inductor's fused kernels come first
because their generated names list the ATen ops they fuse (``triton_poi_fused__scaled_dot_product_..._where``
is a mask, not attention). The rules were tuned on that Qwen3-Next trace (graphs, torch.compile, SSM replay),
where "other" is empty; a kernel of another model may land in "other": the top kernels list names it.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from registry.errors import UserError, exits_on_user_error

# (category, regex) in match order; first match wins; "other" catches the rest. Sources of the names:
# kernels/moe_gemv.py and kernels/quant/<format>.py (_pair_*_kernel, _combine_kernel), torch._grouped_mm
# (CUTLASS GroupProblemShape, prepare_grouped_gemm_data), kernels/router.py (_topk_route_kernel; ATen's
# radix sort of the prefill's token-by-expert argsort), kernels/gdn, kernels/mamba2 and kernels/commit.py
# (replay / ssd / ssu / rewind_commit kernels), fla-core's chunk_* / recompute_w_u kernels, cuDNN SDPA,
# kernels/quant (_quant_group_kernel, *_mm_kernel, *_gemv_kernel, _splitk_sum_kernel), cuBLAS / cuBLASLt
# (nvjet, xmma, splitKreduce, gemvx, dot_kernel), inductor (triton_poi_ / triton_red_ / triton_per_
# pointwise / reduction, triton_tem_ templates), ATen native (at::native::..., cub).
CATEGORIES: list[tuple[str, str]] = [
    ("inductor fused", r"^triton_(poi|red|per)_"),
    ("routed experts", r"_pair_|moe_gemv|grouped_mm|grouped_gemm|GroupProblemShape|cutlass.*grouped"
                       r"|_combine_kernel|fused_moe"),
    ("router", r"topk|_route|radixSort|sort"),
    ("SSM / GDN", r"replay|_gdn|gated_delta|(^|_)chunk_|recompute_w_u|mamba|ssd|selective_(scan|state)|ssu"
                  r"|rewind_commit"),
    ("attention", r"sdpa|flash|attn|fmha|attention"),
    ("conv", r"conv"),
    ("activation quantize", r"_quant_group|quantize"),
    ("dense GEMM", r"nvjet|gemm|gemv|xmma|cublas|splitK|splitk_sum|_mm_kernel|^triton_tem_"),
    ("copy / cast / memset", r"^Memcpy|^Memset|memcpy|direct_copy|_copy_kernel|CatArrayBatchedCopy"),
    ("ATen elementwise / reduce", r"at::native|at_cuda_detail|cub::|elementwise|reduce_kernel|vectorized"),
]
OTHER = "other"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API (cuLaunchKernel)
GRAPH_LAUNCH = "cudaGraphLaunch"
EAGER_BEFORE = "eager before the first replay (prefill)"
EAGER_AFTER = "eager after the first replay"
UNATTRIBUTED = "unattributed (no launch correlation)"
_COMPILED = [(name, re.compile(rx)) for name, rx in CATEGORIES]


def categorize(name: str) -> str:
    """The category of kernel `name`: the first :data:`CATEGORIES` rule whose regex `re.search`-es it, else
    :data:`OTHER`."""
    for cat, rx in _COMPILED:
        if rx.search(name):
            return cat
    return OTHER


def load_trace(path) -> list[dict]:
    """The ``traceEvents`` of the Chrome trace at `path` (a JSON object, or a bare event list).

    Raises:
        UserError: the file is missing or unreadable, is not JSON, is not a trace, or holds no device
            kernel events (a profile without ``ProfilerActivity.CUDA``).
    """
    fix = ("pass the DIR/profile_<point>.json that torch.profiler's export_chrome_trace wrote, e.g. "
           "python -m benchmarks.bench_e2e --out DIR --profile qwen3_next:replay:1:graphs on a GPU machine")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})", fix) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})", fix) from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise UserError(f"{path}: not a Chrome trace (traceEvents must be a list of event objects)", fix)
    for i, e in enumerate(events):  # the fields the breakdown reads, on the events it reads them from
        if e.get("cat") in DEVICE_CATS + HOST_LAUNCH_CATS and not (
                isinstance(e.get("name"), str) and isinstance(e.get("ts"), (int, float))
                and isinstance(e.get("dur", 0), (int, float))):
            raise UserError(f"{path}: event {i} (cat {e.get('cat')!r}) lacks a string 'name' or numeric 'ts' / "
                            "'dur': not a trace torch.profiler wrote", fix)
    if not any(e.get("cat") == "kernel" for e in events):
        raise UserError(f"{path}: no device kernel events (cat 'kernel'): the profile did not record CUDA "
                        "activity", fix + ", with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]")
    return events


def _corr(e: dict):
    return (e.get("args") or {}).get("correlation")


def split_replays(events: list[dict]) -> tuple[list[list[dict]], list[dict], list[dict], list[dict]]:
    """Assign the device events of a trace to CUDA-graph replays (module docstring: how).

    events: Chrome trace events (dicts with cat, name, ts, dur in us, args.correlation).
    Returns (replays, eager_before, eager_after, unattributed): one list of device events per
    ``cudaGraphLaunch`` in launch order (empty for a launch none matched), each sorted by start; the eager
    device events that start before and after the first replay's launch; the device events whose
    correlation matches no runtime / driver event; all sorted by start. Mutates nothing.
    """
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") == GRAPH_LAUNCH),
                      key=lambda e: e["ts"])
    index = {_corr(e): i for i, e in enumerate(launches) if _corr(e) is not None}
    runtime_corr = {_corr(e) for e in events if e.get("cat") in HOST_LAUNCH_CATS}
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    replays: list[list[dict]] = [[] for _ in launches]
    eager: list[dict] = []
    unattributed: list[dict] = []
    for e in device:
        c = _corr(e)
        if c in index:
            replays[index[c]].append(e)
        elif c is None or c not in runtime_corr:
            unattributed.append(e)
        else:
            eager.append(e)
    first = launches[0]["ts"] if launches else float("inf")
    return (replays, [e for e in eager if e["ts"] < first], [e for e in eager if e["ts"] >= first],
            unattributed)


def _stats(kernels: list[dict]) -> dict:
    """count, busy_us (summed dur), span_us (first start to last end), by_category {cat: busy us}."""
    by_cat: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_cat[categorize(k["name"])] += k["dur"]
    span = max(k["ts"] + k["dur"] for k in kernels) - kernels[0]["ts"] if kernels else 0.0
    return {"kernels": len(kernels), "busy_us": sum(k["dur"] for k in kernels), "span_us": span,
            "by_category": dict(by_cat)}


def _top(kernels: list[dict], n: int, per: int) -> list[dict]:
    """The `n` kernel names with the most summed time, per occurrence-unit `per` (replays of a group)."""
    agg: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        agg[k["name"]][0] += 1
        agg[k["name"]][1] += k["dur"]
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": name, "category": categorize(name), "calls": c / per, "us": t / per} for name, (c, t) in rows]


def _mean_cats(stats: list[dict]) -> dict[str, float]:
    tot: dict[str, float] = defaultdict(float)
    for s in stats:
        for cat, us in s["by_category"].items():
            tot[cat] += us
    order = [c for c, _ in CATEGORIES] + [OTHER]
    return {c: tot[c] / len(stats) for c in order if c in tot}


def _pattern(seq: list[str]) -> tuple[list[str], int]:
    """The shortest prefix p of `seq` that `seq` repeats (seq[i] == p[i % len(p)], a partial last repetition
    allowed: a generation can stop inside a step) and how many whole times; ([], 0) for no replays."""
    for n in range(1, len(seq) + 1):
        if all(seq[i] == seq[i % n] for i in range(len(seq))):
            return seq[:n], len(seq) // n
    return [], 0


def breakdown(events: list[dict], top: int = 10) -> dict:
    """The per-replay breakdown of a trace's device time (module docstring: what and how).

    events: the trace's events (:func:`load_trace`). top: kernel names listed per group.
    Returns a JSON-able dict: ``categories`` (the rules), ``replays`` (number of graph launches),
    ``groups`` (per signature, in order of first replay: name, replays, kernels, busy_us and span_us per
    replay (mean, and the per-replay lists), by_category_us (mean per replay), top), ``sequence`` (the group
    of each replay), ``step`` (the repeating pattern of groups, its repeats, the replays of a partial last
    repetition and the mean device span, busy time and busy time by category of one repetition) and ``eager`` (the two eager parts
    and the unattributed events: kernels, busy_us, span_us, by_category_us, top). Raises nothing on a trace
    without graph launches (no groups).
    """
    replays, before, after, unattributed = split_replays(events)
    sigs: dict[tuple, str] = {}
    members: dict[str, list[int]] = defaultdict(list)
    sequence = []
    for i, ks in enumerate(replays):
        sig = tuple(k["name"] for k in ks)
        name = sigs.setdefault(sig, f"G{len(sigs) + 1}")
        members[name].append(i)
        sequence.append(name)
    groups = []
    for name, idx in members.items():
        st = [_stats(replays[i]) for i in idx]
        groups.append({"name": name, "replays": len(idx), "kernels": st[0]["kernels"],
                       "busy_us": sum(s["busy_us"] for s in st) / len(st),
                       "span_us": sum(s["span_us"] for s in st) / len(st),
                       "busy_us_each": [s["busy_us"] for s in st], "span_us_each": [s["span_us"] for s in st],
                       "by_category_us": _mean_cats(st),
                       "top": _top([k for i in idx for k in replays[i]], top, len(idx))})
    pat, reps = _pattern(sequence)
    step = {"pattern": pat, "repeats": reps, "partial": len(sequence) - reps * len(pat)}
    if sequence:
        n = len(pat)
        cycles = [[k for i in range(c * n, c * n + n) for k in replays[i]] for c in range(reps)]
        cyc = [_stats(sorted(ks, key=lambda k: k["ts"])) for ks in cycles if ks]
        if cyc:
            step["busy_us"] = sum(s["busy_us"] for s in cyc) / len(cyc)
            step["span_us"] = sum(s["span_us"] for s in cyc) / len(cyc)
            step["by_category_us"] = _mean_cats(cyc)
    eager = {}
    for label, ks in ((EAGER_BEFORE, before), (EAGER_AFTER, after), (UNATTRIBUTED, unattributed)):
        s = _stats(ks)
        eager[label] = {"kernels": s["kernels"], "busy_us": s["busy_us"], "span_us": s["span_us"],
                        "by_category_us": _mean_cats([s]) if ks else {}, "top": _top(ks, top, 1)}
    return {"categories": [list(c) for c in CATEGORIES] + [[OTHER, ""]], "replays": len(replays),
            "groups": groups, "sequence": sequence, "step": step, "eager": eager}


def _short(name: str, width: int) -> str:
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[:width - 3] + "..."


def format_report(rep: dict, width: int = 90) -> str:
    """The readable tables of a :func:`breakdown` result: groups, category us (and share) per replay, top
    kernels per group, the eager parts."""
    cols = [(g["name"], g["by_category_us"], g["busy_us"]) for g in rep["groups"]]
    step = rep["step"]
    if len(step["pattern"]) > 1 and "by_category_us" in step:  # one repetition of the pattern: a decode step
        cols.append(("pattern", step["by_category_us"], step["busy_us"]))
    short = {EAGER_BEFORE: "prefill", EAGER_AFTER: "eager-after", UNATTRIBUTED: "unattrib."}
    cols += [(short[label], e["by_category_us"], e["busy_us"]) for label, e in rep["eager"].items()
             if e["kernels"] or label != UNATTRIBUTED]
    out = [f"{rep['replays']} CUDA-graph replays in {len(rep['groups'])} signatures; device times in us "
           "(busy = summed kernel time, span = first kernel start to last kernel end)", ""]
    out.append(f"{'group':<12}{'replays':>8}{'kernels/replay':>16}{'busy/replay':>13}{'span/replay':>13}"
               f"{'busy/span':>10}")
    for g in rep["groups"]:
        out.append(f"{g['name']:<12}{g['replays']:>8}{g['kernels']:>16}{g['busy_us']:>13.1f}{g['span_us']:>13.1f}"
                   f"{g['busy_us'] / g['span_us'] if g['span_us'] else 0:>10.0%}")
    pre = rep["eager"][EAGER_BEFORE]
    out.append(f"{'prefill':<12}{'-':>8}{pre['kernels']:>16}{pre['busy_us']:>13.1f}{pre['span_us']:>13.1f}"
               f"{pre['busy_us'] / pre['span_us'] if pre['span_us'] else 0:>10.0%}")
    post = rep["eager"][EAGER_AFTER]  # spread between the replays: its span is not one piece of work
    out.append(f"{'eager-after':<12}{'-':>8}{post['kernels']:>16}{post['busy_us']:>13.1f}{'-':>13}{'-':>10}")
    lost = rep["eager"][UNATTRIBUTED]
    if lost["kernels"]:
        out.append(f"{'unattrib.':<12}{'-':>8}{lost['kernels']:>16}{lost['busy_us']:>13.1f}{'-':>13}{'-':>10}  "
                   "<- device events whose correlation matches no launch: the trace lacks correlations, "
                   "so their replay is unknown")
    if rep["sequence"]:
        line = f"replay pattern: {' '.join(step['pattern'])} x {step['repeats']}"
        if step["partial"]:
            line += f" (+ {step['partial']} replays of a partial repetition)"
        if "span_us" in step:
            line += (f"; per repetition: busy {step['busy_us']:.1f} us, span {step['span_us']:.1f} us "
                     f"(first kernel of {step['pattern'][0]} to last kernel of {step['pattern'][-1]})")
        out.append(line)
    out += ["", "busy us per replay by category (share of the column's busy time); pattern: per repetition of "
            "the replay pattern;", "prefill, eager-after (and unattrib.): totals; a category empty in every "
            "column is left out",
            f"{'category':<27}" + "".join(f"{name:>17}" for name, _, _ in cols)]
    for cat in [c for c, _ in CATEGORIES] + [OTHER]:
        if cat != OTHER and not any(d.get(cat) for _, d, _ in cols):
            continue
        cells = [f"{d.get(cat, 0.0):>8.1f} ({d.get(cat, 0.0) / busy if busy else 0:>4.0%})" for _, d, busy in cols]
        out.append(f"{cat:<27}" + "".join(f"{c:>17}" for c in cells))
    for g in rep["groups"]:
        out += ["", f"{g['name']}: top kernels per replay ({g['kernels']} kernels, {g['busy_us']:.1f} us busy)"]
        out += [f"  {t['us']:>8.1f} us {t['calls']:>5.0f}x  {t['category']:<26} {_short(t['name'], width)}"
                for t in g["top"]]
    for label, e in rep["eager"].items():
        if label == UNATTRIBUTED and not e["kernels"]:
            continue
        out += ["", f"{label}: top kernels ({e['kernels']} kernels, {e['busy_us']:.1f} us busy)"]
        out += [f"  {t['us']:>8.1f} us {t['calls']:>5.0f}x  {t['category']:<26} {_short(t['name'], width)}"
                for t in e["top"]]
    return "\n".join(out)


@exits_on_user_error
def main(argv=None) -> int:
    """The command line (module docstring); a problem with the user's input prints `error:` / `fix:` lines
    (registry.errors.UserError) and returns 2."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="torch.profiler Chrome trace (export_chrome_trace), e.g. DIR/profile_<point>.json")
    ap.add_argument("--json", default="", metavar="OUT.json", help="also write the breakdown as JSON")
    ap.add_argument("--top", type=int, default=10, help="kernel names listed per group")
    args = ap.parse_args(argv)
    if args.top < 0:
        ap.error("--top must be >= 0")
    rep = breakdown(load_trace(args.trace), top=args.top)
    rep["trace"] = str(args.trace)
    if args.json:  # written before the report is printed: a bad path is refused without a report above it
        try:
            Path(args.json).write_text(json.dumps(rep, indent=1))
        except OSError as e:
            raise UserError(f"--json {args.json}: cannot write it ({e.strerror or e})",
                            "pass a path in an existing, writable folder") from None
    print(format_report(rep))
    if args.json:
        print(f"\n{args.json}: written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
