"""Sweep of the replay kernels' variants against the memory-bandwidth floor and FlashInfer, in one command.

    python -m benchmarks.sweep_replay --out DIR [--budget-s 400] [--no-flashinfer]
    python -m benchmarks.sweep_replay --ncu --out DIR [--sweep DIR/sweep_replay.json]   # Nsight Compute
    python -m benchmarks.sweep_replay --out DIR --write-defaults kernels/replay_defaults.json   # + the table
    python -m benchmarks.sweep_replay --from-json SWEEP.json --write-defaults kernels/replay_defaults.json
    python -m benchmarks.sweep_replay --quick --out DIR; ... --quick --ncu ...           # ~3 + ~1.5 min
    TRITON_INTERPRET=1 python -m benchmarks.sweep_replay --dry-run --out DIR             # CPU smoke run

Operators (kernels.mamba2.replay_verify, kernels.gdn.replay_verify + kernels.commit.replay_advance):
  m2_write     Mamba2 per-step replay verify, PNAT = T - 1 (the state is written)
  m2_nowrite   Mamba2 per-step replay verify, PNAT = 0 (the state is only read)
  m2_ckpt      Mamba2 checkpointing replay (L = max(16, T)), min(3, L - T) pending tokens, no flush
  m2_flush     Mamba2 checkpointing replay, L - T + 1 pending tokens: a flush (the state is written)
  gdn          Gated DeltaNet replay verify with PNAT = T (state written) + replay_advance ("replay total")
Shapes: Nemotron 3 Super mixer per GPU, ws1 (128 heads x head_dim 64 x d_state 128, 8 groups) and ws4 (32
heads, 2 groups); Qwen3-Next GDN ws1 (16 key / 32 value heads of 128 x 128) and ws4 (4 / 8). bf16 inputs,
fp32 and bf16 state, one cache slot per row.

Plan (about 5-7 minutes on one H200; --budget-s stops the grid early and says so in the JSON):
1. FlashInfer's checkpointing_ssu JIT (minutes per state dtype) starts at once in background processes.
2. Headline (batch 64, T = 4, ws1): every kernel configuration of `M2_CONFIGS` / `GDN_CONFIGS` per operator
   and state dtype, each first checked on the GPU against the PyTorch reference at batch 8 ("ok": within
   the GPU test tolerances); the fastest correct one per (operator, state dtype) is "best".
3. The peers at the headline, once FlashInfer's warm-ups are over (if they still build FLASHINFER_EARLY_WAIT_S
   after the headline, the peers are timed after the grid instead: "flashinfer_timed"), each when importable
   (else a row with the error): GDN's, FlashInfer's gated_delta_rule_mtp, fp32 state ("flashinfer_gdn":
   state written after T tokens, and the rewind verify with T intermediate states; `_flashinfer_gdn_rows`),
   and fla-core's fused_recurrent_gated_delta_rule ("fla": T tokens from the state, the final state written
   in fp32; `_fla_rows`);
4. and FlashInfer 0.7.2's checkpointing_ssu (3 pending tokens; a flush) and selective_state_update (rewind
   verify with T intermediate states). Then the confirmation (`confirm_headline`): the headline's fastest few configurations per operator
   and state dtype are timed again, nothing running beside them (and any other whose headline time beats the
   fastest re-timed one), and "best" is the fastest re-timed configuration.
5. Stochastic rounding cost: the best configuration of each state-writing operator (chosen with a bf16 state),
   bf16 and fp16 state, headline: round to nearest, "stochastic" (the default generator, "hash") and
   "stochastic_philox" (kernels/rounding.py).
6. Grid: T in (2, 4, 8) x batch in (1, 8, 64, 256) x both shapes x both dtypes, for the current kernel
   ("fma", the committed default) and the best of every operator sharing the operator's engine launch
   (`grid_configs`), what the defaults table compares.
The time budget (--budget-s) also stops the headline from starting configurations other than
ALWAYS_TIMED (the current one, "mma", "mma_pre" and the not yet measured M2_ISSUE28_CONFIGS: PDL, register
caps); what was skipped is listed in the JSON ("skipped").
--quick: a shorter run for a first look (about 3 minutes plus FlashInfer's wait): only the configurations of
QUICK_CONFIGS (the lowest-register ones without spills in the sm_90 compile report, plus the current,
"mma" and M2_ISSUE28_CONFIGS), --budget-s 150, --flashinfer-extra-s 0; with --ncu, the bf16 state only.
Each timing is triton.testing.do_bench's median (microseconds) after a compile call, with the bytes the
operator must move (state read once, written once where it is written, inputs, outputs and history read and
written once) and the fraction of copy bandwidth: the time of a torch copy of the same number of bytes
(half read, half written), measured in the same run, over the kernel's time.
Writes DIR/sweep_replay.json and DIR/sweep_replay.png (fraction of copy bandwidth against batch) and prints
a short table last; until then DIR/sweep_replay.partial.json holds what is measured so far (its "partial":
the last stage done), so a run cut short keeps its headline and grid. The JSON's "defaults" (beside "best")
names the configuration the engine should run per (operation, state dtype, shape class, batch bucket) by the rule `DEFAULTS_RULE`; --write-defaults PATH writes
that table (`defaults_table`, with the launcher arguments and the evidence) for kernels.replay_defaults, and
--from-json SWEEP.json --write-defaults PATH rewrites it from a committed sweep without a GPU.

--ncu: profiles the headline launch of each chosen kernel (the sweep's best per operator and state dtype and
the current kernel, or the current kernel and "mma" without --sweep; the configurations of --ncu-configs on
every operator that has them; and FlashInfer's checkpointing_ssu without and with a flush, unless
--no-flashinfer, `flashinfer_ncu_specs`; --dtypes restricts the state dtypes; --ncu-sr adds the
stochastic-rounding rows, DIR/ncu_<operator>_<config>_<dtype>_<rn|sr>.txt, for each state-writing
operator's bf16 best and the configurations of --ncu-sr-configs; --ncu-sr-only profiles those pairs alone)
with `ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats`, one launch per process (compiled before the profiled range), and saves each report
as DIR/ncu_<operator>_<config>_<dtype>.txt, with the headline numbers of every report (duration, memory /
DRAM / compute throughput in % of peak, registers, theoretical and achieved occupancy) in DIR/ncu_summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import triton
import triton.testing

from benchmarks.ncu import NCU_METRICS, find_ncu, parse_ncu
from benchmarks.replay_configs import GDN_CONFIGS, M2_CKPT_ONLY_CONFIGS, M2_CONFIGS, M2_ISSUE28_CONFIGS
from kernels import gdn, mamba2, replay_defaults
from kernels.commit import allocate_replay_slots, replay_advance
from kernels.rounding import StochasticRounding
from registry.errors import UserError, exits_on_user_error

SHAPES_M2 = {"ws1": (128, 64, 128, 8), "ws4": (32, 64, 128, 2)}  # H, P, N, G
SHAPES_GDN = {"ws1": (16, 32, 128, 128), "ws4": (4, 8, 128, 128)}  # H, HV, K, V
DRY_SHAPES_M2 = {"ws1": (2, 16, 16, 1)}
DRY_SHAPES_GDN = {"ws1": (1, 2, 16, 16)}
M2_OPS = ("m2_write", "m2_nowrite", "m2_ckpt", "m2_flush")
OPS = M2_OPS + ("gdn",)
CURRENT = "fma"  # the committed kernel before this sweep (the default of DEFAULT_VARIANT at the time)
# --quick: the current kernel, "mma" and the configurations with the fewest registers and no spills
# (docs/kernel_performance.md, sm_90 compile report), the FlashInfer-style split "mma_pre" and the issue 28
# additions (PDL, register caps: M2_ISSUE28_CONFIGS)
QUICK_CONFIGS = ("mma", "mma_c16", "mma_p32w2", "mma_bv32w2", "mma_bv64w4", "mma_pre",
                 "mma_pre_p32w2") + M2_ISSUE28_CONFIGS
# the headline configurations the time budget never skips (the rest only start before the deadline)
ALWAYS_TIMED = (CURRENT, "mma", "mma_pre") + M2_ISSUE28_CONFIGS
HEADLINE = {"batch": 64, "T": 4, "shape": "ws1"}
GRID_T = (2, 4, 8)
GRID_BATCH = (1, 8, 64, 256)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # the stochastic-rounding cost rows
SR_OPS = ("m2_write", "m2_flush", "gdn")  # the state-writing operators whose stochastic rounding is timed
# kernel vs reference on the GPU (tests/test_kernels_*_gpu.py): fp32 state 1e-3, bf16 outputs / state 1.6e-2
TOL = {torch.float32: 1e-3, torch.bfloat16: 1.6e-2, torch.float16: 1.6e-2}


# ---------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------


# do_bench's warm-up and measured milliseconds per timing: the headline and the grid, and the confirmation
# pass's longer ones (the 2026-12-02 sweep, docs/gpu/kperf_3, saw one launch's median move up to 2x between
# passes; the confirmation's median of CONFIRM_ROUNDS rounds is what chooses "best").
TIMING_MS = (10, 40)
CONFIRM_TIMING_MS = (25, 100)


class Timer:
    """do_bench medians on CUDA; one wall-clock call in the interpreter (--dry-run: times mean nothing)."""

    def __init__(self, dev: str):
        self.dev = dev
        self.copy_cache: dict[int, float] = {}

    def __call__(self, fn, *args, ms: tuple[int, int] = TIMING_MS) -> float:
        """Median microseconds of fn(*args); ``ms``: do_bench's (warm-up, measured) milliseconds."""
        fn(*args)  # compile outside the timing
        if self.dev == "cuda":
            torch.cuda.synchronize()
            return triton.testing.do_bench(lambda: fn(*args), warmup=ms[0], rep=ms[1],
                                           return_mode="median") * 1e3
        t0 = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t0) * 1e6

    def copy_us(self, nbytes: int) -> float:
        """Time of a torch copy moving `nbytes` (nbytes / 2 read, nbytes / 2 written), cached per size."""
        key = max(1 << 20, nbytes // 2) if self.dev == "cuda" else 1 << 10
        if key not in self.copy_cache:
            src = torch.empty(key, dtype=torch.uint8, device=self.dev).random_()
            dst = torch.empty_like(src)
            self.copy_cache[key] = self(dst.copy_, src)
            del src, dst
        return self.copy_cache[key] * (nbytes / 2) / key


def _row(timer: Timer, us: float, nbytes: int) -> dict:
    copy = timer.copy_us(nbytes)
    return {"us": round(us, 2), "bytes": int(nbytes), "copy_us": round(copy, 2),
            "frac_copy_bw": round(copy / us, 3) if us > 0 else None}


# ---------------------------------------------------------------------------------------------------------
# operator set-ups: (call(config kwargs) -> None, bytes, check(config kwargs) -> (max error, ok))
# ---------------------------------------------------------------------------------------------------------


def _m2_setup(op: str, shape, batch: int, T: int, sd: torch.dtype, dev: str, seed: int = 0):
    H, P, N, G = shape
    ckpt = op in ("m2_ckpt", "m2_flush")
    L = max(16, T) if ckpt else T
    k = {"m2_write": T - 1, "m2_nowrite": 0, "m2_ckpt": min(3, L - T), "m2_flush": L - T + 1}[op]
    gen = torch.Generator(device=dev).manual_seed(seed)  # inputs drawn on the device: batch 256 is 1 GB
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)
    u = lambda *s: torch.rand(*s, generator=gen, device=dev)
    bf = torch.bfloat16
    x, dt = r(batch, T, H, P).to(bf), (r(batch, T, H) * 0.5 - 1).to(bf)
    B, C = (r(batch, T, G, N) / N**0.5).to(bf), (r(batch, T, G, N) / N**0.5).to(bf)
    A = -torch.exp(u(H) * 2 - 1)
    D, dt_bias = r(H), u(H) - 0.5
    state = r(batch, H, P, N).to(sd)
    hist = mamba2.ReplayHistory.allocate(batch, L, H, P, G, N, dtype=bf, device=dev, checkpointing=ckpt)
    hist.x.copy_(r(*hist.x.shape))
    hist.B.copy_(r(*hist.B.shape) / N**0.5)
    hist.dt.copy_(u(*hist.dt.shape) * 0.9 + 0.1)
    hist.dA_cumsum.copy_(torch.cumsum(A[:, None] * hist.dt, dim=-1))
    slot_ids = torch.arange(batch, dtype=torch.int32, device=dev)
    pnat = torch.full((batch,), k, dtype=torch.int32, device=dev)
    bufidx = torch.zeros(batch, dtype=torch.int32, device=dev)
    out = torch.empty(batch, T, H, P, dtype=bf, device=dev)
    args = (x, dt, A, B, C, D, dt_bias, slot_ids)

    es, ei = torch.empty(0, dtype=sd).element_size(), 2
    state_b = batch * H * P * N * es
    io = (x.numel() + B.numel() + C.numel() + dt.numel() + out.numel()) * ei
    tok = H * P * ei + G * N * ei + 2 * H * 4  # one history token: x, B, dt', dA_cumsum
    writes = op in ("m2_write", "m2_flush")
    nbytes = state_b * (2 if writes else 1) + io + batch * (k + T) * tok
    if op == "m2_ckpt":
        nbytes += batch * k * (G * N * ei + 2 * H * 4)  # the pending tokens' B, dt', cumsum copied over

    def call(cfg, rounding=None):
        mamba2.replay_verify(state, *args, hist, pnat, bufidx, out=out, stochastic_rounding=rounding, **cfg)

    def check(cfg):
        n = min(batch, 8)
        res = []
        for fn, kw in ((mamba2.replay_verify, cfg), (mamba2.replay_verify_ref, {})):
            st = state[:n].clone()
            h = mamba2.ReplayHistory(*(t[:n].clone() for t in (hist.x, hist.B, hist.dt, hist.dA_cumsum)))
            o = fn(st, x[:n], dt[:n], A, B[:n], C[:n], D, dt_bias, slot_ids[:n], h, pnat[:n], bufidx[:n], **kw)
            res.append((o.float(), st.float()))
        err = max((res[0][0] - res[1][0]).abs().max().item(), (res[0][1] - res[1][1]).abs().max().item())
        tol = max(TOL[sd], TOL[torch.bfloat16]) * max(1.0, res[1][0].abs().max().item())
        return err, bool(err <= tol)

    return call, nbytes, check


