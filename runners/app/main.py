"""The application: a composed Hydra config in, one judged evaluation run (GSM8K by default) and its report
out.

`run(cfg)` is what run.py and the tests call. It orchestrates; each step lives with the concept it belongs to:

- every check that needs no model, before anything heavy is imported: runners.app.preflight.check_run (the
  effective settings by registry.resolve.resolve; what this engine and machine can run,
  runners.app.support.check_supported; the task; the baseline rows; the GSM8K files; the tokenizer);
- the task (`eval.name`, the `eval` config group): a row of evals.task.TASKS, which says what runs and what
  judges it;
- that a baseline row can judge the run, and the verdict: registry.baselines, evals.verdict;
- the output folder and its resume file: runners.app.rundir (checked first by the preflight);
- the evaluation: runners.app.lm_adapter.evaluate_engine of the task's row over runners.engine.Engine;
- results.json: evals.results; the compare=replay arms: evals.compare; the console table, summary.md and
  plots: evals.report;
- the run's row in the SQLite results history (history.db): evals.history.record_finished_run.

Every problem the user can fix raises registry.errors.UserError before the engine is built.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from evals.compare import COMPARE_ARMS, COMPARISON_FILE, ComparisonError, combine_arms, compare_arms
from evals.history import check_history_file, record_finished_run, resolve_db
from evals.outdir import GENERATIONS_FILE, claim_out_dir, ensure_writable_dir, write_atomic
from evals.report import format_console, write_report
from evals.results import GSM8K_TEST_ROWS, RESULTS_FILE, build_results, exit_code, full_run_projection
from evals.task import get_task
from evals.verdict import Check, Verdict, evaluate_verdict
from registry.errors import UserError
from registry.resolve import ResolvedRun
from runners.app.lm_adapter import evaluate_engine
from runners.app.preflight import check_run, tokenizer_file
from runners.app.rundir import check_run_folder, fingerprint, run_folder
from runners.engine.engine import Engine
from runners.engine.options import engine_options
from runners.engine.prefix_cache import prefix_cache_off_reason
from runners.engine.stats import GenerationStats

__all__ = ["RunInterrupted", "exit_code", "fingerprint", "run"]


def run(cfg: DictConfig, checked: ResolvedRun | None = None,
        on_accepted: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run the configured evaluation (the task of eval.name), judge it against its baselines, write results
    and report.

    cfg: a composed config (configs/config.yaml with a registry entry as `model`). checked: what
    runners.app.preflight.check_run(cfg) returned, when the caller ran it (run.py does, before it imports
    this module); None: it runs here. on_accepted: called once the run holds its output folder and every
    check before the engine passed (run.py writes Hydra's .hydra/ files then). Output folder: cfg.out_dir,
    else Hydra's run directory. It receives generations.jsonl (appended as requests finish; the resume file),
    samples.jsonl, results.json (docs/results_schema.md), summary.md and PNG plots. An out_dir that already
    holds generations is continued with resume=true and refused without it.

    compare=replay runs two arms on the same samples, ssm_replay=false into out_dir/rewind and ssm_replay=true
    into out_dir/replay, and writes out_dir/comparison.json plus a results.json / summary.md of the replay arm
    with the `comparison` section and the comparison's checks in its verdict.

    Every finished run is then recorded in the SQLite history database `history.db` (evals.history; a failure
    to record is a warning, results.json stays).

    Returns the results dict written to out_dir/results.json; evals.results.exit_code(results) is the process
    status. Raises UserError (before the engine is built) for every configuration problem, and for a missing
    baseline row when verdict.require_reference is true.
    """
    rr = checked if checked is not None else check_run(cfg)
    out_dir = run_folder(rr)
    claim = claim_out_dir(out_dir)  # this run's folder until it ends (another live run's: an error)
    try:
        check_run_folder(out_dir, rr)
        _check_history_db(rr)
        if on_accepted is not None:
            on_accepted()
        _warn_prefix_cache_off(rr)
        _warn_ignored_runtime(rr)
        if rr.world_size > 1:  # one process per rank; rank 0 runs the job below, the others serve its engines
            from runners.engine.launch import launch

            composed = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # no Hydra in the ranks
            return launch(_run_job, (composed, rr, out_dir), world_size=rr.world_size,
                          device="cuda" if rr.device.startswith("cuda") else "cpu",
                          timeout_s=rr.run.runtime.collective_timeout_s,
                          num_threads=rr.run.runtime.num_threads)
        if rr.run.runtime.num_threads is not None:
            torch.set_num_threads(rr.run.runtime.num_threads)
        return _run_job(cfg, rr, out_dir)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM turned into one by run.py (its `signum`)
        raise RunInterrupted(out_dir, signum=getattr(e, "signum", signal.SIGINT)) from None
    except torch.OutOfMemoryError as e:  # the fit check's estimates were short: what is saved, how to go on
        said = ", ".join(m.group(0) for m in re.finditer(r"Tried to allocate [\d.]+ \w+|[\d.]+ \w+ is free",
                                                          str(e)))  # torch's numbers, its advice left out
        raise UserError(
            f"out of device memory while running ({said or type(e).__name__}); "
            f"{_finished_generations(out_dir)} finished generations are saved in {out_dir}",
            "run again with a smaller eval.batch_size=N or model.max_seq_len=N (a new run: resume=true needs "
            "the same settings), or on a device with more free memory") from None
    finally:
        claim.release()


