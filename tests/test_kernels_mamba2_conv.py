"""kernels/mamba2/conv.py: the decode / verify conv step (windows read and written in the cache) against its
PyTorch reference, in the Triton interpreter on the CPU and at Super V3's conv width on a GPU; then the
engine's Mamba2 mixer taking it (plain decode, rewind verify, replay verify) against the reference path.

The three cache uses of the engine: decode (src = dst, the last W - 1 inputs kept), rewind verify (the whole
window to a separate per-step buffer), replay verify (src = dst, read at each row's column offset, written
from column 1). Outputs agree to float32 rounding (2 ulps of the dtype, relative to the pre-activation's
magnitude); the stored windows bitwise. PAD rows share the scratch row, as the engine maps them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.mamba2.conv import MAX_T, causal_conv_step, causal_conv_step_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 2**-21, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _case(mode, B, T, C, W, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = rn(B, T, C + 5).to(DEV, dtype)[:, :, 5:]  # a column slice of the projection, as xBC is
    w = (rn(C, W) * 0.5).to(DEV, dtype)
    b = rn(C).to(DEV, dtype) if bias else None
    S = B + 3
    rows = torch.tensor([S - 1, 0, 2, S - 1][:B], device=DEV)  # two rows on the scratch row, as PAD rows
    cols = None
    if mode == "decode":
        src = rn(S, C, W - 1).to(DEV, dtype)
        dst, dst_from = src, T
    elif mode == "rewind":
        src = rn(S, C, W - 1).to(DEV, dtype)
        dst, dst_from = torch.zeros(S, C, W - 1 + T, device=DEV, dtype=dtype), 0
    else:  # replay: the buffer keeps W - 1 + K columns; each row's window starts at its offset
        src = rn(S, C, W - 1 + T - 1).to(DEV, dtype)
        dst, dst_from = src, 1
        cols = torch.tensor([0, T - 1, 1, 0][:B], device=DEV)
    return x, src, rows, w, b, dst, dst_from, cols


def _run(fn, case):
    x, src, rows, w, b, dst, dst_from, cols = case
    src2 = src.clone()
    dst2 = src2 if dst is src else dst.clone()
    out = fn(x, src2, rows, w, b, dst2, rows, dst_from, cols)
    return out, dst2


def _check(mode, case, live):
    (got, got_dst), (want, want_dst) = _run(causal_conv_step, case), _run(causal_conv_step_ref, case)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    dtype = want.dtype
    err = (got[live].float() - want[live].float()).abs()
    assert (err <= 2 * ULP[dtype] * want[live].float().abs().clamp(min=1.0) + 1e-6).all(), err.max().item()
    rows = case[2][live].unique()
    assert torch.equal(got_dst[rows], want_dst[rows]), mode  # the live rows' stored windows, bitwise
    others = [r for r in range(got_dst.shape[0]) if r not in case[2].tolist()]
    assert torch.equal(got_dst[others], case[5][others])  # rows of no batch row untouched


@pytest.mark.parametrize("mode, T", [("decode", 1), ("rewind", 4), ("replay", 4), ("replay", 2),
                                     ("rewind", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_reference(mode, T, dtype, bias):
    case = _case(mode, B=4, T=T, C=200, W=4, dtype=dtype, bias=bias, seed=T)
    _check(mode, case, live=torch.tensor([1, 2], device=DEV))  # rows 0 and 3 share the scratch row


def test_single_scratch_row_and_width_2():
    """One PAD row only (all its values the reference's) and a one-column window (W = 2)."""
    case = _case("replay", B=1, T=3, C=130, W=2, dtype=torch.float32, seed=5)
    _check("replay", case, live=torch.tensor([0], device=DEV))


def test_rows_strided_or_negative_read_what_torch_indexing_reads():
    """Strided row / column indices are read by position as torch reads them, and a negative row counts from
    the end (-1: the scratch row), in src and in dst."""
    x, src, _, w, b, dst, dst_from, cols = _case("replay", B=3, T=4, C=64, W=4, dtype=torch.float32, seed=6)
    rows = torch.tensor([0, 9, 2, 9, -1, 9], device=DEV)[::2]  # 0, 2, -1 (a view)
    cols = torch.tensor([1, 7, 0, 7, 3, 7], device=DEV)[::2]
    got_src, want_src = src.clone(), src.clone()
    got = causal_conv_step(x, got_src, rows, w, b, got_src, rows, dst_from, cols)
    want = causal_conv_step_ref(x, want_src, rows, w, b, want_src, rows, dst_from, cols)
    torch.testing.assert_close(got, want, rtol=4 * ULP[torch.float32], atol=1e-6)
    assert torch.equal(got_src, want_src)


def test_bad_inputs_are_refused_with_the_problem_named():
    x, src, rows, w, b, dst, dst_from, _ = _case("decode", B=2, T=1, C=16, W=4, dtype=torch.float32)
    cases = [
        (lambda: causal_conv_step(x.to(torch.bfloat16), src, rows, w, b, dst, rows, 1), "share one dtype"),
        (lambda: causal_conv_step(x, src[:, :8], rows, w, b, dst, rows, 1), "channels expected"),
        (lambda: causal_conv_step(x, src, rows[:1], w, b, dst, rows, 1), "src_rows must be"),
        (lambda: causal_conv_step(x, src, rows.float(), w, b, dst, rows, 1), "src_rows must be"),
        (lambda: causal_conv_step(x, src, rows, w, b, dst, None, 1), "dst and dst_rows together"),
        (lambda: causal_conv_step(x, src, rows, w, b, dst, rows, 0), "dst must be"),  # 4 columns into 3
        (lambda: causal_conv_step(x, src[..., :2], rows, w, b, None, None), "window columns"),
        (lambda: causal_conv_step(x.expand(2, MAX_T + 1, 16), src, rows, w, b), "decode / verify sizes"),
    ]
    for call, says in cases:
        with pytest.raises(ValueError, match=says):
            call()


@pytest.mark.gpu
def test_gpu_super_v3_width_and_cuda_graph_capture():
    """Super V3's conv (d_inner 8192 + 2 x 8 groups x 128 = 10,240 channels, W = 4) at batch 64, bf16, replay
    verify (T = 4) and decode: against the reference; then captured in a CUDA graph and replayed on new
    inputs equal to eager bitwise (the cache restored between the runs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for mode, T in (("replay", 4), ("decode", 1)):
        case = list(_case(mode, B=4, T=T, C=10240, W=4, dtype=torch.bfloat16, seed=7))
        big = torch.randn(64, T, 10240 + 5, device="cuda").to(torch.bfloat16)[:, :, 5:]
        S = 70
        src = torch.randn(S, 10240, case[1].shape[2], device="cuda").to(torch.bfloat16)
        rows = torch.randperm(S - 1, device="cuda")[:64]
        cols = None if mode == "decode" else torch.randint(0, T, (64,), device="cuda")
        case = (big, src, rows, case[3], case[4], src, case[6], cols)
        _check(mode, case, live=torch.arange(64, device="cuda"))
        saved = src.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = causal_conv_step(big, src, rows, case[3], case[4], src, rows, case[6], cols)
        src.copy_(saved)
        big.normal_()
        graph.replay()
        after = src.clone()
        src.copy_(saved)
        eager = causal_conv_step(big, src, rows, case[3], case[4], src, rows, case[6], cols)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager) and torch.equal(after, src)


# ---------------------------------------------------------------------------------------- in the engine


@pytest.mark.parametrize("draft_len, replay", [(0, False), (2, False), (2, True)])
def test_engine_mixer_takes_the_kernel_and_gives_the_same_tokens(tmp_path, monkeypatch, draft_len, replay):
    """The Mamba2 mixer's conv through causal_conv_step (its use_inference_kernel forced, the kernel in the
    interpreter) against the reference path: the same greedy tokens, plain decode, rewind and replay MTP."""
    from ckpt_factory import make_hf_model, write_checkpoint

    import runners.engine.models.mamba2 as mamba2_mod
    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    ckpt = write_checkpoint(tmp_path / "ck", make_hf_model(seed=3), with_mtp=True)
    calls = []

    def run(fused: bool):
        with monkeypatch.context() as m:
            if fused:
                fn = mamba2_mod.causal_conv_step
                m.setattr(mamba2_mod, "use_inference_kernel", lambda x: True)
                m.setattr(mamba2_mod, "causal_conv_step", lambda *a: calls.append(1) or fn(*a))
            options = EngineOptions(draft_len=draft_len, ssm_replay=replay, max_batch_size=2, max_seq_len=64)
            return Engine.from_pretrained(ckpt, options).generate([[3, 4, 5], [6, 7]], 6).tokens

    assert run(True) == run(False) and calls