def _gdn_setup(shape, batch: int, T: int, sd: torch.dtype, dev: str, seed: int = 0):
    H, HV, K, V = shape
    gen = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)
    bf = torch.bfloat16
    q, k, v = r(batch, T, H, K).to(bf), r(batch, T, H, K).to(bf), r(batch, T, HV, V).to(bf)
    g = -torch.nn.functional.softplus(r(batch, T, HV)) * 0.5
    beta = r(batch, T, HV).sigmoid().to(bf)
    state = (r(batch, HV, V, K) * 0.1).to(sd)
    hist = gdn.ReplayHistory.allocate(batch, T, H, HV, K, V, device=dev)
    hist.u.copy_(r(*hist.u.shape) * 0.1)
    hist.k.copy_(torch.nn.functional.normalize(r(*hist.k.shape), dim=-1))
    hist.g.copy_(-torch.rand(*hist.g.shape, generator=gen, device=dev).cumsum(2) * 0.3)
    slot_ids = torch.arange(batch, dtype=torch.int32, device=dev)
    pnat = torch.full((batch,), T, dtype=torch.int32, device=dev)
    bufidx = torch.zeros(batch, dtype=torch.int32, device=dev)
    nat = torch.full((batch,), T, dtype=torch.int32, device=dev)
    pn2, bi2 = allocate_replay_slots(batch, device=dev)
    out = torch.empty_like(v)
    args = (q, k, v, g, beta)

    es = torch.empty(0, dtype=sd).element_size()
    io = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta, out))
    tok = HV * V * 4 + H * K * 4 + HV * 4  # one history token: u, k, G (fp32)
    nbytes = 2 * batch * HV * V * K * es + io + batch * 2 * T * tok

    def call(cfg, rounding=None):
        gdn.replay_verify(*args, state, hist, slot_ids, pnat, bufidx, out=out, stochastic_rounding=rounding, **cfg)
        replay_advance(pn2, bi2, slot_ids, nat, T)  # on separate metadata: the verify keeps reading PNAT = T

    def check(cfg):
        n = min(batch, 8)
        res = []
        for fn, kw in ((gdn.replay_verify, cfg), (gdn.replay_verify_ref, {})):
            st = state[:n].clone()
            h = gdn.ReplayHistory(*(t[:n].clone() for t in (hist.u, hist.k, hist.g)))
            o = fn(*(a[:n] for a in args), st, h, slot_ids[:n], pnat[:n], bufidx[:n], **kw)
            res.append((o.float(), st.float()))
        err = max((res[0][0] - res[1][0]).abs().max().item(), (res[0][1] - res[1][1]).abs().max().item())
        tol = max(TOL[sd], TOL[torch.bfloat16]) * max(1.0, res[1][0].abs().max().item())
        return err, bool(err <= tol)

    return call, nbytes, check


