"""SSM replay end to end: replay and rewind give the same tokens and the same acceptance, step by step.

- replay (``ssm_replay=True``) and rewind emit identical tokens and identical acceptance counters on a batch
  of prompts of different lengths under continuous batching, for K = 1, 3, 7, and both equal plain greedy;
- an oracle drafter drives every num_accepted_tokens value 1 .. K + 1 (so every PNAT value is replayed);
- in lockstep, after every verify + commit, each Mamba2 layer's replay state materialised (its pending PNAT
  tokens fast-forwarded) equals the rewind state, and the committed conv window read at its offset equals
  the rewind window.
Both families run: NemotronH (Mamba2) and Qwen3-Next (Gated DeltaNet). Random checkpoints with a 5-token
vocab (tests/ckpt_factory.py, tests/qwen_ckpt.py) make random drafts often right.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ckpt_factory import OracleDraftEngine, make_hf_model, write_checkpoint
from qwen_ckpt import write_qwen_checkpoint

from runners import Engine
from runners.cache import GDNReplayState, GDNState, Mamba2ReplayState, Mamba2State
from runners.engine import GenerationStats
from runners.models.gdn import GDNMixer
from runners.models.mamba2 import Mamba2Mixer

MAX_NEW = 12
SLOTS = 5  # fewer slots than prompts: requests join and leave while others are mid-generation


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "nemotron_h":
        path = write_checkpoint(folder, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM"), with_mtp=True)
    else:
        path = write_qwen_checkpoint(folder / "ckpt", seed=2, vocab_size=5)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (18,), generator=g).tolist()
    prompts = [torch.randint(0, 5, (n,), generator=g).tolist() for n in lengths]
    plain = Engine.from_pretrained(path, max_batch_size=SLOTS, max_seq_len=80)
    return path, prompts, plain.generate(prompts, MAX_NEW, stop_token_ids=[]).tokens


def _engine(path, K, replay, cls=Engine, **kw):
    return cls.from_pretrained(
        path, draft_len=K, ssm_replay=replay, max_batch_size=SLOTS, max_seq_len=80, **kw
    )


def _acceptance(stats: GenerationStats) -> tuple:
    return (stats.steps, stats.request_steps, stats.drafted_tokens, stats.accepted_drafts,
            stats.accepted_per_position, stats.num_accepted_hist)


@pytest.mark.parametrize("K", [1, 3, 7])
def test_replay_equals_rewind_tokens_and_acceptance(setup, K):
    path, prompts, plain = setup
    rewind = _engine(path, K, False).generate(prompts, MAX_NEW, stop_token_ids=[])
    mamba = not isinstance(_recurrent_layers(_engine(path, 1, False))[0][0], GDNMixer)
    replay_engine = _engine(path, K, True, ssm_replay_checkpointing=mamba and K == 7)
    replay = replay_engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert replay.tokens == rewind.tokens == plain
    assert _acceptance(replay.stats) == _acceptance(rewind.stats)
    assert replay.stats.accepted_drafts > 0  # drafts were accepted, so PNAT > 1 was replayed
    assert replay_engine.cache.replay is not None
    assert all(isinstance(state, Mamba2ReplayState) for _, state in _recurrent_layers(replay_engine))


def test_replay_with_every_num_accepted_value(setup):
    path, prompts, plain = setup
    K, outs = 3, []
    for replay in (False, True):
        engine = _engine(path, K, replay, OracleDraftEngine)
        engine.set_oracle(prompts, plain)
        outs.append(engine.generate(prompts, MAX_NEW, stop_token_ids=[]))
    rewind, replay = outs
    assert replay.tokens == rewind.tokens == plain
    assert _acceptance(replay.stats) == _acceptance(rewind.stats)
    assert all(h > 0 for h in replay.stats.num_accepted_hist[1:])  # 1 .. K + 1 accepted tokens all occurred


def _recurrent_layers(engine):
    """[(mixer, layer state)] of the Mamba2 / GDN blocks."""
    blocks = [b for b in engine.model.layers if isinstance(b.mixer, (Mamba2Mixer, GDNMixer))]
    assert blocks
    return [(b.mixer, engine.cache[b.cache_index]) for b in blocks]


@torch.inference_mode()
@pytest.mark.parametrize("checkpointing", [False, True])
def test_materialised_replay_state_equals_rewind_state_after_every_commit(setup, checkpointing):
    path, prompts, _ = setup
    if checkpointing and isinstance(_recurrent_layers(_engine(path, 1, False))[0][0], GDNMixer):
        pytest.skip("the checkpointing replay variant exists for Mamba2 only")
    K = 3
    engines = [_engine(path, K, False), _engine(path, K, True, ssm_replay_checkpointing=checkpointing)]
    slots = [0, 2, 3]  # not contiguous: the gather paths, not the slice paths
    batch = [prompts[1], prompts[4], prompts[7]]
    lens, lasts = [], []
    for e in engines:
        first = e._prefill(batch, slots)
        slot_len = torch.zeros(SLOTS, dtype=torch.long)
        last = torch.zeros(SLOTS, dtype=torch.long)
        slot_len[slots] = torch.tensor([len(p) for p in batch])
        last[slots] = torch.tensor(first)
        lens.append(slot_len)
        lasts.append(last)
    live = torch.tensor(slots)
    stats = [GenerationStats(accepted_per_position=[0] * K, num_accepted_hist=[0] * (K + 2)) for _ in engines]
    flushed, max_pending = False, 0
    for step in range(14):  # checkpointing (L = 16, T = 4): the state is written once > 12 tokens pend
        pending = engines[1].cache.replay.prev_num_accepted[live].clone()
        toks = [e._spec_step(slots, n, t, s) for e, n, t, s in zip(engines, lens, lasts, stats)]
        now = engines[1].cache.replay.prev_num_accepted[live]
        flushed |= bool((now < pending).any())  # checkpointing: a flush restarts the pending count
        max_pending = max(max_pending, int(now.max()))
        assert toks[0] == toks[1], step
        pairs = zip(_recurrent_layers(engines[0]), _recurrent_layers(engines[1]))
        for i, ((mixer, rew), (_, rep)) in enumerate(pairs):
            gdn = isinstance(mixer, GDNMixer)
            want_types = (GDNState, GDNReplayState) if gdn else (Mamba2State, Mamba2ReplayState)
            assert type(rew) is want_types[0] and isinstance(rep, want_types[1])
            A = -torch.exp(mixer.A_log.float())  # Mamba2's decay rate; GDN's decay is in its history
            want = rew.ssm[live].float()
            torch.testing.assert_close(rep.materialized_ssm(A)[live], want, atol=1e-5, rtol=1e-5)
            # the first layer's conv inputs are bit-identical (same embeddings): its window must be too;
            # deeper layers see inputs that differ by the replay's float rounding (~1e-7)
            tol = 0 if i == 0 else 1e-5
            torch.testing.assert_close(rep.materialized_conv()[live], rew.conv[live], atol=tol, rtol=tol)
    replay = engines[1].cache.replay
    assert int(replay.prev_num_accepted[live].min()) >= 1
    assert replay.prev_num_accepted[SLOTS] == 0 and replay.last_accepted[SLOTS] == 0  # scratch row: never
    if checkpointing:  # pending tokens accumulated over several verifies, and the state was written
        assert flushed and K + 1 < max_pending <= 16
    else:  # per-step replay: PNAT is one step's num_accepted_tokens
        assert max_pending <= K + 1
    assert stats[0] == stats[1] and stats[1].accepted_drafts > 0


def test_ssm_replay_without_speculation_is_an_error(setup):
    path, _, _ = setup
    with pytest.raises(ValueError, match="speculative decoding"):
        Engine.from_pretrained(path, draft_len=0, ssm_replay=True, max_batch_size=2, max_seq_len=16)


def test_ssm_backend_option(setup):
    path, _, _ = setup
    engine = _engine(path, 1, True)
    assert engine.ssm_backend == "torch"  # the CPU default
    assert all(m.ssm_backend == "torch" for m, _ in _recurrent_layers(engine))
    with pytest.raises(ValueError, match="ssm_backend"):
        _engine(path, 1, True, ssm_backend="cuda_graphs")


def test_triton_backend_matches_torch_backend(setup):
    """The engine's kernel path (Triton replay verify + advance, Triton rewind verify), run by the Triton
    interpreter on the CPU (conftest sets TRITON_INTERPRET without a GPU): same tokens and acceptance."""
    from kernels._common import interpreter_active

    if not interpreter_active() and not torch.cuda.is_available():
        pytest.skip("Triton is neither in interpreter mode nor on a GPU")
    path, prompts, _ = setup
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = [prompts[0], prompts[5], prompts[2]]  # 3 requests on 2 slots: slot reuse, a join mid-run
    outs = {}
    for backend in ("torch", "triton"):
        for replay in (False, True):
            engine = Engine.from_pretrained(path, draft_len=2, ssm_replay=replay, max_batch_size=2,
                                            max_seq_len=64, ssm_backend=backend, device=device)
            outs[backend, replay] = engine.generate(batch, 5, stop_token_ids=[])
    want = outs["torch", False]
    for out in outs.values():
        assert out.tokens == want.tokens and _acceptance(out.stats) == _acceptance(want.stats)


def test_flashinfer_refused_for_unsupported_mamba_sizes(caplog):
    """head_dim 10 / d_state 12 break FlashInfer's JIT build, 3 heads per group its dispatcher: the engine
    picks Triton and says why; Super V3's sizes pass the guard."""
    from types import SimpleNamespace

    from runners.engine import _resolve_ssm_backend

    for sizes, named in (((10, 12, 6, 2), "mamba_head_dim': 10"), ((64, 128, 6, 2), "n_groups': 3")):
        keys = ("mamba_head_dim", "ssm_state_size", "mamba_num_heads", "n_groups")
        cfg = SimpleNamespace(**dict(zip(keys, sizes)))
        caplog.clear()
        with caplog.at_level("WARNING"):
            backend = _resolve_ssm_backend("flashinfer", torch.device("cuda"), False, cfg)
        assert backend == "triton" and "verified only at" in caplog.text and named in caplog.text
    caplog.clear()
    cfg = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128)  # Super V3
    with caplog.at_level("WARNING"):
        resolved = _resolve_ssm_backend("flashinfer", torch.device("cuda"), False, cfg)
    assert "verified only at" not in caplog.text  # passes the size guard (then needs flashinfer importable)
    assert resolved == ("flashinfer" if importlib.util.find_spec("flashinfer") else "triton")


