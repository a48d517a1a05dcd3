"""Our engine as an lm-eval model: `generate_until` over one `engine.generate` call, with resumable results;
and `evaluate_engine`, the evaluation of an engine (the application's side of evals, which imports nothing of
runners).

lm-eval hands the model text requests `(context, gen_kwargs)`; this adapter tokenizes them with the
checkpoint's `tokenizers.Tokenizer`, gives every request that is not already on disk to ONE
`engine.generate` call (the engine batches and schedules them), stops each request at its first `until`
string through the engine's `stop_checker`, and appends each finished request to a JSONL file
(`GenerationStore`) from `on_finish`, so a killed run loses nothing and a resumed run does not regenerate
what is on disk.

Greedy decoding only (the engine's contract); loglikelihood requests are not supported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (fills the built-in registry first: registering before it hides them)
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.defaults import DEFAULT_MAX_GEN_TOKS  # 256: lm-eval's limit when a task sets no max_gen_toks
from lm_eval.utils import simple_parse_args_string
from tokenizers import Tokenizer

from evals.evaluate import EvalResult, evaluate_lm
from evals.outdir import GENERATIONS_FILE, META_SUFFIX, STATS_SUFFIX, write_atomic
from evals.progress import LineProgress, progress_bar
from evals.task import DEFAULT_TASK, TASKS, EvalTask
from registry.checkpoint import TOKENIZER_FILE, check_checkpoint_dir
from registry.errors import UserError
from runners.engine.stats import GenerationStats

logger = logging.getLogger(__name__)

MODEL_NAME = "hybrid-engine"

# Our finish reasons in records: the EOS / stop token, a task `until` string, or the max_gen_toks limit.
FINISH_STOP_TOKEN, FINISH_STOP_STRING, FINISH_LENGTH = "stop_token", "stop_string", "length"


def sha256_text(text: str) -> str:
    """Hex sha256 of a string's UTF-8 bytes (prompt hashes in records)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON (one tokenizer.json gives one value in any process)."""
    return sha256_text(tokenizer.to_str())


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """Everything besides the prompt text that decides a greedy generation (part of the resume key).

    until: stop strings (order kept as the task gives them); max_gen_toks: generated-token limit;
    stop_token_ids: ids that end a request (kept in the engine's output, dropped from the text);
    tokenizer_sha256: `tokenizer_fingerprint` of the tokenizer that encodes prompts and decodes outputs.
    """

    until: tuple[str, ...]
    max_gen_toks: int
    stop_token_ids: tuple[int, ...]
    tokenizer_sha256: str


def request_key(prompt: str, settings: GenerationSettings) -> str:
    """Stable resume key: sha256 of the exact prompt text plus the generation settings (JSON, sorted keys)."""
    payload = {
        "prompt": prompt,
        "until": list(settings.until),
        "max_gen_toks": settings.max_gen_toks,
        "stop_token_ids": list(settings.stop_token_ids),
        "tokenizer_sha256": settings.tokenizer_sha256,
        "decoding": "greedy",
    }
    return sha256_text(json.dumps(payload, sort_keys=True, ensure_ascii=False))


def _fsync_append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


