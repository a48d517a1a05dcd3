"""Memory accounting of a model load: the fit check before anything is allocated, and the load report.

- :func:`check_memory_fits` compares the bytes a load will allocate (weights at their load dtypes, known from
  the safetensors headers; caches at max_batch_size / max_seq_len, from
  ``runners.engine.cache.cache_memory_bytes``)
  with the device's free memory (``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of /proc/meminfo on
  the CPU) and raises :class:`InsufficientMemoryError` naming both numbers and the fixes that can help; a
  suggested smaller batch leaves :func:`fit_headroom_bytes` free (activations, the prefix cache).
  Tensor-parallel ranks that share one device (``runners.engine.launch.launch(share_device=True)``, or the
  host's memory on the CPU) each take an equal share of its free memory, so that their weights, caches,
  prefill chunks and prefix caches together fit it.
- :class:`LoadReport` is what ``Engine.from_pretrained`` measured: wall time, bytes by kind, the host's peak
  resident set (``VmHWM`` of /proc/self/status, reset at the start of the load through /proc/self/clear_refs
  where the kernel allows) and the device's peak allocation (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from registry.errors import UserError

log = logging.getLogger(__name__)

GIB = 2**30


class InsufficientMemoryError(UserError):
    """Weights + caches do not fit the device's free memory (raised before any allocation)."""


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def free_device_memory(device: torch.device) -> tuple[int | None, str]:
    """(free bytes, where they come from) of ``device``; (None, reason) when it cannot be known.

    CUDA: ``torch.cuda.mem_get_info`` (free bytes of the whole GPU, other processes included) plus what this
    process's caching allocator holds reserved but unallocated (``memory_reserved - memory_allocated``): a
    model freed earlier in the process (the first arm of compare=replay) leaves its blocks reserved, invisible
    to the driver's count yet reusable by the next load. CPU: ``MemAvailable`` of /proc/meminfo (Linux; what
    the kernel can hand out without swapping).
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached), (f"free memory of {device} (torch.cuda.mem_get_info, plus this process's "
                                    "reserved but unallocated blocks)")
    if device.type == "cpu":
        try:
            m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        except OSError as e:
            return None, f"/proc/meminfo is not readable ({e})"
        if m is None:
            return None, "/proc/meminfo has no MemAvailable line"
        return int(m.group(1)) * 1024, "available host memory (MemAvailable of /proc/meminfo)"
    return None, f"no free-memory query for device type {device.type!r}"


# The share of the device's free memory a suggested batch leaves for activations (prefill and decode
# temporaries, the allocator's fragmentation) beyond weights, caches and the prefix cache's budget.
ACTIVATION_HEADROOM_FRACTION = 0.05


def prefix_cache_cap(budget_bytes: int, weight_bytes: int, cache_bytes: int) -> int:
    """The most the prefix cache may take after a load (bytes): half of the memory weights and caches leave;
    the other half stays free for activations. The one rule both the load (``Engine._from_plan``) and the
    batch suggestion (:func:`fit_headroom_bytes`) follow."""
    return max(0, (budget_bytes - weight_bytes - cache_bytes) // 2)


def fit_headroom_bytes(budget_bytes: int, prefix_cache_bytes: int, prefill_bytes_per_token: int = 0) -> int:
    """Bytes a suggested max_batch_size leaves free beyond weights and caches: the prefix cache's budget
    (``prefix_cache_bytes``; 0 when it is off) plus, for activations, the largest of the same again,
    ``ACTIVATION_HEADROOM_FRACTION`` of ``budget_bytes`` and the smallest prefill the load accepts
    (:func:`min_prefill_bytes` of ``prefill_bytes_per_token``; 0: not counted). Since
    :func:`prefix_cache_cap` gives the prefix cache half of what is left, this leaves it its whole budget,
    and a suggested batch is never refused by the prefill's own check."""
    activations = max(prefix_cache_bytes, int(ACTIVATION_HEADROOM_FRACTION * budget_bytes),
                      min_prefill_bytes(prefill_bytes_per_token) if prefill_bytes_per_token else 0)
    return prefix_cache_bytes + activations


# Transient bytes per element of the tensors a routed-expert pair keeps alive at once in a prefill forward
# (runners.engine.models.layers / fp8.py / quant.py): the gathered input (bf16 2 B, the float32 quantization's
# three temporaries -- upcast, scaled, clamped -- 3 x 4 B, its FP8 copy 1 B) and the expert's hidden
# activation (bf16 output 2 B, the activation's output 2 B, the same 3 x 4 B and 1 B): 1.58 MiB per token
# for Nemotron 3 Super FP8, inside the bounds its full-depth prefills on the H200 measured
# (docs/performance.md, "Full depth on one H200").
PREFILL_INPUT_BYTES_PER_ELEMENT = 15
PREFILL_HIDDEN_BYTES_PER_ELEMENT = 17
# What stays free beyond the prefill's estimate: CUDA-graph pools, the allocator's fragmentation, decode
# temporaries.
PREFILL_MARGIN_BYTES = 2 * GIB
# Below this many tokens per prefill forward the prefill is mostly launch latency: refuse instead.
MIN_PREFILL_CHUNK_TOKENS = 128


