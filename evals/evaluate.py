"""The evaluator of the rows of evals.task.TASKS: an lm-eval model scored on a row's lm-eval stock task,
resumable.

`lm_eval.simple_evaluate` runs lm-eval's own task YAML of the row (its task, version, filters and metric),
found by lm-eval's TaskManager: the stock task on its hub dataset, or the row's local group of evals/tasks/
(the same task on the documents of a local folder, passed as task metadata) when the row's data
(evals.task.TaskData) knows a folder. Generation goes through the lm-eval model the caller gives (the
application's: runners.app.lm_adapter.EngineLM, which streams every finished request to
`out_dir/generations.jsonl`; a resumed run reuses those and generates the rest).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import lm_eval
import lm_eval.tasks
from lm_eval.api.metrics import mean_stderr
from lm_eval.api.task import Task
from lm_eval.defaults import DEFAULT_MAX_GEN_TOKS  # 256: lm-eval's limit when a task sets no max_gen_toks
from lm_eval.tasks import TaskManager

from evals.outdir import SAMPLES_FILE, write_atomic
from evals.progress import progress_bar
from evals.stats import GenerationCounters
from evals.task import DEFAULT_TASK, TASKS, EvalTask

logger = logging.getLogger(__name__)

DEFAULT = TASKS[DEFAULT_TASK]  # the default row
TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # our lm-eval tasks (each row's local_task)
STOCK_TASKS_DIR = Path(lm_eval.tasks.__file__).parent  # lm-eval's; a row's stock_dir is a folder of it
# The default row's stock task folder: indexing only a row's (and ours) takes milliseconds, all of lm-eval's
# ~10 s.
STOCK_GSM8K_DIR = STOCK_TASKS_DIR / DEFAULT.stock_dir

TIMING_SCOPE = "all engine.generate calls of this out_dir that returned (earlier parts included)"


@dataclasses.dataclass
class EvalResult:
    """Outcome of `evaluate_lm`.

    scores: {"strict_match": float, "flexible_extract": float, "n": int}; accuracies are fractions in [0, 1].
    stats: see `scored_stats`: the per-request counters (num_requests, prompt_tokens, generated_tokens,
        request_steps, drafted_tokens, accepted_drafts, accepted_per_position, num_accepted_hist and the
        acceptance_* ratios) summed over exactly the requests scored by this call, so a killed-and-resumed
        run reports the counters of an uninterrupted one; timing fields (prefill_seconds, decode_seconds,
        steps, wall_seconds, num_parts, timing_prompt_tokens, timing_generated_tokens, timing_requests;
        timing_largest_call the largest) summed over
        `timing_scope` = every generate call of out_dir that returned; "requests_without_stats" counts
        scored requests whose record has no per-request counters (0 with this engine).
    samples_path: out_dir / "samples.jsonl", one scored record per document (see `evaluate_lm`).
    wall_seconds: wall time of this `evaluate_lm` call (task building, generation, scoring).
    num_resumed / num_generated: requests of this call read from generations.jsonl / sent to the engine.
    task: {"task", "version", "num_fewshot", "fewshot_seed", "limit", "max_gen_toks", "lm_eval_version",
        "data_source"} as actually run.
    outputs: `output_health` of the scored samples (degenerate generations), plus each filter's standard
        error under "stderr".
    """

    scores: dict[str, float | int]
    stats: dict[str, Any]
    samples_path: Path
    wall_seconds: float
    num_resumed: int
    num_generated: int
    task: dict[str, Any]
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_task(data_dir: Path | None, task_row: EvalTask = DEFAULT) -> tuple[Task, TaskManager, str]:
    """lm-eval's stock task of `task_row` (default: the default row), reading the documents of `data_dir`
    (the row's local group of evals/tasks/, `local_task`, handed the folder as task metadata
    `task_row.data.metadata_key`), or its hub dataset when None; found by lm-eval's TaskManager.

    Returns (task, its TaskManager, data_source: the folder, or "hub:<dataset>"). Raises the row's data error
    (`task_row.data.load_error`, a UserError) when the hub dataset cannot be loaded (offline or unreachable;
    HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are respected) or the files cannot be parsed, ValueError for a row
    without data, and RuntimeError when the installed lm-eval's task is not the row's version.
    """
    data = task_row.data
    if data is None:
        raise ValueError(f"task {task_row.name} declares no data (evals.task.TaskData): lm-eval cannot run "
                         "it")
    name = task_row.lm_eval_task
    metadata = {data.metadata_key: str(data_dir)} if data_dir is not None else None
    manager = TaskManager(include_path=[str(STOCK_TASKS_DIR / task_row.stock_dir), str(TASKS_DIR)],
                          include_defaults=False, metadata=metadata)
    try:
        task = manager.load(task_row.local_task if data_dir is not None else name)["tasks"][name]
    except Exception as err:  # datasets raises ConnectionError, FileNotFoundError, DatasetGenerationError...
        raise data.load_error(err, data_dir) from err
    if task.VERSION != task_row.version:
        raise RuntimeError(f"lm-eval {lm_eval.__version__}'s {name} task is version {task.VERSION}, expected "
                           f"{task_row.version}: scores would not be comparable; install lm-eval==0.4.13")
    return task, manager, str(data_dir) if data_dir is not None else f"hub:{data.hub}"


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval logging at ERROR ("Overwriting num_fewshot", "Building contexts"...), datasets at WARNING and
    its progress bars off (datasets.disable_progress_bars); all restored on exit."""
    import datasets

    levels = {name: logging.getLogger(name).level for name in ("lm_eval", "datasets")}
    bars = datasets.is_progress_bar_enabled()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    logging.getLogger("datasets").setLevel(logging.WARNING)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        if bars:
            datasets.enable_progress_bars()


