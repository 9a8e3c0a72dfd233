#!/usr/bin/env bash
# zp's whole test suite, exactly as README's quick start and CI (.ci/run) run it; every test
# runs in one build at least:
#   unsanitized  Debug build of everything (examples, benchmarks; CUDA sources with nvcc when
#                present) but the tests the sanitizer builds run, and those: cpu, mpi (under
#                mpiexec), package, gpu (skipped without one)
#   asan         ASan + UBSan build (Clang 16) of the tests labelled 'sanitize' (host and
#                simulated device) or 'asan' (no threads of their own), and the mutation table
#   tsan         TSan build (Clang 16) of those labelled 'sanitize'
# Each simulated-device scheduler seed runs once among the two: ASan the first, TSan the others.
# (`cmake --workflow --preset dev` builds and runs every test in one Debug build.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh tests
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# mpiexec as root (containers, CI) must be allowed explicitly.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One test per core: an mpi test counts its processes, tests that time wall clocks run alone.
export CTEST_PARALLEL_LEVEL=${CTEST_PARALLEL_LEVEL:-$(nproc)}
for preset in unsanitized asan tsan; do
  echo "=== zp tests: preset $preset"
  cmake --workflow --preset "$preset"
done
