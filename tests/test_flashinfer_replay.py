"""FlashInfer's checkpointing_ssu contract (kernels/mamba2/flashinfer_replay.py) against the project's replay.

CPU, the references only (FlashInfer's kernel is compared with its reference in
tests/test_flashinfer_replay_gpu.py):
- over a run of verify steps with random acceptance, the FlashInfer-layout reference (ring history, ring_start
  moved by ``ring_advance``) gives the outputs of our replay reference (``kernels.mamba2.replay_verify_ref``,
  double-buffered window) at every step and the same committed states, in the checkpointing window (W = 16,
  flushes every few steps) and the per-step one (W = T), with a bfloat16 state too; PAD rows change nothing
  and read zeros; slot 0 is live; slots are reused (reset) mid-run;
- ring_advance moves only flushed live rows, by their pending count, modulo the ring;
- the refusals: a window over 16, T over the window, a dt clamp.
Tolerance: float32 state 1e-5 of the largest output (the two compute the same sums in another order: closed
form vs token by token); bfloat16 state 2e-2 (a flushed state is rounded once in both).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from kernels.commit import allocate_replay_slots, replay_advance_ref
from kernels.mamba2 import ReplayHistory, replay_verify_ref
from kernels.mamba2.flashinfer_replay import (
    MAX_WINDOW,
    RingHistory,
    flashinfer_replay_unsupported,
    replay_verify_flashinfer_ref,
    ring_advance,
)

REPO = Path(__file__).resolve().parents[1]


def _ring(S, W, T, H, P, G, N, dtype):
    return RingHistory(**{k: torch.zeros(shape, dtype=dt)
                          for k, (shape, dt) in RingHistory.shapes(S, W, T, H, P, G, N, dtype=dtype).items()})


@pytest.mark.parametrize("window, state_dtype", [(16, torch.float32), (4, torch.float32),
                                                 (16, torch.bfloat16)])
def test_the_ring_contract_tracks_our_replay_step_by_step(window, state_dtype):
    torch.manual_seed(window)
    S, H, P, G, N, T = 5, 4, 3, 2, 5, 4
    checkpointing = window > T  # W = T is the per-step replay
    A = -torch.rand(H) - 0.5
    D, dt_bias = torch.randn(H), torch.rand(H) - 0.5
    init = torch.randn(S, H, P, N).to(state_dtype)
    ours_state, fi_state = init.clone(), init.clone()
    hist = ReplayHistory.allocate(S, window, H, P, G, N, dtype=torch.float32, device="cpu",
                                  checkpointing=checkpointing)
    ring = _ring(S, window, T, H, P, G, N, torch.float32)
    pnat_a, bufidx = allocate_replay_slots(S, device="cpu")
    pnat_b, _ = allocate_replay_slots(S, device="cpu")
    ring_start = torch.zeros(S, dtype=torch.int32)
    hist_len = window if checkpointing else None
    flushes = 0
    for step in range(14):
        slot_ids = torch.tensor([3, 0, -1, 1] if step % 3 else [0, -1, 4, 2])
        if step == 7:  # slot 0 starts a new request: its prefill wrote the state, nothing pending
            for t in (pnat_a, pnat_b, bufidx, ring_start):
                t[0] = 0
            ours_state[0] = fi_state[0] = torch.randn(H, P, N).to(state_dtype)
        b = slot_ids.shape[0]
        x, C, B = torch.randn(b, T, H, P), torch.randn(b, T, G, N), torch.randn(b, T, G, N)
        dt = torch.randn(b, T, H)
        k = pnat_b[slot_ids.clamp(min=0)].clamp(0, window)
        flushes += int(((k + T > window) & (slot_ids >= 0)).sum())
        want = replay_verify_ref(ours_state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat_a, bufidx)
        got = replay_verify_flashinfer_ref(fi_state, x, dt, A, B, C, D, dt_bias, slot_ids, ring, ring_start,
                                           pnat_b)
        tol = (1e-5 if state_dtype == torch.float32 else 2e-2) * want.abs().max()
        assert (got - want).abs().max() <= tol, step
        assert not got[slot_ids < 0].any()  # PAD rows read zeros
        accepted = torch.randint(1, T + 1, (b,))
        ring_advance(ring_start, pnat_b, slot_ids, T, window, ring.ring_len)
        replay_advance_ref(pnat_a, bufidx, slot_ids, accepted, T, hist_len=hist_len)
        replay_advance_ref(pnat_b, torch.zeros_like(bufidx), slot_ids, accepted, T, hist_len=hist_len)
        assert torch.equal(pnat_a, pnat_b)
        torch.testing.assert_close(fi_state.float(), ours_state.float(), atol=float(tol), rtol=0)
    assert flushes >= 4  # the run crossed the flush rule several times
    assert ring_start.max() > 0 and (ring_start < ring.ring_len).all()


def test_ring_advance_moves_flushed_live_rows_by_their_pending_tokens():
    T, W, R = 4, 16, 20
    ring_start = torch.tensor([18, 5, 7, 0, 9], dtype=torch.int32)
    pnat = torch.tensor([13, 12, 3, 40, 14], dtype=torch.int32)  # 40: garbage, clamped to W
    slot_ids = torch.tensor([0, 1, -1, 3])
    ring_advance(ring_start, pnat, slot_ids, T, W, R)
    # slot 0: 13 + 4 > 16 -> (18 + 13) % 20 = 11; slot 1: 12 + 4 = 16 fits -> 5; slot 2: not in the batch;
    # slot 3: k = 16 -> (0 + 16) % 20; slot 4 (the scratch row the PAD row maps to) unchanged
    assert ring_start.tolist() == [11, 5, 7, 16, 9]


def test_what_flashinfer_cannot_run_is_named():
    assert flashinfer_replay_unsupported(4, 16, (0.0, math.inf)) is None
    assert flashinfer_replay_unsupported(4, 4, None) is None  # the per-step window
    assert "at most 16" in flashinfer_replay_unsupported(4, MAX_WINDOW + 1, None)
    assert "exceeds its window" in flashinfer_replay_unsupported(17, 16, None)
    assert "does not clamp dt" in flashinfer_replay_unsupported(4, 16, (0.0, 0.1))
    assert flashinfer_replay_unsupported(4, 16, None, torch.bfloat16) is None
    assert flashinfer_replay_unsupported(4, 16, None, torch.float16) is None
    assert "computes in float32" in flashinfer_replay_unsupported(4, 16, None, torch.float32)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_engine_on_ring_histories_emits_the_rewind_tokens(tmp_path, monkeypatch, checkpointing):
    """The engine with every Mamba2 replay history in FlashInfer's ring layout (``HybridCache(replay_ring=
    True)``: the contract's reference runs each verify, ``ReplaySlots.advance`` moves ring_start), per-step
    and checkpointing windows, prompts of many lengths over fewer slots than requests: the tokens and the
    acceptance counters of rewind, so the ring's bookkeeping holds through admissions, PAD rows and slot
    reuse. (On the GPU tests/test_flashinfer_replay_gpu.py runs FlashInfer's kernel in its place.)"""
    import functools

    from ckpt_factory import make_hf_model, write_checkpoint

    import runners.engine.runner as runner
    from runners.engine import Engine
    from runners.engine.cache import HybridCache
    from runners.engine.options import EngineOptions

    path = write_checkpoint(tmp_path, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM"), with_mtp=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (10,))]

    def run(replay, ring):
        if ring:
            monkeypatch.setattr(runner, "HybridCache", functools.partial(HybridCache, replay_ring=True))
        options = EngineOptions(draft_len=3, ssm_replay=replay, max_batch_size=4, max_seq_len=80,
                                ssm_replay_checkpointing=checkpointing and replay)
        engine = Engine.from_pretrained(path, options)
        monkeypatch.setattr(runner, "HybridCache", HybridCache)
        out = engine.generate(prompts, 30, stop_token_ids=[])  # enough steps for checkpointing flushes
        slots = engine.runner.cache.replay
        return out, slots

    rewind, _ = run(False, False)
    ring, slots = run(True, True)
    assert slots.ring_start is not None and slots.window == (16 if checkpointing else 4)
    assert int(slots.ring_start.max()) > 0  # the rings turned
    assert ring.tokens == rewind.tokens
    assert (ring.stats.accepted_drafts, ring.stats.num_accepted_hist) == \
        (rewind.stats.accepted_drafts, rewind.stats.num_accepted_hist)


def test_the_probe_says_whether_the_kernel_runs_and_agrees(monkeypatch):
    """probe_flashinfer_replay: a kernel that matches its contract's reference passes (None); one that raises
    (a JIT build failure) or disagrees is named with the reason; each configuration is probed once."""
    from kernels.mamba2 import flashinfer_replay as fr

    calls = []

    def run(*args, **kw):
        calls.append(1)
        return fr.replay_verify_flashinfer_ref(*args, **kw)

    monkeypatch.setattr(fr, "_PROBED", {})
    monkeypatch.setattr(fr, "replay_verify_flashinfer", run)
    args = dict(dtype=torch.float32, state_dtype=torch.float32, device="cpu")
    assert fr.probe_flashinfer_replay(4, 8, 2, 16, 4, 16, **args)[0] is None
    assert fr.probe_flashinfer_replay(4, 8, 2, 16, 4, 16, **args)[0] is None and len(calls) == 1  # remembered

    def fails(*args, **kw):
        raise RuntimeError("static assertion failed\nmore")

    monkeypatch.setattr(fr, "replay_verify_flashinfer", fails)
    why, seconds = fr.probe_flashinfer_replay(4, 8, 2, 16, 4, 8, **args)
    assert why == "FlashInfer's checkpointing_ssu failed at this configuration: RuntimeError: static " \
                  "assertion failed" and seconds >= 0

    def off(*args, **kw):
        return fr.replay_verify_flashinfer_ref(*args, **kw) * 1.5

    monkeypatch.setattr(fr, "replay_verify_flashinfer", off)
    assert "differs from its contract's reference" in fr.probe_flashinfer_replay(4, 8, 2, 16, 4, 4, **args)[0]


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A stand-in ``flashinfer.mamba`` module with a ``checkpointing_ssu`` attribute (CUDA-free: only the
    backend's resolution is tested with it, never a call)."""
    import sys
    from types import ModuleType

    fim = ModuleType("flashinfer.mamba")
    fim.checkpointing_ssu = object()
    package = ModuleType("flashinfer")
    package.mamba = fim
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mamba", fim)
    return fim


def test_resolving_flashinfer_replay_falls_back_with_the_reason(monkeypatch, caplog, fake_flashinfer):
    """ssm_backend=flashinfer with replay on CUDA (a stand-in flashinfer.mamba here): FlashInfer when its
    checkpointing_ssu exists, fits the window and passes the probe; else Triton and a warning naming why.
    results.json's ssm_kernels say which verify ran per layer kind."""
    from types import SimpleNamespace

    import runners.engine.runner as runner

    fim = fake_flashinfer
    cfg = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128,
                          time_step_limit=(0.0, math.inf), gdn_num_value_heads=0)
    probe = {"result": (None, 1.0)}
    monkeypatch.setattr(runner, "probe_flashinfer_replay", lambda *a, **k: probe["result"])
    cuda = torch.device("cuda")
    kw = dict(spec_tokens=4, replay_checkpointing=True, dtype=torch.bfloat16, ssm_state_dtype=torch.float32)
    assert runner.resolve_ssm_backend("flashinfer", cuda, True, cfg, **kw) == "flashinfer"
    assert runner.ssm_kernels("flashinfer", True, cfg) == {"mamba2": "flashinfer checkpointing_ssu"}
    cases = [("probe", "failed at this configuration: RuntimeError: x"),
             ("wide", "its replay window is at most 16 tokens (this run needs 17)"),
             ("clamp", "does not clamp dt"), ("fp32", "takes bfloat16 / float16 activations"),
             ("old", "has no checkpointing_ssu")]
    for case, says in cases:
        failed = "FlashInfer's checkpointing_ssu failed at this configuration: RuntimeError: x"
        probe["result"] = (failed, 1.0) if case == "probe" else (None, 1.0)
        limit = (0.0, 0.1) if case == "clamp" else (0.0, math.inf)
        c = SimpleNamespace(**{**vars(cfg), "time_step_limit": limit})
        if case == "old":
            monkeypatch.delattr(fim, "checkpointing_ssu")
        args = {**kw, "spec_tokens": 17, "replay_checkpointing": False} if case == "wide" else \
            {**kw, "dtype": torch.float32} if case == "fp32" else kw
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert runner.resolve_ssm_backend("flashinfer", cuda, True, c, **args) == "triton", case
        assert "ssm_backend=flashinfer with ssm_replay" in caplog.text and says in caplog.text, case
    qwen = SimpleNamespace(mamba_num_heads=0, gdn_num_value_heads=32)
    assert runner.ssm_kernels("triton", True, qwen) == {"gdn": "triton replay_verify"}
    assert runner.ssm_kernels("torch", False, cfg) == {"mamba2": "torch selective_state_update"}


def test_the_default_backend_is_the_measured_faster_replay_kernel(monkeypatch, caplog, fake_flashinfer):
    """ssm_backend unset (registry ``backend: auto``) on CUDA with replay: FlashInfer where the committed
    table measured its checkpointing_ssu faster at the model's Mamba2 shape and state dtype (Super V3's, in
    the checkpointing variant, and the per-step variant where its row says so) and it probes fine; Triton
    where the table has no such row (another shape), with stochastic rounding, or when the probe fails (a
    warning names why)."""
    from types import SimpleNamespace

    import runners.engine.runner as runner

    probe = {"result": (None, 1.0)}
    monkeypatch.setattr(runner, "probe_flashinfer_replay", lambda *a, **k: probe["result"])
    super_v3 = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128,
                               time_step_limit=(0.0, math.inf), gdn_num_value_heads=0)
    cuda = torch.device("cuda")

    def resolve(cfg=super_v3, checkpointing=True, state=torch.float32, sr=False, replay=True):
        return runner.resolve_ssm_backend(None, cuda, replay, cfg, spec_tokens=4,
                                          replay_checkpointing=checkpointing, dtype=torch.bfloat16,
                                          ssm_state_dtype=state, stochastic_rounding=sr)

    from kernels import replay_defaults

    assert resolve() == "flashinfer" and resolve(state=torch.bfloat16) == "flashinfer"
    # the per-step variant follows its own row of the table (where the sweep timed FlashInfer there too);
    # no row: Triton
    shape = replay_defaults.mamba2_shape_class(128, 64, 128)
    for state in (torch.float32, torch.bfloat16):
        want = replay_defaults.default_backend("mamba2_per_step", state, shape) or "triton"
        assert resolve(checkpointing=False, state=state) == want
    with monkeypatch.context() as m:
        m.setattr(replay_defaults, "default_backend", lambda *a, **k: None)
        assert resolve() == "triton" and resolve(checkpointing=False) == "triton"  # no row: ours
    assert resolve(cfg=SimpleNamespace(**{**vars(super_v3), "mamba_num_heads": 4})) == "triton"
    assert resolve(sr=True) == "triton" and resolve(replay=False) == "triton"
    probe["result"] = ("FlashInfer's checkpointing_ssu failed at this configuration: RuntimeError: x", 1.0)
    with caplog.at_level("WARNING"):
        assert resolve() == "triton"
    assert "measured faster kernel at h128_p64_n128, but FlashInfer's checkpointing_ssu failed" in caplog.text


def test_a_ring_cache_refuses_a_model_that_clamps_dt():
    """FlashInfer's contract (and so its reference) has no dt clamp: a ring cache for a model with a
    time_step_limit (the shipped tiny NemotronH clamps dt below at 0.001) is refused, naming the setting."""
    from registry.schema import REPO_ROOT
    from runners.engine.cache import HybridCache
    from runners.engine.models.config import HybridConfig

    config = HybridConfig.from_pretrained(REPO_ROOT / "registry/checkpoints/tiny_nemotron_h_mtp")
    assert tuple(config.time_step_limit) != (0.0, math.inf)
    kinds = {0: "mamba2"}
    args = dict(max_batch_size=2, max_seq_len=16, dtype=torch.float32, spec_tokens=4, ssm_replay=True)
    with pytest.raises(ValueError, match=r"no dt clamp, and this model clamps dt \(time_step_limit=\(0.001"):
        HybridCache(config, kinds, replay_ring=True, **args)
    HybridCache(config, kinds, **args)  # our replay history takes the clamp


def _ring_case(S=4, H=4, P=8, G=2, N=16, T=4, W=4, state_dtype=torch.float16, seed=0):
    """A small replay case on the CPU: state, ring history, inputs, slots and PNATs, every row flushing."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    ring = RingHistory(*(rand(*shape, scale=0.5).to(dt) for shape, dt in
                         RingHistory.shapes(S, W, T, H, P, G, N, dtype=torch.float32).values()))
    ring.dt_cache.abs_().mul_(0.1)
    state = rand(S, H, P, N, scale=0.5).to(state_dtype)
    args = (rand(2, T, H, P), rand(2, T, H), -rand(H).abs() - 0.5, rand(2, T, G, N, scale=N ** -0.5),
            rand(2, T, G, N, scale=N ** -0.5), rand(H), rand(H))
    slots = torch.tensor([0, 2])
    ring_start = torch.zeros(S, dtype=torch.int32)
    pnat = torch.full((S,), W, dtype=torch.int32)  # k + T > W: every row flushes its pending tokens
    return state, ring, args, slots, ring_start, pnat


def test_stochastic_rounding_of_the_flushed_checkpoints():
    """With ``rounding`` the contract's reference stores the flushed checkpoint stochastically (the rule of
    kernels.rounding): each value one of the two float16 neighbours of the round-to-nearest one's exact
    value, some of them not the nearest; a bf16 state is refused, as FlashInfer rounds float16 only."""
    from kernels.mamba2.flashinfer_replay import SR_STATE_DTYPES, replay_verify_flashinfer_ref
    from kernels.rounding import StochasticRounding

    assert SR_STATE_DTYPES == (torch.float16,)
    state, ring, args, slots, ring_start, pnat = _ring_case()
    nearest, exact = state.clone(), state.float().clone()
    for target in (nearest, exact):
        copy = RingHistory(*(t.clone() for t in vars(ring).values()))
        replay_verify_flashinfer_ref(target, *args, slots, copy, ring_start, pnat)
    rounded = state.clone()
    replay_verify_flashinfer_ref(rounded, *args, slots, ring, ring_start, pnat,
                                 rounding=StochasticRounding.create(7, device="cpu").for_layer(3))
    rows = slots.long()
    assert not torch.equal(rounded[rows], nearest[rows])  # rounded stochastically, not to nearest
    # float16's grid spacing at each exact value (10 mantissa bits; 2^-24 below its smallest normal 2^-14)
    ulp = torch.exp2(torch.floor(torch.log2(exact[rows].abs())).clamp(min=-14) - 10)
    assert ((rounded[rows].float() - exact[rows]).abs() <= ulp).all()  # a neighbour of the exact value
    assert torch.equal(rounded[[1, 3]], state[[1, 3]])  # rows not in the batch untouched
    # the outputs continue from the checkpoint rounded to nearest (FlashInfer rounds only its store of it)
    fresh = lambda: RingHistory(*(t.clone() for t in vars(ring).values()))  # noqa: E731
    out_nearest = replay_verify_flashinfer_ref(state.clone(), *args, slots, fresh(), ring_start, pnat)
    out_rounded = replay_verify_flashinfer_ref(state.clone(), *args, slots, fresh(), ring_start, pnat,
                                               rounding=StochasticRounding.create(7, device="cpu"))
    assert torch.equal(out_rounded, out_nearest)
    with pytest.raises(ValueError, match="float16 state only"):
        replay_verify_flashinfer_ref(state.bfloat16(), *args, slots, ring, ring_start, pnat,
                                     rounding=StochasticRounding.create(7, device="cpu"))


def test_flashinfer_is_given_a_seed_per_layer_and_step(monkeypatch, fake_flashinfer):
    """replay_verify_flashinfer passes FlashInfer rand_seed = the rounding key seed ^ (step << 16 | salt),
    computed on the device (it follows the step counter), and the Philox rounds; none without rounding."""
    from kernels.mamba2.flashinfer_replay import replay_verify_flashinfer
    from kernels.rounding import StochasticRounding

    calls = []
    fake_flashinfer.checkpointing_ssu = lambda *a, **kw: calls.append(kw)
    rounding = StochasticRounding.create(1234, device="cpu", philox_rounds=7).for_layer(5)
    state, ring, args, slots, ring_start, pnat = _ring_case()
    replay_verify_flashinfer(state, *args, slots, ring, ring_start, pnat)
    assert "rand_seed" not in calls[-1]
    rounding.advance()
    rounding.advance()
    replay_verify_flashinfer(state, *args, slots, ring, ring_start, pnat, rounding=rounding)
    seed = calls[-1]["rand_seed"]
    assert seed.dtype == torch.int64 and seed.shape == (1,)
    assert int(seed) == rounding.key() == 1234 ^ (2 << 16 | 5)
    assert calls[-1]["philox_rounds"] == 7
    with pytest.raises(ValueError, match="float16 state only"):
        replay_verify_flashinfer(state.bfloat16(), *args, slots, ring, ring_start, pnat, rounding=rounding)


def test_stochastic_rounding_resolves_to_flashinfer_for_a_float16_state_only(monkeypatch, caplog,
                                                                             fake_flashinfer):
    """ssm_backend=flashinfer, replay, stochastic rounding: FlashInfer with a float16 state (probed with its
    rounding on), Triton with the reason for bf16; the cache refuses FlashInfer's rounding elsewhere."""
    from types import SimpleNamespace

    import runners.engine.runner as runner
    from runners.engine.cache import HybridCache
    from runners.engine.models.config import HybridConfig
    from runners.engine.models.hybrid import HybridLM

    probed = []
    monkeypatch.setattr(runner, "probe_flashinfer_replay", lambda *a, **k: probed.append(k) or (None, 1.0))
    cfg = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128,
                          time_step_limit=(0.0, math.inf), gdn_num_value_heads=0)
    kw = dict(spec_tokens=4, replay_checkpointing=True, dtype=torch.bfloat16, stochastic_rounding=True)
    cuda = torch.device("cuda")
    assert runner.resolve_ssm_backend("flashinfer", cuda, True, cfg, ssm_state_dtype=torch.float16, **kw) \
        == "flashinfer"
    assert probed[-1]["stochastic_rounding"] is True
    with caplog.at_level("WARNING"):
        resolved = runner.resolve_ssm_backend("flashinfer", cuda, True, cfg, ssm_state_dtype=torch.bfloat16,
                                              **kw)
    assert resolved == "triton"
    assert "rounds stochastically into a float16 state only, not bfloat16" in caplog.text
    # the cache: FlashInfer's rounding exists in its replay kernel into a float16 state only
    config = HybridConfig.from_pretrained(REPO / "registry/checkpoints/tiny_nemotron_h_mtp")
    config = dataclasses.replace(config, time_step_limit=(0.0, math.inf))
    kinds = HybridLM(config, with_mtp=True).cache_kinds(include_mtp=True)
    args = dict(max_batch_size=2, max_seq_len=16, dtype=torch.bfloat16, spec_tokens=4,
                ssm_backend="flashinfer", stochastic_rounding=True)
    cache = HybridCache(config, kinds, ssm_state_dtype=torch.float16, ssm_replay=True, **args)
    assert cache.rounding is not None
    with pytest.raises(ValueError, match="runs in its replay kernel into a float16 state only"):
        HybridCache(config, kinds, ssm_state_dtype=torch.float16, ssm_replay=False, **args)
    # a ring history on any backend rounds into a float16 state only (its reference is FlashInfer's contract)
    for backend in ("flashinfer", "torch"):
        with pytest.raises(ValueError, match="ring histories .* rounds into a float16 state only"):
            HybridCache(config, kinds, ssm_state_dtype=torch.bfloat16, ssm_replay=True,
                        **{**args, "ssm_backend": backend}, replay_ring=True)


