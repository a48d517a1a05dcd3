"""The "cuda" variant of the Mamba2 replay verify on a machine without a GPU: its refusals (each a ValueError
with a fix), its build (nvcc for sm_90 when nvcc is installed: CI catches a .cu that does not compile), the
shared-memory mirror against the built library, its place in the sweep and the defaults table. The kernel's
results are checked on the GPU (tests/test_replay_cuda_gpu.py)."""

from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import shutil
import subprocess

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from replay_oracles import mamba2_checkpointing_case  # noqa: E402

from benchmarks import sweep_replay  # noqa: E402
from benchmarks.replay_configs import M2_CKPT_ONLY_CONFIGS, M2_CONFIGS, M2_ISSUE28_CONFIGS  # noqa: E402
from kernels import replay_defaults  # noqa: E402
from kernels.commit import replay_advance_ref  # noqa: E402
from kernels.mamba2 import ReplayHistory, replay, replay_cuda, replay_verify, replay_verify_ref  # noqa: E402
from kernels.rounding import StochasticRounding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the refusals come before any launch: either device
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="refusing CPU tensors needs CPU tensors")


def _case(S=4, T=2, H=2, P=16, N=16, G=1, L=8, checkpointing=True, dtype=torch.float32, state_dtype=None):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, dt = r(S, T, H, P).to(dtype), r(S, T, H).to(dtype)
    B, C = r(S, T, G, N).to(dtype), r(S, T, G, N).to(dtype)
    A, D, dt_bias = -torch.rand(H, generator=g), r(H), r(H)
    hist = ReplayHistory.allocate(S, L, H, P, G, N, dtype=dtype, device=DEV, checkpointing=checkpointing)
    state = r(S, H, P, N).to(state_dtype or torch.float32)
    slot_ids = torch.arange(S, dtype=torch.int32)
    pnat = torch.full((S,), 3, dtype=torch.int32)
    bufidx = torch.zeros(S, dtype=torch.int32)
    return [t.to(DEV) if isinstance(t, torch.Tensor) else t
            for t in (state, x, dt, A, B, C, D, dt_bias, slot_ids, hist, pnat, bufidx)]


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
        replay_verify(*case, variant="cuda", stochastic_rounding=StochasticRounding.create(1, device=DEV))
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
    with pytest.raises(ValueError, match="takes A as float32"):
        replay_verify(*wide, variant="cuda")
    strided = _case()
    strided[0] = torch.randn(*strided[0].shape[:3], 18, device=DEV)[..., :16]  # rows 18 apart: unaligned
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
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="cannot be written.*XDG_CACHE_HOME"):
        replay_cuda.build(flags)


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


@needs_cpu
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


# ---------------------------------------------------------------------------------------------------------
# The kernel itself on the CPU: replay_ckpt.cu compiled by g++ in host emulation (tests/replay_ckpt_host.cc)
# ---------------------------------------------------------------------------------------------------------

HOST_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay_ckpt_host.cc")


def _cuda_include() -> str | None:
    """A CUDA toolkit include folder with cuda_bf16.h and its libcu++ headers (nv/target), or None."""
    cands = [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    nvcc = replay_cuda.find_nvcc()
    if nvcc:
        # nvcc may be a wrapper script: ask it where its toolkit lives
        cands.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
        try:
            with open(nvcc, errors="replace") as f:
                head = f.read(4096)
            cands += [os.path.join(os.path.dirname(os.path.dirname(w)), "include") for w in head.split()
                      if w.endswith("/bin/nvcc")]
        except OSError:
            pass
    cands += ["/usr/local/cuda/include"] + sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True)
    return next((c for c in cands if os.path.exists(os.path.join(c, "cuda_bf16.h"))
                 and os.path.exists(os.path.join(c, "nv", "target"))), None)


HOST_OK = shutil.which("g++") is not None and _cuda_include() is not None
needs_host_build = pytest.mark.skipif(not HOST_OK, reason="needs g++ and the CUDA toolkit's headers")