def _setup(op, shape_name, batch, T, sd, dev, dry):
    if op == "gdn":
        return _gdn_setup((DRY_SHAPES_GDN if dry else SHAPES_GDN)[shape_name], batch, T, sd, dev)
    return _m2_setup(op, (DRY_SHAPES_M2 if dry else SHAPES_M2)[shape_name], batch, T, sd, dev)


def _configs(op: str) -> dict:
    """The configurations of sweep operator `op`: GDN_CONFIGS, or M2_CONFIGS less the checkpointing-only ones
    (M2_CKPT_ONLY_CONFIGS) on the per-step operators."""
    if op == "gdn":
        return GDN_CONFIGS
    if op in ENGINE_OPS["mamba2_checkpointing"]:
        return M2_CONFIGS
    return {k: v for k, v in M2_CONFIGS.items() if k not in M2_CKPT_ONLY_CONFIGS}


# ---------------------------------------------------------------------------------------------------------
# FlashInfer
# ---------------------------------------------------------------------------------------------------------


def _start_flashinfer_warmups(dtypes, T) -> list:
    """Background processes that JIT-compile FlashInfer's checkpointing_ssu (and selective_state_update) per
    state dtype at T, as tests/gpu/run_checks.sh does; [] when FlashInfer is not importable."""
    try:
        import flashinfer.mamba  # noqa: F401
    except Exception:  # noqa: BLE001 - reported with the rows
        return []
    procs = []
    for name in dtypes:
        code = ("import torch; from benchmarks.bench_mamba2 import bench_flashinfer as b; "
                f"print(b(2, {T}, torch.{name}, checkpointing=True))")
        # niced, with their compiler jobs capped: they run beside the headline's timings, whose launches a
        # CPU-starved timing process delays (do_bench's events then count the idle gap). The 2026-12-02 sweep
        # (docs/gpu/kperf_2) ran them at full priority: some headline times were up to 2.2x its ncu durations
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, preexec_fn=lambda: os.nice(19),
                                      env={**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", "4")}))
    return procs


# Seconds the sweep waits after the headline for FlashInfer's JIT warm-ups before it goes on without them (their
# rows then come after the grid).
FLASHINFER_EARLY_WAIT_S = 60.0


def _warmup_output(p, timeout: float) -> str:
    """The whole output of warm-up process ``p`` (subprocess.Popen with stdout piped), once it has ended,
    read with ``communicate`` (so a full pipe never stalls it) and kept on ``p`` for a later call. Raises
    subprocess.TimeoutExpired when it is still running after ``timeout`` seconds (retrying loses no output)."""
    if not hasattr(p, "sweep_output"):
        p.sweep_output = p.communicate(timeout=timeout)[0]
    return p.sweep_output


def warmups_done(procs, wait_s: float) -> bool:
    """Whether every warm-up process has ended, waiting up to ``wait_s`` seconds in all for those still
    running (their output is read meanwhile: `_warmup_output`). Kills nothing."""
    end = time.time() + wait_s
    for p in procs:
        try:
            _warmup_output(p, max(0.01, end - time.time()))
        except subprocess.TimeoutExpired:
            return False
    return True


def _flashinfer_rows(procs, dtypes, timer: Timer, nbytes_of: dict, deadline: float) -> dict:
    try:
        import flashinfer.mamba  # noqa: F401

        from benchmarks import bench_mamba2
    except Exception as e:  # noqa: BLE001
        return {"error": f"flashinfer not importable: {e!r}"}
    warm = {}
    for name, p in zip(dtypes, procs):
        try:
            out = _warmup_output(p, max(1.0, deadline - time.time()))
            warm[name] = {"rc": p.returncode, "log_tail": out[-2000:]}
        except subprocess.TimeoutExpired:
            p.kill()
            warm[name] = {"error": "JIT warm-up still running at the time budget; killed"}
    res = {"warmup": warm}
    for name in dtypes:
        if "error" in warm.get(name, {}):
            res[name] = {"error": warm[name]["error"]}
            continue
        b, T = HEADLINE["batch"], HEADLINE["T"]
        rows = bench_mamba2.bench_flashinfer(b, T, DTYPES[name], checkpointing=True)
        for key, val in list(rows.items()):
            if not isinstance(val, dict):
                continue
            op = ("m2_write" if key == bench_mamba2.FLASHINFER_PER_STEP else "m2_flush" if "flush" in key
                  else "m2_ckpt" if key.startswith("checkpointing_ssu_pnat") else None)
            if op and "us" in val:
                rows[key] = {**val, **{k: v for k, v in _row(timer, val["us"], nbytes_of[(op, name)]).items()
                                        if k != "us"}, "compared_with": op}
        res[name] = rows
    return res


def _gdn_peer_inputs(dev: str):
    """The GDN peers' headline inputs: ((H, HV, K, V), batch, T, r, q, k, v) with r(*shape) a seeded float32
    normal sampler on ``dev`` (drawn after q, k, v) and q, k [batch, T, H, K], v [batch, T, HV, V] in bf16."""
    H, HV, K, V = SHAPES_GDN[HEADLINE["shape"]]
    batch, T = HEADLINE["batch"], HEADLINE["T"]
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)
    bf = torch.bfloat16
    q, k, v = r(batch, T, H, K).to(bf), r(batch, T, H, K).to(bf), r(batch, T, HV, V).to(bf)
    return (H, HV, K, V), batch, T, r, q, k, v


def _fla_rows(dtypes, timer: Timer, dev: str) -> dict:
    """fla-core's fused recurrent gated-delta-rule kernel (kernels.gdn.fla.fla_fused_recurrent_rule) at the
    headline GDN shape, per state dtype: T tokens from the state (read in the state's dtype, L2 norm of q / k
    in the kernel, as our gdn rows), the final state written (fp32: fla's only output dtype). A decode
    kernel: no intermediate states and no replay history, so it is a lower bound for a verify with the
    same state traffic, not an MTP verify itself. {"error": why} where fla-core is not importable."""
    from kernels.gdn.fla import fla_fused_recurrent_rule

    fla_recurrent, why = fla_fused_recurrent_rule()
    if fla_recurrent is None:
        return {"error": f"fla-core not importable: {why}"}
    (H, HV, K, V), batch, T, r, q, k, v = _gdn_peer_inputs(dev)
    bf = torch.bfloat16
    g = -torch.nn.functional.softplus(r(batch, T, HV)) * 0.5
    beta = r(batch, T, HV).sigmoid().to(bf)
    io = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta)) + v.numel() * v.element_size()
    res = {}
    for name in dtypes:
        state = (r(batch, HV, V, K) * 0.1).to(DTYPES[name])

        def call(state=state):
            fla_recurrent(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, state_v_first=True)

        try:
            nbytes = state.numel() * (state.element_size() + 4) + io
            res[name] = {"fused_recurrent": {**_row(timer, timer(call), nbytes), "compared_with": "gdn"}}
        except Exception:  # noqa: BLE001 - a failing peer is a row
            res[name] = {"error": traceback.format_exc(limit=3)}
    return res


