// zp/backend/nccl.hpp: ranks are GPUs, buffers are device memory, operations run on a CUDA
// stream through NCCL. Needs the CUDA runtime and NCCL headers (link zp::nccl); builds with a
// plain C++ compiler (no kernels here).
//
// Getting communicators:
//  - one process per GPU, bootstrapped over MPI: nccl_from_mpi(comm) (available when <mpi.h>
//    is reachable, i.e. when zp::mpi is linked too). Rank 0 creates the ncclUniqueId and
//    MPI_Bcasts it; each process takes the GPU numbered by its rank among the processes of its
//    node (MPI_Comm_split_type SHARED), modulo the GPUs it sees.
//  - one process driving several GPUs: Nccl::create_local({0, 1, ...}) (ncclCommInitAll),
//    one backend per device, rank i on devices[i], each driven by its own host thread: a
//    collective on one of them may block until its peers join it (NCCL sets up connections on
//    first use), so one thread issuing on each in turn would deadlock.
//  - any other bootstrap: Nccl::create(id, rank, size, device) with an ncclUniqueId you
//    distributed yourself.
//
// Streams (zp/device/stream.hpp, on the CUDA primitives of zp/device/cuda.hpp): every operation runs on the backend's own communication stream
// (stream()), after an event recorded on the caller's current stream (the rank's compute
// stream), so it reads inputs the caller's kernels wrote; an event recorded after it completes
// its Work. Work::wait() (and a Work destroyed unwaited) makes the caller's current stream wait
// for that event, as PyTorch's NCCL work does: the host does not wait, and communication
// overlaps the computation queued meanwhile. Launch::blocking orders the same way; barrier()
// alone waits on the host, as a barrier must. The host learns of NCCL's asynchronous errors and
// of hung peers where it waits: in barrier(), in test(), and in device::synchronize() (which
// polls every communicator its thread used): an error or a wait longer than Options::timeout
// aborts the communicator (ncclCommAbort, so the GPU work does not hang either) and throws
// zp::Error(Errc::nccl) or zp::Error(Errc::timeout); afterwards every call on it throws
// Errc::aborted. A backend destroyed during stack unwinding aborts its communicator instead of
// destroying it (ncclCommDestroy could wait for peers that never come); otherwise the last
// one waits for its stream up to the timeout, and aborts past it or on an NCCL error (a drained
// stream then goes to ncclCommDestroy, which some NCCL versions finalize with the peers: not yet
// run on a GPU). Creation and split block until every rank joins: NCCL's non-blocking mode would
// bound them, but it launches each later collective from a new host thread, a cost not yet
// measured on a GPU.
// bf16/fp16 map to ncclBfloat16/ncclFloat16 and reduce with NCCL's own arithmetic (rounded to
// 16 bits between steps, unlike the host backends' fp32 accumulation); avg is ncclAvg.
// reduce_scatter and all_gather are in place when the buffers follow the ZeRO layout (NCCL's
// own in-place convention). barrier is a one-element all_reduce on a device scratch word.
// Every CUDA and NCCL call is checked (Errc::cuda / Errc::nccl with the native code).
//
// send/recv are ncclSend/ncclRecv on stream(), each its own NCCL operation, so they run in
// stream order with everything else: two ranks that exchange must issue them in compatible
// orders (e.g. the lower rank sends first, the higher one receives first), since a send may not
// complete until its recv runs. NCCL cannot see a count or type mismatch between a send and its
// recv (it is undefined behaviour there, usually a hang that ends in the timeout); bad peers
// and buffers are checked here (detail::check_p2p) on the calling rank.
#pragma once

#if !defined(__has_include)
#error "zp/backend/nccl.hpp needs __has_include to find the CUDA and NCCL headers"
#elif !__has_include(<cuda_runtime_api.h>)
#error \
    "zp/backend/nccl.hpp needs the CUDA runtime headers (<cuda_runtime_api.h>): install the CUDA toolkit and link zp::nccl (or zp::cuda)"
#elif !__has_include(<nccl.h>)
#error \
    "zp/backend/nccl.hpp needs NCCL (<nccl.h>): install NCCL (or set NCCL_ROOT) and link zp::nccl"
#endif

#include <cuda_runtime_api.h>
#include <nccl.h>

