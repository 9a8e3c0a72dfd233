#!/usr/bin/env bash
# Fills build/gpu-deps with what tools/gpu_check.sh needs and the GPU machine cannot download:
# doctest (header and CMake package), Google Benchmark (headers, library, CMake package) and
# nlohmann/json (zp::io, for the gpu checkpoint tests), copied from this Debian 12 machine's
# doctest-dev, libbenchmark-dev and nlohmann-json3-dev with their /usr layout,
# so their CMake files find them relative to their own location. Carry build/gpu-deps with the
# call that runs tools/gpu_check.sh, or build the binaries here instead (tools/gpu_check.sh
# binaries) and carry those.
set -euo pipefail
cd "$(dirname "$0")/.."
D=build/gpu-deps
rm -rf "$D" && mkdir -p "$D"
for pkg in doctest-dev libbenchmark-dev libbenchmark1debian nlohmann-json3-dev; do
  dpkg -L "$pkg" | grep -E '^/usr/(include|lib|share/cmake)/' | while read -r f; do
    [[ -f "$f" || -L "$f" ]] || continue
    mkdir -p "$D$(dirname "${f#/usr}")"
    cp -a "$f" "$D${f#/usr}"
  done
done
# doctest's exported targets name /usr literally: make them relative to the package file.
sed -i 's|^set(_IMPORT_PREFIX "/usr")|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' \
  "$D/lib/cmake/doctest/doctestTargets.cmake"
du -sh "$D"
