// zp/backend/threads.hpp: ranks are threads of one process sharing host memory.
//
// The embedded default and the way zp's tests run many ranks. Collectives work directly on the
// ranks' own buffers, with no staging copies: at each operation the ranks publish their buffer
// pointers, then rank r reduces (or copies) its slice across all ranks' buffers and writes the
// result wherever it belongs, then the ranks meet again so no buffer is released early.
//
// Waiting spins briefly only when there are no more ranks than cores, then sleeps on a
// condition variable, so 8 ranks on 2 cores do not burn the CPU. Failure: a rank that throws
// (under run_threads) or leaves (its backend is destroyed) poisons the communicator, and every
// rank waiting in it throws zp::Error(Errc::aborted) naming the cause; a rank that waits longer
// than Options::timeout throws Errc::timeout and poisons it too. Mismatched calls, calls with
// bad arguments (detail::check_call), and calls where a buffer one rank writes overlaps a buffer
// of another rank (threads_detail::check_disjoint: the ranks share one address space) are an
// invalid_argument on every rank naming the ranks' calls, the argument or both buffers, and the
// communicator stays usable (as with mpi).
//
// Lifetime and threads: a Work handle destroyed without wait() waits in its destructor, so an
// operation never touches a buffer after its handle is gone. Once an operation's ranks have met,
// it runs to the end even if the communicator is poisoned meanwhile: no rank returns while
// another still reads or writes its buffers. Each rank of a World has at most one backend, and
// its calls come from one thread at a time; a second backend for the same rank, or two threads
// calling as one rank at once, is an error.
//
// Options::link simulates a slow network between nodes of ranks (for benches): a collective
// whose ranks span nodes is held until its cross-node bytes would have crossed it.
//
// send/recv: only the pair meets, never the world. Every ordered pair (src, dst) has a channel
// holding the sends and the recvs posted but not yet matched, with a message counter per side;
// the k-th send posted by src to dst meets the k-th recv posted by dst from src (MPI's
// non-overtaking order). Whichever of the two is posted second copies the data from the sender's
// buffer into the receiver's (under the channel's lock, so a message is either untouched or
// complete) and completes both handles; a count or type mismatch, or a recv buffer that
// overlaps the send buffer, completes both with an invalid_argument naming both calls (or both
// buffers) instead, copying nothing. Posting never blocks: an async send or recv is posted, in
// issue order, by the rank's progress thread, and a blocking one by the caller, which then waits
// for its match. So two ranks that both send_async before they recv do not deadlock; two
// blocking sends to each other do (there is no buffering), until the timeout. Waiting for the
// match takes at most Options::timeout from posting; then the message is withdrawn, the
// communicator poisoned, and the waiter throws Errc::timeout naming both ranks, the operation,
// the call and the message number. Poisoning (a rank that throws or leaves) withdraws every
// unmatched message and completes it with Errc::aborted.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "zp/collective.hpp"
#include "zp/detail/function_ref.hpp"
#include "zp/detail/progress.hpp"
#include "zp/detail/reduce.hpp"
#include "zp/detail/spin.hpp"
#include "zp/error.hpp"
#include "zp/work.hpp"

namespace zp::backend {

class Threads;
class World;

namespace threads_detail {

// What one rank asked for in the current operation; compared across ranks to catch mismatches.
struct Call {
  CollOp op{};
  const void* src = nullptr;
  void* dst = nullptr;
  std::size_t count = 0;
  DType dtype{};
  ReduceOp reduce{};
  int root = 0;
  int color = -1;  // split only (op == barrier)
  int key = 0;
  // What the rank is doing: a collective, split, or leaving run_threads' function (so a rank
  // that returns early is named as such, not as a barrier the user never called).
  enum class Kind : std::uint8_t { op, split, finish } kind = Kind::op;
  std::string rejected = {};  // why this rank's arguments failed check_call ("" if they did not)
  const void* ext = nullptr;  // a backend built on this world (meet()): the rank's own state
  // all_to_all_v (op all_to_all, count 0): the counts per rank, copied at the call (so async
  // operations keep them); empty where the caller passed none.
  bool exchange_v = false;
  std::vector<std::size_t> sends = {}, recvs = {};

