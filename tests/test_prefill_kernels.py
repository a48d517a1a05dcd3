"""Prefill kernels against their references, on the CPU.

- Mamba2: `mamba_chunk_scan_combined` (Triton, run by the CPU interpreter here: TRITON_INTERPRET=1 is set
  before the first kernel import) against `mamba_chunk_scan_combined_ref`, and the reference against the
  token-by-token recurrence (`selective_state_update_ref` over the same T tokens): awkward T (1, 63, 130),
  chunk sizes that are not powers of two, ngroups, right padding (exact no-op on the state, NaN in padding),
  PAD rows, strided views, NaN-filled outputs, dtypes. Products run in fp32 in the interpreter (its bf16
  tl.dot is wrong), so fp32 inputs agree to 1e-4.
- Gated DeltaNet: fla-core's kernels do not run in the interpreter (tests/test_prefill_kernels_gpu.py holds
  them to the reference on a GPU). Here: on the CPU `chunk_gated_delta_rule` runs the reference and says so
  once; the adapter `kernels.gdn.fla` is checked against a stand-in for fla's function that asserts the
  conventions fla documents (layout, state_v_first, GVA, one dtype for q / k / v, chunk sizes) and computes
  with our recurrence, so its masking and argument mapping are covered without a GPU.
"""

from __future__ import annotations

