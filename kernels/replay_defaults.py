"""The replay kernels' default configuration per (operation, state dtype, shape class, batch bucket): the
measured best of `python -m benchmarks.sweep_replay`, read from the committed table kernels/replay_defaults.json.

Scope: the loader and the lookup that `kernels.mamba2.replay_verify` and `kernels.gdn.replay_verify` run when
the caller passes no `variant=` (what the engine does); the table's one writer is
`benchmarks.sweep_replay.defaults_table` (`--write-defaults PATH`), a pure function of a sweep JSON.

Keys (`key`): "{operation}/{state dtype}/{shape class}/b{batch bucket}", e.g.
"mamba2_checkpointing/bfloat16/h128_p64_n128/b64".
- operation (`OPERATIONS`): the engine's launch paths, "mamba2_per_step" (a per-step `ReplayHistory`),
  "mamba2_checkpointing" (a checkpointing history) and "gdn". One launch serves rows with and without a state
  write (the kernel branches per row on device data), so a path has one configuration.
- state dtype: torch's name without the prefix ("float32", "bfloat16", "float16").
- shape class (`mamba2_shape_class`, `gdn_shape_class`): the per-GPU dimensions that set the work of one
  program and the grid: Mamba2 heads, head_dim, d_state ("h128_p64_n128"); GDN value heads, head_v_dim,
  head_k_dim ("hv32_v128_k128"). Tensor parallelism divides the heads, so each world size is its own class.
- batch bucket: a row "b{n}" serves batches m with (previous bucket) < m <= n; a batch above every bucket of
  its (operation, dtype, shape class) takes the largest (`lookup`).

Row value: {"config": the sweep's configuration name, "kwargs": the launcher keyword arguments of that
configuration ("variant" and its tiles, e.g. {"variant": "mma", "num_stages": 3}), "evidence": what the choice
rests on}. The launcher applies "kwargs" for every tuning argument its caller left at None; a caller's explicit
`variant=` bypasses the table (then `VARIANTS` gives the tiles, as before).

A float16 state without rows of its own takes the bfloat16 rows of its (operation, shape class)
(`ROW_SIBLING`): the sweep times float32 and bfloat16 states only, and the two 16-bit dtypes move the same
bytes through the same kernels (they differ in the store's convert and, with stochastic rounding, in the
rounding rule; in the "mma" variants an fp16 state enters the tensor-core products as two bf16 pieces, a bf16
one as one). Timed side by side, the two dtypes came within a few percent of each other and chose the same
fastest configuration per operator (docs/kernel_performance.md, "the engine's configurations"). A sweep with
float16 states would replace this with measured rows.

Backends (``"backends"``, keyed "{operation}/{state dtype}/{shape class}"): which vendor's replay kernel the
engine runs by default for that operation ("flashinfer": FlashInfer's checkpointing_ssu, "triton": ours), from
the same sweep (`benchmarks.sweep_replay._backends`: the headline times of both, summed over the operation's
operators). `default_backend` reads it; an operation without a row there runs ours.

Fallback (documented default): no table file, no row for the (operation, dtype, shape class) (nor its sibling's),
or a row naming a variant the module does not have -> {"variant": fallback} where fallback is the module's
`FALLBACK_VARIANT` ("fma": the variant every test, shape and dtype covers).
"""

from __future__ import annotations

import functools
import json
import os

import torch

OPERATIONS = ("mamba2_per_step", "mamba2_checkpointing", "gdn")
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay_defaults.json")
SCHEMA = 1
# state dtype -> the dtype whose rows it takes when it has none of its own (module docstring)
ROW_SIBLING = {"float16": "bfloat16"}


def mamba2_shape_class(nheads: int, head_dim: int, d_state: int) -> str:
    """Shape class of a Mamba2 replay launch: "h{heads}_p{head_dim}_n{d_state}" (per GPU)."""
    return f"h{nheads}_p{head_dim}_n{d_state}"


