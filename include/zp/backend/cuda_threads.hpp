// zp/backend/cuda_threads.hpp: N ranks on one device. Ranks are threads of one process sharing
// a device; buffers are device memory; collectives are kernels that rank 0 enqueues, for every
// rank, on its communication stream, written on the device primitives (zp/device/runtime.hpp),
// so the backend builds with nvcc for a GPU or with any C++ compiler for the simulated device.
// NCCL refuses two ranks on one device, so this is how a multi-rank device engine runs on one
// GPU: to test it, and to rehearse an 8-GPU ZeRO-3 job (its memory and its traffic) on one.
//
// Each rank has a communication stream of its own besides its compute stream (the calling
// thread's current stream, zp/device/stream.hpp). Each operation meets the other ranks on the host
// through the threads backend's rendezvous (threads.hpp: the calls compared, timeouts,
// poisoning), but never waits for the GPU:
//   1. rank r records `ready` on its compute stream (its inputs are complete there) and meets
//      the others;
//   2. between the meetings rank 0's communication stream waits for every rank's `ready`, then
//      rank 0 enqueues every rank's part there, one launch where it can (all_reduce: every
//      element of every buffer summed in rank order with the host backends' element math,
//      detail::combine_one, so results equal the threads backend bit for bit; reduce_scatter:
//      each rank's block into its output; all_gather: every input into every output; all_to_all,
//      all_to_all_v, broadcast: copies) and records `done`;
//   3. after the second meeting every other rank's communication stream waits for rank 0's
//      `done` (its outputs are written, and its next operation must not rewrite an input still
//      read), and each rank records its Work's event there. Work::wait() (or a Work destroyed
//      unwaited) makes the compute stream wait for that event, as with nccl.
// One rank enqueuing the whole operation makes about 5N runtime calls in all where every rank
// enqueuing its own part made N (2N + 6), and the device runs one kernel where it ran N: a fixed
// cost per operation that grows as N^2 was what stages 2 and 3 lost on a GPU (bench/RESULTS.md).
// An event is re-recorded only once every wait on it is enqueued: `ready` after the previous
// operation's second meeting, `done` after the next first meeting.
// send/recv are not supported (pipeline parallelism on one GPU is not implemented yet).
// The `site` names of its waits are the mutation table's (tests/device/mutations.cmake).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "zp/backend/threads.hpp"
#include "zp/detail/reduce.hpp"
#include "zp/device/memory.hpp"

namespace zp::backend {

namespace cuda_threads_detail {

inline constexpr int max_ranks = 64;

template <class T>
struct Pointers {
  const T* in[max_ranks];
  T* out[max_ranks];
};

// A reduction, every rank's part in one launch: element e of [0, n) is every input's, reduced in
// rank order, written to every output at e (all_reduce, block 0) or to output e / block at
// e % block (reduce_scatter: n = ranks x block). Work item k: the w elements from w k, one 16-byte
// access per buffer where all are aligned and no block boundary falls inside (vectorized).
template <class T, ReduceOp Op>
struct Reduce {
  static constexpr int w = int(16 / sizeof(T));
  Pointers<T> p;
  int ranks;
  std::size_t n;
  zp::device::DivMod block;  // d == 0: all_reduce
  ReduceOp op;
  bool vectorized;
  template <class X>
  ZP_HOST_DEVICE void put(std::size_t e, const X& v) const {
    if (block.d == 0) {
      for (int q = 0; q < ranks; ++q) *reinterpret_cast<X*>(p.out[q] + e) = v;
    } else {
      const auto [q, r] = block(e);
      *reinterpret_cast<X*>(p.out[q] + r) = v;
    }
  }
  ZP_HOST_DEVICE void operator()(std::size_t k) const {
    using A = typename detail::accum<T>::type;
    using V = zp::device::Pack<T, w>;
    const std::size_t at = std::size_t(w) * k;
    if (vectorized && at + w <= n) {
      A acc[w];
      const V x0 = *reinterpret_cast<const V*>(p.in[0] + at);
      for (int j = 0; j < w; ++j) acc[j] = A(x0.x[j]);
      for (int r = 1; r < ranks; ++r) {
        const V x = *reinterpret_cast<const V*>(p.in[r] + at);
        for (int j = 0; j < w; ++j) acc[j] = detail::combine_one<Op>(acc[j], A(x.x[j]));
      }
      V v;
      for (int j = 0; j < w; ++j) v.x[j] = T(detail::finish_one(acc[j], op, ranks));
      put(at, v);
      return;
    }
    for (std::size_t e = at; e < n && e < at + w; ++e) {
      A acc = A(p.in[0][e]);
      for (int r = 1; r < ranks; ++r) acc = detail::combine_one<Op>(acc, A(p.in[r][e]));
      put(e, T(detail::finish_one(acc, op, ranks)));
    }
  }
};

// An all_gather in one launch: byte e of the ranks' inputs laid end to end (rank e / bytes's
// byte e % bytes) into every output at e, except into the output that is its own input (in
// place). 16 bytes a work item, in one access where all are aligned and bytes is a multiple of 16.
struct Gather {
  const unsigned char* in[max_ranks];
  unsigned char* out[max_ranks];
  int ranks;
  zp::device::DivMod bytes;  // each input's
  bool vectorized;
  ZP_HOST_DEVICE void operator()(std::size_t k) const {
    using V = zp::device::Pack<std::uint32_t, 4>;
    const std::size_t at = 16 * k, total = bytes.d * std::size_t(ranks);
    if (vectorized && at + 16 <= total) {
      const auto [q, r] = bytes(at);
      const unsigned char* src = in[q] + r;
      const V v = *reinterpret_cast<const V*>(src);
      for (int q = 0; q < ranks; ++q)
        if (out[q] + at != src) *reinterpret_cast<V*>(out[q] + at) = v;
      return;
    }
    for (std::size_t e = at; e < total && e < at + 16; ++e) {
      const auto [q, r] = bytes(e);
      const unsigned char* src = in[q] + r;
      for (int q = 0; q < ranks; ++q)
        if (out[q] + e != src) out[q][e] = *src;
    }
  }
};

// The rank's state its peers use: the events of the current operation.
struct Shared {
  zp::device::Event ready, done;
};

// Completion events of a rank's operations, reused: one goes back once the wait on it is enqueued
// (a wait is on the record before it; a later record does not move it). Saves an event's creation
// and destruction per operation.
class EventPool {
 public:
  std::unique_ptr<zp::device::Event> take() {
    std::lock_guard lk(m_);
    if (free_.empty()) return std::make_unique<zp::device::Event>();
    auto e = std::move(free_.back());
    free_.pop_back();
    return e;
  }
  void give(std::unique_ptr<zp::device::Event> e) noexcept {
    try {
      std::lock_guard lk(m_);
      free_.push_back(std::move(e));
    } catch (...) {  // no room to keep it: destroyed instead
    }
  }