BUILD_PROGRESS = "build prompts"  # the label of lm-eval's request-building pass (_labelled_request_build)


@contextlib.contextmanager
def _labelled_request_build(show: bool) -> Iterator[None]:
    """lm-eval builds every request's few-shot prompt before any generation (Task.build_all_requests, a few
    seconds for 1,319 documents) under a bar without a label ("0/1319") from the tqdm its module
    lm_eval.api.task imports, which takes neither a label nor a switch (tqdm's TQDM_* variables are read
    once, when tqdm is first imported, and would reach every bar). For the call that name is this project's
    progress instead (evals.progress.progress_bar, labelled BUILD_PROGRESS, like the generate progress
    that follows: plain lines off a terminal, none with show=False); restored on exit. An lm-eval whose task
    module has no `tqdm` keeps its own bar."""
    import lm_eval.api.task

    unlabelled = getattr(lm_eval.api.task, "tqdm", None)
    if unlabelled is None:
        yield
        return

    def labelled(iterable: Iterable[Any], total: int | None = None, **_: Any) -> Iterator[Any]:
        items = list(iterable)
        with progress_bar(len(items) if total is None else total, desc=BUILD_PROGRESS, show=show) as bar:
            for item in items:
                yield item
                bar.update(1)

    lm_eval.api.task.tqdm = labelled
    try:
        yield
    finally:
        lm_eval.api.task.tqdm = unlabelled


@contextlib.contextmanager
def _without_env_report() -> Iterator[None]:
    """lm-eval's simple_evaluate ends by adding an environment report to its results
    (lm_eval.loggers.utils.add_env_info: torch.utils.collect_env, which runs `pip list` and other probes,
    3-4 s per evaluation on a 2-core machine). evaluate_lm reads none of it (the lm-eval version it
    records is lm_eval.__version__), so the evaluator's reference to it is a no-op for the call; restored on
    exit."""
    import lm_eval.evaluator

    add_env_info = getattr(lm_eval.evaluator, "add_env_info", None)
    if add_env_info is None:  # another lm-eval layout: nothing to skip, the report is only slower
        yield
        return
    lm_eval.evaluator.add_env_info = lambda storage: None
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = add_env_info


@contextlib.contextmanager
def _compiled_templates_kept() -> Iterator[None]:
    """lm-eval renders every Jinja field of every document (question, answer, target: 12 per 5-shot prompt,
    15,828 for the 1319 GSM8K prompts) through lm_eval.utils.apply_template, which compiles the template
    string each time (``env.from_string``: 3 s of CPU for the test set, nine tenths of building the
    requests). Inside, apply_template keeps each string's compiled template and renders that (the same
    environment, the same text); restored on exit."""
    import lm_eval.utils

    apply_template, env = getattr(lm_eval.utils, "apply_template", None), getattr(lm_eval.utils, "env", None)
    if apply_template is None or env is None:  # another lm-eval layout: nothing to keep, only slower
        yield
        return
    compiled: dict[str, Any] = {}

    def kept(template: str, doc: dict) -> str:
        if template not in compiled:
            compiled[template] = env.from_string(template)
        return compiled[template].render(**doc)

    lm_eval.utils.apply_template = kept
    try:
        yield
    finally:
        lm_eval.utils.apply_template = apply_template


