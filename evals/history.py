"""The results history: every finished run's results in one SQLite database, so a nightly job remembers
yesterday (schema and its versioning: docs/history_schema.md).

`record_finished_run(results, run_dir, db)` is what runners.app.main.run calls once per finished run, after
results.json is written: it never raises, so a history problem is reported on stderr and loses nothing (the
run folder can be imported later). `python -m evals.history import <run or sweep folder>...` imports saved
runs (idempotent: a run is identified by the SHA-256 of its results, so importing it twice, or importing a run
that recorded itself, adds no row); `python -m evals.history report --out DIR` renders the trend report
(evals/trends.py).

Writes are one transaction per run (`BEGIN IMMEDIATE` ... `COMMIT`): a writer killed at any point leaves
either the whole run (its row, its verdict checks, its comparison and per-sample rows) or nothing. The
database runs in WAL mode, so readers never block the writer, with a busy timeout and retries with backoff
so that the jobs of one sweep, or two sweeps on one host, can write at the same time. WAL needs every writer
on one host (it shares memory through the -shm file): on a cluster, keep the database on the submitting
host and let the sweep's end import the jobs' folders (evals/sweep.py does), docs/nightly.md.

Only the standard library's sqlite3 is used.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import random
import socket
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from evals.outdir import JOB_STATUS_FILE  # a sweep job's status file; it names the sweep folder
from evals.results import RESULTS_FILE, load_format, read_results
from evals.task import DEFAULT_TASK, TASKS, task_of_results
from registry.baselines import file_protocol
from registry.errors import UserError
from registry.schema import LoadFormat

SCHEMA_VERSION = 3  # PRAGMA user_version of a current database; docs/history_schema.md
ENV_VAR = "HYBRID_EVAL_HISTORY"
DEFAULT_DB = "outputs/history.db"  # relative to the launch directory; configs/config.yaml says the same
BUSY_TIMEOUT_S = 30.0  # how long one statement waits for another writer's lock before SQLITE_BUSY
WRITE_ATTEMPTS = 8  # transactions retried on SQLITE_BUSY / "database is locked", with jittered backoff

# Migrations: MIGRATIONS[v] takes a database from version v - 1 to v. Version 0 is an empty file. Each step
# runs in the same transaction as the user_version bump, so a migration is all or nothing.
MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY,
            run_key TEXT NOT NULL UNIQUE,
            finished_at TEXT NOT NULL,
            recorded_at TEXT NOT NULL,
            source TEXT NOT NULL CHECK (source IN ('run', 'import')),
            run_dir TEXT,
            sweep_dir TEXT,
            entry TEXT NOT NULL,
            model_key TEXT,
            setting TEXT NOT NULL,
            ssm_replay INTEGER,
            draft_len INTEGER,
            world_size INTEGER,
            device TEXT,
            dtype TEXT,
            ssm_state_dtype TEXT,
            compare TEXT,
            eval_limit INTEGER,
            num_fewshot INTEGER,
            git_commit TEXT,
            git_dirty INTEGER,
            n INTEGER,
            strict_match REAL,
            flexible_extract REAL,
            gsm8k_metric TEXT,
            gsm8k_value REAL,
            gsm8k_reference REAL,
            gsm8k_threshold REAL,
            acceptance_rate REAL,
            acceptance_rate_floor REAL,
            acceptance_length REAL,
            acceptance_length_reference REAL,
            acceptance_length_floor REAL,
            verdict_status TEXT,
            verdict_passed INTEGER,
            wall_seconds REAL,
            prefill_tokens_per_s REAL,
            decode_tokens_per_s REAL,
            memory_bytes INTEGER,
            host TEXT,
            device_name TEXT,
            torch_version TEXT,
            triton_version TEXT,
            lm_eval_version TEXT,
            python_version TEXT,
            config_json TEXT NOT NULL,
            memory_json TEXT NOT NULL,
            timings_json TEXT NOT NULL,
            machine_json TEXT NOT NULL,
            results_json TEXT NOT NULL
        )""",
        "CREATE INDEX runs_by_setting ON runs (entry, setting, finished_at)",
        "CREATE INDEX runs_by_sweep ON runs (sweep_dir)",
        "CREATE INDEX runs_by_dir ON runs (run_dir)",
        """CREATE TABLE checks (
            run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            name TEXT NOT NULL,
            status TEXT NOT NULL,
            value REAL,
            reference REAL,
            threshold REAL,
            unit TEXT,
            note TEXT,
            PRIMARY KEY (run_id, name)
        )""",
        """CREATE TABLE comparisons (
            run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            filter TEXT NOT NULL,
            label_a TEXT NOT NULL,
            label_b TEXT NOT NULL,
            n INTEGER NOT NULL,
            a_only INTEGER NOT NULL,
            b_only INTEGER NOT NULL,
            accuracy_a REAL,
            accuracy_b REAL,
            mcnemar_p REAL,
            num_diverged INTEGER,
            PRIMARY KEY (run_id, filter)
        )""",
        """CREATE TABLE samples (
            run_id INTEGER PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE,
            doc_ids TEXT NOT NULL,
            strict_match TEXT NOT NULL,
            flexible_extract TEXT NOT NULL,
            tokens_sha256 TEXT
        )""",
    ],
    # the weights' origin (results.json config.load_format): rows of older runs read the checkpoint ("auto"),
    # except runs already recorded over random weights, which also get their setting re-keyed (setting_label)
    2: [
        "ALTER TABLE runs ADD COLUMN load_format TEXT NOT NULL DEFAULT 'auto'",
        """UPDATE runs SET load_format = 'dummy', setting = setting || ' load=dummy'
            WHERE json_extract(config_json, '$.load_format') = 'dummy'""",
    ],
    # the judged accuracy's columns name no task (the task's own scores stay in checks and results.json)
    3: [f"ALTER TABLE runs RENAME COLUMN gsm8k_{c} TO accuracy_{c}"
        for c in ("metric", "value", "reference", "threshold")],
}
assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION + 1))


