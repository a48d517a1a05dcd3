"""Stochastic rounding of 16-bit state writes (kernels/rounding.py) in every kernel that writes a state, and
in their PyTorch references.

What is checked, for bf16 and fp16 states:
- the rule: values on the 16-bit grid, within one grid step of the exact value, NaN / inf kept, and unbiased
  (the mean over many draws is the exact fp32 value) where round-to-nearest is not;
- each kernel and reference: the written state lies on the grid within one step of the same kernel's fp32
  result, and is unbiased over many rows that repeat one input (each row gets its own Philox counters);
- determinism: the same seed and step give the same bits; an advanced step gives other bits;
- the kernels' random bits themselves (both generators, `random_bits16`): each bit a fair coin, the 16-bit
  values uniform, no correlation between neighbouring elements, rows, steps or layers (salts); every bound
  is the normal / chi-square quantile of a family-wise false-alarm rate of 1e-6 at the sample size, and a
  negative control (the raw counter) shows the statistics reject a bad generator.

Unbiasedness statistic: per element, the mean signed rounding error over n draws divided by the grid step
at the exact value; its mean absolute value over the elements. Stochastic rounding: E|N(0, s)| with
s <= 0.5 / sqrt(n) (about 0.07 at n = 32); round-to-nearest: the fixed offset of each element, about 0.25 on
values spread over a grid step. The tests assert < 0.12 for SR and > 0.15 for round-to-nearest on the same
data (so the statistic can tell them apart).

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the first
kernel import); shapes stay small.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from statistics import NormalDist  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import gdn, mamba2  # noqa: E402
from kernels.rounding import (  # noqa: E402
    StochasticRounding,
    _round_bits,
    random_bits16,
    sr_key,
    stochastic_round,
    stochastic_round_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SR_DTYPES = (torch.bfloat16, torch.float16)
ROWS = 32  # draws per element: every row repeats the same inputs on its own slot
GDN_RULE_REF = gdn.fused_recurrent_gated_delta_rule_ref


def grid_step(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of the `dtype` grid at |x| (fp32 x)."""
    e = torch.floor(torch.log2(x.abs().clamp(min=1e-30)))
    if dtype == torch.bfloat16:
        return torch.ldexp(torch.ones_like(x), (e - 7).int())
    return torch.ldexp(torch.ones_like(x), (torch.clamp(e, min=-14) - 10).int())


def bias(samples: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> float:
    """Mean over elements of |mean over draws (dim 0) of the rounding error| / grid step."""
    err = (samples.double() - exact.double()).mean(0) / grid_step(exact, dtype).double()
    return err.abs().mean().item()


def check_rounded(got: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """got (16-bit) lies within one grid step of exact (fp32), and on the grid (exact conversion)."""
    step = grid_step(exact, got.dtype)
    assert ((got.float() - exact).abs() <= step * 1.0001).all(), f"{what}: more than one grid step away"


# ---------------------------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SR_DTYPES)
def test_reference_rule_is_unbiased_where_nearest_is_not(dtype):
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(512, generator=g) * torch.exp(torch.randn(512, generator=g) * 3)
    exact = exact.clamp(-6e4, 6e4)  # inside fp16's finite range
    exact[:4] = torch.tensor([1e-6, -3e-8, 65000.0, 2.0**-20])  # fp16 subnormals / its largest binade
    sr = StochasticRounding.create(11, device="cpu")
    draws = []
    for _ in range(256):
        draws.append(stochastic_round_ref(exact, dtype, sr))
        sr.advance()
    draws = torch.stack(draws)
    check_rounded(draws[0], exact, "stochastic_round_ref")
    assert bias(draws, exact, dtype) < 0.06
    assert bias(exact.to(dtype)[None], exact, dtype) > 0.15, "round-to-nearest must look biased here"
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    out = stochastic_round_ref(special, dtype, sr)
    assert out[0].isnan() and out[1] == float("inf") and out[2] == -float("inf") and out[3] == 0


@triton.jit
def _round_kernel(x_ptr, bits_ptr, out_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = stochastic_round(tl.load(x_ptr + offs, mask=m), tl.load(bits_ptr + offs, mask=m), IS_BF16)
    tl.store(out_ptr + offs, r, mask=m)


@pytest.mark.parametrize("dtype", SR_DTYPES)
def test_kernel_rule_equals_reference_rule_bitwise(dtype):
    """The kernels' rule (Triton `stochastic_round`) and the references' (`_round_bits`) give the same bits
    for the same random bits, over every binade of fp16 and bf16, both signs, fp16's subnormal / normal
    boundary, values next to fp16's largest finite one and beyond, and the specials (the other tests compare
    kernels and references statistically, since their random bits differ)."""
    g = torch.Generator().manual_seed(3)
    n = 1 << 14
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 18, (n,), generator=g).float())
    edge = [2.0**-14, -(2.0**-14), 2.0**-14 * (1 - 2.0**-12), 2.0**-24, 2.0**-25, 3 * 2.0**-26, 65504.0,
            65519.0, 65520.0, -65535.0, 1e6, 2047.99, 1.0 - 2.0**-20, 0.0, -0.0, float("inf"), -float("inf"),
            float("nan"), 1e-38, -1e-40, -1e-30]
    # the GPU's NaN and its negation
    nans = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
    edge = torch.cat([torch.tensor(edge), nans])
    x[: len(edge)] = edge
    bits = torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32)
    bits[: len(edge)] = 0x1FFF  # the largest draw: rounds up wherever a bit below the grid is set
    bits[len(edge): 2 * len(edge)] = 0
    x[len(edge): 2 * len(edge)] = x[: len(edge)]
    x, bits = x.to(DEV), bits.to(DEV)
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(n, 1024),)](x, bits, out, n, IS_BF16=dtype == torch.bfloat16, BLOCK=1024)
    got, want = out.to(dtype), _round_bits(x, bits, dtype)
    ok = got.isfinite()  # beyond the format's largest finite value the 16-bit result is infinite
    assert torch.equal(out[ok], got.float()[ok]), "the kernel's result is not on the 16-bit grid"
    nan = want.isnan()  # NaN stays NaN; its payload is the hardware's
    assert torch.equal(got.isnan(), nan) and nan.sum().item() == 2 * 3
    diff = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not diff.any(), f"{diff.sum().item()} of {n} values differ, e.g. x = {x[diff][:4].tolist()}"