def prefill_bytes_per_token(config) -> int:
    """Estimated peak transient bytes one token of a prefill forward needs (the widest layer's temporaries).

    Routed experts dominate: ``num_experts_per_tok`` pairs per token, each holding its input
    (``moe_latent_size`` or ``hidden_size`` wide) and its hidden activation (``moe_intermediate_size``, twice
    for gated experts) at :data:`PREFILL_INPUT_BYTES_PER_ELEMENT` / :data:`PREFILL_HIDDEN_BYTES_PER_ELEMENT`
    bytes per element; a dense layer (MLP, shared expert, the mixers' input projections) adds the same per
    element of its widest projection once.

    Args:
        config: a ``registry.hf_config.HybridConfig``.

    Returns:
        Bytes per prefill token (int, > 0).
    """
    c = config
    gate = 2 if c.mlp_gated else 1
    pair = 0
    if c.n_routed_experts:
        width_in = c.moe_latent_size or c.hidden_size
        pair = (PREFILL_INPUT_BYTES_PER_ELEMENT * width_in
                + PREFILL_HIDDEN_BYTES_PER_ELEMENT * gate * c.moe_intermediate_size)
    mamba_in = (2 * c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
                + c.mamba_num_heads) if c.mamba_num_heads else 0
    gdn_in = (2 * c.gdn_num_key_heads * c.gdn_key_head_dim + 2 * c.gdn_num_value_heads * c.gdn_value_head_dim
              if c.gdn_num_key_heads else 0)
    dense = max(c.hidden_size, gate * c.intermediate_size, gate * c.moe_shared_expert_intermediate_size,
                mamba_in, gdn_in)
    return c.num_experts_per_tok * pair + PREFILL_HIDDEN_BYTES_PER_ELEMENT * dense


def min_prefill_bytes(bytes_per_token: int) -> int:
    """Free bytes the smallest prefill a load accepts needs: :data:`MIN_PREFILL_CHUNK_TOKENS` tokens of
    ``bytes_per_token`` (:func:`prefill_bytes_per_token`) plus :data:`PREFILL_MARGIN_BYTES`."""
    return PREFILL_MARGIN_BYTES + MIN_PREFILL_CHUNK_TOKENS * bytes_per_token


