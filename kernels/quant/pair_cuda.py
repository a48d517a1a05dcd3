"""The "cuda" per-pair kernels of the quantized routed experts: one projection of
:func:`kernels.quant.nvfp4.moe_gemv_nvfp4` (NVFP4, W4A16) or of :func:`kernels.quant.block_fp8.moe_gemv_block_fp8`
in its w8a16 scheme (block FP8) at decode sizes (kernels/quant/moe_gemv.py's per-pair scheme) as a CUDA kernel
(kernels/quant/pair_gemv.cu) compiled with nvcc at first use on the GPU (kernels/_nvcc.py), loaded with ctypes.

Why CUDA: Triton decodes each packed word twice and stages the decoded tile through shared memory before
its tensor-core product, and its CUDA-core per-pair NVFP4 GEMV costs 8.6 SASS instructions per weight in the K
loop (docs/kernel_performance.md, "Where the per-pair NVFP4 GEMV's time goes"): issue-bound at about twice the
weight-read floor on the H200. This kernel decodes two weights per 32-bit operation straight into the bf16x2
registers of ``mma.sync.m16n8k16`` (no shared memory, no weight re-layout: each lane's logical MMA columns are
mapped onto the 32 physical columns it loaded, and x's registers permuted to match), about 3.6 instructions
per NVFP4 weight in the loop for sm_90 (docs/compile_report_sm90_pair_gemv.json, ``cuda``). Layout, decode
and rounding: the comment at the top of the .cu.

Formats (``FORMATS``): "nvfp4", experts (codes uint8 [E, N, K / 2], weight_scale float8_e4m3fn [E, N, K / 16],
weight_scale_2 float32 [E]); "nvfp4_repacked", the same with the codes repacked at load time
(kernels.quant.nvfp4.repack_codes: a bit permutation inside each 32-bit word that makes the decode about a
third cheaper; per-pair and the grouped REPACKED_FORMS only; "block_fp8_repacked" likewise with
kernels.quant.block_fp8.repack_codes); "block_fp8", experts (weight float8_e4m3fn [E, N, K], weight_scale_inv float32
[E, ceil(N / 128), ceil(K / 128)]).

Scope (:func:`unsupported` names what is missing): bf16 activations (the engine's), input width K a multiple of
32, codes 16-byte aligned (row and expert strides included), scales 2-byte (NVFP4) or 4-byte (block FP8,
contiguous) aligned, activation rows 16-byte aligned, at most 65535 pairs, CUDA tensors on an sm_80+ NVIDIA GPU,
an nvcc that builds it for that GPU (without one, or when the build fails, the Triton kernel runs instead,
with one warning). Unsplit launches only: the kernel's 4 warps split K inside each CTA and add their sums in a
fixed order (the same bits eager and in a CUDA graph).

The CPU tests run the kernel's source in host emulation (tests/pair_gemv_host.cc); the GPU tests
(tests/test_kernels_quant_moe_gemv_gpu.py) run it for real against the references.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch

from kernels import _nvcc

SOURCE = Path(__file__).with_name("pair_gemv.cu")
ABI = 9  # NVP_ABI of pair_gemv.cu: the layout of nvp_launch's argument arrays
N_PTRS, N_INTS = 9, 19
FORMATS = {"nvfp4": 0, "block_fp8": 1, "nvfp4_repacked": 2, "block_fp8_repacked": 3}  # the .cu's format codes (nvp::kFmt*)
NVFP4_FORMATS = ("nvfp4", "nvfp4_repacked")  # codes uint8 [E, N, K / 2], e4m3 block scales, weight_scale_2
K_MULTIPLE = 32  # input columns per lane load
MAX_PAIRS = 65535  # the grid's y dimension
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 bf16 (sm_80 - sm_89: the bf16x2 multiply as an fma with -0.0)
MAX_EXPERTS = 65535  # the grouped form's grid y dimension
# The grouped form decodes each weight chunk once per 32 rows of an expert (16 in the pipelined form): past
# this many rows per expert on average (prefill sizes) each pass re-reads the weights, and Triton's GEMM
# tiles take the call instead.
GROUPED_MAX_ROWS_PER_EXPERT = 64
SCALE_DTYPES = {"nvfp4": torch.float8_e4m3fn, "block_fp8": torch.float32, "nvfp4_repacked": torch.float8_e4m3fn,
                "block_fp8_repacked": torch.float32}
REPACKED = {"nvfp4_repacked": "nvfp4", "block_fp8_repacked": "block_fp8"}  # repacked format -> its module
KERNELS = ("triton", "cuda")  # the values of each format's PAIR_KERNEL setting
# Per-pair form, both formats (bench_moe_gemv's ``_cuda_prefetch`` / ``_cuda_pdl`` rows time them against the
# plain kernel; neither changes a bit of the result):
# PREFETCH: each CTA asks for all of its weight chunks into L2 (prefetch.global.L2) before its loop, so more
#   bytes are in flight than its registers hold (the loop's later chunks then come from L2).
PREFETCH = False
# PDL: a launch that run_pair_launches marks ``dependent`` (the down projection, right after gate / up) goes out
#   as a programmatic dependent launch on sm_90+: its CTAs start as gate / up's last CTAs run, prefetch their
#   weights (with PREFETCH) and wait for gate / up to complete before reading its output.
PDL = False
PDL_MIN_CAPABILITY = (9, 0)  # griddepcontrol and the launch attribute (Hopper)
# The grouped form's kernel (read at call time; both give each output its sum in a fixed order):
# "split": grouped_gemv_kernel, one CTA per 16 output rows and expert, its 4 warps splitting K (each warp loads
#   x for its own chunks: at 8 tokens per group, 2 bytes of x per byte of NVFP4 codes);
# "wide": grouped_wide_kernel, one CTA per 64 output rows and expert, each warp its own 16 rows over all of K,
#   the 4 warps reading the same x columns in the same step (a quarter of the x traffic from L2);
# "pipelined": grouped_pipelined_kernel, the wide form's grid with the next two chunks' codes in flight while
#   the current two are multiplied, and a pass's token-group count a template argument (every group's x loaded
#   before the chunk's MMAs). The same sums in the same order as "wide": the same bits.
# "persistent": persistent_kernel (grouped), a grid of 3 CTAs per SM (the .cu's kPersistentCtasPerSm) walking
#   the (expert, 64 rows) tiles, each warp loading its next pass's first chunks (the next tile's included) in
#   the last step of the current one, so that its loads do not stop at tile boundaries. The pipelined form's
#   sums in the same order: the same bits.
# "wide" is faster than "split" at every point measured (H100, docs/kernel_performance.md: 1.18-1.29x), and
# "pipelined" than "wide" for NVFP4 (1.21-1.32x at 32-256 tokens of Super V3's experts), within 3 % of it
# for block FP8 (docs/kernel_performance.md, "The grouped CUDA kernel's pipelined form"). "persistent" is
# 4-16 % slower than "pipelined" at 64-256 tokens on an H100 (fewer warps per SM hide less of the x loads'
# latency: docs/kernel_performance.md, "The persistent forms of the routed experts' CUDA kernels").
# "m32": grouped_m32_kernel, one CTA per 128 output rows and expert, each warp 32 rows (two MMA tiles) over all
#   of K, each x fragment feeding both tiles: half the pipelined form's x loads per weight byte. The pipelined
#   form's sums in the same order: the same bits. On an H100 (Super V3's routed experts, the whole call) it is
#   9 % faster than "pipelined" at 256 tokens (11 rows per expert), 2 % at 64 (2.75), 4 % slower at 8 (0.34);
#   the batch-64 replay step at half depth 3.5 % faster (docs/kernel_performance.md, "The m32 grouped form").
# "auto" (the default, not a kernel): grouped_form's measured rule, "m32" for the stored NVFP4 codes from
#   M32_MIN_ROWS_PER_EXPERT rows per expert, "pipelined" elsewhere.
GROUPED_FORMS = ("split", "wide", "pipelined", "persistent", "m32")
REPACKED_FORMS = ("pipelined", "persistent", "m32")  # the grouped forms built for the repacked formats
GROUPED_FORM_SETTINGS = ("auto",) + GROUPED_FORMS  # what GROUPED_FORM takes
GROUPED_FORM = "auto"
# The fewest rows per expert (a launch's rows / experts) at which "auto" runs "m32" for "nvfp4": the lowest point
# measured where m32 was the faster form (64 tokens of Super V3's top-22 of 512 experts); below it the nearest
# measured point (8 tokens) had "pipelined" ahead.
M32_MIN_ROWS_PER_EXPERT = 2.75
# X_PERM (read at call time; NVFP4 in the grouped forms X_PERM_FORMS only, else ignored): grouped_mm copies x with
#   each 8 columns in the order X_PERM_ORDER (permute_x_columns) and the kernel takes each x word as an MMA B
#   register as loaded, where it otherwise spends two byte permutes per MMA pairing element i with i + 4 (the
#   codes' order). The same products in the same order: the same bits. Off: on an H100 the pipelined form with
#   it gained 2-4 % of Super V3's routed experts at 8 and 64 tokens and lost 2 % at 256 in one run
#   (docs/kernel_performance.md, "The NVFP4 decode's instruction count"), and gained 4 / 6 / 1.6 % at 8 / 64 /
#   256 in another (docs/kernel_performance.md, "The m32 grouped form"), where at 64 tokens it was ahead of m32
#   too. M32_MIN_ROWS_PER_EXPERT holds with X_PERM off; m32 with X_PERM is not yet timed.
#   The repacked format "nvfp4_repacked" drops the same permutes with no copy.
X_PERM = False
X_PERM_FORMS = ("pipelined", "m32")  # the grouped forms built to take x permuted (NVFP4)
# GROUPED_PREFETCH (read at call time; the "m32" form of "nvfp4" / "nvfp4_repacked" only, else ignored): each
#   warp asks for its codes 4 whole chunks ahead into L2 (prefetch.global.L2, no registers), so more bytes are
#   in flight than its registers hold; the m32 kernel still waited on global loads at 58-62 % of DRAM's peak
#   (docs/kernel_performance.md, "The m32 grouped form"). The same loads: the same bits. Off: not yet timed.
#   Unlike PREFETCH (the per-pair form's up-front prefetch of a CTA's every chunk, slower at every point
#   measured) it keeps a fixed distance ahead of the loads.
GROUPED_PREFETCH = False
GROUPED_PREFETCH_FORMATS = ("nvfp4", "nvfp4_repacked")
X_PERM_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# The per-pair form's kernel (read at call time):
# "split": pair_gemv_kernel, one CTA per (16 output rows, pair), its 4 warps splitting K and adding their sums
#   through shared memory;
# "persistent": the per-pair persistent_kernel, 4 CTAs per SM (NVFP4 ungated) or 3 (block FP8, gated pairs)
#   walking the (pair, 64 rows) tiles, each warp one pair's 16 rows over all of K (a gated pair's gate and up
#   together, one chunk of each per step) with the next tile's codes loaded in the last step of the current
#   one; PREFETCH does not apply to it. Each sum in another order than "split" (one warp over K in column
#   order), so other bits; the same bits eager and in a CUDA graph. On an H100 it is 7 % (NVFP4) and 32 %
#   (block FP8) slower than "split" at one token (docs/kernel_performance.md, "The persistent forms of the
#   routed experts' CUDA kernels"): "split" stays the default.
PAIR_FORMS = ("split", "persistent")
PAIR_FORM = "split"


def fix(fmt: str) -> str:
    """The way out named in this module's errors for format `fmt`."""
    module = REPACKED.get(fmt, fmt)
    return f"set kernels.quant.{module}.PAIR_KERNEL / GROUPED_KERNEL = 'triton' (the Triton kernels)"


