"""sm_90 compile report of every replay / rewind kernel variant, on a machine without a GPU.

    python -m benchmarks.compile_report [--out report.json] [--sass DIR]

Each kernel is compiled through its real launcher (so Triton's argument specialisation applies: strides of 1
become constants, 16-byte alignment is known, which decides vectorised and cp.async loads) against a stand-in
driver that reports an sm_90 target and launches nothing; tensors are CPU tensors of the real shapes at batch 2.
Reported per kernel: registers and stack bytes per thread and shared memory (cuobjdump -res-usage: spills show
as STACK > 0), the SASS instruction count and its most frequent opcodes (HMMA = tensor cores, SHFL = the
cross-lane reductions, LDGSTS = cp.async pipelined loads). Shapes: Super V3 mixer (128 x 64 x 128, 8 groups)
and Qwen3-Next GDN (16 / 32 heads of 128 x 128), T = 4, bf16 inputs; `SR_CONFIGS` with stochastic rounding
(`_sr` rows) and with an fp16 state (`_f16`); and the stochastic-rounding rule alone
(`rule_<bf16|f16>_<rn|sr>`: 8 elements per thread, so (sr - rn) / 8 is its instructions per element).

--pair-gemv: instead, the quantized per-pair GEMVs (the engine's routed experts at decode: kernels/quant/
nvfp4.py's and block_fp8.py's ``_launch_pair``) at Super V3's NVFP4 and Qwen3-Next's block-FP8 expert shapes,
per launch setting (kernels/moe_gemv.py PAIR_LAUNCH: warps, num_stages; the NVFP4 decode and activation load
variants), with each kernel's SASS opcodes; and the marginal cost of a weight: the same kernel compiled at two
tile sizes (nvfp4.PAIR_TILE_WEIGHTS 8192 and 16384: one K step decodes twice the weights per thread, the rest
of the kernel is the same), (instructions at 16384 - at 8192) / (the extra weights per thread), overall and
per opcode class (`OPCODE_CLASSES`); and, per kernel, ``loop_per_weight``: the K loop's body (`loop_body`: run
once per K step, never unrolled) over the weights a thread decodes per step, the dynamic cost at that tile,
per-step overheads included. These are thread instructions per weight: times the weights a step reads,
divided by 32 threads per warp instruction and by the SMs' issue rate (4 warp instructions per clock per SM),
it is the issue time below which the kernel cannot go, beside the weight-read floor. Under "cuda", the same
loop count for the CUDA per-pair kernels (kernels/quant/pair_gemv.cu, built by nvcc: `cuda_pair_report`).

Triton internals (the launch path, the driver object) are used best effort; the GPU machine's Triton
version may compile somewhat differently.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as _driver
from triton.runtime.jit import JITFunction

from kernels.rounding import stochastic_round

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Sm90Driver:
    """Stands in for the CUDA driver: an sm_90 target, device 0, stream 0."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _install() -> list:
    """Compile instead of launching; returns the list the compiled kernels are appended to."""
    compiled = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    _driver.set_active(_Sm90Driver())
    JITFunction.run = compile_only
    for m in list(sys.modules.values()):  # the launchers' interpreter / CPU-tensor checks
        if getattr(m, "__name__", "").startswith("kernels"):
            if hasattr(m, "interpreter_active"):
                m.interpreter_active = lambda: False
            if hasattr(m, "check_launchable"):
                m.check_launchable = lambda *a, **k: None
    return compiled


def _usage(kernel, top: int = 12) -> tuple[dict, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True).stdout
    return _sass_usage(res, sass, top), sass


def _sass_usage(res: str, sass: str, top: int) -> dict:
    """Registers, stack and shared bytes (cuobjdump -res-usage text ``res``) and the opcode counts of one
    kernel's SASS listing ``sass``."""
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?", line)
        if m:
            ops[m.group(2) + (m.group(3) or "")] += 1
    get = lambda key: int(re.search(key + r":(\d+)", res).group(1))
    return {"REG": get("REG"), "STACK": get("STACK"), "SHARED": get("SHARED"),
            "instructions": sum(ops.values()), "top_opcodes": dict(ops.most_common(top))}