def test_reference_rule_is_deterministic_per_key():
    x = torch.randn(1000)
    sr = StochasticRounding.create(5, device="cpu")
    a, b = stochastic_round_ref(x, torch.bfloat16, sr), stochastic_round_ref(x, torch.bfloat16, sr)
    assert torch.equal(a, b)
    sr.advance()
    assert not torch.equal(a, stochastic_round_ref(x, torch.bfloat16, sr))
    assert not torch.equal(a, stochastic_round_ref(x, torch.bfloat16, sr.for_layer(3)))


def test_bad_rounding_arguments_raise():
    sr = StochasticRounding.create(1, device="cpu")
    with pytest.raises(ValueError, match="bfloat16 / float16 states"):
        sr.check(torch.zeros(2), "f")
    with pytest.raises(ValueError, match="salt"):
        sr.for_layer(1 << 16).check(torch.zeros(2, dtype=torch.bfloat16), "f")
    bad = StochasticRounding(seed=torch.zeros(1, dtype=torch.int32), step=sr.step)
    with pytest.raises(ValueError, match="seed must be a \\(1,\\) int64"):
        bad.check(torch.zeros(2, dtype=torch.bfloat16), "f")


# ---------------------------------------------------------------------------------------------------------
# the random bits
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _bits_kernel(out_ptr, seed_ptr, step_ptr, salt, row0, R: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                 ROUNDS: tl.constexpr):
    # the (R, W) bits of rows row0 .. row0 + R - 1 of a W-wide buffer, one program per C columns
    col0 = tl.program_id(0) * C
    offs_r = tl.arange(0, R)
    bits = random_bits16(sr_key(seed_ptr, step_ptr, salt), row0 + offs_r.to(tl.int64), col0, R, C, W, ROUNDS)
    tl.store(out_ptr + offs_r[:, None] * W + col0 + tl.arange(0, C)[None, :], bits)


