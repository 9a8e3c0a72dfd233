// zp/device.cuh: zp's buffers and operations in GPU memory (nvcc only): Allocator and Ops for
// MemorySpace::device, the specialisations memory.hpp names, so engine.hpp runs unchanged on a
// device backend (nccl) with this header included.
//
// Streams: every allocation, free and operation is enqueued on the calling thread's current
// stream (device::current_stream(); a StreamScope sets it, e.g. to the nccl backend's stream
// for the rank this thread drives). Nothing waits for the GPU except Ops::to_host, the engine's
// one synchronisation per optimizer step; device::sync_count() counts them per thread, so a test
// can hold the engine (each rank) to that.
//
//   zp::Collective<zp::backend::Nccl> comm(...);
//   zp::device::StreamScope on(comm.backend().stream());   // the model's kernels run there too
//   zp::Engine<zp::backend::Nccl, zp::bf16, 3> engine(comm, model, config);
#pragma once

#if !defined(__CUDACC__)
#error "zp/device.cuh needs nvcc; host-only code uses zp/memory.hpp's host specialisations"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <utility>

#include "zp/error.hpp"
#include "zp/memory.hpp"
#include "zp/optim/cuda.cuh"

namespace zp::device {

namespace detail {
inline cudaStream_t& current() {
  thread_local cudaStream_t s = nullptr;  // the legacy default stream until a scope sets one
  return s;
}
inline std::uint64_t& syncs() {
  thread_local std::uint64_t n = 0;  // per thread: a rank's own (cuda_threads runs one per thread)
  return n;
}
inline void check(cudaError_t e, const char* what) { optim::cuda::detail::check(e, what); }

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
}  // namespace detail

// The stream this thread's zp operations go to.
inline cudaStream_t current_stream() noexcept { return detail::current(); }

// Makes `s` this thread's current stream for the scope.
class StreamScope {
 public:
  explicit StreamScope(cudaStream_t s) noexcept : prev_(std::exchange(detail::current(), s)) {}
  ~StreamScope() { detail::current() = prev_; }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  cudaStream_t prev_;
};

// Host waits for the GPU by zp so far (Ops::to_host) on this thread.
inline std::uint64_t sync_count() noexcept { return detail::syncs(); }

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
    device::detail::check(e, "cudaMallocAsync");
    return p;
  }
  // Ordered after everything enqueued on the current stream, which must be the stream that
  // used the memory last (the engine's, as StreamScope sets it).
  static void deallocate(void* p) noexcept {
    if (p) (void)cudaFreeAsync(p, device::current_stream());
  }
};

template <>
struct Ops<MemorySpace::device> {
  template <class T>
  static void zero(std::span<T> x) {
    if (!x.empty()) device::detail::check(cudaMemsetAsync(x.data(), 0, x.size_bytes(), device::current_stream()), "cudaMemsetAsync");
  }
  template <class T>
  static void copy(std::span<T> dst, std::span<const T> src) {
    ZP_EXPECT(dst.size() == src.size(), "copy: ", src.size(), " elements into ", dst.size());
    if (!src.empty())
      device::detail::check(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyDeviceToDevice,
                                            device::current_stream()),
                            "cudaMemcpyAsync (device to device)");
  }
  template <class To, class From>
  static void accumulate(std::span<To> dst, std::span<const From> src) {
    ZP_EXPECT(dst.size() == src.size(), "accumulate: ", src.size(), " elements into ", dst.size());
    if (dst.empty()) return;
    device::detail::accumulate_kernel<To, From><<<device::detail::blocks_for(dst.size()), device::detail::block, 0,
                                                  device::current_stream()>>>(dst.data(), src.data(), dst.size());
    device::detail::check(cudaGetLastError(), "accumulate launch");
  }
  template <class To, class From>
  static void convert(std::span<To> dst, std::span<const From> src) {
    ZP_EXPECT(dst.size() == src.size(), "convert: ", src.size(), " elements into ", dst.size());
    if (dst.empty()) return;
    device::detail::convert_kernel<To, From><<<device::detail::blocks_for(dst.size()), device::detail::block, 0,
                                               device::current_stream()>>>(dst.data(), src.data(), dst.size());
    device::detail::check(cudaGetLastError(), "convert launch");
  }
  // From pageable host memory: the call returns once the source was read (CUDA stages it).
  template <class T>
  static void from_host(std::span<T> dst, std::span<const T> src) {
    ZP_EXPECT(dst.size() == src.size(), "from_host: ", src.size(), " elements into ", dst.size());
    if (!src.empty())
      device::detail::check(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyHostToDevice,
                                            device::current_stream()),
                            "cudaMemcpyAsync (host to device)");
  }
  // Waits for the current stream: the one synchronisation (counted).
  template <class T>
  static void to_host(std::span<T> dst, std::span<const T> src) {
    ZP_EXPECT(dst.size() == src.size(), "to_host: ", src.size(), " elements into ", dst.size());
    const cudaStream_t s = device::current_stream();
    if (!src.empty())
      device::detail::check(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyDeviceToHost, s),
                            "cudaMemcpyAsync (device to host)");
    device::detail::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    ++device::detail::syncs();
  }
  template <class G>
  static void grad_stats(std::span<const G> g, double* stats, const optim::cpu::Options&) {
    optim::cuda::grad_stats(g, stats, device::current_stream());
  }
  template <class Opt, class T, class G>
  static void step(const Opt& opt, const optim::StepScalars& s, const optim::ShardView<T, G>& shard,
                   const optim::cpu::Options&) {
    optim::cuda::step(opt, s, shard, {}, device::current_stream());
  }
};

}  // namespace zp
