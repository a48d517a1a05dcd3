"""The "cuda" variant of the Mamba2 replay verify on a machine without a GPU: its refusals (each a ValueError
with a fix), its build (nvcc for sm_90 when nvcc is installed: CI catches a .cu that does not compile), the
shared-memory mirror against the built library, its place in the sweep and the defaults table. The kernel's
results are checked on the GPU (tests/test_replay_cuda_gpu.py)."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks import sweep_replay  # noqa: E402
from benchmarks.replay_configs import M2_CKPT_ONLY_CONFIGS, M2_CONFIGS, M2_ISSUE28_CONFIGS  # noqa: E402
from kernels import replay_defaults  # noqa: E402
from kernels.mamba2 import ReplayHistory, replay, replay_cuda, replay_verify, replay_verify_ref  # noqa: E402
from kernels.rounding import StochasticRounding  # noqa: E402

needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="refusing CPU tensors needs CPU tensors")


def _case(S=4, T=2, H=2, P=16, N=16, G=1, L=8, checkpointing=True, dtype=torch.float32, state_dtype=None):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, dt = r(S, T, H, P).to(dtype), r(S, T, H).to(dtype)
    B, C = r(S, T, G, N).to(dtype), r(S, T, G, N).to(dtype)
    A, D, dt_bias = -torch.rand(H, generator=g), r(H), r(H)
    hist = ReplayHistory.allocate(S, L, H, P, G, N, dtype=dtype, device="cpu", checkpointing=checkpointing)
    state = r(S, H, P, N).to(state_dtype or torch.float32)
    slot_ids = torch.arange(S, dtype=torch.int32)
    pnat = torch.full((S,), 3, dtype=torch.int32)
    bufidx = torch.zeros(S, dtype=torch.int32)
    return [state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx]


@pytest.mark.parametrize("kw,says", [
    (dict(checkpointing=False), "checkpointing history only"),
    (dict(N=12), "a multiple of 8"),
    (dict(N=264), "d_state <= 256"),
    (dict(P=136), "head_dim <= 128"),
    (dict(T=17, L=20), "T <= 16"),
])
def test_unsupported_histories_and_shapes_are_refused_with_a_fix(kw, says):
    with pytest.raises(ValueError, match=says) as e:
        replay_verify(*_case(**kw), variant="cuda")
    assert "use variant='fma' or 'mma'" in str(e.value)


def test_stochastic_rounding_tiles_dtypes_and_strides_are_refused():
    case = _case(state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rounds the state to nearest only.*variant='fma'"):
        replay_verify(*case, variant="cuda", stochastic_rounding=StochasticRounding.create(1, device="cpu"))
    with pytest.raises(ValueError, match="none of the Triton tiles.*block_p"):
        replay_verify(*case, variant="cuda", block_p=16)
    with pytest.raises(ValueError, match="maxnreg must be an int"):
        replay_verify(*case, variant="cuda", maxnreg=8)
    mixed = _case()
    mixed[4] = mixed[4].to(torch.bfloat16)  # B in another dtype than x
    with pytest.raises(ValueError, match="one input dtype.*B torch.bfloat16"):
        replay_verify(*mixed, variant="cuda")
    wide = _case()
    wide[3] = wide[3].double()  # A in float64
    with pytest.raises(ValueError, match="reads A as float32"):
        replay_verify(*wide, variant="cuda")
    strided = _case()
    strided[0] = torch.randn(*strided[0].shape[:3], 18)[..., :16]  # rows 18 apart: unaligned
    with pytest.raises(ValueError, match="16-byte chunks"):
        replay_verify(*strided, variant="cuda")


@needs_cpu
def test_cpu_tensors_are_refused_with_a_fix():
    with pytest.raises(ValueError, match="CUDA tensors only.*replay_verify_ref"):
        replay_verify(*_case(), variant="cuda")


def test_missing_or_failing_nvcc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = replay_cuda.build_flags("sm_90", torch.float32, torch.bfloat16, 128)
    monkeypatch.setattr(replay_cuda, "find_nvcc", lambda: None)
    with pytest.raises(ValueError, match="no nvcc was found.*NVCC=.*variant='fma'"):
        replay_cuda.build(flags)
    monkeypatch.setattr(replay_cuda, "find_nvcc", lambda: "/bin/false")
    with pytest.raises(ValueError, match=r"(?s)nvcc failed \(exit 1\).*variant='fma'"):
        replay_cuda.build(flags)
    assert not replay_cuda.library_path(flags).exists()
    assert not [p for p in replay_cuda.cache_dir().iterdir() if p.suffix == ".so"]  # no half-written library


# (state dtype, input dtype, d_state, maxnreg): every dtype code of the .cu, every threads-per-row layout and
# the register cap of the sweep's "cuda_r96"
BUILDS = [(torch.float32, torch.bfloat16, 128, None), (torch.bfloat16, torch.float16, 256, None),
          (torch.float16, torch.float32, 48, None), (torch.bfloat16, torch.bfloat16, 128, 96)]


@pytest.mark.skipif(replay_cuda.find_nvcc() is None, reason="nvcc is not installed here")
def test_kernel_source_compiles_for_sm90_and_matches_the_smem_mirror(tmp_path, monkeypatch):
    """nvcc builds kernels/mamba2/replay_ckpt.cu for sm_90 (four of its instantiations, ~3 s each); the
    library loads without a GPU, reports its ABI, and its shared-memory plan equals `smem_bytes`; a second
    build is the cached file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for sd, ind, n, maxnreg in BUILDS:
        flags = replay_cuda.build_flags("sm_90", sd, ind, n, maxnreg)
        path = replay_cuda.build(flags)
        assert path.parent == replay_cuda.cache_dir() and path.stat().st_size > 0
        mtime = path.stat().st_mtime_ns
        assert replay_cuda.build(flags) == path and path.stat().st_mtime_ns == mtime
        lib = replay_cuda.load(str(path))
        assert lib.m2r_abi() == replay_cuda.ABI
        for T, L in ((1, 1), (4, 16), (8, 12), (16, 40)):
            assert lib.m2r_smem_bytes(T, L) == replay_cuda.smem_bytes(T, L, n, sd), (sd, n, T, L)
    assert replay_cuda.smem_bytes(4, 16, 128, torch.float32) == 52384  # Super V3: 34 KB state, 17 KB rest