 private:
  std::mutex m_;
  std::vector<std::unique_ptr<zp::device::Event>> free_;
};

// The completion event of an operation on a rank's communication stream (the Op of zp::Work):
// finishing it makes the caller's current stream wait for it. A failed device fails the next
// call that can throw, as CUDA's errors are sticky.
struct Op {
  std::unique_ptr<zp::device::Event> event;
  std::shared_ptr<EventPool> pool;  // where the event goes back

  explicit operator bool() const noexcept { return event != nullptr; }
  void finish() noexcept {
    try {
      zp::device::wait(zp::device::current_stream(), event->get(), "cuda_threads.work.wait");
    } catch (const Error& e) {  // sticky: the next call that can throw reports it, if any comes
      zp::detail::log_dropped("cuda_threads backend: Work", e.what());
    }
    pool->give(std::move(event));
  }
  bool done() {
    if (!zp::device::event_done(event->get())) return false;
    finish();
    return true;
  }
  void drop() noexcept {
    if (event) finish();
  }
};

}  // namespace cuda_threads_detail

class CudaThreads {
 public:
  static constexpr const char* name = "cuda_threads";
  static constexpr MemorySpace memory = MemorySpace::device;

  // An enqueued operation (work.hpp): finishing it makes the caller's current stream wait for it.
  using Work = zp::Work<cuda_threads_detail::Op>;

  // Rank `base.rank()` of the world `base` belongs to, on the current device; the backend takes
  // the rank over and creates its communication stream.
  explicit CudaThreads(Threads base)
      : base_(std::move(base)),
        shared_(std::make_shared<cuda_threads_detail::Shared>()),
        stream_(std::make_unique<zp::device::Stream>()) {
    ZP_EXPECT(base_.size() <= cuda_threads_detail::max_ranks,
              "cuda_threads backend: ", base_.size(), " ranks, at most ",
              cuda_threads_detail::max_ranks);
  }
  CudaThreads(CudaThreads&&) noexcept = default;
  CudaThreads& operator=(CudaThreads&&) noexcept = default;

  int rank() const { return base_.rank(); }
  int size() const { return base_.size(); }
  zp::device::stream_t stream() const { return stream_->get(); }  // the communication stream

