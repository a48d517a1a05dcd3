"""Write a quantized checkpoint in a release's format from an unquantized one, calibrated on GSM8K train
prompts where the format has static scales.

    python -m runners.tools.quantize --format FORMAT SRC DST [--calib-samples 32]
        [--calib-tokens 32] [--device cuda] [--dtype bfloat16] [--data-dir DIR] [--exclude PATTERN ...]
        [--no-kv-cache] [--shard-size 5GB]
    (--fp8 = --format fp8; FORMAT: a quantized release format of registry.releases.FORMATS)

The formats and what each quantizes are runners.tools.formats' (one rule with runners.tools.synth); each
weight is quantized by its format's recipe (runners/engine/formats/), with the calibrated input amax where
the format has static scales: ``fp8`` ModelOpt's FP8 (below); Nemotron 3 Super's NVFP4 release, ModelOpt's
MIXED_PRECISION (routed experts NVFP4 with ModelOpt's recipe, ``input_scale`` = calibrated amax / (448 * 6);
Mamba in / out projections, shared experts and MLPs FP8 as below; NemotronH only); ``block_fp8`` Qwen's block
FP8 (128 x 128 ``weight_scale_inv`` in bfloat16, dynamic activations: no calibration; Qwen3-Next only).

Post-training quantization as ModelOpt's FP8 recipe does it (max calibration; vLLM's modelopt.py reads the
result): each quantized linear layer / expert projection gets

- ``weight`` float8_e4m3fn = clamp(W / weight_scale, -448, 448), ``weight_scale`` = amax(|W|) / 448
  (per tensor; per expert for routed experts);
- ``input_scale`` = amax of its input activations over the calibration run / 448 (static activation
  quantization; an expert that no calibration token reached takes the largest input scale of its block's
  experts of that projection, and the count is recorded);
- with the KV cache (default on), every attention block ``k_proj.k_scale`` / ``v_proj.v_scale`` = amax of the
  keys / values it wrote into the KV cache (after norm and RoPE) / 448.

Calibration runs the unquantized model through the engine (``runners.Engine``) on ``--calib-samples`` GSM8K
train questions, each after 5 other train examples in lm-eval's few-shot layout, generating
``--calib-tokens`` greedy tokens with MTP drafting when the checkpoint has an MTP module, so prefill, decode,
verify and the MTP module's attention are all seen; forward pre-hooks record the linear inputs, the MoE blocks
record per-expert inputs, and the KV caches record what is written.

What stays in the source dtype is the exclude list written into the checkpoint (``hf_quant_config.json``
``exclude_modules`` and config.json ``quantization_config.ignore``; for MIXED_PRECISION also
``quantized_layers``, for block_fp8 ``modules_to_not_convert``); the engine's loader reads that list, so what
it runs quantized is what
the list says (runners.engine.quant.quantization_targets, one rule for both). The FP8 default list
(runners.tools.formats.RELEASE_EXCLUDES) follows the FP8 release of Nemotron 3 Super (NVIDIA's model
card: MoE experts, shared experts and
Mamba in / out projections in FP8; attention projections, MoE latent projections, router, Mamba conv,
embeddings and output layer in BF16) and ModelOpt's defaults for other models (router gates, Qwen3-Next's
``shared_expert_gate``, convolutions and the LM head unquantized). Our additions, both families: the MTP
module stays in BF16 (the releases' cards do not say; drafting quality is what acceptance measures) and, for
Qwen3-Next, ``linear_attn.in_proj_ba`` (the 2 HV-row projection of the decay and write-strength gates,
router-like and negligible in cost). ``--exclude`` adds patterns (fnmatch, checkpoint names).

Outputs in DST: the tensors (quantized ones replaced, the others byte-identical, shards of ``--shard-size``
with an index when more than one), config.json with ``quantization_config`` (ModelOpt's flat form:
``quant_method: modelopt, quant_algo: FP8, kv_cache_scheme, ignore``), ``hf_quant_config.json`` (ModelOpt's
file), the source's tokenizer / generation config / synth.json, and ``quantize.json`` (the command, the
calibration data and statistics). Errors (missing data, a source already quantized) exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels.quant.fp8 import FP8_MAX
from registry.checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    HF_QUANT_CONFIG_FILE,
    INDEX_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    tensor_files,
)
from registry.errors import UserError
from registry.hf_config import FORMAT_BLOCK_FP8, FORMAT_FP8, FORMAT_NVFP4
from runners.engine.engine import Engine
from runners.engine.loader import load_model, read_config
from runners.engine.models.attention import KVCache
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.moe import EXPERT_KINDS, MoE
from runners.engine.options import EngineOptions
from runners.engine.quant import QuantTargets, quantization_targets
from runners.tools.formats import (
    FORMATS,
    FormatError,
    block_fp8_not_converted,
    quant_config_files,
    quantize_weight,
    release_rule,
)

log = logging.getLogger("runners.tools.quantize")

RECIPE_FILE = "quantize.json"
COPIED_FILES = (GENERATION_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "synth.json")
NUM_FEWSHOT = 5
class QuantizeError(UserError):
    """A quantizer input problem (source, data, options): `problem` and `fix`, exit status 2."""


# ------------------------------------------------------------------------------------------------ calibration


class AmaxRecorder:
    """Running maxima of |activation| on the device (no host synchronisation until :meth:`values`)."""

    def __init__(self) -> None:
        self.amax: dict[str, torch.Tensor] = {}

    def merge(self, key: str, m: torch.Tensor) -> None:
        """Fold a maximum (0-dim, or [E] per expert) into ``key``'s running maximum."""
        m = m.detach().float()
        self.amax[key] = m if key not in self.amax else torch.maximum(self.amax[key], m)

    def update(self, key: str, x: torch.Tensor) -> None:
        if x.numel():
            self.merge(key, x.detach().abs().amax())

    def values(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.amax.items()}


