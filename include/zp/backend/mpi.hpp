// zp/backend/mpi.hpp: ranks are MPI processes, buffers are host memory (multi-node CPU).
//
// Speed: all_reduce, reduce_scatter and all_gather take the node path (Options::shared_memory,
// mpi_node.hpp): through a shared segment inside each node, or reading the node peers' buffers
// in place where they are zp allocations (Options::node_direct_bytes; bench/RESULTS.md has the
// speed against the copy limit and OpenMPI), in rank order across nodes, bitwise the threads
// backend's results; async ones run in issue order on a progress thread (with
// MPI_THREAD_MULTIPLE, which MpiEnvironment asks for; else at issue, on the caller's thread).
// Everything else (and
// those three with shared_memory off) is exactly one MPI call on the caller's buffers
// (MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather, MPI_Alltoall, MPI_Alltoallv,
// MPI_Bcast; MPI_IN_PLACE for the in-place ZeRO layouts), at the speed of the MPI
// library; async ones use the MPI-3 nonblocking collectives (MPI_Iallreduce, ...), whose
// post-step (avg division, the conversion of a 16-bit result) runs when the work handle
// completes. Everything is standard MPI-3: OpenMPI, MPICH and their derivatives work.
//
// Element types (MPI calls): f32/f64/i32/i64 map to MPI types. bf16 and fp16 reductions are
// staged through a float buffer (convert every element once, reduce with MPI_FLOAT, round once
// at the end), so sums accumulate in fp32 as in the threads backend; the staging costs 2 bytes in
// and 4 out per element of host traffic and 4 bytes per element of memory. 16-bit all_gather,
// all_to_all and broadcast move raw 16-bit words. avg is a sum followed by a division by size()
// (integers truncate toward zero, like C++ division).
//
// Failure semantics (nothing hangs):
//  - Mismatch check (Options::check_calls, on by default): before each operation the ranks
//    exchange a signature (operation, count, element type, reduce op, root) in one small
//    MPI_Allreduce(MAX) over {s, -s}; if any field differs, every rank throws
//    zp::Error(Errc::invalid_argument) naming the first rank whose call differs from rank 0's,
//    and the communicator stays usable (the data operation was never issued). Cost: one
//    96-byte allreduce per operation (all_to_all_v: two, and the counts' exchange), a few
//    microseconds (bench/RESULTS.md has the numbers);
//    an async launch waits for that exchange, so it synchronises with the peers' launch of the
//    same operation. Turn it off to shave that latency; then a mismatch is undefined behaviour
//    of the MPI library (usually an MPI error or a watchdog abort).
//  - Watchdog (Options::timeout): one thread per process. A rank blocked inside a zp MPI call
//    (a blocking operation, the mismatch check, split, or Work::wait) for longer than timeout
//    prints a message naming the rank, the operation, its call number, count and type to
//    stderr and calls MPI_Abort, so the whole job ends in bounded time with the reason.
//  - A backend destroyed while an exception propagates (its rank failed; the others may be
//    waiting for it in a collective) prints the rank and calls MPI_Abort instead of hanging.
//    Exceptions every rank raises together do not abort: a detected mismatch, and an error that
//    an agreement over the whole job (on_every_rank over MPI_COMM_WORLD's ranks, agreement.hpp)
//    raised on every rank, such as an engine's configuration error.
//  - Every MPI call is checked (MPI_ERRORS_RETURN on zp's communicator): a failure throws
//    zp::Error(Errc::mpi) with MPI_Error_string and the native code.
//
// send/recv: the data is one MPI_Send/MPI_Recv (blocking) or MPI_Isend/MPI_Irecv (async) on
// zp's private communicator with a zp-private tag, so MPI's non-overtaking rule orders the
// messages of each (sender, receiver) pair. With check_calls on, both sides also post, when
// the call is issued, a 5-word signature (operation, count, element type, call number, message
// number) to the other one, each on its own tag; neither waits for the other to act, so no
// call order deadlocks that plain MPI would not. Each side compares the two signatures when
// its call completes and both decide the same: a count or type mismatch is an
// Errc::invalid_argument on the sender and the receiver, naming both calls, and the pair stays
// usable (exactly one data message flows per send, so later messages still pair up; the
// receive buffer's contents are unspecified after a mismatch). Cost: two small messages per
// send/recv beside the data; with check_calls off only the data moves and a mismatch is MPI's
// (a truncation error on the receiver, or nothing). The data moves as bytes, at most INT_MAX
// per message. A blocking send returns when MPI_Send does (it may buffer small messages); a
// peer that never comes is the watchdog's timeout like any other wait.
// Counts are limited to INT_MAX elements per call (MPI's int counts).
// One backend object is used by one thread at a time; different backends may be used by
// different threads when MPI provides MPI_THREAD_MULTIPLE.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "zp/collective.hpp"
#include "zp/detail/copy.hpp"
#include "zp/detail/progress.hpp"
#include "zp/detail/reduce.hpp"
#include "zp/dtype.hpp"
#include "zp/backend/mpi_node.hpp"
#include "zp/backend/mpi_watchdog.hpp"
#include "zp/error.hpp"
#include "zp/work.hpp"

