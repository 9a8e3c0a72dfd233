// zp/backend/cuda_threads.hpp: N ranks on one device. Ranks are threads of one process sharing
// a device; buffers are device memory; collectives are kernels on each rank's communication
// stream, written on the device primitives (zp/device/runtime.hpp), so the backend builds with
// nvcc for a GPU or with any C++ compiler for the simulated device. NCCL refuses two ranks on one
// device, so this is how a multi-rank device engine runs on one GPU: to test it, and to rehearse
// an 8-GPU ZeRO-3 job (its memory and its traffic) on one.
//
// Each rank has a communication stream of its own besides its compute stream (the calling
// thread's current stream, zp/device/stream.hpp). Each operation meets the other ranks on the host
// through the threads backend's rendezvous (threads.hpp: the calls compared, timeouts,
// poisoning), but never waits for the GPU:
//   1. rank r records `ready` on its compute stream (its inputs are complete there) and meets
//      the others;
//   2. between the meetings its communication stream waits for every rank's `ready`, then it
//      enqueues its part there (all_reduce: its slice of every rank's buffers, summed in rank
//      order with the host backends' element math, detail::combine_one, so results equal the
//      threads backend bit for bit; all_gather: its input into every output; all_to_all (and
//      all_to_all_v): its input's block q into rank q's output) and records `done`;
//   3. after the second meeting its communication stream waits for every rank's `done` (the
//      other ranks wrote into its outputs, and its next operation must not rewrite a buffer
//      another rank still reads), and records the Work's event there. Work::wait() (or a Work
//      destroyed unwaited) makes the compute stream wait for that event, as with nccl.
// Events are re-recorded only after the next first meeting, when every wait on them is enqueued.
// send/recv are not supported (pipeline parallelism on one GPU is not implemented yet).
// The `site` names of its waits are the mutation table's (tests/device/mutations.cmake).
#pragma once

#include <memory>
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

// Rank `rank`'s part of a reduction, element lo + i: every input reduced in rank order into
// every output (all_reduce, n_out = ranks) or into its own output at i (reduce_scatter, n_out =
// 1, inputs offset by the caller).
template <class T, ReduceOp Op>
struct Reduce {
  Pointers<T> p;
  int ranks, n_out;
  std::size_t lo;
  ReduceOp op;
  ZP_HOST_DEVICE void operator()(std::size_t i) const {
    using A = typename detail::accum<T>::type;
    const std::size_t at = lo + i;
    A acc = A(p.in[0][at]);
    for (int r = 1; r < ranks; ++r) acc = detail::combine_one<Op>(acc, A(p.in[r][at]));
    const T v = T(detail::finish_one(acc, op, ranks));
    for (int k = 0; k < n_out; ++k) p.out[k][n_out == 1 ? i : at] = v;
  }
};

// The rank's state its peers use: the events of the current operation.
struct Shared {
  zp::device::Event ready, done;
};

// The completion event of an operation on a rank's communication stream (the Op of zp::Work):
// finishing it makes the caller's current stream wait for it. A failed device fails the next
// call that can throw, as CUDA's errors are sticky.
struct Op {
  std::unique_ptr<zp::device::Event> event;

