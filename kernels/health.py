"""The eager inference step's numerical-health flags without extra launches: the residual add that ends
every block, fused with the "did this output go non-finite" check, and the check alone for the outputs that
have no residual add (embeddings, final norm, logits, the MTP module's output); with their PyTorch
references.

The engine keeps one bool flag per watched output (``runners.engine.models.hybrid.HybridLM.nonfinite``,
named by ``HybridLM.health_names``) and reads them once per ``generate`` call, without a host
synchronisation inside the step. The reference path (CPU, autograd, torch.compile) reduces each output to
its max |x| and tests all the peaks at once, a reduction launch per block plus about a dozen per forward
(stack, isfinite, the flag updates); here
the block's residual add, which reads and writes the whole output anyway, tests its own elements and sets
the flag:

    y = x + delta                       (in x's dtype: the sum in float32, rounded to nearest even as torch's
                                         16-bit add rounds it, so y is bitwise torch's ``x + delta``)
    flags[index] = True  if any y is NaN or +-inf   (left as it is otherwise: the flags accumulate)

Several programs may set the same flag; they all store True, so no atomic is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, round_rne

HEALTH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 2048  # elements per program (four warps, 16 per thread)


def flag_index(flags: torch.Tensor, index: int, name: str) -> int:
    """``index`` as a non-negative position in ``flags`` (Python-style negative index allowed).

    Raises:
        ValueError: flags not a contiguous 1-D bool tensor, or index outside them (the message starts with
            ``name``)."""
    if flags.dtype != torch.bool or flags.dim() != 1 or not flags.is_contiguous():
        raise ValueError(f"{name}: flags must be a contiguous 1-D bool tensor, got {flags.dtype} "
                         f"{tuple(flags.shape)}")
    n = flags.numel()
    if not -n <= index < n:
        raise ValueError(f"{name}: flag index {index} is outside the {n} flags")
    return index % n


def residual_add_ref(x: torch.Tensor, delta: torch.Tensor, flags: torch.Tensor | None = None,
                     index: int = 0) -> torch.Tensor:
    """``x + delta``; with ``flags``, also ``flags[index] |= not isfinite(x + delta).all()``.

    Args:
        x, delta: tensors of one shape and dtype (float32, bf16, fp16).
        flags: bool [n] health flags (mutated in place at ``index``; Python-style negative index allowed).

    Returns:
        a new tensor x + delta.

    Raises:
        ValueError: flags not a contiguous 1-D bool tensor, or ``index`` outside them.
    """
    y = x + delta
    if flags is not None:
        flags[flag_index(flags, index, "residual_add_ref")] |= ~torch.isfinite(y).all()
    return y


def flag_nonfinite_ref(x: torch.Tensor, flags: torch.Tensor, index: int) -> None:
    """``flags[index] |= not isfinite(x).all()``: x any shape, flags bool [n] (mutated in place; a negative
    index counts from the end); an empty x flags nothing.

    Raises:
        ValueError: flags not a contiguous 1-D bool tensor, or ``index`` outside them.
    """
    flags[flag_index(flags, index, "flag_nonfinite_ref")] |= ~torch.isfinite(x).all()


@triton.jit
def _check_kernel(x_ptr, d_ptr, y_ptr, flag_ptr, n, ADD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if ADD:
        dt = y_ptr.dtype.element_ty
        v = round_rne(v + tl.load(d_ptr + offs, mask=m, other=0.0).to(tl.float32), dt)
        tl.store(y_ptr + offs, v.to(dt), mask=m)
    flag_if_nonfinite(v, m, flag_ptr)


@triton.jit
def flag_if_nonfinite(v, mask, flag_ptr):
    """Store True at flag_ptr where a masked-in element of v is NaN or an infinity (nothing otherwise: flags
    accumulate, and every program that stores stores True, so no atomic is needed). For the kernels that
    produce a flagged output themselves (this file's, kernels/norm.py's add_rms_norm)."""
    # NaN fails every comparison and an infinity exceeds the largest float: both are "not <= max"
    bad = tl.max(tl.where(mask & ~(tl.abs(v) <= 3.4028234663852886e38), 1, 0), axis=0)
    tl.store(flag_ptr, bad > 0, mask=bad > 0)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1)


def residual_add(x: torch.Tensor, delta: torch.Tensor, flags: torch.Tensor, index: int) -> torch.Tensor:
    """:func:`residual_add_ref` with flags, in one Triton launch (``cdiv(numel, BLOCK)`` programs). Same result,
    bitwise (one float32 add rounded to x's dtype); mutates ``flags[index]`` only to set it.

    Raises:
        ValueError: CPU tensors without the Triton interpreter, x and delta of different shapes or dtypes,
            a dtype outside HEALTH_DTYPES, flags not a contiguous 1-D bool tensor, an index outside them.
    """
    name = "residual_add"
    if not isinstance(flags, torch.Tensor):
        raise ValueError(f"{name}: flags must be a contiguous 1-D bool tensor, got {type(flags).__name__} (the "
                         "reference residual_add_ref takes flags=None for a plain add)")
    check_launchable(x, delta, flags, name=name)
    if x.shape != delta.shape or x.dtype != delta.dtype or x.dtype not in HEALTH_DTYPES:
        raise ValueError(f"{name}: x and delta must share a shape and a dtype in {HEALTH_DTYPES}; got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(delta.shape)} {delta.dtype}")
    i = flag_index(flags, index, name)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    n = x.numel()
    if n:
        _check_kernel[(triton.cdiv(n, BLOCK),)](_flat(x), _flat(delta), y, flags[i:], n, ADD=True,
                                               BLOCK_SIZE=BLOCK, num_warps=4)
    return y


def flag_nonfinite(x: torch.Tensor, flags: torch.Tensor, index: int) -> None:
    """:func:`flag_nonfinite_ref` in one Triton launch, reading x once (a non-contiguous x is copied first).

    Raises:
        ValueError: CPU tensors without the Triton interpreter, a dtype outside HEALTH_DTYPES, flags not a
            contiguous 1-D bool tensor, an index outside them.
    """
    name = "flag_nonfinite"
    if not isinstance(flags, torch.Tensor):
        raise ValueError(f"{name}: flags must be a contiguous 1-D bool tensor, got {type(flags).__name__}")
    check_launchable(x, flags, name=name)
    if x.dtype not in HEALTH_DTYPES:
        raise ValueError(f"{name}: x must be one of {HEALTH_DTYPES}, got {x.dtype}")
    i = flag_index(flags, index, name)
    n = x.numel()
    if n:
        flat = _flat(x)
        _check_kernel[(triton.cdiv(n, BLOCK),)](flat, flat, flat, flags[i:], n, ADD=False, BLOCK_SIZE=BLOCK,
                                               num_warps=4)
