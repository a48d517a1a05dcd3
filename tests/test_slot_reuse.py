"""A request's tokens do not depend on what its cache slot held before (issue 46, item 13).

Every per-slot buffer of a used engine -- the attention KV rows (target and MTP) at every position, the
recurrent conv / SSM states, the rewind buffers, the replay histories and bookkeeping, the decode step's slot
state -- is overwritten with what a broken previous occupant could have left (NaN, inf, stale counters);
then a new request is admitted and must generate exactly the tokens it generated on the fresh engine, with
no layer flagged non-finite. Covered: plain decode alone and beside a longer request, MTP drafting with
draft_len 3 (draft, verify, commit, catch-up) alone and beside a longer request under rewind and replay, a
chunked prefill, and a prefix-cache restore; both tiny families.
"""

from __future__ import annotations

import pytest
import torch

from registry.schema import REPO_ROOT
from runners.engine import Engine
from runners.engine.options import EngineOptions

CKPTS = REPO_ROOT / "registry" / "checkpoints"
FAMILIES = ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp")
MAX_NEW = 12

_gen = torch.Generator().manual_seed(46)
LONG = torch.randint(3, 2048, (40,), generator=_gen).tolist()
SHORT = torch.randint(3, 2048, (5,), generator=_gen).tolist()


def _engine(name: str, **options) -> Engine:
    base = dict(max_batch_size=2, max_seq_len=96, dtype="float32", prefix_cache=False)
    return Engine.from_pretrained(CKPTS / name, EngineOptions(**(base | options)))


def _cache_tensors(engine: Engine) -> list[torch.Tensor]:
    """Every tensor a slot owns: each cache layer's declared buffers (KV, conv, SSM, rewind / replay
    buffers; ``LayerState.layout``), the replay bookkeeping and the decode step's slot state."""
    out = []
    for layer in engine.cache.layers.values():
        for name in layer.layout:
            t = layer
            for part in name.split("."):
                t = getattr(t, part)
            out.append(t)
    replay = engine.cache.replay
    if replay is not None:
        out += [replay.prev_num_accepted, replay.buffer_index, replay.last_accepted]
    s = engine.step.slots
    out += [t for t in (s.length, s.last_token, s.mtp_hidden, s.draft1) if t is not None]
    return out


def _poison(engine: Engine, scratch: bool = True) -> int:
    """Leave every slot (with ``scratch`` the scratch row too) as a broken occupant could: floats alternate
    NaN / +inf / -inf along each tensor's flattened rows, integer bookkeeping holds 1 (a stale "one token
    accepted, buffer 1"). Every buffer's first axis is the S + 1 cache rows. Returns the number of tensors
    poisoned."""
    tensors = _cache_tensors(engine)
    for t in tensors:
        t = t if scratch else t[: engine.options.max_batch_size]
        if t.dtype.is_floating_point:
            bad = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(t.numel() // 3 + 1)
            t.view(-1).copy_(bad[: t.numel()].to(t.dtype))  # (an FP8 KV cache: e4m3fn's NaN)
        else:
            t.fill_(1)
    return len(tensors)


def _fresh_then_poisoned(engine: Engine, prompts: list[list[int]], scratch: bool = True
                         ) -> tuple[list, list, list]:
    """(tokens on the fresh engine, tokens after poisoning every slot, layers flagged non-finite then)."""
    first = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert first.nonfinite == []
    assert _poison(engine, scratch) > 0
    again = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    return first.tokens, again.tokens, again.nonfinite


CASES = {
    # (options, prompts): the short request decoded alone or beside a longer one
    "decode_alone": (dict(draft_len=0), [SHORT]),
    "decode_beside_longer": (dict(draft_len=0), [LONG, SHORT]),
    "mtp_alone": (dict(draft_len=3), [SHORT]),
    "mtp_beside_longer": (dict(draft_len=3), [LONG, SHORT]),
    "mtp_replay_beside_longer": (dict(draft_len=3, ssm_replay=True), [LONG, SHORT]),
    # a chunked prefill: each later chunk reads the slot's KV up to the batch's longest row
    "chunked_prefill": (dict(draft_len=3, prefill_chunk_tokens=8), [LONG, SHORT]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", FAMILIES)
def test_new_request_ignores_what_the_slot_held(name, case):
    options, prompts = CASES[case]
    fresh, poisoned, nonfinite = _fresh_then_poisoned(_engine(name, **options), prompts)
    assert poisoned == fresh
    assert nonfinite == []


@pytest.mark.parametrize("name", FAMILIES)
def test_prefix_cache_restore_ignores_what_the_slot_held(name):
    """The restore writes positions [0, L) of the admitted slot; the rest of the slot must not leak into the
    prefill of the remainder or the decode after it."""
    engine = _engine(name, draft_len=3, prefix_cache=True)
    prefix = LONG[:32]
    engine.generate([prefix], 1, stop_token_ids=[])  # stores the prefix
    prompts = [prefix + SHORT]
    fresh = _engine(name, draft_len=3, prefix_cache=False).generate(prompts, MAX_NEW, stop_token_ids=[])
    _poison(engine)
    out = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert out.stats.prefix_cache_hit_tokens > 0  # the restore ran
    assert out.tokens == fresh.tokens
    assert out.nonfinite == []


def test_fp8_kv_cache_slot_is_cleared_too():
    """An FP8 KV cache holds e4m3fn's NaN (0x7f) just as well; admission clears it the same way."""
    engine = Engine.from_pretrained(CKPTS / "tiny_nemotron_h_mtp", EngineOptions(
        max_batch_size=2, max_seq_len=96, dtype="float32", prefix_cache=False, draft_len=3,
        kv_cache_quant="fp8"))
    fresh, poisoned, nonfinite = _fresh_then_poisoned(engine, [LONG, SHORT])
    assert poisoned == fresh
    assert nonfinite == []


@pytest.mark.gpu
@pytest.mark.parametrize("K, replay", [(0, False), (3, False), (3, True)])
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_cuda_graphs_new_requests_ignore_what_the_slots_held(name, K, replay):
    """On CUDA: Triton kernels, the step as CUDA graphs padded to batch 4 (three requests and a PAD row,
    KV read up to the graph's bucket), the device path of the KV reset. Every live slot poisoned (the
    scratch row is the PAD rows', not a request's: left as the model wrote it), the same tokens."""
    options = EngineOptions(draft_len=K, ssm_replay=replay, max_batch_size=4, max_seq_len=96, dtype="float32",
                            prefix_cache=False, cuda_graphs=True, cuda_graph_batch_sizes=[4])
    engine = Engine.from_pretrained(CKPTS / name, options, device="cuda")
    assert engine.step.cuda_graphs
    fresh, poisoned, nonfinite = _fresh_then_poisoned(engine, [LONG, SHORT, LONG[:17]], scratch=False)
    assert poisoned == fresh
    assert nonfinite == []
    assert engine.graphs.graphs and all(engine.graphs.graphs.values())  # the steps ran as graphs
