"""The on-disk layout of an HF checkpoint directory, and the checks that need no weights loaded.

A checkpoint is ``config.json`` (+ ``generation_config.json``), ``tokenizer.json`` (+
``tokenizer_config.json``) and its safetensors weights: ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). The engine's loader
(runners.engine.loader) reads the tensors; the checks here run before it, and in `python -m registry
validate`.
Tensor names are read from the safetensors headers (safe_open with numpy: no torch needed).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from safetensors import SafetensorError, safe_open

from registry.errors import UserError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# NVIDIA ModelOpt's quantization config beside config.json (quantized checkpoints; hf_config.py reads it)
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"


class CheckpointError(UserError):
    """A checkpoint directory that cannot be loaded or run: `problem` names the file / tensor / key,
    `fix` what to do (re-save, copy the missing file, point model.checkpoint elsewhere)."""


def safetensors_index(path: str | Path) -> dict[str, Path] | None:
    """``{tensor name: shard path}`` from the directory's model.safetensors.index.json; None when the
    weights are one model.safetensors file (no index).

    Raises:
        CheckpointError: neither file exists, the index has no "weight_map" object, or a shard it lists is
            missing (the message counts the missing shards and names the first).
    """
    path = Path(path)
    index = path / INDEX_FILE
    if not index.is_file():
        if (path / WEIGHTS_FILE).is_file():
            return None
        raise CheckpointError(
            f"checkpoint directory {path} has no weights: neither {WEIGHTS_FILE} nor {INDEX_FILE}",
            "copy the safetensors weights next to config.json, or point model.checkpoint elsewhere",
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {str(name): path / str(shard) for name, shard in weight_map.items()}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f'{index}: not a safetensors index (needs a "weight_map" object): {e!r}',
                              "re-save the checkpoint (or restore its index file)") from None
    shards = sorted(set(files.values()))
    missing = [s for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(
            f"{missing[0]}: shard listed in {INDEX_FILE} is missing ({len(missing)} of {len(shards)} "
            "weight shards are)",
            "finish downloading the checkpoint (every shard of the index), or point model.checkpoint "
            "elsewhere",
        )
    return files


def check_checkpoint_dir(path: str | Path, setting: str) -> None:
    """Raise CheckpointError unless `path` is a complete HF checkpoint directory: config.json,
    tokenizer.json and the weights (model.safetensors, or the index and every shard it lists).

    setting: the setting that points at `path` (e.g. "model.checkpoint"), named in every problem.
    """
    path = Path(path)
    if path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is a file (set by {setting}); a checkpoint is the directory that holds the "
            "weights with config.json and tokenizer.json",
            f"point {setting.split()[0]} at the directory holding it: {path.parent}",
        )
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint directory {path} does not exist (set by {setting})",
            "point model.checkpoint at an HF checkpoint directory, or set models_root / $LLM_MODELS_ROOT to "
            "the folder that holds it (embedded tiny checkpoints: python -m runners.tools.tiny "
            "rebuilds them)",
        )
    for name in (CONFIG_FILE, TOKENIZER_FILE):
        if not (path / name).is_file():
            raise CheckpointError(
                f"checkpoint directory {path} has no {name} (set by {setting})",
                f"copy the complete checkpoint (with {name}) there, or point model.checkpoint elsewhere",
            )
    try:
        safetensors_index(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e.problem} (set by {setting})", e.fix) from None


def tensor_files(path: str | Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` of a checkpoint dir, from the index or the single file; every
    file's header is read (so a truncated or corrupt file is found here, before any tensor is loaded).

    Raises:
        CheckpointError: the problems of safetensors_index, a corrupt or truncated file, or an index entry
            whose shard does not hold the tensor.
    """
    files = safetensors_index(path)
    if files is None:
        single = Path(path) / WEIGHTS_FILE
        return {name: single for name in _keys(single)}
    for shard in sorted(set(files.values())):
        absent = {n for n, f in files.items() if f == shard} - set(_keys(shard))
        if absent:
            raise CheckpointError(
                f"{shard}: {INDEX_FILE} lists tensors this shard does not hold: {short_list(absent)}",
                "re-save the checkpoint or fix the index",
            )
    return files


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="numpy") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors file ({e}); the file is corrupt or truncated",
                              "re-download or re-save it") from None


def short_list(names, limit: int = 8) -> str:
    """Up to `limit` sorted names, and how many more."""
    names = sorted(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_tokenizer(path: str | Path) -> None:
    """Load a checkpoint's tokenizer.json once (tokenizers library), so a broken file is a CheckpointError
    before the model is loaded, not a traceback during the evaluation."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise CheckpointError(
            f"{path} cannot be loaded by the tokenizers library: {e}",
            "restore the checkpoint's tokenizer.json (or point model.checkpoint at a complete one)",
        ) from None


def _sha256_file(path: Path) -> str | None:
    """sha256 of a small file's bytes; None when the file does not exist."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def safetensors_header(file: Path) -> bytes:
    """The raw header of a safetensors file: its 8-byte little-endian length and the JSON it announces
    (tensor names, dtypes, shapes and byte offsets; the format's own layout, huggingface/safetensors)."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 100 << 20))


def checkpoint_fingerprint(path: str | Path) -> dict[str, str | None]:
    """What identifies a checkpoint's contents without reading its tensors (the resume fingerprint):

    - ``weights_sha256``: sha256 over the index file (when sharded) and, per weight file in name order, its
      name, size, modification time (ns) and safetensors header. Any rewrite of a weight file -- new bytes
      behind the same header included -- changes its size or mtime; a copy elsewhere changes the path,
      which the run's fingerprint holds separately.
    - ``config_sha256``, ``generation_config_sha256``, ``tokenizer_sha256``: sha256 of those files (None
      when absent).

    Raises CheckpointError for the layout problems of safetensors_index.
    """
    path = Path(path)
    files = safetensors_index(path)
    weight_files = sorted(set(files.values())) if files is not None else [path / WEIGHTS_FILE]
    h = hashlib.sha256()
    if files is not None:
        h.update((path / INDEX_FILE).read_bytes())
    for f in weight_files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        h.update(safetensors_header(f))
    return {
        "weights_sha256": h.hexdigest(),
        "config_sha256": _sha256_file(path / CONFIG_FILE),
        "generation_config_sha256": _sha256_file(path / GENERATION_CONFIG_FILE),
        "tokenizer_sha256": _sha256_file(path / TOKENIZER_FILE),
    }
