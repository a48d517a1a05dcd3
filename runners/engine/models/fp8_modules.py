"""The per-tensor FP8 modules runners.engine.quant swaps into a model (the format's rules:
runners.engine.formats.fp8): :class:`FP8Linear` and :class:`FP8MoE`, over the operators of
runners.engine.models.fp8 (kept apart from them because the FP8 KV cache imports those operators and the
layers import the cache).
"""

from __future__ import annotations

import torch
from torch import nn

from registry.hf_config import FORMAT_FP8
from runners.engine.compile import eager_op
from runners.engine.formats import get_format
from runners.engine.models.fp8 import (
    FP8_DTYPE,
    FP8Weights,
    fp8_linear,
    fp8_linear_w8a16,
    fp8_moe_impl,
    moe_experts_fp8,
    moe_experts_fp8_ref,
    scaled_mm_supported,
)
from runners.engine.models.moe import EXPERT_KINDS, MoE


class FP8Linear(nn.Module):
    """A linear layer with FP8 weights and a static FP8 activation scale (ModelOpt's FP8 layout):

    ``weight`` [out, in] float8_e4m3fn (a Parameter without gradient), ``weight_scale`` 0-dim float32 and
    ``input_scale`` 0-dim float32 (persistent buffers, the checkpoint's per-tensor scales), ``bias`` [out] in
    the model dtype or None. forward(x [..., in]) -> [..., out] in x's dtype through
    :func:`runners.engine.models.fp8.fp8_linear` (``torch._scaled_mm`` on FP8-capable GPUs, else the
    dequantizing reference), or at decode sizes where the format's ``decode_scheme`` is "w8a16"
    :func:`runners.engine.models.fp8.fp8_linear_w8a16` (``input_scale`` unused). Mutates nothing.
    """

    weight_format = FORMAT_FP8

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """An FP8Linear of ``linear``'s shape, device and bias dtype (its values are not copied: the module is
        filled from a checkpoint)."""
        bias = linear.bias
        return cls(linear.in_features, linear.out_features, bias is not None, device=linear.weight.device,
                   bias_dtype=bias.dtype if bias is not None else torch.float32)

    def forward(self, x: torch.Tensor, xq: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]. ``xq``: x's codes under ``input_scale``, given by a producer that asked
        :meth:`prequant_scale` (used only on the path that quantizes x; ignored elsewhere)."""
        rows = x.numel() // max(1, x.shape[-1])
        if get_format(FORMAT_FP8).scheme(rows) == "w8a16":  # the format's decode rule (WeightFormat.scheme)
            return eager_op(fp8_linear_w8a16)(x, self.weight, self.weight_scale, self.bias)
        return eager_op(fp8_linear)(x, self.weight, self.weight_scale, self.input_scale, self.bias, xq)

    def prequant_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The static scale (``input_scale``) the kernel producing x [..., in] should quantize it with in its
        own launch (kernels/norm.py, kernels/activation.py ``quant_scale``), so that :meth:`forward` skips
        its quantization launch: where forward would run ``torch._scaled_mm`` on x (the w8a8 scheme at x's
        rows and :func:`scaled_mm_supported`); None elsewhere (the w8a16 GEMV and the reference read x)."""
        rows = x.numel() // max(1, x.shape[-1])
        if get_format(FORMAT_FP8).scheme(rows) == "w8a16" or not scaled_mm_supported(x, self.weight):
            return None
        return self.input_scale

    def gemm_path(self, dtype: torch.dtype) -> str:
        """The GEMM this layer runs for activations of ``dtype`` on its device: "scaled_mm" or "reference"."""
        probe = torch.empty(0, self.in_features, device=self.weight.device, dtype=dtype)
        return "scaled_mm" if scaled_mm_supported(probe, self.weight) else "reference"

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class FP8MoE(MoE):
    """An MoE block whose routed experts hold FP8 weights: ``experts_{up,gate,down}`` float8_e4m3fn with the
    shapes of :class:`runners.engine.models.moe.MoE`, per-expert ``experts_<kind>_weight_scale`` [E] and
    ``experts_<kind>_input_scale`` [E] float32 buffers (checkpoint names
    ``experts.{e}.<kind>_proj.{weight_scale,input_scale}``). Router, shared expert and latent projections are
    those of the MoE it was made from (the shared expert's linears are FP8Linear where the config says so).

    ``experts_impl`` "fused" runs :func:`moe_experts_fp8` with ``fp8_impl`` (set by :meth:`gemm_path` after
    loading: "scaled_grouped_mm" or "dequant"; None decides per call), "ref" the per-expert loop
    :func:`moe_experts_fp8_ref`.
    """

    weight_format = FORMAT_FP8
    fp8_impl: str | None = None

    def fp8_weights(self) -> tuple[FP8Weights, FP8Weights | None, FP8Weights]:
        """(up, gate or None, down) as FP8Weights."""
        out = []
        for kind in EXPERT_KINDS:
            w = getattr(self, f"experts_{kind}")
            scales = (getattr(self, f"experts_{kind}_{s}", None) for s in ("weight_scale", "input_scale"))
            out.append(None if w is None else FP8Weights(w, *scales))
        up, gate, down = out
        return up, gate, down

    def gemm_path(self, dtype: torch.dtype) -> str:
        """Fix and return ``fp8_impl`` for activations of ``dtype`` on the experts' device (probes
        ``torch._scaled_grouped_mm`` once: call at load time, never inside a captured step)."""
        up, gate, down = self.fp8_weights()
        probe = torch.empty(0, up.weight.shape[2], device=up.weight.device, dtype=dtype)
        self.fp8_impl = fp8_moe_impl(probe, *(p for p in (up, gate, down) if p is not None))
        return self.fp8_impl

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        up, gate, down = self.fp8_weights()
        if self.experts_impl == "ref":
            return moe_experts_fp8_ref(h, weights, indices, up, gate, down, self.act)
        return moe_experts_fp8(h, weights, indices, up, gate, down, self.act, impl=self.fp8_impl)


def to_fp8_moe(moe: MoE) -> None:
    """Turn ``moe`` (on any device, usually meta) into an :class:`FP8MoE` in place: FP8 expert parameters of
    the same shapes, scale buffers of ones."""
    for kind in EXPERT_KINDS:
        p = getattr(moe, f"experts_{kind}")
        if p is None:
            continue
        setattr(moe, f"experts_{kind}",
                nn.Parameter(torch.empty(p.shape, dtype=FP8_DTYPE, device=p.device), requires_grad=False))
        for scale in ("weight_scale", "input_scale"):
            moe.register_buffer(f"experts_{kind}_{scale}", torch.ones(p.shape[0], device=p.device))
    moe.__class__ = FP8MoE
