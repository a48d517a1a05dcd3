"""The engine and the programs around it, in three parts (docs/architecture.md):

- ``runners.engine``: our lean PyTorch + Triton inference engine (model code, caches, loading, the
  speculative step, tensor parallelism); ``from runners.engine import Engine``.
- ``runners.app``: the application ``run.py`` calls: one evaluation of a registry entry, end to end.
- ``runners.tools``: checkpoint tools run by hand (``python -m runners.tools.<name>``): train, tiny, synth,
  quantize.

Nothing is imported here, so ``import runners.engine.stats`` stays free of torch.
"""
