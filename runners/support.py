"""What this engine can run: every registry field is honoured, or a run that needs it stops here.

`python -m registry validate` checks entries against the schema on any machine; this module is the run-time
counterpart, called by the application before anything heavy is loaded. Each field the engine does not
implement yet is refused with a UserError naming the field, so an entry never runs silently as something
else (an fp8 entry in bfloat16, judged against fp8 baseline rows). The checks that depend on this machine
(CUDA present, enough GPUs, FlashInfer on a GPU) are here too.
"""

from __future__ import annotations

import torch

from registry.errors import UserError
from registry.resolve import ResolvedRun
from registry.schema import KVCacheQuant, Quant, SSMBackend


def check_supported(rr: ResolvedRun) -> None:
    """Raise UserError for the first setting of `rr` this engine cannot honour on this machine.

    Refused: a weight quantization (`quant` other than none: the engine computes in runtime.dtype only), an
    FP8 KV cache (`kv_cache_quant`), CUDA-graph capture (`cuda_graph_batch_sizes` not empty), tensor
    parallelism (world_size > 1), ssm.backend=flashinfer on the CPU, a CUDA device where CUDA is missing.
    """
    e = rr.entry
    if e.quant != Quant.none:
        raise UserError(
            f"entry {e.name} sets quant={e.quant.value}, but the engine has no {e.quant.value.upper()} path "
            f"yet: it would run the weights in {rr.dtype} and be judged against {e.quant.value} baseline "
            "rows",
            "use an entry with quant: none (or model.quant=none, with baseline rows for that setting)",
        )
    if e.kv_cache_quant != KVCacheQuant.none:
        raise UserError(
            f"entry {e.name} sets kv_cache_quant={e.kv_cache_quant.value}, but the engine keeps its KV cache "
            f"in {rr.dtype} only",
            "use an entry with kv_cache_quant: none (or model.kv_cache_quant=none)",
        )
    if e.cuda_graph_batch_sizes:
        raise UserError(
            f"entry {e.name} sets cuda_graph_batch_sizes={e.cuda_graph_batch_sizes}, but the engine does not "
            "capture CUDA graphs yet",
            "add model.cuda_graph_batch_sizes=[] to run without CUDA graphs",
        )
    if rr.world_size > 1:
        raise UserError(
            f"world_size={rr.world_size}: the engine (runners.Engine) does not implement tensor parallelism "
            "yet",
            "run with world_size=1 (the registry's _ws4 entries compose and check head divisibility only)",
        )
    if rr.device == "cpu" and e.ssm.backend == SSMBackend.flashinfer:
        raise UserError(
            f"entry {e.name} uses ssm.backend=flashinfer, which runs only on CUDA GPUs; runtime.device is "
            "cpu",
            "use runtime=gpu, or model.ssm.backend=torch (on the CPU the PyTorch references run anyway)",
        )
    if rr.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"runtime.device is {rr.device} but CUDA is not available here", "use runtime=cpu")
