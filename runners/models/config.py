"""The shared "hybrid decoder" vocabulary: one config dataclass for every model family the engine runs.

A model is an embedding, a list of residual blocks (``x = x + mixer(norm(x))``) of kind ``mamba2``, ``gdn``
(Gated DeltaNet), ``attention``, ``mlp`` or ``moe``, a final norm and an LM head, plus an optional
MTP module. Family-specific code lives in one module per HF ``model_type``, ``runners/models/<model_type>.py``
(found by :func:`family_module`): it parses the family's ``config.json`` into a :class:`HybridConfig` and maps
checkpoint tensor names to model tensors. Everything else (modules, caches, engine) is shared.
Non-finite floats that transformers 5 writes as ``{"__float__": "Infinity"}`` are decoded here.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BLOCK_KINDS = ("mamba2", "attention", "mlp", "moe", "gdn")


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
        return family_module(raw.get("model_type"), source).parse_config(raw, source)


def decode_json_floats(obj: Any) -> Any:
    """Turn transformers 5's ``{"__float__": "Infinity"}`` encodings (at any depth) back into floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: decode_json_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_json_floats(v) for v in obj]
    return obj


def validate(cfg: HybridConfig) -> None:
    """Cross-field checks every family parser runs last; raises ConfigError naming the fields."""
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
    if "gdn" in kinds and (
        cfg.gdn_num_key_heads < 1 or cfg.gdn_num_value_heads % cfg.gdn_num_key_heads
    ):
        raise ConfigError(
            f"{src}: GDN value heads ({cfg.gdn_num_value_heads}) must be a positive multiple of its key "
            f"heads ({cfg.gdn_num_key_heads})"
        )
    if cfg.mlp_hidden_act not in ("relu2", "silu"):
        raise ConfigError(f"{src}: MLP activation {cfg.mlp_hidden_act!r} is not supported; use relu2 or silu")
    if "moe" in kinds:
        if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise ConfigError(
                f"{src}: num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                f"[1, n_routed_experts={cfg.n_routed_experts}]"
            )
        if cfg.moe_scoring_func not in ("sigmoid", "softmax"):
            raise ConfigError(
                f"{src}: MoE scoring function {cfg.moe_scoring_func!r} is not supported; "
                "use sigmoid or softmax"
            )
        if cfg.n_routed_experts % cfg.n_group:
            raise ConfigError(
                f"{src}: n_routed_experts={cfg.n_routed_experts} is not a multiple of n_group={cfg.n_group}"
            )


def family_module(model_type: str | None, source: str = "<config>") -> ModuleType:
    """The family module ``runners.models.<model_type>`` (e.g. ``nemotron_h``).

    A family module defines ``parse_config(raw: dict, source: str) -> HybridConfig`` and
    ``checkpoint_targets(model) -> {checkpoint name: tensor}``, and registers any block kinds of its own
    (``runners.models.hybrid.MIXERS``, ``runners.cache.CACHE_LAYOUTS``) when imported.

    Raises:
        ConfigError: no such family module.
    """
    name = str(model_type)
    folder = Path(__file__).parent
    if not name.isidentifier() or not (folder / f"{name}.py").is_file():
        known = sorted(f.stem for f in folder.glob("*.py") if "\ndef parse_config(" in f.read_text())
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported; supported: {known}")
    return importlib.import_module(f"runners.models.{name}")
