"""A run's output folder: a fresh one per run, held by one run at a time, every result file written whole.

- The default folders (`hydra.run.dir`, `hydra.sweep.dir` in configs/config.yaml, and the app's own default
  outside Hydra) go through the `claim_dir` resolver: `${claim_dir:outputs/<entry>/<second>}` creates the
  folder exclusively (`os.mkdir` fails on an existing one) and, when a run started in the same second already
  has it, takes the first free `<folder>-2`, `-3`, ... So concurrent runs never share a default folder, and
  Hydra's own files (.hydra/) and the run's results land in the same one.
- Hydra writes no files at job start (hydra.output_subdir: null, configs/config.yaml): run.py keeps the three
  it would have written and `save_hydra_files` writes them into <folder>/.hydra once the run is accepted
  (it holds its folder, every check passed), so a refused run changes nothing in a folder that existed.
- `claim_out_dir` holds the folder for the run's lifetime: an exclusive lock on `<folder>/.run.lock`
  (`fcntl.flock`, released by the kernel when the process ends, also on SIGKILL). A folder the user named
  (`out_dir=` / `hydra.run.dir=`) that another live run holds is an error instead of a mix of two runs. A
  run that ends (finished, refused, interrupted) removes the lock file while it still holds the lock, so a
  finished folder holds only results; a run that took the lock of a file removed meanwhile sees that its file
  is no longer the folder's and locks the folder's current one instead (so two runs never hold the folder
  at once). Only a killed process (SIGKILL) leaves the file, unlocked.
- A refused run leaves nothing behind: `remove_unused_run_dir` removes its folder when it holds nothing a run
  produced (Hydra's .hydra/, the lock, generation files of a run that generated nothing) and the parents
  created for it, and only folders this process created (the claims above, or a folder named by out_dir= /
  hydra.run.dir= that `note_new_dirs` found missing before Hydra created it).
- `write_atomic` writes a file through a temporary file in the same folder and `os.replace` (POSIX rename is
  atomic): a run interrupted while writing, or a full disk, leaves the previous complete file, never a
  truncated one. Every result file (results.json, summary.md, the plots, samples.jsonl, comparison.json,
  generations.meta.json) goes through it; the append-only generations.jsonl is fsync'd line by line instead
  (runners.app.lm_adapter.GenerationStore).

Problems the user can fix (a folder under a file, no permission, a read-only file system, a full disk, a
folder in use) raise registry.errors.UserError.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.errors import UserError

LOCK_FILE = ".run.lock"
# A run's resume file (runners.app.lm_adapter.GenerationStore appends a line per finished request) and the
# files beside it, <stem>.stats.jsonl (a line per generate call that returned) and <stem>.meta.json (the run's
# fingerprint, written before any request): named here, below the store, for the unused-folder rule.
GENERATIONS_FILE = "generations.jsonl"
SAMPLES_FILE = "samples.jsonl"  # one scored record per document, written once scoring is done
STATS_SUFFIX = ".stats.jsonl"
META_SUFFIX = ".meta.json"
# A sweep job's status file in its run folder (evals.sweep writes it; it names the sweep folder, which
# evals.history reads): here, below both, so that neither imports the other for it.
JOB_STATUS_FILE = "job.json"
MAX_SUFFIX = 1000  # default folders tried: <folder>, <folder>-2 .. <folder>-1000
_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: result files get the permissions a plain open() would give them


def _fix_for(path: Path) -> str:
    return f"choose a writable folder with out_dir=... or hydra.run.dir=... (not {path})"


def _os_error(e: OSError, path: Path, what: str, fix: str | None = None, kind: str = "output folder"
              ) -> UserError:
    """UserError for an OSError met while creating / writing a folder (``kind``: what it is for), naming the
    cause."""
    reason = {
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only file system",
        errno.ENOTDIR: "a path component is a file, not a folder",
        errno.EEXIST: "a file of that name exists",
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
    }.get(e.errno, e.strerror or type(e).__name__)
    return UserError(
        f"{kind} {path} cannot be {what}: {reason} ({e.filename or path})", fix or _fix_for(path)
    )


def ensure_writable_dir(path: Path, fix: str | None = None, kind: str = "output folder") -> None:
    """Create `path` (and parents) if needed and check that a file can be created in it.

    Raises UserError naming the folder (as ``kind``: what it is for) and the reason (under a file,
    permission denied, read-only, full, a path that cannot hold folders such as /proc/x); its fix line is
    ``fix`` (default: run.py's out_dir= / hydra.run.dir= advice).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{kind} {path} exists and is not a folder (a file)", fix or _fix_for(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _os_error(e, path, "created", fix, kind) from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise _os_error(e, path, "written", fix, kind) from None


_CLAIMED: dict[str, str] = {}  # requested folder -> folder claimed by this process (claim_dir is idempotent)
_RUN_DIRS: list[str] = []  # run / sweep folders this process's config resolved to (run_dir, claim_dir)
# absolute paths of the folders this process created for runs, or found missing just before Hydra created
# them: the only folders remove_unused_run_dir removes
_NEW_DIRS: set[str] = set()
HYDRA_SUBDIR = ".hydra"  # where Hydra writes a run's composed config (hydra.output_subdir, Hydra's default)
_GENERATIONS = Path(GENERATIONS_FILE)
# what a run that generated nothing leaves in its folder: Hydra's composed config, the lock, the fingerprint
# of its generations, and (when empty) the generations and their stats
_UNUSED_RUN_FILES = frozenset({HYDRA_SUBDIR, LOCK_FILE, _GENERATIONS.stem + META_SUFFIX,
                               "multirun.yaml"})  # (the last: Hydra's record of a sweep's settings)
_UNUSED_WHEN_EMPTY = frozenset({GENERATIONS_FILE, _GENERATIONS.stem + STATS_SUFFIX})


def _unused(folder: Path) -> bool:
    """Whether `folder` holds nothing a run produced: only the files of _UNUSED_RUN_FILES, those of
    _UNUSED_WHEN_EMPTY when empty, and sub-folders of that kind (the compare=replay arms)."""
    for p in folder.iterdir():
        if p.is_symlink():
            return False
        if p.name in _UNUSED_RUN_FILES or (p.name in _UNUSED_WHEN_EMPTY and p.is_file()
                                           and p.stat().st_size == 0):
            continue
        if not (p.is_dir() and _unused(p)):
            return False
    return True


def _missing_dirs(path: str | Path) -> list[str]:
    """`path` and those of its parents that do not exist, as absolute paths, deepest first."""
    missing, p = [], Path(os.path.abspath(path))
    for d in (p, *p.parents):
        if d.exists():
            break
        missing.append(str(d))
    return missing


def note_new_dirs(path: str | Path) -> None:
    """Record `path` and those of its parents that do not exist yet as created for this process's run, before
    Hydra creates them (its run folder named by out_dir= or hydra.run.dir=): remove_unused_run_dir may remove
    them again, while a folder that existed before is never removed."""
    _NEW_DIRS.update(_missing_dirs(path))


def save_hydra_files(folder: str | Path, files: dict[str, Any]) -> None:
    """Write a job's Hydra files into `<folder>/.hydra` with Hydra's own writer
    (hydra.core.utils._save_config, what Hydra's run_job calls at job start when hydra.output_subdir is set).

    files: file name -> the DictConfig / ListConfig it holds (run.py: config.yaml, hydra.yaml,
    overrides.yaml, copied at job start). A .hydra/ this call creates is recorded as this run's
    (remove_unused_run_dir removes it again from a folder that existed). Raises UserError when the folder
    cannot be written.
    """
    from hydra.core.utils import _save_config

    target = Path(folder) / HYDRA_SUBDIR
    created = _missing_dirs(target)
    try:
        for name, cfg in files.items():
            _save_config(cfg, name, target)
    except OSError as e:
        raise _os_error(e, target, "written") from None
    finally:
        _NEW_DIRS.update(d for d in created if os.path.isdir(d))


def remove_unused_run_dir(folder: str | Path) -> None:
    """Remove the folder of a run that was refused before it generated anything, and the parents created for
    it, so a refused command leaves nothing behind.

    Removed: `folder` when this process created it (claim_fresh_dir, or note_new_dirs before Hydra made it),
    it holds nothing a run produced (Hydra's .hydra/, the run's lock, generations.meta.json, an empty
    generations.jsonl / generations.stats.jsonl, sub-folders holding only those), and no live run holds that
    lock (the refusal may be that very conflict); then each parent created with it, while empty. Of a folder
    that existed before, only the .hydra/ this run added. Anything else is left as it is: a folder that
    existed before, one holding generations of an earlier run or a user's files, a parent that another run's
    folder appeared in.
    Best effort: an OSError leaves the rest in place.
    """
    path = Path(os.path.abspath(folder))
    if str(path) not in _NEW_DIRS:
        if str(path / HYDRA_SUBDIR) in _NEW_DIRS:  # the folder existed: only Hydra's files of this run go
            shutil.rmtree(path / HYDRA_SUBDIR, ignore_errors=True)
        return
    try:
        if not path.is_dir() or not _unused(path):
            return
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a live run holds it
            shutil.rmtree(path)
        finally:
            os.close(fd)
        for parent in path.parents:
            if str(parent) not in _NEW_DIRS:
                break
            os.rmdir(parent)  # fails (ENOTEMPTY) once another run's folder is inside: kept
    except OSError:
        pass  # best effort: the refusal itself is what the user needs


def claim_dir(path: str) -> str:
    """Create a fresh folder for a run: `path` itself, or the first free `path-2`, `path-3`, ... when
    another run has it, each created exclusively (os.mkdir), parents as needed. Idempotent within a process
    (a second resolution of the same path returns the same folder). Registered as the OmegaConf resolver
    `claim_dir` by `register_resolver`. Raises UserError when nothing can be created there."""
    if path not in _CLAIMED:
        _CLAIMED[path] = claim_fresh_dir(path)
        _RUN_DIRS.append(_CLAIMED[path])
    return _CLAIMED[path]


def claim_fresh_dir(path: str) -> str:
    """claim_dir without its cache: every call creates a new folder (`path`, `path-2`, ...). The app's own
    default folder outside Hydra uses it, so two runs in one process within a second never share one."""
    requested = Path(path)
    i, retries = 1, 3
    while i <= MAX_SUFFIX:
        folder = requested if i == 1 else requested.with_name(f"{requested.name}-{i}")
        parents = _missing_dirs(requested.parent)
        try:
            requested.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _os_error(e, requested.parent, "created") from None
        _NEW_DIRS.update(parents)
        try:
            folder.mkdir()
        except FileExistsError:
            i += 1
            continue
        except FileNotFoundError as e:  # a refused run removed the parent it had created: create it again
            retries -= 1
            if retries:
                continue
            raise _os_error(e, folder, "created") from None
        except OSError as e:
            raise _os_error(e, folder, "created") from None
        _NEW_DIRS.add(os.path.abspath(folder))
        return str(folder)
    raise UserError(
        f"no free output folder next to {requested} ({MAX_SUFFIX} tried)",
        "pass out_dir= / hydra.run.dir= explicitly",
    )


def run_dir(out_dir: str | None, default: str) -> str:
    """Hydra's run folder: the user's `out_dir` when one is given (Hydra's .hydra/ files then go there, and
    no default folder is created beside it), else `claim_dir(default)`. Registered as the resolver
    `run_dir` (configs/config.yaml: `hydra.run.dir: ${run_dir:${out_dir},outputs/...}`). Hydra resolves it
    before it creates the folder: a missing out_dir is recorded as new then (note_new_dirs)."""
    if out_dir in (None, ""):
        return claim_dir(default)
    note_new_dirs(str(out_dir))
    _RUN_DIRS.append(str(out_dir))
    return str(out_dir)


def remove_unused_run_dirs() -> None:
    """remove_unused_run_dir for every run or sweep folder this process's config resolved to (claim_dir,
    run_dir): run.py's cleanup when Ctrl-C stops a command before its run was accepted, wherever that was
    (composing, resolving, checking)."""
    for folder in reversed(_RUN_DIRS):
        remove_unused_run_dir(folder)


def register_resolver() -> None:
    """Make `${claim_dir:<path>}` and `${run_dir:<out_dir>,<default>}` available to configs (run.py calls it
    before Hydra composes)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("claim_dir"):
        OmegaConf.register_new_resolver("claim_dir", claim_dir)
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_dir)


@dataclass
class Claim:
    """An output folder held by this process: `path`, and the open lock file that holds it (release() or
    the process's end frees it)."""

    path: Path
    _fd: int | None = None

    def release(self) -> None:
        """Remove the lock file, then free the lock (closing the descriptor releases it). Idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):  # best effort: the folder may be gone or read-only by now
                (self.path / LOCK_FILE).unlink()  # while still locked: see claim_out_dir
            os.close(self._fd)
            self._fd = None


def _holder(path: Path) -> str:
    try:
        return (path / LOCK_FILE).read_text().strip() or "another process"
    except OSError:
        return "another process"


def _is_file_of(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the one at ``path`` now (not one removed, or replaced, since)."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def folder_in_use(path: str | Path) -> str | None:
    """Whether a live run holds folder `path` (its lock, as :func:`claim_out_dir` takes it): that run's
    "pid N on host" line, or None (free, or no lock file). Creates and writes nothing: a probe before the
    claim, which stays the authority (a run may take the folder in between)."""
    try:
        fd = os.open(Path(path) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(Path(path))
    finally:
        os.close(fd)
    return None


def claim_out_dir(path: str | Path) -> Claim:
    """Create `path` if needed, check it is writable, and hold it for this run (the lock of the module doc).

    Returns a Claim (release it when the run ends: that removes the lock file). Raises UserError: the folder
    cannot be created or written; another live run holds it.
    """
    folder = Path(path)
    ensure_writable_dir(folder)
    lock = folder / LOCK_FILE
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _os_error(e, folder, "written") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(
                f"output folder {folder} is in use by a run that is still going ({_holder(folder)})",
                "wait for it to finish, or choose another out_dir= / hydra.run.dir=",
            ) from None
        if _is_file_of(fd, lock):
            break
        os.close(fd)  # a run that ended removed this file after it was opened here: lock the current one
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    return Claim(folder, fd)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` whole: into a temporary file beside it, fsync'd, then os.replace. A reader
    sees the old file or the new one, never a part. Raises UserError when the folder cannot be written."""
    path = Path(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise _os_error(e, path.parent, "written") from None
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _os_error(e, path.parent, "written") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
