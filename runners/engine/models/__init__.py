"""Model code of the engine: the shared hybrid-decoder vocabulary (config, layers, mamba2, gdn, moe, fp8,
hybrid) and one module per HF ``model_type`` (``nemotron_h``, ``qwen3_next``) that maps the checkpoint's
tensor names to the model's (``checkpoint_targets``, found by ``config.py``). config.json itself is parsed by
registry.hf_config (``HybridConfig``), which ``config.py`` re-exports."""
