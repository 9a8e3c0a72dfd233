// bench/membw.hpp: the memory-bandwidth probe zp's benchmarks measure themselves against.
//
// membw_copy(threads) copies one large buffer into another, each thread its own contiguous
// part, and reports GBps as bytes read + bytes written per second (memcpy of large blocks uses
// non-temporal stores, so no read-for-ownership traffic is hidden). Register it in a benchmark
// binary with ZP_BENCH_MEMBW_COPY() to get membw/copy/threads:T next to the kernel it bounds.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

namespace zp::bench {

// Copies src to dst with `threads` threads (the caller is one of them).
inline void parallel_copy(char* dst, const char* src, std::size_t bytes, int threads) {
  const std::size_t chunk = (bytes / std::size_t(threads) + 4095) / 4096 * 4096;
  std::vector<std::jthread> pool;
  for (int t = 1; t < threads; ++t) {
    const std::size_t b = std::min(bytes, chunk * std::size_t(t)), e = std::min(bytes, b + chunk);
    pool.emplace_back([=] { std::memcpy(dst + b, src + b, e - b); });
  }
  std::memcpy(dst, src, std::min(bytes, chunk));
}

// Benchmark body: `threads` copy two buffers of `bytes` each.
inline void membw_copy(benchmark::State& state, int threads, std::size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);  // touched: no page faults while timing
  parallel_copy(dst.data(), src.data(), bytes, threads);
  if (std::memcmp(dst.data(), src.data(), bytes) != 0) {
    state.SkipWithError("copy produced wrong bytes");
    return;
  }
  for (auto _ : state) {
    parallel_copy(dst.data(), src.data(), bytes, threads);
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =
      benchmark::Counter(double(2 * bytes) * double(state.iterations()), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}

inline void register_membw_copy(std::size_t bytes, std::initializer_list<int> threads) {
  for (int t : threads)
    benchmark::RegisterBenchmark(("membw/copy/threads:" + std::to_string(t)).c_str(),
                                 [=](benchmark::State& s) { membw_copy(s, t, bytes); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

}  // namespace zp::bench
