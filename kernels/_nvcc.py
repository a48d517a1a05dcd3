"""The project's CUDA kernels built with nvcc at first use and loaded with ctypes: one build cache, one way of
finding nvcc, one race-free build (kernels/mamba2/replay_cuda.py, kernels/quant/pair_cuda.py use it).

A library is built per (source text, nvcc flags) into ``cache_dir()`` as ``<stem>_<sha256 of both>.so``; a file
lock serialises builders of one library and the result is renamed into place, so concurrent processes never
load a half-written file. nvcc is ``$NVCC``, else on PATH, else ``$CUDA_HOME/bin/nvcc``, else
/usr/local/cuda/bin/nvcc.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/hybrid_mtp_eval/replay_cuda (default ~/.cache/...): where the built libraries live (the
    folder keeps the name of its first user)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hybrid_mtp_eval" / "replay_cuda"


def find_nvcc() -> str | None:
    """The nvcc to build with: $NVCC, nvcc on PATH, $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc; None."""
    cands = [os.environ.get("NVCC"), shutil.which("nvcc")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    cands.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def arch_of(device: torch.device) -> str:
    """nvcc's -arch for `device`: "sm_<major><minor>" of torch.cuda.get_device_capability."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def library_path(source: Path, flags: list[str]) -> Path:
    """cache_dir()/<source stem>_<hash>.so, the hash over the source text and the flags."""
    h = hashlib.sha256(source.read_bytes())
    h.update("\0".join(flags).encode())
    return cache_dir() / f"{source.stem}_{h.hexdigest()[:20]}.so"


def build(source: Path, flags: list[str], nvcc: str | None, *, name: str, what: str, fix: str) -> Path:
    """The library of `source` built with `flags` (everything but the output path and the source) unless the
    cache already has it; returns its path. `nvcc` is the compiler (the caller's ``find_nvcc()``, None when
    there is none); `name`, `what` and `fix` word the errors ("replay_verify", "variant 'cuda'", "use ...").

    Raises:
        ValueError: no nvcc, a cache folder that cannot be written, or the build failed (nvcc's output tail in
            the message), each with `fix`.
    """
    path = library_path(source, flags)
    if path.exists():
        return path
    if nvcc is None:
        raise ValueError(f"{name}: {what} compiles {source.parent.parent.name}/{source.parent.name}/{source.name} "
                         f"with nvcc at first use, and no nvcc was found ($NVCC, PATH, $CUDA_HOME/bin, "
                         f"/usr/local/cuda/bin); install the CUDA toolkit or set NVCC=/path/to/nvcc, or {fix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise ValueError(f"{name}: {what} builds its kernel into {path.parent}, which cannot be written "
                         f"({e.strerror or e}); set XDG_CACHE_HOME to a writable folder, or {fix}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it while we waited
            return path
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
        os.close(fd)
        try:
            p = subprocess.run([nvcc, *flags, "-o", tmp, str(source)], capture_output=True, text=True)
            if p.returncode != 0:
                raise ValueError(f"{name}: {what}: nvcc failed (exit {p.returncode}) building {source.name} with "
                                 f"{' '.join(flags)}:\n{(p.stdout + p.stderr)[-3000:]}\n"
                                 f"fix: check the CUDA toolkit (nvcc {nvcc}) supports this GPU, or {fix}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def check_abi(got: int, expected: int, path: str, owner: str) -> None:
    """Refuse a loaded library whose ABI number ``got`` (its ``*_abi()`` export) is not ``expected``: a stale
    build (the cache key hashes the source, so this takes a file put there by hand or an older scheme).

    Raises:
        ValueError: naming the library, both numbers and the fix (delete the cache folder; it is rebuilt).
    """
    if got != expected:
        raise ValueError(f"{owner}: {path} has ABI {got}, this module expects {expected}; delete {cache_dir()} "
                         "and rerun (it is rebuilt)")