def build_flags(arch: str) -> list[str]:
    """nvcc flags of the library for GPU architecture `arch` ("sm_90")."""
    return ["-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-std=c++17"]


def build(flags: list[str], name: str = "moe_gemv_nvfp4", fmt: str = "nvfp4") -> Path:
    """The library of `flags`, built with nvcc unless the cache has it (kernels/_nvcc.py); returns its path.

    Raises:
        ValueError: no nvcc, an unwritable cache folder or a failed build, with the fix.
    """
    return _nvcc.build(SOURCE, flags, _nvcc.find_nvcc(), name=name, what="PAIR_KERNEL 'cuda'", fix=fix(fmt))


@functools.cache
def load(path: str):
    """ctypes handle of a built library, argument types set, its ABI checked.

    Raises:
        ValueError: a library whose ABI is not `ABI` (a stale build: delete it from the cache folder).
    """
    lib = ctypes.CDLL(path)
    lib.nvp_abi.restype = ctypes.c_int
    lib.nvp_launch.restype = ctypes.c_int
    lib.nvp_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong), ctypes.c_void_p]
    lib.nvp_launch_grouped.restype = ctypes.c_int
    lib.nvp_launch_grouped.argtypes = lib.nvp_launch.argtypes
    lib.nvp_error_string.restype = ctypes.c_char_p
    lib.nvp_error_string.argtypes = [ctypes.c_int]
    _nvcc.check_abi(lib.nvp_abi(), ABI, path, "pair_cuda")
    return lib


