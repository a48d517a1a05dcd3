"""The inference engine: batched greedy generation with continuous batching over per-slot caches.

The engine knows nothing about tokenization: prompts and outputs are token ids. ``generate`` admits
requests into free cache slots, prefills newly admitted requests together (right-padded, long prompts in
chunks of ``prefill_chunk_tokens``), then decodes all active slots in one batched forward per step; a
finished request frees its slot at once and a waiting request takes it. Host-side bookkeeping (appending a
token, stop checks, callbacks) loops over requests; model compute never does.

With ``draft_len = K > 0`` each decode step is an MTP speculative step (:meth:`Engine._spec_step`): K drafts
from the checkpoint's MTP module, one verify forward over K + 1 tokens, greedy acceptance, and a rewind
commit of the recurrent state; the output equals plain greedy decoding. ``ssm_replay=True`` replaces the
rewind commit by replay (TensorRT-LLM's "SSM replay"; ``runners.cache.Mamba2ReplayState`` /
``GDNReplayState``): a verify fast-forwards the committed state by the previous step's accepted tokens, and
the commit only advances per-slot bookkeeping. ``ssm_backend`` ("triton" default on CUDA, "flashinfer",
"torch" default on CPU) picks who runs the recurrent decode / verify / commit operators: the Triton kernels of
kernels/ or their PyTorch references (the cache's layer states carry it to the mixers).

Contract: docs/architecture.md ("Engine API").
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from runners.cache import SSM_BACKENDS, BatchMeta, HybridCache, cache_memory_bytes
from runners.loader import materialize, plan_load
from runners.memory import LoadReport, check_memory_fits, host_peak_rss_bytes, host_peak_rss_reset
from runners.models.config import HybridConfig
from runners.models.fp8 import FP8_DTYPE
from runners.models.hybrid import HybridLM
from runners.models.mamba2 import Mamba2Mixer
from runners.quant import kv_cache_scales

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN = 64, 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_QUANTS = {None: None, "none": None, "fp8": FP8_DTYPE}  # kv_cache_quant -> KV storage dtype


def _kv_cache_dtype(kv_cache_quant: str | None) -> torch.dtype | None:
    if kv_cache_quant not in KV_CACHE_QUANTS:
        raise ValueError(f"kv_cache_quant={kv_cache_quant!r} is not one of 'none', 'fp8'")
    return KV_CACHE_QUANTS[kv_cache_quant]


@dataclass
class GenerationStats:
    """Counters of one ``generate`` call, kept as raw sums so runs can be merged (``a + b``). Seconds are
    wall time.

    Speculative decoding (MTP, draft length K) adds, per (request, verify step) pair -- a *request-step*:
    ``request_steps`` counts them; ``drafted_tokens`` = K per request-step; ``accepted_drafts`` sums the
    accepted draft tokens; ``accepted_per_position`` [K] counts request-steps whose draft i (1..K) was
    accepted; ``num_accepted_hist`` [K + 2] counts request-steps by num_accepted_tokens (index 0 stays 0).
    These stay zero / empty without speculation.

    Derived metrics (TensorRT-LLM definitions; None without drafts), in :meth:`to_dict` next to the sums:
    ``acceptance_rate`` = accepted_drafts / drafted_tokens; ``acceptance_length`` = 1 + accepted_drafts /
    request_steps (tokens per request-step); ``acceptance_per_position`` [K] = accepted_per_position /
    request_steps.
    """

    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_accepted_hist: list[int] = field(default_factory=list)
    request_steps: int = 0

    DERIVED = ("acceptance_rate", "acceptance_length", "acceptance_per_position")

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens, or None when nothing was drafted."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens a request advances per verify step: 1 + accepted drafts / request-steps."""
        return 1 + self.accepted_drafts / self.request_steps if self.request_steps else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """[K] fraction of request-steps whose draft i (1..K) was accepted (non-increasing in i)."""
        if not self.request_steps:
            return [0.0] * len(self.accepted_per_position)
        return [a / self.request_steps for a in self.accepted_per_position]

    def record_step(self, accepted_drafts: Sequence[int], draft_len: int) -> None:
        """Count one verify step: ``accepted_drafts`` [B] accepted drafts per request, each in [0, K]."""
        if not self.num_accepted_hist:
            self.accepted_per_position, self.num_accepted_hist = [0] * draft_len, [0] * (draft_len + 2)
        if len(self.accepted_per_position) != draft_len:
            have = len(self.accepted_per_position)
            raise ValueError(f"draft_len={draft_len}, but these stats count K={have} positions")
        if any(not 0 <= a <= draft_len for a in accepted_drafts):
            raise ValueError(f"accepted drafts {list(accepted_drafts)} must lie in [0, K={draft_len}]")
        self.request_steps += len(accepted_drafts)
        self.drafted_tokens += draft_len * len(accepted_drafts)
        for a in accepted_drafts:
            self.accepted_drafts += a
            self.num_accepted_hist[a + 1] += 1
            for i in range(a):
                self.accepted_per_position[i] += 1

    def acceptance(self) -> dict:
        """The acceptance statistics of results.json (docs/results_schema.md): ``rate``, ``length``,
        ``per_position`` (the derived metrics; rate and length None without drafts) and the raw sums behind
        them, ``drafted``, ``accepted``, ``request_steps``, ``accepted_per_position``,
        ``num_accepted_hist``."""
        return {
            "rate": self.acceptance_rate,
            "length": self.acceptance_length,
            "per_position": self.acceptance_per_position,
            "drafted": self.drafted_tokens,
            "accepted": self.accepted_drafts,
            "request_steps": self.request_steps,
            "accepted_per_position": list(self.accepted_per_position),
            "num_accepted_hist": list(self.num_accepted_hist),
        }

    def to_dict(self) -> dict:
        """The raw sums (the dataclass fields) plus the derived metrics of :data:`DERIVED`."""
        d = asdict(self)
        d.update((k, getattr(self, k)) for k in self.DERIVED)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> GenerationStats:
        """Inverse of :meth:`to_dict`: derived keys are recomputed, not read; unknown keys raise TypeError."""
        return cls(**{k: v for k, v in d.items() if k not in cls.DERIVED})

    def __add__(self, other: GenerationStats) -> GenerationStats:
        """Element-wise sum of two runs' counters (lists padded to the longer: runs of different K)."""

        def add(a, b):
            if isinstance(a, list):
                n = max(len(a), len(b))
                return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]
            return a + b

        return GenerationStats(**{k: add(v, getattr(other, k)) for k, v in asdict(self).items()})


