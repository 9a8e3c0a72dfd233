// zp/device/sim.hpp: a simulated device with CUDA's stream semantics (the primitives of
// zp/device/runtime.hpp), built with any C++ compiler, so zp's device code runs and is tested on
// machines without a GPU. What it keeps is what ordering bugs depend on:
//   - each stream is a worker thread running its queue in order; launches, copies, fills and
//     stream-ordered frees run there, never on the caller;
//   - an event completes when its stream reaches the record; a stream waiting on it runs nothing
//     later before that; queries and host waits see exactly what has run;
//   - device memory comes from a pool; a freed block goes back only when its stream reaches the
//     free, is filled with 0xff bytes (NaN in every float type) and poisoned under ASan; new
//     blocks are filled the same way (device memory starts unspecified); a memory limit makes
//     allocations fail as CUDA's do; copies are checked against their blocks;
//   - a seeded adversarial scheduler delays tasks at random (Options), so an ordering that holds
//     only by luck fails;
//   - under TSan, the only happens-before edges it adds are CUDA's (enqueue -> task, record ->
//     wait, completion -> host wait or query, free -> reuse of the block), so every missing wait
//     is a data race TSan reports, between two streams or a stream and the host;
//   - a task that throws is a sticky error, as a faulting kernel is: every later call throws
//     Errc::cuda "simulated device: ..." naming the task and its stream.
// What it cannot show: kernel compilation, speed, the hardware's own memory model, NCCL.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "zp/config.hpp"
#include "zp/error.hpp"

#if ZP_ASAN
#include <sanitizer/asan_interface.h>
#define ZP_SIM_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define ZP_SIM_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define ZP_SIM_POISON(p, n) ((void)(p), (void)(n))
#define ZP_SIM_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#if ZP_TSAN
extern "C" {
void AnnotateIgnoreSyncBegin(const char*, int);
void AnnotateIgnoreSyncEnd(const char*, int);
void AnnotateIgnoreReadsBegin(const char*, int);
void AnnotateIgnoreReadsEnd(const char*, int);
void AnnotateIgnoreWritesBegin(const char*, int);
void AnnotateIgnoreWritesEnd(const char*, int);
void __tsan_acquire(void*);
void __tsan_release(void*);
}
#endif

namespace zp::device {

namespace sim {

struct Options {
  std::uint64_t seed = 1;  // the adversarial scheduler's
  // Each task waits, with probability 1/4, a random time up to this before it runs (0: never).
  std::chrono::microseconds max_delay{0};
  std::size_t memory_limit = 0;  // bytes of device memory (0: unlimited)
  // The ordering site (runtime.hpp's `site` names) whose waits, records and stream-ordered frees
  // are dropped: a mutation, to prove a test catches its absence (empty: none).
  std::string drop;
};

// The defaults, from the environment: ZP_SIM_SEED (1), ZP_SIM_DELAY_US (50, at most 10 s),
// ZP_SIM_MEMORY (bytes, 0: unlimited), ZP_SIM_DROP (a site name).
inline Options options_from_env() {
  auto num = [](const char* name, unsigned long long fallback, unsigned long long most) {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    errno = 0;
    const unsigned long long x = std::strtoull(v, &end, 10);
    // strtoull takes a sign and wraps "-1" to the largest value: digits only.
    ZP_EXPECT(*end == '\0' && errno != ERANGE && x <= most &&
                  std::all_of(v, const_cast<const char*>(end),
                              [](char c) { return c >= '0' && c <= '9'; }),
              "simulated device: ", name, "=", v, " is not an integer in [0, ", most, "]");
    return x;
  };
  constexpr auto any = std::numeric_limits<unsigned long long>::max();
  Options o;
  o.seed = num("ZP_SIM_SEED", 1, any);
  o.max_delay = std::chrono::microseconds(num("ZP_SIM_DELAY_US", 50, 10'000'000));
  o.memory_limit = std::size_t(num("ZP_SIM_MEMORY", 0, std::numeric_limits<std::size_t>::max()));
  if (const char* d = std::getenv("ZP_SIM_DROP")) o.drop = d;
  return o;
}

}  // namespace sim

namespace sim_detail {

// The simulator's own bookkeeping is invisible to TSan (neither its accesses nor its locks make
// edges); the edges CUDA guarantees are stated explicitly with acquire()/release().
class Quiet {
 public:
  Quiet() {
#if ZP_TSAN
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
  }
  ~Quiet() {
#if ZP_TSAN
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
#endif
  }
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;
};
inline void release([[maybe_unused]] const void* edge) {
#if ZP_TSAN
  __tsan_release(const_cast<void*>(edge));
#endif
}
inline void acquire([[maybe_unused]] const void* edge) {
#if ZP_TSAN
  __tsan_acquire(const_cast<void*>(edge));
#endif
}

inline constexpr std::size_t alignment = 256;  // cudaMalloc's
inline constexpr unsigned char garbage = 0xff;

// A point in a stream that an event record or a host wait refers to.
struct Fence {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  void signal() {
    release(this);
    Quiet q;
    std::lock_guard lock(m);
    done = true;
    cv.notify_all();
  }
  void await() {
    {
      Quiet q;
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return done; });
    }
    acquire(this);
  }
  bool reached() {
    bool d;
    {
      Quiet q;
      std::lock_guard lock(m);
      d = done;
    }
    if (d) acquire(this);
    return d;
  }
};

