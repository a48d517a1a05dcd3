"""The shared "hybrid decoder" vocabulary: one config dataclass for every model family the engine runs.

A model is an embedding, a list of residual blocks (``x = x + mixer(norm(x))``) of kind ``mamba2``,
``attention``, ``mlp`` or ``moe`` (a later family adds ``gdn``), a final norm and an LM head, plus an optional
MTP module. Family-specific code is limited to parsing a family's HF ``config.json`` into a
:class:`HybridConfig` (here: NemotronH) and to the weight-name mapping (``runners/models/nemotron_h.py``).

NemotronH ``config.json`` comes in two dialects, both read here:
- released checkpoints: ``hybrid_override_pattern`` ("M" mamba2, "*" attention, "E" moe, "-" mlp) and
  ``mtp_hybrid_override_pattern``; legacy aliases such as ``mamba_n_groups`` / ``mamba_d_conv``;
- transformers 5 ``save_pretrained``: ``layers_block_type`` / ``mtp_layers_block_type`` lists of
  'linear_attention' / 'full_attention' / 'moe' / 'mlp', and non-finite floats written as
  ``{"__float__": "Infinity"}`` (e.g. ``time_step_limit``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BLOCK_KINDS = ("mamba2", "attention", "mlp", "moe", "gdn")

_NEMOTRON_PATTERN = {"M": "mamba2", "*": "attention", "E": "moe", "-": "mlp"}
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


class ConfigError(ValueError):
    """A config.json that the engine cannot run; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class HybridConfig:
    """Architecture of one hybrid decoder (all sizes in elements; eps are RMSNorm epsilons).

    ``layer_types`` lists the residual blocks of the backbone in order, each one of :data:`BLOCK_KINDS`;
    ``mtp_layer_types`` the blocks of the MTP module (empty when ``num_nextn_predict_layers == 0``).
    Fields of a block kind that the model does not use keep their defaults.
    """

    family: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    norm_eps: float = 1e-5
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
    # dense MLP
    intermediate_size: int = 0
    mlp_bias: bool = False
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
    # MTP
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    source: str = field(default="", compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

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
        """Read ``<path>/config.json`` (or a config.json path) and parse it by its ``model_type``.

        Raises:
            ConfigError: missing or unreadable file, unknown ``model_type``, or a bad layout field.
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(
                f"{file}: config.json not found; point the engine at an HF checkpoint directory "
                "that contains config.json"
            )
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e}); re-export the checkpoint's config.json") from e
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>") -> HybridConfig:
        """Parse an HF config dict (either dialect); see the module docstring."""
        raw = decode_json_floats(raw)
        model_type = raw.get("model_type")
        parser = _PARSERS.get(model_type)
        if parser is None:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: {sorted(_PARSERS)}"
            )
        return parser(raw, source)


def decode_json_floats(obj: Any) -> Any:
    """Turn transformers 5's ``{"__float__": "Infinity"}`` encodings (at any depth) back into floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: decode_json_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_json_floats(v) for v in obj]
    return obj


def _kinds_from_list(types: list[str], key: str, source: str) -> tuple[str, ...]:
    if not isinstance(types, list):
        raise ConfigError(f"{source}: {key} must be a list of layer types, got {type(types).__name__}")
    bad = sorted({t for t in types if t not in _NEMOTRON_LAYER_TYPE})
    if bad:
        raise ConfigError(
            f"{source}: {key} has unknown layer types {bad}; allowed: {sorted(_NEMOTRON_LAYER_TYPE)}"
        )
    return tuple(_NEMOTRON_LAYER_TYPE[t] for t in types)


def _kinds_from_pattern(pattern: str, key: str, source: str) -> tuple[str, ...]:
    bad = sorted({c for c in pattern if c not in _NEMOTRON_PATTERN})
    if bad:
        raise ConfigError(
            f"{source}: {key} has unknown letters {bad}; allowed: M (mamba2), * (attention), E (moe), - (mlp)"
        )
    return tuple(_NEMOTRON_PATTERN[c] for c in pattern)


def _parse_nemotron_h(raw: dict[str, Any], source: str) -> HybridConfig:
    raw = dict(raw)
    for old, new in _NEMOTRON_ALIASES.items():
        if old in raw and new not in raw:
            raw[new] = raw[old]
    if raw.get("layers_block_type") is not None:
        layer_types = _kinds_from_list(raw["layers_block_type"], "layers_block_type", source)
        pattern = raw.get("hybrid_override_pattern")
        if pattern is not None and _kinds_from_pattern(pattern, "hybrid_override_pattern", source) != layer_types:
            raise ConfigError(
                f"{source}: hybrid_override_pattern {pattern!r} disagrees with layers_block_type; "
                "keep one of them (transformers 5 reads layers_block_type) or make them agree"
            )
    elif raw.get("hybrid_override_pattern") is not None:
        layer_types = _kinds_from_pattern(raw["hybrid_override_pattern"], "hybrid_override_pattern", source)
    else:
        raise ConfigError(
            f"{source}: neither layers_block_type nor hybrid_override_pattern is set; add one "
            '(e.g. "hybrid_override_pattern": "M*E")'
        )
    if "num_hidden_layers" in raw and raw["num_hidden_layers"] not in (None, len(layer_types)):
        raise ConfigError(
            f"{source}: num_hidden_layers={raw['num_hidden_layers']} but the layout lists "
            f"{len(layer_types)} layers; make them agree"
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
        if n_mtp != 1:
            raise ConfigError(
                f"{source}: num_nextn_predict_layers={n_mtp}; only 1 MTP module (applied "
                "recursively) is supported"
            )
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    num_heads = raw.get("mamba_num_heads", 128)  # transformers' default; d_inner = H * P (not expand * D)
    limit = raw.get("time_step_limit", (0.0, math.inf))
    cfg = HybridConfig(
        family="nemotron_h",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        layer_types=layer_types,
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        num_attention_heads=raw.get("num_attention_heads", 0),
        num_key_value_heads=raw.get("num_key_value_heads") or raw.get("num_attention_heads", 0),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // max(raw.get("num_attention_heads", 1), 1),
        attention_bias=bool(raw.get("attention_bias", False)),
        mamba_num_heads=num_heads,
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
    _validate(cfg)
    return cfg


def _validate(cfg: HybridConfig) -> None:
    src, kinds = cfg.source, set(cfg.layer_types) | set(cfg.mtp_layer_types)
    if "mlp" in cfg.mtp_layer_types or "mamba2" in cfg.mtp_layer_types:
        raise ConfigError(
            f"{src}: MTP layers {cfg.mtp_layer_types} are not supported; the MTP module must be "
            "attention / moe blocks"
        )
    if "mamba2" in kinds:
        if cfg.mamba_num_heads % cfg.n_groups:
            raise ConfigError(
                f"{src}: mamba_num_heads={cfg.mamba_num_heads} is not a multiple of n_groups={cfg.n_groups}"
            )
        if cfg.mamba_d_inner % cfg.n_groups:
            raise ConfigError(
                f"{src}: d_inner={cfg.mamba_d_inner} is not a multiple of n_groups={cfg.n_groups}"
            )
    if "attention" in kinds and cfg.num_attention_heads % max(cfg.num_key_value_heads, 1):
        raise ConfigError(
            f"{src}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if "moe" in kinds:
        if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise ConfigError(
                f"{src}: num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                f"[1, n_routed_experts={cfg.n_routed_experts}]"
            )
        if cfg.n_routed_experts % cfg.n_group:
            raise ConfigError(
                f"{src}: n_routed_experts={cfg.n_routed_experts} is not a multiple of n_group={cfg.n_group}"
            )


_PARSERS = {"nemotron_h": _parse_nemotron_h}


def register_family(model_type: str, parser) -> None:
    """Register ``parser(raw: dict, source: str) -> HybridConfig`` for an HF ``model_type``."""
    _PARSERS[model_type] = parser
