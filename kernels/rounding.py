"""Stochastic rounding of 16-bit recurrent-state writes: the rule, its Triton helpers and its PyTorch reference.

Why: a bf16 / fp16 state is rounded to nearest on every store. A head whose per-token decay exp(A dt') is
closer to 1 than half a bf16 ulp (2^-9) can then never decay (the product rounds back to the same value),
while small updates below half an ulp are dropped: the state drifts systematically over long sequences.
Stochastic rounding (SR) rounds up with probability equal to the distance to the lower grid point over the
grid spacing, so E[SR(x)] = x: rounding errors stay unbiased and grow like sqrt(steps) instead of linearly.

The rule (software, as on Hopper, which has no stochastic-rounding convert instruction; `cvt.rs` is a
Blackwell instruction):
- bf16 (fp32's exponent range, 7 mantissa bits): add 16 random bits to the low 16 bits of the fp32 pattern
  and truncate them. The carry into bit 16 happens with probability (low 16 bits) / 2^16, exactly the
  fractional distance, on the magnitude (IEEE is sign-magnitude, so the sign is unaffected); subnormals
  and the carry into the next binade follow from the same integer addition.
- fp16 (10 mantissa bits, exponents -14..15, subnormal spacing 2^-24): the same add-and-truncate on 13 bits,
  after scaling x by 2^-112 and followed by scaling back by 2^112. The scale puts fp16's smallest normal
  2^-14 at fp32's, 2^-126, so in the scaled value fp16's grid is fp32's pattern with its low 13 bits
  cleared in both ranges: 13 mantissa bits below fp16's 10 in the normal range, and in the subnormal range
  fp16's spacing 2^-24 becomes 2^-136 = 2^13 fp32 subnormal steps of 2^-149. Both scalings are exact except
  the first for |x| < 2^-14, which rounds |x| to nearest on a 2^-37 grid (13 bits below fp16's subnormal
  spacing) before the stochastic step. So with u the fp16 grid spacing at |x| and f the 13 random bits as a
  fraction in [0, 1), the result is floor(|x| / u + f) u with the sign of x (|x| so pre-rounded below 2^-14),
  as FlashInfer's software fp16 path resolves it with 13 bits. Per element: two multiplies, an add, a mask
  and the NaN select (5 sm_90 instructions; bf16's rule 3; the floor form the kernels used before, which
  built u and 1/u from the exponent of |x| and floored, 15: `benchmarks/compile_report.py`'s rule rows and
  docs/kernel_performance.md; the floor form's results differ from this rule's only below 2^-14, in 5e-5 of
  random values there, by one subnormal step).
- NaN stays NaN; infinities stay infinite; a magnitude that rounds beyond the format's largest finite
  value becomes infinite; the sign is kept (-0 stays -0, a negative value that rounds to 0 gives -0).

Randomness (`StochasticRounding.generator`). Kernels read the seed and a step counter from device memory
(`StochasticRounding.seed`, `.step`: (1,) int64 tensors), so a captured CUDA graph draws new bits on every
replay once the step counter is advanced inside it (`StochasticRounding.advance`, an in-place add on the
device). The key is seed ^ (step << 16 | salt), salt a per-layer constant < 2^16; the counter is the index
of the element in the buffer written (row * width + column), so every element of every layer and step gets
its own bits. The same (seed, step, salt, inputs) give the same bits: deterministic, bitwise equal under
graph replay.
- "hash" (the default): one 32-bit integer hash per pair of neighbouring columns (its low 16 bits for the
  even column, its high 16 for the odd one), p = row * (W / 2) + column / 2 the pair counter:
  bits = mix(lo32(p) ^ mix(hi32(p - column / 2) ^ mix(lo32(key) ^ mix(hi32(key))))), mix = the bijective
  "lowbias32" hash of C. Wellons' hash-prospector (github.com/skeeto/hash-prospector: two multiplies and
  three xor-shifts). The key and row terms are per program / per row (R values), so a pair costs an add,
  an xor and one mix. Distinct pairs of one (key, buffer) get distinct hash inputs, hence distinct 32-bit
  words (mix is a bijection). Why: Philox-4x32-10 costs 10 rounds of 2 wide multiplies per 128 bits (16
  elements' worth at 16 bits each, ~1.3 multiplies per element against 1 here) and more registers (sm_90
  compile of the Super V3 per-step replay, bf16 state, Triton 3.9: `mma` 145 registers / 1776 SASS
  instructions with Philox, 127 / 1616 with the hash, 112 / 1400 rounding to nearest; `fma` 106 / 2136,
  100 / 2064, 95 / 1784). A weaker generator than Philox, but stochastic rounding needs only uniform bits
  uncorrelated with the values rounded (tests/test_stochastic_rounding.py tests uniformity and
  independence at a fixed seed).
- "philox": Philox-4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Triton's
  `tl.randint4x`), `philox_rounds` rounds, the counter the index of a group of 8 elements (4 x 32 bits =
  8 x 16 bits per call). Kept to compare against (the sweep's `sr` rows time both).

The PyTorch reference (`stochastic_round_ref`) applies the same rule with bits from a torch.Generator
seeded from the same key (read to the host: the references are the CPU path). Kernel and reference do not
draw the same bits; both are unbiased and deterministic for a fixed seed.

Sources: the rounding rule as in FlashInfer's include/flashinfer/mamba/conversion.cuh (software fp16 SR on
pre-Blackwell GPUs) and the stochastic-rounding Mamba cache options of SGLang (PR 26929) and TensorRT-LLM
(PR 14509); written from the description above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

# dtypes stochastic rounding applies to (an fp32 state is never rounded)
SR_DTYPES = (torch.bfloat16, torch.float16)
MAX_SALT = 1 << 16  # salts (layer indices) live in the low 16 bits of the key's step word
GENERATORS = ("hash", "philox")  # sources of the random bits (module docstring)


@dataclass(frozen=True)
class StochasticRounding:
    """Where the random bits of stochastically rounded state writes come from (see the module docstring).

    seed: (1,) int64 on the state's device, read by every kernel launch (not baked into a CUDA graph).
    step: (1,) int64 on the same device: a counter to advance once per engine step (`advance`), on the
        device, so graph replays draw new bits.
    salt: int in [0, 2^16): distinguishes the layers sharing seed and step (the layer index).
    philox_rounds: Philox rounds per 128 random bits with generator "philox" (10 = Triton's and FlashInfer's
        default; 7 passes BigCrush too, per Salmon et al.).
    generator: "hash" (one integer hash per element, the default) or "philox" (module docstring).
    """

    seed: torch.Tensor
    step: torch.Tensor
    salt: int = 0
    philox_rounds: int = 10
    generator: str = "hash"

    @classmethod
    def create(cls, seed: int, *, device: torch.device | str, philox_rounds: int = 10,
               generator: str = "hash") -> StochasticRounding:
        """Seed and step tensors (step 0) on `device`; salt 0 (use `for_layer` per layer)."""
        return cls(seed=torch.tensor([seed], dtype=torch.int64, device=device),
                   step=torch.zeros(1, dtype=torch.int64, device=device), philox_rounds=philox_rounds,
                   generator=generator)

    def for_layer(self, salt: int) -> StochasticRounding:
        """The same seed / step tensors with another salt (layer index)."""
        return replace(self, salt=salt)

    def advance(self) -> None:
        """step += 1 on the device (graph-capturable; call once per engine step, after every layer)."""
        self.step.add_(1)

    def device_key(self) -> torch.Tensor:
        """The key seed ^ (step << 16 | salt) as a (1,) int64 tensor computed on the device (no host sync,
        CUDA-graph capturable: a replay after :meth:`advance` gives the new key), for a kernel that takes its
        seed as a tensor (FlashInfer's ``rand_seed``: kernels.mamba2.flashinfer_replay)."""
        return torch.bitwise_xor(self.seed, torch.bitwise_or(torch.bitwise_left_shift(self.step, 16), self.salt))

    def key(self) -> int:
        """The Philox key the kernels compute on the device, read to the host (a sync; references only)."""
        return int(self.device_key().item())

    def check(self, state: torch.Tensor, name: str) -> None:
        """Raise ValueError unless this can round writes of `state` (a 16-bit state on the same device)."""
        if state.dtype not in SR_DTYPES:
            raise ValueError(f"{name}: stochastic rounding applies to bfloat16 / float16 states, got a "
                             f"{state.dtype} state (nothing is rounded: pass stochastic_rounding=None)")
        for what, t in (("seed", self.seed), ("step", self.step)):
            if t.shape != (1,) or t.dtype != torch.int64 or t.device != state.device:
                raise ValueError(f"{name}: stochastic_rounding.{what} must be a (1,) int64 tensor on "
                                 f"{state.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
        if not 0 <= self.salt < MAX_SALT:
            raise ValueError(f"{name}: stochastic_rounding.salt must be in [0, {MAX_SALT}), got {self.salt}")
        if self.philox_rounds < 1:
            raise ValueError(f"{name}: philox_rounds must be >= 1, got {self.philox_rounds}")
        if self.generator not in GENERATORS:
            raise ValueError(f"{name}: stochastic_rounding.generator must be one of {GENERATORS}, got "
                             f"{self.generator!r}")


def launch_args(rounding: StochasticRounding | None, state: torch.Tensor, name: str) -> dict:
    """Keyword arguments of a kernel launch for `rounding` (None: round to nearest). SR_ROUNDS, a constexpr
    of every state-writing kernel: the Philox rounds, or 0 for the "hash" generator."""
    if rounding is None:
        return dict(sr_seed_ptr=state, sr_step_ptr=state, sr_salt=0, SR=False, SR_ROUNDS=1)
    rounding.check(state, name)
    return dict(sr_seed_ptr=rounding.seed, sr_step_ptr=rounding.step, sr_salt=rounding.salt, SR=True,
                SR_ROUNDS=rounding.philox_rounds if rounding.generator == "philox" else 0)


# ---------------------------------------------------------------------------------------------------------
# Triton helpers
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def sr_key(seed_ptr, step_ptr, salt):
    """The random-bits key, int64: seed ^ (step << 16 | salt), read from device memory."""
    seed = tl.load(seed_ptr)
    step = tl.load(step_ptr)
    return seed ^ ((step << 16) | salt)


@triton.jit
def intermediate_rows(row):
    """Rows of the rewind verify's intermediate-state buffer as counter rows: offset by 2^40, so they
    never share counters (hence bits) with the state's rows (< 2^40 per buffer) written under the same key."""
    return row + (1 << 40)


@triton.jit
def mix32(x):
    """uint32 -> uint32 bijective integer hash: "lowbias32" of C. Wellons' hash-prospector
    (github.com/skeeto/hash-prospector): xor-shift 16, multiply, xor-shift 15, multiply, xor-shift 16."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _hash_key(key):
    """The "hash" generator's per-program input (`random_bits16`): uint32 from the int64 key."""
    return mix32(key.to(tl.uint32) ^ mix32((key >> 32).to(tl.uint32)))


@triton.jit
def _bits_from_key(key, kk, row, col0, R: tl.constexpr, C: tl.constexpr, W: tl.constexpr, ROUNDS: tl.constexpr):
    """`random_bits16` given its per-program hash input kk = `_hash_key(key)` (unused by Philox)."""
    if ROUNDS == 0:
        W2: tl.constexpr = W // 2 if C >= 2 else W
        base = row * W2  # (R,) int64: the counter of each row's first pair
        k_row = mix32((base >> 32).to(tl.uint32) ^ kk)  # per row
        lo = base.to(tl.uint32)
        # one hash per pair of neighbouring columns: its low 16 bits for the even column, its high 16 bits
        # for the odd one (the pair counter is row * (W / 2) + col / 2). Distinct pairs -> distinct
        # (k_row, lo + c) inputs: rows sharing hi32(row * W2) have lo32 values W2 apart (W2 divides 2^32)
        # and c < W2
        C2: tl.constexpr = C // 2 if C >= 2 else 1
        c0 = col0 // 2 if C >= 2 else col0
        hsh = mix32((lo[:, None] + (c0 + tl.arange(0, C2)).to(tl.uint32)[None, :]) ^ k_row[:, None])
        if C >= 2:
            res = tl.reshape(tl.join((hsh & 0xFFFF).to(tl.int32), (hsh >> 16).to(tl.int32)), (R, C))
        else:
            res = (hsh & 0xFFFF).to(tl.int32)
    elif C >= 8:
        C8: tl.constexpr = C // 8
        ctr = row[:, None] * (W // 8) + (col0 // 8 + tl.arange(0, C8))[None, :]  # (R, C8) int64
        r0, r1, r2, r3 = tl.randint4x(key, ctr, ROUNDS)
        m = 0xFFFF
        a = tl.join(r0 & m, (r0 >> 16) & m)
        b = tl.join(r1 & m, (r1 >> 16) & m)
        c = tl.join(r2 & m, (r2 >> 16) & m)
        d = tl.join(r3 & m, (r3 >> 16) & m)
        bits = tl.join(tl.join(a, b), tl.join(c, d))  # (R, C8, 2, 2, 2)
        res = tl.reshape(bits, (R, C)).to(tl.int32, bitcast=True)
    else:  # narrow tiles (tests, tiny models)
        ctr = row[:, None] * W + (col0 + tl.arange(0, C))[None, :]
        res = tl.randint(key, ctr, ROUNDS).to(tl.int32, bitcast=True) & 0xFFFF
    return res


@triton.jit
def random_bits16(key, row, col0, R: tl.constexpr, C: tl.constexpr, W: tl.constexpr, ROUNDS: tl.constexpr):
    """(R, C) int32 tensor of independent 16-bit random values (in the low bits), for the columns col0 ..
    col0 + C - 1 of rows `row` ((R,) int64 global row index of the buffer written, unique per row) of a
    buffer W columns wide (C, W powers of two, col0 a multiple of C), from the int64 `key`.
    ROUNDS = 0: the "hash" generator, one `mix32` per pair of columns (module docstring). ROUNDS > 0: Philox with
    that many rounds, one call per 8 elements (counter = row * (W / 8) + column group), one per element
    when C < 8."""
    return _bits_from_key(key, _hash_key(key), row, col0, R, C, W, ROUNDS)  # (kk: dead code for Philox)


@triton.jit
def stochastic_round(x, bits, IS_BF16: tl.constexpr):
    """fp32 x -> fp32 values on the bf16 (IS_BF16) or fp16 grid, rounded stochastically with `bits` (int32,
    16 random low bits per element); converting the result to the 16-bit dtype is exact."""
    if IS_BF16:
        r = ((x.to(tl.int32, bitcast=True) + (bits & 0xFFFF)) & -65536).to(tl.float32, bitcast=True)
        r = tl.where(x != x, x, r)  # NaN stays NaN (0x7FFFFFFF + bits would carry into the sign)
    else:
        # fp16 in fp32's pattern: x 2^-112 puts fp16's smallest normal 2^-14 at fp32's 2^-126, so fp16's grid
        # is fp32's with the pattern's low 13 bits cleared in both its normal and subnormal ranges (fp16's
        # subnormal spacing 2^-24 -> 2^-136 = 2^13 fp32 subnormal steps): bf16's add-and-truncate on 13 bits,
        # scaled back exactly (the module docstring's rule)
        y = (x * 1.925929944387236e-34).to(tl.int32, bitcast=True)
        r = ((y + (bits & 0x1FFF)) & -8192).to(tl.float32, bitcast=True) * 5.192296858534828e33
        r = tl.where(x != x, x, r)  # NaN stays NaN
    return r


# ---------------------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------------------


def _round_bits(x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rule of `stochastic_round` in torch: fp32 x, int32 bits (16 random low bits) -> `dtype`."""
    x = x.float()
    if dtype == torch.bfloat16:
        xi = (x.view(torch.int32) + (bits & 0xFFFF)) & -65536
        r = xi.view(torch.float32)
    else:  # fp16's grid as fp32's pattern truncated by 13 bits after scaling by 2^-112 (module docstring)
        y = (x * 2.0**-112).view(torch.int32)
        r = ((y + (bits & 0x1FFF)) & -8192).view(torch.float32) * 2.0**112
    return torch.where(torch.isnan(x), x, r).to(dtype)


def stochastic_round_ref(x: torch.Tensor, dtype: torch.dtype, rounding: StochasticRounding | None,
                         stream: int = 0) -> torch.Tensor:
    """x (any shape, float) rounded to `dtype`: round-to-nearest when `rounding` is None or dtype is fp32,
    else stochastically with torch random bits from a generator seeded by (rounding.key(), stream).

    `stream` separates several roundings of one call (e.g. a state and the intermediate states). Reads the
    seed / step to the host (a sync): the references' CPU path.
    """
    if rounding is None or dtype not in SR_DTYPES:
        return x.to(dtype)
    g = torch.Generator(device=x.device)
    g.manual_seed((rounding.key() * 0x9E3779B1 + stream) & ((1 << 63) - 1))
    bits = torch.randint(0, 1 << 16, x.shape, generator=g, device=x.device, dtype=torch.int32)
    return _round_bits(x, bits, dtype)


@triton.jit
def sr_tile_keys(seed_ptr, step_ptr, salt, SR: tl.constexpr):
    """The per-program part of the random bits, (key, kk) = (`sr_key`, its hash), for `round_to_state_keyed`:
    computed once before a loop over column chunks, the compiler cannot hoist it out of such a loop itself
    (the loop's state stores may alias seed_ptr / step_ptr, so their loads stay in every chunk). Whether it
    pays depends on the kernel's registers: the callers hoist it where it measured faster
    (docs/kernel_performance.md, "the key hoisted").
    Arguments as `round_to_state`'s; without SR, placeholders that are never read."""
    if SR:
        key = sr_key(seed_ptr, step_ptr, salt)
        kk = _hash_key(key)  # dead code (removed) for Philox
    else:
        key = salt
        kk = salt
    return key, kk


@triton.jit
def round_to_state_keyed(h, state_ptr, row, col0, key, kk, R: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                         SR: tl.constexpr, ROUNDS: tl.constexpr):
    """`round_to_state` with its per-program part precomputed by `sr_tile_keys` (same result, bit for bit)."""
    if SR:
        bits = _bits_from_key(key, kk, row, col0, R, C, W, ROUNDS)
        r = stochastic_round(h, bits, state_ptr.dtype.element_ty == tl.bfloat16)
    else:
        r = h.to(state_ptr.dtype.element_ty).to(tl.float32)
    return r


@triton.jit
def round_to_state(h, state_ptr, row, col0, seed_ptr, step_ptr, salt, R: tl.constexpr, C: tl.constexpr,
                   W: tl.constexpr, SR: tl.constexpr, ROUNDS: tl.constexpr):
    """fp32 tile h (R, C) -> fp32 values exactly representable in the dtype `state_ptr` points to: rounded to
    nearest, or stochastically (SR) with random bits (`random_bits16`; ROUNDS 0 = the "hash" generator, else
    Philox rounds) keyed by `sr_key(seed_ptr, step_ptr, salt)` for the tile's global rows `row` (R,) int64 and
    columns col0 .. col0 + C - 1 of a buffer W columns wide (seed_ptr / step_ptr are read only with SR).
    Inside a loop over column chunks, `sr_tile_keys` before the loop and `round_to_state_keyed` in it read
    and hash the key once."""
    key, kk = sr_tile_keys(seed_ptr, step_ptr, salt, SR)
    return round_to_state_keyed(h, state_ptr, row, col0, key, kk, R, C, W, SR, ROUNDS)
