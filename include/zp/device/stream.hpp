// zp/device/stream.hpp: the stream context of zp's device code, on the primitives of
// zp/device/runtime.hpp (CUDA or the simulated device).
//
// Two roles of stream per rank. The compute stream is the calling thread's current stream
// (current_stream(); StreamScope sets it): the model's kernels and every zp operation on
// buffers (Memory<device>) run there. Each communicator has its own communication stream. An
// operation records an event on the compute stream that its communication stream waits on (its
// inputs are complete), and its Work::wait() makes the compute stream wait for its completion
// event: communication overlaps computation, and no host thread waits for either.
//
// In training the host waits for the device in one place, synchronize() (Memory<device>::to_host:
// the engine's one synchronisation per optimizer step; ZeRO-Offload's copies), counted per thread
// (sync_count()). It polls the communicators this thread used (watch()), so an asynchronous
// error or a hung peer becomes an error there, within the communicator's timeout, instead of a
// wait that never ends. Outside the steps a Stream's destructor, freeing pinned memory and nccl's
// barrier and split wait too.
//
// Test mode: delay_streams() makes every stream of one role idle before each enqueue there
// (before_enqueue()), so a test can prove that results do not depend on timing; on the simulated
// device its adversarial scheduler (sim::Options) perturbs every stream besides.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "zp/device/runtime.hpp"
#include "zp/error.hpp"

namespace zp::device {

enum class Role : std::uint8_t { compute, comm };

// A communicator whose failures surface in a host synchronisation.
class Watched {
 public:
  virtual ~Watched() = default;
  // Throws (after aborting the communicator, so its device work ends too) on an asynchronous
  // error, or once the host has waited `waited` longer than the communicator's timeout.
  virtual void poll(std::chrono::steady_clock::duration waited) = 0;
};

namespace detail {
inline stream_t& current() {
  thread_local stream_t s = nullptr;  // the legacy default stream until a scope sets one
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
inline std::atomic<std::int64_t>& delay_us(Role r) {
  static std::atomic<std::int64_t> us[2] = {0, 0};
  return us[int(r)];
}
}  // namespace detail

// The stream this thread's zp operations (and its model's kernels) go to.
inline stream_t current_stream() noexcept { return detail::current(); }

// Makes `s` this thread's current stream for the scope.
class StreamScope {
 public:
  explicit StreamScope(stream_t s) noexcept : prev_(std::exchange(detail::current(), s)) {}
  ~StreamScope() { detail::current() = prev_; }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  stream_t prev_;
};

// Host waits for the device by zp so far (synchronize()) on this thread.
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
// The host waits until done() holds, polling the watched communicators.
template <class Done>
void host_wait(Done&& done) {
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 0; !done(); ++spins) {
    const auto waited = std::chrono::steady_clock::now() - start;
    for (const auto& x : watched())  // poll() registers nothing, so the list stays put
      if (auto w = x.lock()) w->poll(waited);
    if (spins > 1000)
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    else
      std::this_thread::yield();
  }
}
}  // namespace detail

// Waits on the host until everything enqueued on `s` has run: the one synchronisation (see the
// top of this file), polling the watched communicators meanwhile. `site` names it (runtime.hpp).
inline void synchronize(stream_t s, const char* site) {
  if (dropped(site)) return;
  ++detail::syncs();
  detail::host_wait([s] { return stream_done(s); });
}
// The same for the work before an event's last record (ZeRO-Offload's per-segment copies).
inline void synchronize(event_t e, const char* site) {
  if (dropped(site)) return;
  ++detail::syncs();
  detail::host_wait([e] { return event_done(e); });
}

// An owned non-blocking stream on the current device; destroying it waits for its work.
class Stream {
 public:
  Stream() : s_(create_stream()) {}
  ~Stream() {
    try {
      while (!stream_done(s_)) std::this_thread::yield();
    } catch (const Error& e) {  // a failed device: nothing left to wait for
      zp::detail::log_dropped("device::Stream's destructor", e.what());
    }
    destroy_stream(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  stream_t get() const noexcept { return s_; }

 private:
  stream_t s_;
};

// An owned event (ordering only, no timing).
class Event {
 public:
  Event() : e_(create_event()) {}
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      if (e_) destroy_event(e_);
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  ~Event() {
    if (e_) destroy_event(e_);  // the waits enqueued on it stay valid
  }
  event_t get() const noexcept { return e_; }

 private:
  event_t e_ = nullptr;
};

// Makes `waiter` wait (on the device) for everything enqueued on `s` so far, through `e`.
inline void order(stream_t waiter, stream_t s, event_t e, const char* site) {
  if (waiter == s) return;
  record(e, s, site);
  wait(waiter, e, site);
}

// Test mode: every stream of role `r` idles `us` before each operation zp enqueues there (0: off).
inline void delay_streams(Role r, std::chrono::microseconds us) {
  detail::delay_us(r).store(us.count());
}
inline void before_enqueue(stream_t s, Role r) {
  if (const std::int64_t us = detail::delay_us(r).load(std::memory_order_relaxed))
    delay(s, std::chrono::microseconds(us));
}

}  // namespace zp::device
