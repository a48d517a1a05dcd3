"""The task modules (one per task family: its data, documents and prompts) and our lm-eval groups (YAML)."""