def _bits(sr: StochasticRounding, row0: int, R: int = 64, C: int = 32, W: int = 64) -> torch.Tensor:
    out = torch.empty(R, W, dtype=torch.int32, device=DEV)
    rounds = sr.philox_rounds if sr.generator == "philox" else 0
    _bits_kernel[(W // C,)](out, sr.seed, sr.step, sr.salt, row0, R=R, C=C, W=W, ROUNDS=rounds)
    return out.cpu().long()


def _z(alpha: float, tests: int) -> float:
    """Two-sided normal quantile of one of `tests` tests at family-wise false-alarm rate alpha."""
    return NormalDist().inv_cdf(1 - alpha / (2 * tests))


def _chi2_bound(dof: int, z: float) -> float:
    """Upper chi-square quantile at the normal quantile z (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _bit_statistics(draws: torch.Tensor, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Failures of the uniformity / independence statistics of 16-bit draws (any shape) and of the given
    (a, b) pairs of equal-shape draws, each against its bound at family-wise alpha = 1e-6."""
    x = draws.flatten().double()
    n = x.numel()
    tests = 16 + 2 + len(pairs)
    z = _z(1e-6, tests)
    bad = {}
    ones = torch.stack([((draws.flatten() >> b) & 1).sum() for b in range(16)]).double()
    dev = (ones - n / 2).abs().max().item()
    if dev > z * math.sqrt(n / 4):
        bad["bit frequency"] = dev
    for name, byte in (("low byte", draws.flatten() & 0xFF), ("high byte", (draws.flatten() >> 8) & 0xFF)):
        counts = torch.bincount(byte, minlength=256).double()
        chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
        if chi2 > _chi2_bound(255, z):
            bad[name] = chi2
    for name, (a, b) in pairs.items():
        a, b = a.flatten().double(), b.flatten().double()
        r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        if abs(r) > z / math.sqrt(a.numel()):
            bad[name] = r
    return bad


@pytest.mark.parametrize("generator", ["hash", "philox"])
def test_random_bits_are_uniform_and_independent(generator):
    sr = StochasticRounding.create(20261201, device=DEV, generator=generator)
    row0 = (1 << 26) - 32  # rows * 64 columns cross 2^32 inside the tile: the counter's high word changes
    steps = []
    for _ in range(4):
        steps.append(_bits(sr, row0))
        sr.advance()
    draws = torch.stack(steps)  # (4, 64, 64): steps 0 .. 3 of layer 0
    layers = (_bits(sr, row0), _bits(sr.for_layer(1), row0))  # step 4, layers 0 and 1
    assert draws.min() >= 0 and draws.max() < 1 << 16
    pairs = {"column neighbours": (draws[..., :-1], draws[..., 1:]),
             "row neighbours": (draws[:, :-1], draws[:, 1:]),
             "steps": (draws[:-1], draws[1:]), "layers": layers,
             "bit 0 vs bit 15": (draws & 1, (draws >> 15) & 1)}
    assert _bit_statistics(draws, pairs) == {}
    # determinism, and intermediate-state rows (offset 2^40) draw other bits than the state's rows
    assert torch.equal(_bits(sr, row0), _bits(sr, row0))
    assert (_bits(sr, row0 + (1 << 40)) != _bits(sr, row0)).float().mean() > 0.99
    # negative control: the raw counter (what a missing hash would give) fails the same statistics
    counter = (torch.arange(64 * 64) + row0 * 64).reshape(1, 64, 64) & 0xFFFF
    assert _bit_statistics(counter, {"column neighbours": (counter[..., :-1], counter[..., 1:])})


def test_unknown_generator_is_refused():
    with pytest.raises(ValueError, match="generator"):
        StochasticRounding.create(1, device="cpu", generator="xorshift").check(
            torch.zeros(2, dtype=torch.bfloat16), "f")


# ---------------------------------------------------------------------------------------------------------
# kernels and references
# ---------------------------------------------------------------------------------------------------------


def _mamba2_case(state_dtype, T=2, H=1, P=16, N=16, G=1, seed=0):
    """ROWS rows with identical inputs on ROWS slots holding the same state."""
    g = torch.Generator().manual_seed(seed)
    one = lambda *s: torch.randn(1, *s, generator=g).expand(ROWS, *s).contiguous().to(DEV)
    x, B, C = one(T, H, P), one(T, G, N) / N**0.5, one(T, G, N) / N**0.5
    dt = one(T, H) * 0.5 - 1.0
    A = -torch.exp(torch.rand(H, generator=g) * 2 - 1).to(DEV)
    D, dt_bias = torch.randn(H, generator=g).to(DEV), (torch.rand(H, generator=g) - 0.5).to(DEV)
    state = (torch.randn(1, H, P, N, generator=g) * 3).expand(ROWS, H, P, N).to(DEV, state_dtype).contiguous()
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, state=state,
                slot_ids=torch.arange(ROWS, dtype=torch.int32, device=DEV))


def _mamba2_history(case, T, L, seed=1):
    g = torch.Generator().manual_seed(seed)
    H, P = case["x"].shape[2:]
    G, N = case["B"].shape[2:]
    hist = mamba2.ReplayHistory.allocate(ROWS, L, H, P, G, N, dtype=torch.float32, device=DEV)
    hist.x.copy_(torch.randn(1, *hist.x.shape[1:], generator=g).expand_as(hist.x))
    hist.B.copy_(torch.randn(1, *hist.B.shape[1:], generator=g).expand_as(hist.B) / N**0.5)
    hist.dt.copy_(torch.rand(1, *hist.dt.shape[1:], generator=g).expand_as(hist.dt) * 0.9 + 0.1)
    hist.dA_cumsum.copy_(torch.cumsum(case["A"].cpu()[:, None] * hist.dt.cpu(), dim=-1))
    return hist


def _run_mamba2(op, case, state, sr, inter=None):
    """Run `op` ("decode", "rewind", or a replay variant / "replay_ref") on a copy of the case with `state`;
    returns the written 16-bit (or fp32) buffer."""
    c = case
    args = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], c["slot_ids"])
    if op in ("decode", "decode_ref"):
        fn = mamba2.selective_state_update if op == "decode" else mamba2.selective_state_update_ref
        fn(state, c["x"][:, :1], c["dt"][:, :1], c["A"], c["B"][:, :1], c["C"][:, :1], c["D"], c["dt_bias"],
           c["slot_ids"], stochastic_rounding=sr)
        return state
    if op in ("rewind", "rewind_ref"):
        fn = mamba2.selective_state_update if op == "rewind" else mamba2.selective_state_update_ref
        fn(state, *args, intermediate_states=inter, stochastic_rounding=sr)
        return inter
    T = c["x"].shape[1]
    hist = _mamba2_history(c, T, T)
    pnat = torch.full((ROWS,), T, dtype=torch.int32, device=DEV)
    bufidx = torch.zeros(ROWS, dtype=torch.int32, device=DEV)
    if op == "replay_ref":
        mamba2.replay_verify_ref(state, *args, hist, pnat, bufidx, stochastic_rounding=sr)
    else:
        mamba2.replay_verify(state, *args, hist, pnat, bufidx, variant=op, stochastic_rounding=sr)
    return state


