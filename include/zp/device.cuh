// zp/device.cuh: zp's buffers and operations in GPU memory (nvcc only): Allocator and Ops for
// MemorySpace::device, the specialisations memory.hpp names, so engine.hpp runs unchanged on a
// device backend (nccl, cuda_threads) with this header included.
//
// Streams (zp/stream.hpp): every allocation, free and operation is enqueued on the calling
// thread's current stream, the rank's compute stream, where the model's kernels run too; the
// backends order their communication streams against it with events. Nothing waits for the GPU
// except Ops::to_host (device::synchronize), the engine's one synchronisation per optimizer step.
//
//   zp::device::Stream compute;                          // the rank's compute stream
//   zp::device::StreamScope on(compute.get());           // the model's kernels run there too
//   zp::Collective<zp::backend::Nccl> comm(...);
//   zp::Engine<zp::backend::Nccl, zp::bf16, 3> engine(comm, model, config);
//
// Test mode: delay_streams() puts a spin kernel before every enqueue on streams of one role.
#pragma once

#if !defined(__CUDACC__)
#error "zp/device.cuh needs nvcc; host-only code uses zp/memory.hpp's host specialisations"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#include "zp/error.hpp"
#include "zp/memory.hpp"
#include "zp/optim/cuda.cuh"
#include "zp/stream.hpp"

namespace zp::device {

namespace detail {
inline constexpr int block = 256;
inline int blocks_for(std::size_t n) { return optim::cuda::detail::grid_for(n); }

template <class To, class From>
__global__ void accumulate_kernel(To* dst, const From* src, std::size_t n) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = To(float(dst[i]) + float(src[i]));
}
template <class To, class From>
__global__ void convert_kernel(To* dst, const From* src, std::size_t n) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = To(float(src[i]));
}
template <class F, class X>
__global__ void invoke_kernel(F f, X* p) {
  f(p);
}
__global__ inline void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
inline std::atomic<long long>& delay_cycles(Role r) {
  static std::atomic<long long> c[2] = {0, 0};
  return c[int(r)];
}
inline void spin_hook(cudaStream_t s, Role r) {
  if (const long long c = delay_cycles(r).load(std::memory_order_relaxed)) {
    spin_kernel<<<1, 1, 0, s>>>(c);
    check(cudaGetLastError(), "spin kernel launch");
  }
}
// The current stream, after the delay hook (test mode) had its turn.
inline cudaStream_t compute_stream() {
  const cudaStream_t s = current_stream();
  before_enqueue(s, Role::compute);
  return s;
}
}  // namespace detail

// Test mode: a spin kernel of `cycles` GPU clock cycles before every enqueue on every stream of
// role `r` (0: none), so kernels and copies there run late; results must not change.
inline void delay_streams(Role r, long long cycles) {
  detail::delay_cycles(r).store(cycles);
  const bool any = detail::delay_cycles(Role::compute).load() || detail::delay_cycles(Role::comm).load();
  set_delay_hook(any ? &detail::spin_hook : nullptr);
}

}  // namespace zp::device

namespace zp {

// Stream-ordered allocation from the device's memory pool (cudaMallocAsync): after the first
// steps the pool holds the engine's working set, so a step allocates nothing from the driver.
template <>
struct Allocator<MemorySpace::device> {
  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, bytes, device::current_stream());
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear it: the Buffer reports out_of_memory with the size
      throw std::bad_alloc();
    }
    device::check(e, "cudaMallocAsync");
    return p;
  }
  // Ordered after everything enqueued on the current stream: the rank's compute stream, which
  // the backends make wait for every operation on the memory (Work::wait, or a dropped Work).
  static void deallocate(void* p) noexcept {
    if (p) (void)cudaFreeAsync(p, device::current_stream());
  }
};

template <>
struct Ops<MemorySpace::device> {
  template <class T>
  static void zero(std::span<T> x) {
    if (!x.empty()) device::check(cudaMemsetAsync(x.data(), 0, x.size_bytes(), device::detail::compute_stream()), "cudaMemsetAsync");
  }
  template <class T>
  static void copy(std::span<T> dst, std::span<const T> src) {
    copy_async(dst, src, cudaMemcpyDeviceToDevice, "copy");
  }
  // dst += src in float, rounded once to To (gradient accumulation).
  template <class To, class From>
  static void accumulate(std::span<To> dst, std::span<const From> src) {
    elementwise(device::detail::accumulate_kernel<To, From>, dst, src, "accumulate");
  }
  template <class To, class From>
  static void convert(std::span<To> dst, std::span<const From> src) {
    elementwise(device::detail::convert_kernel<To, From>, dst, src, "convert");
  }
  // From pageable host memory: the call returns once the source was read (CUDA stages it).
  template <class T>
  static void from_host(std::span<T> dst, std::span<const T> src) {
    copy_async(dst, src, cudaMemcpyHostToDevice, "from_host");
  }
  // Waits for the current stream: the one synchronisation (device::synchronize, counted).
  template <class T>
  static void to_host(std::span<T> dst, std::span<const T> src) {
    device::synchronize(copy_async(dst, src, cudaMemcpyDeviceToHost, "to_host"));
  }
  template <class G>
  static void grad_stats(std::span<const G> g, double* stats, const optim::cpu::Options&) {
    optim::cuda::grad_stats(g, stats, device::detail::compute_stream());
  }
  template <class Opt, class T, class G>
  static void step(const Opt& opt, const optim::StepScalars& s, const optim::ShardView<T, G>& shard,
                   const optim::cpu::Options&, const double* gate) {
    optim::cuda::step(opt, s, shard, {.gate = gate}, device::detail::compute_stream());
  }
  template <class F, class X>
  static void invoke(const F& f, X* p) {
    device::detail::invoke_kernel<<<1, 1, 0, device::detail::compute_stream()>>>(f, p);
    device::check(cudaGetLastError(), "invoke launch");
  }