namespace zp::backend {

struct MpiOptions {
  // How long a rank may stay blocked in one zp MPI call before the watchdog aborts the job.
  // Zero or negative disables the watchdog.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Exchange a signature of every call first, so mismatched calls are an error on every rank.
  bool check_calls = true;
  // all_reduce, reduce_scatter and all_gather through a shared segment inside each node and in
  // rank order across nodes (mpi_node.hpp): bitwise the threads backend's results. false: each
  // is one MPI call (MPI's speed and reduction order).
  bool shared_memory = true;
  // Ranks per node; 0: ZP_RANKS_PER_NODE if set, else the machines (MPI's shared-memory split).
  int ranks_per_node = 0;
  // Bytes per rank and round of the node path's staging (two areas of it per rank in the segment).
  std::size_t node_chunk_bytes = std::size_t(1) << 20;
  // all_gather outputs at least this large are written with streaming stores on the node path
  // (no read for ownership: 2 bytes of memory traffic per byte instead of 3, the output not
  // cached). SIZE_MAX: never.
  std::size_t node_stream_bytes = detail::stream_min_bytes;
  // With two or more ranks on a node: host allocations of at least this many bytes made from
  // then on (zp's Buffers, and a user's through zp::HostAllocator) are memfds the node's other
  // processes can map (node_memory.hpp: process-wide, and it stays), and a node-path call of at
  // least this many bytes reads the peers' buffers in place where every rank's are such: one
  // copy per byte instead of two through the segment. Other buffers stage as before. The same
  // on every rank; 0: never.
  std::size_t node_direct_bytes = std::size_t(1) << 20;
};

namespace mpi_detail {

inline MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_SUM;
}

inline bool is_16bit(DType t) { return t == DType::bf16 || t == DType::f16; }

// Operation codes of the signature (CollOp values, plus split and all_to_all_v).
inline constexpr std::int64_t split_code = 100, all_to_all_v_code = 101;

// Tags of zp's point-to-point traffic (its communicator is private, so they only need to
// differ from each other): the data, the sender's signature and the receiver's signature.
inline constexpr int tag_data = 0x7a70, tag_send_signature = 0x7a71, tag_recv_signature = 0x7a72;

inline const char* op_name(std::int64_t code) {
  return code == split_code          ? "split"
         : code == all_to_all_v_code ? "all_to_all_v"
                                     : name(CollOp(code));
}

// The fields every rank must agree on.
struct Signature {
  static constexpr int fields = 6;
  std::int64_t v[fields]{};  // op, count, dtype, reduce, root, rejected (local argument error)

  std::string describe() const {
    return detail::cat(op_name(v[0]), "(count=", v[1], ", dtype=", name(DType(v[2])),
                       ", op=", name(ReduceOp(v[3])), ", root=", v[4], ")");
  }
};

// The part of a backend that outlives moves of the backend object and is shared with its
// outstanding work handles.
struct Context {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1, world_rank = 0;
  MpiOptions opt;
  std::uint64_t calls = 0;
  std::vector<float> scratch;     // 16-bit staging of blocking calls, reused
  std::atomic<bool> busy{false};  // a thread is issuing a call (detail::OneCaller)
  std::shared_ptr<Watchdog> watchdog;
  std::vector<std::uint64_t> sent, received;  // messages posted to / from each peer
  std::unique_ptr<NodeComm> node;             // shared_memory: the node path
  bool node_async = false;  // MPI_THREAD_MULTIPLE: node operations may run on `progress`
  std::unique_ptr<detail::Progress> progress;  // async node operations, in issue order

  ~Context() {
    progress.reset();  // runs what is queued: it uses `node`
    node.reset();
    int fin = 0;
    MPI_Finalized(&fin);
    if (comm != MPI_COMM_NULL && !fin) MPI_Comm_free(&comm);
  }
};

// What runs after the MPI call completed: convert a float staging buffer back to 16 bits,
// move an in-place reduce_scatter result to the rank's shard, divide for avg.
struct Post {
  void* dst = nullptr;
  const void* from = nullptr;  // memmove source (in-place reduce_scatter), or nullptr
  float* stage = nullptr;
  std::size_t n = 0;
  DType t{};
  int divisor = 0;  // 0: no division

  void run() const {
    if (n == 0) return;
    if (stage) {
      detail::narrow_16bit(stage, t, dst, n, divisor);
      return;
    }
    if (from && from != dst) std::memmove(dst, from, n * size_of(t));
    if (divisor) {
      visit_dtype(t, [&](auto tag) {
        using T = decltype(tag);
        if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
          return;  // staged above
        } else {
          T* o = static_cast<T*>(dst);
          const T d = T(divisor);
          for (std::size_t i = 0; i < n; ++i) o[i] = o[i] / d;
        }
      });
    }
  }
};

// One MPI call, fully described, so the blocking and the nonblocking paths share the setup.
struct Plan {
  CollOp op{};
  const void* send = nullptr;
  void* recv = nullptr;
  int count = 0;
  MPI_Datatype type = MPI_BYTE;
  MPI_Op reduce = MPI_SUM;
  int root = 0;
  bool skip = false;  // nothing to send (barrier already implied by the signature check)
  Post post;
};

// One side of a send/recv's signature exchange: ours goes out, the peer's comes in.
struct P2p {
  static constexpr int fields = 5;  // op, count, dtype, call, message number
  std::int64_t mine[fields]{}, theirs[fields]{};
  MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int peer = 0;
  bool checked = false;  // check_calls: the signatures were exchanged
};

// An issued nonblocking operation.
struct Pending {
  std::shared_ptr<Context> ctx;
  MPI_Request req = MPI_REQUEST_NULL;
  Post post;
  std::vector<float> stage;
  Blocked info;
  std::unique_ptr<P2p> p2p;                 // send/recv only
  std::shared_ptr<detail::Completion> job;  // an operation of the node path
  std::vector<int> layout;                  // all_to_all_v: counts and displacements
};

