"""The model runner: everything of an engine that lives on the device, behind a few public commands.

:class:`ModelRunner` owns the model, its caches (``runners.engine.cache.HybridCache``), the decode step
(``runners.engine.step.DecodeStep``), the prefill (``runners.engine.prefill.Prefill``) and the prefix cache
(``runners.engine.prefix_cache.PrefixCache``). The host-side scheduler (runners.engine.scheduler) decides
what runs; the engine's loop (``runners.engine.engine.Engine.generate``) hands each decision to one of the
runner's commands (:data:`ModelRunner.COMMANDS`):

- :meth:`ModelRunner.prefill`: admit prompts into cache slots (the prefix cache's restores and its split of
  the admission, chunked prefill, MTP over the prompt); returns their first tokens
  (``runners.engine.prefill.Prefilled``);
- :meth:`ModelRunner.launch`: queue one decode step (plain decode, or draft / verify / commit / catch-up)
  over live slots without waiting for the device; the commit of the accepted drafts is a phase of the step,
  on the device (no host round trip);
- :meth:`ModelRunner.read`: wait for a launched step and return its new tokens;
- :meth:`ModelRunner.logits`, :meth:`ModelRunner.force_acceptance`, :meth:`ModelRunner.capture_graphs`.

A command's arguments and results are host values (token ids, slot ids, ints), so the tensor-parallel
launcher (runners.engine.launch) runs every command on every rank by sending its arguments: the lockstep
wraps exactly :data:`ModelRunner.COMMANDS`. The runner reads the engine's options where it uses them
(``self.options``, with the device's defaults filled in: ``EngineOptions.on_device``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kernels import replay_defaults
from kernels.mamba2.flashinfer_replay import (
    aot_module_dir,
    flashinfer_replay_unsupported,
    jit_cache_dir,
    probe_flashinfer_replay,
    weight_dtype,
)
from runners.engine.cache import SSM_BACKENDS, HybridCache, cache_memory_bytes
from runners.engine.graphs import PhaseTimer, StepGraphs
from runners.engine.models.config import HybridConfig
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.mamba2 import Mamba2Mixer
from runners.engine.onednn import use_onednn_linears
from runners.engine.options import DTYPES, EngineOptions, dtype_name
from runners.engine.prefill import Prefill, Prefilled
from runners.engine.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, prefix_cache_off_reason
from runners.engine.quant import kv_cache_scales
from runners.engine.state import replay_hist_len
from runners.engine.step import DecodeStep, LaunchedStep, SlotState

log = logging.getLogger(__name__)

# FlashInfer 0.7.2's selective_state_update compiles one module per (head_dim, d_state); at some sizes its
# build fails a static assertion in its vector-load helpers, and it dispatches heads per group over powers of
# two only. tests/gpu/flashinfer_sizes.py probed it on the H200 (docs/gpu/flashinfer_sizes.json): it builds
# and matches our reference at the sizes below, and fails to build at head_dim 16 and 32. Only sizes measured
# (or listed by its dispatcher) are sent to it; others run our Triton kernel, with a warning.
FLASHINFER_SIZES = {"mamba_head_dim": (64, 128), "ssm_state_size": (32, 64, 128, 256)}
FLASHINFER_HEADS_PER_GROUP = (1, 2, 4, 8, 16, 32, 64)


def resolve_ssm_backend(
    backend: str | None, device: torch.device, ssm_replay: bool, config: HybridConfig | None = None, *,
    spec_tokens: int = 0, replay_checkpointing: bool = False, dtype: torch.dtype | None = None,
    ssm_state_dtype: torch.dtype | None = None, stochastic_rounding: bool = False,
    param_dtype: torch.dtype | None = None,
) -> str:
    """The recurrent-kernel backend to run: the default per device, FlashInfer only where importable and
    where the model's Mamba2 sizes suit its kernel (else Triton, with a warning naming the reason). With
    ``ssm_replay`` FlashInfer runs the replay verify (``checkpointing_ssu``, ``spec_tokens`` = T wide, over a
    window of ``replay_hist_len(T, replay_checkpointing)`` tokens): where its version has none, or the window
    or the model's dt clamp is beyond it (``kernels.mamba2.flashinfer_replay.flashinfer_replay_unsupported``),
    or, given the model ``dtype`` and ``ssm_state_dtype``, one probe call at the model's sizes fails or
    disagrees with the contract's reference (``probe_flashinfer_replay``: its JIT build, once per process and
    configuration), Triton runs instead, with a warning.

    Default (``backend`` None) on CUDA with ``ssm_replay``: the measured faster replay kernel of the model's
    Mamba2 shape and state dtype (``kernels.replay_defaults.default_backend``: FlashInfer's where the
    committed sweep timed it faster), when FlashInfer can run it here (as above; and not with stochastic
    rounding: the table timed rounding to nearest); else Triton. The choice is logged. With
    ``stochastic_rounding`` FlashInfer's replay rounds a float16 state with its own Philox bits; another
    state dtype falls back to Triton, with the reason. ``param_dtype``: the dtype the run gives FlashInfer
    the model's D and dt_bias in (:func:`mamba2_param_dtype`), which the probe builds its module for; None:
    ``dtype``.

    Raises:
        ValueError: an unknown backend; flashinfer off CUDA; a Triton backend on the CPU without the
            interpreter.
    """
    if backend is None and device.type == "cuda" and ssm_replay and not stochastic_rounding:
        backend = _measured_default(config, spec_tokens, replay_checkpointing, dtype, ssm_state_dtype, device,
                                    param_dtype)
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
                why = _flashinfer_replay_unsupported(config, spec_tokens, replay_checkpointing, dtype,
                                                     ssm_state_dtype, stochastic_rounding)
                if not why and dtype is not None and ssm_state_dtype is not None:
                    why, seconds = _probe_flashinfer_replay(config, spec_tokens, replay_checkpointing, dtype,
                                                            ssm_state_dtype, device, stochastic_rounding,
                                                            param_dtype)
                    log.info("ssm_backend=flashinfer: checkpointing_ssu probed in %.1f s (its JIT build or "
                             "the load of a prebuilt module included)", seconds)
                if why:
                    log.warning("ssm_backend=flashinfer with ssm_replay: %s; using triton", why)
                    backend = "triton"
    if backend != "torch" and device.type != "cuda":
        from kernels._common import interpreter_active

        if not interpreter_active():
            raise ValueError(
                f"ssm_backend={backend!r} runs Triton kernels, but the device is {device.type} and Triton "
                "is not in interpreter mode; use ssm_backend='torch' on the CPU (or set TRITON_INTERPRET=1 "
                "before importing triton, for tests)"
            )
    return backend


def _flashinfer_replay_unsupported(config: HybridConfig | None, spec_tokens: int, checkpointing: bool,
                                   dtype: torch.dtype | None = None,
                                   ssm_state_dtype: torch.dtype | None = None,
                                   stochastic_rounding: bool = False) -> str | None:
    """Why FlashInfer cannot run this replay (its version, the window, the dt clamp, the activations'
    ``dtype``, stochastic rounding of a state other than float16), or None."""
    import flashinfer.mamba as fim

    if not hasattr(fim, "checkpointing_ssu"):
        return "this FlashInfer has no checkpointing_ssu (0.7.2 has)"
    limit = getattr(config, "time_step_limit", None)
    window = replay_hist_len(spec_tokens, checkpointing)
    return flashinfer_replay_unsupported(spec_tokens, window, limit, dtype,
                                         stochastic_rounding=stochastic_rounding, state_dtype=ssm_state_dtype)


def _measured_default(config: HybridConfig | None, spec_tokens: int, checkpointing: bool,
                      dtype: torch.dtype | None, ssm_state_dtype: torch.dtype | None, device: torch.device,
                      param_dtype: torch.dtype | None = None) -> str | None:
    """"flashinfer" where the defaults table names it the faster replay kernel of this model's Mamba2 shape
    and state dtype and it runs here (importable, supported, probed); else None (the device default)."""
    if not getattr(config, "mamba_num_heads", 0) or ssm_state_dtype is None or dtype is None:
        return None
    operation = "mamba2_checkpointing" if checkpointing else "mamba2_per_step"
    shape = replay_defaults.mamba2_shape_class(config.mamba_num_heads, config.mamba_head_dim,
                                               config.ssm_state_size)
    if replay_defaults.default_backend(operation, ssm_state_dtype, shape) != "flashinfer":
        return None
    try:
        import flashinfer.mamba  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not usable here: ours runs
        log.info("ssm_backend default: FlashInfer's replay is the measured faster kernel at %s, but "
                 "flashinfer.mamba is not importable (%r); using triton", shape, e)
        return None
    why = _flashinfer_replay_unsupported(config, spec_tokens, checkpointing, dtype)
    if not why:
        why, _ = _probe_flashinfer_replay(config, spec_tokens, checkpointing, dtype, ssm_state_dtype, device,
                                          param_dtype=param_dtype)
    if why:
        log.warning("ssm_backend default: FlashInfer's replay is the measured faster kernel at %s, but %s; "
                    "using triton", shape, why)
        return None
    log.info("ssm_backend default: flashinfer (its checkpointing_ssu is the measured faster replay kernel at "
             "%s, %s state: kernels/replay_defaults.json)", shape, ssm_state_dtype)
    return "flashinfer"


def _probe_flashinfer_replay(config: HybridConfig, spec_tokens: int, checkpointing: bool, dtype: torch.dtype,
                             ssm_state_dtype: torch.dtype, device: torch.device,
                             stochastic_rounding: bool = False, param_dtype: torch.dtype | None = None
                             ) -> tuple[str | None, float]:
    """``probe_flashinfer_replay`` at the model's Mamba2 sizes and its D / dt_bias dtype (``param_dtype``,
    :func:`mamba2_param_dtype`; None: ``dtype``): (why not, or None; seconds)."""
    window = replay_hist_len(spec_tokens, checkpointing)
    return probe_flashinfer_replay(config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                                   config.ssm_state_size, spec_tokens, window, dtype=dtype,
                                   state_dtype=ssm_state_dtype, device=device,
                                   stochastic_rounding=stochastic_rounding, param_dtype=param_dtype)


def mamba2_param_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype FlashInfer's replay is given the model's Mamba2 D and dt_bias in
    (``kernels.mamba2.flashinfer_replay.weight_dtype`` of the first layer that has both), or None without
    one."""
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            return weight_dtype(module.D.dtype, module.dt_bias.dtype)
    return None


