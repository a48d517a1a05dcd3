"""The one error type for problems the user can fix: a bad config, a missing checkpoint or baseline row.

Raise `UserError(problem, fix)` (or a subclass naming the area, e.g. `registry.baselines.BaselineError`) for
anything the user can correct; run.py prints it as `error: <problem>` / `  fix: <fix>` on stderr and exits
with status 2, without a traceback. Bugs stay ordinary exceptions, with their traceback. The registry is the
bottom layer of the project, so every folder can import this module.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


class UserError(ValueError):
    """An input problem the user can fix.

    problem: what is wrong, naming the file / key / value concerned.
    fix: what to do about it (the setting to change, the command to run).
    """

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}\n  fix: {fix}")
        self.problem = problem
        self.fix = fix

    def format(self) -> str:
        """The two lines run.py prints: `error: <problem>\\n  fix: <fix>`."""
        return f"error: {self.problem}\n  fix: {self.fix}"


class UserErrors(UserError):
    """Several problems of one input at once (e.g. every problem of a registry file, so a contributor fixes
    them in one round): ``errors`` lists them; problem and fix are the first's, the problem noting how many
    more there are."""

    def __init__(self, errors: list[UserError]):
        if not errors:
            raise ValueError("UserErrors needs at least one error")
        more = len(errors) - 1
        note = f" (and {more} more problem{'s' if more > 1 else ''}: python -m registry validate lists all)"
        super().__init__(errors[0].problem + (note if more else ""), errors[0].fix)
        self.errors = list(errors)


def raise_all(errors: list[UserError]) -> None:
    """Raise nothing for no errors, the error itself for one, :class:`UserErrors` for several."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise UserErrors(errors)


def exits_on_user_error(main: Callable[..., int]) -> Callable[..., int]:
    """Decorate a command line's ``main(argv) -> exit status``: a :class:`UserError` it raises is printed as
    run.py prints it (``error:`` / ``fix:`` lines on stderr) and the status is 2, without a traceback."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(e.format(), file=sys.stderr)
            return 2

    return wrapped
