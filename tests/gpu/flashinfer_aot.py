"""Build FlashInfer's Mamba2 JIT modules for sm_90a on a CPU machine, as an AOT folder the device loads.

FlashInfer compiles one module per operand signature on first use (about 4 minutes of one core's nvcc
each; a GPU call that needs nine of them spends ~400 s of device time on nvcc). A module is plain host +
sm_90a code: nvcc builds it without a GPU. This script builds the modules the device scripts need (MODULES,
each named by FlashInfer's own URI, which encodes its dtypes and sizes) here, and packs them as
``<uri>/<uri>.so`` into a tarball. tests/gpu/env.sh's ``gpu_env`` unpacks that tarball into FlashInfer's
``data/aot`` folder, the first place ``JitSpec.try_load`` looks (flashinfer/jit/env.py ``get_aot_artifacts``
in 0.7.2), so those modules load instead of building; any other module still builds on the device as before.

    FLASHINFER_SITE=/tmp/fisite python3 tests/gpu/flashinfer_aot.py --out .device/flashinfer-aot.tgz

FLASHINFER_SITE holds the FlashInfer the device runs (.device/flashinfer-trimmed.tgz unpacked) and
apache-tvm-ffi of the same version as .gpu-bundle's (any CPython ABI: only its headers are used). Needs nvcc
13 (the device's torch is cu130). Linking asks for libcudart and libcuda: the CUDA toolkit here has no
driver, so a CUDA_HOME shim with an empty ``libcuda.so`` (soname libcuda.so.1) is made in the work folder;
the modules resolve the real driver on the device. A module whose URI the installed FlashInfer names
differently is refused (the URI is rebuilt from its parsed fields and compared). The modules hold sm_90a code
only (H100 / H200, the device's cards): FlashInfer would load them on another GPU without checking.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The modules the device scripts load, by FlashInfer's URI (d 64 / ds 128 / T = 4: Super V3's Mamba2 heads).
_ENGINE = ("checkpointing_ssu_s_{s}_i_bf16_dt_bf16_w_bf16_a_f32_si_i64_d_64_ds_128_np_4_mw_{w}"
           "_hpg_{hpg}_ng_{ng}")
_REWIND = "selective_state_update_s_{s}_i_bf16_w_f32_a_f32_si_i32_d_64_ds_128_nt_4_cs_i32_na_i64_sm90"
MODULES = (
    # the engine's replay (kernels.mamba2.flashinfer_replay), which benchmarks.bench_mamba2 (the sweep) also
    # runs: Super V3 (16 heads per group, 8 groups), the contract test (8 / 2) and the tiny engine tests
    # (2 / 2); per-step (window 4) and checkpointing (window 16)
    [_ENGINE.format(s=s, w=w, hpg=hpg, ng=ng) for hpg, ng in ((16, 8), (8, 2))
     for s in ("f32", "bf16") for w in (4, 16)]
    + [_ENGINE.format(s="f32", w=w, hpg=2, ng=2) for w in (4, 16)]
    # the FlashInfer rewind verify (runners/engine/models/mamba2.py, benchmarks.bench_mamba2)
    + [_REWIND.format(s=s) for s in ("f32", "bf16")]
    # ... with float32 activations (tests/test_replay_engine.py test_gpu_flashinfer_rewind_equals_triton)
    + [_REWIND.replace("_i_bf16_", "_i_f32_").format(s="f32")]
    # a float16 state, stochastic rounding and round to nearest (tests/test_flashinfer_replay_gpu.py)
    + ["checkpointing_ssu_s_f16_i_bf16_dt_f32_w_f32_a_f32_si_i64_d_64_ds_128_np_4_mw_16_hpg_8_ng_2" + pr
       for pr in ("_pr_10", "")]
)

_CKPT = re.compile(r"checkpointing_ssu_s_(\w+?)_i_(\w+?)_dt_(\w+?)_w_(\w+?)_a_(\w+?)_si_(\w+?)"
                   r"_d_(\d+)_ds_(\d+)_np_(\d+)_mw_(\d+)_hpg_(\d+)_ng_(\d+)"
                   r"(?:_sc_(\w+?))?(?:_pr_(\d+))?(_pdl)?")
_SSU = re.compile(r"selective_state_update_s_(\w+?)_i_(\w+?)_w_(\w+?)_a_(\w+?)_si_(\w+?)_d_(\d+)"
                  r"_ds_(\d+)_nt_(\d+)_cs_(\w+?)_na_(\w+?)(?:_sc_(\w+?))?(?:_pr_(\d+))?_sm90")


def jit_spec(uri: str):
    """FlashInfer's JitSpec for ``uri`` (its gen function called with the URI's parsed fields).

    Raises:
        ValueError: a URI of another kernel, or one the installed FlashInfer would name differently.
    """
    import torch
    from flashinfer.jit.mamba.checkpointing_ssu import gen_checkpointing_ssu_module
    from flashinfer.jit.mamba.selective_state_update import gen_selective_state_update_sm90_module

    names = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i32": torch.int32,
             "i64": torch.int64, None: None}

    def dt(name):
        if name not in names:
            known = sorted(filter(None, names))
            raise ValueError(f"{uri}: dtype {name!r} is not one this script maps ({known}); "
                             "add it to jit_spec")
        return names[name]

    if m := _CKPT.fullmatch(uri):
        g = m.groups()
        spec = gen_checkpointing_ssu_module(*(dt(x) for x in g[:6]), dt(g[12]), *map(int, g[6:12]),
                                            int(g[13] or 0), bool(g[14]))
    elif m := _SSU.fullmatch(uri):
        g = m.groups()
        spec = gen_selective_state_update_sm90_module(*(dt(x) for x in g[:5]), dt(g[10]), *map(int, g[5:8]),
                                                      dt(g[8]), dt(g[9]), int(g[11] or 0))
    else:
        raise ValueError(f"{uri}: not a checkpointing_ssu or sm90 selective_state_update URI")
    if spec.name != uri:
        raise ValueError(f"{uri}: this FlashInfer names that module {spec.name}; update MODULES")
    return spec


def cuda_home_shim(work: Path) -> Path:
    """A CUDA_HOME whose lib64 holds the toolkit's libraries and lib64/stubs an empty libcuda.so.

    Raises:
        FileNotFoundError: no nvcc on PATH.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH: the modules need nvcc 13 (the device's torch is cu130)")
    # the toolkit: the first candidate with libcudart (nvcc on PATH may be a wrapper script outside it)
    candidates = [os.environ.get("CUDA_HOME"), Path(os.path.realpath(nvcc)).parent.parent, "/usr/local/cuda",
                  *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)]
    toolkit = next((Path(c) for c in candidates if c and any(Path(c).glob("lib*/libcudart.so"))), None)
    if toolkit is None:
        raise FileNotFoundError(f"no CUDA toolkit with lib64/libcudart.so among {candidates}; set CUDA_HOME")
    home = work / "cuda_home"
    (home / "lib64" / "stubs").mkdir(parents=True, exist_ok=True)
    for name in ("bin", "include", "nvvm", "targets"):
        if (toolkit / name).exists() and not (home / name).is_symlink():
            (home / name).symlink_to(toolkit / name)
    libdir = next(d for d in (toolkit / "lib64", toolkit / "lib") if (d / "libcudart.so").exists())
    for lib in libdir.iterdir():
        if not (home / "lib64" / lib.name).exists():
            (home / "lib64" / lib.name).symlink_to(lib)
    stub = home / "lib64" / "stubs" / "libcuda.so"
    if not stub.exists():
        src = work / "empty.c"
        src.write_text("")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(src)],
                       check=True)
    return home


