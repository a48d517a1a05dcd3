"""The inference engine: batched greedy generation with continuous batching over per-slot caches.

The engine knows nothing about tokenization: prompts and outputs are token ids. :class:`Engine` is the
public API (``from_pretrained``, ``from_dummy``, ``logits``, ``generate``, ``cache_memory``); ``generate``
is a short loop over two parts, one module each:

- runners.engine.scheduler: the host side of a ``generate`` call (``Scheduler``): which requests are
  admitted into free cache slots, which slots step, when a step is read; token appends, stop checks,
  callbacks. It returns a ``Plan`` per iteration and never touches the device;
- runners.engine.runner: the device side (``ModelRunner``): model, caches, decode step, prefill, prefix
  cache, and the commands that run them (``prefill``, ``launch``, ``read``, ...); the tensor-parallel
  lockstep (runners.engine.launch) wraps exactly these commands.

Beside them: runners.engine.options (``EngineOptions``, passed and read where used) and runners.engine.build
(the fit check and load). With ``draft_len = K > 0`` each decode step is an MTP speculative step (K drafts,
one verify forward over K + 1 tokens, greedy acceptance, a rewind or, with ``ssm_replay``, TensorRT-LLM's
replay commit of the recurrent state: runners.engine.step); the output equals plain greedy decoding.
Contract: docs/architecture.md ("Engine API").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runners.engine.build import from_plan, start_load_clock
from runners.engine.graphs import PhaseTimer, StepGraphs
from runners.engine.loader import materialize, plan_load
from runners.engine.memory import LoadReport
from runners.engine.models.config import HybridConfig
from runners.engine.models.hybrid import HybridLM
from runners.engine.options import EngineOptions
from runners.engine.prefix_cache import PrefixCache
from runners.engine.runner import ModelRunner
from runners.engine.scheduler import Scheduler, check_input_ids, checked_requests, progress_reporter
from runners.engine.stats import GenerationStats


@dataclass
class GenerationOutput:
    """tokens: generated ids per prompt (prompt excluded, a stop token kept); finish_reasons: "stop_token" |
    "stop_checker" | "length"; stats: the run's counters; nonfinite: the model outputs (``HybridLM.
    health_names``) that held a NaN or an infinity in any forward of the call, first appearance first."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats
    nonfinite: list[str] = field(default_factory=list)