class RunInterrupted(UserError):
    """Ctrl-C (SIGINT) or SIGTERM (kill, a batch scheduler's time limit) during a run: what is on disk and how
    to continue. run.py prints it as error / fix lines and exits with `exit_status`, 128 + the signal number
    (130 for Ctrl-C, 143 for SIGTERM: the shell's convention); `out_dir` is the run's folder, to which run.py
    adds the exact command that resumes it."""

    def __init__(self, out_dir: Path, command: str | None = None, *, signum: int = signal.SIGINT):
        self.out_dir = Path(out_dir)
        self.signum = int(signum)
        self.exit_status = 128 + self.signum
        how = "interrupted (Ctrl-C)" if self.signum == signal.SIGINT else \
            f"stopped by {signal.Signals(self.signum).name}"
        super().__init__(
            f"{how}; {_finished_generations(self.out_dir)} finished generations are saved in {self.out_dir}",
            f"continue with: {command}" if command else
            f"rerun the same command with resume=true hydra.run.dir={self.out_dir}",
        )


def _finished_generations(out_dir: Path) -> int:
    """Generations saved in a run folder: its own generations file and each compare arm's."""
    return _count_lines(out_dir / GENERATIONS_FILE) + sum(
        _count_lines(out_dir / arm / GENERATIONS_FILE) for arm in COMPARE_ARMS)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except OSError:
        return 0


def _run_job(cfg: DictConfig, rr: ResolvedRun, out_dir: Path) -> dict[str, Any]:
    """The evaluation (or the compare=replay arms) of a checked run, in this process (rank 0 under
    world_size > 1: its engines are runners.engine.launch's lockstep engines)."""
    if rr.run.compare is None:
        torch.manual_seed(rr.run.seed)
        results = _evaluate_arm(cfg, rr, out_dir)
    else:
        results = _run_compare_replay(cfg, rr, out_dir)
    # results.json is on disk: a history failure is reported as a warning and never loses it
    record_finished_run(results, out_dir, rr.run.history.db)
    return results


def _check_history_db(rr: ResolvedRun) -> None:
    """A history database the run could not write is refused now, not found after the run."""
    history_db = resolve_db(rr.run.history.db)
    if history_db is not None:
        fix = f"pass history.db= another path (not {history_db}), or history.db=null to keep no history"
        ensure_writable_dir(history_db.parent, fix=fix, kind="the history database's folder")
        check_history_file(history_db, fix)


