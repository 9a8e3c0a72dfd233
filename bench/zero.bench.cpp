// zp_bench_zero: the time of one ZeRO training step per stage on the threads backend.
//
// zero_step/stage:S/ranks:N  one optimizer step of a 51M-parameter model (8 modules) in bf16
//   with fp32 master weights and AdamW (the layout of the ZeRO formulas): module guards around a
//   synthetic forward (reads each module's parameters) and backward (writes every gradient),
//   bucket reductions, statistics, the optimizer on this rank's shard and the parameter gathers.
//   The model's compute is deliberately minimal, so the time is zp's: communication, memory
//   traffic and the optimizer. ranks:1 is the single-rank baseline (the same step, no peers).
// Counters: params (Psi), state_bytes_per_rank (16-bit params, gradients, fp32 master, optimizer
// state), comm_bus_bytes_per_rank_per_step (nccl-tests bus bytes), buckets and gathered bytes.
// Each configuration checks its memory report and communication volume against the ZeRO
// formulas before timing; iterations are timed inside the ranks (manual time, rank 0's clock
// between barriers).
#include <benchmark/benchmark.h>

#include <zp/backend/threads.hpp>
#include <zp/engine.hpp>

#include "synthetic.hpp"

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

using zp::bf16;
using zp::Collective;
using zp::backend::Threads;

constexpr int modules = 8;
constexpr std::size_t weight_elems = 6'400'000, bias_elems = 1'000;

struct Synthetic : zp::bench::SyntheticParams<modules> {
  std::vector<bf16> grad_w, grad_b;  // the "computed" gradient each backward writes
  float sink = 0;

  Synthetic()
      : SyntheticParams(weight_elems, bias_elems),
        grad_w(weight_elems),
        grad_b(bias_elems, bf16(1e-3f)) {
    for (std::size_t i = 0; i < weight_elems; ++i) grad_w[i] = weight_grad(i);
  }
  void forward(int m) {  // touches the gathered parameters, as a layer would
    float acc = 0;
    const auto& v = w[m].value;
    for (std::size_t i = 0; i < v.size(); i += 4096) acc += float(v[i]);
    sink += acc + float(b[m].value[0]);
  }
  void backward(int m) {
    std::memcpy(static_cast<void*>(w[m].grad.data()), grad_w.data(), weight_elems * sizeof(bf16));
    std::memcpy(static_cast<void*>(b[m].grad.data()), grad_b.data(), bias_elems * sizeof(bf16));
  }
};

struct Measured {
  std::vector<double> seconds;
  double psi = 0, state_bytes = 0, bus_bytes = 0, bucket_bytes = 0, gathered_bytes = 0;
  std::string error;
};

template <int Stage>
Measured measure(int ranks, int iterations) {
  Measured out;
  zp::backend::run_threads(ranks, [&](Collective<Threads>& comm) {
    Synthetic model;
    zp::EngineConfig cfg;  // default buckets (16 MiB), no clipping, no persistence
    zp::Engine<Threads, bf16, Stage> engine(comm, model, cfg, zp::optim::AdamW{});
    const auto first = zp::bench::train_step(engine, model);  // checked before timing
    const auto& L = engine.layout();
    const auto mem = engine.memory();
    const std::string err = zp::bench::check_first_step(engine, first, comm.size());
    const double bus = engine.last_step_comm().total().bus_bytes;
    std::vector<double> times;
    for (int i = 0; i < iterations; ++i) {
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      zp::bench::train_step(engine, model);
      comm.barrier();
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    if (comm.rank() == 0) {
      out.seconds = times;
      out.psi = double(L.used());
      out.state_bytes = double(mem.model_states());
      out.bus_bytes = bus;
      out.bucket_bytes = double(mem.buckets);
      out.gathered_bytes = double(mem.gathered_peak);
      out.error = err;
    }
  });
  return out;
}

template <int Stage>
void zero_step(benchmark::State& state) {
  const int ranks = int(state.range(0));
  const auto m = measure<Stage>(ranks, int(state.max_iterations));
  if (!m.error.empty()) {
    state.SkipWithError(m.error.c_str());
    return;
  }
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(m.seconds[i++ % m.seconds.size()]);
  state.counters["params"] = m.psi;
  state.counters["state_bytes_per_rank"] = m.state_bytes;
  state.counters["comm_bus_bytes_per_rank_per_step"] = m.bus_bytes;
  state.counters["bucket_bytes"] = m.bucket_bytes;
  state.counters["gathered_peak_bytes"] = m.gathered_bytes;
}

}  // namespace

// Names: zero_step/stage:S/ranks:N/iterations:3/manual_time.
BENCHMARK(zero_step<0>)
    ->Name("zero_step/stage:0")
    ->ArgName("ranks")
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(zero_step<1>)
    ->Name("zero_step/stage:1")
    ->ArgName("ranks")
    ->Arg(2)
    ->Arg(4)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(zero_step<2>)
    ->Name("zero_step/stage:2")
    ->ArgName("ranks")
    ->Arg(2)
    ->Arg(4)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(zero_step<3>)
    ->Name("zero_step/stage:3")
    ->ArgName("ranks")
    ->Arg(2)
    ->Arg(4)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
