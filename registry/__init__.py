"""The model registry, the project's bottom layer: entries (registry/model/*.yaml, data only), the schema of a
run's config, its resolution, the checkpoint config.json parser and layout checks, baselines, tiny
checkpoints.

`python -m registry list` prints the entries; `python -m registry validate` checks every one (CI runs it).
Import the modules themselves (registry.schema, registry.errors, ...): this package module imports nothing,
so the light ones (registry.errors) stay light.
"""