def test_flashinfer_backend_on_cpu_and_for_gdn(caplog):
    """On the CPU the request is refused naming FlashInfer and the fix; a model without Mamba2 layers
    (Qwen3-Next) gets Triton with the reason: FlashInfer has no Gated DeltaNet kernels."""
    from types import SimpleNamespace

    from runners.engine import _resolve_ssm_backend

    cfg = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128)
    with pytest.raises(ValueError, match="ssm_backend='flashinfer' runs FlashInfer's CUDA kernels.*'torch'"):
        _resolve_ssm_backend("flashinfer", torch.device("cpu"), True, cfg)
    with caplog.at_level("WARNING"):
        gdn_only = SimpleNamespace(mamba_num_heads=0)
        resolved = _resolve_ssm_backend("flashinfer", torch.device("cuda"), True, gdn_only)
    assert resolved == "triton" and "no Gated DeltaNet kernels" in caplog.text


@pytest.mark.gpu
def test_gpu_flashinfer_rewind_equals_triton(tmp_path):
    """FlashInfer's selective_state_update (rewind) against our Triton kernels at sizes it supports."""
    pytest.importorskip("flashinfer.mamba")
    # FlashInfer builds at Super V3's Mamba2 sizes (head_dim 64, d_state 128); head_dim 16 / 32 fail its JIT,
    # and it takes a power-of-two number of heads per group (4 heads / 2 groups here).
    path = write_checkpoint(tmp_path, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM", mamba_head_dim=64,
                                                    ssm_state_size=128, mamba_num_heads=4), with_mtp=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (12,))]
    outs = {}
    for backend, replay in (("triton", False), ("flashinfer", False), ("flashinfer", True)):
        engine = Engine.from_pretrained(path, device="cuda", draft_len=3, ssm_replay=replay,
                                        ssm_backend=backend, max_batch_size=SLOTS, max_seq_len=80)
        assert engine.ssm_backend == backend
        outs[backend, replay] = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    want = outs["triton", False]
    for out in outs.values():
        assert out.tokens == want.tokens and _acceptance(out.stats) == _acceptance(want.stats)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_replay_equals_rewind(setup, backend):
    """On CUDA: replay (our Triton replay kernel, also under ssm_backend=flashinfer) against rewind (our
    Triton selective_state_update, or FlashInfer's; falls back to Triton with a log line without it)."""
    path, prompts, _ = setup
    outs = []
    for replay in (False, True):
        engine = Engine.from_pretrained(path, device="cuda", draft_len=3, ssm_replay=replay,
                                        ssm_backend=backend, max_batch_size=SLOTS, max_seq_len=80)
        outs.append(engine.generate(prompts, MAX_NEW, stop_token_ids=[]))
    assert outs[1].tokens == outs[0].tokens
    assert _acceptance(outs[1].stats) == _acceptance(outs[0].stats) and outs[1].stats.accepted_drafts > 0
