"""The results history (evals/history.py): schema and its version, rows of a run, idempotent import, a writer
killed mid-transaction, concurrent writers, a locked database, and runners.app.main.run's guarded hook."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from history_factory import make_results, write_run
from test_app import _cfg, fakes, make_checkpoint  # noqa: F401 - fakes is a fixture used below

from evals import history
from registry.errors import UserError
from registry.schema import REPO_ROOT
from runners.app import main as app

BASELINE_COMPARE_RUN = REPO_ROOT / "docs" / "baselines" / "tiny_nemotron_h_mtp"


def _count(db: Path, table: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()


def test_new_database_has_the_current_schema_in_wal_mode(tmp_path):
    db = tmp_path / "sub" / "h.db"
    conn = history.connect(db)
    try:
        assert history.schema_version(conn) == history.SCHEMA_VERSION == 3
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert tables == {"runs", "checks", "comparisons", "samples"}
    finally:
        conn.close()


def test_schema_doc_lists_every_column():
    """docs/history_schema.md documents each column of each table (a column added without docs fails)."""
    doc = (REPO_ROOT / "docs" / "history_schema.md").read_text()
    conn = history.connect(":memory:")
    try:
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            assert f"### {table}" in doc, table
            for col in conn.execute(f"PRAGMA table_info({table})"):
                assert f"| `{col[1]}` |" in doc, (table, col[1])
    finally:
        conn.close()


def test_newer_foreign_and_missing_databases_are_refused(tmp_path):
    newer = tmp_path / "newer.db"
    history.connect(newer).close()
    conn = sqlite3.connect(newer)
    conn.execute(f"PRAGMA user_version = {history.SCHEMA_VERSION + 1}")
    conn.close()
    v = history.SCHEMA_VERSION
    with pytest.raises(history.HistoryError, match=f"schema version {v + 1}; this checkout reads up to {v}"):
        history.connect(newer)
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE notes (x)")
    conn.close()
    with pytest.raises(history.HistoryError, match="without a history schema version"):
        history.connect(foreign)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(history.HistoryError, match="is not a history database"):
        history.connect(junk)
    with pytest.raises(history.HistoryError, match="no history database"):
        history.connect(tmp_path / "absent.db", create=False)


def test_an_older_database_is_migrated_in_place(tmp_path, monkeypatch):
    """A current file with a run in it, opened by a checkout whose schema is one version newer (a
    hypothetical migration adding a column): migrated once, data kept."""
    db = tmp_path / "h.db"
    folder = write_run(tmp_path / "run", make_results(), correct=[1, 0, 0, 1])
    history.import_runs([folder], db)
    new = history.SCHEMA_VERSION + 1
    monkeypatch.setattr(history, "SCHEMA_VERSION", new)
    monkeypatch.setitem(history.MIGRATIONS, new, ["ALTER TABLE runs ADD COLUMN note TEXT"])
    conn = history.connect(db)
    try:
        assert history.schema_version(conn) == new
        assert conn.execute("SELECT entry, note FROM runs").fetchall() == [("tiny_nemotron_h_mtp", None)]
    finally:
        conn.close()
    history.connect(db).close()  # migrating again is a no-op


def test_a_version_2_database_keeps_its_accuracy_under_the_new_names(tmp_path):
    """Version 3 renamed the judged accuracy's columns (gsm8k_* -> accuracy_*): a database as version 2 left
    it (a run recorded, then the columns under their old names) is migrated in place with its values."""
    import sqlite3

    db = tmp_path / "h.db"
    folder = write_run(tmp_path / "run", make_results(), correct=[1, 0, 0, 1])
    history.import_runs([folder], db)
    cols = ("metric", "value", "reference", "threshold")
    conn = history.connect(db)
    try:
        want = conn.execute(f"SELECT {', '.join('accuracy_' + c for c in cols)} FROM runs").fetchone()
    finally:
        conn.close()
    assert want[1] == 50.0
    raw = sqlite3.connect(db)  # back to version 2's layout
    for c in cols:
        raw.execute(f"ALTER TABLE runs RENAME COLUMN accuracy_{c} TO gsm8k_{c}")
    raw.execute("PRAGMA user_version = 2")
    raw.commit()
    raw.close()
    conn = history.connect(db)
    try:
        assert history.schema_version(conn) == 3
        got = conn.execute(f"SELECT {', '.join('accuracy_' + c for c in cols)} FROM runs").fetchone()
        assert tuple(got) == tuple(want)
        assert [r["accuracy_value"] for r in history.fetch_runs(conn)] == [50.0]
    finally:
        conn.close()


def test_rows_of_a_single_run(tmp_path):
    sweep = tmp_path / "sweep"
    folder = write_run(sweep / "job0", make_results(ssm_replay=True, correct=[1, 0, 0, 1]),
                       correct=[1, 0, 0, 1], sweep_dir=sweep)
    db = tmp_path / "h.db"
    [(d, rec)] = history.import_runs([folder], db)
    assert rec.inserted and d == folder
    conn = history.connect(db)
    try:
        runs = history.fetch_runs(conn)
        samples = history.fetch_samples(conn, [runs[0]["id"]])
    finally:
        conn.close()
    [run] = runs
    assert run["entry"] == "tiny_nemotron_h_mtp" and run["setting"] == "replay K=3 float32 ws=1 cpu"
    assert run["source"] == "import" and run["sweep_dir"] == str(sweep) and run["run_dir"] == str(folder)
    assert run["n"] == 4 and run["accuracy_value"] == 50.0 and run["accuracy_threshold"] == -20.0
    assert run["acceptance_rate"] == 0.55 and run["acceptance_rate_floor"] == 0.43
    assert run["verdict_status"] == "pass" and run["verdict_passed"] == 1 and run["memory_bytes"] == 3072
    assert run["git_commit"] == "abc123" and run["lm_eval_version"] == "0.4.13"
    assert {c["name"]: c["status"] for c in run["checks"]} == {
        "gsm8k.mean": "pass", "acceptance.rate": "pass", "acceptance.length": "pass"}
    s = samples[run["id"]]
    assert s["doc_ids"] == [0, 1, 2, 3] and s["strict_match"] == [1, 0, 0, 1] and len(s["tokens_sha256"]) == 4


def test_rows_of_a_compare_run():
    """The shipped compare=replay baseline run: its comparison per filter becomes rows of `comparisons`."""
    results = json.loads((BASELINE_COMPARE_RUN / "results.json").read_text())
    rows = history.run_rows(results, BASELINE_COMPARE_RUN, source="import")
    assert rows.run["setting"] == "compare=replay K=3 float32 ws=1 cpu" and rows.run["n"] == 1319
    assert {c["filter"]: (c["a_only"], c["b_only"], c["num_diverged"]) for c in rows.comparisons} == {
        "strict_match": (0, 0, 0), "flexible_extract": (0, 0, 0)}
    assert rows.samples is None  # the compare folder's samples are in its arms


def test_import_is_idempotent_and_finds_runs_below_a_sweep(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for i, replay in enumerate((False, True)):
        write_run(sweep / f"job{i}", make_results(ssm_replay=replay), correct=[1, 0, 0, 1], sweep_dir=sweep)
    cmp_dir = tmp_path / "cmp"
    shutil.copytree(BASELINE_COMPARE_RUN, cmp_dir)
    (cmp_dir / "rewind").mkdir()  # an arm folder with its own results.json is part of the compare run
    shutil.copy(BASELINE_COMPARE_RUN / "rewind_results.json", cmp_dir / "rewind" / "results.json")
    db = tmp_path / "h.db"
    assert history.main(["--db", str(db), "import", str(sweep), str(cmp_dir)]) == 0
    assert "3 new of 3 runs" in capsys.readouterr().out
    assert history.main(["--db", str(db), "import", str(sweep), str(cmp_dir / "results.json")]) == 0
    out = capsys.readouterr().out
    assert "0 new of 3 runs" in out and out.count("already recorded") == 3
    assert _count(db, "runs") == 3 and _count(db, "comparisons") == 2 and _count(db, "checks") > 6
    assert history.main(["--db", str(db), "info"]) == 0
    assert f"schema version {history.SCHEMA_VERSION}, 3 runs, 1 entries" in capsys.readouterr().out
    assert history.main(["--db", str(db), "import", str(tmp_path / "nothing")]) == 2
    assert "error: " in capsys.readouterr().err


def test_a_folder_is_one_run_whose_newest_results_win(tmp_path):
    """A finished run resumed rewrites its results.json (new timings): the newer results replace the folder's
    row; results older than the recorded ones never replace them."""
    db = tmp_path / "h.db"
    folder = write_run(tmp_path / "run", make_results(wall=1.0), correct=[1, 0, 0, 1])
    os.utime(folder / "results.json", (1_000_000, 1_000_000))
    history.import_runs([folder], db)
    write_run(folder, make_results(wall=2.0), correct=[1, 0, 0, 1])
    os.utime(folder / "results.json", (2_000_000, 2_000_000))
    [(_, rec)] = history.import_runs([folder], db)
    assert rec.inserted and rec.replaced == 1
    assert _count(db, "runs") == 1 and _count(db, "checks") == 3 and _count(db, "samples") == 1
    conn = history.connect(db)
    assert conn.execute("SELECT wall_seconds FROM runs").fetchall() == [(2.0,)]
    conn.close()
    write_run(folder, make_results(wall=3.0), correct=[1, 0, 0, 1])
    os.utime(folder / "results.json", (1_500_000, 1_500_000))  # older than the recorded results
    [(_, rec)] = history.import_runs([folder], db)
    assert not rec.inserted and _count(db, "runs") == 1


def test_the_same_run_recorded_by_the_app_and_imported_is_one_row(fakes, tmp_path):  # noqa: F811
    ckpt = make_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    db = tmp_path / "h.db"
    results = app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={out}", f"history.db={db}"))
    assert _count(db, "runs") == 1
    conn = history.connect(db)
    [run] = history.fetch_runs(conn)
    machine = json.loads(conn.execute("SELECT machine_json FROM runs").fetchone()[0])
    conn.close()
    assert run["source"] == "run" and run["run_dir"] == str(out.resolve()) and run["sweep_dir"] is None
    assert machine["host"] and machine["torch"] and machine["python"] and "device_name" in machine
    assert run["git_commit"] == results["git_commit"]
    [(_, rec)] = history.import_runs([out], db)
    assert not rec.inserted and rec.run_id == run["id"] and _count(db, "runs") == 1


def test_history_disabled_and_broken_history_never_lose_the_run(fakes, tmp_path, capsys,  # noqa: F811
                                                                 monkeypatch):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "off"
    app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={out}", "history.db=null"))
    assert "history:" not in capsys.readouterr().out
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"not a database" * 200)
    out = tmp_path / "broken_run"
    # a file that is no history database is refused before the run, read only
    with pytest.raises(UserError, match=f"{broken} is not a history database \\(not an SQLite file\\)"):
        app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={out}", f"history.db={broken}"))
    assert broken.read_bytes() == b"not a database" * 200
    # one that breaks after that check (here: the check skipped) still never loses the run
    monkeypatch.setattr(app, "check_history_file", lambda path, fix: None)
    results = app.run(_cfg(f"model.checkpoint={ckpt}", f"out_dir={out}", f"history.db={broken}"))
    err = capsys.readouterr().err
    assert results["entry"] == "tiny_nemotron_h_mtp" and (out / "results.json").is_file()
    assert f"warning: the run was not recorded in the history database {broken}" in err
    assert f"python -m evals.history --db {broken} import {out}" in err
    # the printed command works as printed (with a database that can be written)
    command = err[err.index("python -m evals.history"):].split()
    good = tmp_path / "good.db"
    command[command.index("--db") + 1] = str(good)
    proc = subprocess.run([sys.executable, *command[1:]], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "1 new of 1 runs" in proc.stdout, proc.stdout + proc.stderr
    # a report from a database that does not exist: error / fix lines, exit 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "evals.history", "--db", str(tmp_path / "none.db"), "report",
                           "--out", str(tmp_path / "rep")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: no history database at {tmp_path / 'none.db'}")


def test_relative_history_path_is_relative_to_the_launch_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert history.resolve_db("hist/h.db") == tmp_path / "hist" / "h.db"
    assert history.resolve_db(None) is None and history.resolve_db("null") is None
    assert history.resolve_db(str(tmp_path / "abs.db")) == tmp_path / "abs.db"


def test_default_path_agrees_with_the_config(monkeypatch):
    text = (REPO_ROOT / "configs" / "config.yaml").read_text()
    assert f"db: ${{oc.env:{history.ENV_VAR},{history.DEFAULT_DB}}}" in text
    monkeypatch.delenv(history.ENV_VAR)
    assert history.default_db_path() == Path(history.DEFAULT_DB)


WRITER = textwrap.dedent('''
    import sys, time
    sys.path[:0] = [{root!r}, {tests!r}]
    from evals import history
    from history_factory import make_results

    db, tag, count, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    original = history._insert_details

    def slow_details(conn, run_id, rows):
        original(conn, run_id, rows)
        print("inside", run_id, flush=True)  # the run row and its checks are written, not committed
        time.sleep(hold)

    history._insert_details = slow_details
    for i in range(count):
        history.record_run(make_results(commit=f"{{tag}}-{{i}}", wall=float(i)), None, db)
    print("done", flush=True)
''')


def _writer(tmp_path: Path, db: Path, tag: str, count: int, hold: float) -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(root=str(REPO_ROOT), tests=str(Path(__file__).parent)))
    return subprocess.Popen([sys.executable, str(script), str(db), tag, str(count), str(hold)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_writer_killed_mid_transaction_leaves_no_half_row(tmp_path):
    db = tmp_path / "h.db"
    history.import_runs([write_run(tmp_path / "earlier", make_results(commit="earlier"))], db)
    proc = _writer(tmp_path, db, "killed", 1, 60.0)
    line = proc.stdout.readline()
    assert line.startswith("inside"), line + proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    conn = history.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert [r["git_commit"] for r in history.fetch_runs(conn)] == ["earlier"]
        assert conn.execute("SELECT COUNT(*) FROM checks").fetchone()[0] == 3  # the earlier run's only
    finally:
        conn.close()
    history.record_run(make_results(commit="after"), None, db)  # the lock died with the writer
    assert _count(db, "runs") == 2


def test_two_concurrent_writers_both_land_every_row(tmp_path):
    """Two processes each hold the write lock for 0.1 s per run while the other waits (busy timeout)."""
    db = tmp_path / "h.db"
    history.connect(db).close()
    procs = [_writer(tmp_path, db, tag, 6, 0.1) for tag in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip().endswith("done"), err
    conn = history.connect(db)
    try:
        runs = history.fetch_runs(conn)
        assert sorted(r["git_commit"] for r in runs) == sorted(f"{t}-{i}" for t in "ab" for i in range(6))
        assert all(len(r["checks"]) == 3 for r in runs)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


def test_a_database_locked_too_long_is_a_clear_error(tmp_path, monkeypatch):
    db = tmp_path / "h.db"
    history.connect(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    monkeypatch.setattr(history, "BUSY_TIMEOUT_S", 0.05)
    monkeypatch.setattr(history, "WRITE_ATTEMPTS", 3)
    t0 = time.monotonic()
    try:
        with pytest.raises(history.HistoryError, match="stayed locked while recording"):
            history.record_run(make_results(), None, db)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert time.monotonic() - t0 < 10
    history.record_run(make_results(), None, db)
    assert _count(db, "runs") == 1


def test_report_errors_are_error_and_fix_lines(tmp_path, capsys):
    """`report --out` a folder that cannot be made (/proc/x), or an existing file, and a database whose pages
    are damaged: one error line, one fix line, exit 2 (no FileNotFoundError / FileExistsError /
    sqlite3.DatabaseError traceback)."""
    write_run(tmp_path / "run", make_results(), correct=[1, 0, 1, 1])
    db = tmp_path / "h.db"
    assert history.main(["--db", str(db), "import", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, why in (("/proc/x", "cannot be created"), (str(a_file), "is not a folder")):
        assert history.main(["--db", str(db), "report", "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: output folder {out} ") and why in err, err
        assert "\n  fix: pass a writable folder with --out" in err
    # damage every page after the first (the header and schema stay readable, the rows do not)
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    assert len(data) > 2 * page
    data[page:] = bytes([0xA5]) * (len(data) - page)
    db.write_bytes(bytes(data))
    for command in (["report", "--out", str(tmp_path / "rep")], ["info"]):
        assert history.main(["--db", str(db), *command]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {db} cannot be read: ") and "damaged" in err, err
        assert "\n  fix: restore it from a copy" in err


def _dummy_results(**kw) -> dict:
    """make_results of a run over random weights (config.load_format = "dummy")."""
    res = make_results(**kw)
    res["config"]["load_format"] = "dummy"
    return res


def test_dummy_runs_have_their_own_setting(tmp_path):
    """A dummy-weight run and a real one of the same entry and settings are separate trend lines; a config
    without load_format (an older run) is a real one."""
    db = tmp_path / "h.db"
    real = write_run(tmp_path / "real", make_results(correct=[1, 0, 0, 1]), correct=[1, 0, 0, 1])
    dummy = write_run(tmp_path / "dummy", _dummy_results(correct=[0, 0, 0, 0]), correct=[0, 0, 0, 0])
    history.import_runs([real, dummy], db)
    conn = history.connect(db)
    try:
        rows = {r["run_dir"]: (r["setting"], r["load_format"]) for r in history.fetch_runs(conn)}
    finally:
        conn.close()
    assert rows == {str(real): ("rewind K=3 float32 ws=1 cpu", "auto"),
                    str(dummy): ("rewind K=3 float32 ws=1 cpu load=dummy", "dummy")}


def test_version_1_rows_get_their_load_format(tmp_path):
    """Migration 2 on a version-1 file: rows without the column count as "auto", except those whose stored
    config says dummy, which also move to the dummy setting."""
    db = tmp_path / "h.db"
    real = write_run(tmp_path / "real", make_results(correct=[1, 0, 0, 1]), correct=[1, 0, 0, 1])
    dummy = write_run(tmp_path / "dummy", _dummy_results(correct=[0, 0, 0, 0]), correct=[0, 0, 0, 0])
    history.import_runs([real, dummy], db)
    conn = sqlite3.connect(db)  # back to version 1: no column, settings without the load format
    for c in ("metric", "value", "reference", "threshold"):  # and version 1's names (migration 3)
        conn.execute(f"ALTER TABLE runs RENAME COLUMN accuracy_{c} TO gsm8k_{c}")
    conn.execute("ALTER TABLE runs DROP COLUMN load_format")
    conn.execute("UPDATE runs SET setting = 'rewind K=3 float32 ws=1 cpu'")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    conn = history.connect(db)
    try:
        assert history.schema_version(conn) == history.SCHEMA_VERSION
        rows = {r["run_dir"]: (r["setting"], r["load_format"]) for r in history.fetch_runs(conn)}
    finally:
        conn.close()
    assert rows == {str(real): ("rewind K=3 float32 ws=1 cpu", "auto"),
                    str(dummy): ("rewind K=3 float32 ws=1 cpu load=dummy", "dummy")}
