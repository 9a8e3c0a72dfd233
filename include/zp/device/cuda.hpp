// zp/device/cuda.hpp: the device primitives (zp/device/runtime.hpp) on the CUDA runtime. Plain
// C++ against <cuda_runtime_api.h> for streams, events, memory and copies (the nccl backend
// needs no nvcc); launch() and sum() need nvcc: one grid-stride kernel template for every
// element function, and a CUB block reduction. Build without --use_fast_math: the element math
// must round as the host's does.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <thread>

#include "zp/error.hpp"

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>
#endif

namespace zp::device {

using stream_t = cudaStream_t;
using event_t = cudaEvent_t;

// Throws Errc::cuda naming the call and the runtime's error.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) [[unlikely]]
    throw Error(
        Errc::cuda,
        zp::detail::cat(what, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)),
        int(e));
}

namespace cuda_detail {
// true: done; false: not ready; throws on an error.
inline bool done(cudaError_t q, const char* what) {
  if (q == cudaErrorNotReady) return false;
  check(q, what);
  return true;
}
}  // namespace cuda_detail

// A site's ordering is never dropped on a real device (sim.hpp: the mutation test mode).
inline constexpr bool dropped(const char* /*site*/) { return false; }

inline stream_t create_stream() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}
inline void destroy_stream(stream_t s) noexcept {
  if (const cudaError_t e = cudaStreamDestroy(s); e != cudaSuccess)
    zp::detail::log_dropped("cudaStreamDestroy", cudaGetErrorString(e));
}
inline bool stream_done(stream_t s) {
  return cuda_detail::done(cudaStreamQuery(s), "cudaStreamQuery");
}

inline event_t create_event() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return e;
}
inline void destroy_event(event_t e) noexcept {  // after the waits on it
  if (const cudaError_t r = cudaEventDestroy(e); r != cudaSuccess)
    zp::detail::log_dropped("cudaEventDestroy", cudaGetErrorString(r));
}
inline void record(event_t e, stream_t s, const char* /*site*/) {
  check(cudaEventRecord(e, s), "cudaEventRecord");
}
inline void wait(stream_t s, event_t e, const char* /*site*/) {
  check(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent");
}
inline bool event_done(event_t e) { return cuda_detail::done(cudaEventQuery(e), "cudaEventQuery"); }

// From the device's memory pool: after the first steps the pool holds the working set, so a
// step allocates nothing from the driver.
inline void* allocate(std::size_t bytes, stream_t s) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, bytes, s);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it: the caller reports out_of_memory with the size
    throw std::bad_alloc();
  }
  check(e, "cudaMallocAsync");
  return p;
}
inline void deallocate(void* p, stream_t s, const char* /*site*/) noexcept {
  if (p) (void)cudaFreeAsync(p, s);
}
inline void* allocate_pinned(std::size_t bytes) {
  void* p = nullptr;
  if (bytes) check(cudaMallocHost(&p, bytes), "cudaMallocHost");
  return p;
}
inline void deallocate_pinned(void* p) noexcept {
  if (p) (void)cudaFreeHost(p);
}

inline void copy(void* dst, const void* src, std::size_t bytes, stream_t s) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
}
inline void zero(void* p, std::size_t bytes, stream_t s) {
  if (bytes) check(cudaMemsetAsync(p, 0, bytes, s), "cudaMemsetAsync");
}

// The simulator's check that a collective's buffer is device memory. On a GPU nccl checks its
// own, and cuda_threads' kernels reach page-locked memory too, so there is nothing to check.
inline void expect_device_memory(const void*, const char*) {}

// Test mode: a host function that sleeps holds the stream back.
inline void delay(stream_t s, std::chrono::microseconds us) {
  auto sleep = [](void* n) {
    std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<std::uintptr_t>(n)));
  };
  check(cudaLaunchHostFunc(s, sleep, reinterpret_cast<void*>(std::uintptr_t(us.count()))),
        "cudaLaunchHostFunc");
}

