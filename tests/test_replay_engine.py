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
from replay_oracles import gdn_materialized_state, mamba2_materialized_state, materialized_conv

from runners.engine import Engine
from runners.engine.models.gdn import GDNMixer, GDNReplayState, GDNState
from runners.engine.models.mamba2 import Mamba2Mixer, Mamba2ReplayState, Mamba2State
from runners.engine.options import EngineOptions
from runners.engine.stats import GenerationStats

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
    plain = Engine.from_pretrained(path, EngineOptions(max_batch_size=SLOTS, max_seq_len=80))
    return path, prompts, plain.generate(prompts, MAX_NEW, stop_token_ids=[]).tokens


def _engine(path, K, replay, cls=Engine, device="cpu", **kw):
    return cls.from_pretrained(path, EngineOptions(draft_len=K, ssm_replay=replay, max_batch_size=SLOTS,
                                                   max_seq_len=80, **kw), device=device)


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
    assert all(type(state) is type(mixer).state_class(replay=True)
               for mixer, state in _recurrent_layers(replay_engine))


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
@pytest.mark.parametrize(
    "checkpointing, backend, steps",
    # the Triton kernels (interpreted on the CPU, compiled on CUDA) for fewer steps: too few for a flush
    [(False, "torch", 14), (True, "torch", 14), (False, "triton", 3)],
)
def test_materialised_replay_state_equals_rewind_state_after_every_commit(
    setup, checkpointing, backend, steps
):
    path, prompts, _ = setup
    if checkpointing and isinstance(_recurrent_layers(_engine(path, 1, False))[0][0], GDNMixer):
        pytest.skip("the checkpointing replay variant exists for Mamba2 only")
    K = 3
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(ssm_backend=backend, device=device)
    engines = [_engine(path, K, False, **kw),
               _engine(path, K, True, ssm_replay_checkpointing=checkpointing, **kw)]
    slots = [0, 2, 3]  # not contiguous
    # 12, 5 and 4 tokens (chunk_size 8: one prompt spans two chunks): short prefills for the interpreter
    batch = [prompts[11], prompts[8], prompts[12]]
    for e in engines:
        e.runner.prefill(batch, slots)  # the slots' lengths and first tokens now live on the device
    live = torch.tensor(slots)
    flushed, max_pending, accepted = False, 0, 0
    for step in range(steps):  # checkpointing (L = 16, T = 4): the state is written once > 12 tokens pend
        pending = engines[1].cache.replay.prev_num_accepted[live].clone()
        toks = [e.runner.read(e.runner.launch(slots, e.options.max_seq_len)) for e in engines]
        now = engines[1].cache.replay.prev_num_accepted[live]
        flushed |= bool((now < pending).any())  # checkpointing: a flush restarts the pending count
        max_pending = max(max_pending, int(now.max()))
        assert toks[0] == toks[1], step  # the same tokens, hence the same acceptance
        accepted += sum(len(t) - 1 for t in toks[1])
        pairs = zip(_recurrent_layers(engines[0]), _recurrent_layers(engines[1]))
        for i, ((mixer, rew), (_, rep)) in enumerate(pairs):
            gdn = isinstance(mixer, GDNMixer)
            want_types = (GDNState, GDNReplayState) if gdn else (Mamba2State, Mamba2ReplayState)
            assert type(rew) is want_types[0] and type(rep) is want_types[1]
            bookkeeping = engines[1].cache.replay
            meta = (rep.ssm, rep.history, bookkeeping.prev_num_accepted, bookkeeping.buffer_index)
            if gdn:  # GDN's decay is in its history; Mamba2's decay rate A = -exp(A_log)
                materialised = gdn_materialized_state(*meta)
            else:
                materialised = mamba2_materialized_state(*meta, -torch.exp(mixer.A_log.float()))
            torch.testing.assert_close(materialised[live], rew.ssm[live].float(), atol=1e-5, rtol=1e-5)
            # the first layer's conv inputs are bit-identical (same embeddings): its window must be too;
            # deeper layers see inputs that differ by the replay's float rounding (~1e-7)
            tol = 0 if i == 0 else 1e-5
            torch.testing.assert_close(materialized_conv(rep)[live], rew.conv[live], atol=tol, rtol=tol)
    replay = engines[1].cache.replay
    assert int(replay.prev_num_accepted[live].min()) >= 1
    assert replay.prev_num_accepted[SLOTS] == 0 and replay.last_accepted[SLOTS] == 0  # scratch row: never
    if checkpointing:  # pending tokens accumulated over several verifies, and the state was written
        assert flushed and K + 1 < max_pending <= 16
    else:  # per-step replay: PNAT is one step's num_accepted_tokens
        assert max_pending <= K + 1
    assert accepted > 0


