"""ATen operators per decode-step phase and per block kind, counted on the CPU: where a step repeats work.

    python -m benchmarks.count_step_ops --family nemotron_h [--format nvfp4] [--layers 22] [--draft-len 3]
        [--replay] [--batch 1] [--steps 4] [--top 25] [--json OUT.json]

An op count, not a speed claim: it counts the ATen operators (``TorchDispatchMode``) that the eager padded
decode step (``runners.engine.graphs.StepGraphs`` mode "eager_padded", the phases a CUDA graph captures)
dispatches on the CPU, per phase (``decode``, or ``draft`` / ``verify`` / ``commit`` / ``catchup``) and per
block kind (``mamba2``, ``moe``, ``attention``, ``gdn``, ``mlp``; ``mtp.<kind>`` for the MTP module's blocks;
``step`` for everything outside the blocks: embedding, final norm, LM head, health flags, the step's own
bookkeeping; in the eager inference step each block's residual add runs in the next block's norm launch,
``add_rms_norm``, so it counts under the next block's kind, and the last block's under ``step`` with the
final norm: block.forward_blocks_fused). The device's kernel count per step is ``benchmarks/bench_e2e.py``'s ``kernels_per_step``
(torch.profiler on the H200); this script is its CPU proxy for finding repeated per-layer work.

Conventions, so the counts track device launches rather than CPU implementation detail:
- views (``aten.view``, ``slice``, ``select``, ``expand``, ``transpose``, ...: no kernel on any device, and
  aliasing composites such as ``to`` / ``reshape`` when they did not copy) and allocations (``empty``,
  ``new_empty``, ...) are counted apart (``views``) from the operators that run a kernel (``ops``);
- each operator that runs as one Triton kernel on CUDA but as its PyTorch reference on the CPU (the
  recurrent-state operators of ``runners.engine.state.kernel_or_reference``, the router's top-k
  ``kernels.router.topk_route_ref`` and, where moe.ROUTER_FORMS gives a decode size a form as on CUDA,
  ``router_fused`` / ``router_logits`` + ``topk_route``, the norms of kernels/norm.py, GDN's prologue, the shared-expert
  combine) and the routed experts (``MoE._experts``: kernels/moe_gemv.py's three
  launches on CUDA at decode sizes) count as one op named ``kernel:<name>``; the operators inside are not
  counted;
- in a quantized ``--format``, each call of a quantized GEMM (the functions of
  runners.engine.models.nvfp4 / block_fp8 and fp8's ``fp8_linear``: one Triton or cuBLAS kernel on CUDA, the
  dequantizing reference on the CPU) counts as ``kernel:<name>``, plus ``kernel:<name>.prep`` for the one
  helper launch the kernels make before it on CUDA (NVFP4's column-class copy of x, block FP8's activation
  quantization where its scheme is w8a8, per-tensor FP8's static cast, kernels.quant.fp8, except where the
  kernel producing its input wrote the codes, as it does on an FP8 GPU: FP8Linear.prequant_scale; a split-K sum
  launch, which depends on the real widths, is not counted); the quantized MoE's routing glue around its
  grouped GEMMs counts op by op, except its kernels on CUDA (the expert grouping ``sort_pairs``, the
  activation, the combine ``combine_sorted``: one op each).
  Where the quantized experts take a per-pair decode path on CUDA (their format's ``use_moe_gemv`` gate,
  runners.engine.formats), the count takes it too (the gate's pair bound, ``--quant-moe-gemv-max-pairs``,
  not its device test) and the path
  counts as the one op ``kernel:moe_experts``, as the bf16 experts. FP8 (per-tensor) MoE experts count the
  CPU reference's ops (not the device's);
- ``host_syncs``: ``aten._local_scalar_dense`` / ``aten.item`` / ``aten.nonzero`` calls outside those
  references (a step must have none: CUDA graphs capture it).

The model is ``runners.tools.synth.synthetic_model`` at the release's layer pattern cut to ``--layers``
(quarter depth by default: 22 for Nemotron 3 Super, 12 for Qwen3-Next, as bench_e2e) with small widths
(:data:`SHRINK`; :data:`FORMAT_SHRINK` for a quantized ``--format``: every quantized width a multiple of
NVFP4's 16-column scale groups and of block FP8's 128 x 128 blocks), the format's modules swapped in by the
engine's own rule (``registry.releases.release_rule`` of the family, as ``model.load_format=dummy`` builds a
release; no FP8 KV cache, whose scales only change the cache dtype) in bfloat16 (``--dtype``; float32 would hide the casts a bf16 step runs): the op count depends on the layer pattern, not on the widths. Drafted steps use
``Engine.force_acceptance(--accept-length)`` (random weights accept nothing on their own). The first decode
step is not counted (warm-up); the counts are the mean over ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

QUARTER_LAYERS = {"nemotron_h": 22, "qwen3_next": 12}
# widths small enough for a CPU run in seconds (the op count does not depend on them)
SHRINK = {"hidden_size": 128, "vocab_size": 4096, "mamba_num_heads": 8, "moe_latent_size": 64,
          "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64}
# quantized formats: widths that fill whole 128 x 128 block-FP8 blocks (NVFP4 needs multiples of 16)
FORMAT_SHRINK = {**SHRINK, "moe_latent_size": 128, "moe_intermediate_size": 128,
                 "moe_shared_expert_intermediate_size": 128}
FORMATS = ("bf16", "nvfp4", "block_fp8", "fp8")


def _dense_block_fp8_prep(x, *args, **kwargs) -> bool:
    """Whether a dense block-FP8 call of activations ``x`` quantizes them in a launch of its own: w8a8 does,
    w8a16 (the decode scheme up to the format's decode_rows) does not."""
    from runners.engine.models.block_fp8 import dense_scheme

    return dense_scheme(x) == "w8a8"


def _grouped_block_fp8_prep(x, weight, *args, **kwargs) -> bool:
    """The same for a grouped block-FP8 call of x [P, K] over experts ``weight`` [E, N, K]."""
    from runners.engine.models.block_fp8 import grouped_scheme

    return grouped_scheme(x.shape[0], weight.shape[0]) == "w8a8"


def _fp8_linear_prep(x, weight, weight_scale, input_scale, bias=None, xq=None) -> bool:
    """Whether a per-tensor FP8 linear quantizes x in a launch of its own: not where the kernel producing x
    wrote its codes (``xq``: kernels/norm.py, kernels/activation.py ``quant_scale``)."""
    return xq is None


def _fp8_prequant_scale_on_cuda(self, x):
    """FP8Linear.prequant_scale as on an FP8 GPU (the scaled_mm path wherever the format's scheme is w8a8), so
    that the count follows the producers' codes as CUDA does."""
    from registry.hf_config import FORMAT_FP8
    from runners.engine.formats import get_format

    rows = x.numel() // max(1, x.shape[-1])
    return None if get_format(FORMAT_FP8).scheme(rows) == "w8a16" else self.input_scale


# quantized GEMM wrappers counted as kernels: (module, attribute, whether a helper launch precedes it on CUDA:
# a bool, or a function of the call's arguments)
QUANT_KERNELS = (("runners.engine.models.nvfp4", "nvfp4_linear", True),
                 ("runners.engine.models.nvfp4", "nvfp4_grouped_mm", True),
                 ("runners.engine.models.block_fp8", "block_fp8_linear", _dense_block_fp8_prep),
                 ("runners.engine.models.block_fp8", "block_fp8_grouped_mm", _grouped_block_fp8_prep),
                 ("runners.engine.models.fp8_modules", "fp8_linear", _fp8_linear_prep))  # the static cast
HOST_SYNC_OPS = ("_local_scalar_dense", "item", "nonzero")
ALLOC_OPS = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided")
STEP = "step"  # the kind of ops outside every block


def _op_name(func) -> str:
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


def _aliases(func, args, out) -> bool:
    """Whether ``func`` returned a view of its first argument (no kernel): a view op, or an aliasing
    composite (``to``, ``reshape``, ``contiguous``) that did not copy."""
    import torch

    if not getattr(func, "is_view", False):
        return False
    first = args[0] if args else None
    res = out[0] if isinstance(out, (tuple, list)) and out else out
    if not (isinstance(first, torch.Tensor) and isinstance(res, torch.Tensor)):
        return True
    return res.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


class StepOpCounter:
    """Counts ATen operators by (phase, kind, op name) while active (see the module docstring).

    ``phase`` / ``kind`` are set by the caller (:meth:`in_phase`, block hooks); ``opaque`` > 0 stops the
    counting inside a kernel's reference. ``counts[(phase, kind)]``: Counter of op names (views under
    ``"view:<name>"``)."""

    def __init__(self):
        self.counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
        self.phase: str | None = None
        self.kind = STEP
        self.opaque = 0

    def record(self, name: str) -> None:
        if self.phase is not None:
            self.counts[(self.phase, self.kind)][name] += 1

    @contextmanager
    def in_phase(self, name: str):
        self.phase = name
        try:
            yield
        finally:
            self.phase = None

    def mode(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not counter.opaque:
                    name = _op_name(func)
                    if name in HOST_SYNC_OPS:
                        counter.record(f"sync:{name}")
                    if name in ALLOC_OPS:  # memory only, no kernel (a graph replays none)
                        counter.record(f"view:{name}")
                    else:
                        counter.record(f"view:{name}" if _aliases(func, args, out) else name)
                return out

        del torch
        return Mode()

    def opaque_kernel(self, name: str, fn, *, prep=False):
        """``fn`` counted as the one op ``kernel:<name>`` (its own operators not counted); with ``prep`` (True,
        or a function of the call's arguments that says so) also ``kernel:<name>.prep`` (a helper launch
        before the kernel)."""
        def run(*args, **kwargs):
            if prep(*args, **kwargs) if callable(prep) else prep:
                self.record(f"kernel:{name}.prep")
            self.record(f"kernel:{name}")
            self.opaque += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.opaque -= 1
        return run


@contextmanager
def _patched(counter: StepOpCounter, quant_moe_gemv_max_pairs: dict):
    """Make the kernels' references (and the routed experts, the quantized GEMMs) opaque single ops while
    counting."""
    import importlib

    import runners.engine.models.attention as attention_mod
    import runners.engine.models.block as block_mod
    import runners.engine.models.block_fp8 as block_fp8_mod
    import runners.engine.models.gdn as gdn_mod
    import runners.engine.models.hybrid as hybrid_mod
    import runners.engine.models.layers as layers_mod
    import runners.engine.models.mamba2 as mamba2_mod
    import runners.engine.models.moe as moe_mod
    import runners.engine.models.mtp as mtp_mod
    import runners.engine.models.nvfp4 as nvfp4_mod
    import runners.engine.state as state_mod
    from runners.engine.formats import get_format

    original = state_mod.kernel_or_reference

    def kernel_or_reference(ssm_backend, kernel, reference):
        fn = original(ssm_backend, kernel, reference)
        return counter.opaque_kernel(getattr(kernel, "__name__", "op"), fn)

    saved = []
    try:  # the patching itself inside: what was replaced before an error is put back
        saved += [(m, "kernel_or_reference", original) for m in (state_mod, gdn_mod, mamba2_mod)]
        saved.append((moe_mod, "topk_route_ref", moe_mod.topk_route_ref))
        # the blocks' fused stages: the dispatch CUDA takes (layers.use_inference_kernel true), each kernel
        # run as its reference (same signature) and counted as the one launch it is on CUDA
        for m in (layers_mod, moe_mod, attention_mod, gdn_mod, mamba2_mod, hybrid_mod, mtp_mod, block_mod):
            saved.append((m, "use_inference_kernel", m.use_inference_kernel))
            m.use_inference_kernel = lambda x: True
        from kernels import activation, health, moe_combine, moe_gemv, moe_sort, norm, rope
        from kernels.gdn import prologue
        from kernels.mamba2 import conv

        fused = [(layers_mod, norm, "rms_norm"), (layers_mod, norm, "gated_group_rms_norm"),
                 (moe_mod, moe_combine, "shared_gate_combine"), (attention_mod, rope, "norm_rope"),
                 (gdn_mod, norm, "gated_rms_norm"), (gdn_mod, prologue, "gdn_prologue"),
                 (block_mod, health, "residual_add"), (block_mod, health, "flag_nonfinite"),
                 (block_mod, norm, "add_rms_norm"),
                 (hybrid_mod, health, "flag_nonfinite"), (mtp_mod, health, "flag_nonfinite"),
                 (layers_mod, activation, "relu2"), (layers_mod, activation, "silu_mul"),
                 (moe_mod, activation, "relu2"), (moe_mod, activation, "silu_mul"),
                 (moe_mod, moe_sort, "sort_pairs"), (moe_mod, moe_gemv, "combine_sorted"),
                 (mamba2_mod, conv, "causal_conv_step")]
        for m, owner, attr in fused:
            saved.append((m, attr, getattr(m, attr)))
            setattr(m, attr, counter.opaque_kernel(attr, getattr(owner, attr + "_ref")))
        saved.append((moe_mod.MoE, "_experts", moe_mod.MoE._experts))
        for m in (state_mod, gdn_mod, mamba2_mod):
            m.kernel_or_reference = kernel_or_reference
        moe_mod.topk_route_ref = counter.opaque_kernel("topk_route", moe_mod.topk_route_ref)
        # the router's decode form as on CUDA (moe.ROUTER_FORMS), each kernel its reference counted as one op
        from kernels import router

        form = moe_mod.router_form
        saved.append((moe_mod, "router_form", form))
        moe_mod.router_form = lambda x, n_group: form(x, n_group, on_cuda=True)
        for attr in ("router_fused", "router_logits", "topk_route"):
            saved.append((moe_mod, attr, getattr(moe_mod, attr)))
            setattr(moe_mod, attr, counter.opaque_kernel(attr, getattr(router, attr + "_ref")))
        experts = moe_mod.MoE._experts
        moe_mod.MoE._experts = lambda self, *a: counter.opaque_kernel("moe_experts", experts)(self, *a)
        for mod_name, attr, prep in QUANT_KERNELS:
            mod = importlib.import_module(mod_name)
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, counter.opaque_kernel(attr, getattr(mod, attr), prep=prep))
        # the per-pair quantized experts: CUDA's decision (the pair bound, not the device), counted as one op
        for name, n in quant_moe_gemv_max_pairs.items():
            fmt = get_format(name)
            saved.append((fmt, "use_moe_gemv", fmt.use_moe_gemv))
            fmt.use_moe_gemv = lambda h, indices, pair_kernel=None, n=n: indices.numel() <= n
        # FP8 linears ask their producers for the input codes as on an FP8 GPU (the count's references give
        # them: kernels/norm.py's and kernels/activation.py's quant_scale contract)
        from runners.engine.models.fp8_modules import FP8Linear

        saved.append((FP8Linear, "prequant_scale", FP8Linear.prequant_scale))
        FP8Linear.prequant_scale = _fp8_prequant_scale_on_cuda
        for mod, attr in ((nvfp4_mod, "moe_gemv_nvfp4"), (block_fp8_mod, "moe_gemv_block_fp8")):
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, counter.opaque_kernel("moe_experts", getattr(mod, attr)))
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def _synthetic_model(family: str, fmt: str, layers: int, experts: int, overrides: dict, dtype):
    """``runners.tools.synth.synthetic_model`` in checkpoint format ``fmt`` (bf16: as it is; else the
    release rule of ``fmt`` swapped in and the weights quantized as ``model.load_format=dummy`` does)."""
    import dataclasses

    from registry.hf_config import HybridConfig
    from registry.releases import release_rule
    from runners.engine.dummy import materialize_dummy, plan_dummy
    from runners.tools.synth import synth_config, synthetic_model

    if fmt == "bf16":
        return synthetic_model(family, num_layers=layers, num_experts=experts, overrides=overrides,
                               dtype=dtype, device="cpu")[0]
    config = synth_config(family, num_layers=layers, num_experts=experts, overrides=overrides)
    hc = HybridConfig.from_dict(config, source=f"synthetic {family} {fmt}")
    hc = dataclasses.replace(hc, quantization=release_rule(family, fmt, kv_cache=False))
    plan = plan_dummy(hc, dtype=dtype, with_mtp=hc.num_nextn_predict_layers > 0)
    return materialize_dummy(plan, "cpu")


