"""Benchmark of the Mamba2 verify kernels (rewind, replay) at the Nemotron 3 Super mixer shape on one GPU.

    python -m benchmarks.bench_mamba2 [--out results.json] [--batch 64] [--T 4] [--state-dtypes float32,bfloat16]
                                   [--flashinfer] [--flashinfer-checkpointing bfloat16]

Times with triton.testing.do_bench (median, microseconds) per state dtype (float32, bfloat16), bf16 inputs:
- rewind verify: `selective_state_update` writing T intermediate states, and `kernels.commit.rewind_commit`
- decode: `selective_state_update` with T = 1, state updated in place
- replay verify: `replay_verify` with PNAT = 0 (no state write) and PNAT = T - 1 (state written), for a
  sweep of head_dim block x warps; the checkpointing variant (L = 16) without and with a flush;
  `kernels.commit.replay_advance`
- a torch copy of the whole state (read + write): the memory-bound floor for anything that rewrites it
- with --flashinfer and FlashInfer importable: its `selective_state_update` (rewind, multi-token); with
  --flashinfer-checkpointing DTYPES also its `checkpointing_ssu` (3 pending tokens, and a flush); a call
  that fails (first-use JIT, an API that differs from the one assumed here) is recorded with its error
  instead of stopping the run
Each timing comes with the bytes it must move and the bandwidth that implies. Prints one JSON document and
writes it to --out. Needs CUDA; the state cache has as many slots as the batch has rows (slot b = row b).
Without a GPU: `--dry-run` (TRITON_INTERPRET=1) runs every call once at a tiny shape; `--compile-check`
compiles the kernels for sm_90 and prints registers / stack bytes per thread (spills show up there;
`python -m benchmarks.compile_report`).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch
import triton
import triton.testing

from kernels.commit import allocate_replay_slots, replay_advance, rewind_commit
from kernels.mamba2 import ReplayHistory, replay_verify, selective_state_update
from kernels.mamba2.flashinfer_replay import MAX_WINDOW, tied  # its ring: MAX_WINDOW + T rows per slot

H, P, N, G = 128, 64, 128, 8  # Super V3 Mamba2: 128 heads x head_dim 64, d_state 128, 8 groups


def _bench(fn, reps_ms=200):
    fn()  # compile / JIT outside the timing
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median") * 1e3  # us


def flashinfer_checkpointing_cases(T: int) -> list[tuple[int, str]]:
    """(pending tokens, result name) of the checkpointing_ssu calls :func:`bench_flashinfer` times at T tokens:
    3 pending (no flush) and ring - 2T + 1 pending (a flush: the state is written when pending + 2T > ring)."""
    ring = MAX_WINDOW + T
    return [(k, f"checkpointing_ssu_pnat{k}{'_flush' if k + 2 * T > ring else ''}") for k in (3, ring - 2 * T + 1)]


# the name of bench_flashinfer's per-step replay call (window T): the sweep compares it with m2_write
FLASHINFER_PER_STEP = "checkpointing_ssu_perstep"


class _Skip(Exception):
    """bench_flashinfer's ``only`` names another call."""


def _dry(fn):
    """--dry-run timer: call once (CPU interpreter, tiny shape) to catch errors before GPU time is spent."""
    fn()
    return 1.0


def _row(us, nbytes):
    return {"us": round(us, 2), "bytes": int(nbytes), "GBps": round(nbytes / (us * 1e-6) / 1e9, 1)}


