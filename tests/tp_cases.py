"""What the tensor-parallel tests run: test checkpoints whose head counts divide 4, and the engine cases run
both in the test process (world size 1) and on rank 0 of ``runners.engine.launch.launch`` (world size 2 / 4).

Imported by the ranks (spawned processes), so it imports nothing of pytest.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from registry.errors import UserError
from runners.engine.options import EngineOptions

# Widths that world size 4 shards and that exercise every rule of runners/engine/tp.py: KV heads (2) fewer
# than 4
# ranks (replicated), mamba ngroups 2 < 4 (the group's norm spans 2 ranks) and = 2 (split), a dense MLP layer,
# biases everywhere NemotronH allows them (row-parallel ones are added once), GDN with K != V, a latent MoE.
SYNTH_TP = {
    "nemotron_h": dict(
        hidden_size=64, vocab_size=2048, hybrid_override_pattern="M*EM-E", mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64, moe_latent_size=32, num_experts_per_tok=2, use_bias=True,
        attention_bias=True, mlp_bias=True,
    ),
    "qwen3_next": dict(
        hidden_size=64, vocab_size=2048, mlp_only_layers=[1], intermediate_size=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=12, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts_per_tok=2,
    ),
}
TINY_CHECKPOINTS = Path(__file__).resolve().parents[1] / "registry" / "checkpoints"


def write_tp_checkpoint(path: Path, family: str) -> Path:
    """A float32 synthetic checkpoint (runners.tools.synth) at :data:`SYNTH_TP` widths, 4 layers, 6 experts,
    its
    1-D tensors (norm scales, biases, D, the router's correction bias; not A_log / dt_bias) moved off their
    identity / zero initialisation so that a wrongly sliced one changes the logits. (Random weights: the MTP
    module drafts nothing the target accepts; the trained tiny checkpoints give real acceptance.)"""
    from runners.tools.synth import write_synthetic_checkpoint

    write_synthetic_checkpoint(path, family, num_layers=4, num_experts=6, overrides=SYNTH_TP[family],
                               dtype=torch.float32, check_disk=False)
    g = torch.Generator().manual_seed(5)
    for shard in path.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name, t in tensors.items():
            if t.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                tensors[name] = t + 0.2 * torch.randn(t.shape, generator=g)
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return path


def _pad_blocks(t: torch.Tensor, n_blocks: int, per_group: int, new_per_group: int, dim: int = 0,
                zero: bool = False) -> torch.Tensor:
    """t's ``dim`` holds n_blocks equal blocks in groups of ``per_group``; append ``new_per_group -
    per_group`` blocks to each group: copies of the group's first block, or zeros."""
    blocks = list(t.chunk(n_blocks, dim=dim))
    out = []
    for g in range(0, n_blocks, per_group):
        group = blocks[g:g + per_group]
        extra = [torch.zeros_like(group[0]) if zero else group[0]] * (new_per_group - per_group)
        out += group + extra
    return torch.cat(out, dim=dim)


def pad_tiny_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a shipped tiny checkpoint (trained: real MTP acceptance) whose head counts 4 divides, with
    the same outputs: the tiny NemotronH's 6 attention heads (2 KV groups of 3) become 8 (4 per group), the
    tiny Qwen3-Next's 2 GDN key heads (with 2 value heads each) become 4. Each new head copies a head of its
    group (finite activations) and its output projection columns are zero, so it adds nothing."""
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    tensors = load_file(str(dst / "model.safetensors"))
    if config["model_type"] == "nemotron_h":
        H, KVH = config["num_attention_heads"], config["num_key_value_heads"]
        per, new = H // KVH, 4
        for name in list(tensors):
            if name.endswith("mixer.q_proj.weight"):
                tensors[name] = _pad_blocks(tensors[name], H, per, new)
            elif name.endswith("mixer.o_proj.weight"):
                tensors[name] = _pad_blocks(tensors[name], H, per, new, dim=1, zero=True)
        config["num_attention_heads"] = KVH * new
    else:
        H, HV = config["linear_num_key_heads"], config["linear_num_value_heads"]
        K, V = config["linear_key_head_dim"], config["linear_value_head_dim"]
        for name in list(tensors):
            t = tensors[name]
            if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
                tensors[name] = _pad_blocks(t, H, H, 2 * H)  # per key head blocks
            elif name.endswith("linear_attn.conv1d.weight"):  # [Q (H K) | K (H K) | V (HV V)]
                q, k, v = t.split([H * K, H * K, HV * V])
                tensors[name] = torch.cat([_pad_blocks(q, H, H, 2 * H), _pad_blocks(k, H, H, 2 * H),
                                           _pad_blocks(v, HV, HV, 2 * HV)])
            elif name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
                tensors[name] = _pad_blocks(t, HV, HV, 2 * HV)
            elif name.endswith("linear_attn.out_proj.weight"):
                tensors[name] = _pad_blocks(t, HV, HV, 2 * HV, dim=1, zero=True)
        config["linear_num_key_heads"], config["linear_num_value_heads"] = 2 * H, 2 * HV
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


PROMPTS = [[1, 5, 9, 33, 100, 7, 18], [1, 7, 8], [1, 40, 41, 42, 43, 44], [1, 300], [1, 9, 9, 9, 12]]
LOGIT_IDS = [[1, 5, 9, 33, 100, 7, 18, 2], [1, 300, 299, 12, 13, 14, 15, 16]]
ARMS = ((3, False), (3, True), (0, False))  # (draft_len, ssm_replay)


def graph_keys(engine) -> list[tuple[int, int, bool]]:
    """(batch size, KV bound, captured) of every CUDA graph plan of the engine's step ([] when eager)."""
    return sorted((B, L, g is not None) for (B, L), g in engine.graphs.graphs.items())


def run_cases(build, checkpoints: list[str], max_new_tokens: int = 10, arms=ARMS, **options) -> dict:
    """For every checkpoint and arm of ``arms`` (default :data:`ARMS`; the first one's draft length and
    replay are ``ARMS[0]``'s): an engine from ``build(path, options)`` (3 slots for 5
    prompts: slots are reused; ``options``: more ``EngineOptions`` fields, e.g. cuda_graphs), its greedy
    tokens, acceptance, cache and weight bytes, the CUDA graphs its step captured and why graphs were
    dropped (``cuda_graphs_off_reason`` of a launch's engine, else None), and (first arm) the logits of
    :data:`LOGIT_IDS`. Stop tokens off, float32."""
    assert arms[0] == ARMS[0], arms
    out = {}
    for ck in checkpoints:
        for draft_len, replay in arms:
            engine = build(ck, EngineOptions(dtype="float32", draft_len=draft_len, ssm_replay=replay,
                                             max_batch_size=3, max_seq_len=64, **options))
            result = engine.generate(PROMPTS, max_new_tokens, stop_token_ids=[])
            out[(ck, draft_len, replay)] = {
                "tokens": result.tokens,
                "acceptance": result.stats.acceptance(),
                "memory": engine.cache_memory(),
                "weight_bytes": engine.load_report.weight_bytes,
                "graphs": graph_keys(engine),
                "cuda_graphs_off_reason": getattr(engine, "cuda_graphs_off_reason", None),
            }
            if (draft_len, replay) == ARMS[0]:
                out[(ck, "logits")] = engine.logits(torch.tensor(LOGIT_IDS)).cpu()
            del engine
    return out


def tp_cases(checkpoints: list[str], max_new_tokens: int = 10, arms=ARMS, **options) -> dict:
    """:func:`run_cases` on rank 0 of a launch: every rank builds its shard
    (runners.engine.launch.build_engine)."""
    from runners.engine.launch import build_engine

    return run_cases(build_engine, checkpoints, max_new_tokens, arms, **options)


def nccl_graphs_vs_eager(checkpoints: list[str], max_new_tokens: int = 10) -> dict:
    """Rank 0 of a one-rank NCCL launch (one GPU): for every checkpoint and arm of :data:`ARMS`, the engine
    (``runners.engine.launch.build_engine`` / ``rebuild_engine``) with CUDA graphs off and on, the model's
    block mixers given the tensor-parallel all-reduce hooks (``runners.engine.tp.AllReduceOutput``: at one
    rank an identity, but a real NCCL kernel, captured in the graphs), capture failures raising
    (``StepGraphs.strict``). Per (checkpoint, arm, cuda_graphs): tokens, acceptance, graph plans
    (:func:`graph_keys`) and, with drafts, the float32 logits of row 0 of the last verify (its target hidden
    states through the LM head)."""
    from runners.engine.launch import build_engine, current, rebuild_engine
    from runners.engine.tp import SHARDED_KINDS, AllReduceOutput

    ctx = current()
    assert ctx.backend == "nccl" and ctx.world_size == 1, (ctx.backend, ctx.world_size)
    out: dict = {}
    for ck in checkpoints:
        engine = None
        for draft_len, replay in ARMS:
            for graphs in (False, True):
                options = EngineOptions(dtype="float32", draft_len=draft_len, ssm_replay=replay,
                                        max_batch_size=3, max_seq_len=64, cuda_graphs=graphs)
                if engine is None:
                    engine = build_engine(ck, options)
                    model = engine.model
                    blocks = list(model.layers) + (list(model.mtp.blocks) if model.mtp is not None else [])
                    hook = AllReduceOutput(ctx.tp.group)
                    for block in blocks:
                        if block.kind in SHARDED_KINDS:
                            block.mixer.register_forward_hook(hook)
                else:
                    engine = rebuild_engine(engine, options)
                engine.graphs.strict = True
                result = engine.generate(PROMPTS, max_new_tokens, stop_token_ids=[])
                case = {"tokens": result.tokens, "acceptance": result.stats.acceptance(),
                        "graphs": graph_keys(engine), "cuda_graphs": engine.step.cuda_graphs}
                if draft_len:
                    with torch.inference_mode():
                        case["logits"] = engine.model.lm_logits(engine.step.io.hidden[:1]).float().cpu()
                out[(ck, draft_len, replay, graphs)] = case
    return out


SHARED = [1] + [(7 * i + 3) % 500 + 2 for i in range(80)]  # an 81-token prefix (> one 64-token block)
PREFIX_PROMPTS = [SHARED + [11, 12, 13], SHARED + [14], SHARED + [15, 16] + SHARED[:70],
                  SHARED + [11, 12, 13], [1, 40, 41, 42], SHARED[:70] + [9, 9], SHARED + [14, 20, 21]]


PREFIX_CASES = ((0, 4 * 2**20), (3, 4 * 2**20), (3, 2**19))  # (draft_len, prefix_cache_bytes)


def prefix_cases(build, checkpoints: list[str], max_new_tokens: int = 6) -> dict:
    """For every checkpoint and (draft length, prefix-cache budget) of :data:`PREFIX_CASES`: an engine from
    ``build(path, options)`` with the prefix cache on (float32, 2 slots) generating :data:`PREFIX_PROMPTS`
    (long shared prefixes: hits, junctions, deferred admissions; the 512 KiB budget holds only a few
    entries, so entries are evicted or not stored): its tokens, acceptance and prefix-cache counters."""
    from dataclasses import asdict

    out = {}
    for ck in checkpoints:
        for draft_len, budget in PREFIX_CASES:
            options = EngineOptions(dtype="float32", draft_len=draft_len, max_batch_size=2, max_seq_len=256,
                                    prefix_cache=True, prefix_cache_bytes=budget)
            engine = build(ck, options)
            result = engine.generate(PREFIX_PROMPTS, max_new_tokens, stop_token_ids=[])
            stats = asdict(result.stats)
            out[(ck, draft_len, budget)] = {
                "tokens": result.tokens, "acceptance": result.stats.acceptance(),
                "prefix": {k: v for k, v in stats.items() if k.startswith("prefix_cache")},
            }
            del engine
    return out


def tp_prefix_cases(checkpoints: list[str]) -> dict:
    """:func:`prefix_cases` on rank 0 of a launch (every rank builds its shard and its prefix cache)."""
    from runners.engine.launch import build_engine

    return prefix_cases(build_engine, checkpoints)


def tp_cases_and_prefix_cases(checkpoints: list[str], prefix_checkpoints: list[str]) -> tuple[dict, dict]:
    """:func:`tp_cases` of ``checkpoints`` and :func:`tp_prefix_cases` of ``prefix_checkpoints`` in one
    launch (a launch's start-up costs seconds on the CPU)."""
    return tp_cases(checkpoints), tp_prefix_cases(prefix_checkpoints)


# ---- failure cases (runners.engine.launch with all_ranks=True: every rank runs the function)
# ----------------------


def fail_on_rank1() -> None:
    """Rank 1 raises a UserError while rank 0 waits in a collective it will never complete."""
    if dist.get_rank() == 1:
        time.sleep(0.5)
        raise UserError("the checkpoint of rank 1 is unreadable", "fix rank 1's files")
    dist.barrier()


def stall_rank1() -> None:
    """Rank 1 never joins rank 0's all-reduce (alive, elsewhere): rank 0's collective times out."""
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def record_pid_and_wait(folder: str) -> None:
    """Every rank writes its pid to ``folder`` and then waits in a collective that never completes."""
    Path(folder, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.barrier()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped) counts as ended
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False




def kill_rank0() -> None:
    """Rank 0 dies of SIGKILL (no Python error) while rank 1 waits for it in a barrier: rank 1 then fails
    with a lost connection, the consequence the launcher must not report as the cause."""
    if dist.get_rank() == 0:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def stall_every_rank() -> None:
    """Every rank waits in one call forever, outside any collective (no torch.distributed timeout ends it)."""
    time.sleep(600)


def stall_rank0_while_rank1_works() -> None:
    """Rank 0 waits in one call forever (as a rank blocked on a graph replay whose collective never completes:
    no watchdog ends it), while rank 1 keeps running Python lines (it makes progress) for 600 s."""
    if dist.get_rank() == 0:
        time.sleep(600)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # two lines in turn: the progress watcher sees the line change
        time.sleep(0.2)
        time.sleep(0.2)


def work_while_the_followers_wait(seconds: float) -> int:
    """Rank 0 (the followers serve, waiting for its next command) runs Python lines for ``seconds``, then
    returns the world size: the followers' wait is idle, not a stall."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)
        time.sleep(0.2)
    return dist.get_world_size()


# Held by a thread of the launching process (tests/test_tp.py): a rank forked from it would inherit it held
HELD = threading.Lock()


def take_held_lock() -> bool:
    """Whether this rank can take :data:`HELD` within 10 s (False: it inherited the launcher's held lock)."""
    got = HELD.acquire(timeout=10)
    if got:
        HELD.release()
    return got


def autograd_by_rank(checkpoint: str, max_new_tokens: int = 4) -> list[dict]:
    """Every rank of a launch (``all_ranks=True``) counts what autograd records while rank 0's engine
    generates: the forwards of modules whose output requires grad, and the bytes of the tensors autograd
    saved for a backward (``torch.autograd.graph.saved_tensors_hooks``; an inference engine saves none).
    Rank 0 builds the engine and generates :data:`PROMPTS` (MTP drafts and replay on); the other ranks serve
    it (``runners.engine.launch.serve``) as they do in any launch. Returns every rank's counts, by rank, with
    its ``ranks_per_device`` and, on CUDA, its process's peak allocation (``peak_bytes``; None on the CPU)."""
    from runners.engine import launch as lockstep

    counts = {"grad_outputs": 0, "saved_bytes": 0, "forwards": 0}

    def record(module, args, output):
        counts["forwards"] += 1
        counts["grad_outputs"] += isinstance(output, torch.Tensor) and output.requires_grad

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts["saved_bytes"] += t.numel() * t.element_size()
        return t

    ctx = lockstep.current()
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if ctx.rank == 0:
                engine = lockstep.build_engine(checkpoint, EngineOptions(
                    dtype="float32", draft_len=3, ssm_replay=True, max_batch_size=3, max_seq_len=64))
                engine.generate(PROMPTS, max_new_tokens, stop_token_ids=[])
                lockstep._broadcast(("exit",))  # all_ranks: rank 0 ends the followers' serve loop itself
            else:
                lockstep.serve()
    finally:
        handle.remove()
    counts["ranks_per_device"] = ctx.tp.ranks_per_device
    counts["peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, counts, group=ctx.control)
    return every