#if __has_include(<mpi.h>)
#include <mpi.h>
#define ZP_NCCL_HAS_MPI_BOOTSTRAP 1
#else
#define ZP_NCCL_HAS_MPI_BOOTSTRAP 0
#endif

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "zp/collective.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"
#include "zp/work.hpp"
#include "zp/device/stream.hpp"

namespace zp::backend {

struct NcclOptions {
  // How long a wait may last before the communicator is aborted (Errc::timeout).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

namespace nccl_detail {

inline void cuda_check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) [[unlikely]]
    device::check(e, detail::cat("nccl backend: ", call).c_str());
}
// A device primitive's error, as the backend's.
template <class F>
auto cuda_call(F&& f) -> decltype(f()) {
  return detail::with_context(f, [](const std::string& m) { return "nccl backend: " + m; });
}

inline void nccl_check(ncclResult_t r, const char* call, ncclComm_t comm = nullptr) {
  if (r != ncclSuccess && r != ncclInProgress) [[unlikely]] {
    std::string msg = detail::cat("nccl backend: ", call, " failed: ", ncclGetErrorString(r));
    const char* last = ncclGetLastError(comm);
    if (last && *last) msg += detail::cat(" (", last, ")");
    throw Error(Errc::nccl, msg, int(r));
  }
}

inline ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
  }
  return ncclFloat32;
}

// The reduction over `ranks` ranks. The mean of one rank's values is those values: at world
// size 1 avg goes to NCCL as a sum, because NCCL's one-rank path for ncclAvg (the libnccl of
// the H100 machine, 2026-11) left the last 3 of 1000003 f64 elements of an out-of-place
// all_reduce and reduce_scatter unwritten (tests/backend/nccl.test.cpp, the one-GPU case).
inline ncclRedOp_t nccl_op(ReduceOp op, int ranks) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ranks == 1 ? ncclSum : ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

// Makes `device` current for the scope, restoring the caller's device afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cuda_check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device)
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
    else
      prev_ = -1;
  }
  ~DeviceScope() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

// Shared by a backend and its outstanding work handles; watched by the host synchronisations
// of the threads that use it.
// A host wait's pause between polls: yields first, then sleeps (a wait past a millisecond or so
// is a slow peer, not a kernel about to end).
inline void pause(int spins) noexcept {
  if (spins > 1000)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  else
    std::this_thread::yield();
}

struct Context final : device::Watched {
  ncclComm_t comm = nullptr;
  device::stream_t stream = nullptr;
  device::event_t ready = nullptr;  // recorded on the caller's stream before each operation
  int device = 0, rank = 0, size = 1;
  NcclOptions opt;
  bool aborted = false;
  std::string abort_reason;
  void* scratch = nullptr;  // one device word for barrier
  std::uint64_t calls = 0;

  void abort(const std::string& why) noexcept {
    if (aborted) return;
    aborted = true;
    abort_reason = why;
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
  }
  // Throws after aborting on an asynchronous NCCL error or a wait past the timeout (`what`: the
  // operation waited for, or nullptr for a stream synchronisation).
  void poll(std::chrono::steady_clock::duration waited, const char* what) {
    if (aborted) throw Error(Errc::aborted, "nccl backend: communicator aborted: " + abort_reason);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    const char* in = what ? what : "an operation";
    if (async != ncclSuccess && async != ncclInProgress) {
      const std::string why = detail::cat("rank ", rank, ": asynchronous NCCL error in ", in, ": ",
                                          ncclGetErrorString(async));
      abort(why);
      throw Error(Errc::nccl, "nccl backend: " + why, int(async));
    }
    if (waited > opt.timeout) {
      const std::string why = detail::cat("rank ", rank, " of ", size, " timed out after ",
                                          opt.timeout.count(), " ms waiting for ", in,
                                          " (the other ranks did not take part); "
                                          "communicator aborted");
      abort(why);
      throw Error(Errc::timeout, "nccl backend: " + why);
    }
  }
  void poll(std::chrono::steady_clock::duration waited) override { poll(waited, nullptr); }
  // Whether the stream ran out before the timeout, with no NCCL error: a peer that died with an
  // operation in flight must not hang this rank's teardown (aborting ends the kernels instead).
  bool drained() const noexcept {
    if (!stream) return true;
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess) return true;
      if (e != cudaErrorNotReady) {
        dropped(e, "cudaStreamQuery");
        return false;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if ((async != ncclSuccess && async != ncclInProgress) ||
          std::chrono::steady_clock::now() - start > opt.timeout)
        return false;
      pause(spins);
    }
  }
  static void dropped(cudaError_t e, const char* call) noexcept {
    if (e != cudaSuccess)
      zp::detail::log_dropped(detail::cat("nccl backend: ", call).c_str(), cudaGetErrorString(e));
  }
  ~Context() override {
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    if (comm && !drained()) {
      abort(detail::cat("rank ", rank, ": its stream did not finish within the timeout (",
                        opt.timeout.count(), " ms) or NCCL reported an error as it was destroyed"));
      zp::detail::log_dropped("nccl backend: teardown aborted the communicator",
                              abort_reason.c_str());
    }
    if (comm)
      if (const ncclResult_t r = ncclCommDestroy(comm); r != ncclSuccess)
        zp::detail::log_dropped("nccl backend: ncclCommDestroy", ncclGetErrorString(r));
    if (scratch) dropped(cudaFree(scratch), "cudaFree");
    if (ready) device::destroy_event(ready);
    if (stream) device::destroy_stream(stream);
    if (prev >= 0) cudaSetDevice(prev);
  }
};

