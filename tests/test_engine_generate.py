"""Engine.generate against a greedy loop over transformers' forward, plus the generate contract.

Checks: greedy tokens equal the oracle's; batching different prompt lengths and continuous batching
(fewer slots than prompts) give each prompt's tokens alone; stop_token_ids / stop_checker / on_finish /
progress behave; option errors; cache_memory and GenerationStats.to_dict.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint

from runners.engine import Engine, GenerationStats
from runners.engine.options import EngineOptions

MAX_NEW = 10
PROMPT_LENS = (7, 1, 19, 12, 3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = make_hf_model(seed=5)
    path = write_checkpoint(tmp_path_factory.mktemp("gen"), hf, with_mtp=True)
    torch.manual_seed(11)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,)).tolist() for n in PROMPT_LENS]
    with torch.inference_mode():
        expected = [_oracle_greedy(hf, p, MAX_NEW) for p in prompts]
    return hf, path, prompts, expected


def _oracle_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards of transformers' model (no cache involved)."""
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(hf(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_greedy_batch_matches_transformers(setup):
    hf, path, prompts, expected = setup
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=8, max_seq_len=64))
    ids = torch.tensor([prompts[0], prompts[3][:7]])
    with torch.inference_mode():
        torch.testing.assert_close(engine.logits(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert engine.generate([], MAX_NEW).tokens == []
    out = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert out.tokens == expected
    assert out.finish_reasons == ["length"] * len(prompts)
    s = out.stats
    assert (s.num_requests, s.prompt_tokens, s.generated_tokens) == (5, sum(PROMPT_LENS), 5 * MAX_NEW)
    assert s.steps == MAX_NEW - 1  # the first token of every request comes from its prefill
    d = s.to_dict()
    assert d["generated_tokens"] == 5 * MAX_NEW and d["drafted_tokens"] == 0 and isinstance(d, dict)


def test_transformers_generate_agrees(setup):
    hf, path, prompts, expected = setup
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompts[2]]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert ref[0, len(prompts[2]) :].tolist() == expected[2]


def test_each_prompt_alone_and_continuous_batching_agree(setup):
    _, path, prompts, expected = setup
    alone = Engine.from_pretrained(path, EngineOptions(max_batch_size=1, max_seq_len=64))
    assert [alone.generate([p], MAX_NEW, stop_token_ids=[]).tokens[0] for p in prompts[:2]] == expected[:2]
    # 2 slots for 5 prompts: requests join as others leave; small prefill chunks force chunked prefill, of
    # both admitted prompts together (padded rows, as on a GPU; the CPU's default prefills one per forward)
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=2, max_seq_len=64,
                                                        prefill_chunk_tokens=6, prefill_max_rows=2))
    finished_order = []
    out = engine.generate(
        prompts, MAX_NEW, stop_token_ids=[], on_finish=lambda i, toks, reason, stats: finished_order.append(i)
    )
    assert out.tokens == expected
    assert sorted(finished_order) == list(range(5))


def test_stop_tokens_checker_and_on_finish(setup):
    _, path, prompts, expected = setup
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=3, max_seq_len=64))
    stop_tok = expected[0][3]
    first_stop = expected[0].index(stop_tok)
    calls, progress = [], []

    def checker(i, toks):
        return i == 1 and len(toks) == 4

    def on_finish(i, toks, reason, request_stats):
        calls.append((i, list(toks), reason))
        # no speculation: no request-steps; the token counts are the request's own
        assert request_stats == {
            "request_steps": 0, "drafted_tokens": 0, "accepted_drafts": 0, "accepted_per_position": [],
            "num_accepted_hist": [], "generated_tokens": len(toks), "prompt_tokens": len(prompts[i]),
            # every request looks the prefix cache up; these random prompts share no prefix
            "prefix_cache_queries": 1, "prefix_cache_query_tokens": len(prompts[i]), "prefix_cache_hits": 0,
            "prefix_cache_hit_tokens": 0}

    out = engine.generate(
        prompts,
        MAX_NEW,
        stop_token_ids=[stop_tok],
        stop_checker=checker,
        on_finish=on_finish,
        progress=lambda done, total: progress.append((done, total)),
    )
    assert out.tokens[0] == expected[0][: first_stop + 1]  # the stop token is kept
    assert out.finish_reasons[0] == "stop_token"
    for i in range(5):  # what each request must have produced: the first stop condition wins
        want, reason = expected[i], "length"
        for n in range(1, MAX_NEW + 1):
            if expected[i][n - 1] == stop_tok:
                want, reason = expected[i][:n], "stop_token"
                break
            if checker(i, expected[i][:n]):
                want, reason = expected[i][:n], "stop_checker"
                break
        assert (out.tokens[i], out.finish_reasons[i]) == (want, reason)
    assert out.finish_reasons[1] in ("stop_checker", "stop_token")
    assert sorted(c[0] for c in calls) == list(range(5))  # once per request
    assert {c[0]: (c[1], c[2]) for c in calls} == {
        i: (out.tokens[i], out.finish_reasons[i]) for i in range(5)
    }
    assert progress[-1] == (5, 5) and len(progress) == 5


