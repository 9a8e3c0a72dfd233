// zp/memory.hpp: where zp's buffers live (Buffer, Allocator) and the operations on them outside
// collectives (Memory<S>: zero, copy, accumulate, convert, the transfers to and from host
// memory), the staging views that read or feed a buffer wherever it lives, and ZeRO-Offload's
// transfers (OffloadStaging). The optimizer's per-space operations are in shard_step.hpp.
//
// Both are selected by a MemorySpace, which is a property of the backend (Backend::memory): the
// threads and mpi backends use MemorySpace::host (here); device backends get the device
// specialisations from zp/device/memory.hpp (kernels on the calling rank's stream), so engine.hpp has
// one code path for both. Nothing here initialises memory implicitly: a new Buffer's contents
// are unspecified until written, as with cudaMalloc.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "zp/collective.hpp"
#include "zp/config.hpp"
#include "zp/detail/host_arena.hpp"
#include "zp/error.hpp"

namespace zp {

template <MemorySpace S>
struct Allocator;

// The host memory a backend of memory space S offloads to: plain host memory for the host
// backends, page-locked beside a device (Allocator<pinned>: zp/device/memory.hpp), which the
// device's copies move asynchronously and its kernels read and write in place.
template <MemorySpace S>
inline constexpr MemorySpace offload_space =
    S == MemorySpace::host ? MemorySpace::host : MemorySpace::pinned;

// Host memory, 64-byte aligned (a cache line; also the widest SIMD load), from the installed
// HostArena where it takes the request. From `mapped` bytes on, pages mapped for the buffer
// alone, as glibc maps them until a free raises its threshold (to 32 MiB at most): past that,
// buffers freed and allocated again (stage 3's gathers) stayed resident in its per-thread
// heaps, and a thread-rank run's resident memory grew step after step. ASan's builds keep its
// allocator, which checks these buffers' bounds.
template <>
struct Allocator<MemorySpace::host> {
  static constexpr std::size_t alignment = 64;
  static constexpr std::size_t mapped = ZP_ASAN ? SIZE_MAX : std::size_t(1) << 20;
  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (auto* a = detail::host_arena().load(std::memory_order_acquire))
      if (void* p = a->allocate(bytes)) return p;
    if (bytes < mapped) return ::operator new(bytes, std::align_val_t(alignment));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }
  // p from allocate(bytes).
  static void deallocate(void* p, std::size_t bytes) noexcept {
    if (!p) return;
    if (auto* a = detail::host_arena().load(std::memory_order_acquire))
      if (a->deallocate(p)) return;
    if (bytes < mapped)
      ::operator delete(p, std::align_val_t(alignment));
    else
      ::munmap(p, bytes);
  }
};

// Allocator<host> for standard containers: a user's own buffers allocated with it are what
// zp's buffers are, e.g. readable in place by the mpi backend's node peers
// (std::vector<float, zp::HostAllocator<float>>).
template <class T>
struct HostAllocator {
  static_assert(alignof(T) <= Allocator<MemorySpace::host>::alignment);
  using value_type = T;
  HostAllocator() = default;
  template <class U>
  HostAllocator(const HostAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(Allocator<MemorySpace::host>::allocate(detail::checked_mul(
        n, sizeof(T), "HostAllocator: ", n, " elements of ", sizeof(T), " bytes")));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    Allocator<MemorySpace::host>::deallocate(p, n * sizeof(T));
  }
  template <class U>
  bool operator==(const HostAllocator<U>&) const noexcept {
    return true;
  }
};

// What a device can still allocate, as its runtime reports it (Allocator<device>::room(), for
// the engine's check before it allocates): bytes (-1: no limit) and a name unique to the device.
struct DeviceRoom {
  std::int64_t bytes = -1;
  std::string device;
};

