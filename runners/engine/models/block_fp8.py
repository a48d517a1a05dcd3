"""Block FP8 weights in the engine (transformers' fine-grained FP8, Qwen's and DeepSeek's FP8 releases):
``weight`` float8_e4m3fn [N, K] with ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] (a multiplier per
128 x 128 block: ``W = weight * weight_scale_inv[n // 128, k // 128]``), activations quantized at run time
per token and 128-column group (``activation_scheme: dynamic``), the w8a8 block GEMM of DeepSeek-V3's
inference code as vLLM (fp8_utils ``w8a8_block_fp8_matmul``) and SGLang run it. The GEMMs are
kernels.quant.block_fp8's (Triton, or block-scaled ``torch._scaled_mm`` where the device's torch runs it;
each beside its PyTorch reference); :func:`block_fp8_path` says which runs on a device.
:class:`BlockFP8Linear` / :class:`BlockFP8MoE` are the modules runners.engine.quant swaps in (the format's
rules: runners.engine.formats.block_fp8).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.moe_gemv import ACT_CODES
from kernels.quant.block_fp8 import BLOCK, moe_gemv_block_fp8
from registry.hf_config import FORMAT_BLOCK_FP8
from runners.engine.compile import eager_op
from runners.engine.formats import get_format
from runners.engine.models.moe import MoE, expert_kinds, moe_experts_grouped

FP8_DTYPE = torch.float8_e4m3fn
BLOCK_FP8_BLOCK = (BLOCK, BLOCK)  # the block the kernels run


def block_fp8_path(device: torch.device, shape: tuple[int, int] | None = None) -> str:
    """Which GEMMs a block-FP8 weight of ``shape`` (N, K; None for routed experts) runs on ``device``:
    "reference" off CUDA; "triton+scaled_mm" where kernels.quant.block_fp8.block_scaled_mm_supported holds
    and N, K are whole blocks (its ``block_fp8_linear`` picks block-scaled ``torch._scaled_mm`` for larger row
    counts and the Triton kernels at decode sizes), else "triton". Runs that function's one-time probe on the
    device (call at load time, never inside a captured step)."""
    if device.type != "cuda":
        return "reference"
    if shape is None:
        return "triton"
    from kernels.quant.block_fp8 import block_scaled_mm_supported

    whole = shape[0] % BLOCK_FP8_BLOCK[0] == 0 and shape[1] % BLOCK_FP8_BLOCK[1] == 0
    return "triton+scaled_mm" if whole and block_scaled_mm_supported(device) else "triton"


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times block-FP8 ``weight`` [N, K] (``weight_scale_inv`` [ceil(N/128), ceil(K/128)] float32)
    plus bias [N] -> [..., N] in x's dtype; the kernel on CUDA, the reference elsewhere."""
    from kernels.quant import block_fp8

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = block_fp8.block_fp8_linear if x.is_cuda else block_fp8.block_fp8_linear_ref

    x2 = x.reshape(-1, x.shape[-1])
    return kernel(x2, weight, weight_scale_inv, bias, scheme=dense_scheme(x)).reshape(*x.shape[:-1],
                                                                                      weight.shape[0])


def dense_scheme(x: torch.Tensor) -> str:
    """The scheme (w8a8 / w8a16) of a dense block-FP8 product of ``x`` [..., K]: the format's rule
    (WeightFormat.scheme) for its rows, with the format's wider dense bound where the w8a16 product runs the
    tensor-core kernel (kernels.quant.block_fp8.use_w8a16_dot: 16-bit x, from W8A16_DOT_MIN_ROWS rows),
    whose time stays flat in the rows; the GEMV's grows with them."""
    from kernels.quant import block_fp8

    rows = x.numel() // max(1, x.shape[-1])
    flat = block_fp8.use_w8a16_dot(x, rows, grouped=False)
    return get_format(FORMAT_BLOCK_FP8).scheme(rows, dense=flat)


def grouped_scheme(rows: int, experts: int) -> str:
    """The scheme of a grouped block-FP8 product of ``rows`` (P, the routed pairs) over ``experts`` (E): the
    format's rule for about P / min(E, P) rows per expert."""
    return get_format(FORMAT_BLOCK_FP8).scheme(rows / max(1, min(experts, rows)))


