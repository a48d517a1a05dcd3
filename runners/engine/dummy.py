"""Random weights at a model's real configuration and in its checkpoint format, built straight on the device:
``model.load_format=dummy`` (vLLM's ``--load-format dummy``), and the one owner of the synthetic weights'
initialisation that runners.tools.synth writes to disk.

Initialisation (seeded per tensor from ``seed`` and the tensor's checkpoint name, so a dummy model equals the
loaded synthetic checkpoint of the same options): N(0, 1/fan_in) for projections and experts (fan_in =
product of all but the first dim), N(0, 1) embeddings, RMSNorm scales at their identity (1, or 0 for
Qwen3-Next's ``1 + w`` norms), Mamba2 / GDN ``A_log`` = log U(1, 16) and ``dt_bias`` = softplus^-1 of a
log-uniform dt in [1e-3, 1e-1] (the Mamba2 initialisation, Dao & Gu 2024, arXiv:2405.21060), ``D`` = 1,
biases and the router's correction bias 0. A layer kind whose parameters need another rule declares it on
its mixer class (``dummy_init``: {parameter name below the mixer: rule}; Mamba2 and GDN declare ``A_log``,
``dt_bias``, ``D`` and their output norm); :func:`init_rule` is the rule of every other tensor. With this
scaling activations stay finite over all 88 / 48 layers of the releases (tests/test_synth.py checks logits
at depth).

Quantized formats: each weight the format quantizes (``runners.engine.quant.quantization_targets`` of the
format's QuantConfig) is generated in the model dtype, then quantized on the device (:func:`quantize_weight`:
the format's recipe, runners/engine/formats/<format>.py) and copied into the
model's packed / FP8 storage, one tensor at a time: the device never holds a BF16 copy of the model, only one
weight matrix at a time beside the final storage.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from registry.hf_config import FORMATS, HybridConfig, QuantConfig
from registry.releases import DUMMY_SEED
from runners.engine.formats import get_format
from runners.engine.models.config import family_module
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.moe import EXPERT_KINDS

# |activation| bound assumed for static input scales when no calibration ran (random weights)
ASSUMED_INPUT_AMAX = 64.0

# on-disk float32 tensors: transformers keeps NemotronH's router in float32 (_keep_in_fp32_modules_strict);
# Qwen3-Next releases store everything in the checkpoint dtype
FP32_ON_DISK = {"nemotron_h": ("gate.weight", "gate.e_score_correction_bias"), "qwen3_next": ()}

@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: released name, shape, on-disk dtype and its initialisation rule."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str  # "normal" (std 1/sqrt(fan_in)) | "embedding" | "ones" | "zeros" | "A_log" | "dt_bias"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def init_rule(name: str, family: str, ndim: int) -> str:
    """The generic initialisation rule of checkpoint tensor ``name`` (``ndim`` dims) of ``family``, for the
    tensors whose kind declares none (``dummy_init`` on its mixer class, :func:`declared_init`)."""
    leaf = name.rsplit(".", 2)
    module = leaf[-2] if len(leaf) >= 2 else ""
    if name.endswith(("embeddings.weight", "embed_tokens.weight")):
        return "embedding"
    if "norm" in module and ndim == 1:
        # Qwen3-Next scales by (1 + w), NemotronH by w (a kind with a plain-w norm declares it)
        return "zeros" if family == "qwen3_next" else "ones"
    if ndim >= 2:
        return "normal"
    return "zeros"  # biases, the router's correction bias


def tensor_specs(config: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """Every tensor of a checkpoint of config.json dict ``config`` (MTP module included), in model order,
    with the names and shapes the engine's loader expects (the family's ``checkpoint_targets`` on a
    meta-device model), floating tensors in ``dtype`` except those the release keeps in float32."""
    hc = HybridConfig.from_dict(config, source="synth config")
    with torch.device("meta"):
        model = HybridLM(hc, with_mtp=hc.num_nextn_predict_layers > 0)
    return _specs_of(model, dtype)


def init_tensor(spec: TensorSpec, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor of ``spec`` on ``device`` in its dtype, from a generator seeded by (seed, name)."""
    device = torch.device(device)
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=spec.dtype, device=device)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    if spec.init in ("A_log", "dt_bias"):
        u = torch.rand(spec.shape, generator=g, device=device)
        if spec.init == "A_log":  # A = -exp(A_log) in [-16, -1]
            return torch.log(1 + 15 * u).to(spec.dtype)
        dt = torch.exp(math.log(1e-3) + u * (math.log(1e-1) - math.log(1e-3)))
        return (dt + torch.log(-torch.expm1(-dt))).to(spec.dtype)  # softplus(dt_bias) = dt
    std = 1.0 if spec.init == "embedding" else 1.0 / math.sqrt(math.prod(spec.shape[1:]))
    t = torch.randn(spec.shape, generator=g, device=device, dtype=torch.float32)
    return t.mul_(std).to(spec.dtype)


