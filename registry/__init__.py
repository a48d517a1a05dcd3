"""The model registry: entries (registry/model/*.yaml, data only), their schema, baselines, tiny checkpoints.

`python -m registry list` prints the entries; `python -m registry validate` checks every one (CI runs it).
"""

from registry.schema import ModelEntry, entry_names, validate_entry

__all__ = ["ModelEntry", "entry_names", "validate_entry"]