MAMBA2_OPS = ["decode", "decode_ref", "rewind", "rewind_ref", "fma", "mma", "replay_ref"]
# every operator with a bf16 state; fp16 (the other branch of the rule) on one kernel per write path
CASES = [(op, torch.bfloat16) for op in MAMBA2_OPS] + [
    (op, torch.float16) for op in ("decode", "rewind", "mma")]


# the Philox generator (StochasticRounding.generator="philox") on one kernel per family and write path
PHILOX = [("fma", torch.bfloat16), ("rewind", torch.float16)]
GEN_CASES = [(op, dtype, "hash") for op, dtype in CASES] + [(op, dtype, "philox") for op, dtype in PHILOX]


@pytest.mark.parametrize("op,dtype,generator", GEN_CASES)
def test_mamba2_state_writes_round_stochastically(op, dtype, generator):
    case = _mamba2_case(dtype)
    T, H, P, N = case["x"].shape[1], *case["state"].shape[1:]
    inter = torch.empty(ROWS, T, H, P, N, dtype=dtype, device=DEV) if op.startswith("rewind") else None
    exact = _run_mamba2(op, case, case["state"].float().clone(), None,
                        None if inter is None else inter.float().clone())
    sr = StochasticRounding.create(7, device=DEV, generator=generator)
    got = _run_mamba2(op, case, case["state"].clone(), sr, inter).float()
    nearest = _run_mamba2(op, case, case["state"].clone(), None, None if inter is None else inter.clone())
    check_rounded(got[0].to(dtype), exact[0], op)
    assert bias(got, exact[0], dtype) < 0.12, f"{op}: stochastic rounding looks biased"
    assert bias(nearest.float(), exact[0], dtype) > 0.15, f"{op}: the statistic cannot separate the roundings"
    again = _run_mamba2(op, case, case["state"].clone(), sr, None if inter is None else inter.clone())
    assert torch.equal(again.float(), got), f"{op}: same seed and step must give the same bits"
    sr.advance()
    other = _run_mamba2(op, case, case["state"].clone(), sr, None if inter is None else inter.clone())
    assert not torch.equal(other.float(), got), f"{op}: an advanced step must draw other bits"


