#include "zp/memory.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include <unistd.h>

namespace {
// The process's resident bytes (/proc/self/statm).
std::int64_t resident() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, pages = 0;
  statm >> size >> pages;
  REQUIRE(statm);
  return pages * ::sysconf(_SC_PAGESIZE);
}
}  // namespace

// glibc maps a large malloc for it alone, and unmaps it at its free, until such a free raises
// its threshold (to the chunk's size, up to 32 MiB): after that, chunks below it come from its
// heaps, and a freed one stays resident. zp's large host buffers are mapped whatever it is.
TEST_CASE("a freed large host buffer gives its pages back, also past glibc's raised threshold") {
  constexpr std::size_t big = std::size_t(24) << 20, mib = std::size_t(1) << 20;
  void* raise = std::malloc(big);
  REQUIRE(raise);
  std::memset(raise, 1, big);
  std::free(raise);
  for (const std::size_t bytes : {16 * mib, 4 * mib + 4096 + 64, 1 * mib}) {
    CAPTURE(bytes);
    const std::int64_t before = resident();
    {
      zp::Buffer<float> b(bytes / sizeof(float), "test");
      CHECK(reinterpret_cast<std::uintptr_t>(b.data()) %
                zp::Allocator<zp::MemorySpace::host>::alignment ==
            0);
      std::memset(b.data(), 1, b.bytes());  // every page resident
      CHECK(resident() >= before + std::int64_t(bytes - mib / 4));
    }
    CHECK(resident() < before + std::int64_t(mib / 4));
    {
      std::vector<double, zp::HostAllocator<double>> v(bytes / sizeof(double), 1.0);
      CHECK(resident() >= before + std::int64_t(bytes - mib / 4));
    }
    CHECK(resident() < before + std::int64_t(mib / 4));
  }
}
