// zp/agreement.hpp: what the ranks of a group must agree on, checked so that a disagreement is an
// error on every rank, and a local failure inside a collective operation reaches every rank.
//
// Host values travel through the backend's memory (all_reduce_host, broadcast_host), so the
// same checks serve host and device backends. spread() is the one primitive: a MAX all_reduce
// over {v, -v} gives every rank the smallest and the largest of each value at once, so a rank
// whose value differs learns it, and so do the ranks that agree with each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "zp/collective.hpp"
#include "zp/detail/function_ref.hpp"
#include "zp/error.hpp"
#include "zp/memory.hpp"

namespace zp {

namespace detail {
template <Backend B, class T, class Op>
void via_backend_memory(std::span<T> x, Op&& op) {
  constexpr MemorySpace S = B::memory;
  if constexpr (S == MemorySpace::host) {
    op(x);
  } else {
    Buffer<T, S> d(x.size(), "host values staged for a collective");
    Memory<S>::from_host(d.span(), std::span<const T>(x));
    op(d.span());
    Memory<S>::to_host(x, std::span<const T>(d.span()));
  }
}
}  // namespace detail

// Collectives of values in host memory over any backend: on a device they go through device
// memory and the host waits for the result (a device backend's collectives only order its
// streams, so a host buffer would be read after the call returned).
template <Backend B, class T>
void all_reduce_host(Collective<B>& comm, std::span<T> x, ReduceOp op) {
  detail::via_backend_memory<B>(x, [&](std::span<T> s) { comm.all_reduce(s, op); });
}
template <Backend B, class T>
void broadcast_host(Collective<B>& comm, std::span<T> x, int root) {
  detail::via_backend_memory<B>(x, [&](std::span<T> s) { comm.broadcast(s, root); });
}

// The smallest and largest of one value over the ranks.
struct Spread {
  std::int64_t lo = 0, hi = 0;
  bool same() const noexcept { return lo == hi; }
};

// Every value's spread over the group, in one all_reduce of 2 * v.size() words. Values must be
// greater than INT64_MIN (their negation must exist).
template <Backend B>
std::vector<Spread> spread(Collective<B>& comm, std::span<const std::int64_t> v) {
  const std::size_t n = v.size();
  std::vector<std::int64_t> w(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    ZP_ASSERT(v[i] != INT64_MIN, "spread: value ", i,
              " is INT64_MIN, whose negation does not exist");
    w[i] = v[i];
    w[n + i] = -v[i];
  }
  all_reduce_host(comm, std::span<std::int64_t>(w), ReduceOp::max);
  std::vector<Spread> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = {-w[n + i], w[i]};
  return out;
}

// The index of the first fingerprint that is not the same on every rank, or h.size() when all
// are. Fingerprints compare in their top 62 bits.
template <Backend B>
std::size_t first_difference(Collective<B>& comm, std::span<const std::uint64_t> h) {
  std::vector<std::int64_t> v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) v[i] = std::int64_t(h[i] >> 2);
  const std::vector<Spread> s = spread(comm, std::span<const std::int64_t>(v));
  std::size_t i = 0;
  while (i < s.size() && s[i].same()) ++i;
  return i;
}

template <Backend B>
bool same_on_every_rank(Collective<B>& comm, std::uint64_t h) {
  const std::uint64_t one[] = {h};
  return first_difference(comm, std::span<const std::uint64_t>(one)) == std::size(one);
}

namespace detail {
// The ranks of the job comm's backend runs in (an MPI job's processes); 0 where it has no such
// notion (a thread rank's failure does not abort anything).
template <Backend B>
std::int64_t job_size(Collective<B>& comm) {
  if constexpr (requires { comm.backend().job_size(); })
    return comm.backend().job_size();
  else
    return 0;
}
// Rethrows err, which `ranks` ranks of comm's job agreed to raise together: where they are the
// whole job, recorded so (raised_on_every_rank) for the backend that would abort it. Only a
// zp::Error: the other ranks raise one of its category, so a handler treats all alike (a
// failing rank's bad_alloc could escape a handler of zp::Error that caught the others').
template <Backend B>
[[noreturn]] void rethrow_agreed(Collective<B>& comm, std::exception_ptr err, std::int64_t ranks) {
  if (ranks == job_size(comm)) {
    try {
      std::rethrow_exception(err);
    } catch (const Error& e) {
      raised_on_every_rank(e.what());
    } catch (...) {
    }
  }
  std::rethrow_exception(err);
}
}  // namespace detail