class HistoryError(UserError):
    """The database cannot be used: written by a newer version, not a history database, locked for too long,
    or a results dict / folder that cannot be recorded (problem / fix: registry.errors.UserError)."""


# ----------------------------------------------------------------------------------------------------------
# Connection, schema version, transactions


def check_history_file(path: Path, fix: str) -> None:
    """Refuse, before a run, a file at ``path`` that is not a history database (another SQLite file, or not
    SQLite at all), reading it only: the run would otherwise finish and then fail to record itself. A
    missing or empty file is fine (it is created). Raises HistoryError with ``fix`` as its fix line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb") as f:
        header = f.read(16)
    tables: set[str] = set()
    if header == b"SQLite format 3\x00":
        with contextlib.suppress(sqlite3.DatabaseError), contextlib.closing(
                sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "runs" not in tables:
        raise HistoryError(f"{path} is not a history database"
                           + (" (an SQLite file without its tables)" if header == b"SQLite format 3\x00"
                              else " (not an SQLite file)"), fix)


def default_db_path() -> Path:
    """$HYBRID_EVAL_HISTORY, else outputs/history.db under the current directory."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_DB)


def _is_busy(e: sqlite3.OperationalError) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


def _retrying(what: str, fn: Callable[[], Any]) -> Any:
    """fn(), retried on SQLITE_BUSY with jittered exponential backoff; HistoryError when it never gets in."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            return fn()
        except sqlite3.OperationalError as e:
            if not _is_busy(e) or attempt == WRITE_ATTEMPTS - 1:
                if _is_busy(e):
                    raise HistoryError(
                        f"the history database stayed locked while {what} ({WRITE_ATTEMPTS} attempts, "
                        f"{BUSY_TIMEOUT_S:.0f} s each): {e}",
                        "another process holds a write transaction open; retry, or import the run folder "
                        "later with python -m evals.history import <folder>",
                    ) from e
                raise
            time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: BEGIN IMMEDIATE (takes the write lock up front, so two writers never deadlock
    upgrading read locks), COMMIT on success, ROLLBACK on any exception (also KeyboardInterrupt)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def connect(path: str | os.PathLike, *, create: bool = True) -> sqlite3.Connection:
    """Open (and create or migrate) a history database; the connection is in autocommit mode (transactions
    are explicit, see transaction()), WAL, with a busy timeout and foreign keys on.

    Raises HistoryError: the file is not a history database (another SQLite file, or not SQLite), it was
    written by a newer schema version, or (create=False) it does not exist.
    """
    path = Path(path)
    if not path.exists():
        if not create:
            raise HistoryError(f"no history database at {path}",
                               f"run a sweep or import run folders first (python -m evals.history --db "
                               f"{path} import <folder>), or pass --db / set ${ENV_VAR}")
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        _retrying("switching to WAL mode", lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone())
        conn.execute("PRAGMA foreign_keys = ON")
        _migrate(conn, path)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise HistoryError(f"{path} is not a history database: {e}",
                           f"pass another --db / {ENV_VAR}, or move that file away") from None
    except BaseException:
        conn.close()
        raise
    return conn


def schema_version(conn: sqlite3.Connection) -> int:
    """The database's schema version (PRAGMA user_version; 0 for a new, empty file)."""
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the database to SCHEMA_VERSION, one migration per transaction; refuse newer or foreign files."""
    version = schema_version(conn)
    if version > SCHEMA_VERSION:
        raise HistoryError(
            f"{path} has history schema version {version}; this checkout reads up to {SCHEMA_VERSION}",
            "update the checkout (git pull), or use another database file",
        )
    if version == 0:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        if tables:
            raise HistoryError(
                f"{path} is an SQLite database without a history schema version "
                f"(tables: {', '.join(tables)})",
                f"pass another --db / {ENV_VAR}; this file is not a results history",
            )
    while version < SCHEMA_VERSION:

        def step(v: int = version + 1) -> bool:
            with transaction(conn):
                if schema_version(conn) >= v:  # another process migrated while this one waited
                    return False
                for statement in MIGRATIONS[v]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {v}")
            return True

        _retrying(f"migrating the schema to version {version + 1}", step)
        version = schema_version(conn)


# ----------------------------------------------------------------------------------------------------------
# One run as rows


def canonical_results(results: Mapping[str, Any]) -> dict[str, Any]:
    """The results dict as results.json holds it (json.dump(..., default=str) read back)."""
    return json.loads(json.dumps(results, default=str))


def run_key(results: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the results: one finished run, however often it is recorded."""
    text = json.dumps(canonical_results(results), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def setting_label(config: Mapping[str, Any]) -> str:
    """The run's setting as one string, e.g. "replay K=3 float32 ws=1 cpu": what a trend line follows.

    Mode: "compare" (compare=replay), "replay" / "rewind" (SSM replay on / off), "greedy" (draft_len 0);
    then the draft length, compute dtype (and a non-float32 SSM state dtype), world size and device kind,
    the task when it is not the default row (evals.task: another task's scores are another trend line),
    "<n>-shot" / "gen=<n>" when eval.num_fewshot / eval.max_gen_toks differ from the protocol of the task's
    references (registry.baselines.file_protocol: another protocol is another benchmark), and "load=<format>"
    when the weights were not read from the checkpoint (model.load_format=dummy: random
    weights, whose speed and scores must not join the real runs' trend; a config without the field, from an
    older run, read the checkpoint).
    """
    draft_len = int(config.get("draft_len") or 0)
    if config.get("compare"):
        mode = f"compare={config['compare']}"
    elif draft_len == 0:
        mode = "greedy"
    else:
        mode = "replay" if config.get("ssm_replay") else "rewind"
    parts = [mode]
    if draft_len:
        parts.append(f"K={draft_len}")
    parts.append(str(config.get("dtype")))
    state = ((config.get("model") or {}).get("ssm") or {}).get("state_dtype")
    if state and state != "float32":
        parts.append(f"state={state}")
    parts.append(f"ws={config.get('world_size')}")
    device = str(config.get("device") or "?")
    parts.append("gpu" if device.startswith("cuda") else device)
    task = (config.get("eval") or {}).get("name") or DEFAULT_TASK
    if task != DEFAULT_TASK:
        parts.append(f"task={task}")
    parts += _protocol_parts(config.get("eval") or {}, task)
    fmt = load_format({"config": config})
    if fmt != LoadFormat.auto.value:
        parts.append(f"load={fmt}")
    return " ".join(parts)


def _protocol_parts(eval_cfg: Mapping[str, Any], task: str) -> list[str]:
    """["<n>-shot", "gen=<n>"]: the settings of a run's protocol that differ from its task's references
    (none for a config without them, from an older run, or a task without a baselines file)."""
    try:
        ref = file_protocol(TASKS[task].baselines_path)
    except (KeyError, UserError):
        return []
    out = []
    if eval_cfg.get("num_fewshot") is not None and int(eval_cfg["num_fewshot"]) != ref.num_fewshot:
        out.append(f"{int(eval_cfg['num_fewshot'])}-shot")
    if eval_cfg.get("max_gen_toks") is not None and int(eval_cfg["max_gen_toks"]) != ref.max_gen_toks:
        out.append(f"gen={int(eval_cfg['max_gen_toks'])}")
    return out


def machine_info() -> dict[str, Any]:
    """Where this process runs: host, device name, and the versions of the libraries results depend on.

    The device name is the CUDA device's when torch is already imported and CUDA is available, else the
    CPU's model name (Linux /proc/cpuinfo, else platform.processor()).
    """
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    device_name = None
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_available():
                device_name = torch.cuda.get_device_name(torch.cuda.current_device())
    if device_name is None:
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    device_name = line.split(":", 1)[1].strip()
                    break
    return {
        "host": socket.gethostname(),
        "device_name": device_name or platform.processor() or None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "triton": version("triton"),
        "lm_eval": version("lm-eval") or version("lm_eval"),
        "flashinfer": version("flashinfer-python"),
    }


def _utc(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")


def _check(results: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    for c in (results.get("verdict") or {}).get("checks") or []:
        if str(c.get("name", "")).startswith(prefix):
            return c
    return {}


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _bool(x: Any) -> int | None:
    return None if x is None else int(bool(x))


def _sweep_dir(run_dir: Path) -> str | None:
    """The multirun folder a run belongs to: job.json's `sweep_dir` (evals/sweep.py), else Hydra's saved
    config of the job (.hydra/hydra.yaml: output_dir minus the job's override_dirname), else None."""
    job = run_dir / JOB_STATUS_FILE
    if job.is_file():
        with contextlib.suppress(ValueError, OSError):
            sweep = json.loads(job.read_text()).get("sweep_dir")
            if sweep:
                return str(sweep)
    hydra_yaml = run_dir / ".hydra" / "hydra.yaml"
    if hydra_yaml.is_file():
        import yaml

        with contextlib.suppress(Exception):
            h = (yaml.safe_load(hydra_yaml.read_text()) or {}).get("hydra") or {}
            if str(h.get("mode")) == "RunMode.MULTIRUN" or h.get("mode") == "MULTIRUN":
                out = str((h.get("runtime") or {}).get("output_dir") or "")
                sub = str((h.get("job") or {}).get("override_dirname") or "")
                if out and sub and out.endswith(sub):
                    return str(Path(out[: -len(sub)]))
                if out and not sub:
                    return out
    return None


def _current_sweep_dir(run_dir: Path) -> str | None:
    """The sweep folder of the running Hydra job when it is a multirun job writing into run_dir."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:  # pragma: no cover - hydra is a dependency
        return None
    if not HydraConfig.initialized():
        return None
    h = HydraConfig.get()
    if h.mode != RunMode.MULTIRUN:
        return None
    return str((Path(h.runtime.cwd) / str(h.sweep.dir)).resolve())


@dataclass
class RunRows:
    """The rows of one run: `run` (column -> value of table runs), `checks`, `comparisons`, `samples`."""

    run: dict[str, Any]
    checks: list[dict[str, Any]]
    comparisons: list[dict[str, Any]]
    samples: dict[str, Any] | None


def run_rows(results: Mapping[str, Any], run_dir: str | os.PathLike | None, *, source: str,
             finished_at: str | None = None, machine: Mapping[str, Any] | None = None,
             sweep_dir: str | None = None) -> RunRows:
    """Rows for one results dict (docs/results_schema.md) written by the run in run_dir.

    finished_at: UTC ISO-8601; default results.json's modification time in run_dir, else now. machine:
    default results["machine"] when the results carry one, else machine_info() for source "run" and unknown
    for "import". Per-sample rows come from run_dir's samples.jsonl (evals.compare.load_run_samples) when
    present. Raises HistoryError when results has no `entry` or `config`.
    """
    res = canonical_results(results)
    if not isinstance(res.get("config"), dict) or not res.get("entry"):
        raise HistoryError("the results have no `entry` / `config` section (not a results.json of run.py)",
                           "import the folder of a finished run (docs/results_schema.md)")
    folder = Path(run_dir).resolve() if run_dir is not None else None
    if finished_at is None:
        rj = folder / RESULTS_FILE if folder is not None else None
        finished_at = _utc(rj.stat().st_mtime if rj is not None and rj.is_file() else time.time())
    if machine is None:
        machine = res.get("machine") if isinstance(res.get("machine"), dict) else (
            machine_info() if source == "run" else {})
    c = res["config"]
    section = task_of_results(res).section  # the run's task row: where its scores and score check are
    g = res.get(section) or {}
    acc = res.get("acceptance") or {}
    gcheck, rate = _check(res, section + "."), _check(res, "acceptance.rate")
    length = _check(res, "acceptance.length")
    verdict = res.get("verdict") or {}
    memory = res.get("memory") or {}
    timings = res.get("timings") or {}
    eval_cfg = c.get("eval") or {}
    run = {
        "run_key": run_key(res),
        "finished_at": finished_at,
        "recorded_at": _utc(time.time()),
        "source": source,
        "run_dir": str(folder) if folder is not None else None,
        "sweep_dir": sweep_dir,
        "entry": str(res["entry"]),
        "model_key": res.get("model_key"),
        "setting": setting_label(c),
        "load_format": load_format(res),
        "ssm_replay": _bool(c.get("ssm_replay")),
        "draft_len": c.get("draft_len"),
        "world_size": c.get("world_size"),
        "device": c.get("device"),
        "dtype": c.get("dtype"),
        "ssm_state_dtype": ((c.get("model") or {}).get("ssm") or {}).get("state_dtype"),
        "compare": c.get("compare"),
        "eval_limit": eval_cfg.get("limit"),
        "num_fewshot": eval_cfg.get("num_fewshot"),
        "git_commit": res.get("git_commit"),
        "git_dirty": _bool(res.get("git_dirty")),
        "n": g.get("n"),
        "strict_match": _num(g.get("strict_match")),
        "flexible_extract": _num(g.get("flexible_extract")),
        "accuracy_metric": (gcheck.get("details") or {}).get("metric"),
        "accuracy_value": _num(gcheck.get("value")),
        "accuracy_reference": _num(gcheck.get("reference")),
        "accuracy_threshold": _num(gcheck.get("threshold")),
        "acceptance_rate": _num(acc.get("rate")),
        "acceptance_rate_floor": _num(rate.get("threshold")),
        "acceptance_length": _num(acc.get("length")),
        "acceptance_length_reference": _num(length.get("reference")),
        "acceptance_length_floor": _num(length.get("threshold")),
        "verdict_status": verdict.get("status"),
        "verdict_passed": _bool(verdict.get("passed")),
        "wall_seconds": _num(timings.get("wall_seconds")),
        "prefill_tokens_per_s": _num(timings.get("prefill_tokens_per_s")),
        "decode_tokens_per_s": _num(timings.get("decode_tokens_per_s")),
        "memory_bytes": int(sum(v for v in memory.values() if isinstance(v, int | float))),
        "host": machine.get("host"),
        "device_name": machine.get("device_name"),
        "torch_version": machine.get("torch"),
        "triton_version": machine.get("triton"),
        "lm_eval_version": machine.get("lm_eval") or (res.get("task") or {}).get("lm_eval_version"),
        "python_version": machine.get("python"),
        "config_json": json.dumps(c, sort_keys=True),
        "memory_json": json.dumps(memory, sort_keys=True),
        "timings_json": json.dumps(timings, sort_keys=True),
        "machine_json": json.dumps(dict(machine), sort_keys=True),
        "results_json": json.dumps(res, sort_keys=True),
    }
    checks = [
        {"name": str(ch.get("name")), "status": str(ch.get("status")), "value": _num(ch.get("value")),
         "reference": _num(ch.get("reference")), "threshold": _num(ch.get("threshold")),
         "unit": ch.get("unit"), "note": ch.get("note")}
        for ch in verdict.get("checks") or []
    ]
    comparisons = []
    comp = res.get("comparison") or {}
    div = comp.get("divergence") or {}
    for name, f in (comp.get("filters") or {}).items():
        comparisons.append({
            "filter": name, "label_a": comp.get("label_a", "a"), "label_b": comp.get("label_b", "b"),
            "n": int(f.get("n", comp.get("n", 0))), "a_only": int(f.get("a_only", 0)),
            "b_only": int(f.get("b_only", 0)), "accuracy_a": _num(f.get("accuracy_a")),
            "accuracy_b": _num(f.get("accuracy_b")), "mcnemar_p": _num(f.get("mcnemar_p")),
            "num_diverged": div.get("num_diverged"),
        })
    samples = _sample_rows(folder) if folder is not None and not comp else None
    return RunRows(run, checks, comparisons, samples)


def _sample_rows(folder: Path) -> dict[str, Any] | None:
    """Per-sample correctness and token hashes of a single run's folder; None without samples.jsonl."""
    from evals.compare import ComparisonError, load_run_samples
    from evals.outdir import SAMPLES_FILE

    if not (folder / SAMPLES_FILE).is_file():
        return None

    try:
        samples = load_run_samples(folder)
    except (ComparisonError, ValueError, OSError):
        return None  # a damaged samples file does not stop the run's own row; the report says "no samples"
    ids = sorted(samples, key=lambda s: (isinstance(s, str), s))

    def bits(key: str) -> list[int]:
        return [int(bool(samples[i].get(key))) for i in ids]

    tokens = None
    if ids and all("tokens" in samples[i] for i in ids):
        tokens = [hashlib.sha256(json.dumps(samples[i]["tokens"]).encode()).hexdigest()[:16] for i in ids]
    return {"doc_ids": json.dumps(ids), "strict_match": json.dumps(bits("strict_match")),
            "flexible_extract": json.dumps(bits("flexible_extract")),
            "tokens_sha256": json.dumps(tokens) if tokens is not None else None}


def _insert(conn: sqlite3.Connection, table: str, row: Mapping[str, Any]) -> sqlite3.Cursor:
    cols = list(row)
    sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})"
    return conn.execute(sql, [row[c] for c in cols])


def _insert_run(conn: sqlite3.Connection, rows: RunRows) -> int | None:
    """Insert the run row; None when a run with the same run_key is already recorded."""
    cols = list(rows.run)
    sql = (f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)}) "
           "ON CONFLICT (run_key) DO NOTHING")
    cur = conn.execute(sql, [rows.run[c] for c in cols])
    return cur.lastrowid if cur.rowcount == 1 else None


