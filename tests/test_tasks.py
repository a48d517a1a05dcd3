"""The task table (evals/task.py) and its seam: every row has its config group file, lm-eval task, local group
and baseline files; the app dispatches on eval.name; gsm8k_cot is scored through lm-eval's own filters on the
local GSM8K files; a task without references gives a readable verdict instead of pass / fail."""
# ruff: noqa: F811  (the `fakes` fixture is imported from test_app and named as an argument)

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from test_app import FakeEngine, _cfg, fakes, make_checkpoint, make_gsm8k_dir  # noqa: F401
from test_gsm8k_fakes import FakeEngine as ScriptedEngine
from test_gsm8k_fakes import gold_final, read_jsonl, train_tiny_tokenizer
from tokenizers import Tokenizer

from evals.evaluate import STOCK_TASKS_DIR, TASKS_DIR, load_task
from evals.task import DEFAULT_TASK, TASKS, get_task
from registry.baselines import load_acceptance_baselines, load_accuracy_baselines
from registry.errors import UserError
from registry.schema import REPO_ROOT
from runners.app import main as app
from runners.app.lm_adapter import evaluate_engine

EVAL_GROUP = REPO_ROOT / "configs" / "eval"
COT = TASKS["gsm8k_cot"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_row_has_its_config_task_files_and_baselines(name):
    task = TASKS[name]
    assert task.name == name
    cfg = yaml.safe_load((EVAL_GROUP / f"{name}.yaml").read_text())
    assert cfg["name"] == name  # eval=<name> selects the row through eval.name
    local = yaml.safe_load((TASKS_DIR / f"{task.local_task}.yaml").read_text().replace("!function", ""))
    assert local["group"] == task.local_task and local["task"][0]["task"] == task.lm_eval_task
    stock = [yaml.safe_load(p.read_text().replace("!function", "")) for p in
             (STOCK_TASKS_DIR / task.stock_dir).glob("*.yaml")]
    (row,) = [s for s in stock if s.get("task") == task.lm_eval_task]
    assert row["metadata"]["version"] == task.version
    assert {f["name"] for f in row["filter_list"]} == set(task.filters.values())
    assert [m["metric"] for m in row["metric_list"]] == [task.metric]
    assert load_accuracy_baselines(task.baselines_path)  # loads and validates
    if task.acceptance_baselines_path is not None:
        assert load_acceptance_baselines(task.acceptance_baselines_path)


def test_every_config_group_file_names_a_row():
    names = {yaml.safe_load(p.read_text())["name"]: p.stem for p in EVAL_GROUP.glob("*.yaml")}
    assert names == {n: n for n in TASKS}
    assert DEFAULT_TASK in TASKS


def test_unknown_task_is_a_user_error_naming_the_rows(fakes, tmp_path):
    with pytest.raises(UserError) as err:
        get_task("gsm9k")
    assert "eval.name='gsm9k'" in err.value.problem and "gsm8k, gsm8k_cot" in err.value.fix
    cfg = _cfg(f"model.checkpoint={make_checkpoint(tmp_path / 'ckpt')}", f"out_dir={tmp_path / 'out'}",
               "eval.name=gsm9k")
    with pytest.raises(UserError, match="unknown evaluation task"):
        app.run(cfg)
    assert FakeEngine.built == []  # refused before the engine is built


def test_app_dispatches_gsm8k_cot_and_reports_no_reference(fakes, tmp_path, capsys):
    """eval=gsm8k_cot: the row reaches the evaluation, its 8 shots and the task enter the fingerprint; its
    references are placeholders and no acceptance floor applies, so nothing is judged and the run exits 0."""
    out = tmp_path / "out"
    cfg = _cfg(f"model.checkpoint={make_checkpoint(tmp_path / 'ckpt')}", f"out_dir={out}", "eval=gsm8k_cot",
               f"eval.data_dir={make_gsm8k_dir(tmp_path / 'gsm8k')}")
    results = app.run(cfg)
    (call,) = fakes
    assert call["task"] is COT and call["num_fewshot"] == 8
    assert call["fingerprint"]["task"] == "gsm8k_cot" and call["fingerprint"]["num_fewshot"] == 8
    checks = {c["name"]: c for c in results["verdict"]["checks"]}
    assert checks["gsm8k.mean"]["status"] == "no_reference"
    assert "placeholder" in checks["gsm8k.mean"]["note"]
    assert checks["acceptance.rate"]["status"] == "no_reference"
    assert "no acceptance floor is measured on gsm8k_cot's prompts" in checks["acceptance.rate"]["note"]
    assert results["verdict"]["headline"] == "NO REFERENCE" and app.exit_code(results) == 0
    assert "verdict                  NO REFERENCE" in capsys.readouterr().out


def test_task_without_a_reference_row(fakes, tmp_path):
    """A model key without gsm8k_cot rows (the released models' have none yet): refused before loading,
    naming the task's file, unless verdict.require_reference=false, which reports the check as not judged."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    data = make_gsm8k_dir(tmp_path / "gsm8k")
    base = [f"model.checkpoint={ckpt}", "eval=gsm8k_cot", f"eval.data_dir={data}", "model.baseline=super_v3"]
    with pytest.raises(UserError) as err:
        app.run(_cfg(*base, f"out_dir={tmp_path / 'a'}"))
    assert "gsm8k_cot.yaml" in err.value.problem and FakeEngine.built == []
    results = app.run(_cfg(*base, f"out_dir={tmp_path / 'b'}", "verdict.require_reference=false"))
    (check,) = [c for c in results["verdict"]["checks"] if c["name"] == "gsm8k.mean"]
    assert check["status"] == "no_reference" and "gsm8k_cot.yaml" in check["note"]
    assert app.exit_code(results) == 0


def test_gsm8k_cot_prompts_share_the_exemplars_and_read_the_local_files(gsm8k_dir):
    task, _, source = load_task(gsm8k_dir, COT)
    assert source == str(gsm8k_dir) and task.VERSION == COT.version
    docs = list(task.test_docs())
    first = json.loads((gsm8k_dir / "test.jsonl").read_text().splitlines()[0])
    assert docs[0]["question"] == first["question"]  # the local test split, in file order
    prompts = [task.fewshot_context(d, num_fewshot=8) for d in docs[:3]]
    prefix = os.path.commonprefix(prompts)
    assert prefix.startswith("Q: There are 15 trees in the grove.") and prefix.count("The answer is") == 8
    assert all(p.endswith(f"Q: {d['question']}\nA:") for p, d in zip(prompts, docs))


def _last_cot_question(prompt: str) -> str:
    return prompt.rsplit("Q: ", 1)[1].rsplit("\nA:", 1)[0]


@pytest.mark.parametrize("offset, correct", [(0, True), (1, False)])
def test_gsm8k_cot_scores_the_answer_after_the_answer_is(gsm8k_dir, tmp_path, offset, correct):
    """A scripted model that reasons and ends "The answer is N." is right under both of lm-eval's gsm8k_cot
    filters when N is the gold answer and wrong under both when it is not; the stop string "Q:" cuts the
    next question it starts."""
    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()]
    gold = {r["question"]: gold_final(r["answer"]).replace(",", "") for r in rows}

    def complete(prompt: str) -> str:
        n = int(float(gold[_last_cot_question(prompt)])) + offset
        return f" Let us think. The answer is {n}.\n\nQ: How many eggs are left?\nA: none"

    tok_path = train_tiny_tokenizer(gsm8k_dir, tmp_path / "tokenizer.json")
    engine = ScriptedEngine(Tokenizer.from_file(str(tok_path)), complete)
    res = evaluate_engine(engine, tok_path, data_dir=gsm8k_dir, out_dir=tmp_path / "out", limit=3,
                          num_fewshot=8, progress=False, task=COT)
    assert res.scores == {"strict_match": float(correct), "flexible_extract": float(correct), "n": 3}
    assert res.task["task"] == "gsm8k_cot" and res.task["num_fewshot"] == 8
    samples = read_jsonl(res.samples_path)
    assert all(s["finish_reason"] == "stop_string" and s["stop_string"] == "Q:" for s in samples)
    assert [s["target_answer"] for s in samples] == [gold[r["question"]] for r in rows[:3]]


@pytest.mark.slow
def test_run_py_gsm8k_cot_on_the_tiny_entry_reuses_the_exemplars(gsm8k_dir, tmp_path, capsys):
    """The real engine on the shipped tiny checkpoint, the four requests fitting one admission: the first
    prompt prefills the 8 exemplars alone and stores them (a junction of runners.engine.prefix_cache; the
    others wait for the next admission, PrefixCache.split_admission), and the three others restore them
    instead of prefilling them (results.json prefix_cache). The run is `python run.py eval=gsm8k_cot ...`'s
    config through the application run.py calls, in process."""
    from registry.compose import compose_config
    from runners.app import main as app

    run_dir = tmp_path / "run"
    capsys.readouterr()
    app.run(compose_config(["eval=gsm8k_cot", "eval.limit=4", "eval.max_gen_toks=8",
                            f"eval.data_dir={gsm8k_dir}", f"out_dir={run_dir}", "history.db=null"]))
    stdout = capsys.readouterr().out
    results = json.loads((run_dir / "results.json").read_text())
    assert results["task"]["task"] == "gsm8k_cot" and results["gsm8k"]["n"] == 4
    pc = results["prefix_cache"]
    assert pc["enabled"] and pc["queries"] == 4 and pc["hits"] == 3 and pc["hit_rate"] > 0.6
    assert "prefix cache" in stdout and "of prompt tokens reused" in stdout
    assert results["verdict"]["status"] == "no_reference"
    assert Path(results["samples_path"]).is_file()


def test_another_task_is_its_own_trend_line():
    from evals.history import setting_label

    config = {"draft_len": 3, "ssm_replay": True, "dtype": "float32", "world_size": 1, "device": "cpu"}
    assert setting_label({**config, "eval": {"name": "gsm8k"}}) == "replay K=3 float32 ws=1 cpu"
    assert setting_label(config) == "replay K=3 float32 ws=1 cpu"  # results.json written before the table
    cot = setting_label({**config, "eval": {"name": "gsm8k_cot"}})
    assert cot == "replay K=3 float32 ws=1 cpu task=gsm8k_cot"


def test_another_protocol_is_its_own_trend_line():
    """A run whose few-shot count or generation limit differs from its task's references' protocol is
    another benchmark: its trend line says so ("0-shot", "gen=64"); the task's own protocol adds nothing
    (gsm8k: 5-shot, 256 tokens; gsm8k_cot: 8 exemplars)."""
    from evals.history import setting_label

    config = {"draft_len": 3, "ssm_replay": True, "dtype": "float32", "world_size": 1, "device": "cpu"}
    base = "replay K=3 float32 ws=1 cpu"
    label = lambda **ev: setting_label({**config, "eval": ev})
    assert label(name="gsm8k", num_fewshot=5, max_gen_toks=256) == base
    assert label(name="gsm8k", num_fewshot=0, max_gen_toks=256) == f"{base} 0-shot"
    assert label(name="gsm8k", num_fewshot=5, max_gen_toks=64) == f"{base} gen=64"
    assert label(name="gsm8k_cot", num_fewshot=8, max_gen_toks=256) == f"{base} task=gsm8k_cot"
    assert label(name="gsm8k_cot", num_fewshot=5, max_gen_toks=256) == f"{base} task=gsm8k_cot 5-shot"