// A pending operation of the nccl backend (the Op of zp::Work): a CUDA event recorded after it on
// the communicator's stream. Finishing it makes the caller's current stream wait for the event
// (PyTorch's semantics) after polling for an asynchronous NCCL error already known.
class Op {
 public:
  Op() = default;
  Op(std::shared_ptr<Context> c, device::event_t e, const char* what)
      : ctx_(std::move(c)), event_(e), what_(what), issued_(std::chrono::steady_clock::now()) {}
  Op(Op&& o) noexcept
      : ctx_(std::move(o.ctx_)),
        event_(std::exchange(o.event_, nullptr)),
        what_(o.what_),
        issued_(o.issued_) {}
  Op& operator=(Op&& o) noexcept {
    if (this != &o) {
      release();
      ctx_ = std::move(o.ctx_);
      event_ = std::exchange(o.event_, nullptr);
      what_ = o.what_;
      issued_ = o.issued_;
    }
    return *this;
  }
  ~Op() { release(); }

  explicit operator bool() const noexcept { return event_ != nullptr; }
  device::event_t event() const noexcept { return event_; }
  void finish() {
    try {
      ctx_->poll(std::chrono::steady_clock::duration::zero(), what_);
    } catch (...) {
      release();
      throw;
    }
    drop();
  }
  // Whether the operation completed on the device (polling errors and the timeout).
  bool done() {
    bool complete = false;
    try {
      complete = cuda_call([&] { return device::event_done(event_); });
      if (!complete) ctx_->poll(std::chrono::steady_clock::now() - issued_, what_);
    } catch (...) {
      release();
      throw;
    }
    if (complete) finish();
    return complete;
  }
  // The caller's current stream waits for the event; then the handle is empty.
  void drop() noexcept {
    try {
      if (event_) device::wait(device::current_stream(), event_, "nccl.work.wait");
    } catch (const Error& e) {  // sticky: the next synchronisation reports it, if any comes
      zp::detail::log_dropped("nccl backend: a dropped Work", e.what());
    }
    release();
  }
  // Waits on the host until the operation completed, or the error or timeout (barrier()).
  void wait_host() {
    for (int spins = 0; event_; ++spins) {
      try {
        if (cuda_call([&] { return device::event_done(event_); })) break;
        ctx_->poll(std::chrono::steady_clock::now() - issued_, what_);
      } catch (...) {
        release();
        throw;
      }
      pause(spins);
    }
    release();
  }

 private:
  void release() noexcept {
    if (event_) device::destroy_event(event_);
    event_ = nullptr;
    ctx_.reset();
  }
  std::shared_ptr<Context> ctx_;
  device::event_t event_ = nullptr;
  const char* what_ = "";
  std::chrono::steady_clock::time_point issued_{};
};

}  // namespace nccl_detail

// The backend over one NCCL communicator, one device and one stream it owns. Move-only.
class Nccl {
 public:
  using Options = NcclOptions;
  static constexpr MemorySpace memory = MemorySpace::device;
  static constexpr const char* name = "nccl";

