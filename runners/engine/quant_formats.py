"""Which checkpoint quantizations the engine runs, decided from the checkpoint's config alone: torch-free, so
the application refuses a checkpoint it cannot run before torch and the model code are imported
(runners.app.preflight). The modules that run each format are runners.engine.quant's.
"""

from __future__ import annotations

from registry.checkpoint import CheckpointError
from registry.hf_config import FORMAT_BLOCK_FP8, FORMAT_FP8, FORMAT_NVFP4, QuantConfig

BLOCK_FP8_BLOCK = (128, 128)  # the block the kernels run (the releases' weight_block_size)


def checkpoint_formats(quant: QuantConfig) -> tuple[str, ...]:
    """The weight formats (``registry.hf_config.FORMAT_*``) a checkpoint's config declares, sorted, without
    building a model: a MIXED_PRECISION config's per-module formats, else its one format."""
    if quant.algo == "MIXED_PRECISION":
        return tuple(sorted({f for _, f in quant.quantized_layers}))
    if quant.method == "nvfp4":
        return (FORMAT_NVFP4,)
    return (FORMAT_BLOCK_FP8,) if quant.weight_block_size is not None else (FORMAT_FP8,)


def check_runnable(quant: QuantConfig) -> None:
    """Raise CheckpointError unless the engine runs this quantization: per-tensor FP8 with static activation
    scales, block FP8 with 128 x 128 blocks and dynamic activations, NVFP4 (group size 16) as W4A16, or a
    ModelOpt MIXED_PRECISION mix of FP8 and NVFP4 modules."""
    src = quant.source
    if quant.method not in ("fp8", "nvfp4"):
        raise CheckpointError(f"{src}: {quant.method} weights ({quant.format} {quant.algo}) are not "
                              "supported", "use the checkpoint's FP8, NVFP4 or BF16 release")
    if quant.weight_block_size is not None:
        if tuple(quant.weight_block_size) != BLOCK_FP8_BLOCK:
            raise CheckpointError(
                f"{src}: block FP8 with weight_block_size {list(quant.weight_block_size)} is not supported: "
                f"the engine's block-FP8 GEMMs run {list(BLOCK_FP8_BLOCK)} blocks (Qwen's and DeepSeek's "
                "releases)",
                "use a checkpoint with 128 x 128 blocks, or write a per-tensor FP8 one with "
                "python -m runners.tools.quantize --format fp8 SRC DST",
            )
        if quant.activation_scheme != "dynamic":
            raise CheckpointError(
                f"{src}: block FP8 with activation_scheme {quant.activation_scheme} is not supported: block "
                "FP8 quantizes activations at run time (activation_scheme: dynamic)",
                "restore the checkpoint's quantization_config (activation_scheme: dynamic)",
            )
        return
    if quant.method == "fp8" and quant.activation_scheme != "static":
        raise CheckpointError(
            f"{src}: activation_scheme {quant.activation_scheme} is not supported for per-tensor FP8: the "
            "engine runs static (calibrated input_scale) FP8 activations",
            "use a checkpoint with static activation scales (python -m runners.tools.quantize --format fp8 "
            "writes one)",
        )
