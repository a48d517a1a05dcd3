"""Build the project's shipped tiny checkpoints: a GSM8K byte-level BPE tokenizer and two small random-weight
HF checkpoints (NemotronH and Qwen3-Next, each with its `mtp.*` module), deterministic for a given seed.

    python -m runners.tools.tiny --out registry/checkpoints --seed 0 [--vocab-size N] [--train PATH]

The base weights come from transformers' own model classes (random init under `torch.manual_seed(seed)`) and
are written with the names released checkpoints use (per-expert MoE tensors, `backbone.` / `model.` prefixes).
The `mtp.*` tensors, which transformers does not model, are cut from a second random transformers model whose
layers have the MTP block types, then renamed; so an MTP block's names match a backbone block's names exactly.
`write_random_checkpoint` is the reusable entry point for tests that need a random checkpoint of custom size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from evals.tasks.gsm8k import gsm8k_dir
from registry.checkpoint import CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 in this order
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 2048
# GPT-2's split pattern with `\p{N}+` narrowed to `\p{N}`: every digit is its own pre-token (a leading space
# may stay attached, as with words), so no merge ever spans two digits and "1234" is always four tokens.
SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# family -> the shipped checkpoint's folder under registry/checkpoints/ (and its registry entry's name)
CHECKPOINT_NAMES = {"nemotron_h": "tiny_nemotron_h_mtp", "qwen3_next": "tiny_qwen3_next_mtp"}
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)


def default_gsm8k_train() -> Path:
    """GSM8K train split of evals.tasks.gsm8k.gsm8k_dir's folder ($GSM8K_DIR, else ../shared/data/gsm8k)."""
    path, _ = gsm8k_dir(None)
    if path is None:
        raise FileNotFoundError("no GSM8K folder found; pass --train PATH or set GSM8K_DIR to the folder "
                                "holding train.jsonl")
    return path / "train.jsonl"


def gsm8k_documents(train_path: str | os.PathLike) -> Iterator[str]:
    """Yield one "Question: {q}\\nAnswer: {a}\\n\\n" string per line of a GSM8K jsonl file, in file order.

    This is the text layout of lm-eval's gsm8k few-shot examples, so the tokenizer learns the merges that the
    evaluation prompts use. Raises FileNotFoundError naming the path and how to point at the data.
    """
    path = Path(train_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K train split not found at {path}; pass --train PATH or set GSM8K_DIR to the folder "
            "holding train.jsonl"
        )
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield f"Question: {row['question']}\nAnswer: {row['answer']}\n\n"


