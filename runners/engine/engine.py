"""The inference engine: batched greedy generation with continuous batching over per-slot caches.

The engine knows nothing about tokenization: prompts and outputs are token ids. ``generate`` admits
requests into free cache slots, prefills newly admitted requests together (right-padded, long prompts in
chunks of ``prefill_chunk_tokens``), then decodes all active slots in one batched forward per step; a
finished request frees its slot at once and a waiting request takes it. Host-side bookkeeping (appending a
token, stop checks, callbacks) loops over requests; model compute never does.

With ``draft_len = K > 0`` each decode step is an MTP speculative step (the phases after
:meth:`Engine._phase_draft`): K drafts
from the checkpoint's MTP module, one verify forward over K + 1 tokens, greedy acceptance, and a rewind
commit of the recurrent state; the output equals plain greedy decoding. ``ssm_replay=True`` replaces the
rewind commit by replay (TensorRT-LLM's "SSM replay"; ``runners.engine.cache.Mamba2ReplayState`` /
``GDNReplayState``): a verify fast-forwards the committed state by the previous step's accepted tokens, and
the commit only advances per-slot bookkeeping. ``ssm_backend`` ("triton" default on CUDA, "flashinfer",
"torch" default on CPU) picks who runs the recurrent decode / verify / commit operators: the Triton kernels of
kernels/ or their PyTorch references (the cache's layer states carry it to the mixers).

A decode step never synchronises with the host: each slot's length, last token and first draft live on the
device and the step advances them itself; the host only writes the batch's slot ids and reads the new tokens
back through pinned memory (:meth:`Engine._launch` / :meth:`Engine._step_tokens`). The step is a fixed
sequence of phases (decode; or draft, verify, commit, catch-up) that ``runners.engine.graphs.StepGraphs`` runs
eagerly or as CUDA graphs captured per padded batch size (``cuda_graph_batch_sizes``; PAD rows touch no
live slot). With ``overlap_steps`` (default on CUDA) the next step is queued before the host does this one's
bookkeeping (token appends, stop checks, callbacks), so the two overlap.

Contract: docs/architecture.md ("Engine API").
"""

from __future__ import annotations

import logging
import numbers
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels._common import PAD_SLOT_ID
from runners.engine.cache import SSM_BACKENDS, BatchMeta, HybridCache, cache_memory_bytes
from runners.engine.graphs import (
    HostBlock,
    HostRing,
    PhaseTimer,
    StepGraphs,
    StepIO,
    default_graph_batch_sizes,
    kv_bucket,
)
from runners.engine.loader import materialize, plan_load
from runners.engine.memory import LoadReport, check_memory_fits, host_peak_rss_bytes, host_peak_rss_reset
from runners.engine.models.config import HybridConfig
from runners.engine.models.fp8 import FP8_DTYPE
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.mamba2 import Mamba2Mixer
from runners.engine.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from runners.engine.quant import kv_cache_scales
from runners.engine.stats import GenerationStats

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN = 64, 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_QUANTS = {None: None, "none": None, "fp8": FP8_DTYPE}  # kv_cache_quant -> KV storage dtype


def _kv_cache_dtype(kv_cache_quant: str | None) -> torch.dtype | None:
    if kv_cache_quant not in KV_CACHE_QUANTS:
        raise ValueError(f"kv_cache_quant={kv_cache_quant!r} is not one of 'none', 'fp8'")
    return KV_CACHE_QUANTS[kv_cache_quant]


class SlotCounters:
    """Per-slot speculative counters of the request that holds each cache slot; host int64 tensors.

    ``request_steps`` [S], ``accepted_drafts`` [S], ``accepted_per_position`` [S, K] and ``num_accepted_hist``
    [S, K + 2] mirror the :class:`GenerationStats` fields of the same names for one request;
    ``prefix_queried`` [S] (0 / 1) and ``prefix_hit_tokens`` [S] its prefix-cache lookup
    (:meth:`record_prefix`). :meth:`reset`
    zeroes a slot's row when a request is admitted; :meth:`record` updates all rows of a verify step at once
    (no loop over requests), with the committed counts (:class:`GenerationStats`); :meth:`request_stats` reads
    one row back as the ``request_stats`` dict that ``on_finish`` receives. Summed over all requests of a
    ``generate`` call the rows equal that call's :class:`GenerationStats` counters.
    """

    def __init__(self, num_slots: int, draft_len: int):
        self.draft_len = draft_len
        self.request_steps = torch.zeros(num_slots, dtype=torch.long)
        self.accepted_drafts = torch.zeros(num_slots, dtype=torch.long)
        self.accepted_per_position = torch.zeros(num_slots, draft_len, dtype=torch.long)
        self.num_accepted_hist = torch.zeros(num_slots, draft_len + 2 if draft_len else 0, dtype=torch.long)
        self.prefix_queried = [0] * num_slots
        self.prefix_hit_tokens = [0] * num_slots

    def reset(self, slots: Sequence[int]) -> None:
        """Zero the rows of ``slots`` (newly admitted requests)."""
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        self.request_steps[idx] = 0
        self.accepted_drafts[idx] = 0
        self.accepted_per_position[idx] = 0
        self.num_accepted_hist[idx] = 0
        for s in slots:
            self.prefix_queried[s] = self.prefix_hit_tokens[s] = 0

    def record_prefix(self, slot: int, hit_tokens: int) -> None:
        """The request in ``slot`` looked the prefix cache up and reused ``hit_tokens`` prompt tokens."""
        self.prefix_queried[slot], self.prefix_hit_tokens[slot] = 1, hit_tokens

    def record(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """Count one verify step: ``slots`` [B] distinct slot ids, ``accepted`` [B] accepted drafts in [0, K]
        (host int64)."""
        K = self.draft_len
        self.request_steps[slots] += 1
        self.accepted_drafts[slots] += accepted
        self.accepted_per_position[slots] += (torch.arange(K)[None, :] < accepted[:, None]).long()
        self.num_accepted_hist[slots, accepted + 1] += 1

    def request_stats(self, slot: int, prompt_tokens: int, generated_tokens: int) -> dict:
        """The counters of the request in ``slot`` as a plain dict: ``request_steps``, ``drafted_tokens``
        (K per request-step), ``accepted_drafts``, ``accepted_per_position`` [K], ``num_accepted_hist``
        [K + 2] (both [] without speculation), ``generated_tokens``, ``prompt_tokens`` and the prefix-cache
        counters ``prefix_cache_queries`` / ``_query_tokens`` / ``_hits`` / ``_hit_tokens``."""
        steps = int(self.request_steps[slot])
        queried, hit = self.prefix_queried[slot], self.prefix_hit_tokens[slot]
        return {
            "request_steps": steps,
            "drafted_tokens": self.draft_len * steps,
            "accepted_drafts": int(self.accepted_drafts[slot]),
            "accepted_per_position": self.accepted_per_position[slot].tolist(),
            "num_accepted_hist": self.num_accepted_hist[slot].tolist(),
            "generated_tokens": generated_tokens,
            "prompt_tokens": prompt_tokens,
            "prefix_cache_queries": queried,
            "prefix_cache_query_tokens": prompt_tokens if queried else 0,
            "prefix_cache_hits": int(hit > 0),
            "prefix_cache_hit_tokens": hit,
        }


@dataclass
class GenerationOutput:
    """tokens: generated ids per prompt (prompt excluded, a stop token kept); finish_reasons: "stop_token" |
    "stop_checker" | "length"; stats: the run's counters; nonfinite: the model outputs
    (``HybridLM.health_names``) that held a NaN or an infinity in any forward of the call, in forward order
    (the first is where they appeared; [] for a healthy call)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats
    nonfinite: list[str] = field(default_factory=list)


@dataclass
class _Step:
    """A launched decode step (:meth:`Engine._launch`): its live slots and the request that held each at
    launch, the pinned host block its tokens arrive in, and its phase timing marks (profiling only)."""

    slots: list[int]
    requests: list[int]
    block: HostBlock
    marks: list = field(default_factory=list)


class ForcedAcceptance:
    """Accepted drafts per verify step from a fixed schedule instead of the greedy comparison: a benchmark
    hook for random-weight checkpoints (:meth:`Engine.force_acceptance`).

    Step c (counted on the device, only for steps with a live row) accepts floor((c + 1) m) - floor(c m)
    drafts in every row, m = acceptance_length - 1: the integers around m whose running mean is m (e.g.
    1, 2, 2, 1, 2, ... for m = 1.6), so the acceptance length over any run is acceptance_length to within
    1 / steps. No host synchronisation (CUDA-graph capturable).
    """

    def __init__(self, acceptance_length: float, draft_len: int, device: torch.device):
        if draft_len < 1:
            raise ValueError("forced acceptance needs speculative decoding (draft_len >= 1)")
        if not 1.0 <= acceptance_length <= draft_len + 1:
            raise ValueError(
                f"acceptance_length={acceptance_length} must lie in [1, K + 1 = {draft_len + 1}]"
            )
        self.mean_accepted = acceptance_length - 1.0
        self.draft_len = draft_len
        self.step = torch.zeros((), dtype=torch.float64, device=device)

    def next(self, live: torch.Tensor) -> torch.Tensor:
        """Accepted drafts [B] int64 for this step (live [B] bool: a step of PAD rows only -- a graph's
        warm-up -- does not advance the schedule)."""
        c, m = self.step, self.mean_accepted
        a = (torch.floor((c + 1) * m) - torch.floor(c * m)).long().clamp(0, self.draft_len)
        self.step += live.any()
        return a.expand(live.shape[0])


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _token_id(value, where: str) -> int:
    """One token id as a Python int. Raises TypeError for anything but an integer (bools, floats -- even 2.0
    -- strings, floating tensors), naming ``where`` (e.g. "prompts[0][3]")."""
    if isinstance(value, torch.Tensor):
        if (
            value.numel() != 1
            or value.dtype.is_floating_point
            or value.dtype.is_complex
            or value.dtype == torch.bool
        ):
            raise TypeError(
                f"{where} must be an integer token id, got a tensor of dtype {value.dtype} and "
                f"shape {list(value.shape)}"
            )
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} must be an integer token id, got {type(value).__name__} {value!r}")
    return int(value)


def _token_list(values, where: str) -> list[int]:
    """A sequence of token ids as a list of ints (see :func:`_token_id`); a string is refused."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | torch.Tensor):
        raise TypeError(
            f"{where} must be a sequence of integer token ids, got {type(values).__name__} {values!r}"
        )
    if isinstance(values, torch.Tensor) and values.dim() != 1:
        raise TypeError(
            f"{where} must be a 1-D sequence of token ids, got a tensor of shape {list(values.shape)}"
        )
    return [_token_id(v, f"{where}[{j}]") for j, v in enumerate(values)]


def _token_rows(rows, where: str) -> list[list[int]]:
    """Token-id rows (a sequence of sequences, or a 2-D integer tensor) as lists of ints. Raises TypeError."""
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence | torch.Tensor):
        raise TypeError(f"{where} must be a list of token-id lists, got {type(rows).__name__}")
    return [_token_list(row, f"{where}[{i}]") for i, row in enumerate(rows)]


