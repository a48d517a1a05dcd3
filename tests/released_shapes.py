"""A HybridConfig from a registry entry's `arch:` block, to size caches at released shapes without weights.

Only the tests need it (tests/test_replay_cache.py: replay's speculative buffers at the released Nemotron 3
Super and Qwen3-Next sizes); it reads registry.arch.ARCH_FIELDS, the table arch_from_config uses, backwards.
"""

from __future__ import annotations

from dataclasses import asdict

from registry.arch import ARCH_FIELDS
from registry.hf_config import HybridConfig
from registry.schema import ArchConfig, Family


def config_from_arch(arch: ArchConfig, family: Family | str, *, num_nextn_predict_layers: int = 1
                     ) -> HybridConfig:
    """A HybridConfig with the cache-relevant dimensions of an `arch:` block, for sizing caches of released
    models without their weights (runners.engine.cache.cache_memory_bytes).

    Layer order is not in the block and does not change cache sizes: the backbone lists its recurrent blocks,
    then its attention blocks (FFN blocks hold no cache and are left out). The MTP module is one attention +
    one MoE block (both families) when num_nextn_predict_layers > 0.

    Raises:
        ValueError: the family's recurrent dimensions (`mamba:` for nemotron_h, `gdn:` for qwen3_next) are
            missing from the block.
    """
    family = Family(family)
    dims_name = "mamba" if family == Family.nemotron_h else "gdn"
    dims = getattr(arch, dims_name)
    if dims is None:
        raise ValueError(f"arch block of a {family.value} entry needs its `{dims_name}:` dimensions")
    values = asdict(arch)
    mapped = {v: values[k] for k, v in ARCH_FIELDS.items() if "." not in k}
    mapped.update({v: getattr(dims, k.split(".")[1]) for k, v in ARCH_FIELDS.items()
                   if k.startswith(dims_name + ".")})
    recurrent = "mamba2" if family == Family.nemotron_h else "gdn"
    count = arch.num_mamba_layers if family == Family.nemotron_h else arch.num_gdn_layers
    return HybridConfig(
        family=family.value,
        layer_types=(recurrent,) * count + ("attention",) * arch.num_attention_layers,
        num_nextn_predict_layers=num_nextn_predict_layers,
        mtp_layer_types=("attention", "moe") if num_nextn_predict_layers else (),
        source="<registry arch block>",
        **mapped,
    )
