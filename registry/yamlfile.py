"""The one YAML reader of registry files (entries, baselines, the template): safe, and without aliases.

Registry files are untrusted pull-request input. ``yaml.safe_load`` already refuses tags that build Python
objects (``!!python/object``...), but it expands aliases: a few hundred bytes of nested anchors and aliases
(the "billion laughs" shape, https://en.wikipedia.org/wiki/Billion_laughs_attack) become a structure that
every later walk (OmegaConf, the schema checks) expands into gigabytes. Registry files need no aliases (a
variant reuses its base through `defaults:`), so :func:`load` refuses every alias at the first one it
meets, before anything is built. A key given twice in one mapping is refused too: PyYAML's safe loader keeps
the last silently, while Hydra's loader (OmegaConf's) refuses the same file later with a traceback.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from registry.errors import UserError

__all__ = ["RegistryYAMLError", "load", "yaml_error"]


class RegistryYAMLError(UserError):
    """A registry file that is not valid YAML, uses an alias, repeats a key, or carries a tag safe YAML
    refuses."""


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that raises at the first alias (``*name``) instead of composing it, and at a key given
    twice in one mapping instead of keeping the last."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"found the alias *{event.anchor}: registry files may not use YAML aliases",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # a merge key (`<<`) may override, by design; other keys are checked by value
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the duplicate key {key_node.value!r} (first at line {seen[key].line + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load(text: str, where: str) -> Any:
    """The data of the YAML ``text`` of the registry file ``where`` (its name, for messages).

    Raises RegistryYAMLError (a UserError, so also a ValueError) naming ``where`` and the line: invalid
    YAML, an alias (refused before it is expanded), a key given twice in one mapping, a tag that safe YAML
    refuses (e.g. ``!!python/...``).
    """
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise yaml_error(e, where) from None


def yaml_error(e: yaml.YAMLError, where: str, of: str = "the registry") -> RegistryYAMLError:
    """The UserError for the YAML error ``e`` of the file ``where`` (its name, for messages): the problem with
    its line and column, and the fix. ``of``: what the file is read for (``the registry``, ``Hydra's run
    config`` for configs/). Used by :func:`load` and for the errors Hydra's own loader raises
    (registry.compose.config_error), so both read the same."""
    mark = getattr(e, "problem_mark", None)
    at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    duplicate = re.match(r"found (?:the )?duplicate key '?([^'(]*?)'?(?: \(|$)", problem)
    if duplicate:
        fix = f"remove one of the two `{duplicate.group(1)}:` (a YAML mapping holds each key once)"
    elif "alias" in problem:
        fix = "write the values out; an entry reuses another through `defaults: [<base entry>, _self_]`"
    elif "tag" in problem:
        fix = "remove the tag: registry files hold plain data (strings, numbers, lists, mappings)"
    else:
        fix = "fix the YAML syntax"
    return RegistryYAMLError(f"{where}: not valid YAML for {of}{at}: {problem}", fix)
