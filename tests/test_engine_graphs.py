"""The decode step as phases over static buffers (runners/engine/graphs.py): eager on the CPU, CUDA graphs
on a GPU.

CPU (the same restructured step a GPU captures):
- padded steps (live rows padded with PAD rows to a "captured" batch size, the KV bound rounded up to its
  bucket), with every static step buffer and every scratch row of the caches and of the per-slot decode
  state filled with garbage (NaN / 0x7BADBEEF) first, give the tokens, finish reasons and per-request
  acceptance counters of unpadded steps: plain decoding, MTP + rewind, MTP + replay, both families; the live
  slots' caches stay finite;
- queuing the next step before the host's bookkeeping of this one (``overlap_steps``) changes no token and
  no counter;
- forced acceptance (the benchmark hook) realises its acceptance length, and greedy decoding is back once
  it is removed;
- the helpers (KV buckets, default sizes, batch planning, the host ring) and the option checks.
GPU (``gpu`` marker, the shipped tiny checkpoints in float32): graph replay equals eager execution of the
same padded step bitwise -- tokens, finish reasons, counters and every live cache row -- with garbage in the
static buffers before the first capture, graphs captured in the middle of a generation (a new KV bucket),
and batches larger than the largest captured size run eagerly; graphs give the tokens of unpadded eager
steps; a step (graph or eager) queues without a host synchronisation (``torch.cuda.set_sync_debug_mode``);
the same bitwise equality in bfloat16 at the releases' head structure (grouped-GEMM MoE, forced acceptance).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint
from qwen_ckpt import write_qwen_checkpoint
from test_realdim_engine import ENGINE_SIZES

from runners.engine import Engine
from runners.engine.graphs import POISON_INT, HostRing, StepGraphs, default_graph_batch_sizes, kv_bucket
from runners.engine.options import EngineOptions
from runners.engine.runner import ModelRunner

REPO = Path(__file__).resolve().parents[1]
MAX_NEW, SLOTS = 10, 4
LIMITS = (10, 3, 7, 1, 9, 5, 10, 2)  # requests finish at different steps: batches of 4, 3, 2, 1 live rows
ARMS = [(0, False), (3, False), (3, True)]  # (draft_len, ssm_replay)


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "nemotron_h":
        path = write_checkpoint(folder, make_hf_model(seed=2, vocab_size=5, pattern="M*MEM"), with_mtp=True)
    else:
        path = write_qwen_checkpoint(folder / "ckpt", seed=2, vocab_size=5)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 30, (len(LIMITS),), generator=g).tolist()
    return path, [torch.randint(0, 5, (n,), generator=g).tolist() for n in lengths]


def _engine(path, K, replay, **kw):
    kw = {"max_batch_size": SLOTS, "max_seq_len": 64, **kw}
    return Engine.from_pretrained(path, EngineOptions(draft_len=K, ssm_replay=replay, **kw))


def _run(engine, prompts, limits=LIMITS, max_new=MAX_NEW):
    """tokens, finish reasons, per-request counters and the acceptance sums of one generate call."""
    request_stats = {}
    out = engine.generate(prompts, max_new, stop_token_ids=[], stop_checker=lambda i, t: len(t) >= limits[i],
                          on_finish=lambda i, toks, reason, st: request_stats.__setitem__(i, st))
    s = out.stats
    counters = (s.request_steps, s.drafted_tokens, s.accepted_drafts, s.accepted_per_position,
                s.num_accepted_hist, s.generated_tokens)
    return out.tokens, out.finish_reasons, request_stats, counters


def _tensors(obj, prefix=""):
    """(name, tensor) of every tensor reachable through the attributes of a cache layer state (its history,
    the shared replay slots)."""
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v
        elif hasattr(v, "__dict__") and not isinstance(v, (str, torch.dtype, torch.device)):
            yield from _tensors(v, f"{prefix}{k}.")


def _state_tensors(engine):
    """(name, tensor) of every per-slot buffer with S + 1 rows: the caches and the decode state."""
    out = [(f"cache[{i}].{n}", t) for i, layer in engine.cache.layers.items() for n, t in _tensors(layer)]
    return out + [(f"step.slots.{n}", t) for n, t in vars(engine.step.slots).items() if t is not None]


def _poison(engine):
    """Garbage in every static step buffer and in every scratch row (what a PAD row reads)."""
    engine.step.io.poison()
    R = engine.options.max_batch_size + 1
    for _, t in _state_tensors(engine):
        if t.dim() and t.shape[0] == R:
            t[R - 1] = float("nan") if t.is_floating_point() else POISON_INT


def _live_rows_finite(engine):
    S = engine.options.max_batch_size
    bad = [n for n, t in _state_tensors(engine) if t.is_floating_point() and not torch.isfinite(t[:S]).all()]
    assert not bad, f"non-finite values in live slot rows of {bad}: a PAD row leaked into a live slot"


def _diff(got, want, what):
    """A readable account of where two runs' outputs differ (None when they agree)."""
    lines = []
    for i, (g, w) in enumerate(zip(got[0], want[0])):
        if g != w:
            j = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            lines.append(f"request {i}: first differing token {j}: {g[j:j + 5]} vs {w[j:j + 5]}")
    if got[1] != want[1]:
        lines.append(f"finish reasons {got[1]} vs {want[1]}")
    for i in sorted(want[2]):
        if got[2].get(i) != want[2][i]:
            lines.append(f"request {i} counters {got[2].get(i)} vs {want[2][i]}")
    if got[3] != want[3]:
        lines.append(f"acceptance sums {got[3]} vs {want[3]}")
    return f"{what}:\n  " + "\n  ".join(lines) if lines else None