def _flashinfer_gdn_rows(timer: Timer, dev: str) -> dict:
    """FlashInfer's gated-delta-rule MTP kernel (flashinfer.gdn_decode.gated_delta_rule_mtp, CuTe DSL, sm_90+)
    at the headline GDN shape with an fp32 state (the only state dtype that entry point takes): "state_update"
    = T tokens from the state, the state written after them (the traffic of our gdn rows); "intermediate" =
    the rewind verify, the T per-token states written to a (B, T, HV, V, K) fp32 buffer, the state kept.
    Raw gates as its API takes them (a, b, A_log, dt_bias; q / k L2-normalised in the kernel). {"error": why}
    where FlashInfer does not import; a failing row holds its traceback."""
    try:
        from flashinfer.gdn_decode import gated_delta_rule_mtp
    except Exception as e:  # noqa: BLE001
        return {"error": f"flashinfer.gdn_decode not importable: {e!r}"}
    if gated_delta_rule_mtp is None:  # 0.7.2 binds the name to None where its CuTe DSL backend does not import
        return {"error": "flashinfer.gdn_decode.gated_delta_rule_mtp is None in this FlashInfer (its CuTe DSL "
                         "backend is not importable); fla-core's row is the GDN peer"}
    (H, HV, K, V), batch, T, r, q, k, v = _gdn_peer_inputs(dev)
    bf = torch.bfloat16
    a, b = r(batch, T, HV).to(bf), r(batch, T, HV).to(bf)
    A_log, dt_bias = r(HV) * 0.5, r(HV) * 0.1
    state = r(batch, HV, V, K) * 0.1
    idx = torch.arange(batch, dtype=torch.int32, device=dev)
    out = torch.empty_like(v)
    io = sum(t.numel() * t.element_size() for t in (q, k, v, a, b, out))
    res = {}
    for name, inter in (("state_update", None), ("intermediate", torch.empty(batch, T, HV, V, K, device=dev))):
        def call(inter=inter):
            gated_delta_rule_mtp(q, k, v, state, idx, A_log, a, dt_bias, b, output=out,
                                 intermediate_states_buffer=inter, disable_state_update=inter is not None,
                                 use_qk_l2norm=True)

        nbytes = state.numel() * 4 * (1 + (T if inter is not None else 1)) + io
        try:
            res[name] = {**_row(timer, timer(call), nbytes), "compared_with": "gdn"}
        except Exception:  # noqa: BLE001 - a failing peer is a row
            res[name] = {"error": traceback.format_exc(limit=3)}
    return {"float32": res}


def time_peers(res: dict, procs, dtypes, timer: Timer, dev: str, nbytes_of: dict, deadline_s: float,
               no_flashinfer: bool = False) -> None:
    """The peers at the headline into ``res`` ("flashinfer", "fla", "flashinfer_gdn"), none of them timed
    beside a FlashInfer JIT warm-up (kperf_4's fla rows, timed during the builds, read 1.2-1.5x slow): first
    waits for the warm-ups ``procs`` until ``deadline_s`` (time.time() seconds), then FlashInfer's rows (which
    kill a warm-up still building then), then fla-core's and FlashInfer's GDN rows. Mutates ``res``."""
    warmups_done(procs, max(0.0, deadline_s - time.time()))
    res["flashinfer"] = ({"error": "--no-flashinfer"} if no_flashinfer
                         else _flashinfer_rows(procs, dtypes, timer, nbytes_of, deadline_s))
    res["fla"] = _fla_rows(dtypes, timer, dev)
    res["flashinfer_gdn"] = {"error": "--no-flashinfer"} if no_flashinfer else _flashinfer_gdn_rows(timer, dev)


# ---------------------------------------------------------------------------------------------------------
# the engine's defaults table (kernels/replay_defaults.json, read by kernels.replay_defaults)
# ---------------------------------------------------------------------------------------------------------

# The sweep operators that time each engine launch path (kernels.replay_defaults.OPERATIONS). Per-step replay
# is timed by m2_write alone: after a request's first verify PNAT = num_accepted >= 1 (the bonus token is
# always accepted), so every later verify writes the state; a checkpointing launch is a no-flush step or a
# flush, both frequent, so both count.
ENGINE_OPS = {"mamba2_per_step": ("m2_write",), "mamba2_checkpointing": ("m2_ckpt", "m2_flush"), "gdn": ("gdn",)}
DEFAULTS_RULE = (
    "per (operation, state dtype, shape, grid batch): among the configurations that matched the reference at "
    "the headline for every sweep operator of the operation (ENGINE_OPS) and were timed, for each of them, at "
    "every grid T at which all of them were timed, the one with the least sum over those operators of the "
    "median over those T of the time; the headline rows alone decide a headline (shape, batch) where those T "
    "lack the headline T")


def _shape_class(family: str, dims) -> str:
    if family == "gdn":
        _, HV, K, V = dims
        return replay_defaults.gdn_shape_class(HV, V, K)
    H, P, N, _ = dims
    return replay_defaults.mamba2_shape_class(H, P, N)


def _grid_cost(by_cfg: dict, ops) -> tuple[list, dict]:
    """(T values, {config: sum over `ops` of the median over those T of its time in us}) of one (shape, batch)
    point, `by_cfg` = {config: {op: {T: us}}}. The T values are those at which every operator was timed (a
    budget-cut grid may have timed one operator at fewer); only configurations timed at each of them for
    every operator count."""
    per_op_ts = [{t for per_op in by_cfg.values() for t in per_op.get(op, {})} for op in ops]
    ts = sorted(set.intersection(*per_op_ts)) if per_op_ts else []
    if not ts:
        return [], {}
    cost = {c: round(sum(statistics.median(per_op[op][t] for t in ts) for op in ops), 2)
            for c, per_op in by_cfg.items() if all(op in per_op and set(ts) <= set(per_op[op]) for op in ops)}
    return ts, cost


def defaults_table(res: dict, *, source: str = "", date: str = "") -> dict:
    """The engine's defaults table (kernels.replay_defaults: {"schema", "provenance", "rows"}) from a sweep
    result `res` (the sweep_replay.json document): a pure function, by the rule `DEFAULTS_RULE`.

    Reads res["shapes"], res["headline"], res["headline_rows"] and res["grid"]; `source` / `date` (else
    res["date"]) go into the provenance. A (operation, dtype, shape, batch) without a usable measurement gets
    no row (the launchers then fall back, kernels.replay_defaults).
    """
    rows = {}
    for operation, ops in ENGINE_OPS.items():
        family = "gdn" if operation == "gdn" else "mamba2"
        configs = GDN_CONFIGS if family == "gdn" else M2_CONFIGS
        dtypes = sorted({k.split("/")[1] for k in res.get("headline_rows", {}) if k.split("/")[0] in ops})
        for dt in dtypes:
            heads = [res["headline_rows"].get(f"{op}/{dt}", {}) for op in ops]
            ok = sorted(c for c in configs if all(h.get(c, {}).get("ok") for h in heads))
            points: dict = {}  # (shape, batch) -> {config: {op: {T: us}}}
            for g in res.get("grid", []):
                if g.get("op") in ops and g.get("state_dtype") == dt and "us" in g and g.get("config") in ok:
                    cell = points.setdefault((g["shape"], g["batch"]), {}).setdefault(g["config"], {})
                    cell.setdefault(g["op"], {})[g["T"]] = g["us"]
            hl = res.get("headline", {})
            hl_point = (hl["shape"], hl["batch"]) if "shape" in hl else None
            hl_cells = {c: {op: {hl["T"]: h[c]["us"]} for op, h in zip(ops, heads)} for c in ok} if hl_point else {}
            if hl_point and hl_point not in points:
                points[hl_point] = hl_cells
            for (shape, batch), by_cfg in sorted(points.items()):
                ts, cost = _grid_cost(by_cfg, ops)
                if (shape, batch) == hl_point and (not cost or hl["T"] not in ts):
                    # the grid timed every operator only at other T (or none): the headline's confirmed rows
                    ts, cost = _grid_cost(hl_cells, ops)
                if not cost:
                    continue
                best = min(sorted(cost), key=cost.get)
                dims = res["shapes"][family][shape]
                rows[replay_defaults.key(operation, dt, _shape_class(family, dims), batch)] = {
                    "config": best, "kwargs": dict(configs[best]),
                    "evidence": {"sweep_ops": list(ops), "shape": shape, "T": ts, "cost_us": cost}}
    provenance = {"sweep_json": source, "date": date or res.get("date", ""), "device": res.get("device", ""),
                  "torch": res.get("torch", ""), "triton": res.get("triton", ""), "rule": DEFAULTS_RULE,
                  "backend_rule": BACKEND_RULE}
    return {"schema": replay_defaults.SCHEMA, "provenance": provenance, "rows": dict(sorted(rows.items())),
            "backends": _backends(res)}


