"""Run one GSM8K evaluation of a registry entry: `python run.py model=<entry> [ssm_replay=true] [...]`.

A thin Hydra wrapper around runners.app.main.run(cfg). Before Hydra composes, the registry entries the command
line selects pass the untrusted-input guard (registry.compose.check_overrides). Hydra runs with
HYDRA_FULL_ERROR=1, its documented switch that lets composition errors propagate, so an unknown entry, option
or key and a value of the wrong type (checked by Hydra against the structured schema registry.schema.
RunConfig) become, like every runners / registry UserError, `error: <problem>` / `  fix: <fix>` on stderr
with exit status 2 and no traceback.

Exit status: 0 the verdict passed, or had no reference yet (placeholder baseline rows) / was not required
(verdict.require_reference=false); 1 a verdict check failed (GSM8K below its threshold, an acceptance floor
missed, a health check, or with compare=replay a flipped sample / diverged tokens); 2 a user error; 130 an
interruption (Ctrl-C) and 143 a SIGTERM, each reported with the command that resumes the run. A sweep (`-m`,
or `+experiment=nightly`) runs every job even when one is refused or crashes (a crash counts 1), records each
job's status in its folder, ends with a table of every job (evals/sweep.py) and exits with the worst status;
Ctrl-C or SIGTERM stops it.

Hydra writes no .hydra/ at job start (hydra.output_subdir: null, configs/config.yaml): the three files it
would write are copied then and written into the run folder once the run holds it and every check passed
(evals.outdir.save_hydra_files), so a refused run changes nothing in a folder that existed before.
"""

from __future__ import annotations

import copy
import functools
import os
import shlex
import signal
import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from evals import sweep
from evals.outdir import (
    note_new_dirs,
    register_resolver,
    remove_unused_run_dir,
    remove_unused_run_dirs,
    save_hydra_files,
)
from registry.compose import CONFIG_DIR, CONFIG_NAME, check_overrides, config_error
from registry.errors import UserError
from registry.selection import register_resolvers

EXIT_INTERRUPTED = 130  # 128 + SIGINT: the shell's status for a command ended by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, a batch scheduler's time limit), raised in the main thread as Ctrl-C is, so the run
    stops the same way: finished generations saved, the command that resumes it printed, exit 143."""

    signum = signal.SIGTERM


def _on_sigterm(signum, frame):
    raise Terminated()

# Exit status of each job: one for a plain run, one per job of a sweep (`python run.py -m model=a,b
# ssm_replay=false,true`); a sweep runs every job even when one fails or crashes, ends with a table of every
# job (evals/sweep.py) and exits with the worst status.
_EXIT_CODES: list[int] = []


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> int:
    # every check that needs no model, before torch / lm-eval / datasets are imported (seconds): a settings
    # mistake is refused at once
    from runners.app.preflight import check_run

    hydra_files = _hydra_files(cfg)  # as Hydra has them at job start, before anything runs
    job_dir = HydraConfig.get().runtime.output_dir
    try:
        checked = check_run(cfg)
    except UserError as e:
        return _refused(e)
    from runners.app import (
        main as app,  # the engine and lm-eval: only when a job runs (not for --cfg job or --help)
    )

    error = None
    try:
        accepted = functools.partial(save_hydra_files, job_dir, hydra_files)  # once the run holds its folder
        code = app.exit_code(app.run(cfg, checked, on_accepted=accepted))
    except app.RunInterrupted as e:
        if not sweep.in_multirun():
            remove_unused_run_dir(e.out_dir)  # a folder this run made and wrote no generation into
        if not e.out_dir.exists():
            print(_stopped_early(e), file=sys.stderr)
            _EXIT_CODES.append(e.exit_status)
            raise SystemExit(e.exit_status) from None
        # the exact command that continues this run (of a sweep: this job), its folder named, resume=true
        overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
        stopped = app.RunInterrupted(e.out_dir, resume_command(overrides, e.out_dir), signum=e.signum)
        print(stopped.format(), file=sys.stderr)
        sweep.record_job(stopped.exit_status, f"error: {stopped.problem.split(';')[0]}")
        _EXIT_CODES.append(stopped.exit_status)
        raise SystemExit(stopped.exit_status) from None  # a sweep stops too: Ctrl-C / SIGTERM means stop
    except UserError as e:
        return _refused(e)
    except Exception as e:
        if not sweep.in_multirun():
            raise
        traceback.print_exc()  # one crashing job of a sweep does not stop the others
        code, error = 1, f"crash: {type(e).__name__}: {e}"
    sweep.record_job(code, error)  # <job folder>/job.json in a sweep, read by the sweep's summary table
    _EXIT_CODES.append(code)
    return code


def _hydra_files(cfg: DictConfig) -> dict[str, object]:
    """The files Hydra's run_job writes into <job folder>/<hydra.output_subdir> at job start, copied as it
    copies them: config.yaml (the job's config), hydra.yaml (Hydra's), overrides.yaml (the job's
    overrides)."""
    hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)
    return {"config.yaml": copy.deepcopy(cfg), "hydra.yaml": hydra_cfg,
            "overrides.yaml": copy.deepcopy(hydra_cfg.hydra.overrides.task)}


def _stopped_early(e: BaseException) -> str:
    """The two lines of a run stopped (Ctrl-C, SIGTERM) before it kept anything."""
    term = isinstance(e, Terminated) or getattr(e, "signum", signal.SIGINT) == signal.SIGTERM
    how = "stopped by SIGTERM" if term else "interrupted (Ctrl-C)"
    return f"error: {how} before the run wrote anything\n  fix: rerun the command"


def _refused(e: UserError) -> int:
    """A job refused with a UserError: its two lines on stderr, status 2. A single run's folder goes again
    with the parents made for it (evals.outdir.remove_unused_run_dir: only what this run created and left
    empty); a sweep's job folder keeps its job.json for the summary table."""
    print(e.format(), file=sys.stderr)
    if not sweep.in_multirun():
        remove_unused_run_dir(HydraConfig.get().runtime.output_dir)
    sweep.record_job(2, f"error: {e.problem}")
    _EXIT_CODES.append(2)
    return 2


