"""The inference engine: batched greedy generation with continuous batching over per-slot caches.

The engine knows nothing about tokenization: prompts and outputs are token ids. :class:`Engine` is the
public API (``from_pretrained``, ``logits``, ``generate``, ``cache_memory``) and the scheduler's entry;
the work lives beside it, one module per seam:

- runners.engine.options: ``EngineOptions``, the one list of the engine's settings (defaults, units,
  checks), and ``engine_options``, which makes it from a resolved registry run;
- runners.engine.scheduler: one ``generate`` call's continuous batching (``Generation``): admit requests
  into free cache slots, prefill the newly admitted together, decode all active slots in one batched step;
  a finished request frees its slot at once and a waiting request takes it. Host-side bookkeeping
  (appending a token, stop checks, callbacks) loops over requests; model compute never does;
- runners.engine.prefill: the prefill (``Prefill``: right-padded chunks of ``prefill_chunk_tokens``, the
  prefix cache's restores and save points, the MTP module over the prompt);
- runners.engine.step: the decode step (``DecodeStep``: the per-slot device state, the static step buffers,
  the phases decode, or draft / verify / commit / catch-up, and their CUDA graphs). A step never
  synchronises with the host: each slot's length, last token and first draft live on the device and the
  step advances them itself; the host only writes the batch's slot ids and reads the new tokens back
  through pinned memory. With ``overlap_steps`` (default on CUDA) the next step is queued before the host
  does this one's bookkeeping, so the two overlap.

With ``draft_len = K > 0`` each decode step is an MTP speculative step: K drafts from the checkpoint's MTP
module, one verify forward over K + 1 tokens, greedy acceptance, and a rewind commit of the recurrent state;
the output equals plain greedy decoding. ``ssm_replay=True`` replaces the rewind commit by replay
(TensorRT-LLM's "SSM replay"; ``runners.engine.state.RecurrentReplayState``).
``ssm_backend`` ("triton" default on CUDA, "flashinfer", "torch" default on CPU) picks who runs the recurrent
decode / verify / commit operators: the Triton kernels of kernels/ or their PyTorch references.

Contract: docs/architecture.md ("Engine API").
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runners.engine.cache import SSM_BACKENDS, HybridCache, cache_memory_bytes
from runners.engine.graphs import PhaseTimer, StepGraphs
from runners.engine.loader import materialize, plan_load
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
from runners.engine.models.config import HybridConfig
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.mamba2 import Mamba2Mixer
from runners.engine.onednn import use_onednn_linears
from runners.engine.options import DTYPES, EngineOptions, dtype_name
from runners.engine.prefill import Prefill
from runners.engine.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, prefix_cache_off_reason
from runners.engine.quant import kv_cache_scales
from runners.engine.scheduler import Generation, SlotCounters
from runners.engine.stats import GenerationStats
from runners.engine.step import DecodeStep, LaunchedStep, SlotState

log = logging.getLogger(__name__)

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
    if isinstance(values, list) and all(type(v) is int for v in values):  # the usual case, checked at once
        return list(values)
    return [_token_id(v, f"{where}[{j}]") for j, v in enumerate(values)]


def _token_rows(rows, where: str) -> list[list[int]]:
    """Token-id rows (a sequence of sequences, or a 2-D integer tensor) as lists of ints. Raises TypeError."""
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence | torch.Tensor):
        raise TypeError(f"{where} must be a list of token-id lists, got {type(rows).__name__}")
    return [_token_list(row, f"{where}[{i}]") for i, row in enumerate(rows)]


# FlashInfer 0.7.2's selective_state_update compiles one module per (head_dim, d_state); at some sizes its
# build fails a static assertion in its vector-load helpers, and it dispatches heads per group over powers of
# two only. tests/gpu/flashinfer_sizes.py probed it on the H200 (docs/gpu/flashinfer_sizes.json): it builds
# and matches our reference at the sizes below, and fails to build at head_dim 16 and 32. Only sizes measured
# (or listed by its dispatcher) are sent to it; others run our Triton kernel, with a warning.
FLASHINFER_SIZES = {"mamba_head_dim": (64, 128), "ssm_state_size": (32, 64, 128, 256)}
FLASHINFER_HEADS_PER_GROUP = (1, 2, 4, 8, 16, 32, 64)


def resolve_ssm_backend(
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


def planned_cache_memory(config: HybridConfig, cache_kinds: dict[int, str], options: EngineOptions,
                         ssm_state_dtype: torch.dtype) -> dict[str, int]:
    """Bytes of the engine's per-slot state by kind (:meth:`Engine.cache_memory`), from the architecture
    alone: ``runners.engine.cache.cache_memory_bytes`` plus, with drafts, the decode step's per-slot first
    draft and MTP hidden (``runners.engine.step.SlotState``; the scratch row included, like every cache
    buffer)."""
    mem = cache_memory_bytes(config, cache_kinds, **options.cache_args(ssm_state_dtype))
    mem["spec_buffers_bytes"] += SlotState.spec_bytes(options.max_batch_size, config.hidden_size,
                                                      options.torch_dtype, options.draft_len)
    return mem


def _state_dtype(options: EngineOptions, config: HybridConfig) -> torch.dtype:
    """The SSM state dtype: the option, else the checkpoint's ``mamba_ssm_cache_dtype``."""
    return DTYPES[dtype_name(options.ssm_state_dtype or config.mamba_ssm_cache_dtype)]


