"""runners/engine/models/footprint.py: a decode step's active weight bytes (the floor of bench_e2e) on a model
small enough to count by hand, and the distinct-expert counter on routers whose choices are forced."""

from __future__ import annotations

import pytest
import torch

from runners.engine.models.config import HybridConfig
from runners.engine.models.footprint import ExpertChoiceCounter, active_weight_bytes, expert_bytes
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.moe import ROUTING_OBSERVERS

F32 = 4  # bytes


def _model(tied: bool = False, mtp: bool = False) -> HybridLM:
    # vocab 8, hidden 4, one MoE block: 4 experts of intermediate size 2, top-2, shared expert of size 2
    c = HybridConfig(family="nemotron_h", vocab_size=8, hidden_size=4, layer_types=("moe",),
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=2,
                     moe_shared_expert_intermediate_size=2, tie_word_embeddings=tied,
                     num_nextn_predict_layers=1 if mtp else 0, mtp_layer_types=("moe",) if mtp else ())
    return HybridLM(c, with_mtp=mtp)


def test_bytes_by_hand():
    model = _model()
    # one expert: up [2, 4] + down [4, 2] = 16 floats
    assert expert_bytes(model.layers[0].mixer) == 16 * F32
    # dense: 1 embedding row (4) + block norm (4) + router weight [4, 4] (16) + correction bias (4)
    #        + shared expert up [2, 4] and down [4, 2] (16) + final norm (4) + LM head [8, 4] (32) = 80 floats
    got = active_weight_bytes(model, {"layers.0.mixer": 3}, include_mtp=False, embedding_rows=1)
    assert got == {"dense_bytes": 80 * F32, "expert_bytes": 3 * 16 * F32, "total_bytes": (80 + 48) * F32}
    # 2.5 distinct experts on average, two rows looked up
    got = active_weight_bytes(model, {"layers.0.mixer": 2.5}, include_mtp=False, embedding_rows=2)
    assert got["dense_bytes"] == 84 * F32 and got["expert_bytes"] == 2.5 * 16 * F32


def test_tied_head_reads_the_whole_table():
    model = _model(tied=True)
    got = active_weight_bytes(model, {"layers.0.mixer": 1}, include_mtp=False, embedding_rows=1)
    assert got["dense_bytes"] == (4 + 16 + 4 + 16 + 4 + 32) * F32  # the table once, as the head


def test_mtp_module_counted_only_when_the_step_drafts():
    model = _model(mtp=True)
    plain = active_weight_bytes(model, {"layers.0.mixer": 2}, include_mtp=False, embedding_rows=1)
    assert plain["dense_bytes"] == 80 * F32
    spec = active_weight_bytes(model, {"layers.0.mixer": 2, "mtp.blocks.0.mixer": 4}, include_mtp=True,
                               embedding_rows=1)
    # MTP: enorm, hnorm, final norm (3 x 4) + eh_proj [4, 8] (32) + block norm (4) + router (16 + 4)
    #      + shared expert (16) = 84 floats
    assert spec["dense_bytes"] == (80 + 84) * F32
    assert spec["expert_bytes"] == (2 + 4) * 16 * F32
    with pytest.raises(ValueError, match="mtp.blocks.0.mixer"):
        active_weight_bytes(model, {"layers.0.mixer": 2}, include_mtp=True)


def test_counter_counts_distinct_choices_per_step():
    model = _model()
    router = model.layers[0].mixer.gate
    with torch.no_grad():  # the router picks the experts with the largest bias (scores tie at sigmoid(0))
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    x = torch.zeros(1, 1, 4)
    with ExpertChoiceCounter(model) as counter:
        model(x.long()[..., 0])  # outside a step: not counted
        with counter.step():  # experts {2, 3}
            model(torch.zeros(1, 1, dtype=torch.long))
        with torch.no_grad():
            router.e_score_correction_bias.copy_(torch.tensor([3.0, 2.0, 1.0, 0.0]))
        with counter.step():  # {0, 1} twice in one step: still 2 distinct; then {0, 1} again
            model(torch.zeros(2, 1, dtype=torch.long))
            model(torch.zeros(1, 1, dtype=torch.long))
        with torch.no_grad():
            router.e_score_correction_bias.copy_(torch.tensor([3.0, 0.0, 0.0, 2.0]))
        with counter.step():  # {0, 3}
            model(torch.zeros(1, 1, dtype=torch.long))
        assert counter.steps == 3
        assert counter.mean_distinct() == {"layers.0.mixer": 2.0}
        with counter.step():  # a step of two forwards choosing different experts: {0, 3} + {1, 2} = 4
            model(torch.zeros(1, 1, dtype=torch.long))
            with torch.no_grad():
                router.e_score_correction_bias.copy_(torch.tensor([0.0, 3.0, 2.0, 0.0]))
            model(torch.zeros(1, 1, dtype=torch.long))
        assert counter.mean_distinct() == {"layers.0.mixer": (2 + 2 + 2 + 4) / 4}
    assert not ROUTING_OBSERVERS  # removed on exit