def quantize_weight(fmt: str, module: str, w: torch.Tensor, input_amax: torch.Tensor | float | None = None
                    ) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of module ``module`` whose weight ``w`` [N, K] (any float dtype) is stored in
    ``fmt``, on ``w``'s device: the format's ``quantize_weight`` (runners/engine/formats/<fmt>.py: the packed
    or FP8 ``weight`` and its scale tensors, in the release's dtypes). ``input_amax`` None:
    :data:`ASSUMED_INPUT_AMAX`. Mutates nothing.

    Raises:
        ValueError: an unknown format (or bf16, which stores weights as they are).
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantize_weight: unknown format {fmt!r}")
    amax = torch.as_tensor(ASSUMED_INPUT_AMAX if input_amax is None else input_amax, dtype=torch.float32)
    amax = amax.to(w.device).clamp(min=1e-12)
    return get_format(fmt).quantize_weight(module, w, amax)


def stored_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes :func:`quantize_weight` writes for a weight of ``shape`` [N, K] stored in ``fmt`` (weight, scales
    and input scale; ``bf16``: two bytes a value). Used to size a checkpoint before writing it.

    Raises:
        ValueError: an unknown format."""
    if fmt not in FORMATS:
        raise ValueError(f"stored_nbytes: unknown format {fmt!r}")
    return get_format(fmt).stored_nbytes(shape[0], math.prod(shape[1:]))


def quantized_weights(model: HybridLM, quant: QuantConfig) -> dict[str, tuple[str, str]]:
    """``{checkpoint weight name: (checkpoint module, format)}`` of every weight ``quant`` stores quantized in
    ``model`` (an unquantized model, any device; each routed expert projection by name), from the engine's
    own rule (``runners.engine.quant.quantization_targets``)."""
    from runners.engine.quant import quantization_targets

    targets = quantization_targets(model, quant)
    out: dict[str, tuple[str, str]] = {}
    for _, ckpt, _ in targets.linears:
        out[f"{ckpt}.weight"] = (ckpt, targets.formats[ckpt])
    for _, prefix, moe in targets.moes:
        for kind in EXPERT_KINDS:
            if getattr(moe, f"experts_{kind}") is None:
                continue
            for e in range(moe.experts_up.shape[0]):
                module = f"{prefix}experts.{e}.{kind}_proj"
                out[f"{module}.weight"] = (module, targets.formats[prefix])
    return out


def kv_scale_modules(rule: QuantConfig, attentions: list[str]) -> list[str]:
    """The attention blocks (checkpoint prefixes such as ``backbone.layers.5.mixer.``) a release gives k / v
    scales: with an FP8 KV cache, those its exclude list does not exclude as a block (ModelOpt exports an
    excluded MTP module without any scale; attention projections excluded one by one keep their KV scales)."""
    if rule.kv_cache_quant != "fp8":
        return []
    return [a for a in attentions if not rule.is_excluded(a.rstrip("."))]


@dataclass
class DummyPlan:
    """A dummy model on the meta device (no memory allocated yet): ``model`` in its load dtypes with the
    quantized modules of ``config.quantization`` swapped in, ``weight_bytes`` what :func:`materialize_dummy`
    allocates, ``rewrite`` the quantized weights (:func:`quantized_weights`), ``specs`` every checkpoint
    tensor in model order."""

    config: HybridConfig
    model: HybridLM
    dtype: torch.dtype
    weight_bytes: int
    specs: list[TensorSpec]
    rewrite: dict[str, tuple[str, str]]


def plan_dummy(config: HybridConfig, *, dtype: torch.dtype, with_mtp: bool) -> DummyPlan:
    """The :class:`DummyPlan` of ``config`` (its ``quantization`` says the format; None: unquantized), with
    the MTP module when ``with_mtp``. Allocates nothing: the fit check runs on ``weight_bytes``.

    Raises:
        registry.checkpoint.CheckpointError: a quantization the engine cannot run.
        ValueError: tied embeddings (the releases do not tie them; dummy weights do not re-tie).
    """
    from runners.engine.loader import build_meta_model, model_bytes
    from runners.engine.quant import apply_quantization

    if config.tie_word_embeddings:
        raise ValueError("load_format=dummy: tied embeddings are not supported (the releases do not tie "
                         "them)")
    with_mtp = with_mtp and bool(config.mtp_layer_types)
    plain = build_meta_model(config, dtype=dtype, with_mtp=with_mtp)
    rewrite = quantized_weights(plain, config.quantization) if config.quantization is not None else {}
    specs = _specs_of(plain, dtype)
    model = build_meta_model(config, dtype=dtype, with_mtp=with_mtp)
    if config.quantization is not None:  # k / v scales where the release has them (kv_scale_modules)
        from runners.engine.quant import quantization_targets

        attentions = [ckpt for _, ckpt, _ in quantization_targets(plain, config.quantization).attentions]
        kv = [f"{a}{t}_proj.{t}_scale" for a in kv_scale_modules(config.quantization, attentions)
              for t in ("k", "v")]
        apply_quantization(model, config.quantization, tensor_names=set(kv))
    return DummyPlan(config, model, dtype, model_bytes(model), specs, rewrite)


def declared_init(model: torch.nn.Module) -> dict[int, str]:
    """``{id(tensor): rule}`` of every parameter whose module declares its rule (``dummy_init``: {parameter
    name below the module: rule}, a layer kind's mixer class)."""
    out: dict[int, str] = {}
    for module in model.modules():
        for name, rule in getattr(module, "dummy_init", {}).items():
            out[id(module.get_parameter(name))] = rule
    return out


def _specs_of(model: HybridLM, dtype: torch.dtype) -> list[TensorSpec]:
    hc = model.config
    targets = family_module(hc.family).checkpoint_targets(model)
    fp32 = FP32_ON_DISK[hc.family]
    declared = declared_init(model)
    return [TensorSpec(name, tuple(t.shape), torch.float32 if fp32 and name.endswith(fp32) else dtype,
                       declared.get(id(t)) or init_rule(name, hc.family, t.dim()))
            for name, t in targets.items()]


def materialize_dummy(plan: DummyPlan, device: str | torch.device, *, seed: int = DUMMY_SEED,
                      log: Callable[[str], None] | None = None) -> HybridLM:
    """Allocate ``plan.model`` on ``device`` (uninitialised) and fill every tensor from :func:`init_tensor`
    generated on ``device``; each quantized weight is generated in ``plan.dtype`` and quantized there
    (:func:`quantize_weight`) before it is copied into its storage, so the peak above the model is one weight
    matrix (the largest: the embeddings or LM head). KV-cache scales are 1.0. Then the non-persistent buffers
    (``init_buffers``) and, for a quantized model, ``runners.engine.quant.prepare_fp8``. ``log`` gets a line
    per tenth of the tensors (progress of a full-depth build).

    Returns:
        The model in eval mode (``plan.model``, now on ``device``).

    Raises:
        RuntimeError: a model tensor the builder left unset (a bug of the name mapping).
    """
    from runners.engine.loader import _to_empty_keeping_ties
    from runners.engine.quant import prepare_fp8

    device = torch.device(device)
    model = _to_empty_keeping_ties(plan.model, device)
    targets = family_module(plan.config.family).checkpoint_targets(model)
    filled: set[str] = set()
    say = log or (lambda _m: None)
    t0, step = time.perf_counter(), max(1, len(plan.specs) // 10)
    with torch.no_grad():
        for i, spec in enumerate(plan.specs):
            t = init_tensor(spec, seed, device)
            if spec.name in plan.rewrite:
                module, fmt = plan.rewrite[spec.name]
                parts = quantize_weight(fmt, module, t)
            else:
                parts = {spec.name: t}
            for name, value in parts.items():
                target = targets[name]
                target.copy_(value.reshape(target.shape))
                filled.add(name)
            del t, parts
            if (i + 1) % step == 0 or i + 1 == len(plan.specs):  # the last line says all of them
                say(f"dummy weights: {i + 1}/{len(plan.specs)} tensors ({time.perf_counter() - t0:.1f} s)")
        for name, target in targets.items():
            if name not in filled and name.endswith((".k_scale", ".v_scale")):
                target.fill_(1.0)
                filled.add(name)
        computed = {id(m._buffers[n]) for m in model.modules() for n in m._non_persistent_buffers_set
                    if m._buffers[n] is not None}
        unset = [n for n, t in targets.items() if n not in filled and id(t) not in computed]
        if unset:
            raise RuntimeError(f"load_format=dummy left {len(unset)} tensors unset: {unset[:4]}")
        for module in model.modules():
            if module._non_persistent_buffers_set:
                module.init_buffers()
    if plan.config.quantization is not None:
        prepare_fp8(model, plan.dtype)
    return model.eval()
