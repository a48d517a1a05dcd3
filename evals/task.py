"""The evaluation tasks a run can score, one row each: `python run.py eval=<name>` picks a row by its name.

A row says which lm-eval task runs (the stock task, and our group of evals/tasks/ that runs it on the local
GSM8K folder), how lm-eval's output is read (the filters whose exact_match is the score, the task version the
references were measured with) and what judges it (the baseline file of accuracy references under
registry/baselines/, and the acceptance floors where they apply). The app (runners.app.main) dispatches on
`eval.name` (the `eval` config group: configs/eval/<name>.yaml); the evaluator (evals.gsm8k.evaluate_lm)
and the verdict (evals.verdict.evaluate_verdict) read the row. Adding a task: docs/adding_a_model.md,
"Adding a task".

Every row here is a generate_until task on GSM8K's test questions scored by lm-eval's exact_match under the
strict-match and flexible-extract filters, so results.json keeps one `gsm8k` section for all of them and its
`task` section names the row that ran. Light on purpose (no lm-eval, no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from registry.errors import UserError
from registry.schema import BASELINES_DIR

# results.json's filter keys (its `gsm8k` section, samples.jsonl) -> lm-eval's filter names
GSM8K_FILTERS: Mapping[str, str] = MappingProxyType(
    {"strict_match": "strict-match", "flexible_extract": "flexible-extract"})


@dataclass(frozen=True)
class EvalTask:
    """One evaluation task.

    name: the row's key: `eval.name`, configs/eval/<name>.yaml.
    lm_eval_task: lm-eval 0.4.13's task name (results.json `task.task` records it), found in `stock_dir`.
    local_task: our lm-eval group in evals/tasks/ (<local_task>.yaml) that runs `lm_eval_task` on the local
        GSM8K folder's JSONL files (evals.data.gsm8k_dir), so no hub download happens.
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

    @property
    def baselines_path(self) -> Path:
        """The accuracy references' file."""
        return BASELINES_DIR / self.baselines

    @property
    def acceptance_baselines_path(self) -> Path | None:
        """The acceptance floors' file, None when the task has none."""
        return BASELINES_DIR / self.acceptance_baselines if self.acceptance_baselines else None


TASKS: Mapping[str, EvalTask] = MappingProxyType({t.name: t for t in (
    # lm-eval's stock gsm8k (lm_eval/tasks/gsm8k/gsm8k.yaml): 5-shot from train, "Question: ...\nAnswer:",
    # stop at "Question:"; the references of TensorRT-LLM's accuracy suite were measured with it
    EvalTask(name="gsm8k", lm_eval_task="gsm8k", local_task="gsm8k_local"),
    # lm-eval's stock gsm8k_cot (gsm8k-cot.yaml): the 8 fixed chain-of-thought exemplars of Wei et al.
    # 2022 ("Chain-of-Thought Prompting Elicits Reasoning in Large Language Models", arXiv:2201.11903),
    # "Q: ...\nA:", answer after "The answer is"; every prompt starts with the same exemplars, so the prefix
    # cache restores them (results.json prefix_cache.hit_rate)
    EvalTask(name="gsm8k_cot", lm_eval_task="gsm8k_cot", local_task="gsm8k_cot_local",
             baselines="gsm8k_cot.yaml", acceptance_baselines=None),
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
