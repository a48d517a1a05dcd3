"""torch.compile of the decode step's per-layer math (``EngineOptions.compile``): what is compiled, what is
kept out, and the compile-time bound.

The decode step (runners/engine/step.py) is hundreds of small kernels at small batch: elementwise chains,
norms, gates and residuals between the GEMMs (issue 27's profile). With ``compile`` on, every residual block
of the step's forwards (target and MTP) runs through one ``torch.compile``'d function
(:func:`compiled_block_call`: inductor, no CUDA-graph mode -- the engine captures its own graphs,
runners/engine/graphs.py), so inductor fuses that math into a few Triton kernels, as gpt-fast does
(https://github.com/pytorch-labs/gpt-fast). Blocks of one kind share their compiled code (parameters are
graph inputs), so the compile cost scales with block kinds x step shapes, not with depth.

Kept out of the compiled region, called by the compiled code as they are (a graph break; :func:`eager_op`):
the hand-written recurrent kernels (``runners.engine.state.kernel_or_reference``: SSM decode / verify /
replay, GDN rule, and their references), FlashInfer's kernel, the routed experts (grouped GEMMs, quantized
or not) and the quantized linears. Their outputs are bitwise those of the eager step; the compiled math
around them agrees with eager to float rounding (inductor reorders reductions).

Dynamic batch (:data:`DYNAMIC_BATCH`, on): the batch dimension is symbolic, so one compiled graph per block
kind and step shape serves every captured batch size >= 2, as vLLM compiles one graph for all its CUDA-graph
sizes (https://docs.vllm.ai/en/latest/design/torch_compile.html). Each call marks dim 0 of the block's input
and of the batch metadata's [B] tensors with ``torch._dynamo.maybe_mark_dynamic`` (weak: where the code
specialises a size -- batch 1, by dynamo's 0/1 specialisation -- dynamo specialises instead of raising), and
compiles with ``dynamic=None``: dynamo's automatic dynamic shapes make the tensors of the frames that resume
after a graph break (no mark reaches the eager operators' outputs) symbolic at their second batch size. A
strict ``mark_dynamic`` raises there (the resumed frames specialise the batch), and marks with
``dynamic=False`` leave those frames static: they recompile at every size. Batch 1 keeps its own specialised
graphs. Automatic dynamic applies to any size that changes between calls of one frame, so a frame run at
T = 1 and T = K + 1 (the draft and the verify of one block kind) or at two KV buckets may also compile its
second shape symbolic in T or the bound: fewer graphs still, and the same values. Measured on the CPU (tiny
NemotronH: Mamba2, attention, MoE; batch sizes [1, 2, 4, 8], inductor caches off; docs/performance.md,
"compile start-up"): plain decoding 36 graphs in 129 s per size, 18 graphs in 65 s dynamic (9 at batch 1, 9
at batch 2, none after); MTP (K = 2) with replay 68 graphs in 312 s per size, 34 in 252 s dynamic (17 +
17). Set :data:`DYNAMIC_BATCH` to False for one static compile per (batch size, KV bucket, phase)
(``dynamic=False``), should the symbolic batch make the GPU's kernels slower (not yet measured there).
With inductor's on-disk caches on (torch's default), a reused AOTAutograd cache entry checks guards of its own
and adds them to the frame's, so a later batch size can still recompile a resumed frame (CI counted 2 graphs
at batch 4 that a cold compile never pays); the step's values do not change, only its compile count.

The step compiles before its graphs are captured (``DecodeStep.compile_for``, per (padded batch size, KV
bound) it has not run: with a dynamic batch the later sizes find the graphs compiled and cost only the
warm-up); the seconds and the graphs dynamo compiled are reported (``DecodeStep.compile_seconds``,
``DecodeStep.compile_graphs``) and a total beyond :data:`COMPILE_WARN_SECONDS` logs a warning that names the
option to turn off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# A step's compile time above this (seconds, summed over its batch sizes and KV buckets) is reported as a
# warning: the compile is paid once per engine, but it should not dominate a short evaluation.
COMPILE_WARN_SECONDS = 600.0
# Compiled code entries per code object: block kinds (<= 5) x phases' shapes (T = 1, K + 1) x batch sizes
# (<= 8 by default; 2 -- batch 1 and the rest -- with DYNAMIC_BATCH) x KV buckets (attention only); dynamo's
# default limit (8) would fall back to eager.
RECOMPILE_LIMIT = 1024
# One graph for every batch size >= 2 (symbolic batch dimension) instead of one per batch size; False: the
# static per-size compile (module docstring).
DYNAMIC_BATCH = True


@torch.compiler.disable
def _call_eager(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def eager_op(fn: Callable) -> Callable:
    """``fn`` as the compiled code should call it: unchanged when not tracing; while torch.compile traces, a
    call that leaves the compiled region and runs ``fn`` as it is (a Triton launch, a grouped GEMM, a
    function that mutates its arguments). Costs nothing in eager code."""
    return functools.partial(_call_eager, fn) if torch.compiler.is_compiling() else fn


def _call_block(block, x, cache, meta, peak=None):
    y = block(x, cache, meta)
    return y if peak is None else (y, peak(y))


def eager_block_call(block, x, cache, meta, peak=None):
    """A residual block's forward, eagerly: ``block(x, cache, meta)``; with ``peak`` (a function of the
    output, e.g. the model's max-|x| health reduction) the pair ``(output, peak(output))``, so a compiled call
    fuses that reduction into the block's last kernels instead of launching it after the block."""
    return _call_block(block, x, cache, meta, peak)


