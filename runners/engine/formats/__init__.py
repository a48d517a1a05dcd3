"""The weight formats the engine runs, one module each named after the format (bf16.py, fp8.py, block_fp8.py,
nvfp4.py), and the registry of their format objects keyed by name (``registry.hf_config.FORMATS``: the names
checkpoints' quantization configs resolve to, ``QuantConfig.module_format``). Generic code asks
:func:`get_format` instead of naming a format: the swap of quantized modules (runners.engine.quant), dummy
weights and the checkpoint tools (quantize a weight, its stored bytes), the quantization report, the hardware
check (runners.app.support).

Torch-free at import, so the application checks a run against the formats before torch loads
(runners.app.preflight); a format's torch modules and GEMMs live in runners/engine/models/<name>.py and are
imported by its methods when first used. The kernels are kernels/quant/<name>.py's.
"""

from __future__ import annotations

import importlib
from typing import Any

from registry.checkpoint import CheckpointError
from registry.hf_config import FORMATS, QuantConfig


class WeightFormat:
    """One weight format (a module of this package holds its one instance, ``FORMAT``).

    Attributes:
        name: the format's name (``registry.hf_config.FORMATS``; ``--format`` of the tools).
        method: the registry's ``quant`` value of a checkpoint in this format (None: unquantized).
        label: the format in words (errors, logs).
        min_capability: the CUDA compute capability its GEMMs need, or None (every device runs them).
        tensor_suffixes: the checkpoint tensors a quantized module stores beside ``.weight``
            (``.weight_scale``, ...), for the loader's explanation of unexpected tensors.
        moe_gemv: whether its routed experts take per-pair GEMVs at decode sizes (its kernel file's
            ``moe_gemv_<format>``, kernels/quant/moe_gemv.py's scheme).
        moe_gemv_max_pairs: the (token, expert) pairs up to which they do (None: the unquantized experts'
            bound, runners.engine.models.moe.MOE_GEMV_MAX_PAIRS).
        moe_gemv_max_pairs_by_kernel: a bound of its own for a per-pair kernel named here ("cuda": the CUDA
            kernel of kernels/quant/pair_gemv.cu; None: the unquantized experts' bound), measured against the
            grouped path with that kernel; a kernel not named takes ``moe_gemv_max_pairs``
            (:meth:`moe_gemv_bound`).
        report_always: the quantization report (runners.engine.quant.prepare_fp8) keeps its keys when no
            module is in this format.
        decode_scheme: for a format whose kernels take either, what the activations are in a product of at
            most ``decode_rows`` rows per weight matrix (:meth:`scheme`): "w8a8" quantized (the format's own
            rule) or "w8a16" kept in 16 bits against the weight converted in registers
            (kernels.quant.block_fp8.SCHEMES: one launch, no quantization). Larger products stay "w8a8".
            Set from measurements (benchmarks/bench_quant_gemm.py, bench_moe_gemv.py, bench_e2e.py
            ``--fp8-decode-scheme``, which sets it on the format object for a whole run).
        dense_decode_rows: a wider bound for dense products whose caller says a kernel that stays flat in
            the rows serves them (``scheme(..., dense=True)``); None: ``decode_rows`` for every product.
    """

    name: str = ""
    method: str | None = None
    label: str = ""
    min_capability: tuple[int, int] | None = None
    tensor_suffixes: tuple[str, ...] = ()
    moe_gemv: bool = False
    moe_gemv_max_pairs: int | None = None
    moe_gemv_max_pairs_by_kernel: dict[str, int | None] = {}  # read only
    report_always: bool = False
    decode_scheme: str = "w8a8"
    decode_rows: int = 8
    dense_decode_rows: int | None = None

    def check(self, quant: QuantConfig) -> None:
        """Raise CheckpointError unless the engine runs ``quant``'s modules of this format (its parameters:
        activation scheme, block size). Default: every checkpoint of the format runs."""

    def runs_on(self, capability: tuple[int, int] | None) -> bool:
        """Whether its GEMMs run on a CUDA device of compute ``capability`` (None: the CPU, which runs every
        format's PyTorch references)."""
        return capability is None or self.min_capability is None or capability >= self.min_capability

    def linear(self, in_features: int, out_features: int, bias: bool, *, device: Any, bias_dtype: Any) -> Any:
        """The module that holds a linear layer [out_features, in_features] of this format (values unset:
        the checkpoint fills them)."""
        raise NotImplementedError(f"{self.name}: no quantized linear module")

    def to_moe(self, moe: Any) -> None:
        """Turn MoE block ``moe`` (usually on the meta device) into this format's MoE class in place: expert
        parameters and scale buffers of the format's shapes and dtypes."""
        raise NotImplementedError(f"{self.name}: no quantized MoE module")

    def quantize_weight(self, module: str, w: Any, input_amax: Any) -> dict[str, Any]:
        """The checkpoint tensors ``{name: tensor}`` of module ``module`` whose weight ``w`` [N, K] is stored
        in this format, on ``w``'s device; ``input_amax`` a float32 0-dim tensor on that device (the static
        activation bound). Mutates nothing."""
        raise ValueError(f"quantize_weight: unknown format {self.name!r}")

    def stored_nbytes(self, n: int, k: int) -> int:
        """Bytes :meth:`quantize_weight` writes for a weight [n, k] (weight, scales, input scale)."""
        raise NotImplementedError

    def use_moe_gemv(self, h: Any, indices: Any, pair_kernel: str | None = None) -> bool:
        """Whether routed experts of this format take the per-pair GEMVs for tokens ``h`` [N, L] routed by
        ``indices`` [N, k]: at most :meth:`moe_gemv_bound` pairs for ``pair_kernel`` (the per-pair kernel
        that would run them; None: the one the format's setting names, the best case: a call the CUDA kernel
        does not take runs on Triton's, whose bound may be lower, so a caller that knows the kernel passes it)
        and runners.engine.models.moe.use_moe_gemv's rule (CUDA, int64 indices, a 16-bit or float32 h).
        Shapes and dtypes only."""
        from runners.engine.models.moe import use_moe_gemv

        return (self.moe_gemv and indices.numel() <= self.moe_gemv_bound(pair_kernel)
                and use_moe_gemv(h, indices))

    def scheme(self, rows_per_matrix: float, *, dense: bool = False) -> str:
        """The activation scheme of a product with about ``rows_per_matrix`` rows per weight matrix:
        :attr:`decode_scheme` up to :attr:`decode_rows` (with ``dense``, a dense product its caller runs on
        a kernel flat in the rows: up to :attr:`dense_decode_rows` where set), "w8a8" above."""
        limit = self.dense_decode_rows if dense and self.dense_decode_rows is not None else self.decode_rows
        return self.decode_scheme if rows_per_matrix <= limit else "w8a8"

    def pair_kernel(self) -> str:
        """The per-pair kernel this format's setting names for its routed experts ("triton" unless the
        format's kernel file says otherwise, e.g. kernels.quant.nvfp4.PAIR_KERNEL); the kernel that runs a
        given call may still fall back to Triton (kernels.quant.pair_cuda.kernel_for)."""
        return "triton"

    def moe_gemv_bound(self, pair_kernel: str | None = None) -> int:
        """The pair bound of the per-pair path when ``pair_kernel`` runs it (None: :meth:`pair_kernel`):
        its entry in :attr:`moe_gemv_max_pairs_by_kernel`, else :attr:`moe_gemv_max_pairs`, None (in either)
        resolved to the unquantized experts' bound."""
        kernel = self.pair_kernel() if pair_kernel is None else pair_kernel
        bound = self.moe_gemv_max_pairs_by_kernel.get(kernel, self.moe_gemv_max_pairs)
        if bound is not None:
            return bound
        from runners.engine.models.moe import MOE_GEMV_MAX_PAIRS

        return MOE_GEMV_MAX_PAIRS

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"


