// zp_bench_gpt: what activation checkpointing (gpt::Activations' recompute, zp_gpt --recompute)
// costs and saves, on one rank of examples/gpt.hpp's transformer (no engine: the model's own
// forward, loss and backward, the part recomputing changes).
//
// gpt_step/layers:L  each iteration runs one micro-batch's forward, loss and backward twice from
//   the same weights: keeping every block's activations (the baseline) and recomputing them;
//   the iteration time is the recomputing step's (manual time).
// Counters:
//   vs_kept             the recomputing step's time over the keeping step's, summed over the
//                       iterations (both in the same iterations, alternating)
//   kept_MiB, recomputed_MiB  the micro-batch's activation set (Activations::bytes) each way
//   memory_ratio        recomputed_MiB / kept_MiB
//   same_gradients      1 when every gradient of the two steps is bitwise equal (else the row
//                       fails)
// Shape: d_model 128, 4 heads, context 128, micro-batch 4, vocabulary 64, fp32.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <string_view>
#include <vector>

#include "gpt.hpp"
#include "zp/model.hpp"

namespace {

struct Run {
  double seconds = 0;
  std::size_t bytes = 0;
  std::vector<std::vector<float>> grads;
};

// One micro-batch's forward, loss and backward from fresh gradients; returns its time, the
// activation set's size and the gradients.
Run step(const gpt::Config& c, int batch, bool recompute) {
  gpt::Model<float> m(c, 1234);
  Run r;
  zp::visit_parameters<float>(m,
                              [&](std::string_view, int, zp::View<float>& v, zp::View<float>& g) {
                                r.grads.emplace_back(v.size(), 0.0f);
                                g.rebind(r.grads.back().data());
                              });
  gpt::Activations<float> a(c, batch, recompute);
  for (std::size_t i = 0; i < a.tokens.size(); ++i) {
    a.tokens[i] = int((i * 7919 + 13) % std::size_t(c.vocab));
    a.targets[i] = int((i * 104729 + 7) % std::size_t(c.vocab));
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < m.modules(); ++k) m.forward(k, a);
  benchmark::DoNotOptimize(m.loss(a, 1.0f));
  for (int k = m.modules() - 1; k >= 0; --k) m.backward(k, a);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.bytes = a.bytes();
  return r;
}

void gpt_step(benchmark::State& state) {
  const gpt::Config c{
      .vocab = 64, .context = 128, .d_model = 128, .heads = 4, .layers = int(state.range(0))};
  constexpr int batch = 4;
  double kept = 0, recomputed = 0;
  Run a, b;
  for (auto _ : state) {
    a = step(c, batch, false);
    b = step(c, batch, true);
    if (a.grads != b.grads) {
      state.SkipWithError("recomputed gradients differ from kept ones");
      return;
    }
    kept += a.seconds;
    recomputed += b.seconds;
    state.SetIterationTime(b.seconds);
  }
  state.counters["vs_kept"] = recomputed / kept;
  state.counters["kept_MiB"] = double(a.bytes) / (1 << 20);
  state.counters["recomputed_MiB"] = double(b.bytes) / (1 << 20);
  state.counters["memory_ratio"] = double(b.bytes) / double(a.bytes);
  state.counters["same_gradients"] = 1;
}
BENCHMARK(gpt_step)->ArgName("layers")->Arg(2)->Arg(6)->UseManualTime()->Unit(
    benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