# ---------------------------------------------------------------------------------------------- CPU


@torch.inference_mode()
@pytest.mark.parametrize("K, replay", ARMS)
def test_padded_step_over_garbage_equals_unpadded(setup, K, replay):
    path, prompts = setup
    want = _run(_engine(path, K, replay), prompts)
    engine = _engine(path, K, replay)
    assert engine.graphs.mode == "eager_padded"  # the CPU runs the padded step eagerly
    engine.graphs.batch_sizes = [3]  # 1 or 2 live rows run with 2 or 1 PAD rows; 4 live rows unpadded
    planned = [engine.graphs.plan(n, 20) for n in (1, 2, 3, 4)]
    assert planned == [(3, 64, True), (3, 64, True), (3, 64, True), (4, 20, False)]
    _poison(engine)
    got = _run(engine, prompts)
    assert got == want, _diff(got, want, "padded steps over garbage vs unpadded")
    assert K == 0 or want[3][2] > 0  # drafts were accepted: commits of several lengths ran
    _live_rows_finite(engine)


class _OutstandingRunner(ModelRunner):
    """Counts how many launched steps were unread at once."""

    def launch(self, *a, **kw):
        self.outstanding = getattr(self, "outstanding", 0) + 1
        self.max_outstanding = max(getattr(self, "max_outstanding", 0), self.outstanding)
        return super().launch(*a, **kw)

    def read(self, step):
        self.outstanding -= 1
        return super().read(step)


class _Outstanding(Engine):
    runner_class = _OutstandingRunner


@torch.inference_mode()
@pytest.mark.parametrize("K, replay", [(0, False), (3, True)])
def test_running_the_next_step_ahead_changes_nothing(setup, K, replay):
    path, prompts = setup
    want = _run(_engine(path, K, replay), prompts)
    engine = _Outstanding.from_pretrained(path, EngineOptions(draft_len=K, ssm_replay=replay,
                                                              max_batch_size=SLOTS, max_seq_len=64,
                                                              overlap_steps=True))
    got = _run(engine, prompts)
    assert engine.runner.max_outstanding == 2  # a step was queued before the previous one was read
    assert got == want, _diff(got, want, "overlap_steps=True vs False")


@torch.inference_mode()
def test_forced_acceptance_realises_its_length(setup):
    path, prompts = setup
    engine = _engine(path, 3, True)
    engine.force_acceptance(2.6)
    out = engine.generate(prompts[:3], 40, stop_token_ids=[])
    s = out.stats
    assert abs(s.acceptance_length - 2.6) < 0.05, s.acceptance_length
    assert s.num_accepted_hist[0] == s.num_accepted_hist[1] == s.num_accepted_hist[4] == 0  # only 2 and 3
    engine.force_acceptance(None)  # greedy comparison again: the output is plain greedy decoding
    plain = _engine(path, 0, False).generate(prompts[:3], 8, stop_token_ids=[])
    assert engine.generate(prompts[:3], 8, stop_token_ids=[]).tokens == plain.tokens
    with pytest.raises(ValueError, match=r"must lie in \[1, K \+ 1 = 4\]"):
        engine.force_acceptance(4.5)
    with pytest.raises(ValueError, match="needs speculative decoding"):
        _engine(path, 0, False).force_acceptance(2.0)


def test_graph_options_on_the_cpu(setup, caplog):
    path, _ = setup
    with caplog.at_level(logging.WARNING):
        engine = _engine(path, 3, False, cuda_graphs=True)
    assert "cuda_graphs=True is ignored on cpu" in caplog.text
    assert not engine.step.cuda_graphs and not engine.options.overlap_steps and engine.capture_graphs() == 0
    with pytest.raises(ValueError, match=r"sizes \[2, 5\] must lie in \[1, max_batch_size=4\]"):
        _engine(path, 0, False, cuda_graph_batch_sizes=[2, 5])
    with pytest.raises(TypeError, match="unexpected keyword argument 'cuda_graph'"):
        _engine(path, 0, False, cuda_graph=True)


