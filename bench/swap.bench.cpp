// zp_bench_swap: ZeRO-Infinity's optimizer step with the state on NVMe (zp/swap.hpp) against the
// same step with the state in host memory (ZeRO-Offload) and against the swap's I/O alone, in
// the same run. One rank's bf16 AdamW shard of ZP_BENCH_SWAP_ELEMS elements (default 32M: 384 MB
// of fp32 master weights and state), sub-groups of 4M elements, 4 buffers, the swap file in
// ZP_BENCH_SWAP_DIR (default: the temporary directory; put it on the NVMe device to measure).
//
// io/pipelined:P/depth:D    every sub-group read and written back, no compute (the I/O time)
// memory                    the CPU step with master weights and state in host memory
// nvme/pipelined:P/depth:D  the CPU step through the swap: step_ms; vs_memory = step / memory's;
//                      vs_io = step / io's; vs_sum = step / (io + memory);
//                      hidden = (io + memory - step) / min(io, memory), the fraction of the
//                      shorter of I/O and compute that ran behind the other (1: fully hidden)
// overlap/pipelined:P/compute_per_io:R/next_step:N  the swap (depth 8) with each sub-group
//                      stepped `passes` times, so that the compute takes about R times as long
//                      as the I/O: here the disk moves the state about 13x slower than the CPU
//                      steps it, which leaves the nvme rows too little compute to measure an
//                      overlap with. io_ms and compute_ms, each alone, in the same iterations;
//                      hidden as above. The compute alone runs right after the step, where a
//                      trainer's forward and backward would: N = 1 leaves the next step's first
//                      sub-groups reading behind it (end_step's read-ahead), N = 0 drops them.
//                      wait_ms: the step's time waiting for the swap (first_wait_ms: for
//                      sub-group 0); compute_in_step: the rest of the step over compute_ms
// P = 1: pipeline_read and pipeline_write, P = 0: neither (each sub-group read, stepped and
// written in turn); D: the I/O queue depth (requests of 1 MiB).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "zp/layout.hpp"
#include "zp/memory.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/partition.hpp"
#include "zp/step_gate.hpp"
#include "zp/swap.hpp"

namespace {

using Part = zp::Partitioned<zp::bf16, 1>;

std::size_t elements() {
  const char* v = std::getenv("ZP_BENCH_SWAP_ELEMS");
  return v ? std::size_t(std::strtoull(v, nullptr, 10)) : std::size_t(32) << 20;
}

std::filesystem::path swap_dir() {
  const char* d = std::getenv("ZP_BENCH_SWAP_DIR");
  return d ? std::filesystem::path(d) : std::filesystem::temp_directory_path();
}

zp::Layout layout() {
  std::vector<zp::ParamInfo> ps;
  const std::size_t n = elements(), per = (n + 15) / 16;
  for (int i = 0; i < 16; ++i)
    ps.push_back({zp::detail::cat("p", i), i, std::min(per, n - std::min(n, per * i))});
  return zp::Layout(ps, 1, {.bucket_elems = std::size_t(1) << 22});
}

zp::NvmeOptions nvme_options(bool pipelined, unsigned depth) {
  return {.path = swap_dir(),
          .pipeline_read = pipelined,
          .pipeline_write = pipelined,
          .sub_group_size = std::size_t(4) << 20,
          .queue_depth = depth};
}
zp::NvmeOptions nvme_options(const benchmark::State& state) {
  return nvme_options(state.range(0) != 0, unsigned(state.range(1)));
}
std::string key(const char* what, const benchmark::State& state) {
  return zp::detail::cat(what, state.range(0), "/", state.range(1));
}

// Random gradients (small, so AdamW's state stays finite over any number of steps).
void fill(std::span<zp::bf16> grads) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1e-2f, 1e-2f);
  for (auto& g : grads) g = zp::bf16(u(rng));
}

// The swap's I/O of a step alone: every sub-group read and written back.
void io_pass(zp::Swap<float>& swap) {
  swap.begin_step();
  for (std::size_t c = 0; c < swap.sub_groups(); ++c) {
    swap.enter(c);
    swap.leave(c);
  }
  swap.end_step();
}