  explicit operator bool() const noexcept { return event != nullptr; }
  void finish() noexcept {
    try {
      zp::device::wait(zp::device::current_stream(), event->get(), "cuda_threads.work.wait");
    } catch (const Error& e) {  // sticky: the next call that can throw reports it, if any comes
      zp::detail::log_dropped("cuda_threads backend: Work", e.what());
    }
    event.reset();
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
    return collective({CollOp::all_reduce, src, dst, n, t, op},
                      [&](const auto& calls, zp::device::stream_t s) {
                        visit_dtype(t, [&](auto tag) {
                          using T = decltype(tag);
                          cuda_threads_detail::Pointers<T> p{};
                          for (int r = 0; r < size(); ++r) {
                            p.in[r] = static_cast<const T*>(calls[std::size_t(r)].src);
                            p.out[r] = static_cast<T*>(calls[std::size_t(r)].dst);
                          }
                          const auto [lo, hi] = detail::rank_slice(n, rank(), size());
                          reduce(p, size(), size(), lo, hi, op, s);
                        });
                      });
  }
  Work reduce_scatter(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch) {
    return collective({CollOp::reduce_scatter, src, dst, n, t, op},
                      [&](const auto& calls, zp::device::stream_t s) {
                        visit_dtype(t, [&](auto tag) {
                          using T = decltype(tag);
                          cuda_threads_detail::Pointers<T> p{};
                          for (int r = 0; r < size(); ++r)
                            p.in[r] = static_cast<const T*>(calls[std::size_t(r)].src);
                          p.out[0] = static_cast<T*>(dst);  // the kernel writes out[0][i - lo]
                          const std::size_t lo = std::size_t(rank()) * n;
                          reduce(p, size(), 1, lo, lo + n, op, s);
                        });
                      });
  }
  Work all_gather(const void* src, void* dst, std::size_t n, DType t, Launch) {
    return collective(
        {CollOp::all_gather, src, dst, n, t}, [&](const auto& calls, zp::device::stream_t s) {
          const std::size_t bytes = n * size_of(t);
          for (int r = 0; r < size(); ++r) {
            char* out = static_cast<char*>(calls[std::size_t(r)].dst) + std::size_t(rank()) * bytes;
            if (out != src) zp::device::copy(out, src, bytes, s);
          }
        });
  }
  Work all_to_all(const void* src, void* dst, std::size_t n, DType t, Launch) {
    return collective(
        {CollOp::all_to_all, src, dst, n, t}, [&](const auto& calls, zp::device::stream_t s) {
          const std::size_t bytes = n * size_of(t);
          if (!bytes) return;
          for (int r = 0; r < size(); ++r)
            zp::device::copy(
                static_cast<char*>(calls[std::size_t(r)].dst) + std::size_t(rank()) * bytes,
                static_cast<const char*>(src) + std::size_t(r) * bytes, bytes, s);
        });
  }
  // Its block q into rank q's output, where q's receive counts put it.
  Work all_to_all_v(const void* src, const std::size_t* send_counts, void* dst,
                    const std::size_t* recv_counts, DType t, Launch) {
    return collective(
        threads_detail::exchange_v_call(src, send_counts, dst, recv_counts, t, size()),
        [&](const auto& calls, zp::device::stream_t s) {
          const std::size_t es = size_of(t);
          std::size_t at = 0;  // elements of src before block r
          for (int r = 0; r < size(); ++r) {
            const auto& to = calls[std::size_t(r)];
            const std::size_t k = send_counts[r];
            if (k)
              zp::device::copy(
                  static_cast<char*>(to.dst) + detail::block_offset(to.recvs.data(), rank()) * es,
                  static_cast<const char*>(src) + at * es, k * es, s);
            at += k;
          }
        });
  }
  Work broadcast(const void* src, void* dst, std::size_t n, DType t, int root, Launch) {
    threads_detail::Call c{CollOp::broadcast, src, dst, n, t};
    c.root = root;
    return collective(c, [&](const auto& calls, zp::device::stream_t s) {
      const void* from = calls[std::size_t(root)].src;
      if (from != dst) zp::device::copy(dst, from, n * size_of(t), s);
    });
  }
  Work barrier(Launch) {  // the host meetings are the barrier
    return collective({CollOp::barrier}, [](const auto&, zp::device::stream_t) {});
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

  template <class T>
  static void reduce(const cuda_threads_detail::Pointers<T>& p, int n, int n_out, std::size_t lo,
                     std::size_t hi, ReduceOp op, zp::device::stream_t s) {
    if (lo >= hi) return;
    auto run = [&](auto kind) {
      zp::device::launch(
          s, hi - lo, cuda_threads_detail::Reduce<T, decltype(kind)::value>{p, n, n_out, lo, op});
    };
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: return run(std::integral_constant<ReduceOp, ReduceOp::sum>{});
      case ReduceOp::max: return run(std::integral_constant<ReduceOp, ReduceOp::max>{});
      case ReduceOp::min: return run(std::integral_constant<ReduceOp, ReduceOp::min>{});
    }
  }

  // Steps 1-3 of the file comment around `enqueue(calls, stream)`, this rank's part.
  template <class Enqueue>
  Work collective(threads_detail::Call c, Enqueue&& enqueue) {
    const zp::device::stream_t s = zp::device::current_stream(), cs = stream();
    zp::device::record(shared_->ready.get(), s, "cuda_threads.ready.record");
    c.ext = &shared_;
    // Taken during the meeting, while every rank is inside it: after it a peer may return from
    // its last operation and destroy its backend while this rank still enqueues waits on them.
    std::shared_ptr<const cuda_threads_detail::Shared> peers[cuda_threads_detail::max_ranks];
    base_.meet(c, [&](const std::vector<threads_detail::Call>& calls) {
      for (int r = 0; r < size(); ++r) peers[r] = peer(calls[std::size_t(r)]);
      for (int r = 0; r < size(); ++r)
        zp::device::wait(cs, peers[r]->ready.get(), "cuda_threads.ready.wait");
      zp::device::before_enqueue(cs, zp::device::Role::comm);
      enqueue(calls, cs);
      zp::device::record(shared_->done.get(), cs, "cuda_threads.done.record");
    });
    for (int r = 0; r < size(); ++r)
      if (r != rank()) zp::device::wait(cs, peers[r]->done.get(), "cuda_threads.done.wait");
    auto e = std::make_unique<zp::device::Event>();
    zp::device::record(e->get(), cs, "cuda_threads.work.record");
    return Work(cuda_threads_detail::Op{std::move(e)});
  }
  static std::shared_ptr<const cuda_threads_detail::Shared> peer(const threads_detail::Call& c) {
    return *static_cast<const std::shared_ptr<cuda_threads_detail::Shared>*>(c.ext);
  }

  Threads base_;
  std::shared_ptr<cuda_threads_detail::Shared>
      shared_;  // peers keep it alive until their waits are enqueued
  std::unique_ptr<zp::device::Stream> stream_;  // on the heap: the backend moves
};

static_assert(Backend<CudaThreads>);

// Runs fn(Collective<CudaThreads>&) on `ranks` threads driving `device`, each rank with its own
// compute stream as its current stream (zp::device::StreamScope), and joins them; failures as
// run_threads.
template <class F>
void run_cuda_threads(int ranks, F&& fn, int device = 0, ThreadsOptions opt = {}) {
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
