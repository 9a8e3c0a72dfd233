// The synthetic model of the ZeRO step benchmarks (zp_bench_zero, zp_bench_zero_cuda): the
// parameters (`modules` blocks of a weight and a bias, named block<m>.weight / block<m>.bias,
// every value starting from one shared host array of initial values, which zp copies), the
// pattern the "computed" gradients follow, one training step under the engine's guards, its
// timing loop, and the check each benchmark runs before timing. A benchmark's model adds forward(m) and
// backward(m): where the gradients come from and the compute.
#pragma once

#include <zp/dtype.hpp>
#include <zp/engine.hpp>
#include <zp/model.hpp>

#include <chrono>
#include <cmath>
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

// One optimizer step: forward guards in order, backward guards in reverse, step().
template <class E, class M>
zp::StepResult train_step(E& engine, M& model) {
  for (int m = 0; m < M::modules; ++m) {
    auto g = engine.forward(m);
    model.forward(m);
  }
  for (int m = M::modules - 1; m >= 0; --m) {
    auto g = engine.backward(m);
    model.backward(m);
  }
  return engine.step();
}

// `iterations` steps after one untimed, each timed on this rank's clock between barriers (so rank
// 0's times are the slowest rank's), and the share of the steps' time no phase of StepTimes
// accounts for. StepTimes::total runs from the end of one step() to the end of the next, so it
// includes this loop's barriers between steps; they are taken out of both sums.
struct TimedSteps {
  std::vector<double> seconds;
  double untracked = 0;
};
template <class E, class M, class C>
TimedSteps timed_steps(E& engine, M& model, C& comm, int iterations) {
  using clock = std::chrono::steady_clock;
  const auto sec = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  TimedSteps out;
  double untracked = 0, total = 0;
  train_step(engine, model);
  auto last = clock::now();
  for (int i = 0; i < iterations; ++i) {
    comm.barrier();
    const auto t0 = clock::now();
    const zp::StepResult r = train_step(engine, model);
    const auto t1 = clock::now();
    comm.barrier();
    out.seconds.push_back(sec(clock::now() - t0));
    const double between = sec(t0 - last);  // the barriers since the last step() returned
    untracked += r.times.untracked() - between;
    total += r.times.total - between;
    last = t1;
  }
  out.untracked = total > 0 ? untracked / total : 0;
  return out;
}

// Checked before timing: the first step applied, and the engine's model-state bytes and the
// step's bus bytes follow the ZeRO formulas (AdamW: 2 state arrays). "" or what differs.
template <class E>
std::string check_first_step(const E& engine, const zp::StepResult& first, int ranks) {
  using T = typename E::value_type;
  const zp::Layout& L = engine.layout();
  const double f = ranks > 1 ? double(ranks - 1) / ranks : 0.0;
  const double want_bus = (E::stage == 3 ? 3.0 : 2.0) * f * double(L.total() * sizeof(T)) +
                          2.0 * f * double(E::statistics_count * sizeof(double));
  const double bus = engine.last_step_comm().total().bus_bytes;
  if (!first.applied) return "the first step was not applied";
  if (engine.memory().model_states() !=
      zp::zero_model_state_bytes(E::stage, L.total(), ranks, sizeof(T), 2))
    return "model-state bytes differ from the ZeRO formula";
  if (std::abs(bus - want_bus) > 1e-6 * want_bus + 1)
    return "bus bytes differ from the ZeRO formula";
  return "";
}

}  // namespace zp::bench
