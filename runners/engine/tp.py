"""Tensor parallelism as a layer over the models: a per-rank config view, per-rank checkpoint readers, and an
all-reduce where each block's row-parallel output ends. The model code never mentions ranks.

The model to follow is gpt-fast's tp.py (pytorch-labs/gpt-fast): shard an already-built model by swapping its
weights for their shards and summing the outputs of the row-parallel layers across ranks. Here the model is
first built on the meta device from the checkpoint (``runners.engine.loader.plan_load``: every name and
shape checked
against the safetensors headers, nothing allocated); :func:`shard_plan` then rebuilds it, still on the meta
device, from the rank's config view (:func:`rank_config`: head counts and intermediate sizes divided by the
world size), registers the all-reduces as forward hooks, and gives the loader one reader per checkpoint tensor
that reads only this rank's part of the memory-mapped file (safetensors ``get_slice``). So each rank allocates
and reads only its shard; ``runners.engine.loader.materialize`` fills it.

How each block kind is split (its mixer declares it, ``shard_rules``; runners/engine/models/kinds.py. W world
size, r this rank; full sizes of config.json):

- attention: query heads split (q_proj rows; gated attention's rows are per head [q_h, gate_h]); KV heads
  split, or when there are fewer KV heads than ranks each rank holds the one KV head its query heads read
  (vLLM / TensorRT-LLM replicate them the same way); o_proj by columns. q / k norms replicated.
- mamba2: heads split. in_proj's output is [z | x | B | C | dt]: each rank reads its heads' part of z, x and
  dt and its groups' part of B and C; the conv over [x | B | C] likewise; A_log, D, dt_bias and the norm
  weight by head; out_proj by columns. With ngroups >= W the groups split with the heads; with ngroups < W
  (W a multiple of it) each rank holds the one group its heads read, and the gated grouped RMSNorm, whose
  group then spans W / ngroups ranks, sums its statistics over those ranks
  (``runners.engine.models.mamba2.SpanningGroupRMSNorm``).
- gdn: key heads split together with their value heads. in_proj_qkvz and in_proj_ba are grouped per key head
  ([q_h, k_h, v_h, z_h] and [b_h, a_h]), so a rank's rows are one contiguous block; the conv over the
  de-interleaved [Q | K | V] reads its part of each; A_log / dt_bias by value head; the output norm (over the
  value head dim) replicated; out_proj by columns.
- mlp (dense blocks and shared experts): gate / up by rows (column parallel), down by columns (row parallel).
- moe: the router replicated (every rank routes every token alike); every routed expert split along its
  intermediate size (up / gate rows, down columns), so each rank runs the same fused grouped GEMMs over all
  routed (token, expert) pairs with its slice of each expert ("sharded intermediate"); the shared expert as an
  mlp; NemotronH's latent projections replicated (fc2_latent_proj is linear: it maps the partial sums). This
  instead of expert parallelism: the MoE forward stays unchanged (no token dispatch, no host sync, CUDA-graph
  capturable), every rank does the same work whatever the routing, and any expert count shards.
- the MTP module's blocks as above; its enorm / hnorm / eh_proj / final norm replicated. Embeddings, lm_head
  and every block norm are replicated (simpler than a vocab-parallel head, at the cost of one copy of the
  embedding and head per rank).
- Row-parallel biases (o_proj, out_proj, down_proj, fc2_latent_proj) are loaded on rank 0 and are zero on the
  other ranks, so the all-reduced sum adds them once.

Every block mixer that holds a shard (attention, mamba2, gdn, mlp, moe) gets a forward hook that sums its
output over the ranks (``torch.distributed.all_reduce``, in place: NCCL on GPUs, gloo on the CPU; NCCL's
all-reduce can be captured in a CUDA graph); the residual stream, norms, logits and greedy tokens are then the
same on every rank. The engine sizes every cache from the model's config, which is the rank view: recurrent
states, conv windows, KV caches, replay histories and rewind buffers hold this rank's heads only.

Order with other module swaps (e.g. quantized linears): shard first (this module, on the plan), then swap
modules of the sharded plan's model, then materialize.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from registry.arch import check_world_size
from registry.errors import UserError
from registry.hf_config import HybridConfig
from runners.engine.loader import LoadPlan, build_meta_model, load_targets, model_bytes
from runners.engine.shard import FirstRankOnly, Rule, Shard

__all__ = [
    "TensorParallel",
    "Shard",
    "FirstRankOnly",
    "rank_config",
    "shard_plan",
    "shard_rules",
]

# block kinds whose mixer holds a shard and ends in a row-parallel projection (an all-reduce after it)
SHARDED_KINDS = ("attention", "mamba2", "gdn", "mlp", "moe")

# a routed expert's tensors in a checkpoint (both families): experts.{e}.{up,gate,down}_proj.weight
_EXPERT = re.compile(r"\.experts\.\d+\.(up|gate|down)_proj\.weight$")


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` in [0, ``world_size``) of ``group`` (a
    ``torch.distributed`` process group; None: the default group). The process group must be initialised
    before a sharded model runs a forward (and before :func:`shard_plan` when a mamba group spans ranks).
    ``ranks_per_device``: how many of the group's ranks allocate on this rank's device (1: a GPU per rank;
    ``world_size`` when every rank shares one GPU, ``runners.engine.launch.launch(share_device=True)``, or
    the host's memory on the CPU): each rank's memory budget is that share of the device's free memory
    (``runners.engine.memory.check_memory_fits``)."""

    rank: int
    world_size: int
    group: Any = None
    ranks_per_device: int = 1
    _subgroups: dict[int, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must lie in [0, world_size={self.world_size})")
        if not 1 <= self.ranks_per_device <= self.world_size:
            raise ValueError(f"ranks_per_device={self.ranks_per_device} must lie in [1, world_size="
                             f"{self.world_size}]")

    def all_ranks_zero(self, flags: torch.Tensor) -> torch.Tensor:
        """``flags`` (int32 [n], 1 where this rank's part of a weight is all zeros) combined over the ranks:
        1 only where every rank's is (an all-reduce MIN over ``group``, a collective: every rank calls it with
        the same n). Without an initialised process group (one process materialising a rank's shard, as the
        tests do) the rank's own flags are returned."""
        if not dist.is_initialized():
            return flags
        flags = flags.clone()
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        return flags

    def all_ranks_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value`` (an all-reduce MIN over ``group``, a collective: every rank
        calls it; an int64 on ``device`` over NCCL, on the CPU over gloo). Without an initialised process
        group, ``value``."""
        if not dist.is_initialized():
            return value
        on = device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def subgroup(self, span: int) -> Any:
        """The process group of the ``span`` consecutive ranks this rank belongs to (ranks ``k span ..
        (k + 1) span - 1``). Every rank must ask for the same spans in the same order: creating a group is a
        collective call (``torch.distributed.new_group``)."""
        if span not in self._subgroups:
            ranks = (list(range(self.world_size)) if self.group is None
                     else dist.get_process_group_ranks(self.group))
            mine = None
            for start in range(0, self.world_size, span):
                g = dist.new_group(ranks[start:start + span])
                if start <= self.rank < start + span:
                    mine = g
            self._subgroups[span] = mine
        return self._subgroups[span]


def rank_config(config: HybridConfig, world_size: int) -> HybridConfig:
    """The config one rank's model is built from: attention, KV, mamba and GDN head counts, mamba groups and
    the dense / routed / shared intermediate sizes divided by ``world_size`` (KV heads and mamba groups fewer
    than ranks become 1: replicated). Every rank's view is the same. ``world_size = 1`` returns ``config``.

    Raises:
        registry.errors.UserError: a count that ``world_size`` cannot shard, naming it
            (``registry.arch.check_world_size``).
    """
    check_world_size(config, world_size, config.source or "the model")
    if world_size == 1:
        return config
    W = world_size
    c = config
    return replace(
        c,
        num_attention_heads=c.num_attention_heads // W,
        num_key_value_heads=max(1, c.num_key_value_heads // W) if c.num_key_value_heads else 0,
        mamba_num_heads=c.mamba_num_heads // W,
        n_groups=max(1, c.n_groups // W),
        gdn_num_key_heads=c.gdn_num_key_heads // W,
        gdn_num_value_heads=c.gdn_num_value_heads // W,
        intermediate_size=c.intermediate_size // W,
        moe_intermediate_size=c.moe_intermediate_size // W,
        moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size // W,
        source=f"{c.source} (one rank's view at world_size {W})",
    )


# ------------------------------------------------------------------------------------------------------------
# What each rank reads of a checkpoint tensor
# ------------------------------------------------------------------------------------------------------------


def shard_rules(model: nn.Module, full: HybridConfig, tp: TensorParallel) -> dict[str, Rule]:
    """``{parameter / buffer name: what this rank reads}`` for a model built from the rank view of ``full``
    (names as ``model.named_parameters()``); names absent from the result are replicated. Each block kind
    declares its own rules (its mixer's ``shard_rules(full, W, r)``, ``runners/engine/models/kinds.py``); a
    module inside one that declares them (the MoE's shared expert) is covered by its owner's rules."""
    W, r = tp.world_size, tp.rank
    rules: dict[str, Rule] = {}
    owners: list[str] = []
    for prefix, module in model.named_modules():
        if not hasattr(module, "shard_rules") or any(prefix.startswith(o + ".") for o in owners):
            continue
        owners.append(prefix)
        rules.update({f"{prefix}.{k}": v for k, v in module.shard_rules(full, W, r).items()})
    return rules


def _expert_rule(name: str, local_shape: tuple[int, ...], rank: int) -> Rule:
    """A per-expert checkpoint tensor [I, L] (up / gate) or [L, I] (down): this rank's intermediate rows /
    columns (one row of the stacked parameter's :class:`Shard`)."""
    kind = _EXPERT.search(name).group(1)
    dim = 1 if kind == "down" else 0
    Il = local_shape[dim]
    return Shard(dim, ((rank * Il, (rank + 1) * Il),))


# ------------------------------------------------------------------------------------------------------------
# Modules the sharding layer adds: the all-reduce hook, the spanning grouped norm
# ------------------------------------------------------------------------------------------------------------


class AllReduceOutput:
    """Forward hook that sums a module's output over ``group`` in place (``torch.distributed.all_reduce``):
    the end of a row-parallel block."""

    def __init__(self, group: Any = None):
        self.group = group

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=self.group)
        return output


# ------------------------------------------------------------------------------------------------------------
# The plan transformation
# ------------------------------------------------------------------------------------------------------------


def shard_plan(plan: LoadPlan, tp: TensorParallel) -> LoadPlan:
    """This rank's load plan: the model rebuilt on the meta device from :func:`rank_config`, the all-reduce
    hooks registered on every sharded block mixer, the kinds' own module swaps (a mixer's ``shard_modules``:
    Mamba2's norm whose group spans ranks), and a reader per checkpoint tensor that is not read whole.
    ``plan`` must come from ``runners.engine.loader.plan_load`` (its model unsharded); it is not modified.
    ``tp.world_size == 1`` returns ``plan``.

    Raises:
        registry.errors.UserError: a head count or intermediate size the world size cannot shard; an FP8
            checkpoint (not sharded yet).
        RuntimeError: a checkpoint tensor whose shard does not fit the rank's model (a bug in the rules).
    """
    if tp.world_size == 1:
        return plan
    if plan.config.quantization is not None:
        raise UserError(f"{plan.config.source}: an FP8 checkpoint cannot be sharded yet "
                        "(runners.engine.tp splits "
                        "unquantized weights; FP8 scales are not sharded)", "run it with world_size=1")
    full = plan.config
    config = rank_config(full, tp.world_size)
    model = build_meta_model(config, dtype=plan.dtype, with_mtp=plan.model.mtp is not None)
    for module in list(model.modules()):  # a kind's own module swaps (Mamba2: a norm spanning ranks)
        if hasattr(module, "shard_modules"):
            module.shard_modules(full, tp.world_size, tp.subgroup)
    hook = AllReduceOutput(tp.group)
    blocks = list(model.layers) + (list(model.mtp.blocks) if model.mtp is not None else [])
    for block in blocks:
        if block.kind in SHARDED_KINDS:
            block.mixer.register_forward_hook(hook)

    by_param = shard_rules(model, full, tp)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    rule_of = {id(t): by_param.get(n) for n, t in named.items()}
    full_targets, targets = load_targets(plan.model), load_targets(model)
    if set(full_targets) != set(targets):
        raise RuntimeError(f"sharded model tensors differ from the checkpoint's: "
                           f"{sorted(set(full_targets) ^ set(targets))[:5]}")
    readers = {}
    for name, target in targets.items():
        rule = rule_of[id(target)] if id(target) in rule_of else (
            _expert_rule(name, tuple(target.shape), tp.rank) if _EXPERT.search(name) else None)
        full_shape = tuple(full_targets[name].shape)
        want = full_shape if rule is None else rule.shape(full_shape)
        if want != tuple(target.shape):
            raise RuntimeError(
                f"rank {tp.rank}: {name} would load a {list(want)} shard into a {list(target.shape)} tensor "
                f"({rule or 'replicated'}); the sharding rules of runners/engine/tp.py do not fit this model"
            )
        if rule is not None:
            readers[name] = rule.read
    return replace(plan, config=config, model=model, weight_bytes=model_bytes(model), readers=readers,
                   all_ranks_zero=tp.all_ranks_zero)
