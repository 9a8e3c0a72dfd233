// zp/backend/mpi_watchdog.hpp: how the mpi backend fails: an MPI error is a zp::Error naming the
// call (check), and a job whose rank is stuck ends in bounded time (the backend's
// Options::timeout). A rank registers each blocking region (Guard) with the process's
// one watchdog thread; a region that outlives its deadline prints what the rank was blocked in
// (operation, call number, count, type, the peer it waited for) and aborts the job (abort_job:
// MPI_Abort where MPI may be called from that thread, else _Exit, which mpiexec turns into the
// end of the job). While a region waits, the watchdog also asks its PeerCheck (the node's shared
// segment, which knows the other local ranks' processes) every 50 ms whether a peer's process
// is gone, and ends the job at once naming it: a rank killed while the others wait inside MPI
// (the call check's signature exchange, a cross-node message) ends the job in well under the
// timeout whether or not the launcher notices first.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "zp/collective.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"

namespace zp::backend::mpi_detail {

// MPI's text for an error code.
inline std::string error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(buf, std::size_t(len));
}

inline int world_rank() {
  int init = 0, fin = 0, r = -1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// An MPI call's failure as Errc::mpi, naming the call and the rank.
inline void check(int rc, const char* call, int rank) {
  if (rc != MPI_SUCCESS) [[unlikely]]
    throw Error(
        Errc::mpi,
        detail::cat("mpi backend: ", call, " failed on rank ", rank, ": ", error_string(rc)), rc);
}
// The thread that initialised MPI through MpiEnvironment (or first constructed a backend).
inline std::thread::id& main_thread_id_storage() {
  static std::thread::id id = std::this_thread::get_id();
  return id;
}
inline std::thread::id main_thread_id() { return main_thread_id_storage(); }

// For the message of an abort while an exception propagates: the exception's text where it is
// this thread's newest zp::Error (made just before it began), else "".
inline std::string propagating_error() {
  const detail::NewestError& e = detail::newest_error();
  if (e.what.empty() || e.in_flight + 1 != std::uncaught_exceptions()) return "";
  return detail::cat(
      ". This thread's newest zp::Error (the exception, unless one not from zp "
      "came after it): ",
      e.what);
}

// Ends the job after printing why: MPI_Abort when MPI may be called from any thread,
// otherwise _Exit (mpirun/mpiexec then terminate the other ranks).
[[noreturn]] inline void abort_job(const std::string& why) {
  std::fputs(("zp: mpi backend: " + why + "\n").c_str(), stderr);
  std::fflush(stderr);
  int init = 0, fin = 0, level = MPI_THREAD_SINGLE;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) {
    MPI_Query_thread(&level);
    if (level == MPI_THREAD_MULTIPLE || std::this_thread::get_id() == main_thread_id())
      MPI_Abort(MPI_COMM_WORLD, 134);
  }
  std::_Exit(134);
}

// Tells whether a peer of this rank's process is gone: its description ("rank 3 of its node
// (pid 1234) is gone (killed or crashed)"), or empty. Called from the watchdog's thread.
class PeerCheck {
 public:
  virtual std::string gone() const = 0;

 protected:
  ~PeerCheck() = default;
};

// What a rank is blocked in, for the watchdog's message.
struct Blocked {
  std::chrono::steady_clock::time_point deadline;
  long long timeout_ms = 0;
  int rank = 0, size = 0, world_rank = 0;
  const char* what = "";  // operation name
  std::uint64_t call = 0;
  std::size_t count = 0;
  DType dtype{};
  ReduceOp reduce{};
  bool has_reduce = false;
  int peer = -1;                     // send/recv: the one rank waited for
  const PeerCheck* peers = nullptr;  // the node's other processes, where known
};

// "rank R of N (world rank W) in WHAT (call #C, count=N, dtype=T[, op=O][, peer=P])".
inline std::string describe(const Blocked& b, const std::string& after_rank = "") {
  std::string s = detail::cat("rank ", b.rank, " of ", b.size, " (world rank ", b.world_rank, ")",
                              after_rank, " in ", b.what, " (call #", b.call, ", count=", b.count,
                              ", dtype=", name(b.dtype));
  if (b.has_reduce) s += detail::cat(", op=", name(b.reduce));
  if (b.peer >= 0) s += detail::cat(", peer=", b.peer);
  return s + ")";
}

// The job's end when a peer of b's rank is gone mid-call.
[[noreturn]] inline void abort_gone(const Blocked& b, const std::string& gone) {
  abort_job(detail::cat(describe(b), ": ", gone, " mid-collective; aborting the job"));
}

// One thread per process that aborts the job when a registered wait outlives its deadline.
// Shared by every backend of the process; stops when the last one is gone.
class Watchdog {
 public:
  static std::shared_ptr<Watchdog> get() {
    static std::mutex m;
    static std::weak_ptr<Watchdog> instance;
    std::lock_guard lk(m);
    auto p = instance.lock();
    if (!p) {
      p = std::shared_ptr<Watchdog>(new Watchdog());
      instance = p;
    }
    return p;
  }
  ~Watchdog() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void add(Blocked* b) {
    std::lock_guard lk(m_);
    active_.push_back(b);
  }
  void remove(Blocked* b) {
    std::lock_guard lk(m_);
    auto it = std::find(active_.begin(), active_.end(), b);
    if (it != active_.end()) {
      *it = active_.back();
      active_.pop_back();
    }
  }

 private:
  Watchdog() : thread_([this] { loop(); }) {}
  void loop() {
    std::unique_lock lk(m_);
    while (!stop_) {
      cv_.wait_for(lk, std::chrono::milliseconds(50));
      const auto now = std::chrono::steady_clock::now();
      for (const Blocked* b : active_) {
        if (b->peers)
          if (const std::string gone = b->peers->gone(); !gone.empty()) abort_gone(*b, gone);
        if (now < b->deadline) continue;
        abort_job(describe(*b, detail::cat(" timed out after ", b->timeout_ms, " ms")) +
                  (b->peer >= 0 ? detail::cat(" waiting for rank ", b->peer,
                                              " (it failed, left or never issued the matching "
                                              "call); aborting the job")
                                : std::string(" waiting for the other ranks (one failed, left or "
                                              "skipped the call); aborting the job")));
      }
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<Blocked*> active_;
  std::thread thread_;
};

// RAII registration of a blocking region with the watchdog.
class Guard {
 public:
  Guard(Watchdog* w, Blocked& b, std::chrono::milliseconds timeout)
      : w_(timeout.count() > 0 ? w : nullptr), b_(b) {
    if (!w_) return;
    b_.timeout_ms = timeout.count();
    b_.deadline = detail::deadline_after(timeout);
    w_->add(&b_);
  }
  ~Guard() {
    if (w_) w_->remove(&b_);
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

 private:
  Watchdog* w_;
  Blocked& b_;
};

}  // namespace zp::backend::mpi_detail