def _build_engine(rr: ResolvedRun) -> Engine:
    """The engine for the run, with the options of runners.engine.options.engine_options.
    Engine.from_pretrained raises CheckpointError (a UserError) for the files and ValueError for options it
    refuses; every option comes from the config, so those are the user's too. Under world_size > 1 (this
    process is rank 0 of runners.engine.launch) every rank builds its shard of it."""
    from runners.engine import launch

    try:
        options = engine_options(rr)
        if rr.dummy:  # world_size 1 (registry.resolve refuses dummy weights over ranks)
            print(f"building dummy weights of {rr.entry.name} on {rr.device} ({rr.checkpoint_config.source})",
                  flush=True)
            engine = Engine.from_dummy(rr.checkpoint_config, options, device=rr.device,
                                       log=lambda msg: print(msg, flush=True))
            forced = rr.run.runtime.forced_acceptance_length  # dummy weights only (registry.resolve)
            if forced is not None:
                engine.force_acceptance(forced)
                print(f"forced acceptance length {forced}: each verify accepts a fixed schedule of drafts",
                      flush=True)
            return engine
        if launch.current() is not None:
            return launch.build_engine(str(rr.checkpoint_dir), options)  # each rank on its own device
        return Engine.from_pretrained(str(rr.checkpoint_dir), options, device=rr.device)
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e), f"check model.checkpoint={rr.checkpoint_dir} and the model.* settings"
                        ) from None


def _warn_prefix_cache_off(rr: ResolvedRun) -> None:
    """Say before loading when the run asks for the prefix cache and the engine will not keep one
    (runners.engine.prefix_cache.prefix_cache_off_reason decides; results.json records the same reason)."""
    if not rr.run.runtime.prefix_cache or rr.run.runtime.prefix_cache_bytes == 0:
        return  # asked off: nothing to warn about
    try:
        reason = prefix_cache_off_reason(engine_options(rr))
    except ValueError:
        return  # _build_engine reports the bad option
    if reason is not None:
        print(f"warning: runtime.prefix_cache is off: {reason}", flush=True)


def _warn_ignored_runtime(rr: ResolvedRun) -> None:
    """Say before loading when runtime.cuda_graphs / runtime.compile were asked for and cannot apply
    (results.json records the reasons as config.cuda_graphs_off_reason / config.compile_off_reason)."""
    for reason in (rr.cuda_graphs_off_reason, rr.compile_off_reason):
        if reason is not None:
            print(f"warning: {reason}", flush=True)


