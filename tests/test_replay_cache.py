"""SSM replay at the cache level: the kernels' PyTorch references against token-by-token oracles, the
per-slot bookkeeping, and memory computed from the architecture alone.

- the vectorised references the CPU engine runs (``kernels.mamba2.replay_verify_ref``, both history
  layouts, and ``kernels.gdn.replay_verify_ref``) equal the per-row oracles of
  tests/replay_oracles.py in output, state and history, with PAD rows, slot 0 live, every PNAT value,
  checkpointing rows with and without a flush, and garbage metadata;
- bookkeeping: metadata zero-initialised, reset at admission, PAD rows never advance nor touch a live slot,
  a second commit without a verify raises, a non-verify forward on a lagging slot raises;
- memory: ``cache_memory_bytes`` (config only) equals the allocated tensors' bytes for every scheme; replay's
  speculative buffers are >= 10x smaller than rewind's at the released shapes (registry ``arch:`` blocks,
  no weights); ssm_replay without speculation is an error.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import yaml
from released_shapes import config_from_arch
from replay_oracles import gdn_replay_verify_oracle, mamba2_replay_verify_oracle

from kernels import gdn, mamba2
from registry.schema import validate_entry
from runners.engine.cache import HybridCache, cache_memory_bytes
from runners.engine.models.config import HybridConfig
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.kinds import stateful
from runners.engine.models.mamba2 import Mamba2Mixer, Mamba2ReplayState
from runners.engine.state import BatchMeta

REPO = Path(__file__).resolve().parents[1]
allocate_history = mamba2.ReplayHistory.allocate
GARBAGE = 0x7BADBEEF


def model_cache_kinds(config: HybridConfig, include_mtp: bool = True) -> dict[int, str]:
    """``{cache_index: kind}`` of the stateful blocks of ``config`` in the order ``HybridLM.cache_kinds``
    numbers them (backbone, then MTP), without building the model: sizes released shapes."""
    kinds = [k for k in config.layer_types if stateful(k)]
    if include_mtp:
        kinds += [k for k in config.mtp_layer_types if stateful(k)]
    return dict(enumerate(kinds))


def _tiny_config(**kw) -> HybridConfig:
    base = dict(family="nemotron_h", vocab_size=7, hidden_size=16, layer_types=("mamba2",), mamba_num_heads=4,
                mamba_head_dim=6, ssm_state_size=5, n_groups=2, conv_kernel=4, chunk_size=8)
    return HybridConfig(**{**base, **kw})


def test_mamba2_replay_reference_equals_oracle():
    torch.manual_seed(0)
    S, H, P, G, N, T = 6, 4, 6, 2, 5, 4
    state = torch.randn(S, H, P, N)
    A = -torch.rand(H) - 0.5
    hist = allocate_history(S, T, H, P, G, N, dtype=torch.float32, device="cpu")
    hist.x.normal_()
    hist.B.normal_()
    hist.dt.uniform_(0.1, 1.0)
    hist.dA_cumsum.copy_(torch.cumsum(A[:, None] * hist.dt, dim=-1))  # a consistent history: cumsum(A dt')
    pnat = torch.tensor([0, 1, T, 2, GARBAGE, 3], dtype=torch.int32)  # garbage is clamped to L
    buf = torch.tensor([0, 1, 1, 0, 1, GARBAGE], dtype=torch.int32)  # read modulo 2
    slot_ids = torch.tensor([3, -1, 0, 4, 1, 5])  # PAD row, slot 0 live, slot 2 not in the batch
    B = len(slot_ids)
    x, Bm, Cm = torch.randn(B, T, H, P), torch.randn(B, T, G, N), torch.randn(B, T, G, N)
    dt, D, dt_bias = torch.randn(B, T, H), torch.randn(H), torch.randn(H)
    outs, states, hists = [], [], []
    for fn in (mamba2.replay_verify_ref, mamba2_replay_verify_oracle):
        s, h = state.clone(), allocate_history(S, T, H, P, G, N, dtype=torch.float32, device="cpu")
        for name in ("x", "B", "dt", "dA_cumsum"):
            getattr(h, name).copy_(getattr(hist, name))
        outs.append(fn(s, x, dt, A, Bm, Cm, D, dt_bias, slot_ids, h, pnat.clone(), buf.clone()))
        states.append(s)
        hists.append(h)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], states[1], atol=1e-5, rtol=1e-5)
    for name in ("x", "B", "dt", "dA_cumsum"):
        torch.testing.assert_close(getattr(hists[0], name), getattr(hists[1], name), atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][1], torch.zeros_like(outs[0][1]))  # the PAD row's output is zero
    assert torch.equal(states[0][2], state[2]) and torch.equal(hists[0].x[2], hist.x[2])  # slot 2 untouched
    assert not torch.equal(states[0][3], state[3])  # PNAT = 2 > 0: the state was fast-forwarded


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_mamba2_checkpointing_reference_equals_oracle(state_dtype):
    """The checkpointing layout (L = 16, T = 4): rows without a flush (0, 3 and 12 pending tokens: the state
    stays, the new tokens go behind the pending ones) and with one (13 pending: 13 + T > L), vectorised."""
    torch.manual_seed(1)
    S, H, P, G, N, T, L = 7, 4, 6, 2, 5, 4, 16
    A = -torch.rand(H) - 0.5
    hist = allocate_history(S, L, H, P, G, N, dtype=torch.float32, device="cpu", checkpointing=True)
    assert hist.checkpointing and hist.x.shape[1] == 1
    hist.x.normal_()
    hist.B.normal_()
    hist.dt.uniform_(0.05, 0.3)
    hist.dA_cumsum.copy_(torch.cumsum(A[:, None] * hist.dt, dim=-1))
    # NaN behind the pending tokens of the buffers read (slot 0: 3 pending in buffer 1, slot 2: 12 in buffer
    # 0): never read, so nothing may come out NaN
    for slot, buf_read, k in ((0, 1, 3), (2, 0, 12)):
        hist.B[slot, buf_read, k:] = float("nan")
        hist.dt[slot, buf_read, :, k:] = float("nan")
        hist.dA_cumsum[slot, buf_read, :, k:] = float("nan")
    hist.x[0, 0, 3:] = float("nan")  # one x buffer in this layout; slot 0's new tokens overwrite 3..6
    state = torch.randn(S, H, P, N).to(state_dtype)
    pnat = torch.tensor([3, 0, 12, 13, GARBAGE, 0, 16], dtype=torch.int32)
    buf = torch.tensor([1, 0, 0, 1, 1, 0, GARBAGE], dtype=torch.int32)
    slot_ids = torch.tensor([0, 2, -1, 3, 4, 6, 1])  # slot 4: garbage PNAT (clamped to L: a flush)
    B = len(slot_ids)
    x, Bm, Cm = torch.randn(B, T, H, P), torch.randn(B, T, G, N), torch.randn(B, T, G, N)
    dt, D, dt_bias = torch.randn(B, T, H), torch.randn(H), torch.randn(H)
    res = []
    for fn in (mamba2.replay_verify_ref, mamba2_replay_verify_oracle):
        st = state.clone()
        h = allocate_history(S, L, H, P, G, N, dtype=torch.float32, device="cpu", checkpointing=True)
        for name in ("x", "B", "dt", "dA_cumsum"):
            getattr(h, name).copy_(getattr(hist, name))
        res.append((fn(st, x, dt, A, Bm, Cm, D, dt_bias, slot_ids, h, pnat.clone(), buf.clone()), st, h))
    (out, st, h), (out_o, st_o, h_o) = res
    # bf16: the closed-form and the token-by-token fast-forward round to different neighbours (2^-8 relative)
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    assert not out.isnan().any() and not st.float().isnan().any()
    torch.testing.assert_close(out, out_o, **tol)
    torch.testing.assert_close(st.float(), st_o.float(), **tol)
    for name in ("x", "B", "dt", "dA_cumsum"):
        torch.testing.assert_close(getattr(h, name), getattr(h_o, name), atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(st[0], state[0]) and torch.equal(st[2], state[2])  # no flush: the state stays
    assert not torch.equal(st[3], state[3]) and not torch.equal(st[4], state[4])  # flush: fast-forwarded
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the PAD row
    # slot 2 (12 pending, buffer 0): the pending tokens copied to buffer 1, the new ones at 12..15
    assert torch.equal(h.B[2, 1, :12], hist.B[2, 0, :12]) and torch.equal(h.B[2, 1, 12:16], Bm[1])
    assert torch.equal(h.x[2, 0, 12:16], x[1]) and torch.equal(h.x[2, 0, :12], hist.x[2, 0, :12])


def test_gdn_replay_reference_equals_oracle():
    torch.manual_seed(0)
    S, H, HV, K, V, T = 6, 2, 4, 6, 5, 3  # K != V: a transposed state would fail
    state = torch.randn(S, HV, V, K)
    hist = gdn.ReplayHistory.allocate(S, T, H, HV, K, V, device="cpu")
    hist.u.normal_()
    hist.k.copy_(torch.nn.functional.normalize(torch.randn_like(hist.k), dim=-1))
    hist.g.copy_(torch.cumsum(-torch.rand_like(hist.g), dim=2))
    pnat = torch.tensor([0, 1, T, 2, GARBAGE, 3], dtype=torch.int32)
    buf = torch.tensor([0, 1, 1, 0, 1, GARBAGE], dtype=torch.int32)
    slot_ids = torch.tensor([3, -1, 0, 4, 1, 5], dtype=torch.int32)
    B = len(slot_ids)
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, HV, V)
    g, beta = -torch.rand(B, T, HV), torch.rand(B, T, HV)
    outs, states, hists = [], [], []
    for fn in (gdn.replay_verify_ref, gdn_replay_verify_oracle):
        s, h = state.clone(), gdn.ReplayHistory.allocate(S, T, H, HV, K, V, device="cpu")
        for name in ("u", "k", "g"):
            getattr(h, name).copy_(getattr(hist, name))
        outs.append(fn(q, k, v, g, beta, s, h, slot_ids, pnat.clone(), buf.clone()))
        states.append(s)
        hists.append(h)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], states[1], atol=1e-5, rtol=1e-5)
    for name in ("u", "k", "g"):
        torch.testing.assert_close(getattr(hists[0], name), getattr(hists[1], name), atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][1], torch.zeros_like(outs[0][1]))  # the PAD row's output is zero
    assert torch.equal(states[0][2], state[2]) and torch.equal(hists[0].u[2], hist.u[2])  # slot 2 untouched


def _replay_cache(config, S=3, T=3):
    return HybridCache(config, {0: "mamba2"}, max_batch_size=S, max_seq_len=16, dtype=torch.float32,
                       spec_tokens=T, ssm_replay=True)


def test_replay_metadata_and_buffers_start_zeroed():
    cache = _replay_cache(_tiny_config())
    rs, layer = cache.replay, cache[0]
    assert isinstance(layer, Mamba2ReplayState)
    for t in (rs.prev_num_accepted, rs.buffer_index, rs.last_accepted):
        assert t.dtype == torch.int32 and t.shape == (4,) and not t.any()
    hist = layer.history
    for t in (layer.ssm, layer.conv, hist.x, hist.B, hist.dt, hist.dA_cumsum):
        assert not t.any()


@torch.inference_mode()
def test_bookkeeping_reset_pad_rows_and_single_advance():
    torch.manual_seed(0)
    config = _tiny_config()
    mixer = Mamba2Mixer(config).eval()
    S, T = 3, 3
    cache = _replay_cache(config, S, T)
    layer, rs = cache[0], cache.replay
    cache.reset(torch.tensor([0, 1, 2]))
    prefill = BatchMeta.decode(torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.long), 5)
    mixer(torch.randn(3, 5, 16), layer, prefill)  # prefill: a non-verify forward at PNAT = 0
    slot1 = [t.clone() for t in (layer.ssm[1], layer.conv[1], layer.history.x[1])]

    slot_ids = torch.tensor([-1, 0, 2])  # a PAD row first; slot 0 is live; slot 1 is not in the batch
    verify = BatchMeta.decode(slot_ids, torch.full((3,), 5), T, verify=True)
    mixer(torch.randn(3, T, 16), layer, verify)
    cache.commit(slot_ids, torch.tensor([3, 2, 1]))
    assert rs.prev_num_accepted.tolist() == [2, 0, 1, 0]  # the scratch row (PAD, index S) never advances
    assert rs.buffer_index.tolist() == [1, 0, 1, 0]
    assert rs.last_accepted.tolist() == [2, 0, 1, 0]
    for before, after in zip(slot1, (layer.ssm[1], layer.conv[1], layer.history.x[1])):
        assert torch.equal(before, after)  # neither the PAD row nor the others touched slot 1
    with pytest.raises(RuntimeError, match="exactly once per verify step"):
        cache.commit(slot_ids, torch.tensor([3, 2, 1]))  # advancing twice would replay the wrong buffer
    with pytest.raises(RuntimeError, match="every step after prefill must be a verify"):
        mixer(torch.randn(1, 1, 16), layer, BatchMeta.decode(torch.tensor([0]), torch.tensor([8])))

    cache.reset(torch.tensor([0]))  # a new request is admitted to slot 0
    assert rs.prev_num_accepted.tolist() == [0, 0, 1, 0] and rs.buffer_index[0] == rs.last_accepted[0] == 0
    assert not layer.ssm[0].any() and not layer.conv[0].any()
    mixer(torch.randn(1, 4, 16), layer, BatchMeta.decode(torch.tensor([0]), torch.tensor([0]), 4))


def test_num_accepted_out_of_range_is_rejected():
    cache = _replay_cache(_tiny_config())
    with pytest.raises(ValueError, match=r"\[1, T=3\]"):
        cache.commit(torch.tensor([0]), torch.tensor([0]))


def test_replay_without_speculation_is_an_error():
    config = _tiny_config()
    with pytest.raises(ValueError, match="speculative decoding"):
        HybridCache(
            config, {0: "mamba2"}, max_batch_size=2, max_seq_len=4, dtype=torch.float32, ssm_replay=True
        )
    with pytest.raises(ValueError, match="speculative decoding"):
        cache_memory_bytes(config, {0: "mamba2"}, max_batch_size=2, max_seq_len=4, dtype=torch.float32,
                           ssm_replay=True)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
@pytest.mark.parametrize(
    "spec_tokens, replay, checkpointing, ring", [(0, False, False, False), (4, False, False, False),
                                                 (4, True, False, False), (8, True, False, False),
                                                 (4, True, True, False), (4, True, False, True),
                                                 (4, True, True, True)]
)
def test_planned_memory_equals_allocated_bytes(family, spec_tokens, replay, checkpointing, ring):
    """ring: FlashInfer ring histories and ring_start for Mamba2 (kernels.mamba2.flashinfer_replay)."""
    config = HybridConfig.from_pretrained(REPO / f"registry/checkpoints/tiny_{family}_mtp")
    if ring:  # FlashInfer's contract has no dt clamp: a ring cache takes an unclamped model only
        config = dataclasses.replace(config, time_step_limit=(0.0, math.inf))
    kinds = model_cache_kinds(config, include_mtp=spec_tokens > 0)
    assert kinds == HybridLM(config, with_mtp=True).cache_kinds(include_mtp=spec_tokens > 0)
    args = dict(max_batch_size=3, max_seq_len=32, dtype=torch.bfloat16, spec_tokens=spec_tokens,
                ssm_replay=replay, replay_checkpointing=checkpointing, replay_ring=ring)
    if checkpointing and family == "qwen3_next":
        with pytest.raises(ValueError, match="mamba2 layers only"):
            HybridCache(config, kinds, **args)
        return
    cache = HybridCache(config, kinds, **args)
    allocated = cache.memory()
    planned = cache_memory_bytes(config, kinds, **args)
    assert planned == allocated
    assert (allocated["spec_buffers_bytes"] > 0) == (spec_tokens > 0)
    # the plan counts every tensor the cache holds, found by walking it (not through its own declaration)
    assert sum(planned.values()) == sum(t.numel() * t.element_size() for t in _all_tensors(cache))


def _all_tensors(obj, seen=None):
    """Every distinct tensor reachable through the attributes of ``obj`` (layers, histories, replay slots)."""
    seen = {} if seen is None else seen
    items = obj.items() if isinstance(obj, dict) else vars(obj).items() if hasattr(obj, "__dict__") else ()
    for _, v in items:
        if isinstance(v, torch.Tensor):
            seen.setdefault(id(v), v)
        elif isinstance(v, dict) or (hasattr(v, "__dict__") and not isinstance(v, (type, torch.dtype))):
            _all_tensors(v, seen)
    return list(seen.values())


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
@pytest.mark.parametrize("draft_len, replay", [(0, False), (3, False), (3, True)])
def test_engine_memory_plan_equals_its_allocated_tensors(family, draft_len, replay):
    """The engine's plan (``Engine.cache_memory``: what from_pretrained checks against the budget before
    allocating) equals the bytes of every per-slot tensor it then holds: the caches and the decode step's
    slot state, drafts on and off, replay on and off, both families."""
    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    engine = Engine.from_pretrained(REPO / f"registry/checkpoints/tiny_{family}_mtp",
                                    EngineOptions(draft_len=draft_len, ssm_replay=replay, max_batch_size=3,
                                                  max_seq_len=48))
    slots = engine.step.slots
    spec_slot_state = [t for t in (slots.mtp_hidden, slots.draft1) if t is not None]
    tensors = _all_tensors(engine.cache) + spec_slot_state
    plan = engine.cache_memory()
    assert sum(plan.values()) == sum(t.numel() * t.element_size() for t in tensors)
    assert (plan["spec_buffers_bytes"] > 0) == (draft_len > 0)
    assert engine.load_report.cache_bytes == sum(plan.values())


def _registry_memory(entry: str, replay: bool) -> dict[str, int]:
    doc = yaml.safe_load((REPO / "registry/model" / f"{entry}.yaml").read_text())
    config = config_from_arch(validate_entry(doc, name=entry).arch, doc["family"])
    K = doc["speculative"]["draft_len"]
    return cache_memory_bytes(
        config, model_cache_kinds(config), max_batch_size=doc["max_batch_size"],
        max_seq_len=doc["max_seq_len"], dtype=getattr(torch, doc["dtype"]),
        ssm_state_dtype=getattr(torch, doc["ssm"]["state_dtype"]), spec_tokens=K + 1, ssm_replay=replay,
    )


@pytest.mark.parametrize("entry", ["super_v3_mtp", "qwen3_next_mtp"])
def test_replay_spec_buffers_10x_smaller_at_released_shapes(entry):
    rewind, replay = _registry_memory(entry, False), _registry_memory(entry, True)
    for key in ("ssm_state_bytes", "conv_state_bytes", "kv_cache_bytes"):
        assert rewind[key] == replay[key] > 0
    assert rewind["spec_buffers_bytes"] >= 10 * replay["spec_buffers_bytes"] > 0


def test_mamba2_decay_rate_is_cached_only_in_the_inference_step(monkeypatch):
    """Mamba2Mixer.decay_rate: -exp(A_log) in float32; where the fused inference stages run
    (layers.use_inference_kernel) one tensor reused until A_log changes in place (a load bumps its version),
    stored only where layers.cacheable_now holds (not in a CUDA-graph capture) but read in a capture too, a
    new value written into the kept tensor in place; elsewhere recomputed at every call (CPU, training)."""
    import runners.engine.models.mamba2 as mamba2_mod

    torch.manual_seed(0)
    mixer = Mamba2Mixer(_tiny_config())
    with torch.no_grad():
        mixer.A_log.uniform_(-1.0, 1.0)
    first = mixer.decay_rate()
    assert torch.equal(first, -torch.exp(mixer.A_log.float())) and mixer.decay_rate() is not first
    monkeypatch.setattr(mamba2_mod, "use_inference_kernel", lambda x: True)
    capturing = [True]
    monkeypatch.setattr(mamba2_mod, "cacheable_now", lambda x: not capturing[0])
    # captured before any eager step: computed in the graph, nothing stored
    assert mixer.decay_rate() is not mixer.decay_rate() and mixer._A_cache is None
    capturing[0] = False  # the eager warm-up stores it ...
    cached = mixer.decay_rate()
    assert mixer.decay_rate() is cached and torch.equal(cached, first)
    capturing[0] = True  # ... and the capture reads it: no launch in the graph
    assert mixer.decay_rate() is cached
    capturing[0] = False
    with torch.no_grad():
        mixer.A_log.add_(0.5)  # an in-place update (as a checkpoint load): a new value
    fresh = mixer.decay_rate()
    # written into the kept tensor: a graph captured on it reads the new value
    assert fresh is cached and torch.equal(fresh, -torch.exp(mixer.A_log.float()))
    assert not torch.equal(fresh, first)
    # kept from an engine step (inference mode: an inference tensor), refreshed after a load outside it
    mixer._A_cache = None
    with torch.inference_mode():
        kept = mixer.decay_rate()
    assert kept.is_inference()
    with torch.no_grad():
        mixer.A_log.add_(0.25)
        assert mixer.decay_rate() is kept and torch.equal(kept, -torch.exp(mixer.A_log.float()))
    # a model built inside torch.inference_mode (as the engine tests build theirs): inference tensors carry
    # no version counter (reading it raised on the H200, gpu_suite_2), so nothing is cached for them
    with torch.inference_mode():
        frozen = Mamba2Mixer(_tiny_config())
    assert frozen.A_log.is_inference()
    once = frozen.decay_rate()
    assert frozen.decay_rate() is not once and torch.equal(once, -torch.exp(frozen.A_log.float()))


def test_attention_rope_frequencies_are_cached_only_where_cacheable(monkeypatch):
    """Attention._inv_freq (Qwen3-Next's RoPE frequencies, float32): recomputed at every call off the eager
    inference step (here the CPU), one tensor per device stored where layers.cacheable_now holds and read
    where layers.use_inference_kernel does (a CUDA-graph capture included); equal values either way."""
    import runners.engine.models.attention as attention_mod
    from runners.engine.models.attention import Attention, rope_inv_freq

    config = HybridConfig.from_pretrained(REPO / "registry/checkpoints/tiny_qwen3_next_mtp")
    attn = Attention(config)
    assert attn.rotary_dim > 0
    x = torch.zeros(1, 1, config.hidden_size)
    first = attn._inv_freq(x)
    assert torch.equal(first, rope_inv_freq(attn.rotary_dim, attn.rope_theta))
    assert attn._inv_freq(x) is not first
    monkeypatch.setattr(attention_mod, "use_inference_kernel", lambda t: True)
    capturing = [True]
    monkeypatch.setattr(attention_mod, "cacheable_now", lambda t: not capturing[0])
    assert attn._inv_freq(x) is not attn._inv_freq(x)  # captured first: nothing stored
    capturing[0] = False
    cached = attn._inv_freq(x)
    assert attn._inv_freq(x) is cached and torch.equal(cached, first) and cached.dtype == torch.float32
    capturing[0] = True  # a capture after the eager warm-up reads the stored value
    assert attn._inv_freq(x) is cached


@pytest.mark.gpu
def test_gpu_nothing_is_cached_while_a_cuda_graph_is_captured():
    """layers.cacheable_now: True in the eager inference step on CUDA, False while the current stream
    captures a graph (a launch captured there writes nothing until replay, so a cache filled then would hold
    unwritten memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from runners.engine.models.layers import cacheable_now

    x = torch.zeros(8, device="cuda")
    with torch.no_grad():
        assert cacheable_now(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
            inside = cacheable_now(x)
    assert not inside
