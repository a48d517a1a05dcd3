"""The block kinds of the hybrid decoders: ``{kind: mixer class}``, the one table the block builder
(``runners.engine.models.block``) and the cache (``runners.engine.cache``) read.

A kind's module declares everything about it on its mixer class, so adding a kind is one module and one row
here: ``state_class(replay)`` (the per-slot :class:`runners.engine.state.LayerState` it keeps: shapes and
dtypes from the config's dims, its commit under rewind or replay; None: stateless), ``shard_rules`` (what a
tensor-parallel rank reads of each tensor; ``shard_modules`` where a rank's model needs a module swapped)
and, where it is not the generic one, ``dummy_init`` (how ``runners.engine.dummy`` initialises its
parameters). docs/architecture.md, "Layer kinds". A mixer is built by its ``from_config(config)`` when
it has one, else by ``cls(config)``.
"""

from __future__ import annotations

from torch import nn

from runners.engine.models.attention import Attention
from runners.engine.models.config import HybridConfig
from runners.engine.models.gdn import GDNMixer
from runners.engine.models.layers import MLP
from runners.engine.models.mamba2 import Mamba2Mixer
from runners.engine.models.moe import MoE
from runners.engine.state import LayerState

MIXERS: dict[str, type[nn.Module]] = {
    "mamba2": Mamba2Mixer,
    "attention": Attention,
    "gdn": GDNMixer,
    "mlp": MLP,
    "moe": MoE,
}


def mixer_class(kind: str) -> type[nn.Module]:
    """The mixer class of block kind ``kind``. Raises ValueError for an unknown kind."""
    if kind not in MIXERS:
        raise ValueError(f"block kind {kind!r} has no mixer; known kinds: {sorted(MIXERS)}")
    return MIXERS[kind]


def build_mixer(kind: str, config: HybridConfig) -> nn.Module:
    """A fresh mixer of block kind ``kind`` for ``config`` (on the current default device)."""
    cls = mixer_class(kind)
    return getattr(cls, "from_config", cls)(config)


def state_class(kind: str, replay: bool = False) -> type[LayerState] | None:
    """The per-slot state class block kind ``kind`` keeps in the cache (None: a stateless kind), under
    ssm_replay when ``replay``. Raises ValueError for an unknown kind."""
    return mixer_class(kind).state_class(replay)


def stateful(kind: str) -> bool:
    """Whether blocks of ``kind`` keep per-slot state (and so get a ``cache_index``); False for a kind
    without a mixer (the block builder then raises, naming the known kinds)."""
    return kind in MIXERS and MIXERS[kind].state_class(False) is not None
