// zp/collective.hpp: Collective<Backend>, the typed front end every ZeRO stage communicates
// through, and the Backend concept that threads, mpi and nccl model.
//
// Conventions (the ZeRO layout; the same as NCCL's):
//  - all_reduce: in place when input and output are the same buffer.
//  - reduce_scatter: input holds size() * n elements, rank r receives the reduction of input
//    elements [r*n, r*n + n). In place when output == input + r*n.
//  - all_gather: every rank contributes n elements; output holds size() * n elements with rank
//    r's contribution at [r*n, r*n + n). In place when input == output + r*n.
//  - all_to_all: input and output hold size() * n elements; rank r's input block q
//    ([q*n, q*n + n)) lands in rank q's output block r. Never in place (the buffers must not
//    overlap).
//  - all_to_all_v: per-peer counts. Rank r sends send_counts[q] elements to rank q and receives
//    recv_counts[q] from it; the blocks lie packed in rank order (block q of the input starts at
//    send_counts[0] + ... + send_counts[q-1], the output likewise), rank r's send_counts[q] must
//    equal rank q's recv_counts[r] (host backends check it on every rank; nccl cannot see it),
//    and the count arrays are read before the call returns. Never in place.
//  - Buffers live in the backend's memory space (host for threads and mpi, device for nccl).
//    Where ranks share one address space (threads, cuda_threads), a buffer one rank writes must
//    not overlap any buffer of another rank; the backend refuses such a call on every rank.
//  - Every rank of the communicator must issue the same operations in the same order with the
//    same counts and element types; a mismatch the backend can see is an Errc::invalid_argument
//    on every rank, and a peer that never arrives is an Errc::timeout (or a job abort for mpi)
//    after the backend's timeout, never a hang.
//  - send/recv (point to point) are the exception: only the two ranks of a pair take part. A
//    send to rank b is matched with b's recv from this rank, the k-th send from a to b with the
//    k-th recv from a on b (MPI's non-overtaking order); the pair must agree on count and element
//    type (else Errc::invalid_argument on both sides, naming both calls).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "zp/dtype.hpp"
#include "zp/error.hpp"

namespace zp {

enum class ReduceOp : std::uint8_t { sum, avg, max, min };

// Collective operations, for accounting and error messages.
// send and recv are point to point (one peer), counted with the collectives.
enum class CollOp : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  barrier,
  send,
  recv,
  all_to_all
};
inline constexpr std::size_t coll_op_count = 8;

namespace detail {
inline constexpr EnumValueNames reduce_op_values{"ReduceOp"}, coll_op_values{"CollOp"};
}

// A value outside the enum names its number, e.g. "ReduceOp(9)" (see detail::EnumValueNames).
constexpr const char* name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return detail::reduce_op_values[std::uint8_t(op)];
}
constexpr const char* name(CollOp op) noexcept {
  switch (op) {
    case CollOp::all_reduce: return "all_reduce";
    case CollOp::reduce_scatter: return "reduce_scatter";
    case CollOp::all_gather: return "all_gather";
    case CollOp::broadcast: return "broadcast";
    case CollOp::barrier: return "barrier";
    case CollOp::send: return "send";
    case CollOp::recv: return "recv";
    case CollOp::all_to_all: return "all_to_all";
  }
  return detail::coll_op_values[std::uint8_t(op)];
}

// Where a buffer lives. A backend's memory is host or device; pinned is page-locked host memory
// beside a device (the host reads and writes it, the device's copies and kernels reach it too):
// where a device backend keeps what is offloaded to the host.
enum class MemorySpace : std::uint8_t { host, device, pinned };

// Whether a backend call returns after the operation completed (blocking) or as soon as it is
// enqueued (async; completion through the returned work handle).
enum class Launch : std::uint8_t { blocking, async };

