"""Mamba2 SSM replay through FlashInfer's ``checkpointing_ssu`` (flashinfer.mamba, 0.7.2): its ring history,
the per-slot bookkeeping it leaves to the caller, and a plain-PyTorch reference of its contract.

FlashInfer's "ReplaySSM" contract (include/flashinfer/mamba/checkpointing_ssu.cuh in FlashInfer 0.7.2):

    state     (S, H, P, N)          the checkpoint: the state before the slot's pending tokens
    x_cache   (S, H, R, P)          input dtype   a ring of R = W + T rows per slot: the pending tokens' x,
    B_cache   (S, G, R, N)          input dtype   B and processed dt' = softplus(dt + dt_bias), W the
    dt_cache  (S, H, R)             fp32          replay window (<= 16), T the verify width
    ring_start (S,) int32           the oldest live row: pending token j (< pnat) is row (ring_start + j) % R
    pnat      (S,) int32            prev_num_accepted_tokens: the pending tokens

A call, for each row b of slot s with k = pnat[s]: fast-forward the checkpoint by the k pending tokens
(recomputing their decays from dt_cache), run the T new tokens from there (y_t = C_t . h_t + D x_t), append
the new tokens' x, B, dt' at rows (ring_start + k + t) % R, and, when they do not fit behind the pending ones
(k + T > W: a "flush"), store the fast-forwarded state as the new checkpoint. The kernel never moves
ring_start or pnat: the caller does, after acceptance of a tokens (``kernels.commit.replay_advance`` with
``ring_start=``, one launch; its reference ``kernels.commit.ring_advance``): on a flush ring_start += k (the
pending tokens are folded in) and pnat = a, else pnat = k + a.

That is the project's own checkpointing replay (kernels/mamba2/replay.py, ``hist_len`` L = W) in another
layout: the same flush rule (k + T > L), the same PNAT update, the state written at the same steps, so the two
backends keep the same committed states and produce the same outputs up to where each rounds. FlashInfer
rounds more: its fast-forward multiplies the pending tokens' x by coeff_j * B_j rounded to x's dtype (bf16
tensor-core operands, include/flashinfer/mamba/kernel_checkpointing_ssu_common.cuh in 0.7.2), and its outputs
take the state as a bf16 operand; the reference below keeps float32 there, as our kernels do, so at bf16 the
two part at near ties (tests/near_ties.py). With W = T (flush whenever k > 0) it is the per-step replay. Only
the history differs (a ring instead of a window rewritten from position 0 on a flush, and no dA_cumsum).

- :class:`RingHistory`: one layer's ring (allocation and the memory plan read its :meth:`RingHistory.shapes`).
- :func:`replay_verify_flashinfer` runs ``flashinfer.mamba.checkpointing_ssu`` on CUDA;
  :func:`replay_verify_flashinfer_ref` (same signature and effects) is the contract in PyTorch, what the
  tests compare it with and what a CPU run calls.
- ``ring_advance`` (imported from kernels/commit.py, which owns the per-slot bookkeeping): ring_start after a
  verify step (before PNAT moves), for the live rows.
- :func:`flashinfer_replay_unsupported`: why FlashInfer cannot run a configuration (None when it can).
- :func:`tied`: the stride-0 layout FlashInfer's Mamba2 kernels take per-head values in.

Source: FlashInfer 0.7.2, flashinfer/mamba/checkpointing_ssu.py (the Python contract) and
include/flashinfer/mamba/checkpointing_ssu.cuh (the ring's bookkeeping); the recurrence is Mamba2's SSD
(Dao & Gu, "Transformers are SSMs", 2024).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.commit import ring_advance  # noqa: F401  (the ring's rule, owned by kernels/commit.py)
from kernels.rounding import StochasticRounding, stochastic_round_ref

# FlashInfer 0.7.2: checkpointing_ssu keeps at most 16 pending tokens (max_window), and the verify width must
# not exceed the window (npredicted <= max_window)
MAX_WINDOW = 16
# the activation dtypes its kernel is built for (x, B, C, z in 16-bit tensor-core operands)
INPUT_DTYPES = (torch.bfloat16, torch.float16)
# the state dtypes it rounds stochastically (its rand_seed): float16 only (include/flashinfer/mamba/
# conversion.cuh: the software fp16 rule before Blackwell, `cvt.rs.f16x2.f32` on it; no bf16 path)
SR_STATE_DTYPES = (torch.float16,)


@dataclass
class RingHistory:
    """One Mamba2 layer's replay history in FlashInfer's ring layout (module docstring).

    x_cache: (S, H, R, P) input dtype; B_cache: (S, G, R, N) input dtype; dt_cache: (S, H, R) float32
    processed dt'. R = W + T: the window W (replay_hist_len) plus the verify width T.
    """

    x_cache: torch.Tensor
    B_cache: torch.Tensor
    dt_cache: torch.Tensor

    @staticmethod
    def shapes(num_slots: int, window: int, spec_tokens: int, nheads: int, head_dim: int, ngroups: int,
               d_state: int, *, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{field: (shape, dtype)} of a layer's ring for ``num_slots`` slots, window W and verify width T."""
        S, R, H, P, G, N = num_slots, window + spec_tokens, nheads, head_dim, ngroups, d_state
        return {"x_cache": ((S, H, R, P), dtype), "B_cache": ((S, G, R, N), dtype),
                "dt_cache": ((S, H, R), torch.float32)}

    @property
    def ring_len(self) -> int:
        """R, the ring's rows per slot."""
        return self.x_cache.shape[2]

    def nbytes(self) -> int:
        """Bytes of the three ring tensors."""
        return sum(t.numel() * t.element_size() for t in (self.x_cache, self.B_cache, self.dt_cache))