class _CalibratingMoE(MoE):
    """An MoE block during calibration: its routed experts computed by the per-expert loop of
    ``runners.engine.models.moe.moe_experts_ref`` (unquantized, host-synchronising: calibration only),
    recording per
    expert the amax of its input rows (``<prefix>experts.in``: what up and gate read) and of its
    down-projection input (``<prefix>experts.down_in``), [E] each, in ``recorder``."""

    recorder: AmaxRecorder
    calib_prefix: str

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        n, k = indices.shape
        E = self.experts_up.shape[0]
        expert = indices.flatten()
        order = torch.argsort(expert, stable=True)
        token, w = order // k, weights.flatten()[order]
        in_max = torch.zeros(E, device=h.device)
        down_max = torch.zeros(E, device=h.device)
        out = torch.zeros(n, h.shape[-1], dtype=torch.float32, device=h.device)
        start = 0
        for e, cnt in enumerate(torch.bincount(expert, minlength=E).tolist()):
            if cnt == 0:
                continue
            tok = token[start : start + cnt]
            x = h[tok]
            in_max[e] = x.abs().amax().float()
            up = x @ self.experts_up[e].T
            a = self.act(up) if self.experts_gate is None else self.act(x @ self.experts_gate[e].T) * up
            down_max[e] = a.abs().amax().float()
            out.index_add_(0, tok, (a @ self.experts_down[e].T).float() * w[start : start + cnt, None])
            start += cnt
        self.recorder.merge(self.calib_prefix + "in", in_max)
        self.recorder.merge(self.calib_prefix + "down_in", down_max)
        return out.to(h.dtype)


