"""Benchmark the prefill kernels against their PyTorch references at the releases' dimensions on a GPU.

One Nemotron 3 Super Mamba2 layer (128 heads x head_dim 64, d_state 128, 8 groups, chunk 128) and one
Qwen3-Next Gated DeltaNet layer (16 key heads x K 128, 32 value heads x V 128, chunk 64), bf16 activations,
fp32 states, for every batch x T case (default 1x1024, 8x1024, 1x4096). For each, prefill tokens/s of

- the operator: `mamba_chunk_scan_combined` (our Triton kernels) vs `mamba_chunk_scan_combined_ref`, and
  `chunk_gated_delta_rule` (fla-core's kernels) vs `chunk_gated_delta_rule_ref`, on the inputs the mixer
  gives them (with the kernel's relative error against the reference, a correctness check at full size);
- the whole mixer layer (projections, conv, the operator, gated norm, out_proj) with a cache, for
  ssm_backend "triton" vs "torch".

With ``--model DIR`` (an HF checkpoint, e.g. from ``python -m runners.tools.synth``) also the whole engine's prefill
(`Engine.generate` of one token after B prompts of T random ids) under both backends. Times are medians of
triton.testing.do_bench after a warm-up (JIT compilation excluded); prints one JSON object.

    python -m benchmarks.bench_prefill [--cases 1x1024,8x1024,1x4096] [--out prefill.json] [--model DIR]
    python -m benchmarks.bench_prefill --compile-check     # no GPU needed: registers / spills on sm_90
    TRITON_INTERPRET=1 python -m benchmarks.bench_prefill --dry-run   # CPU smoke run at tiny shapes
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import triton

from kernels.gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_ref
from kernels.mamba2 import ChunkScanTiles, mamba_chunk_scan_combined, mamba_chunk_scan_combined_ref
from runners.engine.models.config import HybridConfig
from runners.engine.models.gdn import GDNMixer
from runners.engine.models.mamba2 import Mamba2Mixer
from runners.engine.state import CacheSpec, LayerState
from runners.tools.synth import synth_config

DEFAULT_CASES = "1x1024,8x1024,1x4096"
# Tiny shapes of the dry run (CPU interpreter): every code path once, the numbers mean nothing.
TINY = {"nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                       "chunk_size": 16, "hidden_size": 64},
        "qwen3_next": {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16, "hidden_size": 64}}


def _do_bench(fn) -> float:
    """Median milliseconds of fn() on the GPU."""
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def _wall_once(fn) -> float:
    """One call, wall clock (the dry run's timer)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _layer_config(family: str, tiny: bool) -> HybridConfig:
    return HybridConfig.from_dict(synth_config(family, num_layers=2 if family == "qwen3_next" else 3,
                                               num_experts=4, overrides=TINY[family] if tiny else None))


def _state(mixer: type, cfg: HybridConfig, rows: int, dev) -> LayerState:
    """The rewind-scheme state ``mixer``'s kind keeps (its ``state_class``), ``rows`` live slots, no drafts."""
    cls = mixer.state_class(replay=False)
    spec = CacheSpec(rows=rows + 1, max_seq_len=1, dtype=torch.bfloat16, ssm_state_dtype=torch.float32,
                     device=dev, spec_tokens=0)
    return cls.allocate(cfg, spec)


def _row(ms_kernel: float, ms_ref: float, tokens: int) -> dict:
    return {"kernel_ms": round(ms_kernel, 4), "reference_ms": round(ms_ref, 4),
            "kernel_tokens_per_s": round(tokens / ms_kernel * 1e3), "reference_tokens_per_s":
            round(tokens / ms_ref * 1e3), "speedup": round(ms_ref / ms_kernel, 2)}


@torch.no_grad()
def bench_mamba2(B: int, T: int, *, dev, timer, tiny=False, tiles: ChunkScanTiles | None = None) -> dict:
    """One Super V3 Mamba2 layer: the chunked scan operator and the whole mixer, kernel vs reference."""
    from runners.engine.state import BatchMeta

    cfg = _layer_config("nemotron_h", tiny)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg).to(dev, torch.bfloat16)
    with torch.no_grad():  # a realistic dt range: softplus(dt_bias) about 0.01 - 0.1, A in [-16, -1]
        mixer.dt_bias.copy_(torch.empty(cfg.mamba_num_heads).uniform_(-4.5, -2.3))
        mixer.A_log.copy_(torch.empty(cfg.mamba_num_heads).uniform_(0.0, 2.77))
    H, P, N, G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
    x = torch.randn(B, T, H, P, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
    Bm = torch.randn(B, T, G, N, device=dev, dtype=torch.bfloat16) / N**0.5
    Cm = torch.randn(B, T, G, N, device=dev, dtype=torch.bfloat16) / N**0.5
    A = -torch.exp(mixer.A_log.float())
    slots = torch.arange(B, device=dev)
    state0 = torch.randn(B + 1, H, P, N, device=dev) * 0.1
    out = torch.empty(B, T, H, P, device=dev)
    args = (x, dt, A, Bm, Cm, mixer.D, mixer.dt_bias, slots)
    kw = {"chunk_size": cfg.chunk_size, "out": out}
    s_k, s_r = state0.clone(), state0.clone()
    y_k = mamba_chunk_scan_combined(s_k, *args, tiles=tiles, **kw).clone()
    y_r = mamba_chunk_scan_combined_ref(s_r, *args, **kw).clone()
    err = {"y": _rel(y_k, y_r), "state": _rel(s_k, s_r)}  # before the timed calls move the states on
    res = {"op_rel_err": None if tiny else err,
           "op": _row(timer(lambda: mamba_chunk_scan_combined(s_k, *args, tiles=tiles, **kw)),
                      timer(lambda: mamba_chunk_scan_combined_ref(s_r, *args, **kw)), B * T)}
    hidden = torch.randn(B, T, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    state = _state(Mamba2Mixer, cfg, B, dev)
    meta = BatchMeta(slots, torch.zeros_like(slots), torch.full_like(slots, T), all_valid=True)
    ms = {}
    for backend in ("triton", "torch"):
        state.ssm_backend = backend
        mixer(hidden, state, meta)  # warm-up (JIT)
        ms[backend] = timer(lambda: mixer(hidden, state, meta))
    res["layer"] = _row(ms["triton"], ms["torch"], B * T)
    return res


@torch.no_grad()
def bench_gdn(B: int, T: int, *, dev, timer, tiny=False) -> dict:
    """One Qwen3-Next Gated DeltaNet layer: the chunked rule and the whole mixer, kernel vs reference."""
    from kernels.gdn._common import l2norm
    from kernels.gdn.fla import fla_chunk_rule
    from runners.engine.state import BatchMeta

    cfg = _layer_config("qwen3_next", tiny)
    H, HV, K, V = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    torch.manual_seed(0)
    mixer = GDNMixer(cfg).to(dev, torch.bfloat16)
    q = l2norm(torch.randn(B, T, H, K, device=dev))  # as the mixer gives them: fp32, normalised
    k = l2norm(torch.randn(B, T, H, K, device=dev))
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    g = -torch.nn.functional.softplus(torch.randn(B, T, HV, device=dev)) * 0.5
    beta = torch.rand(B, T, HV, device=dev)
    h0 = torch.randn(B, HV, V, K, device=dev) * 0.1
    C = cfg.gdn_chunk_size
    o_k, s_k = chunk_gated_delta_rule(q, k, v, g, beta, h0, C)
    o_r, s_r = chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, C)
    res = {"fla": "fla-core" if dev == "cuda" and fla_chunk_rule()[0] is not None else
           "reference (fla-core not importable or not on CUDA): the kernel column is the reference too",
           "op_rel_err": None if tiny else {"o": _rel(o_k, o_r), "state": _rel(s_k, s_r)},
           "op": _row(timer(lambda: chunk_gated_delta_rule(q, k, v, g, beta, h0, C)),
                      timer(lambda: chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, C)), B * T)}
    hidden = torch.randn(B, T, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    state = _state(GDNMixer, cfg, B, dev)
    slots = torch.arange(B, device=dev)
    meta = BatchMeta(slots, torch.zeros_like(slots), torch.full_like(slots, T), all_valid=True)
    ms = {}
    for backend in ("triton", "torch"):
        state.ssm_backend = backend
        mixer(hidden, state, meta)  # warm-up (JIT)
        ms[backend] = timer(lambda: mixer(hidden, state, meta))
    res["layer"] = _row(ms["triton"], ms["torch"], B * T)
    return res


def bench_engine(path: str, B: int, T: int) -> dict:
    """The engine's prefill (plus one decode-free token) on a checkpoint, ssm_backend triton vs torch: prefill
    tokens/s from GenerationStats (median of 3 runs after a warm-up)."""
    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    torch.manual_seed(0)
    res = {}
    for backend in ("triton", "torch"):
        engine = Engine.from_pretrained(path, EngineOptions(dtype=torch.bfloat16, ssm_backend=backend,
                                                            max_batch_size=B, max_seq_len=T + 8), device="cuda")
        V = engine.config.vocab_size
        prompts = torch.randint(3, V, (B, T)).tolist()
        engine.generate(prompts, 1, stop_token_ids=[])  # warm-up: JIT and allocator
        secs = sorted(engine.generate(prompts, 1, stop_token_ids=[]).stats.prefill_seconds for _ in range(3))
        res[backend] = {"prefill_seconds": round(secs[1], 4), "prefill_tokens_per_s": round(B * T / secs[1])}
        del engine
        torch.cuda.empty_cache()
    res["speedup"] = round(res["torch"]["prefill_seconds"] / res["triton"]["prefill_seconds"], 2)
    return res


def compile_check() -> dict:
    """Compile the Mamba2 chunk-scan kernels for sm_90 without a GPU (Triton's ahead-of-time path and its
    bundled cuobjdump) with the default tiles at Super V3's shapes; report registers / stack (spill) bytes per
    thread. Strides of the last dimension are 1 and the others divisible by 16, as the engine's tensors are
    (the JIT specialises on both). Triton internals: best effort across Triton versions."""
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from kernels.mamba2 import chunk

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    unit = ("s_xp", "s_Bn", "s_Cn", "s_sn", "s_op", "s_cl", "s_stn", "s_dth")

    def usage(kernel, io, constexprs, num_warps):
        ptr = dict(x_ptr=io, dt_ptr=io, B_ptr=io, C_ptr=io, len_ptr="*i64", slot_ptr="*i64")
        names = kernel.arg_names
        consts = {**constexprs, **{n: 1 for n in unit if n in names}}
        sig = {n: "constexpr" if n in consts else
               ptr.get(n, "*fp32") if n.endswith("_ptr") else "fp32" if n in ("dt_min", "dt_max") else "i32"
               for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                 if sig[n] != "constexpr" and (sig[n].startswith("*") or n.startswith("s_"))}
        src = ASTSource(kernel, sig, constexprs={(names.index(c),): v for c, v in consts.items()}, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            report = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        fields = [w for line in report.splitlines() if "REG:" in line for w in line.split()]
        return {w.split(":")[0]: int(w.split(":")[1]) for w in fields if w.split(":")[0] in ("REG", "STACK")}

    res = {}
    for io, fp32 in (("*bf16", False), ("*fp32", True)):
        t = ChunkScanTiles.for_dot(fp32)
        tag = "fp32_ieee" if fp32 else "bf16"
        res[f"cumsum_{tag}"] = usage(chunk._ssd_chunk_cumsum_kernel, io, dict(
            HAS_LENGTHS=True, HAS_DT_LIMIT=False, BLOCK_L=128), 1)
        res[f"chunk_state_{tag}"] = usage(chunk._ssd_chunk_state_kernel, io, dict(
            DOT_FP32=fp32, BLOCK_L=128, BLOCK_K=t.state_k, BLOCK_P=t.state_p, BLOCK_N=t.state_n), t.state_warps)
        res[f"state_passing_{tag}"] = usage(chunk._ssd_state_passing_kernel, io, dict(BLOCK_L=128, BLOCK=1024),
                                            4)
        res[f"chunk_scan_{tag}"] = usage(chunk._ssd_chunk_scan_kernel, io, dict(
            HAS_D=True, HAS_LENGTHS=True, DOT_FP32=fp32, BLOCK_L=128, BLOCK_M=t.scan_m, BLOCK_K=t.scan_k,
            BLOCK_P=t.scan_p, BLOCK_N=t.scan_n), t.scan_warps)
    return res


# Alternatives the benchmark times for the Mamba2 operator (16-bit path), beside the default tiles.
TILE_SWEEP = {
    "default": ChunkScanTiles(),
    "scan_m128": ChunkScanTiles(scan_m=128, scan_k=32, scan_n=64),
    "scan_k64": ChunkScanTiles(scan_k=64, scan_n=64),
    "state_k32_w4": ChunkScanTiles(state_k=32, state_warps=4),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated BxT cases (batch x tokens per row)")
    ap.add_argument("--families", default="nemotron_h,qwen3_next", help="nemotron_h (Mamba2), qwen3_next (GDN)")
    ap.add_argument("--model", default=None, help="also time the whole engine's prefill on this checkpoint")
    ap.add_argument("--tile-sweep", action="store_true", help="also time the Mamba2 operator with other tiles")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--compile-check", action="store_true",
                    help="compile the Mamba2 kernels for sm_90 without a GPU; print registers / stack per thread")
    ap.add_argument("--dry-run", action="store_true",
                    help="every path once on the CPU at tiny shapes, no timings (needs TRITON_INTERPRET=1)")
    a = ap.parse_args(argv)
    try:
        cases = [tuple(int(v) for v in c.lower().split("x")) for c in a.cases.split(",") if c]
        if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
            raise ValueError
    except ValueError:
        ap.error(f"--cases {a.cases!r}: give BxT pairs of positive integers, e.g. {DEFAULT_CASES}")
    families = [f for f in a.families.split(",") if f]
    if not families or set(families) - {"nemotron_h", "qwen3_next"}:
        ap.error(f"--families {a.families!r}: a comma-separated subset of nemotron_h, qwen3_next")
    if a.compile_check:
        print(json.dumps(compile_check(), indent=1))
        return 0
    if a.dry_run:
        from kernels._common import interpreter_active

        if not interpreter_active():
            ap.error("--dry-run runs the kernels in Triton's interpreter, which is switched on before triton is "
                     "imported: TRITON_INTERPRET=1 python -m benchmarks.bench_prefill --dry-run")
        res = {f"{B}x{T}": {"mamba2": bench_mamba2(B, T, dev="cpu", timer=_wall_once, tiny=True),
                            "gdn": bench_gdn(B, T, dev="cpu", timer=_wall_once, tiny=True)}
               for B, T in ((1, 20), (2, 33))}
        print(json.dumps({"dry_run": "ok", "cases": list(res)}))
        return 0
    if not torch.cuda.is_available():
        print("bench_prefill: needs a CUDA GPU (or --dry-run / --compile-check on the CPU)", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "dtype": "bfloat16 activations, float32 states",
              "cases": {}}
    try:
        import fla

        result["fla_core"] = getattr(fla, "__version__", "unknown")
    except Exception as exc:  # reported, not fatal: the GDN rows then time the reference twice
        result["fla_core"] = f"not importable: {type(exc).__name__}: {exc}"
    for B, T in cases:
        entry = {}
        if "nemotron_h" in families:
            entry["mamba2_super_v3_layer"] = bench_mamba2(B, T, dev="cuda", timer=_do_bench)
            if a.tile_sweep:
                entry["mamba2_tile_sweep_op_ms"] = {
                    name: bench_mamba2(B, T, dev="cuda", timer=_do_bench, tiles=t)["op"]["kernel_ms"]
                    for name, t in TILE_SWEEP.items()}
        if "qwen3_next" in families:
            entry["gdn_qwen3_next_layer"] = bench_gdn(B, T, dev="cuda", timer=_do_bench)
        if a.model:
            entry["engine"] = bench_engine(a.model, B, T)
        result["cases"][f"{B}x{T}"] = entry
        print(json.dumps({f"{B}x{T}": entry}), file=sys.stderr, flush=True)  # progress
        torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
