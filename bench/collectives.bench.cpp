// zp_bench_collectives: collective bandwidth in nccl-tests' conventions (REFERENCE.md).
//
// <backend>/<op>/ranks:N/bytes:S  one in-place operation (the ZeRO layout) on float buffers
//   (all_to_all, never in place: from one buffer of S bytes into another). S is the full buffer
//   (for all_gather, reduce_scatter and all_to_all: N x shard). Counters: algbw_GBps = S / t,
//   busbw_GBps = algbw x (2(N-1)/N for all_reduce, (N-1)/N for all_gather, reduce_scatter and
//   all_to_all, 1 for broadcast), wrong = elements that differed from the exact result in the
//   check run before timing (any difference skips the benchmark with an error).
//   backends: threads (ranks are threads of this process), mpi (zp's mpi backend, call check
//   on), mpi_unchecked (check_calls = false), mpi_plain_stores (all_gather only: the node path's
//   outputs written with plain stores at every size, MpiOptions::node_stream_bytes's baseline),
//   mpi_staged (all_reduce, reduce_scatter, all_gather on a plain std::vector, which the node's
//   peers cannot map: the node path copying every byte through its segment, the baseline of
//   the mpi rows, whose buffers come from zp::HostAllocator and are read in place),
//   mpi_raw (the bare MPI call: the baseline),
//   nccl (one process, one GPU per rank; only when built with NCCL and a device is present).
// mpi_paired/<op>/ranks:N/bytes:S  the bare MPI call and zp's mpi backend alternately, each
//   timed on its own; time and busbw_GBps are zp's, raw_busbw_GBps the bare call's, and
//   ratio = zp busbw / raw busbw, free of the drift between two separate benchmark runs.
// <backend>/all_to_all_v/ranks:N/bytes:S and <backend>/all_to_all_v_skewed/...  per-peer counts:
//   rank r sends count(r, q) floats to rank q, each rank S bytes in and out. Even: S / N bytes to
//   each peer, all_to_all's split (the row beside <backend>/all_to_all is the v form's cost);
//   skewed: n + e (2 ((q - r) mod N) - (N - 1)) elements with n = S / 4N and e = n / 2N, so
//   blocks differ by up to a factor of 2 and every rank keeps n - (N - 1) e for itself.
//   busbw_GBps = the bytes a rank sends to the other ranks / t ((N-1)/N x algbw when even);
//   mpi_raw: the bare MPI_Alltoallv.
// <backend>/send_recv/ranks:2/bytes:S  point to point: a ping-pong between ranks 0 and 1 (rank 0
//   sends S bytes, rank 1 receives them and sends them back; under a launcher with more ranks
//   the others idle). One iteration moves 2S: algbw_GBps = busbw_GBps = 2S / t. backends:
//   threads (one memcpy per message, so bounded by GBps(membw/copy/threads:1)), mpi,
//   mpi_unchecked (no signature exchange), mpi_raw (bare MPI_Send/MPI_Recv: the baseline).
// membw/copy/ranks:N (under mpirun, before the mpi rows): every rank streams its own copy at once;
//   mpi and mpi_paired rows then report limit_fraction = busbw / the busbw that copy limit
//   allows the operation (busbw_limit below; for 2 ranks membw/4, /6, /4 for all_reduce,
//   reduce_scatter, all_gather: the threads backend's bar).
// membw/copy/threads:T  the memory-bandwidth limit measured in the same run (bench/membw.hpp):
//   a 2-rank in-place all_reduce moves at least 4 bytes per byte of S through memory (each
//   rank's half: read both inputs, write both outputs), so busbw of threads/all_reduce/ranks:2
//   is bounded by GBps(threads:2) / 4.
//
// Running:
//   zp_bench_collectives                      threads, membw (and nccl); no MPI launcher needed
//   mpirun -n 2 zp_bench_collectives          mpi, mpi_unchecked and mpi_raw at 2 ranks
//   mpirun -n 4 --oversubscribe zp_bench_collectives   the same at 4 ranks (more ranks than
//                                             cores needs --oversubscribe)
// Under a launcher with >= 2 ranks only the MPI benchmarks are registered (idle ranks polling
// in MPI would distort the threads numbers); every rank runs the same list with fixed
// iteration counts, so the collectives match; rank 0 alone reports.
#include <benchmark/benchmark.h>

