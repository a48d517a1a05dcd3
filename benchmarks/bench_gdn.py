"""Benchmark the Gated DeltaNet verify kernels (rewind vs replay) at the Qwen3-Next shape on a GPU.

Default shape (one Qwen3-Next GDN layer, MTP verify): batch 64, T = 4 tokens per row, 16 key heads x K = 128,
32 value heads x V = 128, bf16 inputs, fp32 state (--state-dtype bf16 for the 16-bit variant). Times with
triton.testing.do_bench (median ms, after warm-up so JIT compilation is excluded) and prints one JSON object:
per kernel the best block_v of a small sweep (no autotune: the kernels update state in place), its time in
microseconds and the achieved bandwidth of its compulsory traffic, next to a torch copy of the whole state
(read + write) as the memory-bound yardstick, and the per-layer memory of both schemes' speculative buffers.

    python -m benchmarks.bench_gdn [--batch 64 --T 4 --state-dtype fp32 --out results.json]

--device cpu (with TRITON_INTERPRET=1) runs the same script under the Triton interpreter with a wall-clock
timer: a smoke test of the script on tiny shapes, its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import triton

from kernels.commit import allocate_replay_slots, replay_advance, rewind_commit
from kernels.gdn import ReplayHistory, fused_recurrent_gated_delta_rule, replay_verify

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(B, T, H, HV, K, V, dtype, device):
    q, k = (torch.randn(B, T, H, K, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, HV, V, device=device, dtype=dtype)
    g = -torch.nn.functional.softplus(torch.randn(B, T, HV, device=device)) * 0.5
    beta = torch.rand(B, T, HV, device=device, dtype=dtype)
    return q, k, v, g, beta


def _time_ms(fn, device: str) -> float:
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    t0 = time.perf_counter()  # interpreter smoke run: one call, wall clock
    fn()
    return (time.perf_counter() - t0) * 1e3


def _best(fn_of_block, blocks, bytes_moved, device):
    """Time fn_of_block(bv) for each bv; return the fastest as a dict (us, GB/s, block_v, sweep)."""
    sweep = {}
    for bv in blocks:
        fn = fn_of_block(bv)
        fn()  # compile outside the timed region
        sweep[bv] = _time_ms(fn, device) * 1e3
    bv = min(sweep, key=sweep.get)
    return {"us": round(sweep[bv], 2), "block_v": bv, "GBps": round(bytes_moved / sweep[bv] / 1e3, 1),
            "sweep_us": {str(b): round(t, 2) for b, t in sweep.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--T", type=int, default=4, help="tokens per verify (draft length + 1)")
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--HV", type=int, default=32)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--slots", type=int, default=None, help="cache slots (default: batch)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="q, k, v, beta dtype")
    p.add_argument("--state-dtype", choices=DTYPES, default="fp32")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: interpreter smoke run (needs TRITON_INTERPRET=1), times meaningless")
    a = p.parse_args(argv)
    small = [f"--{n} {getattr(a, n)}" for n in ("batch", "T", "H", "HV", "K", "V") if getattr(a, n) < 1]
    if small:
        p.error(f"{', '.join(small)}: sizes must be >= 1")
    if a.HV % a.H:
        p.error(f"--HV {a.HV} must be a multiple of --H {a.H} (each key head serves HV / H value heads)")
    if a.slots is not None and a.slots < a.batch:
        p.error(f"--slots {a.slots} < --batch {a.batch}: every row needs its own cache slot")
    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke run)")
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the kernels in the Triton interpreter: set TRITON_INTERPRET=1")
    B, T, H, HV, K, V = a.batch, a.T, a.H, a.HV, a.K, a.V
    S = a.slots or B
    dt, sdt = DTYPES[a.dtype], DTYPES[a.state_dtype]
    torch.manual_seed(0)
    q, k, v, g, beta = _inputs(B, T, H, HV, K, V, dt, dev)
    state = (torch.randn(S, HV, V, K, device=dev) * 0.1).to(sdt)
    slot_ids = torch.randperm(S, device=dev)[:B].to(torch.int32)
    inter = torch.empty(B, T, HV, V, K, device=dev, dtype=sdt)
    hist = ReplayHistory.allocate(S, T, H, HV, K, V, device=dev)
    pnat, buf = allocate_replay_slots(S, device=dev)
    num_accepted = torch.randint(1, T + 1, (B,), device=dev, dtype=torch.int32)
    out = torch.empty_like(v)

    st_bytes = state.element_size() * HV * V * K  # one slot's state for one layer
    in_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta)) + out.numel() * out.element_size()
    hist_tok = HV * V * hist.u.element_size() + H * K * hist.k.element_size() + HV * 4  # one token, one slot
    res = {"shape": {"B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "S": S, "dtype": a.dtype,
                     "state_dtype": a.state_dtype},
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)", "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version()}

    blocks = (8, 16, 32, 64)
    one = [t[:, :1].contiguous() for t in (q, k, v, g, beta, out)]
    res["decode_T1_inplace"] = _best(
        lambda bv: (lambda: fused_recurrent_gated_delta_rule(*one[:5], state, slot_ids, out=one[5], block_v=bv)),
        blocks, 2 * B * st_bytes + in_bytes / T, dev)
    res["rewind_verify"] = _best(
        lambda bv: (lambda: fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, state, slot_ids, update_state=False, intermediate_states=inter, out=out,
            block_v=bv)),
        blocks, (1 + T) * B * st_bytes + in_bytes, dev)
    res["rewind_commit"] = _best(
        lambda bv: (lambda: rewind_commit(state, inter, slot_ids, num_accepted, block_rows=bv)),
        blocks, 2 * B * st_bytes, dev)
    res["rewind_total_us"] = round(res["rewind_verify"]["us"] + res["rewind_commit"]["us"], 2)

    for name, n_old in (("replay_verify_pnat0", 0), ("replay_verify_pnat_T", T)):
        pnat.fill_(n_old)
        state_traffic = (2 if n_old else 1) * B * st_bytes
        res[name] = _best(
            lambda bv: (lambda: replay_verify(q, k, v, g, beta, state, hist, slot_ids, pnat, buf, out=out,
                                                  block_v=bv)),
            blocks, state_traffic + in_bytes + (n_old + T) * B * hist_tok, dev)
    # warps per program at the two best tile heights (the default picks 1 warp up to 2048 elements, else 4)
    pnat.fill_(T)
    res["replay_verify_pnat_T_warps_sweep_us"] = {
        f"bv{bv}_w{nw}": round(_time_ms(lambda bv=bv, nw=nw: replay_verify(
            q, k, v, g, beta, state, hist, slot_ids, pnat, buf, out=out, block_v=bv, num_warps=nw), dev) * 1e3, 2)
        for bv in (8, 16, 32) for nw in (1, 2, 4)}
    pnat.zero_()
    t_commit = _time_ms(lambda: replay_advance(pnat, buf, slot_ids, num_accepted, T), dev) * 1e3
    res["replay_commit"] = {"us": round(t_commit, 2)}
    res["replay_total_us"] = round(res["replay_verify_pnat_T"]["us"] + res["replay_commit"]["us"], 2)

    dst = torch.empty_like(state)
    t_copy = _time_ms(lambda: dst.copy_(state), dev) * 1e3
    res["torch_state_copy"] = {"us": round(t_copy, 2), "GBps": round(2 * state.numel() * state.element_size()
                                                                       / t_copy / 1e3, 1)}
    res["memory_per_layer_bytes"] = {
        "state": S * st_bytes,
        "rewind_intermediate_states": inter.numel() * inter.element_size(),
        "replay_history": hist.nbytes(),
        "replay_metadata_shared_by_layers": 2 * S * 4,
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return res


if __name__ == "__main__":
    main()
