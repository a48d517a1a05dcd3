"""Composing the run config with Hydra, with every user mistake reported as a UserError.

configs/config.yaml extends the structured schema `run_schema` (registry.schema.RunConfig), so Hydra and
OmegaConf type-check every value and reject unknown keys and options while they compose. This module adds
what Hydra does not do, in the words of the fix:

- `check_overrides`, before composition: the registry entries that `model=` overrides (or the default)
  select pass the untrusted-input guard of registry.schema.check_entry_file before Hydra loads them;
- `config_error`, after a failed composition: Hydra's MissingConfigException (an unknown option of a config
  group) and ConfigCompositionException (an override OmegaConf refused; its cause carries `full_key` and the
  schema class `object_type`) become a UserError naming the override, with the closest valid names; a YAML
  error of a file under configs/ (a syntax error, a key given twice) one naming the file and line.

run.py runs `@hydra.main` with HYDRA_FULL_ERROR=1 (Hydra's documented switch that lets composition errors
propagate) and hands them to `config_error`; `compose_config` does the same with Hydra's compose API, for
`python -m registry validate` and the tests.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from enum import Enum
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
)

from registry.errors import UserError
from registry.schema import (
    MODEL_DIR,
    REPO_ROOT,
    check_entry_file,
    entry_names,
    schema_fields,
    unknown_entry_error,
)
from registry.selection import register_resolvers
from registry.yamlfile import yaml_error

CONFIG_DIR = REPO_ROOT / "configs"
CONFIG_NAME = "config"


def default_entry() -> str:
    """The registry entry configs/config.yaml selects when no `model=` override is given."""
    path = CONFIG_DIR / f"{CONFIG_NAME}.yaml"
    try:
        defaults = yaml.safe_load(path.read_text())["defaults"]
    except yaml.YAMLError as e:  # refused as Hydra refuses it, before Hydra reads it
        raise yaml_error(e, str(path.relative_to(REPO_ROOT)), "Hydra's run config") from None
    return next(d["model"] for d in defaults if isinstance(d, dict) and "model" in d)


def check_overrides(overrides: list[str]) -> None:
    """Before Hydra composes: parse the command line's overrides and guard the entries they select.

    Every `model=` choice (each option of a sweep `model=a,b` / `glob(...)`, or the default entry) must be a
    registry entry whose raw file passes registry.schema.check_entry_file. Raises UserError.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise UserError(f"cannot parse the overrides: {str(e).strip().splitlines()[0]}",
                        "write each override as key=value (python run.py --help)") from None
    folder_keys = ("out_dir", "hydra.run.dir")
    folders = {o.key_or_group: str(o.value()) for o in parsed
               if o.key_or_group in folder_keys and not o.is_delete() and not o.is_sweep_override()}
    if len(folders) == 2 and Path(folders["out_dir"]).resolve() != Path(folders["hydra.run.dir"]).resolve():
        raise UserError(
            f"out_dir={folders['out_dir']} and hydra.run.dir={folders['hydra.run.dir']} name two folders: "
            "the results would go to out_dir and Hydra's own files (.hydra/, the log) to hydra.run.dir",
            f"give one of them (out_dir={folders['out_dir']} puts everything there)")
    models: list[str] = []
    for o in parsed:
        if o.key_or_group != "model" or o.is_delete():
            continue
        value = o.value()
        if isinstance(value, Glob):
            models += value.filter(entry_names())
        elif o.is_sweep_override():
            models += [str(v) for v in o.sweep_string_iterator()]
        else:
            models.append(str(value))
    for name in models or [default_entry()]:
        if name not in entry_names():
            raise unknown_entry_error(name)
        check_entry_file(name)