import logging
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import _common  # noqa: E402
from kernels.gdn import chunk as gdn_chunk  # noqa: E402
from kernels.gdn import fla as gdn_fla  # noqa: E402
from kernels.gdn import recurrent_gated_delta_rule  # noqa: E402
from kernels.gdn._common import l2norm  # noqa: E402
from kernels.mamba2 import (  # noqa: E402
    ChunkScanTiles,
    mamba_chunk_scan_combined,
    mamba_chunk_scan_combined_ref,
    selective_state_update_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

if DEV == "cpu" and not _common.interpreter_active():  # pragma: no cover - depends on test import order
    raise RuntimeError("triton was imported in compiled mode before TRITON_INTERPRET=1 was set; set it in "
                       "the environment (tests/conftest.py does on machines without CUDA)")

# Kernel vs reference, both fp32 math (the interpreter's products in fp32): summation order only.
TOL = 1e-4
# 16-bit inputs: the kernel rounds the products' operands (x dt' decay, the scores, the entering state) to
# the input dtype as the GPU does (the reference keeps them in fp32): fp16 ulp 2^-11 -> 5e-3 after summing;
# bf16 ulp 2^-8 -> 4e-2. Outputs here are fp32 (as the mixer asks).
TOL_16 = {torch.float16: 5e-3, torch.bfloat16: 4e-2}


def close(a, b, tol, what):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def mamba_case(Bsz, T, H, P, G, N, *, dtype=torch.float32, state_dtype=torch.float32, S=None, seed=0):
    """Inputs of one prefill: state cache (S, H, P, N), x, dt (raw), A, B, C, D, dt_bias."""
    g = torch.Generator().manual_seed(seed)
    S = S or Bsz + 2
    x = torch.randn(Bsz, T, H, P, generator=g)
    dt = torch.randn(Bsz, T, H, generator=g) * 0.5 - 1.0  # softplus(dt + dt_bias) about 0.1 - 1
    B = torch.randn(Bsz, T, G, N, generator=g) / N**0.5
    C = torch.randn(Bsz, T, G, N, generator=g) / N**0.5
    A = -torch.exp(torch.rand(H, generator=g) * 2 - 1)
    D = torch.randn(H, generator=g)
    dt_bias = torch.rand(H, generator=g) - 0.5
    state = torch.randn(S, H, P, N, generator=g).to(state_dtype)
    inputs = [t.to(DEV, dtype) for t in (x, dt, B, C)]
    return state.to(DEV), inputs, A.to(DEV), D.to(DEV), dt_bias.to(DEV)


def run_both(state, inputs, A, D, dt_bias, slot_ids, **kw):
    """(out, state) of the kernel and of the reference from copies of `state`; the kernel's output buffer
    starts NaN-filled so an element it forgets to write fails loudly."""
    x, dt, B, C = inputs
    s_k, s_r = state.clone(), state.clone()
    out_k = torch.full(x.shape, float("nan"), device=x.device)
    mamba_chunk_scan_combined(s_k, x, dt, A, B, C, D, dt_bias, slot_ids, out=out_k, **kw)
    out_r = mamba_chunk_scan_combined_ref(s_r, x, dt, A, B, C, D, dt_bias, slot_ids,
                                          out=torch.empty(x.shape, device=x.device), **kw)
    return (out_k, s_k), (out_r, s_r)


@pytest.mark.parametrize("T,chunk_size", [(1, 16), (63, 16), (130, 128), (130, 32), (40, 5), (17, 8)])
def test_mamba2_kernel_matches_reference_awkward_sizes(T, chunk_size):
    Bsz, H, P, G, N = 2, 4, 12, 2, 10  # P, N not powers of two
    state, inputs, A, D, dt_bias = mamba_case(Bsz, T, H, P, G, N)
    slots = torch.tensor([3, 0], device=DEV)
    (y_k, s_k), (y_r, s_r) = run_both(state, inputs, A, D, dt_bias, slots, chunk_size=chunk_size)
    close(y_k, y_r, TOL, "y")
    close(s_k, s_r, TOL, "state")
    assert torch.equal(s_k[[1, 2]], state[[1, 2]])  # rows of other slots untouched


@pytest.mark.parametrize("tiles,sizes", [
    (ChunkScanTiles(), (2, 64, 2, 128, 130, 128)),  # the 16-bit path's tiles at Super V3's P, N, L
    (ChunkScanTiles(16, 16, 16, 4, 16, 16, 16, 16, 4), (2, 40, 1, 40, 75, 64)),  # every loop runs > 1 time
])
def test_mamba2_kernel_tilings(tiles, sizes):
    """Tilings other than the interpreter's default (fp32 products): the GPU's 16-bit defaults at Nemotron 3
    Super's head_dim / d_state / chunk (2 heads), and small tiles that split every dimension."""
    H, P, G, N, T, L = sizes
    state, inputs, A, D, dt_bias = mamba_case(2, T, H, P, G, N)
    lens = torch.tensor([T, T // 2], device=DEV)
    (y_k, s_k), (y_r, s_r) = run_both(state, inputs, A, D, dt_bias, torch.tensor([1, 0], device=DEV),
                                      chunk_size=L, lengths=lens, tiles=tiles)
    close(y_k, y_r, TOL, "y")
    close(s_k, s_r, TOL, "state")


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mamba2_kernel_16bit_inputs_and_ngroups(G, dtype):
    state, inputs, A, D, dt_bias = mamba_case(2, 37, 4, 16, G, 16, dtype=dtype)
    slots = torch.tensor([1, 2], device=DEV)
    (y_k, s_k), (y_r, s_r) = run_both(state, inputs, A, D, dt_bias, slots, chunk_size=16)
    close(y_k, y_r, TOL_16[dtype], "y")
    close(s_k, s_r, TOL_16[dtype], "state")


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_mamba2_kernel_16bit_state_cache(state_dtype):
    """A 16-bit state cache: read once, stored once (rounded from fp32 by both sides)."""
    state, inputs, A, D, dt_bias = mamba_case(2, 20, 4, 16, 2, 16, state_dtype=state_dtype)
    (y_k, s_k), (y_r, s_r) = run_both(state, inputs, A, D, dt_bias, torch.tensor([0, 1], device=DEV),
                                      chunk_size=8)
    close(y_k, y_r, TOL, "y")
    close(s_k, s_r, 1.6e-2 if state_dtype == torch.bfloat16 else 2e-3, "state")


def test_mamba2_reference_equals_token_by_token_recurrence():
    """The chunked prefill of T tokens equals T recurrent steps (selective_state_update_ref, the decode
    operator's reference), outputs and final state, with the dt clamp and without D."""
    state, (x, dt, B, C), A, _, dt_bias = mamba_case(2, 29, 4, 8, 2, 6)
    slots = torch.tensor([2, 0], device=DEV)
    for D, limit in ((None, (0.0, math.inf)), (torch.randn(4, device=DEV), (0.3, 0.8))):
        s_chunk, s_rec = state.clone(), state.clone()
        y_chunk = mamba_chunk_scan_combined_ref(s_chunk, x, dt, A, B, C, D, dt_bias, slots, chunk_size=8,
                                                time_step_limit=limit, out=torch.empty(x.shape, device=DEV))
        y_rec = selective_state_update_ref(s_rec, x, dt, A, B, C, D, dt_bias, slots, time_step_limit=limit,
                                           out=torch.empty(x.shape, device=DEV))
        close(y_chunk, y_rec, TOL, "y")
        close(s_chunk, s_rec, TOL, "state")
        (y_k, s_k), _ = run_both(state, [x, dt, B, C], A, D, dt_bias, slots, chunk_size=8,
                                 time_step_limit=limit)
        close(y_k, y_rec, TOL, "kernel y vs recurrence")
        close(s_k, s_rec, TOL, "kernel state vs recurrence")


def test_mamba2_right_padding_is_a_no_op():
    """Right-padded rows (lengths) leave each state where its last valid token left it, whatever the padding
    holds (NaN here), outputs at padded columns are 0, and a row of length 0 keeps its state bit for bit."""
    T, H, P, G, N = 45, 4, 8, 2, 8
    lengths = [45, 19, 0, 1]
    state, inputs, A, D, dt_bias = mamba_case(4, T, H, P, G, N, S=6)
    slots = torch.tensor([4, 1, 2, 0], device=DEV)
    valid = torch.arange(T, device=DEV)[None, :] < torch.tensor(lengths, device=DEV)[:, None]
    poisoned = [torch.where(valid.view(4, T, *([1] * (t.dim() - 2))), t, float("nan")) for t in inputs]
    lens = torch.tensor(lengths, device=DEV, dtype=torch.int32)
    (y_k, s_k), (y_r, s_r) = run_both(state, poisoned, A, D, dt_bias, slots, chunk_size=16, lengths=lens)
    for y, s, who in ((y_k, s_k, "kernel"), (y_r, s_r, "reference")):
        assert not y.isnan().any() and not s.isnan().any(), who
        assert (y[~valid] == 0).all(), who
        assert torch.equal(s[2], state[2]), f"{who}: a row of length 0 changed its state"
    close(y_k, y_r, TOL, "y")
    close(s_k, s_r, TOL, "state")
    # each row alone, unpadded, gives the same state and outputs
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        alone = state.clone()
        xr, dtr, Br, Cr = (t[b : b + 1, :n] for t in inputs)
        y_alone = mamba_chunk_scan_combined(alone, xr, dtr, A, Br, Cr, D, dt_bias, slots[b : b + 1],
                                            chunk_size=16, out=torch.empty(1, n, H, P, device=DEV))
        close(y_k[b, :n], y_alone[0], TOL, f"row {b} y alone")
        close(s_k[slots[b]], alone[slots[b]], TOL, f"row {b} state alone")


def test_mamba2_pad_rows_read_and_write_nothing():
    state, inputs, A, D, dt_bias = mamba_case(3, 21, 4, 8, 2, 8, S=4)
    slots = torch.tensor([-1, 2, -1], device=DEV)
    (y_k, s_k), (y_r, s_r) = run_both(state, inputs, A, D, dt_bias, slots, chunk_size=8)
    for y, s in ((y_k, s_k), (y_r, s_r)):
        assert (y[[0, 2]] == 0).all()
        assert torch.equal(s[[0, 1, 3]], state[[0, 1, 3]])
    close(y_k, y_r, TOL, "y")
    close(s_k, s_r, TOL, "state")


def test_mamba2_strided_views():
    """x, B and C as the mixer makes them (splits of one conv output), a strided state cache view."""
    Bsz, T, H, P, G, N = 2, 19, 4, 8, 2, 8
    g = torch.Generator().manual_seed(3)
    xBC = torch.randn(Bsz, T, H * P + 2 * G * N, generator=g).to(DEV)
    x, B, C = xBC.split([H * P, G * N, G * N], dim=-1)
    x, B, C = x.reshape(Bsz, T, H, P), B.reshape(Bsz, T, G, N), C.reshape(Bsz, T, G, N)
    dt = (torch.randn(Bsz, T, 2 * H, generator=g).to(DEV) * 0.5 - 1.0)[..., ::2]
    _, _, A, D, dt_bias = mamba_case(Bsz, T, H, P, G, N)
    big = torch.randn(4, H, P, 2 * N, generator=g).to(DEV)
    state = big[..., :N]  # last dim contiguous, other strides free
    beside = big[..., N:].clone()
    assert not state.is_contiguous() and not x.is_contiguous()
    slots = torch.tensor([1, 3], device=DEV)
    s_ref = state.contiguous()
    y_r = mamba_chunk_scan_combined_ref(s_ref, x.contiguous(), dt.contiguous(), A, B.contiguous(),
                                        C.contiguous(), D, dt_bias, slots, chunk_size=8)
    y_k = mamba_chunk_scan_combined(state, x, dt, A, B, C, D, dt_bias, slots, chunk_size=8)
    close(y_k, y_r, TOL, "y")
    close(state, s_ref, TOL, "state")
    assert torch.equal(big[..., N:], beside)  # nothing written beside the view


def test_mamba2_bad_inputs_raise_clear_errors():
    state, (x, dt, B, C), A, D, dt_bias = mamba_case(2, 8, 4, 8, 2, 8)
    slots = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        mamba_chunk_scan_combined(state, x, dt, A, B, C, D, dt_bias, slots, chunk_size=0)
    with pytest.raises(ValueError, match="lengths must have shape"):
        mamba_chunk_scan_combined(state, x, dt, A, B, C, D, dt_bias, slots, chunk_size=8,
                                  lengths=torch.tensor([3]))
    with pytest.raises(ValueError, match="lengths must be int32 or int64"):
        mamba_chunk_scan_combined(state, x, dt, A, B, C, D, dt_bias, slots, chunk_size=8,
                                  lengths=torch.tensor([3.0, 2.0]))
    with pytest.raises(ValueError, match="x, B and C must share one dtype"):
        mamba_chunk_scan_combined(state, x, dt, A, B.half(), C, D, dt_bias, slots, chunk_size=8)
    with pytest.raises(ValueError, match="B must have shape"):
        mamba_chunk_scan_combined(state, x, dt, A, B[:, :4], C, D, dt_bias, slots, chunk_size=8)
    with pytest.raises(ValueError, match="tile sizes must be powers of two >= 16.*scan_m"):
        mamba_chunk_scan_combined(state, x, dt, A, B, C, D, dt_bias, slots, chunk_size=8,
                                  tiles=ChunkScanTiles(scan_m=24))


# ----------------------------------------------------------------------------------------------------------
# Gated DeltaNet
# ----------------------------------------------------------------------------------------------------------


def gdn_case(Bsz, T, H, HV, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(Bsz, T, H, K, generator=g))
    k = l2norm(torch.randn(Bsz, T, H, K, generator=g))
    v = torch.randn(Bsz, T, HV, V, generator=g)
    gate = -torch.rand(Bsz, T, HV, generator=g) * 0.5
    beta = torch.rand(Bsz, T, HV, generator=g)
    h0 = torch.randn(Bsz, HV, V, K, generator=g) * 0.1
    return q, k, v, gate, beta, h0


def test_gdn_chunk_on_cpu_runs_the_reference_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(gdn_chunk, "_fallback_logged", set())
    q, k, v, g, beta, h0 = gdn_case(2, 23, 2, 4, 16, 8)
    lengths = torch.tensor([23, 9])
    with caplog.at_level(logging.INFO, logger="kernels.gdn.chunk"):
        o, s = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, h0, 16, lengths=lengths)
        gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, h0, 16)
    o_r, s_r = gdn_chunk.chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, 16, lengths=lengths)
    assert torch.equal(o, o_r) and torch.equal(s, s_r)
    said = [r for r in caplog.records if "reference chunk_gated_delta_rule_ref" in r.getMessage()]
    assert len(said) == 1, caplog.text  # once, not per call