def test_launch_configuration():
    assert [replay_cuda.threads_per_row(n) for n in (16, 48, 64, 65, 128, 200, 256)] == [1, 1, 1, 2, 2, 4, 4]
    assert replay_cuda.launch_config(64, 128, 64, 128) == {"ctas": 8192, "threads": 128, "rows_per_cta": 64,
                                                          "threads_per_row": 2}
    assert replay_cuda.launch_config(2, 4, 128, 256)["ctas"] == 2 * 4 * 4  # 32 rows per CTA


def test_sweep_times_cuda_on_checkpointing_operators_only():
    cuda_cfgs = {k for k, c in M2_CONFIGS.items() if c["variant"] == replay.CUDA_VARIANT}
    assert cuda_cfgs and cuda_cfgs == set(M2_CKPT_ONLY_CONFIGS) and cuda_cfgs <= set(M2_ISSUE28_CONFIGS)
    for op in ("m2_write", "m2_nowrite"):
        assert not cuda_cfgs & set(sweep_replay._configs(op))
    for op in ("m2_ckpt", "m2_flush"):
        assert cuda_cfgs <= set(sweep_replay._configs(op))
    assert replay.CUDA_VARIANT not in replay.VARIANTS and replay.CUDA_VARIANT in replay.ALL_VARIANTS


def test_a_table_row_naming_cuda_falls_back_on_cpu_tensors(tmp_path, monkeypatch):
    """The defaults table may name "cuda" for a checkpointing shape (a sweep's pick): CUDA tensors would run
    it, CPU tensors (the interpreter) run the fallback "fma" and match the reference."""
    case = _case()
    state, x = case[0], case[1]
    shape = replay_defaults.mamba2_shape_class(*state.shape[1:])
    row = {"config": "cuda", "kwargs": {"variant": "cuda"}, "evidence": {}}
    path = tmp_path / "t.json"
    rows = {replay_defaults.key("mamba2_checkpointing", "float32", shape, 64): row}
    path.write_text(json.dumps({"schema": replay_defaults.SCHEMA, "provenance": {}, "rows": rows}))
    got = replay_defaults.lookup("mamba2_checkpointing", torch.float32, shape, 4, fallback="fma",
                                 variants=replay.ALL_VARIANTS, path=str(path))
    assert got == {"variant": "cuda"}
    monkeypatch.setattr(replay_defaults, "TABLE_PATH", str(path))
    res = []
    for fn in (replay_verify, replay_verify_ref):
        st, h = state.clone(), ReplayHistory(*(t.clone() for t in (case[9].x, case[9].B, case[9].dt,
                                                                   case[9].dA_cumsum)))
        out = fn(st, *case[1:9], h, *case[10:])
        res.append((out, st))
    torch.testing.assert_close(res[0][0], res[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res[0][1], res[1][1], atol=1e-4, rtol=1e-4)
    assert x.device.type == "cpu"