struct Task {
  std::function<void()> body;
  const char* what;
  bool work;  // launches, copies, fills: skipped after a sticky error (ordering tasks still run)
};

class Stream;

// The one simulated device: memory, the sticky error, the streams' scheduler settings.
class Device {
 public:
  static Device& get() {
    static Device d;
    return d;
  }

  const sim::Options& options() {
    std::call_once(configured_, [&] { options_ = sim::options_from_env(); });
    return options_;
  }
  // The seed and delay apply to streams created afterwards; the limit and drop at once.
  void configure(sim::Options o) {
    std::call_once(configured_, [] {});
    Quiet q;
    std::lock_guard lock(m_);
    options_ = std::move(o);
  }
  void fail_pinned(std::uint64_t n) {
    Quiet q;
    std::lock_guard lock(m_);
    pinned_countdown_ = n;
  }
  bool dropped(const char* site) { return !options().drop.empty() && options().drop == site; }
  std::uint64_t next_stream_id() { return stream_ids_.fetch_add(1) + 1; }

  // The sticky error: the first task that failed, thrown from every call after it.
  void fail(std::string message) {
    Quiet q;
    std::lock_guard lock(m_);
    if (error_.empty()) error_ = std::move(message);
    failed_.store(true, std::memory_order_relaxed);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void throw_if_failed() {
    if (!failed()) [[likely]]
      return;
    std::string e;
    {
      Quiet q;
      std::lock_guard lock(m_);
      e = error_;
    }
    throw Error(Errc::cuda, e);
  }
  // Clears the sticky error (a real device needs a reset; tests of the simulator use this).
  void reset() {
    Quiet q;
    std::lock_guard lock(m_);
    error_.clear();
    failed_.store(false, std::memory_order_relaxed);
  }

  void* allocate(std::size_t bytes) {
    throw_if_failed();
    if (bytes == 0) return nullptr;
    const std::size_t limit = options().memory_limit;
    void* p = nullptr;
    {
      Quiet q;
      std::lock_guard lock(m_);
      if (auto it = pool_.find(bytes); it != pool_.end()) {
        p = it->second;
        pool_.erase(it);
      } else {
        if (limit && reserved_ + bytes > limit) trim();
        if (limit && reserved_ + bytes > limit) throw std::bad_alloc();
        p = ::operator new(bytes, std::align_val_t(alignment));
        reserved_ += bytes;
      }
      blocks_[p] = {bytes, true};
      in_use_ += bytes;
    }
    ZP_SIM_UNPOISON(p, bytes);
    acquire(p);  // the free that returned it happened before
    std::memset(p, garbage, bytes);
    return p;
  }
  // At the stream's free: the block becomes garbage and goes back to the pool.
  void free_now(void* p) {
    const std::size_t bytes = block_bytes(p, "free");
    std::memset(p, garbage, bytes);  // a late reader on another stream sees NaN, TSan a race
    release(p);
    ZP_SIM_POISON(p, bytes);
    Quiet q;
    std::lock_guard lock(m_);
    blocks_[p].live = false;
    in_use_ -= bytes;
    pool_.emplace(bytes, p);
  }
  std::int64_t in_use() {
    Quiet q;
    std::lock_guard lock(m_);
    return std::int64_t(in_use_);
  }

  void* allocate_pinned(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    {
      Quiet q;
      std::lock_guard lock(m_);
      if (pinned_countdown_ && --pinned_countdown_ == 0)
        throw Error(Errc::cuda, detail::cat("simulated device: cudaMallocHost of ", bytes,
                                            " bytes failed: out of memory (sim::fail_pinned)"));
    }
    void* p = ::operator new(bytes, std::align_val_t(alignment));
    Quiet q;
    std::lock_guard lock(m_);
    pinned_[p] = {bytes, true};
    return p;
  }
  void deallocate_pinned(void* p) {
    if (!p) return;
    {
      Quiet q;
      std::lock_guard lock(m_);
      pinned_.erase(p);
    }
    ::operator delete(
        p, std::align_val_t(alignment));  // at once, as cudaFreeHost: readers must be done
  }

  enum class Kind { device, pinned, pageable };
  // Where [p, p + n) lies; a range that starts in a device block must end in it, in a live one.
  Kind classify(const void* p, std::size_t n, const char* what) {
    Quiet q;
    std::lock_guard lock(m_);
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    auto in = [&](const auto& map) {
      auto it = map.upper_bound(const_cast<void*>(p));
      if (it == map.begin()) return map.end();
      --it;
      return at < reinterpret_cast<std::uintptr_t>(it->first) + it->second.bytes ? it : map.end();
    };
    if (auto it = in(blocks_); it != blocks_.end()) {
      const std::size_t off = at - reinterpret_cast<std::uintptr_t>(it->first);
      if (!it->second.live)
        throw Error(Errc::cuda, detail::cat("simulated device: ", what, " of ", n,
                                            " bytes at offset ", off, " of a device block of ",
                                            it->second.bytes, " bytes that was freed"));
      if (n > it->second.bytes - off)
        throw Error(
            Errc::cuda,
            detail::cat("simulated device: ", what, " of ", n, " bytes at offset ", off,
                        " runs past the end of its device block of ", it->second.bytes, " bytes"));
      return Kind::device;
    }
    if (auto it = in(pinned_); it != pinned_.end()) {
      const std::size_t off = at - reinterpret_cast<std::uintptr_t>(it->first);
      if (n > it->second.bytes - off)
        throw Error(
            Errc::cuda,
            detail::cat("simulated device: ", what, " of ", n, " bytes at offset ", off,
                        " runs past the end of its pinned block of ", it->second.bytes, " bytes"));
      return Kind::pinned;
    }
    return Kind::pageable;
  }

  ~Device() {
    for (auto& [bytes, p] : pool_) {
      ZP_SIM_UNPOISON(p, bytes);
      ::operator delete(p, std::align_val_t(alignment));
    }
  }

 private:
  struct Block {
    std::size_t bytes;
    bool live;
  };

  Device() = default;
  std::size_t block_bytes(void* p, const char* what) {
    Quiet q;
    std::lock_guard lock(m_);
    auto it = blocks_.find(p);
    if (it == blocks_.end() || !it->second.live)
      throw Error(Errc::cuda, detail::cat("simulated device: ", what, " of ", p,
                                          ", which is not a live device allocation"));
    return it->second.bytes;
  }
  // Gives the pooled blocks back (under m_), as CUDA's pool does before it fails an allocation.
  void trim() {
    for (auto& [bytes, p] : pool_) {
      ZP_SIM_UNPOISON(p, bytes);
      ::operator delete(p, std::align_val_t(alignment));
      blocks_.erase(p);
      reserved_ -= bytes;
    }
    pool_.clear();
  }

  std::once_flag configured_;
  sim::Options options_;
  std::mutex m_;
  std::atomic<std::uint64_t> stream_ids_{0};
  std::atomic<bool> failed_{false};
  std::string error_;
  std::map<void*, Block> blocks_;           // every device block, live or pooled
  std::multimap<std::size_t, void*> pool_;  // freed blocks by size, reused for that size only
  std::map<void*, Block> pinned_;           // page-locked host blocks (always live)
  std::uint64_t pinned_countdown_ = 0;      // sim::fail_pinned's, under m_
  std::size_t reserved_ = 0, in_use_ = 0;
};

// A stream: a worker thread running its queue in order.
class Stream {
 public:
  Stream()
      : id_(Device::get().next_stream_id()),
        rng_(Device::get().options().seed * 0x9e3779b97f4a7c15ull + id_) {
    worker_ = std::thread([this] { run(); });
  }
  ~Stream() {
    {
      Quiet q;
      std::lock_guard lock(m_);
      stop_ = true;
      cv_.notify_all();
    }
    worker_.join();
  }

