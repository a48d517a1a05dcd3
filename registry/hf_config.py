"""A checkpoint's HF ``config.json`` read once: :class:`HybridConfig`, the architecture of one hybrid decoder.

A model is an embedding, a list of residual blocks (``x = x + mixer(norm(x))``) of kind ``mamba2``, ``gdn``
(Gated DeltaNet), ``attention``, ``mlp`` or ``moe``, a final norm and an LM head, plus an optional MTP
module. This module is the project's only parser of ``config.json``: the engine builds its model from the
HybridConfig (runners.engine.loader), and the registry derives an entry's ``arch:`` dimensions from the same
object
(registry.arch). It imports neither torch nor the engine, so registry validation runs without them.

One parser per HF ``model_type`` (:data:`PARSERS`), each reading both dialects of its family:

- ``nemotron_h`` (Nemotron 3 Super / Nano): released checkpoints spell the layout as
  ``hybrid_override_pattern`` ("M" mamba2, "*" attention, "E" moe, "-" mlp) plus legacy aliases such as
  ``mamba_n_groups``; transformers 5 ``save_pretrained`` writes ``layers_block_type`` lists of
  'mamba' / 'attention' / 'moe' / 'mlp' (both may be present; they must agree).
- ``qwen3_next`` (Qwen3-Next): released checkpoints have ``full_attention_interval`` and top-level
  ``rope_theta`` / ``partial_rotary_factor``; transformers 5 writes ``layer_types`` and
  ``rope_parameters``. Its config has no MTP field: released checkpoints carry one ``mtp.*`` module, so
  ``num_nextn_predict_layers`` defaults to 1 (as vLLM and SGLang assume).

Fields a config.json omits take transformers' defaults for that family. Non-finite floats that
transformers 5 writes as ``{"__float__": "Infinity"}`` are decoded. Stop ids come from
``generation_config.json`` where it sets ``eos_token_id`` (what transformers' ``generate`` stops on), else
from config.json.

A quantized checkpoint says so in config.json's ``quantization_config`` or, for NVIDIA ModelOpt exports, in
``hf_quant_config.json`` beside it; :func:`parse_quantization` reads either into :class:`QuantConfig`
(``HybridConfig.quantization``), the one description the registry checks entries against and the engine's
runners/engine/quant.py builds its FP8 modules from.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from registry.checkpoint import CONFIG_FILE, GENERATION_CONFIG_FILE, HF_QUANT_CONFIG_FILE, CheckpointError

BLOCK_KINDS = ("mamba2", "attention", "mlp", "moe", "gdn")
_RESTORE = "restore the checkpoint's config.json (or point model.checkpoint at a complete checkpoint)"


# Weight formats, as data (each is one module of runners/engine/formats/, which runs it): unquantized,
# per-tensor FP8 (ModelOpt / HF static fp8), block FP8 (transformers' fine-grained FP8, weight_scale_inv per
# block), NVFP4 (ModelOpt: packed e2m1, fp8 block scales). QuantConfig.module_format gives each module's.
FORMAT_BF16, FORMAT_FP8, FORMAT_BLOCK_FP8, FORMAT_NVFP4 = "bf16", "fp8", "block_fp8", "nvfp4"
FORMATS = (FORMAT_BF16, FORMAT_FP8, FORMAT_BLOCK_FP8, FORMAT_NVFP4)
NVFP4_GROUP_SIZE = 16  # elements per NVFP4 block scale (ModelOpt's group_size)


@dataclass(frozen=True)
class QuantConfig:
    """The weight quantization a checkpoint declares (None in HybridConfig when it declares none).

    Formats of one module's weight (:meth:`module_format`; the on-disk tensors beside ``<module>.weight``):

    - ``"fp8"`` per-tensor FP8: ``weight`` float8_e4m3fn, float32 ``weight_scale`` (``w = weight *
      weight_scale``) and ``input_scale`` (static activations, ``x_fp8 = clamp(x / input_scale, -448, 448)``);
      routed experts per expert.
    - ``"block_fp8"`` (transformers' fine-grained FP8, Qwen's and DeepSeek's FP8 releases): ``weight``
      float8_e4m3fn [N, K], ``weight_scale_inv`` [ceil(N / b0), ceil(K / b1)] (a multiplier despite the name;
      bfloat16 in Qwen3-Next's release, float32 in DeepSeek-V3's), activations quantized at run time per token
      and b1-column group.
    - ``"nvfp4"`` (NVIDIA ModelOpt NVFP4): ``weight`` uint8 [N, K / 2] (two e2m1 values per byte, element 2j
      in the low nibble), ``weight_scale`` float8_e4m3fn [N, K / 16], float32 ``weight_scale_2`` (global) and
      ``input_scale`` (the activation global scale, unused by the engine's weight-only W4A16 GEMMs).

    The files that declare them:

    - NVIDIA ModelOpt (``format="modelopt"``): ``hf_quant_config.json`` ``{"producer": ..., "quantization":
      {"quant_algo": "FP8" | "NVFP4" | "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "exclude_modules":
      [...], "quantized_layers": {module: {"quant_algo": "NVFP4", "group_size": 16} | {"quant_algo":
      "FP8"}}}}`` (the nested form), or config.json's ``quantization_config`` (ModelOpt's converted form,
      Model-Optimizer ``convert_hf_config.py``): ``{"quant_method": "modelopt", "quant_algo": ..., "ignore":
      [...], "kv_cache_scheme": {"type": "float", "num_bits": 8}, "config_groups": {"group_0":
      {"weights": {"num_bits": 8 | 4, "type": "float", "group_size": 16}, "targets": [modules]}},
      "quantized_layers": ...}`` (as vLLM's modelopt.py ``ModelOptFp8Config`` / ``ModelOptNvFp4Config`` /
      ``ModelOptMixedPrecisionConfig`` read them). ``MIXED_PRECISION`` quantizes exactly the modules
      ``quantized_layers`` (or the config groups' ``targets``) names; a module absent from it is
      unquantized. An FP8 KV cache adds per-tensor
      ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` where the export calibrated them (``k = k_fp8 *
      k_scale``; the engine uses 1.0 where a checkpoint has none, as vLLM does).
    - HF / vLLM ``fp8`` (``format="fp8"``): ``{"quant_method": "fp8", "activation_scheme": "static" |
      "dynamic", "ignored_layers" | "modules_to_not_convert": [...]}``; with ``weight_block_size`` it is
      block FP8 (``fmt: e4m3``, ``activation_scheme: dynamic``).

    Fields: ``method`` "fp8" | "nvfp4" (the registry's ``quant`` values: a MIXED_PRECISION checkpoint with
    NVFP4 modules is "nvfp4"); ``format``; ``algo`` the file's algorithm name ("FP8", "FP8_BLOCK", "NVFP4",
    "MIXED_PRECISION"); ``activation_scheme`` "static" | "dynamic"; ``weight_block_size`` None or (rows,
    cols);
    ``kv_cache_quant`` "fp8" | None; ``exclude_modules`` the modules kept unquantized, as written (checkpoint
    names, wildcards); ``quantized_layers`` ((module pattern, format), ...) of a MIXED_PRECISION checkpoint
    (empty otherwise); ``group_size`` NVFP4's elements per block scale; ``source`` the file it came from.
    """

    method: str
    format: str
    algo: str
    activation_scheme: str = "static"
    weight_block_size: tuple[int, int] | None = None
    kv_cache_quant: str | None = None
    exclude_modules: tuple[str, ...] = ()
    quantized_layers: tuple[tuple[str, str], ...] = ()
    group_size: int | None = None
    source: str = field(default="", compare=False)

    def is_excluded(self, module: str) -> bool:
        """Whether checkpoint module ``module`` (e.g. ``backbone.layers.1.mixer.q_proj``) stays unquantized by
        the exclude list: it equals an entry, lies below one (``lm_head`` excludes ``lm_head.*``), or matches
        one as an fnmatch wildcard (ModelOpt's ``exclude_modules`` are wildcards, e.g. ``*.mixer.q_proj``,
        ``mtp*``; vLLM's modelopt.py matches them the same way)."""
        return any(_module_matches(module, p) for p in self.exclude_modules)

    def module_format(self, module: str) -> str | None:
        """The weight format of checkpoint module ``module`` (:data:`FORMAT_FP8`, :data:`FORMAT_BLOCK_FP8`,
        :data:`FORMAT_NVFP4`) or None when it stays unquantized: excluded modules are unquantized; a
        MIXED_PRECISION checkpoint quantizes what ``quantized_layers`` names (a module equal to, below or
        matching an entry: ``...mixer.experts`` covers ``...mixer.experts.3.up_proj``) and nothing else;
        other checkpoints quantize every module the engine may quantize in their one format."""
        if self.is_excluded(module):
            return None
        if self.algo == "MIXED_PRECISION":
            exact, wildcards = self._layer_lookup
            parts = module.split(".")
            for i in range(len(parts), 0, -1):  # the module itself, then each module above it
                fmt = exact.get(".".join(parts[:i]))
                if fmt is not None:
                    return fmt
            return next((fmt for p, fmt in wildcards if fnmatch.fnmatchcase(module, p)), None)
        return self.default_format

    @property
    def default_format(self) -> str:
        """The one format of a checkpoint that is not MIXED_PRECISION (its ``method``; per-tensor FP8 made
        block FP8 by ``weight_block_size``)."""
        if self.method == FORMAT_NVFP4:
            return FORMAT_NVFP4
        return FORMAT_BLOCK_FP8 if self.weight_block_size is not None else FORMAT_FP8


    @cached_property
    def _layer_lookup(self) -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
        """quantized_layers split into exact names {module: format} and wildcard entries (a release lists
        every expert projection: tens of thousands of names, looked up per module)."""
        exact = {p: f for p, f in self.quantized_layers if not any(c in p for c in "*?[")}
        return exact, tuple((p, f) for p, f in self.quantized_layers if p not in exact)


def _module_matches(module: str, pattern: str) -> bool:
    """``module`` equals ``pattern``, lies below it (``pattern.``...) or matches it as an fnmatch wildcard."""
    return module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern)


@dataclass(frozen=True)
class HybridConfig:
    """Architecture of one hybrid decoder (all sizes in elements; eps are RMSNorm epsilons).

    ``layer_types`` lists the residual blocks of the backbone in order, each one of :data:`BLOCK_KINDS`;
    ``mtp_layer_types`` the blocks of the MTP module (empty when ``num_nextn_predict_layers == 0``).
    Fields of a block kind that the model does not use keep their defaults. ``eos_token_id``: the ids that
    end a generation (generation_config.json's where present, else config.json's).
    """

    family: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    norm_eps: float = 1e-5
    norm_weight_offset: float = 0.0  # RMSNorm scale is (offset + weight): 0 for NemotronH, 1 for Qwen3-Next
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 4096
    # attention
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    attn_output_gate: bool = False  # q_proj also gives a per-head gate: o_proj(attn * sigmoid(gate))
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE
    rope_theta: float | None = None  # None: no positional encoding (NemotronH); else NeoX-style RoPE
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * factor) dims of each head
    # mamba2 (H = mamba_num_heads, P = mamba_head_dim, N = ssm_state_size, G = n_groups, W = conv_kernel)
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_ssm_cache_dtype: str = "float32"
    # gdn (Gated DeltaNet; H = gdn_num_key_heads, HV = gdn_num_value_heads, K / V key / value head dims;
    # its conv width is conv_kernel)
    gdn_num_key_heads: int = 0
    gdn_num_value_heads: int = 0
    gdn_key_head_dim: int = 0
    gdn_value_head_dim: int = 0
    gdn_chunk_size: int = 64  # chunk of the prefill form of the gated delta rule
    # dense MLP
    intermediate_size: int = 0
    mlp_bias: bool = False
    mlp_hidden_act: str = "relu2"  # "relu2" | "silu", for dense MLPs, routed and shared experts
    mlp_gated: bool = False  # down(act(gate(x)) * up(x)) (SwiGLU) instead of down(act(up(x)))
    # MoE
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    moe_scoring_func: str = "sigmoid"  # "sigmoid" (+ selection-only correction bias) | "softmax"
    moe_shared_expert_gate: bool = False  # shared expert output scaled by sigmoid(shared_expert_gate(x))
    # MTP
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    # weight quantization declared by the checkpoint (parse_quantization); None: unquantized
    quantization: QuantConfig | None = None
    source: str = field(default="", compare=False)

    @property
    def mamba_d_inner(self) -> int:
        """d_inner = H * P (the mamba2 inner width)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x (d_inner) + B and C (G * N each)."""
        return self.mamba_d_inner + 2 * self.n_groups * self.ssm_state_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time_step_limit"] = [float(v) for v in self.time_step_limit]
        return d

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HybridConfig:
        """The HybridConfig of a checkpoint directory (or of a config.json path).

        Reads ``config.json`` and, beside it, ``generation_config.json`` when present (its ``eos_token_id``,
        an int or a list, becomes the stop ids) and ``hf_quant_config.json`` when present (ModelOpt's
        quantization config, :func:`parse_quantization`).

        Raises:
            CheckpointError: a missing or unreadable file, a file that is not a JSON object, an unknown
                ``model_type``, a layout / size problem (see :meth:`from_dict`), an unsupported or
                inconsistent quantization config.
        """
        path = Path(path)
        file = path / CONFIG_FILE if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(
                f"{file}: config.json not found",
                "point the engine at an HF checkpoint directory that contains config.json",
            )
        raw = _read_json(file)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file} is not a JSON object (got {type(raw).__name__})", _RESTORE)
        quant_file = file.parent / HF_QUANT_CONFIG_FILE
        hf_quant = _read_json(quant_file) if quant_file.is_file() else None
        if hf_quant is not None and not isinstance(hf_quant, dict):
            raise CheckpointError(f"{quant_file} is not a JSON object", "restore the checkpoint's file")
        config = cls.from_dict(raw, source=str(file), hf_quant_config=hf_quant,
                               hf_quant_source=str(quant_file))
        gen_file = file.parent / GENERATION_CONFIG_FILE
        if gen_file.is_file():
            gen = _read_json(gen_file)
            eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
            if eos is not None:
                config = replace(config, eos_token_id=_ids(eos, f"{gen_file}: eos_token_id"))
        return config

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        *,
        source: str = "<dict>",
        hf_quant_config: dict[str, Any] | None = None,
        hf_quant_source: str = HF_QUANT_CONFIG_FILE,
    ) -> HybridConfig:
        """Parse an HF config dict of a supported ``model_type`` (either dialect) into a HybridConfig.

        ``hf_quant_config``: the content of ModelOpt's hf_quant_config.json beside it, if any (named by
        ``hf_quant_source`` in messages); with ``raw["quantization_config"]`` it sets ``quantization``.

        Raises:
            CheckpointError: unknown ``model_type``, a missing or unknown layout, layouts that disagree,
                inconsistent sizes, a feature the engine does not implement (e.g. a scaled RoPE), an
                unsupported or inconsistent quantization config.
        """
        raw = decode_json_floats(raw)
        model_type = raw.get("model_type")
        if model_type not in PARSERS:
            raise CheckpointError(
                f"{source}: model_type {model_type!r} is not supported; supported: {sorted(PARSERS)}",
                "use a NemotronH or Qwen3-Next checkpoint, or add a parser to registry/hf_config.py and its "
                "model code to runners/engine/models/",
            )
        for key in ("vocab_size", "hidden_size"):
            if key not in raw:
                raise CheckpointError(f"{source}: {key} is missing",
                                      f"a {model_type} config.json must set it; {_RESTORE}")
        config = PARSERS[model_type](raw, source)
        quant = parse_quantization(raw.get("quantization_config"), hf_quant_config, source=source,
                                   hf_quant_source=hf_quant_source)
        if quant is not None:
            config = replace(config, quantization=quant)
        check_config(config)
        return config


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} cannot be read as JSON: {e}", _RESTORE) from None


def decode_json_floats(obj: Any) -> Any:
    """Turn transformers 5's ``{"__float__": "Infinity"}`` encodings (at any depth) back into floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: decode_json_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_json_floats(v) for v in obj]
    return obj


def _ids(value: Any, what: str) -> tuple[int, ...]:
    """Token ids from an int or a list of ints (HF writes either)."""
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{what} must be an int or a list of ints, got {value!r}", _RESTORE)
    return tuple(values)


# ModelOpt quant_algo -> the registry's quant value (algorithms the engine may meet; others are refused here).
# MIXED_PRECISION is "nvfp4" when a module is NVFP4, else "fp8" (:func:`_mixed_layers`).
_MODELOPT_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "MIXED_PRECISION": None}
# per-module algorithms of quantized_layers -> the module's weight format
_LAYER_ALGOS = {"FP8": FORMAT_FP8, "NVFP4": FORMAT_NVFP4, "W4A16_NVFP4": FORMAT_NVFP4}
_QUANT_FIX = (
    "use an unquantized checkpoint, a ModelOpt FP8 / NVFP4 / MIXED_PRECISION checkpoint, an HF fp8 "
    "checkpoint (per-tensor or 128 x 128 blocks), or write one with python -m runners.tools.quantize"
)


def _exclude_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{what} must be a list of module names, got {value!r}", _RESTORE)
    return tuple(value)


def _group_size(value: Any, what: str) -> int:
    """NVFP4's group size (default 16); any other value is refused (the format fixes it at 16)."""
    size = NVFP4_GROUP_SIZE if value is None else value
    if size != NVFP4_GROUP_SIZE:
        raise CheckpointError(f"{what}: NVFP4 group_size {value!r} is not supported (NVFP4 blocks are "
                              f"{NVFP4_GROUP_SIZE} values)", _RESTORE)
    return size


def _mixed_layers(q: dict[str, Any], source: str) -> tuple[tuple[str, str], ...]:
    """``((module pattern, format), ...)`` of a MIXED_PRECISION config: its ``quantized_layers`` ({module:
    {"quant_algo": "NVFP4" | "W4A16_NVFP4" | "FP8", "group_size": 16}}), else (config.json's converted form
    without it) the ``config_groups``' ``targets`` by their ``weights`` (8-bit float: FP8; 4-bit float
    with group_size 16: NVFP4). Empty when neither is there (the other file may carry them)."""
    layers = q.get("quantized_layers")
    out: list[tuple[str, str]] = []
    if layers is not None:
        if not isinstance(layers, dict):
            raise CheckpointError(f"{source}: quantized_layers must be an object, got {layers!r}", _RESTORE)
        for module, spec in layers.items():
            algo = str(spec.get("quant_algo", "")).upper() if isinstance(spec, dict) else ""
            if algo not in _LAYER_ALGOS:
                raise CheckpointError(
                    f"{source}: quantized_layers[{module!r}] = {spec!r}: per-module quant_algo must be "
                    f"one of {sorted(_LAYER_ALGOS)}", _QUANT_FIX)
            if _LAYER_ALGOS[algo] == FORMAT_NVFP4:
                _group_size(spec.get("group_size"), f"{source}: quantized_layers[{module!r}]")
            out.append((module, _LAYER_ALGOS[algo]))
        return tuple(out)
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise CheckpointError(f"{source}: config_groups must be an object, got {groups!r}", _RESTORE)
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(w, dict) or not isinstance(targets, list):
            raise CheckpointError(f"{source}: config_groups.{name} needs weights and targets", _RESTORE)
        kind = (w.get("type"), w.get("num_bits"))
        if kind == ("float", 8):
            fmt = FORMAT_FP8
        elif kind == ("float", 4):
            _group_size(w.get("group_size"), f"{source}: config_groups.{name}")
            fmt = FORMAT_NVFP4
        else:
            raise CheckpointError(f"{source}: config_groups.{name} weights {w!r} are not FP8 or NVFP4",
                                  _QUANT_FIX)
        out += [(str(t), fmt) for t in targets]
    return tuple(out)


def _modelopt(q: dict[str, Any], source: str, *, nested: bool) -> QuantConfig:
    """A ModelOpt quantization dict: the legacy ``quantization`` object (``kv_cache_quant_algo``,
    ``exclude_modules``) when ``nested``, else config.json's converted form (``kv_cache_scheme``,
    ``ignore``, ``config_groups``); MIXED_PRECISION's ``quantized_layers`` in either."""
    algo = str(q.get("quant_algo") or "").upper()
    if algo not in _MODELOPT_ALGOS:
        raise CheckpointError(
            f"{source}: ModelOpt quant_algo {q.get('quant_algo')!r} is not supported (supported: "
            f"{sorted(_MODELOPT_ALGOS)})",
            _QUANT_FIX,
        )
    kv = q.get("kv_cache_quant_algo")
    scheme = q.get("kv_cache_scheme")
    fp8_scheme = isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
    if kv is None and fp8_scheme:
        kv = "FP8"
    elif kv is None and scheme is not None:
        raise CheckpointError(f"{source}: kv_cache_scheme {scheme!r} is not supported (only 8-bit float)",
                              _QUANT_FIX)
    if kv is not None and str(kv).upper() != "FP8":
        raise CheckpointError(f"{source}: kv_cache_quant_algo {kv!r} is not supported (only FP8)", _QUANT_FIX)
    key = "exclude_modules" if nested or "exclude_modules" in q else "ignore"
    layers: tuple[tuple[str, str], ...] = ()
    group_size = None
    if algo == "MIXED_PRECISION":
        layers = _mixed_layers(q, source)
        method = "nvfp4" if any(f == FORMAT_NVFP4 for _, f in layers) else "fp8"
        group_size = NVFP4_GROUP_SIZE if method == "nvfp4" else None
    else:
        method = _MODELOPT_ALGOS[algo]
        if method == "nvfp4":
            group_size = _group_size(q.get("group_size"), source)
    return QuantConfig(
        method=method,
        format="modelopt",
        algo=algo,
        kv_cache_quant="fp8" if kv is not None else None,
        exclude_modules=_exclude_list(q.get(key), f"{source}: {key}"),
        quantized_layers=layers,
        group_size=group_size,
        source=source,
    )


def _hf_fp8(q: dict[str, Any], source: str) -> QuantConfig:
    """transformers / vLLM ``quant_method: fp8``: per-tensor (static or dynamic activations) or, with
    ``weight_block_size``, block-wise."""
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise CheckpointError(f"{source}: activation_scheme {scheme!r} must be static or dynamic", _RESTORE)
    if str(q.get("fmt", "e4m3")).lower() != "e4m3":
        raise CheckpointError(f"{source}: fp8 fmt {q.get('fmt')!r} is not supported (only e4m3)", _QUANT_FIX)
    block = q.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2):
        raise CheckpointError(f"{source}: weight_block_size must be [rows, cols], got {block!r}", _RESTORE)
    key = "ignored_layers" if "ignored_layers" in q else "modules_to_not_convert"
    return QuantConfig(
        method="fp8",
        format="fp8",
        algo="FP8_BLOCK" if block is not None else "FP8",
        activation_scheme=scheme,
        weight_block_size=tuple(int(b) for b in block) if block is not None else None,
        exclude_modules=_exclude_list(q.get(key), f"{source}: {key}"),
        source=source,
    )


def parse_quantization(
    quantization_config: Any,
    hf_quant_config: dict[str, Any] | None = None,
    *,
    source: str = "<config>",
    hf_quant_source: str = HF_QUANT_CONFIG_FILE,
) -> QuantConfig | None:
    """The checkpoint's :class:`QuantConfig` from config.json's ``quantization_config`` and / or ModelOpt's
    ``hf_quant_config.json`` content (None when neither is given: an unquantized checkpoint). When both are
    there they must name the same algorithm; config.json's is returned (with the KV-cache setting of
    either: older exports put it in hf_quant_config.json only).

    Raises:
        CheckpointError: a quantization method / algorithm the engine does not know (GPTQ, AWQ,
            compressed-tensors, FP8 per-channel, ...), malformed fields, or the two files disagreeing.
    """
    parsed = []
    if quantization_config is not None:
        q = quantization_config
        where = f"{source}: quantization_config"
        if not isinstance(q, dict):
            raise CheckpointError(f"{where} must be an object, got {type(q).__name__}", _RESTORE)
        method = str(q.get("quant_method", "")).lower()
        if method.startswith("modelopt"):
            nested = isinstance(q.get("quantization"), dict)
            parsed.append(_modelopt(q["quantization"] if nested else q, where, nested=nested))
        elif method == "fp8":
            parsed.append(_hf_fp8(q, where))
        else:
            raise CheckpointError(
                f"{where}: quant_method {q.get('quant_method')!r} is not supported (supported: modelopt with "
                "quant_algo FP8 / NVFP4 / MIXED_PRECISION, fp8)",
                _QUANT_FIX,
            )
    if hf_quant_config is not None:
        q = hf_quant_config.get("quantization")
        if not isinstance(q, dict):
            raise CheckpointError(f'{hf_quant_source}: no "quantization" object', _RESTORE)
        parsed.append(_modelopt(q, hf_quant_source, nested=True))
    if len(parsed) == 2 and parsed[0].algo == parsed[1].algo == "MIXED_PRECISION":
        # config.json's converted form may list the modules in config_groups only, or in neither
        layers = parsed[0].quantized_layers or parsed[1].quantized_layers
        parsed[0] = replace(parsed[0], quantized_layers=layers,
                            method="nvfp4" if any(f == FORMAT_NVFP4 for _, f in layers) else "fp8",
                            group_size=parsed[0].group_size or parsed[1].group_size)
        parsed[1] = replace(parsed[1], method=parsed[0].method)
    if len(parsed) == 2 and (parsed[0].method, parsed[0].algo) != (parsed[1].method, parsed[1].algo):
        raise CheckpointError(
            f"{source}: quantization_config says {parsed[0].algo} but {hf_quant_source} says "
            f"{parsed[1].algo}",
            "keep the files of one checkpoint together (re-download or re-export it)",
        )
    if len(parsed) == 2 and parsed[0].kv_cache_quant is None:
        return replace(parsed[0], kv_cache_quant=parsed[1].kv_cache_quant)
    return parsed[0] if parsed else None


def check_config(cfg: HybridConfig) -> None:
    """Cross-field checks every family parser's result passes; raises CheckpointError naming the fields."""
    src, kinds = cfg.source, set(cfg.layer_types) | set(cfg.mtp_layer_types)
    fix = "fix config.json (or use a checkpoint the engine supports)"
    if "mlp" in cfg.mtp_layer_types or "mamba2" in cfg.mtp_layer_types:
        raise CheckpointError(
            f"{src}: MTP layers {cfg.mtp_layer_types} are not supported",
            "the MTP module must be attention / moe blocks; use a checkpoint without MTP or with such a "
            "module",
        )
    if "mamba2" in kinds:
        if cfg.mamba_num_heads % cfg.n_groups:
            raise CheckpointError(
                f"{src}: mamba_num_heads={cfg.mamba_num_heads} is not a multiple of n_groups={cfg.n_groups}",
                fix,
            )
        if cfg.mamba_d_inner % cfg.n_groups:
            raise CheckpointError(
                f"{src}: d_inner={cfg.mamba_d_inner} is not a multiple of n_groups={cfg.n_groups}", fix
            )
    if "attention" in kinds and cfg.num_attention_heads % max(cfg.num_key_value_heads, 1):
        raise CheckpointError(
            f"{src}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}",
            fix,
        )
    if "gdn" in kinds and (cfg.gdn_num_key_heads < 1 or cfg.gdn_num_value_heads % cfg.gdn_num_key_heads):
        raise CheckpointError(
            f"{src}: GDN value heads ({cfg.gdn_num_value_heads}) must be a positive multiple of its key "
            f"heads ({cfg.gdn_num_key_heads})",
            fix,
        )
    if cfg.mlp_hidden_act not in ("relu2", "silu"):
        raise CheckpointError(f"{src}: MLP activation {cfg.mlp_hidden_act!r} is not supported",
                              "use a checkpoint whose hidden_act is relu2 or silu")
    if "moe" in kinds:
        if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise CheckpointError(
                f"{src}: num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                f"[1, n_routed_experts={cfg.n_routed_experts}]",
                fix,
            )
        if cfg.moe_scoring_func not in ("sigmoid", "softmax"):
            raise CheckpointError(f"{src}: MoE scoring function {cfg.moe_scoring_func!r} is not supported",
                                  "use a checkpoint whose router scores with sigmoid or softmax")
        if cfg.n_routed_experts % cfg.n_group:
            raise CheckpointError(
                f"{src}: n_routed_experts={cfg.n_routed_experts} is not a multiple of n_group={cfg.n_group}",
                fix,
            )


def _one_mtp_module(n_mtp: int, source: str) -> None:
    if n_mtp > 1:
        raise CheckpointError(
            f"{source}: num_nextn_predict_layers={n_mtp}; only 1 MTP module (applied recursively) is "
            "supported",
            "use a checkpoint with one MTP module (set num_nextn_predict_layers: 1)",
        )


# ---------------------------------------------------------------------------------------------- NemotronH

NEMOTRON_PATTERN = {"M": "mamba2", "*": "attention", "E": "moe", "-": "mlp"}
_NEMOTRON_LAYER_TYPE = {
    "linear_attention": "mamba2",
    "mamba": "mamba2",
    "full_attention": "attention",
    "attention": "attention",
    "moe": "moe",
    "mlp": "mlp",
}
# Legacy NemotronH field names (released configs) -> transformers 5 names.
_NEMOTRON_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "mamba_d_state": "ssm_state_size",
}


def _kinds_from_list(types: Any, key: str, source: str) -> tuple[str, ...]:
    if not isinstance(types, list):
        raise CheckpointError(f"{source}: {key} must be a list of layer types, got {type(types).__name__}",
                              _RESTORE)
    bad = sorted({t for t in types if t not in _NEMOTRON_LAYER_TYPE})
    if bad:
        raise CheckpointError(f"{source}: {key} has unknown layer types {bad}",
                              f"use the layer types {sorted(_NEMOTRON_LAYER_TYPE)}")
    return tuple(_NEMOTRON_LAYER_TYPE[t] for t in types)


def _kinds_from_pattern(pattern: str, key: str, source: str) -> tuple[str, ...]:
    bad = sorted({c for c in pattern if c not in NEMOTRON_PATTERN})
    if bad:
        raise CheckpointError(f"{source}: {key} has unknown letters {bad}",
                              "use the letters M (mamba2), * (attention), E (moe), - (mlp)")
    return tuple(NEMOTRON_PATTERN[c] for c in pattern)


def parse_nemotron_h(raw: dict[str, Any], source: str) -> HybridConfig:
    """A NemotronH ``config.json`` dict (either dialect, floats already decoded) as a HybridConfig."""
    raw = dict(raw)
    for old, new in _NEMOTRON_ALIASES.items():
        if old in raw and new not in raw:
            raw[new] = raw[old]
    if raw.get("layers_block_type") is not None:
        layer_types = _kinds_from_list(raw["layers_block_type"], "layers_block_type", source)
        pattern = raw.get("hybrid_override_pattern")
        if pattern is not None and (
            _kinds_from_pattern(pattern, "hybrid_override_pattern", source) != layer_types
        ):
            raise CheckpointError(
                f"{source}: hybrid_override_pattern {pattern!r} disagrees with layers_block_type",
                "keep one of them (transformers 5 reads layers_block_type) or make them agree",
            )
    elif raw.get("hybrid_override_pattern") is not None:
        layer_types = _kinds_from_pattern(raw["hybrid_override_pattern"], "hybrid_override_pattern", source)
    else:
        raise CheckpointError(
            f"{source}: neither layers_block_type nor hybrid_override_pattern is set",
            'add one (e.g. "hybrid_override_pattern": "M*E")',
        )
    if "num_hidden_layers" in raw and raw["num_hidden_layers"] not in (None, len(layer_types)):
        raise CheckpointError(
            f"{source}: num_hidden_layers={raw['num_hidden_layers']} but the layout lists "
            f"{len(layer_types)} layers",
            "make them agree",
        )
    n_mtp = int(raw.get("num_nextn_predict_layers") or 0)
    mtp_types: tuple[str, ...] = ()
    if n_mtp > 0:
        if raw.get("mtp_layers_block_type") is not None:
            mtp_types = _kinds_from_list(raw["mtp_layers_block_type"], "mtp_layers_block_type", source)
        elif raw.get("mtp_hybrid_override_pattern") is not None:
            mtp_types = _kinds_from_pattern(
                raw["mtp_hybrid_override_pattern"], "mtp_hybrid_override_pattern", source
            )
        else:
            mtp_types = ("attention", "moe")  # transformers' default
        _one_mtp_module(n_mtp, source)
    eos = raw.get("eos_token_id")
    limit = raw.get("time_step_limit", (0.0, math.inf))
    return HybridConfig(
        family="nemotron_h",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        layer_types=layer_types,
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=() if eos is None else _ids(eos, f"{source}: eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        num_attention_heads=raw.get("num_attention_heads", 0),
        num_key_value_heads=raw.get("num_key_value_heads") or raw.get("num_attention_heads", 0),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // max(raw.get("num_attention_heads", 1), 1),
        attention_bias=bool(raw.get("attention_bias", False)),
        # transformers' defaults; d_inner = H * P (not expand * D)
        mamba_num_heads=raw.get("mamba_num_heads", 128),
        mamba_head_dim=raw.get("mamba_head_dim", 64),
        ssm_state_size=raw.get("ssm_state_size", 128),
        n_groups=raw.get("n_groups", 8),
        conv_kernel=raw.get("conv_kernel", 4),
        chunk_size=raw.get("chunk_size", 128),
        use_conv_bias=bool(raw.get("use_conv_bias", True)),
        mamba_proj_bias=bool(raw.get("use_bias", raw.get("mamba_proj_bias", False))),
        time_step_limit=(float(limit[0]), float(limit[1])),
        mamba_ssm_cache_dtype=raw.get("mamba_ssm_cache_dtype", "float32"),
        intermediate_size=raw.get("intermediate_size", 0),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        n_routed_experts=raw.get("n_routed_experts", 0),
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        moe_shared_expert_intermediate_size=raw.get("moe_shared_expert_intermediate_size", 0),
        moe_latent_size=raw.get("moe_latent_size"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_group=raw.get("n_group", 1),
        topk_group=raw.get("topk_group", 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        num_nextn_predict_layers=n_mtp,
        mtp_layer_types=mtp_types,
        source=source,
    )


# ---------------------------------------------------------------------------------------------- Qwen3-Next

_QWEN_MIXER_KIND = {"linear_attention": "gdn", "full_attention": "attention"}
# transformers' Qwen3NextConfig defaults (the 80B-A3B sizes), used when config.json omits a field
_QWEN_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "intermediate_size": 5632,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
}


def _qwen_get(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    return _QWEN_DEFAULTS[key] if value is None else value


def _qwen_rope(raw: dict[str, Any], source: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` (transformers 5) or the top-level keys
    and ``rope_scaling`` (released configs). Raises CheckpointError for a scaled RoPE (not implemented)."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"{source}: RoPE type {rope_type!r} is not supported (only 'default')",
            "remove rope_scaling / set rope_parameters.rope_type to 'default', or extend "
            "runners.engine.models.attention.apply_rope",
        )
    theta = params.get("rope_theta", raw.get("rope_theta"))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    theta = _QWEN_DEFAULTS["rope_theta"] if theta is None else theta
    factor = _QWEN_DEFAULTS["partial_rotary_factor"] if factor is None else factor
    return float(theta), float(factor)


def _qwen_ffn_kind(i: int, raw: dict[str, Any]) -> str:
    """transformers' rule: MoE unless the layer is in ``mlp_only_layers``, there are no experts, or it is off
    the ``decoder_sparse_step``."""
    sparse = i not in (raw.get("mlp_only_layers") or []) and _qwen_get(raw, "num_experts") > 0
    return "moe" if sparse and (i + 1) % _qwen_get(raw, "decoder_sparse_step") == 0 else "mlp"


def parse_qwen3_next(raw: dict[str, Any], source: str) -> HybridConfig:
    """A Qwen3-Next ``config.json`` dict (either dialect, floats already decoded) as a HybridConfig.

    A decoder layer is two residual blocks: a token mixer (``gdn`` for 'linear_attention' layers, gated
    ``attention`` for 'full_attention' layers) and an FFN (``moe``, or a dense SwiGLU ``mlp`` for
    ``mlp_only_layers`` / off the ``decoder_sparse_step``): layer ``i`` is blocks ``2i`` and ``2i + 1``.
    """
    n_layers = _qwen_get(raw, "num_hidden_layers")
    mixers = raw.get("layer_types")
    if mixers is None:
        interval = _qwen_get(raw, "full_attention_interval")
        mixers = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if not isinstance(mixers, list) or sorted(set(mixers) - set(_QWEN_MIXER_KIND)):
        raise CheckpointError(f"{source}: layer_types must be a list of {sorted(_QWEN_MIXER_KIND)}; "
                              f"got {mixers!r}", _RESTORE)
    if len(mixers) != n_layers:
        raise CheckpointError(
            f"{source}: num_hidden_layers={n_layers} but layer_types lists {len(mixers)} layers",
            "make them agree",
        )
    layer_types: list[str] = []
    for i, mixer in enumerate(mixers):
        layer_types += [_QWEN_MIXER_KIND[mixer], _qwen_ffn_kind(i, raw)]
    n_mtp = raw.get("num_nextn_predict_layers")
    n_mtp = 1 if n_mtp is None else int(n_mtp)
    _one_mtp_module(n_mtp, source)
    # the MTP decoder layer is built like backbone layer 0 (vLLM builds mtp.layers.0 with layer index 0)
    mtp_types = ("attention", _qwen_ffn_kind(0, raw)) if n_mtp == 1 else ()
    eos = raw.get("eos_token_id")
    theta, rotary = _qwen_rope(raw, source)
    return HybridConfig(
        family="qwen3_next",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        layer_types=tuple(layer_types),
        norm_eps=_qwen_get(raw, "rms_norm_eps"),
        norm_weight_offset=1.0,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=() if eos is None else _ids(eos, f"{source}: eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=_qwen_get(raw, "max_position_embeddings"),
        num_attention_heads=_qwen_get(raw, "num_attention_heads"),
        num_key_value_heads=_qwen_get(raw, "num_key_value_heads"),
        head_dim=raw.get("head_dim") or _QWEN_DEFAULTS["head_dim"],
        attention_bias=bool(raw.get("attention_bias", False)),
        attn_output_gate=True,
        qk_norm=True,
        rope_theta=theta,
        partial_rotary_factor=rotary,
        gdn_num_key_heads=_qwen_get(raw, "linear_num_key_heads"),
        gdn_num_value_heads=_qwen_get(raw, "linear_num_value_heads"),
        gdn_key_head_dim=_qwen_get(raw, "linear_key_head_dim"),
        gdn_value_head_dim=_qwen_get(raw, "linear_value_head_dim"),
        conv_kernel=_qwen_get(raw, "linear_conv_kernel_dim"),
        intermediate_size=_qwen_get(raw, "intermediate_size"),
        mlp_hidden_act=_qwen_get(raw, "hidden_act"),
        mlp_gated=True,
        n_routed_experts=_qwen_get(raw, "num_experts"),
        num_experts_per_tok=_qwen_get(raw, "num_experts_per_tok"),
        moe_intermediate_size=_qwen_get(raw, "moe_intermediate_size"),
        moe_shared_expert_intermediate_size=_qwen_get(raw, "shared_expert_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_scoring_func="softmax",
        moe_shared_expert_gate=True,
        num_nextn_predict_layers=n_mtp,
        mtp_layer_types=mtp_types,
        source=source,
    )


# model_type -> parser; the model code of a family lives in runners/engine/models/<model_type>.py
PARSERS: dict[str, Callable[[dict[str, Any], str], HybridConfig]] = {
    "nemotron_h": parse_nemotron_h,
    "qwen3_next": parse_qwen3_next,
}