def bench_ours(batch, T, state_dtype, in_dtype=torch.bfloat16, *, dev="cuda", timer=_bench, shape=None):
    H, P, N, G = shape or (globals()["H"], globals()["P"], globals()["N"], globals()["G"])
    es, ei = torch.empty(0, dtype=state_dtype).element_size(), torch.empty(0, dtype=in_dtype).element_size()
    S = batch
    state_bytes = S * H * P * N * es
    state = torch.randn(S, H, P, N, device=dev).to(state_dtype)
    x = torch.randn(batch, T, H, P, device=dev, dtype=in_dtype)
    dt = (torch.randn(batch, T, H, device=dev) * 0.5 - 1).to(in_dtype)
    B = (torch.randn(batch, T, G, N, device=dev) / N**0.5).to(in_dtype)
    C = (torch.randn(batch, T, G, N, device=dev) / N**0.5).to(in_dtype)
    A = -torch.rand(H, device=dev) - 0.5
    D = torch.randn(H, device=dev)
    dt_bias = torch.rand(H, device=dev) - 0.5
    slot_ids = torch.arange(batch, device=dev, dtype=torch.int32)
    nat = torch.full((batch,), T, device=dev, dtype=torch.int32)
    out = torch.empty(batch, T, H, P, device=dev, dtype=in_dtype)
    io_bytes = (x.numel() + B.numel() + C.numel() + out.numel()) * ei
    res = {}

    inter = torch.empty(batch, T, H, P, N, device=dev, dtype=state_dtype)
    for bp in (4, 8, 16):
        us = timer(lambda bp=bp: selective_state_update(
            state, x, dt, A, B, C, D, dt_bias, slot_ids, intermediate_states=inter, out=out, block_p=bp))
        res[f"rewind_verify_block_p{bp}"] = _row(us, state_bytes * (1 + T) + io_bytes)
    res["rewind_commit"] = _row(timer(lambda: rewind_commit(state, inter, slot_ids, nat)),
                                2 * state_bytes)
    x1, dt1, B1, C1, out1 = x[:, :1], dt[:, :1], B[:, :1], C[:, :1], out[:, :1]
    res["decode_T1"] = _row(timer(lambda: selective_state_update(state, x1, dt1, A, B1, C1, D, dt_bias, slot_ids,
                                                                  out=out1)), 2 * state_bytes + io_bytes / T)

    hist = ReplayHistory.allocate(S, T, H, P, G, N, dtype=in_dtype, device=dev)
    pnat, bufidx = allocate_replay_slots(S, device=dev)
    hist_bytes = hist.nbytes() // 2  # one buffer read per verify (the other one written: ~io_bytes)
    variants = [(bp, nw) for bp in (4, 8, 16, 32) for nw in (2, 4, 8) if 8 <= bp * N // (32 * nw) <= 32]
    for k in (0, T - 1):
        for bp, nw in variants:
            def run(bp=bp, nw=nw, k=k):
                pnat.fill_(k)  # a fill per call keeps PNAT fixed (a real step advances it)
                replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx, out=out,
                              block_p=bp, num_warps=nw)
            nbytes = state_bytes * (2 if k else 1) + io_bytes + hist_bytes
            res[f"replay_verify_pnat{k}_p{bp}_w{nw}"] = _row(timer(run), nbytes)
    res["replay_verify_pnat0_default"] = _row(timer(lambda: replay_verify(
        state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat.fill_(0), bufidx, out=out)),
        state_bytes + io_bytes + hist_bytes)
    # checkpointing (L = 16): PNAT = 3 pending tokens (no state write), PNAT = 12 (no write, the most
    # pending tokens without a flush), PNAT = 13 (13 + T > 16: flush)
    L = max(16, T)
    ck = ReplayHistory.allocate(S, L, H, P, G, N, dtype=in_dtype, device=dev, checkpointing=True)
    for k in sorted({min(3, L - T), L - T, L - T + 1}):
        flush = k + T > L
        for bp, nw in ((None, None), (4, 2), (16, 4)):
            def run_ck(k=k, bp=bp, nw=nw):
                pnat.fill_(k)
                replay_verify(state, x, dt, A, B, C, D, dt_bias, slot_ids, ck, pnat, bufidx, out=out,
                              block_p=bp, num_warps=nw)
            nbytes = state_bytes * (2 if flush else 1) + io_bytes + ck.nbytes() * k // (2 * L)
            tag = "" if bp is None else f"_p{bp}_w{nw}"
            res[f"checkpointing_verify_pnat{k}{'_flush' if flush else ''}{tag}"] = _row(timer(run_ck), nbytes)
    res["pnat_fill_only"] = _row(timer(lambda: pnat.fill_(1)), S * 4)
    res["replay_advance"] = _row(timer(lambda: replay_advance(pnat, bufidx, slot_ids, nat, T)), 4 * S * 4)
    dst = torch.empty_like(state)
    res["torch_state_copy"] = _row(timer(lambda: dst.copy_(state)), 2 * state_bytes)
    res["memory_per_slot_per_layer_bytes"] = {
        "rewind_intermediate_states": T * H * P * N * es,
        "replay_history_two_buffers": hist.nbytes() // S,
        "checkpointing_history_L16": ck.nbytes() // S,
    }
    return res


