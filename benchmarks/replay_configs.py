"""The kernel configurations of the replay kernels that the benchmarks time and compile: name -> keyword
arguments of the launcher (kernels.mamba2.replay_verify, kernels.gdn.replay_verify).

One list for the two programs that go through every variant: benchmarks.sweep_replay times them against the
memory-bandwidth floor, benchmarks.compile_report reports their sm_90 registers and instruction counts. Its own
module so that neither imports the other (sweep_replay reaches compile_report through bench_mamba2).
"""

from __future__ import annotations

M2_CONFIGS = {
    "fma": {"variant": "fma"},
    "fma_p8": {"variant": "fma", "block_p": 8},
    "mma": {"variant": "mma"},
    "mma_c16": {"variant": "mma", "chunk_n": 16},
    "mma_c64": {"variant": "mma", "chunk_n": 64},
    "mma_st3": {"variant": "mma", "num_stages": 3},
    "mma_p32w2": {"variant": "mma", "block_p": 32, "num_warps": 2},
    "mma_p64w4": {"variant": "mma", "block_p": 64, "num_warps": 4},
    "mma_split3": {"variant": "mma", "split": 3},
    "mma_pre": {"variant": "mma_pre"},
    "mma_pre_p32w2": {"variant": "mma_pre", "block_p": 32, "num_warps": 2},
    # issue 28, FlashInfer checkpointing_ssu's launch features (docs/kernel_performance.md, "Ahead of
    # FlashInfer"): programmatic dependent launch ("mma_pre_pdl") and register caps ("_r<maxnreg>": 80 = 6
    # resident warps per SM sub-partition instead of 4 at 104-128 registers; checkpointing_ssu caps at 80),
    # chunk 16 where the cap spills least in the sm_90 compile report (0-16 bytes at 80), "mma_pre_c16" the
    # uncapped control
    "mma_pre_pdl": {"variant": "mma_pre_pdl"},
    "mma_pre_pdl_c16_r80": {"variant": "mma_pre_pdl", "chunk_n": 16, "maxnreg": 80},
    "mma_pre_c16": {"variant": "mma_pre", "chunk_n": 16},
    "mma_pre_c16_r80": {"variant": "mma_pre", "chunk_n": 16, "maxnreg": 80},
    "mma_pre_r96": {"variant": "mma_pre", "maxnreg": 96},
    "mma_c16_r80": {"variant": "mma", "chunk_n": 16, "maxnreg": 80},
    # persistent grid-stride loop over the (P block, row, head) units, head fastest: about as many programs
    # per SM as stay resident (12 at 130-160 registers, 24 at 80; docs/kernel_performance.md)
    "mma_c16_pers12": {"variant": "mma", "chunk_n": 16, "persistent": 12},
    "mma_pre_pdl_c16_r80_pers24": {"variant": "mma_pre_pdl", "chunk_n": 16, "maxnreg": 80, "persistent": 24},
    # issue 28, the CUDA route: kernels/mamba2/replay_cuda.py (one 128-thread CTA per head, state staged in shared
    # memory; checkpointing histories only), uncapped (128 registers at the Super V3 shape, 4 CTAs per SM) and
    # capped at 96 (__maxnreg__; 5 CTAs per SM with a bf16 state, whose 36 KB of shared memory allow 6, ~24
    # bytes of spills in the sm_90 build; an fp32 state's 52 KB keep 4)
    "cuda": {"variant": "cuda"},
    "cuda_r96": {"variant": "cuda", "maxnreg": 96},
}
# The configurations that run on a checkpointing history only: the sweep times them on m2_ckpt / m2_flush and
# never on the per-step operators (benchmarks.sweep_replay._configs).
M2_CKPT_ONLY_CONFIGS = ("cuda", "cuda_r96")
# The configurations added for issue 28 that no sweep has timed yet: benchmarks.sweep_replay runs them in
# --quick and never lets its time budget skip them at the headline.
M2_ISSUE28_CONFIGS = ("mma_pre_pdl", "mma_pre_pdl_c16_r80", "mma_pre_c16", "mma_pre_c16_r80", "mma_pre_r96",
                      "mma_c16_r80", "mma_c16_pers12", "mma_pre_pdl_c16_r80_pers24", "cuda", "cuda_r96")
GDN_CONFIGS = {
    "fma": {"variant": "fma"},
    "fma_bv8": {"variant": "fma", "block_v": 8},
    "mma": {"variant": "mma"},
    "mma_c16": {"variant": "mma", "chunk_k": 16},
    "mma_st3": {"variant": "mma", "num_stages": 3},
    "mma_bv32w2": {"variant": "mma", "block_v": 32, "num_warps": 2, "chunk_k": 16},
    "mma_bv64w4": {"variant": "mma", "block_v": 64, "num_warps": 4, "chunk_k": 16},
    "mma_split3": {"variant": "mma", "split": 3},
}