def _calibration_prompts(tokenizer_path: Path, data_dir: str | None, n: int, seed: int) -> tuple[list, str]:
    """``n`` GSM8K train prompts in lm-eval's 5-shot layout (5 other train examples, then the question), as
    token ids; and the train file used. Raises QuantizeError when no GSM8K train split is found."""
    from tokenizers import Tokenizer

    from runners.tools.train import (
        FEWSHOT_DELIMITER,
        format_example,
        format_prompt,
        read_gsm8k,
        resolve_train_file,
    )

    try:
        train = resolve_train_file(data_dir)
        rows = read_gsm8k(train)
    except (FileNotFoundError, ValueError) as e:
        raise QuantizeError(f"calibration needs the GSM8K train split: {e}",
                            "pass --data-dir DIR (a folder with train.jsonl) or set GSM8K_DIR") from None
    need = n * (1 + NUM_FEWSHOT)  # each question with NUM_FEWSHOT examples of its own
    if len(rows) < need:
        raise QuantizeError(f"{train} has {len(rows)} rows; --calib-samples {n} needs {need}",
                            "lower --calib-samples")
    rng = random.Random(seed)
    picks = rng.sample(range(len(rows)), n + NUM_FEWSHOT * n)
    tok = Tokenizer.from_file(str(tokenizer_path))
    prompts = []
    for i in range(n):
        q = rows[picks[i]]
        shots = [rows[j] for j in picks[n + NUM_FEWSHOT * i : n + NUM_FEWSHOT * (i + 1)]]
        text = FEWSHOT_DELIMITER.join([format_example(r["question"], r["answer"]) for r in shots]
                                      + [format_prompt(q["question"])])
        prompts.append(tok.encode(text).ids)
    return prompts, str(train)


def calibrate(
    model: HybridLM,
    targets: QuantTargets,
    prompts: list[list[int]],
    *,
    new_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int = 16,
) -> dict[str, torch.Tensor]:
    """Run ``prompts`` through ``model`` (an Engine with MTP drafting when the model has MTP weights) and
    return the activation maxima: ``<ckpt module>`` for each target linear's input, ``<prefix>experts.in`` /
    ``<prefix>experts.down_in`` [E] for each target MoE, ``<ckpt attn>k_proj.k`` / ``v_proj.v`` for each
    target attention's cached keys / values. The model is restored afterwards (hooks removed, classes
    back)."""
    rec = AmaxRecorder()
    hooks = []
    for _, ckpt, linear in targets.linears:
        hooks.append(linear.register_forward_pre_hook(lambda _m, args, key=ckpt: rec.update(key, args[0])))
    for _, prefix, moe in targets.moes:
        moe.__class__ = _CalibratingMoE
        moe.recorder, moe.calib_prefix = rec, prefix + "experts."
    draft_len = 3 if model.mtp is not None else 0
    options = EngineOptions(dtype=dtype, draft_len=draft_len, max_batch_size=min(batch_size, len(prompts)),
                            max_seq_len=max(map(len, prompts)) + new_tokens + draft_len + 1)
    engine = Engine(model, options, device=device)
    kv_keys = {}
    for _, ckpt, attn in targets.attentions:
        for block in list(model.layers) + (list(model.mtp.blocks) if model.mtp is not None else []):
            if block.mixer is attn:
                kv_keys[block.cache_index] = ckpt
    for idx, layer in engine.cache.layers.items():
        if isinstance(layer, KVCache) and idx in kv_keys:
            layer.write = _recording_write(layer, rec, kv_keys[idx])
    try:
        engine.generate(prompts, new_tokens, stop_token_ids=[])
    finally:
        for h in hooks:
            h.remove()
        for _, _, moe in targets.moes:
            moe.__class__ = MoE
            del moe.recorder, moe.calib_prefix
    return rec.values()


def _recording_write(layer: KVCache, rec: AmaxRecorder, ckpt: str) -> Callable:
    """``layer.write`` that first records the amax of the keys / values of live rows (not the scratch row)."""
    write = layer.write
    scratch = layer.k.shape[0] - 1

    def recording(rows, pos, k, v):
        live = rows != scratch
        rec.update(ckpt + "k_proj.k", k[live])
        rec.update(ckpt + "v_proj.v", v[live])
        write(rows, pos, k, v)

    return recording


# ------------------------------------------------------------------------------------------------ writing


def _scale(amax: torch.Tensor | float) -> torch.Tensor:
    """amax / 448 as float32 (at least 1e-12: an all-zero tensor quantizes to zeros)."""
    return (torch.as_tensor(amax, dtype=torch.float32) / FP8_MAX).clamp(min=1e-12)


