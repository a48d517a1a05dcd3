"""flash-linear-attention (fla-core) as the Gated DeltaNet chunked-prefill kernel: the adapter between our
conventions and fla's `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (the kernel transformers, vLLM and
SGLang call for Qwen3-Next's prefill).

fla-core is optional (the `gpu` extra): `fla_chunk_rule()` imports it once and returns None, with the reason,
when it is missing or broken; `kernels.gdn.chunk.chunk_gated_delta_rule` then runs our PyTorch reference and
says so once in the log. fla's Triton kernels need a GPU: its chunk kernels do not run under Triton's CPU
interpreter (a loop counter is a Python int there and `i_t.to(...)` fails; fla-core 0.6.0, triton 3.9), so on
the CPU the reference runs.

Conventions mapped (fla-core 0.6.0, fla/ops/gated_delta_rule/chunk.py):
- layout: fla takes q, k (B, T, H, K), v (B, T, HV, V), g, beta (B, T, HV), as ours; HV > H directly (its
  "GVA": value head hv reads key head hv // (HV / H), our grouping), so q / k are not repeated;
- state: `state_v_first=True` makes fla's initial / final state (N, HV, V, K), K contiguous: our layout, so no
  transpose; the final state comes back float32 (its kernel keeps the state in fp32 registers);
- q, k arrive L2-normalised (the mixer normalises them in fp32), so `use_qk_l2norm_in_kernel=False`; fla's
  default `scale` is K^-0.5, ours too; g is the log decay in fp32, beta in (0, 1) (post-sigmoid);
- dtypes: fla's matrix products take q, k and v in one dtype (its WY kernel multiplies tiles of k's dtype with
  tiles of v's), so q, k and beta are cast to v's dtype (bf16 in the engine) and g stays fp32: the
  combination transformers and vLLM call it with (beta = sigmoid(b) in the activations' dtype, g in fp32);
- right padding: columns t >= lengths[b] are zeroed (`kernels.gdn._common.mask_right_padding`: g = beta = k =
  q = v = 0) and the batch runs as B equal-length rows. A padded step is then the identity on the state in
  exact arithmetic: it adds u k^T with k = 0 and decays by exp(0) = 1. (fla's other way, `cu_seqlens` over a
  packed batch of one row, needs the valid tokens gathered and host-side chunk indices; masking keeps the
  batch as it is and costs the padded columns' compute.)
- chunk size: fla's kernels take 16, 32 or 64 tokens; another `chunk_size` runs at 64 (the same math).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from kernels.gdn._common import check_gdn_inputs, mask_right_padding

log = logging.getLogger(__name__)

FLA_CHUNK_SIZES = (16, 32, 64)


@functools.lru_cache(maxsize=1)
def fla_chunk_rule() -> tuple[Callable | None, str]:
    """(fla's chunk_gated_delta_rule, "") when fla-core imports, else (None, why not). Imported once."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception as exc:  # ImportError, or a broken install (its import touches triton and the GPU)
        return None, f"{type(exc).__name__}: {exc}"
    return fla_chunk, ""


@functools.lru_cache(maxsize=1)
def fla_fused_recurrent_rule() -> tuple[Callable | None, str]:
    """(fla's fused_recurrent_gated_delta_rule, "") when fla-core imports, else (None, why not): its
    token-by-token decode kernel (fla/ops/gated_delta_rule/fused_recurrent.py: one program per (V block,
    sequence, value head), the state in fp32 registers, the final state written in fp32), the GDN peer that
    benchmarks.sweep_replay times beside our replay verify. Imported once."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception as exc:  # ImportError, or a broken install
        return None, f"{type(exc).__name__}: {exc}"
    return fla_recurrent, ""


def fla_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    output_final_state: bool = True,
    *,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunked form through fla's Triton kernels (CUDA only; fla-core installed).

    Args and returns: as `kernels.gdn.chunk.chunk_gated_delta_rule_ref` (q, k (B, T, H, K) L2-normalised and
    unscaled; v (B, T, HV, V); g, beta (B, T, HV); initial_state (B, HV, V, K), never written; lengths (B,)
    right padding). o: (B, T, HV, V) in v's dtype; final_state: (B, HV, V, K) float32 (None unless
    output_final_state).

    Raises:
        RuntimeError: fla-core cannot be imported (the message has the import error).
        ValueError: shapes that do not fit (as the reference), lengths outside [0, T].
    """
    fla_chunk, why = fla_chunk_rule()
    if fla_chunk is None:
        raise RuntimeError(f"fla-core is not importable ({why}); install the `gpu` extra "
                           "(pip install '.[gpu]') or run chunk_gated_delta_rule_ref")
    B, T, H, HV, K, V = check_gdn_inputs(q, k, v, g, beta)
    if initial_state is not None and initial_state.shape != (B, HV, V, K):
        raise ValueError(f"initial_state must be (B, HV, V, K) = {(B, HV, V, K)}, K contiguous; got "
                         f"{tuple(initial_state.shape)}")
    if lengths is not None:
        q, k, v, g, beta = mask_right_padding(q, k, v, g, beta, lengths)
    o, final = fla_chunk(
        q.to(v.dtype), k.to(v.dtype), v, g.float(), beta.to(v.dtype),
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False, state_v_first=True,
        chunk_size=chunk_size if chunk_size in FLA_CHUNK_SIZES else 64,
    )
    return o.to(v.dtype), final
