"""The GSM8K task's own module: where GSM8K is read from (the one lookup of the data folder, for evaluation,
training and the tests), its documents for our lm-eval groups, and its prompts.

A GSM8K folder holds `train.jsonl` and `test.jsonl` (rows {"question", "answer"}). The folder is, in order:
the one the caller names (`eval.data_dir`, `--data-dir`), else `$GSM8K_DIR`, else `../shared/data/gsm8k`
beside the checkout (the layout of the project's machines and CI) when it exists, else none: evaluation then
reads the hub dataset `openai/gsm8k`. Also the prompts lm-eval's gsm8k task builds from such a folder
(gsm8k_prompts) and the check that the run's prompts fit the model (check_prompt_room). The task table
(evals.task) declares its rows' data from here (`DATA_KEY`, `load_error`); lm-eval loads this file by its path
for the groups of evals/tasks/ (their `custom_dataset: !function gsm8k.load_gsm8k`). Light on purpose (no
torch, of lm-eval only its pure-Python few-shot sampler, `datasets` only when lm-eval asks for documents): the
tiny-model tools, the task table and the application's checks before anything heavy loads
(runners.app.preflight) import it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from registry.errors import UserError

DATA_ENV = "GSM8K_DIR"
FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed (simple_evaluate / the CLI): the few-shot draw
PROMPTS_TASK = "gsm8k"  # the lm-eval task whose prompts gsm8k_prompts builds (gsm8k.yaml, version 3.0)
HUB_DATASET = "openai/gsm8k"
SPLITS = ("train", "test")
SIBLING_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
DATA_KEY = "gsm8k_dir"  # the lm-eval metadata key of the local folder (simple_evaluate / --metadata)


def gsm8k_dir(configured: str | os.PathLike | None = None, *, setting: str = "eval.data_dir"
              ) -> tuple[Path | None, str]:
    """(folder, where it came from) by the lookup above; (None, "hub:openai/gsm8k") when no folder is known.

    configured: the folder the caller was given (None or "" when not). setting: its name, for messages.
    The folder is returned as given, expanded (~) and absolute; whether it holds the splits is the reader's
    check (gsm8k_files names the origin in its error).
    """
    if configured is not None and str(configured) != "":
        return Path(configured).expanduser().resolve(), setting
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser().resolve(), f"${DATA_ENV}"
    if SIBLING_DIR.is_dir():
        return SIBLING_DIR.resolve(), "../shared/data/gsm8k beside the checkout"
    return None, f"hub:{HUB_DATASET}"


class GSM8KDataError(UserError):
    """GSM8K data cannot be found or read (problem names the folder or file and where it came from)."""


def gsm8k_files(configured: str | os.PathLike | None = None, *, setting: str = "eval.data_dir"
                ) -> Path | None:
    """The folder of gsm8k_dir's lookup, checked to hold both splits, each line of them a row
    (check_gsm8k_file); None when there is none (the hub).

    Raises GSM8KDataError naming the folder, where it came from and the missing file, or the file and line
    of a malformed row.
    """
    path, origin = gsm8k_dir(configured, setting=setting)
    if path is None:
        return None
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise GSM8KDataError(f"GSM8K directory {path} (from {origin}) {what}",
                             f"point {origin} at a directory holding train.jsonl and test.jsonl, "
                             "e.g. ../shared/data/gsm8k beside the checkout")
    missing = [f"{split}.jsonl" for split in SPLITS if not (path / f"{split}.jsonl").is_file()]
    if missing:
        raise GSM8KDataError(f"GSM8K directory {path} (from {origin}) lacks {', '.join(missing)}",
                             "GSM8K needs both splits as JSONL rows {\"question\", \"answer\"} (few-shot "
                             "examples come from train); point it at a full copy, e.g. ../shared/data/gsm8k")
    for split in SPLITS:
        check_gsm8k_file(path / f"{split}.jsonl")
    return path


ROW_KEYS = ("question", "answer")
ANSWER_MARKER = "####"  # GSM8K answers end in '#### <number>' (the final answer lm-eval's gsm8k task scores)
_CHECKED: dict[tuple[str, int, int], None] = {}  # (file, size, mtime_ns) of files that passed


def check_gsm8k_file(file: Path) -> None:
    """Every line of a GSM8K JSONL file must be a JSON object with non-empty string "question" and "answer",
    the answer ending in '#### <number>' (blank lines aside); otherwise the datasets library fails deep inside
    lm-eval, or a row is scored against a target it can never match ('None', or a whole solution). Raises
    GSM8KDataError naming the file and the line number. A file that passed is not read again while its size
    and mtime stay the same."""
    st = file.stat()
    key = (str(file), st.st_size, st.st_mtime_ns)
    if key in _CHECKED:
        return
    fix = ("each line must be one JSON object with string fields \"question\" and \"answer\" (the answer "
           "ending in '#### <number>'); fix or remove that line, or restore the file from a full GSM8K copy")
    rows = 0
    with open(file, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rows += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                # some of json's messages end in "at" ("Invalid control character '\n' at"): one "at"
                msg = e.msg.removesuffix(" at")
                raise GSM8KDataError(f"{file}:{lineno}: not valid JSON ({msg} at column {e.colno})",
                                     fix) from None
            if not isinstance(row, dict):
                raise GSM8KDataError(f"{file}:{lineno}: a JSON {type(row).__name__}, not an object", fix)
            bad = [k for k in ROW_KEYS if not isinstance(row.get(k), str) or not row[k].strip()]
            if bad:
                what = ", ".join(f"\"{k}\" is {'missing' if k not in row else repr(row[k])}" for k in bad)
                raise GSM8KDataError(f"{file}:{lineno}: {what}", fix)
            # lm-eval's gsm8k target is the text after the last '####': without one, the whole solution
            # would be the target and the question could never be scored right
            if not row["answer"].rsplit(ANSWER_MARKER, 1)[-1].strip() or ANSWER_MARKER not in row["answer"]:
                raise GSM8KDataError(f"{file}:{lineno}: the answer has no final '{ANSWER_MARKER} <number>' "
                                     f"(it ends: {row['answer'][-40:]!r})", fix)
    if not rows:
        raise GSM8KDataError(f"{file} holds no rows (it is empty)",
                             "restore the file from a full GSM8K copy (train: 7473 rows, test: 1319), e.g. "
                             "../shared/data/gsm8k")
    _CHECKED[key] = None


def _rows(file: Path) -> list[dict]:
    """The rows of a GSM8K JSONL file (checked by gsm8k_files), blank lines skipped."""
    with open(file, encoding="utf-8", errors="replace") as f:
        return [json.loads(line) for line in f if line.strip()]


def _example(row: dict) -> str:
    """A few-shot example of lm-eval's gsm8k task: doc_to_text, target_delimiter " ", doc_to_target, then
    fewshot_delimiter "\\n\\n"."""
    return f"Question: {row['question']}\nAnswer: {row['answer']}\n\n"


def _prompts(train: list[dict], test: list[dict], num_fewshot: int) -> list[str]:
    from lm_eval.api.samplers import ContextSampler  # pure Python (random); no torch, no datasets

    sampler = ContextSampler(train, rnd=FEWSHOT_SEED)  # one draw per question, in order
    return ["".join(map(_example, sampler.sample(num_fewshot))) + f"Question: {row['question']}\nAnswer:"
            for row in test]


def gsm8k_prompts(data_dir: str | os.PathLike, num_fewshot: int, limit: int | None = None) -> list[str]:
    """The prompts lm-eval 0.4.13's stock gsm8k task (PROMPTS_TASK) builds for the first ``limit`` test
    questions of ``data_dir`` (all when None), in order: ``num_fewshot`` train examples drawn by lm-eval's own
    sampler (lm_eval.api.samplers.ContextSampler seeded with FEWSHOT_SEED, one draw per question in order, as
    its Task.build_all_requests draws them), each "Question: <q>\\nAnswer: <a>\\n\\n", then
    "Question: <q>\\nAnswer:". tests/test_preflight.py checks that they equal the contexts lm-eval builds.
    Reads train.jsonl (for shots) and test.jsonl; the files must have passed gsm8k_files.
    """
    test = _rows(Path(data_dir) / "test.jsonl")[:limit]
    train = _rows(Path(data_dir) / "train.jsonl") if num_fewshot else []
    return _prompts(train, test, num_fewshot)


def _first_too_long(tokenizer, prompts: list[str], room: int) -> tuple[int, int] | None:
    """(index, tokens) of the first prompt that encodes (as runners.app.lm_adapter.EngineLM encodes
    prompts) to more than ``room`` tokens; None when all fit. Encoded in growing chunks, so a count far too
    large stops after a prompt or two."""
    start, size = 0, 1
    while start < len(prompts):
        for i, enc in enumerate(tokenizer.encode_batch(prompts[start:start + size]), start):
            if len(enc.ids) > room:
                return i, len(enc.ids)
        start, size = start + size, min(4 * size, 1024)
    return None


def check_prompt_room(tokenizer_file: str | Path, data_dir: Path | None, num_fewshot: int, max_gen_toks: int,
                      max_seq_len: int, *, draft_len: int = 0, limit: int | None = None,
                      exact: bool = False) -> None:
    """Refuse, before any model is loaded, settings whose prompts do not fit ``max_seq_len``: an
    ``max_gen_toks`` that leaves no position for a prompt, a ``num_fewshot`` too large for any prompt (the
    bound below) and, with ``exact``, any prompt of the run that does not fit.

    A prompt holds ``num_fewshot`` train examples ("Question: ...\\nAnswer: ...", lm-eval's gsm8k format),
    the question, and leaves ``max_gen_toks`` + ``draft_len`` positions (the engine's verify step) to
    generate. The bound, without tokenizing: a text of b UTF-8 bytes is at least ceil(b / L) tokens, L the
    longest vocabulary entry (byte-level BPE entries are one character per byte). When even the
    ``num_fewshot`` shortest examples exceed the positions left, no prompt fits; the error names the key and
    the largest value the bound allows. ``exact`` (the run's task is PROMPTS_TASK): the prompts of the first
    ``limit`` questions (gsm8k_prompts) are encoded with the tokenizer, and the first that does not fit is
    refused, naming the largest few-shot count below ``num_fewshot`` whose prompts all fit (and a count above
    the train split's rows, which lm-eval cannot draw). The few-shot
    checks are skipped for the hub dataset (``data_dir`` None); the bound for 0 shots.

    Raises registry.errors.UserError naming eval.max_gen_toks / eval.num_fewshot / model.max_seq_len and
    the counts involved.
    """
    if max_gen_toks >= max_seq_len:
        raise UserError(
            f"eval.max_gen_toks={max_gen_toks} leaves no room for a prompt: model.max_seq_len={max_seq_len} "
            "positions hold the prompt and the generated tokens (allowed: eval.max_gen_toks < "
            "model.max_seq_len)",
            "lower eval.max_gen_toks (256 is lm-eval's default) or raise model.max_seq_len")
    if data_dir is None:
        return

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    room = max_seq_len - max_gen_toks - draft_len  # positions a prompt may take
    train = _rows(Path(data_dir) / "train.jsonl") if num_fewshot else []
    draft = f" and draft_len={draft_len}" if draft_len else ""
    if num_fewshot:
        _check_fewshot_bound(tokenizer, train, num_fewshot, max(room - 1, 0),  # one kept for the question
                             f"model.max_seq_len={max_seq_len} minus eval.max_gen_toks={max_gen_toks}{draft}")
    if not exact:
        return
    if num_fewshot > len(train):  # lm-eval's draw would fail ("Sample larger than population")
        raise UserError(
            f"eval.num_fewshot={num_fewshot} is more than the {len(train)} examples of "
            f"{Path(data_dir) / 'train.jsonl'}, the pool the few-shot examples are drawn from",
            f"lower eval.num_fewshot to at most {len(train)}, or point eval.data_dir / ${DATA_ENV} at a full "
            "GSM8K copy (train: 7473 rows)")
    test = _rows(Path(data_dir) / "test.jsonl")[:limit]
    first = _first_too_long(tokenizer, _prompts(train, test, num_fewshot), room)
    if first is None:
        return
    i, tokens = first
    fits = next((n for n in range(num_fewshot - 1, -1, -1)
                 if _first_too_long(tokenizer, _prompts(train, test, n), room) is None), None)
    what = (f"eval.num_fewshot={num_fewshot} makes a prompt too long" if num_fewshot else
            "a prompt is too long even without few-shot examples (eval.num_fewshot=0)")
    raise UserError(
        f"{what}: the prompt of test question {i} has {tokens} tokens, and with eval.max_gen_toks="
        f"{max_gen_toks}{draft} it needs {tokens + max_gen_toks + draft_len} positions, more than "
        f"model.max_seq_len={max_seq_len}",
        (f"lower eval.num_fewshot to {fits} (the most for which every prompt of this run's {len(test)} "
         "questions fits), lower eval.max_gen_toks, or raise model.max_seq_len" if fits is not None else
         "lower eval.max_gen_toks or raise model.max_seq_len (no few-shot count fits)"))


def _check_fewshot_bound(tokenizer, train: list[dict], num_fewshot: int, room: int, left: str) -> None:
    """check_prompt_room's bound: ``room`` positions for the examples of ``train`` (``left`` says whence)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    longest = max((len(t.encode()) for t in vocab), default=1)
    # tokens each example needs at least, ascending
    least = sorted(-(-len(_example(row).encode()) // longest) for row in train)
    fits, total = 0, 0
    for n in least:
        if total + n > room:
            break
        total, fits = total + n, fits + 1
    else:
        return  # every example together fits: the bound refuses nothing (the train split's size is not ours)
    if num_fewshot > fits:
        need = sum(least[:num_fewshot])
        raise UserError(
            f"eval.num_fewshot={num_fewshot} cannot fit a prompt: even the {num_fewshot} shortest GSM8K "
            f"train examples need at least {need} tokens, and {left} leaves {room} for them (one position is "
            f"kept for the question); eval.num_fewshot can be at most {fits} here "
            f"(allowed range [0, {fits}])",
            f"set eval.num_fewshot to at most {fits} (5 is the task's own), or raise model.max_seq_len / "
            "lower eval.max_gen_toks")


def load_error(err: Exception, data_dir: Path | None) -> GSM8KDataError:
    """The error of a failed lm-eval task load (evals.evaluate.load_task): the hub dataset could not be
    loaded (data_dir None: offline or unreachable) or the files of data_dir could not be parsed."""
    if data_dir is None:
        return GSM8KDataError(
            f"no GSM8K directory given (data_dir unset, ${DATA_ENV} unset) and the hub dataset "
            f"{HUB_DATASET} could not be loaded: {type(err).__name__}: {err}",
            f"set {DATA_ENV}=/path/to/gsm8k (a directory with train.jsonl and test.jsonl, e.g. "
            "../shared/data/gsm8k) or pass data_dir; or allow hub access (unset HF_DATASETS_OFFLINE / "
            "HF_HUB_OFFLINE on a machine with network)")
    return GSM8KDataError(f"GSM8K files in {data_dir} could not be read: {type(err).__name__}: {err}",
                          "each line of train.jsonl / test.jsonl must be a JSON object with "
                          "\"question\" and \"answer\"")


def load_gsm8k(**metadata: Any) -> Any:
    """The documents of our local lm-eval groups (evals/tasks/gsm8k_local.yaml, gsm8k_cot_local.yaml; lm-eval
    calls it with the task's metadata instead of downloading the hub dataset): `{"train", "test"}` datasets
    (datasets.DatasetDict) of `<folder>/{train,test}.jsonl` (rows {"question", "answer"}), read by the
    datasets library's json builder, as lm-eval's stock gsm8k task reads the hub dataset's splits.

    The folder: metadata[DATA_KEY] when lm-eval was given one, else gsm8k_dir's lookup ($GSM8K_DIR,
    ../shared/data/gsm8k). Raises GSM8KDataError when no folder holds both splits.
    """
    import datasets

    path = gsm8k_files(metadata.get(DATA_KEY), setting=f"lm-eval metadata {DATA_KEY}")
    if path is None:
        raise GSM8KDataError(
            "the gsm8k_local task found no GSM8K folder (no metadata gsm8k_dir, $GSM8K_DIR unset, no "
            "../shared/data/gsm8k beside the checkout)",
            "pass --metadata '{\"gsm8k_dir\": \"/path/to/gsm8k\"}' or set GSM8K_DIR to a folder with "
            "train.jsonl and test.jsonl (or use the task gsm8k, which reads the hub dataset)",
        )
    return datasets.load_dataset("json", data_files={s: str(path / f"{s}.jsonl") for s in SPLITS})


def sample_fields(doc: Mapping[str, Any], target: str) -> dict[str, Any]:
    """GSM8K's fields of a scored sample (samples.jsonl), from lm-eval's logged document and target:
    "question", "target" (the reference solution text) and "target_answer" (the text after its last
    ANSWER_MARKER, the final answer lm-eval's filters are compared with; the whole text without one)."""
    answer = target.split(ANSWER_MARKER)[-1].strip() if ANSWER_MARKER in target else target.strip()
    return {"question": doc["question"], "target": target, "target_answer": answer}
