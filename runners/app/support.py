"""What this engine can run: every registry field is honoured, or a run that needs it stops here.

`python -m registry validate` checks entries against the schema on any machine; this module is the run-time
counterpart, called by the application before anything heavy is loaded. Each field the engine does not
implement yet is refused with a UserError naming the field, so an entry never runs silently as something
else (an nvfp4 entry in bfloat16, judged against nvfp4 baseline rows). The checks that depend on this machine
(CUDA present, enough GPUs, FlashInfer on a GPU, FP4 tensor cores) are here too.
"""

from __future__ import annotations

import torch

from registry.checkpoint import CheckpointError
from registry.errors import UserError
from registry.resolve import ResolvedRun
from registry.schema import Quant, SSMBackend
from runners.engine.quant import check_runnable

# First compute capability with FP4 tensor cores (NVFP4 GEMMs): Blackwell, sm_100.
FP4_MIN_CAPABILITY = (10, 0)


def _hardware(device: str) -> tuple[str, tuple[int, int] | None]:
    """(a description of the run's device, its CUDA compute capability or None off CUDA)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})", cap
    return f"the CPU (runtime.device={device})", None


def check_quant_hardware(rr: ResolvedRun) -> None:
    """Raise UserError when the entry's weight quantization cannot run on this machine, from the settings
    alone (callable before the checkpoint is resolved, so an nvfp4 entry is refused naming the hardware even
    where its weights are absent): NVFP4 needs FP4 tensor cores (Blackwell, sm_100+), and the engine has no
    NVFP4 path on any hardware yet (the nvfp4 baseline rows stay for Blackwell users)."""
    e = rr.entry
    if e.quant != Quant.nvfp4:
        return
    hw, cap = _hardware(rr.device)
    if cap is None or cap < FP4_MIN_CAPABILITY:
        problem = (
            f"entry {e.name} sets quant=nvfp4: NVFP4 weights need FP4 tensor cores (NVIDIA Blackwell, "
            f"sm_100 or newer), and this run is on {hw}"
        )
    else:
        problem = f"entry {e.name} sets quant=nvfp4, but the engine has no NVFP4 path yet (device: {hw})"
    raise UserError(problem, f"use {_runnable_siblings(e.name)}; the nvfp4 entries and baseline rows are for "
                             "Blackwell GPUs")


def _runnable_siblings(name: str) -> str:
    """'<fp8 entry> (FP8) or <base entry> (bf16)': the registry entries of `name`'s model (its bases and
    their variants) at one GPU that this hardware runs; a generic phrase when `name` is no registry entry."""
    from registry.selection import entry_bases, entry_data, variants_of

    try:
        bases = [b for b in entry_bases(name) if b != name]
        family = sorted(set(bases) | set(variants_of(bases)))
        data = {n: entry_data(n) for n in family}
    except (KeyError, ValueError):
        return "the model's fp8 entry or its bf16 entry"
    single = [n for n in family if data[n].get("world_size", 1) == 1]
    picks = [f"model={n} (FP8)" for n in single if data[n].get("quant") == Quant.fp8.value]
    picks += [f"model={n} (bf16)" for n in single if data[n].get("quant", "none") == Quant.none.value]
    return " or ".join(picks) if picks else "the model's fp8 entry or its bf16 entry"


def check_supported(rr: ResolvedRun) -> None:
    """Raise UserError for the first setting of `rr` this engine cannot honour on this machine.

    Refused: NVFP4 weights (`quant: nvfp4`, :func:`check_quant_hardware`); an FP8 checkpoint in a layout
    the engine does not run (block-wise FP8, dynamic activation scales: runners.engine.quant.check_runnable);
    world_size > 1 with FP8 weights or an FP8 KV cache (runners.engine.tp shards unquantized models only),
    on one
    named GPU (cuda:N) or on fewer GPUs than ranks; ssm.backend=flashinfer on the CPU; a CUDA device where
    CUDA is missing. Allowed: `quant: fp8` (ModelOpt / HF per-tensor FP8 checkpoints; FP8 GEMMs on GPUs of
    sm_89+, a dequantizing fallback elsewhere) and `kv_cache_quant: fp8` (runners.engine.quant,
    runners.engine.cache.KVCache). (the entry's graph batch sizes are honoured: the engine captures its decode
    step at
    those sizes on a GPU, runners/engine/graphs.py; on the CPU the same step runs eagerly. world_size > 1
    runs one
    process per rank, runners.engine.launch, with eager steps: no CUDA graphs, no run-ahead steps, a warning
    says
    so; the head counts it shards are checked by registry.resolve.)
    """
    check_quant_hardware(rr)
    e = rr.entry
    quant = rr.checkpoint_config.quantization if rr.checkpoint_config is not None else None
    if quant is not None:
        try:
            check_runnable(quant)
        except CheckpointError as err:
            raise UserError(f"entry {e.name}: {err.problem}", err.fix) from None
    if rr.device == "cpu" and e.ssm.backend == SSMBackend.flashinfer:
        raise UserError(
            f"entry {e.name} uses ssm.backend=flashinfer, which runs only on CUDA GPUs; runtime.device is "
            "cpu",
            "use runtime=gpu, or model.ssm.backend=torch (on the CPU the PyTorch references run anyway)",
        )
    if rr.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"runtime.device is {rr.device} but CUDA is not available here", "use runtime=cpu")
    if rr.world_size > 1 and (quant is not None or e.kv_cache_quant.value != "none"):
        raise UserError(
            f"entry {e.name} with world_size={rr.world_size}: tensor parallelism (runners.engine.tp) "
            "shards models "
            "without FP8 weights or FP8 KV cache only (their scales are not sharded yet)",
            "use world_size=1 with the FP8 entry, or a bf16 entry (quant: none, kv_cache_quant: none) with "
            "world_size > 1",
        )
    if rr.world_size > 1 and rr.device.startswith("cuda:"):
        raise UserError(
            f"runtime.device={rr.device} with world_size={rr.world_size}: tensor-parallel rank r runs on "
            "cuda:r",
            "use runtime.device=cuda (choose the GPUs with CUDA_VISIBLE_DEVICES)",
        )
    if rr.world_size > 1 and rr.device == "cuda" and torch.cuda.device_count() < rr.world_size:
        raise UserError(
            f"world_size={rr.world_size} needs {rr.world_size} GPUs (one per rank), but "
            f"{torch.cuda.device_count()} are visible",
            f"run on a node with {rr.world_size} GPUs, or set world_size to the GPU count",
        )