// nccl-tests' bus-bandwidth factor: busbw = algbw * factor, comparable with link bandwidth for
// any rank count (nccl-tests, doc/PERFORMANCE.md). A send or recv moves its bytes over one link: factor 1.
constexpr double bus_factor(CollOp op, int ranks) noexcept {
  if (op == CollOp::send || op == CollOp::recv) return 1.0;
  if (ranks <= 1) return op == CollOp::broadcast ? 1.0 : 0.0;
  const double n = ranks;
  switch (op) {
    case CollOp::all_reduce: return 2.0 * (n - 1.0) / n;
    case CollOp::reduce_scatter:
    case CollOp::all_gather:
    case CollOp::all_to_all: return (n - 1.0) / n;
    case CollOp::broadcast: return 1.0;
    case CollOp::barrier: return 0.0;
    case CollOp::send:
    case CollOp::recv: return 1.0;
  }
  return 0.0;
}

namespace detail {

// Part `index` of [0, n) cut into `parts` contiguous ranges, the first n % parts one larger:
// {begin, end}. The one cut of a range among ranks (tensor-parallel splits, the backends' slices).
constexpr std::pair<std::size_t, std::size_t> even_part(std::size_t n, int parts,
                                                        int index) noexcept {
  const std::size_t p = std::size_t(parts), i = std::size_t(index), q = n / p, r = n % p;
  const std::size_t begin = i * q + (i < r ? i : r);
  return {begin, begin + q + (i < r ? 1 : 0)};
}

// The argument checks every backend runs on its untyped core (so the rules are one, whatever
// the backend): a known element type and reduction, no null buffer with a nonzero count, sizes
// that do not wrap, a root inside the communicator, and input/output buffers either identical
// (or at the in-place ZeRO offset) or disjoint. Returns "" when the call is well-formed, else
// what is wrong, naming the argument and its value. mpi and threads exchange the verdict so every
// rank throws together; the communicator stays usable.
inline std::string check_call(CollOp op, const void* src, const void* dst, std::size_t n, DType t,
                              ReduceOp rop, int root, int rank, int ranks) {
  const char* what = name(op);
  if (std::uint8_t(t) > std::uint8_t(DType::f16))
    return cat(what, ": element type DType(", int(t),
               ") is not one of f32, f64, i32, i64, bf16, f16");
  const bool reduces = op == CollOp::all_reduce || op == CollOp::reduce_scatter;
  if (reduces && std::uint8_t(rop) > std::uint8_t(ReduceOp::min))
    return cat(what, ": reduction ReduceOp(", int(rop), ") is not one of sum, avg, max, min");
  if (op == CollOp::broadcast && (root < 0 || root >= ranks))
    return cat("broadcast: root ", root, " is not a rank in [0, ", ranks, ")");
  if (op == CollOp::barrier || n == 0) return {};
  const bool scatter = op == CollOp::reduce_scatter, gather = op == CollOp::all_gather,
             exchange = op == CollOp::all_to_all;
  std::size_t part = 0, full = 0;
  if (__builtin_mul_overflow(n, size_of(t), &part) ||
      __builtin_mul_overflow(part, std::size_t(scatter || gather || exchange ? ranks : 1), &full))
    return cat(what, ": count ", n, " of ", name(t), " over ", ranks,
               " ranks overflows a 64-bit size");
  if (!src && (op != CollOp::broadcast || rank == root))
    return cat(what, ": the input buffer is null but count is ", n);
  if (!dst) return cat(what, ": the output buffer is null but count is ", n);
  // Byte ranges [s, s + in) and [d, d + out): overlap is allowed only where it is in place.
  const auto s = reinterpret_cast<std::uintptr_t>(src), d = reinterpret_cast<std::uintptr_t>(dst);
  const std::size_t in = scatter || exchange ? full : part, out = gather || exchange ? full : part;
  const bool overlap = src && s < d + out && d < s + in;
  if (exchange && overlap)
    return cat("all_to_all: the input and output buffers overlap (they are ", std::intptr_t(d - s),
               " bytes apart, each ", full, " bytes); all_to_all is never in place");
  const std::uintptr_t own = std::uintptr_t(rank) * part;
  if (!overlap || (scatter && d == s + own) || (gather && s == d + own) ||
      (!scatter && !gather && s == d))
    return {};
  if (scatter)
    return cat(
        "reduce_scatter: the output overlaps the input but is not this rank's shard (in place "
        "means output == input + rank * count = input + ",
        own, " bytes; it is input + ", std::intptr_t(d - s), ")");
  if (gather)
    return cat(
        "all_gather: the input overlaps the output but is not this rank's shard (in place "
        "means input == output + rank * count = output + ",
        own, " bytes; it is output + ", std::intptr_t(s - d), ")");
  return cat(what,
             ": the input and output buffers overlap but are not the same buffer (in place "
             "means input == output; they are ",
             std::intptr_t(d - s), " bytes apart)");
}

// The element counts of the blocks of all_to_all_v before block `q` (where block q starts).
inline std::size_t block_offset(const std::size_t* counts, int q) noexcept {
  std::size_t at = 0;
  for (int i = 0; i < q; ++i) at += counts[i];
  return at;
}

// check_call's counterpart for all_to_all_v: a known element type, count arrays present, totals
// that do not wrap, no null buffer with a nonzero total, and buffers that do not overlap. "" when
// well-formed, else what is wrong and its value.
inline std::string check_exchange_v(const void* src, const std::size_t* send_counts, void* dst,
                                    const std::size_t* recv_counts, DType t, int ranks) {
  if (std::uint8_t(t) > std::uint8_t(DType::f16))
    return cat("all_to_all_v: element type DType(", int(t),
               ") is not one of f32, f64, i32, i64, bf16, f16");
  if (!send_counts || !recv_counts)
    return cat("all_to_all_v: the ", !send_counts ? "send" : "receive",
               " counts are null; expected ", ranks, " counts, one per rank");
  std::size_t bytes[2] = {0, 0};
  const std::size_t* counts[2] = {send_counts, recv_counts};
  for (int side = 0; side < 2; ++side) {
    std::size_t total = 0;
    for (int q = 0; q < ranks; ++q)
      if (__builtin_add_overflow(total, counts[side][q], &total) ||
          __builtin_mul_overflow(total, size_of(t), &bytes[side]))
        return cat("all_to_all_v: the ", side ? "receive" : "send", " counts up to rank ", q, " (",
                   counts[side][q], " elements there) overflow a 64-bit size of ", name(t));
  }
  if (!src && bytes[0])
    return cat("all_to_all_v: the input buffer is null but sends ", bytes[0], " bytes");
  if (!dst && bytes[1])
    return cat("all_to_all_v: the output buffer is null but receives ", bytes[1], " bytes");
  const auto s = reinterpret_cast<std::uintptr_t>(src), d = reinterpret_cast<std::uintptr_t>(dst);
  if (bytes[0] && bytes[1] && s < d + bytes[1] && d < s + bytes[0])
    return cat("all_to_all_v: the input and output buffers overlap (they are ",
               std::intptr_t(d - s), " bytes apart; the input is ", bytes[0], " bytes, the output ",
               bytes[1], "); all_to_all_v is never in place");
  return {};
}

// The error for an all_to_all_v whose ranks disagree on one block's size, the same words on
// every backend: "" when they agree.
inline std::string check_block_agrees(int from, int to, std::size_t sent, std::size_t expected) {
  if (sent == expected) return {};
  return cat("all_to_all_v: rank ", from, " sends ", sent, " elements to rank ", to, " but rank ",
             to, "'s receive count for rank ", from, " is ", expected,
             "; every send count must equal its receiver's receive count");
}

// check_call's counterpart for send and recv (op is CollOp::send or CollOp::recv): a known
// element type, a size that does not wrap, no null buffer with a nonzero count, and a peer that
// is another rank of the communicator. "" when well-formed, else what is wrong and its value.
inline std::string check_p2p(CollOp op, const void* buf, std::size_t n, DType t, int peer, int rank,
                             int ranks) {
  const char* what = name(op);
  if (std::uint8_t(t) > std::uint8_t(DType::f16))
    return cat(what, ": element type DType(", int(t),
               ") is not one of f32, f64, i32, i64, bf16, f16");
  if (peer < 0 || peer >= ranks)
    return cat(what, ": peer ", peer, " is not a rank in [0, ", ranks, ")");
  if (peer == rank)
    return cat(what, ": peer ", peer, " is this rank; a rank cannot ", what,
               op == CollOp::send ? " to itself" : " from itself");
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(n, size_of(t), &bytes))
    return cat(what, ": count ", n, " of ", name(t), " overflows a 64-bit size");
  if (!buf && n > 0) return cat(what, ": the buffer is null but count is ", n);
  return {};
}