def _evaluate_arm(cfg: DictConfig, rr: ResolvedRun, out_dir: Path) -> dict[str, Any]:
    """Build the engine, evaluate the task (eval.name) into out_dir, judge, write and print; returns the
    results dict."""
    t0 = time.perf_counter()
    ensure_writable_dir(out_dir)
    engine = _build_engine(rr)
    _print_load(engine)
    capture_seconds = _capture_graphs(engine, rr)
    t_loaded = time.perf_counter()
    try:
        evaluation = evaluate_engine(
            engine,
            str(tokenizer_file(rr)),
            data_dir=rr.run.eval.data_dir,
            limit=rr.run.eval.limit,
            num_fewshot=rr.run.eval.num_fewshot,
            max_gen_toks=rr.run.eval.max_gen_toks,
            out_dir=str(out_dir),
            resume=rr.run.resume,
            progress=True,  # a bar on a terminal, a line every 30 s in a log (evals.progress)
            fingerprint=fingerprint(rr),
            task=get_task(rr.run.eval.name),
        )
    except UserError:
        raise
    except ValueError as e:  # the engine's and the evaluation's refusals of their (configured) arguments
        raise UserError(str(e), "a prompt that does not fit: lower eval.num_fewshot or eval.max_gen_toks, or "
                        "raise model.max_seq_len; else check the eval.* settings and eval.data_dir / "
                        "$GSM8K_DIR") from None
    config = rr.to_dict()
    config["ssm_backend"] = engine.ssm_backend  # what ran: the engine falls back from flashinfer to triton
    # the recurrent layers' verify kernels per layer kind (runners.engine.runner.ssm_kernels)
    config["ssm_kernels"] = getattr(getattr(engine, "runner", None), "ssm_kernels", None)
    # which FP8 GEMMs ran (runners.engine.quant.prepare_fp8): the device's FP8 kernels or the dequantizing
    # references
    config["fp8_gemms"] = getattr(getattr(engine, "model", None), "quant_report", None)
    config["prefix_cache"] = engine.prefix_cache is not None  # and its limit after the engine's memory cap
    config["prefix_cache_bytes"] = engine.prefix_cache.max_bytes if engine.prefix_cache is not None else None
    config["prefix_cache_off_reason"] = engine.prefix_cache_off_reason
    # why the run goes without the graphs it asked for (the CPU; a gloo tensor-parallel engine), or None
    config["cuda_graphs_off_reason"] = (getattr(engine, "cuda_graphs_off_reason", None)
                                        or rr.cuda_graphs_off_reason)
    config["compile_off_reason"] = rr.compile_off_reason
    results = build_results(
        entry=rr.entry.name,
        model_key=rr.entry.baseline,
        config=config,
        composed_config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        evaluation=evaluation,
        draft_len=rr.draft_len,
        memory=engine.cache_memory(),
        load_seconds=t_loaded - t0,
        eval_seconds=time.perf_counter() - t_loaded,
        load=engine.load_report.to_dict() if engine.load_report else None,
        counters=GenerationStats,
    )
    results["timings"]["capture_seconds"] = capture_seconds
    # torch.compile ran before the capture (inside capture_seconds) or in the generate calls: count both
    results["timings"]["compile_seconds"] = getattr(engine, "compile_seconds",
                                                    results["timings"]["compile_seconds"])
    results["timings"]["compile_graphs"] = getattr(engine, "compile_graphs",
                                                   results["timings"].get("compile_graphs", 0))
    scored = results[get_task(rr.run.eval.name).section]["n"]  # the task row's section holds the scores
    if rr.run.eval.limit is not None and scored < GSM8K_TEST_ROWS:
        results["projection"] = full_run_projection(results["timings"], results["generation"],
                                                    max_gen_toks=rr.run.eval.max_gen_toks,
                                                    max_batch_size=rr.max_batch_size)
    results["verdict"] = _verdict(rr, results)
    _finish(results, out_dir)
    return results


def _print_load(engine: Engine) -> None:
    """One line of the load: seconds, weight bytes and the caches by kind (a full-depth run's log)."""
    r = getattr(engine, "load_report", None)
    if r is None:
        return
    kinds = ", ".join(f"{k.removesuffix('_bytes')} {v / 2**30:.2f}" for k, v in engine.cache_memory().items())
    peak = f", device peak {r.device_peak_bytes / 2**30:.2f} GiB" if r.device_peak_bytes else ""
    print(f"loaded in {r.seconds:.1f} s: weights {r.weight_bytes / 2**30:.2f} GiB, caches GiB: {kinds}{peak}",
          flush=True)


def _capture_graphs(engine: Engine, rr: ResolvedRun) -> float | None:
    """Capture the decode step's CUDA graphs ahead of the evaluation (every captured batch size, KV buckets
    up to max_seq_len) and return the seconds; None when the run has no graphs (CPU, graphs off)."""
    if not rr.cuda_graph_batch_sizes or rr.world_size > 1:
        return None
    print(f"capturing CUDA graphs at batch sizes {rr.cuda_graph_batch_sizes}", flush=True)
    t0 = time.perf_counter()
    n = engine.capture_graphs(max_kv_len=rr.entry.max_seq_len)
    seconds = time.perf_counter() - t0
    compiled = getattr(engine, "compile_seconds", 0.0)
    print(f"captured {n} (batch size, KV bound) graphs in {seconds:.1f} s"
          + (f" (torch.compile {compiled:.1f} s of it, {getattr(engine, 'compile_graphs', 0)} dynamo graphs)"
             if compiled else ""), flush=True)
    return seconds