def mark_batch_dynamic(x: torch.Tensor, meta) -> None:
    """Mark dim 0 -- the batch -- of ``x`` [B, T, D] and of every tensor field of ``meta`` (a ``BatchMeta``:
    slot_ids, start_pos, lengths, cache_rows, all [B]) as dynamic for dynamo, weakly
    (``torch._dynamo.maybe_mark_dynamic``: a size the code specialises, such as 1, is specialised, not an
    error). Sets an attribute on those tensor objects; no device work."""
    torch._dynamo.maybe_mark_dynamic(x, 0)
    for v in vars(meta).values():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            torch._dynamo.maybe_mark_dynamic(v, 0)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (``torch._dynamo.utils.counters``' unique_graphs,
    every torch.compile'd function together): the difference across a compile is the graphs it paid."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def compiled_block_call(dynamic_batch: bool | None = None) -> Callable:
    """``eager_block_call`` compiled with inductor (no cudagraphs mode), same arguments and result (a ``peak``
    function is traced into the block's graph: dynamo guards on its identity). One
    compiled function per process and mode: dynamo keys its code entries by the block's structure and the
    input shapes. ``dynamic_batch`` (None: :data:`DYNAMIC_BATCH`, read at the call): the batch dimension is
    symbolic (:func:`mark_batch_dynamic` on each call, ``dynamic=None``: one graph for batch sizes >= 2,
    batch 1 specialised); False: ``dynamic=False``, every shape static (one graph per batch size). Raises the
    dynamo recompile limit to :data:`RECOMPILE_LIMIT` (static shapes compile an entry per shape)."""
    return _compiled_block_call(DYNAMIC_BATCH if dynamic_batch is None else bool(dynamic_batch))


@functools.cache
def _compiled_block_call(dynamic_batch: bool) -> Callable:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * RECOMPILE_LIMIT)
    elif hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 8 * RECOMPILE_LIMIT)
    if not dynamic_batch:
        return torch.compile(_call_block, backend="inductor", dynamic=False, fullgraph=False)
    compiled = torch.compile(_call_block, backend="inductor", dynamic=None, fullgraph=False)

    def call(block, x, cache, meta, peak=None):
        mark_batch_dynamic(x, meta)
        return compiled(block, x, cache, meta, peak)
    return call
