"""lm-eval's own command line, with this project's model and tasks:
`python -m runners.app.lm_eval_cli <arguments>`.

It registers our engine as the lm-eval model `hybrid-engine` (runners.app.lm_adapter.EngineLM; `--model_args
pretrained=<checkpoint dir>,draft_len=K,...`, the options of EngineLM.from_checkpoint) and adds evals/tasks/
to `--include_path` (tasks `gsm8k_local` / `gsm8k_cot_local`: lm-eval's stock gsm8k / gsm8k_cot on the local
GSM8K JSONL files, the local groups of evals/task.py's rows), then hands the arguments to lm-eval's CLI
(lm_eval.__main__.cli_evaluate), so every lm-eval option and generation task works. Run from the checkout
(nothing is installed). The shipped tiny checkpoint on 10 GSM8K questions, on the CPU:

    python -m runners.app.lm_eval_cli --model hybrid-engine \\
        --model_args pretrained=registry/checkpoints/tiny_nemotron_h_mtp,draft_len=3,num_threads=1 \\
        --tasks gsm8k_local --device cpu --batch_size 16 --limit 10

`--use_cache <path>` keeps every finished response in lm-eval's SQLite cache (the adapter feeds its cache
hook as each request finishes), so a killed run repeated with the same command generates only the rest.
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

import runners.app.lm_adapter  # noqa: F401  (registers the model "hybrid-engine" with lm-eval)
from evals.evaluate import TASKS_DIR
from registry.errors import UserError


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI on `argv` (default: the command line) with evals/tasks/ on its include path."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not {"-h", "--help", "--include_path"} & set(args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except UserError as e:  # a bad --model_args or checkpoint: error / fix lines, status 2, no traceback
        print(e.format(), file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
