// zp/memory.hpp: where zp's buffers live and every operation the engine runs on them outside
// collectives: zero, copy, accumulate, convert, the gradient statistics, the fused optimizer
// step, and the transfers to and from host memory.
//
// Both are selected by a MemorySpace, which is a property of the backend (Backend::memory): the
// threads and mpi backends use MemorySpace::host (here); device backends get the device
// specialisations from zp/device.cuh (kernels on the calling rank's stream), so engine.hpp has
// one code path for both. Nothing here initialises memory implicitly: a new Buffer's contents
// are unspecified until written, as with cudaMalloc.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

#include "zp/collective.hpp"
#include "zp/error.hpp"
#include "zp/optim/cpu.hpp"
#include "zp/optim/optimizer.hpp"

namespace zp {

template <MemorySpace S>
struct Allocator;

// Host memory, 64-byte aligned (a cache line; also the widest SIMD load).
template <>
struct Allocator<MemorySpace::host> {
  static constexpr std::size_t alignment = 64;
  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    return ::operator new(bytes, std::align_val_t(alignment));
  }
  static void deallocate(void* p) noexcept {
    if (p) ::operator delete(p, std::align_val_t(alignment));
  }
};

// An owning, move-only array of trivially copyable elements in memory space S.
template <class T, MemorySpace S = MemorySpace::host>
class Buffer {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  Buffer() = default;
  // Throws Errc::invalid_argument when n * sizeof(T) overflows and Errc::out_of_memory, naming
  // the size and `what`, when the allocation fails.
  explicit Buffer(std::size_t n, const char* what = "buffer") : size_(n) {
    const std::size_t bytes = detail::checked_mul(n, sizeof(T), what, ": ", n, " elements of ", sizeof(T), " bytes");
    try {
      data_ = static_cast<T*>(Allocator<S>::allocate(bytes));
    } catch (const std::bad_alloc&) {
      throw Error(Errc::out_of_memory, detail::cat(what, ": cannot allocate ", n, " elements (", bytes,
                                                   " bytes) in ", S == MemorySpace::host ? "host" : "device",
                                                   " memory"));
    }
  }
  Buffer(Buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      Allocator<S>::deallocate(data_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~Buffer() { Allocator<S>::deallocate(data_); }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  std::span<T> span() const noexcept { return {data_, size_}; }
  std::span<T> span(std::size_t offset, std::size_t n) const noexcept { return {data_ + offset, n}; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// Element-wise operations on buffers of one memory space.
template <MemorySpace S>
struct Ops;

template <>
struct Ops<MemorySpace::host> {
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
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = To(float(dst[i]) + float(src[i]));
  }
  // dst[i] = To(src[i]), rounding to nearest even.
  template <class To, class From>
  static void convert(std::span<To> dst, std::span<const From> src) {
    ZP_EXPECT(dst.size() == src.size(), "convert: ", src.size(), " elements into ", dst.size());
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = To(float(src[i]));
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
  // stats[0] += the squared L2 norm of g (as stored), stats[1] += 1 if any value is inf or nan;
  // stats: 2 doubles in this space.
  template <class G>
  static void grad_stats(std::span<const G> g, double* stats, const optim::cpu::Options& o) {
    const optim::GradStats st = optim::cpu::grad_stats(g, o);
    stats[0] += st.sumsq;
    if (!st.finite) stats[1] += 1;
  }
  // One optimizer step over a shard (optim/cpu.hpp; the caller checked for overflow).
  template <class Opt, class T, class G>
  static void step(const Opt& opt, const optim::StepScalars& s, const optim::ShardView<T, G>& shard,
                   const optim::cpu::Options& o) {
    optim::cpu::step(opt, s, shard, o);
  }
};

}  // namespace zp
