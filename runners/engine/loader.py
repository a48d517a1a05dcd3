"""Load an HF checkpoint directory into a :class:`runners.engine.models.hybrid.HybridLM`.

The directory layout, the config.json parser and the listing of tensor names per file are the registry's
(registry/checkpoint.py, registry/hf_config.py: registry validation uses them without torch). Loading is
strict: every tensor the model expects must be present with its exact shape, and every tensor on disk must be
known. The MTP tensors (``mtp.*``) form an optional group: a checkpoint without any of them loads for plain
decoding; one with some of them must have all of them. A checkpoint with ``tie_word_embeddings: true`` may
also store ``lm_head.weight`` (transformers' save_pretrained and conversion scripts write it): it must have
the embeddings' shape and is not read, the embeddings serve as the head, as transformers' ``tie_weights``
makes them. After loading, every tensor is checked for NaN / infinite values and every weight matrix for
being all zeros (corrupt or overwritten bytes behind an intact header). Every problem raises
registry.checkpoint.CheckpointError (a UserError) naming the file or tensor and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kernels.quant.fp8 import FP8_DTYPE
from registry.checkpoint import CONFIG_FILE, CheckpointError, short_list, tensor_files
from registry.hf_config import HybridConfig
from runners.engine.models.config import family_module
from runners.engine.models.hybrid import HybridLM
from runners.engine.quant import QUANT_TENSOR_SUFFIXES, apply_quantization, prepare_fp8

MTP_PREFIX = "mtp."
TIED_HEAD = "lm_head.weight"  # the output head, the embeddings' tensor when tie_word_embeddings is true
# Elements per isfinite / nonzero reduction of the weight check: bounds its temporary memory (bytes of bool).
_CHECK_CHUNK = 1 << 24

# Tensors kept in float32 whatever the model dtype (transformers keeps the NemotronH router in fp32).
FP32_SUFFIXES = ("gate.weight", "gate.e_score_correction_bias")
SAFETENSORS_FP8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SAFETENSORS_U8 = "U8"  # NVFP4's packed weights

__all__ = [
    "CheckpointError",
    "LoadPlan",
    "build_meta_model",
    "check_weights",
    "load_model",
    "load_targets",
    "materialize",
    "model_bytes",
    "plan_load",
    "read_config",
]


def read_config(path: str | Path) -> HybridConfig:
    """The HybridConfig of a checkpoint directory (registry.hf_config.HybridConfig.from_pretrained).

    Raises:
        CheckpointError: no such directory, or the config problems of HybridConfig.from_pretrained.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found",
                              "pass the path of an HF checkpoint dir")
    return HybridConfig.from_pretrained(path)


def _group(files: dict[str, Path]) -> dict[Path, list[str]]:
    """{file: its tensor names} of a {tensor name: file} map."""
    out: dict[Path, list[str]] = {}
    for name, f in files.items():
        out.setdefault(f, []).append(name)
    return out


@dataclass
class LoadPlan:
    """A checked checkpoint and its model built on the meta device (no tensor memory allocated yet).

    ``model``: the :class:`HybridLM` on ``torch.device("meta")`` with every parameter and buffer already in
    its load dtype; ``files``: ``{tensor name: safetensors file}`` of the tensors to load; ``weight_bytes``:
    what :func:`materialize` will allocate for parameters and buffers (shapes and dtypes as checked against
    the safetensors headers, tied weights counted once). ``readers``: ``{tensor name: read(slice) -> tensor}``
    for tensors that load only a part of the file's tensor (tensor parallelism,
    ``runners.engine.tp.shard_plan``:
    ``read`` gets the memory-mapped ``safe_open(...).get_slice(name)`` and reads only its part); other tensors
    are read whole. ``all_ranks_zero``: for a sharded plan, ``f(flags) -> flags`` (int32 [n], 1 where this
    rank's part of a weight matrix is all zeros) that is 1 only where every rank's part is
    (``runners.engine.tp.TensorParallel.all_ranks_zero``): one rank's part may be all zeros (padded heads)
    while the
    matrix is not; :func:`check_weights` judges the whole matrix.
    """

    path: Path
    config: HybridConfig
    model: HybridLM
    files: dict[str, Path]
    dtype: torch.dtype
    weight_bytes: int
    readers: dict[str, Callable[[Any], torch.Tensor]] = field(default_factory=dict)
    all_ranks_zero: Callable[[torch.Tensor], torch.Tensor] | None = None