def train_tokenizer(train_path: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE tokenizer on the GSM8K train split (questions and answers only).

    Args:
        train_path: GSM8K `train.jsonl` (fields "question", "answer").
        vocab_size: total vocabulary including the 3 special tokens and the 256 byte symbols; >= 259 + 1.
    Returns:
        tokenizers.Tokenizer with `<pad>`=0, `<s>`=1, `</s>`=2, single-digit pre-tokens (SPLIT_PATTERN),
        byte-level decoding and no post-processor (encode adds no BOS/EOS; callers add them explicitly).
    The BPE trainer breaks count ties deterministically, so the same input gives the same tokenizer.json.
    Raises ValueError for a vocab_size too small to hold the special tokens and the byte alphabet.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    min_size = len(SPECIAL_TOKENS) + 256 + 1
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small; use at least {min_size} (3 special + 256 bytes + 1)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(gsm8k_documents(train_path), trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer


def transformers_clash() -> str | None:
    """Why transformers cannot be imported beside this checkout, or None when it can.

    transformers imports the PyPI package `kernels` (Hugging Face's hub kernels) at import time whenever its
    `is_kernels_available()` holds: the package is installed in the version range that release accepts
    (transformers 5.25 depends on it, so there it always holds). Run from the checkout, `import kernels` finds
    this repository's kernels/ first, and transformers fails with "cannot import name ... from 'kernels'".
    The project pins transformers below 5.25 (pyproject.toml), where the range excludes the version 5.25
    pulls in; this names the problem and the fix when an environment has another combination.
    """
    try:
        from transformers.utils.import_utils import is_kernels_available
    except ImportError:
        return None  # no transformers (or too old to probe): its users report that themselves
    if not is_kernels_available():
        return None
    from importlib.metadata import version

    return (f"transformers {version('transformers')} imports the PyPI package `kernels` "
            f"{version('kernels')}, which this checkout's kernels/ shadows (the project runs from the "
            "checkout, so both cannot be imported)")


TRANSFORMERS_CLASH_FIX = ("pip install 'transformers>=5.0,<5.25' (the test extra's pin), "
                          "or pip uninstall kernels")


def _require_transformers() -> None:
    """Raise UserError (registry.errors) when `transformers_clash` finds a problem."""
    problem = transformers_clash()
    if problem:
        from registry.errors import UserError

        raise UserError(problem, TRANSFORMERS_CLASH_FIX)


def save_tokenizer(tokenizer, out_dir: str | os.PathLike, model_max_length: int = 4096) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` so both `tokenizers.Tokenizer.from_file` and
    transformers' `AutoTokenizer.from_pretrained` load it (PreTrainedTokenizerFast with bos `<s>`, eos `</s>`,
    pad `<pad>`). Creates out_dir; overwrites existing tokenizer files. Returns out_dir.

    Raises:
        UserError: transformers cannot be imported beside this checkout (`transformers_clash`).
    """
    _require_transformers()
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[BOS_TOKEN_ID],
        eos_token=SPECIAL_TOKENS[EOS_TOKEN_ID],
        pad_token=SPECIAL_TOKENS[PAD_TOKEN_ID],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    # transformers 5 records its own backend class name; the generic class name also loads in transformers 4
    # and in engines that read tokenizer_config.json themselves.
    config_path = out / TOKENIZER_CONFIG_FILE
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return out


# Default sizes of the shipped checkpoints (see registry/checkpoints/README.md for the measured numbers).
# Both keep awkward-but-legal shape pairs that catch transposition bugs: mamba head_dim P=32 != d_state N=16,
# GDN head_k_dim K=32 != head_v_dim V=64 with HV = 2H, MoE latent 96 != moe_intermediate 128.
TINY_NEMOTRON_H = dict(
    hidden_size=192,
    layers_block_type=[
        "linear_attention",
        "full_attention",
        "moe",
        "linear_attention",
        "mlp",
        "linear_attention",
        "full_attention",
        "moe",
    ],  # "M*EM-M*E"
    mtp_layers_block_type=["full_attention", "moe"],  # "*E", as Nemotron 3 Super
    num_nextn_predict_layers=1,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    mamba_num_heads=12,
    mamba_head_dim=32,
    expand=2,  # informational: d_inner = mamba_num_heads * mamba_head_dim = 384 = 2 * hidden_size
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=128,
    # transformers' NemotronH clamps dt' at time_step_min in its prefill path whatever time_step_limit says;
    # writing the same floor into time_step_limit (which our engine applies on every path) keeps a trained
    # checkpoint's logits equal in both. Released configs use (0, inf); the engine reads whichever is given.
    time_step_min=0.001,
    time_step_limit=(0.001, float("inf")),
    intermediate_size=512,
    mlp_hidden_act="relu2",
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    moe_latent_size=96,
    moe_shared_expert_intermediate_size=256,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    max_position_embeddings=4096,
    layer_norm_epsilon=1e-5,
    mamba_ssm_cache_dtype="float32",
    tie_word_embeddings=False,
)
TINY_QWEN3_NEXT = dict(
    hidden_size=128,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=128,
    intermediate_size=256,  # unused: every layer is MoE (decoder_sparse_step 1, no mlp_only_layers)
    decoder_sparse_step=1,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_FAMILY_DEFAULTS = {"nemotron_h": TINY_NEMOTRON_H, "qwen3_next": TINY_QWEN3_NEXT}
# Std of the Gaussian noise added to tensors whose transformers init is a constant (norm weights, conv bias,
# Mamba D, the router's e_score_correction_bias): with exact ones / zeros a loader that drops or misroutes
# such a tensor, or applies a Qwen3-Next (1 + w) norm as w, would still reproduce the reference logits.
CONSTANT_INIT_NOISE_STD = 0.05


def _model_classes(family: str):
    _require_transformers()
    from transformers import NemotronHConfig, NemotronHForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    classes = {
        "nemotron_h": (NemotronHConfig, NemotronHForCausalLM),
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; use one of {sorted(classes)}")
    return classes[family]


def _perturb_constant_tensors(model: torch.nn.Module, std: float) -> None:
    """Add N(0, std) noise (global torch RNG) in place to every floating parameter or buffer whose elements
    are all equal. Mutates model."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if (
                tensor.is_floating_point()
                and tensor.numel() > 0
                and bool((tensor == tensor.flatten()[0]).all())
            ):
                tensor.add_(torch.randn(tensor.shape, dtype=tensor.dtype) * std)


def _random_hf_tensors(config, model_cls) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """Instantiate model_cls(config) with random init (global torch RNG), perturb constant tensors and save
    it with transformers' own save_pretrained, which writes the released on-disk names (per-expert MoE
    tensors, NemotronH `backbone.` prefix). Returns (float32 tensors by on-disk name, config.json dict, names
    of modules transformers keeps in float32)."""
    from safetensors.torch import load_file

    model = model_cls(config).float().eval()
    _perturb_constant_tensors(model, CONSTANT_INIT_NOISE_STD)
    keep_fp32 = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(shard))
        config_dict = json.loads((Path(tmp) / CONFIG_FILE).read_text())
    return tensors, config_dict, keep_fp32


def _mtp_block_config(config, family: str):
    """A copy of `config` whose backbone layers are the MTP blocks, so their tensors get backbone names."""
    config_cls, _ = _model_classes(family)
    d = config.to_dict()
    d.pop("transformers_version", None)
    if family == "nemotron_h":
        d["layers_block_type"] = list(config.mtp_layers_block_type)
        d["num_nextn_predict_layers"] = 0
    else:
        d.update(
            num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[], decoder_sparse_step=1
        )
    return config_cls.from_dict(d)


def _mtp_tensors(config, family: str, std: float) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors (float32) for one MTP module, named as released checkpoints name them.

    NemotronH: mtp.layers.0 = attention block (+ enorm, hnorm, eh_proj [H, 2H]); mtp.layers.1 = MoE block
    (+ final_layernorm). Qwen3-Next: mtp.fc [H, 2H], mtp.pre_fc_norm_{embedding,hidden}, mtp.norm and
    mtp.layers.0 = one full-attention + MoE decoder layer. Block tensors come from a random transformers model
    whose layers are the MTP block types, so their names equal a backbone layer's names minus the prefix.
    """
    _, model_cls = _model_classes(family)
    block_tensors, _, _ = _random_hf_tensors(_mtp_block_config(config, family), model_cls)
    H = config.hidden_size
    prefix = "backbone.layers." if family == "nemotron_h" else "model.layers."
    out = {"mtp.layers." + k[len(prefix) :]: v for k, v in block_tensors.items() if k.startswith(prefix)}

    def proj() -> torch.Tensor:  # [H, 2H] linear over concat[norm(embed), norm(hidden)]
        return torch.randn(H, 2 * H) * config.initializer_range

    def norm(centre: float) -> torch.Tensor:
        return centre + torch.randn(H) * std

    if family == "nemotron_h":
        out["mtp.layers.0.enorm.weight"] = norm(1.0)
        out["mtp.layers.0.hnorm.weight"] = norm(1.0)
        out["mtp.layers.0.eh_proj.weight"] = proj()
        last = len(config.mtp_layers_block_type) - 1
        out[f"mtp.layers.{last}.final_layernorm.weight"] = norm(1.0)
    else:  # Qwen3-Next RMSNorms scale by (1 + w): zero-centred weights
        out["mtp.fc.weight"] = proj()
        out["mtp.pre_fc_norm_embedding.weight"] = norm(0.0)
        out["mtp.pre_fc_norm_hidden.weight"] = norm(0.0)
        out["mtp.norm.weight"] = norm(0.0)
    return out


def _tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / TOKENIZER_FILE)).get_vocab_size(with_added_tokens=True)


def write_random_checkpoint(
    out_dir: str | os.PathLike,
    family: str,
    config_overrides: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a random-weight HF checkpoint of `family` ("nemotron_h" | "qwen3_next") with one MTP module.

    Args:
        out_dir: created if missing; config.json, generation_config.json, model.safetensors (one file, keys
            sorted) are overwritten, plus tokenizer.json / tokenizer_config.json copied from tokenizer_dir.
        config_overrides: transformers config fields replacing the tiny defaults (TINY_NEMOTRON_H /
            TINY_QWEN3_NEXT), e.g. {"hidden_size": 64, "layers_block_type": [...]}. The layer layout may also
            be given as NemotronH "hybrid_override_pattern" ("M*E-") / "mtp_hybrid_override_pattern", or as
            Qwen3-Next "num_hidden_layers" with "full_attention_interval" (default 4).
        seed: `torch.manual_seed(seed)` before any init; same seed + same arguments -> same file bytes.
        dtype: on-disk dtype of every tensor except those transformers keeps in float32
            (`_keep_in_fp32_modules_strict`: NemotronH router gate.weight and e_score_correction_bias).
        tokenizer_dir: folder with tokenizer.json; vocab_size defaults to its size. Without it, vocab_size
            comes from config_overrides or the transformers default.
    Returns:
        Path of out_dir. The base model loads with transformers' `<Family>ForCausalLM.from_pretrained`
        (which ignores `mtp.*`). NemotronH configs are written in the transformers-5 dialect
        (layers_block_type, mtp_layers_block_type) plus the derived legacy strings hybrid_override_pattern /
        mtp_hybrid_override_pattern for older readers; the lists are authoritative.
    Raises:
        ValueError: unknown family, or a vocab_size smaller than the tokenizer's.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config_cls, model_cls = _model_classes(family)
    out = Path(out_dir)
    fields = dict(_FAMILY_DEFAULTS[family])
    fields.update(pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        tokenizer_size = _tokenizer_vocab_size(tokenizer_dir)
        fields["vocab_size"] = tokenizer_size
    overrides = dict(config_overrides or {})
    # A layer layout given in another spelling replaces the default list instead of being silently outvoted
    # by it (transformers lets an explicit list win over the legacy pattern string / the attention interval).
    if family == "nemotron_h":
        for pattern, layers in (
            ("hybrid_override_pattern", "layers_block_type"),
            ("mtp_hybrid_override_pattern", "mtp_layers_block_type"),
        ):
            if pattern in overrides and layers not in overrides:
                fields.pop(layers)
    elif "layer_types" not in overrides and (
        "num_hidden_layers" in overrides or "full_attention_interval" in overrides
    ):
        fields.pop("layer_types")
        fields.setdefault("full_attention_interval", 4)
    fields.update(overrides)
    if tokenizer_dir is not None and fields["vocab_size"] < tokenizer_size:
        raise ValueError(
            f"vocab_size={fields['vocab_size']} is smaller than the tokenizer's {tokenizer_size} tokens in "
            f"{tokenizer_dir}; drop the vocab_size override or raise it"
        )
    if family == "qwen3_next" and "layer_types" in fields and "num_hidden_layers" not in overrides:
        fields["num_hidden_layers"] = len(fields["layer_types"])
    config = config_cls(**fields)

    torch.manual_seed(seed)
    tensors, config_dict, keep_fp32 = _random_hf_tensors(config, model_cls)
    tensors.update(_mtp_tensors(config, family, CONSTANT_INIT_NOISE_STD))
    fp32_name = (
        re.compile(r"(^|\.)(" + "|".join(map(re.escape, keep_fp32)) + r")(\.|$)") if keep_fp32 else None
    )
    tensors = {
        name: t.to(torch.float32 if fp32_name and fp32_name.search(name) else dtype).contiguous()
        for name, t in sorted(tensors.items())
    }

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config_dict["dtype"] = str(dtype).removeprefix("torch.")
    if family == "nemotron_h":
        config_dict["hybrid_override_pattern"] = config.hybrid_override_pattern
        config_dict["mtp_hybrid_override_pattern"] = config.mtp_hybrid_override_pattern
    (out / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        do_sample=False,
        max_new_tokens=256,
    ).save_pretrained(out)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def build_all(
    out_root: str | os.PathLike,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    train_path: str | os.PathLike | None = None,
    config_overrides: dict[str, dict] | None = None,
) -> dict[str, Path]:
    """Train the GSM8K tokenizer and write both shipped checkpoints under out_root/<CHECKPOINT_NAMES[family]>.

    config_overrides maps family -> overrides for write_random_checkpoint (tests use it to shrink the models).
    Returns {family: checkpoint dir}.
    """
    out_root = Path(out_root)
    tokenizer = train_tokenizer(train_path or default_gsm8k_train(), vocab_size)
    written = {}
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(tokenizer, tok_dir)
        for family, name in CHECKPOINT_NAMES.items():
            written[family] = write_random_checkpoint(
                out_root / name,
                family,
                (config_overrides or {}).get(family),
                seed=seed,
                tokenizer_dir=tok_dir,
            )
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runners.tools.tiny",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default="registry/checkpoints", help="folder receiving one folder per checkpoint"
    )
    parser.add_argument("--seed", type=int, default=0, help="torch seed for every random weight")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocabulary size")
    parser.add_argument("--train", default=None, help="GSM8K train.jsonl (default: $GSM8K_DIR or ../shared)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Writing model shards" bar per save is noise here
    for family, path in build_all(args.out, args.seed, args.vocab_size, args.train).items():
        size = (path / WEIGHTS_FILE).stat().st_size
        print(f"{family}: {path} (model.safetensors {size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
