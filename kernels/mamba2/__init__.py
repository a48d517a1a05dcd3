"""Mamba2 (NemotronH mixer) recurrent-state operators: one file per operator, each with its Triton kernel,
launcher and plain-PyTorch reference (`*_ref`, same signature and effects).

- `chunk`: `mamba_chunk_scan_combined` (prefill: the chunked SSD scan on the slot-indexed state cache) and its
  reference `mamba_chunk_scan_combined_ref`, built on `ssd_chunked_scan` (the chunked math on gathered states);
- `recurrent`: `selective_state_update` (decode T = 1, rewind verify T = K + 1) and the token-by-token
  `ssm_recurrent_scan` its reference runs;
- `replay`: `replay_verify` and the history it reads and writes, `ReplayHistory`;
- `conv`: `causal_conv_step` (the conv + SiLU of a decode / verify step, windows read and written in the
  cache) and its reference `causal_conv_step_ref`.
The commit after acceptance (`rewind_commit`, `replay_advance`, `allocate_replay_slots`) is the same for every
family: `kernels.commit`.
"""

from kernels.mamba2.chunk import (
    ChunkScanTiles,
    mamba_chunk_scan_combined,
    mamba_chunk_scan_combined_ref,
    ssd_chunked_scan,
)
from kernels.mamba2.conv import causal_conv_step, causal_conv_step_ref
from kernels.mamba2.recurrent import selective_state_update, selective_state_update_ref, ssm_recurrent_scan
from kernels.mamba2.replay import ReplayHistory, replay_verify, replay_verify_ref

__all__ = [
    "ChunkScanTiles",
    "ReplayHistory",
    "causal_conv_step",
    "causal_conv_step_ref",
    "mamba_chunk_scan_combined",
    "mamba_chunk_scan_combined_ref",
    "replay_verify",
    "replay_verify_ref",
    "selective_state_update",
    "selective_state_update_ref",
    "ssd_chunked_scan",
    "ssm_recurrent_scan",
]
