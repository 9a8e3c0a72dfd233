// zp_bench_optim_cuda: the device AdamW step on a GPU (zp/optim/gpu.hpp) against the device's memory
// bandwidth, measured in the same run.
//
// cuda/adamw/<layout>/params:N  one fused step over N parameters, fp32 layout (fp32 master = the
//   model copy, fp32 gradient) or bf16 layout (fp32 master, m, v; bf16 gradient and model copy):
//   28 bytes per parameter either way (REFERENCE.md); GBps counts exactly those.
// cuda/grad_stats/<grad type>/params:N  the statistics pass (squared norm, overflow); GBps counts
//   the gradient's bytes (bf16: the bf16 layout; fp32: the fp32 layout, PyTorch's clip_grad_norm_).
// cuda/clip_adamw/fp32/params:N  what PyTorch's clip_grad_norm_ + AdamW(fused=True).step() do, as
//   the engine does it on one rank: the statistics of the fp32 gradient, the gate (clip to norm 1),
//   the step it gates; GBps counts 32 bytes per parameter (the gradient read twice).
// cuda/copy/bytes:B  cudaMemcpyAsync device to device, GBps = 2B (read + write) per second: the
//   baseline; copy_fraction on the AdamW rows is their GBps over the copy of the same bytes.
// Times are CUDA events around 10 launches (manual time), after a warm-up, 20 iterations a row
// (Google Benchmark's own choice, by manual time, ran 10x longer than it counted); every AdamW
// row first checks one step against the CPU step (zp/optim/cpu.hpp) on a small shard, bit for bit.
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_copy.hpp"
#include "zp/optim/cpu.hpp"
#include "zp/optim/gpu.hpp"
#include "zp/device/memory.hpp"
#include "zp/step_gate.hpp"

using namespace zp::optim;
using zp::bench::copy_gbps;
using zp::bench::ok;
using zp::bench::timed;