#include <zp/backend/threads.hpp>
#include <zp/collective.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "membw.hpp"
#include "mpi_main.hpp"

#if ZP_BENCH_MPI
#include <zp/backend/mpi.hpp>
#include <zp/memory.hpp>
#endif
#if ZP_BENCH_NCCL
#include <cuda_runtime_api.h>

#include <zp/backend/nccl.hpp>
#endif

namespace {

using zp::CollOp;

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;
const std::vector<std::size_t> sizes = {4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB,
                                        4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB};

// Fixed iteration counts (identical on every MPI rank): about 1 GiB of S per benchmark,
// between 5 and 2000 iterations.
benchmark::IterationCount iterations(std::size_t bytes) {
  return std::clamp<benchmark::IterationCount>(benchmark::IterationCount((1024 * MiB) / bytes), 5,
                                               2000);
}

// Exact inputs: small integers, so sums over <= 64 ranks are exact in float.
inline float value(int rank, std::size_t i) {
  return float(int((i + 3 * std::size_t(rank)) % 13) - 6);
}
constexpr float poison = -1000.0f;

// Fills this rank's buffer of `elems` floats for an in-place `op` over N ranks.
void fill(std::span<float> buf, CollOp op, int rank, int N) {
  const std::size_t n = buf.size() / std::size_t(N);
  for (std::size_t i = 0; i < buf.size(); ++i) {
    switch (op) {
      case CollOp::all_gather: buf[i] = i / n == std::size_t(rank) ? value(rank, i) : poison; break;
      case CollOp::broadcast: buf[i] = rank == 0 ? value(0, i) : poison; break;
      default: buf[i] = value(rank, i); break;
    }
  }
}

// Elements of this rank's result (all_to_all's: its output) that differ from the exact one.
// shard_at_start: the raw MPI_Reduce_scatter_block in place leaves the shard at the start of the
// buffer.
std::uint64_t wrong(std::span<const float> buf, CollOp op, int rank, int N,
                    bool shard_at_start = false) {
  const std::size_t n = buf.size() / std::size_t(N);
  auto sum = [&](std::size_t i) {
    float s = 0;
    for (int q = 0; q < N; ++q) s += value(q, i);
    return s;
  };
  std::uint64_t w = 0;
  switch (op) {
    case CollOp::all_reduce:
      for (std::size_t i = 0; i < buf.size(); ++i) w += buf[i] != sum(i);
      break;
    case CollOp::reduce_scatter: {
      const std::size_t at = shard_at_start ? 0 : std::size_t(rank) * n;
      for (std::size_t i = 0; i < n; ++i) w += buf[at + i] != sum(std::size_t(rank) * n + i);
      break;
    }
    case CollOp::all_gather:
      for (std::size_t i = 0; i < buf.size(); ++i) w += buf[i] != value(int(i / n), i);
      break;
    case CollOp::broadcast:
      for (std::size_t i = 0; i < buf.size(); ++i) w += buf[i] != value(0, i);
      break;
    case CollOp::all_to_all:  // block q came from rank q's block `rank`
      for (std::size_t i = 0; i < buf.size(); ++i)
        w += buf[i] != value(int(i / n), std::size_t(rank) * n + i % n);
      break;
    case CollOp::barrier:
    case CollOp::send:
    case CollOp::recv: break;
  }
  return w;
}

void set_counters(benchmark::State& state, CollOp op, int N, std::size_t bytes, std::uint64_t bad) {
  // In GB (1e9 bytes) so that, divided by the seconds (kIsRate), the value is GB/s as named.
  const double s = double(bytes) * double(state.iterations()) * 1e-9;
  state.counters["algbw_GBps"] = benchmark::Counter(s, benchmark::Counter::kIsRate);
  state.counters["busbw_GBps"] =
      benchmark::Counter(s * zp::bus_factor(op, N), benchmark::Counter::kIsRate);
  state.counters["wrong"] = double(bad);
}

// out: all_to_all's output (the other operations are in place in buf).
template <class B>
void run_op(zp::Collective<B>& comm, CollOp op, std::span<float> buf, std::span<float> out) {
  switch (op) {
    case CollOp::all_reduce: comm.all_reduce(buf); break;
    case CollOp::reduce_scatter: comm.reduce_scatter(buf); break;
    case CollOp::all_gather: comm.all_gather(buf); break;
    case CollOp::all_to_all: comm.all_to_all(std::span<const float>(buf), out); break;
    case CollOp::broadcast: comm.broadcast(buf, 0); break;
    case CollOp::barrier: comm.barrier(); break;
    case CollOp::send:
    case CollOp::recv: break;  // ping_pong's
  }
}

// all_to_all's output buffer (empty for the in-place operations), and the buffer to check.
std::vector<float> output_of(CollOp op, std::size_t elems) {
  return std::vector<float>(op == CollOp::all_to_all ? elems : 0, poison);
}
std::span<const float> result(CollOp op, std::span<const float> buf, std::span<const float> out) {
  return op == CollOp::all_to_all ? out : buf;
}

// all_to_all_v rows: even counts (all_to_all's) or skewed ones (see the top of the file).
enum class Split { none, even, skewed };
const char* split_name(Split v) {
  return v == Split::even ? "all_to_all_v" : "all_to_all_v_skewed";
}

std::size_t v_count(Split v, int r, int q, int N, std::size_t n) {
  if (v != Split::skewed) return n;
  const std::size_t e = n / (2 * std::size_t(N)), k = std::size_t(((q - r) % N + N) % N);
  return n + 2 * k * e - std::size_t(N - 1) * e;
}

// Rank r's send and receive counts of an all_to_all_v over N ranks of n elements a block (none:
// the row is not one).
struct Counts {
  Split split;
  std::size_t n;
  std::vector<std::size_t> send, recv;
  Counts(Split v, int r, int N, std::size_t elems) : split(v), n(elems / std::size_t(N)) {
    for (int q = 0; q < N; ++q) {
      send.push_back(v_count(v, r, q, N, n));
      recv.push_back(v_count(v, q, r, N, n));
    }
  }
};

// Elements of rank r's all_to_all_v output that differ from the exact one: the block from rank q
// is q's input (value(q, i)) from where q's block for r starts.
std::uint64_t wrong_v(std::span<const float> out, Split v, int r, int N, std::size_t n) {
  std::uint64_t w = 0;
  std::size_t at = 0;
  for (int q = 0; q < N; ++q) {
    std::size_t from = 0;
    for (int p = 0; p < r; ++p) from += v_count(v, q, p, N, n);
    for (std::size_t j = 0; j < v_count(v, q, r, N, n); ++j) w += out[at++] != value(q, from + j);
  }
  return w + (at != out.size());
}

// One operation of a row: op, or all_to_all_v with c's counts.
template <class B>
void run_row(zp::Collective<B>& comm, CollOp op, const Counts& c, std::span<float> buf,
             std::span<float> out) {
  if (c.split == Split::none) return run_op(comm, op, buf, out);
  comm.all_to_all_v(std::span<const float>(buf), std::span<const std::size_t>(c.send), out,
                    std::span<const std::size_t>(c.recv));
}
std::uint64_t wrong_row(CollOp op, const Counts& c, std::span<const float> buf,
                        std::span<const float> out, int r, int N, bool shard_at_start = false) {
  return c.split == Split::none ? wrong(result(op, buf, out), op, r, N, shard_at_start)
                                : wrong_v(out, c.split, r, N, c.n);
}

// set_counters; for all_to_all_v rows busbw = the bytes rank 0 sends to the others / t.
void set_row_counters(benchmark::State& state, CollOp op, Split v, int N, std::size_t bytes,
                      std::uint64_t bad) {
  set_counters(state, op, N, bytes, bad);
  if (v == Split::none) return;
  const std::size_t n = bytes / sizeof(float) / std::size_t(N);
  const double sent = double(bytes - v_count(v, 0, 0, N, n) * sizeof(float));
  state.counters["busbw_GBps"] =
      benchmark::Counter(sent * double(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// One round trip of buf between ranks 0 and 1 (other ranks do nothing); send(peer) and
// recv(peer) move the whole buffer.
template <class Send, class Recv>
void ping_pong(int rank, Send&& send, Recv&& recv) {
  if (rank == 0) {
    send(1);
    recv(1);
  } else if (rank == 1) {
    recv(0);
    send(0);
  }
}

// Before the round trip rank 0 holds value(0, i) and rank 1 poison; after it both hold rank 0's.
void fill_ping_pong(std::vector<float>& buf, int rank) {
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = rank == 0 ? value(0, i) : poison;
}
std::uint64_t wrong_ping_pong(const std::vector<float>& buf, int rank) {
  std::uint64_t w = 0;
  if (rank <= 1)
    for (std::size_t i = 0; i < buf.size(); ++i) w += buf[i] != value(0, i);
  return w;
}

std::string p2p_name(const char* backend, std::size_t bytes) {
  return std::string(backend) + "/send_recv/ranks:2/bytes:" + std::to_string(bytes);
}

std::string bench_name(const char* backend, CollOp op, int N, std::size_t bytes) {
  return std::string(backend) + "/" + zp::name(op) + "/ranks:" + std::to_string(N) +
         "/bytes:" + std::to_string(bytes);
}

std::string v_name(const char* backend, Split v, int N, std::size_t bytes) {
  return std::string(backend) + "/" + split_name(v) + "/ranks:" + std::to_string(N) +
         "/bytes:" + std::to_string(bytes);
}

const CollOp ops[] = {CollOp::all_reduce, CollOp::reduce_scatter, CollOp::all_gather,
                      CollOp::all_to_all, CollOp::broadcast};

// --- threads: rank 0 is the benchmark's thread, ranks 1..N-1 persistent threads that run
// the same number of operations; the timed region is rank 0's loop of collectives.
// split: an all_to_all_v row (op all_to_all).
void bench_threads(benchmark::State& state, CollOp op, int N, std::size_t bytes,
                   Split split = Split::none) {
  using zp::backend::Threads;
  auto world = zp::backend::World::create(N, {.timeout = std::chrono::seconds(120)});
  const std::size_t elems = bytes / sizeof(float);
  std::vector<std::vector<float>> bufs(std::size_t(N), std::vector<float>(elems, 0.0f));
  std::vector<std::vector<float>> outs(std::size_t(N), output_of(op, elems));
  std::vector<std::uint64_t> bad(std::size_t(N), 0);
  const auto iters = state.max_iterations;
  auto rank_body = [&](zp::Collective<Threads>& comm, int r, bool timed) {
    auto& buf = bufs[std::size_t(r)];
    auto& out = outs[std::size_t(r)];
    const Counts counts(split, r, N, elems);
    auto once = [&] { run_row(comm, op, counts, std::span<float>(buf), std::span<float>(out)); };
    fill(buf, op, r, N);
    once();  // the check run (and warm-up)
    std::int64_t w = std::int64_t(wrong_row(op, counts, buf, out, r, N));
    comm.all_reduce(std::span<std::int64_t>(&w, 1));
    bad[std::size_t(r)] = std::uint64_t(w);
    if (w) return;
    if (op == CollOp::all_gather || op == CollOp::reduce_scatter) fill(buf, op, r, N);
    comm.barrier();
    if (timed) {
      for (auto _ : state) once();
    } else {
      for (benchmark::IterationCount k = 0; k < iters; ++k) once();
    }
  };
  std::vector<std::jthread> peers;
  for (int r = 1; r < N; ++r)
    peers.emplace_back([&, r] {
      zp::Collective<Threads> comm{Threads(world, r)};
      rank_body(comm, r, false);
      comm.barrier();
    });
  {
    zp::Collective<Threads> comm{Threads(world, 0)};
    rank_body(comm, 0, true);
    comm.barrier();
  }
  peers.clear();
  if (bad[0]) {
    state.SkipWithError(("threads: " + std::to_string(bad[0]) + " wrong elements").c_str());
    return;
  }
  set_row_counters(state, op, split, N, bytes, bad[0]);
}

// --- threads send/recv: rank 0 is the benchmark's thread, rank 1 a thread answering each ping.
void bench_threads_p2p(benchmark::State& state, std::size_t bytes) {
  using zp::backend::Threads;
  auto world = zp::backend::World::create(2, {.timeout = std::chrono::seconds(120)});
  std::vector<std::vector<float>> bufs(2, std::vector<float>(bytes / sizeof(float)));
  std::vector<std::uint64_t> bad(2, 0);
  const auto iters = state.max_iterations;
  auto rank_body = [&](zp::Collective<Threads>& comm, int r, bool timed) {
    auto& buf = bufs[std::size_t(r)];
    auto once = [&] {
      ping_pong(
          r, [&](int peer) { comm.send(std::span<const float>(buf), peer); },
          [&](int peer) { comm.recv(std::span<float>(buf), peer); });
    };
    fill_ping_pong(buf, r);
    once();  // the check run (and warm-up)
    std::int64_t w = std::int64_t(wrong_ping_pong(buf, r));
    comm.all_reduce(std::span<std::int64_t>(&w, 1));
    bad[std::size_t(r)] = std::uint64_t(w);
    if (w) return;
    comm.barrier();
    if (timed) {
      for (auto _ : state) once();
    } else {
      for (benchmark::IterationCount k = 0; k < iters; ++k) once();
    }
  };
  {
    std::jthread peer([&] {
      zp::Collective<Threads> comm{Threads(world, 1)};
      rank_body(comm, 1, false);
      comm.barrier();
    });
    zp::Collective<Threads> comm{Threads(world, 0)};
    rank_body(comm, 0, true);
    comm.barrier();
  }
  if (bad[0]) {
    state.SkipWithError(
        ("threads send_recv: " + std::to_string(bad[0]) + " wrong elements").c_str());
    return;
  }
  set_counters(state, CollOp::send, 2, 2 * bytes, bad[0]);
}

void register_threads() {
  for (int N : {2, 4})
    for (CollOp op : ops)
      for (std::size_t bytes : sizes)
        benchmark::RegisterBenchmark(bench_name("threads", op, N, bytes).c_str(),
                                     [=](benchmark::State& s) { bench_threads(s, op, N, bytes); })
            ->Iterations(iterations(bytes))
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
  for (int N : {2, 4})
    for (Split v : {Split::even, Split::skewed})
      for (std::size_t bytes : sizes)
        benchmark::RegisterBenchmark(
            v_name("threads", v, N, bytes).c_str(),
            [=](benchmark::State& s) { bench_threads(s, CollOp::all_to_all, N, bytes, v); })
            ->Iterations(iterations(bytes))
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
  for (std::size_t bytes : sizes)
    benchmark::RegisterBenchmark(p2p_name("threads", bytes).c_str(),
                                 [=](benchmark::State& s) { bench_threads_p2p(s, bytes); })
        ->Iterations(iterations(2 * bytes))
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
}

#if ZP_BENCH_MPI
// --- mpi: every rank runs the same registered list; rank 0's loop is the timed region.
std::uint64_t mpi_total(std::uint64_t w, MPI_Comm comm) {
  MPI_Allreduce(MPI_IN_PLACE, &w, 1, MPI_UINT64_T, MPI_SUM, comm);
  return w;
}

// membw/copy/ranks:N: every rank streams its own 256 MiB / N copy at once (between barriers), so
// GBps (bytes read + written by all ranks per second) is the limit the N processes share.
double g_membw_gbps = 0;  // its last value, for limit_fraction below

void bench_membw_ranks(benchmark::State& state) {
  int N = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &N);
  const std::size_t bytes = 256 * MiB / std::size_t(N);
  const zp::bench::PageBuffer src(bytes, 1), dst(bytes, 0);
  double seconds = 0;
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    zp::detail::stream_copy(dst.get(), src.get(), bytes);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(t);
    seconds += t;
  }
  const double gb = 2.0 * double(bytes) * double(N) * double(state.iterations()) * 1e-9;
  g_membw_gbps = gb / seconds;
  state.counters["GBps"] = g_membw_gbps;
}

// The busbw an in-place operation of N ranks cannot exceed with the copy limit: each rank's
// result costs at least what it must read and write (all_reduce: N inputs read and N outputs
// written per element of S; reduce_scatter: the N inputs read and one output written;
// all_gather: (N-1)/N of S read and written per rank), and busbw = S x bus_factor / t.
double busbw_limit(CollOp op, int N, double membw) {
  const double n = N;
  switch (op) {
    case CollOp::all_reduce: return membw * zp::bus_factor(op, N) / (2 * n);
    case CollOp::reduce_scatter: return membw * zp::bus_factor(op, N) / (n + 1);
    case CollOp::all_gather: return membw * zp::bus_factor(op, N) / (2 * (n - 1));
    default: return 0;
  }
}

// limit_fraction = busbw / busbw_limit, where membw/copy/ranks:N ran earlier in this process.
void set_limit_fraction(benchmark::State& state, CollOp op, int N, std::size_t bytes,
                        double seconds) {
  const double limit = busbw_limit(op, N, g_membw_gbps);
  if (limit <= 0 || seconds <= 0) return;
  const double busbw =
      double(bytes) * zp::bus_factor(op, N) * double(state.iterations()) / seconds * 1e-9;
  state.counters["limit_fraction"] = busbw / limit;
}

// The mpi rows' buffers: from zp's host allocator, as an engine's are, so the node path reads
// the peers' in place (MpiOptions::node_direct_bytes); the mpi_staged rows' a plain vector.
using Floats = std::vector<float, zp::HostAllocator<float>>;

// split: an all_to_all_v row (op all_to_all). Vec: the buffer's type.
template <class Vec = Floats>
void bench_mpi(benchmark::State& state, CollOp op, std::size_t bytes,
               const zp::backend::Mpi::Options& opt, Split split = Split::none) {
  zp::Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD, opt)};
  const int N = comm.size(), r = comm.rank();
  Vec buf(bytes / sizeof(float));
  auto out = output_of(op, buf.size());
  const Counts counts(split, r, N, buf.size());
  auto once = [&] { run_row(comm, op, counts, std::span<float>(buf), std::span<float>(out)); };
  fill(buf, op, r, N);
  once();
  const auto bad = mpi_total(wrong_row(op, counts, buf, out, r, N), comm.backend().comm());
  if (bad) {
    state.SkipWithError(("mpi: " + std::to_string(bad) + " wrong elements").c_str());
    return;
  }
  if (op == CollOp::all_gather || op == CollOp::reduce_scatter) fill(buf, op, r, N);
  MPI_Barrier(comm.backend().comm());
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) once();
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MPI_Barrier(comm.backend().comm());
  set_row_counters(state, op, split, N, bytes, bad);
  if (split == Split::none) set_limit_fraction(state, op, N, bytes, t);
}

