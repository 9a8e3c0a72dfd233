// For the gpu tests: without a CUDA device, say so and exit 77, which ctest reports as skipped
// (tests/CMakeLists.txt, SKIP_RETURN_CODE). Call it from a namespace-scope initializer so it
// runs before doctest's main.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

namespace zp::test {

inline int devices_or_skip(const char* what) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("skip: no CUDA device available, %s did not run\n", what);
    std::exit(77);
  }
  return count;
}

}  // namespace zp::test