  std::string describe() const {
    if (kind == Kind::finish) return "returned from its function (run_threads)";
    if (kind == Kind::split) return detail::cat("called split(color=", color, ", key=", key, ")");
    if (exchange_v) return detail::cat("called all_to_all_v(dtype=", name(dtype), ")");
    return detail::cat("called ", name(op), "(count=", count, ", dtype=", name(dtype),
                       ", op=", name(reduce), ", root=", root, ")");
  }
};

// An all_to_all_v call of a communicator of n ranks (the counts copied).
inline Call exchange_v_call(const void* src, const std::size_t* send_counts, void* dst,
                            const std::size_t* recv_counts, DType t, int n) {
  Call c{CollOp::all_to_all, src, dst, 0, t};
  c.exchange_v = true;
  if (send_counts) c.sends.assign(send_counts, send_counts + n);
  if (recv_counts) c.recvs.assign(recv_counts, recv_counts + n);
  return c;
}

// The argument checks of one rank's call (detail::check_call or check_exchange_v).
inline std::string check(const Call& c, int rank, int n) {
  if (!c.exchange_v)
    return detail::check_call(c.op, c.src, c.dst, c.count, c.dtype, c.reduce, c.root, rank, n);
  return detail::check_exchange_v(c.src, c.sends.empty() ? nullptr : c.sends.data(), c.dst,
                                  c.recvs.empty() ? nullptr : c.recvs.data(), c.dtype, n);
}

// all_to_all_v: every rank's send count to q against q's receive count from it (the calls are
// well-formed). "" when all agree, else the first pair that does not (the same on every rank).
inline std::string check_counts(const std::vector<Call>& calls) {
  const std::size_t n = calls.size();
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t q = 0; q < n; ++q) {
      std::string why =
          detail::check_block_agrees(int(r), int(q), calls[r].sends[q], calls[q].recvs[r]);
      if (!why.empty()) return why;
    }
  return {};
}

// The bytes a rank's call reads (its input) and writes (its output) in a collective of n ranks;
// {nullptr, 0} for none. broadcast reads only the root's input.
struct Extent {
  const void* at = nullptr;
  std::size_t bytes = 0;
};
inline std::pair<Extent, Extent> extents(const Call& c, int rank, int n) {
  if (c.kind != Call::Kind::op || c.op == CollOp::barrier) return {};
  const std::size_t part = c.count * size_of(c.dtype), full = part * std::size_t(n);
  if (c.exchange_v)
    return {{c.src, detail::block_offset(c.sends.data(), n) * size_of(c.dtype)},
            {c.dst, detail::block_offset(c.recvs.data(), n) * size_of(c.dtype)}};
  switch (c.op) {
    case CollOp::reduce_scatter: return {{c.src, full}, {c.dst, part}};
    case CollOp::all_gather: return {{c.src, part}, {c.dst, full}};
    case CollOp::all_to_all: return {{c.src, full}, {c.dst, full}};
    case CollOp::broadcast:
      return {{rank == c.root ? c.src : nullptr, rank == c.root ? part : 0}, {c.dst, part}};
    default: return {{c.src, part}, {c.dst, part}};
  }
}
inline bool overlap(Extent a, Extent b) {
  const auto x = reinterpret_cast<std::uintptr_t>(a.at), y = reinterpret_cast<std::uintptr_t>(b.at);
  return a.bytes && b.bytes && x < y + b.bytes && y < x + a.bytes;
}
inline std::string describe_buffer(const char* side, int rank, Extent e) {
  return detail::cat("rank ", rank, "'s ", side, " [", e.at, ", +", e.bytes, " bytes)");
}

// Ranks are threads of one address space, so one rank's buffers can overlap another's. A buffer
// a rank writes must not overlap any buffer of another rank (the ranks' copies and reductions
// would race, or memcpy between overlapping ranges); reading the same input is fine. Within one
// rank, check_call allows only the in-place forms. "" when disjoint, else the first conflict
// (the same on every rank, which all see every call, so they throw together).
inline std::string check_disjoint(const std::vector<Call>& calls) {
  const int n = int(calls.size());
  for (int r = 0; r < n; ++r) {
    const Extent out = extents(calls[std::size_t(r)], r, n).second;
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      const auto [in_q, out_q] = extents(calls[std::size_t(q)], q, n);
      for (const auto& [side, e] : {std::pair{"output", out_q}, std::pair{"input", in_q}})
        if (overlap(out, e))
          return detail::cat(
              name(calls[std::size_t(r)].op), ": ", describe_buffer("output", r, out), " overlaps ",
              describe_buffer(side, q, e),
              "; a buffer one rank writes must not overlap another rank's "
              "buffers (in place is only one rank's own input and output, collective.hpp)");
    }
  }
  return {};
}

// The completion of one operation, shared by its Work handle and whoever completes it (the
// progress thread for collectives, the matching peer for send/recv).
struct Op;  // a pending operation, below World

struct WorkState : detail::Completion {
  bool spin = false;  // send/recv with a core to spare: spin briefly before sleeping
  // send/recv only, set when the message is posted unmatched: when the waiter gives up, and
  // the world whose channel to withdraw the message from (weak: a channel's entries hold their
  // states, so a strong pointer would be a cycle).
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::weak_ptr<World> world;
  bool is_send = false;
  int src = 0, dst = 0;
};

// A send or recv posted on a channel and not yet matched.
struct Message {
  const void* src = nullptr;  // send: the data
  void* dst = nullptr;        // recv: where it goes
  std::size_t count = 0;
  DType dtype{};
  std::uint64_t call = 0;  // the poster's operation number (call #)
  std::uint64_t seq = 0;   // its number on the channel, from 1 (message #)
  std::shared_ptr<WorkState> state;
};

// The messages from one rank to another. Only one of the queues is ever non-empty: a post
// that finds the other side waiting matches it instead of queueing.
struct Channel {
  std::mutex m;
  std::deque<Message> sends, recvs;
  std::uint64_t sent = 0, received = 0;  // posted so far, per side
};

}  // namespace threads_detail

struct ThreadsOptions {
  // How long a rank waits for its peers inside one operation before it gives up.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // A simulated network between nodes, to measure what cross-node traffic would cost (benches):
  // the world's ranks form nodes of `ranks_per_node` consecutive ranks (sub-groups keep their
  // ranks' nodes), and each rank's collective lasts at least the bytes it reads from or writes to
  // ranks of other nodes (its own data movement here: all_gather, reduce_scatter and all_to_all
  // read a block from each such rank, all_reduce reads and writes its slice there, broadcast
  // reads the root's buffer) over `bytes_per_second`, its own link. Off while either is 0;
  // send and recv are never delayed.
  struct Link {
    int ranks_per_node = 0;
    double bytes_per_second = 0;
  } link = {};
};