@functools.cache
def _host_kernel(state_dtype, in_dtype, d_state, folder, out_dtype=None):
    """The kernel of replay_ckpt.cu built for the host (one std::thread per CUDA thread): ctypes handle."""
    codes = replay_cuda.DTYPE_CODES
    out_code = codes[out_dtype or in_dtype]
    out = os.path.join(folder, f"host_{codes[state_dtype]}_{codes[in_dtype]}_{out_code}_{d_state}.so")
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", f"-I{_cuda_include()}",
           f"-I{replay_cuda.SOURCE.parent}", f"-DM2R_STATE={codes[state_dtype]}",
           f"-DM2R_IN={codes[in_dtype]}", f"-DM2R_OUT={out_code}",
           f"-DM2R_TPR={replay_cuda.threads_per_row(d_state)}", HOST_SOURCE, "-o", out]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    lib = ctypes.CDLL(out)
    lib.m2r_host_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong),
                                    ctypes.POINTER(ctypes.c_float)]
    lib.m2r_smem_bytes.restype = ctypes.c_longlong
    return lib


def _host_verify(lib, state, x, dt, A, B, C, D, dt_bias, slot_ids, history, pnat, bufidx, *,
                 time_step_limit=(0.0, float("inf")), out=None, out_dtype=None):
    """replay_verify's effects through the host-emulated kernel (the launcher's own argument arrays)."""
    out = torch.full(x.shape, float("nan"), dtype=out_dtype or x.dtype) if out is None else out
    lib.m2r_host_launch(*replay_cuda.launch_args(state, x, dt, A, B, C, D, dt_bias, slot_ids, history, pnat,
                                                 bufidx, time_step_limit=time_step_limit, out=out))
    return out


def _clone_case(case):
    c = list(case)
    c[0] = c[0].clone()
    c[9] = ReplayHistory(*(t.clone() for t in (c[9].x, c[9].B, c[9].dt, c[9].dA_cumsum)))
    return c


def _assert_agree(got, want, tol, what):
    scale = max(1.0, want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol,
                               msg=lambda m: f"{what}: {m}")


