"""Prefill kernels compiled for real on a GPU, at the releases' shapes, against their references.

Every test here is `gpu` (skipped without CUDA). Self-diagnosing: each case prints one line
``[prefill-gpu] <case>: <metric>=<value> ...`` (run pytest with -s to see them all) and a failing test lists
every case's numbers, not only the first bad one.

- Mamba2 (`mamba_chunk_scan_combined`, our Triton kernels) at Nemotron 3 Super's mixer shape (128 heads x
  head_dim 64, d_state 128, 8 groups, chunk 128), bf16 and fp32 inputs, T = 1, 63, 130, 1024, 4096, right
  padding and a row of length 0;
- Gated DeltaNet (`chunk_gated_delta_rule` through fla-core) at Qwen3-Next's shape (16 key heads, 32 value
  heads, K = V = 128), K != V, padding, and the fallback when fla-core is missing;
- both mixers at full width with a cache: ssm_backend "triton" against "torch" over a two-chunk prefill.
Errors are relative norms ||kernel - reference|| / ||reference|| over valid positions (rel) and max |diff|.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kernels.gdn import chunk as gdn_chunk
from kernels.gdn._common import l2norm
from kernels.gdn.fla import fla_chunk_rule
from kernels.mamba2 import mamba_chunk_scan_combined, mamba_chunk_scan_combined_ref

pytestmark = pytest.mark.gpu

# Tolerances on the relative norm error. Mamba2 bf16: the kernel rounds the products' operands to bf16 (ulp
# 2^-8; the reference keeps fp32) -> a few 1e-3 expected. fp32: IEEE products, summation order only.
# fla-core bf16: its WY factors and per-chunk states are bf16 (its own tests allow ~1e-2); fp32 inputs run
# its products in tf32 (10-bit mantissa).
MAMBA_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
GDN_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-2}
H, P, N, G, L = 128, 64, 128, 8, 128  # Super V3 mixer
QH, QHV, QK, QV = 16, 32, 128, 128  # Qwen3-Next Gated DeltaNet


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


class Report:
    """Collects per-case lines and failures; `check()` fails once with every line."""

    def __init__(self, name: str):
        self.name, self.lines, self.bad = name, [], []

    def add(self, case: str, ok: bool, **metrics) -> None:
        line = f"[prefill-gpu] {self.name} {case}: " + " ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print(line + ("" if ok else "   <-- FAIL"))
        self.lines.append(line)
        if not ok:
            self.bad.append(line)

    def check(self) -> None:
        bad, every = "\n".join(self.bad), "\n".join(self.lines)
        assert not self.bad, f"failing cases:\n{bad}\nall cases:\n{every}"


def mamba_params(seed=0, heads=H):
    """A, D, dt_bias as Mamba2 initialises them: A_log ~ U(log 1, log 16), dt = softplus(dt_bias) ~
    log-uniform in [1e-3, 1e-1]."""
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(heads, generator=g) * math.log(16))
    dt0 = torch.exp(torch.rand(heads, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
    D = torch.randn(heads, generator=g)
    return A.cuda(), D.cuda(), dt_bias.cuda()


def mamba_inputs(B, T, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=g)
    dt = torch.randn(B, T, H, generator=g)
    Bm = torch.randn(B, T, G, N, generator=g) / N**0.5
    Cm = torch.randn(B, T, G, N, generator=g) / N**0.5
    return [t.to("cuda", dtype) for t in (x, dt, Bm, Cm)]


MAMBA_CASES = [(1, 1, None), (2, 63, None), (2, 130, [130, 77]), (4, 1024, [1024, 1000, 513, 0]),
               (1, 4096, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_mamba2_chunk_scan_super_v3(dtype):
    A, D, dt_bias = mamba_params()
    rep = Report(f"mamba2 {str(dtype)[6:]}")
    for i, (B, T, lengths) in enumerate(MAMBA_CASES):
        x, dt, Bm, Cm = mamba_inputs(B, T, dtype, seed=i)
        S = B + 3
        state0 = torch.randn(S, H, P, N, device="cuda") * 0.5
        slots = torch.randperm(S, device="cuda")[:B]
        lens = None if lengths is None else torch.tensor(lengths, device="cuda")
        s_k, s_r = state0.clone(), state0.clone()
        y_k = torch.full((B, T, H, P), float("nan"), device="cuda")
        mamba_chunk_scan_combined(s_k, x, dt, A, Bm, Cm, D, dt_bias, slots, chunk_size=L, lengths=lens,
                                  out=y_k)
        y_r = mamba_chunk_scan_combined_ref(s_r, x, dt, A, Bm, Cm, D, dt_bias, slots, chunk_size=L,
                                            lengths=lens, out=torch.empty(B, T, H, P, device="cuda"))
        torch.cuda.synchronize()
        valid = torch.ones(B, T, dtype=torch.bool, device="cuda") if lens is None else \
            torch.arange(T, device="cuda")[None, :] < lens[:, None]
        others = torch.ones(S, dtype=torch.bool, device="cuda")
        others[slots] = False
        nan = bool(y_k.isnan().any())
        pad_zero = bool((y_k[~valid] == 0).all())
        untouched = torch.equal(s_k[others], state0[others])
        len0 = [b for b in range(B) if lengths and lengths[b] == 0]
        len0_kept = all(torch.equal(s_k[slots[b]], state0[slots[b]]) for b in len0)
        e_y, e_s = rel(y_k[valid], y_r[valid]), rel(s_k, s_r)
        tol = MAMBA_TOL[dtype]
        ok = not nan and pad_zero and untouched and len0_kept and e_y < tol and e_s < tol
        rep.add(f"B={B} T={T} lengths={lengths}", ok, rel_y=e_y, rel_state=e_s,
                max_y=maxabs(y_k[valid], y_r[valid]), max_state=maxabs(s_k, s_r), nan=nan, pad_zero=pad_zero,
                others_untouched=untouched, len0_state_kept=len0_kept, tol=tol)
    rep.check()


def test_gpu_mamba2_padding_is_exact_and_bf16_state():
    """A right-padded row ends in the same state as the row alone (bit for bit: padded columns add exact
    zeros and decay by exp(0) = 1); a bf16 state cache agrees with the reference to its rounding."""
    A, D, dt_bias = mamba_params()
    rep = Report("mamba2 padding")
    x, dt, Bm, Cm = mamba_inputs(2, 300, torch.bfloat16, seed=7)
    state0 = torch.randn(3, H, P, N, device="cuda") * 0.5
    padded, alone = state0.clone(), state0.clone()
    slots = torch.tensor([0, 2], device="cuda")
    mamba_chunk_scan_combined(padded, x, dt, A, Bm, Cm, D, dt_bias, slots, chunk_size=L,
                              lengths=torch.tensor([300, 141], device="cuda"))
    mamba_chunk_scan_combined(alone, x[1:, :141], dt[1:, :141], A, Bm[1:, :141], Cm[1:, :141], D, dt_bias,
                              slots[1:], chunk_size=L)
    d = maxabs(padded[2], alone[2])
    rep.add("row of 141 in T=300 vs alone", d <= 1e-6, max_state_diff=d,
            bitwise=torch.equal(padded[2], alone[2]))
    s16 = state0.to(torch.bfloat16)
    s_k, s_r = s16.clone(), s16.clone()
    y_k = mamba_chunk_scan_combined(s_k, x, dt, A, Bm, Cm, D, dt_bias, slots, chunk_size=L,
                                    out=torch.empty(2, 300, H, P, device="cuda"))
    y_r = mamba_chunk_scan_combined_ref(s_r, x, dt, A, Bm, Cm, D, dt_bias, slots, chunk_size=L,
                                        out=torch.empty(2, 300, H, P, device="cuda"))
    e_y, e_s = rel(y_k, y_r), rel(s_k, s_r)
    rep.add("bf16 state cache", e_y < 2e-2 and e_s < 2e-2, rel_y=e_y, rel_state=e_s)
    rep.check()


# ----------------------------------------------------------------------------------------------------------
# Gated DeltaNet through fla-core
# ----------------------------------------------------------------------------------------------------------


def test_gpu_fla_core_is_importable():
    fn, why = fla_chunk_rule()
    import triton

    print(f"[prefill-gpu] fla-core: {'ok' if fn else why}; triton {triton.__version__}, "
          f"torch {torch.__version__}")
    assert fn is not None, f"fla-core does not import on the GPU machine: {why}"


def gdn_inputs(B, T, H_, HV, K, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H_, K, generator=g)).to(dtype)  # the adapter casts q, k to v's dtype:
    k = l2norm(torch.randn(B, T, H_, K, generator=g)).to(dtype)  # the reference gets the same rounding
    v = torch.randn(B, T, HV, V, generator=g).to(dtype)
    gate = -torch.nn.functional.softplus(torch.randn(B, T, HV, generator=g)) * 0.5
    beta = torch.rand(B, T, HV, generator=g).to(dtype)  # the adapter passes beta in v's dtype, as the engine
    h0 = torch.randn(B, HV, V, K, generator=g) * 0.1      # gets it: the reference sees the same rounding
    return [t.cuda() for t in (q, k, v, gate, beta, h0)]


GDN_CASES = [(1, 1, None), (2, 63, None), (2, 130, [130, 50]), (4, 1024, [1024, 700, 64, 0]), (1, 4096, None)]


def _gdn_compare(rep, shape, cases, dtype):
    H_, HV, K, V = shape
    for i, (B, T, lengths) in enumerate(cases):
        q, k, v, g, beta, h0 = gdn_inputs(B, T, H_, HV, K, V, dtype, seed=i)
        lens = None if lengths is None else torch.tensor(lengths, device="cuda")
        o_k, s_k = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, h0, 64, lengths=lens)
        o_r, s_r = gdn_chunk.chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, 64, lengths=lens)
        torch.cuda.synchronize()
        valid = torch.ones(B, T, dtype=torch.bool, device="cuda") if lens is None else \
            torch.arange(T, device="cuda")[None, :] < lens[:, None]
        e_o, e_s = rel(o_k[valid], o_r[valid]), rel(s_k, s_r)
        len0 = [b for b in range(B) if lengths and lengths[b] == 0]
        len0_kept = all(maxabs(s_k[b], h0[b]) == 0.0 for b in len0)
        tol = GDN_TOL[dtype]
        ok = e_o < tol and e_s < tol and len0_kept and o_k.dtype == v.dtype and s_k.dtype == torch.float32
        rep.add(f"H={H_} HV={HV} K={K} V={V} B={B} T={T} lengths={lengths}", ok, rel_o=e_o, rel_state=e_s,
                max_o=maxabs(o_k[valid], o_r[valid]), max_state=maxabs(s_k, s_r), len0_state_kept=len0_kept,
                o_dtype=str(o_k.dtype)[6:], tol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_gdn_fla_matches_reference_qwen3_next(dtype):
    if fla_chunk_rule()[0] is None:
        pytest.fail(f"fla-core does not import: {fla_chunk_rule()[1]}")
    rep = Report(f"gdn fla {str(dtype)[6:]}")
    _gdn_compare(rep, (QH, QHV, QK, QV), GDN_CASES, dtype)
    rep.check()


def test_gpu_gdn_fla_k_neq_v_and_padding():
    """K != V both ways (our state (HV, V, K) is fla's state_v_first layout, no transpose), and a padded
    row's final state against the same row alone (to bf16 resolution: see the comment below)."""
    if fla_chunk_rule()[0] is None:
        pytest.fail(f"fla-core does not import: {fla_chunk_rule()[1]}")
    rep = Report("gdn fla K!=V")
    for shape in ((4, 8, 128, 64), (4, 8, 64, 128)):
        _gdn_compare(rep, shape, [(2, 130, [130, 77])], torch.bfloat16)
    q, k, v, g, beta, h0 = gdn_inputs(2, 200, QH, QHV, QK, QV, torch.bfloat16, seed=9)
    _, s_pad = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, h0, 64,
                                                lengths=torch.tensor([200, 77], device="cuda"))
    _, s_alone = gdn_chunk.chunk_gated_delta_rule(*(t[1:, :77] for t in (q, k, v, g, beta)), h0[1:], 64)
    # Zeroed q, k, v, g, beta past a row's length make padding a no-op in exact arithmetic, but fla-core keeps
    # its per-chunk states in the input dtype: the padded row crosses more chunk boundaries (T = 200 vs 77),
    # each a bf16 rounding of the state. Measured on the H200: max |diff| 1.25e-4 (not bitwise). So the check
    # is at bf16 resolution of the state, relative.
    d, r = maxabs(s_pad[1], s_alone[0]), rel(s_pad[1], s_alone[0])
    rep.add("row of 77 in T=200 vs alone", r <= 4e-3, rel_state=r, max_state_diff=d,
            bitwise=torch.equal(s_pad[1], s_alone[0]))
    rep.check()


