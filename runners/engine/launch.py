"""One process per tensor-parallel rank: launch, lockstep engines, failures.

:func:`launch` starts ``world_size`` processes on this host with multiprocessing's ``spawn`` method: fresh
interpreters, untouched by whatever the caller did before (a CUDA context, threads, forks: a process forked
after CUDA was initialised may hang in its first CUDA call, and a long-lived forkserver carries state from one
launch to the next; https://pytorch.org/docs/stable/notes/multiprocessing.html#cuda-in-multiprocessing).
Each initialises ``torch.distributed`` (NCCL on CUDA GPUs, rank r on ``cuda:r``; gloo on the CPU) with a
timeout on every collective, plus a second gloo group for control messages. Rank 0 runs ``fn(*args)``, and
its return value is :func:`launch`'s; the other ranks serve rank 0's engines until it returns:

- :func:`build_engine` on rank 0 broadcasts the checkpoint path and its ``EngineOptions``, and every rank
  builds the same engine (``Engine.from_pretrained(path, options, tensor_parallel=...)``: each loads and
  allocates only its shard, ``runners.engine.tp``); rank 0 gets a :class:`LockstepEngine`.
  :func:`rebuild_engine` makes a new engine (other draft length, replay, cache sizes) around the model every
  rank already holds.
- Rank 0 drives and broadcasts per step. Its engine's ``generate`` loop runs on rank 0 only (the scheduler:
  admission, stop checks, ``on_finish`` callbacks, lm-eval around it); its model runner is a
  :class:`LockstepRunner`, whose every command (``ModelRunner.COMMANDS``: ``prefill`` (admission, the prefix
  cache's split of it included), ``launch`` (queue one decode / speculative step), ``read`` (read a queued
  step's tokens), ``logits``, ``force_acceptance``, ``capture_graphs``) first broadcasts its name and
  host-side arguments over the control group, and every other rank runs the same command on its runner with
  the same arguments (outside ``generate``'s inference mode: each command that runs the model enters
  inference mode itself, ``ModelRunner.prefill`` / ``launch``). A step handle
  (``runners.engine.step.LaunchedStep``: pinned host buffers) is not sent: each follower keeps the steps it
  launched in launch order, and ``read`` reads its oldest (the scheduler reads steps in launch order). So
  all ranks run the same forwards in the same order and their all-reduces pair up; the device state the
  steps keep (caches, the next drafts) evolves identically, since every rank computes the same all-reduced
  hidden states, logits and tokens. The followers need neither tokenizer nor callbacks. Cost: one small
  broadcast per step. At the end of every ``generate`` all ranks compare a digest of the tokens their steps
  produced and the CUDA graphs they captured (:meth:`LockstepEngine.check_lockstep`): ranks that diverged
  raise instead of reporting wrong numbers.
  (The alternative, every rank running ``generate`` itself, would need the caller's ``stop_checker`` on every
  rank and deterministic there.)

Failures: an exception on any rank is written, with its rank and traceback, to the launch's folder; the parent
process, which watches every rank, gives the others a moment to report theirs, ends them (SIGTERM, then
SIGKILL) and raises for the rank that failed FIRST: a ``UserError`` as a UserError whose problem starts with
``rank r of N:`` (run.py prints it as usual), anything else as :class:`RankFailure` naming the rank, how it
failed (its error, or the signal / exit status of a rank that died without one) and then what followed on
the others. A peer's "Connection reset by peer" never outranks the death that caused it. A rank stuck in an
eager collective whose peer is alive but elsewhere raises after ``timeout_s`` (the process group's timeout).
A rank that makes no progress for ``stall_timeout_s`` (default ``timeout_s`` + 30 s) ends the launch with a
RankFailure naming every rank that stopped and the line it waits on: this bounds the waits that have no
timeout of their own -- a collective replayed inside a CUDA graph (the NCCL watchdog does not track captured
work), a hung device call, a control message. A follower waiting for rank 0's next command is idle, not
stuck (rank 0 may run lm-eval for long), so only a rank in the middle of work can stall the launch.
Ctrl-C (SIGINT to the parent) ends every rank; ranks also die with the parent (``PR_SET_PDEATHSIG``). The
launch's temporary folder (``hybrid-launch-*``) is removed however the launch ends. On CUDA the ranks keep
NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1,
unless already set).

One host only (the control messages and rendezvous use a file in a temporary folder).

The prefix cache (where ``runners.engine.prefix_cache.prefix_cache_off_reason`` keeps it on, as at world
size 1) is kept in lockstep: every rank's cache gets the same byte budget (the smallest rank's memory cap,
``Engine.from_pretrained``), and each of its decisions follows from the token ids and the entry sizes, which
are the same on every rank; the one decision about which prompts to defer to the next admission (it is
recorded for the save points) is taken inside the lockstep command ``prefill``. So every rank hits, saves,
evicts and cuts its prefill chunks alike, and the ranks' all-reduces pair up; the token digest and the stall
limit catch a rank that would not.

CUDA graphs at ``world_size > 1`` (NCCL): every rank captures the decode / draft / verify / commit / catch-up
phases with the model's all-reduces inside the graphs (NCCL's kernels are captured like any other; the
process group was initialised eagerly with its device, and each capture's warm-up runs the collectives once
outside the graph). The ranks stay in lockstep by construction: each ``launch`` runs on every rank with the
same slot ids and KV bound, so every rank plans the same padded batch size and KV bucket
(``runners.engine.graphs.StepGraphs.plan``), captures the same (B, L) at the same step, in the same order,
and replays the same graph for each step; ``capture_graphs`` ahead of time is mirrored too. A capture that
fails on a rank ends the launch (``StepGraphs.strict``): at world size 1 a failed size runs eagerly, but
here one rank running a step eagerly while another replays would pair collectives that do not belong
together. The captured sizes are compared at the end of every ``generate`` (:func:`_compare_digests`).
With gloo on CUDA (``share_device``) the model's all-reduces go through host memory, which a CUDA graph
cannot capture: engines there run eagerly and say why (:func:`graphs_off_reason`: a warning, and
``LockstepEngine.cuda_graphs_off_reason``, which run.py records in results.json). On the CPU graphs are off
anyway. ``overlap_steps`` stays off under launch (:func:`build_engine` turns it off and refuses a request for
it): running steps ahead of the host has not been checked with the lockstep messages.

``share_device=True`` (CUDA only) puts every rank on cuda:0 and runs the model's collectives over gloo, which
all-reduces CUDA tensors through host memory (NCCL refuses two ranks on one GPU). It exists to check
correctness -- tokens, acceptance and logits of world size N at real dimensions -- on a machine with one GPU;
its throughput says nothing about NCCL tensor parallelism (the ranks share one GPU's compute and every
all-reduce is a device-host round trip). Each rank budgets its load with 1 / world_size of the GPU's free
memory (``TensorParallel.ranks_per_device``; the same on the CPU, whose ranks share the host's memory): the
ranks check before any of them allocates, so each would otherwise count the others' share as its own when
sizing its prefill chunks and prefix cache (``Engine.from_pretrained``).
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import gc
import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from registry.errors import UserError
from runners.engine.engine import Engine
from runners.engine.options import EngineOptions
from runners.engine.runner import ModelRunner
from runners.engine.tp import TensorParallel

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LockstepEngine",
    "LockstepRunner",
    "RankContext",
    "RankFailure",
    "build_engine",
    "current",
    "graphs_off_reason",
    "rebuild_engine",
    "launch",
]

log = logging.getLogger(__name__)

START_METHOD = "spawn"  # fresh interpreters: nothing of the caller's CUDA, threads or forks (see launch())
DEFAULT_TIMEOUT_S = 600  # seconds a collective of the model's process group may wait for its peers
CONTROL_TIMEOUT = timedelta(days=1)  # followers wait for rank 0's next command (it may run lm-eval for long)
_TOKEN_STEPS = ("prefill", "read")  # runner commands whose results (token ids) enter the digest
GLOO_GRAPHS_OFF_REASON = (
    "the model's all-reduces run over gloo (share_device: every rank on one GPU), which moves CUDA tensors "
    "through host memory; a CUDA graph cannot capture that, so the decode steps run eagerly (NCCL, one GPU "
    "per rank, captures them)"
)
STALL_GRACE_S = 30.0  # default stall limit = timeout_s + this (a collective's own timeout error comes first)
START_ALLOWANCE_S = 120.0  # more seconds for a rank still starting (spawn imports torch and the engine)
FAIL_GRACE_S = 2.0  # after a rank fails: the others' time to report what they saw before they are ended
PROGRESS_EVERY_S = 0.5  # how often a rank's watcher looks for progress (_watch_progress)
# An error that only says a peer went away (the consequence of another rank's death, not a cause)
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "DistNetworkError",
             "remote process exited", "ECONNRESET")
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class RankFailure(RuntimeError):
    """A rank of a :func:`launch` failed; ``rank`` is its index, the message holds its error and traceback."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


