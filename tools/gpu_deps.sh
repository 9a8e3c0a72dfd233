#!/usr/bin/env bash
# Fills build/gpu-deps with what tools/gpu_check.sh needs and the GPU machine cannot download:
# doctest (header and CMake package), Google Benchmark (headers, library, CMake package) and
# nlohmann/json (zp::io, for the gpu checkpoint tests), copied from this Debian 12 machine's
# doctest-dev, libbenchmark-dev and nlohmann-json3-dev with their /usr layout,
# so their CMake files find them relative to their own location. Carry build/gpu-deps with the
# call that runs tools/gpu_check.sh.
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

# --binaries: also build the gpu tests, benchmarks and demo here (Release, sm_90, no MPI) into
# build/gpu-bin with the shared libraries the GPU machine's image may lack (the CUDA runtime this
# nvcc links, Google Benchmark), so a short lease runs them without building there. Carry
# build/gpu-bin and run `ZP_GPU_BIN=build/gpu-bin bash tools/gpu_check.sh`. NCCL and cuBLAS come
# from that machine (PyTorch's wheels or its toolkit).
if [[ ${1:-} == --binaries ]]; then
  B=build/gpu
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" -DZP_ENABLE_MPI=OFF \
    -DZP_BUILD_BENCH=ON -DZP_BUILD_EXAMPLES=ON -DZP_BUILD_TOOLS=OFF > /dev/null
  tests=(zp.test.optim.gpu.cuda zp.test.backend.cuda_threads.cuda zp.test.backend.nccl zp.test.engine_device.cuda)
  benches=(zp_bench_optim_cuda zp_bench_collectives_cuda zp_bench_zero_cuda)
  cmake --build "$B" --target "${tests[@]}" "${benches[@]}" zp_demo_gpu
  G=build/gpu-bin
  rm -rf "$G" && mkdir -p "$G/tests" "$G/bench" "$G/examples" "$G/lib"
  for t in "${tests[@]}"; do cp "$B/tests/$t" "$G/tests/"; done
  for b in "${benches[@]}"; do cp "$B/bench/$b" "$G/bench/"; done
  cp "$B/examples/zp_demo_gpu" "$G/examples/"
  for lib in libcudart.so.13 libbenchmark.so.1debian; do
    cp -L "$(ldd "$G/bench/zp_bench_optim_cuda" | awk -v l="$lib" '$1 == l { print $3 }')" "$G/lib/"
  done
  du -sh "$G"
fi