def count_step_ops(family: str, *, layers: int | None = None, draft_len: int = 0, replay: bool = False,
                   batch: int = 1, steps: int = 4, accept_length: float = 2.6, experts: int = 8,
                   shrink: dict | None = None, prompt_len: int = 12, dtype: str = "bfloat16",
                   fmt: str = "bf16", quant_moe_gemv_max_pairs: int | None = None) -> dict:
    """Op counts of ``steps`` decode steps of a synthetic ``family`` model in checkpoint format ``fmt``
    (:data:`FORMATS`; module docstring). ``quant_moe_gemv_max_pairs``: the pair bound up to which the quantized
    experts take their per-pair path, in every quantized format (None: the engine's per-format
    ``WeightFormat.moe_gemv_bound``, runners.engine.formats).

    Returns ``{"config": ..., "steps": n, "phases": {phase: {"ops", "views", "host_syncs", "kinds": {kind:
    {"ops", "blocks", "ops_per_block", "top": [[op, count per step], ...]}}}}, "total_ops": per step}``; every
    count is per step (mean over the counted steps).

    Raises:
        ValueError: ``replay`` without drafts, an unknown ``fmt`` or one the family has no release rule for
            (registry.releases.FormatError), or no decode step was counted.
    """
    import torch

    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    if replay and draft_len < 1:
        raise ValueError("ssm replay needs drafts (draft_len >= 1)")
    from runners.engine.formats import all_formats

    engine_bound = {f.name: f.moe_gemv_bound() for f in all_formats() if f.moe_gemv}
    bound = (engine_bound if quant_moe_gemv_max_pairs is None
             else dict.fromkeys(engine_bound, quant_moe_gemv_max_pairs))
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    layers = QUARTER_LAYERS[family] if layers is None else layers
    overrides = dict((SHRINK if fmt == "bf16" else FORMAT_SHRINK) if shrink is None else shrink)
    torch.manual_seed(0)
    model = _synthetic_model(family, fmt, layers, experts, overrides, getattr(torch, dtype))
    new_tokens = (steps + 2) * (draft_len + 1)
    max_seq = prompt_len + new_tokens + 2 * (draft_len + 1) + 8
    engine = Engine(model, EngineOptions(dtype=dtype, draft_len=draft_len, ssm_replay=replay,
                                         max_batch_size=batch, max_seq_len=max_seq,
                                         cuda_graph_batch_sizes=[batch]), device=torch.device("cpu"))
    if draft_len:
        engine.force_acceptance(accept_length)
    counter = StepOpCounter()
    blocks = [(b, b.kind) for b in model.layers]
    if model.mtp is not None:
        blocks += [(b, f"mtp.{b.kind}") for b in model.mtp.blocks]
    n_blocks = Counter(kind for _, kind in blocks)

    def enter(kind):
        def pre(module, args):
            counter.kind = kind
        return pre

    def leave(module, args, out):
        counter.kind = STEP

    hooks = [h for b, kind in blocks for h in (b.register_forward_pre_hook(enter(kind)),
                                                b.register_forward_hook(leave))]
    graphs = engine.step.graphs
    original_phases = dict(graphs.phases)
    seen = Counter()

    def wrap(name, fn):
        def run(B, L):
            seen[name] += 1
            if seen[name] == 1:  # the first step warms up (not counted)
                return fn(B, L)
            with counter.in_phase(name):
                return fn(B, L)
        return run

    graphs.phases = {name: wrap(name, fn) for name, fn in original_phases.items()}
    prompt = [(7 * i + 3) % 4000 + 1 for i in range(prompt_len)]
    try:
        with _patched(counter, bound), counter.mode():
            engine.generate([prompt] * batch, new_tokens, stop_token_ids=[])
    finally:
        graphs.phases = original_phases
        for h in hooks:
            h.remove()
    n = min(seen.values()) - 1 if seen else 0
    counted = {name: seen[name] - 1 for name in seen}
    if n < 1:
        raise ValueError(f"no decode step was counted (phases run: {dict(seen)}); raise --steps")
    phases: dict = {}
    for name in original_phases:
        per = max(counted.get(name, 0), 1)
        kinds, ops_all, views_all, syncs = {}, 0, 0, 0
        for (phase, kind), c in sorted(counter.counts.items()):
            if phase != name:
                continue
            ops = {k: v for k, v in c.items() if not k.startswith(("view:", "sync:"))}
            n_ops = sum(ops.values()) / per
            n_views = sum(v for k, v in c.items() if k.startswith("view:")) / per
            n_sync = sum(v for k, v in c.items() if k.startswith("sync:")) / per
            ops_all, views_all, syncs = ops_all + n_ops, views_all + n_views, syncs + n_sync
            nb = n_blocks.get(kind, 0)
            kinds[kind] = {"ops": n_ops, "views": n_views, "blocks": nb,
                           "ops_per_block": n_ops / nb if nb else None,
                           "top": [[k, v / per] for k, v in Counter(ops).most_common()]}
        phases[name] = {"ops": ops_all, "views": views_all, "host_syncs": syncs, "kinds": kinds}
    return {"config": {"family": family, "format": fmt, "layers": layers, "experts": experts, "draft_len": draft_len,
                       "ssm_replay": replay, "batch": batch, "dtype": dtype, "block_kinds": dict(n_blocks),
                       "quant_moe_gemv_max_pairs": bound},
            "steps": n, "phases": phases, "total_ops": sum(p["ops"] for p in phases.values())}