@triton.jit
def _rule_kernel(x_ptr, bits_ptr, out_ptr, SR: tl.constexpr, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """The rounding rule alone: BLOCK fp32 values -> the 16-bit dtype of out_ptr, stochastically (SR, with the
    given 16 random bits per element) or to nearest (the store's convert)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    if SR:
        x = stochastic_round(x, tl.load(bits_ptr + offs), IS_BF16)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty))


RULE_BLOCK, RULE_WARPS = 1024, 4  # 8 elements per thread: (instructions with SR - without) / 8 = per element
# Mamba2 configurations compiled with stochastic rounding too (bf16 and fp16 states; docs/gpu/kperf_8)
SR_CONFIGS = ("mma_st3", "mma_split3", "mma_c16_r80")


def report(sass_dir: str | None = None) -> dict:
    from benchmarks.replay_configs import GDN_CONFIGS, M2_CONFIGS
    from kernels import gdn, mamba2
    from kernels.commit import allocate_replay_slots, replay_advance, rewind_commit
    from kernels.rounding import StochasticRounding

    compiled = _install()  # after the kernel modules are imported: it patches their launch checks

    res = {}

    def record(name, fn, *args, **kwargs):
        compiled.clear()
        try:
            fn(*args, **kwargs)
            res[name], sass = _usage(compiled[-1])
            if sass_dir:
                with open(os.path.join(sass_dir, f"{name}.sass"), "w") as f:
                    f.write(sass)
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a row with its error
            res[name] = {"error": repr(e)[:500]}

    # the stochastic-rounding rule alone (rule_<dtype>_<rn|sr>): its instructions per element, no kernel around it
    xs, bits = torch.zeros(RULE_BLOCK), torch.zeros(RULE_BLOCK, dtype=torch.int32)
    for dt16, tag in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        for on in (False, True):
            record(f"rule_{tag}_{'sr' if on else 'rn'}", lambda on=on, dt16=dt16: _rule_kernel[(1,)](
                xs, bits, torch.zeros(RULE_BLOCK, dtype=dt16), SR=on, IS_BF16=dt16 == torch.bfloat16,
                BLOCK=RULE_BLOCK, num_warps=RULE_WARPS))

    B, T, bf = 2, 4, torch.bfloat16
    H, P, N, G = 128, 64, 128, 8
    x, dt = torch.zeros(B, T, H, P, dtype=bf), torch.zeros(B, T, H, dtype=bf)
    Bm, C = torch.zeros(B, T, G, N, dtype=bf), torch.zeros(B, T, G, N, dtype=bf)
    A, D, dtb = torch.zeros(H), torch.zeros(H), torch.zeros(H)
    slot = torch.arange(B, dtype=torch.int32)
    pnat, bi = allocate_replay_slots(B, device="cpu")
    sr = StochasticRounding.create(0, device="cpu")
    for sd in (torch.float32, torch.bfloat16):
        tag = "f32" if sd == torch.float32 else "bf16"
        state = torch.zeros(B, H, P, N, dtype=sd)
        inter = torch.zeros(B, T, H, P, N, dtype=sd)
        record(f"m2_rewind_verify_{tag}", mamba2.selective_state_update,
            state, x, dt, A, Bm, C, D, dtb, slot, intermediate_states=inter, intermediate_state_indices=slot)
        record(f"m2_decode_{tag}", mamba2.selective_state_update,
            state, x[:, :1], dt[:, :1], A, Bm[:, :1], C[:, :1], D, dtb, slot)
        record(f"rewind_commit_{tag}", rewind_commit, state, inter, slot, pnat, intermediate_state_indices=slot)
        for ckpt in (False, True):
            hist = mamba2.ReplayHistory.allocate(B, 16 if ckpt else T, H, P, G, N, dtype=bf, device="cpu",
                                                 checkpointing=ckpt)
            for cfg_name, cfg in M2_CONFIGS.items():
                if cfg["variant"] == "cuda":  # not a Triton kernel: `nvcc -Xptxas -v` reports its registers
                    continue
                record(f"m2_{'ckpt' if ckpt else 'replay'}_{cfg_name}_{tag}", mamba2.replay_verify,
                    state, x, dt, A, Bm, C, D, dtb, slot, hist, pnat, bi, **cfg)
            if sd == torch.bfloat16:
                for v in ("fma", "mma"):
                    record(f"m2_{'ckpt' if ckpt else 'replay'}_{v}_{tag}_sr", mamba2.replay_verify,
                        state, x, dt, A, Bm, C, D, dtb, slot, hist, pnat, bi, variant=v, stochastic_rounding=sr)
    # fp16 state: the write variants rounded to nearest and stochastically (the fp16 rule's own cost)
    state = torch.zeros(B, H, P, N, dtype=torch.float16)
    for ckpt in (False, True):
        hist = mamba2.ReplayHistory.allocate(B, 16 if ckpt else T, H, P, G, N, dtype=bf, device="cpu",
                                             checkpointing=ckpt)
        for v in ("fma", "mma"):
            for rounding, suffix in ((None, ""), (sr, "_sr")):
                record(f"m2_{'ckpt' if ckpt else 'replay'}_{v}_f16{suffix}", mamba2.replay_verify,
                    state, x, dt, A, Bm, C, D, dtb, slot, hist, pnat, bi, variant=v, stochastic_rounding=rounding)
    # stochastic rounding at the configurations kperf_8 profiled (each operator's best, the engine's defaults):
    # the bf16 rows rounded to nearest are the loop's above, m2_<layout>_<config>_bf16
    for dt16, tag in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        state = torch.zeros(B, H, P, N, dtype=dt16)
        for ckpt in (False, True):
            hist = mamba2.ReplayHistory.allocate(B, 16 if ckpt else T, H, P, G, N, dtype=bf, device="cpu",
                                                 checkpointing=ckpt)
            for cfg_name in SR_CONFIGS:
                for rounding, suffix in (((sr, "_sr"),) if tag == "bf16" else ((None, ""), (sr, "_sr"))):
                    record(f"m2_{'ckpt' if ckpt else 'replay'}_{cfg_name}_{tag}{suffix}", mamba2.replay_verify,
                        state, x, dt, A, Bm, C, D, dtb, slot, hist, pnat, bi, stochastic_rounding=rounding,
                        **M2_CONFIGS[cfg_name])
    record("replay_advance", replay_advance, pnat, bi, slot, pnat, T)

    Hk, HV, K, V = 16, 32, 128, 128
    q, k = torch.zeros(B, T, Hk, K, dtype=bf), torch.zeros(B, T, Hk, K, dtype=bf)
    v, g, beta = torch.zeros(B, T, HV, V, dtype=bf), torch.zeros(B, T, HV), torch.zeros(B, T, HV, dtype=bf)
    for sd in (torch.float32, torch.bfloat16):
        tag = "f32" if sd == torch.float32 else "bf16"
        state = torch.zeros(B, HV, V, K, dtype=sd)
        inter = torch.zeros(B, T, HV, V, K, dtype=sd)
        record(f"gdn_rewind_verify_{tag}", gdn.fused_recurrent_gated_delta_rule,
            q, k, v, g, beta, state, slot, update_state=False, intermediate_states=inter)
        hist = gdn.ReplayHistory.allocate(B, T, Hk, HV, K, V, device="cpu")
        for cfg_name, cfg in GDN_CONFIGS.items():
            record(f"gdn_replay_{cfg_name}_{tag}", gdn.replay_verify,
                q, k, v, g, beta, state, hist, slot, pnat, bi, **cfg)
        if sd == torch.bfloat16:
            for var in ("fma", "mma"):
                record(f"gdn_replay_{var}_{tag}_sr", gdn.replay_verify,
                    q, k, v, g, beta, state, hist, slot, pnat, bi, variant=var, stochastic_rounding=sr)
    state = torch.zeros(B, HV, V, K, dtype=torch.float16)
    for var in ("fma", "mma"):
        for rounding, suffix in ((None, ""), (sr, "_sr")):
            record(f"gdn_replay_{var}_f16{suffix}", gdn.replay_verify,
                q, k, v, g, beta, state, hist, slot, pnat, bi, variant=var, stochastic_rounding=rounding)
    return res


# opcode classes of the per-weight cost (SASS mnemonics, the part before the first ".")
OPCODE_CLASSES = {"int": ("LOP3", "PLOP3", "IMAD", "SHF", "PRMT", "IADD3", "VIADD", "ISETP", "SEL", "LEA"),
                  "fp32": ("FMUL", "FFMA", "FADD", "FMNMX", "FSETP"),
                  "fp16x2": ("HMUL2", "HFMA2"),  # packed 16-bit arithmetic (HADD2.F32 is the f16 -> f32 convert)
                  "convert": ("HADD2", "F2F", "F2FP", "I2F", "I2FP", "F2I"),
                  "mma": ("HMMA",), "global_load": ("LDG", "LDGSTS", "LDC"),
                  "shared": ("LDS", "LDSM", "STS"), "shuffle": ("SHFL",)}


def _classes(ops: dict) -> dict:
    """{class: count} of SASS opcode counts ``ops`` ({"LOP3.LUT": n, ...}) by OPCODE_CLASSES (others left out)."""
    out = dict.fromkeys(OPCODE_CLASSES, 0)
    for op, n in ops.items():
        for cls, names in OPCODE_CLASSES.items():
            if op.split(".")[0] in names:
                out[cls] += n
    return out


# A probe of the decode issue 43 asks for (Marlin's): each code pair of a word, elements c and c + 4, moved into a
# bf16x2 pattern (e2m1 * 2^-126) by two shifts and two logic operations, times its block scale pair (bf16x2,
# scale * 2^118) in one multiply, fed to the tensor cores against 16 activation rows. Compiled only (never
# run): it asks whether Triton keeps such a decode in the MMA operand's registers.
PACKED_DECODE_ASM = tl.constexpr("""
{
.reg .b32 t, u;
shl.b32 t, $8, 6; shl.b32 u, $8, 12; and.b32 u, u, 0x80008000; lop3.b32 t, t, 0x01C001C0, u, 0xEA;
mul.rn.bf16x2 t, t, $9; mov.b32 {$0, $4}, t;
shl.b32 t, $8, 2; shl.b32 u, $8, 8; and.b32 u, u, 0x80008000; lop3.b32 t, t, 0x01C001C0, u, 0xEA;
mul.rn.bf16x2 t, t, $9; mov.b32 {$1, $5}, t;
shr.b32 t, $8, 2; shl.b32 u, $8, 4; and.b32 u, u, 0x80008000; lop3.b32 t, t, 0x01C001C0, u, 0xEA;
mul.rn.bf16x2 t, t, $9; mov.b32 {$2, $6}, t;
shr.b32 t, $8, 6; and.b32 u, $8, 0x80008000; lop3.b32 t, t, 0x01C001C0, u, 0xEA;
mul.rn.bf16x2 t, t, $9; mov.b32 {$3, $7}, t;
}
""")


@triton.jit
def _packed_decode_probe(x_ptr, w_ptr, s_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, 16] = W x^T for x [16, K] bf16, W as int32 words [N, K / 8] decoded by PACKED_DECODE_ASM with
    the bf16x2 scale pairs s [N, K / 16] (int32): the probe above."""
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    offs_m = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for w0 in range(0, K // 8, WORDS):
        wd = tl.load(w_ptr + offs_n[:, None] * (K // 8) + (w0 + offs_w)[None, :])
        s2 = tl.load(s_ptr + offs_n[:, None] * (K // 16) + ((w0 + offs_w) // 2)[None, :])
        e = tl.inline_asm_elementwise(PACKED_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wd, s2],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        xc = x_ptr + offs_m[None, :] * K + 8 * (w0 + offs_w)[:, None]  # [WORDS, 16]: column class c at + c
        for c in tl.static_range(8):
            acc = tl.dot(e[c], tl.load(xc + c), acc)
    tl.store(out_ptr + offs_n[:, None] * 16 + offs_m[None, :], acc)


def loop_body(sass: str) -> dict | None:
    """The SASS opcodes of a kernel's main loop: the instructions from the target of its widest backward branch
    (a BRA to a lower address) to that branch, {"instructions": n, "opcodes": {mnemonic: count}}; None without
    a backward branch. The K loops here have runtime trip counts, so Triton does not unroll them and this body
    runs once per K step: its count over the weights a thread decodes per step is the dynamic cost per weight."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?\s*([^;]*);", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(3) + (m.group(4) or ""), m.group(5)))
    best = None
    for addr, op, operands in lines:
        t = re.match(r"\s*0x([0-9a-f]+)", operands or "")
        if op == "BRA" and t and int(t.group(1), 16) < addr and (best is None or addr - int(t.group(1), 16) > best[1] - best[0]):
            best = (int(t.group(1), 16), addr)
    if best is None:
        return None
    body = collections.Counter(op for addr, op, _ in lines if best[0] <= addr <= best[1])
    return {"instructions": sum(body.values()), "opcodes": dict(body.most_common())}


# Opcodes inner_loops counts in full in every loop (by the opcode before its first dot): the spills (LDL / STL)
# and the byte permutes (PRMT) a loop's claims rest on, which the 10 most frequent opcodes may leave out.
TRACKED_OPS = ("PRMT", "LDL", "STL")


def inner_loops(sass: str) -> list[dict]:
    """Every loop of a kernel but its widest (`loop_body`'s): the bodies from each backward branch's target to
    the branch, widest first, each {"instructions": n, "opcodes": the 10 most frequent, "tracked": the full
    count of each of TRACKED_OPS (0 included)}; an empty list with fewer than two loops."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?\s*([^;]*);", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(3) + (m.group(4) or "")))
    spans = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
        if m and int(m.group(3), 16) < int(m.group(1), 16):
            spans.append((int(m.group(3), 16), int(m.group(1), 16)))
    spans.sort(key=lambda sp: sp[0] - sp[1])
    out = []
    for lo, hi in spans[1:]:
        body = collections.Counter(op for addr, op in lines if lo <= addr <= hi)
        tracked = {name: sum(n for op, n in body.items() if op.split(".")[0] == name) for name in TRACKED_OPS}
        out.append({"instructions": sum(body.values()), "opcodes": dict(body.most_common(10)), "tracked": tracked})
    return out


def cuda_pair_report() -> dict:
    """The CUDA per-pair kernels (kernels/quant/pair_gemv.cu) built by nvcc for sm_90 with the launcher's
    flags: per format (NVFP4, block FP8 and their repacked forms, pair_cuda.FORMATS) and gating, the
    pair_gemv_kernel instance's usage and ``loop_per_weight``, the main loop's body (`loop_body`: two
    128-column chunks per warp step) over the weights a lane decodes per step (2 chunks x 64, twice that
    gated); and the grouped forms' usage (``<fmt>_cuda_grouped``, ``<fmt>_cuda_grouped_wide``,
    ``<fmt>_cuda_grouped_pipelined``, ``<fmt>_cuda_grouped_m32``, ``nvfp4_cuda_grouped_pipelined_xperm``,
    ``nvfp4_cuda_grouped_m32_xperm``, ``nvfp4[_repacked]_cuda_grouped_m32_prefetch``,
    ``<fmt>_cuda_grouped_persistent``;
    the repacked formats the pipelined and persistent forms only), the pipelined and persistent ones with
    ``k_loops`` (`inner_loops` over 100 instructions: one K loop per token-group count); and the per-pair
    persistent form (``<fmt>_cuda_persistent`` and ``_gated``, every format) with its one K loop and
    ``loop_per_weight`` (its step's 2 chunks x 64 weights a lane). {"error": ...} without nvcc."""
    from kernels import _nvcc
    from kernels.quant import pair_cuda

    nvcc = _nvcc.find_nvcc()
    if nvcc is None:
        return {"error": "no nvcc"}
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        flags = [f for f in pair_cuda.build_flags("sm_90") if f not in ("-shared", "-Xcompiler", "-fPIC")]
        subprocess.run([nvcc, *flags, "-cubin", "-o", cubin, str(pair_cuda.SOURCE)], check=True,
                       capture_output=True)
        res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    out = {}
    # each format's struct as the symbols spell it (pair_gemv.cu: Nvfp4Codes / BlockFp8Codes<REPACKED>)
    for fmt, tag in (("nvfp4", "10Nvfp4CodesILb0EE"), ("block_fp8", "13BlockFp8CodesILb0EE"),
                     ("nvfp4_repacked", "10Nvfp4CodesILb1EE"), ("block_fp8_repacked", "13BlockFp8CodesILb1EE")):
        for gated in (False, True):
            inst = f"pair_gemv_kernelINS_{tag}ELb{int(gated)}E"
            fn_res = next(b for b in res.split("Function ")[1:] if inst in b.split(":")[0])
            fn_sass = next(b for b in sass.split("Function : ")[1:] if inst in b.splitlines()[0])
            usage = _sass_usage(fn_res, fn_sass, 200)
            body = loop_body(fn_sass)
            weights = 2 * 64 * (2 if gated else 1)
            usage["loop_per_weight"] = {"instructions": round(body["instructions"] / weights, 2),
                                        **{c: round(n / weights, 2) for c, n in _classes(body["opcodes"]).items()}}
            usage["top_opcodes"] = dict(list(usage["top_opcodes"].items())[:16])
            out[f"{fmt}_cuda" + ("_gated" if gated else "")] = usage
        # the grouped forms (split, wide, pipelined, persistent) and the per-pair persistent form: their usage
        # (registers, shared memory, opcodes); the pipelined and persistent forms also their K loops (the
        # grouped loops decode a chunk once for up to 2 token groups, so no single per-weight count; the
        # per-pair persistent loop's one group: per weight, as the per-pair kernel's)
        for kernel, suffix, xp in (("grouped_gemv_kernel", "_cuda_grouped", ""),
                                   ("grouped_wide_kernel", "_cuda_grouped_wide", ""),
                                   ("grouped_pipelined_kernel", "_cuda_grouped_pipelined", "ELb0E"),
                                   ("grouped_pipelined_kernel", "_cuda_grouped_pipelined_xperm", "ELb1E"),
                                   ("grouped_m32_kernel", "_cuda_grouped_m32", "ELb0ELb0E"),
                                   ("grouped_m32_kernel", "_cuda_grouped_m32_xperm", "ELb1ELb0E"),
                                   ("grouped_m32_kernel", "_cuda_grouped_m32_prefetch", "ELb0ELb1E"),
                                   ("persistent_kernel", "_cuda_grouped_persistent", "ELb0ELb0E"),
                                   ("persistent_kernel", "_cuda_persistent", "ELb1ELb0E"),
                                   ("persistent_kernel", "_cuda_persistent_gated", "ELb1ELb1E")):
            if suffix.endswith("_xperm") and fmt != "nvfp4":
                continue  # X_PERM is NVFP4's only
            if suffix.endswith("_prefetch") and fmt not in pair_cuda.GROUPED_PREFETCH_FORMATS:
                continue  # the m32 form's rolling prefetch: NVFP4's (natural and repacked) only
            if fmt.endswith("_repacked") and suffix.startswith("_cuda_grouped") \
                    and (suffix.split("_") + [""])[3] not in pair_cuda.REPACKED_FORMS:  # "_cuda_grouped_<form>..."
                continue  # the repacked formats run the pipelined and persistent grouped forms only
            inst = f"{kernel}INS_{tag}{xp}EEv" if xp else f"{kernel}INS_{tag}EEEv"
            fn_res = next(b for b in res.split("Function ")[1:] if inst in b.split(":")[0])
            fn_sass = next(b for b in sass.split("Function : ")[1:] if inst in b.splitlines()[0])
            usage = out[f"{fmt}{suffix}"] = _sass_usage(fn_res, fn_sass, 16)
            if "_pipelined" in suffix or "_persistent" in suffix or "_m32" in suffix:
                # its K loops, one per token-group count (a step of two 128-column chunks per warp: 2 KB of
                # NVFP4 codes, 4 KB of FP8), the most instructions first (two groups)
                usage["k_loops"] = [lp for lp in inner_loops(fn_sass) if lp["instructions"] > 100]
            if suffix.startswith("_cuda_persistent") and usage["k_loops"]:
                loop = usage["k_loops"][0]  # 2 chunks (gated: gate's and up's) x 64 weights a lane per step
                usage["loop_per_weight"] = {"instructions": round(loop["instructions"] / 128, 2),
                                            **{c: round(n / 128, 2) for c, n in _classes(loop["opcodes"]).items()}}
    return out


def pair_gemv_report() -> dict:
    """--pair-gemv (module docstring): {"kernels": {name: usage}, "per_weight": {name: marginal instructions
    per weight, overall and per class}}."""
    from kernels import moe_gemv
    from kernels.quant import block_fp8, nvfp4

    compiled = _install()
    E, L, I, P = 8, 1024, 2688, 22  # Super V3's latent 1024 -> 2688, 22 pairs (one token)
    x, idx = torch.zeros(1, L, dtype=torch.bfloat16), torch.zeros(P, dtype=torch.int64)
    nv = lambda n, k: (torch.zeros(E, n, k // 2, dtype=torch.uint8),
                       torch.zeros(E, n, k // 16, dtype=torch.float8_e4m3fn), torch.zeros(E))
    QL, QI = 2048, 512  # Qwen3-Next 2048 -> 512, gated, 10 pairs
    qx, qidx = torch.zeros(1, QL, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.int64)
    fp = lambda n, k: (torch.zeros(E, n, k, dtype=torch.float8_e4m3fn), torch.zeros(E, n // 128, k // 128))
    launches = {
        "nvfp4_up": lambda: nvfp4._launch_pair(x, idx, nv(I, L), None, torch.bfloat16, P, 1),
        "nvfp4_down": lambda: nvfp4._launch_pair(torch.zeros(P, I, dtype=torch.bfloat16), idx, nv(L, I), None,
                                                 torch.bfloat16, 1, 0),
        "block_fp8_gate_up_w8a16": lambda: block_fp8._launch_pair(qx, qidx, fp(QI, QL), fp(QI, QL),
                                                                 torch.bfloat16, 10, 2, a16=True),
        "block_fp8_down_w8a16": lambda: block_fp8._launch_pair(torch.zeros(10, QI, dtype=torch.bfloat16), qidx,
                                                              fp(QL, QI), None, torch.bfloat16, 1, 0, a16=True),
    }
    settings = {"warps4": {"num_warps": 4, "num_stages": 1}, "warps4_stages3": {"num_warps": 4, "num_stages": 3},
                "warps8": {"num_warps": 8, "num_stages": 1}}
    nv_variants = {"": {}, "_convert": {"DECODE": {**nvfp4.DECODE, "pair": "convert"}},
                   "_xtile": {"PAIR_X_LOAD": "tile"}}
    res: dict = {"kernels": {}, "per_weight": {}, "cuda": cuda_pair_report()}
    keep = (moe_gemv.PAIR_LAUNCH, nvfp4.PAIR_TILE_WEIGHTS, nvfp4.DECODE, nvfp4.PAIR_X_LOAD)
    try:
        for sname, launch in settings.items():
            moe_gemv.PAIR_LAUNCH = launch
            threads = 32 * launch["num_warps"]
            for kname, fn in launches.items():
                variants = nv_variants if kname.startswith("nvfp4") else {"": {}}
                for vname, patch in variants.items():
                    counts = {}
                    for tile in ((8192, 16384) if kname.startswith("nvfp4") else (None,)):
                        nvfp4.DECODE, nvfp4.PAIR_X_LOAD = patch.get("DECODE", keep[2]), patch.get("PAIR_X_LOAD",
                                                                                               keep[3])
                        if tile:
                            nvfp4.PAIR_TILE_WEIGHTS = tile
                        compiled.clear()
                        name = f"{kname}{vname}_{sname}" + (f"_tile{tile}" if tile else "")
                        try:
                            fn()
                            usage, sass = _usage(compiled[-1], top=200)
                        except Exception as e:  # noqa: BLE001 - a row with its error
                            res["kernels"][name] = {"error": repr(e)[:300]}
                            continue
                        usage["classes"] = _classes(usage["top_opcodes"])
                        body = loop_body(sass)
                        if body and tile:  # weights a thread decodes per K step: the tile over the threads
                            usage["loop_per_weight"] = {
                                "instructions": round(body["instructions"] / (tile / threads), 2),
                                **{c: round(n / (tile / threads), 2) for c, n in _classes(body["opcodes"]).items()}}
                        usage["top_opcodes"] = dict(list(usage["top_opcodes"].items())[:16])
                        res["kernels"][name] = usage
                        counts[tile] = usage
                    if len(counts) == 2:  # the marginal cost of one weight (module docstring)
                        extra = (16384 - 8192) / threads
                        a, b = counts[8192], counts[16384]
                        res["per_weight"][f"{kname}{vname}_{sname}"] = {
                            "instructions": round((b["instructions"] - a["instructions"]) / extra, 2),
                            **{c: round((b["classes"][c] - a["classes"][c]) / extra, 2) for c in OPCODE_CLASSES}}
    finally:
        moe_gemv.PAIR_LAUNCH, nvfp4.PAIR_TILE_WEIGHTS, nvfp4.DECODE, nvfp4.PAIR_X_LOAD = keep
    # the packed-decode probe at Super V3's up shape, 32-row tiles, 4 warps, two K tiles (its per-weight cost
    # as above: 32 x 256 more weights per program over 128 threads)
    counts = {}
    for bk in (256, 512):
        compiled.clear()
        name = f"packed_decode_probe_bk{bk}"
        try:
            _packed_decode_probe[(I // 32,)](torch.zeros(16, L, dtype=torch.bfloat16),
                                             torch.zeros(I, L // 8, dtype=torch.int32),
                                             torch.zeros(I, L // 16, dtype=torch.int32), torch.zeros(I, 16), L,
                                             BLOCK_N=32, BLOCK_K=bk, num_warps=4)
            usage, _ = _usage(compiled[-1], top=200)
        except Exception as e:  # noqa: BLE001
            res["kernels"][name] = {"error": repr(e)[:300]}
            continue
        usage["classes"] = _classes(usage["top_opcodes"])
        counts[bk] = usage
        res["kernels"][name] = {**usage, "top_opcodes": dict(list(usage["top_opcodes"].items())[:16])}
    if len(counts) == 2:
        a, b = counts[256], counts[512]
        extra = 32 * 256 / 128
        ops = set(a["top_opcodes"]) | set(b["top_opcodes"])
        res["per_weight"]["packed_decode_probe_warps4"] = {
            "instructions": round((b["instructions"] - a["instructions"]) / extra, 2),
            **{c: round((b["classes"][c] - a["classes"][c]) / extra, 2) for c in OPCODE_CLASSES},
            "by_opcode": {op: round(d, 2) for op in sorted(ops) if abs(d := (b["top_opcodes"].get(op, 0)
                                                                             - a["top_opcodes"].get(op, 0)) / extra) >= 0.1}}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--sass", default=None, help="folder for each kernel's SASS listing")
    ap.add_argument("--pair-gemv", action="store_true",
                    help="the quantized per-pair GEMVs and their instructions per weight instead (docstring)")
    args = ap.parse_args(argv)
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("run on a machine without CUDA and without TRITON_INTERPRET=1 (it swaps in an sm_90 stand-in "
                 "driver)")
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    if args.pair_gemv and args.sass:
        ap.error("--sass applies to the replay kernels' report, not to --pair-gemv")
    res = pair_gemv_report() if args.pair_gemv else report(args.sass)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
