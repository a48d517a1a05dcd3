"""The "cuda" variant of the Mamba2 checkpointing replay verify (kernels/mamba2/replay_cuda.py) on a GPU.

Every test here is `gpu` (skipped without CUDA): the kernel is built with nvcc at first use, so the first test
takes a few seconds per (state dtype, input dtype, d_state class). They hold the CUDA kernel to the PyTorch
reference `replay_verify_ref`, to the Triton "fma" variant and to the token-by-token oracle of
tests/replay_oracles.py: the Super V3 shape (batch 64, T = 4, 128 heads x 64 x 128, 8 groups, L = 16) and
small shapes that reach the other thread layouts (d_state 48 -> 1 thread per row, 256 -> 4 threads per row and
several CTAs per head) and a head_dim that is not a multiple of the CTA's rows; fp32 and bf16 states, with and
without flushes, PAD rows, garbage PNAT and buffer_index, back-to-back steps with `replay_advance`. CUDA-graph
capture with poisoned buffers (bitwise equal to eager) is the shared test of every variant,
tests/test_kernels_mamba2_gpu.py::test_gpu_cuda_graph_replay_verify_matches_eager_bitwise.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # keep the interpreter setting consistent with the other kernel tests
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from replay_oracles import (  # noqa: E402
    mamba2_checkpointing_case,
    mamba2_materialized_state,
    mamba2_replay_verify_oracle,
)

from kernels.commit import allocate_replay_slots, replay_advance  # noqa: E402
from kernels.mamba2 import ReplayHistory, replay_cuda, replay_verify, replay_verify_ref  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_memory(6)]  # Super V3 shape: 4.1 GiB at the peak

# Kernel vs reference: all state math is fp32 FMAs (~1e-6 relative); bf16 outputs / states: 1.6e-2 = 4 ulps
TOL = {torch.float32: 1e-3, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# (batch, T, H, P, N, G, L): Super V3 ws1; N 48 (TPR 1, masked d_state chunks), P 40 (masked rows); N 256
# (TPR 4: 32 rows per CTA, 4 CTAs per head of 128) with T 8 and L 12 (pending tokens in two staged chunks)
SHAPES = {
    "super_v3": (64, 4, 128, 64, 128, 8, 16),
    "small_n48_p40": (6, 3, 4, 40, 48, 2, 8),
    "n256_p128_t8": (5, 8, 4, 128, 256, 1, 12),
}


def close(a, b, tol, what):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def make_case(shape, state_dtype, in_dtype=torch.bfloat16, seed=0, slots_extra=7):
    """tests/replay_oracles.py's checkpointing case on the GPU, as a dict of replay_verify's arguments."""
    c = mamba2_checkpointing_case(shape, state_dtype, in_dtype, seed, slots_extra)
    hist = ReplayHistory(*(t.cuda() for t in (c[9].x, c[9].B, c[9].dt, c[9].dA_cumsum)))
    names = ("state", "x", "dt", "A", "B", "C", "D", "dt_bias", "slot_ids", "history", "pnat", "bufidx")
    return {n: hist if n == "history" else t.cuda() for n, t in zip(names, c)}


def run(fn, case, out_dtype=None, **kw):
    """One verify on clones of the case's state and history: (state, history, out). A case with
    "state_layers" runs on view [:, 1] of a clone of it (clone() of a strided view would be contiguous)."""
    st = case["state_layers"].clone()[:, 1] if "state_layers" in case else case["state"].clone()
    h = ReplayHistory(*(t.clone() for t in (case["history"].x, case["history"].B, case["history"].dt,
                                            case["history"].dA_cumsum)))
    x = case["x"]
    out = torch.full(x.shape, float("nan"), device="cuda", dtype=out_dtype or x.dtype)
    fn(st, x, case["dt"], case["A"], case["B"], case["C"], case.get("D"), case["dt_bias"], case["slot_ids"],
       h, case["pnat"], case["bufidx"], out=out, **kw)
    torch.cuda.synchronize()
    return st, h, out


def compare(a, b, state_dtype, in_dtype, what):
    (st_a, h_a, out_a), (st_b, h_b, out_b) = a, b
    tol = max(TOL[state_dtype], TOL[in_dtype])
    close(out_a, out_b, tol, f"{what}: out")
    close(st_a, st_b, TOL[state_dtype], f"{what}: state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        close(getattr(h_a, f), getattr(h_b, f), TOL[torch.float32], f"{what}: history.{f}")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference_fma_and_oracle(shape, state_dtype):
    """CUDA kernel vs replay_verify_ref, the Triton "fma" variant and the token-by-token oracle; the state
    written exactly on the flushed live slots; PAD rows zero; nothing outside the batch touched."""
    case = make_case(SHAPES[shape], state_dtype)
    Bsz, T, H, P, N, G, L = SHAPES[shape]
    got = run(replay_verify, case, variant="cuda")
    compare(got, run(replay_verify_ref, case), state_dtype, torch.bfloat16, "cuda vs reference")
    compare(got, run(replay_verify, case, variant="fma"), state_dtype, torch.bfloat16, "cuda vs fma")
    compare(got, run(mamba2_replay_verify_oracle, case), state_dtype, torch.bfloat16, "cuda vs oracle")
    st, h, out = got
    slot_ids, state0, pnat = case["slot_ids"], case["state"], case["pnat"]
    live = slot_ids[slot_ids >= 0].long()
    k = pnat[live].clamp(0, L)
    flushed = live[(k + T > L) & (k > 0)]
    kept = live[k + T <= L]
    assert flushed.numel() and kept.numel(), "the case must have rows with and without a flush"
    assert not torch.equal(st[flushed], state0[flushed]), "a flush must write the state"
    assert torch.equal(st[kept], state0[kept]), "the state was written without a flush"
    assert (out[slot_ids < 0] == 0).all() and not torch.isnan(out).any()
    others = torch.ones(state0.shape[0], dtype=torch.bool, device="cuda")
    others[live] = False  # slots outside the batch (PAD rows name none): untouched bitwise
    assert torch.equal(st[others], state0[others])
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert torch.equal(getattr(h, f)[others], getattr(case["history"], f)[others]), f"history.{f}"
    # the replayed state of the flushed slots equals the materialised one (pending tokens one at a time)
    mat = mamba2_materialized_state(state0, case["history"], pnat, case["bufidx"], case["A"])
    close(st[flushed], mat[flushed], TOL[state_dtype], "flushed state vs materialised")


@pytest.mark.parametrize("variant_kw", [{"variant": "cuda"}, {"variant": "cuda", "maxnreg": 96}],
                         ids=["uncapped", "r96"])
def test_cuda_options_time_step_limit_no_d_fp16_strided_state(variant_kw):
    """The paths the headline does not take: a time-step clamp, D = None, fp16 inputs / outputs (fp32 state),
    a per-layer view of the state cache (slot stride over two layers), int64 slot ids, the register cap."""
    shape = SHAPES["small_n48_p40"]
    case = make_case(shape, torch.float32, in_dtype=torch.float16, seed=3)
    case["D"] = None
    case["slot_ids"] = case["slot_ids"].long()
    S, H, P, N = case["state"].shape
    layers = torch.randn(S, 2, H, P, N, device="cuda")
    layers[:, 1] = case["state"]
    case["state_layers"] = layers  # the state is layers[:, 1]: strides (2HPN, HPN, N, 1)
    kw = dict(time_step_limit=(0.05, 0.4))
    got = run(replay_verify, case, **variant_kw, **kw)
    assert not got[0].is_contiguous()  # the kernel ran on the strided view
    compare(got, run(replay_verify_ref, case, **kw), torch.float32, torch.float16, "cuda vs reference")
    compare(got, run(replay_verify, case, variant="fma", **kw), torch.float32, torch.float16, "cuda vs fma")


def _steps(shape, n, seed):
    Bsz, T, H, P, N, G, L = shape
    res = []
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        c = make_case(shape, torch.float32, seed=seed + i)
        nat = torch.randint(0, T + 1, (Bsz,), generator=g, dtype=torch.int32).cuda()
        res.append(((c["x"], c["dt"], c["B"], c["C"]), c["slot_ids"], nat))
    return res


@pytest.mark.parametrize("shape", ["super_v3", "n256_p128_t8"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cuda_back_to_back_steps_with_replay_advance(shape, state_dtype):
    """Eight verify + replay_advance steps (reordered slots, PAD rows, 0..T accepted: the pending window fills
    over several verifies, then flushes) for the CUDA kernel and the reference side by side: every step's
    output, and at the end the state, history and the materialised state agree."""
    Bsz, T, H, P, N, G, L = SHAPES[shape]
    base = make_case(SHAPES[shape], state_dtype, seed=11)
    steps = _steps(SHAPES[shape], 8, seed=100)
    runs = []
    for fn, kw in ((replay_verify, {"variant": "cuda"}), (replay_verify_ref, {})):
        st = base["state"].clone()
        hist = ReplayHistory.allocate(st.shape[0], L, H, P, G, N, dtype=torch.bfloat16, device="cuda",
                                      checkpointing=True)
        pnat, bufidx = allocate_replay_slots(st.shape[0], device="cuda")
        outs = []
        for (x, dt, B, C), slot_ids, nat in steps:
            outs.append(fn(st, x, dt, base["A"], B, C, base["D"], base["dt_bias"], slot_ids, hist, pnat,
                           bufidx, **kw))
            replay_advance(pnat, bufidx, slot_ids, nat, T, hist_len=L)
        torch.cuda.synchronize()
        runs.append((st, hist, outs, pnat, bufidx))
    (st_k, h_k, outs_k, pnat_k, bi_k), (st_r, h_r, outs_r, pnat_r, bi_r) = runs
    tol = max(TOL[state_dtype], TOL[torch.bfloat16])
    for i, (a, b) in enumerate(zip(outs_k, outs_r)):
        close(a, b, tol, f"out of step {i}")
    assert torch.equal(pnat_k, pnat_r) and torch.equal(bi_k, bi_r)
    assert int(pnat_k.max()) > T, "the steps must leave pending tokens from several verifies"
    close(st_k, st_r, TOL[state_dtype], "state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        close(getattr(h_k, f), getattr(h_r, f), TOL[torch.float32], f"history.{f}")
    close(mamba2_materialized_state(st_k, h_k, pnat_k, bi_k, base["A"]),
          mamba2_materialized_state(st_r, h_r, pnat_r, bi_r, base["A"]), tol, "materialised state")


def test_cuda_launch_configuration_at_super_v3():
    """The launch the docs and the sweep describe: one 128-thread CTA per (row, head) at the Super V3 shape,
    the library's shared-memory size equal to the Python mirror."""
    Bsz, T, H, P, N, G, L = SHAPES["super_v3"]
    assert replay_cuda.launch_config(Bsz, H, P, N) == {"ctas": Bsz * H, "threads": 128, "rows_per_cta": 64,
                                                       "threads_per_row": 2}
    dev = torch.device("cuda")
    for sd in (torch.float32, torch.bfloat16):
        flags = replay_cuda.build_flags(replay_cuda.arch_of(dev), sd, torch.bfloat16, N)
        lib = replay_cuda.load(str(replay_cuda.build(flags)))
        assert lib.m2r_smem_bytes(T, L) == replay_cuda.smem_bytes(T, L, N, sd)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cuda_engine_layout_split_views_fp32_out(state_dtype):
    """The engine's call (runners/engine/models/mamba2.py): x, B, C split views of one xBC projection, dt a
    view of the in_proj output, a float32 `out` for bf16 inputs, at the Super V3 shape; vs the reference."""
    Bsz, T, H, P, N, G, L = SHAPES["super_v3"]
    case = make_case(SHAPES["super_v3"], state_dtype, seed=31)
    xBC = torch.cat([case["x"].reshape(Bsz, T, H * P), case["B"].reshape(Bsz, T, G * N),
                     case["C"].reshape(Bsz, T, G * N)], dim=-1)
    x, Bm, Cm = xBC.split([H * P, G * N, G * N], dim=-1)
    case["x"], case["B"] = x.reshape(Bsz, T, H, P), Bm.reshape(Bsz, T, G, N)
    case["C"] = Cm.reshape(Bsz, T, G, N)
    zdt = torch.cat([torch.randn(Bsz, T, 16, device="cuda", dtype=torch.bfloat16), case["dt"]], dim=-1)
    case["dt"] = zdt[..., 16:]
    assert not case["x"].is_contiguous() and not case["dt"].is_contiguous()
    got = run(replay_verify, case, out_dtype=torch.float32, variant="cuda")
    assert got[2].dtype == torch.float32
    compare(got, run(replay_verify_ref, case, out_dtype=torch.float32), state_dtype, torch.bfloat16,
            "cuda vs reference")