int raw_op(CollOp op, float* buf, float* out, std::size_t elems, int N, MPI_Comm comm) {
  const int n = int(elems / std::size_t(N));
  switch (op) {
    case CollOp::all_to_all: return MPI_Alltoall(buf, n, MPI_FLOAT, out, n, MPI_FLOAT, comm);
    case CollOp::all_reduce:
      return MPI_Allreduce(MPI_IN_PLACE, buf, int(elems), MPI_FLOAT, MPI_SUM, comm);
    case CollOp::reduce_scatter:
      return MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, comm);
    case CollOp::all_gather:
      return MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, n, MPI_FLOAT, comm);
    case CollOp::broadcast: return MPI_Bcast(buf, int(elems), MPI_FLOAT, 0, comm);
    case CollOp::barrier: return MPI_Barrier(comm);
    case CollOp::send:
    case CollOp::recv: break;  // bench_mpi_p2p's
  }
  return MPI_SUCCESS;
}

// send/recv ping-pong between ranks 0 and 1: zp's backend (raw = false) or the bare
// MPI_Send/MPI_Recv on a duplicate of MPI_COMM_WORLD (the baseline).
void bench_mpi_p2p(benchmark::State& state, std::size_t bytes, bool raw, bool check_calls) {
  zp::backend::Mpi::Options opt;
  opt.check_calls = check_calls;
  zp::Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD, opt)};
  const MPI_Comm c = comm.backend().comm();
  const int r = comm.rank();
  std::vector<float> buf(bytes / sizeof(float));
  const int n = int(buf.size());
  auto once = [&] {
    if (raw)
      ping_pong(
          r, [&](int peer) { MPI_Send(buf.data(), n, MPI_FLOAT, peer, 7, c); },
          [&](int peer) { MPI_Recv(buf.data(), n, MPI_FLOAT, peer, 7, c, MPI_STATUS_IGNORE); });
    else
      ping_pong(
          r, [&](int peer) { comm.send(std::span<const float>(buf), peer); },
          [&](int peer) { comm.recv(std::span<float>(buf), peer); });
  };
  fill_ping_pong(buf, r);
  once();
  const auto bad = mpi_total(wrong_ping_pong(buf, r), c);
  if (bad) {
    state.SkipWithError(("mpi send_recv: " + std::to_string(bad) + " wrong elements").c_str());
    return;
  }
  MPI_Barrier(c);
  for (auto _ : state) once();
  MPI_Barrier(c);
  set_counters(state, CollOp::send, 2, 2 * bytes, bad);
}

