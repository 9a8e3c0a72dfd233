// zp_bench_optim: the fused optimizer step against the memory-bandwidth limit.
//
// adamw/<layout>/threads:T/params:N  zp::optim::cpu::step, fp32 layout (fp32 master = model
//   copy, fp32 gradient) or bf16 layout (fp32 master, m, v; bf16 gradient and model copy).
//   Both move 28 bytes per parameter (REFERENCE.md); GBps counts exactly those.
// adamw/<layout>/scalar_loop/threads:1/params:N  a plain loop of the same update, the baseline.
// grad_stats/<layout>/threads:T/params:N  the separate statistics pass (bytes of the gradient).
// membw/copy/threads:T  the bandwidth limit measured in the same run (bench/membw.hpp).
// Every benchmark checks its result against the scalar loop before timing.
#include <benchmark/benchmark.h>

#include <zp/optim/cpu.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "membw.hpp"

using namespace zp::optim;

namespace {

constexpr double bytes_per_param = 28.0;

// The plain loop: torch.optim.AdamW's update written out, one element at a time.
template <class T, class G>
void adamw_scalar_loop(const AdamW& o, std::int64_t t, float grad_mul, float* master, const G* grad,
                       float* m, float* v, T* param, std::size_t n) {
  const float bc1 = 1.0f - std::pow(o.beta1, float(t));
  const float bc2_sqrt = std::sqrt(1.0f - std::pow(o.beta2, float(t)));
  const float step = o.lr / bc1, decay = 1.0f - o.lr * o.weight_decay;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = float(grad[i]) * grad_mul;
    float p = master[i] * decay;
    m[i] = o.beta1 * m[i] + (1.0f - o.beta1) * g;
    v[i] = o.beta2 * v[i] + (1.0f - o.beta2) * g * g;
    p -= step * m[i] / (std::sqrt(v[i]) / bc2_sqrt + o.eps);
    master[i] = p;
    param[i] = T(p);
  }
}

template <class T, class G>
struct Buffers {
  std::vector<float> master, m, v;
  std::vector<G> grad;
  std::vector<T> param;  // empty for the fp32 layout: the model copy is the master itself
  explicit Buffers(std::size_t n)
      : master(n), m(n), v(n), grad(n), param(std::is_same_v<T, float> ? 0 : n) {
    for (std::size_t i = 0; i < n; ++i) {
      master[i] = 1.0f + float(i % 1024) * 1e-3f;
      grad[i] = G(float(int(i % 37) - 18) * 1e-2f);
      m[i] = 1e-3f;
      v[i] = 1e-4f;
    }
  }
  ShardView<T, G> view() {
    std::span<T> p;
    if constexpr (std::is_same_v<T, float>)
      p = master;
    else
      p = param;
    return {master, std::span<const G>(grad), {std::span<float>(m), std::span<float>(v)}, p};
  }
};

// Before timing: zp's step and the scalar loop agree on a small shard (to fp32 rounding: the
// plain loop does not use fma).
template <class T, class G>
bool result_ok(int threads) {
  const std::size_t n = 4099;
  Buffers<T, G> a(n), b(n);
  cpu::step(AdamW{}, {3, 0.5f}, a.view(), {.threads = threads});
  const auto bv = b.view();
  adamw_scalar_loop(AdamW{}, 3, 0.5f, b.master.data(), b.grad.data(), b.m.data(), b.v.data(),
                    bv.param.data(), n);
  for (std::size_t i = 0; i < n; ++i)
    if (!(std::abs(a.master[i] - b.master[i]) <= 1e-6f * std::abs(b.master[i]) + 1e-9f) ||
        !(std::abs(a.m[i] - b.m[i]) <= 1e-6f * std::abs(b.m[i]) + 1e-12f))  // NaN: unequal
      return false;
  return true;
}

void set_counters(benchmark::State& state, std::size_t n, double bytes) {
  const double it = double(state.iterations());
  state.counters["params_per_s"] = benchmark::Counter(double(n) * it, benchmark::Counter::kIsRate);
  state.counters["GBps"] =
      benchmark::Counter(bytes * double(n) * it * 1e-9, benchmark::Counter::kIsRate);  // GB/s
}

template <class T, class G>
void bench_step(benchmark::State& state, int threads, std::size_t n) {
  if (!result_ok<T, G>(threads)) {
    state.SkipWithError("zp step differs from the scalar loop");
    return;
  }
  Buffers<T, G> b(n);
  const auto view = b.view();
  std::int64_t t = 0;
  for (auto _ : state) {
    cpu::step(AdamW{}, {++t, 1.0f}, view, {.threads = threads});
    benchmark::ClobberMemory();
  }
  set_counters(state, n, bytes_per_param);
}

template <class T, class G>
void bench_scalar_loop(benchmark::State& state, int, std::size_t n) {
  Buffers<T, G> b(n);
  const auto view = b.view();
  std::int64_t t = 0;
  for (auto _ : state) {
    adamw_scalar_loop(AdamW{}, ++t, 1.0f, b.master.data(), b.grad.data(), b.m.data(), b.v.data(),
                      view.param.data(), n);
    benchmark::ClobberMemory();
  }
  set_counters(state, n, bytes_per_param);
}

template <class G>
void bench_grad_stats(benchmark::State& state, int threads, std::size_t n) {
  std::vector<G> g(n, G(0.5f));
  if (cpu::grad_stats(std::span<const G>(g), {.threads = threads}).sumsq != 0.25 * double(n)) {
    state.SkipWithError("grad_stats wrong");
    return;
  }
  for (auto _ : state)
    benchmark::DoNotOptimize(cpu::grad_stats(std::span<const G>(g), {.threads = threads}));
  set_counters(state, n, double(sizeof(G)));
}

template <class F>
void add(const std::string& name, F f, int threads, std::int64_t n) {
  benchmark::RegisterBenchmark(
      (name + "/threads:" + std::to_string(threads) + "/params:" + std::to_string(n)).c_str(),
      [=](benchmark::State& s) { f(s, threads, std::size_t(n)); })
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t sizes[] = {std::int64_t(16) << 20, std::int64_t(64) << 20};
  zp::bench::register_membw_copy(std::size_t(256) << 20, {1, 2});
  for (std::int64_t n : sizes) {
    for (int t : {1, 2}) {
      add("adamw/fp32", bench_step<float, float>, t, n);
      add("adamw/bf16", bench_step<zp::bf16, zp::bf16>, t, n);
    }
    add("adamw/fp32/scalar_loop", bench_scalar_loop<float, float>, 1, n);
    for (int t : {1, 2}) add("grad_stats/fp32", bench_grad_stats<float>, t, n);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
