"""Nsight Compute profiles of the grouped CUDA kernel of the quantized routed experts (kernels/quant/pair_gemv.cu
through kernels.quant.pair_cuda.grouped_mm), one launch per process: where its time goes beside the bytes it
reads, per grouped form and code layout.

    python -m benchmarks.ncu_grouped --out DIR [--tokens 8 256] [--models super_v3 qwen3_next] \
        [--projs up down] [--forms pipelined persistent] [--layouts natural repacked]

Each profiled launch (a "spec", model:proj:tokens:form:layout) is one expert projection of one MoE layer:
Super V3 NVFP4 (512 experts, top-22; up 1024 -> 2688, down 2688 -> 1024) or Qwen3-Next block FP8 (512
experts, top-10, w8a16; up / gate 2048 -> 512, down 512 -> 2048), its experts random codes in the release
format (the kernel's time does not depend on the values), the rows of ``tokens`` tokens routed at random
(distinct experts per token, benchmarks.bench_quant_gemm's routing) and sorted by expert, in pair_cuda's
GROUPED_FORM `form`, with the codes as stored ("natural") or repacked at load time ("repacked": the format's
repack_codes and pair_cuda's "<fmt>_repacked" format). A worker process builds it, runs it once (the nvcc
build and the warm-up outside the profiled range), then once inside it; ncu profiles that launch with
--clock-control none and the sections SpeedOfLight, MemoryWorkloadAnalysis, SchedulerStats,
WarpStateStats, Occupancy and LaunchStats into DIR/ncu_<spec>.ncu-rep, read back as text twice: the details
page (DIR/ncu_<spec>.txt) and the raw metrics (for the warp-stall breakdown, DIR/ncu_<spec>_raw.txt; the
report file is then deleted).

DIR/ncu_grouped.json holds per spec: ncu's exit status, the worker's description (rows P, active experts,
the weight bytes those experts store, ``weight_bytes``), the headline numbers (benchmarks.ncu NCU_METRICS and
SCHEDULER_METRICS: duration, memory / DRAM / compute throughput, cache hit rates, the schedulers' issue
rate, warp cycles per issued instruction, occupancy, registers), ``read_gbps`` (the weight bytes over the
duration) and ``stalls`` (the warp-stall breakdown, warps stalled per issued instruction by reason, largest
first). A table is printed last. It needs a CUDA GPU and ncu; the CPU tests check the specs, the commands
and the parsing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.ncu import NCU_METRICS, SCHEDULER_METRICS, STALL_PREFIX, find_ncu, parse_ncu, parse_raw  # noqa: E402
from registry.errors import UserError, exits_on_user_error  # noqa: E402

# model: (release format, (L, I, E, top_k)) of one MoE layer's routed experts
MODELS = {"super_v3": ("nvfp4", (1024, 2688, 512, 22)), "qwen3_next": ("block_fp8", (2048, 512, 512, 10))}
PROJS = ("up", "down")  # up (and gate): L -> I; down: I -> L
LAYOUTS = ("natural", "repacked")
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "SchedulerStats", "WarpStateStats", "Occupancy",
            "LaunchStats")
# pair_gemv.cu's grouped kernels (grouped_*_kernel, persistent_kernel): the only launch in the profiled range
KERNEL_REGEX = "regex:grouped_|persistent_kernel"
STALL_SUFFIX = "_per_issue_active.ratio"


def parse_spec(spec: str) -> tuple[str, str, int, str, str]:
    """(model, proj, tokens, form, layout) of "model:proj:tokens:form:layout".

    Raises:
        UserError: a part that is not one of MODELS / PROJS / a positive integer / pair_cuda.GROUPED_FORMS /
            LAYOUTS, or a repacked layout in a form it does not run (pair_cuda.REPACKED_FORMS).
    """
    from kernels.quant import pair_cuda

    parts = spec.split(":")
    fix = (f"write model:proj:tokens:form:layout with model in {tuple(MODELS)}, proj in {PROJS}, form in "
           f"{pair_cuda.GROUPED_FORMS}, layout in {LAYOUTS}")
    if len(parts) != 5:
        raise UserError(f"ncu_grouped: spec {spec!r} has {len(parts)} parts, not 5", fix)
    model, proj, tokens, form, layout = parts
    if model not in MODELS or proj not in PROJS or form not in pair_cuda.GROUPED_FORMS or layout not in LAYOUTS \
            or not tokens.isdigit() or int(tokens) < 1:
        raise UserError(f"ncu_grouped: spec {spec!r} names an unknown model, projection, form or layout, or "
                        "tokens that are not a positive integer", fix)
    if layout == "repacked" and form not in pair_cuda.REPACKED_FORMS:
        raise UserError(f"ncu_grouped: spec {spec!r}: the repacked codes run only in the forms "
                        f"{pair_cuda.REPACKED_FORMS}", "profile the repacked layout in one of those forms")
    return model, proj, int(tokens), form, layout


def specs_of(args) -> list[str]:
    """Every spec of the command line's lists (repacked layouts only in pair_cuda.REPACKED_FORMS), each checked
    by parse_spec."""
    from kernels.quant import pair_cuda

    out = [f"{m}:{p}:{t}:{f}:{lay}" for m in args.models for p in args.projs for t in args.tokens
           for f in args.forms for lay in args.layouts
           if lay == "natural" or f in pair_cuda.REPACKED_FORMS]
    for spec in out:
        parse_spec(spec)
    return out


def ncu_command(exe: str, spec: str, report: str) -> list[str]:
    """The ncu command that profiles `spec`'s launch into `report` (.ncu-rep)."""
    sections = [a for s in SECTIONS for a in ("--section", s)]
    return [exe, "--clock-control", "none", *sections, "--profile-from-start", "off", "-k", KERNEL_REGEX,
            "--launch-count", "1", "--export", report, "--force-overwrite", sys.executable, "-m",
            "benchmarks.ncu_grouped", "--worker", spec]