def _insert_details(conn: sqlite3.Connection, run_id: int, rows: RunRows) -> None:
    """The run's verdict checks, comparison filters and per-sample row (same transaction as the run)."""
    for ch in rows.checks:
        _insert(conn, "checks", {"run_id": run_id, **ch})
    for comp in rows.comparisons:
        _insert(conn, "comparisons", {"run_id": run_id, **comp})
    if rows.samples is not None:
        _insert(conn, "samples", {"run_id": run_id, **rows.samples})


@dataclass
class Recorded:
    """What record_rows did: the run's row id; whether a row was written (False: these results, or newer ones
    of the same folder, are already in the database); how many older rows of the same folder it replaced."""

    run_id: int
    inserted: bool
    replaced: int = 0


def record_rows(conn: sqlite3.Connection, rows: RunRows) -> Recorded:
    """Write one run's rows in one transaction (retried while the database is busy).

    One row per run: the same results (run_key) are written once; and a run folder holds one run, so results
    of a folder that already has a row (a finished run resumed, which rewrites its results.json) replace
    that row when they are newer (finished_at) and are skipped when they are older.
    """

    def write() -> Recorded:
        with transaction(conn):
            same = conn.execute("SELECT id FROM runs WHERE run_key = ?", (rows.run["run_key"],)).fetchone()
            if same is not None:
                return Recorded(int(same[0]), False)
            older = []
            if rows.run["run_dir"] is not None:
                prior = conn.execute("SELECT id, finished_at FROM runs WHERE run_dir = ?",
                                     (rows.run["run_dir"],)).fetchall()
                newer = [rid for rid, when in prior if when > rows.run["finished_at"]]
                if newer:
                    return Recorded(int(newer[0]), False)
                older = [rid for rid, _ in prior]
                for rid in older:
                    conn.execute("DELETE FROM runs WHERE id = ?", (rid,))  # its details cascade
            run_id = _insert_run(conn, rows)
            assert run_id is not None  # the run_key was checked inside this transaction
            _insert_details(conn, run_id, rows)
            return Recorded(run_id, True, len(older))

    return _retrying(f"recording {rows.run['entry']}", write)


