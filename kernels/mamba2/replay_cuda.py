"""The "cuda" variant of `kernels.mamba2.replay.replay_verify`: the checkpointing replay verify as a CUDA kernel
(kernels/mamba2/replay_ckpt.cu) compiled with nvcc at first use on the GPU, loaded with ctypes.

Scope: checkpointing histories only (`ReplayHistory.allocate(..., checkpointing=True)`), round-to-nearest state
writes, CUDA tensors of one input dtype (x, B, C, history x / B; out in any). Same math, history layout, flush rule,
PAD-row and metadata conventions as the Triton kernels (module docstring of kernels/mamba2/replay.py); the
Triton "fma" / "mma" variants stay the tested portable path (CPU interpreter, any strides, stochastic rounding).

Why CUDA: the Nsight Compute profile of issue 28 (docs/kernel_performance.md, "H200 sweep of 2026-12-02 with
FlashInfer and Nsight Compute") shows FlashInfer's checkpointing_ssu DRAM-bound with one 4-warp CTA per (row,
head) and the head's operands staged once in shared memory, and ours bound on chip with four 1-warp programs
per head re-loading C / B / history; Triton 3.6 cannot be told to stage in shared memory.

Kernel (replay_ckpt.cu): one CTA of 128 threads per (P block, batch row, head), head fastest; BP = 128 / TPR
state rows per CTA with TPR = next_pow2(max(N, 64)) / 64 threads per row (Super V3, P 64 x N 128: TPR 2, one
CTA per head). The state tile goes global -> shared memory by cp.async (16-byte chunks, rows padded against
bank conflicts) while C of the new tokens, the new x, dt' and the pending tokens' weights are staged; each
thread then holds 64 state elements of one row in fp32 registers, so the C_t . h reductions are 64 in-thread
FMAs plus log2(TPR) shuffles. The pending tokens (B and x) are staged in chunks of 16 (8 at N > 128), the
first with the other small operands.
A flush stores the state from registers in 16-byte chunks (round to nearest), as the Triton kernel does.
The CPU tests run this kernel's source in host emulation (tests/replay_ckpt_host.cc); the GPU tests
(tests/test_replay_cuda_gpu.py) run it for real.

Build: `nvcc -O3 -arch=sm_XX -shared -Xcompiler -fPIC -DM2R_STATE=.. -DM2R_IN=.. -DM2R_OUT=.. -DM2R_TPR=..
[-DM2R_MAXNREG=R]` per (GPU arch, state / input / output dtype, TPR, register cap), about 3 s, into `cache_dir()` as
replay_ckpt_<sha256 of source and flags>.so; a file lock serialises builders of one library and the result is
renamed into place atomically, so concurrent processes never load a half-written file. nvcc is `$NVCC`, else
on PATH, else `$CUDA_HOME/bin/nvcc`, else /usr/local/cuda/bin/nvcc. The launch goes on
torch.cuda.current_stream() with no allocation or synchronisation, so it can be captured in a CUDA graph
(dynamic shared memory above 48 KB is opted into once per device, at the first, eager launch).

Source: FlashInfer's checkpointing_ssu design (flashinfer.mamba; include/flashinfer/mamba/
kernel_checkpointing_ssu_main.cuh: a CTA per head, operands staged in shared memory, cp.async state loads) and
the closed form of the Mamba2 SSD recurrence (Dao & Gu, "Transformers are SSMs", 2024); written from the math.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from kernels import _nvcc

SOURCE = Path(__file__).with_name("replay_ckpt.cu")
# dtype codes of the .cu (M2R_STATE, M2R_IN, the runtime codes of dt, A, D, dt_bias)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Shapes the kernel takes: head_dim P <= MAX_P (one CTA holds at most 128 rows), d_state N <= MAX_N and a
# multiple of N_MULTIPLE (16-byte state chunks of a bf16 / fp16 state), verify width T <= MAX_T (the new
# tokens' C is staged whole), the GPU at least MIN_CAPABILITY (cp.async).
MAX_P, MAX_N, N_MULTIPLE, MAX_T = 128, 256, 8, 16
MIN_CAPABILITY = (8, 0)
THREADS = 128
ABI = 1  # M2R_ABI of replay_ckpt.cu: the layout of m2r_launch's argument arrays
N_PTRS, N_INTS, N_FLOATS = 16, 13 + 39, 2
FIX = "use variant='fma' or 'mma' (the Triton kernels), or leave variant=None"


def threads_per_row(d_state: int) -> int:
    """TPR of the .cu: threads sharing one state row (64 elements each): 1, 2 or 4 for N <= 64, 128, 256."""
    return max(1, 1 << max(0, math.ceil(math.log2(d_state)) - 6))


def launch_config(batch: int, nheads: int, head_dim: int, d_state: int) -> dict:
    """The launch of one verify: {"ctas", "threads", "rows_per_cta", "threads_per_row"} (a 1-D grid of
    batch x heads x P blocks, head fastest)."""
    tpr = threads_per_row(d_state)
    rows = THREADS // tpr
    return {"ctas": batch * nheads * -(-head_dim // rows), "threads": THREADS, "rows_per_cta": rows,
            "threads_per_row": tpr}


def smem_bytes(T: int, L: int, d_state: int, state_dtype: torch.dtype) -> int:
    """Dynamic shared memory of one CTA in bytes: the Python mirror of `Smem` in replay_ckpt.cu (the launch
    checks it against the library's own `m2r_smem_bytes`)."""
    tpr = threads_per_row(d_state)
    np_, bp, kc = 64 * tpr, THREADS // tpr, 8 if tpr == 4 else 16
    row = (np_ * torch.empty(0, dtype=state_dtype).element_size() + tpr * 16) // 4
    return 4 * (bp * row + 2 * T * np_ + T * bp + kc * np_ + kc * bp + T * T + 2 * T + L)  # C and B: 2 T NP


cache_dir = _nvcc.cache_dir
find_nvcc = _nvcc.find_nvcc
arch_of = _nvcc.arch_of


def build_flags(arch: str, state_dtype: torch.dtype, in_dtype: torch.dtype, d_state: int,
                maxnreg: int | None = None, out_dtype: torch.dtype | None = None) -> list[str]:
    """nvcc flags of one library (everything but the output path and the source): arch "sm_90" etc.; the
    output dtype defaults to the input dtype."""
    flags = ["-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
             f"-DM2R_STATE={DTYPE_CODES[state_dtype]}", f"-DM2R_IN={DTYPE_CODES[in_dtype]}",
             f"-DM2R_OUT={DTYPE_CODES[out_dtype or in_dtype]}", f"-DM2R_TPR={threads_per_row(d_state)}"]
    if maxnreg is not None:
        flags.append(f"-DM2R_MAXNREG={maxnreg}")  # __maxnreg__ (nvcc >= 12.4); -maxrregcount loses to launch bounds
    return flags


def library_path(flags: list[str]) -> Path:
    """cache_dir()/replay_ckpt_<hash>.so, the hash over the source text and the flags."""
    return _nvcc.library_path(SOURCE, flags)


def build(flags: list[str], name: str = "replay_verify") -> Path:
    """The library of `flags`, built with nvcc unless the cache already has it; returns its path
    (kernels/_nvcc.py: one lock per library, written under a temporary name and renamed into place).

    Raises:
        ValueError: no nvcc, a cache folder that cannot be written, or the build failed (nvcc's output tail
            in the message).
    """
    return _nvcc.build(SOURCE, flags, find_nvcc(), name=name, what="variant 'cuda'", fix=FIX)


@functools.cache
def load(path: str):
    """ctypes handle of a built library, argument types set, its ABI checked.

    Raises:
        ValueError: a library whose ABI is not `ABI` (a stale build: delete it from `cache_dir()`).
    """
    lib = ctypes.CDLL(path)
    lib.m2r_abi.restype = ctypes.c_int
    lib.m2r_smem_bytes.restype = ctypes.c_longlong
    lib.m2r_smem_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.m2r_launch.restype = ctypes.c_int
    lib.m2r_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong),
                               ctypes.POINTER(ctypes.c_float), ctypes.c_void_p]
    lib.m2r_error_string.restype = ctypes.c_char_p
    lib.m2r_error_string.argtypes = [ctypes.c_int]
    _nvcc.check_abi(lib.m2r_abi(), ABI, path, "replay_verify")
    return lib