def quantized_tensors(
    targets: QuantTargets, amax: dict[str, torch.Tensor], kv: bool
) -> tuple[dict[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]], dict[str, torch.Tensor], dict]:
    """How each checkpoint weight of a quantized module is rewritten in its format (``targets.formats``):
    ``{weight name: f(tensor) -> {name: tensor}}`` (runners.tools.formats.quantize_weight: the quantized
    weight and its scales, static input scales from the calibration maxima ``amax``), the extra tensors (k / v
    scales when ``kv``) and statistics (uncalibrated experts and linears)."""
    rewrite: dict[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]] = {}
    extra: dict[str, torch.Tensor] = {}
    stats = {"quantized_linears": len(targets.linears), "quantized_moe_blocks": len(targets.moes),
             "uncalibrated_experts": 0, "uncalibrated_linears": []}

    def make(fmt: str, module: str, in_amax: torch.Tensor) -> Callable:
        return lambda w: quantize_weight(fmt, module, w, in_amax)

    for _, ckpt, _ in targets.linears:
        a = amax.get(ckpt)
        if a is None or float(a) == 0.0:
            stats["uncalibrated_linears"].append(ckpt)  # never run by the calibration (e.g. unused block)
            a = torch.tensor(FP8_MAX)  # FP8 input scale 1.0
        rewrite[f"{ckpt}.weight"] = make(targets.formats[ckpt], ckpt, a)
    for _, prefix, moe in targets.moes:
        kinds = [k for k in EXPERT_KINDS if getattr(moe, f"experts_{k}") is not None]
        E = moe.experts_up.shape[0]
        zeros = torch.zeros(E)
        for kind in kinds:
            per = amax.get(prefix + ("experts.down_in" if kind == "down" else "experts.in"), zeros).clone()
            missing = per == 0
            if bool(missing.all()):
                per[:] = FP8_MAX
            elif bool(missing.any()):
                per[missing] = per.max()
            if kind == "up":
                stats["uncalibrated_experts"] += int(missing.sum())
            for e in range(E):
                module = f"{prefix}experts.{e}.{kind}_proj"
                rewrite[f"{module}.weight"] = make(targets.formats[prefix], module, per[e])
    if kv:
        for _, ckpt, _ in targets.attentions:
            for t in ("k", "v"):
                a = amax.get(f"{ckpt}{t}_proj.{t}")
                extra[f"{ckpt}{t}_proj.{t}_scale"] = _scale(FP8_MAX if a is None or float(a) == 0 else a)
    return rewrite, extra, stats


