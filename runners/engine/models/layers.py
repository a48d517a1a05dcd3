"""Shared blocks of the hybrid decoders: norms, MLP, MoE (attention: ``runners/engine/models/attention.py``).

Each family's variant is a config option of the same module, not a copy:
- ``RMSNorm``: scale ``w`` (NemotronH) or ``1 + w`` (Qwen3-Next), ``HybridConfig.norm_weight_offset``;
- ``MLP`` / experts: non-gated relu2 (NemotronH) or gated SiLU, SwiGLU (Qwen3-Next);
- ``MoE``: sigmoid router with a selection-only correction bias, latent experts (NemotronH), or softmax
  router and a sigmoid-gated shared expert (Qwen3-Next).
The math is checked against transformers 5's ``modeling_nemotron_h.py`` and ``modeling_qwen3_next.py`` (the
test oracles); parameter names equal NemotronH's names below ``mixer.``, so its weight map stays a plain
rename (the Qwen3-Next map renames a few, see ``runners/engine/models/qwen3_next.py``).
Shapes: B batch, T tokens, D hidden, Hq query heads, KVH key/value heads, hd head_dim, E routed experts,
k top-k, L latent size (= D without a latent projection), I expert intermediate size.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import relu2, relu2_ref, silu_mul
from kernels.moe_combine import shared_gate_combine, shared_gate_combine_ref
from kernels.norm import gated_group_rms_norm, gated_group_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.router import topk_route, topk_route_ref
from runners.engine.compile import eager_op
from runners.engine.models.config import HybridConfig
from runners.engine.models.moe import moe_experts_fused, moe_experts_ref
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


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32, returned in the input dtype:
    ``(offset + w) * x / rms(x)``; ``offset`` is 0 for NemotronH and 1 for Qwen3-Next's ``(1 + w)`` norms.
    ``kernels.norm.rms_norm_ref``, or its one-launch kernel where :func:`use_inference_kernel`."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_inference_kernel(x):
            return rms_norm(x, self.weight, self.eps, self.offset)
        return rms_norm_ref(x, self.weight, self.eps, self.offset)


class GatedGroupRMSNorm(nn.Module):
    """Mamba2 output norm: ``w * groupnorm_rms(y * silu(z))`` (gate before the norm), RMS taken per group of
    ``group_size`` channels (d_inner / n_groups). y, z: [..., d_inner]; returns float32 [..., d_inner].
    ``kernels.norm.gated_group_rms_norm_ref``, or its one-launch kernel where :func:`use_inference_kernel`."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """float32 [..., d_inner], or cast to ``out_dtype`` (by the kernel itself where it runs)."""
        norm = gated_group_rms_norm if use_inference_kernel(y) else gated_group_rms_norm_ref
        return norm(y, z, self.weight, self.group_size, self.eps, out_dtype)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The activation (and the gate's product) is one launch where :func:`use_inference_kernel` holds
        (kernels/activation.py: relu2, silu_mul), its reference elsewhere."""
        if self.gate_proj is None:
            h = self.up_proj(x)
            fused = self.act_name == "relu2" and use_inference_kernel(h)
            return self.down_proj(relu2(h) if fused else self.act(h))
        g, u = self.gate_proj(x), self.up_proj(x)
        fused = (self.act_name == "silu" and use_inference_kernel(g) and g.shape == u.shape
                 and g.dtype == u.dtype)
        return self.down_proj(silu_mul(g, u) if fused else self.act(g) * u)


# Tokens up to which the router's top-k runs as the sort-free Triton kernel on CUDA (decode and verify steps:
# batch 64 x T = 4); larger batches (prefill) take torch.topk. Not yet measured against torch.topk.
ROUTER_KERNEL_MAX_TOKENS = 256


