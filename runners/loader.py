"""Load an HF checkpoint directory into a :class:`runners.models.hybrid.HybridLM`.

A checkpoint is ``config.json`` plus either ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). Loading is strict: every
tensor the model expects must be present with its exact shape, and every tensor on disk must be known. The
MTP tensors (``mtp.*``) form an optional group: a checkpoint without any of them loads for plain decoding;
one with some of them must have all of them. Every problem raises :class:`CheckpointError` naming the file
or tensor and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from runners.models.config import ConfigError, HybridConfig, family_module
from runners.models.hybrid import HybridLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MTP_PREFIX = "mtp."

# Tensors kept in float32 whatever the model dtype (transformers keeps the NemotronH router in fp32).
FP32_SUFFIXES = ("gate.weight", "gate.e_score_correction_bias")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file / tensor and the fix."""


def _list(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def read_config(path: str | Path) -> HybridConfig:
    """Parse ``<path>/config.json``; raises CheckpointError (wrapping the config problem)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: checkpoint directory not found; pass the path of an HF checkpoint dir"
        )
    try:
        return HybridConfig.from_pretrained(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e


def tensor_files(path: str | Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` of a checkpoint dir, from the index or the single file.

    Raises:
        CheckpointError: no weights file, a malformed index, a shard the index names but the dir lacks, a
            corrupt file, or an index entry whose shard does not hold the tensor.
    """
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f'{index}: not a safetensors index (needs a "weight_map" object): {e}; re-save the checkpoint'
            ) from e
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(
                    f"{shard}: shard listed in {INDEX_FILE} is missing; copy the complete "
                    "checkpoint (all shards)"
                )
        for shard, names in _group(files).items():
            on_disk = set(_keys(shard))
            absent = set(names) - on_disk
            if absent:
                raise CheckpointError(
                    f"{shard}: {INDEX_FILE} lists tensors this shard does not hold: "
                    f"{_list(absent)}; re-save the checkpoint or fix the index"
                )
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return {name: single for name in _keys(single)}
    raise CheckpointError(
        f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found; a checkpoint needs its "
        "safetensors weights next to config.json"
    )


def _group(files: dict[str, Path]) -> dict[Path, list[str]]:
    out: dict[Path, list[str]] = {}
    for name, f in files.items():
        out.setdefault(f, []).append(name)
    return out


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{file}: cannot read safetensors file ({e}); the file is corrupt or truncated, "
            "re-download or re-save it"
        ) from e


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_mtp: bool | None = None,
) -> HybridLM:
    """Build the model of ``<path>/config.json`` and fill it from the checkpoint's safetensors.

    Args:
        path: HF checkpoint directory.
        dtype: model dtype (the MoE router stays float32).
        device: where the model is placed.
        load_mtp: True requires the ``mtp.*`` tensors; False ignores them; None (default) loads them when
            the config declares MTP layers and the checkpoint has them.

    Returns:
        The model in eval mode; ``model.mtp`` is None when no MTP weights were loaded.

    Raises:
        CheckpointError: any problem with config.json, the files, or the tensors (names, shapes).
    """
    path = Path(path)
    config = read_config(path)
    files = tensor_files(path)
    mtp_on_disk = {n for n in files if n.startswith(MTP_PREFIX)}
    has_mtp_layers = bool(config.mtp_layer_types)
    if load_mtp is None:
        load_mtp = has_mtp_layers and bool(mtp_on_disk)
    if load_mtp and not has_mtp_layers:
        raise CheckpointError(
            f"{path / 'config.json'}: MTP weights requested but num_nextn_predict_layers is 0; "
            "set num_nextn_predict_layers (and mtp_hybrid_override_pattern) in config.json"
        )
    if load_mtp and not mtp_on_disk:
        raise CheckpointError(
            f"{path}: MTP (draft) weights requested but the checkpoint has no mtp.* tensors; "
            "use a checkpoint that ships its MTP module or turn speculative decoding off"
        )
    if not load_mtp and has_mtp_layers:
        files = {n: f for n, f in files.items() if not n.startswith(MTP_PREFIX)}
    model = HybridLM(config, with_mtp=load_mtp)
    targets = family_module(config.family, config.source).checkpoint_targets(model)
    unknown = set(files) - set(targets)
    if unknown:
        hint = (
            " (mtp.* tensors but config.json declares no MTP layers: set num_nextn_predict_layers)"
            if unknown & mtp_on_disk and not has_mtp_layers
            else ""
        )
        raise CheckpointError(
            f"{path}: unknown tensors {_list(unknown)}{hint}; the checkpoint does not match "
            f"config.json ({config.family}) -- check the layer pattern and sizes"
        )
    missing = set(targets) - set(files)
    if missing:
        raise CheckpointError(
            f"{path}: missing tensors {_list(missing)}; the checkpoint is incomplete or was "
            "saved for a different config.json"
        )

    with torch.no_grad():
        for shard, names in _group(files).items():
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in names:
                        dst = targets[name]
                        shape = tuple(f.get_slice(name).get_shape())
                        if shape != tuple(dst.shape):
                            raise CheckpointError(
                                f"{shard}: tensor {name} has shape {list(shape)}, config.json implies "
                                f"{list(dst.shape)}; the checkpoint does not match its config.json"
                            )
                        dst.copy_(f.get_tensor(name))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise CheckpointError(
                    f"{shard}: cannot read tensors ({e}); the file is corrupt, re-save it"
                ) from e
    model.to(device=device)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not name.endswith(FP32_SUFFIXES):
            t.data = t.data.to(dtype)
    return model.eval()