// The engine's optimizer update (step_gate.hpp's apply_update), the gate open.
void step(const Part& p, zp::OffloadStaging<zp::MemorySpace::host>& staging) {
  static const double gate[2] = {1.0, 0.0};
  zp::apply_update<false>(p, zp::optim::AdamW{.lr = 1e-4f}, zp::optim::StepScalars{1, 1.0f},
                          zp::optim::cpu::Options{}, gate, staging);
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Mean milliseconds of the io and memory rows, for the nvme rows' ratios.
std::map<std::string, double>& times() {
  static std::map<std::string, double> t;
  return t;
}

template <class F>
void timed(benchmark::State& state, const std::string& key, F&& f) {
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double ms = ms_since(t0);
    total += ms;
    state.SetIterationTime(ms / 1e3);
  }
  const double mean = total / double(state.iterations());
  times()[key] = mean;
  state.counters["step_ms"] = mean;
  state.counters["state_GB"] = double(elements()) * 12 / 1e9;
}

void BM_io(benchmark::State& state) {
  zp::Swap<float> swap(nvme_options(state), elements(), 3, "zp_bench_swap");
  timed(state, key("io", state), [&] { io_pass(swap); });
  state.counters["direct"] = swap.direct();
}

void BM_memory(benchmark::State& state) {
  Part p(layout(), 0, 2, false, true);
  fill(p.buffer<zp::Field::grad>());
  zp::OffloadStaging<zp::MemorySpace::host> staging;
  timed(state, "memory", [&] { step(p, staging); });
}

void BM_nvme(benchmark::State& state) {
  const zp::NvmeOptions o = nvme_options(state);
  Part p(layout(), 0, 2, false, true, &o);
  p.expect_swap_opened();
  fill(p.buffer<zp::Field::grad>());
  zp::OffloadStaging<zp::MemorySpace::host> staging;
  timed(state, key("nvme", state), [&] { step(p, staging); });
  const double t = times()[key("nvme", state)], m = times()["memory"],
               i = times()[key("io", state)];
  state.counters["vs_memory"] = t / m;
  state.counters["vs_io"] = t / i;
  state.counters["vs_sum"] = t / (i + m);
  state.counters["hidden"] = std::clamp((i + m - t) / std::min(i, m), 0.0, 1.0);
  state.counters["host_MB"] = double(p.memory().swap_buffers) / 1e6;
  state.counters["direct"] = p.swap()->direct();
}

// One pass of the CPU step per sub-group `passes` times, the state at `state(c, f)` (what the
// swap's enter(c) makes of a sub-group, or one sub-group's arrays in memory), then leave(c).
// (grad and param: one sub-group's, every sub-group steps with the same.)
template <class State, class Enter, class Leave>
void stepped(std::size_t subs, int passes, std::span<const zp::bf16> grad,
             std::span<zp::bf16> param, State&& state, Enter&& enter, Leave&& leave) {
  const std::size_t n = elements(), sub = grad.size();
  for (std::size_t c = 0; c < subs; ++c) {
    enter(c);
    const std::size_t m = std::min(sub, n - c * sub);
    const zp::optim::ShardView<zp::bf16, zp::bf16> v{{state(c, 0), m},
                                                     {grad.data(), m},
                                                     {{{state(c, 1), m}, {state(c, 2), m}}},
                                                     {param.data(), m}};
    for (int k = 0; k < passes; ++k)
      zp::optim::cpu::step(zp::optim::AdamW{.lr = 1e-4f}, zp::optim::StepScalars{k + 1, 1.0f}, v);
    leave(c);
  }
}

