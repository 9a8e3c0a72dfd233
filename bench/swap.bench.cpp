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

zp::NvmeOptions nvme_options(const benchmark::State& state) {
  return {.path = swap_dir(),
          .pipeline_read = state.range(0) != 0,
          .pipeline_write = state.range(0) != 0,
          .sub_group_size = std::size_t(4) << 20,
          .queue_depth = unsigned(state.range(1))};
}
std::string key(const char* what, const benchmark::State& state) {
  return zp::detail::cat(what, state.range(0), "/", state.range(1));
}

// Random gradients (small, so AdamW's state stays finite over any number of steps).
void fill(const Part& p) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1e-2f, 1e-2f);
  for (auto& g : p.buffer<zp::Field::grad>()) g = zp::bf16(u(rng));
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
  timed(state, key("io", state), [&] {
    swap.begin_step();
    for (std::size_t c = 0; c < swap.sub_groups(); ++c) {
      swap.enter(c);
      swap.leave(c);
    }
    swap.end_step();
  });
  state.counters["direct"] = swap.direct();
}

void BM_memory(benchmark::State& state) {
  Part p(layout(), 0, 2, false, true);
  fill(p);
  zp::OffloadStaging<zp::MemorySpace::host> staging;
  timed(state, "memory", [&] { step(p, staging); });
}

void BM_nvme(benchmark::State& state) {
  const zp::NvmeOptions o = nvme_options(state);
  Part p(layout(), 0, 2, false, true, &o);
  p.expect_swap_opened();
  fill(p);
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

}  // namespace

// pipelined: 0 or 1; depth: the I/O queue depth (DeepSpeed's default 8, and 32).
void rows(benchmark::internal::Benchmark* b) {
  b->ArgNames({"pipelined", "depth"})->ArgsProduct({{0, 1}, {8, 32}});
  b->MinTime(2.0)->UseManualTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_io)->Apply(rows);
BENCHMARK(BM_memory)->MinTime(2.0)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_nvme)->Apply(rows);

BENCHMARK_MAIN();
