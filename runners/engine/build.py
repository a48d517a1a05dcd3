"""Building an engine from a planned model: the fit check, the prefill chunk and prefix-cache caps, the load.

``Engine.from_pretrained`` (a checkpoint) and ``Engine.from_dummy`` (random weights) plan a model on the meta
device; :func:`from_plan` checks that its weights and the caches fit the device's memory before anything is
allocated (runners.engine.memory), lowers ``prefill_chunk_tokens`` and caps ``prefix_cache_bytes`` to what
stays free (the options the engine then runs on: ``options.replace``, never a field copied elsewhere), builds
the weights, the engine around them and its ``LoadReport``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from runners.engine.memory import (
    GIB,
    MIN_PREFILL_CHUNK_TOKENS,
    PREFILL_MARGIN_BYTES,
    InsufficientMemoryError,
    LoadReport,
    check_memory_fits,
    fit_prefill_chunk_tokens,
    host_peak_rss_bytes,
    host_peak_rss_reset,
    prefill_bytes_per_token,
    prefix_cache_cap,
)
from runners.engine.options import EngineOptions, dtype_name
from runners.engine.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, prefix_cache_off_reason
from runners.engine.runner import planned_cache_memory, state_dtype

log = logging.getLogger(__name__)


def from_plan(engine_class, plan, build, options: EngineOptions, device: torch.device, tensor_parallel,
              prefix_store: PrefixCache | None, t0: float, host_reset: bool, *, shardable: bool = True):
    """The fit check on a planned (meta-device) model (``runners.engine.loader.plan_load`` or
    ``runners.engine.dummy.plan_dummy``), then ``build(plan, device)`` and ``engine_class(model, options,
    ...)`` around it, with its load report (``engine.load_report``). ``t0`` / ``host_reset``: the load's
    clock (:func:`start_load_clock`); ``shardable``: whether a refusal may suggest more GPUs (False for
    dummy weights, built on one device).

    Raises:
        runners.engine.memory.InsufficientMemoryError: weights + caches (or a minimal prefill) do not fit;
            raised before any allocation.
    """
    # the caches this engine will allocate, sized before anything is: weights + caches must fit
    ssm_state = state_dtype(options, plan.config)
    kinds = plan.model.cache_kinds(include_mtp=options.draft_len > 0)

    def cache_bytes_at(batch: int) -> int:
        sized = dataclasses.replace(options, max_batch_size=batch)
        return sum(planned_cache_memory(plan.config, kinds, sized, ssm_state).values())

    cache_bytes = cache_bytes_at(options.max_batch_size)
    prefix_on = prefix_store is None and prefix_cache_off_reason(
        options, ssm_state_dtype=dtype_name(ssm_state)) is None
    quant = plan.config.quantization
    budget = check_memory_fits(plan.weight_bytes, cache_bytes, device,
                               budget_bytes=options.memory_budget_bytes,
                               max_batch_size=options.max_batch_size, max_seq_len=options.max_seq_len,
                               cache_bytes_at=cache_bytes_at,
                               prefix_cache_bytes=_prefix_cache_want(options) if prefix_on else 0,
                               prefill_bytes_per_token=prefill_bytes_per_token(plan.config),
                               quant=quant.method if quant is not None else "none", can_shard=shardable,
                               ranks_per_device=(1 if tensor_parallel is None
                                                 else tensor_parallel.ranks_per_device))
    if budget is not None:
        options = _fit_prefill_chunk(options, plan, budget, cache_bytes, device, tensor_parallel)
    if budget is not None and prefix_on:
        cap = prefix_cache_cap(budget, plan.weight_bytes, cache_bytes)
        if tensor_parallel is not None:  # one byte budget for every rank: their caches stay in lockstep
            cap = tensor_parallel.all_ranks_min(cap, device)
        options = _cap_prefix_cache(options, cap)
    t_weights = time.perf_counter()
    model = build(plan, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_weights = time.perf_counter() - t_weights
    engine = engine_class(model, options, device=device, tensor_parallel=tensor_parallel,
                 prefix_store=prefix_store)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    engine.load_report = LoadReport(
        seconds=time.perf_counter() - t0,
        weights_seconds=t_weights,
        device=str(device),
        dtype=options.dtype,
        weight_bytes=plan.weight_bytes,
        cache_bytes=sum(engine.cache_memory().values()),
        budget_bytes=budget,
        host_peak_rss_bytes=host_peak_rss_bytes(),
        host_peak_reset=host_reset,
        device_peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        device_allocated_bytes=torch.cuda.memory_allocated(device) if cuda else None,
    )
    return engine


def _fit_prefill_chunk(options: EngineOptions, plan, budget: int, cache_bytes: int, device: torch.device,
                       tensor_parallel) -> EngineOptions:
    """``options`` with ``prefill_chunk_tokens`` lowered to what the memory left after weights and caches
    holds (runners.engine.memory.prefill_bytes_per_token's estimate; every rank takes the smallest, so that
    their forwards stay in lockstep), said in a warning.

    Raises:
        InsufficientMemoryError: fewer than ``MIN_PREFILL_CHUNK_TOKENS`` tokens per forward would fit.
    """
    per_token = prefill_bytes_per_token(plan.config)
    left = budget - plan.weight_bytes - cache_bytes
    chunk = fit_prefill_chunk_tokens(left, per_token, options.prefill_chunk_tokens)
    if tensor_parallel is not None:
        chunk = tensor_parallel.all_ranks_min(chunk, device)
    if chunk >= options.prefill_chunk_tokens:
        return options
    what = (f"{left / GIB:.2f} GiB are left after {plan.weight_bytes / GIB:.2f} GiB of weights and "
            f"{cache_bytes / GIB:.2f} GiB of caches; a prefill token needs about {per_token / 2**20:.2f} MiB "
            f"of temporaries (an estimate) and {PREFILL_MARGIN_BYTES / GIB:.0f} GiB stay free")
    if chunk < min(MIN_PREFILL_CHUNK_TOKENS, options.prefill_chunk_tokens):
        raise InsufficientMemoryError(
            f"no room for a prefill of {MIN_PREFILL_CHUNK_TOKENS} tokens per forward on {device}: {what}",
            "lower max_batch_size or max_seq_len to shrink the caches (run.py: eval.batch_size=N, "
            "model.max_seq_len=N)")
    log.warning("prefill_chunk_tokens lowered from %d to %d to fit the device: %s",
                options.prefill_chunk_tokens, chunk, what)
    return options.replace(prefill_chunk_tokens=chunk)


def _prefix_cache_want(options: EngineOptions) -> int:
    """The prefix cache's byte budget asked of the engine: ``prefix_cache_bytes``, else the default."""
    return DEFAULT_PREFIX_CACHE_BYTES if options.prefix_cache_bytes is None else options.prefix_cache_bytes


def _cap_prefix_cache(options: EngineOptions, cap: int) -> EngineOptions:
    """``options`` with ``prefix_cache_bytes`` at most ``cap`` (the prefix cache grows while generating: it
    may take at most half of the memory that stays free after weights and caches)."""
    want = _prefix_cache_want(options)
    if want <= cap:
        return options
    log.warning("prefix_cache_bytes=%d capped at %d (half of the memory left after weights and caches)", want,
                cap)
    return options.replace(prefix_cache_bytes=cap)


def start_load_clock(device: torch.device) -> tuple[float, bool]:
    """Start a load's measurements: (perf_counter seconds, whether the host peak RSS could be reset); the
    device's peak-memory counter is reset on CUDA (LoadReport's device peak covers the load only)."""
    t0 = time.perf_counter()
    host_reset = host_peak_rss_reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return t0, host_reset

