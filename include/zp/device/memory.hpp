// zp/device/memory.hpp: zp's buffers and operations in device memory: Allocator, Memory,
// ShardStep and OffloadStaging for MemorySpace::device, specialising what memory.hpp and
// shard_step.hpp declare, so engine.hpp runs unchanged on a device backend (nccl, cuda_threads)
// with this header included. Written on the primitives of zp/device/runtime.hpp only: it builds
// with nvcc for a GPU, or with any C++ compiler for the simulated device (ZP_DEVICE_SIM).
//
// Streams (zp/device/stream.hpp): every allocation, free and operation is enqueued on the
// calling thread's current stream, the rank's compute stream, where the model's kernels run too;
// the backends order their communication streams against it with events. Nothing in a step waits
// for the device except Memory::to_host (synchronize), the engine's one synchronisation per
// optimizer step, and ZeRO-Offload's copies.
//
//   zp::device::Stream compute;                          // the rank's compute stream
//   zp::device::StreamScope on(compute.get());           // the model's kernels run there too
//   zp::Collective<zp::backend::Nccl> comm(...);
//   zp::Engine<zp::backend::Nccl, zp::bf16, 3> engine(comm, model, config);
#pragma once

#if !defined(__CUDACC__) && !defined(ZP_DEVICE_SIM)
#error \
    "zp/device/memory.hpp runs kernels: build with nvcc, or for the simulated device (ZP_DEVICE_SIM, zp::sim)"
#endif

#include <algorithm>
#include <cstddef>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#include "zp/device/stream.hpp"
#include "zp/error.hpp"
#include "zp/memory.hpp"
#include "zp/optim/gpu.hpp"
#include "zp/shard_step.hpp"

namespace zp {

namespace device::detail {
// The current stream, after the delay test mode had its turn.
inline stream_t compute_stream() {
  const stream_t s = current_stream();
  before_enqueue(s, Role::compute);
  return s;
}
template <class F, class X>
struct InvokeAt {  // f(p) once, as a one-element launch
  F f;
  X* p;
  ZP_HOST_DEVICE void operator()(std::size_t) const { f(p); }
};
}  // namespace device::detail

// Stream-ordered allocation on the current stream.
template <>
struct Allocator<MemorySpace::device> {
  static void* allocate(std::size_t bytes) {
    return device::allocate(bytes, device::current_stream());
  }
  // Ordered after everything enqueued on the current stream: the rank's compute stream, which
  // the backends make wait for every operation on the memory (Work::wait, or a dropped Work).
  static void deallocate(void* p, std::size_t) noexcept {
    device::deallocate(p, device::current_stream(), "buffer.free");
  }
  static DeviceRoom room() { return {device::memory_free(), device::device_name()}; }
};

// Page-locked host memory (offload_space<device>, memory.hpp). A free does not wait for the
// device, so it first waits for the current stream, the one whose copies and kernels use the
// memory (an offloaded parameter shard: its uploads and its step).
template <>
struct Allocator<MemorySpace::pinned> {
  static void* allocate(std::size_t bytes) { return device::allocate_pinned(bytes); }
  static void deallocate(void* p, std::size_t) noexcept {
    if (!p) return;
    try {
      device::synchronize(device::current_stream(), "pinned.free.sync");
    } catch (const Error& e) {  // a failed device: nothing runs any more
      zp::detail::log_dropped("freeing pinned memory", e.what());
    }
    device::deallocate_pinned(p);
  }
};

template <>
struct Memory<MemorySpace::device> {
  template <class T>
  static void zero(std::span<T> x) {
    device::zero(x.data(), x.size_bytes(), device::detail::compute_stream());
  }
  template <class T>
  static void copy(std::span<T> dst, std::span<const T> src) {
    copy_async(dst, src, "copy");
  }
  template <class To, class From>
  static void accumulate(std::span<To> dst, std::span<const From> src) {
    ZP_EXPECT(dst.size() == src.size(), "accumulate: ", src.size(), " elements into ", dst.size());
    device::launch(device::detail::compute_stream(), dst.size(),
                   detail::Accumulate<To, From>{dst.data(), src.data()});
  }
  template <class To, class From>
  static void convert(std::span<To> dst, std::span<const From> src) {
    ZP_EXPECT(dst.size() == src.size(), "convert: ", src.size(), " elements into ", dst.size());
    device::launch(device::detail::compute_stream(), dst.size(),
                   detail::Convert<To, From>{dst.data(), src.data()});
  }
  // From pageable host memory: the call returns once the source was read (CUDA may wait for
  // the stream's earlier work first, unpolled, so the per-step path sets values by a launch).
  template <class T>
  static void from_host(std::span<T> dst, std::span<const T> src) {
    copy_async(dst, src, "from_host");
  }
  // Waits for the current stream: the one synchronisation (device::synchronize, counted). Into
  // pageable memory the copy call itself waits for the stream's earlier work, and nothing polls
  // the communicators there (a hung peer would hang it): the host waits for that work first,
  // polling, then for the copy.
  template <class T>
  static void to_host(std::span<T> dst, std::span<const T> src) {
    const device::stream_t s = device::current_stream();
    device::detail::host_wait([s] { return device::stream_done(s); });
    device::synchronize(copy_async(dst, src, "to_host"), "to_host.sync");
  }
  template <class F, class X>
  static void invoke(const F& f, X* p) {
    device::launch(device::detail::compute_stream(), 1, device::detail::InvokeAt<F, X>{f, p});
  }
  template <class F>
  static void for_each(std::size_t n, const F& f) {
    if (n > 0) device::launch(device::detail::compute_stream(), n, f);
  }

