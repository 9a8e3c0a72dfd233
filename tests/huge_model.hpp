// tests/huge_model.hpp: a model of any size that holds no memory of its own, for the memory
// checks: one bf16 parameter of n elements whose values the engine asks huge_values for
// (EngineConfig::initializer), so only the engine allocates.
#pragma once

#include <cstddef>
#include <span>
#include <string_view>

#include "zp/dtype.hpp"
#include "zp/model.hpp"

namespace zp::test {

struct Huge {
  View<bf16> w, g;
  explicit Huge(std::size_t n) : w(n), g(n) {}
};
template <class Visit>
void for_each_parameter(Huge& m, Visit&& visit) {
  visit("huge.weight", 0, m.w, m.g);
}
// Element i of the parameter is i mod 7.
inline void huge_values(std::string_view, std::size_t first, std::span<float> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = float((first + i) % 7);
}

}  // namespace zp::test
