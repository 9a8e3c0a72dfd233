// zp_bench_pipeline: the idle time (bubble) of one pipeline flush, GPipe against 1F1B, on the
// threads backend, measured against its formula.
//
// pipeline/<schedule>/stages:P/micro_batches:M  one Runner::run() per iteration over P thread
//   ranks: every stage's forward sleeps tf = 2 ms and its backward tb = 4 ms (sleeps, not
//   compute, so that P stages plus their progress threads on a 2-core machine do not compete
//   for cores: what is measured is the schedule, not CPU contention), activations of 64 KiB
//   (16384 floats) per micro-batch and boundary.
// Counters:
//   idle            measured: the mean over stages of 1 - busy / flush, where busy is the time
//                   the stage spent in its callbacks (Stats::busy) and flush the slowest stage's
//                   run() (every stage starts after the same barrier); averaged over iterations.
//                   Every stage has the same busy time here, so the mean and the max agree to
//                   the run-to-run noise.
//   idle_formula    bubble_fraction(P, M) = (P - 1) / (M + P - 1), the same for both schedules.
//   idle_ratio      idle / idle_formula (1: the runner adds no idle time of its own).
//   excess_ms       the flush time minus what the formula predicts from the measured busy time
//                   (mean busy x (M + P - 1) / M): what the messages on the critical path cost
//                   (copies and thread wake-ups), which the formula counts as zero.
//   peak_in_flight  stage 0's most micro-batches forwarded but not yet backwarded (its
//                   activation memory): M for gpipe, min(M, P) for 1F1B.
//   in_flight_vs_gpipe  that peak over gpipe's (M): 1F1B's activation memory relative to gpipe's.
// Each configuration first checks a flush: the data every stage received (each stage adds 1 to
// what it forwards and to the gradient it passes back), the message counts and the peaks.
// Iterations are timed inside the ranks (manual time: rank 0's clock between barriers).
#include <benchmark/benchmark.h>

#include <zp/backend/threads.hpp>
#include <zp/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace {

using zp::Collective;
using zp::backend::Threads;
using zp::pipeline::Schedule;

constexpr auto tf = std::chrono::milliseconds(2), tb = std::chrono::milliseconds(4);
constexpr std::size_t activation_elems = 64 * 1024 / sizeof(float);

struct Measured {
  std::vector<double> seconds;  // per iteration, rank 0's clock
  double idle = 0;              // mean over stages and iterations
  double excess = 0;            // seconds, mean over iterations
  int peak_in_flight = 0;       // stage 0
  std::string error;
};

Measured measure(Schedule sched, int stages, int m, int iterations) {
  Measured out;
  // [iteration][stage]; iteration 0 is the checked one, not timed.
  std::vector<std::vector<zp::pipeline::Stats>> stats(
      std::size_t(iterations) + 1, std::vector<zp::pipeline::Stats>(std::size_t(stages)));
  std::vector<std::string> errors(static_cast<std::size_t>(stages));
  zp::backend::run_threads(stages, [&](Collective<Threads>& pp) {
    const int s = pp.rank(), p = pp.size();
    zp::pipeline::Runner<Threads, float> pipe(pp, sched, m, activation_elems);
    std::string& err = errors[std::size_t(s)];
    const auto expect = [&](const char* what, int k, float got, float want) {
      if (got != want && err.empty())
        err = "stage " + std::to_string(s) + " micro-batch " + std::to_string(k) + ": " + what +
              " " + std::to_string(got) + ", expected " + std::to_string(want);
    };
    const auto fwd = [&](int k, int, std::span<const float> in, std::span<float> o) {
      std::this_thread::sleep_for(tf);
      if (s > 0) expect("activation", k, in.back(), float(k + s - 1));
      if (s == 0)
        std::fill(o.begin(), o.end(), float(k));
      else if (!o.empty())
        std::transform(in.begin(), in.end(), o.begin(), [](float v) { return v + 1; });
    };
    const auto bwd = [&](int k, int, std::span<const float> out_grad, std::span<float> in_grad) {
      std::this_thread::sleep_for(tb);
      if (s < p - 1) expect("gradient", k, out_grad.front(), float(k + p - 2 - s));
      if (s == p - 1)
        std::fill(in_grad.begin(), in_grad.end(), float(k));
      else if (!in_grad.empty())
        std::transform(out_grad.begin(), out_grad.end(), in_grad.begin(),
                       [](float v) { return v + 1; });
    };
    std::vector<double> times;
    for (int it = 0; it <= iterations; ++it) {
      pp.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      stats[std::size_t(it)][std::size_t(s)] = pipe.run(fwd, bwd);
      pp.barrier();
      if (it > 0)
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    if (s == 0) out.seconds = times;
  });
  for (const auto& e : errors)
    if (out.error.empty() && !e.empty()) out.error = e;
  for (int s = 0; s < stages; ++s) {
    const auto& st = stats[0][std::size_t(s)];
    const std::uint64_t msgs = std::uint64_t(s > 0 ? m : 0) + std::uint64_t(s < stages - 1 ? m : 0);
    if (out.error.empty() && (st.sent != msgs || st.received != msgs))
      out.error = "stage " + std::to_string(s) +
                  " message counts differ from 2 per micro-batch per boundary";
    if (out.error.empty() && st.peak_in_flight != zp::pipeline::max_in_flight(sched, stages, s, m))
      out.error = "stage " + std::to_string(s) + " peak in flight differs from max_in_flight";
  }
  out.peak_in_flight = stats[0][0].peak_in_flight;
  double idle = 0, excess = 0;
  for (int it = 1; it <= iterations; ++it) {
    double flush = 0, busy = 0;
    for (const auto& st : stats[std::size_t(it)]) flush = std::max(flush, st.total);
    for (const auto& st : stats[std::size_t(it)]) {
      idle += 1.0 - st.busy / flush;
      busy += st.busy / double(stages);
    }
    excess += flush - busy * double(m + stages - 1) / double(m);
  }
  out.idle = idle / double(iterations * stages);
  out.excess = excess / double(iterations);
  return out;
}

void pipeline_flush(benchmark::State& state, Schedule sched) {
  const int p = int(state.range(0)), m = int(state.range(1));
  const auto r = measure(sched, p, m, int(state.max_iterations));
  if (!r.error.empty()) {
    state.SkipWithError(r.error.c_str());
    return;
  }
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(r.seconds[i++ % r.seconds.size()]);
  const double formula = zp::pipeline::bubble_fraction(p, m);
  state.counters["idle"] = r.idle;
  state.counters["idle_formula"] = formula;
  state.counters["idle_ratio"] = r.idle / formula;
  state.counters["excess_ms"] = r.excess * 1e3;
  state.counters["peak_in_flight"] = r.peak_in_flight;
  state.counters["in_flight_vs_gpipe"] =
      double(r.peak_in_flight) / double(zp::pipeline::max_in_flight(Schedule::gpipe, p, 0, m));
}

}  // namespace

// Names: pipeline/gpipe/stages:P/micro_batches:M/iterations:5/manual_time.
BENCHMARK_CAPTURE(pipeline_flush, gpipe, Schedule::gpipe)
    ->Name("pipeline/gpipe")
    ->ArgNames({"stages", "micro_batches"})
    ->ArgsProduct({{2, 4}, {4, 8, 16}})
    ->Iterations(5)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(pipeline_flush, one_f_one_b, Schedule::one_f_one_b)
    ->Name("pipeline/1f1b")
    ->ArgNames({"stages", "micro_batches"})
    ->ArgsProduct({{2, 4}, {4, 8, 16}})
    ->Iterations(5)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