// split: MPI_Alltoallv with an all_to_all_v row's counts (op all_to_all).
void bench_mpi_raw(benchmark::State& state, CollOp op, std::size_t bytes,
                   Split split = Split::none) {
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  int N = 1, r = 0;
  MPI_Comm_size(comm, &N);
  MPI_Comm_rank(comm, &r);
  std::vector<float> buf(bytes / sizeof(float)), out = output_of(op, buf.size());
  const Counts counts(split, r, N, buf.size());
  std::vector<int> sends, recvs, send_at, recv_at;
  for (int q = 0, s = 0, t = 0; q < N; ++q) {
    sends.push_back(int(counts.send[std::size_t(q)]));
    recvs.push_back(int(counts.recv[std::size_t(q)]));
    send_at.push_back(std::exchange(s, s + sends.back()));
    recv_at.push_back(std::exchange(t, t + recvs.back()));
  }
  auto once = [&] {
    return split == Split::none
               ? raw_op(op, buf.data(), out.data(), buf.size(), N, comm)
               : MPI_Alltoallv(buf.data(), sends.data(), send_at.data(), MPI_FLOAT, out.data(),
                               recvs.data(), recv_at.data(), MPI_FLOAT, comm);
  };
  fill(buf, op, r, N);
  const int rc = once();
  const auto bad =
      mpi_total(rc == MPI_SUCCESS ? wrong_row(op, counts, buf, out, r, N, true) : buf.size(), comm);
  if (bad) {
    state.SkipWithError(("mpi_raw: " + std::to_string(bad) + " wrong elements").c_str());
  } else {
    if (op == CollOp::all_gather || op == CollOp::reduce_scatter) fill(buf, op, r, N);
    MPI_Barrier(comm);
    for (auto _ : state) once();
    MPI_Barrier(comm);
    set_row_counters(state, op, split, N, bytes, bad);
  }
  MPI_Comm_free(&comm);
}