def record_run(results: Mapping[str, Any], run_dir: str | os.PathLike | None, db: str | os.PathLike, *,
               source: str = "run", sweep_dir: str | None = None) -> Recorded:
    """Record one finished run's results (the dict written to run_dir/results.json) in the database db.

    Idempotent: a run already recorded (same results) is not added again; newer results of an already
    recorded run folder replace its row (record_rows). Raises HistoryError (see connect and run_rows) and
    sqlite3 errors other than "busy".
    """
    folder = Path(run_dir) if run_dir is not None else None
    if sweep_dir is None and folder is not None:
        sweep_dir = _current_sweep_dir(folder) if source == "run" else None
        sweep_dir = sweep_dir or _sweep_dir(folder)
    rows = run_rows(results, folder, source=source, sweep_dir=sweep_dir)
    conn = connect(db)
    try:
        return record_rows(conn, rows)
    finally:
        conn.close()


def resolve_db(db: str | os.PathLike | None) -> Path | None:
    """The configured database path made absolute: relative to the directory the Hydra application was
    started from (hydra.runtime.cwd) inside a Hydra job, else to the current directory. None stays None."""
    if db is None or str(db).strip() in ("", "null", "None"):
        return None
    path = Path(os.path.expanduser(str(db)))
    if path.is_absolute():
        return path
    base = Path.cwd()
    with contextlib.suppress(ImportError, ValueError):
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            base = Path(HydraConfig.get().runtime.cwd)
    return base / path