class _FlaStandIn:
    """Stands in for fla.ops.gated_delta_rule.chunk_gated_delta_rule (fla-core 0.6.0) on the CPU: asserts the
    call follows fla's documented conventions, then computes with our token-by-token recurrence (GVA as fla
    does: value head hv reads key head hv // (HV / H); state (N, HV, V, K) under state_v_first=True)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, state_v_first=False, chunk_size=64, **kw):
        assert not kw, kw
        assert q.dtype == k.dtype == v.dtype == beta.dtype and g.dtype == torch.float32, (q.dtype, g.dtype)
        assert state_v_first and not use_qk_l2norm_in_kernel and chunk_size in (16, 32, 64)
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        assert initial_state is None or initial_state.shape == (B, HV, V, K)
        self.calls.append({"chunk_size": chunk_size, "scale": scale, "dtype": q.dtype})
        o, s, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, scale=scale)
        return o.to(q.dtype), (s.float() if output_final_state else None)


@pytest.mark.parametrize("K,V", [(16, 8), (8, 16)])
def test_gdn_fla_adapter_conventions_and_padding(monkeypatch, K, V):
    """The adapter's mapping, with the stand-in in fla's place: GVA without repeating q / k, our state layout
    as is, K != V both ways, right padding as a no-op (padded columns carry NaN), q / k in v's dtype, an
    unsupported chunk size run at 64."""
    fake = _FlaStandIn()
    monkeypatch.setattr(gdn_fla, "fla_chunk_rule", lambda: (fake, ""))
    q, k, v, g, beta, h0 = gdn_case(3, 21, 2, 4, K, V)
    lengths = torch.tensor([21, 7, 0])
    valid = torch.arange(21)[None, :] < lengths[:, None]
    v_nan = torch.where(valid[..., None, None], v, float("nan"))
    o, s = gdn_fla.fla_chunk_gated_delta_rule(q, k, v_nan, g, beta, h0, 64, lengths=lengths)
    o_r, s_r = gdn_chunk.chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, 64, lengths=lengths)
    close(o[valid], o_r[valid], TOL, "o")
    assert (o[~valid] == 0).all()
    close(s, s_r, TOL, "state")
    assert torch.equal(s[2], h0[2])  # length 0: the state passes through
    gdn_fla.fla_chunk_gated_delta_rule(q, k, v.to(torch.bfloat16), g, beta, h0, 5)
    assert fake.calls[-1] == {"chunk_size": 64, "scale": None, "dtype": torch.bfloat16}


def test_gdn_fla_adapter_without_fla_names_the_fix(monkeypatch):
    why = "ModuleNotFoundError: No module named 'fla'"
    monkeypatch.setattr(gdn_fla, "fla_chunk_rule", lambda: (None, why))
    q, k, v, g, beta, h0 = gdn_case(1, 4, 1, 2, 8, 8)
    with pytest.raises(RuntimeError, match=r"fla-core is not importable.*pip install '\.\[gpu\]'"):
        gdn_fla.fla_chunk_gated_delta_rule(q, k, v, g, beta, h0)


# ----------------------------------------------------------------------------------------------------------
# The benchmark script (the H200 runs it; here its dry run, compile check and argument errors)
# ----------------------------------------------------------------------------------------------------------


def test_bench_prefill_dry_run_and_bad_arguments(capsys):
    from benchmarks import bench_prefill

    if _common.interpreter_active():
        assert bench_prefill.main(["--dry-run"]) == 0
        assert '"dry_run": "ok"' in capsys.readouterr().out
    for argv, says in ((["--cases", "8x"], "give BxT pairs"), (["--cases", "0x16"], "give BxT pairs"),
                       (["--families", "mamba"], "subset of nemotron_h, qwen3_next")):
        with pytest.raises(SystemExit) as exc:
            bench_prefill.main(argv)
        assert exc.value.code == 2 and says in capsys.readouterr().err


def test_bench_prefill_compile_check_lowers_every_kernel_for_sm90():
    """Triton's ahead-of-time compile for sm_90 (no GPU needed) of the four Mamba2 kernels with the default
    tiles, 16-bit and fp32 products: a type or lowering error shows here, before GPU time is spent. Runs in a
    subprocess without TRITON_INTERPRET (interpreted kernels cannot be compiled). The register / spill report
    is printed (run with -s), not asserted: it depends on the Triton version."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("Triton's bundled CUDA tools are not in this install")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_prefill", "--compile-check"], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    print(res)
    assert len(res) == 8 and all(r.get("REG", 0) > 0 for r in res.values()), res