// Held while a rank issues a call, over a flag per rank: two threads calling as the same rank
// at once would interleave that rank's operations (and, on threads, meet each other instead of
// their peers), so the second one is an error instead.
class OneCaller {
 public:
  OneCaller(std::atomic<bool>& flag, const char* backend, const char* what, int rank)
      : flag_(flag) {
    if (flag_.exchange(true, std::memory_order_acquire)) [[unlikely]]
      throw Error(
          Errc::invalid_argument,
          cat(backend, " backend: two threads issued ", what, " and another call as rank ", rank,
              " at the same time; each rank's calls must come from one thread at a time"));
  }
  ~OneCaller() { flag_.store(false, std::memory_order_release); }
  OneCaller(const OneCaller&) = delete;
  OneCaller& operator=(const OneCaller&) = delete;

 private:
  std::atomic<bool>& flag_;
};

}  // namespace detail

// A handle on an issued operation: wait() completes it for the caller (rethrowing its error),
// test() polls without blocking. Host backends block in wait() until the operation is done;
// device backends (memory space device) make the caller's current CUDA stream wait for it
// instead (zp/device/stream.hpp), so kernels enqueued there afterwards see the result and the host
// never waits. A handle destroyed without wait() must complete (or order) its operation
// before it is gone, so no operation outlives the buffers its caller frees next. A default
// constructed handle is empty (Collective<B>::Work holds one before anything is issued).
template <class W>
concept WorkHandle = std::movable<W> && std::default_initializable<W> && requires(W& w) {
  w.wait();
  { w.test() } -> std::same_as<bool>;
};

