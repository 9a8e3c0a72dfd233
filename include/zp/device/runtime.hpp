// zp/device/runtime.hpp: the stream-ordered primitives every device operation of zp goes
// through. Two implementations with one interface, chosen per program:
//   zp/device/cuda.hpp  the CUDA runtime (streams, events, cudaMallocAsync, cudaMemcpyAsync);
//                       under nvcc also launch() and sum() as one grid-stride kernel and CUB
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
//   delay(s, us)                              test mode: s idles `us` before its next work
//   set_device(d), device_count(), memory_in_use()
//   check the `site` names (the mutation table, tests/device/mutations.cmake): a simulated
//   device can be told to drop one site's ordering, to prove a test catches its absence.
// The host-side context on top (current stream, RAII streams and events, host waits, the delay
// test mode) is zp/device/stream.hpp; zp's buffers and operations on a device, zp/device/memory.hpp.
//
// One implementation per program: a translation unit built for the simulated device and one built
// for CUDA must not be linked together.
#pragma once

#include <cstdint>

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
}  // namespace zp::device
