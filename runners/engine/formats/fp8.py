"""Per-tensor FP8 weights (NVIDIA ModelOpt ``quant_algo: FP8``, HF / vLLM ``quant_method: fp8`` with static
activation scales; Nemotron 3 Super FP8): ``weight`` float8_e4m3fn [N, K], float32 0-dim ``weight_scale``
(``W = weight * weight_scale``) and ``input_scale`` (``x_fp8 = clamp(x / input_scale, -448, 448)``); routed
experts per expert. Its modules and GEMMs: runners.engine.models.fp8 (``torch._scaled_mm`` on sm_89+, a
dequantizing reference elsewhere, so every device runs it)."""

from __future__ import annotations

from typing import Any

from registry.checkpoint import CheckpointError
from registry.hf_config import FORMAT_FP8, QuantConfig
from registry.schema import Quant
from runners.engine.formats import WeightFormat


class FP8Format(WeightFormat):
    name = FORMAT_FP8
    method = Quant.fp8.value
    label = "FP8"
    tensor_suffixes = (".weight_scale", ".input_scale")
    report_always = True  # the quantization report keeps fp8_linears / fp8_moe even when empty

    def check(self, quant: QuantConfig) -> None:
        """Refuses dynamic activation scales (the engine runs calibrated static ``input_scale``)."""
        if quant.activation_scheme != "static":
            raise CheckpointError(
                f"{quant.source}: activation_scheme {quant.activation_scheme} is not supported for "
                "per-tensor FP8: the engine runs static (calibrated input_scale) FP8 activations",
                "use a checkpoint with static activation scales (python -m runners.tools.quantize --format "
                "fp8 writes one)",
            )

    def linear(self, in_features: int, out_features: int, bias: bool, *, device: Any, bias_dtype: Any) -> Any:
        from runners.engine.models.fp8_modules import FP8Linear

        return FP8Linear(in_features, out_features, bias, device=device, bias_dtype=bias_dtype)

    def to_moe(self, moe: Any) -> None:
        from runners.engine.models.fp8_modules import to_fp8_moe

        to_fp8_moe(moe)

    def quantize_weight(self, module: str, w: Any, input_amax: Any) -> dict[str, Any]:
        """``weight`` = clamp(w / s) in float8_e4m3fn, ``weight_scale`` s = amax(|w|) / 448, ``input_scale`` =
        input_amax / 448 (float32 0-dim): ModelOpt's per-tensor recipe."""
        from kernels.quant.fp8 import FP8_MAX, quantize_fp8_ref

        s = (w.detach().abs().amax().float() / FP8_MAX).clamp(min=1e-12)
        return {f"{module}.weight": quantize_fp8_ref(w, s), f"{module}.weight_scale": s,
                f"{module}.input_scale": input_amax / FP8_MAX}

    def stored_nbytes(self, n: int, k: int) -> int:
        return n * k + 2 * 4


FORMAT = FP8Format()