def _run_compare_replay(cfg: DictConfig, rr: ResolvedRun, out_dir: Path) -> dict[str, Any]:
    """compare=replay: the rewind arm, the replay arm, their paired comparison (see run())."""
    arms: dict[str, tuple[ResolvedRun, dict[str, Any]]] = {}
    for arm, replay in zip(COMPARE_ARMS, (False, True)):
        arm_rr = rr.compare_arm(replay)
        print(f"== arm {arm}: ssm_replay={str(replay).lower()} -> {out_dir / arm}")
        torch.manual_seed(rr.run.seed)
        arms[arm] = (arm_rr, _evaluate_arm(cfg, arm_rr, out_dir / arm))
        if torch.cuda.is_available():  # the arm's engine is gone: hand its cached blocks back to the driver
            torch.cuda.empty_cache()
    (_, rewind), (replay_rr, replay) = arms[COMPARE_ARMS[0]], arms[COMPARE_ARMS[1]]
    # Replay and rewind commit the same recurrent state; in float32 any token difference is a bug. In 16-bit
    # the two orders of rounding may flip a few tokens, so only a significant accuracy difference fails. FP8
    # weights or KV cache count as 16-bit: activations and keys / values are rounded to 8 bits, so a last-bit
    # difference of the float32 state can cross a rounding boundary (seen on the GPU: docs/performance.md,
    # the FP8 replay comparison).
    exact = (rr.dtype == "float32" and rr.entry.ssm.state_dtype.value == "float32"
             and rr.entry.quant.value == "none" and rr.entry.kv_cache_quant.value == "none")
    try:
        comparison, checks = compare_arms(out_dir, rewind["verdict"], exact=exact)
    except ComparisonError as err:
        raise UserError(err.problem, "rerun both arms with the same settings into a fresh out_dir") from None
    results = combine_arms(replay, rewind, comparison)
    results["verdict"] = _verdict(replay_rr, results, checks)
    print(f"== comparison {COMPARE_ARMS[0]} (A) vs {COMPARE_ARMS[1]} (B) -> {out_dir / COMPARISON_FILE}")
    _finish(results, out_dir)
    return results


def _verdict(rr: ResolvedRun, results: dict[str, Any], extra_checks: list[Check] | None = None
             ) -> dict[str, Any]:
    """The verdict section of a results dict, against the entry's baseline rows (plus extra checks, e.g. a
    comparison's)."""
    e = rr.entry
    verdict = evaluate_verdict(
        results,
        model_key=e.baseline,
        entry=e.name,
        dtype=rr.dtype,
        quant=e.quant.value,
        kv_cache_quant=e.kv_cache_quant.value,
        spec_dec=rr.spec_dec,
        draft_len=rr.draft_len,
        state=rr.baseline_state,
        require_reference=rr.run.verdict.require_reference,
        task=get_task(rr.run.eval.name),
        dummy=rr.dummy,
    )
    return Verdict(verdict.checks + list(extra_checks or [])).to_dict()


def _finish(results: dict[str, Any], out_dir: Path) -> None:
    """Write results.json, summary.md and the plots into out_dir (each whole: evals.outdir.write_atomic);
    print the table and the paths."""
    path = write_atomic(out_dir / RESULTS_FILE, json.dumps(results, indent=2, default=str) + "\n")
    files = write_report(results, out_dir)
    print(format_console(results))
    print(f"results: {path}\nreport:  {files.summary}")