def _computed_buffers(model: nn.Module) -> set[int]:
    """ids of the non-persistent buffers (values computed by their module, not stored in checkpoints)."""
    return {
        id(m._buffers[n])
        for m in model.modules()
        for n in m._non_persistent_buffers_set
        if m._buffers[n] is not None
    }


def build_meta_model(config: HybridConfig, *, dtype: torch.dtype, with_mtp: bool) -> HybridLM:
    """The :class:`HybridLM` of ``config`` on the meta device (no memory), every floating parameter and buffer
    in ``dtype`` except the MoE router's (:data:`FP32_SUFFIXES`, kept float32)."""
    with torch.device("meta"):
        model = HybridLM(config, with_mtp=with_mtp)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not name.endswith(FP32_SUFFIXES):
            t.data = t.data.to(dtype)  # free on the meta device
    return model


def load_targets(model: HybridLM) -> dict[str, torch.Tensor]:
    """``{checkpoint tensor name: model tensor it fills}`` (the family's ``checkpoint_targets``) without the
    non-persistent buffers, which modules compute (``init_buffers``) instead of loading."""
    config = model.config
    computed = _computed_buffers(model)
    targets = family_module(config.family, config.source).checkpoint_targets(model)
    return {n: t for n, t in targets.items() if id(t) not in computed}


def plan_load(
    path: str | Path, *, dtype: torch.dtype = torch.float32, load_mtp: bool | None = None
) -> LoadPlan:
    """Read config.json and the safetensors headers, build the model on the meta device and check that the
    checkpoint fills it exactly (names, shapes, and FP8 where the model holds FP8); reads no tensor data and
    allocates no tensor memory. A checkpoint that declares a quantization (``HybridConfig.quantization``) gets
    its FP8 modules swapped in first (``runners.engine.quant.apply_quantization``), so FP8 weights load as
    FP8.

    Args: as :func:`load_model` (without ``device``).

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
            f"{path / CONFIG_FILE}: MTP weights requested but num_nextn_predict_layers is 0",
            "set num_nextn_predict_layers (and mtp_hybrid_override_pattern) in config.json",
        )
    if load_mtp and not mtp_on_disk:
        raise CheckpointError(
            f"{path}: MTP (draft) weights requested but the checkpoint has no mtp.* tensors",
            "use a checkpoint that ships its MTP module or turn speculative decoding off",
        )
    if not load_mtp and has_mtp_layers:
        files = {n: f for n, f in files.items() if not n.startswith(MTP_PREFIX)}
    model = build_meta_model(config, dtype=dtype, with_mtp=load_mtp)
    if config.quantization is not None:  # quantized modules where the checkpoint's quantization config says
        apply_quantization(model, config.quantization, tensor_names=files.keys())
    targets = load_targets(model)
    if config.tie_word_embeddings and TIED_HEAD in files and TIED_HEAD not in targets:
        _check_tied_head(files[TIED_HEAD], (config.vocab_size, config.hidden_size))
        files = {n: f for n, f in files.items() if n != TIED_HEAD}
    unknown = set(files) - set(targets)
    if unknown:
        hint = (
            " (mtp.* tensors but config.json declares no MTP layers: set num_nextn_predict_layers)"
            if unknown & mtp_on_disk and not has_mtp_layers
            else ""
        )
        if any(n.endswith(QUANT_TENSOR_SUFFIXES) for n in unknown):
            hint += (
                " (quantization scales of modules the engine keeps unquantized: config.json's "
                "quantization_config / hf_quant_config.json does not declare them quantized, or the engine "
                "never quantizes them: embeddings, norms, routers, convolutions, shared_expert_gate)"
            )
        raise CheckpointError(
            f"{path}: unknown tensors {short_list(unknown)}{hint}; the checkpoint does not match "
            f"config.json ({config.family})",
            "check config.json's layer pattern and sizes against the tensors",
        )
    missing = set(targets) - set(files)
    if missing:
        raise CheckpointError(
            f"{path}: missing tensors {short_list(missing)}; the checkpoint is incomplete or was saved for a "
            "different config.json",
            "copy the complete checkpoint, or fix config.json",
        )
    for shard, names in _group(files).items():
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in names:
                    sl = f.get_slice(name)
                    shape, want = tuple(sl.get_shape()), tuple(targets[name].shape)
                    scalar = want == () and shape in ((), (1,))  # per-tensor scales: [] or [1] on disk
                    if shape != want and not scalar:
                        raise CheckpointError(
                            f"{shard}: tensor {name} has shape {list(shape)}, config.json implies "
                            f"{list(want)}",
                            "the checkpoint does not match its config.json: fix one of them",
                        )
                    if _storage_kind(sl.get_dtype()) != _storage_kind(targets[name].dtype):
                        raise CheckpointError(
                            f"{shard}: tensor {name} is {sl.get_dtype()} on disk but the model holds it in "
                            f"{targets[name].dtype}: the quantized weights and the quantization config "
                            "(config.json quantization_config / hf_quant_config.json) disagree",
                            "restore the checkpoint's quantization config, or re-export the checkpoint",
                        )
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{shard}: cannot read tensor headers ({e}); the file is corrupt",
                                  "re-download or re-save it") from e
    return LoadPlan(path, config, model, files, dtype, model_bytes(model))


def _storage_kind(dtype: str | torch.dtype) -> str:
    """"fp8", "packed" (uint8: NVFP4's two e2m1 values per byte) or "other" of a safetensors dtype name or a
    torch dtype: a tensor must have the same kind on disk and in the model (other floats convert on load)."""
    if dtype in (SAFETENSORS_FP8, FP8_DTYPE):
        return "fp8"
    return "packed" if dtype in (SAFETENSORS_U8, torch.uint8) else "other"


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers at their dtypes, tied tensors counted once."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_tied_head(shard: Path, shape: tuple[int, int]) -> None:
    """A stored ``lm_head.weight`` of a tied checkpoint must have the embeddings' shape [V, D]."""
    try:
        with safe_open(str(shard), framework="pt") as f:
            got = tuple(f.get_slice(TIED_HEAD).get_shape())
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{shard}: cannot read tensor headers ({e}); the file is corrupt",
                              "re-download or re-save it") from e
    if got != shape:
        raise CheckpointError(
            f"{shard}: {TIED_HEAD} has shape {list(got)}, but config.json ties it to the embeddings "
            f"{list(shape)} (tie_word_embeddings: true)",
            "set tie_word_embeddings: false when the head is a separate matrix, or re-save the checkpoint",
        )