def record_finished_run(results: Mapping[str, Any], run_dir: str | os.PathLike, db: str | None) -> bool:
    """runners.app.main.run's hook: record the run; on any failure print a warning naming the import command.

    Never raises (the results are already in run_dir/results.json). Returns whether the run is in the
    database now. db None: history disabled, nothing printed.
    """
    path = resolve_db(db)
    if path is None:
        return False
    try:
        rec = record_run(results, run_dir, path, source="run")
    except Exception as e:  # noqa: BLE001 - a history failure must never lose or fail the run
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"warning: the run was not recorded in the history database {path}: {first}\n"
              f"  its results are in {Path(run_dir) / RESULTS_FILE}; record them later with: "
              f"python -m evals.history --db {path} import {run_dir}", file=sys.stderr)
        return False
    note = ", already recorded" if not rec.inserted else (", replaces the folder's earlier results"
                                                         if rec.replaced else "")
    print(f"history: {path} (run {rec.run_id}{note})")
    return True


# ----------------------------------------------------------------------------------------------------------
# Import of saved run folders


def find_run_dirs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Run folders under paths: a results.json file's folder, a folder holding results.json, or every such
    folder below a folder without one (a sweep). A compare=replay run counts once (its rewind / replay arm
    folders are part of it), sorted by path."""
    found: list[Path] = []

    def walk(d: Path) -> None:
        if (d / RESULTS_FILE).is_file():
            found.append(d)
            return
        for sub in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
            walk(sub)

    for p in map(Path, paths):
        if p.is_file() and p.name == RESULTS_FILE:
            found.append(p.parent)
        elif p.is_dir():
            walk(p)
        else:
            raise HistoryError(f"{p} is neither a run folder nor a results.json",
                               "pass run folders (with results.json) or sweep folders")
    return sorted(set(found))


def import_runs(paths: Sequence[str | os.PathLike], db: str | os.PathLike) -> list[tuple[Path, Recorded]]:
    """Record every run folder under paths (find_run_dirs) in db; [(folder, Recorded)].

    Raises HistoryError for a path that holds no run, a UserError for a results.json that cannot be read or
    is not a run's (evals.results.read_results, run_rows): every folder is read before the database is
    opened, so a refused import creates no database.
    """
    dirs = find_run_dirs(paths)
    if not dirs:
        raise HistoryError(f"no results.json under {', '.join(map(str, paths))}",
                           "pass the output folder of a finished run or sweep")
    rows = [(d, run_rows(read_results(d), d, source="import", sweep_dir=_sweep_dir(d))) for d in dirs]
    conn = connect(db)
    try:
        return [(d, record_rows(conn, r)) for d, r in rows]
    finally:
        conn.close()


# ----------------------------------------------------------------------------------------------------------
# Reading


def fetch_runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every run row (without the large JSON columns), oldest first, with its checks under "checks"."""
    cols = [r[1] for r in conn.execute("PRAGMA table_info(runs)") if not r[1].endswith("_json")]
    runs = [dict(zip(cols, r)) for r in conn.execute(
        f"SELECT {', '.join(cols)} FROM runs ORDER BY finished_at, id")]
    checks: dict[int, list[dict[str, Any]]] = {}
    for row in conn.execute("SELECT run_id, name, status, value, reference, threshold, unit FROM checks"):
        checks.setdefault(row[0], []).append(dict(zip(
            ("name", "status", "value", "reference", "threshold", "unit"), row[1:])))
    for r in runs:
        r["checks"] = checks.get(r["id"], [])
    return runs


