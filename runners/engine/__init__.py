"""Our lean PyTorch + Triton inference engine for hybrid LLMs (docs/architecture.md, "Engine API").

``from runners.engine import Engine`` loads an HF checkpoint directory and generates greedily with continuous
batching and MTP speculative decoding. The names below are resolved on first use (PEP 562), so importing a
torch-free submodule such as ``runners.engine.stats`` does not import torch.
"""

from __future__ import annotations

__all__ = ["Engine", "GenerationOutput", "GenerationStats"]


def __getattr__(name: str):
    if name in ("Engine", "GenerationOutput"):
        from runners.engine import engine

        return getattr(engine, name)
    if name == "GenerationStats":
        from runners.engine import stats

        return stats.GenerationStats
    raise AttributeError(f"module 'runners.engine' has no attribute {name!r}")