def check_weights(tensors: dict[str, torch.Tensor], path: str | Path,
                  all_ranks_zero: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Raise CheckpointError naming the loaded tensors that hold NaN or infinite values, and the weight
    matrices (2 or more dimensions) that are all zeros: what bytes overwritten behind an intact safetensors
    header, a failed conversion or a broken training run leave. One-dimensional tensors may legitimately be
    zero (biases, zero-centred norm weights) and are checked for finiteness only.

    tensors: {checkpoint name: loaded tensor} (on any device; FP8 tensors are upcast chunk by chunk). The
    reductions run on the tensors' device in chunks of 2^24 elements and are read back once (one host
    synchronisation for the whole model). ``all_ranks_zero`` (a sharded load, :class:`LoadPlan`): combines
    the all-zero flags [n] int32 over the tensor-parallel ranks, so a matrix is reported only when every
    rank's part of it is zero; every rank must then call this with the same names in the same order.
    """
    names, flags = [], []
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        flat = t.detach().reshape(-1)
        bad = torch.zeros((), dtype=torch.bool, device=t.device)
        nonzero = torch.zeros((), dtype=torch.bool, device=t.device)
        for i in range(0, flat.numel(), _CHECK_CHUNK):
            chunk = flat[i : i + _CHECK_CHUNK]
            if chunk.element_size() == 1:  # FP8 (e4m3fn / e5m2): torch has no isfinite for them; the
                chunk = chunk.float()  # upcast keeps NaN / inf and zeros exactly
            bad |= ~torch.isfinite(chunk).all()
            nonzero |= (chunk != 0).any()
        names.append(name)
        flags.append(torch.stack([bad, ~nonzero & (t.dim() >= 2)]))
    if not flags:
        return
    stacked = torch.stack(flags)  # [n, 2] bool: (non-finite, all-zero matrix)
    if all_ranks_zero is not None:
        zero = all_ranks_zero(stacked[:, 1].to(torch.int32)).bool()
        stacked = torch.stack([stacked[:, 0], zero], dim=1)
    host = stacked.cpu().tolist()
    nonfinite = [n for n, (b, _) in zip(names, host) if b]
    zero = [n for n, (_, z) in zip(names, host) if z]
    if nonfinite or zero:
        parts = []
        if nonfinite:
            parts.append(f"{len(nonfinite)} of {len(names)} tensors hold NaN or infinite values: "
                         f"{short_list(nonfinite)}")
        if zero:
            parts.append(f"{len(zero)} weight matrices are all zeros: {short_list(zero)}")
        raise CheckpointError(
            f"{path}: the weights are broken: {'; '.join(parts)}",
            "the checkpoint is corrupt or was saved from a broken model: re-download it (compare its "
            "checksums with the source) or re-save it from a healthy model",
        )


def _to_empty_keeping_ties(model: nn.Module, device: str | torch.device) -> nn.Module:
    """``model.to_empty(device=device)``, then re-tie tensors that several modules shared (tied embeddings):
    to_empty gives every module its own new tensor."""
    shared: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for m in model.modules():
        for kind in ("_parameters", "_buffers"):
            for n, t in getattr(m, kind).items():
                if t is not None:
                    shared.setdefault(id(t), []).append((m, kind, n))
    model.to_empty(device=device)
    for refs in shared.values():
        (m0, kind0, n0), rest = refs[0], refs[1:]
        for m, kind, n in rest:
            getattr(m, kind)[n] = getattr(m0, kind0)[n0]
    return model


def materialize(plan: LoadPlan, device: str | torch.device = "cpu") -> HybridLM:
    """Allocate the planned model on ``device`` (uninitialised, ``nn.Module.to_empty``) and fill it from the
    safetensors shards, one shard at a time, each memory-mapped (``safe_open``) and copied tensor by tensor
    into its destination in the destination's dtype: nothing is built on the host first or in float32. A
    tensor with a reader in ``plan.readers`` copies only what the reader returns (its shard).
    Modules with non-persistent buffers compute them in ``init_buffers()``, called last; an FP8 model then
    fixes which quantized GEMMs run on ``device`` (``runners.engine.quant.prepare_fp8``,
    ``model.quant_report``).

    Returns:
        The model in eval mode (``plan.model``, now on ``device``).

    Raises:
        CheckpointError: a shard that cannot be read; tensors with NaN / infinite values or all-zero weight
            matrices (:func:`check_weights`).
        TypeError: a module with non-persistent buffers but no ``init_buffers`` (a model-code bug).
    """
    model = _to_empty_keeping_ties(plan.model, device)
    config = plan.config
    targets = family_module(config.family, config.source).checkpoint_targets(model)
    with torch.no_grad():
        for shard, names in _group(plan.files).items():
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in names:
                        target, read = targets[name], plan.readers.get(name)
                        data = f.get_tensor(name) if read is None else read(f.get_slice(name))
                        target.copy_(data.reshape(target.shape))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise CheckpointError(f"{shard}: cannot read tensors ({e}); the file is corrupt",
                                      "re-download or re-save it") from e
        check_weights({name: targets[name] for name in plan.files}, plan.path, plan.all_ranks_zero)
        for name, module in model.named_modules():
            if module._non_persistent_buffers_set:
                if not hasattr(module, "init_buffers"):
                    raise TypeError(
                        f"{name} ({type(module).__name__}) has non-persistent buffers "
                        f"{sorted(module._non_persistent_buffers_set)} but no init_buffers(); the loader "
                        "builds models on the meta device, so such a module must compute its buffers there"
                    )
                module.init_buffers()
    if config.quantization is not None:
        prepare_fp8(model, plan.dtype)  # which FP8 GEMMs run on this device (model.quant_report)
    return model.eval()


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_mtp: bool | None = None,
) -> HybridLM:
    """Build the model of ``<path>/config.json`` and fill it from the checkpoint's safetensors:
    :func:`plan_load` (meta-device model, every name and shape checked from the headers) then
    :func:`materialize` (weights loaded straight to ``device`` in their dtype, one shard at a time).

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
    return materialize(plan_load(path, dtype=dtype, load_mtp=load_mtp), device)
