"""What this engine can run: every registry field is honoured, or a run that needs it stops here.

`python -m registry validate` checks entries against the schema on any machine; this module is the run-time
counterpart, called by the application before anything heavy is loaded. Each field the engine does not
implement yet is refused with a UserError naming the field, so an entry never runs silently as something
else (a 4-bit entry in bfloat16, judged against its baseline rows). The checks that depend on this machine
(CUDA present, enough GPUs, FlashInfer on a GPU, a GPU for the quantized GEMMs) are here too. torch is
imported only to ask a GPU machine about its GPUs (:func:`cuda_available`), so that on a CPU machine a refused
run never loads it.
"""

from __future__ import annotations

import ctypes
import sys

from registry.checkpoint import CheckpointError
from registry.errors import UserError
from registry.resolve import ResolvedRun
from registry.schema import Quant, SSMBackend
from runners.engine.formats import check_runnable, checkpoint_formats, get_format


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where that answer is known to be False: on Linux
    without the CUDA driver library (libcuda.so.1, which every CUDA build of torch loads to reach a GPU), as
    on a CPU machine. Once torch is imported, torch answers."""
    if "torch" not in sys.modules and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return False
    import torch

    return torch.cuda.is_available()


def _hardware(device: str) -> tuple[str, tuple[int, int] | None]:
    """(a description of the run's device, its CUDA compute capability or None off CUDA)."""
    if device.startswith("cuda") and cuda_available():
        import torch

        cap = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})", cap
    return f"the CPU (runtime.device={device})", None


def check_quant_hardware(rr: ResolvedRun, formats: tuple[str, ...] | None = None) -> None:
    """Raise UserError when the run's weight formats cannot run on this machine: each format says which
    devices run its GEMMs (``runners.engine.formats.WeightFormat.runs_on``: the CPU runs every format's
    PyTorch references, correct and slow; per-tensor FP8 every GPU, through torch._scaled_mm on sm_89+ and
    its dequantizing fallback elsewhere; NVFP4 (weight-only W4A16) and block FP8 need sm_89's fp8 type for
    their Triton kernels).

    ``formats``: the checkpoint's weight formats (``registry.hf_config.FORMATS``); None reads them from the
    entry's settings alone (its ``quant``), so a 4-bit entry is refused naming the hardware before its
    checkpoint is resolved."""
    e = rr.entry
    if formats is None:
        formats = () if e.quant == Quant.none else (e.quant.value,)
    if not any(get_format(f).min_capability for f in formats):
        return
    hw, cap = _hardware(rr.device)
    needs = sorted(f for f in set(formats) if not get_format(f).runs_on(cap))
    if not needs:
        return
    names = " and ".join(get_format(f).label for f in needs)
    raise UserError(
        f"entry {e.name}: the engine's {names} GEMMs are Triton kernels that need a GPU with FP8 support "
        f"(sm_89 or newer: Ada, Hopper, Blackwell), and this run is on {hw}",
        f"run on an sm_89+ GPU or on the CPU (runtime=cpu: slow references), or use "
        f"{_runnable_siblings(e.name)}",
    )


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

    Refused: a quantized checkpoint in a layout the engine does not run
    (runners.engine.formats.check_runnable: per-tensor FP8 with dynamic activation scales, blocks other than
    128 x 128); NVFP4 or block-FP8 weights on a GPU older than sm_89 (:func:`check_quant_hardware`);
    world_size > 1 with FP8 weights or an FP8 KV cache (runners.engine.tp shards unquantized models only), on
    one named GPU (cuda:N) or on fewer GPUs than ranks; ssm.backend=flashinfer on the CPU; a CUDA device where
    CUDA is missing. Allowed: `quant: fp8` (ModelOpt / HF per-tensor FP8 checkpoints: FP8 GEMMs on GPUs of
    sm_89+, a dequantizing fallback elsewhere; block FP8), the 4-bit `quant` (ModelOpt NVFP4 /
    MIXED_PRECISION, run W4A16) and `kv_cache_quant: fp8` (runners.engine.quant,
    runners.engine.models.attention.KVCache). (the entry's graph batch sizes are honoured: the engine captures
    its decode step at those sizes on a GPU, runners/engine/graphs.py; on the CPU the same step runs eagerly.
    world_size > 1 runs one process per rank, runners.engine.launch, with eager steps: no CUDA graphs, no
    run-ahead steps, a warning says so; the head counts it shards are checked by registry.resolve.)
    """
    e = rr.entry
    quant = rr.checkpoint_config.quantization if rr.checkpoint_config is not None else None
    if quant is not None:
        try:
            check_runnable(quant)
        except CheckpointError as err:
            raise UserError(f"entry {e.name}: {err.problem}", err.fix) from None
    check_quant_hardware(rr, checkpoint_formats(quant) if quant is not None else None)
    if rr.device == "cpu" and e.ssm.backend == SSMBackend.flashinfer:
        raise UserError(
            f"entry {e.name} uses ssm.backend=flashinfer, which runs only on CUDA GPUs; runtime.device is "
            "cpu",
            "use runtime=gpu, or model.ssm.backend=torch (on the CPU the PyTorch references run anyway)",
        )
    if rr.device.startswith("cuda") and not cuda_available():
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
    if rr.world_size > 1 and rr.device == "cuda":
        import torch  # CUDA is available (checked above): a GPU run loads torch anyway

        if torch.cuda.device_count() < rr.world_size:
            raise UserError(
                f"world_size={rr.world_size} needs {rr.world_size} GPUs (one per rank), but "
                f"{torch.cuda.device_count()} are visible",
                f"run on a node with {rr.world_size} GPUs, or set world_size to the GPU count",
            )