// The state the ranks of one communicator share. Created by run_threads (or World::create for
// callers that manage their own threads) and held by every rank's backend.
class World {
 public:
  using Options = ThreadsOptions;

  static std::shared_ptr<World> create(int ranks, Options opt = {}) {
    ZP_EXPECT(ranks >= 1, "threads backend: world size must be >= 1, got ", ranks);
    ZP_EXPECT(opt.link.ranks_per_node >= 0 && opt.link.bytes_per_second >= 0 &&
                  std::isfinite(opt.link.bytes_per_second),
              "threads backend: the simulated link needs ranks_per_node >= 0 and a finite "
              "bytes_per_second >= 0, got ",
              opt.link.ranks_per_node, " and ", opt.link.bytes_per_second);
    auto w = std::shared_ptr<World>(new World(ranks, opt));
    for (int r = 0; r < ranks; ++r)
      w->node_[std::size_t(r)] = opt.link.ranks_per_node ? r / opt.link.ranks_per_node : 0;
    return w;
  }

  int size() const { return n_; }
  const Options& options() const { return opt_; }
  bool poisoned() const { return poisoned_.load(std::memory_order_acquire); }

  // Marks the communicator failed; the first reason wins and is what every rank reports.
  // Unmatched sends and recvs are withdrawn and fail with Errc::aborted.
  void poison(const std::string& why) {
    bool first = false;
    {
      std::lock_guard lk(m_);
      if (!poisoned_.load(std::memory_order_relaxed)) {
        reason_ = why;
        poisoned_.store(true, std::memory_order_release);
        first = true;
      }
    }
    cv_.notify_all();
    if (!first) return;
    // After the flag: a post checks it under its channel's lock, so every message is either
    // refused there or still queued when the channel is swept here.
    for (std::size_t i = 0; i < std::size_t(n_) * std::size_t(n_); ++i) {
      const int src = int(i / std::size_t(n_)), dst = int(i % std::size_t(n_));
      std::lock_guard lk(channels_[i].m);
      for (auto* q : {&channels_[i].sends, &channels_[i].recvs}) {
        const bool sends = q == &channels_[i].sends;
        for (auto& msg : *q) msg.state->complete(p2p_aborted(sends, src, dst, msg.call, why));
        q->clear();
      }
    }
  }
  std::string reason() const {
    std::lock_guard lk(m_);
    return reason_;
  }

 private:
  friend class Threads;
  friend struct threads_detail::Op;  // expire()
  World(int n, Options opt)
      : n_(n),
        opt_(opt),
        calls_(std::size_t(n)),
        seqs_(std::size_t(n), 0),
        split_(std::size_t(n)),
        owned_(std::size_t(n), false),
        node_(std::size_t(n), 0),
        busy_(new std::atomic<bool>[std::size_t(n)]),
        channels_(new threads_detail::Channel[std::size_t(n) * std::size_t(n)]) {
    for (int r = 0; r < n; ++r) busy_[std::size_t(r)].store(false, std::memory_order_relaxed);
  }

  // One backend per rank: two would meet each other in rendezvous instead of their peers.
  void claim(int rank) {
    std::lock_guard lk(m_);
    ZP_EXPECT(!owned_[std::size_t(rank)], "threads backend: rank ", rank,
              " of this world already has a backend; two backends for one rank would meet each "
              "other instead of their peers (move the existing one instead)");
    owned_[std::size_t(rank)] = true;
  }

  // Held while a rank issues a call (see detail::OneCaller).
  detail::OneCaller busy(int rank, const char* what) {
    return detail::OneCaller(busy_[std::size_t(rank)], "threads", what, rank);
  }

  threads_detail::Channel& channel(int src, int dst) {
    return channels_[std::size_t(src) * std::size_t(n_) + std::size_t(dst)];
  }

  std::exception_ptr p2p_aborted(bool is_send, int src, int dst, std::uint64_t call,
                                 const std::string& why) const {
    return std::make_exception_ptr(
        Error(Errc::aborted,
              is_send ? detail::cat("threads backend: rank ", src, " in send to rank ", dst,
                                    " (call #", call, "): the communicator was poisoned: ", why)
                      : detail::cat("threads backend: rank ", dst, " in recv from rank ", src,
                                    " (call #", call, "): the communicator was poisoned: ", why)));
  }