 private:
  // Enqueues the copy on the current stream (after the delay test mode) and returns that stream.
  template <class T>
  static device::stream_t copy_async(std::span<T> dst, std::span<const T> src, const char* what) {
    ZP_EXPECT(dst.size() == src.size(), what, ": ", src.size(), " elements into ", dst.size());
    const device::stream_t s = device::detail::compute_stream();
    device::copy(dst.data(), src.data(), src.size_bytes(), s);
    return s;
  }
};

// The optimizer's shard operations on the rank's compute stream (optim/gpu.hpp), each in one
// launch for all of a rank's segments where they fit.
template <>
struct ShardStep<MemorySpace::device> {
  template <class G>
  static void statistics(std::span<const std::span<const G>> grads, double* stats,
                         const optim::cpu::Options&) {
    optim::gpu::grad_stats(grads, stats, device::detail::compute_stream());
  }
  template <class Opt, class T, class G>
  static void update(const Opt& opt, const optim::StepScalars& s,
                     std::span<const optim::ShardView<T, G>> shards, const optim::cpu::Options&,
                     const double* gate) {
    optim::gpu::step(opt, s, shards, gate, device::detail::compute_stream());
  }
};

// ZeRO-Offload on a device (memory.hpp): segment s+1's gradient is copied down to a pinned
// buffer while the CPU steps segment s, whose new T values go up from another pinned buffer,
// all in the compute stream's order; two buffers of each kind. The host reuses param_[k] for
// segment s only after waiting for segment s's gradient, whose copy was enqueued after segment
// s-2's upload from param_[k]: that one wait orders both. Only freeing or growing the buffers
// needs the last uploads' own event.
template <>
class OffloadStaging<MemorySpace::device> {
 public:
  OffloadStaging() = default;
  OffloadStaging(const OffloadStaging&) = delete;
  OffloadStaging& operator=(const OffloadStaging&) = delete;
  ~OffloadStaging() {
    try {
      if (uploaded_)
        device::synchronize(uploaded_->get(),
                            "offload.free.sync");  // the last copies read the pinned memory
    } catch (const Error& e) {                     // a failed device: nothing runs any more
      zp::detail::log_dropped("offload staging's destructor", e.what());
    }
    for (int k = 0; k < 2; ++k) {
      device::deallocate_pinned(grad_[k]);
      device::deallocate_pinned(param_[k]);
    }
  }

  // param_host: the views' T values are in host memory (offloaded parameters): the CPU step
  // writes them there. The stream's earlier copies of them (a gather's upload) ran before the
  // gradient copy that step waits for.
  template <class ViewOf, class Step>
  void run(int segments, ViewOf&& view_of, Step&& step, bool param_host = false) {
    using V = std::decay_t<decltype(view_of(0))>;
    using G = std::remove_const_t<typename decltype(V::grad)::element_type>;
    using T = typename decltype(V::param)::element_type;
    std::size_t most = 0;
    for (int s = 0; s < segments; ++s) most = std::max(most, view_of(s).grad.size());
    reserve(most * sizeof(G), param_host ? 0 : most * sizeof(T));
    const device::stream_t st = device::current_stream();
    auto fetch = [&](int s) {
      const auto v = view_of(s);
      device::copy(grad_[s % 2], v.grad.data(), v.grad.size_bytes(), st);
      device::record(down_[s % 2].get(), st, "offload.down.record");
    };
    if (segments > 0) fetch(0);
    for (int s = 0; s < segments; ++s) {
      const int k = s % 2;
      if (s + 1 < segments) fetch(s + 1);  // the host is done with that buffer (segment s - 1)
      device::synchronize(down_[k].get(),
                          "offload.down.sync");  // and segment s - 2's upload left param_[k]
      V v = view_of(s);
      v.grad = std::span<const G>(static_cast<const G*>(grad_[k]), v.grad.size());
      if (param_host) {
        step(s, v);
        continue;
      }
      const std::span<T> device_param = v.param;
      v.param = std::span<T>(static_cast<T*>(param_[k]), device_param.size());
      step(s, v);
      device::copy(device_param.data(), param_[k], device_param.size_bytes(), st);
    }
    if (!uploaded_) uploaded_.emplace();
    device::record(uploaded_->get(), st, "offload.up.record");
  }

 private:
  void reserve(std::size_t grad_bytes, std::size_t param_bytes) {
    auto grow = [](void*(&b)[2], std::size_t& have, std::size_t want) {
      if (want <= have) return;
      for (auto& p : b) {
        device::deallocate_pinned(std::exchange(p, nullptr));
        p = device::allocate_pinned(want);
      }
      have = want;
    };
    if (grad_bytes <= grad_bytes_ && param_bytes <= param_bytes_) return;
    if (uploaded_)
      device::synchronize(uploaded_->get(),
                          "offload.grow.sync");  // the last run's copies read them
    grow(grad_, grad_bytes_, grad_bytes);
    grow(param_, param_bytes_, param_bytes);
  }

  void* grad_[2] = {nullptr, nullptr};
  void* param_[2] = {nullptr, nullptr};
  std::size_t grad_bytes_ = 0, param_bytes_ = 0;
  device::Event down_[2];                  // a gradient shard arrived in grad_[k]
  std::optional<device::Event> uploaded_;  // the last run's uploads are done
};

}  // namespace zp
