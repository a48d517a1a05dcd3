"""The nightly sweep: the experiment config, the entries it selects, job folder names, the SLURM launcher's
composition, the sweep's summary table and exit status (evals/sweep.py), with the jobs in this process
(Hydra's basic launcher) and in other processes (submitit's local launcher)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from evals.sweep import collect_jobs, format_table, summarize
from registry import selection
from registry.compose import CONFIG_DIR, CONFIG_NAME
from registry.errors import UserError
from registry.schema import REPO_ROOT, entry_names


def _compose(*overrides: str, hydra_config: bool = True):
    selection.register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(CONFIG_NAME, overrides=list(overrides), return_hydra_config=hydra_config)


def test_nightly_experiment_sweeps_the_marked_entries_with_replay_off_and_on():
    cfg = _compose("+experiment=nightly")
    assert cfg.hydra.mode.name == "MULTIRUN"
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True)
    assert params == {"model": "tiny_nemotron_h_mtp,tiny_qwen3_next_mtp", "ssm_replay": "false,true"}
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra:job.override_dirname}"
    assert cfg.hydra.callbacks.sweep_summary._target_ == "evals.sweep.SweepSummary"
    assert "resume" in cfg.hydra.job.config.override_dirname.exclude_keys


def test_entry_data_merges_defaults_as_hydra_does():
    """registry.selection reads the defaults chain from YAML; it must agree with Hydra's composition."""
    def keys_of(data, composed):  # composed also holds the schema's defaults of keys the files do not set
        if isinstance(data, dict) and isinstance(composed, dict):
            return {k: keys_of(v, composed.get(k)) for k, v in data.items()}
        return composed

    for name in entry_names():
        composed = OmegaConf.to_container(_compose(f"model={name}", hydra_config=False).model,
                                          enum_to_str=True)
        data = selection.entry_data(name)
        assert keys_of(data, composed) == data, name