class Engine:
    """A loaded model plus its caches, its decode step and the generate loop. Build it with
    :meth:`from_pretrained`, or around a model with ``Engine(model, options, device=...)``.

    Args:
        model: a :class:`HybridLM` in ``options.dtype`` on ``device`` (eval mode). On the CPU in float32 its
            eligible ``nn.Linear`` modules are swapped in place for oneDNN ones that compute the same bits
            (``options.onednn_linear``, runners.engine.onednn).
        options: the :class:`runners.engine.options.EngineOptions` (None: the defaults); validated here.
        device: where the model lives and the caches are allocated.
        tensor_parallel: this rank's ``runners.engine.tp.TensorParallel`` when the model is a shard
            (``runners.engine.launch`` runs such engines in lockstep), else None.
        prefix_store: a ready :class:`PrefixCache` to use when the prefix cache is on (tests: a small
            ``block_tokens``); None builds one of ``options.prefix_cache_bytes``.

    Attributes:
        config: the model's :class:`HybridConfig`; model: the :class:`HybridLM`; options: the options.
        cache: the :class:`HybridCache` (S = ``max_batch_size`` slots of ``max_seq_len`` positions).
        step: the :class:`runners.engine.step.DecodeStep` (slot state, step buffers, phases, CUDA graphs);
            prefill: the :class:`runners.engine.prefill.Prefill`.
        draft_len, ssm_replay, max_batch_size, max_seq_len, prefill_chunk_tokens, scan_chunk_size,
            kv_cache_quant: the options in effect; ssm_backend: the recurrent operators that run ("triton" |
            "flashinfer" | "torch", after fallbacks); ssm_state_dtype: the SSM state's torch dtype.
        overlap_steps: whether the next step is queued before this one's host bookkeeping (the option in
            effect).
        load_report: :class:`runners.engine.memory.LoadReport` of :meth:`from_pretrained` (None otherwise).
        prefix_cache: the :class:`PrefixCache` admissions reuse prompt prefixes from (None: off;
            ``prefix_cache_off_reason`` then says why, from
            :func:`runners.engine.prefix_cache.prefix_cache_off_reason`).

    Raises:
        ValueError: a bad option (:meth:`EngineOptions.validate`), draft_len without MTP weights.
    """

    def __init__(self, model: HybridLM, options: EngineOptions | None = None, *,
                 device: str | torch.device = "cpu", tensor_parallel=None,
                 prefix_store: PrefixCache | None = None):
        options = (options or EngineOptions()).validate()
        config = model.config
        if options.draft_len > 0 and model.mtp is None:
            raise ValueError(
                f"draft_len={options.draft_len} needs MTP weights, but the checkpoint ({config.source}) has "
                "no mtp.* tensors or its config.json declares no MTP layers; set draft_len=0 or "
                "use a checkpoint with an MTP module"
            )
        self.options, self.model, self.config = options, model, config
        self.device, self.dtype = torch.device(device), options.torch_dtype
        self.draft_len, self.ssm_replay = options.draft_len, options.ssm_replay
        self.max_batch_size, self.max_seq_len = options.max_batch_size, options.max_seq_len
        self.prefill_chunk_tokens, self.kv_cache_quant = options.prefill_chunk_tokens, options.kv_cache_quant
        self.tensor_parallel = tensor_parallel
        self.load_report: LoadReport | None = None  # set by from_pretrained
        self.scan_chunk_size = options.scan_chunk_size
        if self.scan_chunk_size is None:  # the intra-chunk term is quadratic: short chunks are faster on CPUs
            cuda = self.device.type == "cuda"
            self.scan_chunk_size = config.chunk_size if cuda else min(config.chunk_size, 32)
        for module in model.modules():
            if isinstance(module, Mamba2Mixer):
                module.chunk_size = self.scan_chunk_size
        if (options.onednn_linear and not options.compile and self.device.type == "cpu"
                and self.dtype == torch.float32):  # (compiled blocks: inductor's own GEMMs)
            swapped = use_onednn_linears(model)  # bit for bit F.linear, about twice as fast
            log.debug("%d linear layers run through oneDNN", swapped)
        self.ssm_backend = resolve_ssm_backend(options.ssm_backend, self.device, self.ssm_replay, config)
        self.ssm_state_dtype = _state_dtype(options, config)
        if config.mamba_num_heads and self.ssm_state_dtype.itemsize < 4:
            log.warning(
                "ssm_state_dtype=%s for Mamba2 layers: a 16-bit recurrent state drifts from the float32 "
                "reference on long outputs (logit drift grows ~40x over 2,000 teacher-forced tokens); "
                "results are judged only against baseline rows measured with this state dtype",
                dtype_name(self.ssm_state_dtype),
            )
        self._cache_kinds = model.cache_kinds(include_mtp=self.draft_len > 0)
        self.cache = HybridCache(
            config, self._cache_kinds, device=self.device, ssm_backend=self.ssm_backend,
            stochastic_rounding=options.ssm_stochastic_rounding, **options.cache_args(self.ssm_state_dtype)
        )
        if self.kv_cache_quant == "fp8":
            self._attach_kv_scales()
        self.step = DecodeStep(model, self.cache, options, device=self.device, ssm_backend=self.ssm_backend)
        self.overlap_steps = options.overlap_steps
        if self.overlap_steps is None:  # default: on with CUDA, where the host and the device run apart
            self.overlap_steps = self.device.type == "cuda"
        self._slot_counters = SlotCounters(self.max_batch_size, self.draft_len)
        if options.check_finite:  # per-layer "non-finite output" flags, read once per generate call
            model.track_nonfinite(self.device)
        self._setup_prefix_cache(prefix_store)
        max_rows = options.prefill_max_rows
        if max_rows is None and self.device.type == "cpu":
            max_rows = 1  # GEMM-bound per prompt already: rows together would only pad
        self.prefill = Prefill(model, self.cache, self.step, self.prefix_cache, draft_len=self.draft_len,
                               prefill_chunk_tokens=self.prefill_chunk_tokens, device=self.device,
                               prefill_max_rows=max_rows)
        self._stats: GenerationStats | None = None  # the counters of the generate call in progress

    def _setup_prefix_cache(self, prefix_store: PrefixCache | None) -> None:
        """``self.prefix_cache`` (a :class:`PrefixCache`, or None) and ``self.prefix_cache_off_reason``, as
        :func:`runners.engine.prefix_cache.prefix_cache_off_reason` decides.

        Raises:
            ValueError: ``prefix_cache_bytes`` together with a ``prefix_store`` (it brings its own).
        """
        if prefix_store is not None and self.options.prefix_cache_bytes is not None:
            raise ValueError("pass prefix_cache_bytes only without prefix_store (a PrefixCache brings its "
                             "own max_bytes)")
        self.prefix_cache: PrefixCache | None = None
        self.prefix_cache_off_reason = prefix_cache_off_reason(
            self.options, ssm_state_dtype=dtype_name(self.ssm_state_dtype))
        if self.prefix_cache_off_reason is not None:
            log.info("prefix cache off: %s", self.prefix_cache_off_reason)
            return
        nbytes = self.options.prefix_cache_bytes
        if prefix_store is None:  # (not `or`: an empty PrefixCache is falsy, it has a length)
            prefix_store = PrefixCache(max_bytes=DEFAULT_PREFIX_CACHE_BYTES if nbytes is None else nbytes)
        self.prefix_cache = prefix_store
        mtp_blocks = self.model.mtp.blocks if self.model.mtp is not None and self.draft_len > 0 else []
        self.prefix_cache.configure(b.cache_index for b in mtp_blocks if b.kind == "attention")

    @classmethod
    def from_pretrained(cls, path: str | Path, options: EngineOptions | None = None, *,
                        device: str | torch.device = "cpu", tensor_parallel=None,
                        prefix_store: PrefixCache | None = None) -> Engine:
        """Load an HF checkpoint dir (config.json + safetensors) and allocate the caches.

        ``options`` (:class:`runners.engine.options.EngineOptions`; None: the defaults) says everything the
        engine is asked; ``device``, ``tensor_parallel`` and ``prefix_store`` as in :class:`Engine`. With
        ``tensor_parallel`` this process loads, allocates and runs only its rank's shard of the model, and
        ``engine.config`` is the rank's view of config.json (its process group must be initialised).

        The model is built on the meta device and its weights are loaded straight to ``device`` in their
        dtype (:func:`runners.engine.loader.plan_load` / :func:`runners.engine.loader.materialize`);
        ``engine.load_report`` (:class:`runners.engine.memory.LoadReport`) records the load time and host /
        device peak memory. A checkpoint that declares FP8 weights (config.json quantization_config /
        hf_quant_config.json) loads them as FP8 and runs FP8 GEMMs (runners.engine.quant). The weights and
        the caches at max_batch_size / max_seq_len must fit ``options.memory_budget_bytes`` (default: the
        device's free memory; a tensor-parallel rank that shares its device with others takes its share,
        ``TensorParallel.ranks_per_device``); the prefill chunk is cut to what stays free and the prefix
        cache may then take at most half of it.

        Raises:
            runners.engine.memory.InsufficientMemoryError: weights + caches do not fit; raised before any
                allocation.
            runners.engine.loader.CheckpointError: unreadable / inconsistent checkpoint.
            ValueError: bad options (:meth:`EngineOptions.validate`, draft_len without MTP weights).
        """
        options = (options or EngineOptions()).validate()
        device = torch.device(device)
        t0, host_reset = _start_load_clock(device)
        plan = plan_load(path, dtype=options.torch_dtype, load_mtp=True if options.draft_len > 0 else None)
        if tensor_parallel is not None:  # this rank's shard: the model of the rank's config view
            from runners.engine.tp import shard_plan

            plan = shard_plan(plan, tensor_parallel)
        return cls._from_plan(plan, materialize, options, device, tensor_parallel, prefix_store, t0,
                              host_reset)

    @classmethod
    def from_dummy(cls, config: HybridConfig, options: EngineOptions | None = None, *,
                   device: str | torch.device = "cpu", prefix_store: PrefixCache | None = None,
                   log=None) -> Engine:
        """An engine over random weights at ``config`` in its checkpoint format (``config.quantization``;
        ``model.load_format=dummy``, runners.engine.dummy), built straight on ``device``: the same fit check,
        caches, load report and decode step as :meth:`from_pretrained`, no file read. ``log`` gets the
        build's progress lines.

        Raises:
            runners.engine.memory.InsufficientMemoryError: weights + caches do not fit; raised before any
                allocation.
            ValueError: bad options; a config with tied embeddings.
        """
        from runners.engine.dummy import materialize_dummy, plan_dummy

        options = (options or EngineOptions()).validate()
        device = torch.device(device)
        t0, host_reset = _start_load_clock(device)
        plan = plan_dummy(config, dtype=options.torch_dtype, with_mtp=options.draft_len > 0)
        return cls._from_plan(plan, lambda p, d: materialize_dummy(p, d, log=log), options, device, None,
                              prefix_store, t0, host_reset, shardable=False)

    @classmethod
    def _from_plan(cls, plan, build, options: EngineOptions, device: torch.device, tensor_parallel,
                   prefix_store: PrefixCache | None, t0: float, host_reset: bool, *,
                   shardable: bool = True) -> Engine:
        """The fit check on a planned (meta-device) model, then ``build(plan, device)`` and the engine around
        it with its load report (:meth:`from_pretrained`, :meth:`from_dummy`). ``shardable``: whether a
        refusal may suggest more GPUs (False for dummy weights, built on one device)."""
        # the caches this engine will allocate, sized before anything is: weights + caches must fit
        state_dtype = _state_dtype(options, plan.config)
        kinds = plan.model.cache_kinds(include_mtp=options.draft_len > 0)

        def cache_bytes_at(batch: int) -> int:
            sized = dataclasses.replace(options, max_batch_size=batch)
            return sum(planned_cache_memory(plan.config, kinds, sized, state_dtype).values())

        cache_bytes = cache_bytes_at(options.max_batch_size)
        prefix_on = prefix_store is None and prefix_cache_off_reason(
            options, ssm_state_dtype=dtype_name(state_dtype)) is None
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
        engine = cls(model, options, device=device, tensor_parallel=tensor_parallel,
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

    def _attach_kv_scales(self) -> None:
        """Give each FP8 KV cache layer its attention block's checkpoint scales (``k_proj.k_scale`` /
        ``v_proj.v_scale``, runners.engine.quant.kv_cache_scales); a block without them gets 1.0, with a
        warning (values beyond +-448 then saturate)."""
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

        Computed from the architecture by :func:`planned_cache_memory` (the plan ``from_pretrained`` checks
        before allocating); each state class declares its buffers once, for the plan and the allocation
        (runners.engine.cache), and tests check the plan against the tensors.
        """
        return planned_cache_memory(self.config, self._cache_kinds, self.options, self.ssm_state_dtype)

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
        """Greedy generation for every prompt, with continuous batching over ``max_batch_size`` slots
        (runners.engine.scheduler.Generation).

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
        prompts = _token_rows(prompts, "prompts")
        self._check_prompts(prompts, max_new_tokens)
        stop_ids = set(
            self.config.eos_token_id
            if stop_token_ids is None
            else _token_list(stop_token_ids, "stop_token_ids")
        )
        bar, report = self._progress(progress, len(prompts))
        self.model.take_nonfinite()  # flags of earlier forwards (e.g. Engine.logits) are not this call's
        run = Generation(self, prompts, max_new_tokens, stop_ids, stop_checker, on_finish, report)
        self._stats = run.stats  # _prefill adds the prefix-cache counters
        compiled_before, graphs_before = self.step.compile_seconds, self.step.compile_graphs
        try:
            run.run()
        finally:
            self._stats = None
        run.stats.compile_seconds = self.step.compile_seconds - compiled_before
        run.stats.compile_graphs = self.step.compile_graphs - graphs_before
        if bar is not None:
            bar.close()
        run.stats.generated_tokens = sum(map(len, run.out_tokens))
        return GenerationOutput(tokens=run.out_tokens, finish_reasons=run.reasons, stats=run.stats,
                                nonfinite=self.model.take_nonfinite())

    # ------------------------------------------------------------------ what the scheduler runs
    # (runners.engine.launch mirrors these calls on every tensor-parallel rank: LOCKSTEP_METHODS)

    @torch.inference_mode()
    def _prefill(self, prompts: list[list[int]], slots: list[int]) -> list[int]:
        """Prefill newly admitted ``prompts`` into their ``slots``; returns each first token
        (:meth:`runners.engine.prefill.Prefill.run`). Under inference mode whoever calls it (``generate`` or a
        tensor-parallel follower, runners.engine.launch.serve): with autograd on, each forward would keep its
        activations -- at real sizes every gathered expert matrix of a prefill -- for a backward that never
        comes."""
        return self.prefill.run(prompts, slots, record_prefix=self._slot_counters.record_prefix,
                                stats=self._stats)

    def _split_admission(self, prompts: list[list[int]]) -> tuple[list[int], list[int]]:
        """Which of the prompts about to be admitted together to prefill now and which to defer
        (:meth:`runners.engine.prefix_cache.PrefixCache.split_admission`; it records the deferred prompts, so
        tensor-parallel ranks run it in lockstep). Needs the prefix cache."""
        return self.prefix_cache.split_admission(prompts)

    @torch.inference_mode()
    def _launch(self, slots: list[int], kv_bound: int, requests: list[int] | None = None) -> LaunchedStep:
        """Queue one decode step over ``slots`` (:meth:`runners.engine.step.DecodeStep.launch`); under
        inference mode whoever calls it, as :meth:`_prefill`."""
        return self.step.launch(slots, kv_bound, requests)

    def _step_tokens(self, step: LaunchedStep) -> list[list[int]]:
        """Wait for a launched step and return each row's new tokens (:meth:`DecodeStep.read`)."""
        return self.step.read(step)

    def force_acceptance(self, acceptance_length: float | None) -> None:
        """Benchmark hook for random-weight checkpoints, whose drafts are never accepted: from now on each
        verify accepts a fixed schedule of drafts (``runners.engine.step.ForcedAcceptance``, mean
        ``acceptance_length`` - 1 per step, the same for every row) instead of comparing them with the
        target's greedy tokens, so the step costs what it costs at that acceptance length. The output then is
        the drafts, not greedy decoding. None restores the greedy comparison. Captured graphs are dropped.

        Raises:
            ValueError: without drafts, or an acceptance length outside [1, K + 1].
        """
        self.step.force_acceptance(acceptance_length)

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: Sequence[int] | None = None, max_kv_len: int | None = None) -> int:
        """Capture the step's CUDA graphs ahead of time (otherwise each is captured on first use): each of
        ``batch_sizes`` (default: every captured size) at every KV bucket up to the one of ``max_kv_len``
        (default max_seq_len). Uses PAD rows only: safe between generate calls. Returns the number of
        (batch size, KV bound) pairs captured now; 0 when graphs are off.

        Raises:
            ValueError: a batch size that is not one of the sizes the step captures.
        """
        return self.step.capture_graphs(batch_sizes, max_kv_len)

    @property
    def compile_seconds(self) -> float:
        """Wall seconds spent in torch.compile of the decode step so far (``compile=True``; 0 otherwise),
        ahead of time (:meth:`capture_graphs`) and inside generate calls together."""
        return self.step.compile_seconds

    @property
    def compile_graphs(self) -> int:
        """Graphs dynamo compiled for the decode step so far (``compile=True``; 0 otherwise), counted as
        :attr:`compile_seconds` is: the compiles a run paid (runners/engine/compile.py)."""
        return self.step.compile_graphs

    @property
    def graphs(self) -> StepGraphs:
        """The step's phases and captured graphs (``runners.engine.graphs.StepGraphs``)."""
        return self.step.graphs

    @property
    def phase_timer(self) -> PhaseTimer | None:
        """A ``runners.engine.graphs.PhaseTimer`` that times the step's phases (profiling; None: off)."""
        return self.step.phase_timer

    @phase_timer.setter
    def phase_timer(self, timer: PhaseTimer | None) -> None:
        self.step.phase_timer = timer

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


def _start_load_clock(device: torch.device) -> tuple[float, bool]:
    """Start a load's measurements: (perf_counter seconds, whether the host peak RSS could be reset); the
    device's peak-memory counter is reset on CUDA (LoadReport's device peak covers the load only)."""
    t0 = time.perf_counter()
    host_reset = host_peak_rss_reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return t0, host_reset
