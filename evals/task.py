"""The evaluation tasks a run can score, one row each: `python run.py eval=<name>` picks a row by its name.

A row declares everything the rest of evals knows of a task (lm-eval's task YAML is the model): its data (the
stock lm-eval task, our group of evals/tasks/ that runs it on a local folder, the task module's lookup of that
folder: TaskData), its scorer (the filters whose metric is the score, the task version the references were
measured with), its verdict checks (the score check, its baseline files, the health checks that apply) and its
report (the results.json section of its scores, their labels and the report's sections). The verdict
(evals.verdict), the report (evals.report), the sweep table (evals.sweep) and the results history
(evals.history) read the row of a run (`task_of_results`) and name no task. The app (runners.app.main)
dispatches on `eval.name` (the `eval` config group: configs/eval/<name>.yaml); the evaluator
(evals.evaluate.evaluate_lm) and the verdict (evals.verdict.evaluate_verdict) read the row. Adding a task:
docs/adding_a_model.md, "Adding a task".

Both rows of the table are generate_until tasks on GSM8K's test questions scored by lm-eval's exact_match
under the strict-match and flexible-extract filters, so they declare one results.json section, `gsm8k`, and
results.json's `task` section names the row that ran. Light on purpose (no lm-eval, no torch).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from evals.tasks import gsm8k
from registry.errors import UserError
from registry.schema import BASELINES_DIR

# results.json's filter keys (its `gsm8k` section, samples.jsonl) -> lm-eval's filter names
GSM8K_FILTERS: Mapping[str, str] = MappingProxyType(
    {"strict_match": "strict-match", "flexible_extract": "flexible-extract"})

# The score checks a row can declare (evals.verdict): "bernoulli", TensorRT-LLM's one-sided hypothesis test of
# an accuracy against a reference row of the row's baseline file; "floor", each score >= the row's own floor.
SCORE_CHECKS = ("bernoulli", "floor")
# The health checks (evals.verdict.check_health): no non-finite model output, not mostly empty generations,
# not mostly one repeated token, some answer the answer filter reads.
HEALTH_CHECKS = ("finite", "empty", "repeated_token", "answers")
# The report's task sections (evals.report): the scores' table, the accuracy plot (with the reference and
# the pass threshold of a "bernoulli" check).
REPORT_SECTIONS = ("scores", "accuracy_plot")


@dataclass(frozen=True)
class TaskData:
    """Where a task's documents come from (the task module's functions; evals.evaluate.load_task reads it).

    files(configured) -> Path | None: the local folder of the documents (`eval.data_dir` or the module's
        lookup), its files checked; None when no folder is known (lm-eval then reads `hub`). Raises the
        module's UserError when a folder is known but unusable.
    metadata_key: the lm-eval task metadata key that hands the folder to the local group's loader.
    hub: the hub dataset the stock task reads without a folder (results.json task.data_source "hub:<hub>").
    load_error(err, folder) -> UserError: the error of a failed lm-eval task load over `folder` (None: the
        hub), raised from `err`.
    fewshot_seed: lm-eval's fewshot_random_seed of the run (its default; the few-shot draw depends on it).
    sample_fields(doc, target) -> dict: the task's fields of a scored sample (samples.jsonl) from lm-eval's
        logged document and target text.
    """

    files: Callable[[str | os.PathLike | None], Path | None]
    metadata_key: str
    hub: str
    load_error: Callable[[Exception, Path | None], UserError]
    fewshot_seed: int
    sample_fields: Callable[[Mapping[str, Any], str], dict[str, Any]]


# GSM8K's data (evals/tasks/gsm8k.py): a local folder of train.jsonl / test.jsonl, else the hub dataset
GSM8K_DATA = TaskData(files=gsm8k.gsm8k_files, metadata_key=gsm8k.DATA_KEY, hub=gsm8k.HUB_DATASET,
                      load_error=gsm8k.load_error, fewshot_seed=gsm8k.FEWSHOT_SEED,
                      sample_fields=gsm8k.sample_fields)


@dataclass(frozen=True)
class EvalTask:
    """One evaluation task.

    name: the row's key: `eval.name`, configs/eval/<name>.yaml.
    lm_eval_task: lm-eval 0.4.13's task name (results.json `task.task` records it), found in `stock_dir`.
    local_task: our lm-eval group in evals/tasks/ (<local_task>.yaml) that runs `lm_eval_task` on the local
        GSM8K folder's JSONL files (evals.tasks.gsm8k.gsm8k_dir), so no hub download happens.
    stock_dir: lm-eval's task folder (under lm_eval/tasks/) holding the task's YAML; only it and evals/tasks/
        are indexed (milliseconds, instead of ~10 s for all of lm-eval's tasks).
    version: the task's `metadata.version` the references were measured with; another version is another
        benchmark and is refused.
    filters: results.json filter key -> lm-eval filter name; the score of each is lm-eval's `metric`
        (a fraction in [0, 1]). The verdict's health checks read `flexible_extract`.
    metric: lm-eval's metric name of the score.
    baselines: file of accuracy references under registry/baselines/ (the gsm8k.yaml format,
        registry/baselines/README.md), matched on (model key, dtype, quant, kv_cache_quant, spec_dec).
    acceptance_baselines: file of MTP acceptance floors under registry/baselines/, or None when no floor
        was measured on this task's prompts (acceptance is then reported, not judged: the floors depend on
        the text the model writes).
    section: results.json's key of the scores ({score key: fraction, "n", "stderr"}) and the prefix of the
        score check's name ("<section>.<metric>").
    title: the task's name in reports and plots.
    score_labels: score key -> its label in reports (default: lm-eval's filter names, `filters`).
    score_unit: what a score is, in the report's tables (percent of samples).
    score_short_labels: score key -> a short label for narrow tables (a sweep's summary; default: `labels`).
    mean_score: the report adds a row with the mean of the scores (the "bernoulli" check's default metric).
    score_check: one of SCORE_CHECKS: how the verdict judges the scores.
    score_floors: score key -> lowest passing fraction in [0, 1], for score_check "floor".
    health_checks: the HEALTH_CHECKS that judge this task's generations.
    answer_filter: the score key whose extracted answers the "answers" health check reads (its samples'
        `extracted`), None without one.
    report_sections: the REPORT_SECTIONS of the task in summary.md, in order.
    fewshot_pool: the fixed few-shot exemplars the task has (eval.num_fewshot takes the first N, at most
        this many); None: the examples are drawn from its data's train split.
    data: where the documents come from (TaskData); None for a task evaluated without lm-eval's documents
        (a test task).
    """

    name: str
    lm_eval_task: str
    local_task: str
    stock_dir: str = "gsm8k"
    version: float = 3.0
    filters: Mapping[str, str] = field(default_factory=lambda: GSM8K_FILTERS)
    metric: str = "exact_match"
    baselines: str = "gsm8k.yaml"
    acceptance_baselines: str | None = "acceptance.yaml"
    section: str = "scores"
    title: str = ""
    score_labels: Mapping[str, str] | None = None
    score_unit: str = "exact match (%)"
    score_short_labels: Mapping[str, str] | None = None
    mean_score: bool = False
    score_check: str = "bernoulli"
    score_floors: Mapping[str, float] = field(default_factory=dict)
    health_checks: tuple[str, ...] = HEALTH_CHECKS
    answer_filter: str | None = None
    report_sections: tuple[str, ...] = ("scores",)
    data: TaskData | None = None
    fewshot_pool: int | None = None

    def __post_init__(self) -> None:
        if self.score_check not in SCORE_CHECKS:
            raise ValueError(f"task {self.name}: score_check {self.score_check!r} is not one of "
                             f"{SCORE_CHECKS}")
        if self.score_check == "floor" and set(self.score_floors) != set(self.filters):
            raise ValueError(f"task {self.name}: score_floors must give a floor for each score "
                             f"{sorted(self.filters)}, got {sorted(self.score_floors)}")
        for what, names, allowed in (("health_checks", self.health_checks, HEALTH_CHECKS),
                                     ("report_sections", self.report_sections, REPORT_SECTIONS)):
            if not set(names) <= set(allowed):
                raise ValueError(f"task {self.name}: {what} {names} must be among {allowed}")
        if self.answer_filter is not None and self.answer_filter not in self.filters:
            raise ValueError(f"task {self.name}: answer_filter {self.answer_filter!r} is not a score "
                             f"({sorted(self.filters)})")

    @property
    def labels(self) -> Mapping[str, str]:
        """Score key -> its label in reports."""
        return self.score_labels if self.score_labels is not None else self.filters

    @property
    def short_labels(self) -> Mapping[str, str]:
        """Score key -> its short label (narrow tables)."""
        return self.score_short_labels if self.score_short_labels is not None else self.labels

    @property
    def shown_title(self) -> str:
        """The task's name in reports: `title`, else `name`."""
        return self.title or self.name

    @property
    def baselines_path(self) -> Path:
        """The accuracy references' file."""
        return BASELINES_DIR / self.baselines

    @property
    def acceptance_baselines_path(self) -> Path | None:
        """The acceptance floors' file, None when the task has none."""
        return BASELINES_DIR / self.acceptance_baselines if self.acceptance_baselines else None


# What both GSM8K rows declare: one results.json section, exact match under both filters, the accuracy test
# against the row's baseline file, every health check (answers: a number flexible-extract reads), the
# scores' table and the accuracy plot.
_GSM8K_DECLARATIONS: Mapping[str, object] = MappingProxyType(dict(
    section="gsm8k", title="GSM8K", score_short_labels={"strict_match": "strict", "flexible_extract": "flex"},
    mean_score=True, score_check="bernoulli", health_checks=HEALTH_CHECKS,
    answer_filter="flexible_extract", report_sections=REPORT_SECTIONS, data=GSM8K_DATA))

TASKS: Mapping[str, EvalTask] = MappingProxyType({t.name: t for t in (
    # lm-eval's stock gsm8k (lm_eval/tasks/gsm8k/gsm8k.yaml): 5-shot from train, "Question: ...\nAnswer:",
    # stop at "Question:"; the references of TensorRT-LLM's accuracy suite were measured with it
    EvalTask(name="gsm8k", lm_eval_task="gsm8k", local_task="gsm8k_local", **_GSM8K_DECLARATIONS),
    # lm-eval's stock gsm8k_cot (gsm8k-cot.yaml): the 8 fixed chain-of-thought exemplars of Wei et al.
    # 2022 ("Chain-of-Thought Prompting Elicits Reasoning in Large Language Models", arXiv:2201.11903),
    # "Q: ...\nA:", answer after "The answer is"; every prompt starts with the same exemplars, so the prefix
    # cache restores them (results.json prefix_cache.hit_rate)
    EvalTask(name="gsm8k_cot", lm_eval_task="gsm8k_cot", local_task="gsm8k_cot_local",
             baselines="gsm8k_cot.yaml", acceptance_baselines=None, fewshot_pool=8, **_GSM8K_DECLARATIONS),
)})
DEFAULT_TASK = "gsm8k"


def get_task(name: str) -> EvalTask:
    """The row of TASKS named `name` (`eval.name`). Raises UserError naming the known tasks."""
    try:
        return TASKS[name]
    except KeyError:
        raise UserError(f"unknown evaluation task eval.name={name!r}",
                        f"choose one of {', '.join(TASKS)} (eval=<name> picks configs/eval/<name>.yaml), "
                        "or add a row to evals/task.py (docs/adding_a_model.md, \"Adding a task\")") from None


def task_of_setting(setting: str) -> EvalTask:
    """The row of a results-history setting label (evals.history.setting_label: "... task=<name> ..." for a
    task other than the default); the default row when the label names none or an unknown one."""
    names = [part.partition("=")[2] for part in setting.split() if part.startswith("task=")]
    return TASKS.get(names[0], TASKS[DEFAULT_TASK]) if names else TASKS[DEFAULT_TASK]


def task_of_results(results: Mapping[str, object]) -> EvalTask:
    """The row a results dict (results.json) was scored by: the row whose lm-eval task its `task` section
    names; for results without one (older runs, hand-made dicts), the first row whose `section` the results
    hold; else the default row."""
    ran = results.get("task")
    name = ran.get("task") if isinstance(ran, Mapping) else None
    rows = list(TASKS.values())
    return (next((t for t in rows if t.lm_eval_task == name), None)
            or next((t for t in rows if t.section in results), None)
            or TASKS[DEFAULT_TASK])
