// zp/work.hpp: Work<Op>, the handle of an asynchronous operation, written once for every backend
// (threads, mpi, nccl, cuda_threads).
//
// A Work is move-only and completes its operation when waited on, when destroyed and when
// another is moved into it: the buffers an operation reads or writes stay in use until it
// completes, so a dropped or replaced handle must never let the caller free them early. wait()
// and test() report the operation's error; the destructor and move assignment cannot, and drop
// it (a backend whose errors are sticky reports them at its next call). What completing means is
// the backend's (the host waits, or a device stream is ordered after the operation); it says so
// with an Op, a handle that is empty when value-initialised or moved from:
//   explicit operator bool() const  an operation is pending
//   void finish()                   completes it and reports its error; empty afterwards, also
//                                   when it throws
//   bool done()                     false while it runs; else finishes it and returns true
//   void drop() noexcept            completes it without reporting; empty afterwards (also when
//                                   already empty)
#pragma once

#include <utility>

namespace zp {

template <class Op>
class Work {
 public:
  Work() = default;
  explicit Work(Op op) noexcept : op_(std::move(op)) {}
  Work(Work&& o) noexcept : op_(std::move(o.op_)) {}
  Work& operator=(Work&& o) noexcept {
    if (this != &o) {
      op_.drop();
      op_ = std::move(o.op_);
    }
    return *this;
  }
  ~Work() { op_.drop(); }

  void wait() {
    if (op_) op_.finish();
  }
  bool test() { return !op_ || op_.done(); }

 private:
  Op op_{};
};

}  // namespace zp
