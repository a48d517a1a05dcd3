"""`python -m registry pr-check --base <ref>`: check what a registry pull request touches, as CI does.

1. Find the change: the files that differ between the merge base of <ref> and HEAD and the working tree
   (`git diff --name-status`, plus untracked files under registry/).
2. Map it to entries: a changed `registry/model/<name>.yaml`; every entry that reuses a touched one through
   its defaults list (a variant); every entry judged by a baseline key whose rows changed in
   `registry/baselines/*.yaml` (the model blocks of the base and the new file are compared); every embedded
   entry whose checkpoint folder changed. A change to the registry's code (registry/*.py) touches all of them.
3. Validate them with `python -m registry validate <entries>` (schema, composition with ssm_replay on / off
   and world sizes, the baseline rows each would be judged by, an embedded checkpoint that loads). When a
   baseline file changed, every entry is validated: that loads and checks the whole file.
4. Smoke-evaluate each touched embedded entry on the CPU: `python run.py model=<entry> compare=replay
   eval.limit=2` (without speculative decoding: a plain run). It fails when the run cannot complete (user
   error, crash) or when replay and rewind disagree (the comparison's checks); a GSM8K / acceptance check at
   n = 2 is reported but does not fail the pull request (the floors are population floors).

A base ref that names no commit here (a typo, a clone without the remote branch, no git) is a bad invocation
(exit 2, with the fix); with `--if-base-exists` (what CI passes: a fresh clone may have only one branch)
nothing is checked and the command says so (exit 0). Exit status: 0 nothing failed, 1 a check failed, 2 a
bad invocation. The registry's own
template, `registry/model/_template.yaml.example`, is checked against the schema when it changes.

Commands run as subprocesses, so this module imports nothing of the runner or the evaluation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.schema import BASELINES_DIR, MODEL_DIR, REGISTRY_DIR, REPO_ROOT, entry_names, validate_entry
from registry.selection import entry_data, variants_of
from registry.yamlfile import RegistryYAMLError
from registry.yamlfile import load as load_yaml

TEMPLATE = MODEL_DIR / "_template.yaml.example"
SMOKE_LIMIT = 2


class GitError(RuntimeError):
    """git failed (not a repository, no such revision)."""


def _git(args: list[str], repo: Path) -> str:
    try:
        proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise GitError(f"git cannot run: {e}") from None
    if proc.returncode != 0:
        raise GitError(proc.stderr.strip() or f"git {' '.join(args)} failed")
    return proc.stdout


def merge_base(base: str, repo: Path = REPO_ROOT) -> str | None:
    """The merge base of `base` and HEAD; None when `base` names no commit here (or this is no git clone)."""
    try:
        _git(["rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"], repo)
        return _git(["merge-base", base, "HEAD"], repo).strip()
    except GitError:
        return None


def changed_files(commit: str, repo: Path = REPO_ROOT) -> list[tuple[str, str]]:
    """[(status letter, repository path)] of what differs from `commit` (committed, staged, unstaged and
    untracked-but-not-ignored files under registry/); renames appear as a deletion and an addition."""
    out = []
    for line in _git(["diff", "--name-status", "--no-renames", commit, "--", "registry"], repo).splitlines():
        status, _, path = line.partition("\t")
        out.append((status[:1], path))
    for path in _git(["ls-files", "--others", "--exclude-standard", "--", "registry"], repo).splitlines():
        out.append(("A", path))
    return sorted(set(out), key=lambda sp: sp[1])


def _models_block(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        data = load_yaml(text, "baselines file") or {}
    except RegistryYAMLError:
        return {"<unreadable>": text}
    models = data.get("models") if isinstance(data, dict) else None
    return models if isinstance(models, dict) else {"<no models mapping>": data}


def _rows(block: Any) -> list[str]:
    rows = block.get("rows") if isinstance(block, dict) else None
    return [json.dumps(r, sort_keys=True) for r in rows] if isinstance(rows, list) else []


def baseline_changes(path: str, commit: str, repo: Path = REPO_ROOT) -> dict[str, str]:
    """{model key: what changed} between `path` (a baselines YAML, repository-relative) at `commit` and now.

    Compares the `models:` blocks: rows added / removed, other keys (description, source, metric) changed.
    """
    try:
        old_text = _git(["show", f"{commit}:{path}"], repo)
    except GitError:
        old_text = None  # a new file
    new_file = repo / path
    new = _models_block(new_file.read_text() if new_file.is_file() else None)
    old = _models_block(old_text)
    out = {}
    for key in sorted(set(old) | set(new), key=str):
        if old.get(key) == new.get(key):
            continue
        if key not in old:
            out[key] = f"new model key, {len(_rows(new[key]))} rows"
        elif key not in new:
            out[key] = "model key removed"
        else:
            before, after = set(_rows(old[key])), set(_rows(new[key]))
            parts = []
            if after - before:
                parts.append(f"{len(after - before)} rows added or changed")
            if before - after:
                parts.append(f"{len(before - after)} rows removed or changed")
            out[key] = ", ".join(parts) or "description / source / metric changed"
    return out


@dataclass
class Touched:
    """What a change touches: entries to check (name -> why), baseline keys that changed, and more."""

    commit: str
    files: list[tuple[str, str]]
    entries: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    baselines: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> {model key: change}
    unused_keys: list[str] = field(default_factory=list)  # changed baseline keys no entry is judged by
    validate_all: bool = False
    template_changed: bool = False


def _safe_data(name: str) -> dict[str, Any]:
    try:
        return entry_data(name)
    except (KeyError, ValueError):  # ValueError: a defaults cycle, unreadable YAML (RegistryYAMLError)
        return {}  # validation reports what is wrong with it


def find_touched(commit: str, repo: Path = REPO_ROOT) -> Touched:
    """Map the change since `commit` to registry entries (see the module docstring)."""
    t = Touched(commit, changed_files(commit, repo))
    names = entry_names()
    data = {n: _safe_data(n) for n in names}

    def add(name: str, why: str) -> None:
        t.entries.setdefault(name, why)

    rel_model = MODEL_DIR.relative_to(REPO_ROOT).as_posix()
    rel_base = BASELINES_DIR.relative_to(REPO_ROOT).as_posix()
    rel_ckpt = (REGISTRY_DIR / "checkpoints").relative_to(REPO_ROOT).as_posix()
    direct = []
    code = [Path(p).name for _, p in t.files if Path(p).parent.as_posix() == "registry" and p.endswith(".py")]
    if code:
        t.validate_all = True
        for n in names:
            add(n, f"registry code changed ({', '.join(code)})")
    for status, path in t.files:
        p = Path(path)
        if path == TEMPLATE.relative_to(REPO_ROOT).as_posix():
            t.template_changed = True
        elif p.parent.as_posix() == rel_model and p.suffix == ".yaml":
            if status == "D" or p.stem not in names:
                t.removed.append(p.stem)
            else:
                add(p.stem, "changed")
            direct.append(p.stem)
        elif p.parent.as_posix() == rel_base and p.suffix == ".yaml":
            t.baselines[p.name] = baseline_changes(path, commit, repo)
            t.validate_all = True
        elif path.startswith(rel_ckpt + "/") and len(p.parts) > 3:
            folder = p.parts[2]
            for n in names:
                if data[n].get("embedded") and data[n].get("checkpoint") == folder:
                    add(n, f"checkpoint registry/checkpoints/{folder} changed")
    for n in variants_of(direct, candidates=names):
        bases = [d for d in direct if d in _chain(n)]
        add(n, f"variant of {', '.join(bases)}")
    keys = {k for changes in t.baselines.values() for k in changes}
    for n in names:
        if data[n].get("baseline") in keys:
            add(n, f"baseline rows of '{data[n]['baseline']}' changed")
    used = {data[n].get("baseline") for n in names}
    t.unused_keys = sorted(k for k in keys if k not in used)
    t.entries = dict(sorted(t.entries.items()))
    return t


def _chain(name: str) -> list[str]:
    from registry.selection import entry_bases

    try:
        return entry_bases(name, missing_ok=True)
    except (KeyError, ValueError):
        return []


@dataclass
class SmokeResult:
    entry: str
    ok: bool
    lines: list[str]


def smoke(entry: str, out_dir: Path, *, limit: int = SMOKE_LIMIT,
          python: str = sys.executable) -> SmokeResult:
    """Evaluate an embedded entry on `limit` GSM8K questions on the CPU (compare=replay when it drafts)."""
    spec = (_safe_data(entry).get("speculative") or {})
    drafts = spec.get("algorithm") == "mtp" and int(spec.get("draft_len") or 0) > 0
    run_dir = out_dir / entry
    cmd = [python, str(REPO_ROOT / "run.py"), f"model={entry}", f"eval.limit={limit}", "runtime=cpu",
           f"hydra.run.dir={run_dir}", "history.db=null"] + (["compare=replay"] if drafts else [])
    shown = " ".join(cmd[1:]).replace(str(REPO_ROOT) + "/", "")
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    lines = [f"$ python {shown}  (exit {proc.returncode})"]
    results_path = run_dir / "results.json"  # evals.results.RESULTS_FILE (registry imports nothing of evals)
    if proc.returncode not in (0, 1) or not results_path.is_file():
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-6:]
        return SmokeResult(entry, False, lines + ["  the run did not complete:"] + [f"  | {x}" for x in tail])
    results = json.loads(results_path.read_text())
    ok = True
    for c in (results.get("verdict") or {}).get("checks") or []:
        if c.get("status") != "fail":
            continue
        if str(c.get("name", "")).startswith("comparison."):
            ok = False
            lines.append(f"  FAIL {c['name']}: {c.get('note')}")
        else:
            lines.append(f"  note: {c['name']} failed at n={limit} (not judged in a smoke run): "
                         f"{c.get('note')}")
    g = results.get("gsm8k") or {}
    acc = results.get("acceptance") or {}
    rate = acc.get("rate")
    lines.append(f"  GSM8K strict {g.get('strict_match')} flexible {g.get('flexible_extract')} "
                 f"(n={g.get('n')})"
                 + (f"; acceptance rate {rate:.3f}" if isinstance(rate, float) else "")
                 + ("; replay == rewind" if drafts and ok else ""))
    return SmokeResult(entry, ok, lines)


def run_pr_check(base: str, *, run_smoke: bool = True, limit: int = SMOKE_LIMIT, repo: Path = REPO_ROOT,
                 echo: Callable[[str], None] = print, if_base_exists: bool = False) -> int:
    """The whole check (module docstring); returns the exit status. if_base_exists: a missing base ref checks
    nothing (exit 0) instead of being an error (exit 2, error / fix lines on stderr)."""
    commit = merge_base(base, repo)
    if commit is None:
        if if_base_exists:
            echo(f"pr-check: no base ref {base!r} in this clone (or no git): nothing checked")
            return 0
        print(f"error: the base ref {base!r} names no commit in this clone (or this is no git clone)\n"
              "  fix: fetch it (e.g. git fetch origin main) or name the branch the pull request goes into "
              "with --base <ref>", file=sys.stderr)
        return 2
    t = find_touched(commit, repo)
    echo(f"pr-check against {base} (merge base {commit[:12]})")
    if not t.files:
        echo("no file under registry/ changed: nothing to check")
        return 0
    echo("changed: " + ", ".join(f"{s} {p}" for s, p in t.files))
    for fname, changes in t.baselines.items():
        for key, what in changes.items():
            echo(f"baseline {fname} '{key}': {what}")
    for key in t.unused_keys:
        echo(f"note: baseline key '{key}' is not the `baseline` of any entry")
    for name in t.removed:
        echo(f"removed entry: {name}")
    failed = []
    if t.template_changed:
        try:
            raw = load_yaml(TEMPLATE.read_text(), str(TEMPLATE.relative_to(repo)))
            validate_entry({k: v for k, v in raw.items() if k != "defaults"}, name=raw.get("name"))
            echo(f"template {TEMPLATE.relative_to(repo)}: valid")
        except Exception as e:  # noqa: BLE001 - any failure of the template is reported the same way
            failed.append("template")
            echo(f"FAIL template {TEMPLATE.relative_to(repo)}: {getattr(e, 'problem', e)}")
    if not t.entries and not t.validate_all:
        echo("no registry entry touched")
        return 1 if failed else 0
    for name, why in t.entries.items():
        echo(f"entry {name}: {why}")
    to_validate = [] if t.validate_all else sorted(t.entries)
    what = "every entry" if t.validate_all else ", ".join(to_validate)
    echo(f"== python -m registry validate ({what})")
    proc = subprocess.run([sys.executable, "-m", "registry", "validate", *to_validate], cwd=repo,
                          capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).rstrip().splitlines():
        echo(f"  {line}")
    if proc.returncode != 0:
        failed.append("validate")
    embedded = [n for n in t.entries if _safe_data(n).get("embedded")]
    if run_smoke and embedded and proc.returncode == 0:
        with tempfile.TemporaryDirectory(prefix="pr-check-") as tmp:
            for name in embedded:
                echo(f"== smoke evaluation of {name} (embedded), {limit} GSM8K questions on the CPU")
                res = smoke(name, Path(tmp), limit=limit)
                for line in res.lines:
                    echo(f"  {line}")
                if not res.ok:
                    failed.append(f"smoke {name}")
    elif embedded and not run_smoke:
        echo(f"smoke evaluation skipped (--no-smoke): {', '.join(embedded)}")
    if failed:
        echo(f"pr-check: FAILED ({', '.join(failed)})")
        return 1
    echo(f"pr-check: ok ({len(t.entries)} entries checked)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry pr-check", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    """run_pr_check with the options of `add_arguments` (also `python -m registry pr-check`'s entry)."""
    return run_pr_check(args.base, run_smoke=not args.no_smoke, limit=args.limit,
                        if_base_exists=args.if_base_exists)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The pr-check options (shared by `python -m registry pr-check`)."""
    parser.add_argument("--base", default="origin/main",
                        help="the branch / commit the pull request goes into (default origin/main)")
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke evaluations")
    parser.add_argument("--if-base-exists", action="store_true",
                        help="a base ref missing from this clone checks nothing (exit 0), not exit 2 (CI)")
    parser.add_argument("--limit", type=int, default=SMOKE_LIMIT,
                        help=f"GSM8K questions per smoke evaluation (default {SMOKE_LIMIT})")


if __name__ == "__main__":
    sys.exit(main())