def test_gpu_gdn_without_fla_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(gdn_chunk, "fla_chunk_rule", lambda: (None, "ImportError: simulated"))
    monkeypatch.setattr(gdn_chunk, "_fallback_logged", set())
    q, k, v, g, beta, h0 = gdn_inputs(2, 40, 2, 4, 32, 32, torch.bfloat16, seed=1)
    with caplog.at_level(logging.WARNING, logger="kernels.gdn.chunk"):
        o, s = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, h0, 64)
        gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, h0, 64)
    o_r, s_r = gdn_chunk.chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, 64)
    assert torch.equal(o, o_r) and torch.equal(s, s_r)
    said = [r for r in caplog.records
            if "fla-core is not importable (ImportError: simulated)" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text


# ----------------------------------------------------------------------------------------------------------
# The mixers at full width: ssm_backend "triton" against "torch"
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_gpu_mixer_prefill_triton_matches_torch(family):
    """One mixer at the release's width with a cache: a right-padded first chunk then a second chunk (rows
    continue from their slots), bf16, under both backends from the same start: outputs at valid positions and
    the cached SSM / conv states agree."""
    from runners.engine.models.config import HybridConfig
    from runners.engine.models.gdn import GDNMixer, GDNState
    from runners.engine.models.mamba2 import Mamba2Mixer, Mamba2State
    from runners.engine.state import BatchMeta, CacheSpec
    from runners.tools.synth import synth_config

    cfg = HybridConfig.from_dict(synth_config(family, num_layers=2 if family == "qwen3_next" else 3,
                                              num_experts=4))
    torch.manual_seed(0)
    mixer = (GDNMixer if family == "qwen3_next" else Mamba2Mixer)(cfg).to("cuda", torch.bfloat16)
    if family == "nemotron_h":
        A, _, dt_bias = mamba_params(heads=cfg.mamba_num_heads)
        with torch.no_grad():
            mixer.A_log.copy_(torch.log(-A))
            mixer.dt_bias.copy_(dt_bias)
    cls = GDNState if family == "qwen3_next" else Mamba2State
    spec = CacheSpec(rows=5, max_seq_len=1, dtype=torch.bfloat16, ssm_state_dtype=torch.float32,
                     device="cuda", spec_tokens=0)
    slots = torch.tensor([3, 0, 1], device="cuda")
    lengths = torch.tensor([300, 141, 0], device="cuda")
    x1 = torch.randn(3, 300, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    x2 = torch.randn(3, 70, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for backend in ("torch", "triton"):
        state = cls.allocate(cfg, spec)
        state.ssm_backend = backend
        with torch.no_grad():
            y1 = mixer(x1, state, BatchMeta(slots, torch.zeros_like(slots), lengths))
            meta2 = BatchMeta(slots, lengths.clone(), torch.full_like(slots, 70), all_valid=True)
            y2 = mixer(x2, state, meta2)
        outs[backend] = (y1, y2, state.ssm.clone(), state.conv.clone())
    rep = Report(f"mixer {family}")
    valid = torch.arange(300, device="cuda")[None, :] < lengths[:, None]
    (y1t, y2t, st, ct), (y1k, y2k, sk, ck) = outs["torch"], outs["triton"]
    e1, e2, es = rel(y1k[valid], y1t[valid]), rel(y2k, y2t), rel(sk, st)
    rep.add("2 chunks", e1 < 3e-2 and e2 < 3e-2 and es < 3e-2 and torch.equal(ck, ct), rel_y1=e1, rel_y2=e2,
            rel_state=es, conv_equal=torch.equal(ck, ct), max_y2=maxabs(y2k, y2t))
    rep.check()