def random_experts(fmt: str, E: int, N: int, K: int, seed: int = 0):
    """Random experts in `fmt` on CUDA, the engine's tuples: NVFP4 (codes uint8 [E, N, K / 2], e4m3 block
    scales in [0.5, 2] [E, N, K / 16], float32 weight_scale_2 [E] of ones); block FP8 (float8_e4m3fn [E, N, K]
    from random bytes, the two NaN codes 0x7F / 0xFF replaced by 0, float32 block scales of ones [E,
    ceil(N / 128), ceil(K / 128)])."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "nvfp4":
        codes = torch.randint(0, 256, (E, N, K // 2), device="cuda", generator=gen, dtype=torch.uint8)
        scales = (torch.rand(E, N, K // 16, device="cuda", generator=gen) * 1.5 + 0.5).to(torch.float8_e4m3fn)
        return codes, scales, torch.ones(E, device="cuda")
    raw = torch.randint(0, 256, (E, N, K), device="cuda", generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    return raw.view(torch.float8_e4m3fn), torch.ones(E, -(-N // 128), -(-K // 128), device="cuda")


def worker(spec: str) -> dict:
    """Build `spec`'s launch, run it once, then once inside the profiler's range (module docstring); returns
    (and prints as JSON) its description.

    Raises:
        SystemExit: the CUDA kernel cannot run it (pair_cuda.grouped_unsupported's reason).
    """
    import importlib

    import torch

    from benchmarks.bench_quant_gemm import _routing
    from kernels.quant import pair_cuda
    from runners.engine.dummy import stored_nbytes

    model, proj, tokens, form, layout = parse_spec(spec)
    fmt, (L, I, E, k) = MODELS[model]
    N, K = (I, L) if proj == "up" else (L, I)
    w = random_experts(fmt, E, N, K)
    name = fmt
    if layout == "repacked":
        w = (importlib.import_module(f"kernels.quant.{fmt}").repack_codes(w[0]), *w[1:])
        name = f"{fmt}_repacked"
    P, offsets, active = _routing(tokens, k, E, seed=tokens)
    x = torch.randn(P, K, device="cuda").to(torch.bfloat16)
    why = pair_cuda.grouped_unsupported(name, x, w, offsets)
    if why is not None:
        raise SystemExit(f"ncu_grouped: {spec}: the CUDA kernel cannot run it: {why}")
    pair_cuda.GROUPED_FORM = form
    pair_cuda.grouped_mm(name, x, w, offsets)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    pair_cuda.grouped_mm(name, x, w, offsets)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    info = {"spec": spec, "format": name, "N": N, "K": K, "P": P, "active_experts": active,
            "rows_per_active_expert": round(P / active, 2), "weight_bytes": active * stored_nbytes(fmt, (N, K))}
    print(json.dumps(info), flush=True)
    return info


def summarize(spec: str, exit_code: int, worker_out: str, details: str, raw: str) -> dict:
    """One spec's entry of DIR/ncu_grouped.json (module docstring) from ncu's exit status, the worker's
    output (its last JSON line), the details page and the raw page."""
    info = {}
    for line in reversed(worker_out.splitlines()):
        if line.startswith("{"):
            try:
                info = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    got = {"exit": exit_code, **info, **parse_ncu(details, {**NCU_METRICS, **SCHEDULER_METRICS})}
    dur = got.get("duration")
    if dur and info.get("weight_bytes"):
        scale = {"ns": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}.get(dur["unit"])
        if scale:
            got["read_gbps"] = round(info["weight_bytes"] / (dur["value"] * scale) / 1e9, 1)
    stalls = {r.removesuffix(STALL_SUFFIX): v for r, v in parse_raw(raw, STALL_PREFIX).items()
              if r.endswith(STALL_SUFFIX)}
    got["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return got


def table(summary: dict) -> str:
    """The printed table: per spec its duration, weight read rate, DRAM throughput, issue rate, warp cycles
    per instruction and its three largest stall reasons."""
    lines = [f"{'spec':44} {'us':>9} {'GB/s':>7} {'dram%':>6} {'issue':>6} {'cyc/i':>6}  top stalls"]
    for spec, g in summary.items():
        v = lambda k, g=g: g[k]["value"] if k in g else float("nan")  # noqa: E731
        top = ", ".join(f"{r} {x:.2f}" for r, x in list(g.get("stalls", {}).items())[:3])
        lines.append(f"{spec:44} {v('duration'):9.2f} {g.get('read_gbps', float('nan')):7.1f} "
                     f"{v('dram_throughput_pct'):6.1f} {v('issued_warp_per_scheduler'):6.2f} "
                     f"{v('warp_cycles_per_issued_instruction'):6.2f}  {top}")
    return "\n".join(lines)


def profile(args) -> int:
    """Profile every spec (module docstring); returns 1 when a profile failed, else 0."""
    specs = specs_of(args)
    exe = find_ncu("ncu_grouped")
    os.makedirs(args.out, exist_ok=True)
    summary, rc = {}, 0
    for spec in specs:
        stem = os.path.join(args.out, "ncu_" + spec.replace(":", "_"))
        report = stem + ".ncu-rep"
        p = subprocess.run(ncu_command(exe, spec, report), capture_output=True, text=True, cwd=REPO)
        pages = {}
        for page in ("details", "raw"):
            q = subprocess.run([exe, "--import", report, "--page", page], capture_output=True, text=True) \
                if os.path.exists(report) else None
            pages[page] = q.stdout if q is not None else ""
        with open(stem + ".txt", "w") as f:
            f.write(" ".join(ncu_command(exe, spec, report)) + "\n" + p.stdout + p.stderr + pages["details"])
        with open(stem + "_raw.txt", "w") as f:
            f.write(pages["raw"])
        if os.path.exists(report):
            os.remove(report)
        summary[spec] = summarize(spec, p.returncode, p.stdout, pages["details"], pages["raw"])
        rc = rc or int(p.returncode != 0 or "duration" not in summary[spec])
        print(f"{spec}: exit {p.returncode} -> {stem}.txt", flush=True)
        with open(os.path.join(args.out, "ncu_grouped.json"), "w") as f:  # after each spec: a cut run keeps them
            json.dump(summary, f, indent=1)
    print(table(summary))
    return rc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from kernels.quant import pair_cuda

    ap = argparse.ArgumentParser(prog="python -m benchmarks.ncu_grouped", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output folder (reports, ncu_grouped.json)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 256], help="decode tokens per launch")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--projs", nargs="+", default=list(PROJS), choices=PROJS)
    ap.add_argument("--forms", nargs="+", default=list(pair_cuda.REPACKED_FORMS), choices=pair_cuda.GROUPED_FORMS)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # one profiled launch (internal)
    args = ap.parse_args(argv)
    if args.worker is None and not args.out:
        ap.error("--out is required")
    if any(t < 1 for t in args.tokens):
        ap.error("--tokens must be positive")
    return args


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    import torch

    if not torch.cuda.is_available():
        raise UserError("ncu_grouped needs a CUDA GPU", "run it on the device machine")
    return profile(args)


if __name__ == "__main__":
    raise SystemExit(main())
