"""One process per tensor-parallel rank: launch, lockstep engines, failures.

:func:`launch` starts ``world_size`` processes on this host (``torch.multiprocessing.start_processes``, forked
from a forkserver that imported torch once).
Each initialises ``torch.distributed`` (NCCL on CUDA GPUs, rank r on ``cuda:r``; gloo on the CPU) with a
timeout on every collective, plus a second gloo group for control messages. Rank 0 runs ``fn(*args)``, and
its return value is :func:`launch`'s; the other ranks serve rank 0's engines until it returns:

- :func:`build_engine` on rank 0 broadcasts the checkpoint path and its ``EngineOptions``, and every rank
  builds the same engine (``Engine.from_pretrained(path, options, tensor_parallel=...)``: each loads and
  allocates only its shard, ``runners.engine.tp``); rank 0 gets a :class:`LockstepEngine`.
  :func:`rebuild_engine` makes a new engine (other draft length, replay, cache sizes) around the model every
  rank already holds.
- Rank 0 drives and broadcasts per step. Its engine's ``generate`` loop runs on rank 0 only (admission, stop
  checks, ``on_finish`` callbacks, lm-eval around it); each engine method that runs the model
  (:data:`LOCKSTEP_METHODS`: ``_prefill`` (admission), ``_launch`` (queue one decode / speculative step, its
  phases run eagerly), ``_step_tokens`` (read a queued step's tokens), ``logits``, ``force_acceptance``)
  first broadcasts its name and host-side arguments over the control group, and every other rank runs the
  same method with the same arguments. A step handle (``runners.engine.step.LaunchedStep``: pinned host
  buffers) is not sent: each follower keeps the steps it launched in launch order, and ``_step_tokens``
  reads its oldest (the engine reads steps in launch order). So all ranks run the same
  forwards in the same order and their all-reduces pair up; the device state the steps keep (caches, the next
  drafts) evolves identically, since every rank computes the same all-reduced hidden states, logits and
  tokens. The followers need neither tokenizer nor callbacks. Cost: one small broadcast per step. At the end
  of every ``generate`` all ranks compare a digest of the tokens their steps produced
  (:meth:`LockstepEngine.check_lockstep`): ranks that diverged raise instead of reporting wrong numbers.
  (The alternative, every rank running ``generate`` itself, would need the caller's ``stop_checker`` on every
  rank and deterministic there.)

Failures: an exception on any rank is written, with its rank and traceback, to the launch's folder; the parent
process, which watches every rank, then ends the others (SIGTERM) and raises: a ``UserError`` as a UserError
whose problem starts with ``rank r:`` (run.py prints it as usual), anything else as :class:`RankFailure`. A
rank that dies without a Python exception (a signal, the NCCL watchdog's abort) is reported with its exit
status. A rank stuck in a collective whose peer is alive but elsewhere raises after ``timeout_s`` (the process
group's timeout). Ctrl-C (SIGINT to the parent) ends every rank; ranks also die with the parent
(``PR_SET_PDEATHSIG``). On CUDA the ranks keep NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, unless already set).

One host only (the control messages and rendezvous use a file in a temporary folder).

Engines of ``world_size > 1`` run without the prefix cache: each rank's cache would be sized by its own free
memory and could evict, and so prefill, differently from the others, and the ranks' all-reduces would no
longer pair up. The engine decides it from its ``tensor_parallel`` shard
(``runners.engine.prefix_cache.prefix_cache_off_reason``, the policy's one owner).

Engines of ``world_size > 1`` step eagerly: :func:`build_engine` and :func:`rebuild_engine` build them with
``cuda_graphs=False`` and ``overlap_steps=False`` (and raise ValueError when asked for either), because
capturing the model's all-reduces in CUDA graphs and running steps ahead of the host have not been checked
with NCCL, and gloo (CPU, ``share_device``) all-reduces through the host, which a CUDA graph cannot capture.

``share_device=True`` (CUDA only) puts every rank on cuda:0 and runs the model's collectives over gloo, which
all-reduces CUDA tensors through host memory (NCCL refuses two ranks on one GPU). It exists to check
correctness -- tokens, acceptance and logits of world size N at real dimensions -- on a machine with one GPU;
its throughput says nothing about NCCL tensor parallelism (the ranks share one GPU's compute and every
all-reduce is a device-host round trip).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import hashlib
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
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
import torch.multiprocessing as mp

from registry.errors import UserError
from runners.engine.engine import Engine
from runners.engine.options import EngineOptions
from runners.engine.tp import TensorParallel

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LOCKSTEP_METHODS",
    "LockstepEngine",
    "RankContext",
    "RankFailure",
    "build_engine",
    "current",
    "rebuild_engine",
    "launch",
]

START_METHOD = "forkserver"  # of torch.multiprocessing.start_processes (see launch())
DEFAULT_TIMEOUT_S = 600  # seconds a collective of the model's process group may wait for its peers
CONTROL_TIMEOUT = timedelta(days=1)  # followers wait for rank 0's next command (it may run lm-eval for long)
# Engine methods that run model compute: rank 0 broadcasts each call so that every rank runs it
LOCKSTEP_METHODS = ("_prefill", "_launch", "_step_tokens", "logits", "force_acceptance")
_TOKEN_STEPS = ("_prefill", "_step_tokens")  # their results (token ids) enter the digest
_STEP_OPTIONS = ("cuda_graphs", "overlap_steps")  # off under launch (module docstring)
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
    ctx = _require()
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ctx.control)
    return box[0]


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


def _compare_digests(digest: Any) -> None:
    """Every rank contributes its digest; raises RuntimeError on every rank when they differ."""
    ctx = _require()
    digests: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(digests, digest.hexdigest(), group=ctx.control)
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"tensor-parallel ranks diverged: the token ids their engine steps produced differ "
            f"(digests by rank: {[d[:12] for d in digests]}); the ranks' all-reduced activations are not "
            "bitwise equal"
        )


class LockstepEngine(Engine):
    """Rank 0's engine under :func:`launch` (built by :func:`build_engine`): each method of
    :data:`LOCKSTEP_METHODS` first broadcasts its call to the other ranks, which run it on their engine;
    ``generate`` ends with :meth:`check_lockstep`. Otherwise an :class:`runners.Engine` (the same API)."""

    _digest: Any = None

    def generate(self, *args: Any, **kwargs: Any):
        out = super().generate(*args, **kwargs)
        self.check_lockstep()
        return out

    def check_lockstep(self) -> None:
        """Compare the digest of every rank's step results (token ids) since the engine was built; raises
        RuntimeError when a rank produced different tokens."""
        _broadcast(("digest",))
        _compare_digests(self._digest)


def _lockstep(name: str) -> Callable:
    step = getattr(Engine, name)

    @functools.wraps(step)
    def method(self: LockstepEngine, *args: Any, **kwargs: Any) -> Any:
        if name == "_step_tokens":  # the followers read their own oldest launched step
            _broadcast(("call", name, (), {}))
        else:
            _broadcast(("call", name, _to_host(args), _to_host(kwargs)))
        result = step(self, *args, **kwargs)
        _digest_update(self._digest, name, result)
        return result

    return method


for _name in LOCKSTEP_METHODS:
    setattr(LockstepEngine, _name, _lockstep(_name))


def _eager_steps(options: EngineOptions) -> EngineOptions:
    """``options`` with ``cuda_graphs`` and ``overlap_steps`` off (module docstring: engines under launch step
    eagerly). Raises ValueError when either is asked for (True)."""
    asked = [k for k in _STEP_OPTIONS if getattr(options, k)]
    if asked:
        raise ValueError(
            f"{' and '.join(asked)} with world_size > 1: tensor-parallel engines step eagerly (CUDA graphs "
            "of the ranks' all-reduces and run-ahead steps are not supported yet); pass "
            f"{', '.join(k + '=False' for k in asked)} (run.py: runtime.cuda_graphs=false)"
        )
    return options.replace(**dict.fromkeys(_STEP_OPTIONS, False))


def build_engine(path: str | Path, options: EngineOptions | None = None) -> LockstepEngine:
    """On rank 0 of :func:`launch`: build ``Engine.from_pretrained(path, options)`` on every rank, each on
    its own device with its shard (the rank's ``tensor_parallel`` and ``device``), and return rank 0's
    :class:`LockstepEngine`. The other ranks drop the engine they held before.

    Raises:
        ValueError: ``options`` ask for CUDA graphs or overlapping steps (:func:`_eager_steps`).
    """
    ctx = _require()
    if ctx.rank != 0:
        raise RuntimeError("build_engine runs on rank 0; the other ranks build theirs from its message")
    options = _eager_steps(options or EngineOptions())
    _broadcast(("build", str(path), options))
    engine = LockstepEngine.from_pretrained(path, options, device=ctx.device, tensor_parallel=ctx.tp)
    engine._digest = hashlib.sha256()
    return engine


def rebuild_engine(engine: LockstepEngine, options: EngineOptions | None = None) -> LockstepEngine:
    """On rank 0 of :func:`launch`: a new engine on every rank around the model the ranks already hold
    (``Engine(model, options)``: new caches and settings such as draft_len, ssm_replay, max_batch_size, no
    reload), e.g. to run several arms on one load. Drop ``engine`` afterwards: its caches stay allocated while
    it is referenced."""
    ctx = _require()
    options = _eager_steps(options or EngineOptions())
    _broadcast(("rebuild", options))
    new = LockstepEngine(engine.model, options, device=ctx.device, tensor_parallel=engine.tensor_parallel)
    new.load_report = engine.load_report
    new._digest = hashlib.sha256()
    return new


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
    launched: deque = deque()  # this rank's queued steps (Engine._launch handles), oldest first
    while True:
        message = _broadcast()
        op = message[0]
        if op == "exit":
            return
        if op in ("build", "rebuild"):
            launched.clear()
        if op == "build":
            _free(engine)
            engine, digest = None, hashlib.sha256()
            engine = Engine.from_pretrained(message[1], message[2], device=ctx.device, tensor_parallel=ctx.tp)
        elif op == "rebuild":
            model, tp = engine.model, engine.tensor_parallel
            engine = None  # its caches go before the new ones are allocated
            engine = Engine(model, message[1], device=ctx.device, tensor_parallel=tp)
            digest = hashlib.sha256()
        elif op == "call":
            name, args, kwargs = message[1:]
            if name == "_step_tokens":
                args = (launched.popleft(),)
            result = getattr(engine, name)(*args, **kwargs)
            if name == "_launch":
                launched.append(result)
            _digest_update(digest, name, result)
        elif op == "digest":
            _compare_digests(digest)
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
    _CONTEXT = RankContext(rank, world_size, dev, backend, TensorParallel(rank, world_size), control)
    return _CONTEXT


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(obj))
    tmp.replace(path)  # atomic: the parent never reads half a file


def _error_record(rank: int, e: BaseException) -> dict[str, Any]:
    return {
        "rank": rank,
        "time": time.time(),
        "type": f"{type(e).__module__}.{type(e).__qualname__}",
        "message": str(e),
        "user_error": isinstance(e, UserError),
        "problem": getattr(e, "problem", None),
        "fix": getattr(e, "fix", None),
        "traceback": "".join(traceback.format_exception(e)),
    }


def _worker(rank: int, world_size: int, device: str, folder: str, timeout_s: float,
            num_threads: int | None, payload: bytes, all_ranks: bool, share_device: bool) -> None:
    _die_with_parent()
    folder_path = Path(folder)
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        _init_rank(rank, world_size, device, str(folder_path / "rendezvous"), timeout_s, share_device)
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
    except Exception as e:
        _write(folder_path / f"error-{rank}.pkl", _error_record(rank, e))
        raise


def _failure(folder: Path, exc: Exception, world_size: int) -> Exception:
    """The exception to raise for a failed launch: the earliest rank error written, else the exit status."""
    records = []
    for f in folder.glob("error-*.pkl"):
        try:
            records.append(pickle.loads(f.read_bytes()))
        except Exception:  # noqa: BLE001 - a record cut short by the kill: the others (or exc) tell
            continue
    if records:
        first = min(records, key=lambda r: r["time"])
        rank = first["rank"]
        if first["user_error"]:
            return UserError(f"rank {rank} of {world_size}: {first['problem']}", first["fix"])
        return RankFailure(
            f"rank {rank} of {world_size} failed with {first['type']}: {first['message']}\n"
            f"{first['traceback']}", rank)
    rank = getattr(exc, "error_index", -1)
    if getattr(exc, "signal_name", None):
        why = (f"was killed by {exc.signal_name} (out of memory? or the NCCL watchdog after a collective "
               "timeout)")
    else:
        why = f"ended without reporting a Python error ({exc}; its output above says why)"
    return RankFailure(f"rank {rank} of {world_size} {why}", rank)


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
) -> Any:
    """Run ``fn(*args)`` on rank 0 of ``world_size`` new processes (the others serve rank 0's engines, see the
    module docstring) and return its result. ``fn`` must be a module-level function; ``args`` and the result
    must pickle.

    Args:
        device: "cpu" (gloo) or "cuda" (NCCL; rank r on cuda:r, world_size GPUs needed).
        timeout_s: how long a collective of the model's process group waits before it raises.
        num_threads: torch intra-op threads per rank (None: torch's default).
        all_ranks: run ``fn`` on every rank instead (each may call torch.distributed itself); rank 0's result
            is returned.
        share_device: with device="cuda", every rank on cuda:0 and gloo instead of NCCL (one GPU checks the
            results of world size N; not its speed: see the module docstring).

    Raises:
        registry.errors.UserError: a rank raised one (its problem prefixed with ``rank r of N:``).
        RankFailure: a rank raised anything else, or died; the others were ended.
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
    payload = pickle.dumps((fn, args))
    # forkserver: a server process started once (per launching process) imports torch and the engine, and
    # forks the ranks from it; spawn would import them again in every rank (seconds each on a small CPU).
    # The ranks are fresh forks of a process that never touched CUDA or threads, as spawned ones are.
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(["runners.engine.launch"])
    with tempfile.TemporaryDirectory(prefix="hybrid-launch-") as folder:
        context = mp.start_processes(
            _worker,
            args=(world_size, device, folder, timeout_s, num_threads, payload, all_ranks, share_device),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        try:
            while not context.join(timeout=1.0):
                pass
        except KeyboardInterrupt:
            _end(context)
            raise
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            _end(context)
            raise _failure(Path(folder), e, world_size) from None
        result = Path(folder) / "result.pkl"
        if not result.is_file():
            raise RankFailure("rank 0 finished without a result", 0)
        return pickle.loads(result.read_bytes())


def _end(context: Any) -> None:
    """End every rank still running: SIGTERM, then SIGKILL after a short grace."""
    for p in context.processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in context.processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


if __name__ == "__main__":  # pragma: no cover - not a tool
    sys.exit("runners.engine.launch is a module; use runners.engine.launch.launch() or run.py world_size=N")