def gdn_shape_class(num_v_heads: int, head_v_dim: int, head_k_dim: int) -> str:
    """Shape class of a GDN replay launch: "hv{value heads}_v{head_v_dim}_k{head_k_dim}" (per GPU)."""
    return f"hv{num_v_heads}_v{head_v_dim}_k{head_k_dim}"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the sweep's and the table's state-dtype names)."""
    return str(dtype).removeprefix("torch.")


def key(operation: str, state_dtype: str, shape_class: str, batch_bucket: int) -> str:
    """The table key of one row (module docstring)."""
    return f"{operation}/{state_dtype}/{shape_class}/b{batch_bucket}"


def load(path: str | None = None) -> dict:
    """The table at `path` (default `TABLE_PATH`: {"schema", "provenance", "rows"}), read once per process and
    path; an empty table when the file does not exist (every lookup then falls back).

    Raises:
        ValueError: a file that is not a table of this schema (a broken table must not silently fall back).
    """
    return _load(path or TABLE_PATH)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> dict:
    if not os.path.exists(path):
        return {"schema": SCHEMA, "provenance": {}, "rows": {}}
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict) or table.get("schema") != SCHEMA or not isinstance(table.get("rows"), dict):
        raise ValueError(f"{path}: not a replay-defaults table of schema {SCHEMA}; rewrite it with "
                         "`python -m benchmarks.sweep_replay --from-json SWEEP.json --write-defaults PATH`")
    for k, row in table["rows"].items():
        if not isinstance(row, dict) or not isinstance(row.get("kwargs"), dict) or "variant" not in row["kwargs"]:
            raise ValueError(f"{path}: row {k!r} has no kwargs with a variant; rewrite the table with "
                             "`python -m benchmarks.sweep_replay --write-defaults PATH`")
    return table


def lookup(operation: str, state_dtype: torch.dtype, shape_class: str, batch: int, *, fallback: str,
           variants, path: str | None = None) -> dict:
    """Launcher keyword arguments for one launch: the table row's "kwargs" (a fresh dict; a float16 state
    without rows takes its `ROW_SIBLING`'s), or {"variant": fallback} (module docstring). `variants`: the
    variant names the calling module has.

    Raises:
        ValueError: an unknown operation, or a broken table file (`load`).
    """
    if operation not in OPERATIONS:
        raise ValueError(f"replay_defaults.lookup: operation must be one of {OPERATIONS}, got {operation!r}")
    rows = load(path)["rows"]
    name = dtype_name(state_dtype)
    for dt in (name, *filter(None, [ROW_SIBLING.get(name)])):
        prefix = f"{operation}/{dt}/{shape_class}/b"
        buckets = sorted(int(k[len(prefix):]) for k in rows if k.startswith(prefix) and k[len(prefix):].isdigit())
        if buckets:
            break
    if not buckets:
        return {"variant": fallback}
    bucket = next((b for b in buckets if batch <= b), buckets[-1])
    kwargs = dict(rows[prefix + str(bucket)]["kwargs"])
    return kwargs if kwargs["variant"] in variants else {"variant": fallback}


def default_backend(operation: str, state_dtype: torch.dtype, shape_class: str, path: str | None = None
                    ) -> str | None:
    """The table's backend ("flashinfer" / "triton") for ``operation`` at this state dtype and shape class
    (a float16 state takes its `ROW_SIBLING`'s), or None without a row (module docstring).

    Raises:
        ValueError: an unknown operation, or a broken table file (`load`).
    """
    if operation not in OPERATIONS:
        raise ValueError(f"replay_defaults.default_backend: operation must be one of {OPERATIONS}, got "
                         f"{operation!r}")
    backends = load(path).get("backends") or {}
    name = dtype_name(state_dtype)
    for dt in (name, *filter(None, [ROW_SIBLING.get(name)])):
        row = backends.get(f"{operation}/{dt}/{shape_class}")
        if row is not None:
            return row["backend"]
    return None


def resolve(explicit: dict, operation: str, state_dtype: torch.dtype, shape_class: str, batch: int, *,
            fallback: str, variants, path: str | None = None) -> dict:
    """The launcher's tuning arguments: `explicit` (the caller's, None = not given) when it names a variant;
    else the table's (`lookup`) for every argument the caller left at None. Returns a new dict with the keys
    of `explicit`."""
    if explicit.get("variant") is not None:
        return dict(explicit)
    tuned = lookup(operation, state_dtype, shape_class, batch, fallback=fallback, variants=variants, path=path)
    return {k: (v if v is not None else tuned.get(k)) for k, v in explicit.items()}