def test_ssm_replay_without_speculation_is_an_error(setup):
    path, _, _ = setup
    with pytest.raises(ValueError, match="speculative decoding"):
        Engine.from_pretrained(path, EngineOptions(draft_len=0, ssm_replay=True, max_batch_size=2,
                                                   max_seq_len=16))


def test_ssm_backend_option(setup):
    path, _, _ = setup
    engine = _engine(path, 1, True)
    assert engine.ssm_backend == "torch"  # the CPU default
    assert all(state.ssm_backend == "torch" for _, state in _recurrent_layers(engine))
    with pytest.raises(ValueError, match=r"ssm_backend='cuda_graphs' is not one of \['auto', 'triton'"):
        _engine(path, 1, True, ssm_backend="cuda_graphs")
    # "auto" (the registry's default) is the engine's default too: the references on the CPU
    assert _engine(path, 1, True, ssm_backend="auto").ssm_backend == "torch"


# The prefill kernels: our Mamba2 chunked scan (four kernels), and for Gated DeltaNet fla-core's chunked
# kernels on CUDA (one of them, the chunk-to-chunk state pass, stands for the set); on the CPU the GDN prefill
# is the reference (fla's kernels need a GPU).
MAMBA2_PREFILL = {"_ssd_chunk_cumsum_kernel", "_ssd_chunk_state_kernel", "_ssd_state_passing_kernel",
                  "_ssd_chunk_scan_kernel"}
FLA_PREFILL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"


def _fla_prefill_kernels() -> dict:
    """{name: fla's launchable} when the GDN prefill runs fla-core here (CUDA and fla importable), else {}."""
    from kernels.gdn.fla import fla_chunk_rule

    if not torch.cuda.is_available() or fla_chunk_rule()[0] is None:
        return {}
    from fla.ops.common import chunk_delta_h

    return {FLA_PREFILL: getattr(chunk_delta_h, FLA_PREFILL)}


def _count_launches(monkeypatch) -> dict[str, int]:
    """Count the launches of every Triton kernel the engine may run, by name (Triton's launch goes through the
    JIT function's ``run``, or its autotuner's / heuristics' ``run``; wrapping it counts interpreted and
    compiled launches alike)."""
    from kernels import commit
    from kernels.gdn import recurrent as gdn_recurrent
    from kernels.gdn import replay as gdn_replay
    from kernels.mamba2 import chunk as mamba2_chunk
    from kernels.mamba2 import recurrent as mamba2_recurrent
    from kernels.mamba2 import replay as mamba2_replay

    counts: dict[str, int] = {}
    kernels = (mamba2_recurrent._ssu_kernel, mamba2_replay._replay_verify_kernel,
               gdn_recurrent._fused_recurrent_gdn_kernel, gdn_replay._gdn_replay_verify_kernel,
               commit._rewind_commit_kernel, commit._replay_advance_kernel,
               mamba2_chunk._ssd_chunk_cumsum_kernel, mamba2_chunk._ssd_chunk_state_kernel,
               mamba2_chunk._ssd_state_passing_kernel,
               mamba2_chunk._ssd_chunk_scan_kernel)
    named = {k.fn.__name__ if hasattr(k, "fn") else k.__name__: k for k in kernels} | _fla_prefill_kernels()
    for name, kernel in named.items():
        run = kernel.run

        def counted(*args, _name=name, _run=run, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _run(*args, **kw)

        monkeypatch.setattr(kernel, "run", counted)
    return counts


def _is_gdn(path) -> bool:
    """Whether the checkpoint at `path` has Gated DeltaNet layers (else Mamba2)."""
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=1, max_seq_len=16))
    return isinstance(_recurrent_layers(engine)[0][0], GDNMixer)


