"""Tensor parallelism on the CPU with gloo (runners/engine/tp.py, runners/engine/launch.py): world size 2
and 4 give the
same greedy tokens, the same acceptance and float32 logits within 1e-5 (absolute, or relative to logits up to
~10: the ranks' partial sums round differently) of world size 1, replay on and off, both families;
`python run.py model=tiny_nemotron_h_mtp world_size=2 eval.limit=8` equals world_size=1; a failing or stuck
rank is reported with its rank and the others are ended; Ctrl-C ends every rank.

Checkpoints: the shipped tiny ones (trained: real MTP acceptance) at world size 2; copies of them padded to
head counts 4 divides (tp_cases.pad_tiny_checkpoint: same outputs) at 4; synthetic ones at widths that hit
every rule of runners/engine/tp.py (biases, a dense MLP, GDN K != V, KV heads and mamba groups fewer than
ranks) at 2
and 4. Each world size is one launch (process start-up costs seconds) running every case.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import tp_cases
from tp_cases import ARMS, pad_tiny_checkpoint, run_cases, write_tp_checkpoint

from registry.arch import check_world_size
from registry.errors import UserError
from registry.hf_config import HybridConfig
from runners.engine import Engine
from runners.engine.launch import RankFailure, launch
from runners.engine.loader import materialize, plan_load
from runners.engine.tp import TensorParallel, rank_config, shard_plan

REPO = Path(__file__).resolve().parents[1]
TINY = {f: str(tp_cases.TINY_CHECKPOINTS / f) for f in ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp")}
# Sharded matmuls and all-reduces sum in another order than one process: |difference| <= 1e-5 (|logit| + the
# largest |logit| of the batch). An absolute 1e-5 alone is ~10 fp32 ulps of the tiny checkpoints' largest
# logits (~14); reorderings reached 1.4e-5 on an AMD EPYC (AVX2) CI machine. A sharding bug moves logits by
# O(0.1) or more.
LOGITS_TOL = 1e-5


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Sharded logits `got` against one process's `want` within LOGITS_TOL's bound."""
    torch.testing.assert_close(got, want, rtol=LOGITS_TOL, atol=LOGITS_TOL * want.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    out = dict(TINY)
    for name, path in TINY.items():
        out[f"{name}_padded"] = str(pad_tiny_checkpoint(Path(path), root / f"{name}_padded"))
    for family in ("nemotron_h", "qwen3_next"):
        out[f"synth_{family}"] = str(write_tp_checkpoint(root / f"synth_{family}", family))
    return out


WS_CASES = {
    2: ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp", "synth_nemotron_h", "synth_qwen3_next"),
    4: ("tiny_nemotron_h_mtp_padded", "tiny_qwen3_next_mtp_padded", "synth_nemotron_h", "synth_qwen3_next"),
}


# At world size 4 the drafted arms only: the plain arm's decode runs the same sharded layers as their
# verify, and world size 2 runs it (a launch of 4 ranks on the 2-core CI machine costs a minute).
WS_ARMS = {2: ARMS, 4: ARMS[:2]}
PREFIX_CHECKPOINTS = ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp")


@pytest.fixture(scope="module")
def world_size_1(checkpoints) -> dict:
    names = sorted({n for cases in WS_CASES.values() for n in cases})
    return run_cases(Engine.from_pretrained, [checkpoints[n] for n in names])


@pytest.fixture(scope="module")
def world_size_2(checkpoints) -> tuple[dict, dict]:
    """One launch at world size 2 for two tests (a launch's start-up costs seconds): tp_cases of
    WS_CASES[2] and tp_prefix_cases of PREFIX_CHECKPOINTS."""
    return launch(tp_cases.tp_cases_and_prefix_cases, ([checkpoints[n] for n in WS_CASES[2]],
                                                       [checkpoints[n] for n in PREFIX_CHECKPOINTS]),
                  world_size=2, num_threads=1, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(WS_CASES))
def test_world_size_equals_world_size_1(world_size, checkpoints, world_size_1, request):
    paths = [checkpoints[n] for n in WS_CASES[world_size]]
    if world_size == 2:
        got = request.getfixturevalue("world_size_2")[0]
    else:
        got = launch(functools.partial(tp_cases.tp_cases, arms=WS_ARMS[world_size]), (paths,),
                     world_size=world_size, num_threads=1, timeout_s=300)
    assert {k for k in got if k[1] != "logits"} == {(p, *arm) for p in paths for arm in WS_ARMS[world_size]}
    for path in paths:
        assert_logits_close(got[(path, "logits")], world_size_1[(path, "logits")], path)
        diff = (got[(path, "logits")] - world_size_1[(path, "logits")]).abs().max().item()
        print(f"world_size={world_size} {Path(path).name}: max |logit difference| {diff:.2e}")
        for draft_len, replay in WS_ARMS[world_size]:
            want, have = world_size_1[(path, draft_len, replay)], got[(path, draft_len, replay)]
            arm = f"{Path(path).name} draft_len={draft_len} ssm_replay={replay} world_size={world_size}"
            assert have["tokens"] == want["tokens"], arm
            assert have["acceptance"] == want["acceptance"], arm
            # every cache holds this rank's heads: the recurrent state is split exactly
            assert have["memory"]["ssm_state_bytes"] * world_size == want["memory"]["ssm_state_bytes"], arm
            assert have["memory"]["kv_cache_bytes"] < want["memory"]["kv_cache_bytes"], arm
            assert have["weight_bytes"] < want["weight_bytes"], arm
            if draft_len:
                assert have["memory"]["spec_buffers_bytes"] < want["memory"]["spec_buffers_bytes"], arm
    trained = [p for p in paths if "tiny" in p]
    assert all(got[(p, 3, False)]["acceptance"]["accepted"] > 0 for p in trained)  # real drafting


def test_rank_config_and_shards_partition_the_weights():
    """Two ranks' shards of the tiny NemotronH (no process group needed at world size 2: its 2 mamba groups
    split) hold every sharded weight exactly once; replicated tensors are whole on both."""
    plan = plan_load(TINY["tiny_nemotron_h_mtp"], load_mtp=True)
    full = materialize(plan_load(TINY["tiny_nemotron_h_mtp"], load_mtp=True)).state_dict()
    ranks = [shard_plan(plan, TensorParallel(r, 2)) for r in range(2)]
    assert ranks[0].config.num_attention_heads == 3 and ranks[0].config.num_key_value_heads == 1
    assert ranks[0].config.mamba_num_heads == 6 and ranks[0].config.n_groups == 1
    assert ranks[0].config.moe_intermediate_size == 64 and ranks[0].config.n_routed_experts == 8
    assert ranks[0].weight_bytes < plan.weight_bytes
    models = [materialize(p).state_dict() for p in ranks]
    for name, t in full.items():
        a, b = models[0][name], models[1][name]
        if a.shape == t.shape:
            if name.endswith(("o_proj.bias", "out_proj.bias", "down_proj.bias")):
                assert not b.any()  # row-parallel bias: rank 0 only
            else:
                assert torch.equal(a, t) and torch.equal(b, t), name
            continue
        dim = next(d for d in range(t.dim()) if a.shape[d] != t.shape[d])
        if name.endswith(("in_proj.weight", "conv1d.weight", "conv1d.bias")):  # [z | x | B | C | dt] parts
            assert a.shape[dim] + b.shape[dim] == t.shape[dim]
            continue
        assert torch.equal(torch.cat([a, b], dim=dim), t), name


def test_world_size_errors_name_the_dimension():
    nemotron = HybridConfig.from_pretrained(TINY["tiny_nemotron_h_mtp"])
    qwen = HybridConfig.from_pretrained(TINY["tiny_qwen3_next_mtp"])
    with pytest.raises(UserError, match=r"world_size=4 does not divide the attention heads=6"):
        rank_config(nemotron, 4)
    with pytest.raises(UserError, match=r"GDN key heads=2"):
        check_world_size(qwen, 4, "tiny_qwen3_next_mtp")
    with pytest.raises(UserError, match=r"moe_intermediate_size=128, shared expert intermediate size=256"):
        check_world_size(nemotron, 3, "tiny_nemotron_h_mtp")
    assert rank_config(qwen, 2).gdn_num_value_heads == 2 and rank_config(qwen, 1) is qwen


@pytest.fixture
def launch_tmp(tmp_path, monkeypatch) -> Path:
    """A launch from a process whose torch intra-op thread pool is up (as a process that ran work before),
    with a fresh temporary folder: a test checks that the launch left nothing there (no hybrid-launch-*
    folder, no pytorch-errorfile-*)."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    torch.ones(64, 64) @ torch.ones(64, 64)  # the parent's intra-op pool is up
    return tmp_path


@pytest.mark.slow
def test_failing_rank_is_reported_and_the_others_end(launch_tmp):
    """Rank 1 raises (a UserError) while rank 0 waits in a barrier it cannot complete: the launch raises
    the error with rank 1 named, at once rather than after the collective timeout, and leaves nothing in
    the temporary folder."""
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        launch(tp_cases.fail_on_rank1, world_size=2, all_ranks=True, timeout_s=120)
    assert e.value.problem == "rank 1 of 2: the checkpoint of rank 1 is unreadable"
    assert e.value.fix == "fix rank 1's files"
    assert time.monotonic() - t0 < 100  # not the 120 s collective timeout
    assert sorted(p.name for p in launch_tmp.iterdir()) == []


@pytest.mark.slow
def test_stuck_collective_times_out():
    """Rank 1 is alive but never joins the all-reduce: rank 0's collective raises after timeout_s."""
    with pytest.raises(RankFailure) as e:
        launch(tp_cases.stall_rank1, world_size=2, all_ranks=True, timeout_s=3)
    assert e.value.rank == 0 and "rank 0 of 2 failed" in str(e.value)
    assert "timeout" in str(e.value).lower() or "timed out" in str(e.value).lower()


@pytest.mark.slow
def test_killed_rank_0_is_named_first():
    """Rank 0 dies of SIGKILL while rank 1 waits for it in a barrier: the error names rank 0 and the signal
    first; rank 1's lost connection (the consequence) comes after it, never as the cause."""
    with pytest.raises(RankFailure) as e:
        launch(tp_cases.kill_rank0, world_size=2, all_ranks=True, timeout_s=120)
    message = str(e.value)
    assert e.value.rank == 0, message
    assert message.startswith("rank 0 of 2 was killed by SIGKILL"), message


@pytest.mark.slow
def test_stalled_launch_ends_with_an_error_naming_the_ranks(launch_tmp):
    """Every rank waits forever outside any collective (no torch.distributed timeout applies): the launch
    ends with an error naming each rank and the line it waits on, within the stall timeout, never a hang,
    and leaves nothing in the temporary folder."""
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        launch(tp_cases.stall_every_rank, world_size=2, all_ranks=True, timeout_s=600, stall_timeout_s=4)
    elapsed = time.monotonic() - t0
    message = str(e.value)
    assert "stopped making progress" in message and "rank 0:" in message and "rank 1:" in message, message
    assert "stall_every_rank" in message, message  # where the ranks wait, from their stack dumps
    assert elapsed < 4 + 120 + 30, elapsed  # the stall limit, the start-up allowance, ending the ranks
    assert sorted(p.name for p in launch_tmp.iterdir()) == []


@pytest.mark.slow
def test_launch_from_a_process_with_threads_and_held_locks(launch_tmp):
    """The launching process initialised torch's thread pool and holds a lock in a background thread (as a
    process that ran CUDA work, a data loader or a logger thread does): the ranks start clean (spawned, not
    forked: a forked rank would inherit the lock held and wait forever) and the launch leaves nothing in
    the temporary folder (no hybrid-launch-* folder, no pytorch-errorfile-*). (After a rank's failure and
    a stall alike: the failing-rank and stalled-launch tests check the folder too.)"""
    release = __import__("threading").Event()
    holder = __import__("threading").Thread(target=lambda: (tp_cases.HELD.acquire(), release.wait(),
                                                            tp_cases.HELD.release()), daemon=True)
    holder.start()
    try:
        assert launch(tp_cases.take_held_lock, world_size=2, all_ranks=True, timeout_s=60)
    finally:
        release.set()
        holder.join()
    assert sorted(p.name for p in launch_tmp.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_ends_every_rank(tmp_path):
    """SIGINT to the launching process ends it and both ranks (which wait in a never-ending collective)."""
    # Ctrl-C's handler restored first: a suite started as a background job (`cmd &` in a script) ignores
    # SIGINT, and its children inherit that
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
            "import tp_cases\nfrom runners.engine.launch import launch\n"
            f"launch(tp_cases.record_pid_and_wait, ({str(tmp_path)!r},), world_size=2, all_ranks=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 240
    while not all(f.is_file() and f.read_text() for f in pid_files):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.2)
    pids = [int(f.read_text()) for f in pid_files]
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in stderr
    deadline = time.monotonic() + 20
    while any(tp_cases.pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(tp_cases.pid_alive(p) for p in pids)


@pytest.mark.slow
def test_run_py_world_size_2_equals_world_size_1(tmp_path):
    """The issue's command: `python run.py model=tiny_nemotron_h_mtp world_size=2 eval.limit=8` on the CPU
    generates exactly what world_size=1 generates (every token of the 8 GSM8K samples) with the same
    acceptance counters."""
    from registry.compose import compose_config
    from runners.app import main as app

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    runs = {}
    for ws in (1, 2):
        out = tmp_path / f"ws{ws}"
        if ws == 1:  # the reference, in process (the application run.py calls)
            app.run(compose_config(["model=tiny_nemotron_h_mtp", "world_size=1", "eval.limit=8",
                                    f"out_dir={out}"]))
        else:
            proc = subprocess.run([sys.executable, "run.py", "model=tiny_nemotron_h_mtp", f"world_size={ws}",
                                   "eval.limit=8", f"hydra.run.dir={out}"], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
        runs[ws] = ({r["key"]: r for r in records}, json.loads((out / "results.json").read_text()))
    (gen1, res1), (gen2, res2) = runs[1], runs[2]
    assert len(gen1) == 8 and gen1.keys() == gen2.keys()
    # both run with the prefix cache (world_size 2's ranks keep theirs in lockstep): every request counter,
    # its lookups and hits included, is the same
    for key in gen1:
        assert gen2[key]["generated_ids"] == gen1[key]["generated_ids"]
        assert gen2[key]["request_stats"] == gen1[key]["request_stats"]
    assert res2["acceptance"] == res1["acceptance"] and res2["gsm8k"] == res1["gsm8k"]
    assert res2["config"]["world_size"] == 2 and res1["config"]["world_size"] == 1
    for res in (res1, res2):
        assert res["prefix_cache"]["enabled"] and res["prefix_cache"]["off_reason"] is None
        assert res["config"]["cuda_graphs_off_reason"] is None  # the CPU: nothing dropped by the launch
    assert res2["prefix_cache"]["queries"] == res1["prefix_cache"]["queries"] > 0


@pytest.mark.gpu
@pytest.mark.gpu_memory(8)  # the parent's engines and two spawned ranks, each with its CUDA context
@pytest.mark.parametrize("share_device, graphs", [(False, True), (False, False), (True, True)],
                         ids=["nccl_two_gpus_graphs", "nccl_two_gpus_eager", "gloo_one_gpu"])
def test_cuda_world_size_2_equals_world_size_1(share_device, graphs, checkpoints):
    """On CUDA, float32: world size 2 gives the same tokens and acceptance, and logits within 1e-5, as one
    GPU (with CUDA graphs), both families, replay on and off. Over NCCL on two GPUs with CUDA graphs (every
    rank captures the same sizes, its all-reduces inside the graphs) or eagerly, or (share_device) with
    both ranks on cuda:0 over gloo, which checks the sharded CUDA model on a one-GPU machine; gloo's
    all-reduces cannot be captured, so its engines drop the graphs asked for and say why."""
    from runners.engine.launch import GLOO_GRAPHS_OFF_REASON

    if torch.cuda.device_count() < (1 if share_device else 2):
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    paths = [checkpoints[n] for n in WS_CASES[2]]
    want = run_cases(functools.partial(Engine.from_pretrained, device="cuda:0"), paths, cuda_graphs=True)
    # the parent has initialised CUDA (want, above) and, after other GPU tests, holds their threads and
    # memory: the spawned ranks must not care; a stall ends within timeout_s + 30 s (runners.engine.launch)
    got = launch(functools.partial(tp_cases.tp_cases, cuda_graphs=graphs), (paths,), world_size=2,
                 device="cuda", timeout_s=120, share_device=share_device)
    for key, case in got.items():
        if key[1] == "logits":
            continue
        if share_device:
            assert case["cuda_graphs_off_reason"] == GLOO_GRAPHS_OFF_REASON and case["graphs"] == [], key
        elif graphs:  # the same sizes as one GPU, every one captured
            assert case["cuda_graphs_off_reason"] is None, key
            assert case["graphs"] == want[key]["graphs"] and all(g[2] for g in case["graphs"]), key
            assert case["graphs"], key
        else:
            assert case["graphs"] == [], key
    for path in paths:
        diff = (got[(path, "logits")] - want[(path, "logits")]).abs().max().item()
        print(f"{'gloo, one GPU' if share_device else 'NCCL'} {Path(path).name}: max |logit difference| "
              f"{diff:.2e}")
        assert_logits_close(got[(path, "logits")], want[(path, "logits")], path)
        for arm in ARMS:
            assert got[(path, *arm)]["tokens"] == want[(path, *arm)]["tokens"], (path, arm)
            assert got[(path, *arm)]["acceptance"] == want[(path, *arm)]["acceptance"], (path, arm)
            assert got[(path, *arm)]["weight_bytes"] < want[(path, *arm)]["weight_bytes"], (path, arm)


@pytest.mark.gpu
def test_nccl_world_size_1_graphs_equal_eager(checkpoints):
    """The CUDA-graph logic of tensor-parallel ranks on one GPU: a one-rank NCCL launch whose model carries
    the all-reduce hooks (at one rank an identity, but a real NCCL kernel inside every captured graph)
    generates, with graphs, exactly the tokens and acceptance it generates eagerly, and the last verify's
    float32 logits within 1e-5; every size it planned was captured (a capture failure raises), both
    families, replay on and off."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    paths = [checkpoints[n] for n in WS_CASES[2]]
    got = launch(tp_cases.nccl_graphs_vs_eager, (paths,), world_size=1, device="cuda", timeout_s=120)
    for path in paths:
        for draft_len, replay in ARMS:
            eager, graphed = got[(path, draft_len, replay, False)], got[(path, draft_len, replay, True)]
            arm = f"{Path(path).name} draft_len={draft_len} ssm_replay={replay}"
            assert not eager["cuda_graphs"] and eager["graphs"] == [], arm
            assert graphed["cuda_graphs"] and graphed["graphs"], arm
            assert all(captured for _, _, captured in graphed["graphs"]), (arm, graphed["graphs"])
            assert graphed["tokens"] == eager["tokens"], arm
            assert graphed["acceptance"] == eager["acceptance"], arm
            if draft_len:
                torch.testing.assert_close(graphed["logits"], eager["logits"], rtol=LOGITS_TOL,
                                           atol=LOGITS_TOL, msg=lambda m, a=arm: f"{a}: {m}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_followers_run_the_model_without_autograd(device):
    """A follower rank runs rank 0's lockstep calls (``_prefill``, ``_launch``) outside ``generate``'s
    inference mode; each must still run without autograd: with it on, rank 1 of tests/gpu/tp_bench.py
    --share-gpu (float32, 32 experts) kept every gathered expert matrix of its first prefill for a backward
    and ran out of the H200's memory (125 GiB against rank 0's 12.75). Every rank: no module output that
    requires grad, no byte saved for a backward, the same forwards as rank 0; the ranks share their device's
    memory (gloo on the CPU; on CUDA both on cuda:0, share_device) and each budgets half of it; on CUDA no
    rank's peak allocation passes rank 0's by more than the rounding of the allocator."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    counts = launch(tp_cases.autograd_by_rank, (TINY["tiny_nemotron_h_mtp"],), world_size=2, all_ranks=True,
                    num_threads=1, timeout_s=120, device=device, share_device=device == "cuda")
    assert counts[0]["forwards"] > 0
    for rank, c in enumerate(counts):
        assert {k: c[k] for k in ("grad_outputs", "saved_bytes", "forwards", "ranks_per_device")} == {
            "grad_outputs": 0, "saved_bytes": 0, "forwards": counts[0]["forwards"], "ranks_per_device": 2,
        }, (rank, c)
        if device == "cuda":
            assert c["peak_bytes"] <= 1.1 * counts[0]["peak_bytes"] + 2**20, (rank, c, counts[0])


def test_ranks_sharing_a_device_split_its_free_memory(monkeypatch):
    """Ranks that share a device (share_device, or the host on the CPU) all size their loads before any of
    them allocates: each budgets 1 / ranks_per_device of the free memory -- weights + caches checked
    against it, prefill chunk and prefix cache sized from it -- and a refusal says so."""
    from runners.engine.memory import InsufficientMemoryError, check_memory_fits
    from runners.engine.options import EngineOptions

    free = 64 * 2**30
    monkeypatch.setattr("runners.engine.memory.free_device_memory", lambda device: (free, "free memory"))
    options = EngineOptions(dtype="float32", max_batch_size=2, max_seq_len=64)
    path = TINY["tiny_nemotron_h_mtp"]  # its 2 mamba groups shard at world size 2 without a process group
    alone = Engine.from_pretrained(path, options, tensor_parallel=TensorParallel(0, 2))
    shared = Engine.from_pretrained(path, options, tensor_parallel=TensorParallel(0, 2, ranks_per_device=2))
    assert alone.load_report.budget_bytes == free
    assert shared.load_report.budget_bytes == free // 2
    assert check_memory_fits(2 * 2**30, 2**30, "cpu") == free
    with pytest.raises(InsufficientMemoryError, match="divided among the 4 tensor-parallel ranks that share"):
        check_memory_fits(15 * 2**30, 2 * 2**30, "cpu", ranks_per_device=4)
    with pytest.raises(ValueError, match="ranks_per_device=3"):
        TensorParallel(0, 2, ranks_per_device=3)


def test_share_device_needs_cuda():
    with pytest.raises(ValueError, match="share_device=True puts every rank on cuda:0"):
        launch(tp_cases.fail_on_rank1, world_size=2, share_device=True)


def test_fp8_is_not_sharded(tmp_path):
    """FP8 checkpoints (weight / input scales) are not sharded yet: the application run.py calls refuses
    world_size > 1 for them with a UserError before loading (run.py prints a UserError as error / fix lines,
    exit 2: tests/test_nightly.py's unknown-experiment test), and shard_plan refuses their plan."""
    from registry.compose import compose_config
    from runners.app import main as app

    fp8 = str(tp_cases.TINY_CHECKPOINTS / "tiny_nemotron_h_mtp_fp8")
    with pytest.raises(UserError, match="FP8 checkpoint cannot be sharded"):
        shard_plan(plan_load(fp8, load_mtp=True), TensorParallel(0, 2))
    cfg = compose_config(["model=tiny_nemotron_h_mtp_fp8", "world_size=2", "eval.limit=1",
                          f"out_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError) as e:
        app.run(cfg)
    assert "tensor parallelism (runners.engine.tp) shards models without FP8" in e.value.problem
    assert not (tmp_path / "run" / "results.json").exists()


def test_lockstep_options_keep_graphs_over_nccl_and_say_why_not_over_gloo(caplog):
    """Engines under runners.engine.launch: CUDA graphs as asked over NCCL (the all-reduces captured in the
    graphs); over gloo on CUDA (share_device) off, with the reason logged and returned (build_engine keeps it
    as engine.cuda_graphs_off_reason, run.py writes it to results.json); on the CPU and at world size 1
    nothing is dropped; overlap_steps off, and refused with the fix when asked for."""
    import logging

    from runners.engine.launch import (
        GLOO_GRAPHS_OFF_REASON,
        RankContext,
        _lockstep_options,
        graphs_off_reason,
    )
    from runners.engine.options import EngineOptions

    def ctx(backend: str, device: str, world_size: int = 2) -> RankContext:
        return RankContext(0, world_size, torch.device(device), backend, TensorParallel(0, world_size), None)

    nccl, gloo_cuda, cpu = ctx("nccl", "cuda:0"), ctx("gloo", "cuda:0"), ctx("gloo", "cpu")
    for asked in (None, True):
        options, reason = _lockstep_options(EngineOptions(draft_len=3, cuda_graphs=asked), nccl)
        assert options == EngineOptions(draft_len=3, cuda_graphs=asked, overlap_steps=False)
        assert reason is None
        with caplog.at_level(logging.WARNING, logger="runners.engine.launch"):
            options, reason = _lockstep_options(EngineOptions(cuda_graphs=asked), gloo_cuda)
        assert options.cuda_graphs is False and options.overlap_steps is False
        assert reason == GLOO_GRAPHS_OFF_REASON and "gloo" in reason and "cannot capture" in reason
        assert GLOO_GRAPHS_OFF_REASON in caplog.text and "CUDA graphs off at world_size=2" in caplog.text
        caplog.clear()
    assert _lockstep_options(EngineOptions(cuda_graphs=False), gloo_cuda) == (
        EngineOptions(cuda_graphs=False, overlap_steps=False), None)  # asked for none: nothing dropped
    assert _lockstep_options(EngineOptions(), cpu)[1] is None  # the CPU steps eagerly anyway
    assert graphs_off_reason(EngineOptions(), world_size=1, backend="gloo", device=torch.device("cuda:0")
                             ) is None  # one rank: no collectives in the model
    with pytest.raises(ValueError, match=r"overlap_steps with world_size > 1.*overlap_steps=False"):
        _lockstep_options(EngineOptions(overlap_steps=True), nccl)


@pytest.mark.slow
def test_rank_stuck_while_another_works_ends_the_launch():
    """Rank 0 waits forever in one call (as on a graph replay whose all-reduce never completes: no NCCL
    watchdog tracks captured work) while rank 1 keeps running: the launch ends within the stall limit with
    an error naming rank 0 and where it waits, never a hang."""
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        launch(tp_cases.stall_rank0_while_rank1_works, world_size=2, all_ranks=True, timeout_s=600,
               stall_timeout_s=3)
    message = str(e.value)
    assert e.value.rank == 0, message
    assert "rank 0 did not run for 3 s" in message and "stall_rank0_while_rank1_works" in message, message
    assert time.monotonic() - t0 < 3 + 120 + 30  # the stall limit, the start-up allowance, ending the ranks


@pytest.mark.slow
def test_followers_waiting_for_rank_0_are_not_stalled():
    """Followers wait for rank 0's next command (idle) for longer than the stall limit while rank 0 works:
    the launch completes. The limit leaves room for a loaded 2-core CI machine, where a 2 s limit once
    ended this launch (both ranks unscheduled for 3 s), while the work lasts more than twice the limit."""
    assert launch(tp_cases.work_while_the_followers_wait, (13.0,), world_size=2, stall_timeout_s=6) == 2


@pytest.mark.slow
def test_default_stall_limit_follows_the_collective_timeout():
    """Without stall_timeout_s a launch whose ranks wait outside any collective ends within the collective
    timeout plus STALL_GRACE_S (run.py: runtime.collective_timeout_s + 30 s)."""
    from runners.engine.launch import STALL_GRACE_S, START_ALLOWANCE_S

    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="stopped making progress"):
        launch(tp_cases.stall_every_rank, world_size=2, all_ranks=True, timeout_s=2)
    elapsed = time.monotonic() - t0
    assert 2 + STALL_GRACE_S <= elapsed < 2 + STALL_GRACE_S + START_ALLOWANCE_S, elapsed


@pytest.mark.slow
def test_prefix_cache_in_lockstep_equals_world_size_1(checkpoints, world_size_2):
    """Tensor-parallel ranks keep their prefix caches in lockstep: with prompts that share long prefixes
    (hits, junction saves, deferred admissions), world size 2 gives the tokens, acceptance and every
    prefix-cache counter of world size 1, both families, plain and MTP; with a budget of a few entries (the
    ranks' entries are half the size of world size 1's, so they evict other ones) the tokens and acceptance
    still equal world size 1's, and the ranks stay in lockstep while they evict (the launch's token digest
    and graph check pass)."""
    paths = [checkpoints[n] for n in PREFIX_CHECKPOINTS]
    want = tp_cases.prefix_cases(Engine.from_pretrained, paths)
    got = world_size_2[1]
    assert got.keys() == want.keys()
    tight = min(budget for _, budget in tp_cases.PREFIX_CASES)
    for key, case in want.items():
        assert case["prefix"]["prefix_cache_hits"] > 0 and got[key]["prefix"]["prefix_cache_hits"] > 0, key
        assert got[key]["tokens"] == case["tokens"] and got[key]["acceptance"] == case["acceptance"], key
        if key[2] != tight:
            assert got[key]["prefix"] == case["prefix"], key
    assert any(got[key]["prefix"]["prefix_cache_evictions"] > 0 for key in got if key[2] == tight)


def test_sharded_weight_check_judges_the_whole_matrix():
    """A rank's all-zero part of a weight matrix (padded heads) is no broken checkpoint when another rank's
    part is not zero (check_weights' all_ranks_zero); a matrix zero on every rank still is."""
    from runners.engine.loader import CheckpointError, check_weights

    part = {"w": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match="weight matrices are all zeros"):
        check_weights(part, "ck")
    check_weights(part, "ck", all_ranks_zero=torch.zeros_like)  # the other ranks' parts are not zero
    with pytest.raises(CheckpointError, match="weight matrices are all zeros"):
        check_weights(part, "ck", all_ranks_zero=lambda flags: flags)  # zero on every rank