  // Posts rank `rank`'s send (to `peer`) or recv (from `peer`) on their channel: it meets the
  // other side's oldest unmatched message, copying and completing both, or waits in the queue
  // for it. Never blocks beyond the channel's lock; the result arrives in `state`.
  static void post(const std::shared_ptr<World>& self, int rank, bool is_send, int peer,
                   threads_detail::Message mine) {
    World& w = *self;
    const int src = is_send ? rank : peer, dst = is_send ? peer : rank;
    mine.call = ++w.seqs_[std::size_t(rank)];
    threads_detail::Channel& ch = w.channel(src, dst);
    std::unique_lock lk(ch.m);
    if (w.poisoned()) {
      mine.state->complete(w.p2p_aborted(is_send, src, dst, mine.call, w.reason()));
      return;
    }
    mine.seq = is_send ? ++ch.sent : ++ch.received;
    auto& theirs = is_send ? ch.recvs : ch.sends;
    if (theirs.empty()) {
      {
        std::lock_guard slk(mine.state->m);
        mine.state->deadline = detail::deadline_after(w.opt_.timeout);
        mine.state->world = self;
        mine.state->is_send = is_send;
        mine.state->src = src;
        mine.state->dst = dst;
      }
      mine.state->cv.notify_all();  // a waiter that found no deadline yet takes this one
      (is_send ? ch.sends : ch.recvs).push_back(std::move(mine));
      return;
    }
    threads_detail::Message other = std::move(theirs.front());
    theirs.pop_front();
    const auto& s = is_send ? mine : other;
    const auto& r = is_send ? other : mine;
    // A mistake the pair can see fails both sides, naming both calls, and copies nothing.
    const auto refuse = [&](const std::string& why) {
      // One exception object per side, each made before it is published: a temporary Error
      // still alive after complete() would share its message buffer (libstdc++'s
      // reference-counted runtime_error string) with the waiter's copy across threads.
      auto to_sender = std::make_exception_ptr(Error(Errc::invalid_argument, why));
      auto to_receiver = std::make_exception_ptr(Error(Errc::invalid_argument, why));
      s.state->complete(std::move(to_sender));
      r.state->complete(std::move(to_receiver));
    };
    const std::string message =
        detail::cat("(message #", s.seq, " from rank ", src, " to rank ", dst, "): ");
    if (s.count != r.count || s.dtype != r.dtype)
      return refuse(detail::cat("threads backend: mismatched send/recv ", message, "rank ", src,
                                " called send(count=", s.count, ", dtype=", name(s.dtype),
                                ", peer=", dst, ") (call #", s.call, ") but rank ", dst,
                                " called recv(count=", r.count, ", dtype=", name(r.dtype),
                                ", peer=", src, ") (call #", r.call,
                                "); the count and element type of a send and its recv must agree"));
    const threads_detail::Extent from{s.src, s.count * size_of(s.dtype)}, into{r.dst, from.bytes};
    if (threads_detail::overlap(from, into))
      return refuse(detail::cat("threads backend: send/recv ", message,
                                threads_detail::describe_buffer("recv buffer", dst, into),
                                " overlaps ",
                                threads_detail::describe_buffer("send buffer", src, from),
                                "; the buffers of a send and its recv must be disjoint"));
    if (s.count) std::memcpy(r.dst, s.src, from.bytes);
    s.state->complete(nullptr);
    r.state->complete(nullptr);
  }

  // The waiter of an unmatched message gave up: withdraws it (unless it was matched meanwhile),
  // fails it with Errc::timeout and poisons the communicator.
  void expire(threads_detail::WorkState* st) {
    threads_detail::Channel& ch = channel(st->src, st->dst);
    std::string why;
    {
      std::lock_guard lk(ch.m);
      auto& q = st->is_send ? ch.sends : ch.recvs;
      auto it =
          std::find_if(q.begin(), q.end(), [&](const auto& m) { return m.state.get() == st; });
      if (it == q.end()) return;  // matched (or swept) under this lock: the state is complete
      why = st->is_send ? detail::cat("rank ", st->src, " timed out after ", opt_.timeout.count(),
                                      " ms in send to rank ", st->dst, " (call #", it->call,
                                      ", message #", it->seq, " from rank ", st->src, " to rank ",
                                      st->dst, ") waiting for rank ", st->dst, " to recv it")
                        : detail::cat("rank ", st->dst, " timed out after ", opt_.timeout.count(),
                                      " ms in recv from rank ", st->src, " (call #", it->call,
                                      ", message #", it->seq, " from rank ", st->src, " to rank ",
                                      st->dst, ") waiting for rank ", st->src, " to send it");
      const auto state = it->state;
      q.erase(it);
      auto e =
          std::make_exception_ptr(Error(Errc::timeout, "threads backend: " + why));  // see post()
      state->complete(std::move(e));
    }
    poison(why);
  }

  [[noreturn]] void throw_poisoned(int rank, const threads_detail::Call& c) const {
    throw Error(Errc::aborted, detail::cat("threads backend: rank ", rank, " in ", name(c.op),
                                           " (call #", seq_of(rank),
                                           "): the communicator was "
                                           "poisoned: ",
                                           reason()));
  }
  std::uint64_t seq_of(int rank) const { return seqs_[std::size_t(rank)]; }

  // Counts this rank in (m_ held): the last of the n completes the generation, releases the lock
  // and wakes the others (returns true); the others learn the generation they wait to end.
  bool count_in(std::unique_lock<std::mutex>& lk, std::uint64_t& gen) {
    gen = generation_.load(std::memory_order_relaxed);
    if (++arrived_ != n_) return false;
    arrived_ = 0;
    generation_.store(gen + 1, std::memory_order_release);
    lk.unlock();
    cv_.notify_all();
    return true;
  }

