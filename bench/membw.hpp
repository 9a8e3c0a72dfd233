// bench/membw.hpp: the memory-bandwidth probe zp's benchmarks measure themselves against.
//
// membw/copy/threads:T copies one 256 MiB buffer into another, each thread its own contiguous
// part, and reports GBps as bytes read + bytes written per second. The copy streams: aligned
// 32-byte loads and non-temporal stores (zp/detail/copy.hpp, the copy the collectives use for large
// outputs), so no read-for-ownership traffic is hidden and the probe is the machine's copy limit
// rather than a library's memcpy strategy (glibc's memcpy reached only ~2/3 of it on the 2-core
// VM of bench/RESULTS.md).
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "zp/detail/copy.hpp"

namespace zp::bench {

using zp::detail::stream_copy;

// Copies src to dst with `threads` threads (the caller is one of them), in 4 KiB-aligned parts.
inline void parallel_copy(char* dst, const char* src, std::size_t bytes, int threads) {
  const std::size_t chunk = (bytes / std::size_t(threads) + 4095) / 4096 * 4096;
  std::vector<std::jthread> pool;
  for (int t = 1; t < threads; ++t) {
    const std::size_t b = std::min(bytes, chunk * std::size_t(t)), e = std::min(bytes, b + chunk);
    pool.emplace_back([=] { stream_copy(dst + b, src + b, e - b); });
  }
  stream_copy(dst, src, std::min(bytes, chunk));
}

// A page-aligned buffer of `bytes` (a multiple of 4 KiB), every page touched (no page faults
// while timing).
struct PageBuffer {
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> p;
  PageBuffer(std::size_t bytes, int fill) : p(static_cast<char*>(std::aligned_alloc(4096, bytes))) {
    std::memset(p.get(), fill, bytes);
  }
  char* get() const { return p.get(); }
};

// GB/s (read + written) of a streaming copy of `bytes` on this thread: the best of 5 copies, for
// a benchmark that measures its own limit on the data size it moves.
inline double copy_gbps(std::size_t bytes) {
  const std::size_t half = (bytes / 2 + 4095) / 4096 * 4096;
  const PageBuffer src(half, 1), dst(half, 0);
  double best = 0;
  for (int k = 0; k < 5; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    stream_copy(dst.get(), src.get(), half);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(2 * half) / s * 1e-9);
  }
  benchmark::DoNotOptimize(dst.get());
  return best;
}

// GB/s of reading `bytes` on this thread (an OR over 64-bit words, nothing written): the best of
// 5, the limit of a benchmark that mostly reads (one core's loads in flight bound it, not the
// memory's copy bandwidth).
inline double read_gbps(std::size_t bytes) {
  const std::size_t size = (bytes + 4095) / 4096 * 4096;
  const PageBuffer src(size, 1);
  const auto* words = reinterpret_cast<const std::uint64_t*>(src.get());
  double best = 0;
  for (int k = 0; k < 5; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t acc = 0;
    for (std::size_t i = 0; i < size / 8; ++i) acc |= words[i];
    benchmark::DoNotOptimize(acc);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(size) / s * 1e-9);
  }
  return best;
}

// Benchmark body: `threads` copy a buffer of `bytes` (a multiple of 4 KiB) into another.
inline void membw_copy(benchmark::State& state, int threads, std::size_t bytes) {
  const PageBuffer src(bytes, 1), dst(bytes, 0);
  parallel_copy(dst.get(), src.get(), bytes, threads);
  if (std::memcmp(dst.get(), src.get(), bytes) != 0) {
    state.SkipWithError("copy produced wrong bytes");
    return;
  }
  for (auto _ : state) {
    parallel_copy(dst.get(), src.get(), bytes, threads);
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =  // GB/s: GB moved divided by the seconds
      benchmark::Counter(double(2 * bytes) * double(state.iterations()) * 1e-9,
                         benchmark::Counter::kIsRate);
}

inline void register_membw_copy(std::size_t bytes, std::initializer_list<int> threads) {
  for (int t : threads)
    benchmark::RegisterBenchmark(("membw/copy/threads:" + std::to_string(t)).c_str(),
                                 [=](benchmark::State& s) { membw_copy(s, t, bytes); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

}  // namespace zp::bench