// zp and the bare call alternately, each timed on its own, so machine drift (other tenants,
// frequency, OpenMPI's protocol choices) hits both alike: the ratio is zp's own overhead.
void bench_mpi_paired(benchmark::State& state, CollOp op, std::size_t bytes) {
  zp::Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD)};
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  const int N = comm.size(), r = comm.rank();
  std::vector<float> buf(bytes / sizeof(float));  // (the user's own memory: zp stages it)
  auto out = output_of(op, buf.size());
  fill(buf, op, r, N);
  run_op(comm, op, std::span<float>(buf), std::span<float>(out));
  const auto bad = mpi_total(wrong(result(op, buf, out), op, r, N), raw);
  double t_zp = 0, t_raw = 0;
  if (bad == 0) {
    using clock = std::chrono::steady_clock;
    MPI_Barrier(raw);
    for (auto _ : state) {
      const auto t0 = clock::now();
      raw_op(op, buf.data(), out.data(), buf.size(), N, raw);
      const auto t1 = clock::now();
      run_op(comm, op, std::span<float>(buf), std::span<float>(out));
      const auto t2 = clock::now();
      t_raw += std::chrono::duration<double>(t1 - t0).count();
      t_zp += std::chrono::duration<double>(t2 - t1).count();
      state.SetIterationTime(std::chrono::duration<double>(t2 - t1).count());
    }
    MPI_Barrier(raw);
  }
  MPI_Comm_free(&raw);
  if (bad) {
    state.SkipWithError(("mpi_paired: " + std::to_string(bad) + " wrong elements").c_str());
    return;
  }
  set_counters(state, op, N, bytes, bad);  // rates over the manual (zp) time
  const double bus = double(bytes) * zp::bus_factor(op, N) * double(state.iterations());
  state.counters["raw_busbw_GBps"] = bus / t_raw / 1e9;
  state.counters["ratio"] = t_raw / t_zp;  // zp busbw / raw busbw
  set_limit_fraction(state, op, N, bytes, t_zp);
}

