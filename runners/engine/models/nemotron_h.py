"""NemotronH (Nemotron 3 Super / Nano) family code: the checkpoint-name mapping.

Its ``config.json`` (both dialects) is parsed by registry.hf_config.parse_nemotron_h. Names on disk are the
released checkpoints' names, which transformers 5 ``save_pretrained`` also writes (verified with 5.24.0:
``backbone.*``, per-expert ``mixer.experts.{e}.{up,down}_proj.weight``):

- ``backbone.embeddings.weight``, ``backbone.norm_f.weight``, ``lm_head.weight`` (absent when tied)
- ``backbone.layers.{i}.norm.weight`` and ``backbone.layers.{i}.mixer.<parameter>``; the routed experts
  ``mixer.experts.{e}.up_proj.weight`` [I, L] / ``down_proj.weight`` [L, I] are rows of our stacked
  ``experts_up`` / ``experts_down``
- MTP: ``mtp.layers.0.{enorm,hnorm,eh_proj}.weight``, ``mtp.layers.{j}.norm.weight``,
  ``mtp.layers.{j}.mixer.*`` and ``mtp.layers.{last}.final_layernorm.weight``.
"""

from __future__ import annotations

import torch

from runners.engine.models.hybrid import HybridLM
from runners.engine.models.moe import unstack_expert_names


def checkpoint_targets(model: HybridLM) -> dict[str, torch.Tensor]:
    """Map every checkpoint tensor name to the model tensor it fills.

    Returns:
        ``{name: destination}``; a destination is a parameter / buffer or (experts) a view of one row of a
        stacked parameter, so ``destination.copy_(tensor)`` loads it in place. MTP names appear only when
        the model was built with its MTP module; ``lm_head.weight`` is absent for tied embeddings.
    """
    targets: dict[str, torch.Tensor] = {}
    n_mtp = len(model.mtp.blocks) if model.mtp is not None else 0
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    for name, tensor in named.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.startswith(("embeddings.", "layers.", "norm_f.")):
            ckpt = "backbone." + name
        elif name.startswith("mtp."):
            rest = name[len("mtp.") :]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                ckpt = "mtp.layers.0." + rest
            elif rest.startswith("final_norm."):
                ckpt = f"mtp.layers.{n_mtp - 1}.final_layernorm." + rest[len("final_norm.") :]
            else:
                ckpt = "mtp.layers." + rest[len("blocks.") :]
        else:
            ckpt = name
        targets.update(unstack_expert_names(ckpt, tensor))
    return targets
