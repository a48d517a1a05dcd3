"""The run's output folder: where it is, whether this run may write or resume it, and the fingerprint of
the settings its generations depend on. Torch-free (registry/ and the light evals modules only), so
runners.app.preflight refuses a folder mistake -- another run's folder, a resume with other settings, a
folder in use -- before the engine and lm-eval are imported; runners.app.main checks again once it holds
the folder (evals.outdir.claim_out_dir).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evals.compare import COMPARE_ARMS
from evals.outdir import GENERATIONS_FILE, META_SUFFIX, claim_fresh_dir, folder_in_use
from evals.task import DEFAULT_TASK
from evals.tasks.gsm8k import gsm8k_dir
from registry.checkpoint import CONFIG_FILE, checkpoint_fingerprint
from registry.errors import UserError
from registry.releases import DUMMY_SEED
from registry.resolve import ResolvedRun
from registry.schema import REPO_ROOT

__all__ = ["check_existing_run_folder", "check_resume", "check_run_folder", "fingerprint", "run_folder"]


def fingerprint(rr: ResolvedRun) -> dict[str, Any]:
    """The settings stored generations depend on; resuming with different ones is refused (check_resume).

    Included: the checkpoint's contents (registry.checkpoint.checkpoint_fingerprint: weight files' size,
    mtime and safetensors headers, config.json, generation_config.json, tokenizer.json), every engine setting
    (dtypes, draft length, replay, backend, batch size, max_seq_len, CPU threads), eval.num_fewshot and
    eval.max_gen_toks (they change the prompts and the generations, hence the acceptance counters) and the
    GSM8K data folder (absolute path; None = hub). Not included: the git commit (resuming across a code
    change is allowed; results.json records the commit of the finishing run), eval.limit (a resumed run may
    score more or fewer samples: evals.evaluate reports the counters of exactly the scored ones), paths of the
    outputs.
    """
    data_dir, _ = gsm8k_dir(rr.run.eval.data_dir)
    return {
        "entry": rr.entry.name,
        "checkpoint_dir": str(rr.checkpoint_dir),
        # the effective load_format, so that a refused resume names it ('auto', never None)
        "load_format": rr.entry.load_format.value,
        **(_dummy_fingerprint(rr) if rr.dummy else checkpoint_fingerprint(rr.checkpoint_dir)),
        **rr.engine_settings(),  # device, dtypes, draft_len, replay, backend, batch size, world size
        "quant": rr.entry.quant.value,
        "kv_cache_quant": rr.entry.kv_cache_quant.value,
        "max_seq_len": rr.entry.max_seq_len,
        "num_threads": rr.run.runtime.num_threads,
        "num_fewshot": rr.run.eval.num_fewshot,
        "max_gen_toks": rr.run.eval.max_gen_toks,
        "data_dir": str(data_dir) if data_dir is not None else None,
        # present only when on: fingerprints stored before the option equal today's with it off
        **({"ssm_stochastic_rounding": True} if rr.entry.ssm.stochastic_rounding else {}),
        # present only for another task than the default (fingerprints stored before the table equal today's)
        **({"task": rr.run.eval.name} if rr.run.eval.name != DEFAULT_TASK else {}),
    }


def _dummy_fingerprint(rr: ResolvedRun) -> dict[str, Any]:
    """What dummy weights depend on: their seed and the configuration they were built at."""
    config = rr.checkpoint_dir / CONFIG_FILE
    return {"dummy_seed": DUMMY_SEED, "config_source": rr.checkpoint_config.source,
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None}


def run_folder(rr: ResolvedRun) -> Path:
    """out_dir=, else Hydra's run (or sweep job) folder, else -- outside Hydra -- a fresh folder
    outputs/<entry>/<time>[-N] of the checkout (evals.outdir.claim_fresh_dir, as Hydra's default
    folders)."""
    if rr.run.out_dir:
        return Path(rr.run.out_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    return Path(claim_fresh_dir(str(REPO_ROOT / "outputs" / rr.entry.name / stamp)))


def check_run_folder(out_dir: Path, rr: ResolvedRun, *, note: bool = True) -> None:
    """A folder holds one kind of run: a single run (generations.jsonl at the top) or a compare run (one
    folder per arm); continuing or overwriting the other kind would mix or lose results. Then each folder
    that will receive generations must be fresh or resumable with this run's settings (:func:`check_resume`;
    ``note``: its note on a resume that finds nothing). Raises UserError."""
    single = (out_dir / GENERATIONS_FILE).is_file()
    arms = [arm for arm in COMPARE_ARMS if (out_dir / arm / GENERATIONS_FILE).is_file()]
    if (rr.run.compare and single) or (not rr.run.compare and arms):
        held = "a single run" if single else "a compare=replay run"
        asked = "compare=replay" if single else "a single run"
        raise UserError(
            f"{out_dir} holds {held}; {asked} cannot be written or resumed there",
            "choose another out_dir= / hydra.run.dir=, or rerun with the settings of the run it holds",
        )
    if rr.run.compare:
        for arm, replay in zip(COMPARE_ARMS, (False, True)):
            arm_fingerprint = functools.partial(lambda r: fingerprint(rr.compare_arm(r)), replay)
            check_resume(out_dir / arm, rr.run.resume, arm_fingerprint, note=note)
    else:
        check_resume(out_dir, rr.run.resume, lambda: fingerprint(rr), note=note)


# fingerprint keys added after runs were written without them: absent from a stored fingerprint = not checked
_FINGERPRINT_KEYS_ADDED = frozenset({
    "ssm_backend", "ssm_replay_checkpointing", "weights_sha256", "config_sha256", "generation_config_sha256",
    "tokenizer_sha256", "max_seq_len", "num_threads", "load_format",  # older auto runs lack load_format
})


def check_resume(out_dir: Path, resume: bool, fingerprint: dict[str, Any] | Callable[[], dict[str, Any]], *,
                 note: bool = True) -> None:
    """Refuse to overwrite or to mix runs in `out_dir`, before anything heavy is loaded.

    Without resume, a folder holding an earlier run's generations is an error; with resume, the fingerprint
    stored beside them (`<generations>.meta.json`, written by GenerationStore) must equal `fingerprint` (the
    settings the generations depend on; or a function that returns them, called only when there is a
    stored one to compare). ``note``: print a note when resume=true finds no generations (a mistyped folder
    would otherwise start over without a word). Raises UserError naming the differing settings.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output folder {out_dir} exists and is not a folder",
                        "choose another out_dir= / hydra.run.dir=")
    gen = out_dir / GENERATIONS_FILE
    if not resume and gen.is_file() and gen.stat().st_size > 0:
        raise UserError(
            f"{out_dir} already holds generations of an earlier run ({gen})",
            "pass resume=true to continue that run (finished samples are kept), or choose another out_dir= "
            "/ hydra.run.dir=",
        )
    meta = gen.with_name(gen.stem + META_SUFFIX)
    if resume and not gen.is_file() and note:  # a mistyped folder would otherwise start over without a word
        print(f"note: resume=true, but {out_dir} holds no earlier generations: starting from the first "
              "question", file=sys.stderr)
    if resume and meta.is_file():
        try:
            stored = json.loads(meta.read_text()).get("fingerprint") or {}
        except (json.JSONDecodeError, AttributeError):
            raise UserError(f"{meta} is unreadable, so the run cannot be resumed safely",
                            "choose another out_dir= / hydra.run.dir=, or delete that folder") from None
        now = json.loads(json.dumps(fingerprint() if callable(fingerprint) else fingerprint))
        keys = (stored.keys() | now.keys()) - (_FINGERPRINT_KEYS_ADDED - stored.keys())
        diff = sorted(k for k in keys if stored.get(k) != now.get(k))
        if diff:
            from registry.resolve import SETTING_OVERRIDES as names

            label = {k: k if names.get(k, k) == k else f"{k} ({names[k]})" for k in diff}  # + its override
            def shown(v):  # an absent key is a setting that was not set
                return "not set" if v is None else repr(v)

            what = "; ".join(f"{label[k]}: {shown(stored.get(k))} then, {shown(now.get(k))} now"
                             for k in diff)
            raise UserError(
                f"cannot resume the run in {out_dir}: its generations were made with other settings ({what})",
                "resume with the settings of that run, or choose another out_dir= / hydra.run.dir=",
            )


def check_existing_run_folder(rr: ResolvedRun) -> None:
    """The folder checks of :func:`check_run_folder`, and whether another live run holds the folder, for a
    run whose folder already exists (out_dir=, or Hydra's run folder), without creating or writing anything.
    A run without out_dir= outside Hydra gets a fresh folder: nothing to check. Raises UserError."""
    if rr.run.out_dir:
        folder = Path(rr.run.out_dir)
    else:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return
        folder = Path(HydraConfig.get().runtime.output_dir)
    if not folder.exists():
        return
    holder = folder_in_use(folder) if folder.is_dir() else None
    if holder is not None:
        raise UserError(f"output folder {folder} is in use by a run that is still going ({holder})",
                        "wait for it to finish, or choose another out_dir= / hydra.run.dir=")
    check_run_folder(folder, rr, note=False)  # the run's own check, once it holds the folder, notes