def scored_stats(records: list[dict[str, Any]], parts: list[dict[str, Any]],
                 counters: type[GenerationCounters]) -> dict[str, Any]:
    """Generation stats of a scored run: counters from the scored requests, timing from the generate calls.

    records: the generation records (`GenerationStore` lines) of the requests scored, one per distinct
    request; their `request_stats` (the engine's per-request counters) are added up as `counters`
    (num_requests = records with counters), whose to_dict() gives the sums and the acceptance ratios derived
    from them. So the counters depend only on which requests were scored,
    not on how the run was split into parts.
    parts: `{"wall_seconds", "num_requests", "engine_stats"}` per returned `engine.generate` call of the
    out_dir; prefill_seconds, decode_seconds and steps are their sums, with their prompt / generated token
    sums as timing_prompt_tokens / timing_generated_tokens (for throughput), wall_seconds and num_parts,
    timing_requests (the parts' num_requests summed: the requests those token sums are over) and
    timing_largest_call (the most requests one call sent); and timing_scope says they cover every call of
    out_dir, not only the scored requests.
    requests_without_stats: records lacking `request_stats` (their steps are missing from the counters).
    nonfinite: the model outputs flagged with NaN / infinite values by any of the parts (their `nonfinite`:
    the generate output's flags), first appearance first; None when a part does not say.
    counters: the engine's statistics type (evals.stats.GenerationCounters; its PER_CALL fields, e.g. batch
    steps and seconds, are summed over the parts).
    """
    with_stats = [r["request_stats"] for r in records if isinstance(r.get("request_stats"), dict)]
    summed = sum((counters.from_dict(s) for s in with_stats), counters())
    summed.num_requests = len(with_stats)
    timing = sum((counters.from_dict(p["engine_stats"]) for p in parts), counters())
    out = summed.to_dict()
    out.update({k: getattr(timing, k) for k in counters.PER_CALL})
    out["wall_seconds"] = sum(float(p.get("wall_seconds", 0.0)) for p in parts)
    out["num_parts"] = len(parts)
    out["timing_prompt_tokens"] = timing.prompt_tokens
    out["timing_generated_tokens"] = timing.generated_tokens
    # the requests those token sums cover (every call's, resumed runs' earlier calls included) and the most
    # any one call sent (the concurrency the rates were measured at is at most this)
    out["timing_requests"] = sum(int(p.get("num_requests", 0)) for p in parts)
    out["timing_largest_call"] = max((int(p.get("num_requests", 0)) for p in parts), default=0)
    out["timing_scope"] = TIMING_SCOPE
    out["requests_without_stats"] = len(records) - len(with_stats)
    # model outputs that held NaN / infinite values in any generate call of out_dir, in forward order
    # (None when a part predates the flags: unknown, not "none")
    out["nonfinite"] = (list(dict.fromkeys(name for p in parts for name in p["nonfinite"]))
                        if all(isinstance(p.get("nonfinite"), list) for p in parts) else None)
    return out


INVALID_ANSWER = "[invalid]"  # what lm-eval's answer-extracting filters give when they find no answer
# A generation "repeats one token" when it has at least this many ids (a stop token excluded), all the same.
REPEAT_MIN_TOKENS = 4


def repeats_one_token(ids: list[int], stop_ids: set[int] | frozenset[int] = frozenset()) -> bool:
    """True when `ids` (a stop token at the end excluded) are REPEAT_MIN_TOKENS or more copies of one id."""
    body = ids[:-1] if ids and ids[-1] in stop_ids else ids
    return len(body) >= REPEAT_MIN_TOKENS and len(set(body)) == 1


def output_health(samples: list[dict[str, Any]], answer_filter: str | None = "flexible_extract"
                  ) -> dict[str, Any]:
    """Counts of degenerate generations among scored samples (samples.jsonl records), for the verdict's
    health checks (evals.verdict.check_health): `n`; `empty` (no text before the first stop string, blanks
    aside); `repeated_token` (the generation is one token id repeated, see repeats_one_token); `no_answer`
    (`answer_filter`, the task row's lenient filter, found no answer; none counted without one); `ended`
    (generations that ended on their own,
    at a stop token or stop string, not cut by max_gen_toks) and `ended_no_answer` (those of them without a
    number). A model that generates nothing, one token forever, or never an answer is broken, whatever its
    GSM8K score at a small n says."""

    def no_answer(s: dict[str, Any]) -> bool:
        if answer_filter is None:
            return False
        return s["extracted"].get(answer_filter, INVALID_ANSWER) == INVALID_ANSWER

    ended = [s for s in samples if s.get("finish_reason") != "length"]
    return {
        "n": len(samples),
        "empty": sum(s["empty_output"] for s in samples),
        "repeated_token": sum(s["repeats_one_token"] for s in samples),
        "no_answer": sum(map(no_answer, samples)),
        "ended": len(ended),
        "ended_no_answer": sum(map(no_answer, ended)),
    }