@dataclass
class RankContext:
    """This process's rank under :func:`launch`: ``device`` (``cuda:rank``, cuda:0 when ranks share it, or
    cpu), ``backend`` of the model's collectives ("nccl" or "gloo"), ``tp`` (its
    :class:`runners.engine.tp.TensorParallel` on the default process group), ``control`` (the gloo group of
    the
    lockstep messages)."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    tp: TensorParallel
    control: Any


_CONTEXT: RankContext | None = None
_MESSAGES = 0  # control messages this rank passed (its progress, read by _watch_progress)
_AWAITING_COMMAND = False  # a follower waits for rank 0's next command: idle, not stuck (_watch_progress)


def current() -> RankContext | None:
    """The rank context when this process is a rank of :func:`launch`, else None."""
    return _CONTEXT


# ------------------------------------------------------------------------------------------------------------
# Control messages and lockstep engines
# ------------------------------------------------------------------------------------------------------------


def _require() -> RankContext:
    if _CONTEXT is None:
        raise RuntimeError("not a rank of runners.engine.launch.launch: no process group to run a sharded "
                           "engine on")
    return _CONTEXT


def _broadcast(message: Any = None) -> Any:
    """Rank 0 sends ``message`` to every rank over the control group; other ranks get it (returned)."""
    global _MESSAGES
    ctx = _require()
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ctx.control)
    _MESSAGES += 1
    return box[0]


def _next_command() -> Any:
    """A follower's wait for rank 0's next message (:func:`_broadcast`); the wait counts as idle, not as a
    stall (rank 0 may do long work of its own between commands, e.g. lm-eval)."""
    global _AWAITING_COMMAND
    _AWAITING_COMMAND = True
    try:
        return _broadcast()
    finally:
        _AWAITING_COMMAND = False


def _to_host(obj: Any) -> Any:
    """Tensors (in nested tuples / lists / dicts) moved to the CPU: messages hold no device tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    return obj