void register_mpi(int N) {
  benchmark::RegisterBenchmark(("membw/copy/ranks:" + std::to_string(N)).c_str(), bench_membw_ranks)
      ->Iterations(10)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  for (std::size_t bytes : sizes) {
    auto reg = [&](const char* backend, bool raw, bool check_calls) {
      benchmark::RegisterBenchmark(
          p2p_name(backend, bytes).c_str(),
          [=](benchmark::State& s) { bench_mpi_p2p(s, bytes, raw, check_calls); })
          ->Iterations(iterations(2 * bytes))
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    };
    reg("mpi_raw", true, true);
    reg("mpi", false, true);
    reg("mpi_unchecked", false, false);
  }
  // One row at a fixed iteration count, timed on the wall clock.
  auto reg = [](const std::string& name, std::size_t bytes, auto fn) {
    benchmark::RegisterBenchmark(name.c_str(), fn)
        ->Iterations(iterations(bytes))
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  };
  zp::backend::Mpi::Options checked, unchecked, plain_stores;
  unchecked.check_calls = false;
  plain_stores.node_stream_bytes = SIZE_MAX;  // the node path before streaming stores
  for (CollOp op : ops)
    for (std::size_t bytes : sizes) {
      const auto row = [&](const char* backend) { return bench_name(backend, op, N, bytes); };
      reg(row("mpi_raw"), bytes, [=](benchmark::State& s) { bench_mpi_raw(s, op, bytes); });
      reg(row("mpi"), bytes, [=](benchmark::State& s) { bench_mpi(s, op, bytes, checked); });
      reg(row("mpi_unchecked"), bytes,
          [=](benchmark::State& s) { bench_mpi(s, op, bytes, unchecked); });
      if (op == CollOp::all_gather)  // the only operation that streams its output
        reg(row("mpi_plain_stores"), bytes,
            [=](benchmark::State& s) { bench_mpi(s, op, bytes, plain_stores); });
      if (op == CollOp::all_reduce || op == CollOp::reduce_scatter || op == CollOp::all_gather)
        reg(row("mpi_staged"), bytes,
            [=](benchmark::State& s) { bench_mpi<std::vector<float>>(s, op, bytes, checked); });
      benchmark::RegisterBenchmark(row("mpi_paired").c_str(),
                                   [=](benchmark::State& s) { bench_mpi_paired(s, op, bytes); })
          ->Iterations(iterations(bytes))
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  constexpr CollOp a2a = CollOp::all_to_all;
  for (Split v : {Split::even, Split::skewed})
    for (std::size_t bytes : sizes) {
      reg(v_name("mpi_raw", v, N, bytes), bytes,
          [=](benchmark::State& s) { bench_mpi_raw(s, a2a, bytes, v); });
      reg(v_name("mpi", v, N, bytes), bytes,
          [=](benchmark::State& s) { bench_mpi(s, a2a, bytes, checked, v); });
    }
}

#endif

#if ZP_BENCH_NCCL
// --- nccl: one process drives every GPU of a single-process communicator (ranks:1 on one GPU).
void bench_nccl(benchmark::State& state, CollOp op, std::size_t bytes) {
  auto comms = zp::backend::Nccl::create_local({0});
  zp::Collective<zp::backend::Nccl> comm{std::move(comms[0])};
  const int N = comm.size(), r = comm.rank();
  const std::size_t elems = bytes / sizeof(float);
  std::vector<float> host(elems);
  fill(host, op, r, N);
  float* dev = nullptr;  // the buffer, then all_to_all's output
  if (cudaMalloc(&dev, 2 * bytes) != cudaSuccess) {
    state.SkipWithError("nccl: cudaMalloc failed");
    return;
  }
  const std::span<float> buf(dev, elems), out(dev + elems, elems);
  cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice);
  run_op(comm, op, buf, out);
  cudaMemcpy(host.data(), op == CollOp::all_to_all ? out.data() : dev, bytes,
             cudaMemcpyDeviceToHost);
  const auto bad = wrong(host, op, r, N);
  if (bad) {
    cudaFree(dev);
    state.SkipWithError(("nccl: " + std::to_string(bad) + " wrong elements").c_str());
    return;
  }
  for (auto _ : state) run_op(comm, op, buf, out);
  cudaFree(dev);
  set_counters(state, op, N, bytes, bad);
}

void register_nccl() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) return;
  for (CollOp op : ops)
    for (std::size_t bytes : sizes)
      benchmark::RegisterBenchmark(bench_name("nccl", op, 1, bytes).c_str(),
                                   [=](benchmark::State& s) { bench_nccl(s, op, bytes); })
          ->Iterations(iterations(bytes) * 4)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  return zp::bench::mpi_main(
      argc, argv,
      [](int ranks) {
#if ZP_BENCH_MPI
        register_mpi(ranks);
#else
        (void)ranks;
#endif
      },
      [] {
        zp::bench::register_membw_copy(256 * MiB, {1, 2});
        register_threads();
#if ZP_BENCH_NCCL
        register_nccl();
#endif
      });
}