// Bytes of live Buffers in one memory space, counted per thread (each rank runs on its own
// thread, so this is a rank's allocation as its allocator served it): what the ZeRO formulas
// predict, measured. A Buffer freed on another thread than the one that allocated it moves
// bytes between the two threads' counts.
struct MemoryUse {
  std::int64_t current = 0;
  std::int64_t peak = 0;  // the most `current` reached since the thread began or reset_peak()
};

namespace detail {
template <MemorySpace S>
MemoryUse& memory_use() noexcept {
  thread_local MemoryUse u;
  return u;
}
}  // namespace detail

template <MemorySpace S>
MemoryUse memory_use() noexcept {
  return detail::memory_use<S>();
}
template <MemorySpace S>
void reset_peak_memory() noexcept {
  detail::memory_use<S>().peak = detail::memory_use<S>().current;
}

// An owning, move-only array of trivially copyable elements in memory space S.
template <class T, MemorySpace S = MemorySpace::host>
class Buffer {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  Buffer() = default;
  // Throws Errc::invalid_argument when n * sizeof(T) overflows and Errc::out_of_memory, naming
  // the size and `what`, when the allocation fails.
  explicit Buffer(std::size_t n, const char* what = "buffer") : size_(n) {
    const std::size_t bytes =
        detail::checked_mul(n, sizeof(T), what, ": ", n, " elements of ", sizeof(T), " bytes");
    try {
      data_ = static_cast<T*>(Allocator<S>::allocate(bytes));
      MemoryUse& u = detail::memory_use<S>();
      u.peak = std::max(u.peak, u.current += std::int64_t(bytes));
    } catch (const std::bad_alloc&) {
      throw Error(Errc::out_of_memory,
                  detail::cat(what, ": cannot allocate ", n, " elements (", bytes, " bytes) in ",
                              S == MemorySpace::host     ? "host"
                              : S == MemorySpace::device ? "device"
                                                         : "pinned host",
                              " memory"));
    }
  }
  Buffer(Buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~Buffer() { release(); }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  std::span<T> span() const noexcept { return {data_, size_}; }
  std::span<T> span(std::size_t offset, std::size_t n) const noexcept {
    return {data_ + offset, n};
  }

 private:
  void release() noexcept {
    if (!data_) return;
    Allocator<S>::deallocate(data_, bytes());
    detail::memory_use<S>().current -= std::int64_t(bytes());
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

namespace detail {
// The element math of Memory::accumulate and Memory::convert, written once for host loops and
// device launches (zp/device/memory.hpp).
template <class To, class From>
struct Accumulate {  // dst += src in float, rounded once to To
  To* dst;
  const From* src;
  ZP_HOST_DEVICE void operator()(std::size_t i) const {
    dst[i] = To(float(dst[i]) + float(src[i]));
  }
};
template <class To, class From>
struct Convert {  // to nearest even
  To* dst;
  const From* src;
  ZP_HOST_DEVICE void operator()(std::size_t i) const { dst[i] = To(float(src[i])); }
};
}  // namespace detail

// Memory<S>: the operations on buffers of one memory space that are not collectives: zero, copy,
// accumulate, convert, the transfers to and from host memory, and a function run where a
// pointer's memory is (the optimizer's per-space operations: shard_step.hpp).
template <MemorySpace S>
struct Memory;

template <>
struct Memory<MemorySpace::host> {
  template <class T>
  static void zero(std::span<T> x) {
    if (!x.empty()) std::memset(static_cast<void*>(x.data()), 0, x.size_bytes());
  }
  template <class T>
  static void copy(std::span<T> dst, std::span<const T> src) {
    ZP_EXPECT(dst.size() == src.size(), "copy: ", src.size(), " elements into ", dst.size());
    if (!src.empty()) std::memmove(static_cast<void*>(dst.data()), src.data(), src.size_bytes());
  }
  // dst += src in float, rounded once to To (gradient accumulation).
  template <class To, class From>
  static void accumulate(std::span<To> dst, std::span<const From> src) {
    ZP_EXPECT(dst.size() == src.size(), "accumulate: ", src.size(), " elements into ", dst.size());
    const detail::Accumulate<To, From> f{dst.data(), src.data()};
    for (std::size_t i = 0; i < dst.size(); ++i) f(i);
  }
  // dst[i] = To(src[i]), rounding to nearest even.
  template <class To, class From>
  static void convert(std::span<To> dst, std::span<const From> src) {
    ZP_EXPECT(dst.size() == src.size(), "convert: ", src.size(), " elements into ", dst.size());
    const detail::Convert<To, From> f{dst.data(), src.data()};
    for (std::size_t i = 0; i < dst.size(); ++i) f(i);
  }
  // Host memory <-> this space (here: copies). to_host is the engine's one synchronisation point
  // per optimizer step on a device.
  template <class T>
  static void from_host(std::span<T> dst, std::span<const T> src) {
    copy(dst, src);
  }
  template <class T>
  static void to_host(std::span<T> dst, std::span<const T> src) {
    copy(dst, src);
  }
  // f(p) once, where p lives (a device runs it as a one-thread kernel, so f's operator() must be
  // ZP_HOST_DEVICE): scalar decisions without a round trip to the host.
  template <class F, class X>
  static void invoke(const F& f, X* p) {
    f(p);
  }
  // f(i) for i in [0, n), where the memory is (a device runs it as a kernel, f ZP_HOST_DEVICE).
  template <class F>
  static void for_each(std::size_t n, const F& f) {
    for (std::size_t i = 0; i < n; ++i) f(i);
  }
};

// Staging between host memory and space S, for code that reads or feeds buffers wherever they
// live (whole-model views, checkpoints). `host`: the span is in host memory whatever S is
// (ZeRO-Offload's master weights and optimizer state).
// src as a host span: itself, or copied into tmp.
template <MemorySpace S, class U>
std::span<const U> host_view(std::span<const U> src, bool host, std::vector<U>& tmp) {
  if (S == MemorySpace::host || host) return src;
  tmp.resize(src.size());
  Memory<S>::to_host(std::span<U>(tmp), src);
  return tmp;
}
// src as a span in S (e.g. a collective's input): itself, or copied into tmp (grown as needed).
template <MemorySpace S, class U>
std::span<const U> space_view(std::span<const U> src, bool host, Buffer<U, S>& tmp) {
  if (S == MemorySpace::host || !host) return src;
  if (tmp.size() < src.size()) tmp = Buffer<U, S>(src.size(), "staging");
  Memory<S>::from_host(tmp.span(0, src.size()), src);
  return tmp.span(0, src.size());
}
// fill(a host span) writes dst: directly, or through a host copy.
template <MemorySpace S, class U, class Fill>
void fill_via_host(std::span<U> dst, bool host, Fill&& fill) {
  if (S == MemorySpace::host || host) return fill(dst);
  std::vector<U> tmp(dst.size());
  fill(std::span<U>(tmp));
  Memory<S>::from_host(dst, std::span<const U>(tmp));
}

// ZeRO-Offload's transfers for one optimizer step: piece by piece (a segment's shard, or a
// part of one), the gradient to host memory, the CPU step there (optim/cpu.hpp) on the
// host-resident master weights and state, and the new T values back. view_of(s) is piece s
// where the engine keeps it (gradient and T values in space S, or the T values in host memory
// where param_host says so; master and state in host memory); step(s, v) runs the CPU step on
// piece s's view whose arrays are all in host memory, pieces in order. Here (S = host) that is
// the view itself;
// zp/device/memory.hpp's specialisation pipelines the copies through pinned double buffers, so segment
// s+1's gradient travels while the CPU updates segment s.
template <MemorySpace S>
class OffloadStaging;

template <>
class OffloadStaging<MemorySpace::host> {
 public:
  template <class ViewOf, class Step>
  void run(int segments, ViewOf&& view_of, Step&& step, bool /*param_host*/ = false) {
    for (int s = 0; s < segments; ++s) step(s, view_of(s));
  }
};

}  // namespace zp
