"""GPU checks of SSM replay through FlashInfer's checkpointing_ssu (kernels/mamba2/flashinfer_replay.py).

Run on the device machine (``-m gpu``); skips without CUDA or without flashinfer.mamba.checkpointing_ssu.
- the kernel against its contract's PyTorch reference over a run of verifies (random acceptance, flushes,
  ring_start turning, a PAD row on the scratch slot), bf16 inputs, float32 and bfloat16 state, at Super V3's
  Mamba2 head sizes (head_dim 64, d_state 128, 8 heads per group): outputs, committed states and rings;
- the engine: ssm_backend=flashinfer with ssm_replay runs FlashInfer (engine.ssm_backend, ssm_kernels), bf16
  activations (its kernel takes no float32 ones) and a float32 state, per-step and checkpointing, with CUDA
  graphs and without (graph == eager token for token), slots reused across 12 requests over 5 slots; it and
  our Triton replay part from rewind only with tokens near the float32 model's top (tests/near_ties.py).
Tolerances: bf16 inputs, fp32 accumulation in both; outputs within 2e-2 of the largest |reference| output
(FlashInfer multiplies bf16 tensor-core fragments), states within 2e-2 (fp32) / 4e-2 (bf16: one rounding).
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint

from kernels.commit import replay_advance_ref
from kernels.mamba2.flashinfer_replay import (
    RingHistory,
    replay_verify_flashinfer,
    replay_verify_flashinfer_ref,
    ring_advance,
)
from runners.engine import Engine
from runners.engine.options import EngineOptions

pytestmark = [pytest.mark.gpu]


def _need_flashinfer():
    fim = pytest.importorskip("flashinfer.mamba")
    if not hasattr(fim, "checkpointing_ssu"):
        pytest.skip("this FlashInfer has no checkpointing_ssu")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [4, 16])
def test_flashinfer_replay_kernel_equals_its_contract(state_dtype, window):
    """The operands as the engine passes them (x, B, C strided views of one conv output, raw dt, D and
    dt_bias in bf16, int64 slot ids), so this builds and checks the JIT module the engine runs."""
    _need_flashinfer()
    torch.manual_seed(0)
    dev, S, H, P, G, N, T = "cuda", 6, 16, 64, 2, 128, 4
    bf = torch.bfloat16
    A = -torch.rand(H, device=dev) - 0.5
    D, dt_bias = torch.randn(H, device=dev).to(bf), (torch.rand(H, device=dev) - 0.5).to(bf)
    state = (torch.randn(S, H, P, N, device=dev) * 0.5).to(state_dtype)
    ring = RingHistory(*(torch.zeros(shape, dtype=dt, device=dev) for shape, dt in
                         RingHistory.shapes(S, window, T, H, P, G, N, dtype=torch.bfloat16).values()))
    ref_state = state.clone()
    ref_ring = RingHistory(*(t.clone() for t in (ring.x_cache, ring.B_cache, ring.dt_cache)))
    pnat = torch.zeros(S, dtype=torch.int32, device=dev)
    ring_start = torch.zeros(S, dtype=torch.int32, device=dev)
    for step in range(12):
        slots = torch.tensor([0, 3, 1, S - 1] if step % 2 else [2, 4, S - 1, 0], device=dev)  # S-1: PAD's row
        b = slots.shape[0]
        xBC = torch.cat([torch.randn(b, T, H * P, device=dev), torch.randn(b, T, 2 * G * N, device=dev)
                         / N ** 0.5], dim=-1).to(bf)
        x, B, C = xBC.split([H * P, G * N, G * N], dim=-1)
        x, B, C = x.reshape(b, T, H, P), B.reshape(b, T, G, N), C.reshape(b, T, G, N)
        dt = (torch.randn(b, T, H, device=dev) * 0.5 - 1).to(bf)
        args = (x, dt, A, B, C, D, dt_bias, slots)
        got = replay_verify_flashinfer(state, *args, ring, ring_start, pnat)
        want = replay_verify_flashinfer_ref(ref_state, *args, ref_ring, ring_start, pnat)
        live = slots != S - 1
        scale = want[live].float().abs().max()
        assert (got[live].float() - want[live].float()).abs().max() <= 2e-2 * scale, step
        stol = (2e-2 if state_dtype == torch.float32 else 4e-2) * ref_state.float().abs().max()
        assert (state[:S - 1].float() - ref_state[:S - 1].float()).abs().max() <= stol, step
        for a, r in zip((ring.x_cache, ring.B_cache, ring.dt_cache),
                        (ref_ring.x_cache, ref_ring.B_cache, ref_ring.dt_cache)):
            torch.testing.assert_close(a[:S - 1].float(), r[:S - 1].float(), rtol=1e-2, atol=1e-3)
        ids = torch.where(live, slots, -1)
        accepted = torch.randint(1, T + 1, (b,), device=dev)
        ring_advance(ring_start, pnat, ids, T, window, ring.ring_len)
        replay_advance_ref(pnat, torch.zeros_like(pnat), ids, accepted, T,
                           hist_len=window if window > T else None)
    assert int(ring_start.max()) > 0


def test_flashinfer_replay_stochastic_rounding_of_a_float16_state():
    """FlashInfer's rand_seed path (StochasticRounding.device_key) at Super V3's head
    sizes, every row flushing: each stored value is one of the two float16 neighbours of the float32
    checkpoint (the reference in float32), some not the nearest; over 64 steps of the rounding counter the
    mean of the stored values is closer to the exact value than round-to-nearest's error on average (SR is
    unbiased), and a step replayed with the same counter gives the same bits."""
    _need_flashinfer()
    from kernels.rounding import StochasticRounding

    torch.manual_seed(0)
    dev, S, H, P, G, N, T, W = "cuda", 4, 16, 64, 2, 128, 4, 16
    A = -torch.rand(H, device=dev) - 0.5
    D, dt_bias = torch.randn(H, device=dev), torch.rand(H, device=dev) - 0.5
    ring = RingHistory(*(torch.randn(shape, device=dev).mul(0.5).to(dt) for shape, dt in
                         RingHistory.shapes(S, W, T, H, P, G, N, dtype=torch.bfloat16).values()))
    ring.dt_cache.abs_().mul_(0.1)
    state0 = (torch.randn(S, H, P, N, device=dev) * 0.5).to(torch.float16)
    x = torch.randn(2, T, H, P, device=dev).to(torch.bfloat16)
    B = (torch.randn(2, T, G, N, device=dev) / N ** 0.5).to(torch.bfloat16)
    C = (torch.randn(2, T, G, N, device=dev) / N ** 0.5).to(torch.bfloat16)
    dt = torch.randn(2, T, H, device=dev) * 0.5 - 1
    slots = torch.tensor([0, 2], device=dev)
    ring_start = torch.zeros(S, dtype=torch.int32, device=dev)
    pnat = torch.full((S,), W, dtype=torch.int32, device=dev)  # k + T > W: both rows flush
    args = (x, dt, A, B, C, D, dt_bias, slots)

    def run(state, rounding=None, fn=replay_verify_flashinfer):
        copy = RingHistory(*(t.clone() for t in (ring.x_cache, ring.B_cache, ring.dt_cache)))
        fn(state, *args, copy, ring_start, pnat, rounding=rounding)
        return state[slots]

    exact = run(state0.float().clone(), fn=replay_verify_flashinfer_ref).float()
    nearest = run(state0.clone()).float()
    rounding = StochasticRounding.create(11, device=dev).for_layer(3)
    draws = []
    for _ in range(64):
        draws.append(run(state0.clone(), rounding).float())
        rounding.advance()
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs())).clamp(min=-14) - 10)
    # within a neighbour of the float32 checkpoint, FlashInfer's own arithmetic allowed for: it multiplies
    # 16-bit tensor-core operands (its decay-scaled B among them), an error of the largest value's size
    allowance = 2e-3 * exact.abs().max()
    assert all(((d - exact).abs() <= ulp + allowance).all() for d in draws)
    assert any(not torch.equal(d, nearest) for d in draws)
    mean = torch.stack(draws).mean(0)
    assert (mean - exact).abs().mean() < (nearest - exact).abs().mean()
    rounding.step.sub_(1)
    assert torch.equal(run(state0.clone(), rounding).float(), draws[-1])  # the same counter, the same bits


@pytest.mark.parametrize("checkpointing", [False, True])
def test_flashinfer_replay_engine_parts_from_rewind_only_at_near_ties(tmp_path, checkpointing):
    """bf16 activations (FlashInfer's kernel takes 16-bit operands; a float32 run falls back to ours:
    tests/test_replay_engine.py) with a float32 state, slots reused across 12 requests over 5 slots (PAD rows
    in every short batch): FlashInfer's replay runs (ssm_kernels), graph == eager token for token (the same
    kernels on the same inputs), and FlashInfer's replay and our Triton replay part from rewind only with a
    token near the float32 model's top (tests/near_ties.py: at bf16 the three round in other places, so
    exact tokens are a float32 property; a bookkeeping error parts at any gap). Where a run's
    tokens all equal rewind's, so do its acceptance counters."""
    from near_ties import assert_parts_only_at_near_ties

    _need_flashinfer()
    # FlashInfer builds at head_dim 64 / d_state 128 with power-of-two heads per group (4 heads / 2 groups)
    path = write_checkpoint(tmp_path, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM", mamba_head_dim=64,
                                                    ssm_state_size=128, mamba_num_heads=4), with_mtp=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (12,))]
    outs = {}
    for name, backend, replay, graphs in (("rewind", "triton", False, True), ("triton", "triton", True, True),
                                          ("flashinfer", "flashinfer", True, True),
                                          ("flashinfer_eager", "flashinfer", True, False)):
        options = EngineOptions(draft_len=3, ssm_replay=replay, ssm_backend=backend, max_batch_size=5,
                                max_seq_len=96, cuda_graphs=graphs, dtype="bfloat16",
                                ssm_state_dtype="float32",
                                ssm_replay_checkpointing=checkpointing and replay)
        engine = Engine.from_pretrained(path, options, device="cuda")
        assert engine.ssm_backend == backend, name
        if backend == "flashinfer":
            kernels = engine.runner.ssm_kernels
            assert kernels["mamba2"] == "flashinfer checkpointing_ssu" and kernels["flashinfer_probe_s"] >= 0
        outs[name] = engine.generate(prompts, 30, stop_token_ids=[])
    # graph == eager: the same kernels on the same inputs
    assert outs["flashinfer"].tokens == outs["flashinfer_eager"].tokens
    want = outs["rewind"]
    # the reference: the checkpoint's float32 on the CPU (the path tests/near_ties.py was measured on)
    model = Engine.from_pretrained(path, EngineOptions(draft_len=0, max_batch_size=1, max_seq_len=96),
                                   device="cpu").model
    for name in ("triton", "flashinfer"):
        out = outs[name]
        assert_parts_only_at_near_ties(model, prompts, out.tokens, want.tokens, name)
        if out.tokens == want.tokens:
            assert (out.stats.accepted_drafts, out.stats.num_accepted_hist) == \
                (want.stats.accepted_drafts, want.stats.num_accepted_hist), name
