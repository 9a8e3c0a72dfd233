// For the device tests: without a device, say so and exit 77, which ctest reports as skipped
// (tests/CMakeLists.txt, SKIP_RETURN_CODE). Call it from a namespace-scope initializer so it
// runs before doctest's main. The simulated device always has one.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "zp/device/runtime.hpp"

namespace zp::test {

inline int devices_or_skip(const char* what) {
  const int count = zp::device::device_count();
  if (count == 0) {
    std::printf("skip: no CUDA device available, %s did not run\n", what);
    std::exit(77);
  }
  return count;
}

}  // namespace zp::test