void BM_overlap(benchmark::State& state) {
  const zp::NvmeOptions o = nvme_options(state.range(0) != 0, 8);
  // The step's swap, and one for the I/O alone (same options, its own file).
  zp::Swap<float> swap(o, elements(), 3, "zp_bench_swap"), alone(o, elements(), 3, "zp_bench_swap");
  const std::size_t sub = swap.sub_group(), subs = swap.sub_groups();
  std::vector<float> memory(3 * sub, 0.0f);  // one sub-group's master and state, in memory
  std::vector<zp::bf16> grad(sub), param(sub);
  fill(grad);
  const auto nothing = [](std::size_t) {};
  const auto compute = [&](int passes) {
    stepped(
        subs, passes, grad, param,
        [&](std::size_t, int f) { return memory.data() + std::size_t(f) * sub; }, nothing, nothing);
  };
  const auto ms = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return ms_since(t0);
  };
  // The step, adding the time it waits for the swap (in enter, leave and end_step) to `waited`,
  // and its first enter's (sub-group 0's read) to `first`.
  double waited = 0, first = 0;
  const auto both = [&](int passes) {
    swap.begin_step();
    stepped(
        subs, passes, grad, param, [&](std::size_t c, int f) { return swap.slot(c, f); },
        [&](std::size_t c) {
          const double t = ms([&] { swap.enter(c); });
          waited += t;
          if (c == 0) first += t;
        },
        [&](std::size_t c) { waited += ms([&] { swap.leave(c); }); });
    waited += ms([&] { swap.end_step(); });
  };
  // One step's reads and writes: the second of two passes, which waits for the reads the first
  // started at its end and starts its own (then waited for and dropped, so that nothing runs on).
  const auto io = [&] {
    io_pass(alone);
    const double t = ms([&] { io_pass(alone); });
    alone.abandon();
    return t;
  };
  const auto median3 = [](auto&& f) {
    double t[3] = {f(), f(), f()};
    std::sort(t, t + 3);
    return t[1];
  };
  io_pass(swap);  // the files' first writes allocate them
  const double io0 = median3(io), pass = median3([&] { return ms([&] { compute(1); }); });
  const int passes = std::max(1, int(std::lround(double(state.range(1)) * io0 / pass)));
  // Each iteration times the I/O alone and the compute alone too, so that all three see the
  // same minutes of this disk, whose rate drifts. The compute runs right after the step, as a
  // trainer's forward and backward would, behind the next step's first reads (next_step: 1), or
  // with nothing read ahead across steps (0: those reads dropped, so the step starts cold).
  double io_ms = 0, compute_ms = 0, total = 0;
  for (auto _ : state) {
    const double t = ms([&] { both(passes); });
    if (state.range(2) == 0) swap.abandon();
    compute_ms += ms([&] { compute(passes); });
    io_ms += io();
    total += t;
    state.SetIterationTime(t / 1e3);
  }
  const double k = double(state.iterations());
  io_ms /= k, compute_ms /= k, total /= k;
  state.counters["passes"] = passes;
  state.counters["first_wait_ms"] = first / k;
  state.counters["wait_ms"] = waited / k;
  state.counters["compute_in_step"] = (total - waited / k) / compute_ms;
  state.counters["io_ms"] = io_ms;
  state.counters["compute_ms"] = compute_ms;
  state.counters["step_ms"] = total;
  state.counters["vs_sum"] = total / (io_ms + compute_ms);
  state.counters["hidden"] =
      std::clamp((io_ms + compute_ms - total) / std::min(io_ms, compute_ms), 0.0, 1.0);
}

}  // namespace

// pipelined: 0 or 1; depth: the I/O queue depth (DeepSpeed's default 8, and 32).
void rows(benchmark::internal::Benchmark* b) {
  b->ArgNames({"pipelined", "depth"})->ArgsProduct({{0, 1}, {8, 32}});
  b->MinTime(2.0)->UseManualTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_io)->Apply(rows);
BENCHMARK(BM_memory)->MinTime(2.0)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_nvme)->Apply(rows);
BENCHMARK(BM_overlap)
    ->ArgNames({"pipelined", "compute_per_io", "next_step"})
    ->Args({0, 1, 0})
    ->Args({1, 1, 0})
    ->Args({1, 1, 1})
    ->Args({0, 2, 0})
    ->Args({1, 2, 0})
    ->Args({1, 2, 1})
    ->MinTime(2.0)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