def _check_spec_args(draft_len: int, ssm_replay: bool) -> None:
    if draft_len < 0:
        raise ValueError(f"draft_len={draft_len} must be >= 0")
    if ssm_replay and draft_len == 0:
        raise ValueError(
            "ssm_replay requires speculative decoding (draft_len > 0): replay commits the recurrent "
            "state after a verify step; set draft_len to 1..7 (MTP) or ssm_replay=False"
        )


def _planned_cache_memory(
    config: HybridConfig, cache_kinds: dict[int, str], cache_args: dict, draft_len: int
) -> dict[str, int]:
    """Bytes of the engine's per-slot state by kind (:meth:`Engine.cache_memory`), from the architecture
    alone: ``runners.engine.cache.cache_memory_bytes`` plus, with drafts, the per-slot first draft (int64)
    and its
    MTP hidden [S + 1, D] in the model dtype (the scratch row included, like every cache buffer)."""
    mem = cache_memory_bytes(config, cache_kinds, **cache_args)
    if draft_len > 0:
        R, itemsize = cache_args["max_batch_size"] + 1, cache_args["dtype"].itemsize
        mem["spec_buffers_bytes"] += R * (config.hidden_size * itemsize + 8)
    return mem


# FlashInfer 0.7.2's selective_state_update compiles one module per (head_dim, d_state); at some sizes its
# build fails a static assertion in its vector-load helpers, and it dispatches heads per group over powers of
# two only. tests/gpu/flashinfer_sizes.py probed it on the H200 (docs/gpu/flashinfer_sizes.json): it builds
# and matches our reference at the sizes below, and fails to build at head_dim 16 and 32. Only sizes measured
# (or listed by its dispatcher) are sent to it; others run our Triton kernel, with a warning.
FLASHINFER_SIZES = {"mamba_head_dim": (64, 128), "ssm_state_size": (32, 64, 128, 256)}
FLASHINFER_HEADS_PER_GROUP = (1, 2, 4, 8, 16, 32, 64)


def _resolve_ssm_backend(
    backend: str | None, device: torch.device, ssm_replay: bool, config: HybridConfig | None = None
) -> str:
    """The recurrent-kernel backend to run: the default per device, FlashInfer only where importable and
    where the model's Mamba2 sizes suit its kernel (else Triton, with a warning naming the reason).

    Raises:
        ValueError: an unknown backend; flashinfer off CUDA; a Triton backend on the CPU without the
            interpreter.
    """
    if backend == "flashinfer" and device.type != "cuda":
        raise ValueError(
            f"ssm_backend='flashinfer' runs FlashInfer's CUDA kernels, but the device is {device.type}; use "
            "ssm_backend='torch' on the CPU"
        )
    if backend == "flashinfer" and config is not None and not config.mamba_num_heads:
        log.warning("ssm_backend=flashinfer: FlashInfer has no Gated DeltaNet kernels (this model has no "
                    "Mamba2 layers); using triton")
        backend = "triton"
    elif backend == "flashinfer" and config is not None:
        bad = {k: getattr(config, k) for k, ok in FLASHINFER_SIZES.items() if getattr(config, k) not in ok}
        hpg = config.mamba_num_heads // config.n_groups
        if hpg not in FLASHINFER_HEADS_PER_GROUP:
            bad["mamba_num_heads / n_groups"] = hpg
        if bad:
            log.warning(
                "ssm_backend=flashinfer: FlashInfer's selective_state_update is verified only at %s with "
                "mamba_num_heads / n_groups in %s; this model has %s; using triton",
                FLASHINFER_SIZES, FLASHINFER_HEADS_PER_GROUP, bad
            )
            backend = "triton"
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in SSM_BACKENDS:
        raise ValueError(f"ssm_backend={backend!r} is not one of {list(SSM_BACKENDS)}")
    if backend == "flashinfer":
        try:
            import flashinfer.mamba  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
            log.warning("ssm_backend=flashinfer: flashinfer.mamba is not importable (%r); using triton", e)
            backend = "triton"
        else:
            if ssm_replay:
                log.info("ssm_backend=flashinfer with ssm_replay: the verify replays with our Triton kernel")
    if backend != "torch" and device.type != "cuda":
        from kernels._common import interpreter_active

        if not interpreter_active():
            raise ValueError(
                f"ssm_backend={backend!r} runs Triton kernels, but the device is {device.type} and Triton "
                "is not in interpreter mode; use ssm_backend='torch' on the CPU (or set TRITON_INTERPRET=1 "
                "before importing triton, for tests)"
            )
    return backend


@dataclass
class _PrefillRow:
    """One prompt of a prefill (:meth:`Engine._prefill`): ``key`` its index among the admitted prompts,
    ``pos`` its tokens in the slot's cache (the cache hit, then advancing), ``hit`` the cached prefix length,
    ``carry`` the target hidden [D] at ``pos - 1`` restored from the prefix cache (its MTP position is still
    to run), ``save_points`` {position: shared} where the prefix cache stores the slot's state."""

    key: int
    prompt: list[int]
    slot: int
    pos: int = 0
    carry: torch.Tensor | None = None
    save_points: dict[int, bool] = field(default_factory=dict)
    hit: int = 0

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.pos

    def next_stop(self) -> int:
        """The next save point after ``pos``, else the prompt's end."""
        return min((p for p in self.save_points if p > self.pos), default=len(self.prompt))


