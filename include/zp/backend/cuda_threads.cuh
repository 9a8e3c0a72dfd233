// zp/backend/cuda_threads.cuh: N ranks on one GPU (nvcc only). Ranks are threads of one process
// sharing a device; buffers are device memory; collectives are CUDA kernels on each rank's
// stream. NCCL refuses two ranks on one device, so this is how a multi-rank device engine runs
// on one GPU: to test it, and to rehearse an 8-GPU ZeRO-3 job (its memory and its traffic) on one.
//
// Each rank has a communication stream of its own besides its compute stream (the calling
// thread's current stream, zp/stream.hpp). Each operation meets the other ranks on the host
// through the threads backend's rendezvous (threads.hpp: the calls compared, timeouts,
// poisoning), but never waits for the GPU:
//   1. rank r records `ready` on its compute stream (its inputs are complete there) and meets
//      the others;
//   2. between the meetings its communication stream waits for every rank's `ready`, then it
//      enqueues its part there (all_reduce: its slice of every rank's buffers, summed in rank
//      order with the host backends' element math, detail::combine_one, so results equal the
//      threads backend bit for bit; all_gather: its input into every output) and records `done`;
//   3. after the second meeting its communication stream waits for every rank's `done` (the
//      other ranks wrote into its outputs, and its next operation must not rewrite a buffer
//      another rank still reads), and records the Work's event there. Work::wait() (or a Work
//      destroyed unwaited) makes the compute stream wait for that event, as with nccl.
// Events are re-recorded only after the next first meeting, when every wait on them is enqueued.
// send/recv are not supported (pipeline parallelism on one GPU is not implemented yet).
#pragma once

#if !defined(__CUDACC__)
#error "zp/backend/cuda_threads.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "zp/backend/threads.hpp"
#include "zp/detail/reduce.hpp"
#include "zp/device.cuh"

namespace zp::backend {

namespace cuda_threads_detail {

inline constexpr int max_ranks = 64;

template <class T>
struct Pointers {
  const T* in[max_ranks];
  T* out[max_ranks];
};

// Rank `rank`'s part of a reduction: elements [lo, hi) of every input reduced in rank order into
// every output (all_reduce, n_out = ranks) or into its own output at 0 (reduce_scatter, n_out =
// 1, inputs offset by the caller).
template <class T, ReduceOp Op>
__global__ void reduce_kernel(Pointers<T> p, int ranks, int n_out, std::size_t lo, std::size_t hi, ReduceOp op) {
  using A = typename detail::accum<T>::type;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = lo + std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < hi; i += stride) {
    A acc = A(p.in[0][i]);
    for (int r = 1; r < ranks; ++r) acc = detail::combine_one<Op>(acc, A(p.in[r][i]));
    const T v = T(detail::finish_one(acc, op, ranks));
    for (int k = 0; k < n_out; ++k) p.out[k][n_out == 1 ? i - lo : i] = v;
  }
}

// The rank's state its peers use: the events of the current operation.
struct Shared {
  zp::device::Event ready, done;
};

using zp::device::check;

}  // namespace cuda_threads_detail

class CudaThreads {
 public:
  static constexpr const char* name = "cuda_threads";
  static constexpr MemorySpace memory = MemorySpace::device;

  // The completion event of an operation on the rank's communication stream.
  class Work {
   public:
    Work() = default;
    Work(Work&&) noexcept = default;
    Work& operator=(Work&& o) noexcept {
      if (this != &o) {
        wait();
        event_ = std::move(o.event_);
      }
      return *this;
    }
    ~Work() { wait(); }
    // Makes the caller's current stream wait for the operation.
    void wait() noexcept {
      if (!event_) return;
      (void)cudaStreamWaitEvent(zp::device::current_stream(), event_->get(), 0);
      event_.reset();
    }
    bool test() {
      if (!event_) return true;
      const cudaError_t q = cudaEventQuery(event_->get());
      if (q == cudaErrorNotReady) return false;
      cuda_threads_detail::check(q, "cudaEventQuery");
      wait();
      return true;
    }

   private:
    friend class CudaThreads;
    explicit Work(std::unique_ptr<zp::device::Event> e) : event_(std::move(e)) {}
    std::unique_ptr<zp::device::Event> event_;
  };

  // Rank `base.rank()` of the world `base` belongs to, on the current device; the backend takes
  // the rank over and creates its communication stream.
  explicit CudaThreads(Threads base)
      : base_(std::move(base)),
        shared_(std::make_unique<cuda_threads_detail::Shared>()),
        stream_(std::make_unique<zp::device::Stream>()) {
    ZP_EXPECT(base_.size() <= cuda_threads_detail::max_ranks, "cuda_threads backend: ", base_.size(),
              " ranks, at most ", cuda_threads_detail::max_ranks);
  }
  CudaThreads(CudaThreads&&) noexcept = default;
  CudaThreads& operator=(CudaThreads&&) noexcept = default;

  int rank() const { return base_.rank(); }
  int size() const { return base_.size(); }
  cudaStream_t stream() const { return stream_->get(); }  // the communication stream