def config_error(e: BaseException, overrides: list[str]) -> UserError | None:
    """The UserError for an exception Hydra raised while composing with `overrides`; None when `e` is not a
    composition problem (a bug, to be reported with its traceback)."""
    # a UserError raised by a resolver while Hydra composes (${registry_entries:nightly}: a malformed entry,
    # no entry marked) reaches here wrapped in OmegaConf's InterpolationResolutionError
    if isinstance(e, InterpolationResolutionError):
        inner: BaseException | None = e
        while inner is not None and not isinstance(inner, UserError):
            inner = inner.__cause__ or inner.__context__
        if inner is not None:
            return inner
    # a config file Hydra's (OmegaConf's) YAML loader refused: configs/ is read by Hydra only (registry
    # entries pass registry.yamlfile first, in check_overrides)
    bad_yaml: BaseException | None = e
    while bad_yaml is not None and not isinstance(bad_yaml, yaml.YAMLError):
        bad_yaml = bad_yaml.__cause__ or bad_yaml.__context__
    if isinstance(bad_yaml, yaml.YAMLError):
        mark = getattr(bad_yaml, "problem_mark", None) or getattr(bad_yaml, "context_mark", None)
        name = Path(mark.name) if mark is not None else Path("a config file")
        where = str(name.relative_to(REPO_ROOT)) if name.is_relative_to(REPO_ROOT) else str(name)
        of = "the registry" if name.parent == MODEL_DIR else "Hydra's run config"
        return yaml_error(bad_yaml, where, of)
    if isinstance(e, MissingConfigException) and "/" in (e.missing_cfg_file or ""):
        group, _, value = e.missing_cfg_file.rpartition("/")
        if group == "model":
            return unknown_entry_error(value)
        options = list(e.options or [])
        close = difflib.get_close_matches(value, options, n=1)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return UserError(f"unknown {group} option {group}={value}",
                         f"{hint}choose one of: {', '.join(options)}")
    cause = e.__cause__
    if isinstance(e, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        return override_error(cause, overrides)
    ambiguous = _AMBIGUOUS.search(str(e))
    if isinstance(e, HydraException) and ambiguous:
        text = ambiguous.group(1)
        key, _, value = text.partition("=")
        return UserError(
            f"the override '{text}' holds a comma; without -m Hydra cannot tell whether it is one string, a "
            "list or a sweep over several values",
            f"quote the value to keep the comma: \"{key}='{value}'\" (the outer quotes are for the shell), "
            "or add -m to run one job per value",
        )
    if isinstance(e, HydraException):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return UserError(f"the config does not compose: {first}",
                         "check the overrides (python run.py --help)")
    return None


def override_error(e: OmegaConfBaseException, overrides: list[str]) -> UserError:
    """UserError for OmegaConf's complaint about a key of the run config (full_key from the root), naming the
    override that set it (from `overrides`) and the closest keys of the schema class that refused it."""
    key = e.full_key or "?"
    parent, _, leaf = key.rpartition(".")
    of_key = [o for o in overrides if o.lstrip("+~").split("=")[0] == key]
    # a key set twice: the override whose value the complaint quotes, else the last (the one that applies)
    quoted = [o for o in of_key if f"'{o.partition('=')[2]}'" in str(e)]
    text = (quoted or of_key or [key])[-1]
    if isinstance(e, ConfigKeyError | ConfigAttributeError):
        allowed = schema_fields(e.object_type)
        close = difflib.get_close_matches(leaf, allowed, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
        return UserError(
            f"unknown config key '{key}' in the override '{text}'",
            f"{hint}known keys{' of ' + parent if parent else ''}: {', '.join(allowed)}",
        )
    msg = str(e).splitlines()[0]
    cls = e.object_type
    hint = typing.get_type_hints(cls).get(leaf) if dataclasses.is_dataclass(cls) else None
    enums = [a for a in (typing.get_args(hint) or (hint,)) if isinstance(a, type) and issubclass(a, Enum)]
    if enums:
        expected = "one of " + ", ".join(m.value for m in enums[0])
    else:
        declared = {f.name: f.type for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        expected = f"a value of type {declared.get(leaf, 'the schema declares')}"
    # an entry key is named as in registry files (ssm.backend); the override shows its place in the config
    what = f"'{key.removeprefix('model.')}' of the registry entry" if key.startswith("model.") else f"'{key}'"
    where = f"registry/schema.py, {cls.__name__}" if hint is not None else "registry/schema.py"
    return UserError(f"bad value for {what} in the override '{text}': {msg}",
                     f"set {key} to {expected} ({where})")


# Hydra's message for `key=a,b` in a plain run (its sweep syntax outside -m)
_AMBIGUOUS = re.compile(r"Ambiguous value for argument '([^']*)'")
MISSING_MARK = "???"  # OmegaConf's mark of a mandatory value (a placeholder, never a value)


def check_composed(cfg: DictConfig, overrides: list[str]) -> None:
    """After composition, before any value is read: every interpolation resolves and no value is `???`.

    OmegaConf resolves `${...}` lazily and a merge keeps the old value under a `???`, so without this an
    `${oc.env:UNSET}` fails deep inside the run and `eval.num_fewshot=???` silently runs on the default.
    Raises UserError naming the key and the override that set it.
    """
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except InterpolationResolutionError as e:
        key = e.full_key or "?"
        text = next((o for o in overrides if o.lstrip("+~").split("=")[0] == key), None)
        where = f" (the override '{text}')" if text else ""
        cause = e.__cause__ if e.__cause__ is not None else e
        why = str(cause.args[0] if isinstance(cause, KeyError) and cause.args else cause).splitlines()[0]
        env = re.search(r"oc\.env:([A-Za-z_][A-Za-z0-9_]*)", text or "")
        fix = (f"set the environment variable {env.group(1)}, give the interpolation a default "
               f"(${{oc.env:{env.group(1)},<default>}}), or write the value itself" if env else
               "write the value itself, or an interpolation that resolves (python run.py --cfg job shows "
               "the composed config)")
        raise UserError(f"the value of '{key}'{where} cannot be resolved: {why}", fix) from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        given = [o for o in overrides if o.partition("=")[2].strip() == MISSING_MARK]
        where = f" (the override{'s' if len(given) > 1 else ''} {' '.join(given)})" if given else ""
        raise UserError(
            f"no value for {', '.join(missing)}{where}: '???' marks a mandatory value, it is not a value",
            f"give {'each' if len(missing) > 1 else 'it'} a value (e.g. {missing[0]}=<value>), or drop the "
            "override to keep the default",
        )


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The config `python run.py <overrides>` composes (Hydra's compose API on configs/, from any cwd), after
    check_overrides. Raises UserError for every problem run.py reports as one."""
    overrides = list(overrides or [])
    check_overrides(overrides)
    register_resolvers()  # ${registry_entries:nightly} of +experiment=nightly, as run.py
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        try:
            return compose(CONFIG_NAME, overrides=overrides)
        except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
            err = config_error(e, overrides)
            if err is None:
                raise
            raise err from None

