"""Run one GSM8K evaluation of a registry entry: `python run.py model=<entry> [ssm_replay=true] [...]`.

A thin Hydra wrapper around runners.app.run(cfg). Problems the user can fix (runners.errors.UserError, and the
unknown entries / keys that Hydra would otherwise report in its own words) are printed as
`error: <problem>` / `  fix: <fix>` on stderr with exit status 2 and no traceback.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from runners.errors import UserError


def _fail(e: UserError) -> None:
    print(e.format(), file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from runners import app

    try:
        app.run(cfg)
    except UserError as e:
        _fail(e)


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
