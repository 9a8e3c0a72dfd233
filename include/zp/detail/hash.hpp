// zp/detail/hash.hpp: FNV-1a, the fingerprint zp compares across ranks (layouts, configurations,
// optimizer hyper-parameters, a checkpoint's tag and manifest). Not cryptographic: it catches
// mistakes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

namespace zp::detail {

// What Fnv1a::add hashes by value: arithmetic types and enums.
template <class T>
concept Scalar = std::is_arithmetic_v<T> || std::is_enum_v<T>;

class Fnv1a {
 public:
  Fnv1a& bytes(const void* p, std::size_t n) noexcept {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h_ = (h_ ^ b[i]) * 1099511628211ull;
    return *this;
  }
  // Scalars by their exact bits (floats included: -0 and +0, or two NaNs, differ). Only types
  // without padding, so no indeterminate byte is ever hashed.
  template <Scalar T>
  Fnv1a& add(T v) noexcept {
    if constexpr (std::is_same_v<T, bool>) {
      const unsigned char b = v ? 1 : 0;
      return bytes(&b, 1);
    } else {
      return bytes(&v, sizeof v);
    }
  }
  Fnv1a& add(std::string_view s) noexcept {
    add(std::uint64_t(s.size()));
    return bytes(s.data(), s.size());
  }
  template <class... A>
  Fnv1a& all(const A&... a) noexcept {
    (add(a), ...);
    return *this;
  }
  std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = 14695981039346656037ull;
};

}  // namespace zp::detail