def _build_one(uri: str) -> tuple[str, Path | None, float, str]:
    """(uri, its .so or None, seconds, the error's last line or "")."""
    t0 = time.time()
    spec = jit_spec(uri)
    try:
        spec.build()
    except Exception as e:  # noqa: BLE001 - reported per module; the others still build
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        return uri, None, time.time() - t0, (errors or lines or [repr(e)])[0][:300]
    return uri, spec.jit_library_path, time.time() - t0, ""


def main(argv: list[str] | None = None) -> int:
    """Build MODULES (or --only) and pack them into --out; 0, 1 when a module failed (listed, not packed), 2
    without FLASHINFER_SITE. Raises ValueError for a URI FlashInfer names differently (before any build)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the tarball to write (.device/flashinfer-aot.tgz)")
    ap.add_argument("--work", default="/tmp/flashinfer_aot", help="FlashInfer's workspace and the shim")
    ap.add_argument("--jobs", type=int, default=2, help="modules built at once")
    ap.add_argument("--only", nargs="*", help="build these URIs instead of MODULES")
    args = ap.parse_args(argv)
    site = os.environ.get("FLASHINFER_SITE")
    if not site:
        print("set FLASHINFER_SITE to the folder holding FlashInfer and tvm_ffi", file=sys.stderr)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(CUDA_HOME=str(cuda_home_shim(work)), FLASHINFER_CUDA_ARCH_LIST="9.0a",
                      FLASHINFER_WORKSPACE_BASE=str(work / "ws"))
    sys.path.insert(0, site)
    uris = args.only or MODULES
    for uri in uris:  # every name checked before the first build
        jit_spec(uri)
    built, failed = [], []
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, (uri, so, secs, err) in enumerate(pool.map(_build_one, uris), 1):
            print(f"[{i}/{len(uris)}] {uri}: {f'FAILED: {err}' if so is None else 'built'} ({secs:.0f} s)",
                  flush=True)
            (failed if so is None else built).append((uri, so))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for uri, so in built:
            tar.add(so, arcname=f"{uri}/{uri}.so")
    print(f"{out}: {len(built)} modules, {out.stat().st_size / 2**20:.1f} MiB"
          + (f"; {len(failed)} failed (above), not packed" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
