"""The MoE router of one layer at decode sizes on the GPU: the engine's three launches (a float32 copy of x,
``F.linear`` against the float32 router weight, ``kernels.router.topk_route``) against
``kernels.router.router_fused`` (the logits GEMV and the routing in one launch), at the releases' router
shapes, beside the weight-read floor.

    python -m benchmarks.bench_router --out OUT.json [--tokens 1 2 4 8] [--models super_v3 qwen3_next]

Models: ``super_v3`` Nemotron 3 Super (D = 4096, 512 experts, top-22, sigmoid with the correction bias,
scaling 5), ``qwen3_next`` Qwen3-Next (D = 2048, 512 experts, top-10, softmax). Per model and token count
(bf16 activations, random weights), one row each: ``three_launches`` (what runners.engine.models.moe.TopkRouter
runs with ROUTER_FUSED off), ``linear`` (the copy and F.linear alone: the logits' part of it) and ``fused``
(router_fused; ``match``: its indices equal the three launches'). Times from bench_quant_gemm's ``_bench``:
CUDA-graph replays with L2 flushed before each call (the captured decode step), plus "us_eager". ``floor_us``:
the float32 router weight's bytes over the device copy bandwidth measured in the same run; ``x_floor`` = us /
floor_us. What decides runners.engine.models.moe.ROUTER_FUSED: the fused row faster at every token count of
both models.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_quant_gemm import _bench, gpu_report, part_copy, row  # noqa: E402

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

    from kernels.router import router_fused, topk_route

    return {"three_launches": lambda: topk_route(F.linear(x.float(), weight), k, **kw),
            "linear": lambda: F.linear(x.float(), weight),
            "fused": lambda: router_fused(x, weight, k, **kw)}


def part_model(model: str, tokens: list[int], copy_gbps: float) -> list[dict]:
    """The rows of ``model`` at each token count (module docstring), each printed as it is timed; floors from
    ``copy_gbps`` (GB/s, the run's device copy)."""
    rows = []
    for n in tokens:
        x, weight, _, k, kw = router_inputs(model, n)
        floor = weight.numel() * 4 / (copy_gbps * 1e3)  # us
        calls = router_calls(x, weight, k, kw)
        three, fused = calls["three_launches"], calls["fused"]
        meta = {"model": model, "tokens": n, "floor_us": round(floor, 2)}
        for name, fn in calls.items():
            out = row(name, _bench(fn), weight.numel() * 4 + x.numel() * 2, copy_gbps, **meta)
            out["x_floor"] = round(out["us"] / floor, 2)
            if name == "fused":
                out["match"] = bool((fused()[1] == three()[1]).all())
            print(json.dumps(out), flush=True)
            rows.append(out)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    args = parse_args(argv)
    report = gpu_report("python -m benchmarks.bench_router", argv)
    if report is None:
        return 2
    copy = part_copy()
    report["copy"] = copy
    report["rows"] = [r for m in args.models for r in part_model(m, args.tokens, copy["gb_per_s"])]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
