"""The engine's options: one dataclass, its checks, and the one function that makes it from a resolved run.

:class:`EngineOptions` is the single list of what an :class:`runners.engine.engine.Engine` can be asked
(``Engine.from_pretrained(path, options)``, ``Engine(model, options)``): every field has its default, its
unit and its check (:meth:`EngineOptions.validate`) here. :func:`engine_options` maps a resolved registry
entry plus the run's config (``registry.resolve.ResolvedRun``) to it: the application (runners.app.main) and
the tensor-parallel launcher (runners.engine.launch) pass the object it returns; the lm-eval adapter and the
benchmarks build theirs from their own arguments. A new option touches this file and the code that uses it.

Where a placement, not a setting, is meant -- the device, a rank's ``TensorParallel`` shard, a ready-made
``PrefixCache`` -- it is an argument of the engine next to the options, not an option.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.quant.fp8 import FP8_DTYPE
from runners.engine.cache import SSM_BACKENDS

if TYPE_CHECKING:
    from registry.resolve import ResolvedRun

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"none": None, "fp8": FP8_DTYPE}  # kv_cache_quant -> KV storage dtype (None: the model's)


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """A dtype as its name ("float32", "bfloat16", "float16"); None stays None.

    Raises:
        ValueError: any other dtype.
    """
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return name


@dataclass
class EngineOptions:
    """Every setting of an engine, with its default. Dtypes are names ("float32", "bfloat16", "float16"; a
    ``torch.dtype`` is accepted and stored as its name).

    Attributes:
        dtype: compute dtype of the model, its conv states and KV cache (the MoE router stays float32).
        draft_len: K, MTP draft tokens per decode step (0 = plain greedy; > 0 needs the checkpoint's mtp.*).
        ssm_replay: commit the recurrent state by replay instead of rewind (needs draft_len > 0).
        ssm_replay_checkpointing: Mamba2's checkpointing replay variant: a history of max(16, K + 1) tokens,
            the state written only when it is full (needs ssm_replay).
        ssm_backend: who runs the recurrent decode / verify / commit operators: "triton" (kernels/),
            "flashinfer" (FlashInfer's kernels for the Mamba2 verify: selective_state_update for rewind,
            checkpointing_ssu for replay, over its ring history; Triton for the rest; falls back to "triton"
            with a log line where it cannot run) or "torch" (the PyTorch references); None (or "auto", the
            registry's word, turned into None): "torch" off CUDA, on CUDA the measured faster replay kernel
            (runners.engine.runner.resolve_ssm_backend), else "triton".
        ssm_state_dtype: dtype of the SSM state; None: the checkpoint's ``mamba_ssm_cache_dtype`` (float32).
        ssm_stochastic_rounding: round every write of a 16-bit SSM state stochastically (kernels/rounding.py)
            instead of to nearest; needs ssm_state_dtype bfloat16 / float16.
        max_batch_size: S, cache slots (requests decoded at once).
        max_seq_len: positions per slot (prompt + generated tokens + draft_len).
        prefill_chunk_tokens: padded tokens per prefill forward (rows x columns), >= 1.
        prefill_max_rows: prompts prefilled together in one forward at most (padded to the longest), >= 1;
            None: 1 on the CPU, where a prompt's forward is GEMM-bound already and rows together only add
            padding, and no limit elsewhere (``prefill_chunk_tokens`` decides).
        scan_chunk_size: tokens per chunk of the Mamba2 prefill scan; None: the config's ``chunk_size`` on
            CUDA, at most 32 elsewhere (~5x faster on CPUs; the same result up to float rounding).
        kv_cache_quant: "none", or "fp8": keys and values stored in float8_e4m3fn with the checkpoint's
            per-layer k / v scales (1.0, with a warning, where it has none).
        cuda_graphs: replay the decode step as CUDA graphs; None: on with CUDA (ignored with a warning on the
            CPU; off with ssm_backend "torch").
        cuda_graph_batch_sizes: the padded batch sizes captured (each in [1, max_batch_size]); None: 1, 2, 4,
            ... and max_batch_size; larger batches run eagerly.
        overlap_steps: queue the next decode step before this one's host bookkeeping; None: on with CUDA.
        compile: run the decode step's residual blocks (target and MTP) through torch.compile (inductor,
            static shapes; runners.engine.compile) at the graph batch sizes (``cuda_graph_batch_sizes``),
            compiled once per padded batch size and KV bucket before capture; larger batches run the eager
            model. Without graph batch sizes (the CPU, cuda_graphs off) nothing compiles: a warning, and the
            step runs eagerly. Off by default here; a run's ``runtime.compile=true`` turns it on (off in both
            configs/runtime files until measured on the H200). The recurrent kernels, routed experts
            and quantized GEMMs stay outside the compiled code.
        check_finite: flag NaN / infinite outputs of every layer in each forward
            (``GenerationOutput.nonfinite``).
        onednn_linear: on the CPU in float32 (and without ``compile``), run the linear layers through oneDNN
            where that gives bit for bit ``F.linear``'s result, about twice as fast (runners.engine.onednn;
            it checks the equality per weight shape); False: every linear layer runs ``F.linear``.
        prefix_cache: reuse cached prompt prefixes (runners.engine.prefix_cache); the engine still turns it
            off where it would not be exact (:func:`runners.engine.prefix_cache.prefix_cache_off_reason`).
        prefix_cache_bytes: the most the prefix cache's entries may take, bytes; None: 512 MiB, capped by
            ``from_pretrained`` at half the memory left after weights and caches when the budget is known;
            0 turns the cache off.
        memory_budget_bytes: bytes weights + caches may take (``from_pretrained`` checks it before
            allocating); None: the device's free memory (unchecked on the CPU).
    """

    dtype: str = "float32"
    draft_len: int = 0
    ssm_replay: bool = False
    ssm_replay_checkpointing: bool = False
    ssm_backend: str | None = None
    ssm_state_dtype: str | None = None
    ssm_stochastic_rounding: bool = False
    max_batch_size: int = 64
    max_seq_len: int = 4096
    prefill_chunk_tokens: int = 8192
    prefill_max_rows: int | None = None
    scan_chunk_size: int | None = None
    kv_cache_quant: str = "none"
    cuda_graphs: bool | None = None
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    overlap_steps: bool | None = None
    compile: bool = False
    check_finite: bool = True
    onednn_linear: bool = True
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self):
        self.dtype = dtype_name(self.dtype)
        self.ssm_state_dtype = dtype_name(self.ssm_state_dtype)
        if self.kv_cache_quant is None:
            self.kv_cache_quant = "none"
        if self.cuda_graph_batch_sizes is not None:
            self.cuda_graph_batch_sizes = tuple(int(b) for b in self.cuda_graph_batch_sizes)

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a torch.dtype."""
        return DTYPES[self.dtype]

    @property
    def spec_tokens(self) -> int:
        """T = K + 1 tokens of a verify step; 0 without drafts (no speculative buffers)."""
        return self.draft_len + 1 if self.draft_len > 0 else 0

    def cache_args(self, ssm_state_dtype: torch.dtype) -> dict:
        """The arguments of the engine's ``runners.engine.cache.HybridCache`` (and of ``cache_memory_bytes``,
        its plan) with the SSM state in ``ssm_state_dtype`` (the resolved one): speculative buffers
        (rewind: T = K + 1 states per slot; replay: the input history) only with drafts."""
        return dict(
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            dtype=self.torch_dtype,
            ssm_state_dtype=ssm_state_dtype,
            spec_tokens=self.spec_tokens,
            ssm_replay=self.ssm_replay,
            replay_checkpointing=self.ssm_replay_checkpointing,
            kv_cache_dtype=KV_CACHE_DTYPES[self.kv_cache_quant],
        )

    def on_device(self, device: torch.device, scan_chunk_size: int) -> EngineOptions:
        """A copy with the defaults that depend on the device filled in, validated: ``overlap_steps`` (on with
        CUDA, where the host and the device run apart), ``scan_chunk_size`` (``scan_chunk_size``, the
        config's chunk, on CUDA; at most 32 elsewhere: the intra-chunk term is quadratic, short chunks are
        faster on CPUs) and ``prefill_max_rows`` (1 on the CPU, where a prompt's forward is GEMM-bound already
        and rows together would only pad). The engine runs on what this returns (``engine.options``)."""
        cuda = device.type == "cuda"
        return self.replace(
            overlap_steps=cuda if self.overlap_steps is None else self.overlap_steps,
            scan_chunk_size=self.scan_chunk_size or (scan_chunk_size if cuda else min(scan_chunk_size, 32)),
            prefill_max_rows=self.prefill_max_rows or (1 if device.type == "cpu" else None),
        )

    def replace(self, **changes) -> EngineOptions:
        """A copy with ``changes`` applied (``dataclasses.replace``), validated."""
        return dataclasses.replace(self, **changes).validate()

    def validate(self) -> EngineOptions:
        """Check every value and the rules that tie them together; returns self.

        Raises:
            ValueError: naming the option, its value and the fix.
        """
        ints = {"draft_len": 0, "max_batch_size": 1, "max_seq_len": 1, "prefill_chunk_tokens": 1}
        for name, low in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        for name in ("scan_chunk_size", "prefill_max_rows", "prefix_cache_bytes", "memory_budget_bytes"):
            value, low = getattr(self, name), 1 if name in ("scan_chunk_size", "prefill_max_rows") else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name}={value!r} must be None or an integer >= {low}")
        if self.ssm_replay and self.draft_len == 0:
            raise ValueError(
                "ssm_replay requires speculative decoding (draft_len > 0): replay commits the recurrent "
                "state after a verify step; set draft_len to 1..7 (MTP) or ssm_replay=False"
            )
        if self.ssm_replay_checkpointing and not self.ssm_replay:
            raise ValueError("ssm_replay_checkpointing is a variant of ssm_replay; set ssm_replay=True or "
                             "drop it")
        for name in ("compile", "onednn_linear"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.ssm_backend == "auto":  # the registry's word for the default: None
            self.ssm_backend = None
        if self.ssm_backend is not None and self.ssm_backend not in SSM_BACKENDS:
            raise ValueError(f"ssm_backend={self.ssm_backend!r} is not one of {['auto', *SSM_BACKENDS]} "
                             "(auto: the device's default, on a GPU the measured faster replay kernel)")
        if self.kv_cache_quant not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_quant={self.kv_cache_quant!r} is not one of 'none', 'fp8'")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None and any(not 1 <= b <= self.max_batch_size for b in sizes):
            raise ValueError(
                f"cuda_graph_batch_sizes {list(sizes)} must lie in [1, max_batch_size={self.max_batch_size}]"
            )
        return self


def engine_options(rr: ResolvedRun) -> EngineOptions:
    """The options of the engine for a resolved run (``registry.resolve.resolve``): the entry's settings as
    the run's overrides left them, validated. ``prefix_cache`` is the run's wish; the engine decides whether
    it can honour it (:func:`runners.engine.prefix_cache.prefix_cache_off_reason`: tensor-parallel ranks,
    16-bit compute, ... turn it off and say why).

    Raises:
        ValueError: a value the engine refuses (the caller reports it as the user's: every value came from
            the config).
    """
    e, runtime = rr.entry, rr.run.runtime
    return EngineOptions(
        dtype=rr.dtype,
        draft_len=rr.draft_len,
        ssm_replay=rr.ssm_replay,
        ssm_replay_checkpointing=rr.ssm_replay_checkpointing,
        ssm_backend=rr.ssm_backend,  # "auto": the measured default (validate)
        ssm_state_dtype=e.ssm.state_dtype.value,
        ssm_stochastic_rounding=e.ssm.stochastic_rounding,
        max_batch_size=rr.max_batch_size,
        max_seq_len=e.max_seq_len,
        kv_cache_quant=e.kv_cache_quant.value,
        cuda_graphs=bool(rr.cuda_graph_batch_sizes),
        cuda_graph_batch_sizes=tuple(rr.cuda_graph_batch_sizes),
        prefix_cache=runtime.prefix_cache,
        prefix_cache_bytes=runtime.prefix_cache_bytes,
        compile=runtime.compile,
    ).validate()