def _write_jsonl_atomic(path: Path, records: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


class GeneratingLM(Protocol):
    """What the evaluator reads of the lm-eval model it is given (the application's lm-eval model over the
    engine, runners.app.lm_adapter.EngineLM, is one), besides lm-eval's `generate_until`.

    records: request key -> generation record of the last `generate_until` call ({"key", "prompt_sha256",
        "generated_ids", "num_generated_tokens", "finish_reason", "stop_string", "text", "request_stats"}).
    request_key_for(context, gen_kwargs): the key of one lm-eval request.
    stop_token_ids: the ids that end a generation.
    num_resumed / num_generated: requests of the last call read from disk / generated.
    all_stats_parts: {"wall_seconds", "num_requests", "engine_stats", "nonfinite"} of every generate call
        of the out_dir that returned (earlier runs' parts included).
    """

    records: dict[str, dict[str, Any]]
    stop_token_ids: tuple[int, ...]
    num_resumed: int
    num_generated: int

    def request_key_for(self, context: str, gen_kwargs: dict[str, Any]) -> str: ...

    @property
    def all_stats_parts(self) -> list[dict[str, Any]]: ...


def evaluate_lm(make_lm: Callable[[], Any], *, counters: type[GenerationCounters],
                data_dir: str | os.PathLike | None, limit: int | None = None, num_fewshot: int = 5,
                max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, out_dir: str | os.PathLike, progress: bool = True,
                task: EvalTask = DEFAULT) -> EvalResult:
    """Score an lm-eval model on a task row with the row's lm-eval 0.4.13 stock task (greedy, every filter of
    the row), by default the default row's.

    Args:
        make_lm: called once, after the task's data loaded, with nothing; returns the lm-eval model (an
            lm_eval.api.model.LM that also satisfies `GeneratingLM`). The application's builds
            runners.app.lm_adapter.EngineLM over the engine with out_dir's resume file.
        counters: the engine's statistics type (evals.stats.GenerationCounters), to add up its counters.
        data_dir: the documents' folder (the row's data lookup: for GSM8K train.jsonl / test.jsonl; None:
            $GSM8K_DIR, else the hub dataset).
        limit: score only the first `limit` test documents (None: all 1319).
        num_fewshot: few-shot examples per prompt (the default row's own is 5, drawn from train with
            lm-eval's seed 1234; the chain-of-thought row's is 8, its fixed exemplars in order).
        max_gen_toks: the generated-token limit the model was given (recorded in `task`).
        out_dir: created if needed; receives samples.jsonl, written once scoring is done (the model writes
            its own resume files there). Any samples.jsonl of an earlier run is removed at the start.
        progress: show the progress of building the prompts (a tqdm bar on a terminal, plain lines elsewhere).
        task: the evals.task.TASKS row to run (its lm-eval task, version, filters).

    samples.jsonl, one record per test document in doc_id order: {"doc_id", "prompt_sha256", "request_key",
    the task data's fields (`TaskData.sample_fields`; GSM8K's "question", "target": the reference answer text,
    "target_answer": after "####"), "generated_text" (cut
    at the first stop string), "extracted": {"strict_match", "flexible_extract"} (each filter's answer,
    "[invalid]" when it finds none), "correct": {"strict_match": bool, "flexible_extract": bool},
    "num_generated_tokens", "finish_reason" ("stop_token" | "stop_string" | "length"), "stop_string",
    "empty_output" (no text before the stop string), "repeats_one_token" (see `repeats_one_token`)}.

    Returns EvalResult. Raises the row's data error (a UserError: no usable data), ValueError (bad
    arguments, a row without data), RuntimeError (lm-eval's task is not the row's task and version as
    configured). Mutates nothing but out_dir.
    """
    t0 = time.perf_counter()
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if not isinstance(num_fewshot, int) or isinstance(num_fewshot, bool) or num_fewshot < 0:
        raise ValueError(f"num_fewshot must be an int >= 0, got {num_fewshot!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = out_dir / SAMPLES_FILE
    samples_path.unlink(missing_ok=True)  # a samples.jsonl on disk always belongs to a finished run

    with _quiet_lm_eval():
        if task.data is None:
            raise ValueError(f"task {task.name} declares no data (evals.task.TaskData): lm-eval cannot "
                             "run it")
        lm_task, manager, source = load_task(task.data.files(data_dir), task)
        lm = make_lm()
        with _without_env_report(), _labelled_request_build(progress), _compiled_templates_kept():
            results = lm_eval.simple_evaluate(model=lm, tasks=[lm_task], task_manager=manager,
                                              num_fewshot=num_fewshot, limit=limit, log_samples=True,
                                              bootstrap_iters=0, fewshot_random_seed=task.data.fewshot_seed)

    name = task.lm_eval_task
    run_config = results["configs"][name]
    if results["versions"][name] != task.version or run_config["num_fewshot"] != num_fewshot:
        raise RuntimeError(f"lm-eval ran {name} version {results['versions'][name]} with "
                           f"{run_config['num_fewshot']} shots; expected {task.version} with {num_fewshot}")
    metrics = results["results"][name]
    n = int(results["n-samples"][name]["effective"])
    scores: dict[str, float | int] = {
        ours: float(metrics[f"{task.metric},{theirs}"]) for ours, theirs in task.filters.items()}
    scores["n"] = n

    samples = _sample_records(results["samples"][name], lm, task)
    if len(samples) != n:
        raise RuntimeError(f"lm-eval logged {len(samples)} documents for n = {n}")
    for ours in task.filters:  # the per-sample verdicts must reproduce lm-eval's aggregate exactly
        mean = sum(s["correct"][ours] for s in samples) / max(n, 1)
        if not math.isclose(mean, scores[ours], abs_tol=1e-12):
            raise RuntimeError(f"{ours}: per-sample mean {mean} != lm-eval score {scores[ours]}")
    _write_jsonl_atomic(samples_path, samples)
    outputs = output_health(samples, task.answer_filter)
    outputs["stderr"] = {ours: float(mean_stderr([float(s["correct"][ours]) for s in samples])) if n > 1
                         else None for ours in task.filters}

    # lm.records: one record per distinct request of this evaluation (exactly the current limit's requests)
    stats = scored_stats(list(lm.records.values()), lm.all_stats_parts, counters)
    return EvalResult(
        scores=scores,
        stats=stats,
        samples_path=samples_path,
        wall_seconds=time.perf_counter() - t0,
        num_resumed=lm.num_resumed,
        num_generated=lm.num_generated,
        task={"task": name, "version": results["versions"][name], "num_fewshot": num_fewshot,
              "fewshot_seed": task.data.fewshot_seed, "limit": limit, "max_gen_toks": max_gen_toks,
              "lm_eval_version": lm_eval.__version__, "data_source": source},
        outputs=outputs,
    )


def _sample_records(logged: list[dict[str, Any]], lm: GeneratingLM, task: EvalTask) -> list[dict[str, Any]]:
    """Join lm-eval's per-(document, filter) logged samples with our generation records, one per document."""
    by_doc: dict[int, dict[str, Any]] = {}
    for s in logged:
        filt = next((ours for ours, theirs in task.filters.items() if theirs == s["filter"]), None)
        if filt is None:
            continue
        doc_id = int(s["doc_id"])
        if doc_id not in by_doc:
            (context, gen_kwargs), = s["arguments"]  # one generate_until request per document
            gen = lm.records[lm.request_key_for(context, gen_kwargs)]
            by_doc[doc_id] = {
                "doc_id": doc_id,
                "prompt_sha256": gen["prompt_sha256"],
                "request_key": gen["key"],
                **task.data.sample_fields(s["doc"], s["target"]),
                "generated_text": gen["text"],
                "extracted": {},
                "correct": {},
                "num_generated_tokens": gen["num_generated_tokens"],
                "finish_reason": gen["finish_reason"],
                "stop_string": gen["stop_string"],
                "empty_output": not gen["text"].strip(),
                "repeats_one_token": repeats_one_token(gen["generated_ids"], set(lm.stop_token_ids)),
            }
        rec = by_doc[doc_id]
        (extracted,) = s["filtered_resps"]
        rec["extracted"][filt] = extracted
        rec["correct"][filt] = bool(s[task.metric])
    return [by_doc[k] for k in sorted(by_doc)]