def flashinfer_replay_unsupported(spec_tokens: int, window: int, time_step_limit: tuple[float, float] | None,
                                  dtype: torch.dtype | None = None, *, stochastic_rounding: bool = False,
                                  state_dtype: torch.dtype | None = None) -> str | None:
    """Why FlashInfer's checkpointing_ssu cannot run this replay configuration, or None when it can: a window
    above MAX_WINDOW, a verify wider than the window, a dt clamp (it has none), or activations (``dtype``, the
    model's compute dtype; None: not checked) other than bfloat16 / float16 (its kernel multiplies 16-bit
    tensor-core fragments: FlashInfer 0.7.2 ``kernel_checkpointing_ssu_main.cuh``; a float32 build fails in
    its JIT), or ``stochastic_rounding`` of a ``state_dtype`` other than float16 (:data:`SR_STATE_DTYPES`)."""
    if window > MAX_WINDOW:
        return f"its replay window is at most {MAX_WINDOW} tokens (this run needs {window})"
    if spec_tokens > window:
        return f"the verify width T = {spec_tokens} exceeds its window {window}"
    if time_step_limit is not None and tuple(time_step_limit) != (0.0, math.inf):
        return f"it does not clamp dt (the model's time_step_limit is {tuple(time_step_limit)})"
    if dtype is not None and dtype not in INPUT_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return (f"its kernel takes bfloat16 / float16 activations (16-bit tensor-core operands); this run "
                f"computes in {name} (dtype=bfloat16 runs it)")
    if stochastic_rounding and state_dtype not in SR_STATE_DTYPES:
        name = str(state_dtype).removeprefix("torch.")
        return (f"it rounds stochastically into a float16 state only, not {name} (ssm_state_dtype=float16 "
                "runs it)")
    return None


