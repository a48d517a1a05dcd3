"""Checkpoint tools, each a ``python -m runners.tools.<name>`` program: ``train`` (the tiny models' training),
``tiny`` (builds the shipped tiny checkpoints), ``synth`` (synthetic checkpoints at real dimensions),
``quantize`` (the release formats from a float checkpoint)."""
