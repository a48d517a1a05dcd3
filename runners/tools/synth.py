"""Random-weight checkpoints at the released dimensions of Nemotron 3 Super and Qwen3-Next-80B-A3B, written
in the released HF layout, so the engine can be measured at real sizes without the weights.

    python -m runners.tools.synth --family nemotron_h --out DIR [--num-layers 22] [--num-experts 256]
        [--format FORMAT] [--dtype bfloat16] [--device cuda] [--shard-size 5GB] [--seed 0]
        [--set KEY=VALUE ...]

What is written (what the engine's loader, transformers and other engines read from a release):
- ``config.json``: the release's fields and values (:data:`RELEASE_CONFIGS`: NemotronH with
  ``hybrid_override_pattern`` / ``mtp_hybrid_override_pattern`` and the legacy float ``Infinity`` token;
  Qwen3-Next with ``full_attention_interval``, top-level ``rope_theta`` / ``partial_rotary_factor``), except
  what the options change: ``--num-layers`` cuts the layer layout proportionally (:func:`cut_pattern`: the
  NemotronH pattern keeps its ratio of M / E / * with at least one of each; Qwen3-Next keeps one
  full-attention layer per ``full_attention_interval``), ``--num-experts`` reduces the routed experts
  (top-k capped at it), ``--set`` replaces any field (tests shrink hidden sizes with it), and the token ids
  follow the tokenizer written beside it (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2).
- ``model-0000i-of-0000n.safetensors`` shards of about ``--shard-size`` bytes plus
  ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), tensors named as the releases
  name them, the ``mtp.*`` module included (names from the loader's own mapping,
  ``runners.engine.models.<family>.checkpoint_targets``, so every name the loader expects is written).
  Shards are
  generated and written one at a time: the host never holds more than one shard.
- ``--format``: the release's weight format (registry.releases.FORMATS, described in runners.tools.formats:
  ``fp8`` Nemotron 3 Super FP8's ModelOpt layout, its NVFP4 release's (MIXED_PRECISION) layout, ``block_fp8``
  Qwen3-Next FP8's 128 x 128 blocks; default ``bf16``): every weight the release quantizes is generated as
  above in ``--dtype``, then quantized on ``--device`` (its scale tensors written beside it, names and
  dtypes as the release's), KV-cache scales where the release has them, and config.json's
  ``quantization_config`` (plus ``hf_quant_config.json`` for ModelOpt's formats) written as the release
  writes them.
- ``tokenizer.json`` / ``tokenizer_config.json``: the shipped GSM8K byte-level BPE tokenizer
  (registry/checkpoints/tiny_nemotron_h_mtp) padded with added tokens ``<|synth_i|>`` up to the vocab size,
  so GSM8K prompts encode exactly as with the tiny checkpoints and every id the model can emit decodes;
  ``generation_config.json``; ``synth.json`` (the recipe and the ``model.arch.*`` overrides a registry entry
  needs for a cut checkpoint).

Weights (seeded per tensor from ``--seed`` and the tensor name; values depend on the generating device):
N(0, 1/fan_in) for projections and experts (fan_in = product of all but the first dim), N(0, 1) embeddings,
RMSNorm scales at their identity (1, or 0 for Qwen3-Next's ``1 + w`` norms), Mamba2 / GDN ``A_log`` =
log U(1, 16) and ``dt_bias`` = softplus^-1 of a log-uniform dt in [1e-3, 1e-1] (the Mamba2 initialisation,
Dao & Gu 2024), ``D`` = 1, biases and the router's correction bias 0. Activations stay finite through all
layers (tests/test_synth.py checks logits at depth).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from registry.checkpoint import HF_QUANT_CONFIG_FILE as HF_QUANT_FILE
from registry.errors import UserError
from registry.releases import (
    BASE_TOKENIZER,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    EXPERT_KEYS,
    FORMATS,
    PAD_TOKEN_ID,
    RELEASE_CONFIGS,
    SUPER_V3_PATTERN,  # noqa: F401  (the tests' and benchmarks' name for it)
)
from registry.releases import write_tokenizer as _write_tokenizer
from runners.engine.dummy import (  # noqa: F401  (re-exported: the tools' and tests' names)
    FP32_ON_DISK,
    TensorSpec,
    init_tensor,
    tensor_specs,
)
from runners.tools.formats import quantize_weight

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SynthError(UserError):
    """Bad synth options or an unwritable --out: ``problem`` names the option, ``fix`` what to change; the CLI
    prints both and exits with status 2."""


QWEN3_NEXT_MIN_LAYERS = 2  # one Gated DeltaNet and one full-attention layer
MIN_EXPERTS = 1  # --num-experts: at least one routed expert


def pattern_layer_range(pattern: str) -> tuple[int, int]:
    """(fewest, most) layers :func:`cut_pattern` cuts the NemotronH layer pattern ``pattern`` to: one layer of
    each kind (letter) up to the whole pattern."""
    return len(set(pattern)), len(pattern)


def num_layers_range(family: str) -> tuple[int, int | None]:
    """(fewest, most) ``num_layers`` of a synthetic ``family`` model (:func:`synth_config`; most None: no
    upper bound): NemotronH's cut of the release's pattern (:func:`pattern_layer_range`), Qwen3-Next's
    :data:`QWEN3_NEXT_MIN_LAYERS` or more. CLIs with their own option names check their ranges with it.

    Raises:
        KeyError: a family not in :data:`RELEASE_CONFIGS`.
    """
    if family == "nemotron_h":
        return pattern_layer_range(RELEASE_CONFIGS[family]["hybrid_override_pattern"])
    if family not in RELEASE_CONFIGS:
        raise KeyError(f"family {family!r} is not one of {sorted(RELEASE_CONFIGS)}")
    return QWEN3_NEXT_MIN_LAYERS, None


def cut_pattern(pattern: str, num_layers: int) -> str:
    """A NemotronH layer pattern of ``num_layers`` layers in the proportions of ``pattern``.

    Each kind (letter) gets its share of ``num_layers`` by largest remainder, at least one; the kept layers of
    a kind are spread evenly over that kind's occurrences and keep their original order, so the cut pattern
    interleaves like the release (e.g. 22 of Super V3's 88: 10 M, 10 E, 2 *).

    Raises:
        SynthError: num_layers < number of kinds, or > len(pattern).
    """
    kinds = sorted(set(pattern), key=pattern.index)
    least, most = pattern_layer_range(pattern)
    if not least <= num_layers <= most:
        raise SynthError(
            f"--num-layers {num_layers}: the pattern {pattern!r} needs between {least} (one layer of "
            f"each kind {''.join(kinds)}) and {most} layers",
            f"use --num-layers between {least} and {most}",
        )
    positions = {c: [i for i, p in enumerate(pattern) if p == c] for c in kinds}
    quota = {c: len(positions[c]) * num_layers / len(pattern) for c in kinds}
    take = {c: max(1, math.floor(quota[c])) for c in kinds}
    while sum(take.values()) < num_layers:
        c = max((c for c in kinds if take[c] < len(positions[c])), key=lambda c: quota[c] - take[c])
        take[c] += 1
    while sum(take.values()) > num_layers:
        c = min((c for c in kinds if take[c] > 1), key=lambda c: quota[c] - take[c])
        take[c] -= 1
    keep = []
    for c in kinds:
        m, n = len(positions[c]), take[c]
        keep += [positions[c][min(m - 1, math.floor((i + 0.5) * m / n))] for i in range(n)]
    return "".join(pattern[i] for i in sorted(keep))


# config.json fields the engine's parser (registry/hf_config.py) reads that the release's config.json does not
# carry, with their JSON types: a --set may give them (e.g. an MLP width for a "-" layer of a cut pattern).
PARSER_ONLY_KEYS: dict[str, dict[str, tuple[type, ...]]] = {
    "nemotron_h": {"intermediate_size": (int,), "layers_block_type": (list,),
                   "mtp_layers_block_type": (list,)},
    "qwen3_next": {"layer_types": (list,), "rope_parameters": (dict,)},
}
# Integer fields that may be 0 (token ids, counts of optional parts); every other integer field is a size or a
# count that must be >= 1.
ZERO_OK_INT_KEYS = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "num_nextn_predict_layers", "n_shared_experts",
    "intermediate_size", "moe_shared_expert_intermediate_size", "shared_expert_intermediate_size",
})


_JSON_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
                    list: "a JSON list", dict: "a JSON object", type(None): "null"}


def _json_types(value: Any) -> tuple[type, ...]:
    """The JSON types a --set may give a field whose release value is ``value``."""
    if isinstance(value, bool):
        return (bool,)
    if isinstance(value, float):
        return (int, float)
    if value is None:
        return (dict, type(None))  # rope_scaling
    return (type(value),)


def _known_keys(family: str) -> dict[str, tuple[type, ...]]:
    """{config.json field a ``family`` config may set: the JSON types its value may have}."""
    return {k: _json_types(v) for k, v in RELEASE_CONFIGS[family].items()} | PARSER_ONLY_KEYS.get(family, {})


def check_overrides(family: str, overrides: dict[str, Any], *, other_families_ok: bool = False) -> None:
    """Check ``overrides`` (--set) of a ``family`` config before anything is built: every key is a field of
    the release's config.json (:data:`RELEASE_CONFIGS`) or one the engine's parser reads
    (:data:`PARSER_ONLY_KEYS`); with ``other_families_ok`` a field of the other family passes unchecked (one
    override set shared by both families: benchmarks/bench_e2e.py --synth-set). Every value has its field's
    JSON type (an integer field takes an integer, not a float, a string or a bool); numbers are finite,
    integers >= 1 (>= 0 for :data:`ZERO_OK_INT_KEYS`), floats >= 0.

    Raises:
        SynthError: the first bad key or value, naming it.
    """
    release = RELEASE_CONFIGS[family]
    known = _known_keys(family)
    for key, value in overrides.items():
        if key not in known and other_families_ok and any(key in _known_keys(f) for f in RELEASE_CONFIGS):
            continue
        if key not in known:
            raise SynthError(f"--set {key}={json.dumps(value)}: {key} is not a config.json field of {family}",
                             f"use one of: {', '.join(sorted(known))}")
        types = known[key]
        names = " or ".join(_JSON_TYPE_NAMES[t] for t in types)
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise SynthError(f"--set {key}={json.dumps(value)}: {key} takes {names}",
                             f"give {key} {names} (the release has {json.dumps(release.get(key))})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        least = 0 if isinstance(value, float) or key in ZERO_OK_INT_KEYS else 1
        if math.isnan(value) or math.isinf(value) or value < least:
            raise SynthError(f"--set {key}={json.dumps(value)}: {key} must be a finite number >= {least}",
                             f"give {key} a value >= {least} (the release has "
                             f"{json.dumps(release.get(key))})")


def synth_config(
    family: str,
    *,
    num_layers: int | None = None,
    num_experts: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json of a synthetic checkpoint: the release's, cut to ``num_layers`` layers and ``num_experts``
    routed experts (top-k capped at it), then ``overrides`` applied (checked by :func:`check_overrides`; a
    field of the other family is dropped). Validated by the engine's own parser.

    Raises:
        SynthError: unknown family, impossible layer / expert counts, an unknown override field or a value of
            the wrong type or range, or a config the engine rejects.
    """
    if family not in RELEASE_CONFIGS:
        raise SynthError(f"--family {family!r} is not known", f"use one of {sorted(RELEASE_CONFIGS)}")
    check_overrides(family, overrides or {}, other_families_ok=True)
    cfg = copy.deepcopy(RELEASE_CONFIGS[family])
    if num_layers is not None:
        if family == "nemotron_h":
            cfg["hybrid_override_pattern"] = cut_pattern(cfg["hybrid_override_pattern"], num_layers)
        else:
            if num_layers < QWEN3_NEXT_MIN_LAYERS:
                raise SynthError(
                    f"--num-layers {num_layers}: Qwen3-Next needs >= {QWEN3_NEXT_MIN_LAYERS} layers (one "
                    "Gated DeltaNet and one full-attention layer)",
                    f"use --num-layers {QWEN3_NEXT_MIN_LAYERS} or more",
                )
            cfg["full_attention_interval"] = min(cfg["full_attention_interval"], num_layers)
        cfg["num_hidden_layers"] = num_layers
    if num_experts is not None:
        n_key, k_key = EXPERT_KEYS[family]
        if num_experts < MIN_EXPERTS:
            raise SynthError(f"--num-experts {num_experts} must be >= {MIN_EXPERTS}",
                             f"use --num-experts {MIN_EXPERTS} or more")
        cfg[n_key] = num_experts
        cfg[k_key] = min(cfg[k_key], num_experts)
    known = _known_keys(family)
    cfg.update({k: v for k, v in (overrides or {}).items() if k in known})  # not the other family's fields
    if family == "nemotron_h":
        cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
    from registry.checkpoint import CheckpointError
    from registry.hf_config import HybridConfig

    try:
        HybridConfig.from_dict(cfg, source="synth config")
    except CheckpointError as e:
        raise SynthError(e.problem, "change --num-layers / --num-experts / --set") from None
    return cfg


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive specs grouped into shards of at most ``shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def write_tokenizer(out: Path, vocab_size: int, base: Path = BASE_TOKENIZER) -> int:
    """registry.releases.write_tokenizer (the base GSM8K tokenizer padded to ``vocab_size``) into ``out``;
    returns the base vocabulary size.

    Raises:
        SynthError: vocab_size smaller than the base tokenizer.
    """
    try:
        return _write_tokenizer(out, vocab_size, base)
    except ValueError as e:
        raise SynthError(str(e), "raise --set vocab_size to at least the base tokenizer's size") from None


def arch_overrides(config: dict[str, Any], family: str) -> list[str]:
    """``model.arch.<key>=<value>`` for every registry arch field in which ``config`` differs from the
    release (so a registry entry of the release accepts the cut checkpoint: ``run.py`` compares them)."""
    from registry.arch import arch_from_config
    from registry.hf_config import HybridConfig

    def flat(arch) -> dict[str, Any]:
        out = {}
        for k, v in asdict(arch).items() if hasattr(arch, "__dataclass_fields__") else vars(arch).items():
            if isinstance(v, dict):
                out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
            elif v is not None:
                out[k] = v
        return out

    got = flat(arch_from_config(HybridConfig.from_dict(config)))
    release = flat(arch_from_config(HybridConfig.from_dict(RELEASE_CONFIGS[family])))
    return [f"model.arch.{k}={v}" for k, v in got.items() if release.get(k) != v]


def _arch_overrides_or_note(config: dict[str, Any], family: str, say: Callable[[str], None]) -> list[str]:
    try:
        return arch_overrides(config, family)
    except ImportError as e:  # registry needs omegaconf / yaml, which a bare GPU image may lack
        say(f"note: model.arch.* overrides not computed ({e}); install the project's dependencies for them")
        return []


@dataclass
class SynthResult:
    """What :func:`write_synthetic_checkpoint` wrote (bytes of the safetensors payload; wall seconds)."""

    path: str
    family: str
    num_params: int
    total_bytes: int
    num_shards: int
    seconds: float
    generate_seconds: float
    write_seconds: float
    arch_overrides: list[str] = field(default_factory=list)


@dataclass
class QuantLayout:
    """How a release format rewrites a checkpoint: ``rewrite`` {weight name: (module, format)} of the weights
    stored quantized, ``extra`` {name: tensor} added (KV-cache scales), and the quantization config files
    (``config_json``: config.json's ``quantization_config`` or None for bf16; ``hf_quant_config``)."""

    rewrite: dict[str, tuple[str, str]] = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    config_json: dict[str, Any] | None = None
    hf_quant_config: dict[str, Any] | None = None


def release_layout(config: dict[str, Any], fmt: str, names: list[str]) -> QuantLayout:
    """The :class:`QuantLayout` of release format ``fmt`` for a checkpoint of ``config`` whose unquantized
    tensors are ``names``: what is quantized is decided by the engine's own rule
    (``runners.engine.quant.quantization_targets``) applied to the release's config
    (``runners.tools.formats.release_rule``), so the written files and the loader agree by construction.

    Raises:
        SynthError: an unknown format, or one the family has no release in.
    """
    from registry.hf_config import HybridConfig
    from runners.engine.dummy import quantized_weights
    from runners.engine.models.hybrid import HybridLM
    from runners.engine.quant import quantization_targets
    from runners.tools.formats import (
        FORMATS,
        FormatError,
        block_fp8_not_converted,
        kv_scale_modules,
        quant_config_files,
        release_rule,
    )

    if fmt not in FORMATS:
        raise SynthError(f"--format {fmt!r} is not known", f"use one of {', '.join(FORMATS)}")
    if fmt == "bf16":
        return QuantLayout()
    hc = HybridConfig.from_dict(config, source="synth config")
    try:
        rule = release_rule(hc.family, fmt)
    except FormatError as e:
        raise SynthError(str(e), f"use a --format the {hc.family} releases ship (or --format bf16)") from None
    with torch.device("meta"):
        model = HybridLM(hc, with_mtp=hc.num_nextn_predict_layers > 0)
    targets = quantization_targets(model, rule)
    layout = QuantLayout(rewrite=quantized_weights(model, rule))
    modules = dict(layout.rewrite.values())
    for attn in kv_scale_modules(rule, [ckpt for _, ckpt, _ in targets.attentions]):
        for t in ("k", "v"):
            layout.extra[f"{attn}{t}_proj.{t}_scale"] = torch.tensor(1.0)
    not_converted = block_fp8_not_converted(rule, names) if rule.weight_block_size is not None else None
    layout.config_json, layout.hf_quant_config = quant_config_files(rule, modules=modules,
                                                                    not_converted=not_converted)
    return layout


def _remove_empty(dirs) -> None:
    """rmdir each of ``dirs`` (innermost first), keeping any that is not empty (another writer's files)."""
    for d in dirs:
        with contextlib.suppress(OSError):
            d.rmdir()


def _make_out_dir(out: Path) -> list[Path]:
    """Create ``out`` (and missing parents); returns the folders created, innermost first.

    Raises:
        SynthError: ``out`` is a file, or cannot be created (read-only filesystem, no permission, /proc).
    """
    missing = [d for d in (out, *out.parents) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(d for d in missing if d.is_dir())  # those this call created before it failed
        what = "is a file" if out.is_file() else f"cannot be created ({e.strerror or e})"
        raise SynthError(f"--out {out} {what}",
                         "give --out a new or existing folder on a writable disk") from None
    return missing


def write_synthetic_checkpoint(
    out_dir: str | Path,
    family: str,
    *,
    num_layers: int | None = None,
    num_experts: int | None = None,
    overrides: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    shard_bytes: int = 5 * 10**9,
    seed: int = 0,
    check_disk: bool = True,
    log: Callable[[str], None] | None = None,
    fmt: str = "bf16",
) -> SynthResult:
    """Write a synthetic checkpoint (see the module docstring) into ``out_dir`` (created; its files are
    overwritten). Tensors are generated on ``device`` and written shard by shard; ``fmt`` the release format
    (runners.tools.formats.FORMATS).

    Raises:
        SynthError: bad options (a format the family has no release in included), or (``check_disk``) too
            little free disk space for the shards.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    config = synth_config(family, num_layers=num_layers, num_experts=num_experts, overrides=overrides)
    specs = tensor_specs(config, dtype)
    quant = release_layout(config, fmt, [s.name for s in specs])
    shards = plan_shards(specs, shard_bytes)
    from runners.tools.formats import stored_nbytes

    total = sum(stored_nbytes(quant.rewrite[s.name][1], s.shape) if s.name in quant.rewrite else s.nbytes
                for s in specs)  # on disk, in the release format
    created = _make_out_dir(out)
    if check_disk:
        free = shutil.disk_usage(out).free
        if total > free:
            _remove_empty(created)  # leave no folder of ours behind
            raise SynthError(
                f"the checkpoint needs {total / 1e9:.1f} GB but {out} has {free / 1e9:.1f} GB free",
                "use --num-layers / --num-experts (or an --out on a disk with more space)",
            )
    say = log or (lambda _msg: None)
    say(f"{family}: {len(specs)} tensors, {sum(math.prod(s.shape) for s in specs) / 1e9:.2f} B parameters, "
        f"{total / 1e9:.2f} GB in {len(shards)} shards -> {out}")
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json", out / HF_QUANT_FILE]:
        stale.unlink(missing_ok=True)  # an earlier checkpoint of another format in the same folder
    written = dict(config, quantization_config=quant.config_json) if quant.config_json else config
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")  # inf -> Infinity, as releases
    if quant.hf_quant_config is not None:
        (out / HF_QUANT_FILE).write_text(json.dumps(quant.hf_quant_config, indent=2) + "\n")
    gen = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out, config["vocab_size"])
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    t_gen = t_write = 0.0
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        ta = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for s in shard:
            t = init_tensor(s, seed, device)
            if s.name in quant.rewrite:
                tensors.update(quantize_weight(quant.rewrite[s.name][1], quant.rewrite[s.name][0], t))
            else:
                tensors[s.name] = t.cpu()
        if i == len(shards) - 1:
            tensors.update(quant.extra)
        tb = time.perf_counter()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        weight_map.update(dict.fromkeys(tensors, fname))
        tc = time.perf_counter()
        t_gen, t_write = t_gen + tb - ta, t_write + tc - tb
        say(f"  {fname}: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB "
            f"(generate {tb - ta:.1f} s, write {tc - tb:.1f} s)")
        del tensors
    # written last: a checkpoint interrupted while writing shards has no index and does not load
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    result = SynthResult(
        path=str(out),
        family=family,
        num_params=sum(math.prod(s.shape) for s in specs),
        total_bytes=total,
        num_shards=len(shards),
        seconds=time.perf_counter() - t0,
        generate_seconds=t_gen,
        write_seconds=t_write,
        arch_overrides=_arch_overrides_or_note(config, family, say),
    )
    recipe = {
        "family": family,
        "num_layers": num_layers,
        "num_experts": num_experts,
        "overrides": overrides or {},
        "format": fmt,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "seed": seed,
        "shard_bytes": shard_bytes,
        **{k: v for k, v in asdict(result).items() if k not in ("path", "family")},
    }
    (out / "synth.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return result


def synthetic_model(
    family: str,
    *,
    num_layers: int | None = None,
    num_experts: int | None = None,
    overrides: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model that ``runners.engine.loader.load_model(DIR, dtype=dtype, device=device, load_mtp=True)``
    returns
    for ``DIR`` = :func:`write_synthetic_checkpoint` ``(DIR, family, ..., dtype=dtype, device=device,
    seed=seed)`` with the same options, built without writing or reading a file: the model is built on the
    meta device, allocated on ``device`` (the loader's dtype rule: floating tensors in ``dtype``, the MoE
    router's in float32) and filled tensor by tensor from :func:`init_tensor` generated on ``device``. For
    release-size models whose checkpoint would not fit (or take minutes) on the disk beside the GPU
    (benchmarks/bench_e2e.py: quarter-depth Super V3 is 37 GB in bf16).

    Returns:
        (``HybridLM`` in eval mode with its MTP module, the config.json dict it was built from).

    Raises:
        SynthError: bad options (as :func:`synth_config`).
        ValueError: a config with tied embeddings (the releases do not tie them; this path does not re-tie).
    """
    from runners.engine.dummy import materialize_dummy, plan_dummy
    from runners.engine.models.config import HybridConfig

    config = synth_config(family, num_layers=num_layers, num_experts=num_experts, overrides=overrides)
    hc = HybridConfig.from_dict(config, source=f"synthetic {family}")
    plan = plan_dummy(hc, dtype=dtype, with_mtp=hc.num_nextn_predict_layers > 0)
    return materialize_dummy(plan, device, seed=seed), config


def parse_size(text: str) -> int:
    """Bytes of "5GB", "500MB", "2GiB" or a plain integer; raises ValueError for anything else."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    try:
        value = float(num) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(
            f"size {text!r}: use a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)"
        ) from None
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return int(value)


def _parse_set(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: use KEY=VALUE (VALUE as JSON, e.g. hidden_size=256)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runners.tools.synth", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=sorted(RELEASE_CONFIGS))
    p.add_argument("--out", required=True, help="checkpoint folder to write (created)")
    p.add_argument("--num-layers", type=int, default=None, help="layers (default: the release's)")
    p.add_argument("--num-experts", type=int, default=None, help="routed experts (default: the release's)")
    p.add_argument("--format", default="bf16", choices=list(FORMATS),
                   help="the release's weight format (runners/tools/formats.py; default bf16)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="where tensors are generated (cuda: seconds)")
    p.add_argument("--shard-size", default="5GB", help="bytes per shard, e.g. 5GB (default) or 500MB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="replace a config.json field (JSON value), e.g. --set hidden_size=256; repeatable")
    args = p.parse_args(argv)
    try:
        shard_bytes = parse_size(args.shard_size)
        overrides = _parse_set(args.set)
    except ValueError as e:
        p.error(str(e))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here; use --device cpu")
    try:
        check_overrides(args.family, overrides)  # strict: no field of another family
        r = write_synthetic_checkpoint(
            args.out, args.family, num_layers=args.num_layers, num_experts=args.num_experts,
            overrides=overrides, dtype=DTYPES[args.dtype], device=args.device, shard_bytes=shard_bytes,
            seed=args.seed, log=print, fmt=args.format,
        )
    except SynthError as e:
        print(e.format(), file=sys.stderr)
        return 2
    except OSError as e:  # --out became unwritable while writing: disk full, read-only, removed
        err = SynthError(f"writing {e.filename or args.out} failed: {e.strerror or e}",
                         "free space on the disk of --out or give --out a writable folder, then rerun")
        print(err.format(), file=sys.stderr)
        return 2
    print(json.dumps(asdict(r), indent=2))
    if r.arch_overrides:
        print("registry entry overrides for this checkpoint: " + " ".join(r.arch_overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