// The verdict on a completed send/recv: the signatures first (a mismatch is the same error on
// both sides, whatever MPI made of the data), then MPI's own result.
inline void p2p_verdict(const Context& c, const P2p& p, int data_rc, int signature_rc) {
  check(signature_rc, "MPI_Waitall (send/recv signatures)", c.rank);
  if (p.checked) {
    bool same = p.mine[1] == p.theirs[1] && p.mine[2] == p.theirs[2];
    if (!same) {
      const bool sending = p.mine[0] == std::int64_t(CollOp::send);
      const std::int64_t* s = sending ? p.mine : p.theirs;
      const std::int64_t* r = sending ? p.theirs : p.mine;
      const int src = sending ? c.rank : p.peer, dst = sending ? p.peer : c.rank;
      throw Error(Errc::invalid_argument,
                  detail::cat("mpi backend: mismatched send/recv (message #", s[4], " from rank ",
                              src, " to rank ", dst, "): rank ", src, " called send(count=", s[1],
                              ", dtype=", name(DType(s[2])), ", peer=", dst, ") (call #", s[3],
                              ") but rank ", dst, " called recv(count=", r[1],
                              ", dtype=", name(DType(r[2])), ", peer=", src, ") (call #", r[3],
                              "); the count and element type of a send and its recv "
                              "must agree"));
    }
  }
  check(data_rc,
        p.mine[0] == std::int64_t(CollOp::send) ? "MPI_Send/MPI_Isend" : "MPI_Recv/MPI_Irecv",
        c.rank);
}

// MPI_Waitall / MPI_Testall's result split into the data request's and the signatures'.
inline std::pair<int, int> split_rc(int rc, const MPI_Status* st, int n) {
  if (rc != MPI_ERR_IN_STATUS) return {rc, rc};
  int sig = MPI_SUCCESS;
  for (int i = 1; i < n; ++i)
    if (st[i].MPI_ERROR != MPI_SUCCESS) sig = st[i].MPI_ERROR;
  return {st[0].MPI_ERROR, sig};
}

// A pending operation of the mpi backend (the Op of zp::Work).
struct Op {
  std::unique_ptr<Pending> p;

  explicit operator bool() const noexcept { return p != nullptr; }
  void finish() {
    const auto q = std::move(p);
    if (q->job) return q->job->wait();  // its waits run under the watchdog on the progress thread
    if (q->p2p) {
      MPI_Request reqs[3] = {q->req, q->p2p->reqs[0], q->p2p->reqs[1]};
      MPI_Status st[3];
      int rc = MPI_SUCCESS;
      {
        Guard g(q->ctx->watchdog.get(), q->info, q->ctx->opt.timeout);
        rc = MPI_Waitall(3, reqs, st);
      }
      const auto [data_rc, sig_rc] = split_rc(rc, st, 3);
      p2p_verdict(*q->ctx, *q->p2p, data_rc, sig_rc);
      return;
    }
    {
      Guard g(q->ctx->watchdog.get(), q->info, q->ctx->opt.timeout);
      check(MPI_Wait(&q->req, MPI_STATUS_IGNORE), "MPI_Wait", q->ctx->rank);
    }
    q->post.run();
  }
  bool done() {
    if (p->job) {
      if (!p->job->ready.load(std::memory_order_acquire)) return false;
      finish();
      return true;
    }
    if (p->p2p) {
      MPI_Request reqs[3] = {p->req, p->p2p->reqs[0], p->p2p->reqs[1]};
      MPI_Status st[3];
      int all = 0;
      const int rc = MPI_Testall(3, reqs, &all, st);
      if (!all) {
        if (rc == MPI_SUCCESS) return false;  // nothing was completed or freed
        // An error before every request finished: keep what MPI freed, wait for the rest (the
        // buffers stay in use until then), and report.
        p->req = reqs[0];
        p->p2p->reqs[0] = reqs[1];
        p->p2p->reqs[1] = reqs[2];
        finish();
        return true;
      }
      const auto q = std::move(p);
      const auto [data_rc, sig_rc] = split_rc(rc, st, 3);
      p2p_verdict(*q->ctx, *q->p2p, data_rc, sig_rc);
      return true;
    }
    int complete = 0;
    check(MPI_Test(&p->req, &complete, MPI_STATUS_IGNORE), "MPI_Test", p->ctx->rank);
    if (!complete) return false;
    const auto q = std::move(p);
    q->post.run();
    return true;
  }
  void drop() noexcept {
    try {
      if (p) finish();
    } catch (...) {
    }
  }
};

}  // namespace mpi_detail

using NodeLayout = mpi_detail::NodeLayout;

// The backend: one MPI communicator (a private duplicate of the one it was given, so zp's
// traffic never matches the application's own calls). Move-only.
class Mpi {
 public:
  using Options = MpiOptions;
  static constexpr MemorySpace memory = MemorySpace::host;
  static constexpr const char* name = "mpi";

  // A nonblocking operation (work.hpp): completed under the watchdog, then its post-step runs.
  // MPI must complete every request before its buffers may be reused, so a dropped handle waits.
  using Work = zp::Work<mpi_detail::Op>;

  // Duplicates comm (collective over comm). MPI must be initialised (MpiEnvironment).
  explicit Mpi(MPI_Comm comm = MPI_COMM_WORLD, Options opt = {}) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
      throw Error(Errc::mpi,
                  "mpi backend: MPI is not initialised (or already finalised); create "
                  "a zp::backend::MpiEnvironment first");
    MPI_Comm dup = MPI_COMM_NULL;
    mpi_detail::check(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup", mpi_detail::world_rank());
    adopt(dup, opt);
  }
  Mpi(Mpi&& o) noexcept
      : ctx_(std::move(o.ctx_)),
        unwinding_(o.unwinding_),
        rejected_together_(o.rejected_together_) {}
  Mpi& operator=(Mpi&& o) noexcept {
    if (this != &o) {
      leave();
      ctx_ = std::move(o.ctx_);
      unwinding_ = o.unwinding_;
      rejected_together_ = o.rejected_together_;
    }
    return *this;
  }
  ~Mpi() { leave(); }

  int rank() const { return ctx_->rank; }
  int size() const { return ctx_->size; }
  // The job's processes (MPI_COMM_WORLD's): an error agreed on by that many ranks is raised on
  // all of them (agreement.hpp), so none aborts the job for it.
  int job_size() const {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }
  // zp's private communicator (for bootstrapping, e.g. the nccl backend).
  MPI_Comm comm() const { return ctx_->comm; }
  // Where this rank sits among nodes (mpi_node.hpp); one node of size() ranks without
  // shared_memory.
  NodeLayout node_layout() const {
    return ctx_->node ? ctx_->node->layout() : NodeLayout{1, ctx_->size, 0, ctx_->rank};
  }
  // Node-path operations of this communicator that read the node peers' buffers in place
  // (Options::node_direct_bytes); the others staged through the segment or ran one MPI call.
  std::uint64_t node_direct_calls() const { return ctx_->node ? ctx_->node->direct_calls() : 0; }
  const Options& options() const { return ctx_->opt; }