def test_table_row_naming_cuda_falls_back_where_it_cannot_run(tmp_path, monkeypatch):
    """A defaults-table row naming "cuda" (what a future sweep may write): the launch without `variant=` runs
    the CUDA kernel (bitwise equal to variant="cuda"), and with stochastic rounding, which the CUDA kernel
    does not take, the fallback "fma" (bitwise equal to variant="fma")."""
    import json

    from kernels import replay_defaults
    from kernels.rounding import StochasticRounding

    Bsz, T, H, P, N, G, L = SHAPES["super_v3"]
    case = make_case(SHAPES["super_v3"], torch.bfloat16, seed=41)
    shape = replay_defaults.mamba2_shape_class(H, P, N)
    row = {"config": "cuda", "kwargs": {"variant": "cuda"}, "evidence": {}}
    rows = {replay_defaults.key("mamba2_checkpointing", "bfloat16", shape, Bsz): row}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"schema": replay_defaults.SCHEMA, "provenance": {}, "rows": rows}))
    monkeypatch.setattr(replay_defaults, "TABLE_PATH", str(path))
    def same(a, b):
        (st_a, h_a, out_a), (st_b, h_b, out_b) = a, b
        return torch.equal(st_a, st_b) and torch.equal(out_a, out_b) and all(
            torch.equal(getattr(h_a, f), getattr(h_b, f)) for f in ("x", "B", "dt", "dA_cumsum"))

    assert same(run(replay_verify, case), run(replay_verify, case, variant="cuda"))
    sr = StochasticRounding.create(7, device="cuda")
    assert same(run(replay_verify, case, stochastic_rounding=sr),
                run(replay_verify, case, variant="fma", stochastic_rounding=sr))