def block_fp8_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Grouped block-FP8 GEMM of the routed experts: x [P, K] sorted by expert, weight fp8 [E, N, K],
    weight_scale_inv [E, ceil(N/128), ceil(K/128)] float32, offsets [E] int32 cumulative ends -> [P, N] in
    x's dtype (kernels.quant.block_fp8; the reference off CUDA), in the format's scheme for about
    P / min(E, P) rows per expert (WeightFormat.scheme)."""
    from kernels.quant import block_fp8

    # the Triton kernel on CUDA; elsewhere its reference, also under TRITON_INTERPRET=1 (the interpreter is
    # for the kernel tests, far too slow for an engine)
    kernel = block_fp8.block_fp8_grouped_mm if x.is_cuda else block_fp8.block_fp8_grouped_mm_ref
    return kernel(x, weight, weight_scale_inv, offsets, scheme=grouped_scheme(x.shape[0], weight.shape[0]))


class BlockFP8Linear(nn.Module):
    """A linear layer with block-FP8 weights (transformers' fine-grained FP8): ``weight`` [out, in]
    float8_e4m3fn (a Parameter without gradient), ``weight_scale_inv`` [ceil(out / 128), ceil(in / 128)]
    float32 (a persistent buffer; the checkpoint's bfloat16 / float32 block multipliers, upcast on load),
    ``bias`` [out] or None. forward(x [..., in]) -> [..., out] in x's dtype through :func:`block_fp8_linear`
    (activations quantized per token and 128-column group at run time). Mutates nothing."""

    weight_format = FORMAT_BLOCK_FP8

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bn, bk = BLOCK_FP8_BLOCK
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.ones(-(-out_features // bn), -(-in_features // bk),
                                                             dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager_op(block_fp8_linear)(x, self.weight, self.weight_scale_inv, self.bias)

    def gemm_path(self, dtype: torch.dtype) -> str:
        """:func:`block_fp8_path` of this weight on its device."""
        return block_fp8_path(self.weight.device, tuple(self.weight.shape))

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class BlockFP8MoE(MoE):
    """An MoE block whose routed experts hold block-FP8 weights: ``experts_{up,gate,down}`` float8_e4m3fn
    with the shapes of :class:`runners.engine.models.moe.MoE` ([E, out, in]) and
    ``experts_<kind>_weight_scale_inv`` [E, ceil(out / 128), ceil(in / 128)] float32 buffers (checkpoint names
    ``experts.{e}.<kind>_proj.weight_scale_inv``). The experts run as one grouped GEMM per projection over
    expert-sorted rows (:func:`block_fp8_grouped_mm`, no host synchronisation), or at decode sizes on CUDA
    (the format's ``use_moe_gemv``: runners.engine.formats.block_fp8) as kernels/quant/block_fp8.py's per-pair
    GEMVs (three launches, same math); router, shared expert and latent projections are those of the MoE it
    was made from."""

    weight_format = FORMAT_BLOCK_FP8

    def gemm_path(self, dtype: torch.dtype) -> str:
        """:func:`block_fp8_path` of the experts' device."""
        return block_fp8_path(self.experts_up.device)

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.act_name in ACT_CODES and get_format(FORMAT_BLOCK_FP8).use_moe_gemv(h, indices):
            mats = {k: (getattr(self, f"experts_{k}"), getattr(self, f"experts_{k}_weight_scale_inv"))
                    for k in expert_kinds(self)}
            return moe_gemv_block_fp8(h, weights, indices, mats["up"], mats.get("gate"), mats["down"],
                                      self.act_name, scheme=get_format(FORMAT_BLOCK_FP8).scheme(1))

        def mm(x: torch.Tensor, kind: str, offsets: torch.Tensor) -> torch.Tensor:
            return block_fp8_grouped_mm(x, getattr(self, f"experts_{kind}"),
                                        getattr(self, f"experts_{kind}_weight_scale_inv"), offsets)

        return moe_experts_grouped(h, weights, indices, expert_kinds(self), mm, self.act,
                                   self.experts_up.shape[0], activation=self.act_name)


def to_block_fp8_moe(moe: MoE) -> None:
    """Turn ``moe`` (on any device, usually meta) into a :class:`BlockFP8MoE` in place: FP8 expert parameters
    of the same shapes and ``weight_scale_inv`` buffers of ones (the checkpoint fills them)."""
    bn, bk = BLOCK_FP8_BLOCK
    for kind in expert_kinds(moe):
        E, out, inp = getattr(moe, f"experts_{kind}").shape
        dev = getattr(moe, f"experts_{kind}").device
        w = torch.empty(E, out, inp, dtype=FP8_DTYPE, device=dev)
        setattr(moe, f"experts_{kind}", nn.Parameter(w, requires_grad=False))
        moe.register_buffer(f"experts_{kind}_weight_scale_inv",
                            torch.ones(E, -(-out // bn), -(-inp // bk), device=dev))
    moe.__class__ = BlockFP8MoE