def bench_flashinfer(batch, T, state_dtype, in_dtype=torch.bfloat16, *, checkpointing=False, timer=None,
                     only=None):
    """Time FlashInfer's rewind verify (and, with `checkpointing`, its checkpointing_ssu) at the Super V3
    mixer shape (module constants H, P, N, G) with `batch` rows of T tokens, one slot per row.
    ``timer``: the function that times one zero-argument call and returns microseconds (default: this
    module's do_bench median); ``only``: time just the call of that result name (e.g.
    "checkpointing_ssu_pnat3"), as the Nsight Compute worker of benchmarks.sweep_replay does.

    Returns {name: {"us": median microseconds}} per call timed, or {name: {"error": text}} where FlashInfer
    is not importable or a call fails (first-use JIT, an API other than 0.7.2's); never raises for those.
    Needs CUDA. Source of the API: flashinfer.mamba 0.7.2 (selective_state_update, checkpointing_ssu)."""
    try:
        import flashinfer.mamba as fim
    except Exception as e:  # noqa: BLE001 - report, do not fail the run
        return {"error": f"flashinfer not importable: {e!r}"}
    dev = "cuda"
    S = batch
    state = torch.randn(S, H, P, N, device=dev).to(state_dtype)
    x = torch.randn(batch, T, H, P, device=dev, dtype=in_dtype)
    # the rewind verify: dt, D and dt_bias share one dtype in selective_state_update's contract; fp32, as the
    # engine's FlashInfer rewind passes them
    dt = tied(torch.randn(batch, T, H, device=dev) * 0.5 - 1, (batch, T, H, P))
    A = tied(-torch.rand(H, device=dev) - 0.5, (H, P, N))
    B = (torch.randn(batch, T, G, N, device=dev) / N**0.5).to(in_dtype)
    C = (torch.randn(batch, T, G, N, device=dev) / N**0.5).to(in_dtype)
    D = tied(torch.randn(H, device=dev), (H, P))
    dt_bias = tied(torch.rand(H, device=dev) - 0.5, (H, P))
    slot_ids = torch.arange(batch, device=dev, dtype=torch.int32)
    out = torch.empty_like(x)
    res = {}
    timer = timer or _bench
    try:
        inter = torch.empty(batch, T, H, P, N, device=dev, dtype=state_dtype)
        if only not in (None, "selective_state_update_rewind"):
            raise _Skip
        res["selective_state_update_rewind"] = {"us": round(timer(lambda: fim.selective_state_update(
            state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=slot_ids,
            out=out, disable_state_update=True, intermediate_states_buffer=inter,
            intermediate_state_indices=slot_ids, cache_steps=T)), 2)}
    except _Skip:
        pass
    except Exception:  # noqa: BLE001
        res["selective_state_update_rewind"] = {"error": traceback.format_exc(limit=2)}
    if not checkpointing:
        return res
    if not hasattr(fim, "checkpointing_ssu"):
        res["checkpointing_ssu"] = {"error": "flashinfer.mamba has no checkpointing_ssu"}
        return res
    # checkpointing_ssu gets its operands as the engine's replay passes them (replay_verify_flashinfer): x, B,
    # C as strided views of one conv output, raw dt, D and dt_bias in the activation dtype (the model's), int64
    # slot ids; so the sweep times, and its warm-ups build, the JIT module the engine runs
    xBC = torch.cat([torch.randn(batch, T, H * P, device=dev), torch.randn(batch, T, 2 * G * N, device=dev)
                     / N**0.5], dim=-1).to(in_dtype)
    xv, Bv, Cv = xBC.split([H * P, G * N, G * N], dim=-1)
    xv, Bv, Cv = xv.reshape(batch, T, H, P), Bv.reshape(batch, T, G, N), Cv.reshape(batch, T, G, N)
    dt_raw = tied((torch.randn(batch, T, H, device=dev) * 0.5 - 1).to(in_dtype), (batch, T, H, P))
    D16, bias16 = tied(torch.randn(H, device=dev).to(in_dtype), (H, P)), \
        tied((torch.rand(H, device=dev) - 0.5).to(in_dtype), (H, P))
    slots64 = slot_ids.long()
    try:
        # FlashInfer 0.7.2's contract: rings of RING = max_window + T rows per slot, processed dt in fp32,
        # ring_start / prev_num_accepted_tokens owned by the caller; the state is written when pnat + 2T > RING.
        ring = MAX_WINDOW + T
        x_cache = torch.randn(S, H, ring, P, device=dev).to(in_dtype)
        B_cache = (torch.randn(S, G, ring, N, device=dev) / N**0.5).to(in_dtype)
        dt_cache = torch.rand(S, H, ring, device=dev) * 0.1
        ring_start = torch.zeros(S, device=dev, dtype=torch.int32)
        for k, tag in flashinfer_checkpointing_cases(T):
            pnat = torch.full((S,), k, device=dev, dtype=torch.int32)
            if only not in (None, tag):
                continue

            def call(pnat=pnat):
                ring_start.zero_()  # a flush advances it; keep every timed call the same
                fim.checkpointing_ssu(state, x_cache, B_cache, dt_cache, ring_start, pnat, xv, dt_raw, A, Bv, Cv,
                                      out, D=D16, dt_bias=bias16, dt_softplus=True, state_batch_indices=slots64,
                                      algorithm="monolith")
            res[tag] = {"us": round(timer(call), 2)}
        # the per-step replay in FlashInfer's layout: a window of T (a ring of 2T rows), so every verify with
        # pending tokens flushes (T - 1 pending here), as the engine runs it for a per-step replay cache
        tag = FLASHINFER_PER_STEP
        if only in (None, tag):
            x2, B2 = x_cache[:, :, : 2 * T].contiguous(), B_cache[:, :, : 2 * T].contiguous()
            dt2, pnat = dt_cache[:, :, : 2 * T].contiguous(), torch.full((S,), T - 1, device=dev, dtype=torch.int32)

            def per_step():
                ring_start.zero_()
                fim.checkpointing_ssu(state, x2, B2, dt2, ring_start, pnat, xv, dt_raw, A, Bv, Cv, out, D=D16,
                                      dt_bias=bias16, dt_softplus=True, state_batch_indices=slots64,
                                      algorithm="monolith")
            res[tag] = {"us": round(timer(per_step), 2)}
    except Exception:  # noqa: BLE001
        res["checkpointing_ssu"] = {"error": traceback.format_exc(limit=2)}
    return res


