"""The released models, as data: config.json of Nemotron 3 Super and Qwen3-Next-80B-A3B at their released
dimensions (:data:`RELEASE_CONFIGS`), and what each released weight format quantizes (:func:`release_rule`:
NVIDIA ModelOpt FP8 and NVFP4 MIXED_PRECISION of Nemotron 3 Super, Qwen's 128 x 128 block FP8 of
Qwen3-Next). One owner for the tools that write checkpoints of these releases (runners.tools.synth,
runners.tools.formats, runners.tools.quantize) and for ``model.load_format=dummy`` (runners.engine.dummy,
registry.resolve: a dummy run without a checkpoint folder uses the entry's released configuration).

Sources: the releases' config.json / hf_quant_config.json on the Hugging Face hub
(nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-{BF16,FP8,NVFP4}, Qwen/Qwen3-Next-80B-A3B-Instruct{,-FP8}) and
NVIDIA Model-Optimizer's HF export (``unified_export_hf``, ``convert_hf_config.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from registry.hf_config import (
    FORMAT_BF16,
    FORMAT_BLOCK_FP8,
    FORMAT_FP8,
    FORMAT_NVFP4,
    NVFP4_GROUP_SIZE,
    HybridConfig,
    QuantConfig,
)
from registry.schema import REPO_ROOT, Quant

FORMATS = (FORMAT_BF16, FORMAT_FP8, FORMAT_NVFP4, FORMAT_BLOCK_FP8)  # the release formats, in --format order
# the release format of each (family, entry quant): Qwen's FP8 release is block FP8, NVIDIA's per-tensor
RELEASE_FORMATS: dict[tuple[str, str], str] = {
    ("nemotron_h", Quant.none.value): FORMAT_BF16,
    ("nemotron_h", Quant.fp8.value): FORMAT_FP8,
    ("nemotron_h", Quant.nvfp4.value): FORMAT_NVFP4,
    ("qwen3_next", Quant.none.value): FORMAT_BF16,
    ("qwen3_next", Quant.fp8.value): FORMAT_BLOCK_FP8,
}

DUMMY_SEED = 0  # the seed of model.load_format=dummy weights (runners.tools.synth's default --seed)

BASE_TOKENIZER = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp"
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2  # the base tokenizer's <pad>, <s>, </s>

SUPER_V3_PATTERN = (
    "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
)

# config.json of the releases (nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16,
# Qwen/Qwen3-Next-80B-A3B-Instruct), in their own dialect: the fields the loader, transformers and vLLM /
# SGLang read.
RELEASE_CONFIGS: dict[str, dict[str, Any]] = {
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "chunk_size": 128,
        "conv_kernel": 4,
        "eos_token_id": EOS_TOKEN_ID,
        "expand": 2,
        "head_dim": 128,
        "hidden_dropout": 0.0,
        "hidden_size": 4096,
        "hybrid_override_pattern": SUPER_V3_PATTERN,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "mamba_head_dim": 64,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": 128,
        "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "moe_intermediate_size": 2688,
        "moe_latent_size": 1024,
        "moe_shared_expert_intermediate_size": 5376,
        "mtp_hybrid_override_pattern": "*E",
        "n_group": 1,
        "n_groups": 8,
        "n_routed_experts": 512,
        "n_shared_experts": 1,
        "norm_eps": 1e-05,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts_per_tok": 22,
        "num_hidden_layers": 88,
        "num_key_value_heads": 2,
        "num_nextn_predict_layers": 1,
        "pad_token_id": PAD_TOKEN_ID,
        "partial_rotary_factor": 1.0,
        "rope_theta": 10000,
        "routed_scaling_factor": 5.0,
        "ssm_state_size": 128,
        "tie_word_embeddings": False,
        "time_step_floor": 0.0001,
        "time_step_limit": [0.0, math.inf],
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mamba_kernels": True,
        "vocab_size": 131072,
    },
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "decoder_sparse_step": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": PAD_TOKEN_ID,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}
# config keys of the routed expert count and top-k per family
EXPERT_KEYS = {"nemotron_h": ("n_routed_experts", "num_experts_per_tok"),
                "qwen3_next": ("num_experts", "num_experts_per_tok")}
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
        FormatError: no release of that format for the family (NVFP4: nemotron_h; block FP8: qwen3_next).
    """
    kv = "fp8" if kv_cache else None
    if fmt == FORMAT_FP8:
        return QuantConfig(method="fp8", format="modelopt", algo="FP8", kv_cache_quant=kv,
                           exclude_modules=RELEASE_EXCLUDES[family] + exclude, source=f"{fmt} release rule")
    if fmt == FORMAT_NVFP4 and family in NVFP4_LAYERS:
        return QuantConfig(method=Quant.nvfp4.value, format="modelopt", algo="MIXED_PRECISION",
                           kv_cache_quant=kv,
                           exclude_modules=("lm_head", "mtp*") + exclude,
                           quantized_layers=NVFP4_LAYERS[family], group_size=NVFP4_GROUP_SIZE,
                           source=f"{fmt} release rule")
    if fmt == FORMAT_BLOCK_FP8 and family in BLOCK_FP8_NOT_CONVERTED:
        return QuantConfig(method="fp8", format="fp8", algo="FP8_BLOCK", activation_scheme="dynamic",
                           weight_block_size=(128, 128),
                           exclude_modules=BLOCK_FP8_NOT_CONVERTED[family] + exclude,
                           source=f"{fmt} release rule")
    have = {FORMAT_NVFP4: sorted(NVFP4_LAYERS), FORMAT_BLOCK_FP8: sorted(BLOCK_FP8_NOT_CONVERTED)}.get(fmt)
    raise FormatError(f"--format {fmt}: no {fmt} release rule for family {family}"
                      + (f" (the {fmt} release is {', '.join(have)}'s)" if have else "")
                      + f"; formats: {', '.join(FORMATS)}")



