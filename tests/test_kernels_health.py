"""kernels/health.py: the residual add with its non-finite flag, and the flag alone, against their PyTorch
references in the Triton interpreter on the CPU (and at the releases' widths on a GPU); then the engine's
eager inference step, whose health path uses them, against the reference path (same tokens, same flagged
names, the first non-finite layer named).

The add is one float32 sum rounded to the dtype, as torch's 16-bit add, so outputs are compared bitwise.
Sizes cross the kernel's block (2048 elements) and end mid-block; a NaN, an infinity and an overflow of the
sum (finite inputs whose sum is not) each set exactly their flag; the flags accumulate and are never cleared.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

import pytest  # noqa: E402

from kernels.health import (  # noqa: E402
    BLOCK,
    flag_nonfinite,
    flag_nonfinite_ref,
    residual_add,
    residual_add_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _r(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


def _flags(n=5):
    return torch.zeros(n, dtype=torch.bool, device=DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 3, 1000), (BLOCK + 5,)])
def test_residual_add_is_torch_add_bitwise_and_flags_nothing_when_finite(dtype, shape):
    x, d = _r(*shape, dtype=dtype, seed=1), _r(*shape, dtype=dtype, seed=2)
    flags, ref_flags = _flags(), _flags()
    got = residual_add(x, d, flags, 3)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, residual_add_ref(x, d, ref_flags, 3))
    assert torch.equal(got, x + d) and not flags.any() and not ref_flags.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "overflow"])
def test_a_non_finite_sum_sets_exactly_its_flag(dtype, bad):
    n = 2 * BLOCK + 7
    x, d = _r(n, dtype=dtype, seed=3), _r(n, dtype=dtype, seed=4)
    at = BLOCK + 11  # in the second program
    if bad == "overflow":  # both terms finite, their sum beyond the dtype's range
        x[at] = d[at] = torch.finfo(dtype).max
    else:
        d[at] = float(bad)
    flags, ref_flags = _flags(), _flags()
    got = residual_add(x, d, flags, -2)  # Python-style index: flag 3 of 5
    want = residual_add_ref(x, d, ref_flags, -2)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert flags.tolist() == ref_flags.tolist() == [False, False, False, True, False]


def test_flags_accumulate_and_strided_inputs_are_read_as_their_values():
    x = _r(8, 300, dtype=torch.bfloat16, seed=5)
    d = _r(300, 8, dtype=torch.bfloat16, seed=6).t()  # not contiguous: copied first
    flags = _flags(3)
    flags[0] = True  # set by an earlier forward: kept
    assert torch.equal(residual_add(x, d, flags, 1), x + d)
    assert flags.tolist() == [True, False, False]
    d = d.clone()
    d[2, 7] = float("nan")
    residual_add(x, d, flags, 1)
    residual_add(x, x, flags, 1)  # finite again: a set flag stays set
    assert flags.tolist() == [True, True, False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flag_nonfinite_matches_reference(dtype):
    x = _r(3, BLOCK + 100, dtype=dtype, seed=7)
    flags, ref_flags = _flags(), _flags()
    flag_nonfinite(x, flags, 0)
    flag_nonfinite_ref(x, ref_flags, 0)
    assert not flags.any() and not ref_flags.any()
    x[2, -1] = float("inf")  # the last element of the last, partial program
    flag_nonfinite(x[:, ::2], flags, 4)  # a strided view misses it
    assert not flags.any()
    flag_nonfinite(x, flags, 4)
    flag_nonfinite_ref(x, ref_flags, 4)
    assert flags.tolist() == ref_flags.tolist() == [False, False, False, False, True]
    flag_nonfinite(x[:0], flags, 1)  # empty: nothing
    residual_add(x[:0], x[:0], flags, 1)
    assert not flags[1]


def test_bad_inputs_are_refused_with_the_problem_named():
    x = _r(4, 8, dtype=torch.float32, seed=8)
    flags = _flags(2)
    with pytest.raises(ValueError, match="share a shape and a dtype"):
        residual_add(x, x[:, :4], flags, 0)
    with pytest.raises(ValueError, match="share a shape and a dtype"):
        residual_add(x, x.to(torch.bfloat16), flags, 0)
    with pytest.raises(ValueError, match="share a shape and a dtype"):
        residual_add(x.long(), x.long(), flags, 0)
    with pytest.raises(ValueError, match="contiguous 1-D bool tensor"):
        residual_add(x, x, flags.int(), 0)
    with pytest.raises(ValueError, match="flag index 2 is outside the 2 flags"):
        flag_nonfinite(x, flags, 2)
    with pytest.raises(ValueError, match="must be one of"):
        flag_nonfinite(x.long(), flags, 0)
    with pytest.raises(ValueError, match="flags must be a contiguous 1-D bool tensor, got NoneType"):
        residual_add(x, x, None, 0)


@pytest.mark.gpu
def test_gpu_release_width_and_cuda_graph_capture():
    """Super V3's hidden size (4096) at batch 64 x T 4, bf16: bitwise torch's add, the flag set by one NaN;
    captured in a CUDA graph and replayed on new inputs equal to eager, flags included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x, d = _r(64, 4, 4096, dtype=torch.bfloat16, seed=9), _r(64, 4, 4096, dtype=torch.bfloat16, seed=10)
    flags = _flags(2)
    assert torch.equal(residual_add(x, d, flags, 0), x + d) and not flags.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = residual_add(x, d, flags, 1)
    d[63, 3, 4095] = float("nan")
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.nan_to_num(), (x + d).nan_to_num()) and flags.tolist() == [False, True]


