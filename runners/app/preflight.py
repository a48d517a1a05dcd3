"""Every check of a run that needs no model: the settings, this machine, the task, the baseline rows, the
GSM8K files, the tokenizer and the prompt lengths, before torch, lm-eval (but its pure-Python few-shot
sampler) or the engine is imported.

`check_run(cfg)` is the first step of runners.app.main.run, and run.py calls it before it imports that module
(which loads torch, lm-eval and datasets: seconds), so a settings mistake is refused at once. Only registry/,
the light evals modules (evals.task, evals.tasks.gsm8k, evals.results) and runners.app.support (torch-free on
a CPU machine) are imported here; tests/test_preflight.py checks that a refusal loads none of the heavy
libraries.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from evals.results import GSM8K_TEST_ROWS
from evals.task import get_task
from evals.tasks.gsm8k import PROMPTS_TASK, check_prompt_room, gsm8k_dir, gsm8k_files
from registry.baselines import (
    BaselineError,
    Protocol,
    find_acceptance_reference,
    find_accuracy_reference,
    protocol_mismatch,
    reference_protocol,
    run_protocol,
)
from registry.checkpoint import TOKENIZER_FILE, check_tokenizer
from registry.errors import UserError
from registry.releases import dummy_tokenizer_dir
from registry.resolve import ResolvedRun, resolve
from runners.app.rundir import check_existing_run_folder
from runners.app.support import check_quant_hardware, check_supported

__all__ = ["check_references", "check_run", "tokenizer_file"]


def check_run(cfg: DictConfig) -> ResolvedRun:
    """Resolve a composed run config (configs/config.yaml with a registry entry as `model`) and check all
    that holds without a model: registry.resolve.resolve (schema, cross-setting rules, checkpoint directory,
    model dimensions), what this engine and machine run (runners.app.support), the task (evals.task), the
    baseline rows (:func:`check_references`), the GSM8K files (evals.tasks.gsm8k.gsm8k_files), the tokenizer,
    whether the run's prompts fit model.max_seq_len (evals.tasks.gsm8k.check_prompt_room) and, when the run's
    folder exists, whether this run may write or resume it (runners.app.rundir). An eval.limit
    above the test split's size is noted on stdout.

    Returns the ResolvedRun. Raises UserError naming the first problem and its fix. Reads config.json,
    tokenizer.json and the GSM8K splits; writes nothing but, for dummy weights without a tokenizer, the
    shared padded tokenizer (:func:`tokenizer_file`).
    """
    # the weight quantization this machine can run, from the settings alone (before any checkpoint file is
    # required: an NVFP4 entry is refused on the wrong hardware even where its weights are absent), then all
    check_quant_hardware(resolve(cfg, check_checkpoint=False))
    rr = resolve(cfg)
    if rr.run.eval.limit is not None and rr.run.eval.limit > GSM8K_TEST_ROWS:  # noted, not silently clamped
        print(f"note: eval.limit={rr.run.eval.limit} is more than GSM8K's {GSM8K_TEST_ROWS} test questions: "
              f"all {GSM8K_TEST_ROWS} run (eval.limit=null is the same)", flush=True)
    check_supported(rr)
    task = get_task(rr.run.eval.name)  # a task of the table (eval=<name> picks configs/eval/<name>.yaml)
    if task.fewshot_pool is not None and rr.run.eval.num_fewshot > task.fewshot_pool:
        raise UserError(
            f"eval.num_fewshot={rr.run.eval.num_fewshot} is more than the {task.fewshot_pool} exemplars "
            f"{task.name} has (its prompts take the first N of them)",
            f"set eval.num_fewshot to at most {task.fewshot_pool} (configs/eval/{task.name}.yaml sets its "
            "own), or 0 for zero-shot")
    check_references(rr)
    gsm8k_files(rr.run.eval.data_dir)  # the data folder and every line of its files, before anything loads
    tokenizer = tokenizer_file(rr)
    check_tokenizer(tokenizer)
    # every prompt of the run fits max_seq_len (exactly for lm-eval's stock gsm8k, whose prompts
    # evals.tasks.gsm8k rebuilds; a bound for other tasks)
    check_prompt_room(tokenizer, gsm8k_dir(rr.run.eval.data_dir)[0], rr.run.eval.num_fewshot,
                      rr.run.eval.max_gen_toks, rr.entry.max_seq_len, draft_len=rr.draft_len,
                      limit=rr.run.eval.limit, exact=get_task(rr.run.eval.name).lm_eval_task == PROMPTS_TASK)
    check_existing_run_folder(rr)  # another run's folder, a resume with other settings, a folder in use
    return rr


def check_references(rr: ResolvedRun) -> None:
    """Fail fast, before anything heavy is loaded, when no baseline row can judge the run.

    With verdict.require_reference (the default) the entry needs a `baseline` key and the task's baselines
    file (evals.task.EvalTask.baselines, gsm8k.yaml for gsm8k) needs a row for (dtype, quant, kv_cache_quant,
    spec_dec) -- and its acceptance file, when the task has one, a row for (quant, draft_len) when
    speculation is on -- that holds for the run's SSM state dtype (rr.baseline_state). A placeholder row
    (measured: false) counts as found: the run then reports "no reference yet". References measured under
    another protocol (eval.num_fewshot, eval.max_gen_toks; registry.baselines.protocol_mismatch) judge
    nothing, so no row is needed there: a warning on stdout (also with verdict.require_reference=false) says
    the run will be reported, not judged. Raises UserError (registry.baselines.BaselineError) naming the
    missing row and the fix.
    """
    if rr.dummy:  # dummy weights: no accuracy is judged
        return
    e, task, require = rr.entry, get_task(rr.run.eval.name), rr.run.verdict.require_reference
    if e.baseline is None:
        if require:
            raise UserError(
                f"entry {e.name} has no `baseline` key, so no reference can judge this run",
                "set baseline: <model key of registry/baselines/gsm8k.yaml> in the entry, or pass "
                "verdict.require_reference=false to run without a pass/fail verdict",
            )
        return
    run = run_protocol(rr.run.eval.num_fewshot, rr.run.eval.max_gen_toks)
    lookups = [(task.baselines_path, False, lambda: find_accuracy_reference(
        e.baseline, rr.dtype, e.quant.value, e.kv_cache_quant.value, rr.spec_dec, state=rr.baseline_state,
        path=task.baselines_path))]
    if rr.draft_len > 0 and task.acceptance_baselines_path is not None:
        lookups.append((task.acceptance_baselines_path, True, lambda: find_acceptance_reference(
            e.baseline, e.quant.value, rr.draft_len, state=rr.baseline_state,
            path=task.acceptance_baselines_path)))
    other: dict[Protocol, list] = {}  # files measured under another protocol, by that protocol
    for path, acceptance, lookup in lookups:
        try:
            proto = reference_protocol(e.baseline, path, acceptance=acceptance)
            if proto is not None and proto != run:
                other.setdefault(proto, []).append(path)
                continue
            lookup()
        except BaselineError:
            if require:
                raise
    for proto, paths in other.items():  # one line per protocol, naming its files
        print(f"warning: {protocol_mismatch(proto, run, paths, e.baseline)}", flush=True)


def tokenizer_file(rr: ResolvedRun) -> Path:
    """The run's tokenizer.json: the checkpoint's; for dummy weights without one, the GSM8K tokenizer padded
    to the model's vocabulary (registry.releases.dummy_tokenizer_dir)."""
    path = rr.checkpoint_dir / TOKENIZER_FILE
    if rr.dummy and not path.is_file():
        return dummy_tokenizer_dir(rr.checkpoint_config.vocab_size) / TOKENIZER_FILE
    return path