class TopkRouter(nn.Module):
    """Top-k router, ``moe_scoring_func`` "sigmoid" (DeepSeek-V3 style, NemotronH) or "softmax" (Qwen3-Next).

    forward(x [N, D]) -> (weights [N, k] float32, indices [N, k] int64). Scores are sigmoid(x W^T) or
    softmax(x W^T) over experts, in float32. Sigmoid only: ``e_score_correction_bias`` is added for choosing
    experts only, and with n_group > 1 only the ``topk_group`` groups with the best top-2 score sums are
    eligible. The chosen raw scores are renormalised (``norm_topk_prob``) and multiplied by
    ``routed_scaling_factor``. ``weight`` and the bias stay float32. The scoring and top-k are
    ``kernels.router.topk_route_ref``; on CUDA, for at most :data:`ROUTER_KERNEL_MAX_TOKENS` tokens,
    n_group = 1 and logits that need no gradient (the kernel has no backward), its sort-free Triton kernel
    ``topk_route``.
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        self.top_k, self.num_experts = c.num_experts_per_tok, c.n_routed_experts
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = c.norm_topk_prob, c.routed_scaling_factor
        self.softmax = c.moe_scoring_func == "softmax"
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size, dtype=torch.float32))
        if not self.softmax:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32)
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float()).float()  # float32 under autocast too
        kw = dict(softmax=self.softmax, bias=None if self.softmax else self.e_score_correction_bias,
                  norm_topk_prob=self.norm_topk_prob, scaling=self.routed_scaling_factor)
        # the kernel has no backward: training (logits that need a gradient) takes the reference
        if (logits.is_cuda and self.n_group == 1 and logits.shape[0] <= ROUTER_KERNEL_MAX_TOKENS
                and not logits.requires_grad):
            return eager_op(topk_route)(logits, self.top_k, **kw)  # one kernel, no sort (kernels/router.py)
        return topk_route_ref(logits, self.top_k, n_group=self.n_group, topk_group=self.topk_group, **kw)


class MoE(nn.Module):
    """Routed experts plus a shared expert, with the options of ``HybridConfig``:

    - NemotronH: sigmoid router; relu2 experts run in the latent space between ``fc1_latent_proj`` (D -> L)
      and ``fc2_latent_proj`` (L -> D); the shared expert acts on the un-projected input;
    - Qwen3-Next: softmax router; gated SiLU experts (``mlp_gated``); the shared expert's output is scaled
      by ``sigmoid(shared_expert_gate(x))`` (``moe_shared_expert_gate``), computed in float32.

    Expert weights are stacked: ``experts_up`` [E, I, L], ``experts_down`` [E, L, I] and, when gated,
    ``experts_gate`` [E, I, L] (checkpoints hold them per expert as
    ``experts.{e}.{up,down,gate}_proj.weight``; :func:`unstack_expert_names` maps one to the other).
    forward(x [B, T, D]) -> [B, T, D]. ``experts_impl`` ("fused" default, or "ref") selects the routed-expert
    implementation (:mod:`runners.engine.models.moe`).
    """

    experts_impl = "fused"

    @staticmethod
    def state_class(replay: bool) -> None:
        """Keeps no per-slot state (the cache holds nothing for this kind)."""
        return None

    def shard_rules(self, c: HybridConfig, W: int, r: int) -> dict[str, Rule]:
        """Tensor parallelism: the router replicated; every routed expert split along its intermediate
        size (up / gate rows, down columns); the shared expert as an MLP; NemotronH's latent projections
        replicated (fc2_latent_proj's bias on rank 0).
        ``{parameter name below this module: what rank r of W reads}`` (``runners.engine.shard``) from the
        full (unsharded) config ``c``; names absent are replicated."""
        Il = self.experts_up.shape[1]
        rules: dict[str, Rule] = {
            "experts_up": Shard(1, ((r * Il, (r + 1) * Il),)),
            "experts_gate": Shard(1, ((r * Il, (r + 1) * Il),)),
            "experts_down": Shard(2, ((r * Il, (r + 1) * Il),)),
            "fc2_latent_proj.bias": FirstRankOnly(r),
        }
        rules.update({f"shared_experts.{k}": v for k, v in self.shared_experts.shard_rules(c, W, r).items()})
        return rules

    def __init__(self, config: HybridConfig):
        super().__init__()
        c = config
        latent = c.moe_latent_size if c.moe_latent_size is not None else c.hidden_size
        E, I = c.n_routed_experts, c.moe_intermediate_size
        self.act = ACTIVATIONS[c.mlp_hidden_act]
        self.act_name = c.mlp_hidden_act  # lets moe_experts_fused fuse it in its decode GEMV kernels
        self.gate = TopkRouter(c)
        self.experts_up = nn.Parameter(torch.zeros(E, I, latent))
        self.experts_gate = nn.Parameter(torch.zeros(E, I, latent)) if c.mlp_gated else None
        self.experts_down = nn.Parameter(torch.zeros(E, latent, I))
        self.shared_experts = MLP.from_config(c, c.moe_shared_expert_intermediate_size)
        gated_shared = c.moe_shared_expert_gate
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if gated_shared else None
        if c.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(c.hidden_size, latent, bias=c.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, c.hidden_size, bias=c.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        h = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = eager_op(_routed_experts)(self, h, weights, indices)  # grouped GEMMs: outside torch.compile
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        shared = self.shared_experts(flat)
        if self.shared_expert_gate is not None:  # routed + sigmoid(x . w) * shared: one kernel on CUDA
            fused = use_inference_kernel(flat) and shared.dtype == routed.dtype == flat.dtype
            combine = shared_gate_combine if fused else shared_gate_combine_ref
            return combine(flat, self.shared_expert_gate.weight, shared, routed).view(shape)
        return (routed + shared).view(shape)

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(h); h [N, L] -> [N, L]. An expert is
        down(act(up(h))) or, gated, down(act(gate(h)) * up(h)). ``experts_impl`` picks the implementation:
        "fused" (grouped GEMMs, or on CUDA at decode sizes the per-pair GEMV kernels with the activation
        fused; no host sync; :func:`runners.engine.models.moe.moe_experts_fused`) or "ref" (the per-expert
        loop it is tested against)."""
        args = (h, weights, indices, self.experts_up, self.experts_gate, self.experts_down, self.act)
        if self.experts_impl == "ref":
            return moe_experts_ref(*args)
        return moe_experts_fused(*args, activation=self.act_name)


# observer(moe, indices [N, k] int64) callables run before every MoE block's routed experts, eagerly (outside
# torch.compile's code, so registering one recompiles nothing); ExpertChoiceCounter
# (runners/engine/models/footprint.py) registers one to count the experts a step chooses.
ROUTING_OBSERVERS: list = []


def _routed_experts(moe: MoE, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    for observe in ROUTING_OBSERVERS:
        observe(moe, indices)
    return moe._experts(h, weights, indices)


_STACKED_EXPERTS = re.compile(
    r"^(.*\.)experts_(up|gate|down)(?:_(weight_scale_inv|weight_scale_2|weight_scale|input_scale))?$"
)


def unstack_expert_names(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint names of a stacked expert parameter: ``<p>.experts_{up,gate,down}`` [E, ...] ->
    ``{"<p>.experts.{e}.{up,gate,down}_proj.weight": tensor[e]}`` (views, so ``copy_`` loads in place); the
    per-expert scales ``<p>.experts_<kind>_<scale>`` [E, ...] of the quantized experts
    (runners/engine/quant.py; scale: weight_scale, input_scale, weight_scale_2, weight_scale_inv) map to
    ``<p>.experts.{e}.<kind>_proj.<scale>`` likewise. Any other name maps to itself."""
    m = _STACKED_EXPERTS.match(name)
    if not m:
        return {name: tensor}
    prefix, kind, suffix = m.groups()
    part = suffix or "weight"
    return {f"{prefix}experts.{e}.{kind}_proj.{part}": tensor.data[e] for e in range(tensor.shape[0])}
