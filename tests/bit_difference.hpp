// Bitwise comparison of two results for a test's failure message: how many elements differ in
// their bytes, and the first that does.
#pragma once

#include <cstddef>
#include <cstring>
#include <vector>

namespace zp::test {

struct BitDifference {
  std::size_t count = 0, first = 0;  // first: meaningful where count > 0
};

template <class X>
BitDifference bit_difference(const std::vector<X>& a, const std::vector<X>& b) {
  BitDifference d;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(X)) != 0 && d.count++ == 0) d.first = i;
  return d;
}

}  // namespace zp::test
