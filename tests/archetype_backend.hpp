// tests/archetype_backend.hpp: zp::test::Archetype, a backend that has exactly what the Backend
// concept of zp/collective.hpp requires and nothing more, so a front end instantiated with it
// (tests/archetype.test.cpp) fails to compile if it asks a backend for anything extra.
//
// What "nothing more" means here, member by member:
//  - the backend is movable (the concept's std::movable) but not copyable and not default
//    constructible; it is built only by a free function, archetype_world();
//  - memory is a constant (front ends branch on it at compile time, and the concept says so);
//    name is constexpr too, though the concept asks only that it converts to const char* and
//    no front end reads it;
//  - rank() and size() exist only as const members returning int;
//  - the collectives, send, recv and split take exactly the concept's parameter types and
//    return exactly Work (split: Archetype), as non-const members;
//  - Work is movable and default constructible (empty) but not copyable; wait() and test()
//    exist as non-const members only.
//  - no stream, event, timeout, abort or any other optional extra.
//
// The implementation is a world of one rank: every collective leaves in dst what the one rank
// contributed (a copy, or nothing in place). The copy happens when the Work completes (wait(),
// a successful test(), its destruction, or another Work moved into it), not when the call is
// issued, so a front end that reads a result before waiting for it sees stale data. Calls are
// checked with the same rules every backend applies (detail::check_call, detail::check_p2p):
// send and recv have no valid peer in a world of one and always throw.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "zp/collective.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"

namespace zp::test {

class Archetype {
 public:
  static constexpr MemorySpace memory = MemorySpace::host;
  static constexpr const char* name = "archetype";

  // A pending copy of bytes_ bytes from src_ to dst_; empty when bytes_ == 0.
  class Work {
   public:
    Work() = default;  // empty
    Work(Work&& o) noexcept : src_(o.src_), dst_(o.dst_), bytes_(std::exchange(o.bytes_, 0)) {}
    Work& operator=(Work&& o) noexcept {
      if (this != &o) {
        complete();
        src_ = o.src_;
        dst_ = o.dst_;
        bytes_ = std::exchange(o.bytes_, 0);
      }
      return *this;
    }
    Work(const Work&) = delete;
    Work& operator=(const Work&) = delete;
    ~Work() { complete(); }

    void wait() { complete(); }
    bool test() {
      complete();
      return true;
    }

   private:
    friend class Archetype;
    Work(const void* src, void* dst, std::size_t bytes) noexcept
        : src_(src), dst_(dst), bytes_(bytes) {}
    void complete() noexcept {
      if (bytes_ > 0 && src_ != dst_) std::memmove(dst_, src_, bytes_);
      bytes_ = 0;
    }
    const void* src_ = nullptr;
    void* dst_ = nullptr;
    std::size_t bytes_ = 0;
  };

  Archetype(Archetype&&) noexcept = default;
  Archetype& operator=(Archetype&&) noexcept = default;
  Archetype(const Archetype&) = delete;
  Archetype& operator=(const Archetype&) = delete;
  ~Archetype() = default;

  int rank() const { return 0; }
  int size() const { return 1; }

  Work all_reduce(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch launch) {
    return issue(CollOp::all_reduce, src, dst, n, t, op, 0, launch);
  }
  Work reduce_scatter(const void* src, void* dst, std::size_t n, DType t, ReduceOp op,
                      Launch launch) {
    return issue(CollOp::reduce_scatter, src, dst, n, t, op, 0, launch);
  }
  Work all_gather(const void* src, void* dst, std::size_t n, DType t, Launch launch) {
    return issue(CollOp::all_gather, src, dst, n, t, ReduceOp::sum, 0, launch);
  }
  Work all_to_all(const void* src, void* dst, std::size_t n, DType t, Launch launch) {
    return issue(CollOp::all_to_all, src, dst, n, t, ReduceOp::sum, 0, launch);
  }
  Work all_to_all_v(const void* src, const std::size_t* send_counts, void* dst,
                    const std::size_t* recv_counts, DType t, Launch launch) {
    std::string bad = detail::check_exchange_v(src, send_counts, dst, recv_counts, t, 1);
    if (bad.empty()) bad = detail::check_block_agrees(0, 0, send_counts[0], recv_counts[0]);
    if (!bad.empty()) throw Error(Errc::invalid_argument, detail::cat("archetype backend: ", bad));
    Work w(src, dst, send_counts[0] * size_of(t));
    if (launch == Launch::blocking) w.wait();
    return w;
  }
  Work broadcast(const void* src, void* dst, std::size_t n, DType t, int root, Launch launch) {
    return issue(CollOp::broadcast, src, dst, n, t, ReduceOp::sum, root, launch);
  }
  Work barrier(Launch launch) {
    return issue(CollOp::barrier, nullptr, nullptr, 0, DType::f32, ReduceOp::sum, 0, launch);
  }
  Work send(const void* src, std::size_t n, DType t, int peer, Launch) {
    throw Error(Errc::invalid_argument, detail::check_p2p(CollOp::send, src, n, t, peer, 0, 1));
  }
  Work recv(void* dst, std::size_t n, DType t, int peer, Launch) {
    throw Error(Errc::invalid_argument, detail::check_p2p(CollOp::recv, dst, n, t, peer, 0, 1));
  }
  Archetype split(int, int) { return Archetype(); }

 private:
  // The one way to get a backend (not a member: the front end cannot call it).
  friend Archetype archetype_world();
  Archetype() = default;

  static Work issue(CollOp op, const void* src, void* dst, std::size_t n, DType t, ReduceOp rop,
                    int root, Launch launch) {
    const std::string bad = detail::check_call(op, src, dst, n, t, rop, root, 0, 1);
    if (!bad.empty()) throw Error(Errc::invalid_argument, detail::cat("archetype backend: ", bad));
    Work w(src, dst, op == CollOp::barrier ? 0 : n * size_of(t));
    if (launch == Launch::blocking) w.wait();
    return w;
  }
};

// Rank 0 of a world of one.
inline Archetype archetype_world() { return Archetype(); }

// The archetype is a Backend and has no more than the concept asks.
static_assert(Backend<Archetype>);
static_assert(!std::copyable<Archetype> && !std::default_initializable<Archetype>);
static_assert(!std::copyable<Archetype::Work>);

}  // namespace zp::test
