// zp/detail/progress.hpp: the in-order job queue behind the host backends' async operations, and
// the completion an async operation's handle waits for
// (threads; the mpi backend's node-local path). One thread per queue, started on the first post,
// runs the jobs one after another in the order they were posted, so every rank sees its
// operations in the order it issued them; drain() waits until every posted job has run (a
// blocking call drains first, so it runs after the async ones before it). The destructor runs
// what is still queued, then joins.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace zp::detail {

// The end of an operation that runs elsewhere (a progress thread, the matching peer): complete()
// publishes it with its error or none; wait() blocks until then and rethrows the error.
struct Completion {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::atomic<bool> ready{false};  // done, readable without the lock (for a spinning waiter)

  void complete(std::exception_ptr e) {
    std::lock_guard lk(m);
    error = std::move(e);
    done = true;
    ready.store(true, std::memory_order_release);
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lk(m);
    cv.wait(lk, [&] { return done; });
    if (error) std::rethrow_exception(error);
  }
};

class Progress {
 public:
  Progress() = default;
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void post(std::function<void()> job) {
    {
      std::lock_guard lk(m_);
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      ++pending_;
      queue_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

  void drain() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return pending_ == 0; });
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();  // a job reports its own errors (to its Work); it must not throw
      {
        std::lock_guard lk(m_);
        --pending_;
      }
      cv_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::size_t pending_ = 0;  // posted and not yet run to the end
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace zp::detail
