// zp/detail/copy.hpp: stream_copy against memcpy at every alignment of source and destination
// (mod 64), lengths around the 32-byte stores and the cache line, and whole pages; the bytes
// around the destination stay untouched.
#include "zp/detail/copy.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "../random.hpp"

TEST_CASE("stream_copy writes exactly what memcpy does, at any alignment and length") {
  const std::uint64_t seed = zp::test::run_seed("copy.test");
  constexpr std::size_t pad = 64, largest = 3 * 4096 + 77;
  std::vector<std::uint8_t> src(largest + 2 * pad), dst(largest + 2 * pad), want(dst.size());
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = std::uint8_t(zp::test::mix(seed + i));
  const std::size_t lengths[] = {0, 1, 15, 31, 32, 33, 63, 64, 65, 95, 129, 4096, largest};
  int cases = 0;
  for (std::size_t len : lengths)
    for (std::size_t d = 0; d<pad; d += len> 4096 ? 7 : 1)
      for (std::size_t s : {std::size_t(0), std::size_t(1), std::size_t(17), std::size_t(32)}) {
        for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = want[i] = std::uint8_t(0xA5 ^ i);
        zp::detail::stream_copy(dst.data() + d, src.data() + s, len);
        std::memcpy(want.data() + d, src.data() + s, len);
        CAPTURE(len);
        CAPTURE(d);
        CAPTURE(s);
        REQUIRE(dst == want);
        ++cases;
      }
  CHECK(cases > 500);
}
