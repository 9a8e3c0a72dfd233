// zp_bench_collectives_cuda: the cuda_threads collectives (N ranks as threads on one GPU,
// zp/backend/cuda_threads.hpp) in nccl-tests' conventions, against a device-to-device copy
// measured in the same run (bench/cuda_copy.hpp).
//
// cuda_threads/<op>/ranks:N/bytes:S  S is nccl-tests' size: each rank's buffer (all_reduce), each
//   rank's input (reduce_scatter) or output (all_gather); fp32 sums, out of place. Counters:
//     algbw_GBps     S / t;
//     busbw_GBps     algbw x 2(N-1)/N (all_reduce) or (N-1)/N (reduce_scatter, all_gather);
//     device_GBps    the bytes the operation must move through the one GPU's memory, all ranks
//                    together (every input read once, every output written once: 2NS for
//                    all_reduce, (N+1)S for the other two), per second;
//     copy_fraction  device_GBps over the copy's GB/s (read + write) at S bytes.
// t: rank 0's host clock over `reps` operations, from a barrier after every rank's compute stream
// drained to the same after the last. Every row first checks one operation's result on rank 0,
// element by element, against the sum computed on the host.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "cuda_copy.hpp"
#include "zp/backend/cuda_threads.hpp"
#include "zp/device/memory.hpp"

namespace {

using zp::Collective;
using zp::backend::CudaThreads;
using Dev = zp::Memory<zp::MemorySpace::device>;
template <class T>
using DevBuf = zp::Buffer<T, zp::MemorySpace::device>;

enum class Op { all_reduce, reduce_scatter, all_gather };
constexpr int reps = 20;

const char* name(Op op) {
  return op == Op::all_reduce       ? "all_reduce"
         : op == Op::reduce_scatter ? "reduce_scatter"
                                    : "all_gather";
}

// Rank r's input element i: small integers, so every fp32 sum is exact.
float input(int r, std::size_t i) { return float(i % 17) + float(r); }

struct Measured {
  double seconds = 0;
  std::string error;
};

// Every rank runs `op`; rank 0 checks its output once and times `reps` more.
Measured measure(Op op, int ranks, std::size_t bytes) {
  Measured m;
  zp::backend::run_cuda_threads(ranks, [&](Collective<CudaThreads>& comm) {
    const int r = comm.rank();
    const std::size_t n = bytes / sizeof(float), piece = n / std::size_t(ranks);
    const std::size_t n_in = op == Op::all_gather ? piece : n;
    const std::size_t n_out = op == Op::reduce_scatter ? piece : n;
    std::vector<float> host(n_in);
    for (std::size_t i = 0; i < n_in; ++i) host[i] = input(r, i);
    DevBuf<float> in(n_in), out(n_out);
    Dev::from_host(in.span(), std::span<const float>(host));
    const auto run = [&] {
      const std::span<const float> src(in.span());
      if (op == Op::all_reduce) comm.all_reduce(src, out.span(), zp::ReduceOp::sum);
      if (op == Op::reduce_scatter) comm.reduce_scatter(src, out.span(), zp::ReduceOp::sum);
      if (op == Op::all_gather) comm.all_gather(src, out.span());
    };
    run();
    std::vector<float> got(n_out);
    Dev::to_host(std::span<float>(got), std::span<const float>(out.span()));
    if (r == 0) {
      const float base = float(ranks * (ranks - 1) / 2);
      for (std::size_t i = 0; i < n_out && m.error.empty(); ++i) {
        const float want = op == Op::all_gather ? input(int(i / piece), i % piece)
                                                : float(ranks) * float(i % 17) + base;
        if (got[i] != want)
          m.error = std::string(name(op)) + ": element " + std::to_string(i) + " is " +
                    std::to_string(got[i]) + ", expected " + std::to_string(want);
      }
    }
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < reps; ++k) run();
    zp::device::synchronize(zp::device::current_stream(), "bench.done");
    comm.barrier();
    if (r == 0)
      m.seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  });
  return m;
}

void collective(benchmark::State& state, Op op, int ranks, std::size_t bytes) {
  Measured m;
  try {
    m = measure(op, ranks, bytes);
  } catch (const std::exception& e) {
    m.error = e.what();
  }
  if (!m.error.empty()) return state.SkipWithError(m.error.c_str());
  for (auto _ : state) state.SetIterationTime(m.seconds);
  const double S = double(bytes), N = ranks;
  const double algbw = S / m.seconds / 1e9;
  const double moved = op == Op::all_reduce ? 2 * N * S : (N + 1) * S;
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * (op == Op::all_reduce ? 2 : 1) * (N - 1) / N;
  state.counters["device_GBps"] = moved / m.seconds / 1e9;
  state.counters["copy_fraction"] = moved / m.seconds / 1e9 / zp::bench::copy_gbps(bytes);
}

const bool registered = [] {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("zp_bench_collectives_cuda: no CUDA device, nothing to measure\n");
    return false;
  }
  for (Op op : {Op::all_reduce, Op::reduce_scatter, Op::all_gather})
    for (int ranks : {2, 4})
      for (std::size_t mib : {16, 256}) {
        const std::size_t bytes = mib << 20;
        const std::string name_ = std::string("cuda_threads/") + name(op) +
                                  "/ranks:" + std::to_string(ranks) +
                                  "/bytes:" + std::to_string(bytes);
        benchmark::RegisterBenchmark(name_.c_str(),
                                     [=](benchmark::State& s) { collective(s, op, ranks, bytes); })
            ->Iterations(1)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
