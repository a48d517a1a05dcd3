"""The documents of the `gsm8k_local` lm-eval task (gsm8k_local.yaml beside this file): GSM8K from JSONL.

lm-eval loads this file by its path (a `!function` tag of the task YAML) and calls `load_gsm8k` with the
task's metadata instead of downloading the hub dataset.
"""

from __future__ import annotations

from typing import Any

import datasets

from evals.data import SPLITS, GSM8KDataError, gsm8k_files


def load_gsm8k(**metadata: Any) -> datasets.DatasetDict:
    """`{"train", "test"}` datasets of `<folder>/{train,test}.jsonl` (rows {"question", "answer"}), read by
    the datasets library's json builder, as lm-eval's stock gsm8k task reads the hub dataset's splits.

    The folder: metadata["gsm8k_dir"] when lm-eval was given one, else evals.data's lookup ($GSM8K_DIR,
    ../shared/data/gsm8k). Raises evals.data.GSM8KDataError when no folder holds both splits.
    """
    path = gsm8k_files(metadata.get("gsm8k_dir"), setting="lm-eval metadata gsm8k_dir")
    if path is None:
        raise GSM8KDataError(
            "the gsm8k_local task found no GSM8K folder (no metadata gsm8k_dir, $GSM8K_DIR unset, no "
            "../shared/data/gsm8k beside the checkout)",
            "pass --metadata '{\"gsm8k_dir\": \"/path/to/gsm8k\"}' or set GSM8K_DIR to a folder with "
            "train.jsonl and test.jsonl (or use the task gsm8k, which reads the hub dataset)",
        )
    return datasets.load_dataset("json", data_files={s: str(path / f"{s}.jsonl") for s in SPLITS})
