"""The released checkpoint formats, written once for the tools that produce them (runners.tools.synth writes
random weights in a release's layout, runners.tools.quantize converts a BF16 checkpoint): which modules each
release quantizes and how, the quantization config files it ships, and the tensors one quantized weight
becomes.

Formats (``--format``), from the releases' public config files and NVIDIA Model-Optimizer's HF export
(``unified_export_hf``, ``convert_hf_config.py``), as vLLM's modelopt.py / fp8.py and SGLang read them:

- ``bf16``: unquantized (the BF16 releases).
- ``fp8``: NVIDIA ModelOpt FP8 (Nemotron 3 Super FP8: nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8):
  per-tensor float8_e4m3fn ``weight``, float32 ``weight_scale`` and static ``input_scale``; FP8 KV cache with
  per-tensor ``k_proj.k_scale`` / ``v_proj.v_scale`` on the backbone's attention blocks; config.json
  ``quantization_config`` in ModelOpt's converted form (``quant_method: modelopt``, ``quant_algo: FP8``,
  ``ignore``, ``kv_cache_scheme``) and hf_quant_config.json in the nested form (``exclude_modules``,
  ``kv_cache_quant_algo``). Kept in BF16 (:data:`RELEASE_EXCLUDES`): attention projections, MoE latent
  projections, routers, convolutions, embeddings, LM head and the whole MTP module (``mtp*``; ModelOpt copies
  it unquantized, without scales).
- ``nvfp4``: NVIDIA ModelOpt MIXED_PRECISION (Nemotron 3 Super NVFP4): routed experts NVFP4 (uint8
  ``weight`` [N, K / 2], float8_e4m3fn ``weight_scale`` [N, K / 16], float32 ``weight_scale_2`` and
  ``input_scale``; group size 16), Mamba in / out projections, shared experts (and dense MLPs) FP8 as above,
  everything else BF16; ``quantized_layers`` lists every quantized module in hf_quant_config.json, config.json
  carries the same as ``config_groups`` targets (ModelOpt's converted form). NemotronH only.
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

import math
from typing import Any

import torch

from registry.hf_config import FORMAT_BLOCK_FP8, FORMAT_FP8, FORMAT_NVFP4, NVFP4_GROUP_SIZE, QuantConfig

FORMATS = ("bf16", "fp8", "nvfp4", "block_fp8")
FP8_MAX = 448.0
E2M1_MAX = 6.0
# |activation| bound assumed for static input scales when no calibration ran (synthetic weights)
ASSUMED_INPUT_AMAX = 64.0
PRODUCER = {"name": "hybrid-mtp-eval runners.tools", "version": "1"}

# Modules kept in the source dtype by the FP8 (ModelOpt) format, per family (checkpoint names, fnmatch).
# NemotronH: Nemotron 3 Super FP8's model card (MoE experts, shared experts and Mamba in / out projections
# in FP8; attention, latent projections, router, conv, embeddings, output layer in BF16; the MTP module
# copied unquantized). Qwen3-Next (no ModelOpt release): ModelOpt's defaults (routers, shared_expert_gate,
# convolutions, LM head), the MTP module, and linear_attn.in_proj_ba (the 2 HV-row gate projection,
# router-like and negligible in cost).
RELEASE_EXCLUDES: dict[str, tuple[str, ...]] = {
    "nemotron_h": (
        "lm_head",
        "backbone.embeddings",
        "*norm*",
        "*.mixer.gate",
        "*.mixer.conv1d",
        "*.mixer.q_proj",
        "*.mixer.k_proj",
        "*.mixer.v_proj",
        "*.mixer.o_proj",
        "*.mixer.fc1_latent_proj",
        "*.mixer.fc2_latent_proj",
        "mtp*",
    ),
    "qwen3_next": (
        "lm_head",
        "model.embed_tokens",
        "*norm*",
        "*.mlp.gate",
        "*.mlp.shared_expert_gate",
        "*.linear_attn.conv1d",
        "*.linear_attn.in_proj_ba",
        "mtp*",
    ),
}
# Nemotron 3 Super NVFP4 (MIXED_PRECISION): what is quantized in which format; the rest stays BF16.
NVFP4_LAYERS: dict[str, tuple[tuple[str, str], ...]] = {
    "nemotron_h": (
        ("backbone.layers.*.mixer.experts.*", FORMAT_NVFP4),
        ("backbone.layers.*.mixer.in_proj", FORMAT_FP8),
        ("backbone.layers.*.mixer.out_proj", FORMAT_FP8),
        ("backbone.layers.*.mixer.shared_experts.*", FORMAT_FP8),
        ("backbone.layers.*.mixer.up_proj", FORMAT_FP8),
        ("backbone.layers.*.mixer.down_proj", FORMAT_FP8),
    ),
}
# Qwen3-Next FP8 (block): modules_to_not_convert, as patterns over checkpoint names (the release lists each
# module by name; :func:`block_fp8_not_converted` expands them).
BLOCK_FP8_NOT_CONVERTED: dict[str, tuple[str, ...]] = {
    "qwen3_next": (
        "lm_head",
        "*layernorm",
        "*.mlp.gate",
        "*.mlp.shared_expert_gate",
        "*.linear_attn.A_log",
        "*.linear_attn.conv1d",
        "*.linear_attn.dt_bias",
        "*.linear_attn.in_proj_ba",
        "*.linear_attn.norm",
        "*.self_attn.q_norm",
        "*.self_attn.k_norm",
        "mtp.fc",
        "mtp.norm",
        "mtp.pre_fc_norm_embedding",
        "mtp.pre_fc_norm_hidden",
    ),
}


class FormatError(ValueError):
    """A format the family has no release rule for; the message names both and what exists."""


def release_rule(family: str, fmt: str, *, kv_cache: bool = True,
                 exclude: tuple[str, ...] = ()) -> QuantConfig:
    """The QuantConfig that says what release format ``fmt`` quantizes in a ``family`` model (patterns, for
    ``runners.engine.quant.quantization_targets``); ``exclude`` adds modules kept unquantized.

    Raises:
        FormatError: no release of that format for the family (nvfp4: nemotron_h; block_fp8: qwen3_next).
    """
    kv = "fp8" if kv_cache else None
    if fmt == "fp8":
        return QuantConfig(method="fp8", format="modelopt", algo="FP8", kv_cache_quant=kv,
                           exclude_modules=RELEASE_EXCLUDES[family] + exclude, source=f"{fmt} release rule")
    if fmt == "nvfp4" and family in NVFP4_LAYERS:
        return QuantConfig(method="nvfp4", format="modelopt", algo="MIXED_PRECISION", kv_cache_quant=kv,
                           exclude_modules=("lm_head", "mtp*") + exclude,
                           quantized_layers=NVFP4_LAYERS[family], group_size=NVFP4_GROUP_SIZE,
                           source=f"{fmt} release rule")
    if fmt == "block_fp8" and family in BLOCK_FP8_NOT_CONVERTED:
        return QuantConfig(method="fp8", format="fp8", algo="FP8_BLOCK", activation_scheme="dynamic",
                           weight_block_size=(128, 128),
                           exclude_modules=BLOCK_FP8_NOT_CONVERTED[family] + exclude,
                           source=f"{fmt} release rule")
    have = {"nvfp4": sorted(NVFP4_LAYERS), "block_fp8": sorted(BLOCK_FP8_NOT_CONVERTED)}.get(fmt)
    raise FormatError(f"--format {fmt}: no {fmt} release rule for family {family}"
                      + (f" (the {fmt} release is {', '.join(have)}'s)" if have else "")
                      + f"; formats: {', '.join(FORMATS)}")


def kv_scale_modules(rule: QuantConfig, attentions: list[str]) -> list[str]:
    """The attention blocks (checkpoint prefixes such as ``backbone.layers.5.mixer.``) a release gives k / v
    scales: with an FP8 KV cache, those its exclude list does not exclude as a block (ModelOpt exports an
    excluded MTP module without any scale; attention projections excluded one by one keep their KV scales)."""
    if rule.kv_cache_quant != "fp8":
        return []
    return [a for a in attentions if not rule.is_excluded(a.rstrip("."))]


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
    """The checkpoint tensors of module ``module`` whose weight ``w`` [N, K] (any float dtype, any device)
    is stored in ``fmt`` (returned on the CPU):

    - fp8: ``weight`` float8_e4m3fn = clamp(w / s), ``weight_scale`` s = amax(|w|) / 448, ``input_scale`` =
      input_amax / 448 (float32 0-dim);
    - nvfp4: ``weight`` uint8 [N, K / 2], ``weight_scale`` float8_e4m3fn [N, K / 16], ``weight_scale_2``
      (kernels.quant.nvfp4.nvfp4_quantize: ModelOpt's recipe), ``input_scale`` = input_amax / (448 * 6);
    - block_fp8: ``weight`` float8_e4m3fn, ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] in bfloat16 (as
      Qwen's release stores it; kernels.quant.block_fp8.block_fp8_quantize).

    ``input_amax`` None: :data:`ASSUMED_INPUT_AMAX`. Mutates nothing."""
    amax = torch.as_tensor(ASSUMED_INPUT_AMAX if input_amax is None else input_amax, dtype=torch.float32)
    amax = amax.cpu().clamp(min=1e-12)
    if fmt == FORMAT_FP8:
        from runners.engine.models.fp8 import quantize_fp8

        s = (w.detach().abs().amax().float() / FP8_MAX).clamp(min=1e-12)
        return {f"{module}.weight": quantize_fp8(w, s).cpu(), f"{module}.weight_scale": s.cpu(),
                f"{module}.input_scale": amax / FP8_MAX}
    if fmt == FORMAT_NVFP4:
        from kernels.quant.nvfp4 import nvfp4_quantize

        q, scale, scale_2 = nvfp4_quantize(w.detach())
        return {f"{module}.weight": q.cpu(), f"{module}.weight_scale": scale.cpu(),
                f"{module}.weight_scale_2": scale_2.float().reshape(()).cpu(),
                f"{module}.input_scale": amax / (FP8_MAX * E2M1_MAX)}
    if fmt == FORMAT_BLOCK_FP8:
        from kernels.quant.block_fp8 import block_fp8_quantize

        q, scale_inv = block_fp8_quantize(w.detach())
        return {f"{module}.weight": q.cpu(), f"{module}.weight_scale_inv": scale_inv.to(torch.bfloat16).cpu()}
    raise ValueError(f"quantize_weight: unknown format {fmt!r}")


def stored_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes :func:`quantize_weight` writes for a weight of ``shape`` [N, K] stored in ``fmt`` (weight, scales
    and input scale; ``bf16``: two bytes a value). Used to size a checkpoint before writing it.

    Raises:
        ValueError: an unknown format."""
    from kernels.quant.block_fp8 import BLOCK

    n, k = shape[0], math.prod(shape[1:])
    if fmt == "bf16":
        return 2 * n * k
    if fmt == FORMAT_FP8:
        return n * k + 2 * 4
    if fmt == FORMAT_NVFP4:  # two e2m1 values a byte, one e4m3 scale per 16 values, two float32 scales
        return n * k // 2 + n * math.ceil(k / NVFP4_GROUP_SIZE) + 2 * 4
    if fmt == FORMAT_BLOCK_FP8:  # bf16 scale_inv per 128 x 128 block
        return n * k + 2 * math.ceil(n / BLOCK) * math.ceil(k / BLOCK)
    raise ValueError(f"stored_nbytes: unknown format {fmt!r}")


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