  void enqueue(std::function<void()> body, const char* what, bool work) {
    Device::get().throw_if_failed();
    auto t = std::make_unique<Task>(Task{std::move(body), what, work});
    release(t.get());  // what the host did before the call happens before the task
    Quiet q;
    std::lock_guard lock(m_);
    queue_.push_back(std::move(t));
    ++enqueued_;
    cv_.notify_all();
  }
  // Waits until everything enqueued so far has run; then its effects are the host's to see.
  void synchronize() {
    {
      Quiet q;
      std::unique_lock lock(m_);
      const std::uint64_t target = enqueued_;
      cv_.wait(lock, [&] { return completed_ >= target; });
    }
    acquire(this);
    Device::get().throw_if_failed();
  }
  bool done() {
    bool d;
    {
      Quiet q;
      std::lock_guard lock(m_);
      d = completed_ >= enqueued_;
    }
    Device::get().throw_if_failed();
    if (d) acquire(this);
    return d;
  }

 private:
  void run() {
    const auto max_delay = Device::get().options().max_delay;
    for (;;) {
      std::unique_ptr<Task> t;
      {
        Quiet q;
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped, and drained
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      if (max_delay.count() > 0) {
        const std::uint64_t r = rng_();
        if (r % 4 == 0)
          std::this_thread::sleep_for(
              std::chrono::microseconds((r >> 8) % std::uint64_t(max_delay.count() + 1)));
        else if (r % 4 == 1)
          std::this_thread::yield();
      }
      acquire(t.get());
      if (!t->work || !Device::get().failed()) {
        try {
          t->body();
        } catch (const std::exception& e) {
          Device::get().fail(detail::cat("simulated device: ", t->what, " on stream ", id_,
                                         " failed: ", e.what()));
        }
      }
      {
        Quiet q;
        t.reset();
      }
      release(this);
      Quiet q;
      std::lock_guard lock(m_);
      ++completed_;
      cv_.notify_all();
    }
  }

  const std::uint64_t id_;
  std::mt19937_64 rng_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Task>> queue_;
  std::uint64_t enqueued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: started once the rest exists
};

// The legacy default stream (a null stream_t): one per program, created on first use.
inline Stream& default_stream() {
  static Stream s;
  return s;
}

struct Event {
  std::mutex m;
  std::shared_ptr<Fence> last;        // the latest record's point; null: never recorded
  std::shared_ptr<Fence> current() {  // inside a Quiet block
    std::lock_guard lock(m);
    return last;
  }
};

}  // namespace sim_detail

using stream_t = sim_detail::Stream*;
using event_t = sim_detail::Event*;

namespace sim_detail {
inline Stream& at(stream_t s) { return s ? *s : default_stream(); }
}  // namespace sim_detail

namespace sim {
// Sets the simulated device's options (otherwise options_from_env()): the seed and delays for
// streams created afterwards, the memory limit and the dropped site at once.
inline void configure(Options o) { sim_detail::Device::get().configure(std::move(o)); }
// Clears a sticky error (tests of the simulator itself).
inline void reset() { sim_detail::Device::get().reset(); }
// The n-th page-locked allocation from now on fails, as cudaMallocHost does when the host runs
// out of it (0: none): one rank's failure, for the tests of its agreement.
inline void fail_pinned(std::uint64_t n) { sim_detail::Device::get().fail_pinned(n); }
}  // namespace sim

inline bool dropped(const char* site) { return sim_detail::Device::get().dropped(site); }

inline stream_t create_stream() {
  sim_detail::Device::get().throw_if_failed();
  return new sim_detail::Stream();
}
inline void destroy_stream(stream_t s) noexcept { delete s; }  // after its work, as CUDA's
inline bool stream_done(stream_t s) { return sim_detail::at(s).done(); }

inline event_t create_event() {
  sim_detail::Device::get().throw_if_failed();
  return new sim_detail::Event();
}
inline void destroy_event(event_t e) noexcept { delete e; }  // enqueued waits hold their fence
// Fences are shared between the host and the workers; their reference counts change only
// inside Quiet blocks, so that counting them makes no edge CUDA would not have.
inline void record(event_t e, stream_t s, const char* site) {
  if (sim_detail::Device::get().dropped(site)) return;
  std::shared_ptr<sim_detail::Fence> f;
  std::function<void()> body;
  {
    sim_detail::Quiet q;
    f = std::make_shared<sim_detail::Fence>();
    body = [f] { f->signal(); };
  }
  sim_detail::at(s).enqueue(std::move(body), "event record", false);
  sim_detail::Quiet q;
  std::lock_guard lock(e->m);
  e->last = std::move(f);
}
inline void wait(stream_t s, event_t e, const char* site) {
  if (sim_detail::Device::get().dropped(site)) return;
  std::function<void()> body;
  {
    sim_detail::Quiet q;
    if (auto f = e->current()) body = [f] { f->await(); };
  }
  if (body) sim_detail::at(s).enqueue(std::move(body), "event wait", false);
}
inline bool event_done(event_t e) {
  sim_detail::Device::get().throw_if_failed();
  std::shared_ptr<sim_detail::Fence> f;
  {
    sim_detail::Quiet q;
    f = e->current();
  }
  const bool done = !f || f->reached();
  sim_detail::Quiet q;
  f.reset();
  return done;
}

inline void* allocate(std::size_t bytes, stream_t) {
  return sim_detail::Device::get().allocate(bytes);
}
inline void deallocate(void* p, stream_t s, const char* site) noexcept {
  if (!p) return;
  auto& d = sim_detail::Device::get();
  if (d.dropped(site)) return d.free_now(p);  // the mutation: freed at once, not in stream order
  try {
    sim_detail::at(s).enqueue([p] { sim_detail::Device::get().free_now(p); }, "free", false);
  } catch (const Error& e) {  // a sticky error: the device is lost, its memory with it
    zp::detail::log_dropped("stream-ordered free", e.what());
  }
}
inline void* allocate_pinned(std::size_t bytes) {
  return sim_detail::Device::get().allocate_pinned(bytes);
}
inline void deallocate_pinned(void* p) noexcept { sim_detail::Device::get().deallocate_pinned(p); }

inline void copy(void* dst, const void* src, std::size_t bytes, stream_t s) {
  if (bytes == 0) return;
  using K = sim_detail::Device::Kind;
  auto& d = sim_detail::Device::get();
  d.throw_if_failed();
  const K from = d.classify(src, bytes, "copy source"),
          to = d.classify(dst, bytes, "copy destination");
  sim_detail::Stream& st = sim_detail::at(s);
  if (from == K::pageable && to != K::pageable) {  // staged: the caller may reuse src on return
    std::vector<unsigned char> staged(static_cast<const unsigned char*>(src),
                                      static_cast<const unsigned char*>(src) + bytes);
    return st.enqueue(
        [dst, staged = std::move(staged)] { std::memcpy(dst, staged.data(), staged.size()); },
        "copy", true);
  }
  st.enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); }, "copy", true);
  if (to == K::pageable) st.synchronize();  // into pageable memory: returns after the copy
}
inline void zero(void* p, std::size_t bytes, stream_t s) {
  if (bytes == 0) return;
  sim_detail::Device::get().classify(p, bytes, "zero");
  sim_detail::at(s).enqueue([p, bytes] { std::memset(p, 0, bytes); }, "zero", true);
}
inline void expect_device_memory(const void* p, const char* what) {
  using K = sim_detail::Device::Kind;
  if (p && sim_detail::Device::get().classify(p, 1, what) != K::device)
    throw Error(Errc::invalid_argument,
                detail::cat("simulated device: ", what,
                            " is in host memory; a device collective's buffers must be in device "
                            "memory (nccl refuses host memory)"));
}
inline void delay(stream_t s, std::chrono::microseconds us) {
  sim_detail::at(s).enqueue([us] { std::this_thread::sleep_for(us); }, "delay", false);
}

