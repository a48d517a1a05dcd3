"""The one YAML reader of registry files (entries, baselines, the template): safe, and without aliases.

Registry files are untrusted pull-request input. ``yaml.safe_load`` already refuses tags that build Python
objects (``!!python/object``...), but it expands aliases: a few hundred bytes of nested anchors and aliases
(the "billion laughs" shape, https://en.wikipedia.org/wiki/Billion_laughs_attack) become a structure that
every later walk (OmegaConf, the schema checks) expands into gigabytes. Registry files need no aliases (a
variant reuses its base through `defaults:`), so :func:`load` refuses every alias at the first one it
meets, before anything is built.
"""

from __future__ import annotations

from typing import Any

import yaml

from registry.errors import UserError

__all__ = ["RegistryYAMLError", "load"]


class RegistryYAMLError(UserError):
    """A registry file that is not valid YAML, uses an alias, or carries a tag safe YAML refuses."""


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that raises at the first alias (``*name``) instead of composing it."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"found the alias *{event.anchor}: registry files may not use YAML aliases",
                event.start_mark)
        return super().compose_node(parent, index)


def load(text: str, where: str) -> Any:
    """The data of the YAML ``text`` of the registry file ``where`` (its name, for messages).

    Raises RegistryYAMLError (a UserError, so also a ValueError) naming ``where`` and the line: invalid
    YAML, an alias (refused before it is expanded), a tag that safe YAML refuses (e.g. ``!!python/...``).
    """
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "alias" in problem:
            fix = "write the values out; an entry reuses another through `defaults: [<base entry>, _self_]`"
        elif "tag" in problem:
            fix = "remove the tag: registry files hold plain data (strings, numbers, lists, mappings)"
        else:
            fix = "fix the YAML syntax"
        raise RegistryYAMLError(f"{where}: not valid YAML for the registry{at}: {problem}", fix) from None
