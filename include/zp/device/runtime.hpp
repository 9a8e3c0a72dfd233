// zp/device/runtime.hpp: the stream-ordered primitives every device operation of zp goes
// through. Two implementations with one interface, chosen per program:
//   zp/device/cuda.hpp  the CUDA runtime (streams, events, cudaMallocAsync, cudaMemcpyAsync);
//                       under nvcc also launch() as one grid-stride kernel, sum() as one more
//                       (CUB block sums) and a one-block kernel adding them in order
//   zp/device/sim.hpp   a simulated device built with any C++ compiler (define ZP_DEVICE_SIM,
//                       or link zp::sim): each stream a worker thread, device memory host memory
//                       from a checked pool, timing perturbed by a seeded adversarial scheduler
//
// The interface (namespace zp::device), CUDA's semantics in both:
//   stream_t create_stream()                  non-blocking stream; destroy_stream(s) after its work
//   bool stream_done(s)                       everything enqueued on s has run
//   event_t create_event(); destroy_event(e)
//   record(e, s, site)                        e completes when s reaches this point
//   wait(s, e, site)                          s runs nothing later before e's last record completed
//                                             (an event never recorded: no wait)
//   bool event_done(e)
//   void* allocate(bytes, s); deallocate(p, s, site)   stream-ordered (cudaMallocAsync); std::bad_alloc
//                                             when device memory is exhausted
//   allocate_pinned(bytes); deallocate_pinned(p)        page-locked host memory
//   copy(dst, src, bytes, s)                  any direction; from pageable host memory the source
//                                             is read before the call returns, into pageable host
//                                             memory the call returns after the copy
//   zero(p, bytes, s)
//   launch(s, n, f)                           f(i) for i in [0, n): f a ZP_HOST_DEVICE functor
//   sum(s, n, f, acc)                         *acc += the sum of f(i) (double), acc device memory
//   Batch<F>, batched(xs, make, run)          many functors' items as one launch or sum (below)
//   delay(s, us)                              test mode: s idles `us` before its next work
//   expect_device_memory(p, what)             the simulator: an error unless p is device memory
//                                             (a collective's buffers); CUDA: no check
//   set_device(d), device_count(), memory_in_use()
//   memory_free(); device_name()              what the current device can still allocate (-1: no
//                                             limit), and a name unique to it
//   check the `site` names (the mutation table, tests/device/mutations.cmake): a simulated
//   device can be told to drop one site's ordering, to prove a test catches its absence.
// The host-side context on top (current stream, RAII streams and events, host waits, the delay
// test mode) is zp/device/stream.hpp; zp's buffers and operations on a device, zp/device/memory.hpp.
//
// One implementation per program: a translation unit built for the simulated device and one built
// for CUDA must not be linked together.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "zp/config.hpp"

#if defined(ZP_DEVICE_SIM)
#include "zp/device/sim.hpp"
#elif ZP_HAS_CUDA_HEADERS
#include "zp/device/cuda.hpp"
#else
#error \
    "zp/device/runtime.hpp: no device: install the CUDA toolkit (link zp::cuda) or use the simulated device (link zp::sim)"
#endif

namespace zp::device {
// N consecutive elements, loaded and stored as one access (16 bytes: one vector load a thread).
template <class X, int N>
struct alignas(sizeof(X) * N) Pack {
  X x[N];
};
inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Quotient and remainder by d of indices below `limit`, in 32-bit arithmetic where both fit: on
// a GPU a 64-bit division is a subroutine of about a hundred instructions, a 32-bit one a few.
struct DivMod {
  std::size_t d;
  bool narrow;
  DivMod(std::size_t divisor, std::size_t limit)
      : d(divisor), narrow(limit <= 0xFFFFFFFFu && divisor <= 0xFFFFFFFFu) {}
  struct Split {
    std::size_t q, r;
  };
  ZP_HOST_DEVICE Split operator()(std::size_t e) const {
    if (narrow) {
      const auto e32 = std::uint32_t(e), d32 = std::uint32_t(d), q = e32 / d32;
      return {q, e32 - q * d32};
    }
    return {e / d, e % d};
  }
};
// Work items of up to N functors as one range, in their order: item k is item k - end[j-1] of
// f[j], j the functor whose range holds k. One launch for many ranges (a shard's segments): a
// GPU launch costs a few microseconds of ramp and tail however few its items. N fills the 4 KB
// that a kernel's parameters may take on any CUDA GPU.
template <class F>
struct Batch {
  static constexpr int N = int(std::min<std::size_t>(64, (4096 - 64) / (sizeof(F) + 8)));
  static_assert(N >= 2, "a batch's functor is too large for a kernel's parameters");
  F f[N];
  std::size_t end[N] = {};
  int count = 0;
  std::size_t items() const { return count == 0 ? 0 : end[count - 1]; }
  ZP_HOST_DEVICE auto operator()(std::size_t k) const {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (k < end[mid])
        hi = mid;
      else
        lo = mid + 1;
    }
    return f[lo](k - (lo == 0 ? 0 : end[lo - 1]));
  }
};

// run(batch) for the Batches of make(x) = {functor, its item count} over xs, in order, N at a
// time; functors of no items are left out.
template <class X, class Make, class Run>
void batched(std::span<const X> xs, Make&& make, Run&& run) {
  using F = std::remove_cvref_t<decltype(make(xs[0]).first)>;
  Batch<F> b;
  for (const X& x : xs) {
    const auto [f, n] = make(x);
    if (n == 0) continue;
    b.f[b.count] = f;
    b.end[b.count] = b.items() + n;
    if (++b.count == Batch<F>::N) {
      run(b);
      b = {};
    }
  }
  if (b.count > 0) run(b);
}
}  // namespace zp::device