  Work all_reduce(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch l) {
    return issue(CollOp::all_reduce, src, dst, n, t, op, 0, l);
  }
  Work reduce_scatter(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch l) {
    return issue(CollOp::reduce_scatter, src, dst, n, t, op, 0, l);
  }
  Work all_gather(const void* src, void* dst, std::size_t n, DType t, Launch l) {
    return issue(CollOp::all_gather, src, dst, n, t, ReduceOp::sum, 0, l);
  }
  Work all_to_all(const void* src, void* dst, std::size_t n, DType t, Launch l) {
    return issue(CollOp::all_to_all, src, dst, n, t, ReduceOp::sum, 0, l);
  }
  // MPI_Alltoallv (MPI_Ialltoallv). With check_calls, every rank's send counts also reach
  // their receivers first (one MPI_Alltoall of a word per rank), so counts that disagree are an
  // error on every rank, naming the pair on the receiver.
  Work all_to_all_v(const void* src, const std::size_t* send_counts, void* dst,
                    const std::size_t* recv_counts, DType t, Launch l) {
    auto& c = *ctx_;
    const detail::OneCaller busy(c.busy, "mpi", "all_to_all_v", c.rank);
    ++c.calls;
    const std::size_t n = std::size_t(c.size);
    std::string bad = detail::check_exchange_v(src, send_counts, dst, recv_counts, t, c.size);
    if (bad.empty())
      for (const std::size_t* counts : {send_counts, recv_counts})
        if (const std::size_t total = detail::block_offset(counts, c.size); total > INT_MAX)
          bad = detail::cat("all_to_all_v: ", total, " elements on one side exceed MPI's limit of ",
                            INT_MAX, " (int displacements); split the exchange");
    mpi_detail::Blocked info = blocked("all_to_all_v", 0, t, ReduceOp::sum, false);
    if (c.opt.check_calls) {
      mpi_detail::Signature s;
      s.v[0] = mpi_detail::all_to_all_v_code;
      s.v[2] = std::int64_t(t);
      mpi_detail::Guard g(c.watchdog.get(), info, c.opt.timeout);
      agree(s, bad);
      std::vector<std::int64_t> mine(send_counts, send_counts + n), theirs(n);
      mpi_detail::check(
          MPI_Alltoall(mine.data(), 1, MPI_INT64_T, theirs.data(), 1, MPI_INT64_T, c.comm),
          "MPI_Alltoall (all_to_all_v counts check)", c.rank);
      for (std::size_t q = 0; q < n && bad.empty(); ++q)
        bad = detail::check_block_agrees(int(q), c.rank, std::size_t(theirs[q]), recv_counts[q]);
      agree(s, bad);
    } else if (!bad.empty()) {
      throw Error(Errc::invalid_argument, "mpi backend: " + bad);
    }
    std::vector<int> layout(4 * n);  // send counts, send displacements, recv counts, recv ones
    for (std::size_t q = 0, out = 0, in = 0; q < n;
         out += send_counts[q], in += recv_counts[q], ++q) {
      layout[q] = int(send_counts[q]);
      layout[n + q] = int(out);
      layout[2 * n + q] = int(recv_counts[q]);
      layout[3 * n + q] = int(in);
    }
    const MPI_Datatype type = mpi_detail::mpi_type(t);
    const int* v = layout.data();
    if (l == Launch::blocking) {
      mpi_detail::Guard g(c.watchdog.get(), info, c.opt.timeout);
      mpi_detail::check(MPI_Alltoallv(src, v, v + n, type, dst, v + 2 * n, v + 3 * n, type, c.comm),
                        "MPI_Alltoallv", c.rank);
      return Work{};
    }
    auto pending = std::make_unique<mpi_detail::Pending>();
    pending->layout = std::move(layout);
    v = pending->layout.data();
    mpi_detail::check(
        MPI_Ialltoallv(src, v, v + n, type, dst, v + 2 * n, v + 3 * n, type, c.comm, &pending->req),
        "MPI_Ialltoallv", c.rank);
    pending->ctx = ctx_;
    pending->info = info;
    return Work(mpi_detail::Op{std::move(pending)});
  }
  Work broadcast(const void* src, void* dst, std::size_t n, DType t, int root, Launch l) {
    return issue(CollOp::broadcast, src, dst, n, t, ReduceOp::sum, root, l);
  }
  Work barrier(Launch l) {
    return issue(CollOp::barrier, nullptr, nullptr, 0, DType::f32, ReduceOp::sum, 0, l);
  }

  // Point to point (see the file comment): only this rank and `peer` take part.
  Work send(const void* src, std::size_t n, DType t, int peer, Launch l) {
    return issue_p2p(CollOp::send, const_cast<void*>(src), n, t, peer, l);
  }
  Work recv(void* dst, std::size_t n, DType t, int peer, Launch l) {
    return issue_p2p(CollOp::recv, dst, n, t, peer, l);
  }

  // MPI_Comm_split: ranks with the same colour form a group ordered by (key, rank).
  Mpi split(int color, int key) {
    auto& c = *ctx_;
    const detail::OneCaller busy(c.busy, "mpi", "split", c.rank);
    ++c.calls;
    mpi_detail::Signature s;
    s.v[0] = mpi_detail::split_code;
    mpi_detail::Blocked info = blocked("split", 0, DType::f32, ReduceOp::sum, false);
    mpi_detail::Guard g(c.watchdog.get(), info, c.opt.timeout);
    if (c.opt.check_calls) agree(s, "");
    MPI_Comm sub = MPI_COMM_NULL;
    mpi_detail::check(MPI_Comm_split(c.comm, color, key, &sub), "MPI_Comm_split", c.rank);
    Mpi out{Adopt{}};
    out.adopt(sub, c.opt);
    out.unwinding_ = unwinding_;
    return out;
  }