def _digest_update(digest: Any, name: str, result: Any) -> None:
    if name in _TOKEN_STEPS:
        digest.update(repr((name, result)).encode())


def _graph_keys(engine: Engine | None) -> list[tuple[int, int, bool]]:
    """The (batch size, KV bound, captured) of every graph plan the engine's step made (False: its capture
    failed and the size runs eagerly)."""
    if engine is None:
        return []
    return sorted((B, L, g is not None) for (B, L), g in engine.graphs.graphs.items())


def _compare_digests(digest: Any, engine: Engine | None) -> None:
    """Every rank contributes its digest and its captured graphs (:func:`_graph_keys`); raises RuntimeError
    on every rank when they differ."""
    ctx = _require()
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, (digest.hexdigest(), _graph_keys(engine)), group=ctx.control)
    if len({s[0] for s in states}) > 1:
        raise RuntimeError(
            f"tensor-parallel ranks diverged: the token ids their engine steps produced differ "
            f"(digests by rank: {[s[0][:12] for s in states]}); the ranks' all-reduced activations are not "
            "bitwise equal"
        )
    if len({repr(s[1]) for s in states}) > 1:
        raise RuntimeError(
            "tensor-parallel ranks diverged: they captured different CUDA graphs (batch size, KV bound, "
            f"captured) by rank: {[s[1] for s in states]}; their graph replays were not in lockstep"
        )