def ssm_kernels(backend: str, ssm_replay: bool, config: HybridConfig) -> dict[str, str]:
    """{layer kind: "<implementation> <operator>"} of the recurrent layers' speculative verify, for
    results.json: "flashinfer checkpointing_ssu" / "flashinfer selective_state_update" for Mamba2 under
    FlashInfer, else "triton" / "torch" (the references) with "replay_verify" or "selective_state_update" /
    "recurrent rule" (the rewind verify)."""
    out = {}
    if config.mamba_num_heads:
        if backend == "flashinfer":
            out["mamba2"] = "flashinfer " + ("checkpointing_ssu" if ssm_replay else "selective_state_update")
        else:
            out["mamba2"] = f"{backend} " + ("replay_verify" if ssm_replay else "selective_state_update")
    if getattr(config, "gdn_num_value_heads", 0):
        impl = "torch" if backend == "torch" else "triton"
        out["gdn"] = f"{impl} " + ("replay_verify" if ssm_replay else "recurrent rule")
    return out


def planned_cache_memory(config: HybridConfig, cache_kinds: dict[int, str], options: EngineOptions,
                         ssm_state_dtype: torch.dtype, ssm_backend: str | None = None) -> dict[str, int]:
    """Bytes of the engine's per-slot state by kind (:meth:`Engine.cache_memory`), from the architecture
    alone: ``runners.engine.cache.cache_memory_bytes`` plus, with drafts, the decode step's per-slot first
    draft and MTP hidden (``runners.engine.step.SlotState``; the scratch row included, like every cache
    buffer). The replay history is planned in the layout of ``ssm_backend`` (the resolved one; None:
    ``options.ssm_backend``, which before the build may still fall back from FlashInfer's ring to Triton's
    window: a few MB either way)."""
    backend = ssm_backend or options.ssm_backend or "torch"
    mem = cache_memory_bytes(config, cache_kinds, ssm_backend=backend, **options.cache_args(ssm_state_dtype))
    mem["spec_buffers_bytes"] += SlotState.spec_bytes(options.max_batch_size, config.hidden_size,
                                                      options.torch_dtype, options.draft_len)
    return mem