def fetch_comparisons(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Comparison rows of compare=replay runs joined with their run's entry, setting, time and folder."""
    sql = ("SELECT r.id, r.entry, r.setting, r.finished_at, r.run_dir, r.git_commit, c.filter, c.label_a, "
           "c.label_b, c.n, c.a_only, c.b_only, c.mcnemar_p, c.num_diverged FROM comparisons c "
           "JOIN runs r ON r.id = c.run_id ORDER BY r.finished_at, r.id, c.filter")
    keys = ("run_id", "entry", "setting", "finished_at", "run_dir", "git_commit", "filter", "label_a",
            "label_b", "n", "a_only", "b_only", "mcnemar_p", "num_diverged")
    return [dict(zip(keys, row)) for row in conn.execute(sql)]


def fetch_samples(conn: sqlite3.Connection, run_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """{run id: {"doc_ids", "strict_match", "flexible_extract", "tokens_sha256"}} (lists) for those runs."""
    out = {}
    for rid in run_ids:
        row = conn.execute("SELECT doc_ids, strict_match, flexible_extract, tokens_sha256 FROM samples "
                           "WHERE run_id = ?", (rid,)).fetchone()
        if row is not None:
            out[rid] = {k: (json.loads(v) if v is not None else None) for k, v in zip(
                ("doc_ids", "strict_match", "flexible_extract", "tokens_sha256"), row)}
    return out


def write_trend_report(db: str | os.PathLike, out_dir: str | os.PathLike) -> Any:
    """Read the history database db and write its trend report into out_dir (created; files overwritten):
    index.html, report.md and one PNG per entry x setting (evals.trends.render_trend_report, which reads no
    database). Returns evals.trends.TrendFiles. Raises HistoryError when db does not exist or is not a
    history database."""
    from evals.trends import render_trend_report  # matplotlib: only for the report

    conn = connect(db, create=False)
    try:
        runs = fetch_runs(conn)
        comparisons = fetch_comparisons(conn)
        samples = fetch_samples(conn, [r["id"] for r in runs])
    finally:
        conn.close()
    return render_trend_report(db, runs, comparisons, samples, out_dir)


# ----------------------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    """`python -m evals.history import|report|info`; exit 0, or 2 with error / fix lines."""
    parser = argparse.ArgumentParser(prog="python -m evals.history", description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=None,
                        help=f"history database (default: ${ENV_VAR}, else {DEFAULT_DB})")
    sub = parser.add_subparsers(dest="command", required=True)
    p_imp = sub.add_parser("import", help="record saved run folders (or sweep folders) in the database")
    p_imp.add_argument("paths", nargs="+", type=Path, help="run folders, results.json files or sweep folders")
    p_rep = sub.add_parser("report", help="render the trend report (index.html, report.md, PNG plots)")
    p_rep.add_argument("--out", type=Path, required=True, help="folder to write the report into")
    sub.add_parser("info", help="schema version, number of runs, entries and settings")
    args = parser.parse_args(argv)
    db = args.db or default_db_path()
    try:
        if args.command == "import":
            done = import_runs(args.paths, db)
            new = sum(r.inserted for _, r in done)
            for d, r in done:
                what = "replaced" if r.replaced else "recorded" if r.inserted else "already recorded"
                print(f"{what}  run {r.run_id}  {d}")
            print(f"{new} new of {len(done)} runs -> {db}")
        elif args.command == "report":
            files = write_trend_report(db, args.out)
            print(f"report: {files.html}\n        {files.markdown}")
        else:
            conn = connect(db, create=False)
            try:
                runs = fetch_runs(conn)
                print(f"{db}: schema version {schema_version(conn)}, {len(runs)} runs, "
                      f"{len({r['entry'] for r in runs})} entries, "
                      f"{len({(r['entry'], r['setting']) for r in runs})} entry x setting series")
            finally:
                conn.close()
    except UserError as e:  # HistoryError, and an --out folder that cannot be written
        print(e.format(), file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as e:  # a database whose header reads but whose pages do not
        print(HistoryError(f"{db} cannot be read: {e} (the file is damaged)",
                           f"restore it from a copy, or recover its rows with sqlite3 {db} .recover; or "
                           f"start a new database with --db / ${ENV_VAR}").format(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