  // The completion of an enqueued operation (work.hpp): the caller's stream is ordered after it.
  using Work = zp::Work<nccl_detail::Op>;

  // Joins communicator `id` as `rank` of `size` on `device` (ncclCommInitRank; collective over
  // the ranks). The backend creates and owns a non-blocking stream on that device.
  static Nccl create(const ncclUniqueId& id, int rank, int size, int device, Options opt = {}) {
    ZP_EXPECT(size >= 1 && rank >= 0 && rank < size, "nccl backend: rank ", rank, " is not in [0, ",
              size, ")");
    nccl_detail::DeviceScope dev(device);
    ncclComm_t comm = nullptr;
    nccl_detail::nccl_check(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
    return Nccl(comm, device, opt);
  }

  // One communicator over several GPUs driven by this process (ncclCommInitAll): element i is
  // rank i on devices[i].
  static std::vector<Nccl> create_local(const std::vector<int>& devices, Options opt = {}) {
    ZP_EXPECT(!devices.empty(), "nccl backend: create_local needs at least one device");
    std::vector<ncclComm_t> comms(devices.size());
    nccl_detail::nccl_check(ncclCommInitAll(comms.data(), int(devices.size()), devices.data()),
                            "ncclCommInitAll");
    std::vector<Nccl> out;
    out.reserve(devices.size());
    for (std::size_t i = 0; i < devices.size(); ++i) out.push_back(Nccl(comms[i], devices[i], opt));
    return out;
  }

  // A fresh ncclUniqueId (call on one rank, distribute to the others).
  static ncclUniqueId unique_id() {
    ncclUniqueId id;
    nccl_detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return id;
  }

  Nccl(Nccl&& o) noexcept : ctx_(std::move(o.ctx_)), unwinding_(o.unwinding_) {}
  Nccl& operator=(Nccl&& o) noexcept {
    if (this != &o) {
      leave();
      ctx_ = std::move(o.ctx_);
      unwinding_ = o.unwinding_;
    }
    return *this;
  }
  ~Nccl() { leave(); }

  // detail::check_call's rules, raised on this rank (NCCL has no cheap way to agree first; the
  // peers then time out on the missing call).
  void check(CollOp op, const void* src, const void* dst, std::size_t n, DType t, ReduceOp rop,
             int root) const {
    const std::string bad = detail::check_call(op, src, dst, n, t, rop, root, rank(), size());
    if (!bad.empty()) throw Error(Errc::invalid_argument, "nccl backend: " + bad);
  }

  void check_p2p(CollOp op, const void* buf, std::size_t n, DType t, int peer) const {
    const std::string bad = detail::check_p2p(op, buf, n, t, peer, rank(), size());
    if (!bad.empty()) throw Error(Errc::invalid_argument, "nccl backend: " + bad);
  }

  int rank() const { return ctx_->rank; }
  int size() const { return ctx_->size; }
  int device() const { return ctx_->device; }
  device::stream_t stream() const { return ctx_->stream; }
  ncclComm_t comm() const { return ctx_->comm; }

  Work all_reduce(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch l) {
    check(CollOp::all_reduce, src, dst, n, t, op, 0);
    return enqueue("all_reduce", l, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(src, dst, n, nccl_detail::nccl_type(t), nccl_detail::nccl_op(op, size()),
                           c, s);
    });
  }
  Work reduce_scatter(const void* src, void* dst, std::size_t n, DType t, ReduceOp op, Launch l) {
    check(CollOp::reduce_scatter, src, dst, n, t, op, 0);
    return enqueue("reduce_scatter", l, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(src, dst, n, nccl_detail::nccl_type(t),
                               nccl_detail::nccl_op(op, size()), c, s);
    });
  }
  Work all_gather(const void* src, void* dst, std::size_t n, DType t, Launch l) {
    check(CollOp::all_gather, src, dst, n, t, ReduceOp::sum, 0);
    return enqueue("all_gather", l, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(src, dst, n, nccl_detail::nccl_type(t), c, s);
    });
  }
  // One ncclSend and one ncclRecv per rank in one group (NCCL has no all-to-all call).
  Work all_to_all(const void* src, void* dst, std::size_t n, DType t, Launch l) {
    check(CollOp::all_to_all, src, dst, n, t, ReduceOp::sum, 0);
    return enqueue("all_to_all", l, [&](ncclComm_t c, cudaStream_t s) {
      const std::size_t block = n * size_of(t);
      ncclResult_t rc = ncclGroupStart();
      for (int r = 0; r < size() && rc == ncclSuccess; ++r) {
        rc = ncclSend(static_cast<const char*>(src) + std::size_t(r) * block, n,
                      nccl_detail::nccl_type(t), r, c, s);
        if (rc == ncclSuccess)
          rc = ncclRecv(static_cast<char*>(dst) + std::size_t(r) * block, n,
                        nccl_detail::nccl_type(t), r, c, s);
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc == ncclSuccess ? end : rc;
    });
  }
  // The same group with per-peer counts. NCCL cannot see counts that disagree between a sender
  // and its receiver (undefined there: usually a hang that ends in the timeout).
  Work all_to_all_v(const void* src, const std::size_t* send_counts, void* dst,
                    const std::size_t* recv_counts, DType t, Launch l) {
    const std::string bad = detail::check_exchange_v(src, send_counts, dst, recv_counts, t, size());
    if (!bad.empty()) throw Error(Errc::invalid_argument, "nccl backend: " + bad);
    return enqueue("all_to_all_v", l, [&](ncclComm_t c, cudaStream_t s) {
      const std::size_t es = size_of(t);
      std::size_t out = 0, in = 0;  // elements before block r
      ncclResult_t rc = ncclGroupStart();
      for (int r = 0; r < size() && rc == ncclSuccess; ++r) {
        rc = ncclSend(static_cast<const char*>(src) + out * es, send_counts[r],
                      nccl_detail::nccl_type(t), r, c, s);
        if (rc == ncclSuccess)
          rc = ncclRecv(static_cast<char*>(dst) + in * es, recv_counts[r],
                        nccl_detail::nccl_type(t), r, c, s);
        out += send_counts[r];
        in += recv_counts[r];
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc == ncclSuccess ? end : rc;
    });
  }
  Work broadcast(const void* src, void* dst, std::size_t n, DType t, int root, Launch l) {
    check(CollOp::broadcast, src, dst, n, t, ReduceOp::sum, root);
    return enqueue("broadcast", l, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(src, dst, n, nccl_detail::nccl_type(t), root, c, s);
    });
  }
  Work barrier(Launch l) {
    auto& c = live();
    if (!c.scratch) {
      nccl_detail::DeviceScope dev(c.device);
      nccl_detail::cuda_check(cudaMalloc(&c.scratch, sizeof(std::int32_t)), "cudaMalloc");
      nccl_detail::cuda_check(cudaMemsetAsync(c.scratch, 0, sizeof(std::int32_t), c.stream),
                              "cudaMemsetAsync");
    }
    nccl_detail::Op op = issue("barrier", [&](ncclComm_t cm, cudaStream_t s) {
      return ncclAllReduce(c.scratch, c.scratch, 1, ncclInt32, ncclSum, cm, s);
    });
    if (l == Launch::async) return Work(std::move(op));
    op.wait_host();
    return Work{};
  }

  // Point to point on stream() (see the file comment).
  Work send(const void* src, std::size_t n, DType t, int peer, Launch l) {
    check_p2p(CollOp::send, src, n, t, peer);
    return enqueue("send", l, [&](ncclComm_t c, cudaStream_t s) {
      return ncclSend(src, n, nccl_detail::nccl_type(t), peer, c, s);
    });
  }
  Work recv(void* dst, std::size_t n, DType t, int peer, Launch l) {
    check_p2p(CollOp::recv, dst, n, t, peer);
    return enqueue("recv", l, [&](ncclComm_t c, cudaStream_t s) {
      return ncclRecv(dst, n, nccl_detail::nccl_type(t), peer, c, s);
    });
  }

  // ncclCommSplit: ranks with the same colour form a group ordered by (key, rank); the new
  // backend has its own stream on the same device. Collective over this communicator. Its
  // kernels and the parent's may then run at once, and two ranks may start them in different
  // orders, each waiting for a peer busy in the other: where both are used in one step (hpZ,
  // qgZ), set NCCL_LAUNCH_ORDER_IMPLICIT=1 (NCCL 2.26+), which launches them in host order.
  Nccl split(int color, int key) {
    auto& c = live();
    nccl_detail::DeviceScope dev(c.device);
    nccl_detail::cuda_check(cudaStreamSynchronize(c.stream), "cudaStreamSynchronize");
    ncclComm_t sub = nullptr;
    nccl_detail::nccl_check(ncclCommSplit(c.comm, color, key, &sub, nullptr), "ncclCommSplit",
                            c.comm);
    ZP_EXPECT(sub != nullptr, "nccl backend: split with colour ", color,
              " produced no communicator");
    return Nccl(sub, c.device, c.opt);
  }

 private:
  Nccl(ncclComm_t comm, int device, Options opt) : unwinding_(std::uncaught_exceptions()) {
    auto c = std::make_shared<nccl_detail::Context>();
    c->comm = comm;
    c->device = device;
    c->opt = opt;
    ctx_ = c;  // owns comm from here, even if what follows throws
    nccl_detail::DeviceScope dev(device);
    nccl_detail::cuda_call([&] {
      c->stream = device::create_stream();
      c->ready = device::create_event();
    });
    nccl_detail::nccl_check(ncclCommUserRank(comm, &c->rank), "ncclCommUserRank", comm);
    nccl_detail::nccl_check(ncclCommCount(comm, &c->size), "ncclCommCount", comm);
  }

  nccl_detail::Context& live() {
    auto& c = *ctx_;
    if (c.aborted)
      throw Error(Errc::aborted, "nccl backend: communicator aborted earlier: " + c.abort_reason);
    return c;
  }

  void leave() noexcept {
    if (!ctx_) return;
    if (std::uncaught_exceptions() > unwinding_)
      ctx_->abort(detail::cat("rank ", ctx_->rank, " left during stack unwinding"));
    ctx_.reset();
  }

  template <class F>
  Work enqueue(const char* what, Launch l, F&& call) {
    nccl_detail::Op op = issue(what, std::forward<F>(call));
    if (l == Launch::async) return Work(std::move(op));
    op.finish();  // ordered: empty from here
    return Work{};
  }
  // Enqueues call(comm, stream) after the caller's stream order, and the event of its completion.
  template <class F>
  nccl_detail::Op issue(const char* what, F&& call) {
    auto& c = live();
    ++c.calls;
    nccl_detail::DeviceScope dev(c.device);
    // The inputs are complete in the caller's stream order.
    nccl_detail::cuda_call(
        [&] { device::order(c.stream, device::current_stream(), c.ready, "nccl.ready"); });
    device::before_enqueue(c.stream, device::Role::comm);
    nccl_detail::nccl_check(call(c.comm, c.stream), what, c.comm);
    nccl_detail::Op op(ctx_, nccl_detail::cuda_call([] { return device::create_event(); }), what);
    nccl_detail::cuda_call([&] { device::record(op.event(), c.stream, "nccl.work.record"); });
    device::watch(ctx_);
    return op;
  }

  std::shared_ptr<nccl_detail::Context> ctx_;
  int unwinding_ = 0;
};