def state_dtype(options: EngineOptions, config: HybridConfig) -> torch.dtype:
    """The SSM state dtype: the option, else the checkpoint's ``mamba_ssm_cache_dtype``."""
    return DTYPES[dtype_name(options.ssm_state_dtype or config.mamba_ssm_cache_dtype)]



class ModelRunner:
    """The device side of an engine (module docstring): the model, caches, decode step, prefill and prefix
    cache, and the commands that run them.

    Args:
        model: a :class:`HybridLM` in ``options.dtype`` on ``device`` (eval mode). On the CPU in float32 its
            eligible ``nn.Linear`` modules are swapped in place for oneDNN ones that compute the same bits
            (``options.onednn_linear``, runners.engine.onednn); its Mamba2 mixers take
            ``options.scan_chunk_size``.
        options: the engine's :class:`EngineOptions`, validated, the device's defaults filled in
            (``EngineOptions.on_device``).
        device: where the model lives and the caches are allocated.
        tensor_parallel: this rank's ``runners.engine.tp.TensorParallel`` when the model is a shard, else
            None.
        prefix_store: a ready :class:`PrefixCache` to use when the prefix cache is on; None builds one of
            ``options.prefix_cache_bytes``.

    Attributes:
        options, model, device, tensor_parallel: as given; cache: the :class:`HybridCache` (S =
        ``max_batch_size`` slots of ``max_seq_len`` positions); step: the :class:`DecodeStep`; prefiller: the
        :class:`Prefill`; ssm_backend: the recurrent operators that run ("triton" | "flashinfer" | "torch",
        after fallbacks); ssm_state_dtype: the SSM state's torch dtype; prefix_cache: the
        :class:`PrefixCache` (None: off; ``prefix_cache_off_reason`` then says why).

    Raises:
        ValueError: draft_len without MTP weights; ``prefix_cache_bytes`` with a ``prefix_store``; an
            unusable ``ssm_backend`` (:func:`resolve_ssm_backend`).
    """

    # the commands that run the model: every tensor-parallel rank runs each call (runners.engine.launch)
    COMMANDS = ("prefill", "launch", "read", "logits", "force_acceptance", "capture_graphs")

    def __init__(self, model: HybridLM, options: EngineOptions, *, device: torch.device, tensor_parallel=None,
                 prefix_store: PrefixCache | None = None):
        config = model.config
        if options.draft_len > 0 and model.mtp is None:
            raise ValueError(
                f"draft_len={options.draft_len} needs MTP weights, but the checkpoint ({config.source}) has "
                "no mtp.* tensors or its config.json declares no MTP layers; set draft_len=0 or "
                "use a checkpoint with an MTP module"
            )
        self.options, self.model, self.device, self.tensor_parallel = options, model, device, tensor_parallel
        for module in model.modules():
            if isinstance(module, Mamba2Mixer):
                module.chunk_size = options.scan_chunk_size
        if (options.onednn_linear and not options.compile and device.type == "cpu"
                and options.torch_dtype == torch.float32):  # (compiled blocks: inductor's own GEMMs)
            swapped = use_onednn_linears(model)  # bit for bit F.linear, about twice as fast
            log.debug("%d linear layers run through oneDNN", swapped)
        self.ssm_state_dtype = state_dtype(options, config)
        param_dtype = mamba2_param_dtype(model)
        self.ssm_backend = resolve_ssm_backend(options.ssm_backend, device, options.ssm_replay, config,
                                               spec_tokens=options.spec_tokens,
                                               replay_checkpointing=options.ssm_replay_checkpointing,
                                               dtype=options.torch_dtype,
                                               ssm_state_dtype=self.ssm_state_dtype,
                                               stochastic_rounding=options.ssm_stochastic_rounding,
                                               param_dtype=param_dtype)
        self.ssm_kernels = ssm_kernels(self.ssm_backend, options.ssm_replay, config)
        if self.ssm_backend == "flashinfer" and options.ssm_replay:  # its probe: the JIT build, and where
            _, seconds = _probe_flashinfer_replay(config, options.spec_tokens,
                                                  options.ssm_replay_checkpointing, options.torch_dtype,
                                                  self.ssm_state_dtype, device,
                                                  options.ssm_stochastic_rounding, param_dtype)
            self.ssm_kernels["flashinfer_probe_s"] = round(seconds, 2)
            self.ssm_kernels["flashinfer_jit_dir"] = jit_cache_dir()
            if aot_dir := aot_module_dir():  # modules built ahead, loaded before any JIT build
                self.ssm_kernels["flashinfer_aot_dir"] = aot_dir
        if config.mamba_num_heads and self.ssm_state_dtype.itemsize < 4:
            log.warning(
                "ssm_state_dtype=%s for Mamba2 layers: a 16-bit recurrent state drifts from the float32 "
                "reference on long outputs (logit drift grows ~40x over 2,000 teacher-forced tokens); "
                "results are judged only against baseline rows measured with this state dtype",
                dtype_name(self.ssm_state_dtype),
            )
        self.cache_kinds = model.cache_kinds(include_mtp=options.draft_len > 0)
        self.cache = HybridCache(
            config, self.cache_kinds, device=device, ssm_backend=self.ssm_backend,
            stochastic_rounding=options.ssm_stochastic_rounding, **options.cache_args(self.ssm_state_dtype)
        )
        if options.kv_cache_quant == "fp8":
            self._attach_kv_scales()
        self.step = DecodeStep(model, self.cache, options, device=device, ssm_backend=self.ssm_backend)
        if options.check_finite:  # per-layer "non-finite output" flags, read once per generate call
            model.track_nonfinite(device)
        self._setup_prefix_cache(prefix_store)
        self.prefiller = Prefill(model, self.cache, self.step, self.prefix_cache, options, device=device)

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
        mtp = self.model.mtp if self.options.draft_len > 0 else None
        mtp_blocks = mtp.blocks if mtp is not None else []
        self.prefix_cache.configure(b.cache_index for b in mtp_blocks if b.kind == "attention")

    # ------------------------------------------------------------------ the commands

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> Prefilled:
        """Admit ``prompts`` (token ids, checked) into free cache ``slots`` (one per prompt, in the order they
        are handed out): with the prefix cache, a prompt that shares an uncached prefix of a block or more
        with an earlier one of them waits for the next admission (``PrefixCache.split_admission``, which
        records it so the earlier one's prefill saves that junction); the taken prompts, in order, take the
        first slots and are prefilled (:meth:`runners.engine.prefill.Prefill.run`: the slots are reset, their
        state, lengths, first tokens and first drafts written). Returns :class:`Prefilled` (host values).

        Under inference mode whoever calls it (``generate`` or a tensor-parallel follower,
        runners.engine.launch.serve): with autograd on, each forward would keep its activations -- at real
        sizes every gathered expert matrix of a prefill -- for a backward that never comes."""
        take = list(range(len(prompts)))
        if self.prefix_cache is not None:  # prompts sharing an uncached prefix: one prefills it first
            take, _ = self.prefix_cache.split_admission(prompts)
        out = self.prefiller.run([prompts[j] for j in take], slots[: len(take)])
        out.taken = take
        return out

    @torch.inference_mode()
    def launch(self, slots: list[int], kv_bound: int) -> LaunchedStep:
        """Queue one decode step over ``slots`` (live slot ids, sorted; ``kv_bound`` an upper bound of every
        row's cached length after the step) without waiting for the device
        (:meth:`runners.engine.step.DecodeStep.launch`); read it with :meth:`read`, in launch order. Under
        inference mode whoever calls it, as :meth:`prefill`."""
        return self.step.launch(slots, kv_bound)

    def read(self, step: LaunchedStep) -> list[list[int]]:
        """Wait for a launched step and return each row's new tokens, in the order of ``step.slots``: the
        accepted drafts then the bonus token (1 .. K + 1 ids), or the one greedy token without drafts
        (:meth:`runners.engine.step.DecodeStep.read`)."""
        return self.step.read(step)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A full causal forward without cache: input_ids LongTensor [B, T] (checked by the caller) ->
        float32 logits [B, T, V]."""
        return self.model.lm_logits(self.model(input_ids.to(self.device)))

    def force_acceptance(self, acceptance_length: float | None) -> None:
        """``runners.engine.step.DecodeStep.force_acceptance`` (``Engine.force_acceptance``)."""
        self.step.force_acceptance(acceptance_length)

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: Sequence[int] | None = None, max_kv_len: int | None = None) -> int:
        """``runners.engine.step.DecodeStep.capture_graphs`` (``Engine.capture_graphs``)."""
        return self.step.capture_graphs(batch_sizes, max_kv_len)

    # ------------------------------------------------------------------ what the runner holds

    @property
    def graphs(self) -> StepGraphs:
        """The step's phases and captured graphs (``runners.engine.graphs.StepGraphs``)."""
        return self.step.graphs

    @property
    def phase_timer(self) -> PhaseTimer | None:
        """The step's ``runners.engine.graphs.PhaseTimer`` (profiling; None: off)."""
        return self.step.phase_timer

    def _attach_kv_scales(self) -> None:
        """Give each FP8 KV cache layer its attention block's checkpoint scales (``k_proj.k_scale`` /
        ``v_proj.v_scale``, runners.engine.quant.kv_cache_scales); a block without them gets 1.0, with a
        warning (values beyond +-448 then saturate)."""
        scales = kv_cache_scales(self.model)
        missing = []
        for idx, layer in self.cache.layers.items():
            if self.cache_kinds[idx] != "attention":
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
                self.model.config.source, missing)

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
        return planned_cache_memory(self.model.config, self.cache_kinds, self.options, self.ssm_state_dtype,
                                    self.ssm_backend)