// What Collective asks of a backend: an untyped core over {pointer, count, dtype}. Counts are
// elements; for reduce_scatter and all_gather they are the per-rank shard. Optional extras
// (streams, events) are the backend's own and found by the caller with `requires`.
template <class B>
concept Backend = std::movable<B> && WorkHandle<typename B::Work> &&
    requires(B& b, const B& cb, const void* src, void* dst, std::size_t n, DType t, ReduceOp op,
             int root, int color, int key, Launch launch, const std::size_t* counts) {
  typename std::integral_constant<MemorySpace, B::memory>;  // a constant: front ends branch on it
  { B::name } -> std::convertible_to<const char*>;
  { cb.rank() } -> std::same_as<int>;
  { cb.size() } -> std::same_as<int>;
  { b.all_reduce(src, dst, n, t, op, launch) } -> std::same_as<typename B::Work>;
  { b.reduce_scatter(src, dst, n, t, op, launch) } -> std::same_as<typename B::Work>;
  { b.all_gather(src, dst, n, t, launch) } -> std::same_as<typename B::Work>;
  { b.all_to_all(src, dst, n, t, launch) } -> std::same_as<typename B::Work>;
  { b.all_to_all_v(src, counts, dst, counts, t, launch) } -> std::same_as<typename B::Work>;
  { b.broadcast(src, dst, n, t, root, launch) } -> std::same_as<typename B::Work>;
  { b.barrier(launch) } -> std::same_as<typename B::Work>;
  { b.send(src, n, t, root, launch) } -> std::same_as<typename B::Work>;
  { b.recv(dst, n, t, root, launch) } -> std::same_as<typename B::Work>;
  { b.split(color, key) } -> std::same_as<B>;
};

// Per-operation counters. bytes follows nccl-tests' S (the full buffer: for reduce_scatter,
// all_gather and all_to_all size() * shard; for send and recv the message); bus_bytes = bytes * bus_factor, i.e. what crossed the busiest
// link. seconds is issue-to-completion as the caller observed it.
struct OpStats {
  std::uint64_t calls = 0;
  std::uint64_t bytes = 0;
  double bus_bytes = 0;
  double seconds = 0;