class LockstepRunner(ModelRunner):
    """Rank 0's model runner under :func:`launch`: each command (``ModelRunner.COMMANDS``: prefill, launch,
    read, logits, force_acceptance, capture_graphs) first broadcasts its call to the other ranks, which run
    it on their runner; ``digest`` hashes the token ids of its prefills and reads (:meth:`check_lockstep`
    compares them across ranks). Otherwise a ``ModelRunner``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.digest = hashlib.sha256()


def _lockstep(name: str) -> Callable:
    command = getattr(ModelRunner, name)

    @functools.wraps(command)
    def method(self: LockstepRunner, *args: Any, **kwargs: Any) -> Any:
        if name == "read":  # the followers read their own oldest launched step
            _broadcast(("call", name, (), {}))
        else:
            _broadcast(("call", name, _to_host(args), _to_host(kwargs)))
        result = command(self, *args, **kwargs)
        _digest_update(self.digest, name, result)
        return result

    return method


for _name in ModelRunner.COMMANDS:
    setattr(LockstepRunner, _name, _lockstep(_name))


class LockstepEngine(Engine):
    """Rank 0's engine under :func:`launch` (built by :func:`build_engine`): its runner is a
    :class:`LockstepRunner`, so every command the generate loop gives it runs on every rank; ``generate``
    ends with :meth:`check_lockstep`. Otherwise an :class:`runners.Engine` (the same API).
    ``cuda_graphs_off_reason``: why its steps run without the CUDA graphs asked for
    (:func:`graphs_off_reason`), None when nothing was dropped."""

    runner_class = LockstepRunner
    cuda_graphs_off_reason: str | None = None

    def generate(self, *args: Any, **kwargs: Any):
        out = super().generate(*args, **kwargs)
        self.check_lockstep()
        return out

    def check_lockstep(self) -> None:
        """Compare the digest of every rank's step results (token ids) since the engine was built, and the
        CUDA graphs each captured; raises RuntimeError when a rank produced different tokens or graphs."""
        _broadcast(("digest",))
        _compare_digests(self.runner.digest, self)


def graphs_off_reason(options: EngineOptions, *, world_size: int, backend: str, device: torch.device
                      ) -> str | None:
    """Why engines of a launch run without the CUDA graphs ``options`` ask for (None, the default: on with
    CUDA; True), or None when they keep them: with ``world_size > 1`` on CUDA over gloo
    (:data:`GLOO_GRAPHS_OFF_REASON`), whose all-reduces a graph cannot capture. NCCL ranks capture them;
    on the CPU the engine runs eagerly anyway (``runners.engine.step.DecodeStep``); at world size 1 the model
    has no collectives."""
    if options.cuda_graphs is False or device.type != "cuda" or world_size == 1 or backend != "gloo":
        return None
    return GLOO_GRAPHS_OFF_REASON


def _lockstep_options(options: EngineOptions, ctx: RankContext) -> tuple[EngineOptions, str | None]:
    """``options`` as every rank's engine runs them under launch, and why graphs were dropped (None when
    not): ``overlap_steps`` off (module docstring), ``cuda_graphs`` off where :func:`graphs_off_reason` says
    (with a warning). Raises ValueError when ``overlap_steps`` is asked for (True)."""
    if options.overlap_steps:
        raise ValueError(
            "overlap_steps with world_size > 1: tensor-parallel engines do not run steps ahead of the host "
            "(not checked with the lockstep messages yet); pass overlap_steps=False (or None)"
        )
    changes: dict[str, Any] = {"overlap_steps": False}
    reason = graphs_off_reason(options, world_size=ctx.world_size, backend=ctx.backend, device=ctx.device)
    if reason is not None:
        log.warning("CUDA graphs off at world_size=%d: %s", ctx.world_size, reason)
        changes["cuda_graphs"] = False
    return options.replace(**changes), reason


def _lockstep_graphs(engine: Engine, ctx: RankContext) -> Engine:
    """Make a capture failure end the launch (``StepGraphs.strict``) where the ranks' collectives live in
    the graphs (world size > 1): every rank must replay the same graphs (module docstring)."""
    engine.graphs.strict = ctx.world_size > 1
    return engine


def build_engine(path: str | Path, options: EngineOptions | None = None) -> LockstepEngine:
    """On rank 0 of :func:`launch`: build ``Engine.from_pretrained(path, options)`` on every rank, each on
    its own device with its shard (the rank's ``tensor_parallel`` and ``device``), and return rank 0's
    :class:`LockstepEngine`. The other ranks drop the engine they held before.

    CUDA graphs as ``options`` say, except over gloo on CUDA (:func:`graphs_off_reason`: off, with a warning
    and ``engine.cuda_graphs_off_reason``); ``overlap_steps`` off.

    Raises:
        ValueError: ``options`` ask for overlapping steps (:func:`_lockstep_options`).
    """
    ctx = _require()
    if ctx.rank != 0:
        raise RuntimeError("build_engine runs on rank 0; the other ranks build theirs from its message")
    options, reason = _lockstep_options(options or EngineOptions(), ctx)
    _broadcast(("build", str(path), options))
    engine = LockstepEngine.from_pretrained(path, options, device=ctx.device, tensor_parallel=ctx.tp)
    engine.cuda_graphs_off_reason = reason
    return _lockstep_graphs(engine, ctx)


def rebuild_engine(engine: LockstepEngine, options: EngineOptions | None = None) -> LockstepEngine:
    """On rank 0 of :func:`launch`: a new engine on every rank around the model the ranks already hold
    (``Engine(model, options)``: new caches and settings such as draft_len, ssm_replay, max_batch_size, no
    reload), e.g. to run several arms on one load. Drop ``engine`` afterwards: its caches stay allocated while
    it is referenced."""
    ctx = _require()
    options, reason = _lockstep_options(options or EngineOptions(), ctx)
    _broadcast(("rebuild", options))
    new = LockstepEngine(engine.model, options, device=ctx.device, tensor_parallel=engine.tensor_parallel)
    new.load_report = engine.load_report
    new.cuda_graphs_off_reason = reason
    return _lockstep_graphs(new, ctx)


def _free(engine: Engine | None) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def serve() -> None:
    """The loop of ranks other than 0: build, run the steps of, and check the engines rank 0 asks for, until
    it says exit."""
    ctx = _require()
    engine, digest = None, hashlib.sha256()
    launched: deque = deque()  # this rank's queued steps (ModelRunner.launch handles), oldest first
    while True:
        message = _next_command()
        op = message[0]
        if op == "exit":
            return
        if op in ("build", "rebuild"):
            launched.clear()
        if op == "build":
            _free(engine)
            engine, digest = None, hashlib.sha256()
            engine = Engine.from_pretrained(message[1], message[2], device=ctx.device, tensor_parallel=ctx.tp)
            _lockstep_graphs(engine, ctx)
        elif op == "rebuild":
            model, tp = engine.model, engine.tensor_parallel
            engine = None  # its caches go before the new ones are allocated
            engine = Engine(model, message[1], device=ctx.device, tensor_parallel=tp)
            _lockstep_graphs(engine, ctx)
            digest = hashlib.sha256()
        elif op == "call":
            name, args, kwargs = message[1:]
            if name == "read":
                args = (launched.popleft(),)
            result = getattr(engine.runner, name)(*args, **kwargs)
            if name == "launch":
                launched.append(result)
            _digest_update(digest, name, result)
        elif op == "digest":
            _compare_digests(digest, engine)
        else:
            raise RuntimeError(f"unknown lockstep message {op!r}")


# ------------------------------------------------------------------------------------------------------------
# Processes
# ------------------------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (no orphaned rank waits on a collective)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _init_rank(rank: int, world_size: int, device: str, init_file: str, timeout_s: float,
               share_device: bool = False) -> RankContext:
    global _CONTEXT
    cuda = device == "cuda"
    nccl = cuda and not share_device
    if cuda:
        for k, v in NO_MULTICAST_ENV.items():
            os.environ.setdefault(k, v)
        index = 0 if share_device else rank
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if nccl else None,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    backend = "nccl" if nccl else "gloo"
    # ranks on one device (share_device, or the host's memory on the CPU) split its free memory evenly
    tp = TensorParallel(rank, world_size, ranks_per_device=1 if nccl else world_size)
    _CONTEXT = RankContext(rank, world_size, dev, backend, tp, control)
    return _CONTEXT


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(obj))
    tmp.replace(path)  # atomic: the parent never reads half a file


def _error_record(rank: int, e: BaseException) -> dict[str, Any]:
    return {
        "rank": rank,
        "time": time.monotonic(),  # CLOCK_MONOTONIC: one clock for every process of the host (Linux)
        "type": f"{type(e).__module__}.{type(e).__qualname__}",
        "message": str(e),
        "user_error": isinstance(e, UserError),
        "problem": getattr(e, "problem", None),
        "fix": getattr(e, "fix", None),
        "traceback": "".join(traceback.format_exception(e)),
    }


def _watch_progress(board: Any, rank: int, main_thread: int) -> None:
    """A rank's daemon thread: every :data:`PROGRESS_EVERY_S` seconds, ``board[rank] = time.monotonic()`` when
    the rank made progress since the last look -- a control message passed (:func:`_broadcast`), or its main
    thread runs another line of Python -- or is idle, waiting for rank 0's next command
    (:func:`_next_command`). A main thread stuck in one call (a collective, a CUDA call such as the wait for
    a graph replay whose collective never completes, a lock, a sleep) makes no progress."""
    last = None
    while True:
        frame = sys._current_frames().get(main_thread)
        where = (_MESSAGES, None if frame is None else (frame.f_code, frame.f_lineno))
        del frame
        if where != last or _AWAITING_COMMAND:
            board[rank] = time.monotonic()
            last = where
        time.sleep(PROGRESS_EVERY_S)


def _worker(rank: int, world_size: int, device: str, folder: str, timeout_s: float,
            num_threads: int | None, payload: bytes, all_ranks: bool, share_device: bool, board: Any) -> None:
    """A rank's process (started by :func:`launch` with the spawn method). Exits 0 when done, 1 after writing
    ``error-<rank>.pkl`` (:func:`_error_record`) for an exception, 130 on Ctrl-C."""
    _die_with_parent()
    folder_path = Path(folder)
    # SIGUSR1 (the launcher's, when the launch stalls) writes this rank's Python stacks to stack-<rank>.txt
    stacks = open(folder_path / f"stack-{rank}.txt", "w")  # noqa: SIM115 - open for the process's lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        _init_rank(rank, world_size, device, str(folder_path / "rendezvous"), timeout_s, share_device)
        # progress is watched from here on: until then the rank is starting (the launcher allows it
        # START_ALLOWANCE_S more; the rendezvous waits for the slowest rank's imports)
        threading.Thread(target=_watch_progress, args=(board, rank, threading.get_ident()), daemon=True,
                         name="launch-progress").start()
        if rank == 0 or all_ranks:
            fn, args = pickle.loads(payload)
            result = fn(*args)
            if rank == 0:
                if not all_ranks:
                    _broadcast(("exit",))
                _write(folder_path / "result.pkl", result)
        else:
            serve()
        dist.destroy_process_group()
    except KeyboardInterrupt:  # Ctrl-C in a terminal reaches every rank; the launcher reports it
        sys.exit(130)
    except Exception as e:
        _write(folder_path / f"error-{rank}.pkl", _error_record(rank, e))
        sys.exit(1)  # the launcher prints the error and its traceback (once, not once per rank)


def _is_peer_loss(record: dict[str, Any]) -> bool:
    """Whether a rank's error says only that a peer went away (a consequence, not a cause)."""
    text = f"{record['type']}: {record['message']}"
    return any(s in text for s in PEER_LOST)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with status {exitcode} without reporting a Python error"


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _failure(folder: Path, procs: list[Any], seen_exit: dict[int, float], ended: set[int],
             world_size: int) -> Exception:
    """The exception for a failed launch. It names the rank that failed first and how (its Python error, or
    the signal / exit status it died of), then what followed on the other ranks.

    Order: a rank's time is that of its error record (written before it exits) or, for a rank that died
    without one, when the launcher saw it exit. An error that only says a peer went away (:data:`PEER_LOST`,
    e.g. gloo's "Connection reset by peer" after the peer was killed) never outranks a rank that died without
    a Python error: it is that death's consequence, however the two were timed."""
    records: dict[int, dict[str, Any]] = {}
    for f in folder.glob("error-*.pkl"):
        try:
            record = pickle.loads(f.read_bytes())
        except Exception:  # noqa: BLE001 - a record cut short by the kill: the exit status tells
            continue
        records[record["rank"]] = record
    events = []  # (peer loss?, time, rank)
    for rank, p in enumerate(procs):
        if rank in records:
            events.append((_is_peer_loss(records[rank]), records[rank]["time"], rank))
        elif rank in seen_exit and p.exitcode not in (0, None) and rank not in ended:
            events.append((False, seen_exit[rank], rank))
    if not events:
        return RankFailure(f"the launch of {world_size} ranks failed without a rank reporting why", -1)
    events.sort()
    first = events[0][2]
    then = []
    for _, _, rank in events[1:]:
        if rank in records:
            r = records[rank]
            then.append(f"rank {rank} failed with {r['type']}: {_first_line(r['message'])}")
        else:
            then.append(f"rank {rank} {_describe_exit(procs[rank].exitcode)}")
    stopped = sorted(ended - {e[2] for e in events})
    if stopped:
        then.append(f"the launcher ended rank{'s' if len(stopped) > 1 else ''} "
                    f"{', '.join(map(str, stopped))}")
    after = f" (afterwards: {'; '.join(then)})" if then else ""
    if first in records:
        r = records[first]
        if r["user_error"]:
            return UserError(f"rank {first} of {world_size}: {r['problem']}", r["fix"])
        return RankFailure(f"rank {first} of {world_size} failed first, with {r['type']}: {r['message']}"
                           f"{after}\n{r['traceback']}", first)
    why = _describe_exit(procs[first].exitcode)
    if procs[first].exitcode is not None and procs[first].exitcode < 0:
        why += " (out of memory? the NCCL watchdog after a collective timeout? or a kill)"
    else:
        why += " (its output above says why)"
    return RankFailure(f"rank {first} of {world_size} {why}{after}", first)


def _stall_failure(folder: Path, procs: list[Any], board: Any, started: float, stall_s: float,
                   world_size: int) -> RankFailure:
    """The exception for a launch a rank of which stopped making progress (:func:`_watch_progress`): each
    rank's seconds without progress and the line its main thread waits on (from the stacks SIGUSR1 dumps),
    the longest-idle rank first (named by ``RankFailure.rank``)."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)  # faulthandler writes at once; one second covers a busy machine
    now = time.monotonic()
    idle = {r: now - (board[r] or started) for r in range(world_size)}
    lines = []
    for rank in sorted(idle, key=idle.get, reverse=True):
        where = _waiting_line(folder / f"stack-{rank}.txt")
        lines.append(f"rank {rank}: no progress for {idle[rank]:.0f} s"
                     + (f", waiting in {where}" if where else ""))
    worst = max(idle, key=idle.get)
    return RankFailure(
        f"the launch of {world_size} ranks stopped making progress: rank {worst} did not run for "
        f"{stall_s:g} s (launch(stall_timeout_s=...); run.py: runtime.collective_timeout_s plus "
        f"{STALL_GRACE_S:g} s), so every rank was ended; {'; '.join(lines)}", worst)


def _waiting_line(path: Path) -> str | None:
    """The innermost frame of the first non-watcher thread in a faulthandler dump: 'file:line in function'."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for block in text.split("\n\n"):
        frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if frames and "_watch_progress" not in block:
            return frames[0].removeprefix("File ")
    return None


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    *,
    world_size: int,
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    num_threads: int | None = None,
    all_ranks: bool = False,
    share_device: bool = False,
    stall_timeout_s: float | None = None,
) -> Any:
    """Run ``fn(*args)`` on rank 0 of ``world_size`` new processes (the others serve rank 0's engines, see the
    module docstring) and return its result. ``fn`` must be a module-level function; ``args`` and the result
    must pickle.

    The ranks are started with the ``spawn`` method (fresh interpreters): whatever the calling process did
    before (initialised CUDA, started threads, forked) does not reach them. Every launch ends: the ranks are
    joined, and on a failure, Ctrl-C or a stall ended (SIGTERM, then SIGKILL); the launch's temporary folder
    is removed.

    Args:
        device: "cpu" (gloo) or "cuda" (NCCL; rank r on cuda:r, world_size GPUs needed).
        timeout_s: how long a collective of the model's process group waits before it raises.
        num_threads: torch intra-op threads per rank (None: torch's default).
        all_ranks: run ``fn`` on every rank instead (each may call torch.distributed itself); rank 0's result
            is returned.
        share_device: with device="cuda", every rank on cuda:0 and gloo instead of NCCL (one GPU checks the
            results of world size N; not its speed: see the module docstring).
        stall_timeout_s: seconds in which a rank makes no progress (passes no control message and runs no
            other line of Python, :func:`_watch_progress`; a follower waiting for rank 0's next command is
            idle, not stalled) before the launch is ended with :class:`RankFailure` naming each rank's wait;
            default ``timeout_s + STALL_GRACE_S`` (a stuck eager collective of the model's group reports its
            own timeout first; a collective inside a CUDA graph has none, and this bounds it). A rank still
            starting (importing, initialising its process group) gets :data:`START_ALLOWANCE_S` more.

    Raises:
        registry.errors.UserError: a rank raised one first (its problem prefixed with ``rank r of N:``).
        RankFailure: a rank raised anything else, or died (the first to fail is named, and how), or the launch
            stalled; the others were ended.
        KeyboardInterrupt: Ctrl-C; every rank was ended.
        ValueError: bad arguments.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: launch places rank r on cuda:r (device='cuda') or on the cpu")
    if share_device and device != "cuda":
        raise ValueError("share_device=True puts every rank on cuda:0; it needs device='cuda'")
    if device == "cuda" and torch.cuda.device_count() < (1 if share_device else world_size):
        raise ValueError(f"world_size={world_size} needs {1 if share_device else world_size} CUDA GPUs; "
                         f"{torch.cuda.device_count()} are visible"
                         + ("" if share_device else " (share_device=True runs every rank on one GPU)"))
    stall_s = timeout_s + STALL_GRACE_S if stall_timeout_s is None else stall_timeout_s
    if stall_s <= 0:
        raise ValueError(f"stall_timeout_s={stall_timeout_s} must be > 0")
    payload = pickle.dumps((fn, args))
    ctx = multiprocessing.get_context(START_METHOD)
    board = ctx.RawArray("d", world_size)  # per rank: time.monotonic() of its last progress; 0 = not started
    folder = Path(tempfile.mkdtemp(prefix="hybrid-launch-"))
    procs: list[Any] = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker, name=f"rank{rank}", args=(
                rank, world_size, device, str(folder), timeout_s, num_threads, payload, all_ranks,
                share_device, board))
            p.start()
            procs.append(p)
        started = time.monotonic()
        seen_exit: dict[int, float] = {}
        failed_at = None
        pending = {p.sentinel: rank for rank, p in enumerate(procs)}
        while pending:
            for s in multiprocessing.connection.wait(list(pending), timeout=0.5):
                rank = pending.pop(s)
                procs[rank].join()
                seen_exit[rank] = time.monotonic()
                if procs[rank].exitcode != 0 and failed_at is None:
                    failed_at = seen_exit[rank]
            now = time.monotonic()
            if failed_at is not None:
                if now - failed_at >= FAIL_GRACE_S:  # the others had time to report what they saw
                    break
                continue
            if any(now - board[r] > stall_s if board[r] else now - started > stall_s + START_ALLOWANCE_S
                   for r in pending.values()):
                raise _stall_failure(folder, procs, board, started, stall_s, world_size)
        ended = {rank for rank, p in enumerate(procs) if p.is_alive()}
        _end(procs)
        if failed_at is not None:
            raise _failure(folder, procs, seen_exit, ended, world_size) from None
        result = folder / "result.pkl"
        if not result.is_file():
            raise RankFailure("rank 0 finished without a result", 0)
        return pickle.loads(result.read_bytes())
    finally:  # Ctrl-C, a stall, an error: no rank outlives the launch, no folder stays behind
        _end(procs)
        shutil.rmtree(folder, ignore_errors=True)


def _end(procs: list[Any]) -> None:
    """End every rank still running: SIGTERM, then SIGKILL after a short grace; every rank is joined."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


if __name__ == "__main__":  # pragma: no cover - not a tool
    sys.exit("runners.engine.launch is a module; use runners.engine.launch.launch() or run.py world_size=N")
