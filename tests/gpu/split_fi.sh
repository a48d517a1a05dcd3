#!/bin/bash
# Cut .device/flashinfer-trimmed.tgz (the trimmed FlashInfer, ~24 MB) into two halves, .device/fi_part1/ and
# .device/fi_part2/, so that each device call carries the checkout (~42 MB) and one half within the 64 MiB a
# call carries: carry .device/fi_part1 in one call and .device/fi_part2 in the next on the same warm machine;
# tests/gpu/env.sh's gpu_env joins them. Run on this machine from the repository root:
#   bash tests/gpu/split_fi.sh
set -eu
src=.device/flashinfer-trimmed.tgz
[ -f "$src" ] || { echo "no $src (move .gpu-bundle/flashinfer-trimmed.tgz there first)" >&2; exit 1; }
half=$(( ($(stat -c %s "$src") + 1) / 2 ))
mkdir -p .device/fi_part1 .device/fi_part2
head -c "$half" "$src" >.device/fi_part1/flashinfer-trimmed.tgz.part
tail -c +"$((half + 1))" "$src" >.device/fi_part2/flashinfer-trimmed.tgz.part
cat .device/fi_part1/flashinfer-trimmed.tgz.part .device/fi_part2/flashinfer-trimmed.tgz.part | cmp - "$src"
du -sh .device/fi_part1 .device/fi_part2