@pytest.mark.parametrize("D_dtype, bias_dtype, slot_dtype", [(torch.bfloat16, torch.bfloat16, torch.int64),
                                                             (torch.float32, torch.bfloat16, torch.int32)])
def test_the_engine_call_hands_flashinfer_its_operands_without_copies_or_casts(
        monkeypatch, fake_flashinfer, D_dtype, bias_dtype, slot_dtype):
    """replay_verify_flashinfer is one launch: x, B, C go as the strided views of the conv output the engine
    holds (same storage, no copy), raw dt in its own bf16 (FlashInfer converts it), the slot ids as they are
    (int32 or int64), D and dt_bias in their shared dtype, else both float32 (weight_dtype: its contract
    takes one dtype for both). The probe builds its module with those same dtypes and layouts."""
    from kernels.mamba2 import flashinfer_replay as fr

    seen = {}
    fake_flashinfer.checkpointing_ssu = lambda *a, **kw: seen.update(args=a, kw=kw)
    b, T, H, P, G, N, S, W = 2, 4, 4, 8, 2, 16, 3, 16
    bf = torch.bfloat16
    xBC = torch.randn(b, T, H * P + 2 * G * N).to(bf)
    x, B, C = xBC.split([H * P, G * N, G * N], dim=-1)
    x, B, C = x.reshape(b, T, H, P), B.reshape(b, T, G, N), C.reshape(b, T, G, N)
    zdt = torch.randn(b, T, 64 + H).to(bf)
    dt = zdt[..., 64:]  # a strided split of the in_proj output, as the layer's
    slots = torch.tensor([2, 0], dtype=slot_dtype)
    ring = _ring(S, W, T, H, P, G, N, bf)
    zeros = torch.zeros(S, dtype=torch.int32)
    fr.replay_verify_flashinfer(torch.zeros(S, H, P, N), x, dt, -torch.rand(H), B, C,
                                torch.ones(H, dtype=D_dtype), torch.zeros(H, dtype=bias_dtype), slots, ring,
                                zeros, zeros.clone())
    a, kw = seen["args"], seen["kw"]
    got_x, got_dt, got_B, got_C, out = a[6], a[7], a[9], a[10], a[11]
    for got, view in ((got_x, x), (got_B, B), (got_C, C)):
        assert got.data_ptr() == view.data_ptr() and got.stride() == view.stride() and not got.is_contiguous()
    assert got_dt.dtype == bf and got_dt.shape == (b, T, H, P) and got_dt.stride()[-1] == 0
    assert got_dt.untyped_storage().data_ptr() == zdt.untyped_storage().data_ptr()  # dt read in place
    assert kw["state_batch_indices"] is slots
    want_wd = D_dtype if D_dtype == bias_dtype else torch.float32
    assert kw["D"].dtype == kw["dt_bias"].dtype == want_wd and fr.weight_dtype(D_dtype, bias_dtype) == want_wd
    assert out.shape == x.shape and out.dtype == bf and out.is_contiguous()

    # the probe: the same layouts and dtypes (D / dt_bias in the model's dtype, int64 slots)
    calls = []
    monkeypatch.setattr(fr, "replay_verify_flashinfer",
                        lambda *a, **kw: calls.append(a) or fr.replay_verify_flashinfer_ref(*a, **kw))
    monkeypatch.setattr(fr, "_PROBED", {})
    why, _ = fr.probe_flashinfer_replay(H, P, G, N, T, W, dtype=bf, state_dtype=torch.float32, device="cpu",
                                        param_dtype=D_dtype)
    assert why is None
    px, pdt, pB, pD, pslots = calls[0][1], calls[0][2], calls[0][4], calls[0][6], calls[0][8]
    assert not px.is_contiguous() and not pB.is_contiguous() and px.untyped_storage().data_ptr() == \
        pB.untyped_storage().data_ptr()
    assert pdt.dtype == bf and pD.dtype == D_dtype and pslots.dtype == torch.int64