class Engine:
    """A loaded model plus its caches and the generate loop. Build it with :meth:`from_pretrained`.

    Attributes:
        config: the model's :class:`HybridConfig`.
        model: the :class:`HybridLM` (eval mode).
        cache: the :class:`HybridCache` (S = ``max_batch_size`` slots of ``max_seq_len`` positions).
        draft_len: K, MTP draft tokens per step (0 = no speculation); ssm_replay: state commit scheme
            (replay vs rewind); ssm_backend: recurrent-state operators ("triton" | "flashinfer" | "torch").
        load_report: :class:`runners.engine.memory.LoadReport` of :meth:`from_pretrained` (None when the
        engine was
            built from a model object).
        cuda_graphs: whether decode steps replay CUDA graphs (``graphs``: the captured sizes, the phases);
            overlap_steps: whether the next step is queued before this one's host bookkeeping.
        phase_timer: a :class:`runners.engine.graphs.PhaseTimer` to time the step's phases (profiling; None:
        off).
        prefix_cache: the :class:`runners.engine.prefix_cache.PrefixCache` admissions reuse prompt prefixes
        from
            (None: off; ``prefix_cache_off_reason`` then says why).
    """

    def __init__(
        self,
        model: HybridLM,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        draft_len: int = 0,
        ssm_replay: bool = False,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        ssm_state_dtype: torch.dtype | str | None = None,
        prefill_chunk_tokens: int = 8192,
        scan_chunk_size: int | None = None,
        ssm_backend: str | None = None,
        ssm_replay_checkpointing: bool = False,
        kv_cache_quant: str | None = None,
        cuda_graphs: bool | None = None,
        cuda_graph_batch_sizes: Sequence[int] | None = None,
        overlap_steps: bool | None = None,
        ssm_stochastic_rounding: bool = False,
        check_finite: bool = True,
        prefix_cache: bool | PrefixCache = True,
        prefix_cache_bytes: int | None = None,
    ):
        config = model.config
        _check_spec_args(draft_len, ssm_replay)
        if draft_len > 0 and model.mtp is None:
            raise ValueError(
                f"draft_len={draft_len} needs MTP weights, but the checkpoint ({config.source}) has "
                "no mtp.* tensors or its config.json declares no MTP layers; set draft_len=0 or "
                "use a checkpoint with an MTP module"
            )
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1")
        self.model, self.config = model, config
        self.device, self.dtype = torch.device(device), dtype
        self.draft_len, self.ssm_replay = draft_len, ssm_replay
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if scan_chunk_size is None:  # the intra-chunk term is quadratic: short chunks are faster on CPUs
            scan_chunk_size = config.chunk_size if self.device.type == "cuda" else min(config.chunk_size, 32)
        if scan_chunk_size < 1:
            raise ValueError(f"scan_chunk_size={scan_chunk_size} must be >= 1")
        self.scan_chunk_size = scan_chunk_size
        for module in model.modules():
            if isinstance(module, Mamba2Mixer):
                module.chunk_size = scan_chunk_size
        self.ssm_backend = _resolve_ssm_backend(ssm_backend, self.device, ssm_replay, config)
        self.ssm_state_dtype = _resolve_dtype(ssm_state_dtype or config.mamba_ssm_cache_dtype)
        if config.mamba_num_heads and self.ssm_state_dtype.itemsize < 4:
            log.warning(
                "ssm_state_dtype=%s for Mamba2 layers: a 16-bit recurrent state drifts from the float32 "
                "reference on long outputs (logit drift grows ~40x over 2,000 teacher-forced tokens); "
                "results are judged only against baseline rows measured with this state dtype",
                str(self.ssm_state_dtype).removeprefix("torch."),
            )
        # speculative buffers (rewind: T = K + 1 states per slot; replay: the input history) only with drafts
        self._cache_args = dict(
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            dtype=dtype,
            ssm_state_dtype=self.ssm_state_dtype,
            spec_tokens=draft_len + 1 if draft_len > 0 else 0,
            ssm_replay=ssm_replay,
            replay_checkpointing=ssm_replay_checkpointing,
            kv_cache_dtype=_kv_cache_dtype(kv_cache_quant),
        )
        self.kv_cache_quant = "fp8" if self._cache_args["kv_cache_dtype"] is not None else "none"
        self._cache_kinds = model.cache_kinds(include_mtp=draft_len > 0)
        self.load_report: LoadReport | None = None  # set by from_pretrained
        # from_pretrained: the rank's runners.engine.tp.TensorParallel when sharded
        self.tensor_parallel = None
        self.cache = HybridCache(
            config, self._cache_kinds, device=self.device, ssm_backend=self.ssm_backend,
            stochastic_rounding=ssm_stochastic_rounding, **self._cache_args
        )
        if self.kv_cache_quant == "fp8":
            self._attach_kv_scales()
        # Per-slot decode state on the device, S + 1 rows like the caches (PAD rows -> the scratch row S):
        # tokens in the cache, the last token (the next step's input) and, with drafts, the MTP hidden and
        # greedy token that start the next step's drafts. Steps read and advance them without the host.
        R = max_batch_size + 1
        self._slot_len = torch.zeros(R, dtype=torch.long, device=self.device)
        self._last_token = torch.zeros(R, dtype=torch.long, device=self.device)
        if draft_len > 0:
            self._mtp_hidden = torch.zeros(R, config.hidden_size, dtype=dtype, device=self.device)
            self._draft1 = torch.zeros(R, dtype=torch.long, device=self.device)
        self._slot_counters = SlotCounters(max_batch_size, draft_len)
        if check_finite:  # per-layer "non-finite output" flags, read once per generate call
            model.track_nonfinite(self.device)
        self._forced_acceptance: ForcedAcceptance | None = None
        self.phase_timer: PhaseTimer | None = None
        self._setup_step(cuda_graphs, cuda_graph_batch_sizes, overlap_steps)
        self._setup_prefix_cache(prefix_cache, prefix_cache_bytes, ssm_stochastic_rounding)
        self._stats: GenerationStats | None = None  # the counters of the generate call in progress
        self._row_start: int | None = None  # BatchMeta.row_start of the eager step running (_launch)

    def _setup_prefix_cache(self, prefix_cache: bool | PrefixCache, nbytes: int | None,
                            stochastic_rounding: bool) -> None:
        """``self.prefix_cache`` (a :class:`PrefixCache`, or None) and ``self.prefix_cache_off_reason``.

        Off where it would not be exact: with stochastic rounding of the SSM state, the rounding counter
        advances once per forward, so a prefill that skips forwards would draw other random bits later.

        Raises:
            ValueError: ``prefix_cache_bytes`` with a PrefixCache object (it brings its own), or < 0.
        """
        self.prefix_cache: PrefixCache | None = None
        self.prefix_cache_off_reason: str | None = None
        if isinstance(prefix_cache, PrefixCache):
            if nbytes is not None:
                raise ValueError("pass prefix_cache_bytes only with prefix_cache=True (a PrefixCache brings "
                                 "its own max_bytes)")
        elif not prefix_cache:
            self.prefix_cache_off_reason = "prefix_cache=False"
            return
        elif nbytes == 0:
            self.prefix_cache_off_reason = "prefix_cache_bytes=0: no room for any entry"
            return
        if stochastic_rounding:
            self.prefix_cache_off_reason = ("ssm_stochastic_rounding: the rounding bits depend on the number "
                                            "of forwards, which a cache hit changes (not exact)")
            log.info("prefix cache off: %s", self.prefix_cache_off_reason)
            return
        if not isinstance(prefix_cache, PrefixCache):
            prefix_cache = PrefixCache(max_bytes=DEFAULT_PREFIX_CACHE_BYTES if nbytes is None else nbytes)
        self.prefix_cache = prefix_cache
        mtp_blocks = self.model.mtp.blocks if self.model.mtp is not None and self.draft_len > 0 else []
        prefix_cache.configure(b.cache_index for b in mtp_blocks if b.kind == "attention")

    def _setup_step(self, cuda_graphs: bool | None, batch_sizes: Sequence[int] | None,
                    overlap_steps: bool | None) -> None:
        """The static step buffers, the host ring and the phases of the step (``runners.engine.graphs``)."""
        cuda = self.device.type == "cuda"
        if cuda_graphs and not cuda:
            log.warning("cuda_graphs=True is ignored on %s: the same step runs eagerly", self.device)
        if cuda_graphs is None or not cuda:
            cuda_graphs = cuda
        if cuda_graphs and self.ssm_backend == "torch":
            log.warning("cuda_graphs: ssm_backend='torch' runs the PyTorch references, which synchronise "
                        "with the host (nonzero); decode steps run eagerly (use ssm_backend='triton')")
            cuda_graphs = False
        sizes = default_graph_batch_sizes(self.max_batch_size) if batch_sizes is None else list(batch_sizes)
        if any(not 1 <= b <= self.max_batch_size for b in sizes):
            raise ValueError(
                f"cuda_graph_batch_sizes {sizes} must lie in [1, max_batch_size={self.max_batch_size}]"
            )
        self.cuda_graphs = bool(cuda_graphs and sizes)
        self.overlap_steps = cuda if overlap_steps is None else bool(overlap_steps)
        K = self.draft_len
        self._io = StepIO.allocate(self.max_batch_size, K, self.config.hidden_size, self.dtype, self.device)
        self._host = HostRing(self.max_batch_size, K + 1, self.device)
        if K > 0:
            phases = {"draft": self._phase_draft, "verify": self._phase_verify, "commit": self._phase_commit,
                      "catchup": self._phase_catchup}
        else:
            phases = {"decode": self._phase_decode}
        self.graphs = StepGraphs(phases, self._io, sizes if self.cuda_graphs else (), self.max_seq_len,
                                 self.device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        draft_len: int = 0,
        ssm_replay: bool = False,
        **options,
    ) -> Engine:
        """Load an HF checkpoint dir and allocate caches.

        Args:
            path: checkpoint directory (config.json + safetensors).
            device, dtype: where and in which dtype the model and caches live (router stays float32).
            draft_len: MTP draft length K (> 0 requires mtp.* weights).
            ssm_replay: commit recurrent state by replay instead of rewind (needs draft_len > 0).
            **options: max_batch_size (S, default 64), max_seq_len (default 4096), ssm_state_dtype
                (default: config's ``mamba_ssm_cache_dtype``, float32), prefill_chunk_tokens (default 8192:
                padded tokens per prefill forward), scan_chunk_size (chunk of the Mamba2 prefill scan;
                default: config ``chunk_size``, capped at 32 off CUDA where it is ~5x faster; the result is
                the same up to float rounding), ssm_backend ("triton" | "flashinfer" | "torch"; default
                "triton" on CUDA, "torch" elsewhere: who runs the recurrent decode / verify / commit
                operators, the Triton kernels of kernels/ or their PyTorch references; "flashinfer" runs
                the rewind verify with FlashInfer's selective_state_update and the rest with Triton, and
                falls back to "triton" with a log line when FlashInfer is not importable),
                ssm_replay_checkpointing (default False; Mamba2 only: the checkpointing replay variant,
                a history of max(16, K + 1) tokens and a state write only when it is full),
                kv_cache_quant ("none" default, or "fp8": keys and values stored in float8_e4m3fn with the
                checkpoint's per-layer k / v scales, 1.0 with a warning where it has none; half the KV
                bytes of bf16, ``cache_memory()["kv_cache_bytes"]``),
                ssm_stochastic_rounding (default False: round every write of a 16-bit SSM state
                stochastically instead of to nearest, kernels/rounding.py; needs ssm_state_dtype bfloat16 /
                float16),
                check_finite (default True: flag NaN / infinite outputs of every layer in each forward,
                ``GenerationOutput.nonfinite``),
                memory_budget_bytes (default None: the device's free memory; the bytes weights + caches
                may take, checked before anything is allocated), cuda_graphs (default: True on CUDA; ignored
                with a warning on the CPU, and off with ssm_backend "torch": decode steps replay CUDA graphs),
                cuda_graph_batch_sizes (default 1, 2, 4, ... and max_batch_size: the padded batch sizes
                captured; larger batches run eagerly), overlap_steps (default: True on CUDA: queue the next
                step before this one's host bookkeeping), tensor_parallel (default None: a
                ``runners.engine.tp.TensorParallel``; this process then loads, allocates and runs only its
                rank's
                shard of the model, and ``engine.config`` is the rank's view of config.json; its process
                group must be initialised: ``runners.engine.launch`` runs such engines on every rank in
                lockstep),
                prefix_cache (default True: reuse cached prompt prefixes,
                :mod:`runners.engine.prefix_cache`; False
                turns it off; or a :class:`runners.engine.prefix_cache.PrefixCache` to use),
                prefix_cache_bytes
                (default 512 MiB, capped at half of the memory left after weights and caches when the
                budget is known: the most its entries may take).

        The model is built on the meta device and its weights are loaded straight to ``device`` in their
        dtype (:func:`runners.engine.loader.plan_load` / :func:`runners.engine.loader.materialize`);
        ``engine.load_report``
        (:class:`runners.engine.memory.LoadReport`) records the load time and host / device peak memory. A
        checkpoint that declares FP8 weights (config.json quantization_config / hf_quant_config.json) loads
        them as FP8 and runs FP8 GEMMs (runners.engine.quant; ``engine.model.quant_report`` says which ran).

        Raises:
            runners.engine.memory.InsufficientMemoryError: weights + caches at max_batch_size / max_seq_len
            exceed
                the device's free memory (or memory_budget_bytes); raised before any allocation.
            runners.engine.loader.CheckpointError: unreadable / inconsistent checkpoint.
            ValueError: bad options (unknown option, draft_len without MTP weights, ssm_replay without
                drafting).
        """
        allowed = {
            "memory_budget_bytes",
            "max_batch_size",
            "max_seq_len",
            "ssm_state_dtype",
            "prefill_chunk_tokens",
            "scan_chunk_size",
            "ssm_backend",
            "ssm_replay_checkpointing",
            "kv_cache_quant",
            "cuda_graphs",
            "cuda_graph_batch_sizes",
            "overlap_steps",
            "ssm_stochastic_rounding",
            "check_finite",
            "tensor_parallel",
            "prefix_cache",
            "prefix_cache_bytes",
        }
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}; allowed: {sorted(allowed)}")
        dtype = _resolve_dtype(dtype)
        _check_spec_args(draft_len, ssm_replay)
        device = torch.device(device)
        budget = options.pop("memory_budget_bytes", None)
        tp = options.pop("tensor_parallel", None)
        t0 = time.perf_counter()
        host_reset = host_peak_rss_reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        plan = plan_load(path, dtype=dtype, load_mtp=True if draft_len > 0 else None)
        if tp is not None:  # this rank's shard: the model of the rank's config view, readers of its part
            from runners.engine.tp import shard_plan

            plan = shard_plan(plan, tp)
        # the caches this engine will allocate, sized before anything is: weights + caches must fit
        ssm_state_dtype = _resolve_dtype(options.get("ssm_state_dtype") or plan.config.mamba_ssm_cache_dtype)
        cache_args = dict(
            max_batch_size=options.get("max_batch_size", DEFAULT_MAX_BATCH_SIZE),
            max_seq_len=options.get("max_seq_len", DEFAULT_MAX_SEQ_LEN),
            dtype=dtype,
            ssm_state_dtype=ssm_state_dtype,
            spec_tokens=draft_len + 1 if draft_len > 0 else 0,
            ssm_replay=ssm_replay,
            replay_checkpointing=options.get("ssm_replay_checkpointing", False),
            kv_cache_dtype=_kv_cache_dtype(options.get("kv_cache_quant")),
        )
        kinds = plan.model.cache_kinds(include_mtp=draft_len > 0)
        cache_bytes = sum(_planned_cache_memory(plan.config, kinds, cache_args, draft_len).values())
        budget = check_memory_fits(
            plan.weight_bytes,
            cache_bytes,
            device,
            budget_bytes=budget,
            max_batch_size=cache_args["max_batch_size"],
            max_seq_len=cache_args["max_seq_len"],
        )
        if budget is not None and options.get("prefix_cache", True) is True:
            # the prefix cache grows while generating: it may take at most half of what stays free
            want = options.get("prefix_cache_bytes")
            want = DEFAULT_PREFIX_CACHE_BYTES if want is None else want
            cap = max(0, (budget - plan.weight_bytes - cache_bytes) // 2)
            if want > cap:
                log.warning("prefix_cache_bytes=%d capped at %d (half of the memory left after weights and "
                            "caches)", want, cap)
                options["prefix_cache_bytes"] = cap
        t_weights = time.perf_counter()
        model = materialize(plan, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_weights = time.perf_counter() - t_weights
        engine = cls(model, device=device, dtype=dtype, draft_len=draft_len, ssm_replay=ssm_replay, **options)
        engine.tensor_parallel = tp
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        engine.load_report = LoadReport(
            seconds=time.perf_counter() - t0,
            weights_seconds=t_weights,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            weight_bytes=plan.weight_bytes,
            cache_bytes=sum(engine.cache_memory().values()),
            budget_bytes=budget,
            host_peak_rss_bytes=host_peak_rss_bytes(),
            host_peak_reset=host_reset,
            device_peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
            device_allocated_bytes=torch.cuda.memory_allocated(device) if cuda else None,
        )
        return engine

    def _attach_kv_scales(self) -> None:
        """Give each FP8 KV cache layer its attention block's checkpoint scales (``k_proj.k_scale`` /
        ``v_proj.v_scale``, runners.engine.quant.kv_cache_scales); a block without them gets 1.0, with a
        warning
        (values beyond +-448 then saturate)."""
        scales = kv_cache_scales(self.model)
        missing = []
        for idx, layer in self.cache.layers.items():
            if self._cache_kinds[idx] != "attention":
                continue
            if scales.get(idx) is None:
                missing.append(idx)
                one = torch.ones((), device=self.device)
                layer.k_scale, layer.v_scale = one, one
            else:
                layer.k_scale, layer.v_scale = (s.to(self.device, torch.float32) for s in scales[idx])
        if missing:
            log.warning(
                "kv_cache_quant=fp8 but the checkpoint (%s) has no k / v scales for attention blocks %s: "
                "their FP8 KV cache uses scale 1.0 (keys and values beyond +-448 saturate); a checkpoint "
                "calibrated by python -m runners.tools.quantize --fp8 carries them",
                self.config.source, missing)

    def cache_memory(self) -> dict[str, int]:
        """Bytes allocated for per-slot state, by kind (scratch row included):

        - ``ssm_state_bytes``: committed recurrent states (Mamba2 SSM state; a GDN family's state);
        - ``conv_state_bytes``: committed conv windows;
        - ``kv_cache_bytes``: attention KV caches, target and MTP;
        - ``spec_buffers_bytes``: what only speculative decoding allocates (rewind: the per-token verify
          states; replay: the input history, the extra conv columns and the per-slot PNAT / buffer index;
          both: the per-slot first draft and its MTP hidden); 0 when ``draft_len`` is 0.

        The cache part is computed from the architecture by :func:`runners.engine.cache.cache_memory_bytes`
        (the
        function that also sizes released shapes without weights); tests check it against the tensors.
        """
        return _planned_cache_memory(self.config, self._cache_kinds, self._cache_args, self.draft_len)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A full causal forward without cache: input_ids LongTensor [B, T] -> float32 logits [B, T, V].

        Raises (before any compute): TypeError when input_ids is not an integer torch.Tensor; ValueError when
        it is not [B, T] with B, T >= 1, or holds an id outside [0, V).
        """
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                f"input_ids must be a torch.Tensor of token ids [B, T], got {type(input_ids).__name__}"
            )
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got shape {list(input_ids.shape)}")
        V = self.config.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"input_ids holds token id {bad}, outside [0, {V}) (the vocab size); tokenizer and "
                "checkpoint disagree"
            )
        return self.model.lm_logits(self.model(input_ids.to(self.device)))

    # ------------------------------------------------------------------ generate

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        stop_checker: Callable[[int, list[int]], bool] | None = None,
        on_finish: Callable[[int, list[int], str, dict], None] | None = None,
        progress: bool | Callable[[int, int], None] | None = None,
    ) -> GenerationOutput:
        """Greedy generation for every prompt, with continuous batching over ``max_batch_size`` slots.

        Args:
            prompts: token ids per request (non-empty; ids < vocab size).
            max_new_tokens: generated tokens per request at most (finish reason "length").
            stop_token_ids: ids that finish a request (kept in its output); None means the config's
                ``eos_token_id``; an empty list disables stop tokens.
            stop_checker: ``stop_checker(i, generated_ids) -> bool``, called after each step for requests that
                got a token; True finishes request i ("stop_checker").
            on_finish: ``on_finish(i, generated_ids, finish_reason, request_stats)``, called once per request
                as it finishes; ``request_stats`` is a plain dict of that request's counters
                (:meth:`SlotCounters.request_stats`: request_steps, drafted_tokens, accepted_drafts,
                accepted_per_position [K], num_accepted_hist [K + 2], generated_tokens, prompt_tokens).
                Summed over all requests they equal the returned ``stats`` counters.
            progress: True shows a tqdm bar over finished requests; a callable gets (finished, total).

        Returns:
            :class:`GenerationOutput` (tokens, finish_reasons, stats), indexed like ``prompts``.

        Raises (before any compute, naming the argument and the index):
            TypeError: prompts not a list of token-id lists (or a 2-D integer tensor); an id that is not an
                integer (a float such as 1.9 or 2.0, a string, a bool); a non-int max_new_tokens or
                stop_token_ids entry.
            ValueError: an empty prompt, an id outside [0, vocab), max_new_tokens < 1, or a
                prompt that with max_new_tokens does not fit ``max_seq_len``.
        """
        K = self.draft_len
        prompts = _token_rows(prompts, "prompts")
        n = len(prompts)
        self._check_prompts(prompts, max_new_tokens)
        stop_ids = set(
            self.config.eos_token_id
            if stop_token_ids is None
            else _token_list(stop_token_ids, "stop_token_ids")
        )
        stats = GenerationStats(num_requests=n, prompt_tokens=sum(map(len, prompts)))
        self._stats = stats  # _prefill adds the prefix-cache counters
        if K > 0:
            stats.record_step([], K)  # sizes the per-position counters even if no step runs
        out_tokens: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        bar, report = self._progress(progress, n)
        finished = 0
        self.model.take_nonfinite()  # flags of earlier forwards (e.g. Engine.logits) are not this call's

        waiting = deque(range(n))
        free_slots = list(range(self.max_batch_size - 1, -1, -1))  # pop() hands out slot 0 first
        slot_request = [-1] * self.max_batch_size
        slot_len = [0] * self.max_batch_size  # tokens of the slot's request in the cache, as last read back
        active: list[int] = []  # slots decoding, in admission order
        inflight: deque[_Step] = deque()  # launched steps whose tokens are not read yet, oldest first
        counters = self._slot_counters
        T, timer = K + 1, self.phase_timer

        def append(slot: int, tokens: list[int]) -> tuple[int, str | None]:
            """Append a step's ``tokens`` to the slot's request up to the first stop condition (a speculative
            step may bring several tokens); returns (tokens appended, finish reason or None)."""
            i = slot_request[slot]
            toks = out_tokens[i]
            for j, token in enumerate(tokens, start=1):
                toks.append(token)
                if token in stop_ids:
                    return j, "stop_token"
                if stop_checker is not None and stop_checker(i, toks):
                    return j, "stop_checker"
                if len(toks) >= max_new_tokens:
                    return j, "length"
            return len(tokens), None

        def finish(slot: int, reason: str) -> None:
            """Report the slot's request finished (after its counters are complete) and free the slot."""
            nonlocal finished
            i = slot_request[slot]
            reasons[i] = reason
            request_stats = counters.request_stats(slot, len(prompts[i]), len(out_tokens[i]))
            active.remove(slot)
            slot_request[slot] = -1
            free_slots.append(slot)
            finished += 1
            if on_finish is not None:
                on_finish(i, out_tokens[i], reason, request_stats)
            report(finished)

        def read(step: _Step) -> None:
            """The host bookkeeping of a launched step: its tokens go to the requests that still hold their
            slots (a step queued before the previous one was read may carry rows of requests that finished
            there; those rows are dropped)."""
            t0 = time.perf_counter()
            new_tokens = self._step_tokens(step)
            t1 = time.perf_counter()
            rows = zip(step.slots, step.requests, new_tokens)
            kept = [(s, toks) for s, i, toks in rows if slot_request[s] == i]
            if kept:
                stats.steps += 1
                outcomes = []
                for s, toks in kept:
                    slot_len[s] += len(toks)  # the cache holds them all; the output may stop earlier
                    outcomes.append(append(s, toks))
                if K > 0:  # count what was committed to the output: a step cut by a stop keeps j - 1 drafts
                    self._count_acceptance([s for s, _ in kept], [j - 1 for j, _ in outcomes], stats)
                for (s, _), (_, reason) in zip(kept, outcomes):
                    if reason is not None:
                        finish(s, reason)
            if timer is not None:
                timer.add_host("wait", t1 - t0)
                timer.add_host("bookkeeping", time.perf_counter() - t1)

        while waiting or active or inflight:
            t0 = time.perf_counter()
            if waiting and free_slots:  # admit into every free slot, prefill the newcomers together
                while inflight:  # first read every queued step (its requests may finish, its slots free)
                    read(inflight.popleft())
                stats.decode_seconds += time.perf_counter() - t0
                admitted = []
                while waiting and free_slots:
                    slot = free_slots.pop()
                    slot_request[slot] = waiting.popleft()
                    admitted.append(slot)
                counters.reset(admitted)
                t0 = time.perf_counter()
                first = self._prefill([prompts[slot_request[s]] for s in admitted], admitted)
                for slot in admitted:
                    slot_len[slot] = len(prompts[slot_request[slot]])
                stats.prefill_seconds += time.perf_counter() - t0
                active.extend(admitted)
                for slot, token in zip(admitted, first):
                    _, reason = append(slot, [token])
                    if reason is not None:
                        finish(slot, reason)
                continue  # refill slots freed by requests that finished on their first token
            # Every row's KV reads stay below its length before the step + T, and each queued step unread
            # may add up to T tokens: an upper bound the host knows without waiting for the device.
            bound = max((slot_len[s] for s in active), default=0) + T * (len(inflight) + 1)
            ahead = self.overlap_steps and bound <= self.max_seq_len  # a run-ahead step stays in the cache
            launch = bool(active) and (not inflight or ahead)
            if launch:
                slots = sorted(active)
                inflight.append(self._launch(slots, bound, [slot_request[s] for s in slots]))
            if inflight and (not launch or not self.overlap_steps or len(inflight) > 1):
                read(inflight.popleft())  # with overlap: the previous step, while this one runs
            stats.decode_seconds += time.perf_counter() - t0

        if bar is not None:
            bar.close()
        stats.generated_tokens = sum(map(len, out_tokens))
        self._stats = None
        return GenerationOutput(
            tokens=out_tokens, finish_reasons=reasons, stats=stats, nonfinite=self.model.take_nonfinite()
        )

    # ------------------------------------------------------------------ one decode step

    def _launch(self, slots: list[int], kv_bound: int, requests: list[int] | None = None) -> _Step:
        """Queue one decode step over ``slots`` (live slot ids, sorted) on the device; nothing waits for it.

        The host writes only the batch's slot ids (through a pinned buffer); positions, input tokens and
        drafts come from the per-slot device state, which the step advances itself. The step runs padded to
        a captured batch size as CUDA graphs, or eagerly (:class:`runners.engine.graphs.StepGraphs`); its new
        tokens are copied to pinned host memory behind an event. ``kv_bound``: an upper bound of every row's
        cached length after the step (its length before + T); ``requests``: who holds each slot, kept on the
        handle for :meth:`generate`. Read the result with :meth:`_step_tokens`, in launch order.
        """
        t0 = time.perf_counter()
        n = len(slots)
        B, L, graphed = self.graphs.plan(n, kv_bound)
        self.graphs.ensure(B, L, graphed)  # capture first: it leaves the static slot ids all PAD
        block = self._host.acquire()
        block.slot_ids[:B] = PAD_SLOT_ID
        block.slot_ids[:n] = torch.tensor(slots, dtype=torch.long)
        io = self._io
        io.slot_ids[:B].copy_(block.slot_ids[:B], non_blocking=True)
        # an eager step over consecutive slots reads their KV rows as views, not gathered copies (exact: the
        # same values); a captured graph reads through the slot ids, whatever they are at replay
        eager = not graphed or self.graphs.mode != "graph"
        consecutive = B == n and slots == list(range(slots[0], slots[0] + n))
        self._row_start = slots[0] if eager and consecutive else None
        try:
            marks = self.graphs.run(B, L, graphed, timed=self.phase_timer is not None)
        finally:
            self._row_start = None
        block.tokens[:B].copy_(io.tokens[:B], non_blocking=True)
        block.num_accepted[:B].copy_(io.num_accepted[:B], non_blocking=True)
        if block.event is not None:
            block.event.record()
        if self.phase_timer is not None:
            self.phase_timer.add_host("launch", time.perf_counter() - t0)
        return _Step(list(slots), list(requests or []), block, marks)

    def _step_tokens(self, step: _Step) -> list[list[int]]:
        """Wait for a launched step and return each row's new tokens (1 .. K + 1: the accepted drafts and
        the bonus token; 1 without drafts), in the order of ``step.slots``."""
        tokens, num_accepted = HostRing.read(step.block, len(step.slots))
        HostRing.release(step.block)
        if self.phase_timer is not None and step.marks:
            self.phase_timer.add_device(step.marks)
        return [t[:a] for t, a in zip(tokens, num_accepted)]

    def _count_acceptance(self, slots: list[int], accepted: list[int], stats: GenerationStats) -> None:
        """Count one verify step: ``accepted`` drafts per row of ``slots`` in the call's stats and in the
        per-slot counters of the requests."""
        stats.record_step(accepted, self.draft_len)
        long = dict(dtype=torch.long)
        self._slot_counters.record(torch.tensor(slots, **long), torch.tensor(accepted, **long))

    def _batch_rows(self, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's slot ids [B] (PAD -1 past the live rows), live mask [B] and cache rows [B] (PAD -> the
        scratch row S)."""
        slot_ids = self._io.slot_ids[:B]
        return slot_ids, slot_ids >= 0, slot_ids % (self.max_batch_size + 1)

    def _advance_slots(self, rows: torch.Tensor, live: torch.Tensor, length: torch.Tensor,
                       last: torch.Tensor) -> None:
        """Per-slot device state after a step: live rows' slot length and last token become ``length`` /
        ``last`` [B]; PAD rows (the scratch row) keep theirs."""
        self._slot_len.index_copy_(0, rows, torch.where(live, length, self._slot_len[rows]))
        self._last_token.index_copy_(0, rows, torch.where(live, last, self._last_token[rows]))

    def _phase_decode(self, B: int, L: int) -> None:
        """Plain greedy decode (K = 0): feed each slot's last token at its length, greedy next token. PAD
        rows read position 0 / token 0 (whatever the scratch row holds) and write only the scratch row."""
        io = self._io
        slot_ids, live, rows = self._batch_rows(B)
        n = torch.where(live, self._slot_len[rows], 0)
        last = torch.where(live, self._last_token[rows], 0)
        meta = BatchMeta.decode(slot_ids, n, max_kv_len=L, row_start=self._row_start)
        hidden = self.model(last[:, None], self.cache, meta)
        self.cache.advance_rounding()  # in-place on the device: graph-safe
        nxt = self.model.lm_logits(hidden[:, -1]).argmax(-1)
        io.tokens[:B, 0] = nxt
        io.num_accepted[:B] = 1
        self._advance_slots(rows, live, n + 1, nxt)

    # An MTP speculative step: the four phases below, in this order.
    # 1. draft: K tokens per slot with the MTP module (:meth:`_draft`);
    # 2. verify: one target forward over T = K + 1 tokens [last token, d_1 .. d_K] (``BatchMeta.verify``:
    #    recurrent layers keep every intermediate state, or record their inputs for replay), greedy tokens;
    # 3. commit: accepted drafts = the longest draft prefix equal to the target's greedy tokens,
    #    num_accepted_tokens = accepted + 1 (with the bonus target token); recurrent state <- the state after
    #    num_accepted_tokens tokens (``cache.commit``: rewind copy, or replay bookkeeping); the KV caches
    #    (target and MTP) roll back by length: the slot length advances by num_accepted_tokens only, so
    #    entries of rejected positions are never read and later writes overwrite them;
    # 4. catchup: the MTP module re-runs the accepted positions n .. n + a with the target's hidden states
    #    (overwriting its draft-time KV entries); position n + a pairs the target hidden at index a (the last
    #    accepted position) with the bonus token, and its output gives the next step's first draft.
    # The output equals plain greedy decoding. The loop is family-agnostic: it needs only the model
    # forward, ``BatchMeta.verify`` support in the recurrent mixers and ``cache.commit``.

    def _phase_draft(self, B: int, L: int) -> None:
        io = self._io
        slot_ids, live, rows = self._batch_rows(B)
        n = torch.where(live, self._slot_len[rows], 0)
        io.start_pos[:B] = n
        io.drafts[:B] = self._draft(slot_ids, n, L)

    def _draft(self, slot_ids: torch.Tensor, start_pos: torch.Tensor, max_kv_len: int | None = None
               ) -> torch.Tensor:
        """K draft tokens per row: [B, K] int64 on the device. The first was prepared by the previous step
        (or the prefill); each further one applies the MTP module to its own last output and draft, at MTP
        position start_pos - 1 + j. Writes the MTP KV cache there (the catch-up overwrites it). PAD rows
        start from token 0 and a zero hidden. ``max_kv_len``: the step's KV bound (None: computed)."""
        live, rows = slot_ids >= 0, slot_ids % (self.max_batch_size + 1)
        drafts = [torch.where(live, self._draft1[rows], 0)]
        h = torch.where(live[:, None], self._mtp_hidden[rows], 0.0)
        for j in range(1, self.draft_len):
            meta = BatchMeta.decode(slot_ids, start_pos - 1 + j, max_kv_len=max_kv_len,
                                    row_start=self._row_start)
            h = self._mtp(drafts[-1][:, None], h[:, None], meta)[:, 0]
            drafts.append(self.model.lm_logits(h).argmax(-1))
        return torch.stack(drafts, dim=1)

    def _phase_verify(self, B: int, L: int) -> None:
        io = self._io
        slot_ids, live, rows = self._batch_rows(B)
        last = torch.where(live, self._last_token[rows], 0)
        tokens = torch.cat([last[:, None], io.drafts[:B]], dim=1)  # [B, T]
        meta = BatchMeta.decode(slot_ids, io.start_pos[:B], self.draft_len + 1, verify=True, max_kv_len=L,
                                row_start=self._row_start)
        hidden = self.model(tokens, self.cache, meta)  # [B, T, D]
        self.cache.advance_rounding()
        io.hidden[:B] = hidden
        io.greedy[:B] = self.model.lm_logits(hidden).argmax(-1)

    def _phase_commit(self, B: int, L: int) -> None:
        io = self._io
        K, T = self.draft_len, self.draft_len + 1
        slot_ids, live, rows = self._batch_rows(B)
        drafts, greedy = io.drafts[:B], io.greedy[:B]
        if self._forced_acceptance is None:
            accepted = (drafts == greedy[:, :K]).long().cumprod(dim=1).sum(dim=1)  # [B] in [0, K]
        else:
            accepted = self._forced_acceptance.next(live)
        num_accepted = accepted + 1
        # no range checks on the host: num_accepted is in [1, T] by construction (the kernels clamp anyway)
        self.cache.commit(slot_ids, num_accepted, check=False)
        bonus = greedy.gather(1, accepted[:, None])[:, 0]
        # the new tokens, d_1 .. d_a then the bonus; column j is also what MTP position n + j pairs with
        cols = torch.arange(T, device=drafts.device)[None, :]
        io.tokens[:B] = torch.where(cols < accepted[:, None], torch.cat([drafts, drafts[:, :1]], dim=1),
                                    bonus[:, None])
        io.num_accepted[:B] = num_accepted
        self._advance_slots(rows, live, io.start_pos[:B] + num_accepted, bonus)

    def _phase_catchup(self, B: int, L: int) -> None:
        io = self._io
        slot_ids, num_accepted = io.slot_ids[:B], io.num_accepted[:B]
        catch_up = BatchMeta(slot_ids, io.start_pos[:B], num_accepted, max_kv_len=L,
                             row_start=self._row_start)
        out = self._mtp(io.tokens[:B], io.hidden[:B], catch_up)
        self._store_first_draft(slot_ids, out[torch.arange(B, device=out.device), num_accepted - 1])

    def force_acceptance(self, acceptance_length: float | None) -> None:
        """Benchmark hook for random-weight checkpoints, whose drafts are never accepted: from now on each
        verify accepts a fixed schedule of drafts (:class:`ForcedAcceptance`, mean ``acceptance_length`` - 1
        per step, the same for every row) instead of comparing them with the target's greedy tokens, so the
        step costs what it costs at that acceptance length. The output then is the drafts, not greedy
        decoding. None restores the greedy comparison. Captured graphs are dropped (the commit phase
        changes); the real path is not touched.

        Raises:
            ValueError: without drafts, or an acceptance length outside [1, K + 1].
        """
        if acceptance_length is None:
            self._forced_acceptance = None
        else:
            self._forced_acceptance = ForcedAcceptance(acceptance_length, self.draft_len, self.device)
        self.graphs.reset()

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: Sequence[int] | None = None, max_kv_len: int | None = None) -> int:
        """Capture the step's CUDA graphs ahead of time (otherwise each is captured on first use): each of
        ``batch_sizes`` (default: every captured size) at every KV bucket up to the one of ``max_kv_len``
        (default max_seq_len). Uses PAD rows only: safe between generate calls. Returns the number of
        (batch size, KV bound) pairs captured now; 0 when graphs are off.

        Raises:
            ValueError: a batch size that is not one of the engine's ``cuda_graph_batch_sizes``.
        """
        graphs = self.graphs
        if not graphs.enabled:
            return 0
        sizes = graphs.batch_sizes if batch_sizes is None else list(batch_sizes)
        if set(sizes) - set(graphs.batch_sizes):
            raise ValueError(f"batch sizes {sorted(set(sizes) - set(graphs.batch_sizes))} are not among "
                             f"cuda_graph_batch_sizes {graphs.batch_sizes}")
        top = kv_bucket(max_kv_len or self.max_seq_len, self.max_seq_len)
        buckets = [kv_bucket(1, self.max_seq_len)]
        while buckets[-1] < top:
            buckets.append(kv_bucket(buckets[-1] + 1, self.max_seq_len))
        done = 0
        for B in sizes:
            for L in buckets:
                if (B, L) not in graphs.graphs:
                    graphs.capture(B, L)
                    done += 1
        return done

    def _prefill(self, prompts: list[list[int]], slots: list[int]) -> list[int]:
        """Run the prompts of newly admitted requests into their (reset) slots; return each first token.

        With the prefix cache (:mod:`runners.engine.prefix_cache`) each prompt first restores the longest
        cached
        prefix of itself into its slot (``PrefixCache.lookup`` / ``restore``: target KV, MTP KV, recurrent
        states) and only the rest is prefilled; a prompt that is entirely a cached prefix needs no target
        forward (:meth:`_prefill_cached`). The prefill stops at the save points ``PrefixCache.save_points``
        names (the prompt's end, the junctions it shares with other prompts) and stores the slot's state
        there.

        Requests are grouped so that a group's padded size (rows x longest remainder, capped at
        ``prefill_chunk_tokens`` per forward) stays within budget; a group runs in forwards of at most
        ``prefill_chunk_tokens / rows`` columns, right-padded, each row continuing from its own cached state
        at its own position and ending a forward early at its next save point (:meth:`_prefill_group`).
        """
        slot_ids = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.cache.reset(slot_ids)
        rows = [_PrefillRow(j, p, s) for j, (p, s) in enumerate(zip(prompts, slots))]
        pc = self.prefix_cache
        if pc is not None:
            stores, evictions = pc.stores, pc.evictions
            for r in rows:
                entry = pc.lookup(r.prompt)
                if entry is not None:
                    pc.restore(self.cache, r.slot, entry)
                    r.pos = r.hit = len(entry.tokens)
                    r.carry = entry.hidden
                self._slot_counters.record_prefix(r.slot, r.pos)
            for r, points in zip(rows, pc.save_points(prompts, [r.pos for r in rows])):
                r.save_points = points
        first: dict[int, int] = {}
        full = [r for r in rows if r.pos == len(r.prompt)]
        if full:
            first.update(self._prefill_cached(full))
        budget = self.prefill_chunk_tokens
        todo = sorted((r for r in rows if r.pos < len(r.prompt)), key=lambda r: r.remaining)
        group: list[_PrefillRow] = []
        for r in todo + [None]:
            if r is not None and (not group or (len(group) + 1) * min(r.remaining, budget) <= budget):
                group.append(r)
                continue
            if group:
                first.update(self._prefill_group(group))
            group = [r] if r is not None else []
        if pc is not None and self._stats is not None:
            s = self._stats
            s.prefix_cache_queries += len(rows)
            s.prefix_cache_query_tokens += sum(len(r.prompt) for r in rows)
            s.prefix_cache_hits += sum(r.hit > 0 for r in rows)
            s.prefix_cache_hit_tokens += sum(r.hit for r in rows)
            s.prefix_cache_stores += pc.stores - stores
            s.prefix_cache_evictions += pc.evictions - evictions
        first_tokens = [first[j] for j in range(len(prompts))]
        # the decode state the steps start from: the prompt is in the cache, its first token is fed next
        long = dict(dtype=torch.long, device=self.device)
        self._slot_len[slot_ids] = torch.tensor([len(p) for p in prompts], **long)
        self._last_token[slot_ids] = torch.tensor(first_tokens, **long)
        return first_tokens

    def _prefill_cached(self, rows: list[_PrefillRow]) -> dict[int, int]:
        """First tokens of prompts that are entirely a cached prefix: the greedy token of the restored hidden
        of the last position; with drafts, the MTP module at the last prompt position (that hidden paired
        with the first token) gives the first draft."""
        hidden = torch.stack([r.carry for r in rows])  # [n, D]
        tokens = self.model.lm_logits(hidden).argmax(-1)
        if self.draft_len > 0:
            slot_ids = torch.tensor([r.slot for r in rows], dtype=torch.long, device=self.device)
            start = torch.tensor([r.pos - 1 for r in rows], dtype=torch.long, device=self.device)
            meta = BatchMeta.decode(slot_ids, start, max_kv_len=max(r.pos for r in rows))
            out = self._mtp(tokens[:, None], hidden[:, None], meta)
            self._store_first_draft(slot_ids, out[:, 0])
        for r in rows:
            r.carry = None
        return dict(zip([r.key for r in rows], tokens.tolist()))

    def _prefill_group(self, rows: list[_PrefillRow]) -> dict[int, int]:
        """Prefill ``rows`` to their prompts' ends in forwards of at most ``prefill_chunk_tokens / len(rows)``
        columns; returns {row key: first token}.

        Each forward takes from every unfinished row the tokens up to its next save point (at most the
        chunk width), right-padded, at the row's own start position. Rows whose prompt ends in a forward get
        their first token; with drafts the MTP module runs over the same positions (:meth:`_prefill_mtp`). A
        row that reaches a save point stores its slot's state in the prefix cache.
        """
        chunk = max(1, min(max(r.remaining for r in rows), self.prefill_chunk_tokens // len(rows)))
        first: dict[int, int] = {}
        dev, pc = self.device, self.prefix_cache
        while True:
            active = sorted((r for r in rows if r.remaining), key=lambda r: r.slot)
            if not active:
                return first
            n = [min(chunk, r.next_stop() - r.pos) for r in active]
            W = max(n)
            ids = torch.zeros(len(active), W, dtype=torch.long)
            for b, r in enumerate(active):
                ids[b, : n[b]] = torch.tensor(r.prompt[r.pos : r.pos + n[b]], dtype=torch.long)
            slot_list = [r.slot for r in active]
            slot_ids = torch.tensor(slot_list, dtype=torch.long, device=dev)
            consecutive = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
            meta = BatchMeta(
                slot_ids,
                torch.tensor([r.pos for r in active], dtype=torch.long, device=dev),
                torch.tensor(n, dtype=torch.long, device=dev),
                all_valid=min(n) == W,
                max_kv_len=max(r.pos + m for r, m in zip(active, n)),
                fresh=all(r.pos == 0 for r in active),
                row_start=slot_list[0] if consecutive else None,
            )
            hidden = self.model(ids.to(dev), self.cache, meta)  # [B, W, D]
            self.cache.advance_rounding()
            ending = [b for b, r in enumerate(active) if r.pos + n[b] == len(r.prompt)]
            tokens = None
            if ending:
                rows_e = torch.tensor(ending, dtype=torch.long, device=dev)
                cols_e = torch.tensor([n[b] - 1 for b in ending], dtype=torch.long, device=dev)
                tokens = self.model.lm_logits(hidden[rows_e, cols_e]).argmax(-1)
                first.update(zip([active[b].key for b in ending], tokens.tolist()))
            if self.draft_len > 0:
                self._prefill_mtp(active, n, hidden, slot_ids, ending, tokens, meta.row_start)
            for b, r in enumerate(active):
                r.pos += n[b]
                r.carry = None
                if pc is not None and r.pos in r.save_points:
                    pc.save(self.cache, r.slot, r.prompt[: r.pos], hidden[b, n[b] - 1], r.save_points[r.pos])

    def _prefill_mtp(self, active: list[_PrefillRow], n: list[int], hidden: torch.Tensor,
                     slot_ids: torch.Tensor, ending: list[int], first_tokens: torch.Tensor | None,
                     row_start: int | None = None) -> None:
        """The MTP module over one prefill forward's positions (see :meth:`_prefill_group`). MTP position i
        pairs the target hidden at i with token i + 1; the prompt's last position pairs with the first
        generated token, and its output there gives the first draft. A row with a restored hidden (``carry``,
        after a cache hit) starts one position earlier: the restored hidden pairs with its first uncached
        token. Writes the MTP KV cache; stores the first draft of the rows in ``ending`` (indices into
        ``active``; their first tokens ``first_tokens``)."""
        dev, D = self.device, hidden.shape[-1]
        shift = [int(r.carry is not None) for r in active]
        m = [k + s for k, s in zip(n, shift)]  # MTP positions of each row
        Wm = max(m)
        if any(shift):  # column 0: the restored hidden; rows without one read from column 1
            carry = torch.stack([r.carry if r.carry is not None else hidden.new_zeros(D) for r in active])
            h = torch.cat([carry[:, None], hidden], dim=1)  # [B, W + 1, D]
            col = torch.arange(Wm, device=dev)[None, :] + 1 - torch.tensor(shift, device=dev)[:, None]
            h = h.gather(1, col.clamp(max=h.shape[1] - 1)[..., None].expand(-1, -1, D))
        else:
            h = hidden[:, :Wm]
        nxt = torch.zeros(len(active), Wm, dtype=torch.long)
        for b, r in enumerate(active):
            start = r.pos - shift[b]
            after = r.prompt[start + 1 : start + 1 + m[b]]  # the prompt's last position pairs with token 1
            nxt[b, : len(after)] = torch.tensor(after, dtype=torch.long)
        nxt = nxt.to(dev)
        if ending:
            rows_e = torch.tensor(ending, dtype=torch.long, device=dev)
            cols_e = torch.tensor([m[b] - 1 for b in ending], dtype=torch.long, device=dev)
            nxt[rows_e, cols_e] = first_tokens
        meta = BatchMeta(
            slot_ids,
            torch.tensor([r.pos - s for r, s in zip(active, shift)], dtype=torch.long, device=dev),
            torch.tensor(m, dtype=torch.long, device=dev),
            all_valid=min(m) == Wm,
            max_kv_len=max(r.pos + k for r, k in zip(active, n)),
            fresh=all(r.pos - s == 0 for r, s in zip(active, shift)),
            row_start=row_start,
        )
        out = self._mtp(nxt, h, meta)
        if ending:
            self._store_first_draft(slot_ids[rows_e], out[rows_e, cols_e])

    def _mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        """The MTP module at MTP positions ``meta.start_pos + t``: next_ids [B, T] (the token after each
        position), hidden [B, T, D] (target hidden after the final norm, or the MTP's own output when drafting
        recursively) -> MTP hidden [B, T, D]. Writes the MTP attention's KV cache."""
        return self.model.mtp(self.model.embeddings(next_ids), hidden, self.cache, meta)

    def _store_first_draft(self, slot_ids: torch.Tensor, mtp_hidden: torch.Tensor) -> None:
        """Keep each slot's MTP hidden [n, D] and its greedy token: the first draft of the next step (PAD
        rows, slot id -1, write the scratch row)."""
        rows = slot_ids % (self.max_batch_size + 1)
        self._mtp_hidden[rows] = mtp_hidden
        self._draft1[rows] = self.model.lm_logits(mtp_hidden).argmax(-1)

    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """generate's argument checks, before any compute (TypeError / ValueError naming the argument)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(
                f"max_new_tokens must be an int, got {type(max_new_tokens).__name__} {max_new_tokens!r}"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        V = self.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}] is empty; every request needs at least one token (e.g. BOS)")
            bad = next((j for j, t in enumerate(p) if not 0 <= t < V), None)
            if bad is not None:
                raise ValueError(
                    f"prompts[{i}][{bad}] = {p[bad]} is outside [0, {V}) (the vocab size); tokenizer and "
                    "checkpoint disagree"
                )
            if len(p) + max_new_tokens + self.draft_len > self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(p) + max_new_tokens + self.draft_len} > max_seq_len={self.max_seq_len} positions "
                    f"(draft_len={self.draft_len} included); raise "
                    "max_seq_len or shorten the prompt"
                )

    @staticmethod
    def _progress(progress, total: int):
        if callable(progress):
            return None, lambda done: progress(done, total)
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="generate", unit="req")
            return bar, lambda done: bar.update(1)
        return None, lambda done: None