BACKEND_RULE = (
    "per (operation, state dtype, headline shape): FlashInfer's checkpointing_ssu when the sum over the "
    "operation's sweep operators of its headline time (each FlashInfer call names the operator it is "
    "compared with) is below the least such sum of our configurations that matched the reference there; "
    "else Triton. Only operations with a FlashInfer time for every operator get a row")


def _backends(res: dict) -> dict:
    """The table's "backends" section (kernels.replay_defaults.default_backend) from a sweep result: per
    (operation, state dtype, shape class of the headline shape), "flashinfer" or "triton" by BACKEND_RULE,
    with the evidence (both sums, our configuration, the headline batch and T)."""
    out = {}
    hl = res.get("headline", {})
    if "shape" not in hl:
        return out
    for operation, ops in ENGINE_OPS.items():
        if operation == "gdn":
            continue  # FlashInfer's GDN kernels are not a backend of the engine (docs/kernel_performance.md)
        for dt, calls in sorted((res.get("flashinfer") or {}).items()):
            if not isinstance(calls, dict):
                continue
            theirs = {c["compared_with"]: c["us"] for c in calls.values()
                      if isinstance(c, dict) and "us" in c and c.get("compared_with") in ops}
            heads = [res.get("headline_rows", {}).get(f"{op}/{dt}", {}) for op in ops]
            ours = {c: sum(h[c]["us"] for h in heads) for c in M2_CONFIGS
                    if all(h.get(c, {}).get("ok") and "us" in h[c] for h in heads)}
            if set(theirs) != set(ops) or not ours:
                continue
            best = min(sorted(ours), key=ours.get)
            fi = round(sum(theirs.values()), 2)
            shape = _shape_class("mamba2", res["shapes"]["mamba2"][hl["shape"]])
            out[f"{operation}/{dt}/{shape}"] = {
                "backend": "flashinfer" if fi < ours[best] else "triton",
                "evidence": {"sweep_ops": list(ops), "flashinfer_us": fi, "triton_us": round(ours[best], 2),
                             "triton_config": best, "batch": hl["batch"], "T": hl["T"]}}
    return dict(sorted(out.items()))


# What a sweep_replay.json document has for `defaults_table` (older sweeps lack "date" and "defaults").
SWEEP_KEYS = {"shapes": dict, "headline": dict, "headline_rows": dict, "grid": list}


def load_sweep(path: str) -> dict:
    """The sweep_replay.json document at `path`, checked to be one (a JSON object with `SWEEP_KEYS`).

    Raises:
        UserError: a missing or unreadable file, malformed JSON, or JSON that is not a sweep_replay output.
    """
    fix = "give --from-json the sweep_replay.json that `python -m benchmarks.sweep_replay --out DIR` wrote"
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise UserError(f"--from-json {path}: cannot read it ({e.strerror or e})", fix) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--from-json {path}: not valid JSON ({e})", fix) from None
    if not isinstance(doc, dict):
        raise UserError(f"--from-json {path}: a JSON {type(doc).__name__}, not a sweep_replay output "
                        "(a JSON object)", fix)
    bad = [f"{k} (a JSON {'list' if t is list else 'object'})" for k, t in SWEEP_KEYS.items()
           if not isinstance(doc.get(k), t)]
    if bad:
        raise UserError(f"--from-json {path}: not a sweep_replay output: it lacks {', '.join(bad)}", fix)
    return doc


def defaults_from_json(path: str, *, date: str = "") -> dict:
    """`defaults_table` of the sweep at `path` (`load_sweep`), provenance date its "date" else `date`.

    Raises:
        UserError: `load_sweep`'s problems, a sweep whose rows `defaults_table` cannot read, or one that
            yields no row (writing it would leave the engine without defaults).
    """
    src = load_sweep(path)
    fix = "give --from-json a complete sweep_replay.json (a sweep that measured the headline and the grid)"
    try:
        doc = defaults_table(src, source=path, date=src.get("date") or date)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise UserError(f"--from-json {path}: a malformed sweep_replay output ({type(e).__name__}: {e})",
                        fix) from None
    if not doc["rows"]:
        raise UserError(f"--from-json {path}: the sweep yields no defaults row (no configuration matched the "
                        "reference and was timed at every grid T); nothing written", fix)
    return doc


def write_defaults(table: dict, path: str) -> None:
    """Write `table` (`defaults_table`) as JSON to `path` (kernels/replay_defaults.json for the engine).

    Raises:
        UserError: `path` cannot be written (a missing folder, read-only, a folder).
    """
    text = json.dumps(table, indent=1) + "\n"
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise UserError(f"--write-defaults {path}: cannot write it ({e.strerror or e})",
                        "give --write-defaults a file path in an existing, writable folder") from None


# ---------------------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------------------


