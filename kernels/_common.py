"""Small helpers shared by every kernel folder: interpreter detection, launch checks, dtype tables.

Nothing here launches a kernel (`round_rne` is a Triton device function the kernels call). Kernel files import this module after `triton`, so `TRITON_INTERPRET=1`
must already be in the environment when the first kernel module is imported (Triton decides interpreted vs
compiled when a function is decorated with `@triton.jit`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# dtypes a kernel may keep its recurrent state in / take its activations in.
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# dtypes of slot ids and per-row counts (num_accepted_tokens) a launcher accepts.
INDEX_DTYPES = (torch.int32, torch.int64)

# PAD slot id: a batch row whose slot id is negative reads and writes no cache buffer.
PAD_SLOT_ID = -1


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return bool(triton.knobs.runtime.interpret)


def check_launchable(*tensors: torch.Tensor, name: str) -> None:
    """Raise a clear error when `tensors` cannot be handed to a Triton launch in this process.

    Raises:
        ValueError: tensors on different devices, or on the CPU while Triton compiles for a GPU.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type == "cpu" and not interpreter_active():
        raise ValueError(
            f"{name}: got CPU tensors but Triton is not in interpreter mode; set TRITON_INTERPRET=1 before "
            f"the first `import triton`, or call the `*_ref` PyTorch reference on the CPU"
        )


def check_shape(t: torch.Tensor, shape: tuple[int, ...], what: str, name: str) -> None:
    """Raise ValueError(`name`: `what` must have shape ...) when `t.shape != shape`."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: {what} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str, name: str) -> None:
    """Raise ValueError when `t.dtype` is not one of `allowed`."""
    if t.dtype not in allowed:
        raise ValueError(f"{name}: {what} dtype must be one of {allowed}, got {t.dtype}")


def check_rows(slot_ids: torch.Tensor, indices: torch.Tensor | None, buffer_rows: int, what: str,
               name: str) -> None:
    """Check the batch-row -> buffer-row map of a per-row buffer (e.g. the rewind intermediate states).

    slot_ids: (B,) int32 / int64. indices: None (row b of the buffer belongs to batch row b, so the buffer needs
    B rows) or (B,) int32 / int64 buffer rows (the engine passes the slot ids: a buffer indexed like the
    state cache; FlashInfer's `intermediate_state_indices`). Rows whose slot id is PAD are never dereferenced.

    Raises:
        ValueError: a slot_ids / indices shape or dtype that does not fit, or a buffer with fewer than B rows.
    """
    if slot_ids.dim() != 1:
        raise ValueError(f"{name}: slot_ids must be (B,), got shape {tuple(slot_ids.shape)}")
    check_dtype(slot_ids, INDEX_DTYPES, "slot_ids", name)
    if indices is None:
        if buffer_rows < slot_ids.shape[0]:
            raise ValueError(f"{name}: {what} has {buffer_rows} rows for a batch of {slot_ids.shape[0]}; "
                             f"give one row per batch row, or pass intermediate_state_indices")
        return
    check_shape(indices, tuple(slot_ids.shape), "intermediate_state_indices", name)
    check_dtype(indices, INDEX_DTYPES, "intermediate_state_indices", name)


def row_layout(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t or a contiguous copy, R1, s0, s1) for a kernel that walks t's rows: logical row r of t (its dims but
    the last, row-major) starts at element (r // R1) * s0 + (r % R1) * s1; the last dim has stride 1. Up to
    two strided row dims stay views (e.g. a head slice of a projection output); more are copied."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    dims = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:  # merges with the dim before it
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if not dims:
        return t, 1, 0, 0
    if len(dims) == 1:
        return t, dims[0][0], 0, dims[0][1]
    if len(dims) == 2:
        return t, dims[1][0], dims[0][1], dims[1][1]
    t = t.contiguous()
    return t, max(1, t.numel() // t.shape[-1]), 0, t.shape[-1]


@triton.jit
def round_rne(v, dtype: tl.constexpr):
    """fp32 v rounded to ``dtype`` (round to nearest, ties to even, as torch's casts) and returned as fp32.
    bf16 by integer arithmetic on the fp32 bits (add 0x7FFF plus the lowest kept bit, clear the low 16: the
    standard round-to-nearest-even of fp32 -> bf16), because Triton's interpreter truncates in its bf16 cast
    (on the GPU the cast is cvt.rn and gives the same values). A NaN stays NaN: the integer rounding would carry
    NaNs with high payload bits (0x7FFFFFFF, the GPU's canonical NaN) out of the exponent, to -0.0 / +0.0."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        res = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        res = v.to(dtype).to(tl.float32)
    return res