 private:
  // Enqueues the copy on the current stream (after the delay hook) and returns that stream.
  template <class T>
  static cudaStream_t copy_async(std::span<T> dst, std::span<const T> src, cudaMemcpyKind kind, const char* what) {
    ZP_EXPECT(dst.size() == src.size(), what, ": ", src.size(), " elements into ", dst.size());
    const cudaStream_t s = device::detail::compute_stream();
    if (!src.empty()) device::check(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), kind, s), what);
    return s;
  }
  template <class To, class From>
  static void elementwise(void (*kernel)(To*, const From*, std::size_t), std::span<To> dst, std::span<const From> src,
                          const char* what) {
    ZP_EXPECT(dst.size() == src.size(), what, ": ", src.size(), " elements into ", dst.size());
    if (dst.empty()) return;
    kernel<<<device::detail::blocks_for(dst.size()), device::detail::block, 0, device::detail::compute_stream()>>>(
        dst.data(), src.data(), dst.size());
    device::check(cudaGetLastError(), what);
  }
};

// ZeRO-Offload on a device (memory.hpp): segment s+1's gradient is copied down to a pinned
// buffer while the CPU steps segment s, whose new T values go up from another pinned buffer,
// all in the compute stream's order; two buffers of each kind, reused once their copies are done.
template <>
class OffloadStaging<MemorySpace::device> {
 public:
  OffloadStaging() = default;
  OffloadStaging(const OffloadStaging&) = delete;
  OffloadStaging& operator=(const OffloadStaging&) = delete;
  ~OffloadStaging() {
    for (int k = 0; k < 2; ++k) {
      if (up_[k]) cudaEventSynchronize(up_[k]->get());  // the last copies read the pinned memory
      cudaFreeHost(grad_[k]);
      cudaFreeHost(param_[k]);
    }
  }

  template <class ViewOf, class Step>
  void run(int segments, ViewOf&& view_of, Step&& step) {
    using V = std::decay_t<decltype(view_of(0))>;
    using G = std::remove_const_t<typename decltype(V::grad)::element_type>;
    using T = typename decltype(V::param)::element_type;
    std::size_t most = 0;
    for (int s = 0; s < segments; ++s) most = std::max(most, view_of(s).grad.size());
    reserve(most * sizeof(G), most * sizeof(T));
    const cudaStream_t st = device::current_stream();
    auto fetch = [&](int s) {
      const auto v = view_of(s);
      if (!v.grad.empty())
        device::check(cudaMemcpyAsync(grad_[s % 2], v.grad.data(), v.grad.size_bytes(), cudaMemcpyDeviceToHost, st),
                      "cudaMemcpyAsync (gradient shard to host)");
      device::check(cudaEventRecord(down_[s % 2]->get(), st), "cudaEventRecord");
    };
    if (segments > 0) fetch(0);
    for (int s = 0; s < segments; ++s) {
      const int k = s % 2;
      if (s + 1 < segments) fetch(s + 1);  // the host is done with that buffer (segment s - 1)
      device::synchronize(down_[k]->get());
      if (up_[k]) device::synchronize(up_[k]->get());  // segment s - 2's values have left param_[k]
      V v = view_of(s);
      const std::span<T> device_param = v.param;
      v.grad = std::span<const G>(static_cast<const G*>(grad_[k]), v.grad.size());
      v.param = std::span<T>(static_cast<T*>(param_[k]), device_param.size());
      step(v);
      if (!device_param.empty())
        device::check(cudaMemcpyAsync(device_param.data(), param_[k], device_param.size_bytes(), cudaMemcpyHostToDevice, st),
                      "cudaMemcpyAsync (parameter shard to device)");
      if (!up_[k]) up_[k].emplace();
      device::check(cudaEventRecord(up_[k]->get(), st), "cudaEventRecord");
    }
  }

 private:
  void reserve(std::size_t grad_bytes, std::size_t param_bytes) {
    auto grow = [](void* (&b)[2], std::size_t& have, std::size_t want, const char* what) {
      if (want <= have) return;
      for (auto& p : b) {
        cudaFreeHost(p);
        p = nullptr;
        device::check(cudaMallocHost(&p, want), what);
      }
      have = want;
    };
    for (auto& e : down_)
      if (!e) e.emplace();
    if (grad_bytes <= grad_bytes_ && param_bytes <= param_bytes_) return;
    for (auto& e : up_)  // the buffers may still be read by copies of the previous step
      if (e) cudaEventSynchronize(e->get());
    grow(grad_, grad_bytes_, grad_bytes, "cudaMallocHost (offload gradient staging)");
    grow(param_, param_bytes_, param_bytes, "cudaMallocHost (offload parameter staging)");
  }

  void* grad_[2] = {nullptr, nullptr};
  void* param_[2] = {nullptr, nullptr};
  std::size_t grad_bytes_ = 0, param_bytes_ = 0;
  std::optional<device::Event> down_[2];  // a gradient shard arrived in grad_[k]
  std::optional<device::Event> up_[2];    // the T values in param_[k] went up
};

}  // namespace zp