  Work all_reduce(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch) {
    return collective(
        {CollOp::all_reduce, src, dst, n, t, op}, [&](const Calls& calls, stream_t s) {
          visit_dtype(t, [&](auto tag) { reduce<decltype(tag)>(calls, n, 0, op, s); });
        });
  }
  Work reduce_scatter(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch) {
    return collective({CollOp::reduce_scatter, src, dst, n, t, op},
                      [&](const Calls& calls, stream_t s) {
                        visit_dtype(t, [&](auto tag) {
                          reduce<decltype(tag)>(calls, std::size_t(size()) * n, n, op, s);
                        });
                      });
  }
  Work all_gather(const void* src, void* dst, std::size_t n, DType t, Launch) {
    return collective({CollOp::all_gather, src, dst, n, t}, [&](const Calls& calls, stream_t s) {
      const std::size_t bytes = n * size_of(t), total = bytes * std::size_t(size());
      if (alone(calls, total, s)) return;
      cuda_threads_detail::Gather g{{}, {}, size(), {bytes, total}, bytes % 16 == 0};
      for (int r = 0; r < size(); ++r) {
        g.in[r] = static_cast<const unsigned char*>(calls[std::size_t(r)].src);
        g.out[r] = static_cast<unsigned char*>(calls[std::size_t(r)].dst);
        g.vectorized =
            g.vectorized && zp::device::aligned16(g.in[r]) && zp::device::aligned16(g.out[r]);
      }
      zp::device::launch(s, (total + 15) / 16, g);
    });
  }
  Work all_to_all(const void* src, void* dst, std::size_t n, DType t, Launch) {
    return collective({CollOp::all_to_all, src, dst, n, t}, [&](const Calls& calls, stream_t s) {
      const std::size_t bytes = n * size_of(t);
      if (!bytes) return;
      for (int r = 0; r < size(); ++r)  // rank r's block q into rank q's output, at r
        for (int q = 0; q < size(); ++q)
          zp::device::copy(
              static_cast<char*>(calls[std::size_t(q)].dst) + std::size_t(r) * bytes,
              static_cast<const char*>(calls[std::size_t(r)].src) + std::size_t(q) * bytes, bytes,
              s);
    });
  }
  // Rank r's block q into rank q's output, where q's receive counts put it.
  Work all_to_all_v(const void* src, const std::size_t* send_counts, void* dst,
                    const std::size_t* recv_counts, DType t, Launch) {
    return collective(
        threads_detail::exchange_v_call(src, send_counts, dst, recv_counts, t, size()),
        [&](const Calls& calls, stream_t s) {
          const std::size_t es = size_of(t);
          for (int r = 0; r < size(); ++r) {
            const auto& from = calls[std::size_t(r)];
            std::size_t at = 0;  // elements of r's input before block q
            for (int q = 0; q < size(); ++q) {
              const auto& to = calls[std::size_t(q)];
              const std::size_t k = from.sends[std::size_t(q)];
              if (k)
                zp::device::copy(
                    static_cast<char*>(to.dst) + detail::block_offset(to.recvs.data(), r) * es,
                    static_cast<const char*>(from.src) + at * es, k * es, s);
              at += k;
            }
          }
        });
  }
  Work broadcast(const void* src, void* dst, std::size_t n, DType t, int root, Launch) {
    threads_detail::Call c{CollOp::broadcast, src, dst, n, t};
    c.root = root;
    return collective(c, [&](const Calls& calls, stream_t s) {
      const void* from = calls[std::size_t(root)].src;
      for (const auto& to : calls)
        if (to.dst != from) zp::device::copy(to.dst, from, n * size_of(t), s);
    });
  }
  Work barrier(Launch) {  // the host meetings are the barrier
    return collective({CollOp::barrier}, [](const Calls&, stream_t) {});
  }
  Work send(const void*, std::size_t, DType, int, Launch) { throw unsupported("send"); }
  Work recv(void*, std::size_t, DType, int, Launch) { throw unsupported("recv"); }

  CudaThreads split(int color, int key) { return CudaThreads(base_.split(color, key)); }

 private:
  static Error unsupported(const char* what) {
    return Error(Errc::invalid_argument,
                 detail::cat("cuda_threads backend: ", what,
                             " is not supported (point to point needs a GPU backend "
                             "with peers: nccl)"));
  }

  using Calls = std::vector<threads_detail::Call>;
  using stream_t = zp::device::stream_t;

  // One rank: a reduction or gather of one input is that input, so nothing runs in place and
  // out of place it is a copy (a kernel reading and rewriting the buffer in place took ~0.45 ms
  // of kernel time in a ~2 ms step at stage 2 on one rank: bench/RESULTS.md's ncu figures).
  static bool alone(const Calls& calls, std::size_t bytes, stream_t s) {
    if (calls.size() != 1) return false;
    if (bytes && calls[0].src != calls[0].dst)
      zp::device::copy(calls[0].dst, calls[0].src, bytes, s);
    return true;
  }