class Engine:
    """A loaded model's runner plus the generate loop. Build it with :meth:`from_pretrained` or
    :meth:`from_dummy`, or around a model with ``Engine(model, options, device=...)``.

    Args:
        model: a :class:`HybridLM` in ``options.dtype`` on ``device`` (eval mode); device: where it lives and
            the caches are allocated; options: the :class:`EngineOptions` (None: the defaults), validated,
            the device's defaults filled in (``EngineOptions.on_device``); tensor_parallel: this rank's
            ``runners.engine.tp.TensorParallel`` when the model is a shard, else None; prefix_store: a ready
            :class:`PrefixCache` (tests: a small ``block_tokens``; None: one of ``prefix_cache_bytes``).

    Attributes:
        options (every setting is read from here); runner (:class:`ModelRunner`, built as ``runner_class``);
        config, model, device, tensor_parallel; the runner's parts: cache, step, prefix_cache (None: off,
        prefix_cache_off_reason says why), ssm_backend, ssm_state_dtype; load_report
        (:class:`runners.engine.memory.LoadReport` of :meth:`from_pretrained`, None otherwise).

    Raises:
        ValueError: a bad option (:meth:`EngineOptions.validate`), draft_len without MTP weights.
    """

    runner_class = ModelRunner  # the tensor-parallel rank 0 runs a LockstepRunner (runners.engine.launch)

    def __init__(self, model: HybridLM, options: EngineOptions | None = None, *,
                 device: str | torch.device = "cpu", tensor_parallel=None,
                 prefix_store: PrefixCache | None = None):
        self.device = torch.device(device)
        self.options = (options or EngineOptions()).validate().on_device(self.device, model.config.chunk_size)
        self.model, self.config, self.tensor_parallel = model, model.config, tensor_parallel
        self.runner = runner = self.runner_class(model, self.options, device=self.device,
                                                 tensor_parallel=tensor_parallel, prefix_store=prefix_store)
        self.cache, self.step, self.prefix_cache = runner.cache, runner.step, runner.prefix_cache
        self.prefix_cache_off_reason = runner.prefix_cache_off_reason
        self.ssm_backend, self.ssm_state_dtype = runner.ssm_backend, runner.ssm_state_dtype
        self.load_report: LoadReport | None = None  # set by from_pretrained / from_dummy

    @classmethod
    def from_pretrained(cls, path: str | Path, options: EngineOptions | None = None, *,
                        device: str | torch.device = "cpu", tensor_parallel=None,
                        prefix_store: PrefixCache | None = None) -> Engine:
        """Load an HF checkpoint dir (config.json + safetensors) and allocate the caches; ``options``,
        ``device``, ``tensor_parallel`` and ``prefix_store`` as in :class:`Engine`. With ``tensor_parallel``
        this process loads, allocates and runs only its rank's shard, and ``engine.config`` is the rank's
        view of config.json (its process group must be initialised).

        The model is built on the meta device and its weights are loaded straight to ``device`` in their
        dtype (:func:`runners.engine.loader.plan_load` / :func:`runners.engine.loader.materialize`); FP8
        checkpoints load as FP8 (runners.engine.quant). Weights and caches must fit
        ``options.memory_budget_bytes`` (default: the device's free memory, a rank's share of it); the
        prefill chunk and the prefix cache are cut to what stays free (runners.engine.build.from_plan);
        ``engine.load_report`` records the load time and host / device peak memory.

        Raises: runners.engine.memory.InsufficientMemoryError (weights + caches do not fit; before any
        allocation); runners.engine.loader.CheckpointError (an unreadable / inconsistent checkpoint);
        ValueError (bad options: :meth:`EngineOptions.validate`, draft_len without MTP weights).
        """
        options = (options or EngineOptions()).validate()
        device = torch.device(device)
        t0, host_reset = start_load_clock(device)
        plan = plan_load(path, dtype=options.torch_dtype, load_mtp=True if options.draft_len > 0 else None)
        if tensor_parallel is not None:  # this rank's shard: the model of the rank's config view
            from runners.engine.tp import shard_plan

            plan = shard_plan(plan, tensor_parallel)
        return from_plan(cls, plan, materialize, options, device, tensor_parallel, prefix_store, t0,
                         host_reset)

    @classmethod
    def from_dummy(cls, config: HybridConfig, options: EngineOptions | None = None, *,
                   device: str | torch.device = "cpu", prefix_store: PrefixCache | None = None,
                   log=None) -> Engine:
        """An engine over random weights at ``config`` in its checkpoint format (``config.quantization``;
        ``model.load_format=dummy``, runners.engine.dummy), built straight on ``device``: the same fit check,
        caches, load report and decode step as :meth:`from_pretrained`, no file read. ``log`` gets the
        build's progress lines. Raises runners.engine.memory.InsufficientMemoryError (weights + caches do
        not fit; before any allocation), ValueError (bad options; a config with tied embeddings)."""
        from runners.engine.dummy import materialize_dummy, plan_dummy

        options = (options or EngineOptions()).validate()
        device = torch.device(device)
        t0, host_reset = start_load_clock(device)
        plan = plan_dummy(config, dtype=options.torch_dtype, with_mtp=options.draft_len > 0)
        return from_plan(cls, plan, lambda p, d: materialize_dummy(p, d, log=log), options, device, None,
                         prefix_store, t0, host_reset, shardable=False)

    def cache_memory(self) -> dict[str, int]:
        """Bytes allocated for per-slot state, by kind (:meth:`ModelRunner.cache_memory`: ssm_state_bytes,
        conv_state_bytes, kv_cache_bytes, spec_buffers_bytes; scratch row included)."""
        return self.runner.cache_memory()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A full causal forward without cache: input_ids LongTensor [B, T] -> float32 logits [B, T, V].

        Raises (before any compute): TypeError / ValueError for anything but integer ids [B, T] in [0, V)
        (runners.engine.scheduler.check_input_ids).
        """
        check_input_ids(input_ids, self.config.vocab_size)
        return self.runner.logits(input_ids)

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
        """Greedy generation for every prompt, with continuous batching over ``max_batch_size`` slots: the
        scheduler plans each iteration (runners.engine.scheduler.Scheduler.schedule), the runner runs it.

        Args:
            prompts: token ids per request (non-empty; ids < vocab size).
            max_new_tokens: generated tokens per request at most (finish reason "length").
            stop_token_ids: ids that finish a request (kept in its output); None means the config's
                ``eos_token_id``; an empty list disables stop tokens.
            stop_checker: ``stop_checker(i, generated_ids) -> bool``, called after each step for requests that
                got a token; True finishes request i ("stop_checker").
            on_finish: ``on_finish(i, generated_ids, finish_reason, request_stats)``, once per request as it
                finishes; ``request_stats``: its counters (``SlotCounters.request_stats``; summed over all
                requests they equal the returned ``stats`` counters).
            progress: True shows a tqdm bar over finished requests; a callable gets (finished, total).

        Returns:
            :class:`GenerationOutput` (tokens, finish_reasons, stats, nonfinite), indexed like ``prompts``.

        Raises (before any compute, naming the argument and the index): TypeError / ValueError
            (runners.engine.scheduler.checked_requests): ids that are not integers, outside [0, vocab), an
            empty prompt, max_new_tokens < 1, a prompt that with max_new_tokens does not fit max_seq_len.
        """
        prompts, stop_ids = checked_requests(prompts, max_new_tokens, stop_token_ids, self.config,
                                             self.options)
        bar, report = progress_reporter(progress, len(prompts))
        self.model.take_nonfinite()  # flags of earlier forwards (e.g. Engine.logits) are not this call's
        runner, c0, g0 = self.runner, self.step.compile_seconds, self.step.compile_graphs
        sched = Scheduler(prompts, max_new_tokens, stop_ids, stop_checker, on_finish, report, self.options,
                          timer=self.step.phase_timer)
        while not sched.done:  # schedule -> run -> give the results back
            plan, t0 = sched.schedule(), time.perf_counter()
            if plan.admit:
                out = runner.prefill(plan.prompts, plan.slots)
                sched.stats.prefill_seconds += time.perf_counter() - t0
                sched.admitted(plan, out)
                continue
            if plan.launch:
                sched.launched(plan, runner.launch(plan.launch, plan.kv_bound))
            if plan.read:
                sched.read(runner.read(sched.oldest))
            sched.stats.decode_seconds += time.perf_counter() - t0
        stats, step = sched.stats, self.step
        stats.compile_seconds, stats.compile_graphs = step.compile_seconds - c0, step.compile_graphs - g0
        stats.generated_tokens = sum(map(len, sched.out_tokens))
        if bar is not None:
            bar.close()
        return GenerationOutput(tokens=sched.out_tokens, finish_reasons=sched.reasons, stats=stats,
                                nonfinite=self.model.take_nonfinite())

    def force_acceptance(self, acceptance_length: float | None) -> None:
        """Benchmark hook for random-weight checkpoints, whose drafts are never accepted: each verify then
        accepts a fixed schedule of drafts of mean ``acceptance_length`` - 1 (``runners.engine.step.
        ForcedAcceptance``; the output is the drafts, not greedy decoding); None restores the greedy
        comparison. Captured graphs are dropped. Raises ValueError without drafts, or outside [1, K + 1]."""
        self.runner.force_acceptance(acceptance_length)

    def capture_graphs(self, batch_sizes: Sequence[int] | None = None, max_kv_len: int | None = None) -> int:
        """Capture the step's CUDA graphs ahead of time (otherwise each is captured on first use): each of
        ``batch_sizes`` (default: every captured size) at every KV bucket up to the one of ``max_kv_len``
        (default max_seq_len). Uses PAD rows only: safe between generate calls. Returns the number of
        (batch size, KV bound) pairs captured now; 0 when graphs are off. Raises ValueError for a batch size
        that is not one of the sizes the step captures."""
        return self.runner.capture_graphs(batch_sizes, max_kv_len)

    @property
    def compile_seconds(self) -> float:
        """Wall seconds of torch.compile of the decode step so far (``DecodeStep.compile_seconds``)."""
        return self.step.compile_seconds

    @property
    def compile_graphs(self) -> int:
        """Graphs dynamo compiled for the decode step so far (``DecodeStep.compile_graphs``)."""
        return self.step.compile_graphs

    @property
    def graphs(self) -> StepGraphs:  # the step's phases and captured graphs
        return self.step.graphs

    @property
    def phase_timer(self) -> PhaseTimer | None:
        """A ``runners.engine.graphs.PhaseTimer`` that times the step's phases (profiling; None: off)."""
        return self.step.phase_timer

    @phase_timer.setter
    def phase_timer(self, timer: PhaseTimer | None) -> None:
        self.step.phase_timer = timer
