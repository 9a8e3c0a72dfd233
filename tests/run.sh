#!/usr/bin/env bash
# zp's whole test suite, exactly as README's quick start and CI (.ci/run) run it:
#   dev   Debug build of everything (tests, examples, benchmarks; CUDA sources with nvcc when
#         present) and every test: cpu, mpi (under mpiexec), package, sim (the device code on
#         the simulated device, several scheduler seeds, and the mutation table), gpu (skipped
#         without one)
#   asan  ASan + UBSan build of the tests labelled 'sanitize' (host and simulated device) or 'asan'
#         (programs that start no thread)
#   tsan  TSan build of those labelled 'sanitize'
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh tests
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# mpiexec as root (containers, CI) must be allowed explicitly.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One test per core: an mpi test counts its processes, tests that time wall clocks run alone.
export CTEST_PARALLEL_LEVEL=${CTEST_PARALLEL_LEVEL:-$(nproc)}
for preset in dev asan tsan; do
  echo "=== zp tests: preset $preset"
  cmake --workflow --preset "$preset"
done