def _gdn_case(state_dtype, T=2, H=1, HV=1, K=16, V=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    one = lambda *s: torch.randn(1, *s, generator=g).expand(ROWS, *s).contiguous().to(DEV)
    q, k, v = one(T, H, K), one(T, H, K), one(T, HV, V)
    gg = -torch.nn.functional.softplus(one(T, HV)) * 0.3
    beta = one(T, HV).sigmoid()
    state = (torch.randn(1, HV, V, K, generator=g)).expand(ROWS, HV, V, K).to(DEV, state_dtype).contiguous()
    return dict(q=q, k=k, v=v, g=gg, beta=beta, state=state,
                slot_ids=torch.arange(ROWS, dtype=torch.int32, device=DEV))


def _run_gdn(op, case, state, sr, inter=None):
    c = case
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"])
    if op in ("decode", "decode_ref"):
        fn = gdn.fused_recurrent_gated_delta_rule if op == "decode" else GDN_RULE_REF
        fn(*[a[:, :1] for a in args], state, c["slot_ids"], stochastic_rounding=sr)
        return state
    if op in ("rewind", "rewind_ref"):
        fn = gdn.fused_recurrent_gated_delta_rule if op == "rewind" else GDN_RULE_REF
        fn(*args, state, c["slot_ids"], update_state=False, intermediate_states=inter,
           stochastic_rounding=sr)
        return inter
    T, H, K = c["q"].shape[1:]
    HV, V = c["v"].shape[2:]
    g = torch.Generator().manual_seed(3)
    hist = gdn.ReplayHistory.allocate(ROWS, T, H, HV, K, V, device=DEV)
    hist.u.copy_(torch.randn(1, *hist.u.shape[1:], generator=g).expand_as(hist.u))
    hist.k.copy_(torch.nn.functional.normalize(torch.randn(1, *hist.k.shape[1:], generator=g), dim=-1)
                 .expand_as(hist.k))
    hist.g.copy_(-torch.rand(1, *hist.g.shape[1:], generator=g).cumsum(2).expand_as(hist.g) * 0.3)
    pnat = torch.full((ROWS,), T, dtype=torch.int32, device=DEV)
    bufidx = torch.zeros(ROWS, dtype=torch.int32, device=DEV)
    if op == "replay_ref":
        gdn.replay_verify_ref(*args, state, hist, c["slot_ids"], pnat, bufidx, stochastic_rounding=sr)
    else:
        gdn.replay_verify(*args, state, hist, c["slot_ids"], pnat, bufidx, variant=op, stochastic_rounding=sr)
    return state


@pytest.mark.parametrize("op,dtype,generator", GEN_CASES)
def test_gdn_state_writes_round_stochastically(op, dtype, generator):
    case = _gdn_case(dtype)
    T, HV, V, K = case["q"].shape[1], *case["state"].shape[1:]
    inter = torch.empty(ROWS, T, HV, V, K, dtype=dtype, device=DEV) if op.startswith("rewind") else None
    exact = _run_gdn(op, case, case["state"].float().clone(), None,
                     None if inter is None else inter.float().clone())
    sr = StochasticRounding.create(9, device=DEV, generator=generator)
    got = _run_gdn(op, case, case["state"].clone(), sr, inter).float()
    nearest = _run_gdn(op, case, case["state"].clone(), None, None if inter is None else inter.clone())
    check_rounded(got[0].to(dtype), exact[0], op)
    assert bias(got, exact[0], dtype) < 0.12, f"{op}: stochastic rounding looks biased"
    assert bias(nearest.float(), exact[0], dtype) > 0.15, f"{op}: the statistic cannot separate the roundings"
    again = _run_gdn(op, case, case["state"].clone(), sr, None if inter is None else inter.clone())
    assert torch.equal(again.float(), got), f"{op}: same seed and step must give the same bits"
    sr.advance()
    other = _run_gdn(op, case, case["state"].clone(), sr, None if inter is None else inter.clone())
    assert not torch.equal(other.float(), got), f"{op}: an advanced step must draw other bits"


def test_kernels_refuse_rounding_an_fp32_state():
    case = _mamba2_case(torch.float32)
    sr = StochasticRounding.create(1, device=DEV)
    with pytest.raises(ValueError, match="bfloat16 / float16 states"):
        _run_mamba2("fma", case, case["state"].clone(), sr)
    with pytest.raises(ValueError, match="bfloat16 / float16 states"):
        _run_mamba2("decode_ref", case, case["state"].clone(), sr)
