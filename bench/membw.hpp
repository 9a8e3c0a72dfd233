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

// The least a limit below reads: 256 MiB, past any one core's caches. A copy of 40 MB (a 20 MB
// source, inside a 32 MiB L3) measured 68-85 GB/s where 512 MiB measured 46-55 in the same run,
// a limit the data a benchmark streams from memory never sees.
inline constexpr std::size_t out_of_cache_bytes = std::size_t(256) << 20;

// GB/s (read + written) of a streaming copy on this thread, the best of 5 copies: of `bytes`,
// or of a source of out_of_cache_bytes where that is more, for a benchmark that measures its
// own limit.
inline double copy_gbps(std::size_t bytes) {
  const std::size_t half = (std::max(bytes / 2, out_of_cache_bytes) + 4095) / 4096 * 4096;
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

#if ZP_STREAM_X86
// An OR over the 32-byte words at p (bytes a multiple of 128), four loads in flight a step: the
// copy's loads (32 bytes, AVX2), without its stores.
[[gnu::target("avx2")]] inline std::uint64_t or_words_avx2(const char* p, std::size_t bytes) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (std::size_t i = 0; i < bytes; i += 128) {
    a = _mm256_or_si256(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_or_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_or_si256(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_or_si256(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i r = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
  return std::uint64_t(_mm256_extract_epi64(r, 0) | _mm256_extract_epi64(r, 1) |
                       _mm256_extract_epi64(r, 2) | _mm256_extract_epi64(r, 3));
}
#endif

// GB/s of reading `bytes` (at least out_of_cache_bytes) on this thread, nothing written: the
// best of 5, the limit of a benchmark that mostly reads (one core's loads in flight bound it, not
// the memory's copy bandwidth). 32-byte loads where the CPU has AVX2 (an OR over 64-bit words
// read 30-31 GB/s where these read 38-40 on the VM of bench/RESULTS.md), else 64-bit ones.
inline double read_gbps(std::size_t bytes) {
  const std::size_t size = (std::max(bytes, out_of_cache_bytes) + 4095) / 4096 * 4096;
  const PageBuffer src(size, 1);
  const auto* words = reinterpret_cast<const std::uint64_t*>(src.get());
  double best = 0;
  for (int k = 0; k < 5; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t acc = 0;
#if ZP_STREAM_X86
    if (__builtin_cpu_supports("avx2"))
      acc = or_words_avx2(src.get(), size);
    else
#endif
      for (std::size_t i = 0; i < size / 8; ++i) acc |= words[i];
    benchmark::DoNotOptimize(acc);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(size) / s * 1e-9);
  }
  return best;
}

#if ZP_STREAM_X86
// Streams `fill` over the lines at p (bytes a multiple of 128), four stores a step: the copy's
// stores (32 bytes with AVX2, else 16), without its loads.
[[gnu::target("avx2")]] inline void fill_lines_avx2(char* p, std::size_t bytes, char fill) {
  const __m256i v = _mm256_set1_epi8(fill);
  for (std::size_t i = 0; i < bytes; i += 128)
    for (std::size_t j = 0; j < 128; j += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p + i + j), v);
  _mm_sfence();
}
inline void fill_lines_sse2(char* p, std::size_t bytes, char fill) {
  const __m128i v = _mm_set1_epi8(fill);
  for (std::size_t i = 0; i < bytes; i += 128)
    for (std::size_t j = 0; j < 128; j += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(p + i + j), v);
  _mm_sfence();
}
#endif

// GB/s of writing `bytes` (at least out_of_cache_bytes) with streaming stores on this thread,
// nothing read: the best of 5, the limit of a benchmark that mostly writes (dequantize). Off
// x86, memset's plain stores.
inline double write_gbps(std::size_t bytes) {
  const std::size_t size = (std::max(bytes, out_of_cache_bytes) + 4095) / 4096 * 4096;
  const PageBuffer dst(size, 0);
  double best = 0;
  for (int k = 0; k < 5; ++k) {
    const char fill = char(k + 1);
    const auto t0 = std::chrono::steady_clock::now();
#if ZP_STREAM_X86
    __builtin_cpu_supports("avx2") ? fill_lines_avx2(dst.get(), size, fill)
                                   : fill_lines_sse2(dst.get(), size, fill);
#else
    std::memset(dst.get(), fill, size);
#endif
    benchmark::DoNotOptimize(dst.get());
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
