// The parameters of the ZeRO step benchmarks' synthetic model (zp_bench_zero, zp_bench_zero_cuda):
// `modules` blocks of a weight and a bias, named block<m>.weight / block<m>.bias, every value
// starting from one shared host array of initial values (zp copies them), and the pattern the
// "computed" gradients follow. The benchmarks add where those gradients live and the compute.
#pragma once

#include <zp/dtype.hpp>
#include <zp/model.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace zp::bench {

template <int Modules>
struct SyntheticParams {
  static constexpr int modules = Modules;
  zp::Param<zp::bf16> w[Modules], b[Modules];
  std::vector<zp::bf16> init;

  SyntheticParams(std::size_t weight, std::size_t bias) : init(weight) {
    for (std::size_t i = 0; i < weight; ++i) init[i] = zp::bf16(0.01f * float(int(i % 199) - 99));
    for (int m = 0; m < Modules; ++m) {
      w[m] = zp::Param<zp::bf16>(weight);
      b[m] = zp::Param<zp::bf16>(bias);
      w[m].value.rebind(init.data());
      b[m].value.rebind(init.data());
    }
  }
  // Element i of the weight gradient (the bias gradient is 1e-3 everywhere).
  static zp::bf16 weight_grad(std::size_t i) { return zp::bf16(1e-3f * float(int(i % 37) - 18)); }

  template <class V>
  friend void for_each_parameter(SyntheticParams& s, V&& visit) {
    for (int m = 0; m < Modules; ++m) {
      visit("block" + std::to_string(m) + ".weight", m, s.w[m]);
      visit("block" + std::to_string(m) + ".bias", m, s.b[m]);
    }
  }
};

}  // namespace zp::bench