static_assert(Backend<Nccl>);

#if ZP_NCCL_HAS_MPI_BOOTSTRAP
// One process per GPU over an MPI communicator (collective over comm): rank 0's ncclUniqueId
// goes to everyone by MPI_Bcast; the device is this process's rank among those on its node,
// modulo the visible GPUs, and becomes the process's current device (its buffers and streams
// belong there). NCCL ranks equal the ranks in comm.
inline Nccl nccl_from_mpi(MPI_Comm comm, NcclOptions opt = {}) {
  auto mpi = [](int rc, const char* call) {
    if (rc != MPI_SUCCESS)
      throw Error(Errc::mpi, detail::cat("nccl backend bootstrap: ", call, " failed"), rc);
  };
  int rank = 0, size = 1;
  mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  MPI_Comm node = MPI_COMM_NULL;
  mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
      "MPI_Comm_split_type");
  int local = 0;
  MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  int devices = 0;
  nccl_detail::cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  ncclUniqueId id{};
  if (rank == 0) id = Nccl::unique_id();
  mpi(MPI_Bcast(&id, int(sizeof id), MPI_BYTE, 0, comm), "MPI_Bcast");
  nccl_detail::cuda_check(cudaSetDevice(local % devices), "cudaSetDevice");
  return Nccl::create(id, rank, size, local % devices, opt);
}
#endif

}  // namespace zp::backend