@functools.cache
def _library(device: torch.device, name: str, fmt: str):
    """The loaded library for `device`'s architecture (built at first use)."""
    return load(str(build(build_flags(_nvcc.arch_of(device)), name, fmt)))


def _input_width(fmt: str, codes: torch.Tensor) -> int:
    return 2 * codes.shape[-1] if fmt in NVFP4_FORMATS else codes.shape[-1]


def unsupported(fmt: str, x: torch.Tensor, w, w2, P: int) -> str | None:
    """Why the CUDA kernel cannot run the projection x [rows, K] times the experts w of format `fmt` (the
    module docstring's tuples; w2, the up projection of a gated pair, or None) for P pairs, or None when it
    can. Reads shapes, strides, pointers and the device, checked so that the device-independent reasons show
    on a CPU machine too; the first call that passes them on a GPU builds and loads the library
    (`_build_failure`: a failed build is a reason, said once as a warning).

    Raises:
        ValueError: `fmt` is not one of FORMATS.
    """
    if fmt not in FORMATS:
        raise ValueError(f"pair_cuda: format must be one of {tuple(FORMATS)}, got {fmt!r}")
    codes, scales = w[0], w[1]
    K = _input_width(fmt, codes)
    if x.dtype != torch.bfloat16:
        return f"activations must be bfloat16, got {x.dtype}"
    if K % K_MULTIPLE or K == 0:
        return f"the input width K must be a positive multiple of {K_MULTIPLE}, got {K}"
    if P > MAX_PAIRS:
        return f"at most {MAX_PAIRS} (token, expert) pairs per launch, got {P}"
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return "activation rows must be contiguous and 16-byte aligned"
    nvfp4 = fmt in NVFP4_FORMATS
    scale_align = 2 if nvfp4 else 4
    for mat in (w, w2):
        if mat is None:
            continue
        c, s = mat[0], mat[1]
        if s.dtype != SCALE_DTYPES[fmt]:
            return f"{fmt} scales must be {SCALE_DTYPES[fmt]}, got {s.dtype}"
        if nvfp4 and (mat[2].dtype != torch.float32 or mat[2].stride(0) != 1):
            return "the NVFP4 global scales must be contiguous float32"
        if c.stride(2) != 1 or c.stride(1) % 16 or c.stride(0) % 16 or c.data_ptr() % 16:
            return "the experts' codes must be contiguous rows at 16-byte aligned strides and address"
        if s.stride(2) != 1 or (nvfp4 and (s.stride(1) % 2 or s.stride(0) % 2)) \
                or s.data_ptr() % scale_align:
            return "the experts' scales must be contiguous rows, aligned to their element"
        if w2 is not None and (c.stride() != codes.stride() or s.stride() != scales.stride()):
            return "gate and up must share their strides"
    if x.device.type != "cuda":
        return f"CUDA tensors only, got {x.device.type}"
    if torch.version.hip is not None:
        return "an NVIDIA GPU (this is a ROCm build of torch)"
    cap = torch.cuda.get_device_capability(x.device)
    if cap < MIN_CAPABILITY:
        return f"an sm_80+ GPU (bf16 mma.sync), got sm_{cap[0]}{cap[1]}"
    if _nvcc_path() is None:
        return "no nvcc to build it ($NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
    return _build_failure(x.device, fmt)