class GenerationStore:
    """Append-only JSONL of finished generations keyed by `request_key`; the resume file of an evaluation.

    One line per finished request, written (flush + fsync) as the request finishes:
    `{"key", "prompt_sha256", "generated_ids", "num_generated_tokens", "finish_reason",
    "engine_finish_reason", "stop_string", "text", "request_stats"}`; `request_stats` is the engine's
    per-request counter dict passed to `on_finish` (request_steps, drafted_tokens, accepted_drafts,
    accepted_per_position, num_accepted_hist, generated_tokens, prompt_tokens) or null when the engine gave
    none. A sibling file `<stem>.stats.jsonl` gets one line per `engine.generate` call that returned:
    `{"wall_seconds", "num_requests", "engine_stats", "nonfinite"}` (`nonfinite`: the model outputs that held
    NaN / infinite values in that call, `runners.engine.engine.GenerationOutput.nonfinite`).

    `<stem>.meta.json` holds `run_meta` (what must match for stored generations to be reused, e.g. the
    engine's config and options; JSON-serialisable).

    resume=False truncates the files and writes run_meta; resume=True loads them and raises ValueError if the
    stored run_meta differs from `run_meta`. A last line cut short by a kill (no trailing newline) is dropped
    with a warning and removed from the file before anything is appended; an unreadable line elsewhere is set
    aside: the file is rewritten with the readable lines (every line parses for later readers), a copy of it
    as it was is kept as `<name>.damaged-<time>`, and a warning on stderr names both. Later records of a key
    win.
    """

    def __init__(self, path: str | Path, *, resume: bool, run_meta: dict[str, Any] | None = None):
        self.path = Path(path)
        self.stats_path = self.path.with_name(self.path.stem + STATS_SUFFIX)
        self.meta_path = self.path.with_name(self.path.stem + META_SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: dict[str, dict[str, Any]] = {}
        self.stats_parts: list[dict[str, Any]] = []
        run_meta = json.loads(json.dumps(run_meta or {}))  # canonical JSON types, as it will be read back
        if resume and self.meta_path.exists():
            stored = json.loads(self.meta_path.read_text(encoding="utf-8"))
            if stored != run_meta:
                diff = sorted(k for k in stored.keys() | run_meta.keys() if stored.get(k) != run_meta.get(k))
                raise ValueError(
                    f"cannot resume from {self.path}: it was written by a different run (differs in {diff}: "
                    f"stored {[stored.get(k) for k in diff]}, now {[run_meta.get(k) for k in diff]}); "
                    "resume with the same engine settings, or use resume=False or another out_dir")
        write_atomic(self.meta_path, json.dumps(run_meta, indent=1, sort_keys=True) + "\n")
        if not resume:
            for p in (self.path, self.stats_path):
                p.write_text("", encoding="utf-8")
            return
        self.records = {r["key"]: r for r in self._load(self.path, required=("key", "text"))}
        self.stats_parts = self._load(self.stats_path, required=("engine_stats",))

    @staticmethod
    def _load(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1  # a write cut short by a kill: drop it, appends start on a new line
            logger.warning("%s: dropping an incomplete last line (%d bytes) left by an interrupted write",
                           path, len(data) - cut)
            with open(path, "r+b") as f:
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())
            data = data[:cut]
        out, kept, bad = [], [], []
        for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if not isinstance(rec, dict) or any(k not in rec for k in required):
                bad.append(lineno)
                continue
            out.append(rec)
            kept.append(line + "\n")
        if bad:  # set aside, never lost: a copy keeps the damaged file whole, the live one the readable lines
            damaged = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.copyfile(path, damaged)
            write_atomic(path, "".join(kept))
            print(f"warning: {path}: {len(bad)} unreadable record(s) (line {', '.join(map(str, bad[:5]))}"
                  f"{', ...' if len(bad) > 5 else ''}) set aside; the file as it was is kept in {damaged}, "
                  "and what those lines held runs again", file=sys.stderr)
        return out

    def add(self, record: dict[str, Any]) -> None:
        """Append one finished generation (durable on return) and index it by its key."""
        _fsync_append(self.path, json.dumps(record, ensure_ascii=False) + "\n")
        self.records[record["key"]] = record

    def add_stats(self, part: dict[str, Any]) -> None:
        """Append the stats of one `engine.generate` call that returned (durable on return)."""
        _fsync_append(self.stats_path, json.dumps(part) + "\n")
        self.stats_parts.append(part)


def first_stop(text: str, until: Sequence[str]) -> tuple[int, str | None]:
    """Index and value of the earliest occurrence of any stop string in `text`; (len(text), None) if none.

    On a tie (two stop strings starting at the same index) the longer one is reported.
    """
    best, best_s = len(text), None
    for s in until:
        j = text.find(s)
        if j != -1 and (j < best or (j == best and best_s is not None and len(s) > len(best_s))):
            best, best_s = j, s
    return best, best_s


@dataclasses.dataclass
class _Pending:
    index: int  # position in lm-eval's request list
    key: str
    prompt: str
    settings: GenerationSettings
    args: tuple  # the request's (context, gen_kwargs), as lm-eval's cache hook keys it
    checked_len: int = 0  # generated ids already scanned for stop strings


@register_model(MODEL_NAME)
class EngineLM(LM):
    """lm-eval model over a `runners.Engine` (greedy; `generate_until` only).

    Args:
        engine: has `generate(prompts: list[list[int]], max_new_tokens: int, stop_token_ids=None,
            stop_checker=None, on_finish=None, progress=None)` returning `.tokens`, `.finish_reasons`,
            `.stats` (docs/architecture.md) and calling `on_finish(i, generated_ids, finish_reason,
            request_stats)` (an engine that passes only the first three leaves `request_stats` null);
            `engine.config.eos_token_id` is used when present.
        tokenizer: the checkpoint's `tokenizers.Tokenizer` (or a path to its tokenizer.json). Prompts are
            encoded with its post-processor (special tokens such as BOS as the tokenizer.json defines).
        max_gen_toks: generated-token limit for requests whose gen_kwargs do not set `max_gen_toks`.
        store: resume file; finished requests are appended to it, and requests found in it are not
            generated again. None keeps results in memory only.
        progress: show a tqdm bar (one tick per finished request, resumed ones counted as done).

    After `generate_until`, `self.records` maps each request key of the call to its generation record
    (see `GenerationStore`), `self.num_resumed` / `self.num_generated` count reused / new requests and
    `self.stats_parts` holds the call's `{"wall_seconds", "num_requests", "engine_stats", "nonfinite"}`
    (empty when nothing had to be generated).
    """

    def __init__(self, engine: Any, tokenizer: Tokenizer | str | Path, *,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, store: GenerationStore | None = None,
                 progress: bool = True):
        super().__init__()
        if not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise ValueError(f"max_gen_toks must be a positive int, got {max_gen_toks!r}")
        self.engine = engine
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer.from_file(str(tokenizer))
        self.tokenizer = tokenizer
        self.max_gen_toks = max_gen_toks
        self.store = store
        self.progress = progress
        self.tokenizer_sha256 = tokenizer_fingerprint(self.tokenizer)
        self.stop_token_ids = self._stop_token_ids()
        self.records: dict[str, dict[str, Any]] = {}
        self.stats_parts: list[dict[str, Any]] = []
        self.num_resumed = 0
        self.num_generated = 0

    def _stop_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's stop ids (engine.config.eos_token_id: generation_config.json's, else
        config.json's), else the tokenizer's '</s>'."""
        eos = self.engine.config.eos_token_id
        if isinstance(eos, int):
            eos = (eos,)
        if not eos and self.tokenizer.token_to_id("</s>") is not None:
            eos = (self.tokenizer.token_to_id("</s>"),)
        if not eos:
            raise ValueError("no EOS id: the checkpoint sets no eos_token_id (generation_config.json or "
                             "config.json) and the tokenizer has no '</s>'; set eos_token_id in config.json")
        return tuple(sorted({int(e) for e in eos}))

    @classmethod
    def from_checkpoint(cls, pretrained: str | Path, *, device: str = "cpu", dtype: str = "float32",
                        draft_len: int = 0, ssm_replay: bool = False, batch_size: int | str = 16,
                        max_batch_size: int | None = None, max_seq_len: int = 4096,
                        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, ssm_backend: str | None = None,
                        generations: str | Path | None = None, resume: bool = False,
                        num_threads: int | None = None, progress: bool = True) -> EngineLM:
        """The model lm-eval builds from `model_args` (create_from_arg_string): runners.Engine on an HF
        checkpoint directory, with its tokenizer.json.

        Args:
            pretrained: the checkpoint directory.
            device, dtype, draft_len, ssm_replay, max_seq_len, ssm_backend: Engine.from_pretrained's.
            batch_size: concurrent requests (the engine's max_batch_size); "auto" (lm-eval's option) takes
                max_batch_size, else 16.
            max_gen_toks: generated-token limit for tasks that set none (lm-eval's default 256).
            generations / resume: a GenerationStore file (generations.jsonl) to append every finished
                request to, and whether to continue from it.
            num_threads: torch intra-op threads (torch.set_num_threads); 1 suits the tiny models on a CPU
                (configs/runtime/cpu.yaml); None leaves torch's default.
        Raises:
            CheckpointError (an incomplete checkpoint), ValueError (an option the engine refuses, a CUDA
            device without CUDA).
        """
        from runners.engine.engine import Engine
        from runners.engine.options import EngineOptions

        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device} but CUDA is not available here; pass device=cpu "
                             "(--device cpu)")
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = max_batch_size or 16
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        check_checkpoint_dir(pretrained, "pretrained=")
        options = EngineOptions(dtype=dtype, draft_len=int(draft_len), ssm_replay=bool(ssm_replay),
                                max_batch_size=int(batch_size), max_seq_len=int(max_seq_len),
                                ssm_backend=ssm_backend)
        engine = Engine.from_pretrained(str(pretrained), options, device=device)
        store = GenerationStore(generations, resume=resume) if generations else None
        return cls(engine, Path(pretrained) / TOKENIZER_FILE, max_gen_toks=int(max_gen_toks), store=store,
                   progress=progress)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
                            ) -> EngineLM:
        """lm-eval's constructor from a dict of model_args (plus its batch_size / max_batch_size / device
        settings): from_checkpoint(**args). Raises UserError for an argument from_checkpoint does not take
        (listing those it takes) and for a value it refuses (its ValueError)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        args = {**arg_dict, **extra}
        known = [p for p in inspect.signature(cls.from_checkpoint).parameters if p != "progress"]
        unknown = sorted(set(args) - set(known) - {"progress"})
        if unknown:
            raise UserError(f"--model_args {', '.join(unknown)}: not an argument of {MODEL_NAME}",
                            f"use {', '.join(known)} (runners.app.lm_adapter.EngineLM.from_checkpoint)")
        try:
            return cls.from_checkpoint(**args)
        except UserError:  # a checkpoint problem: its own problem / fix
            raise
        except ValueError as e:
            raise UserError(f"--model_args: {e}", "change that argument in --model_args") from None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None
                               ) -> EngineLM:
        """lm-eval's constructor from a model_args string, e.g. "pretrained=<dir>,draft_len=3"."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # --- lm-eval API ---------------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False):
        raise NotImplementedError(
            f"{MODEL_NAME} implements generate_until only: loglikelihood (multiple-choice / scoring tasks) "
            "is not supported by the engine's greedy generate API; run generation tasks such as gsm8k")

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False):
        raise NotImplementedError(
            f"{MODEL_NAME} implements generate_until only: loglikelihood_rolling (perplexity tasks) is not "
            "supported by the engine's greedy generate API; run generation tasks such as gsm8k")

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations of `requests` (`.args = (context, gen_kwargs)`), cut at the first stop string.

        gen_kwargs: `until` (str or list of str), `max_gen_toks` (else the model default), `do_sample` /
        `temperature` (must be greedy), other keys ignored. Raises ValueError on sampling settings.
        All requests not found in the store go to one `engine.generate` call. Returns texts in request order.
        """
        keys: list[str] = []
        queued: dict[str, _Pending] = {}
        self.records = {}
        for idx, req in enumerate(requests):
            context, gen_kwargs = req.args
            settings = self._settings(gen_kwargs)
            key = request_key(context, settings)
            keys.append(key)
            if self.store is not None and key in self.store.records:
                self.records[key] = self.store.records[key]
                self.cache_hook.add_partial("generate_until", req.args, self.records[key]["text"])
            elif key not in queued:  # an identical request twice in one call is generated once
                queued[key] = _Pending(idx, key, context, settings, req.args)
        pending = list(queued.values())
        self.num_resumed = len(self.records)
        self.num_generated = 0
        self.stats_parts = []

        if pending:
            show = self.progress and not disable_tqdm
            total, done = len(self.records) + len(pending), len(self.records)
            with progress_bar(total, done, desc="generate", show=show) as bar:
                self._generate(pending, bar)
        return [self.records[k]["text"] for k in keys]

    @property
    def all_stats_parts(self) -> list[dict[str, Any]]:
        """The stats parts of every generate call of the store's folder that returned (earlier runs' parts
        included; evals.evaluate.GeneratingLM); this model's own calls' without a store."""
        return self.store.stats_parts if self.store is not None else self.stats_parts

    def request_key_for(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        """The resume key this model gives the request `(context, gen_kwargs)` (see `request_key`)."""
        return request_key(context, self._settings(gen_kwargs))

    # --- internals -------------------------------------------------------------------------------------
    def _settings(self, gen_kwargs: dict[str, Any]) -> GenerationSettings:
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}: {gen_kwargs!r}")
        if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0.0) > 0.0:
            raise ValueError(f"{MODEL_NAME} decodes greedily; got do_sample={gen_kwargs.get('do_sample')!r}, "
                             f"temperature={gen_kwargs.get('temperature')!r}: "
                             "set do_sample: false, temperature: 0")
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        if not all(isinstance(s, str) and s for s in until):
            raise ValueError(f"`until` must be non-empty strings, got {until!r}")
        max_gen_toks = gen_kwargs.get("max_gen_toks", self.max_gen_toks)
        if not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise ValueError(f"max_gen_toks must be a positive int, got {max_gen_toks!r}")
        return GenerationSettings(tuple(until), max_gen_toks, self.stop_token_ids, self.tokenizer_sha256)

    def _finish(self, p: _Pending, ids: Sequence[int], engine_reason: str,
                request_stats: dict[str, Any] | None) -> dict[str, Any]:
        ids = [int(t) for t in ids[: p.settings.max_gen_toks]]  # a multi-token step may overshoot the limit
        body = ids[:-1] if ids and ids[-1] in p.settings.stop_token_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        cut, stop = first_stop(text, p.settings.until)
        if stop is not None:
            reason = FINISH_STOP_STRING
        elif len(body) < len(ids):
            reason = FINISH_STOP_TOKEN
        else:
            reason = FINISH_LENGTH
        return {
            "key": p.key,
            "prompt_sha256": sha256_text(p.prompt),
            "generated_ids": ids,
            "num_generated_tokens": len(ids),
            "finish_reason": reason,
            "engine_finish_reason": engine_reason,
            "stop_string": stop,
            "text": text[:cut],
            "request_stats": None if request_stats is None else dict(request_stats),
        }

    def _generate(self, pending: list[_Pending], bar: LineProgress | Any) -> None:
        prompts = []
        for p in pending:
            ids = self.tokenizer.encode(p.prompt).ids
            if not ids:
                raise ValueError(f"request {p.index} encodes to no tokens (empty prompt?)")
            prompts.append(ids)
        # Each check decodes the tokens added since the previous check plus `window` tokens before them, so a
        # stop string straddling two steps is seen. A stop string of L chars spans <= L tokens when every
        # token decodes to >= 1 char; byte-level pieces of one character may decode to none: 2 L + 8.
        window = 2 * max((len(s) for p in pending for s in p.settings.until), default=0) + 8

        def stop_checker(i: int, generated_ids: Sequence[int]) -> bool:
            p = pending[i]
            n = len(generated_ids)
            if n >= p.settings.max_gen_toks:
                return True
            if not p.settings.until:
                return False
            start = max(0, p.checked_len - window)
            p.checked_len = n
            tail = self.tokenizer.decode(list(generated_ids[start:]), skip_special_tokens=True)
            return any(s in tail for s in p.settings.until)

        def on_finish(i: int, generated_ids: Sequence[int], finish_reason: str,
                      request_stats: dict[str, Any] | None = None) -> None:
            p = pending[i]
            if p.key in self.records:
                logger.warning("engine reported request %d finished twice; keeping the first result", i)
                return
            record = self._finish(p, generated_ids, finish_reason, request_stats)
            if self.store is not None:
                self.store.add(record)
            self.records[p.key] = record
            # lm-eval's response cache (`use_cache=` / --use_cache), written as each request finishes
            self.cache_hook.add_partial("generate_until", p.args, record["text"])
            self.num_generated += 1
            bar.update(1)

        t0 = time.perf_counter()
        out = self.engine.generate(
            prompts,
            max(p.settings.max_gen_toks for p in pending),
            stop_token_ids=list(self.stop_token_ids),
            stop_checker=stop_checker,
            on_finish=on_finish,
            progress=None,
        )
        wall = time.perf_counter() - t0
        tokens, reasons = list(out.tokens), list(out.finish_reasons)
        if len(tokens) != len(pending) or len(reasons) != len(pending):
            raise RuntimeError(f"engine.generate returned {len(tokens)} outputs / {len(reasons)} finish "
                               f"reasons for {len(pending)} prompts")
        for i, p in enumerate(pending):
            if p.key not in self.records:  # the engine skipped on_finish for it: use the return value
                logger.warning("engine did not call on_finish for request %d; recording its output", i)
                on_finish(i, tokens[i], reasons[i])
        part = {"wall_seconds": wall, "num_requests": len(pending), "engine_stats": out.stats.to_dict(),
                "nonfinite": list(getattr(out, "nonfinite", None) or [])}
        self.stats_parts.append(part)
        if self.store is not None:
            self.store.add_stats(part)


