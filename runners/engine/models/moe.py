"""The MoE block kind: its mixer (:class:`MoE`: router, routed experts, shared expert) with its declarations
(no per-slot state, its sharding rule; the generic dummy initialisation), the router (:class:`TopkRouter`),
the routing observers, the checkpoint names of its stacked experts (:func:`unstack_expert_names`), and the
routed experts' dispatch: the fused path (grouped GEMMs, no host synchronisation) and its reference.

Each family's variant is a config option of the same block: sigmoid router with a selection-only correction
bias and latent experts (NemotronH), or softmax router and a sigmoid-gated shared expert (Qwen3-Next); the
math is checked against transformers 5's ``modeling_nemotron_h.py`` and ``modeling_qwen3_next.py``.
Shapes: N tokens (B x T flattened), D hidden, E routed experts, k top-k, L latent size (= D without a latent
projection), I expert intermediate size.

The dispatch functions compute, for tokens ``h`` [N, L] each routed to k experts (``indices`` [N, k] int64,
``weights`` [N, k] float32, from :class:`TopkRouter`)::

    out[n] = sum_j weights[n, j] * expert_{indices[n, j]}(h[n])

with ``expert_e(x) = down_e(act(up_e x))`` or, gated, ``down_e(act(gate_e x) * up_e x)``. Expert weights
are stacked in nn.Linear layout (out x in): ``up`` / ``gate`` [E, I, L], ``down`` [E, L, I]. L is the MoE
width (the latent size for NemotronH's latent MoE, the hidden size otherwise), I the expert intermediate size.

- :func:`moe_experts_ref`: a Python loop over experts with the per-expert token counts read on the host
  (``.tolist()``); the specification the tests hold the fused path to.
- :func:`moe_experts_fused`: the N * k (token, expert) pairs are grouped by expert on the device
  (:func:`group_pairs`: a stable sort, each expert's group end as int32 offsets, each pair's position; one
  Triton launch at decode sizes, else ``torch.argsort`` and ``torch.searchsorted``: ``torch.bincount`` would
  size its output from the data), and each projection is one ``torch._grouped_mm`` over the sorted rows, the
  layout torchtitan's MoE uses (tokens sorted by expert, offsets on the device; torchtitan/models/moe). The
  rows return to their tokens weighted and summed over the k choices in float32 (:func:`combine_pairs`).
  Nothing reads a device value on the host and every shape follows from N, k and the weights, so the step can
  be captured in a CUDA graph.

At decode sizes (N * k <= :data:`MOE_GEMV_MAX_PAIRS` pairs, CUDA, an activation kernels/moe_gemv.py fuses,
named by the caller)
:func:`moe_experts_fused` runs kernels/moe_gemv.py's ``moe_gemv`` instead: one program per (token, expert)
pair and output tile reads its expert id straight from ``indices`` (no sort, no pass over all E experts, no
tensor-core tile padded around a few rows), three launches in all. The CPU keeps the grouped path.

``torch._grouped_mm`` needs 16-byte-aligned row strides (L and I multiples of 8 in 16-bit dtypes, of 4 in
float32); on CUDA only bf16 on sm90+ runs its CUTLASS kernel (other dtypes take a fallback that copies the
offsets to the host). Where those do not hold (:func:`grouped_mm_supported`), the fused path multiplies each
pair by its own gathered expert matrix (``torch.bmm`` in chunks of a size fixed by the shapes): still no
host synchronisation, more memory traffic.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import relu2, silu_mul
from kernels.moe_combine import shared_gate_combine, shared_gate_combine_ref
from kernels.moe_gemv import ACT_CODES, combine_sorted, combine_sorted_ref, moe_gemv
from kernels.moe_sort import sort_pairs, sort_pairs_ref, sort_pairs_supported
from kernels.router import (
    ROUTER_FUSED_DTYPES,
    ROUTER_FUSED_MAX_TOKENS,
    check_bounds_table,
    router_fused,
    router_logits,
    topk_route,
    topk_route_ref,
)
from runners.engine.compile import eager_op
from runners.engine.models.config import HybridConfig
from runners.engine.models.layers import ACTIVATIONS, MLP, use_inference_kernel
from runners.engine.shard import FirstRankOnly, Rule, Shard

# Bytes of gathered expert weights per chunk of the bmm path (each pair gathers an I x L matrix).
GATHER_CHUNK_BYTES = 256 * 2**20
# (token, expert) pairs up to which moe_experts_fused takes the per-pair GEMV kernels (kernels/moe_gemv.py) on
# CUDA: 8 decode tokens at Nemotron 3 Super's top-22 (the largest top-k of the released models; 17 tokens at
# Qwen3-Next's top-10): the GEMV is faster than the grouped GEMM at every point measured up to it
# (docs/kernel_performance.md, "Quantized formats: where each path takes over").
MOE_GEMV_MAX_PAIRS = 8 * 22
# Whether the grouped MoE path's glue runs as kernels where use_inference_kernel holds: the expert grouping
# (kernels/moe_sort.py), the activation (kernels/activation.py) and the combine (kernels/moe_gemv.py), one
# launch each; False keeps their references (several launches each; the same grouping, and the combine's fp32
# sums added in another order). Read at call time, so that benchmarks/bench_e2e.py --kernel-setting times both
# in one run. Measured on an H100 (Super V3 NVFP4 at half depth, batch-64 replay): 1,239 -> 800 kernels per
# step, the step time unchanged, 46.34 -> 46.24 ms (docs/kernel_performance.md, "The grouped MoE path's glue
# as three launches").
GLUE_KERNELS = True
# The routed experts' projections, in the order of the MoE block's experts_<kind> parameters (gate: gated
# activations only).
EXPERT_KINDS = ("up", "gate", "down")


def _dense_expert_linear(x: torch.Tensor, w: torch.Tensor, e: int) -> torch.Tensor:
    return x @ w[e].T


def moe_experts_ref(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    up: torch.Tensor,
    gate: torch.Tensor | None,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    linear: Callable[[torch.Tensor, Any, int], torch.Tensor] | None = None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Reference routed experts: one matmul chain per expert that received tokens (host-synchronising).

    Args:
        h: [N, L] expert inputs. weights: [N, k] float32 combine weights. indices: [N, k] int64 expert ids.
        up, gate: [E, I, L] (gate None for non-gated experts); down: [E, L, I]. act: the activation.
        linear: ``linear(x, W, e)`` is x times expert e's matrix of W transposed; default ``x @ W[e].T`` for
            dense [E, out, in] tensors (runners.engine.models.fp8 passes its dequantizing reference and
            FP8Weights).
        num_experts: E; default ``up.shape[0]`` (needed when up is not a tensor).

    Returns:
        [N, L] in h's dtype; each token's k expert outputs are weighted and summed in float32, in expert
        order.
    """
    n, k = indices.shape
    expert = indices.flatten()
    order = torch.argsort(expert, stable=True)
    token = order // k  # token of each (token, choice) pair in expert order
    w = weights.flatten()[order]
    lin = linear or _dense_expert_linear
    counts = torch.bincount(expert, minlength=up.shape[0] if num_experts is None else num_experts).tolist()
    out = torch.zeros(n, h.shape[-1], dtype=torch.float32, device=h.device)
    start = 0
    for e, cnt in enumerate(counts):
        if cnt == 0:
            continue
        tok = token[start : start + cnt]
        x = h[tok]
        if gate is None:
            a = act(lin(x, up, e))
        else:
            a = act(lin(x, gate, e)) * lin(x, up, e)
        y = lin(a, down, e)
        out.index_add_(0, tok, y.float() * w[start : start + cnt, None])
        start += cnt
    return out.to(h.dtype)