def release_format(family: str, quant: str) -> str:
    """The release format (:data:`FORMATS`) of a ``family`` model whose registry entry says ``quant``.

    Raises:
        FormatError: no release of that model in that quantization (e.g. Qwen3-Next NVFP4).
    """
    try:
        return RELEASE_FORMATS[(family, quant)]
    except KeyError:
        have = sorted(q for f, q in RELEASE_FORMATS if f == family)
        raise FormatError(f"no {quant} release of {family} is known (releases: {', '.join(have)})") from None


def release_quant_config(family: str, quant: str, kv_cache_quant: str) -> QuantConfig | None:
    """What the ``family`` release in the entry's ``quant`` quantizes (None for the BF16 release), with an FP8
    KV cache when ``kv_cache_quant`` is fp8.

    Raises:
        FormatError: as :func:`release_format`.
    """
    fmt = release_format(family, quant)
    return None if fmt == "bf16" else release_rule(family, fmt, kv_cache=kv_cache_quant == "fp8")


def release_hybrid_config(family: str, quant: str, kv_cache_quant: str,
                          overrides: dict[str, Any] | None = None) -> HybridConfig:
    """The released configuration of a ``family`` model in the entry's ``quant`` (config.json of
    :data:`RELEASE_CONFIGS` with the release format's :func:`release_quant_config`): what
    ``model.load_format=dummy`` builds when the entry's checkpoint folder is not on this machine.
    ``overrides``: config.json fields replaced (tests and benchmarks shrink widths with them).

    Raises:
        FormatError: no release of that model in that quantization.
    """
    quantization = release_quant_config(family, quant, kv_cache_quant)
    fmt = release_format(family, quant)
    source = f"the released {family} {fmt} configuration (registry/releases.py)"
    config = HybridConfig.from_dict({**RELEASE_CONFIGS[family], **(overrides or {})}, source=source)
    return dataclasses.replace(config, quantization=quantization)


def write_tokenizer(out: Path, vocab_size: int, base: Path = BASE_TOKENIZER) -> int:
    """tokenizer.json (the base GSM8K tokenizer + added tokens ``<|synth_i|>`` up to ``vocab_size``, so every
    id a model of that vocabulary emits decodes and GSM8K prompts encode as with the tiny checkpoints) and
    tokenizer_config.json into ``out``; returns the base vocabulary size.

    Raises:
        ValueError: vocab_size smaller than the base tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < n:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the GSM8K tokenizer's {n} tokens; use >= {n}"
        )
    tok.add_tokens([AddedToken(f"<|synth_{i}|>", normalized=False) for i in range(n, vocab_size)])
    tok.save(str(out / "tokenizer.json"))
    shutil.copyfile(base / "tokenizer_config.json", out / "tokenizer_config.json")
    return n


DUMMY_TOKENIZERS_DIR = REPO_ROOT / "outputs" / "dummy_tokenizers"


def dummy_tokenizer_dir(vocab_size: int, root: Path = DUMMY_TOKENIZERS_DIR) -> Path:
    """A folder holding :func:`write_tokenizer`'s tokenizer of ``vocab_size`` (written once, atomically, then
    reused): the tokenizer of a ``model.load_format=dummy`` run whose checkpoint folder has none.

    Raises:
        ValueError: vocab_size smaller than the base tokenizer.
    """
    final = root / f"vocab_{vocab_size}"
    if (final / "tokenizer.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".vocab_{vocab_size}."))
    write_tokenizer(tmp, vocab_size)
    try:
        os.replace(tmp, final)
    except OSError:  # another run wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return final