def test_triton_backend_matches_torch_backend(setup, monkeypatch):
    """The engine's kernel path, run by the Triton interpreter on the CPU (conftest sets TRITON_INTERPRET
    without a GPU) or compiled on CUDA: ssm_backend="triton" gives the torch backend's tokens and acceptance
    for rewind and replay, launches the family's prefill kernels (Mamba2: our chunked scan; Gated DeltaNet:
    fla-core's on CUDA), decode / verify kernels and the commit kernels (the Triton rewind vs replay
    comparison is kernel against kernel), and ssm_backend="torch" launches no kernel."""
    from kernels._common import interpreter_active

    if not interpreter_active() and not torch.cuda.is_available():
        pytest.skip("Triton is neither in interpreter mode nor on a GPU")
    path, prompts, plain = setup
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [11, 14, 2]  # 3 requests on 2 slots: slot reuse, a join mid-run; 12, 11, 15 tokens: 2 chunks each
    batch, new = [prompts[i] for i in rows], 4
    assert max(len(prompts[i]) for i in rows) > 1  # a multi-token prefill: the chunked path runs
    counts = _count_launches(monkeypatch)
    outs, launched = {}, {}
    for backend in ("torch", "triton"):
        for K, replay in ((0, False), (2, False), (2, True)):
            options = EngineOptions(draft_len=K, ssm_replay=replay, max_batch_size=2, max_seq_len=64,
                                    ssm_backend=backend)
            engine = Engine.from_pretrained(path, options, device=device)
            counts.clear()
            outs[backend, K, replay] = engine.generate(batch, new, stop_token_ids=[])
            launched[backend, K, replay] = set(counts)
    print({f"{b}/K={k}/replay={r}": sorted(names) for (b, k, r), names in launched.items()})
    want = outs["torch", 2, False]
    if device == "cpu":  # `plain` ran on the CPU: on CUDA, float differences could break a near tie
        assert want.tokens == [plain[i][:new] for i in rows]
    for (backend, K, replay), out in outs.items():
        assert out.tokens == want.tokens
        # rewind and replay of one backend share every kernel but the commit: equal acceptance everywhere
        assert not replay or _acceptance(out.stats) == _acceptance(outs[backend, K, False].stats)
        # across backends the drafts are compared too, except where fla-core's GDN prefill runs: in float32
        # it multiplies in tf32 (10-bit mantissa), which can flip a near tie of the MTP head's 5-token vocab
        # (seen on the H200: same tokens, one draft accepted differently; docs/gpu/README.md)
        if device == "cpu" or not _is_gdn(path):
            assert K == 0 or _acceptance(out.stats) == _acceptance(want.stats)
    gdn = _is_gdn(path)
    decode = "_fused_recurrent_gdn_kernel" if gdn else "_ssu_kernel"  # also the family's rewind verify
    replay_verify = "_gdn_replay_verify_kernel" if gdn else "_replay_verify_kernel"
    prefill = set(_fla_prefill_kernels()) if gdn else MAMBA2_PREFILL
    assert all(not names for (backend, _, _), names in launched.items() if backend == "torch")
    assert launched["triton", 0, False] == {decode} | prefill
    assert launched["triton", 2, False] == {decode, "_rewind_commit_kernel"} | prefill
    # replay: the decode kernel only for a one-token prefill chunk, if the prompts have one
    assert {replay_verify, "_replay_advance_kernel"} | prefill <= launched["triton", 2, True]
    assert launched["triton", 2, True] <= {decode, replay_verify, "_replay_advance_kernel"} | prefill