def test_the_probe_is_built_for_the_models_D_and_dt_bias_dtype(tmp_path, monkeypatch, fake_flashinfer):
    """The engine finds the dtype its Mamba2 D / dt_bias reach FlashInfer in (a bf16 model: bf16) and the
    backend's resolution, named or default, probes with it, so the module the probe builds is the one the
    run calls."""
    from types import SimpleNamespace

    from ckpt_factory import make_hf_model, write_checkpoint

    import runners.engine.runner as runner
    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    path = write_checkpoint(tmp_path, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM"), with_mtp=True)
    engine = Engine.from_pretrained(path, EngineOptions(draft_len=3, ssm_replay=True, dtype="bfloat16",
                                                        max_batch_size=2, max_seq_len=32))
    assert runner.mamba2_param_dtype(engine.model) == torch.bfloat16
    assert runner.mamba2_param_dtype(torch.nn.Linear(2, 2)) is None

    seen = []
    monkeypatch.setattr(runner, "probe_flashinfer_replay", lambda *a, **kw: seen.append(kw) or (None, 0.0))
    monkeypatch.setattr(runner.replay_defaults, "default_backend", lambda *a, **kw: "flashinfer")
    cfg = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128,
                          time_step_limit=(0.0, math.inf), gdn_num_value_heads=0)
    kw = dict(spec_tokens=4, replay_checkpointing=True, dtype=torch.bfloat16, ssm_state_dtype=torch.float32,
              param_dtype=torch.bfloat16)
    for backend in ("flashinfer", None):
        seen.clear()
        assert runner.resolve_ssm_backend(backend, torch.device("cuda"), True, cfg, **kw) == "flashinfer"
        assert seen and all(s["param_dtype"] == torch.bfloat16 for s in seen), backend