  // Rendezvous of all ranks. Throws if the communicator is or becomes poisoned, or on timeout.
  void arrive(int rank, const threads_detail::Call& c) {
    std::unique_lock lk(m_);
    if (poisoned_.load(std::memory_order_relaxed)) {
      lk.unlock();
      throw_poisoned(rank, c);
    }
    std::uint64_t gen = 0;
    if (count_in(lk, gen)) return;
    lk.unlock();
    spin_while(gen, true);
    lk.lock();
    const auto deadline = detail::deadline_after(opt_.timeout);
    const auto met = [&] {
      return generation_.load(std::memory_order_relaxed) != gen ||
             poisoned_.load(std::memory_order_relaxed);
    };
    bool done = true;
    if (deadline == std::chrono::steady_clock::time_point::max())
      cv_.wait(lk, met);
    else
      done = cv_.wait_until(lk, deadline, met);
    if (generation_.load(std::memory_order_relaxed) != gen)
      return;  // completed, even if poisoned later
    lk.unlock();
    if (!done) {
      const std::string why =
          detail::cat("rank ", rank, " timed out after ", opt_.timeout.count(), " ms in ",
                      name(c.op), " (call #", seq_of(rank), ") waiting for the other ranks");
      poison(why);
      throw Error(Errc::timeout, "threads backend: " + why);
    }
    throw_poisoned(rank, c);
  }

  // The rendezvous that ends an operation whose ranks have all met in arrive(): it ignores
  // poison and timeouts, because every one of them is already on its way here (bodies never
  // block) and returning early would release buffers another rank is still reading.
  void depart() {
    std::unique_lock lk(m_);
    std::uint64_t gen = 0;
    if (count_in(lk, gen)) return;
    lk.unlock();
    spin_while(gen, false);
    lk.lock();
    cv_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != gen; });
  }

  // Spins a little while generation `gen` lasts, when every rank can have its own core: an
  // operation's two rendezvous then cost microseconds instead of a sleep and wake-up.
  void spin_while(std::uint64_t gen, bool until_poisoned) const {
    if (!detail::spin_pays(n_)) return;
    detail::spin_until([&] {
      return generation_.load(std::memory_order_acquire) != gen || (until_poisoned && poisoned());
    });
  }

  int n_;
  Options opt_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> poisoned_{false};
  std::string reason_;
  std::vector<threads_detail::Call> calls_;    // slot r: rank r's current call
  std::vector<std::uint64_t> seqs_;            // operations issued, per rank (for messages)
  std::vector<std::shared_ptr<World>> split_;  // split results, by the group's first rank
  std::vector<bool> owned_;                    // ranks that have a backend (guarded by m_)
  std::vector<int> node_;                      // each rank's node (Options::link)
  std::unique_ptr<std::atomic<bool>[]> busy_;  // ranks inside a call (see busy())
  std::unique_ptr<threads_detail::Channel[]> channels_;  // send/recv, slot src * n + dst
};

namespace threads_detail {
// A pending operation of the threads backend (the Op of zp::Work): the host waits for the
// progress thread (collectives, posts) or for the peer (a posted send or recv).
struct Op {
  std::shared_ptr<WorkState> s;

  explicit operator bool() const noexcept { return s != nullptr; }
  void finish() {
    const auto st = std::move(s);
    std::exception_ptr error;
    // A message's peer is often microseconds away: a short spin saves a sleep and wake-up.
    if (st->spin) detail::spin_until([&] { return st->ready.load(std::memory_order_acquire); });
    {
      std::unique_lock lk(st->m);
      while (!st->done) {
        // Collectives time out inside their rendezvous; an unmatched send or recv has only its
        // waiter to notice that the peer never came (its deadline is set when posted).
        if (st->deadline == std::chrono::steady_clock::time_point::max()) {
          st->cv.wait(lk);
        } else if (st->cv.wait_until(lk, st->deadline) == std::cv_status::timeout && !st->done) {
          const auto world = st->world.lock();
          lk.unlock();
          if (world) world->expire(st.get());
          lk.lock();
          if (!world) st->cv.wait(lk, [&] { return st->done; });
        }
      }
      // Moved out, so the exception is released by this thread alone, never concurrently by the
      // progress thread dropping its job.
      error = std::move(st->error);
    }
    if (error) std::rethrow_exception(error);
  }
  bool done() {
    {
      std::lock_guard lk(s->m);
      if (!s->done) return false;
    }
    finish();
    return true;
  }
  void drop() noexcept {
    try {
      if (s) finish();
    } catch (...) {
    }
  }
};

struct Finish;  // lets run_threads end a rank (Threads::finish is private)
}  // namespace threads_detail

// The backend. One per rank; move-only. Destroying it while it is still a member (not moved
// from) tells the other ranks it has left: any of them still inside, or later entering, a
// collective fails instead of waiting for it.
class Threads {
 public:
  static constexpr MemorySpace memory = MemorySpace::host;
  static constexpr const char* name = "threads";

  // An operation's handle (work.hpp): waited on, destroyed or assigned over, the host waits.
  using Work = zp::Work<threads_detail::Op>;

  Threads(std::shared_ptr<World> world, int rank) : world_(std::move(world)), rank_(rank) {
    ZP_EXPECT(world_ != nullptr, "threads backend: null world");
    ZP_EXPECT(rank >= 0 && rank < world_->size(), "threads backend: rank ", rank, " is not in [0, ",
              world_->size(), ")");
    world_->claim(rank);
  }
  Threads(Threads&& o) noexcept
      : world_(std::move(o.world_)), rank_(o.rank_), progress_(std::move(o.progress_)) {}
  Threads& operator=(Threads&& o) noexcept {
    if (this != &o) {
      leave();
      world_ = std::move(o.world_);
      rank_ = o.rank_;
      progress_ = std::move(o.progress_);
    }
    return *this;
  }
  ~Threads() { leave(); }