def test_a_variant_inherits_nightly_unless_it_sets_its_own(tmp_path):
    files = {"base": "name: base\nnightly: true\n",
             "base_ws4": "defaults:\n  - base\n  - _self_\nname: base_ws4\nworld_size: 4\n",
             "base_off": "defaults: [base, _self_]\nname: base_off\nnightly: false\n",
             "loop_a": "defaults: [loop_b]\nname: loop_a\n", "loop_b": "defaults: [loop_a]\nname: loop_b\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    read = selection._read_from(tmp_path)
    assert selection.entry_data("base_ws4", read=read) == {"name": "base_ws4", "nightly": True,
                                                           "world_size": 4}
    assert selection.entry_data("base_off", read=read)["nightly"] is False
    assert selection.variants_of(["base"], candidates=list(files), read=read) == ["base_off", "base_ws4"]
    with pytest.raises(ValueError, match="defaults cycle"):
        selection.entry_data("loop_a", read=read)
    (tmp_path / "base.yaml").unlink()  # a deleted base: its variants are still found
    assert selection.variants_of(["base"], candidates=["base_ws4", "base_off"], read=read) == [
        "base_off", "base_ws4"]


def test_nightly_resolver_refuses_what_it_cannot_select(monkeypatch):
    with pytest.raises(UserError, match="unknown selector 'weekly'"):
        selection._entries_resolver("weekly")
    monkeypatch.setattr(selection, "nightly_entries", lambda: [])
    with pytest.raises(UserError, match="no registry entry sets `nightly: true`"):
        selection._entries_resolver("nightly")


def test_nightly_sweep_without_marked_entries_is_a_user_error(tmp_path):
    """The resolver's UserError reaches run.py wrapped in OmegaConf's InterpolationResolutionError while
    Hydra's sweeper expands the choices: run.py prints it as error / fix lines, without a traceback."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("from registry import selection\n"
                                           "selection.nightly_entries = lambda: []\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"}
    proc = _run_py("+experiment=nightly", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, env=env,
                   timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[:2] == [
        "error: no registry entry sets `nightly: true`, so the nightly sweep has nothing to run",
        "  fix: mark one (nightly: true in registry/model/<name>.yaml, docs/nightly.md), or sweep "
        "model=<a>,<b> explicitly"]


def test_slurm_launcher_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = _compose("+experiment=nightly", "hydra/launcher=slurm", "hydra.launcher.partition=h200",
                   "hydra.launcher.array_parallelism=4")
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.array_parallelism) == ("h200", 4)
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)
    assert launcher.timeout_min == 240 and launcher.cpus_per_task == 16 and launcher.mem_gb == 128
    # the plugin's own keys are there too (its schema is the base of ours)
    assert "qos" in launcher and "additional_parameters" in launcher
    default = _compose("+experiment=nightly")
    assert default.hydra.launcher._target_.endswith("BasicLauncher")  # local runs keep the basic launcher


def test_job_folder_names_can_be_passed_back_as_a_run_dir():
    """kv_sep "-" and item_sep "+": "=" and "," in a folder name would break `hydra.run.dir=<folder>`."""
    cfg = _compose("+experiment=nightly", hydra_config=True)
    sep = cfg.hydra.job.config.override_dirname
    name = sep.item_sep.join(f"{k}{sep.kv_sep}{v}" for k, v in
                             [("eval.limit", 8), ("model", "tiny_nemotron_h_mtp"), ("ssm_replay", False)])
    [o] = OverridesParser.create().parse_overrides([f"hydra.run.dir=/tmp/multirun/{name}"])
    assert not o.is_sweep_override() and o.value() == f"/tmp/multirun/{name}"


def test_summary_of_refused_crashed_and_killed_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    ok = sweep / "model-a+ssm_replay-False"
    ok.mkdir(parents=True)
    (ok / "results.json").write_text(json.dumps({
        "entry": "a", "gsm8k": {"strict_match": 0.25, "flexible_extract": 0.5, "n": 4},
        "acceptance": {"rate": 0.5, "length": 2.5},
        "verdict": {"passed": True, "checks": [{"name": "gsm8k.mean", "status": "pass"},
                                               {"name": "acceptance.rate", "status": "no_reference"}]}}))
    (ok / "job.json").write_text(json.dumps({"exit_code": 0, "entry": "a", "job_num": 0,
                                             "overrides": ["model=a", "ssm_replay=False", "eval.limit=4"]}))
    refused = sweep / "model-b+ssm_replay-False"
    refused.mkdir()
    (refused / "job.json").write_text(json.dumps({"exit_code": 2, "entry": "b", "job_num": 1,
                                                  "error": "error: no checkpoint", "overrides": [
                                                      "model=b", "ssm_replay=False", "eval.limit=4"]}))
    crashed = sweep / "model-b+ssm_replay-True"
    crashed.mkdir()
    (crashed / "job.json").write_text(json.dumps({"exit_code": 1, "entry": "b", "job_num": 2,
                                                  "error": "crash: RuntimeError: boom", "overrides": [
                                                      "model=b", "ssm_replay=True", "eval.limit=4"]}))
    failing = sweep / "model-c+ssm_replay-False"
    failing.mkdir()
    (failing / "results.json").write_text(json.dumps({
        "entry": "c", "gsm8k": {"strict_match": 0.0, "flexible_extract": 0.0, "n": 4}, "acceptance": None,
        "verdict": {"passed": False, "checks": [{"name": "gsm8k.mean", "status": "fail"}]}}))
    (failing / "job.json").write_text(json.dumps({"exit_code": 1, "entry": "c", "job_num": 3, "overrides": [
        "model=c", "ssm_replay=False", "eval.limit=4"]}))
    dummy = sweep / "model-d+ssm_replay-False"  # random weights: nothing judged, exit 0, not "passed"
    dummy.mkdir()
    (dummy / "results.json").write_text(json.dumps({
        "entry": "d", "gsm8k": {"strict_match": 0.0, "flexible_extract": 0.0, "n": 4}, "acceptance": None,
        "verdict": {"passed": None, "checks": [{"name": "gsm8k.mean", "status": "no_reference"},
                                               {"name": "health.finite", "status": "pass"}]}}))
    (dummy / "job.json").write_text(json.dumps({"exit_code": 0, "entry": "d", "job_num": 4, "overrides": [
        "model=d", "ssm_replay=False", "eval.limit=4"]}))
    killed = sweep / "model-a+ssm_replay-True"
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "overrides.yaml").write_text("- model=a\n- ssm_replay=True\n- eval.limit=4\n")
    summary = summarize(sweep)
    assert summary.worst == 2
    by_folder = {j.folder.name: j for j in summary.jobs}
    assert by_folder[ok.name].verdict == "PASS (no reference: acceptance.rate)"
    assert by_folder[ok.name].scores == "25.00 / 50.00 % (n=4)"
    assert by_folder[ok.name].acceptance == "0.500 / 2.50"
    assert (by_folder[refused.name].verdict, by_folder[refused.name].exit_code) == ("ERROR (exit 2)", 2)
    assert (by_folder[crashed.name].verdict, by_folder[crashed.name].exit_code) == ("CRASH", 1)
    assert by_folder[killed.name].verdict.startswith("no status") and by_folder[killed.name].exit_code == 1
    assert by_folder[killed.name].entry == "a"
    assert (by_folder[failing.name].verdict, by_folder[failing.name].acceptance) == ("FAIL: gsm8k.mean",
                                                                                      "- (no drafts)")
    assert by_folder[dummy.name].verdict == "no reference" and by_folder[dummy.name].no_reference
    assert not by_folder[ok.name].no_reference
    text = summary.text
    assert "6 jobs (1 passed, 1 no reference, 3 failed, 1 refused (user error)); exit status 2" in text
    assert "every job: eval.limit=4" in text and "| ssm_replay=False |" in text
    assert "job 1: error: no checkpoint" in text and "job 2: crash: RuntimeError: boom" in text
    assert [j.job_num for j in collect_jobs(sweep)][:4] == [0, 1, 2, 3]
    assert format_table([], sweep).startswith(f"Sweep {sweep}: 0 jobs (none); exit status 0")


def _run_py(*args: str, cwd: Path, env: dict | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "run.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def documented_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`python run.py +experiment=nightly eval.limit=8` (the command docs/nightly.md shows), run once for the
    tests below: (the finished process, its sweep folder, its history database)."""
    tmp_path = tmp_path_factory.mktemp("nightly")
    sweep, db = tmp_path / "sweep", tmp_path / "history.db"
    proc = _run_py("+experiment=nightly", "eval.limit=8", f"hydra.sweep.dir={sweep}", f"history.db={db}",
                   cwd=tmp_path, timeout=1200)
    return proc, sweep, db


@pytest.mark.slow
def test_nightly_sweep_runs_the_tiny_entries_and_fills_the_history(documented_sweep):
    """The real thing: four jobs in one process, each job's folder, the summary table, the exit status and
    the history database."""
    proc, sweep, db = documented_sweep
    out = proc.stdout
    folders = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert folders == [f"eval.limit-8+model-{m}+ssm_replay-{r}"
                       for m in ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp") for r in ("False", "True")]
    table = (sweep / "sweep_summary.md").read_text()
    verdicts = [line.split("|")[6].strip() for line in table.splitlines()
                if line.startswith("| ") and "tiny" in line]
    assert verdicts == ["PASS"] * 4, table
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "4 jobs (4 passed); exit status 0" in out
    # replay and rewind of one entry: the same tokens, so the same acceptance
    conn = sqlite3.connect(db)
    pairs = conn.execute("SELECT entry, GROUP_CONCAT(acceptance_rate) FROM runs GROUP BY entry").fetchall()
    assert all(len(set(rates.split(","))) == 1 for _, rates in pairs), pairs
    rows = conn.execute("SELECT entry, setting, sweep_dir, source FROM runs ORDER BY entry, setting")
    rows = rows.fetchall()
    assert conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 4  # one row (8 samples) per run
    conn.close()
    assert [(e, s.split(" ")[0], d, src) for e, s, d, src in rows] == [
        (e, mode, str(sweep.resolve()), "run")
        for e in ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp") for mode in ("replay", "rewind")]
    assert "4 run(s) of this sweep, 0 added now" in out
    # no empty default sweep folders (multirun/<date>/<time>/ in the working folder) beside the sweep's own
    assert not (sweep.parent / "multirun").exists()


FAKE_SITECUSTOMIZE = '''
import sys
sys.path.insert(0, {tests!r})
import test_app
from runners.app import main as app
app.Engine = test_app.FakeEngine

def evaluate(engine, tokenizer_path, **kw):
    if kw["fingerprint"]["ssm_replay"]:
        raise RuntimeError("injected crash")
    return test_app.fake_result({{"strict_match": 1.0, "flexible_extract": 1.0, "n": 1}},
                                kw["out_dir"] + "/samples.jsonl", num_fewshot=kw["num_fewshot"],
                                max_gen_toks=kw["max_gen_toks"])
app.evaluate_engine = evaluate
'''


def test_a_sweep_of_jobs_in_other_processes_reports_every_job_and_the_worst_status(tmp_path):
    """submitit's local launcher runs each job in its own process: the head process has no job status of
    its own, so the table and the exit status come from the job folders. A model= on the command line
    replaces the experiment's list; the crashing job does not stop the other."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_SITECUSTOMIZE.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"}
    sweep = tmp_path / "sweep"
    proc = _run_py("+experiment=nightly", "model=tiny_nemotron_h_mtp", "hydra/launcher=submitit_local",
                   "eval.limit=1", f"hydra.sweep.dir={sweep}", f"history.db={tmp_path / 'h.db'}",
                   cwd=tmp_path, env=env)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-3000:]
    assert "2 jobs (1 passed, 1 failed); exit status 1" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "tiny_" in line]
    assert len(rows) == 2 and "| ssm_replay=False | 100.00 / 100.00 % (n=1) | 0.500 / 2.50" in rows[0]
    assert "| PASS " in rows[0] and "| ssm_replay=True " in rows[1] and "| CRASH " in rows[1]
    assert "job 1: crash: RuntimeError: injected crash" in out
    job_dir = sweep / "eval.limit-1+model-tiny_nemotron_h_mtp+ssm_replay-True"
    job = json.loads((job_dir / "job.json").read_text())
    assert job["exit_code"] == 1 and job["sweep_dir"] == str(sweep.resolve())
    conn = sqlite3.connect(tmp_path / "h.db")
    assert conn.execute("SELECT entry, ssm_replay FROM runs").fetchall() == [("tiny_nemotron_h_mtp", 0)]
    conn.close()


def test_cfg_job_of_the_nightly_sweep_creates_nothing(tmp_path):
    """`--cfg job` runs nothing, so it writes nothing: the experiment picks its sweep folder by an option of
    the hydra/sweep_dir group instead of setting hydra.sweep.dir over the default's `${claim_dir:...}`, whose
    merge would resolve it and so create the default folder (and again for each job of a real sweep)."""
    proc = _run_py("+experiment=nightly", "--cfg", "job", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "ssm_replay" in proc.stdout, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []
    cfg = _compose("+experiment=nightly")
    assert OmegaConf.to_container(cfg.hydra.sweep)["dir"] == "multirun/nightly/${now:%Y-%m-%d_%H-%M-%S}"
    assert OmegaConf.to_container(_compose().hydra.sweep)["dir"].startswith("${claim_dir:multirun/")


@pytest.mark.parametrize("bad", ["draft_len=abc,3", "eval.limt=4,5", "eval=bogus,gsm8k", "runtime=tpu,cpu"])
def test_a_sweep_refused_while_composing_its_jobs_leaves_nothing(tmp_path, bad):
    """A bad value in a sweep is found when Hydra composes the first job, after it made the sweep folder and
    wrote multirun.yaml there: the refusal (error / fix, status 2) removes that folder, which holds nothing
    a run produced."""
    proc = _run_py("-m", bad, "eval.limit=2", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_experiment_is_a_user_error(tmp_path):
    proc = _run_py("+experiment=nightlyy", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[:2] == ["error: unknown experiment option experiment=nightlyy",
                                            "  fix: did you mean experiment=nightly? choose one of: nightly"]


@pytest.mark.slow
def test_the_documented_nightly_table_is_what_the_command_prints(documented_sweep):
    """docs/nightly.md shows the table of `python run.py +experiment=nightly eval.limit=8`: its rows (entry,
    settings, GSM8K, acceptance, verdict, folder) are what that command prints now."""
    proc, sweep, _ = documented_sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def rows(text: str) -> list[list[str]]:
        return [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
                if line.startswith("| ") and "tiny_" in line]

    documented = rows((REPO_ROOT / "docs" / "nightly.md").read_text())
    printed = rows((sweep / "sweep_summary.md").read_text())
    assert len(documented) == 4 and printed == documented, (printed, documented)
