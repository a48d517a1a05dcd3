"""Shared blocks of the hybrid decoders: norms, MLP, and the fused-stage switch every kind's module reads
(the kinds' own modules: ``runners/engine/models/kinds.py``; MoE: ``runners/engine/models/moe.py``).

Each family's variant is a config option of the same module, not a copy:
- ``RMSNorm``: scale ``w`` (NemotronH) or ``1 + w`` (Qwen3-Next), ``HybridConfig.norm_weight_offset``;
- ``MLP`` (dense blocks, MoE's shared expert): non-gated relu2 (NemotronH) or gated SiLU, SwiGLU (Qwen3-Next).
The math is checked against transformers 5's ``modeling_nemotron_h.py`` and ``modeling_qwen3_next.py`` (the
test oracles); parameter names equal NemotronH's names below ``mixer.``, so its weight map stays a plain
rename (the Qwen3-Next map renames a few, see ``runners/engine/models/qwen3_next.py``).
Shapes: B batch, T tokens, D hidden, I intermediate size.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import relu2, relu2_ref, silu_mul
from kernels.norm import gated_group_rms_norm, gated_group_rms_norm_ref, rms_norm, rms_norm_ref
from runners.engine.models.config import HybridConfig
from runners.engine.shard import FirstRankOnly, Rule, Shard

# The switch benchmarks flip to time the fused stages against their references in one run
# (`benchmarks/bench_e2e.py --fused both`, through :func:`fused_stages`); True in every other use.
FUSED_STAGES = True


@contextlib.contextmanager
def fused_stages(enabled: bool):
    """Within the block, :func:`use_inference_kernel` is False everywhere when ``enabled`` is False (the
    references run: the step as before the fused kernels); restores the previous setting on exit. An engine
    built inside keeps, in its captured CUDA graphs, the stages chosen at capture."""
    global FUSED_STAGES
    saved, FUSED_STAGES = FUSED_STAGES, bool(enabled)
    try:
        yield
    finally:
        FUSED_STAGES = saved


def cacheable_now(x: torch.Tensor) -> bool:
    """Whether a value derived from weights alone (a decay rate, RoPE frequencies) may be computed once and
    kept for x's device: :func:`use_inference_kernel` holds and no CUDA graph is being captured on the
    current stream (a captured launch writes nothing until the graph replays, so a value first computed
    there would be kept unwritten; the capture's eager warm-up fills such caches first)."""
    return use_inference_kernel(x) and not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def use_inference_kernel(x: torch.Tensor) -> bool:
    """Whether a block's elementwise stage runs its fused Triton kernel (the norms of kernels/norm.py, GDN's
    prologue kernels/gdn/prologue.py, the gated shared expert's combine kernels/moe_combine.py) rather than
    its PyTorch reference: on CUDA, outside autograd (the
    kernels have no backward) and outside torch.compile (inductor fuses the reference itself; a kernel there
    would be a graph break)."""
    return (FUSED_STAGES and x.is_cuda and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def consumer_quant_scale(linear: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The static FP8 scale with which ``linear`` wants its input quantized by the kernel that produces it
    (x: a tensor of that input's shape and device), so that the linear skips its own quantization launch:
    its ``prequant_scale(x)`` (runners.engine.models.fp8_modules.FP8Linear on its ``torch._scaled_mm``
    path), else None (any other linear). The producer then passes the codes as ``linear(out, xq=q)``."""
    ask = getattr(linear, "prequant_scale", None)
    return None if ask is None else ask(x)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32, returned in the input dtype:
    ``(offset + w) * x / rms(x)``; ``offset`` is 0 for NemotronH and 1 for Qwen3-Next's ``(1 + w)`` norms.
    ``kernels.norm.rms_norm_ref``, or its one-launch kernel where :func:`use_inference_kernel`."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor, quant_scale: torch.Tensor | None = None):
        """x [..., dim] -> x's dtype. With ``quant_scale`` also the result's FP8 codes, (out, q): from the
        kernel's launch (kernels.norm.rms_norm), or the reference's quantization."""
        norm = rms_norm if use_inference_kernel(x) else rms_norm_ref
        return norm(x, self.weight, self.eps, self.offset, quant_scale)


class GatedGroupRMSNorm(nn.Module):
    """Mamba2 output norm: ``w * groupnorm_rms(y * silu(z))`` (gate before the norm), RMS taken per group of
    ``group_size`` channels (d_inner / n_groups). y, z: [..., d_inner]; returns float32 [..., d_inner].
    ``kernels.norm.gated_group_rms_norm_ref``, or its one-launch kernel where :func:`use_inference_kernel`."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                quant_scale: torch.Tensor | None = None):
        """float32 [..., d_inner], or cast to ``out_dtype`` (by the kernel itself where it runs). With
        ``quant_scale`` also the result's FP8 codes, (out, q): from the kernel's launch
        (kernels.norm.gated_group_rms_norm), or the reference's quantization."""
        norm = gated_group_rms_norm if use_inference_kernel(y) else gated_group_rms_norm_ref
        return norm(y, z, self.weight, self.group_size, self.eps, out_dtype, quant_scale)


ACTIVATIONS = {"relu2": relu2_ref, "silu": F.silu}


class MLP(nn.Module):
    """Feed-forward block (dense ``mlp`` blocks and shared experts): ``down(act(up(x)))`` (NemotronH, relu2)
    or, with ``gated``, ``down(act(gate(x)) * up(x))`` (Qwen3-Next, SiLU: SwiGLU). x [..., D] -> [..., D]."""

    @staticmethod
    def state_class(replay: bool) -> None:
        """Keeps no per-slot state (the cache holds nothing for this kind)."""
        return None

    def shard_rules(self, c: HybridConfig, W: int, r: int) -> dict[str, Rule]:
        """Tensor parallelism: gate / up by rows (column parallel), down by columns (row parallel), its bias
        on rank 0, sized from this module (built from the rank's config).
        ``{parameter name below this module: what rank r of W reads}`` (``runners.engine.shard``) from the
        full (unsharded) config ``c``; names absent are replicated."""
        Il = self.up_proj.weight.shape[0]  # the rank's intermediate size (the module is the rank's)
        col, row = Shard(0, ((r * Il, (r + 1) * Il),)), Shard(1, ((r * Il, (r + 1) * Il),))
        return {
            "gate_proj.weight": col, "gate_proj.bias": col, "up_proj.weight": col, "up_proj.bias": col,
            "down_proj.weight": row, "down_proj.bias": FirstRankOnly(r),
        }

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        act: str = "relu2",
        gated: bool = False,
    ):
        super().__init__()
        self.act, self.act_name = ACTIVATIONS[act], act
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    @classmethod
    def from_config(cls, c: HybridConfig, intermediate_size: int | None = None) -> MLP:
        """The config's MLP (size ``intermediate_size``, default the dense ``c.intermediate_size``)."""
        size = c.intermediate_size if intermediate_size is None else intermediate_size
        return cls(c.hidden_size, size, c.mlp_bias, c.mlp_hidden_act, c.mlp_gated)

    def input_linear(self) -> nn.Module | None:
        """The linear that alone reads this mixer's input first (runners.engine.models.block.Block asks it
        for the codes its norm may write): up_proj, or None when gated (gate and up both read it)."""
        return self.up_proj if self.gate_proj is None else None

    def forward(self, x: torch.Tensor, xq: torch.Tensor | None = None) -> torch.Tensor:
        """The activation (and the gate's product) is one launch where :func:`use_inference_kernel` holds
        (kernels/activation.py: relu2, silu_mul), its reference elsewhere; before an FP8 down projection
        that launch also writes the projection's input codes (:func:`consumer_quant_scale`). ``xq``: x's
        codes for :meth:`input_linear` (given only where it asked for them)."""
        if self.gate_proj is None:
            h = self.up_proj(x) if xq is None else self.up_proj(x, xq=xq)
            if not (self.act_name == "relu2" and use_inference_kernel(h)):
                return self.down_proj(self.act(h))
            scale = consumer_quant_scale(self.down_proj, h)  # an FP8 down projection: codes from this launch
            if scale is None:
                return self.down_proj(relu2(h))
            a, q = relu2(h, quant_scale=scale)
            return self.down_proj(a, xq=q)
        g, u = self.gate_proj(x), self.up_proj(x)
        if not (self.act_name == "silu" and use_inference_kernel(g) and g.shape == u.shape
                and g.dtype == u.dtype):
            return self.down_proj(self.act(g) * u)
        scale = consumer_quant_scale(self.down_proj, g)
        if scale is None:
            return self.down_proj(silu_mul(g, u))
        a, q = silu_mul(g, u, quant_scale=scale)
        return self.down_proj(a, xq=q)