def tied(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """FlashInfer's tie_hdim layout of a per-head value ``t`` [H] or [..., H]: a view of ``shape`` (its leading
    dims ``t``'s, then head_dim and d_state) broadcast by stride 0. Copies nothing."""
    return t.reshape(*t.shape, *([1] * (len(shape) - t.dim()))).expand(shape)


def weight_dtype(D_dtype: torch.dtype, dt_bias_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``checkpointing_ssu`` is given D and dt_bias in (its contract: one dtype for both, part of its
    JIT module's key): theirs where they share one, so the call casts nothing, else float32."""
    return D_dtype if D_dtype == dt_bias_dtype else torch.float32


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, T, heads or groups, width) as FlashInfer's checks take it: its last two dims contiguous, the
    batch and token strides free (x, B and C arrive as views of the conv output: no copy); else a copy."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def replay_verify_flashinfer(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                             slot_ids: torch.Tensor, history: RingHistory, ring_start: torch.Tensor,
                             prev_num_accepted: torch.Tensor, *, out: torch.Tensor | None = None,
                             rounding: StochasticRounding | None = None) -> torch.Tensor:
    """One replay verify of a Mamba2 layer by ``flashinfer.mamba.checkpointing_ssu`` (monolithic kernel).

    Args:
        state: (S, H, P, N) the checkpoints (bfloat16 / float16 / float32); mutated on flush rows.
        x: (B, T, H, P) input dtype; dt: (B, T, H) raw dt, any float dtype; A: (H,) negative decay rates;
            B, C: (B, T, G, N); D, dt_bias: (H,). x, B, C may be strided views (their last two dims
            contiguous, as the conv output's split gives them): they are read in place.
        slot_ids: (B,) int32 / int64 cache rows (passed as they are); every row is run (PAD rows must
            already point at a scratch row, as ``BatchMeta.row_index`` maps them).
        history: the layer's :class:`RingHistory`; mutated (the new tokens appended).
        ring_start, prev_num_accepted: (S,) int32, read only (:func:`ring_advance` moves them).
        out: optional (B, T, H, P) in x's dtype.
        rounding: stochastic rounding of the flushed checkpoints (float16 state only), its bits FlashInfer's
            Philox stream seeded per layer and step by ``rounding.device_key()`` (FlashInfer offsets each
            thread's stream itself) with ``rounding.philox_rounds`` rounds; None: round to nearest.

    Returns:
        (B, T, H, P) in x's dtype, D x included.

    Raises:
        ValueError: ``rounding`` with a state other than float16.
        ImportError: flashinfer.mamba is not importable; RuntimeError / AssertionError from FlashInfer for a
            shape or dtype its JIT cannot build (the engine probes before use: runners/engine/runner.py).
    """
    _check_rounding(state, rounding)
    import flashinfer.mamba as fim

    b, T, H, P = x.shape
    N = state.shape[-1]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # Every operand in the layout and dtype the engine holds it in (FlashInfer takes strided batch / token
    # dims, dt in its own dtype, converted to float32 inside, and int32 or int64 slot indices), so the call is
    # one launch: no copies of x, B, C, no casts of dt, D, dt_bias or the slot ids. A is float32 already
    # (Mamba2.decay_rate). D and dt_bias share a dtype in its contract (weight_dtype).
    wd = weight_dtype(D.dtype, dt_bias.dtype)
    fim.checkpointing_ssu(
        state, history.x_cache, history.B_cache, history.dt_cache, ring_start, prev_num_accepted,
        _inner_contiguous(x), tied(dt if dt.stride(-1) == 1 else dt.contiguous(), (b, T, H, P)),
        tied(A.float(), (H, P, N)), _inner_contiguous(B), _inner_contiguous(C), out,
        D=tied(D.to(wd), (H, P)), dt_bias=tied(dt_bias.to(wd), (H, P)), dt_softplus=True,
        state_batch_indices=slot_ids if slot_ids.dtype in (torch.int32, torch.int64) else slot_ids.long(),
        algorithm="monolith",
        **({} if rounding is None else {"rand_seed": rounding.device_key(),
                                        "philox_rounds": rounding.philox_rounds}),
    )
    return out


def _check_rounding(state: torch.Tensor, rounding: StochasticRounding | None) -> None:
    """Raise ValueError for stochastic rounding of a state FlashInfer does not round (SR_STATE_DTYPES)."""
    if rounding is not None and state.dtype not in SR_STATE_DTYPES:
        raise ValueError(f"FlashInfer's checkpointing_ssu rounds stochastically into a float16 state only, got "
                         f"{state.dtype}; use ssm_backend='triton' for stochastic rounding of a bf16 state")


def replay_verify_flashinfer_ref(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                                 slot_ids: torch.Tensor, history: RingHistory, ring_start: torch.Tensor,
                                 prev_num_accepted: torch.Tensor, *, out: torch.Tensor | None = None,
                                 rounding: StochasticRounding | None = None) -> torch.Tensor:
    """FlashInfer's checkpointing_ssu contract in PyTorch: same arguments, effects and result as
    :func:`replay_verify_flashinfer` (module docstring), token by token in float32, vectorised over the rows.

    For each row b (slot s = slot_ids[b]; a negative id is FlashInfer's pad_slot_id: the row is skipped and
    its output is zero), k = pnat[s] clamped to [0, W] (W = R - T):
    1. h = state[s] fast-forwarded by ring rows (ring_start[s] + j) % R, j < k: h <- exp(A dt'_j) h +
       dt'_j x_j (outer) B_j;
    2. if k + T > W, state[s] = h in its dtype (stochastically rounded with ``rounding``: the rule of
       kernels.rounding with torch's random bits, so the same distribution as FlashInfer's, not its bits);
       the new tokens continue from h rounded to nearest in that dtype (FlashInfer rounds only its store of
       the state stochastically; the copy its outputs read is rounded to nearest);
    3. for t < T, dt'_t = softplus(dt_t + dt_bias), h <- exp(A dt'_t) h + dt'_t x_t (outer) B_t,
       y_t = C_t . h + D x_t;
    4. x_t, B_t, dt'_t are written to ring rows (ring_start[s] + k + t) % R.
    Rows of one launch must name distinct slots (as the engine's batches do).
    """
    _check_rounding(state, rounding)
    b, T, H, P = x.shape
    G = B.shape[2]
    R = history.ring_len
    W = R - T
    if out is None:
        out = torch.empty_like(x)
    out.zero_()
    rows = (slot_ids >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    s = slot_ids[rows].long()
    n = rows.numel()
    heads_per_group = H // G
    head_group = torch.arange(H, device=x.device) // heads_per_group
    k = prev_num_accepted[s].long().clamp(0, W)
    start = ring_start[s].long()
    Af = A.float()
    h = state[s].float()  # (n, H, P, N)
    for j in range(W):  # the pending tokens, masked per row
        live = (j < k)[:, None, None, None]
        row = (start + j) % R
        dtj = history.dt_cache[s, :, row]  # (n, H)
        xj = history.x_cache[s, :, row].float()  # (n, H, P)
        Bj = history.B_cache[s, :, row].float()[:, head_group]  # (n, H, N)
        step = torch.exp(Af * dtj)[:, :, None, None] * h + (dtj[:, :, None] * xj)[..., None] * Bj[:, :, None, :]
        h = torch.where(live, step, h)
    flush = k + T > W
    if bool(flush.any()):
        state[s[flush]] = stochastic_round_ref(h[flush], state.dtype, rounding)
        h[flush] = h[flush].to(state.dtype).float()
    dtp = F.softplus(dt[rows].float() + dt_bias.float())  # (n, T, H)
    xr, Br, Cr = x[rows].float(), B[rows].float(), C[rows].float()
    y = torch.empty(n, T, H, P, dtype=torch.float32, device=x.device)
    for t in range(T):
        Bt, Ct = Br[:, t][:, head_group], Cr[:, t][:, head_group]  # (n, H, N)
        h = torch.exp(Af * dtp[:, t])[:, :, None, None] * h + \
            (dtp[:, t][:, :, None] * xr[:, t])[..., None] * Bt[:, :, None, :]
        y[:, t] = (h * Ct[:, :, None, :]).sum(-1) + D.float()[None, :, None] * xr[:, t]
        row = (start + k + t) % R
        history.x_cache[s, :, row] = x[rows, t].to(history.x_cache.dtype)
        history.B_cache[s, :, row] = B[rows, t].to(history.B_cache.dtype)
        history.dt_cache[s, :, row] = dtp[:, t]
    out[rows] = y.to(out.dtype)
    return out


_PROBED: dict[tuple, tuple[str | None, float]] = {}


def probe_flashinfer_replay(nheads: int, head_dim: int, ngroups: int, d_state: int, spec_tokens: int,
                            window: int, *, dtype: torch.dtype, state_dtype: torch.dtype,
                            device: torch.device | str, stochastic_rounding: bool = False,
                            param_dtype: torch.dtype | None = None) -> tuple[str | None, float]:
    """Whether FlashInfer's checkpointing_ssu runs this configuration on ``device``: one call over two rows
    (one without a flush, one with) against :func:`replay_verify_flashinfer_ref`. The first call per
    configuration JIT-builds FlashInfer's module (into its own cache folder, ``FLASHINFER_WORKSPACE_BASE``,
    reused by later processes); the probe is remembered per process. ``stochastic_rounding``: the call
    rounds its flush stochastically, as the run will (FlashInfer builds that variant as its own module).
    The call's operands are what the engine passes (FlashInfer builds one module per combination of their
    dtypes): x, B, C strided views of one (rows, T, H P + 2 G N) tensor and raw dt in ``dtype``, D and
    dt_bias in ``param_dtype`` (the model's; None: ``dtype``), int64 slot ids.

    Returns:
        (None, seconds) when it runs and matches the reference within 5e-2 of the largest output (a sanity
        bound: the GPU tests hold the kernel to tighter ones), else (the reason, seconds): the exception
        FlashInfer raised (a dtype or size its JIT cannot build) or the mismatch. ``seconds``: the probe's
        wall time, the JIT build included.
    """
    import time

    param_dtype = dtype if param_dtype is None else param_dtype
    key = (nheads, head_dim, ngroups, d_state, spec_tokens, window, dtype, state_dtype, str(device),
           stochastic_rounding, param_dtype)
    if key in _PROBED:
        return _PROBED[key]
    start = time.perf_counter()
    H, P, G, N, T, W = nheads, head_dim, ngroups, d_state, spec_tokens, window
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(dt).to(device)

    ring = RingHistory(*(rand(*shape, scale=0.5, dt=d) for shape, d in
                         RingHistory.shapes(3, W, T, H, P, G, N, dtype=dtype).values()))
    ring.dt_cache.abs_().mul_(0.1)
    state = rand(3, H, P, N, scale=0.5, dt=state_dtype)
    # x, B, C as the engine's conv output gives them: views of one tensor, strided over rows and tokens
    xBC = torch.cat([rand(2, T, H * P), rand(2, T, 2 * G * N, scale=N ** -0.5)], dim=-1)
    x, B, C = xBC.split([H * P, G * N, G * N], dim=-1)
    x, B, C = x.reshape(2, T, H, P), B.reshape(2, T, G, N), C.reshape(2, T, G, N)
    dt, A, D, dt_bias = rand(2, T, H), -rand(H, dt=torch.float32).abs() - 0.5, \
        rand(H, dt=param_dtype), rand(H, dt=param_dtype)
    slots = torch.tensor([0, 1], dtype=torch.int64, device=device)
    ring_start = torch.tensor([0, W - 1, 0], dtype=torch.int32, device=device)
    pnat = torch.tensor([1, W, 0], dtype=torch.int32, device=device)  # row 0 keeps its state, row 1 flushes
    ref_state, ref_ring = state.clone(), RingHistory(*(t.clone() for t in (ring.x_cache, ring.B_cache,
                                                                           ring.dt_cache)))
    rounding = StochasticRounding.create(0, device=device) if stochastic_rounding else None
    try:
        got = replay_verify_flashinfer(state, x, dt, A, B, C, D, dt_bias, slots, ring, ring_start, pnat,
                                       rounding=rounding)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here, say which
        result = (f"FlashInfer's checkpointing_ssu failed at this configuration: {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}", time.perf_counter() - start)
    else:
        want = replay_verify_flashinfer_ref(ref_state, x, dt, A, B, C, D, dt_bias, slots, ref_ring, ring_start,
                                            pnat, rounding=rounding)
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))
        serr = float((state.float() - ref_state.float()).abs().max()
                     / ref_state.float().abs().max().clamp(min=1e-6))
        bad = err > 5e-2 or serr > 5e-2 or not torch.isfinite(got).all()
        result = (f"FlashInfer's checkpointing_ssu differs from its contract's reference (outputs {err:.2g}, "
                  f"state {serr:.2g} of the largest value)" if bad else None, time.perf_counter() - start)
    _PROBED[key] = result
    return result


def jit_cache_dir() -> str | None:
    """FlashInfer's folder of built JIT modules (``flashinfer.jit.env.FLASHINFER_JIT_DIR``), or None."""
    try:
        from flashinfer.jit import env
    except Exception:  # noqa: BLE001 - not importable: nothing was built
        return None
    path = getattr(env, "FLASHINFER_JIT_DIR", None)
    return None if path is None else str(path)


def aot_module_dir() -> str | None:
    """FlashInfer's folder of prebuilt modules (``flashinfer.jit.env.FLASHINFER_AOT_DIR``, which it tries before
    building: tests/gpu/flashinfer_aot.py fills it for the device) when it holds any module, else None."""
    try:
        from flashinfer.jit import env
    except Exception:  # noqa: BLE001 - not importable: nothing prebuilt
        return None
    path = getattr(env, "FLASHINFER_AOT_DIR", None)
    return str(path) if path is not None and any(path.glob("*/*.so")) else None
