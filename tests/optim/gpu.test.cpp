// Tests of zp/optim/gpu.hpp against the CPU path: the device step gives bitwise the same step,
// the device-side gate skips the step without touching memory, grad_stats agrees. Built with g++
// it runs on the simulated device (label sim); as gpu.test.cu with nvcc, on a GPU (label gpu;
// without one it exits 77, skip).
#include <doctest/doctest.h>

#include "../device_or_skip.hpp"
#include "../random.hpp"
#include <zp/device/memory.hpp>
#include <zp/optim/cpu.hpp>
#include <zp/optim/gpu.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

using namespace zp::optim;
using zp::bf16;
using zp::fp16;

namespace {

const int devices = zp::test::devices_or_skip("the gpu optimizer tests");  // before doctest's main

using Dev = zp::Memory<zp::MemorySpace::device>;

// An array in device memory, filled from and read back to the host.
template <class X>
struct DeviceArray {
  zp::Buffer<X, zp::MemorySpace::device> buf;
  explicit DeviceArray(const std::vector<X>& host) : buf(host.size()) { set(host); }
  void set(const std::vector<X>& host) { Dev::from_host(buf.span(), std::span<const X>(host)); }
  std::vector<X> get() const {
    std::vector<X> h(buf.size());
    Dev::to_host(std::span<X>(h), std::span<const X>(buf.span()));
    return h;
  }
  X* ptr() const { return buf.data(); }
  std::span<X> span() { return buf.span(); }
};

template <class X>
bool same_bytes(const std::vector<X>& a, const std::vector<X>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(X)) == 0);
}

template <class O>
int uses_slot_count(const O& o) {
  return detail::uses_slot(o, 1) ? 2 : detail::uses_slot(o, 0) ? 1 : 0;
}

// `steps` steps on the CPU and the device from identical inputs; `overflow_at` steps get an inf in
// the gradient and the device gate set to skip, and must change nothing on either side.
template <class O, class T, class G>
void compare(const O& opt, std::size_t n, int steps, int overflow_at) {
  CAPTURE(n);
  std::mt19937_64 rng(zp::test::fresh_seed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> master(n), s0(n), s1(n);
  std::vector<G> grad(n);
  std::vector<T> param(n);
  for (auto& x : master) x = normal(rng);
  DeviceArray<float> d_master(master), d_s0(s0), d_s1(s1);
  DeviceArray<T> d_param(param);
  DeviceArray<double> d_stats(std::vector<double>{0.0}), d_gate(std::vector<double>{1.0, 0.0});
  DeviceArray<G> d_grad(grad);
  std::int64_t t = 0;
  for (int k = 1; k <= steps; ++k) {
    for (auto& g : grad) g = G(normal(rng) * 16.0f);
    const bool overflow = k == overflow_at && n > 0;
    if (overflow) grad[n / 2] = G(std::numeric_limits<float>::infinity());
    d_grad.set(grad);
    d_stats.set({0.0});
    zp::optim::gpu::grad_stats(std::span<const G>(d_grad.ptr(), n), d_stats.ptr(),
                               zp::device::current_stream());
    const GradStats host = cpu::grad_stats(std::span<const G>(grad));
    const double sumsq = d_stats.get()[0];
    CHECK(std::isfinite(sumsq) == host.finite);
    if (host.finite) CHECK(sumsq == doctest::Approx(host.sumsq).epsilon(1e-12));
    if (!overflow) ++t;
    d_gate.set({1.0, host.finite ? 0.0 : 1.0});
    const StepScalars s{t < 1 ? 1 : t, 1.0f / 16.0f};
    const auto before = d_master.get();
    zp::optim::gpu::step(opt, s,
                         ShardView<T, G>{d_master.span(),
                                         std::span<const G>(d_grad.ptr(), n),
                                         {d_s0.span(), d_s1.span()},
                                         d_param.span()},
                         d_gate.ptr(), zp::device::current_stream());
    if (host.finite) cpu::step(opt, s, ShardView<T, G>{master, grad, {s0, s1}, param});
    if (overflow) CHECK(same_bytes(before, d_master.get()));
    CHECK(same_bytes(master, d_master.get()));
    CHECK(same_bytes(param, d_param.get()));
    if (uses_slot_count(opt) > 0) CHECK(same_bytes(s0, d_s0.get()));
    if (uses_slot_count(opt) > 1) CHECK(same_bytes(s1, d_s1.get()));
  }
}

template <class O>
void compare_types(const O& opt) {
  // The largest spans many blocks of a grid-stride launch on a GPU; the simulator's loops are
  // serial, so it gets a smaller one (still a tail of 3 after the packs of 4).
#if defined(ZP_DEVICE_SIM)
  constexpr std::size_t large = 65539;
#else
  constexpr std::size_t large = std::size_t(1) << 20;
#endif
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(5), std::size_t(1027), large}) {
    compare<O, float, float>(opt, n, 4, 2);
    compare<O, bf16, bf16>(opt, n, 4, 3);
    compare<O, fp16, fp16>(opt, n, 4, 0);
    compare<O, bf16, float>(opt, n, 3, 0);
    compare<O, float, fp16>(opt, n, 3, 1);
  }
}

}  // namespace

TEST_CASE("the device step matches the CPU step bit for bit and skips on the device gate") {
  SUBCASE("AdamW") { compare_types(AdamW{}); }
  SUBCASE("Adam") { compare_types(Adam{.weight_decay = 0.1f}); }
  SUBCASE("SGD with Nesterov momentum") {
    compare_types(Sgd{.momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true});
  }
  SUBCASE("SGD without momentum") { compare_types(Sgd{}); }
  SUBCASE("Lion") { compare_types(Lion{.weight_decay = 0.1f}); }
}

