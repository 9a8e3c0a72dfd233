// zp/stream.hpp: the CUDA stream context shared by zp's device code: the nccl backend (a plain
// C++ header) and the nvcc-only device memory space and cuda_threads backend. Needs the CUDA
// runtime API headers only.
//
// Two roles of stream per rank. The compute stream is the calling thread's current stream
// (current_stream(); StreamScope sets it): the model's kernels and every zp operation on
// buffers (Ops<device>) run there. Each communicator has its own communication stream. An
// operation records an event on the compute stream that its communication stream waits on (its
// inputs are complete), and its Work::wait() makes the compute stream wait for its completion
// event: communication overlaps computation, and no host thread waits for either.
//
// The host waits for the GPU in one place, synchronize() (Ops<device>::to_host: the engine's one
// synchronisation per optimizer step; ZeRO-Offload's copies), counted per thread (sync_count()). It polls the
// communicators this thread used (watch()), so an asynchronous error or a hung peer becomes an
// error there, within the communicator's timeout, instead of a wait that never ends.
//
// Test mode: set_delay_hook() runs a hook (zp/device.cuh: a spin kernel) before every enqueue
// on a stream of either role, so a test can prove that results do not depend on timing.
#pragma once

#if !defined(__has_include) || !__has_include(<cuda_runtime_api.h>)
#error "zp/stream.hpp needs the CUDA runtime headers (<cuda_runtime_api.h>): install the CUDA toolkit and link zp::cuda or zp::nccl"
#endif

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "zp/error.hpp"

namespace zp::device {

enum class Role : std::uint8_t { compute, comm };

// Throws Errc::cuda naming the call and the runtime's error.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) [[unlikely]]
    throw Error(Errc::cuda, zp::detail::cat(what, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)), int(e));
}

// A communicator whose failures surface in a host synchronisation.
class Watched {
 public:
  virtual ~Watched() = default;
  // Throws (after aborting the communicator, so its GPU work ends too) on an asynchronous error,
  // or once the host has waited `waited` longer than the communicator's timeout.
  virtual void poll(std::chrono::steady_clock::duration waited) = 0;
};

using DelayHook = void (*)(cudaStream_t, Role);

namespace detail {
inline cudaStream_t& current() {
  thread_local cudaStream_t s = nullptr;  // the legacy default stream until a scope sets one
  return s;
}
inline std::uint64_t& syncs() {
  thread_local std::uint64_t n = 0;  // per thread: a rank's own (cuda_threads runs one per thread)
  return n;
}
inline std::vector<std::weak_ptr<Watched>>& watched() {
  thread_local std::vector<std::weak_ptr<Watched>> w;
  return w;
}
inline std::atomic<DelayHook>& delay_hook() {
  static std::atomic<DelayHook> h{nullptr};
  return h;
}
}  // namespace detail

// The stream this thread's zp operations (and its model's kernels) go to.
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

// An owned non-blocking stream on the current device; destroying it waits for its work.
class Stream {
 public:
  Stream() { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~Stream() {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// An owned event without timing (the cheap kind, for ordering).
class Event {
 public:
  Event() { check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreateWithFlags"); }
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      if (e_) cudaEventDestroy(e_);
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  ~Event() {
    if (e_) cudaEventDestroy(e_);  // released by CUDA once the waits enqueued on it are done
  }
  cudaEvent_t get() const noexcept { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Makes `waiter` wait (on the device) for everything enqueued on `s` so far, through `e`.
inline void order(cudaStream_t waiter, cudaStream_t s, cudaEvent_t e) {
  if (waiter == s) return;
  check(cudaEventRecord(e, s), "cudaEventRecord");
  check(cudaStreamWaitEvent(waiter, e, 0), "cudaStreamWaitEvent");
}

// Host waits for the GPU by zp so far (synchronize()) on this thread.
inline std::uint64_t sync_count() noexcept { return detail::syncs(); }

// Has this thread's host synchronisations poll `w` until it is gone.
inline void watch(const std::shared_ptr<Watched>& w) {
  auto& v = detail::watched();
  for (const auto& x : v)
    if (!x.owner_before(w) && !w.owner_before(x)) return;
  std::erase_if(v, [](const std::weak_ptr<Watched>& x) { return x.expired(); });
  v.push_back(w);
}

namespace detail {
// The host waits until query() is cudaSuccess, polling the watched communicators; counted.
template <class Query>
void host_wait(Query&& query, const char* what) {
  ++syncs();
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    const cudaError_t q = query();
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check(q, what);
    const auto waited = std::chrono::steady_clock::now() - start;
    for (const auto& x : watched())  // poll() registers nothing, so the list stays put
      if (auto w = x.lock()) w->poll(waited);
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    else std::this_thread::yield();
  }
}
}  // namespace detail

// Waits on the host until everything enqueued on `s` has run: the one synchronisation (see the
// top of this file), polling the watched communicators meanwhile.
inline void synchronize(cudaStream_t s) {
  detail::host_wait([s] { return cudaStreamQuery(s); }, "cudaStreamQuery");
}
// The same for the work before a recorded event (ZeRO-Offload's per-segment copies).
inline void synchronize(cudaEvent_t e) {
  detail::host_wait([e] { return cudaEventQuery(e); }, "cudaEventQuery");
}

// Test mode: `h` runs before every enqueue on a compute or communication stream (nullptr: off).
inline void set_delay_hook(DelayHook h) noexcept { detail::delay_hook().store(h); }
inline void before_enqueue(cudaStream_t s, Role r) {
  if (const DelayHook h = detail::delay_hook().load(std::memory_order_relaxed)) h(s, r);
}

}  // namespace zp::device
