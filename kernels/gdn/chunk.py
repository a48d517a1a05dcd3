"""Gated DeltaNet chunked (WY / UT-transform) form: the prefill path.

Scope: `chunk_gated_delta_rule`, the kernel entry (flash-linear-attention's Triton kernels through
`kernels.gdn.fla` on CUDA when fla-core is installed), and `chunk_gated_delta_rule_ref`, its plain-PyTorch
reference (same signature and effects: the engine's prefill for ssm_backend="torch", the CPU path, and the
fallback when fla-core is missing, which the log says once).

Algorithm: the gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025) in the chunked form of Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length" (NeurIPS 2024), as flash-linear-attention's `chunk_gated_delta_rule` computes it. It equals
the token-by-token `kernels.gdn.recurrent.recurrent_gated_delta_rule` (tests hold the two together).

Shapes and state layout: kernels/gdn/_common.py.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels.gdn._common import prepare_rule_inputs
from kernels.gdn.fla import fla_chunk_gated_delta_rule, fla_chunk_rule

log = logging.getLogger(__name__)
_fallback_logged: set[str] = set()


def chunk_gated_delta_rule(
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
    """Gated delta rule in chunked form with a kernel: fla-core's Triton kernels on CUDA
    (`kernels.gdn.fla.fla_chunk_gated_delta_rule`), else `chunk_gated_delta_rule_ref`.

    The reference runs, and the log says so once per reason, on the CPU (fla's kernels need a GPU: they do not
    run in Triton's interpreter) and on CUDA when fla-core cannot be imported (a warning with the import error
    and the fix). Args, returns and raises: as `chunk_gated_delta_rule_ref` (fla computes its products in v's
    dtype: bf16 inputs give bf16-accurate outputs; the final state is float32).
    """
    if q.is_cuda:
        fla_chunk, why = fla_chunk_rule()
        if fla_chunk is not None:
            return fla_chunk_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size, output_final_state,
                                              scale=scale, lengths=lengths)
        _log_fallback_once("cuda", logging.WARNING,
                           f"Gated DeltaNet prefill: fla-core is not importable ({why}); running the PyTorch "
                           "reference chunk_gated_delta_rule_ref (slow). fix: pip install '.[gpu]' (fla-core)")
    else:
        _log_fallback_once("cpu", logging.INFO,
                           "Gated DeltaNet prefill on the CPU: the PyTorch reference chunk_gated_delta_rule_ref "
                           "runs (fla-core's kernels need a GPU)")
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state, chunk_size, output_final_state,
                                      scale=scale, lengths=lengths)


def _log_fallback_once(key: str, level: int, message: str) -> None:
    if key not in _fallback_logged:
        _fallback_logged.add(key)
        log.log(level, message)


def chunk_gated_delta_rule_ref(
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
    """Gated delta rule in chunked (WY / UT-transform) form in PyTorch: the reference of
    `chunk_gated_delta_rule`; same math as the recurrent one.

    Inside a chunk of C tokens with in-chunk cumulative log decay G_i = g_1 + ... + g_i and chunk start state
    S_0, the update vectors solve a unit lower-triangular system

        u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(G_i) S_0 k_i,

    i.e. U = W_v - W_k S_0^T with W_v = L^-1 (beta v), W_k = L^-1 (beta exp(G) k) computed for all chunks at
    once; then o_i = exp(G_i) S_0 q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j and
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) u_j k_j^T. Only the chunk-to-chunk state pass is sequential.
    All exponents are <= 0 (g <= 0), so nothing overflows. T need not be a multiple of chunk_size: the tail is
    padded with identity steps (g = beta = k = 0).

    Args: as `kernels.gdn.recurrent.recurrent_gated_delta_rule` (q, k L2-normalised and unscaled; state (B, HV, V, K)), plus
        chunk_size: tokens per chunk (C), >= 1.
    Returns:
        o: (B, T, HV, V) in v's dtype (float32 accumulation); final_state: (B, HV, V, K) float32 or None.
    Raises ValueError on shape / length mismatches.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    B, T = q.shape[:2]
    out_dtype = v.dtype
    q, k, v, g, beta, state = prepare_rule_inputs(q, k, v, g, beta, initial_state, lengths, scale)
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    HV, V, K = state.shape[1:]
    N = (T + pad) // C
    q, k, v = (t.reshape(B, HV, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(B, HV, N, C) for t in (g, beta))

    G = g.cumsum(dim=-1)  # (B, HV, N, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) for j <= i, else 0 (masked before exp: the upper triangle would overflow)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # Unit lower-triangular L = I + strictly-lower(beta_i exp(G_i - G_j) k_i . k_j); the solver reads only the
    # strictly lower part (unitriangular=True), so the diagonal of the product is irrelevant.
    L = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay
    W_v = torch.linalg.solve_triangular(L, beta[..., None] * v, upper=False, unitriangular=True)
    W_k = torch.linalg.solve_triangular(L, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # (B, HV, N, C, C), causal incl. diagonal
    q_dec = q * G.exp()[..., None]  # reads of the chunk start state
    k_dec = k * (G[..., -1:] - G).exp()[..., None]  # writes, decayed to the chunk end
    chunk_decay = G[..., -1].exp()  # (B, HV, N)

    o = q.new_empty(B, HV, N, C, V)
    for n in range(N):
        u = W_v[:, :, n] - W_k[:, :, n] @ state.transpose(-1, -2)  # (B, HV, C, V)
        o[:, :, n] = q_dec[:, :, n] @ state.transpose(-1, -2) + qk[:, :, n] @ u
        state = state * chunk_decay[:, :, n, None, None] + u.transpose(-1, -2) @ k_dec[:, :, n]
    o = o.reshape(B, HV, N * C, V)[:, :, :T]
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None)