  int rank() const { return rank_; }
  int size() const { return world_->size(); }
  World& world() { return *world_; }

  Work all_reduce(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch l) {
    return submit({CollOp::all_reduce, src, dst, n, t, op}, l);
  }
  Work reduce_scatter(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch l) {
    return submit({CollOp::reduce_scatter, src, dst, n, t, op}, l);
  }
  Work all_gather(const void* src, void* dst, std::size_t n, DType t, Launch l) {
    return submit({CollOp::all_gather, src, dst, n, t}, l);
  }
  Work all_to_all(const void* src, void* dst, std::size_t n, DType t, Launch l) {
    return submit({CollOp::all_to_all, src, dst, n, t}, l);
  }
  Work all_to_all_v(const void* src, const std::size_t* send_counts, void* dst,
                    const std::size_t* recv_counts, DType t, Launch l) {
    return submit(threads_detail::exchange_v_call(src, send_counts, dst, recv_counts, t, size()),
                  l);
  }
  Work broadcast(const void* src, void* dst, std::size_t n, DType t, int root, Launch l) {
    threads_detail::Call c{CollOp::broadcast, src, dst, n, t};
    c.root = root;
    return submit(c, l);
  }
  Work barrier(Launch l) { return submit({CollOp::barrier}, l); }

  // Point to point (see the file comment): only this rank and `peer` take part.
  Work send(const void* src, std::size_t n, DType t, int peer, Launch l) {
    threads_detail::Message m;
    m.src = src;
    m.count = n;
    m.dtype = t;
    return submit_p2p(CollOp::send, std::move(m), peer, l);
  }
  Work recv(void* dst, std::size_t n, DType t, int peer, Launch l) {
    threads_detail::Message m;
    m.dst = dst;
    m.count = n;
    m.dtype = t;
    return submit_p2p(CollOp::recv, std::move(m), peer, l);
  }

  // For backends built on this world (cuda_threads): c goes through the rendezvous of this
  // backend's collectives (one caller per rank, earlier async operations first, the calls and
  // their arguments checked on every rank, timeouts and poisoning), and body(calls) runs on every
  // rank between the two meetings, with every rank's call in view.
  template <class Body>
  void meet(threads_detail::Call c, Body&& body) {
    const auto busy = world_->busy(rank_, zp::name(c.op));
    c.rejected = threads_detail::check(c, rank_, size());
    drain();
    run(*world_, rank_, c, body);
  }