def check_supported(state, x, dt, A, B, C, D, dt_bias, history, out, stochastic_rounding, name: str) -> None:
    """Refuse what the CUDA kernel does not take (`unsupported`), with the fix.

    Raises:
        ValueError: `unsupported`'s reason.
    """
    why = unsupported(state, x, dt, A, B, C, D, dt_bias, history, out, stochastic_rounding, name)
    if why:
        raise ValueError(why)


def unsupported(state, x, dt, A, B, C, D, dt_bias, history, out, stochastic_rounding, name: str) -> str | None:
    """Why the CUDA kernel cannot run this call (a message with the fix), or None; the launcher's shape / dtype
    checks (`_check_inputs`, `_check_history`) have already run. Checked in this order, so that the
    device-independent reasons show on a CPU machine too: a per-step history, stochastic rounding, P > 128,
    N > 256 or not a multiple of 8, T > 16, mixed input dtypes (x, B, C, history x / B), an output or small
    operand (dt, A, D, dt_bias) not fp32 / bf16 / fp16, a state whose rows are not contiguous and 16-byte
    aligned, non-CUDA tensors, a GPU below sm_80, a grid over 2^31 - 1 CTAs, more shared memory than the GPU
    grants a CTA."""
    try:
        _check(state, x, dt, A, B, C, D, dt_bias, history, out, stochastic_rounding, name)
    except ValueError as e:
        return str(e)
    return None