# ------------------------------------------------------------------------------- the engine's health path


def test_engine_health_path_same_tokens_and_names_as_the_reference(tmp_path, monkeypatch):
    """HybridLM.forward's eager inference path (each block's residual add sets its flag, fused with the next
    norm in the backbone; the Triton kernels
    in the interpreter here, as hybrid's use_inference_kernel says on CUDA) against the reference path (max
    |x| peaks, one isfinite): same tokens; with NaN weights in layer 1 the same flagged names, the first
    being layers.1.attention."""
    from ckpt_factory import make_hf_model, write_checkpoint

    import runners.engine.models.block as block_mod
    import runners.engine.models.hybrid as hybrid_mod
    import runners.engine.models.mtp as mtp_mod
    from runners.engine import Engine
    from runners.engine.options import EngineOptions

    ckpt = write_checkpoint(tmp_path / "ck", make_hf_model(seed=3), with_mtp=True)
    launches = {"residual_add": 0, "flag_nonfinite": 0, "add_rms_norm": 0}

    def counted(name, mod):
        fn = getattr(mod, name)

        def call(*a, **k):
            launches[name] += 1
            return fn(*a, **k)
        return call

    def run(fused: bool, poison: bool):
        with monkeypatch.context() as m:
            if fused:
                for mod in (hybrid_mod, mtp_mod):
                    m.setattr(mod, "use_inference_kernel", lambda x: True)
                for mod, name in ((block_mod, "residual_add"), (block_mod, "flag_nonfinite"),
                                  (hybrid_mod, "flag_nonfinite"), (mtp_mod, "flag_nonfinite"),
                                  (block_mod, "add_rms_norm")):
                    m.setattr(mod, name, counted(name, mod))
            options = EngineOptions(draft_len=2, max_batch_size=2, max_seq_len=64)
            engine = Engine.from_pretrained(ckpt, options)
            if poison:
                with torch.no_grad():
                    engine.model.layers[1].mixer.o_proj.weight.fill_(float("nan"))
            return engine.generate([[3, 4, 5], [6, 7]], 5)

    ref, fused = run(False, False), run(True, False)
    assert fused.tokens == ref.tokens and fused.nonfinite == ref.nonfinite == []
    # the kernels' path did run: the backbone's adds fused with the next norms (block.forward_blocks_fused)
    assert launches["add_rms_norm"] > 0 and launches["flag_nonfinite"] > 0
    ref, fused = run(False, True), run(True, True)
    assert fused.nonfinite == ref.nonfinite and fused.nonfinite[0] == "layers.1.attention", fused.nonfinite
    assert "lm_head" in fused.nonfinite and "embeddings" not in fused.nonfinite
