"""Run one GSM8K evaluation of a registry entry: `python run.py model=<entry> [ssm_replay=true] [...]`.

A thin Hydra wrapper around runners.app.run(cfg). Before Hydra composes, the registry entries the command
line selects pass the untrusted-input guard (registry.compose.check_overrides). Hydra runs with
HYDRA_FULL_ERROR=1, its documented switch that lets composition errors propagate, so an unknown entry, option
or key and a value of the wrong type (checked by Hydra against the structured schema registry.schema.
RunConfig) become, like every runners / registry UserError, `error: <problem>` / `  fix: <fix>` on stderr
with exit status 2 and no traceback.

Exit status: 0 the verdict passed, or had no reference yet (placeholder baseline rows) / was not required
(verdict.require_reference=false); 1 a verdict check failed (GSM8K below its threshold, an acceptance floor
missed, or with compare=replay a flipped sample / diverged tokens); 2 a user error.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from registry.compose import CONFIG_DIR, CONFIG_NAME, check_overrides, config_error
from registry.errors import UserError

# Exit status of each job: one for a plain run, one per job of a sweep (`python run.py -m model=a,b
# ssm_replay=false,true`); a sweep runs every job even when one fails, and exits with the worst status.
_EXIT_CODES: list[int] = []


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    from runners import app  # the engine and lm-eval: only when a job runs (not for --cfg job or --help)

    try:
        results = app.run(cfg)
    except UserError as e:
        print(e.format(), file=sys.stderr)
        _EXIT_CODES.append(2)
        return
    _EXIT_CODES.append(app.exit_code(results))


def cli(argv: list[str]) -> int:
    """Guard the overrides, run Hydra, and turn user mistakes into exit status 2 (see the module doc)."""
    # Hydra's own flags (--cfg job, -m, --help, ...) carry no `=` in a separate word or start with `-`.
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        check_overrides(overrides)
        main()
    except UserError as e:
        print(e.format(), file=sys.stderr)
        return 2
    except Exception as e:
        err = config_error(e, overrides)
        if err is None:
            raise
        print(err.format(), file=sys.stderr)
        return 2
    return max(_EXIT_CODES, default=0)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
