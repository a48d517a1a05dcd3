"""Gated DeltaNet (Qwen3-Next linear attention) recurrent-state operators: one file per operator, each with its
Triton kernel, launcher and plain-PyTorch reference (`*_ref`, same signature and effects), as
flash-linear-attention's fla/ops/gated_delta_rule/.

- `chunk`: `chunk_gated_delta_rule`, the chunked (WY / UT-transform) form (prefill: fla-core's Triton kernels
  through the adapter `fla` on CUDA) and its reference `chunk_gated_delta_rule_ref`;
- `recurrent`: `fused_recurrent_gated_delta_rule` (decode T = 1, rewind verify T = K + 1) and the
  token-by-token `recurrent_gated_delta_rule` its reference runs;
- `replay`: `replay_verify` and the history it reads and writes, `ReplayHistory`;
- `_common`: input checks, `l2norm` and the batched rules' input preparation.
The commit after acceptance (`rewind_commit`, `replay_advance`, `allocate_replay_slots`) is the same for every
family: `kernels.commit`.
"""

from kernels.gdn._common import l2norm
from kernels.gdn.chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_ref
from kernels.gdn.recurrent import (
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_ref,
    recurrent_gated_delta_rule,
)
from kernels.gdn.replay import ReplayHistory, replay_verify, replay_verify_ref

__all__ = [
    "ReplayHistory",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_ref",
    "l2norm",
    "recurrent_gated_delta_rule",
    "replay_verify",
    "replay_verify_ref",
]
