"""Probe where FlashInfer's multi-token selective_state_update builds and agrees with our reference.

Which Mamba2 sizes it builds and runs at, and whether it agrees there with our reference (the rewind verify
the engine's ``ssm_backend=flashinfer`` calls).

    python3 tests/gpu/flashinfer_sizes.py [--out sizes.json] [--jobs 6]

FlashInfer compiles one module per (head_dim, d_state, dtypes, T) on first use (about 20 s each), and some
sizes fail to compile (a static_assert in its vector-load helpers; docs/gpu/engine_gpu_flashinfer*.log), so
every case runs in its own subprocess, several at a time. Each case calls it as the engine does (T = 4
tokens, intermediate states written per row, stored state left untouched, tie_hdim views of dt / A / D /
dt_bias) and compares out, intermediate states and the stored state with
``kernels.mamba2.selective_state_update_ref`` on the same inputs. Prints one JSON document: per case
"ok" with the max abs errors, "mismatch" with them, or "error" with the first line that names the failure.
The engine's size guard (runners/engine/runner.py FLASHINFER_SIZES) admits the sizes found "ok" here.
Needs CUDA and flashinfer (.gpu-bundle on the device machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# (head_dim, d_state) probed with fp32 inputs (the engine's test checkpoints); bf16 inputs at a subset.
SIZES = [(16, 32), (32, 32), (32, 64), (64, 32), (64, 64), (32, 128), (64, 128), (128, 128), (64, 256)]
BF16_SIZES = [(64, 128), (128, 128)]
T, BATCH, NHEADS, NGROUPS = 4, 3, 4, 2
# fp32 inputs: both sides accumulate in fp32 in a different order (1e-4 relative at these magnitudes);
# bf16 inputs: the outputs are rounded to bf16 (2^-8 relative) by both.
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


def one_case(head_dim: int, d_state: int, in_dtype: str, state_dtype: str) -> dict:
    """Run one size in this process; returns the case's record (raises only on a bug in this script)."""
    import flashinfer.mamba as fim
    import torch

    from kernels.mamba2 import selective_state_update_ref

    torch.manual_seed(0)
    dev, ind, sd = "cuda", getattr(torch, in_dtype), getattr(torch, state_dtype)
    H, G, P, N, B = NHEADS, NGROUPS, head_dim, d_state, BATCH
    S = B + 2
    state = (torch.randn(S, H, P, N, device=dev) * 0.5).to(sd)
    x = torch.randn(B, T, H, P, device=dev).to(ind)
    dt = (torch.randn(B, T, H, device=dev) * 0.5 - 1).to(ind)
    A = -torch.rand(H, device=dev) - 0.5
    Bm = (torch.randn(B, T, G, N, device=dev) / N**0.5).to(ind)
    Cm = (torch.randn(B, T, G, N, device=dev) / N**0.5).to(ind)
    D = torch.randn(H, device=dev)
    dt_bias = torch.rand(H, device=dev) - 0.5
    slots = torch.tensor([3, 0, 4], device=dev, dtype=torch.int32)  # slot 0 live, not in row order

    def tied(t, shape):
        return t.reshape(*t.shape, *([1] * (len(shape) - t.dim()))).expand(shape)

    before = state.clone()
    inter = torch.full((B, T, H, P, N), float("nan"), device=dev, dtype=sd)
    out = torch.full((B, T, H, P), float("nan"), device=dev, dtype=ind)
    rows = torch.arange(B, device=dev, dtype=torch.int32)
    try:
        fim.selective_state_update(
            # dt, D, dt_bias in fp32 (one dtype in its contract), as runners/engine/models/mamba2.py passes
            # them
            state, x, tied(dt.float(), (B, T, H, P)), tied(A, (H, P, N)), Bm, Cm, tied(D, (H, P)),
            dt_bias=tied(dt_bias, (H, P)), dt_softplus=True, state_batch_indices=slots, out=out,
            disable_state_update=True, intermediate_states_buffer=inter, intermediate_state_indices=rows,
            cache_steps=T,
        )
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the record names it
        lines = [ln.strip() for ln in str(e).splitlines() if "error" in ln.lower()]
        first = (lines or [str(e)[:300]])[0][:300]
        return {"status": "error", "type": type(e).__name__, "first_error": first}
    ref_inter = torch.empty(B, T, H, P, N, device=dev, dtype=torch.float32)
    ref_state = before.clone()
    ref_out = selective_state_update_ref(ref_state, x, dt, A, Bm, Cm, D, dt_bias, slots,
                                         intermediate_states=ref_inter, out=torch.empty_like(out).float())
    err = {
        "out": (out.float() - ref_out).abs().max().item(),
        "intermediate_states": (inter.float() - ref_inter).abs().max().item(),
        "state_changed": (state.float() - before.float()).abs().max().item(),
    }
    tol = TOL[in_dtype] * max(1.0, ref_out.abs().max().item())
    good = err["out"] <= tol and err["intermediate_states"] <= tol and err["state_changed"] == 0
    return {"status": "ok" if good else "mismatch", "max_abs_err": err, "tol": tol}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--jobs", type=int, default=6, help="cases compiled and run at once")
    ap.add_argument("--one", nargs=4, metavar=("HEAD_DIM", "D_STATE", "IN_DTYPE", "STATE_DTYPE"),
                    help=argparse.SUPPRESS)  # internal: run a single case, print its record
    args = ap.parse_args(argv)
    if args.one:
        p, n, ind, sd = args.one
        print(json.dumps(one_case(int(p), int(n), ind, sd)))
        return 0
    import importlib.util

    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        print("flashinfer_sizes: needs a CUDA GPU and flashinfer importable (on the device machine: install "
              ".gpu-bundle as tests/gpu/run_checks.sh does)", file=sys.stderr)
        return 2
    cases = [(p, n, "float32", "float32") for p, n in SIZES]
    cases += [(p, n, "bfloat16", "float32") for p, n in BF16_SIZES]

    def run(case):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", *map(str, case)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
        key = dict(zip(("head_dim", "d_state", "input_dtype", "state_dtype"), case))
        try:
            return {**key, **json.loads(proc.stdout.strip().splitlines()[-1])}
        except (json.JSONDecodeError, IndexError):
            tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
            return {**key, "status": "error", "type": f"exit {proc.returncode}",
                    "first_error": " | ".join(tail)}

    with ThreadPoolExecutor(args.jobs) as pool:
        records = list(pool.map(run, cases))
    text = json.dumps({"T": T, "nheads": NHEADS, "ngroups": NGROUPS, "cases": records}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    raise SystemExit(main())
