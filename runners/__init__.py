"""Our lean PyTorch inference engine for hybrid LLMs (see docs/architecture.md, "Engine API").

``from runners import Engine`` loads an HF checkpoint directory and generates greedily with continuous
batching; the model code lives in ``runners.models``, caches in ``runners.cache``, loading in
``runners.loader``.
"""

from runners.engine import Engine, GenerationOutput, GenerationStats

__all__ = ["Engine", "GenerationOutput", "GenerationStats"]
