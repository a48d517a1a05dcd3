"""The documents of the `gsm8k_local` lm-eval task (gsm8k_local.yaml beside this file): GSM8K from JSONL.

lm-eval loads this file by its path (a `!function` tag of the task YAML) and calls `load_gsm8k` with the
task's metadata instead of downloading the hub dataset.
"""

from __future__ import annotations

from typing import Any

import datasets

from evals.data import SPLITS, gsm8k_dir


def load_gsm8k(**metadata: Any) -> datasets.DatasetDict:
    """`{"train", "test"}` datasets of `<folder>/{train,test}.jsonl` (rows {"question", "answer"}), read by
    the datasets library's json builder, as lm-eval's stock gsm8k task reads the hub dataset's splits.

    The folder: metadata["gsm8k_dir"] when lm-eval was given one, else evals.data.gsm8k_dir's lookup
    ($GSM8K_DIR, ../shared/data/gsm8k). Raises FileNotFoundError when no folder holds the splits.
    """
    path, origin = gsm8k_dir(metadata.get("gsm8k_dir"), setting="metadata gsm8k_dir")
    files = {split: path / f"{split}.jsonl" for split in SPLITS} if path is not None else {}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if path is None or missing:
        raise FileNotFoundError(
            f"no GSM8K splits for the gsm8k_local task (folder {path} from {origin}; missing {missing}); "
            "pass --metadata '{\"gsm8k_dir\": \"/path/to/gsm8k\"}' or set GSM8K_DIR to a folder with "
            "train.jsonl and test.jsonl"
        )
    return datasets.load_dataset("json", data_files={k: str(v) for k, v in files.items()})