def _check(state, x, dt, A, B, C, D, dt_bias, history, out, stochastic_rounding, name: str) -> None:
    if not history.checkpointing:
        raise ValueError(f"{name}: variant 'cuda' takes a checkpointing history only (ReplayHistory.allocate(..., "
                         f"checkpointing=True)), got a per-step history (x with 2 buffers); {FIX}")
    if stochastic_rounding is not None:
        raise ValueError(f"{name}: variant 'cuda' rounds the state to nearest only; for stochastic_rounding {FIX}")
    _, _, P, N = state.shape
    T, L = x.shape[1], history.x.shape[2]
    if P > MAX_P or N > MAX_N or N % N_MULTIPLE or T > MAX_T:
        raise ValueError(f"{name}: variant 'cuda' takes head_dim <= {MAX_P}, d_state <= {MAX_N} and a multiple of "
                         f"{N_MULTIPLE}, T <= {MAX_T}; got head_dim {P}, d_state {N}, T {T}; {FIX}")
    io = {"x": x, "B": B, "C": C, "history.x": history.x, "history.B": history.B}
    if len({t.dtype for t in io.values()}) != 1:
        got = ", ".join(f"{k} {v.dtype}" for k, v in io.items())
        raise ValueError(f"{name}: variant 'cuda' needs one input dtype for x, B, C and the history's x / B, "
                         f"got {got}; allocate them alike, or {FIX}")
    for what, t in (("out", out), ("dt", dt), ("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and t.dtype not in DTYPE_CODES:
            raise ValueError(f"{name}: variant 'cuda' takes {what} as float32 / bfloat16 / float16, got {t.dtype}; "
                             f"cast it, or {FIX}")
    vec = 16 // state.element_size()
    if (state.stride(3) != 1 or any(s % vec for s in state.stride()[:3]) or state.data_ptr() % 16
            or state.numel() == 0):
        raise ValueError(f"{name}: variant 'cuda' loads the state in 16-byte chunks: its d_state axis must be "
                         f"contiguous and its other strides multiples of {vec} elements, from a 16-byte aligned "
                         f"address; got strides {tuple(state.stride())}; pass a contiguous state, or {FIX}")
    if x.device.type != "cuda":
        raise ValueError(f"{name}: variant 'cuda' runs on CUDA tensors only, got {x.device.type} tensors; on the "
                         f"CPU call replay_verify_ref or the Triton variants in the interpreter ({FIX})")
    cap = torch.cuda.get_device_capability(x.device)
    if cap < MIN_CAPABILITY:
        raise ValueError(f"{name}: variant 'cuda' needs an sm_80+ GPU (cp.async), got sm_{cap[0]}{cap[1]}; {FIX}")
    cfg = launch_config(x.shape[0], state.shape[1], P, N)
    if cfg["ctas"] >= 2**31:
        raise ValueError(f"{name}: variant 'cuda' launches batch x heads x P blocks = {cfg['ctas']} CTAs, over the "
                         f"2^31 - 1 of a 1-D grid; split the batch, or {FIX}")
    smem = smem_bytes(T, L, N, state.dtype)
    optin = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 227 * 1024)
    if smem > optin:
        raise ValueError(f"{name}: variant 'cuda' needs {smem} bytes of shared memory per CTA at T {T}, history "
                         f"length {L}, d_state {N}, over this GPU's {optin}; use a shorter history, or {FIX}")


def replay_verify_cuda(state, x, dt, A, B, C, D, dt_bias, slot_ids, history, prev_num_accepted, buffer_index,
                       *, time_step_limit, out, maxnreg: int | None = None, name: str = "replay_verify"):
    """Launch the CUDA kernel on the current stream: `replay_verify`'s effects and result for a checkpointing
    history (arguments as there; `check_supported` must have passed). Builds the library at first use.

    Mutates: state (flushed rows only), history x / B / dt / dA_cumsum (buffer 1 - buffer_index of live rows;
    x in its one buffer), out. Reads prev_num_accepted and buffer_index only.

    Raises:
        ValueError: nvcc missing or failing (`build`), a stale library (`load`).
        RuntimeError: the launch failed (the CUDA error's name).
    """
    N, T, L = state.shape[3], x.shape[1], history.x.shape[2]
    lib = _library(x.device, state.dtype, x.dtype, out.dtype, N, maxnreg, name)
    _check_smem(lib, T, L, N, state.dtype, name)
    c_ptrs, c_ints, c_floats = launch_args(state, x, dt, A, B, C, D, dt_bias, slot_ids, history, prev_num_accepted,
                                           buffer_index, time_step_limit=time_step_limit, out=out)
    if x.device.index == torch.cuda.current_device():  # the launch's runtime uses the thread's current context
        rc = lib.m2r_launch(c_ptrs, c_ints, c_floats, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    else:
        with torch.cuda.device(x.device):
            rc = lib.m2r_launch(c_ptrs, c_ints, c_floats, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if rc:
        raise RuntimeError(f"{name}: variant 'cuda' launch failed: {lib.m2r_error_string(rc).decode()} "
                           f"(CUDA error {rc})")
    return out


@functools.cache
def _library(device: torch.device, state_dtype, in_dtype, out_dtype, d_state: int, maxnreg, name: str):
    """The loaded library of one configuration (built at first use): one build / hash per process."""
    return load(str(build(build_flags(arch_of(device), state_dtype, in_dtype, d_state, maxnreg, out_dtype), name)))


@functools.cache
def _check_smem(lib, T: int, L: int, d_state: int, state_dtype, name: str) -> None:
    """The Python mirror `smem_bytes` must describe the built kernel (checked once per shape)."""
    smem = lib.m2r_smem_bytes(T, L)
    if smem != smem_bytes(T, L, d_state, state_dtype):
        raise RuntimeError(f"{name}: replay_ckpt.cu asks {smem} bytes of shared memory, replay_cuda.smem_bytes "
                           f"says {smem_bytes(T, L, d_state, state_dtype)}: update the mirror")


def launch_args(state, x, dt, A, B, C, D, dt_bias, slot_ids, history, prev_num_accepted, buffer_index, *,
                time_step_limit, out):
    """The argument arrays of m2r_launch (replay_ckpt.cu: pointers, sizes / dtype codes / strides in
    elements, dt clamp): (ctypes void* [16], long long [52], float [2]). The tensors must outlive the launch."""
    _, H, P, N = state.shape
    Bsz, T = x.shape[:2]
    G, L = B.shape[2], history.x.shape[2]
    lo, hi = time_step_limit
    has_limit = lo > 0.0 or hi < math.inf
    ptrs = [state, x, dt, A, B, C, D, dt_bias, slot_ids, out, history.x, history.B, history.dt,
            history.dA_cumsum, prev_num_accepted, buffer_index]
    ints = [Bsz, T, H, P, N, G, L, int(slot_ids.dtype == torch.int64), DTYPE_CODES[dt.dtype],
            DTYPE_CODES[A.dtype], DTYPE_CODES[D.dtype] if D is not None else 0, DTYPE_CODES[dt_bias.dtype],
            int(has_limit)]
    xh = history.x
    ints += [*state.stride()[:3], *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *out.stride(),
             xh.stride(0), xh.stride(2), xh.stride(3), xh.stride(4), *history.B.stride(), *history.dt.stride(),
             *history.dA_cumsum.stride()]
    assert len(ptrs) == N_PTRS and len(ints) == N_INTS
    c_ptrs = (ctypes.c_void_p * N_PTRS)(*[t.data_ptr() if t is not None else None for t in ptrs])
    c_ints = (ctypes.c_longlong * N_INTS)(*ints)
    c_floats = (ctypes.c_float * N_FLOATS)(float(lo), float(hi) if hi < math.inf else 3.0e38)
    return c_ptrs, c_ints, c_floats