  Threads split(int color, int key) {
    const auto busy = world_->busy(rank_, "split");
    drain();
    threads_detail::Call c{CollOp::barrier};
    c.kind = threads_detail::Call::Kind::split;
    c.color = color;
    c.key = key;
    std::shared_ptr<World> mine;
    int my_rank = 0;
    run(*world_, rank_, c, [&](const Calls& calls) {
      std::vector<int> members;
      for (int r = 0; r < size(); ++r)
        if (calls[std::size_t(r)].color == color) members.push_back(r);
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
        return calls[std::size_t(a)].key < calls[std::size_t(b)].key;
      });
      my_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
      const int leader = *std::min_element(members.begin(), members.end());
      if (leader == rank_) {
        auto w = World::create(int(members.size()), world_->options());
        for (std::size_t i = 0; i < members.size(); ++i)
          w->node_[i] = world_->node_[std::size_t(members[i])];
        std::lock_guard lk(world_->m_);
        world_->split_[std::size_t(leader)] = w;
      }
      world_->depart();  // the leader has published the group
      {
        std::lock_guard lk(world_->m_);
        mine = world_->split_[std::size_t(leader)];
      }
    });
    return Threads(std::move(mine), my_rank);
  }

 private:
  using Calls = std::vector<threads_detail::Call>;

  // Async operations run, in issue order, on the rank's progress thread (detail::Progress); a
  // blocking call runs on the caller's thread once the earlier async ones are done, so the order
  // every rank sees is the order it issued.

  friend struct threads_detail::Finish;

  // run_threads' last rendezvous: every rank's function returned.
  void finish() {
    const auto busy = world_->busy(rank_, "finish");
    drain();
    threads_detail::Call c{CollOp::barrier};
    c.kind = threads_detail::Call::Kind::finish;
    run(*world_, rank_, c, [](const Calls&) {});
  }

  void drain() {
    if (progress_) progress_->drain();
  }

  void leave() {
    if (!world_) return;
    progress_.reset();  // finishes queued operations first
    if (!world_->poisoned())
      world_->poison(detail::cat("rank ", rank_,
                                 " left the communicator (its backend was "
                                 "destroyed) while other ranks may still call collectives"));
    world_.reset();
  }

  Work submit(threads_detail::Call c, Launch l) {
    const auto busy = world_->busy(rank_, zp::name(c.op));
    c.rejected = threads_detail::check(c, rank_, size());
    if (l == Launch::blocking) {
      drain();
      execute(*world_, rank_, c);
      return Work{};
    }
    if (!progress_) progress_ = std::make_unique<detail::Progress>();
    auto state = std::make_shared<threads_detail::WorkState>();
    progress_->post([w = world_, r = rank_, c, state] {
      std::exception_ptr err;
      try {
        execute(*w, r, c);
      } catch (...) {
        err = std::current_exception();
      }
      state->complete(std::move(err));  // the waiter alone releases the exception (Op::finish)
    });
    return Work(threads_detail::Op{std::move(state)});
  }

  // A bad argument is an error here, on this rank alone (its peer, if any, is not involved
  // yet). Otherwise the message is posted, by the caller after the earlier async operations
  // (blocking) or by the progress thread in issue order (async); posting never waits, so the
  // progress thread moves on to the next operation while the message waits for its match.
  Work submit_p2p(CollOp op, threads_detail::Message m, int peer, Launch l) {
    const auto busy = world_->busy(rank_, zp::name(op));
    const bool is_send = op == CollOp::send;
    const std::string bad =
        detail::check_p2p(op, is_send ? m.src : m.dst, m.count, m.dtype, peer, rank_, size());
    if (!bad.empty()) throw Error(Errc::invalid_argument, "threads backend: " + bad);
    auto state = std::make_shared<threads_detail::WorkState>();
    state->spin = detail::spin_pays(2);  // the two ranks of the pair
    m.state = state;
    if (l == Launch::blocking) {
      drain();
      World::post(world_, rank_, is_send, peer, std::move(m));
      threads_detail::Op{std::move(state)}.finish();
      return Work{};
    }
    if (!progress_) progress_ = std::make_unique<detail::Progress>();
    progress_->post([w = world_, r = rank_, is_send, peer, m = std::move(m)]() mutable {
      World::post(w, r, is_send, peer, std::move(m));
    });
    return Work(threads_detail::Op{std::move(state)});
  }

  // Publishes this rank's call, meets the others, checks that all calls agree, runs body, and
  // meets again so no rank's buffers are released while another still reads or writes them.
  // Static, over (world, rank), because async jobs outlive moves of the backend object.
  // A call rejected by check_call still meets the others, so every rank throws the same
  // invalid_argument and the communicator stays usable.
  template <class Body>
  static void run(World& w, int rank, const threads_detail::Call& c, Body&& body) {
    ++w.seqs_[std::size_t(rank)];
    w.calls_[std::size_t(rank)] = c;
    w.arrive(rank, c);
    const auto met = std::chrono::steady_clock::now();
    const Calls& calls = w.calls_;
    const auto& c0 = calls[0];
    for (int r = 1; r < w.size(); ++r) {
      const auto& cr = calls[std::size_t(r)];
      if (cr.op != c0.op || cr.kind != c0.kind || cr.count != c0.count || cr.dtype != c0.dtype ||
          cr.reduce != c0.reduce || cr.root != c0.root || cr.exchange_v != c0.exchange_v) {
        const std::string why = detail::cat(
            "mismatched collective calls: rank 0 ", c0.describe(), " but rank ", r, " ",
            cr.describe(), "; every rank must issue the same operations in the same order");
        w.depart();
        throw Error(Errc::invalid_argument, "threads backend: " + why);
      }
    }
    int first = -1;
    for (int r = 0; r < w.size() && first < 0; ++r)
      if (!calls[std::size_t(r)].rejected.empty()) first = r;
    std::string why =
        first < 0 ? (c.exchange_v ? threads_detail::check_counts(calls) : std::string())
        : !c.rejected.empty()
            ? c.rejected
            : detail::cat("rank ", first,
                          " rejected its arguments: ", calls[std::size_t(first)].rejected);
    if (why.empty() && first < 0) why = threads_detail::check_disjoint(calls);
    if (!why.empty()) {
      w.depart();
      throw Error(Errc::invalid_argument, "threads backend: " + why);
    }
    body(calls);
    if (const double link = w.opt_.link.bytes_per_second;
        link > 0 && c.kind == threads_detail::Call::Kind::op)
      std::this_thread::sleep_until(
          met + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(cross_node_bytes(w, c, rank) / link)));
    w.depart();
  }

  // What this rank's part of c moves between its node and others (ThreadsOptions::link).
  static double cross_node_bytes(const World& w, const threads_detail::Call& c, int rank) {
    const int n = w.size();
    const double es = double(size_of(c.dtype));
    const auto [lo, hi] = detail::rank_slice(c.count, rank, n);
    double bytes = 0;
    for (int q = 0; q < n; ++q) {
      if (w.node_[std::size_t(q)] == w.node_[std::size_t(rank)]) continue;
      switch (c.op) {
        case CollOp::all_reduce: bytes += 2.0 * double(hi - lo) * es; break;
        case CollOp::reduce_scatter:
        case CollOp::all_gather: bytes += double(c.count) * es; break;
        case CollOp::all_to_all:
          bytes += double(c.exchange_v ? c.recvs[std::size_t(q)] : c.count) * es;
          break;
        case CollOp::broadcast: bytes += q == c.root ? double(c.count) * es : 0; break;
        default: break;
      }
    }
    return bytes;
  }

  static void execute(World& w, int rank, const threads_detail::Call& c) {
    run(w, rank, c, [&](const Calls& calls) {
      if (c.op == CollOp::barrier) return;
      const int n = w.size();
      visit_dtype(c.dtype, [&](auto tag) {
        using T = decltype(tag);
        switch (c.op) {
          case CollOp::all_reduce: all_reduce_slice<T>(calls, c, rank, n); break;
          case CollOp::reduce_scatter: reduce_scatter_shard<T>(calls, c, rank, n); break;
          case CollOp::all_gather: all_gather_into<T>(calls, c, n); break;
          case CollOp::all_to_all:
            if (c.exchange_v)
              all_to_all_v_into<T>(calls, c, rank, n);
            else
              all_to_all_into<T>(calls, c, rank, n);
            break;
          case CollOp::broadcast: broadcast_into<T>(calls, c); break;
          case CollOp::barrier:
          case CollOp::send:
          case CollOp::recv: break;
        }
      });
    });
  }

  template <class T>
  static void all_reduce_slice(const Calls& calls, const threads_detail::Call& c, int rank, int n) {
    const auto [lo, hi] = detail::rank_slice(c.count, rank, n);
    if (lo == hi) return;
    std::vector<const T*> in(static_cast<std::size_t>(n));
    std::vector<T*> out(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      in[std::size_t(r)] = static_cast<const T*>(calls[std::size_t(r)].src) + lo;
      out[std::size_t(r)] = static_cast<T*>(calls[std::size_t(r)].dst) + lo;
    }
    detail::reduce_chunks(in.data(), n, out.data(), n, hi - lo, c.reduce);
  }

  template <class T>
  static void reduce_scatter_shard(const Calls& calls, const threads_detail::Call& c, int rank,
                                   int n) {
    const std::size_t off = std::size_t(rank) * c.count;
    std::vector<const T*> in(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r)
      in[std::size_t(r)] = static_cast<const T*>(calls[std::size_t(r)].src) + off;
    T* out = static_cast<T*>(c.dst);
    detail::reduce_chunks(in.data(), n, &out, 1, c.count, c.reduce);
  }

  template <class T>
  static void all_gather_into(const Calls& calls, const threads_detail::Call& c, int n) {
    T* out = static_cast<T*>(c.dst);
    for (int r = 0; r < n; ++r) {
      const T* src = static_cast<const T*>(calls[std::size_t(r)].src);
      T* dst = out + std::size_t(r) * c.count;
      if (src != dst && c.count) std::memcpy(dst, src, c.count * sizeof(T));
    }
  }

  // Each rank copies its block from every rank's input (the buffers never overlap: check_call,
  // check_disjoint).
  template <class T>
  static void all_to_all_into(const Calls& calls, const threads_detail::Call& c, int rank, int n) {
    if (!c.count) return;
    T* out = static_cast<T*>(c.dst);
    for (int r = 0; r < n; ++r)
      std::memcpy(out + std::size_t(r) * c.count,
                  static_cast<const T*>(calls[std::size_t(r)].src) + std::size_t(rank) * c.count,
                  c.count * sizeof(T));
  }

  // all_to_all_v: rank r's block for this rank (where r's send counts put it) into this rank's
  // block r.
  template <class T>
  static void all_to_all_v_into(const Calls& calls, const threads_detail::Call& c, int rank,
                                int n) {
    T* out = static_cast<T*>(c.dst);
    for (int r = 0; r < n; ++r) {
      const auto& from = calls[std::size_t(r)];
      const std::size_t k = c.recvs[std::size_t(r)];
      if (k)
        std::memcpy(out,
                    static_cast<const T*>(from.src) + detail::block_offset(from.sends.data(), rank),
                    k * sizeof(T));
      out += k;
    }
  }

  template <class T>
  static void broadcast_into(const Calls& calls, const threads_detail::Call& c) {
    const T* src = static_cast<const T*>(calls[std::size_t(c.root)].src);
    if (src != c.dst && c.count) std::memcpy(c.dst, src, c.count * sizeof(T));
  }

  std::shared_ptr<World> world_;
  int rank_ = 0;
  std::unique_ptr<detail::Progress> progress_;
};