  // Every rank's part of a reduction over n elements in one launch (cuda_threads_detail::Reduce;
  // block 0: all_reduce, else reduce_scatter's block per rank).
  template <class T>
  static void reduce(const Calls& calls, std::size_t n, std::size_t block, ReduceOp op,
                     stream_t s) {
    if (n == 0 || alone(calls, n * sizeof(T), s)) return;
    cuda_threads_detail::Pointers<T> p{};
    bool vectorized = (block * sizeof(T)) % 16 == 0;
    for (std::size_t r = 0; r < calls.size(); ++r) {
      p.in[r] = static_cast<const T*>(calls[r].src);
      p.out[r] = static_cast<T*>(calls[r].dst);
      vectorized = vectorized && zp::device::aligned16(p.in[r]) && zp::device::aligned16(p.out[r]);
    }
    auto run = [&](auto kind) {
      using R = cuda_threads_detail::Reduce<T, decltype(kind)::value>;
      zp::device::launch(s, (n + R::w - 1) / R::w,
                         R{p, int(calls.size()), n, zp::device::DivMod(block, n), op, vectorized});
    };
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: return run(std::integral_constant<ReduceOp, ReduceOp::sum>{});
      case ReduceOp::max: return run(std::integral_constant<ReduceOp, ReduceOp::max>{});
      case ReduceOp::min: return run(std::integral_constant<ReduceOp, ReduceOp::min>{});
    }
  }

  // Steps 1-3 of the file comment: rank 0 enqueues every rank's part, `enqueue(calls, stream)`.
  template <class Enqueue>
  Work collective(threads_detail::Call c, Enqueue&& enqueue) {
    zp::device::expect_device_memory(c.src, "cuda_threads: a collective's input");
    zp::device::expect_device_memory(c.dst, "cuda_threads: a collective's output");
    const stream_t s = zp::device::current_stream(), cs = stream();
    zp::device::record(shared_->ready.get(), s, "cuda_threads.ready.record");
    c.ext = &shared_;
    // Taken during the meeting, while every rank is inside it: after it rank 0 may return from
    // its last operation and destroy its backend while this rank still enqueues its wait.
    std::shared_ptr<const cuda_threads_detail::Shared> leader;
    base_.meet(c, [&](const Calls& calls) {
      leader = peer(calls[0]);
      if (rank() != 0) return;
      for (const auto& call : calls)
        zp::device::wait(cs, peer(call)->ready.get(), "cuda_threads.ready.wait");
      zp::device::before_enqueue(cs, zp::device::Role::comm);
      enqueue(calls, cs);
      zp::device::record(shared_->done.get(), cs, "cuda_threads.done.record");
    });
    if (rank() != 0) {
      zp::device::before_enqueue(cs, zp::device::Role::comm);
      zp::device::wait(cs, leader->done.get(), "cuda_threads.done.wait");
    }
    auto e = pool_->take();
    zp::device::record(e->get(), cs, "cuda_threads.work.record");
    return Work(cuda_threads_detail::Op{std::move(e), pool_});
  }
  static std::shared_ptr<const cuda_threads_detail::Shared> peer(const threads_detail::Call& c) {
    return *static_cast<const std::shared_ptr<cuda_threads_detail::Shared>*>(c.ext);
  }

  Threads base_;
  std::shared_ptr<cuda_threads_detail::Shared>
      shared_;  // peers keep it alive until their waits are enqueued
  std::shared_ptr<cuda_threads_detail::EventPool> pool_ =
      std::make_shared<cuda_threads_detail::EventPool>();  // unwaited Works keep it alive
  std::unique_ptr<zp::device::Stream> stream_;             // on the heap: the backend moves
};

static_assert(Backend<CudaThreads>);

// Runs fn(Collective<CudaThreads>&) on `ranks` threads driving `device`, each rank with its own
// compute stream as its current stream (zp::device::StreamScope), and joins them; failures as
// run_threads.
inline void run_cuda_threads(int ranks, detail::FunctionRef<void(Collective<CudaThreads>&)> fn,
                             int device = 0, ThreadsOptions opt = {}) {
  run_threads(
      ranks,
      [&](Collective<Threads>& host) {
        zp::device::set_device(device);
        zp::device::Stream compute;
        zp::device::StreamScope on(compute.get());
        // Its own world (a split of the host one), so this rank's host backend stays with
        // run_threads; the last barrier keeps it alive until every rank is done with it.
        Collective<CudaThreads> comm{CudaThreads(host.backend().split(0, host.rank()))};
        fn(comm);
        comm.barrier();
      },
      opt);
}

}  // namespace zp::backend
