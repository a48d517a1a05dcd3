"""NVFP4 weights in the engine, run weight-only (W4A16) as the peers run them on Hopper (vLLM's and SGLang's
Marlin paths, TensorRT-LLM #14775): the packed weights stay in device memory and are dequantized inside the
GEMM (kernels.quant.nvfp4: a Triton W4A16 GEMM and a grouped one for the routed experts, each beside its
dequantize-then-matmul PyTorch reference).

The layout is NVIDIA ModelOpt's NVFP4 export (Model-Optimizer ``unified_export_hf``; vLLM modelopt.py
``ModelOptNvFp4LinearMethod`` reads the same): ``weight`` uint8 [N, K / 2], two e2m1 values per byte with
element 2j in the low nibble; ``weight_scale`` float8_e4m3fn [N, K / 16] (one scale per 16 consecutive
values of a row); ``weight_scale_2`` float32 global, ``W = e2m1 * weight_scale * weight_scale_2``;
``input_scale`` float32, the activation scale of the W4A4 path (unused here: activations stay in the compute
dtype). Per-expert tensors are stacked along a leading E.

:func:`nvfp4_path`: "triton" on CUDA (the kernels), "reference" elsewhere (the CPU runs the references:
correct, slow), the same rule as the FP8 path's dequantizing fallback (runners.engine.models.fp8).
:class:`NVFP4Linear` / :class:`NVFP4MoE` are the modules runners.engine.quant swaps in (the format's rules:
runners.engine.formats.nvfp4).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.moe_gemv import ACT_CODES
from kernels.quant.nvfp4 import moe_gemv_nvfp4, nvfp4_words_ok, pair_kernel_for
from registry.hf_config import FORMAT_NVFP4, NVFP4_GROUP_SIZE
from runners.engine.compile import eager_op
from runners.engine.formats import get_format
from runners.engine.models.moe import MoE, expert_kinds, moe_experts_grouped

NVFP4_PACKED_DTYPE = torch.uint8
NVFP4_SCALE_DTYPE = torch.float8_e4m3fn


def nvfp4_path(device: torch.device) -> str:
    """"triton" (kernels.quant.nvfp4's GEMMs) on a CUDA device, else "reference"."""
    return "triton" if device.type == "cuda" else "reference"


def nvfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 ``x W^T + b``: x [..., K] (bf16 / fp16 / fp32), weight uint8 [N, K / 2], weight_scale fp8 [N, K /
    16], weight_scale_2 0-dim float32, bias [N] or None -> [..., N] in x's dtype; the kernel on CUDA, the
    reference elsewhere (kernels.quant.nvfp4). No host synchronisation on CUDA."""
    from kernels.quant import nvfp4

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = nvfp4.nvfp4_linear if x.is_cuda else nvfp4.nvfp4_linear_ref

    x2 = x.reshape(-1, x.shape[-1])
    return kernel(x2, weight, weight_scale, weight_scale_2, bias).reshape(*x.shape[:-1], weight.shape[0])


def nvfp4_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Grouped W4A16 GEMM of the routed experts: x [P, K] sorted by expert, weight uint8 [E, N, K / 2],
    weight_scale fp8 [E, N, K / 16], weight_scale_2 [E] float32, offsets [E] int32 cumulative ends -> [P, N]
    in x's dtype (kernels.quant.nvfp4; the reference off CUDA)."""
    from kernels.quant import nvfp4

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = nvfp4.nvfp4_grouped_mm if x.is_cuda else nvfp4.nvfp4_grouped_mm_ref

    return kernel(x, weight, weight_scale, weight_scale_2, offsets)


class NVFP4Linear(nn.Module):
    """A linear layer with NVFP4 weights run weight-only (W4A16): ``weight`` [out, in / 2] uint8 (two e2m1
    values per byte, element 2j in the low nibble; a Parameter without gradient), ``weight_scale`` [out,
    in / 16] float8_e4m3fn, ``weight_scale_2`` 0-dim float32 (global) and ``input_scale`` 0-dim float32 (the
    W4A4 activation scale, loaded because the checkpoint has it and unused), persistent buffers; ``bias``
    [out] or None. forward(x [..., in]) -> [..., out] in x's dtype through :func:`nvfp4_linear`. Mutates
    nothing."""

    weight_format = FORMAT_NVFP4

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=NVFP4_PACKED_DTYPE,
                                               device=device), requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // NVFP4_GROUP_SIZE,
                                                         dtype=NVFP4_SCALE_DTYPE, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager_op(nvfp4_linear)(x, self.weight, self.weight_scale, self.weight_scale_2, self.bias)

    def gemm_path(self, dtype: torch.dtype) -> str:
        """:func:`nvfp4_path` of its device."""
        return nvfp4_path(self.weight.device)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class NVFP4MoE(MoE):
    """An MoE block whose routed experts hold NVFP4 weights, run W4A16: ``experts_{up,gate,down}`` uint8 [E,
    out, in / 2], ``experts_<kind>_weight_scale`` float8_e4m3fn [E, out, in / 16],
    ``experts_<kind>_weight_scale_2`` and ``experts_<kind>_input_scale`` [E] float32 (checkpoint names
    ``experts.{e}.<kind>_proj.{weight,weight_scale,weight_scale_2,input_scale}``; input scales unused). One
    grouped GEMM per projection over expert-sorted rows (:func:`nvfp4_grouped_mm`, no host synchronisation),
    or at decode sizes on CUDA (the format's ``use_moe_gemv``: runners.engine.formats.nvfp4; codes in whole
    int32 words) as kernels/quant/nvfp4.py's per-pair GEMVs (three launches, same math)."""

    weight_format = FORMAT_NVFP4

    def gemm_path(self, dtype: torch.dtype) -> str:
        """:func:`nvfp4_path` of the experts' device."""
        return nvfp4_path(self.experts_up.device)

    @staticmethod
    def _pair_kernel(h: torch.Tensor, indices: torch.Tensor, mats: dict) -> str:
        """The per-pair kernel whose pair bound decides the path of tokens ``h`` [N, L] routed by ``indices``
        [N, k] (runners.engine.formats.nvfp4: the CUDA kernel's bound reaches further than Triton's): "cuda"
        where both projections would run on it (kernels.quant.nvfp4.pair_kernel_for; for down, ``h`` stands
        for the intermediate, a fresh contiguous tensor of its dtype, whose width K the down codes give), else
        "triton". Asked only between the two bounds and where the per-pair path's device rule holds
        (runners.engine.models.moe.use_moe_gemv): elsewhere the kernel does not change the decision, so a
        prefill or a batch that takes the grouped path either way builds no CUDA library."""
        from runners.engine.models.moe import use_moe_gemv  # at call time: tests force the device rule

        fmt, P = get_format(FORMAT_NVFP4), indices.numel()
        if not (fmt.moe_gemv_bound("triton") < P <= fmt.moe_gemv_bound("cuda") and use_moe_gemv(h, indices)):
            return "triton"  # the same decision under either bound
        first, second = (mats["gate"], mats["up"]) if "gate" in mats else (mats["up"], None)
        kernels = {pair_kernel_for(h, first, second, P), pair_kernel_for(h, mats["down"], None, P)}
        return "cuda" if kernels == {"cuda"} else "triton"

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        mats = {k: tuple(getattr(self, f"experts_{k}{s}") for s in ("", "_weight_scale", "_weight_scale_2"))
                for k in expert_kinds(self)}
        if self.act_name in ACT_CODES and nvfp4_words_ok(*mats.values()):
            fmt = get_format(FORMAT_NVFP4)
            if fmt.use_moe_gemv(h, indices, pair_kernel=self._pair_kernel(h, indices, mats)):
                return moe_gemv_nvfp4(h, weights, indices, mats["up"], mats.get("gate"), mats["down"],
                                      self.act_name)

        def mm(x: torch.Tensor, kind: str, offsets: torch.Tensor) -> torch.Tensor:
            return nvfp4_grouped_mm(x, getattr(self, f"experts_{kind}"),
                                    getattr(self, f"experts_{kind}_weight_scale"),
                                    getattr(self, f"experts_{kind}_weight_scale_2"), offsets)

        return moe_experts_grouped(h, weights, indices, expert_kinds(self), mm, self.act,
                                   self.experts_up.shape[0], activation=self.act_name)


def to_nvfp4_moe(moe: MoE) -> None:
    """Turn ``moe`` (on any device, usually meta) into an :class:`NVFP4MoE` in place: packed expert
    parameters and scale buffers of the format's shapes and dtypes (values unset: the checkpoint fills
    them)."""
    for kind in expert_kinds(moe):
        E, out, inp = getattr(moe, f"experts_{kind}").shape
        dev = getattr(moe, f"experts_{kind}").device
        setattr(moe, f"experts_{kind}", nn.Parameter(
            torch.empty(E, out, inp // 2, dtype=NVFP4_PACKED_DTYPE, device=dev), requires_grad=False))
        moe.register_buffer(f"experts_{kind}_weight_scale", torch.empty(
            E, out, inp // NVFP4_GROUP_SIZE, dtype=NVFP4_SCALE_DTYPE, device=dev))
        moe.register_buffer(f"experts_{kind}_weight_scale_2", torch.ones(E, device=dev))
        moe.register_buffer(f"experts_{kind}_input_scale", torch.ones(E, device=dev))
    moe.__class__ = NVFP4MoE