TEST_CASE("unaligned shards take the element-wise path and still match") {
  const std::size_t n = 1001;
  std::vector<float> master(n + 1, 0.5f), s0(n + 1), s1(n + 1), grad(n + 1), param(n + 1);
  std::mt19937_64 rng(zp::test::fresh_seed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& g : grad) g = normal(rng);
  DeviceArray<float> dm(master), d0(s0), d1(s1), dg(grad), dp(param);
  DeviceArray<double> gate(std::vector<double>{1.0, 0.0});
  const auto sub = [](DeviceArray<float>& a, std::size_t n) {
    return std::span<float>(a.ptr() + 1, n);
  };
  zp::optim::gpu::step(
      AdamW{}, {1},
      ShardView<float, float>{sub(dm, n), sub(dg, n), {sub(d0, n), sub(d1, n)}, sub(dp, n)},
      gate.ptr(), zp::device::current_stream());
  cpu::step(AdamW{}, {1},
            ShardView<float, float>{std::span(master).subspan(1),
                                    std::span<const float>(grad).subspan(1),
                                    {std::span(s0).subspan(1), std::span(s1).subspan(1)},
                                    std::span(param).subspan(1)});
  CHECK(same_bytes(master, dm.get()));
  CHECK(same_bytes(param, dp.get()));
  // The squared norm of the unaligned gradient (element-wise items) against a serial double sum.
  DeviceArray<double> stats(std::vector<double>{0.0});
  zp::optim::gpu::grad_stats(std::span<const float>(dg.ptr() + 1, n), stats.ptr(),
                             zp::device::current_stream());
  double want = 0;
  for (std::size_t i = 1; i <= n; ++i) want += double(grad[i]) * double(grad[i]);
  CHECK(stats.get()[0] == doctest::Approx(want).epsilon(1e-12));
}

TEST_CASE(
    "a step and the statistics over many shards (a rank's segments) match the CPU per "
    "shard, in batches; a bad shard anywhere enqueues nothing") {
  using Item = zp::optim::gpu::detail::StepItem<AdamW, bf16, bf16>;
  constexpr int shards = 2 * zp::device::Batch<Item>::N + 3;  // three batches
  std::mt19937_64 rng(zp::test::fresh_seed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Disjoint shards of 0-300 elements in one buffer, each after a gap of 0-3 (unaligned ones
  // take the element-wise path); the gaps must stay as they were.
  std::vector<std::size_t> at(shards), size(shards);
  std::size_t total = 0;
  for (int j = 0; j < shards; ++j) {
    total += rng() % 4;
    at[std::size_t(j)] = total;
    size[std::size_t(j)] = j % 9 == 4 ? 0 : rng() % 301;
    total += size[std::size_t(j)];
  }
  std::vector<float> master(total), s0(total), s1(total, 0.25f);
  std::vector<bf16> grad(total), param(total, bf16(-3.0f));
  for (auto& x : master) x = normal(rng);
  for (auto& x : s0) x = normal(rng) * 1e-2f;
  for (auto& g : grad) g = bf16(normal(rng));
  DeviceArray<float> dm(master), d0(s0), d1(s1);
  DeviceArray<bf16> dg(grad), dp(param);
  DeviceArray<double> gate(std::vector<double>{0.5, 0.0}), stats(std::vector<double>{0.0});
  const auto views = [&](float* m, const bf16* g, float* a, float* b, bf16* p) {
    std::vector<ShardView<bf16, bf16>> v;
    for (int j = 0; j < shards; ++j) {
      const std::size_t o = at[std::size_t(j)], n = size[std::size_t(j)];
      v.push_back({{m + o, n}, {g + o, n}, {std::span(a + o, n), std::span(b + o, n)}, {p + o, n}});
    }
    return v;
  };
  auto dv = views(dm.ptr(), dg.ptr(), d0.ptr(), d1.ptr(), dp.ptr());
  const StepScalars s{3, 0.75f};

  // A shard whose sizes differ, last: an error, and no shard before it was stepped.
  auto bad = dv;
  bad.back().param = bad.back().param.first(bad.back().param.size() / 2);
  if (!bad.back().master.empty()) {
    CHECK_THROWS_AS(zp::optim::gpu::step(AdamW{}, s, std::span(std::as_const(bad)), gate.ptr(),
                                         zp::device::current_stream()),
                    zp::Error);
    CHECK(same_bytes(master, dm.get()));
  }

  zp::optim::gpu::step(AdamW{}, s, std::span(std::as_const(dv)), gate.ptr(),
                       zp::device::current_stream());
  StepScalars hs = s;
  hs.grad_mul *= 0.5f;  // gate[0]
  for (const auto& v : views(master.data(), grad.data(), s0.data(), s1.data(), param.data()))
    cpu::step(AdamW{}, hs, v);
  CHECK(same_bytes(master, dm.get()));
  CHECK(same_bytes(s0, d0.get()));
  CHECK(same_bytes(s1, d1.get()));
  CHECK(same_bytes(param, dp.get()));

  std::vector<std::span<const bf16>> gs;
  double want = 0;
  for (int j = 0; j < shards; ++j) {
    gs.emplace_back(dg.ptr() + at[std::size_t(j)], size[std::size_t(j)]);
    for (std::size_t i = 0; i < size[std::size_t(j)]; ++i) {
      const double x = double(float(grad[at[std::size_t(j)] + i]));
      want += x * x;
    }
  }
  zp::optim::gpu::grad_stats(std::span(std::as_const(gs)), stats.ptr(),
                             zp::device::current_stream());
  CHECK(stats.get()[0] == doctest::Approx(want).epsilon(1e-12));
}