_LOADED: dict[str, WeightFormat] = {}


def get_format(name: str) -> WeightFormat:
    """The format object of ``name`` (its module ``runners.engine.formats.<name>``, imported on first use).

    Raises:
        KeyError: ``name`` is not one of ``registry.hf_config.FORMATS``."""
    if name not in FORMATS:
        raise KeyError(f"unknown weight format {name!r} (formats: {', '.join(FORMATS)})")
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(f"{__name__}.{name}").FORMAT
    return _LOADED[name]


def all_formats() -> tuple[WeightFormat, ...]:
    """Every format, in ``registry.hf_config.FORMATS`` order (the quantization report's key order)."""
    return tuple(get_format(n) for n in FORMATS)


def checkpoint_formats(quant: QuantConfig) -> tuple[str, ...]:
    """The weight formats a checkpoint's config declares, sorted, without building a model: a
    MIXED_PRECISION config's per-module formats, else its one format (``QuantConfig.default_format``)."""
    if quant.algo == "MIXED_PRECISION":
        return tuple(sorted({f for _, f in quant.quantized_layers}))
    return (quant.default_format,)


def check_runnable(quant: QuantConfig) -> None:
    """Raise CheckpointError unless the engine runs this quantization: a method one of its formats declares
    and, for each format the config uses, that format's :meth:`WeightFormat.check` (per-tensor FP8 with static
    activation scales, block FP8 with 128 x 128 blocks and dynamic activations, NVFP4 as W4A16, a ModelOpt
    MIXED_PRECISION mix of FP8 and NVFP4 modules)."""
    if quant.method not in {f.method for f in all_formats() if f.method is not None}:
        raise CheckpointError(f"{quant.source}: {quant.method} weights ({quant.format} {quant.algo}) are not "
                              "supported", "use the checkpoint's FP8, NVFP4 or BF16 release")
    for name in checkpoint_formats(quant):
        get_format(name).check(quant)