def test_flashinfer_refused_for_unsupported_mamba_sizes(caplog):
    """head_dim 10 / d_state 12 break FlashInfer's JIT build, 3 heads per group its dispatcher: the engine
    picks Triton and says why; Super V3's sizes pass the guard."""
    from types import SimpleNamespace

    from runners.engine.runner import resolve_ssm_backend

    for sizes, named in (((10, 12, 6, 2), "mamba_head_dim': 10"), ((64, 128, 6, 2), "n_groups': 3")):
        keys = ("mamba_head_dim", "ssm_state_size", "mamba_num_heads", "n_groups")
        cfg = SimpleNamespace(**dict(zip(keys, sizes)))
        caplog.clear()
        with caplog.at_level("WARNING"):
            backend = resolve_ssm_backend("flashinfer", torch.device("cuda"), False, cfg)
        assert backend == "triton" and "verified only at" in caplog.text and named in caplog.text
    caplog.clear()
    cfg = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128)  # Super V3
    with caplog.at_level("WARNING"):
        resolved = resolve_ssm_backend("flashinfer", torch.device("cuda"), False, cfg)
    assert "verified only at" not in caplog.text  # passes the size guard (then needs flashinfer importable)
    assert resolved == ("flashinfer" if importlib.util.find_spec("flashinfer") else "triton")


def test_flashinfer_backend_on_cpu_and_for_gdn(caplog):
    """On the CPU the request is refused naming FlashInfer and the fix; a model without Mamba2 layers
    (Qwen3-Next) gets Triton with the reason: FlashInfer has no Gated DeltaNet kernels."""
    from types import SimpleNamespace

    from runners.engine.runner import resolve_ssm_backend

    cfg = SimpleNamespace(mamba_num_heads=128, n_groups=8, mamba_head_dim=64, ssm_state_size=128)
    with pytest.raises(ValueError, match="ssm_backend='flashinfer' runs FlashInfer's CUDA kernels.*'torch'"):
        resolve_ssm_backend("flashinfer", torch.device("cpu"), True, cfg)
    with caplog.at_level("WARNING"):
        gdn_only = SimpleNamespace(mamba_num_heads=0)
        resolved = resolve_ssm_backend("flashinfer", torch.device("cuda"), True, gdn_only)
    assert resolved == "triton" and "no Gated DeltaNet kernels" in caplog.text


@pytest.mark.gpu
def test_gpu_flashinfer_rewind_equals_triton(tmp_path, caplog):
    """FlashInfer's selective_state_update (rewind) against our Triton kernels at sizes it supports; its
    replay in float32 falls back to ours, with the reason."""
    pytest.importorskip("flashinfer.mamba")
    # FlashInfer builds at Super V3's Mamba2 sizes (head_dim 64, d_state 128); head_dim 16 / 32 fail its JIT,
    # and it takes a power-of-two number of heads per group (4 heads / 2 groups here).
    path = write_checkpoint(tmp_path, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM", mamba_head_dim=64,
                                                    ssm_state_size=128, mamba_num_heads=4), with_mtp=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (12,))]
    outs = {}
    for backend, replay in (("triton", False), ("flashinfer", False), ("flashinfer", True)):
        options = EngineOptions(draft_len=3, ssm_replay=replay, ssm_backend=backend, max_batch_size=SLOTS,
                                max_seq_len=80)
        with caplog.at_level("WARNING"):
            engine = Engine.from_pretrained(path, options, device="cuda")
        # FlashInfer's replay kernel takes 16-bit activations: a float32 run says so and runs ours, without
        # trying its JIT build (tests/test_flashinfer_replay_gpu.py runs it in bf16)
        assert engine.ssm_backend == ("triton" if replay else backend)
        if replay:
            assert "takes bfloat16 / float16 activations" in caplog.text and "Ninja" not in caplog.text
        outs[backend, replay] = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    want = outs["triton", False]
    for out in outs.values():
        assert out.tokens == want.tokens and _acceptance(out.stats) == _acceptance(want.stats)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_replay_equals_rewind(setup, backend):
    """On CUDA: replay (our Triton replay kernel, or FlashInfer's checkpointing_ssu under
    ssm_backend=flashinfer) against rewind (our Triton selective_state_update, or FlashInfer's; falls back to
    Triton with a log line without it)."""
    path, prompts, _ = setup
    outs = []
    for replay in (False, True):
        options = EngineOptions(draft_len=3, ssm_replay=replay, ssm_backend=backend, max_batch_size=SLOTS,
                                max_seq_len=80)
        engine = Engine.from_pretrained(path, options, device="cuda")
        outs.append(engine.generate(prompts, MAX_NEW, stop_token_ids=[]))
    assert outs[1].tokens == outs[0].tokens
    assert _acceptance(outs[1].stats) == _acceptance(outs[0].stats) and outs[1].stats.accepted_drafts > 0