class SlotCounters:
    """Per-slot speculative counters of the request that holds each cache slot; host int64 tensors.

    ``request_steps`` [S], ``accepted_drafts`` [S], ``accepted_per_position`` [S, K] and
    ``num_accepted_hist`` [S, K + 2] mirror the :class:`GenerationStats` fields of the same names for one
    request. :meth:`reset` zeroes a slot's row when a request is admitted; :meth:`record` updates all rows
    of a verify step at once (no loop over requests); :meth:`request_stats` reads one row back as the
    ``request_stats`` dict that ``on_finish`` receives. Summed over all requests of a ``generate`` call the
    rows equal that call's :class:`GenerationStats` counters.
    """

    def __init__(self, num_slots: int, draft_len: int):
        self.draft_len = draft_len
        self.request_steps = torch.zeros(num_slots, dtype=torch.long)
        self.accepted_drafts = torch.zeros(num_slots, dtype=torch.long)
        self.accepted_per_position = torch.zeros(num_slots, draft_len, dtype=torch.long)
        self.num_accepted_hist = torch.zeros(num_slots, draft_len + 2 if draft_len else 0, dtype=torch.long)

    def reset(self, slots: Sequence[int]) -> None:
        """Zero the rows of ``slots`` (newly admitted requests)."""
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        self.request_steps[idx] = 0
        self.accepted_drafts[idx] = 0
        self.accepted_per_position[idx] = 0
        self.num_accepted_hist[idx] = 0

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
        [K + 2] (both [] without speculation), ``generated_tokens``, ``prompt_tokens``."""
        steps = int(self.request_steps[slot])
        return {
            "request_steps": steps,
            "drafted_tokens": self.draft_len * steps,
            "accepted_drafts": int(self.accepted_drafts[slot]),
            "accepted_per_position": self.accepted_per_position[slot].tolist(),
            "num_accepted_hist": self.num_accepted_hist[slot].tolist(),
            "generated_tokens": generated_tokens,
            "prompt_tokens": prompt_tokens,
        }


@dataclass
class GenerationOutput:
    """tokens: generated ids per prompt (prompt excluded, a stop token kept); finish_reasons: "stop_token" |
    "stop_checker" | "length"; stats: the run's counters."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


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
    alone: ``runners.cache.cache_memory_bytes`` plus, with drafts, the per-slot first draft (int64) and its
    MTP hidden [S, D] in the model dtype."""
    mem = cache_memory_bytes(config, cache_kinds, **cache_args)
    if draft_len > 0:
        S, itemsize = cache_args["max_batch_size"], cache_args["dtype"].itemsize
        mem["spec_buffers_bytes"] += S * (config.hidden_size * itemsize + 8)
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


class Engine:
    """A loaded model plus its caches and the generate loop. Build it with :meth:`from_pretrained`.

    Attributes:
        config: the model's :class:`HybridConfig`.
        model: the :class:`HybridLM` (eval mode).
        cache: the :class:`HybridCache` (S = ``max_batch_size`` slots of ``max_seq_len`` positions).
        draft_len: K, MTP draft tokens per step (0 = no speculation); ssm_replay: state commit scheme
            (replay vs rewind); ssm_backend: recurrent-state operators ("triton" | "flashinfer" | "torch").
        load_report: :class:`runners.memory.LoadReport` of :meth:`from_pretrained` (None when the engine was
            built from a model object).
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
        self.cache = HybridCache(
            config, self._cache_kinds, device=self.device, ssm_backend=self.ssm_backend, **self._cache_args
        )
        if self.kv_cache_quant == "fp8":
            self._attach_kv_scales()
        if draft_len > 0:  # per slot: the MTP hidden and greedy token that start the next step's drafts
            self._mtp_hidden = torch.zeros(
                max_batch_size, config.hidden_size, dtype=dtype, device=self.device
            )
            self._draft1 = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self._slot_counters = SlotCounters(max_batch_size, draft_len)

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
                memory_budget_bytes (default None: the device's free memory; the bytes weights + caches
                may take, checked before anything is allocated).

        The model is built on the meta device and its weights are loaded straight to ``device`` in their
        dtype (:func:`runners.loader.plan_load` / :func:`runners.loader.materialize`); ``engine.load_report``
        (:class:`runners.memory.LoadReport`) records the load time and host / device peak memory. A
        checkpoint that declares FP8 weights (config.json quantization_config / hf_quant_config.json) loads
        them as FP8 and runs FP8 GEMMs (runners.quant; ``engine.model.quant_report`` says which ran).

        Raises:
            runners.memory.InsufficientMemoryError: weights + caches at max_batch_size / max_seq_len exceed
                the device's free memory (or memory_budget_bytes); raised before any allocation.
            runners.loader.CheckpointError: unreadable / inconsistent checkpoint.
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
        }
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}; allowed: {sorted(allowed)}")
        dtype = _resolve_dtype(dtype)
        _check_spec_args(draft_len, ssm_replay)
        device = torch.device(device)
        budget = options.pop("memory_budget_bytes", None)
        t0 = time.perf_counter()
        host_reset = host_peak_rss_reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        plan = plan_load(path, dtype=dtype, load_mtp=True if draft_len > 0 else None)
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
        t_weights = time.perf_counter()
        model = materialize(plan, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_weights = time.perf_counter() - t_weights
        engine = cls(model, device=device, dtype=dtype, draft_len=draft_len, ssm_replay=ssm_replay, **options)
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
        ``v_proj.v_scale``, runners.quant.kv_cache_scales); a block without them gets 1.0, with a warning
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
                "calibrated by python -m runners.quantize --fp8 carries them", self.config.source, missing)

    def cache_memory(self) -> dict[str, int]:
        """Bytes allocated for per-slot state, by kind (scratch row included):

        - ``ssm_state_bytes``: committed recurrent states (Mamba2 SSM state; a GDN family's state);
        - ``conv_state_bytes``: committed conv windows;
        - ``kv_cache_bytes``: attention KV caches, target and MTP;
        - ``spec_buffers_bytes``: what only speculative decoding allocates (rewind: the per-token verify
          states; replay: the input history, the extra conv columns and the per-slot PNAT / buffer index;
          both: the per-slot first draft and its MTP hidden); 0 when ``draft_len`` is 0.

        The cache part is computed from the architecture by :func:`runners.cache.cache_memory_bytes` (the
        function that also sizes released shapes without weights); tests check it against the tensors.
        """
        return _planned_cache_memory(self.config, self._cache_kinds, self._cache_args, self.draft_len)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A full causal forward without cache: input_ids LongTensor [B, T] -> float32 logits [B, T, V]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {list(input_ids.shape)}")
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

        Raises:
            ValueError: an empty prompt, an id outside the vocab, max_new_tokens < 1, or a prompt that with
                max_new_tokens does not fit ``max_seq_len``.
        """
        K = self.draft_len
        n = len(prompts)
        prompts = [list(map(int, p)) for p in prompts]
        self._check_prompts(prompts, max_new_tokens)
        stop_ids = set(self.config.eos_token_id if stop_token_ids is None else stop_token_ids)
        stats = GenerationStats(num_requests=n, prompt_tokens=sum(map(len, prompts)))
        if K > 0:
            stats.record_step([], K)  # sizes the per-position counters even if no step runs
        out_tokens: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        bar, report = self._progress(progress, n)
        finished = 0

        waiting = deque(range(n))
        free_slots = list(range(self.max_batch_size - 1, -1, -1))  # pop() hands out slot 0 first
        slot_request = [-1] * self.max_batch_size
        slot_len = torch.zeros(self.max_batch_size, dtype=torch.long)  # tokens of the slot's request in cache
        last_token = torch.zeros(self.max_batch_size, dtype=torch.long)
        active: list[int] = []  # slots decoding, in admission order
        counters = self._slot_counters

        def accept(slot: int, tokens: list[int]) -> None:
            """Append a step's ``tokens`` to the slot's request, stopping at the first stop condition (a
            speculative step may bring several tokens); a finished request frees its slot at once."""
            nonlocal finished
            i = slot_request[slot]
            toks = out_tokens[i]
            reason = None
            for token in tokens:
                toks.append(token)
                if token in stop_ids:
                    reason = "stop_token"
                elif stop_checker is not None and stop_checker(i, toks):
                    reason = "stop_checker"
                elif len(toks) >= max_new_tokens:
                    reason = "length"
                if reason is not None:
                    break
            if reason is None:
                return
            reasons[i] = reason
            request_stats = counters.request_stats(slot, len(prompts[i]), len(toks))
            active.remove(slot)
            slot_request[slot] = -1
            free_slots.append(slot)
            finished += 1
            if on_finish is not None:
                on_finish(i, toks, reason, request_stats)
            report(finished)

        while waiting or active:
            if waiting and free_slots:  # admit into every free slot, prefill the newcomers together
                admitted = []
                while waiting and free_slots:
                    slot = free_slots.pop()
                    slot_request[slot] = waiting.popleft()
                    admitted.append(slot)
                counters.reset(admitted)
                t0 = time.perf_counter()
                first = self._prefill([prompts[slot_request[s]] for s in admitted], admitted)
                for slot, token in zip(admitted, first):
                    slot_len[slot] = len(prompts[slot_request[slot]])
                    last_token[slot] = token
                stats.prefill_seconds += time.perf_counter() - t0
                active.extend(admitted)
                for slot, token in zip(admitted, first):
                    accept(slot, [token])
                continue  # refill slots freed by requests that finished on their first token
            t0 = time.perf_counter()
            active.sort()  # contiguous slots (the usual case while the queue is full) are read as a slice
            if K > 0:
                new_tokens = self._spec_step(active, slot_len, last_token, stats)
            else:
                new_tokens = self._decode_step(active, slot_len, last_token)
            stats.steps += 1
            stats.decode_seconds += time.perf_counter() - t0
            for slot, tokens in zip(list(active), new_tokens):
                accept(slot, tokens)

        if bar is not None:
            bar.close()
        stats.generated_tokens = sum(map(len, out_tokens))
        return GenerationOutput(tokens=out_tokens, finish_reasons=reasons, stats=stats)

    def _decode_step(
        self, slots: list[int], slot_len: torch.Tensor, last_token: torch.Tensor
    ) -> list[list[int]]:
        """One batched greedy step over ``slots`` (sorted): feed each slot's last token, return the new
        token(s) per slot. Advances ``slot_len`` [S] and ``last_token`` [S] (host int64) in place.

        This is the unit a speculative step replaces (draft K with the MTP module, verify T = K + 1 tokens
        with ``BatchMeta.verify``, accept, ``cache.commit``); it may then return up to K + 1 tokens per slot.
        """
        idx = torch.tensor(slots, dtype=torch.long)
        contiguous = slots[-1] - slots[0] + 1 == len(slots)
        meta = BatchMeta.decode(
            idx.to(self.device),
            slot_len[idx].to(self.device),
            slot_start=slots[0] if contiguous else None,
            max_kv_len=int(slot_len[idx].max()) + 1,
        )
        hidden = self.model(last_token[idx][:, None].to(self.device), self.cache, meta)
        next_tokens = self.model.lm_logits(hidden[:, -1]).argmax(-1).cpu()
        slot_len[idx] += 1
        last_token[idx] = next_tokens
        return [[t] for t in next_tokens.tolist()]

    def _spec_step(
        self, slots: list[int], slot_len: torch.Tensor, last_token: torch.Tensor, stats: GenerationStats
    ) -> list[list[int]]:
        """One MTP speculative greedy step over ``slots`` (sorted); returns 1 .. K + 1 tokens per slot.

        1. draft: K tokens per slot with the MTP module (:meth:`_draft`);
        2. verify: one target forward over T = K + 1 tokens [last token, d_1 .. d_K] (``BatchMeta.verify``:
           recurrent layers keep every intermediate state);
        3. accept: the longest draft prefix equal to the target's argmax, plus the bonus target token;
           num_accepted_tokens = accepted drafts + 1;
        4. commit: recurrent state <- the state after num_accepted_tokens tokens (``cache.commit``: rewind);
           the KV caches (target and MTP) roll back by length: ``slot_len`` advances by num_accepted_tokens
           only, so entries of rejected positions are never read and later writes overwrite them;
        5. MTP catch-up: the MTP module re-runs the accepted positions n .. n + a with the target's hidden
           states (overwriting its draft-time KV entries); position n + a pairs the target hidden at index a
           (the last accepted position) with the bonus token, and its output gives the next first draft.
        The loop is family-agnostic: it needs only the model forward, ``BatchMeta.verify`` support in the
        recurrent mixers and ``cache.commit`` (each layer state's ``commit``).
        Advances ``slot_len`` / ``last_token``, the acceptance counters of ``stats`` and the per-slot
        counters (:class:`SlotCounters`) in place.
        """
        K, T = self.draft_len, self.draft_len + 1
        idx = torch.tensor(slots, dtype=torch.long)
        dev_idx, n = idx.to(self.device), slot_len[idx]
        dev_n = n.to(self.device)
        slot_start = slots[0] if slots[-1] - slots[0] + 1 == len(slots) else None
        drafts = self._draft(dev_idx, n, slot_start)  # [B, K]
        tokens = torch.cat([last_token[idx][:, None].to(self.device), drafts], dim=1)  # [B, T]
        meta = BatchMeta.decode(
            dev_idx, dev_n, T, verify=True, slot_start=slot_start, max_kv_len=int(n.max()) + T
        )
        hidden = self.model(tokens, self.cache, meta)  # [B, T, D]
        greedy = self.model.lm_logits(hidden).argmax(-1)  # [B, T]
        accepted = (drafts == greedy[:, :K]).long().cumprod(dim=1).sum(dim=1)  # [B] in [0, K]
        num_accepted = accepted + 1
        self.cache.commit(dev_idx, num_accepted)
        bonus = greedy.gather(1, accepted[:, None])[:, 0]
        # MTP position n + j pairs target hidden j with the token after it: d_{j+1} (accepted) or the bonus.
        cols = torch.arange(T, device=self.device)[None, :]
        after = torch.where(
            cols < accepted[:, None], torch.cat([drafts, drafts[:, :1]], dim=1), bonus[:, None]
        )
        catch_up = BatchMeta(dev_idx, dev_n, num_accepted, slot_start=slot_start, max_kv_len=int(n.max()) + T)
        out = self._mtp(after, hidden, catch_up)
        self._store_first_draft(dev_idx, out[torch.arange(len(slots), device=self.device), accepted])

        accepted_h = accepted.cpu()
        acc, drafts_h, bonus_h = accepted_h.tolist(), drafts.tolist(), bonus.tolist()
        slot_len[idx] += accepted_h + 1
        last_token[idx] = bonus.cpu()
        stats.record_step(acc, K)
        self._slot_counters.record(idx, accepted_h)
        return [d[:a] + [b] for d, a, b in zip(drafts_h, acc, bonus_h)]

    def _draft(self, slot_ids: torch.Tensor, slot_len: torch.Tensor, slot_start: int | None) -> torch.Tensor:
        """K draft tokens per slot: [B, K] int64 on the device. The first was prepared by the previous step
        (or the prefill); each further one applies the MTP module to its own last output and draft, at MTP
        position slot_len - 1 + j. Writes the MTP KV cache there (the catch-up overwrites it)."""
        drafts = [self._draft1[slot_ids]]
        h = self._mtp_hidden[slot_ids]
        for j in range(1, self.draft_len):
            pos = slot_len - 1 + j
            meta = BatchMeta.decode(
                slot_ids, pos.to(self.device), slot_start=slot_start, max_kv_len=int(pos.max()) + 1
            )
            h = self._mtp(drafts[-1][:, None], h[:, None], meta)[:, 0]
            drafts.append(self.model.lm_logits(h).argmax(-1))
        return torch.stack(drafts, dim=1)

    def _prefill(self, prompts: list[list[int]], slots: list[int]) -> list[int]:
        """Run the prompts of newly admitted requests into their (reset) slots; return each first token.

        Requests are grouped so that a group's padded size (rows x longest prompt, capped at
        ``prefill_chunk_tokens`` per forward) stays within budget; a group's prompts are right-padded and
        run in column chunks of that size, each row continuing from its own cached state.
        """
        self.cache.reset(torch.tensor(slots, dtype=torch.long, device=self.device))
        budget = self.prefill_chunk_tokens
        order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))
        first: dict[int, int] = {}
        group: list[int] = []
        for j in order + [None]:
            if j is not None and (not group or (len(group) + 1) * min(len(prompts[j]), budget) <= budget):
                group.append(j)
                continue
            first.update(self._prefill_group([prompts[g] for g in group], [slots[g] for g in group], group))
            group = [j] if j is not None else []
        return [first[j] for j in range(len(prompts))]

    def _prefill_group(self, prompts: list[list[int]], slots: list[int], keys: list[int]) -> dict[int, int]:
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        T_max = int(lengths.max())
        chunk = max(1, min(T_max, self.prefill_chunk_tokens // len(prompts)))
        ids = torch.zeros(len(prompts), T_max, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        slot_ids = torch.tensor(slots, dtype=torch.long, device=self.device)
        first: dict[int, int] = {}
        for c0 in range(0, T_max, chunk):
            width = min(chunk, T_max - c0)
            row_len = (lengths - c0).clamp(0, width)
            meta = BatchMeta(
                slot_ids,
                torch.full_like(slot_ids, c0),
                row_len.to(self.device),
                all_valid=bool((row_len == width).all()),
            )
            hidden = self.model(ids[:, c0 : c0 + width].to(self.device), self.cache, meta)
            ending = [b for b in range(len(prompts)) if c0 < lengths[b] <= c0 + width]  # last token here
            rows = torch.tensor(ending, dtype=torch.long, device=self.device)
            cols = (lengths[ending] - 1 - c0).to(self.device)
            tokens = self.model.lm_logits(hidden[rows, cols]).argmax(-1)
            first.update(zip([keys[b] for b in ending], tokens.tolist()))
            if self.draft_len > 0:
                # MTP position i pairs the target hidden at i with token i + 1; the prompt's last position
                # pairs with the first generated token, and its output there gives the first draft.
                nxt = torch.zeros(len(prompts), width, dtype=torch.long)
                shifted = ids[:, c0 + 1 : c0 + width + 1]
                nxt[:, : shifted.shape[1]] = shifted
                nxt = nxt.to(self.device)
                nxt[rows, cols] = tokens
                out = self._mtp(nxt, hidden, meta)
                if ending:
                    self._store_first_draft(slot_ids[rows], out[rows, cols])
        return first

    def _mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        """The MTP module at MTP positions ``meta.start_pos + t``: next_ids [B, T] (the token after each
        position), hidden [B, T, D] (target hidden after the final norm, or the MTP's own output when drafting
        recursively) -> MTP hidden [B, T, D]. Writes the MTP attention's KV cache."""
        return self.model.mtp(self.model.embeddings(next_ids), hidden, self.cache, meta)

    def _store_first_draft(self, slot_ids: torch.Tensor, mtp_hidden: torch.Tensor) -> None:
        """Keep each slot's MTP hidden [n, D] and its greedy token: the first draft of the next step."""
        self._mtp_hidden[slot_ids] = mtp_hidden
        self._draft1[slot_ids] = self.model.lm_logits(mtp_hidden).argmax(-1)

    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        V = self.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every request needs at least one token (e.g. BOS)")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(
                    f"prompt {i} has token ids outside [0, {V}); tokenizer and checkpoint disagree"
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