def sweep(args, save=None) -> dict:
    """The sweep (module docstring) as one JSON document. ``save(res, stage)``, when given, is called with the
    document so far after the headline, after the confirmation and after each operator's grid, so that a run
    cut short (the device call's limit, a crash) keeps what it measured."""
    dev = "cpu" if args.dry_run else "cuda"
    save = save or (lambda res, stage: None)
    dry = args.dry_run
    timer = Timer(dev)
    t_start = time.time()
    deadline = t_start + args.budget_s
    dtypes = list(DTYPES) if not args.dtypes else args.dtypes.split(",")
    only = set(args.configs.split(",")) if args.configs else None
    procs = [] if (dry or args.no_flashinfer) else _start_flashinfer_warmups(dtypes, HEADLINE["T"])
    hb, hT = (2, 2) if dry else (HEADLINE["batch"], HEADLINE["T"])
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter, times mean nothing)",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
           "torch": torch.__version__, "triton": triton.__version__,
           "shapes": {"mamba2": DRY_SHAPES_M2, "gdn": DRY_SHAPES_GDN} if dry else {"mamba2": SHAPES_M2, "gdn": SHAPES_GDN},
           "headline": {**HEADLINE, "batch": hb, "T": hT}, "current": CURRENT, "headline_rows": {}, "best": {},
           "defaults": {}, "grid": [], "sr": {}, "skipped": []}
    nbytes_of = {}

    # 2. headline: every configuration, checked, then timed
    for op in OPS:
        for name in dtypes:
            sd = DTYPES[name]
            call, nbytes, check = _setup(op, "ws1", hb, hT, sd, dev, dry)
            nbytes_of[(op, name)] = nbytes
            rows = {}
            for cfg_name, cfg in _configs(op).items():
                if only and cfg_name not in only and cfg_name != CURRENT:
                    continue
                if cfg_name not in ALWAYS_TIMED and time.time() > deadline:
                    res["skipped"].append(f"headline {op}/{name}/{cfg_name}: time budget")
                    continue
                try:
                    err, ok = check(cfg)
                    row = _row(timer, timer(call, cfg), nbytes)
                    rows[cfg_name] = {**row, "max_err_vs_reference": err, "ok": ok}
                except Exception:  # noqa: BLE001 - a failing configuration is a row, not a crash
                    rows[cfg_name] = {"error": traceback.format_exc(limit=3)}
            res["headline_rows"][f"{op}/{name}"] = rows
            good = {k: v for k, v in rows.items() if v.get("ok")}
            res["best"][f"{op}/{name}"] = min(good, key=lambda k: good[k]["us"]) if good else None
            print(f"[{time.time() - t_start:5.0f} s] headline {op}/{name}: " + ", ".join(
                f"{k} {v['us']:.1f} us" if "us" in v else f"{k} error" for k, v in rows.items()), flush=True)
            if dev == "cuda":
                del call, check
                torch.cuda.empty_cache()

    save(res, "headline")
    # 3-4. the peers at the headline (FlashInfer's checkpointing_ssu / selective_state_update, fla-core's and
    # FlashInfer's GDN kernels), timed once FlashInfer's JIT warm-ups are over (they ran beside the headline;
    # `time_peers`): here when the warm-ups end within FLASHINFER_EARLY_WAIT_S, else after the grid, so that a
    # slow build does not eat the grid's budget (res["flashinfer_timed"] says which)
    if dry:
        res["fla"] = res["flashinfer_gdn"] = res["flashinfer"] = {"error": "--dry-run: no GPU"}
    elif args.no_flashinfer or warmups_done(procs, FLASHINFER_EARLY_WAIT_S):
        res["flashinfer_timed"] = "before the confirmation"
        time_peers(res, procs, dtypes, timer, dev, nbytes_of, time.time() + 60, args.no_flashinfer)
    # 4b. confirmation: the headline's leaders timed again now that nothing runs beside the sweep; the
    # stochastic-rounding rows and the grid use the confirmed choice
    res["confirm"] = confirm_headline(res, dtypes, hb, hT, timer, dev, dry)
    save(res, "confirmation")
    # 5. stochastic rounding cost (16-bit states, the confirmed best configuration of each state-writing
    # operator as chosen with a bf16 state)
    if "bfloat16" in dtypes:
        for op in SR_OPS:
            best = res["best"].get(f"{op}/bfloat16")
            if best is None:
                continue
            cfg = _configs(op)[best]
            for sr_name, sr_dtype in SR_DTYPES.items():
                try:
                    call, nbytes, _ = _setup(op, "ws1", hb, hT, sr_dtype, dev, dry)
                    sr = StochasticRounding.create(1234, device=dev)  # the default generator, "hash"
                    philox = StochasticRounding.create(1234, device=dev, generator="philox")
                    res["sr"][f"{op}/{sr_name}/{best}"] = {
                        "round_to_nearest": _row(timer, timer(call, cfg), nbytes),
                        "stochastic": _row(timer, timer(call, cfg, sr), nbytes),
                        "stochastic_philox": _row(timer, timer(call, cfg, philox), nbytes)}
                except Exception:  # noqa: BLE001
                    res["sr"][f"{op}/{sr_name}/{best}"] = {"error": traceback.format_exc(limit=3)}

    # 6. grid: the current kernel and the confirmed best of every operator that shares the op's engine launch
    # (ENGINE_OPS: m2_ckpt and m2_flush are one launch, so both bests are timed on both), which is what
    # `defaults_table` compares
    grid_T, grid_b = ((2,), (1, 2)) if dry else (GRID_T, GRID_BATCH)
    shapes = ("ws1",) if dry else ("ws1", "ws4")
    for op in OPS:
        print(f"[{time.time() - t_start:5.0f} s] grid {op}", flush=True)
        for name in dtypes:
            sd = DTYPES[name]
            names = grid_configs(res, op, name)
            for shape in shapes:
                for T in grid_T:
                    for batch in grid_b:
                        if time.time() > deadline:
                            res["skipped"].append(f"{op}/{name}/{shape}/T{T}/b{batch}: time budget")
                            continue
                        point = {"op": op, "state_dtype": name, "shape": shape, "T": T, "batch": batch}
                        try:
                            call, nbytes, _ = _setup(op, shape, batch, T, sd, dev, dry)
                        except Exception:  # noqa: BLE001
                            res["grid"].append({**point, "error": traceback.format_exc(limit=3)})
                            continue
                        # each configuration on its own: one that fails leaves the others timed at this point
                        # (else they would miss this T and `defaults_table` could not compare them here)
                        for cfg_name in names:
                            try:
                                us = timer(call, _configs(op)[cfg_name])
                                res["grid"].append({**point, "config": cfg_name, **_row(timer, us, nbytes)})
                            except Exception:  # noqa: BLE001
                                res["grid"].append({**point, "config": cfg_name,
                                                    "error": traceback.format_exc(limit=3)})
                        if dev == "cuda":
                            torch.cuda.empty_cache()
        save(res, f"grid {op}")

    if "flashinfer" not in res:  # the warm-ups were still building after the headline
        res["flashinfer_timed"] = "after the grid"
        time_peers(res, procs, dtypes, timer, dev, nbytes_of, max(deadline, time.time() + 60) + args.flashinfer_extra_s,
                   args.no_flashinfer)
    res["copy_bandwidth_GBps"] = {str(k * 2): round(2 * k / (us * 1e-6) / 1e9, 1)
                                  for k, us in sorted(timer.copy_cache.items())}
    res["wall_s"] = round(time.time() - t_start, 1)
    table = defaults_table(res)
    res["defaults"] = {k: v["config"] for k, v in table["rows"].items()}
    mark_headline_defaults(res, table)
    return res


def mark_headline_defaults(res: dict, table: dict) -> None:
    """Beside each headline row's configurations (res["headline_rows"]["<op>/<dtype>"]), the kernel the
    engine would run there with ``table`` (a ``defaults_table``): ``default`` = {"backend", "config", "us"}
    (FlashInfer's time where the table's backend is FlashInfer, else our default configuration's), and
    ``flashinfer`` = {"us"} where FlashInfer timed that operator. Mutates ``res``."""
    hl = res.get("headline", {})
    if "shape" not in hl:
        return
    for key, row in res.get("headline_rows", {}).items():
        op, dt = key.split("/")
        operation = next((name for name, ops in ENGINE_OPS.items() if op in ops), None)
        if operation is None:
            continue
        family = "gdn" if operation == "gdn" else "mamba2"
        shape = _shape_class(family, res["shapes"][family][hl["shape"]])
        fi = next((c["us"] for c in (res.get("flashinfer") or {}).get(dt, {}).values()
                   if isinstance(c, dict) and c.get("compared_with") == op and "us" in c), None)
        if fi is not None:
            row["flashinfer"] = {"us": fi}
        backend = (table.get("backends") or {}).get(f"{operation}/{dt}/{shape}", {}).get("backend", "triton")
        cfg = (table["rows"].get(replay_defaults.key(operation, dt, shape, hl["batch"])) or {}).get("config")
        if backend == "flashinfer" and fi is not None:
            row["default"] = {"backend": "flashinfer", "config": "checkpointing_ssu", "us": fi}
        elif cfg is not None and "us" in row.get(cfg, {}):
            row["default"] = {"backend": "triton", "config": cfg, "us": row[cfg]["us"]}


def grid_configs(res: dict, op: str, state_dtype: str) -> list[str]:
    """The configurations the grid times for sweep operator `op` at `state_dtype`: the current kernel and the
    best of every operator of the engine launch `op` belongs to (ENGINE_OPS; an operator outside it, e.g.
    m2_nowrite, its own best), sorted. `defaults_table` compares, per engine launch, only configurations timed
    for all its operators, so each operator's grid must time the other operators' bests too."""
    group = next((ops for ops in ENGINE_OPS.values() if op in ops), (op,))
    return sorted({CURRENT} | {b for o in group if (b := res["best"].get(f"{o}/{state_dtype}"))})


# Headline configurations re-timed by `confirm_headline` per (operator, state dtype): the fastest few, and rounds.
CONFIRM_TOP, CONFIRM_ROUNDS = 3, 3


def confirm_headline(res: dict, dtypes, batch: int, T: int, timer: Timer, dev: str, dry: bool) -> dict:
    """Re-time the headline's fastest correct configurations (CONFIRM_TOP of them, plus the current kernel) of
    each operator and state dtype, CONFIRM_ROUNDS rounds interleaved, once nothing runs beside the sweep (the
    FlashInfer warm-ups ended): the median of each configuration's times replaces its headline time (the first
    kept as ``us_first``). "best" is then the fastest confirmed configuration, and never one timed only once:
    while some configuration not yet re-timed has a headline time below the fastest confirmed time, it is
    re-timed the same way too (the headline's picks can be lucky timings). A changed choice is printed and
    kept as ``best_first``. The median, not the least: the 2026-12-02 sweep (docs/gpu/kperf_3) saw single
    timings of one launch differ up to 2x between passes, and the least keeps a lucky one. Each round's timing
    measures longer than the headline's (CONFIRM_TIMING_MS).

    Mutates res["headline_rows"] and res["best"]; returns {"op/dtype": {config: [us per round]}} (every
    configuration re-timed). Runs before the stochastic-rounding rows and the grid, which use the confirmed
    choice."""
    out = {}
    for key, rows in res["headline_rows"].items():
        op, name = key.split("/")
        if name not in dtypes:
            continue
        good = sorted((k for k, v in rows.items() if v.get("ok")), key=lambda k: rows[k]["us"])
        leaders = good[:CONFIRM_TOP] + ([CURRENT] if CURRENT in good[CONFIRM_TOP:] else [])
        if not leaders:
            continue
        call, nbytes, _ = _setup(op, "ws1", batch, T, DTYPES[name], dev, dry)
        times: dict = {}
        pending = leaders
        while pending:  # re-time, until the fastest row is a re-timed one
            for c in pending:
                times[c] = []
            for _ in range(CONFIRM_ROUNDS):
                for c in pending:
                    times[c].append(round(timer(call, _configs(op)[c], ms=CONFIRM_TIMING_MS), 2))
            for c in pending:
                first = rows[c]["us"]
                rows[c].update({**_row(timer, statistics.median(times[c]), nbytes), "us_first": first})
            best = min(good, key=lambda k: rows[k]["us"])
            pending = [] if best in times else [best]
        if best != res["best"].get(key):
            res.setdefault("best_first", {})[key] = res["best"].get(key)
            print(f"confirm {key}: best {res['best'].get(key)} -> {best} "
                  f"({', '.join(f'{c} {statistics.median(ts):.1f}' for c, ts in times.items())} us)", flush=True)
        res["best"][key] = best
        out[key] = times
        if dev == "cuda":
            del call
            torch.cuda.empty_cache()
    return out


