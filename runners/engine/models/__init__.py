"""Model code of the engine: the shared hybrid-decoder vocabulary (config, layers, mamba2, gdn, hybrid) and
one module per HF ``model_type`` (``nemotron_h``, ``qwen3_next``) that parses its config.json and maps
checkpoint names."""