def test_step_helpers():
    assert [kv_bucket(b, 4096) for b in (1, 256, 257, 1000, 4096, 5000)] == [256, 256, 512, 1024, 4096, 4096]
    assert kv_bucket(100, 64) == 64  # never above max_seq_len
    assert default_graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_graph_batch_sizes(5) == [1, 2, 4, 5] and default_graph_batch_sizes(1) == [1]
    graphs = StepGraphs({}, None, [4, 1], 4096, torch.device("cpu"))
    assert graphs.batch_sizes == [1, 4]
    assert graphs.plan(1, 10) == (1, 256, True) and graphs.plan(3, 300) == (4, 512, True)
    assert graphs.plan(5, 300) == (5, 300, False)  # larger than the largest size: eager, exact bound
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        graphs.capture(4, 256)
    ring = HostRing(4, 2, torch.device("cpu"), size=2)
    a, b = ring.acquire(), ring.acquire()
    with pytest.raises(RuntimeError, match="every block holds an unread step"):
        ring.acquire()
    HostRing.release(a)
    assert ring.acquire() is a and b.busy


# ---------------------------------------------------------------------------------------------- GPU

TINY = {"nemotron_h": REPO / "registry/checkpoints/tiny_nemotron_h_mtp",
        "qwen3_next": REPO / "registry/checkpoints/tiny_qwen3_next_mtp"}
# one long prompt: its KV bound crosses 256 mid-generation, so a new bucket is captured with other slots live
GPU_LENGTHS, GPU_LIMITS = (5, 17, 33, 245, 9, 60, 2), (24, 9, 17, 20, 4, 12, 30)


def _gpu_prompts(vocab_size):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in GPU_LENGTHS]


