"""The MoE router of one layer at decode sizes on the GPU: the engine's three launches (a float32 copy of x,
``F.linear`` against the float32 router weight, ``kernels.router.topk_route``) against the fused forms of
kernels/router.py at each launch shape of ``kernels.router.FUSED_CANDIDATES``, at the releases' router
shapes, beside the weight-read floor.

    python -m benchmarks.bench_router --out OUT.json [--tokens 1 2 4 8] [--models super_v3 qwen3_next]

Models: ``super_v3`` Nemotron 3 Super (D = 4096, 512 experts, top-22, sigmoid with the correction bias,
scaling 5), ``qwen3_next`` Qwen3-Next (D = 2048, 512 experts, top-10, softmax). Per model and token count
(bf16 activations, random weights), one row each: ``three_launches`` (the "linear" form of
runners.engine.models.moe.ROUTER_FORMS), ``linear`` (the copy and F.linear alone: the logits' part of it),
and per candidate launch shape C: ``fused:C`` (router_fused, the "fused" form) and ``logits:C``
(router_logits then topk_route, the "logits" form); ``match``: their indices equal the three launches'.
Times from bench_quant_gemm's ``_bench``: CUDA-graph replays with L2 flushed before each call (the captured
decode step), plus "us_eager". ``floor_us``: the float32 router weight's bytes over the device copy bandwidth
measured in the same run; ``x_floor`` = us / floor_us.

``summary`` (printed last): per token count, the fastest matching row summed over the models, and its time
against the three launches'. What sets moe.ROUTER_FORMS and kernels.router.ROUTER_FUSED_CONFIGS: a form and
launch shape where it is faster than the three launches for both models.
"""


from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_quant_gemm import _bench, gpu_report, part_copy, row, write_report  # noqa: E402

FAMILIES = {"super_v3": "nemotron_h", "qwen3_next": "qwen3_next"}


def router_shape(model: str) -> tuple[int, int, int, bool, float]:
    """(D, E, top_k, softmax, routed_scaling_factor) of the released router of ``model``, read from
    registry.releases (the releases' config.json)."""
    from registry.releases import release_hybrid_config

    c = release_hybrid_config(FAMILIES[model], "none", "none")
    return (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_scoring_func == "softmax",
            c.routed_scaling_factor)


MODELS = {m: router_shape(m) for m in FAMILIES}  # model: (D, E, top_k, softmax, scaling)


def router_inputs(model: str, tokens: int, seed: int = 0):
    """(x [tokens, D] bf16, weight [E, D] float32, bias [E] float32 or None, top_k, routing kwargs) on CUDA."""
    import torch

    D, E, k, softmax, scaling = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, D, device="cuda", generator=g).bfloat16()
    weight = torch.randn(E, D, device="cuda", generator=g) / D ** 0.5
    bias = None if softmax else 0.1 * torch.randn(E, device="cuda", generator=g)
    return x, weight, bias, k, dict(softmax=softmax, bias=bias, norm_topk_prob=True, scaling=scaling)


def router_calls(x, weight, k: int, kw: dict) -> dict:
    """{row name: the call it times} for one point (the module docstring's rows)."""
    import torch.nn.functional as F

    from kernels.router import FUSED_CANDIDATES, router_fused, router_logits, topk_route

    calls = {"three_launches": lambda: topk_route(F.linear(x.float(), weight), k, **kw),
             "linear": lambda: F.linear(x.float(), weight)}
    for c in FUSED_CANDIDATES:
        calls[f"fused:{c.name}"] = lambda c=c: router_fused(x, weight, k, config=c, **kw)
        calls[f"logits:{c.name}"] = lambda c=c: topk_route(router_logits(x, weight, c), k, **kw)
    return calls


def part_model(model: str, tokens: list[int], copy_gbps: float) -> list[dict]:
    """The rows of ``model`` at each token count (module docstring), each printed as it is timed; floors from
    ``copy_gbps`` (GB/s, the run's device copy). A launch shape that fails gives a row with ``error``."""
    rows = []
    for n in tokens:
        x, weight, _, k, kw = router_inputs(model, n)
        floor = weight.numel() * 4 / (copy_gbps * 1e3)  # us
        calls = router_calls(x, weight, k, kw)
        want = calls["three_launches"]()[1]
        meta = {"model": model, "tokens": n, "floor_us": round(floor, 2)}
        for name, fn in calls.items():
            try:
                out = row(name, _bench(fn), weight.numel() * 4 + x.numel() * 2, copy_gbps, **meta)
            except Exception as e:  # noqa: BLE001  (a launch shape the compiler or the card refuses: say so)
                out = {"name": name, **meta, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps(out), flush=True)
                rows.append(out)
                continue
            out["x_floor"] = round(out["us"] / floor, 2)
            if ":" in name:
                out["match"] = bool((fn()[1] == want).all())
            print(json.dumps(out), flush=True)  # again, with the floor ratio and the match
            rows.append(out)
    return rows


def summary(rows: list[dict]) -> dict:
    """{tokens: {"best": row name, "us": its time summed over the models, "three_launches_us": theirs, "speedup":
    the ratio, "per_model": {model: [best us, three launches us]}}}: the fastest row that matched on every
    model and timed on all of them (module docstring)."""
    models = sorted({r["model"] for r in rows})
    out = {}
    for n in sorted({r["tokens"] for r in rows}):
        at = [r for r in rows if r["tokens"] == n and "us" in r]
        names = {r["name"] for r in at if r["name"] != "linear"}
        totals = {}
        for name in names:
            mine = [r for r in at if r["name"] == name]
            if len(mine) == len(models) and all(r.get("match", True) for r in mine):
                totals[name] = sum(r["us"] for r in mine)
        if "three_launches" not in totals:
            continue
        best = min(totals, key=totals.get)
        out[n] = {"best": best, "us": round(totals[best], 2), "three_launches_us": round(totals["three_launches"], 2),
                  "speedup": round(totals["three_launches"] / totals[best], 3),
                  "per_model": {m: [next(r["us"] for r in at if r["model"] == m and r["name"] == nm)
                                    for nm in (best, "three_launches")] for m in models}}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring), or SystemExit 2 naming a bad argument."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_router", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args(argv)
    from kernels.router import ROUTER_FUSED_MAX_TOKENS

    bad = [n for n in args.tokens if not 1 <= n <= ROUTER_FUSED_MAX_TOKENS]
    if bad:
        p.error(f"--tokens {bad}: router_fused takes 1 to ROUTER_FUSED_MAX_TOKENS={ROUTER_FUSED_MAX_TOKENS} "
                "tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    """Time every row (module docstring) into ``--out`` and print the summary; 2 without CUDA."""
    args = parse_args(argv)
    report = gpu_report("python -m benchmarks.bench_router", argv)
    if report is None:
        return 2
    copy = part_copy()
    report["copy"] = copy
    report["rows"] = [r for m in args.models for r in part_model(m, args.tokens, copy["gb_per_s"])]
    report["summary"] = summary(report["rows"])
    for n, s in report["summary"].items():
        print(f"{n} tokens: best {s['best']} {s['us']} us vs three launches {s['three_launches_us']} us "
              f"({s['speedup']}x); per model [best, three]: {s['per_model']}", flush=True)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