def evaluate_engine(engine: Any, tokenizer_path: str | os.PathLike, *, data_dir: str | os.PathLike | None,
                    limit: int | None = None, num_fewshot: int = 5, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                    out_dir: str | os.PathLike, resume: bool = False, progress: bool = True,
                    fingerprint: dict[str, Any] | None = None, task: EvalTask = TASKS[DEFAULT_TASK]
                    ) -> EvalResult:
    """Score `engine` on a task row (default gsm8k) through lm-eval: evals.evaluate.evaluate_lm over an
    `EngineLM` whose resume file is out_dir/generations.jsonl.

    Args:
        engine: `runners.Engine` or anything with its `generate` contract (docs/architecture.md).
        tokenizer_path: the checkpoint's tokenizer.json (`tokenizers.Tokenizer.from_file`).
        data_dir, limit, num_fewshot, max_gen_toks, out_dir, progress, task: evals.evaluate.evaluate_lm's
            (max_gen_toks: the generated-token limit per request; the task sets none).
        resume: reuse generations.jsonl from an earlier (possibly killed) run with the same settings; only
            requests not on disk are sent to the engine. False starts the generations files afresh.
        fingerprint: JSON-able settings that generations depend on beyond the prompt and the engine's
            config, e.g. {"model": entry, "dtype": ..., "draft_len": K, "ssm_replay": ...}. Stored with
            type(engine) and repr(engine.config) in generations.meta.json; resume=True with a different one
            raises ValueError instead of mixing runs.

    Returns evals.evaluate.EvalResult (its stats summed as runners.engine.stats.GenerationStats). Raises
    FileNotFoundError (no tokenizer file), GSM8KDataError, ValueError, RuntimeError (evaluate_lm's).
    Mutates nothing but out_dir.
    """
    tokenizer_path = Path(tokenizer_path)
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"tokenizer file {tokenizer_path} not found: "
                                "pass the checkpoint's tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))

    def make_lm() -> EngineLM:  # after the task's data loaded: a data error leaves the resume files alone
        run_meta = {"engine": type(engine).__qualname__, "engine_config": repr(engine.config),
                    "fingerprint": fingerprint or {}}
        store = GenerationStore(Path(out_dir) / GENERATIONS_FILE, resume=resume, run_meta=run_meta)
        return EngineLM(engine, tokenizer, max_gen_toks=max_gen_toks, store=store, progress=progress)

    return evaluate_lm(make_lm, counters=GenerationStats, data_dir=data_dir, limit=limit,
                       num_fewshot=num_fewshot, max_gen_toks=max_gen_toks, out_dir=out_dir, progress=progress,
                       task=task)