inline void set_device(int d) { check(cudaSetDevice(d), "cudaSetDevice"); }
inline int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
namespace cuda_detail {
// A byte count of the current device's default pool (cudaMemPoolAttr*MemCurrent).
inline std::uint64_t pool_bytes(cudaMemPoolAttr a) {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  cudaMemPool_t pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&pool, d), "cudaDeviceGetDefaultMemPool");
  std::uint64_t bytes = 0;
  check(cudaMemPoolGetAttribute(pool, a, &bytes), "cudaMemPoolGetAttribute");
  return bytes;
}
}  // namespace cuda_detail
// Bytes the current device's default pool has handed out and not taken back.
inline std::int64_t memory_in_use() {
  return std::int64_t(cuda_detail::pool_bytes(cudaMemPoolAttrUsedMemCurrent));
}
// What the current device can still allocate: its free memory (cudaMemGetInfo: under MIG, the
// instance's) and what its default pool keeps unused.
inline std::int64_t memory_free() {
  std::size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  const std::uint64_t reserved = cuda_detail::pool_bytes(cudaMemPoolAttrReservedMemCurrent),
                      used = cuda_detail::pool_bytes(cudaMemPoolAttrUsedMemCurrent);
  return std::int64_t(free + (reserved - std::min(reserved, used)));
}
// The current device's name and UUID: unique to it (a MIG instance has its own UUID), and the
// same in every process that sees it, whatever its index there (CUDA_VISIBLE_DEVICES orders).
inline std::string device_name() {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, d), "cudaGetDeviceProperties");
  std::string uuid;
  for (int i = 0; i < 16; ++i) {
    static constexpr char hex[] = "0123456789abcdef";
    const auto b = static_cast<unsigned char>(p.uuid.bytes[i]);
    uuid += hex[b >> 4];
    uuid += hex[b & 15];
    if (i == 3 || i == 5 || i == 7 || i == 9) uuid += '-';
  }
  return detail::cat(p.name, " GPU-", uuid);
}

#if defined(__CUDACC__)
namespace cuda_detail {
inline constexpr int block = 256;

// Blocks that fill the device in one wave: as many as are resident on every SM at once, by the
// kernel's registers and shared memory (the grid-stride loop covers the rest). A fixed 8 a SM
// ran AdamW (5 resident) in 1.6 waves, at 0.88 of a device copy on an H200; one wave: 0.92.
template <auto kernel>
int grid_for(std::size_t n) {
  static const int per_sm = [] {  // one GPU model per process
    int b = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, block, 0),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return b < 1 ? 1 : b;
  }();
  int d = 0, sms = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d), "cudaDeviceGetAttribute");
  const std::size_t want = (n + block - 1) / block, most = std::size_t(sms) * std::size_t(per_sm);
  return int(want < 1 ? 1 : want < most ? want : most);
}

template <class F>
__global__ void __launch_bounds__(block) for_each_kernel(F f, std::size_t n) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

// Block b's sum of f(i) into partial[b].
template <class F>
__global__ void __launch_bounds__(block) sum_kernel(F f, std::size_t n, double* partial) {
  using Reduce = cub::BlockReduce<double, block>;
  __shared__ typename Reduce::TempStorage tmp;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  double part = 0;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    part += double(f(i));
  const double total = Reduce(tmp).Sum(part);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}
// One block: *acc += the sum of partial[0, count). A template: a header's kernel, defined in
// every translation unit that includes it.
template <int Block = block>
__global__ void __launch_bounds__(Block)
    add_partials(const double* partial, int count, double* acc) {
  using Reduce = cub::BlockReduce<double, Block>;
  __shared__ typename Reduce::TempStorage tmp;
  double part = 0;
  for (int i = int(threadIdx.x); i < count; i += Block) part += partial[i];
  const double total = Reduce(tmp).Sum(part);
  if (threadIdx.x == 0) *acc += total;
}
}  // namespace cuda_detail

template <class F>
void launch(stream_t s, std::size_t n, const F& f) {
  if (n == 0) return;
  cuda_detail::for_each_kernel<F>
      <<<cuda_detail::grid_for<cuda_detail::for_each_kernel<F>>(n), cuda_detail::block, 0, s>>>(f,
                                                                                                n);
  check(cudaGetLastError(), "kernel launch");
}

// In a fixed order on a given GPU (blocks' partial sums, then one block adds those), so a run
// repeats bit for bit; atomically added partials would vary in their last bits.
template <class F>
void sum(stream_t s, std::size_t n, const F& f, double* acc) {
  if (n == 0) return;
  const int grid = cuda_detail::grid_for<cuda_detail::sum_kernel<F>>(n);
  auto* partial = static_cast<double*>(allocate(std::size_t(grid) * sizeof(double), s));
  cuda_detail::sum_kernel<F><<<grid, cuda_detail::block, 0, s>>>(f, n, partial);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) {
    cuda_detail::add_partials<><<<1, cuda_detail::block, 0, s>>>(partial, grid, acc);
    e = cudaGetLastError();
  }
  deallocate(partial, s, "sum.partials");  // stream-ordered: after the kernels
  check(e, "reduction launch");
}
#endif

}  // namespace zp::device