def plot(res: dict, path: str) -> None:
    """One figure: fraction of copy bandwidth against batch, per operator (T = 4, ws1), per config and dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(4 * len(OPS), 3.6), sharey=True)
    T = 4 if any(r.get("T") == 4 for r in res["grid"]) else min((r["T"] for r in res["grid"] if "T" in r), default=0)
    for ax, op in zip(axes, OPS):
        rows = [r for r in res["grid"] if r.get("op") == op and r.get("shape") == "ws1" and r.get("T") == T
                and "us" in r]
        for key in sorted({(r["config"], r["state_dtype"]) for r in rows}):
            pts = sorted((r["batch"], r["frac_copy_bw"]) for r in rows if (r["config"], r["state_dtype"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} (T = {T}, ws1)")
        ax.set_xlabel("batch")
        ax.axhline(0.85, color="grey", lw=0.8, ls="--")
        if rows:  # an operator none of whose configurations ran has no line to name
            ax.legend(fontsize=7)
    axes[0].set_ylabel("fraction of copy bandwidth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(res: dict) -> str:
    """The headline rows: per operator and state dtype, current vs best vs FlashInfer."""
    lines = [f"{'operator/state':22s} {'current us':>10s} {'frac':>5s} {'best':>12s} {'us':>8s} {'frac':>5s} "
             f"{'floor us':>8s}"]
    for key, rows in res["headline_rows"].items():
        cur, best = rows.get(CURRENT, {}), res["best"].get(key)
        b = rows.get(best, {}) if best else {}
        lines.append(f"{key:22s} {cur.get('us', float('nan')):10.1f} {cur.get('frac_copy_bw') or 0:5.2f} "
                     f"{str(best):>12s} {b.get('us', float('nan')):8.1f} {b.get('frac_copy_bw') or 0:5.2f} "
                     f"{cur.get('copy_us', float('nan')):8.1f}")
    fi = res.get("flashinfer", {})
    for name in DTYPES:
        for k, v in (fi.get(name) or {}).items():
            if isinstance(v, dict) and "us" in v:
                lines.append(f"flashinfer {k}/{name}: {v['us']:.1f} us" +
                             (f" frac {v['frac_copy_bw']:.2f}" if v.get("frac_copy_bw") else ""))
    for name, rows in (res.get("fla") or {}).items():
        if isinstance(rows, dict) and "fused_recurrent" in rows:
            v = rows["fused_recurrent"]
            lines.append(f"fla fused_recurrent/{name}: {v['us']:.1f} us frac {v['frac_copy_bw']:.2f}")
    for k, v in ((res.get("flashinfer_gdn") or {}).get("float32") or {}).items():
        if "us" in v:
            lines.append(f"flashinfer gated_delta_rule_mtp {k}/float32: {v['us']:.1f} us frac {v['frac_copy_bw']:.2f}")
    for k, v in res["sr"].items():
        if "stochastic" in v:
            lines.append(f"SR {k}: {v['round_to_nearest']['us']:.1f} -> {v['stochastic']['us']:.1f} us "
                         f"(philox {v.get('stochastic_philox', {}).get('us', float('nan')):.1f} us)")
    if res["skipped"]:
        lines.append(f"skipped (time budget): {len(res['skipped'])} grid points")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Nsight Compute
# ---------------------------------------------------------------------------------------------------------


def flashinfer_ncu_specs() -> list[str]:
    """The FlashInfer launches profiled beside ours (``fi:TAG:DTYPE``, TAG a result name of
    benchmarks.bench_mamba2.bench_flashinfer at the headline): checkpointing_ssu with 3 pending tokens and with
    a flush (its ring of 16 + T rows), for both state dtypes."""
    from benchmarks.bench_mamba2 import flashinfer_checkpointing_cases

    return [f"fi:{tag}:{d}" for _, tag in flashinfer_checkpointing_cases(HEADLINE["T"]) for d in DTYPES]


def _profile_once(fn) -> float:
    """bench_flashinfer's timer under Nsight Compute: one warm call, then one call inside the profiled range."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0.0