@functools.cache
def _build_failure(device: torch.device, fmt: str) -> str | None:
    """None once the library for `device` is built and loaded (at the first call that could use it), else why
    not, said once as a warning: a toolkit that cannot build for this GPU leaves the calls to Triton instead of
    failing them."""
    try:
        _library(device, f"moe_gemv_{fmt}", fmt)
    except (ValueError, OSError) as e:
        warnings.warn(f"kernels.quant.pair_cuda: the CUDA kernel could not be built or loaded for {device}; the "
                      f"Triton kernels run instead ({e})", stacklevel=3)
        return f"the CUDA build failed: {str(e)[:300]}"
    return None


@functools.cache
def _nvcc_path() -> str | None:
    """kernels._nvcc.find_nvcc(), looked up once per process (unsupported runs at every launch)."""
    return _nvcc.find_nvcc()


def check_setting(setting: str, fmt: str, what: str = "PAIR_KERNEL") -> None:
    """Raise ValueError unless `setting`, format `fmt`'s `what` setting (PAIR_KERNEL / GROUPED_KERNEL), is
    one of KERNELS."""
    if setting not in KERNELS:
        raise ValueError(f"kernels.quant.{REPACKED.get(fmt, fmt)}.{what} must be one of {KERNELS}, got "
                         f"{setting!r}")