def compile_check() -> dict:
    """sm_90 registers / stack / instruction counts of every kernel variant, without a GPU: the report of
    `benchmarks.compile_report` (compiled through the real launchers, so Triton's argument specialisation
    applies; an earlier version of this check compiled unspecialised signatures and overstated registers)."""
    from benchmarks import compile_report

    return compile_report.report()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=4, help="tokens per verify (draft length + 1)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time FlashInfer's selective_state_update (first-use JIT about 20 s per dtype)")
    ap.add_argument("--flashinfer-checkpointing", default="", metavar="DTYPES",
                    help="also time FlashInfer's checkpointing_ssu for these state dtypes, comma-separated "
                         "(bfloat16,float32); its first-use JIT takes minutes per dtype")
    ap.add_argument("--state-dtypes", default="float32,bfloat16", help="state dtypes to time, comma-separated")
    ap.add_argument("--dry-run", action="store_true",
                    help="run every call once on the CPU at a tiny shape, no timings (needs TRITON_INTERPRET=1 "
                         "in the environment)")
    ap.add_argument("--compile-check", action="store_true",
                    help="compile the kernels for sm_90 without a GPU; print registers / stack per thread")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.T < 1:
        ap.error(f"--batch {args.batch} --T {args.T}: both must be >= 1")
    names = [d for d in args.state_dtypes.split(",") if d]
    bad = [d for d in names if d not in ("float32", "bfloat16", "float16")]
    if bad or not names:
        ap.error(f"--state-dtypes: {bad or names} must be a comma-separated list of float32, bfloat16, float16")
    ckpt = {d for d in args.flashinfer_checkpointing.split(",") if d}
    if ckpt - set(names):
        ap.error(f"--flashinfer-checkpointing {sorted(ckpt - set(names))}: not among --state-dtypes {names}")
    if args.compile_check:
        print(json.dumps(compile_check(), indent=1))
        return 0
    if args.dry_run:
        from kernels._common import interpreter_active

        if not interpreter_active():
            ap.error("--dry-run runs the kernels in Triton's interpreter, which is switched on before triton is "
                     "imported: TRITON_INTERPRET=1 python -m benchmarks.bench_mamba2 --dry-run")
        for sd in (torch.float32, torch.bfloat16):
            bench_ours(2, args.T, sd, dev="cpu", timer=_dry, shape=(2, 16, 16, 1))
        print(json.dumps({"dry_run": "ok"}))
        return 0
    if not torch.cuda.is_available():
        print("bench_mamba2: needs a CUDA GPU (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    result = {
        "shape": {"batch": args.batch, "T": args.T, "nheads": H, "head_dim": P, "d_state": N, "ngroups": G,
                  "input_dtype": "bfloat16"},
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "results": {},
    }
    for name in names:
        sd = getattr(torch, name)
        entry = {"ours": bench_ours(args.batch, args.T, sd)}
        if args.flashinfer or name in ckpt:
            entry["flashinfer"] = bench_flashinfer(args.batch, args.T, sd, checkpointing=name in ckpt)
        result["results"][f"state_{name}"] = entry
        torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