def _gpu_engine(family, K, replay, **kw):
    kw = {"max_batch_size": 5, "max_seq_len": 512, "cuda_graph_batch_sizes": [1, 4], **kw}
    return Engine.from_pretrained(TINY[family], EngineOptions(dtype=torch.float32, draft_len=K,
                                                              ssm_replay=replay, **kw), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("K, replay", ARMS)
@torch.inference_mode()
def test_gpu_graph_replay_equals_eager_bitwise(family, K, replay):
    graph = _gpu_engine(family, K, replay)
    assert graph.step.cuda_graphs and graph.graphs.mode == "graph"
    _poison(graph)  # garbage in every static buffer and scratch row before the first capture
    eager = _gpu_engine(family, K, replay)
    eager.graphs.mode = "eager_padded"  # the same padded steps and KV buckets, no graphs
    plain = _gpu_engine(family, K, replay, cuda_graphs=False)  # unpadded eager steps
    prompts = _gpu_prompts(graph.config.vocab_size)
    outs = {name: _run(e, prompts, GPU_LIMITS, max(GPU_LIMITS))
            for name, e in (("graph", graph), ("eager", eager), ("plain", plain))}
    captured = sorted(k for k, v in graph.graphs.graphs.items() if v)
    failed = sorted(k for k, v in graph.graphs.graphs.items() if v is None)
    print(f"{family} K={K} replay={replay}: captured (batch, KV bound) {captured}, failed {failed}; "
          f"acceptance sums {outs['graph'][3]}")
    assert not failed, f"captures failed at {failed} (see the warning log)"
    assert (4, 512) in captured and len(captured) >= 2, captured  # (4, 512): captured mid-generation
    msg = _diff(outs["graph"], outs["eager"], "graph replay vs eager padded steps")
    S = graph.options.max_batch_size
    cache_diff = []
    for (name, a), (_, b) in zip(_state_tensors(graph), _state_tensors(eager)):
        if not torch.equal(a[:S], b[:S]):
            d = (a[:S].double() - b[:S].double()).abs()
            cache_diff.append(f"{name}: max abs diff {d.max().item():.3g} at {d.argmax().item()}")
    assert msg is None and not cache_diff, "\n".join([msg or "tokens agree"] + cache_diff)
    _live_rows_finite(graph)
    # padding changes the shapes of the GEMMs, not the greedy tokens
    msg = _diff(outs["graph"], outs["plain"], "graphs (padded) vs plain eager (unpadded) steps")
    assert msg is None, msg


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("K, replay, graphs", [(0, False, True), (3, False, True), (3, True, True),
                                               (3, True, False), (0, False, False)])
@torch.inference_mode()
def test_gpu_step_queues_without_host_sync(family, K, replay, graphs):
    engine = _gpu_engine(family, K, replay, cuda_graphs=graphs, max_batch_size=4, cuda_graph_batch_sizes=[4])
    prompts = _gpu_prompts(engine.config.vocab_size)[:3]
    slots = [0, 2, 3]  # a PAD row in the graph batch of 4
    engine.runner.prefill([p[:20] for p in prompts], slots)
    engine.runner.read(engine.runner.launch(slots, 256))  # warm-up: Triton JIT, capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = [engine.runner.launch(slots, 256) for _ in range(2)]  # two queued, as overlap_steps does
    finally:
        torch.cuda.set_sync_debug_mode("default")
    toks = [engine.runner.read(s) for s in steps]
    assert all(1 <= len(t) <= K + 1 for step in toks for t in step)


@pytest.mark.gpu
@pytest.mark.parametrize("replay", [False, True])
@torch.inference_mode()
def test_gpu_forced_acceptance_under_graphs(replay):
    engine = _gpu_engine("nemotron_h", 3, replay, max_batch_size=8, cuda_graph_batch_sizes=[8])
    engine.force_acceptance(2.6)
    out = engine.generate(_gpu_prompts(engine.config.vocab_size)[:6], 60, stop_token_ids=[])
    assert engine.graphs.graphs and all(engine.graphs.graphs.values())
    assert abs(out.stats.acceptance_length - 2.6) < 0.05, out.stats.acceptance_length


# the releases' head structure at tiny depth and width, in bfloat16: the grouped-GEMM MoE path (bf16 on sm90),
# Mamba2 d_state 128 / GDN 16 x 32 heads, as the benchmark runs them
@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(ENGINE_SIZES))
@pytest.mark.parametrize("replay", [False, True])
@torch.inference_mode()
def test_gpu_release_shapes_bf16_graph_equals_eager(family, replay):
    from runners.tools.synth import synthetic_model

    model, _ = synthetic_model(family, dtype=torch.bfloat16, device="cuda", **ENGINE_SIZES[family])
    options = EngineOptions(dtype=torch.bfloat16, draft_len=3, ssm_replay=replay, max_batch_size=5,
                            max_seq_len=512, cuda_graph_batch_sizes=[1, 4])
    # one model, two engines (own caches, buffers)
    graph, eager = Engine(model, options, device="cuda"), Engine(model, options, device="cuda")
    assert graph.graphs.mode == "graph"
    eager.graphs.mode = "eager_padded"
    _poison(graph)
    for e in (graph, eager):
        e.force_acceptance(2.6)  # random weights: a fixed acceptance schedule, the same in both engines
    prompts = _gpu_prompts(2048)
    got, want = (_run(e, prompts, GPU_LIMITS, max(GPU_LIMITS)) for e in (graph, eager))
    captured = sorted(k for k, v in graph.graphs.graphs.items() if v)
    print(f"{family} replay={replay}: captured {captured}; acceptance sums {got[3]}")
    assert captured and all(graph.graphs.graphs.values()), graph.graphs.graphs
    msg = _diff(got, want, "bf16 graph replay vs eager padded steps")
    assert msg is None, msg
    slots = [0, 2, 3]  # and a step of the grouped-GEMM path queues without a host synchronisation
    graph.runner.prefill([p[:20] for p in prompts[:3]], slots)
    graph.runner.read(graph.runner.launch(slots, 256))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = graph.runner.launch(slots, 256)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.runner.read(step)


@pytest.mark.gpu
def test_gpu_failed_capture_runs_eagerly_or_raises_when_strict(caplog):
    """A phase that synchronises with the host cannot be captured: by default that (B, L) is logged and runs
    eagerly (its result still right); with ``strict`` (tensor-parallel ranks, runners.engine.launch) the
    capture raises, naming the batch size and KV bound."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from runners.engine.graphs import StepIO

    io = StepIO.allocate(4, 0, 8, torch.float32, "cuda")

    def phase(B: int, L: int) -> None:  # .item() synchronises: illegal while capturing
        io.tokens[:B, 0] = io.start_pos[:B] + int(io.slot_ids[:B].sum().item() != 0)

    graphs = StepGraphs({"decode": phase}, io, [2], 256, torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="runners.engine.graphs"):
        graphs.ensure(2, 256, True)
    assert graphs.graphs[(2, 256)] is None and "this size runs eagerly" in caplog.text
    io.start_pos[:2] = torch.tensor([5, 7])
    io.slot_ids[:2] = torch.tensor([0, 1])
    graphs.run(2, 256, True)
    assert io.tokens[:2, 0].tolist() == [6, 8]  # eager, the same phase
    strict = StepGraphs({"decode": phase}, io, [2], 256, torch.device("cuda"))
    strict.strict = True
    with pytest.raises(RuntimeError, match=r"capture of the decode step at batch 2, KV bound 256 failed"):
        strict.ensure(2, 256, True)
    # the failed captures left the default generator usable: random draws on the device still work (they
    # raised "Offset increment outside graph capture" in every later test of the process before)
    assert torch.randn(4, device="cuda").isfinite().all()