 private:
  struct Adopt {};
  explicit Mpi(Adopt) {}

  void adopt(MPI_Comm comm, const Options& opt) {
    (void)mpi_detail::main_thread_id();
    auto c = std::make_shared<mpi_detail::Context>();
    c->comm = comm;
    c->opt = opt;
    c->world_rank = mpi_detail::world_rank();
    mpi_detail::check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler",
                      c->world_rank);
    mpi_detail::check(MPI_Comm_rank(comm, &c->rank), "MPI_Comm_rank", c->world_rank);
    mpi_detail::check(MPI_Comm_size(comm, &c->size), "MPI_Comm_size", c->world_rank);
    c->sent.assign(std::size_t(c->size), 0);
    c->received.assign(std::size_t(c->size), 0);
    if (opt.timeout.count() > 0) c->watchdog = mpi_detail::Watchdog::get();
    if (opt.shared_memory) {
      c->node = std::make_unique<mpi_detail::NodeComm>(comm, agreed_ranks_per_node(*c),
                                                       opt.node_chunk_bytes, opt.node_stream_bytes,
                                                       opt.node_direct_bytes);
      int level = MPI_THREAD_SINGLE;
      MPI_Query_thread(&level);
      c->node_async = level == MPI_THREAD_MULTIPLE;
    }
    ctx_ = std::move(c);
    unwinding_ = std::uncaught_exceptions();
  }

  // The ranks per node every rank of c asks for (requested_ranks_per_node), compared before the
  // node's splits, which would pair ranks that took different paths (a hang): a value that does
  // not read, or one that differs, is an error on every rank.
  int agreed_ranks_per_node(const mpi_detail::Context& c) const {
    int mine = -1;
    std::string bad;
    try {
      mine = mpi_detail::requested_ranks_per_node(c.opt.ranks_per_node);
    } catch (const Error& e) {
      bad = e.message();
    }
    int v[2] = {mine, -mine};
    mpi_detail::check(MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_INT, MPI_MAX, c.comm),
                      "MPI_Allreduce (ranks per node)", c.rank);
    if (v[0] == -v[1] && mine >= 0) return mine;
    Error e(Errc::invalid_argument,
            !bad.empty() ? bad
                         : detail::cat("mpi backend: the ranks ask for different ranks per node, "
                                       "from ",
                                       -v[1], " to ", v[0],
                                       " (MpiOptions::ranks_per_node, else ZP_RANKS_PER_NODE; 0: "
                                       "the machines'; -1: a ZP_RANKS_PER_NODE that does not "
                                       "read), this rank ",
                                       mine, "; every rank must ask for the same"));
    if (c.size == job_size()) detail::raised_on_every_rank(e.what());
    throw e;
  }

  void leave() noexcept {
    if (!ctx_) return;
    if (std::uncaught_exceptions() > unwinding_ && ctx_->size > 1 && !ctx_rejected_together() &&
        !detail::every_rank_raises()) {
      mpi_detail::abort_job(detail::cat(
          "rank ", ctx_->rank, " of ", ctx_->size, " (world rank ", ctx_->world_rank,
          ") is leaving its communicator because an exception is propagating (after call #",
          ctx_->calls,
          "); the other ranks may be waiting for it in a collective, so the job is aborted",
          mpi_detail::propagating_error()));
    }
    ctx_.reset();
  }
  bool ctx_rejected_together() const noexcept { return rejected_together_; }

  mpi_detail::Blocked blocked(const char* what, std::size_t n, DType t, ReduceOp op,
                              bool has_reduce) const {
    mpi_detail::Blocked b;
    b.rank = ctx_->rank;
    b.size = ctx_->size;
    b.world_rank = ctx_->world_rank;
    b.what = what;
    b.call = ctx_->calls;
    b.count = n;
    b.dtype = t;
    b.reduce = op;
    b.has_reduce = has_reduce;
    if (ctx_->node) b.peers = ctx_->node->peers();
    return b;
  }

  // The signature exchange. `local_error` is this rank's own argument error ("" if none).
  // Throws the same category on every rank when any field differs or any rank rejected its
  // arguments.
  void agree(mpi_detail::Signature s, const std::string& local_error) {
    auto& c = *ctx_;
    constexpr int F = mpi_detail::Signature::fields;
    s.v[F - 1] = local_error.empty() ? 0 : 1;
    std::int64_t buf[2 * F];
    for (int i = 0; i < F; ++i) {
      buf[i] = s.v[i];
      buf[F + i] = -s.v[i];
    }
    mpi_detail::check(MPI_Allreduce(MPI_IN_PLACE, buf, 2 * F, MPI_INT64_T, MPI_MAX, c.comm),
                      "MPI_Allreduce (call signature check)", c.rank);
    bool same = true;
    for (int i = 0; i < F - 1; ++i) same = same && buf[i] == -buf[F + i];
    if (same && buf[F - 1] == 0) {
      rejected_together_ = false;
      detail::every_rank_handled();
      return;
    }
    // Slow path: learn every rank's call to name the difference.
    std::vector<std::int64_t> all(std::size_t(F) * std::size_t(c.size));
    mpi_detail::check(MPI_Allgather(s.v, F, MPI_INT64_T, all.data(), F, MPI_INT64_T, c.comm),
                      "MPI_Allgather (call signature check)", c.rank);
    rejected_together_ = true;  // every rank throws now: no need to abort the job on unwinding
    auto sig = [&](int r) {
      mpi_detail::Signature x;
      std::copy_n(all.data() + std::size_t(r) * F, F, x.v);
      return x;
    };
    const auto fail = [&](const std::string& why) {
      Error e(Errc::invalid_argument, "mpi backend: " + why);
      if (c.size == job_size()) detail::raised_on_every_rank(e.what());
      throw e;
    };
    const auto s0 = sig(0);
    for (int r = 1; r < c.size; ++r) {
      const auto sr = sig(r);
      if (!std::equal(sr.v, sr.v + F - 1, s0.v))
        fail(detail::cat("mismatched collective calls: rank 0 called ", s0.describe(), " but rank ",
                         r, " called ", sr.describe(), " (call #", c.calls, " on rank ", c.rank,
                         "); every rank must issue the same operations in the same order"));
    }
    if (!local_error.empty()) fail(local_error);
    int first = 0;
    while (first < c.size && sig(first).v[F - 1] == 0) ++first;
    fail(detail::cat("rank ", first, " rejected its arguments to ", s.describe(), " (call #",
                     c.calls, "); see that rank's error"));
  }

  // Argument problems, checked before anything is issued; "" when fine.
  std::string validate(CollOp op, const void* src, void* dst, std::size_t n, DType t, ReduceOp rop,
                       int root) const {
    if (n > std::size_t(INT_MAX))
      return detail::cat(zp::name(op), ": count ", n, " exceeds MPI's limit of ", INT_MAX,
                         " elements per call; split the buffer");
    return detail::check_call(op, src, dst, n, t, rop, root, ctx_->rank, ctx_->size);
  }

  // The MPI call that runs a collective and its post-step. One case per operation, each the
  // whole plan of its operation (so the function is long, and read case by case).
  mpi_detail::Plan plan(CollOp op, const void* src, void* dst, std::size_t n, DType t, ReduceOp rop,
                        int root, std::vector<float>& stage) const {
    const auto& c = *ctx_;
    mpi_detail::Plan p;
    p.op = op;
    p.count = int(n);
    p.type = mpi_detail::mpi_type(t);
    p.reduce = mpi_detail::mpi_op(rop);
    p.root = root;
    const int div = rop == ReduceOp::avg ? c.size : 0;
    const std::size_t es = size_of(t);
    switch (op) {
      case CollOp::all_reduce:
        if (mpi_detail::is_16bit(t)) {
          stage.resize(n);
          detail::widen_16bit(src, t, stage.data(), n);
          p.send = MPI_IN_PLACE;
          p.recv = stage.data();
          p.type = MPI_FLOAT;
          p.post = {dst, nullptr, stage.data(), n, t, div};
        } else {
          p.send = src == dst ? MPI_IN_PLACE : src;
          p.recv = dst;
          p.post = {dst, nullptr, nullptr, n, t, div};
        }
        break;
      case CollOp::reduce_scatter: {
        char* base = static_cast<char*>(dst) - std::size_t(c.rank) * n * es;
        const bool in_place = n > 0 && static_cast<const void*>(base) == src;
        if (mpi_detail::is_16bit(t)) {
          stage.resize(n * std::size_t(c.size));
          detail::widen_16bit(src, t, stage.data(), stage.size());
          p.send = MPI_IN_PLACE;
          p.recv = stage.data();
          p.type = MPI_FLOAT;
          p.post = {dst, nullptr, stage.data(), n, t, div};
        } else if (in_place) {  // MPI leaves the result at the buffer's start
          p.send = MPI_IN_PLACE;
          p.recv = base;
          p.post = {dst, base, nullptr, n, t, div};
        } else {
          p.send = src;
          p.recv = dst;
          p.post = {dst, nullptr, nullptr, n, t, div};
        }
        break;
      }
      case CollOp::all_gather: {
        const char* own = static_cast<const char*>(dst) + std::size_t(c.rank) * n * es;
        p.send = n > 0 && static_cast<const void*>(own) == src ? MPI_IN_PLACE : src;
        p.recv = dst;
        break;
      }
      case CollOp::all_to_all:
        p.send = src;
        p.recv = dst;
        break;
      case CollOp::broadcast:
        if (c.rank == root && src != dst && n) std::memcpy(dst, src, n * es);
        p.recv = dst;
        break;
      case CollOp::barrier:
        p.skip = c.opt.check_calls;  // the signature exchange already met every rank
        break;
      case CollOp::send:
      case CollOp::recv: break;  // issue_p2p's
    }
    return p;
  }

  void call_blocking(const mpi_detail::Plan& p) {
    const auto& c = *ctx_;
    int rc = MPI_SUCCESS;
    const char* fn = "";
    switch (p.op) {
      case CollOp::all_reduce:
        fn = "MPI_Allreduce";
        rc = MPI_Allreduce(p.send, p.recv, p.count, p.type, p.reduce, c.comm);
        break;
      case CollOp::reduce_scatter:
        fn = "MPI_Reduce_scatter_block";
        rc = MPI_Reduce_scatter_block(p.send, p.recv, p.count, p.type, p.reduce, c.comm);
        break;
      case CollOp::all_gather:
        fn = "MPI_Allgather";
        rc =
            p.send == MPI_IN_PLACE
                ? MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p.recv, p.count, p.type, c.comm)
                : MPI_Allgather(p.send, p.count, p.type, p.recv, p.count, p.type, c.comm);
        break;
      case CollOp::all_to_all:
        fn = "MPI_Alltoall";
        rc = MPI_Alltoall(p.send, p.count, p.type, p.recv, p.count, p.type, c.comm);
        break;
      case CollOp::broadcast:
        fn = "MPI_Bcast";
        rc = MPI_Bcast(p.recv, p.count, p.type, p.root, c.comm);
        break;
      case CollOp::barrier:
        fn = "MPI_Barrier";
        rc = MPI_Barrier(c.comm);
        break;
      case CollOp::send:
      case CollOp::recv: break;  // issue_p2p's
    }
    mpi_detail::check(rc, fn, c.rank);
  }

  void call_async(const mpi_detail::Plan& p, MPI_Request* req) {
    const auto& c = *ctx_;
    int rc = MPI_SUCCESS;
    const char* fn = "";
    switch (p.op) {
      case CollOp::all_reduce:
        fn = "MPI_Iallreduce";
        rc = MPI_Iallreduce(p.send, p.recv, p.count, p.type, p.reduce, c.comm, req);
        break;
      case CollOp::reduce_scatter:
        fn = "MPI_Ireduce_scatter_block";
        rc = MPI_Ireduce_scatter_block(p.send, p.recv, p.count, p.type, p.reduce, c.comm, req);
        break;
      case CollOp::all_gather:
        fn = "MPI_Iallgather";
        rc = p.send == MPI_IN_PLACE
                 ? MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p.recv, p.count, p.type,
                                  c.comm, req)
                 : MPI_Iallgather(p.send, p.count, p.type, p.recv, p.count, p.type, c.comm, req);
        break;
      case CollOp::all_to_all:
        fn = "MPI_Ialltoall";
        rc = MPI_Ialltoall(p.send, p.count, p.type, p.recv, p.count, p.type, c.comm, req);
        break;
      case CollOp::broadcast:
        fn = "MPI_Ibcast";
        rc = MPI_Ibcast(p.recv, p.count, p.type, p.root, c.comm, req);
        break;
      case CollOp::barrier:
        fn = "MPI_Ibarrier";
        rc = MPI_Ibarrier(c.comm, req);
        break;
      case CollOp::send:
      case CollOp::recv: break;  // issue_p2p's
    }
    mpi_detail::check(rc, fn, c.rank);
  }

  Work issue(CollOp op, const void* src, void* dst, std::size_t n, DType t, ReduceOp rop, int root,
             Launch l) {
    auto& c = *ctx_;
    const detail::OneCaller busy(c.busy, "mpi", zp::name(op), c.rank);
    ++c.calls;
    const bool has_reduce = op == CollOp::all_reduce || op == CollOp::reduce_scatter;
    if (!has_reduce) rop = ReduceOp::sum;
    if (op != CollOp::broadcast) root = 0;
    const std::string bad = validate(op, src, dst, n, t, rop, root);
    mpi_detail::Blocked info = blocked(zp::name(op), n, t, rop, has_reduce);
    if (c.opt.check_calls) {
      mpi_detail::Signature s;
      s.v[0] = std::int64_t(op);
      s.v[1] = std::int64_t(n);
      s.v[2] = std::int64_t(t);
      s.v[3] = std::int64_t(rop);
      s.v[4] = root;
      mpi_detail::Guard g(c.watchdog.get(), info, c.opt.timeout);
      agree(s, bad);
    } else if (!bad.empty()) {
      throw Error(Errc::invalid_argument, "mpi backend: " + bad);
    }
    if (c.node &&
        (op == CollOp::all_reduce || op == CollOp::reduce_scatter || op == CollOp::all_gather))
      return issue_node(op, src, dst, n, t, rop, info, l);
    if (l == Launch::blocking) {
      auto p = plan(op, src, dst, n, t, rop, root, c.scratch);
      if (!p.skip) {
        mpi_detail::Guard g(c.watchdog.get(), info, c.opt.timeout);
        call_blocking(p);
      }
      p.post.run();
      return Work{};
    }
    auto pending = std::make_unique<mpi_detail::Pending>();
    auto p = plan(op, src, dst, n, t, rop, root, pending->stage);
    if (p.skip) {
      p.post.run();
      return Work{};
    }
    call_async(p, &pending->req);
    pending->ctx = ctx_;
    pending->post = p.post;
    pending->info = info;
    return Work(mpi_detail::Op{std::move(pending)});
  }

  // An operation of the node path: on the caller's thread once the earlier async ones are done
  // (blocking, or async where MPI cannot be called from a second thread), else queued behind
  // them on the progress thread. Its waits run under the watchdog either way.
  Work issue_node(CollOp op, const void* src, void* dst, std::size_t n, DType t, ReduceOp rop,
                  const mpi_detail::Blocked& info, Launch l) {
    auto run = [ctx = ctx_.get(), op, src, dst, n, t, rop,
                info = mpi_detail::Blocked(info)]() mutable {
      mpi_detail::Guard g(ctx->watchdog.get(), info, ctx->opt.timeout);
      auto& node = *ctx->node;
      if (op == CollOp::all_reduce)
        node.all_reduce(src, dst, n, t, rop, info);
      else if (op == CollOp::reduce_scatter)
        node.reduce_scatter(src, dst, n, t, rop, info);
      else
        node.all_gather(src, dst, n, t, info);
    };
    auto& c = *ctx_;
    if (l == Launch::blocking || !c.node_async) {
      if (c.progress) c.progress->drain();
      run();
      return Work{};
    }
    if (!c.progress) c.progress = std::make_unique<detail::Progress>();
    auto pending = std::make_unique<mpi_detail::Pending>();
    pending->ctx = ctx_;  // the Work keeps the context (and so the raw pointer above) alive
    pending->info = info;
    pending->job = std::make_shared<detail::Completion>();
    c.progress->post([run, job = pending->job]() mutable {
      std::exception_ptr e;
      try {
        run();
      } catch (...) {
        e = std::current_exception();
      }
      job->complete(std::move(e));
    });
    return Work(mpi_detail::Op{std::move(pending)});
  }

  // A bad argument is an error on this rank alone (the pair has not met). The signatures are
  // posted first and never waited for before the data is on its way, so neither side depends on
  // the other's progress beyond what MPI_Send/MPI_Recv themselves need.
  Work issue_p2p(CollOp op, void* buf, std::size_t n, DType t, int peer, Launch l) {
    auto& c = *ctx_;
    const detail::OneCaller busy(c.busy, "mpi", zp::name(op), c.rank);
    ++c.calls;
    std::string bad = detail::check_p2p(op, buf, n, t, peer, c.rank, c.size);
    if (bad.empty() && n * size_of(t) > std::size_t(INT_MAX))
      bad = detail::cat(zp::name(op), ": message of ", n * size_of(t),
                        " bytes exceeds MPI's limit of ", INT_MAX,
                        " bytes per message; split the buffer");
    if (!bad.empty()) throw Error(Errc::invalid_argument, "mpi backend: " + bad);
    const bool sending = op == CollOp::send;
    const int bytes = int(n * size_of(t));
    auto pending = std::make_unique<mpi_detail::Pending>();
    pending->ctx = ctx_;
    pending->info = blocked(zp::name(op), n, t, ReduceOp::sum, false);
    pending->info.peer = peer;
    pending->p2p = std::make_unique<mpi_detail::P2p>();
    auto& x = *pending->p2p;
    x.peer = peer;
    x.mine[0] = std::int64_t(op);
    x.mine[1] = std::int64_t(n);
    x.mine[2] = std::int64_t(t);
    x.mine[3] = std::int64_t(c.calls);
    x.mine[4] =
        std::int64_t(sending ? ++c.sent[std::size_t(peer)] : ++c.received[std::size_t(peer)]);
    if (c.opt.check_calls) {
      x.checked = true;
      // Our signature travels with our direction's tag, the peer's comes on the other one.
      const int out_tag = sending ? mpi_detail::tag_send_signature : mpi_detail::tag_recv_signature;
      const int in_tag = sending ? mpi_detail::tag_recv_signature : mpi_detail::tag_send_signature;
      mpi_detail::check(MPI_Isend(x.mine, x.fields, MPI_INT64_T, peer, out_tag, c.comm, &x.reqs[0]),
                        "MPI_Isend (send/recv signature)", c.rank);
      mpi_detail::check(
          MPI_Irecv(x.theirs, x.fields, MPI_INT64_T, peer, in_tag, c.comm, &x.reqs[1]),
          "MPI_Irecv (send/recv signature)", c.rank);
    }
    if (l == Launch::async) {
      const int rc =
          sending
              ? MPI_Isend(buf, bytes, MPI_BYTE, peer, mpi_detail::tag_data, c.comm, &pending->req)
              : MPI_Irecv(buf, bytes, MPI_BYTE, peer, mpi_detail::tag_data, c.comm, &pending->req);
      if (rc != MPI_SUCCESS) {
        Work w(
            mpi_detail::Op{std::move(pending)});  // completes the posted signatures before throwing
        mpi_detail::check(rc, sending ? "MPI_Isend" : "MPI_Irecv", c.rank);
      }
      return Work(mpi_detail::Op{std::move(pending)});
    }
    int data_rc = MPI_SUCCESS, rc = MPI_SUCCESS;
    MPI_Status st[2];
    {
      mpi_detail::Guard g(c.watchdog.get(), pending->info, c.opt.timeout);
      data_rc = sending ? MPI_Send(buf, bytes, MPI_BYTE, peer, mpi_detail::tag_data, c.comm)
                        : MPI_Recv(buf, bytes, MPI_BYTE, peer, mpi_detail::tag_data, c.comm,
                                   MPI_STATUS_IGNORE);
      rc = MPI_Waitall(2, x.reqs, st);
    }
    int sig_rc = rc;
    if (rc == MPI_ERR_IN_STATUS)
      sig_rc = st[0].MPI_ERROR != MPI_SUCCESS ? st[0].MPI_ERROR : st[1].MPI_ERROR;
    mpi_detail::p2p_verdict(c, x, data_rc, sig_rc);
    return Work{};
  }

  std::shared_ptr<mpi_detail::Context> ctx_;
  int unwinding_ = 0;  // std::uncaught_exceptions() when this backend was made
  bool rejected_together_ = false;
};