namespace {

constexpr double bytes_per_param = 28.0;

template <class X>
X* device_array(std::size_t n, float first) {
  X* p = nullptr;
  ok(cudaMalloc(&p, n * sizeof(X)), "cudaMalloc");
  std::vector<X> h(std::min<std::size_t>(n, 1 << 20));
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = X(first + float(int(i % 37) - 18) * 1e-2f);
  for (std::size_t at = 0; at < n; at += h.size())
    ok(cudaMemcpy(p + at, h.data(), std::min(h.size(), n - at) * sizeof(X), cudaMemcpyHostToDevice),
       "cudaMemcpy");
  return p;
}

// The engine's step gate saying "apply, grad_mul 1" (shard_step.hpp, ShardStep::update): two doubles on the device.
const double* apply_gate() {
  static const double* gate = [] {
    double* p = nullptr;
    const double h[2] = {1.0, 0.0};
    ok(cudaMalloc(&p, sizeof h), "cudaMalloc");
    ok(cudaMemcpy(p, h, sizeof h, cudaMemcpyHostToDevice), "cudaMemcpy");
    return p;
  }();
  return gate;
}

void copy_bench(benchmark::State& state) {
  const std::size_t bytes = std::size_t(state.range(0));
  for (auto _ : state) state.SetIterationTime(2.0 * double(bytes) / (copy_gbps(bytes) * 1e9));
  state.counters["GBps"] = copy_gbps(bytes);
}

// One step on the CPU and the GPU from the same inputs agree bit for bit (the kernels share the
// element math); a benchmark that fails this reports an error instead of a time.
template <class T, class G>
bool same_as_cpu() {
  const std::size_t n = 4099;
  std::vector<float> master(n), m(n, 1e-3f), v(n, 1e-4f);
  std::vector<G> grad(n);
  std::vector<T> param(n);
  for (std::size_t i = 0; i < n; ++i) {
    master[i] = 1.0f + float(i % 1024) * 1e-3f;
    grad[i] = G(float(int(i % 37) - 18) * 1e-2f);
  }
  float *dm, *ds0, *ds1;
  G* dg;
  T* dp;
  ok(cudaMalloc(&dm, n * 4), "cudaMalloc");
  ok(cudaMalloc(&ds0, n * 4), "cudaMalloc");
  ok(cudaMalloc(&ds1, n * 4), "cudaMalloc");
  ok(cudaMalloc(&dg, n * sizeof(G)), "cudaMalloc");
  ok(cudaMalloc(&dp, n * sizeof(T)), "cudaMalloc");
  ok(cudaMemcpy(dm, master.data(), n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  ok(cudaMemcpy(ds0, m.data(), n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  ok(cudaMemcpy(ds1, v.data(), n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  ok(cudaMemcpy(dg, grad.data(), n * sizeof(G), cudaMemcpyHostToDevice), "cudaMemcpy");
  const StepScalars s{3, 0.5f};
  zp::optim::gpu::step(
      AdamW{}, s,
      ShardView<T, G>{
          {dm, n}, {dg, n}, {std::span<float>(ds0, n), std::span<float>(ds1, n)}, {dp, n}},
      apply_gate(), nullptr);
  cpu::step(AdamW{}, s,
            ShardView<T, G>{master, grad, {std::span<float>(m), std::span<float>(v)}, param});
  std::vector<float> gm(n);
  std::vector<T> gp(n);
  ok(cudaMemcpy(gm.data(), dm, n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  ok(cudaMemcpy(gp.data(), dp, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  for (void* p : {(void*)dm, (void*)ds0, (void*)ds1, (void*)dg, (void*)dp}) cudaFree(p);
  return std::memcmp(gm.data(), master.data(), n * 4) == 0 &&
         std::memcmp(gp.data(), param.data(), n * sizeof(T)) == 0;
}

// A shard of n parameters in device memory, for AdamW; fp32 layout: the model copy is the
// master itself (T = float, param aliases master).
template <class T, class G>
struct DeviceShard {
  std::size_t n;
  float* master = device_array<float>(n, 1.0f);
  float* m = device_array<float>(n, 1e-3f);
  float* v = device_array<float>(n, 1e-4f);
  G* grad = device_array<G>(n, 0.0f);
  T* param = std::is_same_v<T, float> ? reinterpret_cast<T*>(master) : device_array<T>(n, 1.0f);
  explicit DeviceShard(std::size_t elems) : n(elems) {}
  DeviceShard(const DeviceShard&) = delete;
  DeviceShard& operator=(const DeviceShard&) = delete;
  ~DeviceShard() {
    for (void* p : {(void*)master, (void*)m, (void*)v, (void*)grad}) cudaFree(p);
    if (!std::is_same_v<T, float>) cudaFree(param);
  }
  ShardView<T, G> view() const {
    return {{master, n}, {grad, n}, {std::span<float>(m, n), std::span<float>(v, n)}, {param, n}};
  }
};

template <class T, class G>
void adamw(benchmark::State& state) {
  if (!same_as_cpu<T, G>()) {
    state.SkipWithError("the CUDA step differs from the CPU step");
    return;
  }
  const std::size_t n = std::size_t(state.range(0));
  const DeviceShard<T, G> d(n);
  const ShardView<T, G> shard = d.view();
  std::int64_t t = 0;
  double seconds = 0;
  for (auto _ : state) {
    seconds = timed([&] {
      zp::optim::gpu::step(AdamW{}, StepScalars{++t, 1.0f}, shard, apply_gate(), nullptr);
    });
    state.SetIterationTime(seconds);
  }
  const double gbps = bytes_per_param * double(n) / seconds / 1e9;
  state.counters["GBps"] = gbps;
  state.counters["params_per_s"] = double(n) / seconds;
  state.counters["copy_fraction"] = gbps / copy_gbps(std::size_t(bytes_per_param / 2 * double(n)));
}

void clip_adamw(benchmark::State& state) {
  const std::size_t n = std::size_t(state.range(0));
  const DeviceShard<float, float> d(n);
  const ShardView<float, float> shard = d.view();
  zp::StepStatistics<zp::MemorySpace::device> stats;
  const std::span<const float> grads[] = {shard.grad};
  std::int64_t t = 0;
  double seconds = 0;
  for (auto _ : state) {
    seconds = timed([&] {
      stats.begin(0);
      stats.add(std::span<const std::span<const float>>(grads), cpu::Options{});
      stats.decide(1.0, 1.0f, 1.0f);
      zp::optim::gpu::step(AdamW{}, StepScalars{++t, 1.0f}, shard, stats.gate(), nullptr);
    });
    state.SetIterationTime(seconds);
  }
  const auto outcome = stats.read();  // the gate clipped and applied the step
  if (!(outcome[stats.count] < 1.0) || outcome[stats.count + 1] != zp::detail::StepGate::apply)
    state.SkipWithError("the gate did not clip and apply");
  state.counters["GBps"] = 32.0 * double(n) / seconds / 1e9;
}

template <class G>
void grad_stats(benchmark::State& state) {
  const std::size_t n = std::size_t(state.range(0));
  G* grad = device_array<G>(n, 0.0f);
  double* stats = nullptr;
  ok(cudaMalloc(&stats, 2 * sizeof(double)), "cudaMalloc");
  double seconds = 0;
  for (auto _ : state) {
    seconds =
        timed([&] { zp::optim::gpu::grad_stats(std::span<const G>(grad, n), stats, nullptr); });
    state.SetIterationTime(seconds);
  }
  state.counters["GBps"] = double(n * sizeof(G)) / seconds / 1e9;
  cudaFree(grad);
  cudaFree(stats);
}

const bool registered = [] {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("zp_bench_optim_cuda: no CUDA device, nothing to measure\n");
    return false;
  }
  for (std::int64_t n : {std::int64_t(1) << 24, std::int64_t(1) << 26, std::int64_t(1) << 28,
                         std::int64_t(1) << 30}) {
    benchmark::RegisterBenchmark("cuda/adamw/fp32", adamw<float, float>)
        ->Arg(n)
        ->ArgName("params")
        ->Iterations(20)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("cuda/adamw/bf16", adamw<zp::bf16, zp::bf16>)
        ->Arg(n)
        ->ArgName("params")
        ->Iterations(20)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("cuda/clip_adamw/fp32", clip_adamw)
        ->Arg(n)
        ->ArgName("params")
        ->Iterations(20)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("cuda/grad_stats/bf16", grad_stats<zp::bf16>)
        ->Arg(n)
        ->ArgName("params")
        ->Iterations(20)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("cuda/grad_stats/fp32", grad_stats<float>)
        ->Arg(n)
        ->ArgName("params")
        ->Iterations(20)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("cuda/copy", copy_bench)
        ->Arg(std::int64_t(bytes_per_param / 2) * n)
        ->ArgName("bytes")
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
