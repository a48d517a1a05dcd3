"""The family code of the shared hybrid decoder: one module per HF ``model_type``.

Every model the engine runs is a :class:`HybridConfig` (registry/hf_config.py parses ``config.json`` into one,
without torch, so registry validation reads the same object) and the shared modules of
``runners.engine.models.hybrid``. What differs per family lives in ``runners/engine/models/<model_type>.py``
(found by
:func:`family_module`): the mapping of checkpoint tensor names to model tensors.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from registry.checkpoint import CheckpointError
from registry.hf_config import PARSERS, HybridConfig

__all__ = ["HybridConfig", "family_module"]


def family_module(model_type: str, source: str = "<config>") -> ModuleType:
    """The family module ``runners.engine.models.<model_type>`` (e.g. ``nemotron_h``), which defines
    ``checkpoint_targets(model) -> {checkpoint name: tensor}``. source names the config in messages.

    Raises:
        CheckpointError: a model_type without a parser in registry.hf_config.PARSERS.
    """
    if model_type not in PARSERS:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported; supported: {sorted(PARSERS)}",
            "use a NemotronH or Qwen3-Next checkpoint",
        )
    return importlib.import_module(f"runners.engine.models.{model_type}")