// Runs the local part f of a collective operation on every rank; if it throws on any rank, every
// rank throws: a failing rank its own error, the others one naming the first failing rank, its
// error's category and (at most 4 KiB of) its message. f must not communicate. word: one element
// of the backend's memory for the check that runs every time, so that the call allocates
// nothing unless a rank failed (empty: staged through a fresh buffer). Compiled once per
// backend, not per caller's f (a FunctionRef).
template <Backend B>
void on_every_rank(Collective<B>& comm, detail::FunctionRef<void()> f,
                   std::span<double> word = {}) {
  detail::every_rank_handled();  // an agreed error before this one was handled
  std::exception_ptr err;
  std::string msg;
  Errc category = Errc::io;
  try {
    f();
  } catch (const Error& e) {
    err = std::current_exception();
    msg = e.message();
    category = e.category();
  } catch (const std::exception& e) {
    err = std::current_exception();
    msg = e.what();
    category = Errc::backend;
  } catch (...) {  // a user callback's: still agreed on, or the other ranks would wait
    err = std::current_exception();
    msg = "an exception not derived from std::exception";
    category = Errc::backend;
  }
  std::int64_t first = err ? comm.rank() : comm.size();
  if (word.empty()) {
    all_reduce_host(comm, std::span<std::int64_t>(&first, 1), ReduceOp::min);
  } else {  // rank numbers are exact in a double
    double x = double(first);
    Memory<B::memory>::from_host(word.first(1), std::span<const double>(&x, 1));
    comm.all_reduce(word.first(1), ReduceOp::min);
    Memory<B::memory>::to_host(std::span<double>(&x, 1), std::span<const double>(word.first(1)));
    first = std::int64_t(x);
  }
  if (first == comm.size()) return;
  std::int64_t head[2] = {0, 0};
  if (comm.rank() == first)
    head[0] = std::int64_t(category),
    head[1] = std::int64_t(std::min<std::size_t>(msg.size(), 4096));
  broadcast_host(comm, std::span<std::int64_t>(head), int(first));
  std::vector<std::int64_t> words((std::size_t(head[1]) + 7) / 8, 0);
  if (comm.rank() == first) std::memcpy(words.data(), msg.data(), std::size_t(head[1]));
  broadcast_host(comm, std::span<std::int64_t>(words), int(first));
  std::string text(std::size_t(head[1]), '\0');
  std::memcpy(text.data(), words.data(), text.size());
  if (!err)
    err = std::make_exception_ptr(
        Error(Errc(head[0]), detail::cat("rank ", first, " failed: ", text)));
  detail::rethrow_agreed(comm, err, comm.size());
}

namespace detail {
// on_every_rank over groups that make up a grid, passed on group by group: a failure on any rank
// of the grid is an error on every rank. The groups must be orthogonal (each rank in one group of
// each kind, as a ProcessGrid's dp() and model_parallel(); null ones skipped): their sizes'
// product is then the grid's, which decides whether the whole job raised it.
template <Backend B>
void on_every_rank_of(std::initializer_list<Collective<B>*> groups, detail::FunctionRef<void()> f,
                      std::span<double> word = {}) {
  std::exception_ptr err;
  bool first = true;
  std::int64_t ranks = 1;
  Collective<B>* one = nullptr;  // (for the job's size)
  for (Collective<B>* g : groups) {
    if (!g) continue;
    try {
      if (first)
        on_every_rank(*g, f, word);
      else
        on_every_rank(
            *g,
            [&] {
              if (err) std::rethrow_exception(err);
            },
            word);
    } catch (...) {
      err = std::current_exception();
    }
    first = false;
    ranks *= g->size();
    one = g;
  }
  if (err) rethrow_agreed(*one, err, ranks);
}
}  // namespace detail

// on_every_rank over an engine's grid: its data-parallel group (the shard group, then the
// replicas), then its model-parallel group.
template <class E>
void on_every_grid_rank(E& engine, detail::FunctionRef<void()> f, std::span<double> word = {}) {
  detail::on_every_rank_of({&engine.comm(), engine.replicas(), engine.model_parallel()}, f, word);
}

}  // namespace zp