  OpStats& operator+=(const OpStats& o) {
    calls += o.calls;
    bytes += o.bytes;
    bus_bytes += o.bus_bytes;
    seconds += o.seconds;
    return *this;
  }
  OpStats& operator-=(const OpStats& o) {  // the counts since an earlier snapshot o
    calls -= o.calls;
    bytes -= o.bytes;
    bus_bytes -= o.bus_bytes;
    seconds -= o.seconds;
    return *this;
  }
};

struct CommStats {
  std::array<OpStats, coll_op_count> ops{};

  const OpStats& operator[](CollOp op) const { return ops[index(op)]; }
  OpStats& operator[](CollOp op) { return ops[index(op)]; }
  OpStats total() const {
    OpStats t;
    for (const auto& o : ops) t += o;
    return t;
  }
  // A value outside the enum is an error naming it, not a read past the end of ops.
  static std::size_t index(CollOp op) {
    ZP_EXPECT(std::size_t(op) < coll_op_count,
              "CommStats: expected a CollOp (all_reduce, reduce_scatter, "
              "all_gather, broadcast, barrier, send, recv, all_to_all), got ",
              name(op));
    return std::size_t(op);
  }
};

// The typed front end. Thin: it checks sizes and types, forwards to the backend's untyped core
// and counts. Holds the backend by value; split() returns a new Collective over a sub-group.
template <Backend B>
class Collective {
 public:
  using backend_type = B;
  static constexpr MemorySpace memory = B::memory;

  // An issued operation; wait() completes it and books its time in the communicator's stats.
  // Destroyed or assigned over without wait(), it waits for the operation (every backend's Work
  // does), dropping its error: the buffers belong to the caller and may be freed right after.
  class Work {
   public:
    Work() = default;
    void wait() {
      if (!stats_) return;
      work_.wait();
      (*stats_)[op_].seconds += seconds_since(start_);
      stats_ = nullptr;
    }
    bool test() {
      if (!stats_) return true;
      if (!work_.test()) return false;
      wait();
      return true;
    }

   private:
    friend class Collective;
    Work(typename B::Work w, CommStats* s, CollOp op, std::chrono::steady_clock::time_point t)
        : work_(std::move(w)), stats_(s), op_(op), start_(t) {}
    typename B::Work work_{};
    CommStats* stats_ = nullptr;
    CollOp op_{};
    std::chrono::steady_clock::time_point start_{};
  };

  explicit Collective(B backend) : backend_(std::move(backend)) {}
  Collective(Collective&&) noexcept = default;
  Collective& operator=(Collective&&) noexcept = default;

  int rank() const { return backend_.rank(); }
  int size() const { return backend_.size(); }
  B& backend() { return backend_; }
  const B& backend() const { return backend_; }

  const CommStats& stats() const { return *stats_; }
  void reset_stats() { *stats_ = {}; }