# (batch, T, H, P, N, G, L), state dtype, input dtype, output dtype: the three thread layouts (TPR 1: d_state
# 48 with masked chunks and head_dim 40 with masked rows; TPR 2: the Super V3 head; TPR 4: 4 CTAs per head,
# T 8, the pending tokens in two staged chunks), every state / input dtype, the engine's fp32 output of bf16
# inputs
HOST_CASES = {
    "tpr1_f32_f32": ((6, 3, 4, 40, 48, 2, 8), torch.float32, torch.float32, None),
    "tpr2_bf16_bf16": ((4, 4, 4, 64, 128, 2, 16), torch.bfloat16, torch.bfloat16, None),
    "tpr2_f32_bf16_out_f32": ((4, 4, 4, 64, 128, 2, 16), torch.float32, torch.bfloat16, torch.float32),
    "tpr4_f16_f16": ((3, 8, 2, 128, 256, 1, 12), torch.float16, torch.float16, None),
}
HOST_TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@needs_host_build
@pytest.mark.parametrize("name", list(HOST_CASES))
def test_host_emulated_kernel_matches_reference(name, tmp_path_factory):
    """replay_ckpt.cu's kernel (host emulation, shared memory poisoned with NaN) vs replay_verify_ref: output,
    state, history; the state written exactly on the flushed rows, PAD rows zero, other slots untouched."""
    shape, sd, ind, outd = HOST_CASES[name]
    lib = _host_kernel(sd, ind, shape[4], str(tmp_path_factory.getbasetemp()), outd)
    assert lib.m2r_smem_bytes(shape[1], shape[6]) == replay_cuda.smem_bytes(shape[1], shape[6], shape[4], sd)
    case = mamba2_checkpointing_case(shape, sd, ind, seed=1)
    k_case, r_case = _clone_case(case), _clone_case(case)
    out_k = _host_verify(lib, *k_case, out_dtype=outd)
    out_r = replay_verify_ref(*r_case, out=torch.empty(out_k.shape, dtype=out_k.dtype))
    assert out_k.dtype == (outd or ind)
    tol = max(HOST_TOL[sd], HOST_TOL[ind])
    _assert_agree(out_k, out_r, tol, "out")
    _assert_agree(k_case[0], r_case[0], HOST_TOL[sd], "state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        _assert_agree(getattr(k_case[9], f), getattr(r_case[9], f), HOST_TOL[torch.float32], f"history.{f}")
    state0, slot_ids, pnat = case[0], case[8], case[10]
    T, L = shape[1], shape[6]
    live = slot_ids[slot_ids >= 0].long()
    k = pnat[live].clamp(0, L)
    flushed, kept = live[(k + T > L) & (k > 0)], live[k + T <= L]
    assert flushed.numel() and kept.numel()
    assert torch.equal(k_case[0][kept], state0[kept]) and not torch.equal(k_case[0][flushed], state0[flushed])
    assert (out_k[slot_ids < 0] == 0).all() and not torch.isnan(out_k).any()
    others = torch.ones(state0.shape[0], dtype=torch.bool)
    others[live] = False
    assert torch.equal(k_case[0][others], state0[others])
    for f in ("x", "B", "dt", "dA_cumsum"):
        assert torch.equal(getattr(k_case[9], f)[others], getattr(case[9], f)[others]), f


@needs_host_build
def test_host_emulated_kernel_over_steps_with_options(tmp_path_factory):
    """Six verify + replay_advance_ref steps, host-emulated kernel beside the reference: a time-step clamp,
    D = None, int64 slot ids, a per-layer view of the state; every output, the final state, history and
    metadata agree."""
    shape, sd, ind, _ = HOST_CASES["tpr1_f32_f32"]
    Bsz, T, H, P, N, G, L = shape
    lib = _host_kernel(sd, ind, N, str(tmp_path_factory.getbasetemp()))
    base = mamba2_checkpointing_case(shape, sd, ind, seed=5)
    S = base[0].shape[0]
    layers = torch.randn(S, 2, H, P, N)
    layers[:, 1] = base[0]
    runs = []
    for kernel in (True, False):
        st = layers.clone()[:, 1] if kernel else base[0].clone()
        hist = ReplayHistory.allocate(S, L, H, P, G, N, dtype=ind, device="cpu", checkpointing=True)
        pnat, bufidx = torch.zeros(S, dtype=torch.int32), torch.zeros(S, dtype=torch.int32)
        outs = []
        for i in range(6):
            c = mamba2_checkpointing_case(shape, sd, ind, seed=50 + i)
            slot_ids = c[8].long()
            args = (st, c[1], c[2], base[3], c[4], c[5], None, base[7], slot_ids, hist, pnat, bufidx)
            kw = dict(time_step_limit=(0.05, 0.4))
            outs.append(_host_verify(lib, *args, **kw) if kernel else replay_verify_ref(*args, **kw))
            g = torch.Generator().manual_seed(i)
            nat = torch.randint(0, T + 1, (Bsz,), generator=g, dtype=torch.int32)
            replay_advance_ref(pnat, bufidx, slot_ids, nat, T, hist_len=L)
        runs.append((st, hist, outs, pnat))
    (st_k, h_k, outs_k, pnat_k), (st_r, h_r, outs_r, pnat_r) = runs
    for i, (a, b) in enumerate(zip(outs_k, outs_r)):
        _assert_agree(a, b, 1e-4, f"out of step {i}")
    assert torch.equal(pnat_k, pnat_r) and int(pnat_k.max()) > T
    _assert_agree(st_k, st_r, 1e-4, "state")
    for f in ("x", "B", "dt", "dA_cumsum"):
        _assert_agree(getattr(h_k, f), getattr(h_r, f), 1e-4, f"history.{f}")
