"""User-facing errors: a bad config, a missing checkpoint, an unsupported combination.

Raise UserError(problem, fix) for anything the user can correct; run.py prints it as
`error: <problem>` / `  fix: <fix>` on stderr and exits with status 2, without a traceback. Bugs stay ordinary
exceptions (with their traceback).
"""

from __future__ import annotations


class UserError(Exception):
    """An input problem the user can fix.

    problem: what is wrong, naming the file / key / value concerned.
    fix: what to do about it (the setting to change, the command to run).
    """

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem} (fix: {fix})")
        self.problem = problem
        self.fix = fix

    def format(self) -> str:
        """The two-line message run.py prints: `error: <problem>\\n  fix: <fix>`."""
        return f"error: {self.problem}\n  fix: {self.fix}"
