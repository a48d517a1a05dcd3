"""Write tiny random NemotronH checkpoints in HF format for engine and loader tests.

The weights come from transformers' own ``NemotronHForCausalLM`` (the oracle), re-drawn at a scale that gives
distinct logits (HF's init makes every logit ~0, so greedy ties would dominate), and saved with
``save_pretrained`` -- which writes the released checkpoints' names (``backbone.*``, per-expert
``experts.{e}.{up,down}_proj.weight``). Optional MTP tensors (``mtp.*``, names as in Nemotron 3 Super) are
appended, the config can be rewritten in the released ``hybrid_override_pattern`` dialect, and the weights
can be split into shards with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runners.engine import Engine

PATTERN_TO_TYPE = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def tiny_config_kwargs(pattern: str = "M*EM-E", **overrides) -> dict:
    """Awkward tiny sizes that exercise every block kind: n_groups > 1, GQA, a latent MoE, chunked scan."""
    kw = dict(
        vocab_size=61,
        hidden_size=40,
        layers_block_type=[PATTERN_TO_TYPE[c] for c in pattern],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=36,
        mamba_num_heads=6,
        mamba_head_dim=10,
        n_groups=2,
        ssm_state_size=12,
        conv_kernel=4,
        chunk_size=8,
        n_routed_experts=7,
        num_experts_per_tok=3,
        moe_intermediate_size=20,
        moe_shared_expert_intermediate_size=28,
        moe_latent_size=24,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    kw.update(overrides)
    return kw


def make_hf_model(seed: int = 0, pattern: str = "M*EM-E", **overrides):
    """Return transformers' NemotronHForCausalLM with well-scaled random weights (float32, eval mode)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**tiny_config_kwargs(pattern, **overrides))).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)  # softplus(dt) well above time_step_min
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("embeddings.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))  # fan-in scale
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def mtp_tensors(hf_config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` tensors for a "*E" MTP module with the checkpoint's names and shapes."""
    g = torch.Generator().manual_seed(seed + 7)
    D = hf_config.hidden_size
    r = lambda *s: torch.randn(*s, generator=g) / math.sqrt(s[-1])
    hd, nq, nkv = hf_config.head_dim, hf_config.num_attention_heads, hf_config.num_key_value_heads
    L = hf_config.moe_latent_size or D
    t = {
        "mtp.layers.0.enorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        "mtp.layers.0.hnorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        "mtp.layers.0.eh_proj.weight": r(D, 2 * D),
        "mtp.layers.0.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        "mtp.layers.0.mixer.q_proj.weight": r(nq * hd, D),
        "mtp.layers.0.mixer.k_proj.weight": r(nkv * hd, D),
        "mtp.layers.0.mixer.v_proj.weight": r(nkv * hd, D),
        "mtp.layers.0.mixer.o_proj.weight": r(D, nq * hd),
        "mtp.layers.1.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        "mtp.layers.1.final_layernorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        "mtp.layers.1.mixer.gate.weight": r(hf_config.n_routed_experts, D),
        "mtp.layers.1.mixer.gate.e_score_correction_bias": 0.1
        * torch.randn(hf_config.n_routed_experts, generator=g),
        "mtp.layers.1.mixer.shared_experts.up_proj.weight": r(
            hf_config.moe_shared_expert_intermediate_size, D
        ),
        "mtp.layers.1.mixer.shared_experts.down_proj.weight": r(
            D, hf_config.moe_shared_expert_intermediate_size
        ),
    }
    if hf_config.moe_latent_size is not None:
        t["mtp.layers.1.mixer.fc1_latent_proj.weight"] = r(L, D)
        t["mtp.layers.1.mixer.fc2_latent_proj.weight"] = r(D, L)
    for e in range(hf_config.n_routed_experts):
        t[f"mtp.layers.1.mixer.experts.{e}.up_proj.weight"] = r(hf_config.moe_intermediate_size, L)
        t[f"mtp.layers.1.mixer.experts.{e}.down_proj.weight"] = r(L, hf_config.moe_intermediate_size)
    return t


def write_checkpoint(
    path: str | Path, hf_model, *, with_mtp: bool = True, dialect: str = "hf5", num_shards: int = 1
) -> Path:
    """Save ``hf_model`` as an HF checkpoint dir at ``path``.

    Args:
        with_mtp: append random ``mtp.*`` tensors (Super V3 names).
        dialect: "hf5" keeps transformers 5's config.json (``layers_block_type``, ``{"__float__": ...}``);
            "pattern" rewrites it as released checkpoints do (``hybrid_override_pattern``,
            ``mtp_hybrid_override_pattern``, a legacy ``mamba_n_groups`` alias, ``Infinity`` as a bare
            JSON token).
        num_shards: > 1 splits the tensors round-robin into shards plus ``model.safetensors.index.json``.
    """
    path = Path(path)
    hf_model.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    if with_mtp:
        tensors.update(mtp_tensors(hf_model.config))
    if dialect == "pattern":
        cfg = json.loads((path / "config.json").read_text())
        cfg["hybrid_override_pattern"] = hf_model.config.hybrid_override_pattern
        cfg["mtp_hybrid_override_pattern"] = hf_model.config.mtp_hybrid_override_pattern
        cfg["num_hidden_layers"] = len(cfg.pop("layers_block_type"))
        cfg.pop("mtp_layers_block_type")
        cfg["mamba_n_groups"] = cfg.pop("n_groups")  # a legacy alias, as in older released configs
        cfg["time_step_limit"] = [0.0, float("inf")]  # json writes Infinity, as released configs do
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    elif dialect != "hf5":
        raise ValueError(f"dialect must be 'hf5' or 'pattern', got {dialect!r}")
    (path / "model.safetensors").unlink()
    if num_shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::num_shards]}
        save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


class OracleDraftEngine(Engine):
    """Drafts the true greedy continuation, with draft ``step % (K + 1)`` corrupted at each step (none when
    that index is K), so num_accepted_tokens cycles through 1 .. K + 1."""

    def set_oracle(self, prompts, greedy):
        self.prompts = [list(p) for p in prompts]
        self.sequences = [p + g for p, g in zip(prompts, greedy)]
        self.slot_request, self.calls = {}, 0
        self.step.draft = self._oracle_draft  # the decode step drafts with the oracle
        self.runner.prefill = self._prefill  # the runner's command, seen first here

    def _prefill(self, prompts, slots):
        out = type(self.runner).prefill(self.runner, prompts, slots)
        for j, s in zip(out.taken, slots):
            self.slot_request[s] = self.prompts.index(list(prompts[j]))
        return out

    def _oracle_draft(self, slot_ids, start_pos, max_kv_len=None):
        K, V = self.options.draft_len, self.config.vocab_size
        wrong = self.calls % (K + 1)
        self.calls += 1
        rows = []
        for s, n in zip(slot_ids.tolist(), start_pos.tolist()):
            seq = self.sequences[self.slot_request[s]]
            row = [seq[n + 1 + j] if n + 1 + j < len(seq) else 0 for j in range(K)]
            if wrong < K:
                row[wrong] = (row[wrong] + 1) % V
            rows.append(row)
        return torch.tensor(rows, device=self.device)
