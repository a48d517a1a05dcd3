"""Run one GSM8K evaluation of a registry entry: `python run.py model=<entry> [ssm_replay=true] [...]`.

A thin Hydra wrapper around runners.app.run(cfg). Problems the user can fix (runners.errors.UserError, and the
unknown entries / keys that Hydra would otherwise report in its own words) are printed as
`error: <problem>` / `  fix: <fix>` on stderr with exit status 2 and no traceback.

Exit status: 0 the verdict passed, or had no reference yet (placeholder baseline rows) / was not required
(verdict.require_reference=false); 1 a verdict check failed (GSM8K below its threshold, an acceptance floor
missed, or with compare=replay a flipped sample / diverged tokens); 2 a user error.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from runners.errors import UserError

# Exit status of each job: one for a plain run, one per job of a sweep (`python run.py -m model=a,b
# ssm_replay=false,true`); a sweep runs every job even when one fails, and exits with the worst status.
_EXIT_CODES: list[int] = []


def _fail(e: UserError) -> None:
    print(e.format(), file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from runners import app

    try:
        results = app.run(cfg)
    except UserError as e:
        print(e.format(), file=sys.stderr)
        _EXIT_CODES.append(2)
        return
    _EXIT_CODES.append(app.exit_code(results))


def _preflight(argv: list[str]) -> None:
    """Check the command line's overrides before Hydra sees them (see runners.app.preflight)."""
    from hydra._internal.utils import get_args_parser

    from runners import app

    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return
    try:
        app.preflight(list(args.overrides))
    except UserError as e:
        _fail(e)


if __name__ == "__main__":
    _preflight(sys.argv[1:])
    main()
    sys.exit(max(_EXIT_CODES, default=0))