  // --- all_reduce: 2(N-1)/N * bytes over the busiest link -----------------------------------
  template <Element T>
  Work all_reduce_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    ZP_EXPECT(in.size() == out.size(), "all_reduce: input has ", in.size(),
              " elements but output has ", out.size(), "; they must be equal");
    return issue(CollOp::all_reduce, out.size_bytes(), [&] {
      return backend_.all_reduce(in.data(), out.data(), out.size(), dtype_of<T>, op, Launch::async);
    });
  }
  template <Element T>
  Work all_reduce_async(std::span<T> inout, ReduceOp op = ReduceOp::sum) {
    return all_reduce_async(std::span<const T>(inout), inout, op);
  }
  template <Element T>
  void all_reduce(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    ZP_EXPECT(in.size() == out.size(), "all_reduce: input has ", in.size(),
              " elements but output has ", out.size(), "; they must be equal");
    blocking(CollOp::all_reduce, out.size_bytes(), [&] {
      return backend_.all_reduce(in.data(), out.data(), out.size(), dtype_of<T>, op,
                                 Launch::blocking);
    });
  }
  template <Element T>
  void all_reduce(std::span<T> inout, ReduceOp op = ReduceOp::sum) {
    all_reduce(std::span<const T>(inout), inout, op);
  }

  // --- reduce_scatter: in has size()*out.size() elements; (N-1)/N * bytes(in) ----------------
  template <Element T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    check_scatter("reduce_scatter", in.size(), out.size());
    return issue(CollOp::reduce_scatter, in.size_bytes(), [&] {
      return backend_.reduce_scatter(in.data(), out.data(), out.size(), dtype_of<T>, op,
                                     Launch::async);
    });
  }
  template <Element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    check_scatter("reduce_scatter", in.size(), out.size());
    blocking(CollOp::reduce_scatter, in.size_bytes(), [&] {
      return backend_.reduce_scatter(in.data(), out.data(), out.size(), dtype_of<T>, op,
                                     Launch::blocking);
    });
  }
  // In place (ZeRO layout): buf.size() must divide by size(); this rank's result is left in
  // shard(buf), the rest of buf is unspecified afterwards.
  template <Element T>
  Work reduce_scatter_async(std::span<T> buf, ReduceOp op = ReduceOp::sum) {
    return reduce_scatter_async(std::span<const T>(buf), shard(buf), op);
  }
  template <Element T>
  void reduce_scatter(std::span<T> buf, ReduceOp op = ReduceOp::sum) {
    reduce_scatter(std::span<const T>(buf), shard(buf), op);
  }

  // --- all_gather: out has size()*in.size() elements; (N-1)/N * bytes(out) -------------------
  template <Element T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    check_scatter("all_gather", out.size(), in.size());
    return issue(CollOp::all_gather, out.size_bytes(), [&] {
      return backend_.all_gather(in.data(), out.data(), in.size(), dtype_of<T>, Launch::async);
    });
  }
  template <Element T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    check_scatter("all_gather", out.size(), in.size());
    blocking(CollOp::all_gather, out.size_bytes(), [&] {
      return backend_.all_gather(in.data(), out.data(), in.size(), dtype_of<T>, Launch::blocking);
    });
  }
  // In place (ZeRO layout): this rank's contribution already sits in shard(buf).
  template <Element T>
  Work all_gather_async(std::span<T> buf) {
    return all_gather_async(std::span<const T>(shard(buf)), buf);
  }
  template <Element T>
  void all_gather(std::span<T> buf) {
    all_gather(std::span<const T>(shard(buf)), buf);
  }

  // --- all_to_all: in and out have size()*n elements; block q of in goes to rank q ----------
  // (N-1)/N * bytes(in) over the busiest link (nccl-tests' alltoall). Rank r's in[q*n, q*n + n)
  // becomes rank q's out[r*n, r*n + n); in and out must not overlap.
  template <Element T>
  Work all_to_all_async(std::span<const T> in, std::span<T> out) {
    const std::size_t n = check_exchange(in.size(), out.size());
    return issue(CollOp::all_to_all, in.size_bytes(), [&] {
      return backend_.all_to_all(in.data(), out.data(), n, dtype_of<T>, Launch::async);
    });
  }
  template <Element T>
  void all_to_all(std::span<const T> in, std::span<T> out) {
    const std::size_t n = check_exchange(in.size(), out.size());
    blocking(CollOp::all_to_all, in.size_bytes(), [&] {
      return backend_.all_to_all(in.data(), out.data(), n, dtype_of<T>, Launch::blocking);
    });
  }

  // --- all_to_all_v: per-peer counts (see the file comment) ---------------------------------
  // send_counts[q] elements of in go to rank q, recv_counts[q] of out come from it, each side
  // packed in rank order; in and out may be longer than their counts' sums. Booked under
  // all_to_all: bytes is what this rank sends, bus_bytes what it sends to other ranks (the even
  // form's (N-1)/N).
  template <Element T>
  Work all_to_all_v_async(std::span<const T> in, std::span<const std::size_t> send_counts,
                          std::span<T> out, std::span<const std::size_t> recv_counts) {
    const auto [bytes, bus] =
        check_exchange_v(in.size(), send_counts, out.size(), recv_counts, sizeof(T));
    return issue(CollOp::all_to_all, bytes, bus, [&] {
      return backend_.all_to_all_v(in.data(), send_counts.data(), out.data(), recv_counts.data(),
                                   dtype_of<T>, Launch::async);
    });
  }
  template <Element T>
  void all_to_all_v(std::span<const T> in, std::span<const std::size_t> send_counts,
                    std::span<T> out, std::span<const std::size_t> recv_counts) {
    const auto [bytes, bus] =
        check_exchange_v(in.size(), send_counts, out.size(), recv_counts, sizeof(T));
    blocking(CollOp::all_to_all, bytes, bus, [&] {
      return backend_.all_to_all_v(in.data(), send_counts.data(), out.data(), recv_counts.data(),
                                   dtype_of<T>, Launch::blocking);
    });
  }

  // --- broadcast from root into every rank's buf: bytes over every link ---------------------
  // The root is checked by the backend (collectively on mpi, so a bad root on one rank is an
  // error on every rank instead of a job abort).
  template <Element T>
  Work broadcast_async(std::span<T> buf, int root) {
    return issue(CollOp::broadcast, buf.size_bytes(), [&] {
      return backend_.broadcast(buf.data(), buf.data(), buf.size(), dtype_of<T>, root,
                                Launch::async);
    });
  }
  template <Element T>
  void broadcast(std::span<T> buf, int root) {
    blocking(CollOp::broadcast, buf.size_bytes(), [&] {
      return backend_.broadcast(buf.data(), buf.data(), buf.size(), dtype_of<T>, root,
                                Launch::blocking);
    });
  }

  void barrier() {
    blocking(CollOp::barrier, 0, [&] { return backend_.barrier(Launch::blocking); });
  }

  // --- send / recv: point to point, buf.size_bytes() over one link ------------------------
  // send(buf, peer) is matched with peer's recv(buf', rank()), in order per (sender, receiver)
  // pair; both must have the same count and element type. Only the two ranks take part. A
  // blocking send returns once the peer's matching recv has the data (no buffering: two ranks
  // that both send before they recv deadlock, up to the backend's timeout; use send_async).
  // The async forms return at once; the buffer must stay untouched (send) or unread (recv)
  // until the Work completes. Errors: a bad peer or buffer is an invalid_argument on this rank
  // only; a count or type mismatch an invalid_argument on both ranks; a peer that never comes
  // the backend's timeout.
  template <Element T>
  Work send_async(std::span<const T> buf, int peer) {
    return issue(CollOp::send, buf.size_bytes(), [&] {
      return backend_.send(buf.data(), buf.size(), dtype_of<T>, peer, Launch::async);
    });
  }
  template <Element T>
  Work send_async(std::span<T> buf, int peer) {
    return send_async(std::span<const T>(buf), peer);
  }
  template <Element T>
  void send(std::span<const T> buf, int peer) {
    blocking(CollOp::send, buf.size_bytes(), [&] {
      return backend_.send(buf.data(), buf.size(), dtype_of<T>, peer, Launch::blocking);
    });
  }
  template <Element T>
  void send(std::span<T> buf, int peer) {
    send(std::span<const T>(buf), peer);
  }
  template <Element T>
  Work recv_async(std::span<T> buf, int peer) {
    return issue(CollOp::recv, buf.size_bytes(), [&] {
      return backend_.recv(buf.data(), buf.size(), dtype_of<T>, peer, Launch::async);
    });
  }
  template <Element T>
  void recv(std::span<T> buf, int peer) {
    blocking(CollOp::recv, buf.size_bytes(), [&] {
      return backend_.recv(buf.data(), buf.size(), dtype_of<T>, peer, Launch::blocking);
    });
  }

  // Sub-groups: ranks passing the same colour form a new communicator, ordered by (key, rank).
  // Collective over this communicator: every rank must call it.
  Collective split(int color, int key) {
    ZP_EXPECT(color >= 0, "split: colour must be >= 0, got ", color);
    return Collective(backend_.split(color, key));
  }

  // This rank's shard of a buffer cut into size() equal parts (the ZeRO layout).
  template <class T>
  std::span<T> shard(std::span<T> buf) const {
    ZP_EXPECT(buf.size() % std::size_t(size()) == 0, "shard: buffer of ", buf.size(),
              " elements does not divide into ", size(), " equal shards");
    const std::size_t n = buf.size() / std::size_t(size());
    return buf.subspan(std::size_t(rank()) * n, n);
  }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  void count(CollOp op, std::size_t bytes, double bus_bytes) {
    auto& s = (*stats_)[op];
    s.calls += 1;
    s.bytes += bytes;
    s.bus_bytes += bus_bytes;
  }
  template <class F>
  Work issue(CollOp op, std::size_t bytes, double bus_bytes, F&& launch) {
    const auto t = std::chrono::steady_clock::now();
    auto w = launch();
    count(op, bytes, bus_bytes);
    return Work(std::move(w), stats_.get(), op, t);
  }
  template <class F>
  Work issue(CollOp op, std::size_t bytes, F&& launch) {
    return issue(op, bytes, double(bytes) * bus_factor(op, size()), std::forward<F>(launch));
  }
  template <class F>
  void blocking(CollOp op, std::size_t bytes, double bus_bytes, F&& launch) {
    const auto t = std::chrono::steady_clock::now();
    launch().wait();
    count(op, bytes, bus_bytes);
    (*stats_)[op].seconds += seconds_since(t);
  }
  template <class F>
  void blocking(CollOp op, std::size_t bytes, F&& launch) {
    blocking(op, bytes, double(bytes) * bus_factor(op, size()), std::forward<F>(launch));
  }
  // all_to_all's block size: both buffers hold size() equal blocks.
  std::size_t check_exchange(std::size_t in, std::size_t out) const {
    ZP_EXPECT(in == out && in % std::size_t(size()) == 0, "all_to_all: input has ", in,
              " elements and output ", out, "; both must hold ", size(),
              " equal blocks (one per rank)");
    return in / std::size_t(size());
  }
  // all_to_all_v's counts: one per rank, sums within the buffers. Returns {bytes sent, bytes
  // sent to other ranks}.
  std::pair<std::size_t, double> check_exchange_v(std::size_t in,
                                                  std::span<const std::size_t> send_counts,
                                                  std::size_t out,
                                                  std::span<const std::size_t> recv_counts,
                                                  std::size_t element) const {
    const std::size_t n = std::size_t(size());
    ZP_EXPECT(send_counts.size() == n && recv_counts.size() == n, "all_to_all_v: expected ", n,
              " send and receive counts (one per rank), got ", send_counts.size(), " and ",
              recv_counts.size());
    std::size_t sends = 0, receives = 0;
    for (std::size_t q = 0; q < n; ++q) {
      ZP_EXPECT(!__builtin_add_overflow(sends, send_counts[q], &sends) &&
                    !__builtin_add_overflow(receives, recv_counts[q], &receives),
                "all_to_all_v: the counts up to rank ", q, " overflow a 64-bit size");
    }
    ZP_EXPECT(sends <= in && receives <= out, "all_to_all_v: the send counts add up to ", sends,
              " elements and the receive counts to ", receives, ", but the input has ", in,
              " and the output ", out);
    const std::size_t own = send_counts[std::size_t(rank())];
    return {sends * element, double((sends - own) * element)};
  }
  void check_scatter(const char* what, std::size_t full, std::size_t part) const {
    ZP_EXPECT(full == part * std::size_t(size()), what, ": the full buffer has ", full,
              " elements but the shard has ", part, " and there are ", size(),
              " ranks; expected full = ranks * shard = ", part * std::size_t(size()));
  }

  B backend_;
  // On the heap so pending Work handles keep a valid pointer when the Collective moves.
  std::unique_ptr<CommStats> stats_ = std::make_unique<CommStats>();
};

}  // namespace zp