def group_pairs(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, choice) pairs by expert, on the device: kernels.moe_sort.sort_pairs (one launch)
    where :data:`GLUE_KERNELS` is on, :func:`use_inference_kernel` holds, the ids are int64 and
    kernels.moe_sort.sort_pairs_supported takes the size (up to SORT_KERNEL_MAX_PAIRS pairs: decode and verify
    steps), else its reference (a radix sort; prefill). Both give the same tensors.

    Args:
        indices: [N, k] int64 expert ids in [0, num_experts).

    Returns:
        ``order`` [N * k] int64: pair ids (``n * k + j``) sorted by expert (stable: pairs of one expert keep
        token order); ``inverse`` [N * k] int64: each pair's position in ``order``; ``offsets`` [E] int32:
        ``offsets[e]`` = number of pairs routed to experts <= e (the end of expert e's group in ``order``;
        ``torch._grouped_mm``'s ``offs``). No host synchronisation.
    """
    if (GLUE_KERNELS and use_inference_kernel(indices) and indices.dtype == torch.int64
            and sort_pairs_supported(indices.numel(), num_experts)):
        return sort_pairs(indices, num_experts)
    return sort_pairs_ref(indices, num_experts)


def combine_pairs(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * y[inverse[n * k + j]] in float32, in y's dtype: the routed experts' rows
    (expert-sorted, [P, L]) back to their tokens. kernels.moe_gemv.combine_sorted (one launch) where
    :data:`GLUE_KERNELS` is on, :func:`use_inference_kernel` holds and y is float32 / bfloat16 / float16, else
    its reference."""
    kernel = (GLUE_KERNELS and use_inference_kernel(y)
              and y.dtype in (torch.float32, torch.bfloat16, torch.float16))
    return (combine_sorted if kernel else combine_sorted_ref)(y, inverse, weights.float())


def grouped_mm_supported(x: torch.Tensor, *stacked: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x`` [P, L] against the transposed stacked weights ``[E, I, L]``
    without a host synchronisation: every row stride 16-byte aligned, and on CUDA bf16 on sm90+ (its CUTLASS
    kernel); on the CPU any of float32 / bfloat16 / float16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    align = 16 // x.element_size()
    for w in stacked:
        if w.dtype != x.dtype or w.shape[-1] % align or w.shape[-2] % align or not w.is_contiguous():
            return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x [P, in] sorted by group times their group's w [E, out, in] transposed -> [P, out]."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)


def _gathered_linear(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Row p of x [P, in] times w[expert[p]] [out, in] transposed -> [P, out], by gathered bmm in chunks of a
    size fixed by the shapes (no host synchronisation)."""
    P = x.shape[0]
    per_pair = w.shape[1] * w.shape[2] * w.element_size()
    chunk = max(1, GATHER_CHUNK_BYTES // per_pair)
    parts = [
        torch.bmm(w[expert[s : s + chunk]], x[s : s + chunk, :, None])[..., 0] for s in range(0, P, chunk)
    ]
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def use_moe_gemv(h: torch.Tensor, indices: torch.Tensor, *stacked: torch.Tensor) -> bool:
    """Whether :func:`moe_experts_fused` takes the per-pair GEMV kernels: h on CUDA, at most
    :data:`MOE_GEMV_MAX_PAIRS` (token, expert) pairs with int64 expert ids, the expert weights ``stacked`` in
    h's dtype (16-bit or float32). Reads only shapes and dtypes (no synchronisation)."""
    return (h.is_cuda and indices.numel() <= MOE_GEMV_MAX_PAIRS and indices.dtype == torch.int64
            and h.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(w.dtype == h.dtype for w in stacked))


def expert_kinds(moe: Any) -> tuple[str, ...]:
    """The :data:`EXPERT_KINDS` an MoE block holds (``experts_gate`` is None without a gated activation)."""
    return tuple(k for k in EXPERT_KINDS if getattr(moe, f"experts_{k}") is not None)


def moe_experts_fused(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    up: torch.Tensor,
    gate: torch.Tensor | None,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Routed experts as grouped GEMMs over expert-sorted pairs; same arguments and result as
    :func:`moe_experts_ref` (float32 combine; the k choices are summed in choice order, so results agree
    with the reference to float rounding). No per-expert Python loop, no host synchronisation, shapes fixed
    by N, k and the weights (CUDA-graph capturable). Where ``activation`` names ``act`` and
    :func:`use_moe_gemv` holds (CUDA, at most :data:`MOE_GEMV_MAX_PAIRS` pairs), the per-pair GEMV kernels of
    kernels/moe_gemv.py compute the same result instead.

    Args:
        h: [N, L]. weights: [N, k] float32. indices: [N, k] int64. up, gate: [E, I, L] (gate may be None);
            down: [E, L, I]; all in h's dtype.
        activation: the name ``act`` has in kernels.moe_gemv.ACT_CODES ("relu2" / "silu": the keys of
            runners.engine.models.layers.ACTIVATIONS, which MoE passes), so the GEMV kernels can fuse it; None
            (a caller's own callable) keeps the grouped path.

    Returns:
        [N, L] in h's dtype.
    """
    stacked = (up, down) if gate is None else (up, gate, down)
    if activation in ACT_CODES and use_moe_gemv(h, indices, *stacked):
        return moe_gemv(h, weights, indices, up, gate, down, activation)
    n, k = indices.shape
    E = up.shape[0]
    order, inverse, offsets = group_pairs(indices, E)
    x = h.index_select(0, order // k)  # [P, L]: each pair's token, in expert order
    if grouped_mm_supported(x, *stacked):
        linear = lambda inp, w: _grouped_linear(inp, w, offsets)
    else:
        expert_sorted = indices.flatten().index_select(0, order)
        linear = lambda inp, w: _gathered_linear(inp, w, expert_sorted)
    if gate is None:
        a = act(linear(x, up))
    else:
        a = act(linear(x, gate)) * linear(x, up)
    y = linear(a, down)  # [P, L] in expert order
    return combine_pairs(y.to(h.dtype), inverse, weights)  # back to pair order n * k + j, summed


def moe_experts_grouped(
    h: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    kinds: tuple[str, ...],
    grouped_mm: Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
    num_experts: int,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Routed experts over expert-sorted pairs with a caller's grouped GEMM (the quantized experts of
    runners/engine/models/<format>.py): the pairs are grouped by expert (:func:`group_pairs`),
    each projection is ``grouped_mm(x [P, in] sorted by expert, kind, offsets [E] int32 cumulative ends) ->
    [P, out]``, the results are summed over the k choices in float32 in one pass over the sorted rows
    (:func:`combine_pairs`); as :func:`moe_experts_fused`: no host synchronisation when ``grouped_mm`` has
    none. Where :data:`GLUE_KERNELS` is on and :func:`use_inference_kernel` holds, the activation named
    ``activation`` ("relu2", or "silu" gated) is one launch (kernels/activation.py's relu2 / silu_mul, as
    :class:`MLP`); elsewhere ``act``.

    Args:
        h: [N, L]. weights: [N, k] float32. indices: [N, k] int64. kinds: ("up", "down") or ("up", "gate",
            "down"). act: the activation. num_experts: E. activation: act's name, or None (act alone).

    Returns:
        [N, L] in h's dtype.
    """
    n, k = indices.shape
    order, inverse, offsets = group_pairs(indices, num_experts)
    x = h.index_select(0, order // k)  # [P, L]
    kernel = GLUE_KERNELS and use_inference_kernel(x)
    if "gate" in kinds:
        g, u = grouped_mm(x, "gate", offsets), grouped_mm(x, "up", offsets)
        fused = kernel and activation == "silu" and g.shape == u.shape and g.dtype == u.dtype
        a = silu_mul(g, u) if fused else act(g) * u
    else:
        u = grouped_mm(x, "up", offsets)
        a = relu2(u) if kernel and activation == "relu2" else act(u)
    y = grouped_mm(a.to(h.dtype), "down", offsets).to(h.dtype)
    return combine_pairs(y, inverse, weights)  # each pair's row of y, weighted and summed over the choices


# Tokens up to which the router's top-k runs as the sort-free Triton kernel on CUDA (decode and verify steps:
# batch 64 x T = 4); larger batches (prefill) take torch.topk. Not yet measured against torch.topk.
ROUTER_KERNEL_MAX_TOKENS = 256
# The router's form at decode sizes: (max tokens, form) pairs in increasing bounds of at most
# kernels.router.ROUTER_FUSED_MAX_TOKENS, the first bound >= N applying. "fused": kernels.router.router_fused
# (the logits GEMV and the routing in one launch, reading x in its dtype); "logits": router_logits then
# topk_route (two launches). Past the last bound, while the table is empty, and off CUDA: "linear", a float32
# copy of x, F.linear and topk_route (three launches; 15 us a layer at one token in the half-depth Super V3
# profile, docs/kernel_performance.md). Set from benchmarks/bench_router.py's timings on an H100 at 1, 2, 4
# and 8 tokens (fused fastest at 1, the two launches at 2-8; 3 and 5-7 tokens take the form of the counts
# around them, untimed); read at call time.
ROUTER_FORMS: tuple[tuple[int, str], ...] = ((1, "fused"), (ROUTER_FUSED_MAX_TOKENS, "logits"))
ROUTER_FORM_NAMES = ("linear", "fused", "logits")


def router_form(x: torch.Tensor, n_group: int, on_cuda: bool | None = None) -> str:
    """The form :class:`TopkRouter` runs on x [N, D] (:data:`ROUTER_FORMS`): "fused" or "logits" only on CUDA
    (``on_cuda``, default x.is_cuda: benchmarks/count_step_ops.py asks as CUDA would) with n_group = 1, no
    gradient and x in kernels.router.ROUTER_FUSED_DTYPES; else "linear".

    Raises:
        ValueError: a ROUTER_FORMS table kernels.router.check_bounds_table refuses (bounds not strictly
            increasing in [1, ROUTER_FUSED_MAX_TOKENS], a form outside ROUTER_FORM_NAMES), whatever x is.
    """
    check_bounds_table("ROUTER_FORMS", ROUTER_FORMS, lambda form: form in ROUTER_FORM_NAMES)
    cuda = x.is_cuda if on_cuda is None else on_cuda
    if not (cuda and n_group == 1 and x.dtype in ROUTER_FUSED_DTYPES and not torch.is_grad_enabled()):
        return "linear"
    for bound, form in ROUTER_FORMS:
        if x.shape[0] <= bound:
            return form
    return "linear"


class TopkRouter(nn.Module):
    """Top-k router, ``moe_scoring_func`` "sigmoid" (DeepSeek-V3 style, NemotronH) or "softmax" (Qwen3-Next).

    forward(x [N, D]) -> (weights [N, k] float32, indices [N, k] int64). Scores are sigmoid(x W^T) or
    softmax(x W^T) over experts, in float32. Sigmoid only: ``e_score_correction_bias`` is added for choosing
    experts only, and with n_group > 1 only the ``topk_group`` groups with the best top-2 score sums are
    eligible. The chosen raw scores are renormalised (``norm_topk_prob``) and multiplied by
    ``routed_scaling_factor``. ``weight`` and the bias stay float32. The scoring and top-k are
    ``kernels.router.topk_route_ref``; on CUDA, for at most :data:`ROUTER_KERNEL_MAX_TOKENS` tokens,
    n_group = 1 and logits that need no gradient (the kernel has no backward), its sort-free Triton kernel
    ``topk_route``; at decode sizes the logits as :func:`router_form` says (``kernels.router.router_fused``:
    with the routing in one launch; ``router_logits``: x read in its dtype, then ``topk_route``).
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
        kw = dict(softmax=self.softmax, bias=None if self.softmax else self.e_score_correction_bias,
                  norm_topk_prob=self.norm_topk_prob, scaling=self.routed_scaling_factor)
        form = router_form(x, self.n_group)
        if form == "fused":  # the logits and the routing in one launch (kernels/router.py)
            return eager_op(router_fused)(x if x.stride(-1) == 1 else x.contiguous(), self.weight.float(),
                                          self.top_k, **kw)
        if form == "logits":  # the logits from x in its dtype, then the routing kernel
            logits = eager_op(router_logits)(x if x.stride(-1) == 1 else x.contiguous(), self.weight.float())
            return eager_op(topk_route)(logits, self.top_k, **kw)
        with torch.autocast(x.device.type, enabled=False):  # float32 logits under autocast too
            logits = F.linear(x.float(), self.weight.float())
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
    implementation (:func:`moe_experts_fused` / :func:`moe_experts_ref`).

    Declarations of the kind (``runners.engine.models.kinds``): no per-slot state (``state_class``), the
    tensor-parallel rule (``shard_rules``); no ``dummy_init``: dummy and synthetic weights take the generic
    rule of ``runners.engine.dummy.init_rule`` (experts and router N(0, 1/fan_in), biases and the router's
    correction bias 0).
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

    def input_linear(self) -> nn.Module | None:
        """The linear that alone among FP8-capable ones reads the block's input first: the shared expert's
        (:meth:`MLP.input_linear`); the router (float32) and the latent projection read it unquantized."""
        return self.shared_experts.input_linear()

    def forward(self, x: torch.Tensor, xq: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., D] -> [..., D]; ``xq``: x's codes for the shared expert's input linear (given only where
        :meth:`input_linear` asked for them)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        h = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = eager_op(_routed_experts)(self, h, weights, indices)  # grouped GEMMs: outside torch.compile
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        shared = self.shared_experts(flat, None if xq is None else xq.reshape(flat.shape))
        if self.shared_expert_gate is not None:  # routed + sigmoid(x . w) * shared: one kernel on CUDA
            fused = use_inference_kernel(flat) and shared.dtype == routed.dtype == flat.dtype
            combine = shared_gate_combine if fused else shared_gate_combine_ref
            return combine(flat, self.shared_expert_gate.weight, shared, routed).view(shape)
        return (routed + shared).view(shape)

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(h); h [N, L] -> [N, L]. An expert is
        down(act(up(h))) or, gated, down(act(gate(h)) * up(h)). ``experts_impl`` picks the implementation:
        "fused" (grouped GEMMs, or on CUDA at decode sizes the per-pair GEMV kernels with the activation
        fused; no host sync; :func:`moe_experts_fused`) or "ref" (the per-expert
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