static_assert(Backend<Mpi>);

// Initialises MPI for the lifetime of the object, asking for MPI_THREAD_MULTIPLE (the watchdog
// calls MPI_Abort from its own thread), and finalises it on destruction. If MPI was already
// initialised (by the application), it does nothing either way. Destroyed while an exception
// propagates with more than one rank, it aborts the job instead of finalising (MPI_Finalize is
// collective: the others would wait for this rank forever), unless every rank of the job raised
// that exception together (an agreed error, agreement.hpp).
class MpiEnvironment {
 public:
  MpiEnvironment() : MpiEnvironment(nullptr, nullptr) {}
  MpiEnvironment(int* argc, char*** argv, int required = MPI_THREAD_MULTIPLE) {
    int init = 0;
    mpi_detail::check(MPI_Initialized(&init), "MPI_Initialized", -1);
    if (init) {
      MPI_Query_thread(&provided_);
    } else {
      (void)mpi_detail::main_thread_id();
      mpi_detail::check(MPI_Init_thread(argc, argv, required, &provided_), "MPI_Init_thread", -1);
      owner_ = true;
    }
    unwinding_ = std::uncaught_exceptions();
  }
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;
  ~MpiEnvironment() {
    if (!owner_) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (std::uncaught_exceptions() > unwinding_ && size > 1 && !detail::every_rank_raises())
      mpi_detail::abort_job(detail::cat("world rank ", mpi_detail::world_rank(),
                                        " is finalising MPI while an exception propagates; "
                                        "aborting the job",
                                        mpi_detail::propagating_error()));
    MPI_Finalize();
  }

  // The thread support level MPI provides (MPI_THREAD_*).
  int thread_level() const { return provided_; }
  // Whether this object initialised MPI (and will finalise it).
  bool owns() const { return owner_; }
  int world_rank() const { return mpi_detail::world_rank(); }
  int world_size() const {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }
  // A backend over (a duplicate of) MPI_COMM_WORLD.
  Mpi world(MpiOptions opt = {}) const { return Mpi(MPI_COMM_WORLD, opt); }

 private:
  int provided_ = MPI_THREAD_SINGLE;
  int unwinding_ = 0;
  bool owner_ = false;
};

}  // namespace zp::backend