def resume_command(overrides: list[str], out_dir) -> str:
    """`python run.py <overrides> resume=true hydra.run.dir=<out_dir>`: the command that continues a run in
    out_dir (overrides: the job's own, as Hydra lists them). An earlier resume= is replaced; out_dir= is
    kept (it names the folder)."""
    keep = [a for a in overrides if not a.startswith(("resume=", "hydra.run.dir="))]
    folder = [] if any(a.startswith("out_dir=") for a in keep) else [f"hydra.run.dir={out_dir}"]
    return " ".join(shlex.quote(a) for a in ["python", "run.py", *keep, "resume=true", *folder])


def cli(argv: list[str]) -> int:
    """Guard the overrides, run Hydra, and turn user mistakes into exit status 2, Ctrl-C into 130 and SIGTERM
    into 143 (see the module doc)."""
    # Hydra's own flags (--cfg job, -m, --help, ...) carry no `=` in a separate word or start with `-`.
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    os.environ["HYDRA_FULL_ERROR"] = "1"
    register_resolvers()  # ${registry_entries:nightly} in configs/experiment/nightly.yaml
    register_resolver()  # ${claim_dir:...}: the default output folders (configs/config.yaml)
    signal.signal(signal.SIGTERM, _on_sigterm)
    for a in overrides:  # a run folder named on the command line: whether it is new, before Hydra creates it
        if a.startswith("hydra.run.dir=") and "${" not in a:
            note_new_dirs(a.split("=", 1)[1])
    try:
        check_overrides(overrides)
        main()
    except UserError as e:
        print(e.format(), file=sys.stderr)
        return 2
    except SystemExit as e:
        if e.code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            return e.code
        raise
    except KeyboardInterrupt as e:  # before the run was accepted (composing, resolving, checking)
        remove_unused_run_dirs()  # the folder made for it, holding nothing yet
        print(_stopped_early(e), file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    except Exception as e:
        # Hydra creates the run folder (hydra.run.dir / hydra.sweep.dir) before the job starts; the job's
        # own folder errors are UserErrors already (evals.outdir). Hydra's MissingConfigException is an
        # OSError too, without a file name: config_error handles it.
        if isinstance(e, OSError) and e.filename is not None:
            print(f"error: cannot create the run folder {e.filename}: {e.strerror}\n"
                  "  fix: choose a writable folder with hydra.run.dir=... (or out_dir=...)", file=sys.stderr)
            return 2
        err = config_error(e, overrides)
        if err is None:
            raise
        remove_unused_run_dirs()  # a sweep refused while composing its jobs: its folder holds nothing yet
        print(err.format(), file=sys.stderr)
        return 2
    # a sweep's worst status also covers jobs that ran in other processes (evals/sweep.py)
    return max([*_EXIT_CODES, sweep.worst_status() or 0])


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
