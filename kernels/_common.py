"""Small helpers shared by the Triton kernel files: interpreter detection, launch checks, dtype tables.

Nothing here launches a kernel. Kernel files import this module after `triton`, so `TRITON_INTERPRET=1`
must already be in the environment when the first kernel module is imported (Triton decides interpreted vs
compiled when a function is decorated with `@triton.jit`).
"""

from __future__ import annotations

import torch
import triton

# dtypes a kernel may keep its recurrent state in / take its activations in.
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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


def default_dot_precision() -> str:
    """`tl.dot` input precision for fp32 operands: 'ieee' in the interpreter, 'tf32x3' on a GPU.

    tf32x3 splits each fp32 operand into a high and a low tf32 part and keeps fp32-level accuracy (about 1e-6
    relative) on tensor cores; plain 'tf32' (about 1e-3 relative) would bias the recurrent state every step.
    """
    return "ieee" if interpreter_active() else "tf32x3"
