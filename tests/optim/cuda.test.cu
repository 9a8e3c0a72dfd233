// Tests of zp/optim/cuda.cuh against the CPU path: the kernel gives bitwise the same step, the
// device-side overflow flag skips the step without touching memory, grad_stats agrees.
// Without a CUDA device the test prints why and exits with 77, which ctest reports as a skip.
#include <doctest/doctest.h>

#include "../cuda_device.hpp"
#include <zp/optim/cpu.hpp>
#include <zp/optim/cuda.cuh>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace zp::optim;
using zp::bf16;
using zp::fp16;

namespace {

const int devices = zp::test::devices_or_skip("the gpu optimizer tests");  // before doctest's main

void ok(cudaError_t e) { REQUIRE_MESSAGE(e == cudaSuccess, cudaGetErrorString(e)); }

template <class X>
struct DeviceArray {
  X* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceArray(const std::vector<X>& host) : n(host.size()) {
    ok(cudaMalloc(&ptr, (n ? n : 1) * sizeof(X)));
    if (n) ok(cudaMemcpy(ptr, host.data(), n * sizeof(X), cudaMemcpyHostToDevice));
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  std::vector<X> get() const {
    std::vector<X> h(n);
    if (n) ok(cudaMemcpy(h.data(), ptr, n * sizeof(X), cudaMemcpyDeviceToHost));
    return h;
  }
  std::span<X> span() { return {ptr, n}; }
};

template <class X>
bool same_bytes(const std::vector<X>& a, const std::vector<X>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(X)) == 0);
}

template <class O>
int uses_slot_count(const O& o) {
  return detail::uses_slot(o, 1) ? 2 : detail::uses_slot(o, 0) ? 1 : 0;
}

// `steps` steps on the CPU and the GPU from identical inputs; `overflow_at` steps get an inf in
// the gradient and the device flag set, and must change nothing on either side.
template <class O, class T, class G>
void compare(const O& opt, std::size_t n, int steps, int overflow_at) {
  CAPTURE(n);
  std::mt19937_64 rng(n * 7919 + steps);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> master(n), s0(n), s1(n);
  std::vector<G> grad(n);
  std::vector<T> param(n);
  for (auto& x : master) x = normal(rng);
  DeviceArray<float> d_master(master), d_s0(s0), d_s1(s1);
  DeviceArray<T> d_param(param);
  DeviceArray<int> d_flag(std::vector<int>{0});
  DeviceArray<double> d_sumsq(std::vector<double>{0.0});
  std::int64_t t = 0;
  for (int k = 1; k <= steps; ++k) {
    for (auto& g : grad) g = G(normal(rng) * 16.0f);
    const bool overflow = k == overflow_at && n > 0;
    if (overflow) grad[n / 2] = G(std::numeric_limits<float>::infinity());
    DeviceArray<G> d_grad(grad);
    ok(cudaMemset(d_flag.ptr, 0, sizeof(int)));
    ok(cudaMemset(d_sumsq.ptr, 0, sizeof(double)));
    zp::optim::cuda::grad_stats(std::span<const G>(d_grad.ptr, n), d_sumsq.ptr, d_flag.ptr, nullptr);
    const GradStats host = cpu::grad_stats(std::span<const G>(grad));
    const int flag = d_flag.get()[0];
    CHECK(flag == (host.finite ? 0 : 1));
    if (host.finite) CHECK(d_sumsq.get()[0] == doctest::Approx(host.sumsq).epsilon(1e-12));
    if (!overflow) ++t;
    const StepScalars s{t < 1 ? 1 : t, 1.0f / 16.0f};
    const auto before = d_master.get();
    zp::optim::cuda::step(opt, s,
               ShardView<T, G>{d_master.span(), std::span<const G>(d_grad.ptr, n), {d_s0.span(), d_s1.span()},
                               d_param.span()},
               {.overflow = d_flag.ptr}, nullptr);
    if (host.finite) cpu::step(opt, s, ShardView<T, G>{master, grad, {s0, s1}, param});
    ok(cudaDeviceSynchronize());
    if (overflow) CHECK(same_bytes(before, d_master.get()));
    CHECK(same_bytes(master, d_master.get()));
    CHECK(same_bytes(param, d_param.get()));
    if (uses_slot_count(opt) > 0) CHECK(same_bytes(s0, d_s0.get()));
    if (uses_slot_count(opt) > 1) CHECK(same_bytes(s1, d_s1.get()));
  }
}

template <class O>
void compare_types(const O& opt) {
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(5), std::size_t(1027), std::size_t(1) << 20}) {
    compare<O, float, float>(opt, n, 4, 2);
    compare<O, bf16, bf16>(opt, n, 4, 3);
    compare<O, fp16, fp16>(opt, n, 4, 0);
    compare<O, bf16, float>(opt, n, 3, 0);
    compare<O, float, fp16>(opt, n, 3, 1);
  }
}

}  // namespace

TEST_CASE("the CUDA step matches the CPU step bit for bit and skips on the device overflow flag") {
  SUBCASE("AdamW") { compare_types(AdamW{}); }
  SUBCASE("Adam") { compare_types(Adam{.weight_decay = 0.1f}); }
  SUBCASE("SGD with Nesterov momentum") { compare_types(Sgd{.momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true}); }
  SUBCASE("SGD without momentum") { compare_types(Sgd{}); }
  SUBCASE("Lion") { compare_types(Lion{.weight_decay = 0.1f}); }
}

TEST_CASE("unaligned shards take the element-wise kernel and still match") {
  const std::size_t n = 1001;
  std::vector<float> master(n + 1, 0.5f), s0(n + 1), s1(n + 1), grad(n + 1, 0.25f), param(n + 1);
  DeviceArray<float> dm(master), d0(s0), d1(s1), dg(grad), dp(param);
  const auto sub = [](DeviceArray<float>& a, std::size_t n) { return std::span<float>(a.ptr + 1, n); };
  zp::optim::cuda::step(AdamW{}, {1}, ShardView<float, float>{sub(dm, n), sub(dg, n), {sub(d0, n), sub(d1, n)}, sub(dp, n)}, {},
             nullptr);
  cpu::step(AdamW{}, {1},
            ShardView<float, float>{std::span(master).subspan(1), std::span<const float>(grad).subspan(1),
                                    {std::span(s0).subspan(1), std::span(s1).subspan(1)}, std::span(param).subspan(1)});
  ok(cudaDeviceSynchronize());
  CHECK(same_bytes(master, dm.get()));
  CHECK(same_bytes(param, dp.get()));
}