def kernel_for(setting: str, fmt: str, x: torch.Tensor, w, w2, P: int) -> str:
    """The kernel a format's PAIR_KERNEL `setting` gives one projection: "cuda" where the setting asks for it
    and :func:`unsupported` finds nothing missing, else "triton".

    Raises:
        ValueError: `setting` is not one of KERNELS.
    """
    check_setting(setting, fmt)
    if setting == "cuda" and unsupported(fmt, x, w, w2, P) is None:
        return "cuda"
    return "triton"


def launch_args(fmt: str, x, idx, w, w2, out, topk: int, act_code: int, experts: int = 0, prefetch: bool = False,
                pdl: bool = False, form: str = "split", x_permuted: bool = False, ctas: int = 0):
    """The argument arrays of nvp_launch / nvp_launch_grouped (pair_gemv.cu: pointers; sizes, codes, strides,
    the format, grouped the experts E with idx the offsets, the per-pair form's prefetch and pdl flags, the
    form's kernel, one of GROUPED_FORMS (per pair: of PAIR_FORMS) by its index in GROUPED_FORMS, whether x's
    columns are stored permuted, and the persistent forms' CTAs, 0 for the launcher's default): (ctypes void*
    [N_PTRS], long long [N_INTS]). The tensors must outlive the launch.
    Scale strides go in bytes."""
    codes, scales = w[0], w[1]
    gs = w[2] if fmt in NVFP4_FORMATS else scales  # the FP8 kernel reads no global scale
    o2 = w2 if w2 is not None else w
    gs2 = o2[2] if fmt in NVFP4_FORMATS else o2[1]
    P, NOUT, K = (x.shape[0] if experts else idx.numel()), codes.shape[1], _input_width(fmt, codes)
    ptrs = [x, idx, codes, scales, gs, o2[0], o2[1], gs2, out]
    es = scales.element_size()
    ints = [P, NOUT, K, topk, act_code, int(w2 is not None), x.stride(0), codes.stride(0), codes.stride(1),
            scales.stride(0) * es, scales.stride(1) * es, out.stride(0), FORMATS[fmt], experts, int(prefetch),
            int(pdl), GROUPED_FORMS.index(form), int(x_permuted), ctas]
    assert len(ptrs) == N_PTRS and len(ints) == N_INTS
    return (ctypes.c_void_p * N_PTRS)(*[t.data_ptr() for t in ptrs]), (ctypes.c_longlong * N_INTS)(*ints)