def test_default_stop_is_eos(setup):
    _, path, prompts, _ = setup
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=2, max_seq_len=64))
    out = engine.generate(prompts, MAX_NEW)  # stop_token_ids=None -> config eos (2)
    for toks, reason in zip(out.tokens, out.finish_reasons):
        assert (reason == "stop_token") == (2 in toks)
        assert 2 not in toks[:-1]


def test_option_and_input_errors(setup, tmp_path):
    hf, path, prompts, _ = setup
    with pytest.raises(ValueError, match="ssm_replay requires speculative decoding"):
        Engine.from_pretrained(path, EngineOptions(ssm_replay=True))
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_batch'"):
        Engine.from_pretrained(path, EngineOptions(max_batch=4))
    for bad, says in [(dict(max_batch_size=0), "max_batch_size=0 must be an integer >= 1"),
                      (dict(prefill_chunk_tokens=0), "prefill_chunk_tokens=0 must be an integer >= 1"),
                      (dict(dtype="float64"), "dtype 'float64' is not supported"),
                      (dict(kv_cache_quant="int8"), "kv_cache_quant='int8' is not one of"),
                      (dict(ssm_replay_checkpointing=True), "variant of ssm_replay"),
                      (dict(max_batch_size=2, cuda_graph_batch_sizes=[4]),
                       r"must lie in \[1, max_batch_size=2\]")]:
        with pytest.raises(ValueError, match=says):
            EngineOptions(**bad).validate()
    no_mtp = write_checkpoint(tmp_path / "nomtp", hf, with_mtp=False)
    with pytest.raises(ValueError, match="needs MTP weights|mtp"):
        Engine.from_pretrained(no_mtp, EngineOptions(draft_len=3))
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=2, max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([prompts[2]], 10)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[hf.config.vocab_size]], 1)


def test_draft_len_is_stored_and_mtp_cache_allocated(setup):
    _, path, prompts, expected = setup
    plain = Engine.from_pretrained(path, EngineOptions(max_batch_size=2, max_seq_len=32))
    spec = Engine.from_pretrained(path, EngineOptions(draft_len=3, ssm_replay=True, max_batch_size=2,
                                                      max_seq_len=32))
    assert spec.options.draft_len == 3 and spec.options.ssm_replay and spec.model.mtp is not None
    m0, m1 = plain.cache_memory(), spec.cache_memory()
    assert set(m0) == {"ssm_state_bytes", "conv_state_bytes", "kv_cache_bytes", "spec_buffers_bytes"}
    assert m1["kv_cache_bytes"] > m0["kv_cache_bytes"]  # the MTP attention block has its own KV cache
    assert m0["spec_buffers_bytes"] == 0
    assert spec.generate(prompts[:2], MAX_NEW, stop_token_ids=[]).tokens == expected[:2]


def test_generation_stats_to_dict_roundtrip():
    s = GenerationStats(num_requests=2, steps=3)
    d = s.to_dict()
    assert d["acceptance_rate"] is None and d["acceptance_length"] is None  # nothing drafted
    assert GenerationStats.from_dict(d) == s


def test_every_public_runner_method_is_a_lockstep_command():
    """The tensor-parallel lockstep wraps ``ModelRunner.COMMANDS`` (runners.engine.launch.LockstepRunner): a
    public runner method that runs the model left out of it would run on rank 0 only, and the ranks'
    collectives would not pair. ``cache_memory`` is arithmetic on the architecture (no model run)."""
    import inspect

    from runners.engine.launch import LockstepRunner
    from runners.engine.runner import ModelRunner

    public = {name for name, f in vars(ModelRunner).items()
              if not name.startswith("_") and inspect.isfunction(f)}
    assert public == set(ModelRunner.COMMANDS) | {"cache_memory"}
    assert all(name in vars(LockstepRunner) for name in ModelRunner.COMMANDS)


def test_the_scheduler_plans_admission_after_reading_queued_steps():
    """Scheduler.schedule: with waiting requests and a free slot every queued step is read first, one plan
    each; then one plan admits into every free slot (slot 0 first); with nothing to admit it launches over
    the active slots and, with overlap, reads the previous step while the new one runs."""
    from runners.engine.prefill import Prefilled
    from runners.engine.scheduler import Scheduler

    options = EngineOptions(max_batch_size=2, max_seq_len=64, overlap_steps=True)
    sched = Scheduler([[1, 2], [3], [4, 5, 6]], 4, set(), None, None, lambda done: None, options)
    plan = sched.schedule()
    assert (plan.admit, plan.slots, plan.launch, plan.read) == ([0, 1], [0, 1], [], False)
    sched.admitted(plan, Prefilled(taken=[0, 1], tokens=[7, 8]))
    assert sched.slot_request == [0, 1] and list(sched.waiting) == [2]
    plan = sched.schedule()  # no free slot: a step over both, kv bound = longest prompt + T
    assert (plan.admit, plan.launch, plan.kv_bound, plan.read) == ([], [0, 1], 3, False)
    sched.launched(plan, "handle-1")
    plan = sched.schedule()  # overlap: the next step is queued, the previous one read meanwhile
    assert (plan.launch, plan.kv_bound, plan.read) == ([0, 1], 4, True)
    sched.launched(plan, "handle-2")
    assert sched.oldest == "handle-1"
    sched.read([[9], [2]])
    assert sched.out_tokens[:2] == [[7, 9], [8, 2]]
