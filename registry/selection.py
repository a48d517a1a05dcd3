"""Selecting registry entries by their data: the bases a variant reuses, the variants of an entry, the entries
marked for the nightly sweep.

An entry file may reuse other entries through its `defaults:` list (registry.schema.check_entry_file allows
only entry names and `_self_` there). `entry_data` merges a file over its bases the way Hydra's defaults list
does (each base in list order, the file's own keys at `_self_`, which Hydra 1.1+ puts last when the list
omits it), reading YAML only: it works where Hydra is already running (inside a sweeper's resolver) and on
files of another git revision (registry.pr_check). tests/test_nightly.py checks that it agrees with Hydra's
composition for every entry.

`python run.py +experiment=nightly` sweeps `${registry_entries:nightly}`: the OmegaConf resolver registered
by `register_resolvers()` (run.py calls it before Hydra starts) that expands to the comma-separated names of
the entries whose composed `nightly` key is true.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from registry.errors import UserError
from registry.schema import MODEL_DIR, check_entry_file, entry_names
from registry.yamlfile import load as load_yaml

ReadEntry = Callable[[str], str | None]  # entry name -> the YAML text of its file (None: no such entry)


def _read_from(model_dir: Path) -> ReadEntry:
    def read(name: str) -> str | None:
        path = model_dir / f"{name}.yaml"
        return path.read_text() if path.is_file() else None

    return read


def _raw(name: str, read: ReadEntry) -> dict[str, Any]:
    text = read(name)
    if text is None:
        raise KeyError(f"no registry entry {name!r}")
    data = load_yaml(text, f"registry/model/{name}.yaml")  # RegistryYAMLError: a ValueError
    return data if isinstance(data, dict) else {}


def _defaults(raw: dict[str, Any]) -> list[str]:
    defaults = raw.get("defaults") or []
    return [d for d in defaults if isinstance(d, str)]


def entry_bases(name: str, *, read: ReadEntry | None = None, missing_ok: bool = False) -> list[str]:
    """Every entry `name` reuses through its defaults list, transitively, nearest first.

    read: how to read an entry file (default: registry/model/). missing_ok: a base whose file is missing is
    listed but not followed (a pull request that deletes a base), instead of raising. Raises KeyError for a
    missing entry and ValueError for a defaults cycle or a file that is not valid registry YAML
    (registry.yamlfile.RegistryYAMLError; registry.schema.check_entry_file reports all to users).
    """
    read = read or _read_from(MODEL_DIR)
    out: list[str] = []

    def walk(n: str, seen: tuple[str, ...]) -> None:
        for base in _defaults(_raw(n, read)):
            if base == "_self_":
                continue
            if base in seen:
                raise ValueError(f"defaults cycle: {' -> '.join((*seen, base))}")
            if base not in out:
                out.append(base)
            if missing_ok and read(base) is None:
                continue
            walk(base, (*seen, base))

    walk(name, (name,))
    return out


def entry_data(name: str, *, read: ReadEntry | None = None) -> dict[str, Any]:
    """The entry's keys merged over its bases' as Hydra's defaults list merges them (plain dict, unvalidated).

    Raises KeyError for a missing entry, ValueError for a defaults cycle or unreadable YAML.
    """
    read = read or _read_from(MODEL_DIR)

    def merged(n: str, seen: tuple[str, ...]) -> Any:
        raw = _raw(n, read)
        own = {k: v for k, v in raw.items() if k != "defaults"}
        order = _defaults(raw)
        if "_self_" not in order:
            order.append("_self_")
        cfg = OmegaConf.create()
        for item in order:
            if item == "_self_":
                cfg = OmegaConf.merge(cfg, own)
            elif item in seen:
                raise ValueError(f"defaults cycle: {' -> '.join((*seen, item))}")
            else:
                cfg = OmegaConf.merge(cfg, merged(item, (*seen, item)))
        return cfg

    return OmegaConf.to_container(merged(name, (name,)), resolve=False)


def variants_of(names: Iterable[str], *, candidates: Iterable[str] | None = None,
                read: ReadEntry | None = None) -> list[str]:
    """The entries (of `candidates`, default all) that reuse any of `names` through their defaults, sorted.

    A base that no longer exists still counts (its variants are what a deletion breaks); an entry in a
    defaults cycle counts as a variant of nothing here, the registry's validation reports it.
    """
    targets = set(names)
    out = []
    for cand in candidates if candidates is not None else entry_names():
        try:
            if targets & set(entry_bases(cand, read=read, missing_ok=True)):
                out.append(cand)
        except (KeyError, ValueError):
            continue
    return sorted(out)


def nightly_entries() -> list[str]:
    """Names of the entries whose (merged) `nightly` key is true, sorted.

    Each file is checked first (registry.schema.check_entry_file: no `# @package`, no foreign defaults, only
    schema keys), so a malformed entry is a UserError here too, not a silent omission.
    """
    out = []
    for name in entry_names():
        check_entry_file(name)
        if entry_data(name).get("nightly") is True:
            out.append(name)
    return out


def _entries_resolver(selector: str) -> str:
    """`${registry_entries:nightly}`: the nightly entries, comma-separated (a Hydra sweep's choice list).
    Raises UserError for another selector, a malformed entry, or no entry marked."""
    if selector != "nightly":
        raise UserError(f"${{registry_entries:{selector}}}: unknown selector {selector!r}",
                        "the only selector is 'nightly': ${registry_entries:nightly}")
    names = nightly_entries()
    if not names:
        raise UserError("no registry entry sets `nightly: true`, so the nightly sweep has nothing to run",
                        "mark one (nightly: true in registry/model/<name>.yaml, docs/nightly.md), or sweep "
                        "model=<a>,<b> explicitly")
    return ",".join(names)


def register_resolvers() -> None:
    """Register `${registry_entries:nightly}` with OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver("registry_entries"):
        OmegaConf.register_new_resolver("registry_entries", _entries_resolver)