def ncu_worker(spec: str) -> None:
    """One profiled launch: OP:CONFIG:DTYPE[:rn|sr] at the headline, compiled (and warmed) before the profiled
    range (``sr``: with stochastic rounding, the default generator, as the sweep's SR rows; DTYPE may then be
    float16); OP "fi": FlashInfer's call named CONFIG (flashinfer_ncu_specs), its JIT build warm from the
    sweep."""
    op, cfg_name, name, *mode = spec.split(":")
    if op == "fi":
        from benchmarks.bench_mamba2 import bench_flashinfer

        got = bench_flashinfer(HEADLINE["batch"], HEADLINE["T"], DTYPES[name], checkpointing=True,
                               timer=_profile_once, only=cfg_name)
        print(json.dumps(got), flush=True)
        if cfg_name not in got:
            raise SystemExit(f"FlashInfer's {cfg_name} did not run: {got}")
        return
    call, _, _ = _setup(op, "ws1", HEADLINE["batch"], HEADLINE["T"], {**DTYPES, **SR_DTYPES}[name], "cuda", False)
    cfg = _configs(op)[cfg_name]
    rounding = StochasticRounding.create(1234, device="cuda") if mode == ["sr"] else None
    call(cfg, rounding)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call(cfg, rounding)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def ncu(args) -> int:
    exe = find_ncu("sweep_replay --ncu")
    if args.sweep and not os.path.exists(args.sweep):
        print(f"sweep_replay --ncu: no sweep JSON at {args.sweep}; profiling the current kernel and 'mma' "
              "instead of the sweep's best configurations", file=sys.stderr)
    if args.sweep and os.path.exists(args.sweep):
        best = load_sweep(args.sweep).get("best")
        if not isinstance(best, dict):
            raise UserError(f"--sweep {args.sweep}: a sweep_replay output without its \"best\" configurations",
                            "give --sweep the sweep_replay.json of a finished sweep (`--out DIR` writes it)")
        specs = sorted({f"{k.split('/')[0]}:{v}:{k.split('/')[1]}" for k, v in best.items() if v}
                       | {f"{op}:{CURRENT}:{d}" for op in OPS for d in DTYPES})
    else:
        specs = [f"{op}:{c}:{d}" for op in OPS for c in (CURRENT, "mma") for d in DTYPES]
    extra = [c for c in args.ncu_configs.split(",") if c]
    specs += [f"{op}:{c}:{d}" for c in extra for op in OPS if c in _configs(op) for d in DTYPES
              if f"{op}:{c}:{d}" not in specs]
    if not args.no_flashinfer:
        specs += flashinfer_ncu_specs()
    if args.dtypes:
        specs = [sp for sp in specs if sp.split(":")[2] in args.dtypes.split(",")]
    if args.quick and not args.dtypes:
        specs = [sp for sp in specs if sp.endswith(":bfloat16")]
    if args.ncu_sr_only:
        specs = []
    if args.ncu_sr:  # the SR cost rows: each state-writing operator's bf16 best, both 16-bit dtypes, RN and SR
        best = load_sweep(args.sweep).get("best", {}) if args.sweep and os.path.exists(args.sweep) else {}
        cfgs = {op: [best.get(f"{op}/bfloat16") or CURRENT] for op in SR_OPS}
        for c in (c for c in args.ncu_sr_configs.split(",") if c):  # more pairs: another config's SR cost
            for op in SR_OPS:
                if c in _configs(op) and c not in cfgs[op]:
                    cfgs[op].append(c)
        specs += [f"{op}:{c}:{d}:{m}" for op in SR_OPS for c in cfgs[op] for d in SR_DTYPES for m in ("rn", "sr")]
    os.makedirs(args.out, exist_ok=True)
    rc = 0
    summary = {}
    for spec in specs:
        op, cfg, name, *mode = spec.split(":")
        kernel = ("regex:checkpointing_ssu|selective_state_update" if op == "fi" else
                  "regex:_gdn_replay" if op == "gdn" else "regex:_replay_verify")
        cmd = [exe, "--clock-control", "none", "--section", "SpeedOfLight", "--section", "Occupancy",
               "--section", "LaunchStats", "--profile-from-start", "off", "-k", kernel, "--launch-count", "1",
               sys.executable, "-m", "benchmarks.sweep_replay", "--ncu-worker", spec]
        p = subprocess.run(cmd, capture_output=True, text=True)
        path = os.path.join(args.out, "_".join(["ncu", op, cfg, name, *mode]) + ".txt")
        with open(path, "w") as f:
            f.write(" ".join(cmd) + "\n" + p.stdout + p.stderr)
        summary[spec] = {"exit": p.returncode, **parse_ncu(p.stdout)}
        got = summary[spec]
        print(f"{spec}: exit {p.returncode} -> {path}; " + ", ".join(
            f"{k} {got[k]['value']:g} {got[k]['unit']}".rstrip() for k in NCU_METRICS if k in got), flush=True)
        if op != "fi":  # FlashInfer's rows are a peer's: their failure is reported, not the run's
            rc = rc or p.returncode
    with open(os.path.join(args.out, "ncu_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return rc


@exits_on_user_error
def main(argv=None) -> int:
    """The command line (module docstring); a problem with the user's input prints `error:` / `fix:` lines
    (registry.errors.UserError) and returns 2."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=False, help="output folder (JSON, plot, ncu reports)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="stop starting grid points after this many seconds (FlashInfer rows come after)")
    ap.add_argument("--flashinfer-extra-s", type=float, default=60.0,
                    help="how long past the budget to wait for FlashInfer's JIT warm-up")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--dtypes", default="", help="state dtypes, comma-separated (default float32,bfloat16)")
    ap.add_argument("--configs", default="", help="only these configurations (and the current one)")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter smoke run at tiny shapes")
    ap.add_argument("--ncu", action="store_true", help="profile the chosen kernels with Nsight Compute")
    ap.add_argument("--sweep", default="", help="with --ncu: a sweep_replay.json whose best configs to profile")
    ap.add_argument("--ncu-configs", default="", metavar="LIST",
                    help="with --ncu: also profile these configurations (comma-separated) on every operator that "
                         "has them, e.g. cuda,cuda_r96")
    ap.add_argument("--quick", action="store_true",
                    help="a short first look: QUICK_CONFIGS, --budget-s 150, --flashinfer-extra-s 0 (bf16 with --ncu)")
    ap.add_argument("--write-defaults", default="", metavar="PATH",
                    help="also write the engine's defaults table (kernels/replay_defaults.json) from the sweep")
    ap.add_argument("--from-json", default="", metavar="SWEEP_JSON",
                    help="with --write-defaults: no sweep, the table from this sweep_replay.json (CPU)")
    ap.add_argument("--source-date", default="",
                    help="the provenance date of --from-json when its JSON has no 'date' (older sweeps)")
    ap.add_argument("--ncu-sr", action="store_true",
                    help="with --ncu: also profile the stochastic-rounding rows (each state-writing operator's "
                         "bf16 best, bf16 and fp16 state, round to nearest and stochastic)")
    ap.add_argument("--ncu-sr-configs", default="", metavar="LIST",
                    help="with --ncu-sr: also these configurations' pairs (comma-separated), on every "
                         "state-writing operator that has them")
    ap.add_argument("--ncu-sr-only", action="store_true",
                    help="with --ncu-sr: only the stochastic-rounding pairs (not the best / current kernels)")
    ap.add_argument("--ncu-worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.from_json:
        if not args.write_defaults:
            ap.error("--from-json needs --write-defaults PATH")
        if args.ncu or args.ncu_configs or args.ncu_sr:
            ap.error("--from-json writes the defaults table from a committed sweep and runs nothing: drop "
                     "--ncu / --ncu-configs / --ncu-sr (profile with `--ncu --sweep JSON` on the GPU)")
        doc = defaults_from_json(args.from_json, date=args.source_date)
        write_defaults(doc, args.write_defaults)
        print(f"{args.write_defaults}: {len(doc['rows'])} rows from {args.from_json}")
        return 0
    if args.quick:
        args.configs = args.configs or ",".join(QUICK_CONFIGS)
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        if "--budget-s" not in given:
            args.budget_s = 150.0
        if "--flashinfer-extra-s" not in given:
            args.flashinfer_extra_s = 0.0
    if args.ncu_worker:
        ncu_worker(args.ncu_worker)
        return 0
    if not args.out:
        ap.error("--out DIR is required")
    bad = [d for d in args.dtypes.split(",") if d and d not in DTYPES]
    if bad:
        ap.error(f"--dtypes {bad}: choose from {list(DTYPES)}")
    for flag, names in (("--configs", args.configs), ("--ncu-configs", args.ncu_configs),
                        ("--ncu-sr-configs", args.ncu_sr_configs)):
        unknown = [c for c in names.split(",") if c and c not in M2_CONFIGS and c not in GDN_CONFIGS]
        if unknown:
            ap.error(f"{flag} {unknown}: not among {sorted(set(M2_CONFIGS) | set(GDN_CONFIGS))}")
    if args.ncu_configs and not args.ncu:
        ap.error("--ncu-configs is an option of --ncu (the sweep itself takes --configs)")
    if (args.ncu_sr_configs or args.ncu_sr_only) and not args.ncu_sr:
        ap.error("--ncu-sr-configs / --ncu-sr-only shape --ncu-sr's pairs: give --ncu --ncu-sr too")
    if args.ncu_sr and not args.ncu:
        ap.error("--ncu-sr is an option of --ncu (the sweep itself times the stochastic-rounding rows)")
    if args.ncu:
        if not torch.cuda.is_available():
            ap.error("--ncu: no CUDA GPU here: Nsight Compute profiles the kernels on one; run it on the GPU "
                     "machine (python -m benchmarks.sweep_replay --ncu --out DIR)")
        return ncu(args)
    if args.dry_run:
        from kernels._common import interpreter_active

        if not interpreter_active():
            ap.error("--dry-run runs the kernels in Triton's interpreter: TRITON_INTERPRET=1 python -m "
                     "benchmarks.sweep_replay --dry-run --out DIR")
    elif not torch.cuda.is_available():
        ap.error("no CUDA GPU here: the sweep times the kernels on one; run it on the GPU machine, or smoke-test "
                 "it on the CPU with TRITON_INTERPRET=1 python -m benchmarks.sweep_replay --dry-run --out DIR")
    os.makedirs(args.out, exist_ok=True)
    partial = os.path.join(args.out, "sweep_replay.partial.json")
    if os.path.exists(partial):  # an earlier run's: this run's replaces it after its headline
        os.remove(partial)

    def save(res: dict, stage: str) -> None:  # what a cut-short run keeps (its "partial": the last stage done)
        with open(partial + ".tmp", "w") as f:
            json.dump({**res, "partial": stage}, f, indent=1)
        os.replace(partial + ".tmp", partial)

    res = sweep(args, save)
    with open(os.path.join(args.out, "sweep_replay.json"), "w") as f:
        json.dump(res, f, indent=1)
    if os.path.exists(partial):
        os.remove(partial)
    plot(res, os.path.join(args.out, "sweep_replay.png"))
    print(table(res))
    if args.write_defaults:
        write_defaults(defaults_table(res, source=os.path.join(args.out, "sweep_replay.json")), args.write_defaults)
        print(f"{args.write_defaults}: the engine's defaults ({len(res['defaults'])} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
