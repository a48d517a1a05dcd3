"""The released checkpoint formats, written once for the tools that produce them (runners.tools.synth writes
random weights in a release's layout, runners.tools.quantize converts a BF16 checkpoint): which modules each
release quantizes and how, the quantization config files it ships, and the tensors one quantized weight
becomes.

The releases (``--format``: registry.releases.FORMATS), from their public config files and NVIDIA
Model-Optimizer's HF export (``unified_export_hf``, ``convert_hf_config.py``), as vLLM's modelopt.py / fp8.py
and SGLang read them; the tensors of one quantized weight are its format's (runners/engine/formats/):

- ``bf16``: unquantized (the BF16 releases).
- ``fp8``: NVIDIA ModelOpt FP8 (Nemotron 3 Super FP8: nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8):
  per-tensor float8_e4m3fn ``weight``, float32 ``weight_scale`` and static ``input_scale``; FP8 KV cache with
  per-tensor ``k_proj.k_scale`` / ``v_proj.v_scale`` on the backbone's attention blocks; config.json
  ``quantization_config`` in ModelOpt's converted form (``quant_method: modelopt``, ``quant_algo: FP8``,
  ``ignore``, ``kv_cache_scheme``) and hf_quant_config.json in the nested form (``exclude_modules``,
  ``kv_cache_quant_algo``). Kept in BF16 (:data:`RELEASE_EXCLUDES`): attention projections, MoE latent
  projections, routers, convolutions, embeddings, LM head and the whole MTP module (``mtp*``; ModelOpt copies
  it unquantized, without scales).
- Nemotron 3 Super NVFP4, NVIDIA ModelOpt MIXED_PRECISION: routed experts NVFP4 (group size 16), Mamba in /
  out projections, shared experts (and dense MLPs) FP8 as above, everything else BF16; ``quantized_layers``
  lists every quantized module in hf_quant_config.json, config.json carries the same as ``config_groups``
  targets (ModelOpt's converted form). NemotronH only.
- ``block_fp8``: Qwen's FP8 release (Qwen/Qwen3-Next-80B-A3B-Instruct-FP8; transformers' fine-grained FP8):
  float8_e4m3fn ``weight`` with ``weight_scale_inv`` per 128 x 128 block stored in bfloat16; config.json
  ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
  "modules_to_not_convert": [...]}`` naming every module left out (lm_head, norms, routers,
  shared_expert_gate, the GDN A_log / conv1d / dt_bias / in_proj_ba / norm, MTP's fc, norms and gates; MTP's
  projections are quantized); no hf_quant_config.json, no KV-cache scales. Qwen3-Next only.

Static scales where nothing is calibrated (runners.tools.synth's random weights): ``input_scale`` =
:data:`ASSUMED_INPUT_AMAX` / 448 (FP8) or / (448 * 6) (NVFP4's convention), KV scales 1.0.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.quant.fp8 import FP8_MAX  # noqa: F401  (re-exported)
from registry.hf_config import FORMAT_FP8, FORMAT_NVFP4, NVFP4_GROUP_SIZE, QuantConfig
from registry.releases import (  # noqa: F401  (the release rules, re-exported for the tools)
    BLOCK_FP8_NOT_CONVERTED,
    FORMATS,
    NVFP4_LAYERS,
    RELEASE_EXCLUDES,
    FormatError,
    release_rule,
)
from runners.engine.dummy import (  # noqa: F401  (re-exported)
    ASSUMED_INPUT_AMAX,
    kv_scale_modules,  # noqa: F401  (re-exported)
    stored_nbytes,
)
from runners.engine.dummy import quantize_weight as _quantize_on_device

PRODUCER = {"name": "hybrid-mtp-eval runners.tools", "version": "1"}

def block_fp8_not_converted(rule: QuantConfig, tensor_names: list[str]) -> list[str]:
    """``modules_to_not_convert`` as Qwen's release writes it: every module (or parameter, for GDN's
    ``A_log`` / ``dt_bias``) of the checkpoint that the rule's patterns name, in checkpoint order."""
    out: dict[str, None] = {}
    for name in tensor_names:
        module = name.removesuffix(".weight").removesuffix(".bias")
        if rule.is_excluded(module):
            out[module] = None
    return list(out)


def quantize_weight(fmt: str, module: str, w: torch.Tensor, input_amax: torch.Tensor | float | None = None
                    ) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of module ``module`` whose weight ``w`` [N, K] is stored in ``fmt``, returned on
    the CPU to be written (the rule: runners.engine.dummy.quantize_weight, which keeps them on ``w``'s
    device). Mutates nothing."""
    return {k: v.cpu() for k, v in _quantize_on_device(fmt, module, w, input_amax).items()}


def quant_config_files(rule: QuantConfig, *, modules: dict[str, str], not_converted: list[str] | None = None
                       ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json ``quantization_config``, hf_quant_config.json content or None) of a release format.

    Args:
        rule: :func:`release_rule`'s config. modules: {checkpoint module: format} of every quantized module
            (each routed expert projection by name), for MIXED_PRECISION's ``quantized_layers`` /
            ``config_groups``. not_converted: block FP8's ``modules_to_not_convert``
            (:func:`block_fp8_not_converted`).
    """
    if rule.weight_block_size is not None:
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "modules_to_not_convert": list(not_converted or []),
                "weight_block_size": list(rule.weight_block_size)}, None
    exclude = list(rule.exclude_modules)
    flat: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": rule.algo, "producer": PRODUCER,
                            "ignore": exclude}
    nested: dict[str, Any] = {"quant_algo": rule.algo, "exclude_modules": exclude}
    if rule.kv_cache_quant == "fp8":
        flat["kv_cache_scheme"] = {"type": "float", "num_bits": 8, "dynamic": False}
        nested["kv_cache_quant_algo"] = "FP8"
    if rule.algo == "MIXED_PRECISION":
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP_SIZE}
        groups, layers = {}, {}
        for i, (fmt, spec) in enumerate(((FORMAT_FP8, fp8), (FORMAT_NVFP4, fp4))):
            targets = sorted(m for m, f in modules.items() if f == fmt)
            if targets:
                groups[f"group_{i}"] = {"input_activations": spec, "weights": spec, "targets": targets}
        for m, f in modules.items():
            layers[m] = ({"quant_algo": "NVFP4", "group_size": NVFP4_GROUP_SIZE} if f == FORMAT_NVFP4
                         else {"quant_algo": "FP8"})
        flat["config_groups"] = groups
        nested["group_size"] = NVFP4_GROUP_SIZE
        nested["quantized_layers"] = layers
    return flat, {"producer": PRODUCER, "quantization": nested}