def launch_pair(fmt: str, x, idx, w, w2, out_dtype, topk: int, act_code: int, name: str = "moe_gemv_nvfp4",
                dependent: bool = False):
    """One projection of the per-pair path (the ``launch`` contract of kernels/moe_gemv.py's
    ``run_pair_launches``): x [rows, K] bf16, idx [P] int64 expert per pair (pair p reads row p // topk of x),
    w / w2 the experts in format `fmt` (w2: up of a gated pair, else None), act_code 0 / 1 relu2 / 2 silu.
    Returns (out [P, N] bf16 with the activation applied, None, 1): never split. Launched on the current
    stream, no allocation but out, no synchronisation (CUDA-graph capturable). `unsupported` must have
    returned None. ``dependent``: the previous kernel on the stream wrote x and nothing else this launch reads
    (run_pair_launches' down projection); with PDL on an sm_90+ GPU the launch then overlaps that kernel's
    end (the module's PDL note). PREFETCH applies to every launch of the split form. PAIR_FORM picks the
    kernel.

    Raises:
        ValueError: nvcc missing or failing, a stale library, a PAIR_FORM not in PAIR_FORMS.
        RuntimeError: the launch failed (the CUDA error's name).
    """
    if PAIR_FORM not in PAIR_FORMS:
        raise ValueError(f"kernels.quant.pair_cuda.PAIR_FORM = {PAIR_FORM!r}: expected one of {PAIR_FORMS}")
    if out_dtype != torch.bfloat16:
        raise ValueError(f"{name}: PAIR_KERNEL 'cuda' writes bfloat16, asked for {out_dtype}; {fix(fmt)}")
    lib = _library(x.device, name, fmt)
    P, NOUT = idx.numel(), w[0].shape[1]
    out = torch.empty(P, NOUT, dtype=torch.bfloat16, device=x.device)
    pdl = dependent and PDL and torch.cuda.get_device_capability(x.device) >= PDL_MIN_CAPABILITY
    c_ptrs, c_ints = launch_args(fmt, x, idx, w, w2, out, topk, act_code, prefetch=PREFETCH, pdl=pdl,
                                 form=PAIR_FORM)
    with torch.cuda.device(x.device):
        rc = lib.nvp_launch(c_ptrs, c_ints, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if rc:
        raise RuntimeError(f"{name}: PAIR_KERNEL 'cuda' launch failed: {lib.nvp_error_string(rc).decode()} "
                           f"(CUDA error {rc})")
    return out, None, 1


def grouped_unsupported(fmt: str, x: torch.Tensor, w, offsets: torch.Tensor) -> str | None:
    """Why the grouped CUDA kernel cannot run x [P, K] (rows sorted by expert) times the experts w of format
    `fmt` with int32 cumulative row ends `offsets` [E], or None: :func:`unsupported`'s conditions (no pair
    limit: the grid is over experts), offsets contiguous int32, at most MAX_EXPERTS experts and
    GROUPED_MAX_ROWS_PER_EXPERT rows per expert on average.

    Raises:
        ValueError: `fmt` is not one of FORMATS.
    """
    if offsets.dtype != torch.int32 or offsets.stride(0) != 1:
        return "offsets must be contiguous int32"
    if offsets.numel() > MAX_EXPERTS:
        return f"at most {MAX_EXPERTS} experts, got {offsets.numel()}"
    if x.shape[0] > GROUPED_MAX_ROWS_PER_EXPERT * offsets.numel():
        return (f"at most {GROUPED_MAX_ROWS_PER_EXPERT} rows per expert on average, got {x.shape[0]} rows for "
                f"{offsets.numel()} experts")
    return unsupported(fmt, x, w, None, 0)


def grouped_kernel_for(setting: str, fmt: str, x: torch.Tensor, w, offsets: torch.Tensor) -> str:
    """The kernel a format's GROUPED_KERNEL `setting` gives one grouped product: "cuda" where the setting
    asks for it and :func:`grouped_unsupported` finds nothing missing, else "triton".

    Raises:
        ValueError: `setting` is not one of KERNELS.
    """
    check_setting(setting, fmt, "GROUPED_KERNEL")
    if setting == "cuda" and grouped_unsupported(fmt, x, w, offsets) is None:
        return "cuda"
    return "triton"


def permute_x_columns(x: torch.Tensor) -> torch.Tensor:
    """x [P, K] (K % 8 == 0) with each 8 columns 8j .. 8j + 7 in the order X_PERM_ORDER: a new contiguous
    tensor whose column 8j + m is x's column 8j + X_PERM_ORDER[m] (the layout grouped_mm's X_PERM hands the
    NVFP4 pipelined kernel).

    Raises:
        ValueError: x is not 2-D or K is not a multiple of 8.
    """
    if x.dim() != 2 or x.shape[1] % 8:
        raise ValueError(f"permute_x_columns: x must be [P, K] with K % 8 == 0, got {tuple(x.shape)}")
    # (0, 4, 1, 5, 2, 6, 3, 7) is each 8 columns as 2 x 4 read transposed: a strided copy, no index tensor
    # (a host-to-device copy of one would synchronise, which CUDA-graph capture refuses)
    return x.reshape(x.shape[0], -1, 2, 4).transpose(2, 3).reshape(x.shape[0], -1)


def grouped_form(fmt: str, rows_per_expert: float) -> str:
    """The grouped form (one of GROUPED_FORMS) that runs format `fmt` for a launch of `rows_per_expert` rows
    per expert on average (its rows / its experts): GROUPED_FORM, except that "auto" is "m32" for "nvfp4" from
    M32_MIN_ROWS_PER_EXPERT and "pipelined" elsewhere, and that a repacked format runs "pipelined" where the
    form is not one of REPACKED_FORMS.

    Raises:
        ValueError: GROUPED_FORM is not one of GROUPED_FORM_SETTINGS.
    """
    if GROUPED_FORM not in GROUPED_FORM_SETTINGS:
        raise ValueError(f"kernels.quant.pair_cuda.GROUPED_FORM = {GROUPED_FORM!r}: expected one of "
                         f"{GROUPED_FORM_SETTINGS}")
    if GROUPED_FORM == "auto":
        return "m32" if fmt == "nvfp4" and rows_per_expert >= M32_MIN_ROWS_PER_EXPERT else "pipelined"
    if fmt in REPACKED and GROUPED_FORM not in REPACKED_FORMS:
        return "pipelined"
    return GROUPED_FORM


def grouped_mm(fmt: str, x: torch.Tensor, w, offsets: torch.Tensor, out: torch.Tensor | None = None,
               name: str = "grouped_mm") -> torch.Tensor:
    """Rows offsets[e - 1] .. offsets[e] - 1 of x [P, K] bf16 (sorted by expert) times expert e's matrix of
    format `fmt`, transposed: [P, N] bf16, each sum in fp32 rounded once (kernels/quant's grouped references;
    rows past offsets[-1] are left unwritten). The form is grouped_form's for x's rows over offsets' experts
    (the default "auto": "m32" for NVFP4 from M32_MIN_ROWS_PER_EXPERT, else "pipelined"). One CTA per (64
    output rows, expert) with "wide" or "pipelined", per 128 with "m32" (each warp two 16-row tiles), per 16
    with "split", 3 per SM walking the 64-row tiles with "persistent"; the expert's rows are the MMA's N, up
    to 32 per pass over its weights (16 with "pipelined", "persistent" and "m32"). With X_PERM (NVFP4,
    X_PERM_FORMS) x is first copied with its columns permuted (permute_x_columns); with GROUPED_PREFETCH
    ("m32", NVFP4) each warp's codes are asked into L2 a few chunks ahead. Current stream, no
    synchronisation (CUDA-graph capturable).
    `grouped_unsupported` must have returned None; ``out``, when given, a row-contiguous [P, N] bf16 tensor
    (the callers' output_buffer) is written and returned.

    Raises:
        ValueError: nvcc missing or failing, a stale library, an `out` that does not fit, a GROUPED_FORM not
            in GROUPED_FORM_SETTINGS.
        RuntimeError: the launch failed (the CUDA error's name).
    """
    form = grouped_form(fmt, x.shape[0] / max(offsets.numel(), 1))
    lib = _library(x.device, name, fmt)
    shape = (x.shape[0], w[0].shape[1])
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != torch.bfloat16 or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"{name}: out must be a row-contiguous {shape} bfloat16 tensor on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    x_permuted = X_PERM and fmt == "nvfp4" and form in X_PERM_FORMS
    prefetch = GROUPED_PREFETCH and form == "m32" and fmt in GROUPED_PREFETCH_FORMATS
    if x_permuted:
        x = permute_x_columns(x)
    c_ptrs, c_ints = launch_args(fmt, x, offsets, w, None, out, 1, 0, experts=offsets.numel(),
                                 form=form, x_permuted=x_permuted, prefetch=prefetch)
    with torch.cuda.device(x.device):
        rc = lib.nvp_launch_grouped(c_ptrs, c_ints, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if rc:
        raise RuntimeError(f"{name}: GROUPED_KERNEL 'cuda' launch failed: {lib.nvp_error_string(rc).decode()} "
                           f"(CUDA error {rc})")
    return out