static_assert(Backend<Threads>);

namespace threads_detail {
struct Finish {
  static void of(Threads& rank) { rank.finish(); }
};
}  // namespace threads_detail

// Runs fn(Collective<Threads>&) on `ranks` threads and joins them. If any rank throws, the
// communicator is poisoned so the others fail fast, and the first failure (not the aborts it
// caused) is rethrown here.
inline void run_threads(int ranks, detail::FunctionRef<void(Collective<Threads>&)> fn,
                        World::Options opt = {}) {
  auto world = World::create(ranks, opt);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::atomic<int> first{-1};
  std::vector<std::thread> threads;
  threads.reserve(std::size_t(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      // Constructed outside the try so the cause is published before the backend's
      // destructor reports this rank as gone.
      Collective<Threads> comm{Threads(world, r)};
      try {
        fn(comm);
        // Leaving normally is not a failure: wait for every rank to finish before the
        // communicator is torn down.
        threads_detail::Finish::of(comm.backend());
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = std::current_exception();
        const auto* ze = dynamic_cast<const Error*>(&e);
        if (!ze || ze->category() != Errc::aborted) {
          int expected = -1;
          first.compare_exchange_strong(expected, r);
        }
        world->poison(detail::cat("rank ", r, " failed: ", e.what()));
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
        int expected = -1;
        first.compare_exchange_strong(expected, r);
        world->poison(detail::cat("rank ", r, " failed with a non-standard exception"));
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first.load() >= 0) std::rethrow_exception(errors[std::size_t(first.load())]);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace zp::backend
