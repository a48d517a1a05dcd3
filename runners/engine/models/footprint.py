"""The weight bytes a decode step must read: the one owner of the "active bytes" behind a step's floor.

A decode step (plain, or MTP draft + verify + commit + catch-up) is memory-bound at small batch: every weight
it uses crosses HBM at least once, so ``active bytes / copy bandwidth`` is a lower bound of its time (the
"weight-read floor" of gpt-fast's write-up, https://pytorch.org/blog/accelerating-generative-ai-2/, and of
the roofline model). The active bytes of one step are

- every dense weight the step runs (parameters and buffers of the backbone, the final norm and the LM head;
  the MTP module's too when the step drafts), each counted once however many forwards read it;
- of the token embedding table only the rows the step looks up (``embedding_rows`` of them), unless the LM
  head shares the table (``tie_word_embeddings``: the head reads all of it);
- of each MoE block's routed experts only the *distinct* experts the step's tokens chose (over all of the
  step's forwards through that block), times the bytes of one expert (its ``experts_*`` tensors and their
  per-expert scales, divided by E).

:class:`ExpertChoiceCounter` counts the distinct experts from the routers' choices while steps run eagerly
(an observer of every MoE block's routing; a CUDA graph replay runs no Python, so a benchmark counts on an
eager run of the same padded step); :func:`active_weight_bytes` turns the counts into bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch
from torch import nn

from runners.engine.models.moe import ROUTING_OBSERVERS, MoE


def _tensors(module: nn.Module):
    """(name, tensor) of every parameter and buffer, shared tensors once (tied weights)."""
    seen: set[int] = set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        key = id(t)
        if key not in seen:
            seen.add(key)
            yield name, t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _routed_names(moe: MoE) -> list[str]:
    """Local names of a MoE block's routed-expert tensors (``experts_up``, ``experts_up_weight_scale``, ...),
    each stacked over the E experts on dim 0."""
    E = moe.gate.num_experts
    names = []
    for name, t in [*moe.named_parameters(recurse=False), *moe.named_buffers(recurse=False)]:
        if name.startswith("experts_") and t is not None and t.dim() >= 1 and t.shape[0] == E:
            names.append(name)
    return names


def expert_bytes(moe: MoE) -> int:
    """Bytes of one routed expert of ``moe``: its stacked ``experts_*`` tensors (weights and per-expert
    scales) over E. Raises ValueError when they do not split evenly."""
    E = moe.gate.num_experts
    total = sum(_nbytes(getattr(moe, n)) for n in _routed_names(moe))
    if total % E:
        raise ValueError(f"routed-expert bytes {total} of an MoE block do not split over its {E} experts")
    return total // E


def moe_blocks(model: nn.Module, include_mtp: bool = True) -> dict[str, MoE]:
    """{module name: MoE block} of ``model`` (a ``HybridLM``), the MTP module's only with ``include_mtp``."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, MoE) and (include_mtp or not name.startswith("mtp."))}


def active_weight_bytes(model: nn.Module, distinct_experts: Mapping[str, float], *, include_mtp: bool,
                        embedding_rows: int = 0) -> dict[str, float]:
    """Weight bytes one decode step reads at least once (see the module docstring).

    Args:
        model: a ``runners.engine.models.hybrid.HybridLM`` (any weight dtypes, quantized experts included).
        distinct_experts: {MoE module name (``model.named_modules()``, e.g. ``layers.3.mixer``): distinct
            routed experts a step's tokens chose in that block, a mean over steps} for every MoE block the
            step runs (:meth:`ExpertChoiceCounter.mean_distinct`).
        include_mtp: whether the step runs the MTP module (speculative steps).
        embedding_rows: token-embedding rows the step looks up (tokens fed per step; B for a plain step).

    Returns:
        {"dense_bytes", "expert_bytes", "total_bytes"}: bytes per step (floats: the expert part is a mean).

    Raises:
        ValueError: an MoE block the step runs that ``distinct_experts`` does not name.
    """
    mtp = getattr(model, "mtp", None)
    skip = set()
    blocks = moe_blocks(model, include_mtp)
    for moe in moe_blocks(model, True).values():
        skip.update(id(getattr(moe, n)) for n in _routed_names(moe))
    emb = model.embeddings.weight
    tied = model.lm_head.weight is emb
    dense = 0
    for name, t in _tensors(model):
        if id(t) in skip or (not include_mtp and mtp is not None and name.startswith("mtp.")):
            continue
        if t is emb and not tied:
            dense += min(embedding_rows, emb.shape[0]) * _nbytes(emb[0])
            continue
        dense += _nbytes(t)
    missing = sorted(set(blocks) - set(distinct_experts))
    if missing:
        raise ValueError(f"distinct_experts names no count for the MoE blocks {missing}")
    experts = sum(float(distinct_experts[name]) * expert_bytes(moe) for name, moe in blocks.items())
    return {"dense_bytes": float(dense), "expert_bytes": experts, "total_bytes": dense + experts}


class ExpertChoiceCounter:
    """Counts, per MoE block, the distinct routed experts each decode step's tokens choose.

    An observer of every MoE block of ``model`` (``runners.engine.models.moe.ROUTING_OBSERVERS``: called
    with the router's choices before the routed experts, outside torch.compile's code) marks the chosen
    expert ids in a per-block device mask while a :meth:`step` is open (forwards outside, e.g. prefills, are
    not counted); closing the step adds each mask's count to a device total and clears it (no host
    synchronisation: the totals are read once, by :meth:`mean_distinct`). Observers run only when Python
    runs the forward: count on eager steps (a CUDA graph replay of the same step chooses the same experts but
    runs no Python). Use as a context manager (the observer is removed on exit).
    """

    def __init__(self, model: nn.Module):
        self.steps = 0
        self._open = False
        self._seen: dict[str, torch.Tensor] = {}
        self._total: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        for name, moe in moe_blocks(model, True).items():
            dev = moe.gate.weight.device
            self._names[id(moe)] = name
            self._seen[name] = torch.zeros(moe.gate.num_experts, dtype=torch.bool, device=dev)
            self._total[name] = torch.zeros((), dtype=torch.long, device=dev)
        ROUTING_OBSERVERS.append(self._observe)

    def _observe(self, moe: MoE, indices: torch.Tensor) -> None:
        name = self._names.get(id(moe))
        if self._open and name is not None:
            self._seen[name][indices.flatten()] = True

    @contextmanager
    def step(self):
        """Count the forwards run inside as one decode step."""
        self._open = True
        try:
            yield
        finally:
            self._open = False
            for name, seen in self._seen.items():
                self._total[name] += seen.sum()
                seen.zero_()
            self.steps += 1

    def mean_distinct(self) -> dict[str, float]:
        """{MoE module name: distinct experts per step, mean over the counted steps} (blocks no counted step
        ran, e.g. the MTP module's in plain steps, are left out). Reads the device totals (one sync each)."""
        n = max(self.steps, 1)
        return {name: int(t) / n for name, t in self._total.items() if int(t) > 0}

    def close(self) -> None:
        """Stop observing (idempotent)."""
        if self._observe in ROUTING_OBSERVERS:
            ROUTING_OBSERVERS.remove(self._observe)

    def __enter__(self) -> ExpertChoiceCounter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
