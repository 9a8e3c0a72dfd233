// zp/optim/gpu.hpp: the fused optimizer step and gradient statistics on a device (a GPU under
// nvcc, or the simulated device), as launches of the device primitives (zp/device/runtime.hpp).
//
// Same element math as the CPU path (optim/optimizer.hpp), so a step on the device gives the same
// bits as zp::optim::cpu::step (IEEE division and square root: do not build with
// --use_fast_math). Each work item handles 4 consecutive elements, with 128-bit loads of the fp32
// arrays (64-bit for 16-bit arrays) when every pointer is 16-byte aligned.
//
// No host synchronisation: grad_stats adds the squared norm into device memory, and step reads
// the engine's gate (device memory too) and writes nothing when it says skip.
#pragma once

#if !defined(__CUDACC__) && !defined(ZP_DEVICE_SIM)
#error \
    "zp/optim/gpu.hpp runs kernels: build with nvcc, or for the simulated device (ZP_DEVICE_SIM, zp::sim)"
#endif

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "zp/device/runtime.hpp"
#include "zp/error.hpp"
#include "zp/optim/optimizer.hpp"

namespace zp::optim::gpu {

namespace detail {
using optim::detail::Step;

using device::aligned16;
template <class X>
using Pack4 = device::Pack<X, 4>;

// Work item k of a step over n elements: elements [4k, min(4k + 4, n)).
template <class O, class T, class G>
struct StepItem {
  Step<O> c;
  float* master;
  const G* grad;
  float* state0;
  float* state1;
  T* param;
  int slots;
  std::size_t n;
  bool vectorized;
  const double*
      gate;  // [0] multiplies grad_mul, [1] nonzero: skip (shard_step.hpp, ShardStep::update)

  ZP_HOST_DEVICE void operator()(std::size_t k) const {
    if (gate[1] != 0) return;  // the whole step is skipped
    Step<O> s = c;
    s.grad_mul *= float(gate[0]);
    if (vectorized && 4 * k + 4 <= n) {
      Pack4<float> p = reinterpret_cast<const Pack4<float>*>(master)[k];
      const Pack4<G> g = reinterpret_cast<const Pack4<G>*>(grad)[k];
      Pack4<float> s0{}, s1{};
      if (slots > 0) s0 = reinterpret_cast<const Pack4<float>*>(state0)[k];
      if (slots > 1) s1 = reinterpret_cast<const Pack4<float>*>(state1)[k];
      Pack4<T> out;
      for (int j = 0; j < 4; ++j) {
        float st[2] = {s0.x[j], s1.x[j]};
        optim::detail::update(s, optim::detail::to_float(g.x[j]), p.x[j], st);
        s0.x[j] = st[0];
        s1.x[j] = st[1];
        out.x[j] = optim::detail::from_float<T>(p.x[j]);
      }
      reinterpret_cast<Pack4<float>*>(master)[k] = p;
      if (slots > 0) reinterpret_cast<Pack4<float>*>(state0)[k] = s0;
      if (slots > 1) reinterpret_cast<Pack4<float>*>(state1)[k] = s1;
      reinterpret_cast<Pack4<T>*>(param)[k] = out;
      return;
    }
    for (std::size_t i = 4 * k; i < n && i < 4 * k + 4; ++i) {
      float p = master[i];
      float st[2] = {0.0f, 0.0f};
      if (slots > 0) st[0] = state0[i];
      if (slots > 1) st[1] = state1[i];
      optim::detail::update(s, optim::detail::to_float(grad[i]), p, st);
      master[i] = p;
      if (slots > 0) state0[i] = st[0];
      if (slots > 1) state1[i] = st[1];
      param[i] = optim::detail::from_float<T>(p);
    }
  }
};

// Work item k of the squared norm: the squares, in double, of the gradient values (as stored)
// [wk, min(wk + w, n)), w = 16 bytes of G, read in one 16-byte load when the gradient is aligned.
template <class G>
struct SquareItem {
  static constexpr int w = int(16 / sizeof(G));
  const G* g;
  std::size_t n;
  bool vectorized;
  ZP_HOST_DEVICE double operator()(std::size_t k) const {
    double acc = 0;
    if (vectorized && w * k + w <= n) {
      const device::Pack<G, w> p = reinterpret_cast<const device::Pack<G, w>*>(g)[k];
      for (int j = 0; j < w; ++j) {
        const double x = optim::detail::to_float(p.x[j]);
        acc += x * x;
      }
      return acc;
    }
    for (std::size_t i = w * k; i < n && i < w * k + w; ++i) {
      const double x = optim::detail::to_float(g[i]);
      acc += x * x;
    }
    return acc;
  }
};

}  // namespace detail

// Adds the squared norm of the gradients (as stored) to stats[0], in device memory; an inf or
// nan makes it inf or nan, which the engine's gate reads as an overflow. Enqueued on `stream`,
// all in one launch (device::Batch) where they fit. 16 bytes a work item: scalar 2-byte loads
// reached 1.3 TB/s on an H100, 43% of a device copy.
template <class G>
void grad_stats(std::span<const std::span<const G>> grads, double* stats, device::stream_t stream) {
  constexpr std::size_t w = detail::SquareItem<G>::w;
  device::batched(
      grads,
      [](std::span<const G> g) {
        return std::pair{detail::SquareItem<G>{g.data(), g.size(), detail::aligned16(g.data())},
                         (g.size() + w - 1) / w};
      },
      [&](const auto& batch) { device::sum(stream, batch.items(), batch, stats); });
}
template <class G>
void grad_stats(std::span<const G> grad, double* stats, device::stream_t stream) {
  grad_stats(std::span<const std::span<const G>>(&grad, 1), stats, stream);
}

// One optimizer step over shards in device memory (a rank's segments), enqueued on `stream`,
// all in one launch (device::Batch) where they fit, gated by the two doubles at `gate` in device
// memory (shard_step.hpp, ShardStep::update). Throws Errc::invalid_argument on mismatched sizes.
template <Optimizer Opt, class T, class G>
void step(const Opt& opt, const StepScalars& s, std::span<const ShardView<T, G>> shards,
          const double* gate, device::stream_t stream) {
  for (const ShardView<T, G>& shard : shards)  // all checked before any is enqueued
    optim::detail::check_step(opt, s, shard);
  const int slots = optim::detail::used_slots(opt);
  const auto c = optim::detail::prepare(opt, s),
             no_decay = optim::detail::prepare(optim::detail::for_view(opt, false), s);
  const auto item = [&](const ShardView<T, G>& v) {
    detail::StepItem<Opt, T, G> f{v.decay ? c : no_decay,
                                  v.master.data(),
                                  v.grad.data(),
                                  v.state[0].data(),
                                  v.state[1].data(),
                                  v.param.data(),
                                  slots,
                                  v.master.size(),
                                  false,
                                  gate};
    f.vectorized = detail::aligned16(f.master) && detail::aligned16(f.grad) &&
                   detail::aligned16(f.param) && (slots < 1 || detail::aligned16(f.state0)) &&
                   (slots < 2 || detail::aligned16(f.state1));
    return std::pair{f, (f.n + 3) / 4};
  };
  device::batched(shards, item,
                  [&](const auto& batch) { device::launch(stream, batch.items(), batch); });
}
template <Optimizer Opt, class T, class G>
void step(const Opt& opt, const StepScalars& s, const ShardView<T, G>& shard, const double* gate,
          device::stream_t stream) {
  step(opt, s, std::span<const ShardView<T, G>>(&shard, 1), gate, stream);
}

}  // namespace zp::optim::gpu