def _save_shards(shards: list[dict[str, torch.Tensor]], dst: Path) -> None:
    from safetensors.torch import save_file

    if len(shards) == 1:
        save_file(shards[0], str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")


def write_quantized_checkpoint(
    src: Path, dst: Path, rewrite: dict[str, Callable], extra: dict[str, torch.Tensor], *,
    device: torch.device, shard_bytes: int,
) -> int:
    """Copy every tensor of ``src`` into shards under ``dst``, rewriting the quantized weights on ``device``
    (the others keep their bytes and dtype) and adding ``extra``; returns the bytes written. Shards are
    written as they fill (host memory holds one shard), the index last."""
    from safetensors import safe_open

    files = tensor_files(src)
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    missing = set(rewrite) - set(files)
    if missing:
        raise QuantizeError(f"{src}: tensors {sorted(missing)[:4]} are missing", "use a complete checkpoint")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = [0]
    total = 0

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal total
        n = t.numel() * t.element_size()
        if size[-1] and size[-1] + n > shard_bytes:
            shards.append({})
            size.append(0)
        shards[-1][name] = t.contiguous()
        size[-1] += n
        total += n

    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(names):
                t = st.get_tensor(name)
                if name in rewrite:
                    for n2, t2 in rewrite[name](t.to(device)).items():
                        add(n2, t2)
                else:
                    add(name, t)
    for name, t in extra.items():
        add(name, t)
    _save_shards(shards, dst)
    return total


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    fmt: str = "fp8",
    calib_samples: int = 32,
    calib_tokens: int = 32,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    data_dir: str | None = None,
    exclude: list[str] | None = None,
    kv_cache: bool = True,
    shard_bytes: int = 5 * 10**9,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Quantize checkpoint ``src`` into ``dst`` in release format ``fmt`` (a quantized one of
    registry.releases.FORMATS: runners.tools.formats; see the module docstring); returns the recipe written
    to ``dst/quantize.json``.
    Block FP8 (dynamic activations) needs no calibration and runs none.

    Raises:
        QuantizeError: src already quantized, dst equal to src, bad options, a format the family has no
            release rule for, no GSM8K train split.
        registry.checkpoint.CheckpointError: an unreadable source checkpoint.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise QuantizeError(f"DST {dst} is the source checkpoint",
                            "write the quantized checkpoint to another folder")
    if calib_samples < 1 or calib_tokens < 1:
        raise QuantizeError(f"--calib-samples {calib_samples} and --calib-tokens {calib_tokens} must be >= 1",
                            "pass positive values")
    if fmt not in FORMATS or fmt == "bf16":
        raise QuantizeError(f"--format {fmt!r} is not a quantized format",
                            f"use one of {', '.join(f for f in FORMATS if f != 'bf16')}")
    config = read_config(src)
    if config.quantization is not None:
        q = config.quantization
        raise QuantizeError(f"{src} is already quantized ({q.format} {q.algo})",
                            "quantize an unquantized (BF16 / FP32) checkpoint")
    try:
        rule = release_rule(config.family, fmt, kv_cache=kv_cache, exclude=tuple(exclude or ()))
    except FormatError as e:
        raise QuantizeError(str(e), "use a format the family has a release in") from None
    calibrated = rule.activation_scheme == "static"
    dev = torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    say(f"loading {src} ({dtype}, {device})")
    model = load_model(src, dtype=dtype, device=dev)
    targets = quantization_targets(model, rule)
    kv = kv_cache and rule.kv_cache_quant == "fp8"
    say(f"{fmt}: {len(targets.linears)} linear layers, {len(targets.moes)} MoE blocks; KV scales for "
        f"{len(targets.attentions) if kv else 0} attention blocks; kept in {dtype}: "
        f"{list(rule.exclude_modules)}")
    amax: dict[str, torch.Tensor] = {}
    prompts, train_file, t_cal = [], None, 0.0
    if calibrated:
        prompts, train_file = _calibration_prompts(src / TOKENIZER_FILE, data_dir, calib_samples, seed)
        t_cal = time.perf_counter()
        with torch.inference_mode():
            amax = calibrate(model, targets, prompts, new_tokens=calib_tokens, device=dev, dtype=dtype)
        t_cal = time.perf_counter() - t_cal
        say(f"calibrated on {len(prompts)} GSM8K train prompts ({sum(map(len, prompts))} prompt tokens, "
            f"{calib_tokens} generated each) in {t_cal:.1f} s")
    rewrite, extra, stats = quantized_tensors(targets, amax, kv)
    modules = {ckpt: targets.formats[ckpt] for _, ckpt, _ in targets.linears}
    modules.update({name.removesuffix(".weight"): targets.formats[prefix] for _, prefix, _ in targets.moes
                    for name in rewrite if name.startswith(prefix + "experts.")})
    del model, targets  # the writer reads the source files again; free the device for it
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    dst.mkdir(parents=True, exist_ok=True)
    for stale in list(dst.glob("*.safetensors")) + [dst / INDEX_FILE, dst / HF_QUANT_CONFIG_FILE]:
        stale.unlink(missing_ok=True)
    t_w = time.perf_counter()
    with torch.inference_mode():
        total = write_quantized_checkpoint(src, dst, rewrite, extra, device=dev, shard_bytes=shard_bytes)
    t_w = time.perf_counter() - t_w
    raw = json.loads((src / CONFIG_FILE).read_text())
    not_converted = (block_fp8_not_converted(rule, list(tensor_files(src)))
                     if rule.weight_block_size is not None else None)
    flat, nested = quant_config_files(rule, modules=modules, not_converted=not_converted)
    raw["quantization_config"] = flat
    (dst / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
    if nested is not None:
        (dst / HF_QUANT_CONFIG_FILE).write_text(json.dumps(nested, indent=2) + "\n")
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    recipe = {
        "command": "python -m runners.tools.quantize " + " ".join(sys.argv[1:]) if sys.argv else None,
        "source": str(src),
        "format": {FORMAT_FP8: "modelopt FP8 (per-tensor weight scales, static input scales)",
                   FORMAT_NVFP4: "modelopt MIXED_PRECISION (NVFP4 routed experts, FP8 per-tensor elsewhere)",
                   FORMAT_BLOCK_FP8: "fp8 128 x 128 blocks (bfloat16 weight_scale_inv), dynamic activations"
                   }[fmt],
        "kv_cache": "fp8" if kv else None,
        "exclude_modules": list(rule.exclude_modules),
        "calibration": None if not calibrated else {
            "train_file": train_file, "samples": calib_samples, "few_shot": NUM_FEWSHOT,
            "new_tokens": calib_tokens, "seed": seed, "prompt_tokens": sum(map(len, prompts)),
            "device": str(dev), "dtype": str(dtype).removeprefix("torch.")},
        "counts": {k: (len(v) if isinstance(v, list) else v) for k, v in stats.items()},
        "uncalibrated_linears": stats["uncalibrated_linears"] if calibrated else [],
        "bytes": total,
        "seconds": {"calibration": round(t_cal, 2), "write": round(t_w, 2),
                    "total": round(time.perf_counter() - t0, 2)},
    }
    (dst / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    say(f"wrote {dst}: {total / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s"
        + (f" ({stats['uncalibrated_experts']} experts without calibration tokens took their block's max "
           "input scale)" if calibrated else ""))
    return recipe


def quantize_fp8_checkpoint(src: str | Path, dst: str | Path, **kwargs: Any) -> dict[str, Any]:
    """:func:`quantize_checkpoint` in ModelOpt's FP8 format (same keyword arguments but ``fmt``)."""
    return quantize_checkpoint(src, dst, fmt="fp8", **kwargs)


def main(argv: list[str] | None = None) -> int:
    from runners.tools.synth import parse_size

    p = argparse.ArgumentParser(prog="python -m runners.tools.quantize", description=__doc__.split("\n\n")[0])
    fmt = p.add_mutually_exclusive_group(required=True)
    fmt.add_argument("--format", choices=[f for f in FORMATS if f != "bf16"],
                     help="the release format to write (runners/tools/formats.py)")
    fmt.add_argument("--fp8", action="store_const", dest="format", const="fp8", help="= --format fp8")
    p.add_argument("src", help="unquantized HF checkpoint folder")
    p.add_argument("dst", help="folder for the quantized checkpoint (created)")
    p.add_argument("--calib-samples", type=int, default=32, help="GSM8K train prompts (default 32)")
    p.add_argument("--calib-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (calibration and quantization)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="calibration dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--data-dir", default=None,
                   help="GSM8K folder (default: $GSM8K_DIR, else ../shared/data/gsm8k)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="also keep these checkpoint modules unquantized (fnmatch); repeatable")
    p.add_argument("--no-kv-cache", action="store_true", help="no k / v scales (no FP8 KV cache declared)")
    p.add_argument("--shard-size", default="5GB", help="bytes per output shard (default 5GB)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        quantize_checkpoint(
            args.src, args.dst, fmt=args.format, calib_samples=args.calib_samples,
            calib_tokens=args.calib_tokens,
            device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None,
            data_dir=args.data_dir, exclude=args.exclude, kv_cache=not args.no_kv_cache,
            shard_bytes=parse_size(args.shard_size), seed=args.seed,
        )
    except UserError as e:
        print(f"error: {e.problem}\n  fix: {e.fix}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