  Work all_reduce(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch) {
    return collective({CollOp::all_reduce, src, dst, n, t, op}, [&](const auto& calls, cudaStream_t s) {
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
    return collective({CollOp::reduce_scatter, src, dst, n, t, op}, [&](const auto& calls, cudaStream_t s) {
      visit_dtype(t, [&](auto tag) {
        using T = decltype(tag);
        cuda_threads_detail::Pointers<T> p{};
        for (int r = 0; r < size(); ++r) p.in[r] = static_cast<const T*>(calls[std::size_t(r)].src);
        p.out[0] = static_cast<T*>(dst);  // the kernel writes out[0][i - lo]
        const std::size_t lo = std::size_t(rank()) * n;
        reduce(p, size(), 1, lo, lo + n, op, s);
      });
    });
  }
  Work all_gather(const void* src, void* dst, std::size_t n, DType t, Launch) {
    return collective({CollOp::all_gather, src, dst, n, t}, [&](const auto& calls, cudaStream_t s) {
      const std::size_t bytes = n * size_of(t);
      for (int r = 0; r < size(); ++r) {
        char* out = static_cast<char*>(calls[std::size_t(r)].dst) + std::size_t(rank()) * bytes;
        if (out != src && bytes)
          cuda_threads_detail::check(cudaMemcpyAsync(out, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
      }
    });
  }
  Work broadcast(const void* src, void* dst, std::size_t n, DType t, int root, Launch) {
    threads_detail::Call c{CollOp::broadcast, src, dst, n, t};
    c.root = root;
    return collective(c, [&](const auto& calls, cudaStream_t s) {
      const void* from = calls[std::size_t(root)].src;
      if (from != dst && n)
        cuda_threads_detail::check(cudaMemcpyAsync(dst, from, n * size_of(t), cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    });
  }
  Work barrier(Launch) {  // the host meetings are the barrier
    return collective({CollOp::barrier}, [](const auto&, cudaStream_t) {});
  }
  Work send(const void*, std::size_t, DType, int, Launch) { throw unsupported("send"); }
  Work recv(void*, std::size_t, DType, int, Launch) { throw unsupported("recv"); }

  CudaThreads split(int color, int key) { return CudaThreads(base_.split(color, key)); }

 private:
  static Error unsupported(const char* what) {
    return Error(Errc::invalid_argument, detail::cat("cuda_threads backend: ", what,
                                                     " is not supported (point to point needs a GPU backend "
                                                     "with peers: nccl)"));
  }

  template <class T>
  static void reduce(const cuda_threads_detail::Pointers<T>& p, int n, int n_out, std::size_t lo, std::size_t hi,
                     ReduceOp op, cudaStream_t s) {
    if (lo >= hi) return;
    const int blocks = optim::cuda::detail::grid_for(hi - lo), threads = 256;
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        cuda_threads_detail::reduce_kernel<T, ReduceOp::sum><<<blocks, threads, 0, s>>>(p, n, n_out, lo, hi, op);
        break;
      case ReduceOp::max:
        cuda_threads_detail::reduce_kernel<T, ReduceOp::max><<<blocks, threads, 0, s>>>(p, n, n_out, lo, hi, op);
        break;
      case ReduceOp::min:
        cuda_threads_detail::reduce_kernel<T, ReduceOp::min><<<blocks, threads, 0, s>>>(p, n, n_out, lo, hi, op);
        break;
    }
    cuda_threads_detail::check(cudaGetLastError(), "cuda_threads reduction launch");
  }

  // Steps 1-3 of the file comment around `enqueue(calls, stream)`, this rank's part.
  template <class Enqueue>
  Work collective(threads_detail::Call c, Enqueue&& enqueue) {
    const cudaStream_t s = zp::device::current_stream(), cs = stream();
    cuda_threads_detail::check(cudaEventRecord(shared_->ready.get(), s), "cudaEventRecord");
    c.ext = shared_.get();
    const cuda_threads_detail::Shared* peers[cuda_threads_detail::max_ranks] = {};
    base_.meet(c, [&](const std::vector<threads_detail::Call>& calls) {
      for (int r = 0; r < size(); ++r) peers[r] = peer(calls[std::size_t(r)]);
      for (int r = 0; r < size(); ++r)
        cuda_threads_detail::check(cudaStreamWaitEvent(cs, peers[r]->ready.get(), 0), "cudaStreamWaitEvent");
      zp::device::before_enqueue(cs, zp::device::Role::comm);
      enqueue(calls, cs);
      cuda_threads_detail::check(cudaEventRecord(shared_->done.get(), cs), "cudaEventRecord");
    });
    for (int r = 0; r < size(); ++r)
      if (r != rank()) cuda_threads_detail::check(cudaStreamWaitEvent(cs, peers[r]->done.get(), 0), "cudaStreamWaitEvent");
    auto e = std::make_unique<zp::device::Event>();
    cuda_threads_detail::check(cudaEventRecord(e->get(), cs), "cudaEventRecord");
    return Work(std::move(e));
  }
  static const cuda_threads_detail::Shared* peer(const threads_detail::Call& c) {
    return static_cast<const cuda_threads_detail::Shared*>(c.ext);
  }

  Threads base_;
  std::unique_ptr<cuda_threads_detail::Shared> shared_;  // on the heap: peers hold its address
  std::unique_ptr<zp::device::Stream> stream_;            // on the heap: the backend moves
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
        cuda_threads_detail::check(cudaSetDevice(device), "cudaSetDevice");
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