def format_report(report: dict, top: int = 25) -> str:
    """A plain-text table of :func:`count_step_ops`' result: per phase and kind, then the top ops."""
    c = report["config"]
    lines = [f"{c['family']} {c.get('format', 'bf16')}, {c['layers']} layers {c['block_kinds']}, batch {c['batch']}, draft_len "
             f"{c['draft_len']}, ssm_replay {c['ssm_replay']}: {report['total_ops']:.1f} ops per step "
             f"(mean of {report['steps']} steps)"]
    for name, p in report["phases"].items():
        lines.append(f"  phase {name}: {p['ops']:.1f} ops, {p['views']:.1f} views, "
                     f"{p['host_syncs']:.1f} host syncs")
        for kind, k in sorted(p["kinds"].items(), key=lambda kv: -kv[1]["ops"]):
            per = f", {k['ops_per_block']:.1f} per block x {k['blocks']}" if k["blocks"] else ""
            lines.append(f"    {kind:<16} {k['ops']:7.1f} ops{per}")
            ranked = k["top"][:top]
            lines.append("      " + ", ".join(f"{op} {v:g}" for op, v in ranked))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); bad arguments exit 2 with argparse's ``error:`` line, before any
    model is built."""
    from runners.engine.options import DTYPES
    from runners.tools.synth import MIN_EXPERTS, num_layers_range

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(QUARTER_LAYERS), required=True)
    p.add_argument("--format", choices=FORMATS, default="bf16",
                   help="checkpoint format of the synthetic model (its quantized module classes)")
    p.add_argument("--layers", type=int, default=None, help="default: quarter depth (22 / 12)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--draft-len", type=int, default=0)
    p.add_argument("--replay", action="store_true", help="ssm_replay (needs --draft-len >= 1)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accept-length", type=float, default=2.6)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="model dtype (bf16 as the GPU runs: its casts count)")
    p.add_argument("--top", type=int, default=25, help="ops listed per phase and kind")
    p.add_argument("--json", type=Path, default=None, help="also write the counts here")
    p.add_argument("--quant-moe-gemv-max-pairs", type=int, default=None, metavar="N",
                   help="pair bound of the quantized experts' per-pair path, every format (default: the "
                        "engine's per-format bound; 176 counts it as bf16's)")
    args = p.parse_args(argv)
    if args.layers is not None:  # the synthetic model's limits, under this script's option name
        least, most = num_layers_range(args.family)
        if args.layers < least or most is not None and args.layers > most:
            between = f"between {least} and {most}" if most is not None else f"{least} or more"
            p.error(f"--layers {args.layers}: a {args.family} model has {between} layers; use --layers {between}")
    if args.experts < MIN_EXPERTS:
        p.error(f"--experts {args.experts}: a model has at least {MIN_EXPERTS} routed expert; use --experts "
                f"{MIN_EXPERTS} or more")
    if args.quant_moe_gemv_max_pairs is not None and args.quant_moe_gemv_max_pairs < 0:
        p.error(f"--quant-moe-gemv-max-pairs {args.quant_moe_gemv_max_pairs}: a pair bound is a count; use 0 "
                "(no per-pair path) or more")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: its folder {args.json.parent} does not exist; create it or pass another path")
    try:
        report = count_step_ops(args.family, layers=args.layers, draft_len=args.draft_len, replay=args.replay,
                                batch=args.batch, steps=args.steps, accept_length=args.accept_length,
                                experts=args.experts, dtype=args.dtype, fmt=args.format,
                                quant_moe_gemv_max_pairs=args.quant_moe_gemv_max_pairs)
    except ValueError as e:  # the engine's and the synthetic model's checks of these arguments
        p.error(str(e))
    print(format_report(report, args.top))
    if args.json:
        try:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as e:
            p.error(f"--json {args.json}: cannot write it ({e.strerror}); pass a writable path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