def test_at_bf16_the_ring_replay_parts_from_rewind_only_at_near_ties(tmp_path, monkeypatch):
    """bf16 activations (FlashInfer's only ones) with a float32 state: the engine on ring histories (the
    contract's reference in FlashInfer's place) may part from rewind only with a token near the float32
    model's top (tests/near_ties.py), which is what the GPU test holds FlashInfer's kernel to;
    with ring_start never moved (a broken ring bookkeeping) the same check fails."""
    import functools

    from ckpt_factory import make_hf_model, write_checkpoint
    from near_ties import assert_parts_only_at_near_ties, divergence_gaps

    import kernels.commit as commit
    import runners.engine.runner as runner
    from runners.engine import Engine
    from runners.engine.cache import HybridCache
    from runners.engine.options import EngineOptions

    path = write_checkpoint(tmp_path, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM", mamba_head_dim=64,
                                                    ssm_state_size=128, mamba_num_heads=4), with_mtp=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (12,))]

    def run(replay):
        options = EngineOptions(draft_len=3, ssm_replay=replay, max_batch_size=5, max_seq_len=96,
                                dtype="bfloat16", ssm_state_dtype="float32", ssm_replay_checkpointing=replay)
        return Engine.from_pretrained(path, options).generate(prompts, 30, stop_token_ids=[]).tokens

    want = run(False)
    model = Engine.from_pretrained(path, EngineOptions(draft_len=0, max_batch_size=1, max_seq_len=96)).model
    monkeypatch.setattr(runner, "HybridCache", functools.partial(HybridCache, replay_ring=True))
    got = run(True)
    assert_parts_only_at_near_ties(model, prompts, got, want, "ring replay")
    monkeypatch.setattr(commit, "ring_advance", lambda *a, **kw: None)  # the CPU engine runs the reference
    broken = run(True)
    assert len(divergence_gaps(model, prompts, broken, want)) > 3
    with pytest.raises(AssertionError, match="not near"):
        assert_parts_only_at_near_ties(model, prompts, broken, want, "broken ring replay")


def test_aot_module_dir_names_flashinfers_prebuilt_folder_only_when_it_holds_a_module(tmp_path, monkeypatch):
    """results.json's "flashinfer_aot_dir" (runners/engine/runner.py): FlashInfer's data/aot folder, which it
    loads from before building (tests/gpu/flashinfer_aot.py fills it), only once a module is there."""
    import types

    from kernels.mamba2.flashinfer_replay import aot_module_dir

    env = types.ModuleType("flashinfer.jit.env")
    env.FLASHINFER_AOT_DIR = tmp_path / "aot"
    jit = types.ModuleType("flashinfer.jit")
    jit.env = env
    for name, mod in (("flashinfer", types.ModuleType("flashinfer")), ("flashinfer.jit", jit),
                      ("flashinfer.jit.env", env)):
        monkeypatch.setitem(sys.modules, name, mod)
    assert aot_module_dir() is None  # no folder
    (tmp_path / "aot" / "m").mkdir(parents=True)
    assert aot_module_dir() is None  # a folder without a module
    (tmp_path / "aot" / "m" / "m.so").write_bytes(b"")
    assert aot_module_dir() == str(tmp_path / "aot")