// f(i) for every i in [0, n), on the stream's worker. f is copied, as a kernel's arguments are.
template <class F>
void launch(stream_t s, std::size_t n, const F& f) {
  if (n == 0) return;
  sim_detail::at(s).enqueue(
      [f, n] {
        for (std::size_t i = 0; i < n; ++i) f(i);
      },
      "kernel", true);
}
template <class F>
void sum(stream_t s, std::size_t n, const F& f, double* acc) {
  if (n == 0) return;
  sim_detail::at(s).enqueue(
      [f, n, acc] {
        double total = 0;
        for (std::size_t i = 0; i < n; ++i) total += double(f(i));
        *acc += total;
      },
      "reduction", true);
}

inline void set_device(int d) {
  ZP_EXPECT(d == 0, "simulated device: device ", d,
            " does not exist (the simulator has one, device 0)");
}
inline int device_count() { return 1; }
inline std::int64_t memory_in_use() { return sim_detail::Device::get().in_use(); }
// What the device can still allocate: its limit less the blocks in use (a full pool is trimmed
// first), or -1 without a limit.
inline std::int64_t memory_free() {
  const std::size_t limit = sim_detail::Device::get().options().memory_limit;
  return limit ? std::max<std::int64_t>(0, std::int64_t(limit) - memory_in_use()) : -1;
}
// A name unique to the device among the ranks that may share it: a process's threads.
inline std::string device_name() {
  return detail::cat("the simulated device of process ", ::getpid(), " (ZP_SIM_MEMORY ",
                     sim_detail::Device::get().options().memory_limit, " bytes)");
}

}  // namespace zp::device
