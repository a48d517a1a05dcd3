# Sourced by the device scripts in tests/gpu/ (run from the repository root): `gpu_outdir OUTDIR` refuses a
# source folder of the repository as the log folder and creates it; `gpu_env` installs the GPU bundle
# (.gpu-bundle, built by the shared gpu-bundle.sh: wheels the device image lacks, FlashInfer where the
# bundle carries it) into /tmp/site and exports what the runs need (GSM8K from .device/gsm8k, offline hubs,
# unbuffered output).
gpu_outdir() {
  case "$1" in kernels|kernels/*|benchmarks|benchmarks/*|tests|tests/*|runners|runners/*|evals|evals/*|registry|registry/*|configs|configs/*)
    echo "OUTDIR '$1' is a source folder of the repository; give a folder for the logs (e.g. \$OUT or /tmp/x)" >&2
    return 2 ;;
  esac
  mkdir -p "$1"
}
gpu_env() {
  # the bundle, else .device/bundle_fi: the few wheels a FlashInfer call carries beside FlashInfer (hydra-core,
  # omegaconf, antlr4, einops, apache-tvm-ffi, cuda-tile, copied out of .gpu-bundle), as the checkout, the
  # bundle and FlashInfer together exceed what one call carries
  local bundle=.gpu-bundle
  [ -d "$bundle" ] || bundle=.device/bundle_fi
  if [ -d "$bundle" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$bundle"/*.whl \
      && { [ ! -f "$bundle"/flashinfer-trimmed.tgz ] || tar xzf "$bundle"/flashinfer-trimmed.tgz -C /tmp/site; } \
      || return 1  # a bundle without FlashInfer (smaller, for calls that carry more): its tests skip
    export PYTHONPATH=/tmp/site:$PWD
  fi
  # FlashInfer carried apart from the bundle (.device/flashinfer-trimmed.tgz: the checkout, the bundle and
  # FlashInfer together exceed what one call carries, so a FlashInfer call may carry it without the bundle).
  # Since the checkout passed 40 MiB even the checkout and FlashInfer exceed one call: tests/gpu/split_fi.sh
  # cuts it into .device/fi_part1 and .device/fi_part2, carried by two calls on one warm machine and joined here.
  if [ ! -f .device/flashinfer-trimmed.tgz ] && [ -f .device/fi_part1/flashinfer-trimmed.tgz.part ] \
      && [ -f .device/fi_part2/flashinfer-trimmed.tgz.part ]; then
    cat .device/fi_part1/flashinfer-trimmed.tgz.part .device/fi_part2/flashinfer-trimmed.tgz.part \
      >.device/flashinfer-trimmed.tgz.tmp && gzip -t .device/flashinfer-trimmed.tgz.tmp \
      && mv .device/flashinfer-trimmed.tgz.tmp .device/flashinfer-trimmed.tgz \
      || { rm -f .device/flashinfer-trimmed.tgz.tmp; return 1; }  # never a truncated tarball left in place
  fi
  if [ -f .device/flashinfer-trimmed.tgz ] && [ ! -d /tmp/site/flashinfer ]; then
    mkdir -p /tmp/site && tar xzf .device/flashinfer-trimmed.tgz -C /tmp/site || return 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
  # FlashInfer's modules built ahead on a CPU machine (tests/gpu/flashinfer_aot.py, .device/flashinfer-aot.tgz:
  # <uri>/<uri>.so) into its data/aot folder, where it looks before building: those modules load, not build
  # (again whenever the tarball changes: its checksum is the marker, as /tmp/site outlives a call)
  if [ -f .device/flashinfer-aot.tgz ] && [ -d /tmp/site/flashinfer ]; then
    local aot=/tmp/site/flashinfer/data/aot sum
    sum=$(sha256sum .device/flashinfer-aot.tgz | cut -d' ' -f1)
    if [ "$(cat $aot/.unpacked 2>/dev/null)" != "$sum" ]; then
      mkdir -p $aot && tar xzf .device/flashinfer-aot.tgz -C $aot && echo "$sum" >$aot/.unpacked || return 1
    fi
  fi
  # FlashInfer's JIT cache in the checkout's ignored .device/ (kept between calls on a warm machine, as the
  # checkout's ignored outputs are; its home folder may not be): a later call reuses the ~4-minute builds
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.device/fi_ws}
  export GSM8K_DIR=${GSM8K_DIR:-$PWD/.device/gsm8k} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
}
gpu_start() {
  # a device script's start: gpu_env (its output hidden) and the card's name and memory, or a message and 1
  gpu_env >/dev/null 2>&1 || { echo "gpu_env failed (run it in a shell on the machine to see why)"; return 1; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
}