def fit_prefill_chunk_tokens(free_bytes: int, bytes_per_token: int, requested: int) -> int:
    """The most tokens per prefill forward, up to ``requested``, whose estimated temporaries
    (``bytes_per_token`` each, :func:`prefill_bytes_per_token`) fit ``free_bytes`` less
    :data:`PREFILL_MARGIN_BYTES`. May return less than :data:`MIN_PREFILL_CHUNK_TOKENS` (even 0): the caller
    refuses then."""
    return max(0, min(requested, (free_bytes - PREFILL_MARGIN_BYTES) // max(1, bytes_per_token)))


def _other_fixes(device: torch.device, quant: str | None, can_shard: bool) -> list[str]:
    """Fixes beyond smaller caches that can help this load: more GPUs only on CUDA where the load can be
    sharded (not dummy weights, not the CPU), a smaller weight format only where one exists."""
    fixes = []
    if device.type == "cuda" and can_shard:
        fixes.append("spread the model over more GPUs (world_size=N)")
    smaller = {"none": "use an FP8 or NVFP4 entry (1 byte or 4 bits per stored weight)",
               "fp8": "use an NVFP4 entry (4-bit weights, about half the bytes of FP8)"}.get(quant or "none")
    if smaller:
        fixes.append(smaller)
    return fixes


def check_memory_fits(
    weight_bytes: int,
    cache_bytes: int,
    device: torch.device | str,
    *,
    budget_bytes: int | None = None,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    cache_bytes_at: Callable[[int], int] | None = None,
    prefix_cache_bytes: int = 0,
    prefill_bytes_per_token: int = 0,
    quant: str | None = None,
    can_shard: bool = True,
    ranks_per_device: int = 1,
) -> int | None:
    """Raise when the weights and caches of a load cannot fit; call it before allocating anything.

    Args:
        weight_bytes: bytes of the parameters and buffers at their load dtypes.
        cache_bytes: bytes of the per-slot caches (``Engine.cache_memory()`` summed).
        device: where they would be allocated.
        budget_bytes: the bytes available; None (default) asks the device (:func:`free_device_memory`).
        max_batch_size, max_seq_len: named in the message (the settings the cache size follows).
        cache_bytes_at: ``f(batch) -> cache bytes`` at another max_batch_size (monotone in batch): with it a
            refusal names the largest batch below ``max_batch_size`` that fits with
            :func:`fit_headroom_bytes` to spare (:func:`largest_fitting_batch`).
        prefix_cache_bytes: the prefix cache's budget (0: off), reserved in a suggested batch.
        prefill_bytes_per_token: :func:`prefill_bytes_per_token` of the model (0: not counted): a suggested
            batch leaves room for the smallest prefill (:func:`min_prefill_bytes`).
        quant: the weights' quantization method (registry.schema.Quant's values; None = "none"): a refusal
            suggests a smaller format only where one exists.
        can_shard: whether the load could be spread over GPUs (False for dummy weights): a refusal on CUDA
            suggests world_size only then.
        ranks_per_device: how many tensor-parallel ranks load onto this device at once (each its own shard:
            ``runners.engine.tp.TensorParallel.ranks_per_device``); with ``budget_bytes`` None each gets an
            equal share of the device's free memory (they all ask before any of them allocates, so each would
            otherwise count the others' share as its own).

    Returns:
        The budget compared against, or None when it could not be determined (the check is skipped and a
        log line says why).

    Raises:
        InsufficientMemoryError: weight_bytes + cache_bytes > budget; the message names both numbers, the
            budget and the fixes that can help (smaller max_batch_size / max_seq_len, more GPUs, a smaller
            weight format).
    """
    device = torch.device(device)
    where = "the given memory budget"
    if budget_bytes is None:
        budget_bytes, where = free_device_memory(device)
        if budget_bytes is None:
            log.info("memory fit check skipped: %s", where)
            return None
        if ranks_per_device > 1:
            budget_bytes //= ranks_per_device
            where = f"{where}, divided among the {ranks_per_device} tensor-parallel ranks that share it"
    need = weight_bytes + cache_bytes
    if need > budget_bytes:
        sizes = ", ".join(
            f"{k}={v}" for k, v in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)) if v
        )
        headroom = fit_headroom_bytes(budget_bytes, prefix_cache_bytes, prefill_bytes_per_token)
        fit = None
        if cache_bytes_at is not None and max_batch_size:
            fit = largest_fitting_batch(weight_bytes, budget_bytes, cache_bytes_at, max_batch_size - 1,
                                        headroom_bytes=headroom)
        fixes = _other_fixes(device, quant, can_shard)
        if fit is not None:
            first = (f"lower max_batch_size: eval.batch_size={fit} is the largest that fits (weights + "
                     f"{_gib(cache_bytes_at(fit))} of caches, {_gib(headroom)} left for activations and the "
                     "prefix cache), or lower max_seq_len (model.max_seq_len=N)")
        elif weight_bytes >= budget_bytes:
            first = ("the weights alone exceed it, so no smaller max_batch_size or max_seq_len helps: run on "
                     f"a device with more than {_gib(weight_bytes)} free")
        elif cache_bytes_at is not None:
            first = (f"not even max_batch_size 1 fits with {_gib(headroom)} left for activations and the "
                     "prefix cache: lower max_seq_len (model.max_seq_len=N)")
        else:
            first = ("lower max_batch_size or max_seq_len (run.py: eval.batch_size=N, model.max_seq_len=N) "
                     "to shrink the caches")
        raise InsufficientMemoryError(
            f"the model needs {_gib(weight_bytes)} of weights + {_gib(cache_bytes)} of caches"
            f"{f' ({sizes})' if sizes else ''} = {_gib(need)}, more than the {_gib(budget_bytes)} of {where} "
            f"on {device}",
            "; or ".join([first, *fixes]),
        )
    return budget_bytes


def largest_fitting_batch(weight_bytes: int, budget_bytes: int, cache_bytes_at: Callable[[int], int],
                          upper: int, *, headroom_bytes: int = 0) -> int | None:
    """The largest batch b in [1, upper] with weight_bytes + cache_bytes_at(b) + headroom_bytes <=
    budget_bytes (binary search; cache_bytes_at must not decrease with b), or None when not even b = 1 fits.
    ``headroom_bytes``: what must stay free (:func:`fit_headroom_bytes`)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if weight_bytes + cache_bytes_at(mid) + headroom_bytes <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def host_peak_rss_reset() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where it is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def host_peak_rss_bytes() -> int | None:
    """Peak resident set of this process (VmHWM; file-backed pages such as memory-mapped safetensors
    included), or None off Linux."""
    try:
        m = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


@dataclass
class LoadReport:
    """What one ``Engine.from_pretrained`` measured (bytes; seconds of wall time).

    ``weight_bytes`` / ``cache_bytes``: parameters and buffers, and per-slot caches, as allocated.
    ``budget_bytes``: the free memory the fit check compared against (None: not determinable, skipped).
    ``host_peak_rss_bytes``: VmHWM after the load; it is the load's own peak when ``host_peak_reset`` (the
    counter was reset at the start), else the process's peak so far. ``device_peak_bytes`` /
    ``device_allocated_bytes``: ``torch.cuda.max_memory_allocated`` since the start of the load and
    ``memory_allocated`` after it (None off CUDA).
    """

    seconds: float
    weights_seconds: float
    device: str
    dtype: str
    weight_bytes: int
    cache_bytes: int
    budget_bytes: int | None
    host_peak_rss_bytes: int | None
    host_peak_reset: bool
    device_peak_bytes: int | None
    device_allocated_bytes: int | None

    def to_dict(self) -> dict:
        return asdict(self)
