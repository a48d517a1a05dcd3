"""torch.compile of the decode step's per-layer math (``EngineOptions.compile``): what is compiled, what is
kept out, and the compile-time bound.

The decode step (runners/engine/step.py) is hundreds of small kernels at small batch: elementwise chains,
norms, gates and residuals between the GEMMs (issue 27's profile). With ``compile`` on, every residual block
of the step's forwards (target and MTP) runs through one ``torch.compile``'d function
(:func:`compiled_block_call`: inductor, ``dynamic=False``, no CUDA-graph mode -- the engine captures its own
graphs, runners/engine/graphs.py), so inductor fuses that math into a few Triton kernels, as gpt-fast does
(https://github.com/pytorch-labs/gpt-fast). Blocks of one kind share their compiled code (parameters are
graph inputs), so the compile cost scales with block kinds x step shapes, not with depth.

Kept out of the compiled region, called by the compiled code as they are (a graph break; :func:`eager_op`):
the hand-written recurrent kernels (``runners.engine.cache.kernel_or_reference``: SSM decode / verify /
replay, GDN rule, and their references), FlashInfer's kernel, the routed experts (grouped GEMMs, quantized
or not) and the quantized linears. Their outputs are bitwise those of the eager step; the compiled math
around them agrees with eager to float rounding (inductor reorders reductions).

The step compiles once per (padded batch size, KV bucket, phase) before its graphs are captured
(``DecodeStep.compile_for``); the seconds spent are reported (``DecodeStep.compile_seconds``) and a total
beyond :data:`COMPILE_WARN_SECONDS` logs a warning that names the option to turn off.
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
# (<= 8 by default) x KV buckets (attention only); dynamo's default limit (8) would fall back to eager.
RECOMPILE_LIMIT = 1024


@torch.compiler.disable
def _call_eager(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def eager_op(fn: Callable) -> Callable:
    """``fn`` as the compiled code should call it: unchanged when not tracing; while torch.compile traces, a
    call that leaves the compiled region and runs ``fn`` as it is (a Triton launch, a grouped GEMM, a
    function that mutates its arguments). Costs nothing in eager code."""
    return functools.partial(_call_eager, fn) if torch.compiler.is_compiling() else fn


def _call_block(block, x, cache, meta):
    return block(x, cache, meta)


def eager_block_call(block, x, cache, meta):
    """A residual block's forward, eagerly: ``block(x, cache, meta)``."""
    return _call_block(block, x, cache, meta)


@functools.cache
def compiled_block_call() -> Callable:
    """``eager_block_call`` compiled with inductor (``dynamic=False``; no cudagraphs mode). One compiled
    function per process: dynamo keys its code entries by the block's structure and the input shapes.
    Raises the dynamo recompile limit to :data:`RECOMPILE_LIMIT` (shapes are static on purpose)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * RECOMPILE_LIMIT)
    elif hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 8 * RECOMPILE_LIMIT)
    return torch.compile(_call_block, backend="inductor", dynamic=False, fullgraph=False)
