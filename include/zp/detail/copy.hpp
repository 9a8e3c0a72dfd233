// zp/detail/copy.hpp: a copy into memory that is not read again soon, with non-temporal stores.
//
// A plain store to a line that is not in the cache first reads the line (read for ownership), so
// a copy into a buffer larger than the caches moves three bytes through memory per byte copied.
// Streaming stores write whole lines without reading them: two. Collectives use this for large
// outputs (and zp's benchmarks for the copy limit they measure against); the streamed lines leave
// the cache, so it is the wrong copy for data its reader takes next. The stores are fenced before
// return, so a flag set afterwards (a barrier in shared memory) publishes them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDA_ARCH__)
#define ZP_STREAM_X86 1
#include <immintrin.h>
#else
#define ZP_STREAM_X86 0
#endif

namespace zp::detail {

// Outputs at least this large are written with streaming stores where zp writes them whole and
// nobody reads them before the call returns (the mpi node path's all_gather, dequantize): past
// the 32 MiB L3 cache of the VMs in bench/RESULTS.md, the cache would not keep them anyway.
inline constexpr std::size_t stream_min_bytes = std::size_t(32) << 20;

#if ZP_STREAM_X86
// 32 bytes a store where the CPU has AVX2 (checked at run time), else 16 (SSE2: every x86-64).
[[gnu::target("avx2")]] inline void stream_lines_avx2(char* d, const char* s, std::size_t bytes) {
  for (std::size_t i = 0; i < bytes; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
}
inline void stream_lines_sse2(char* d, const char* s, std::size_t bytes) {
  for (std::size_t i = 0; i < bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
}
#endif

// Copies `bytes` from src to dst (not overlapping; any alignment): the 32-byte-aligned runs of
// dst streamed, the unaligned ends copied plainly.
inline void stream_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if ZP_STREAM_X86
  static const bool avx2 = __builtin_cpu_supports("avx2");
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  const std::size_t head =
      std::min<std::size_t>(bytes, (32 - reinterpret_cast<std::uintptr_t>(d) % 32) % 32);
  std::memcpy(d, s, head);
  const std::size_t body = (bytes - head) / 32 * 32;
  (avx2 ? stream_lines_avx2 : stream_lines_sse2)(d + head, s + head, body);
  _mm_sfence();
  std::memcpy(d + head + body, s + head + body, bytes - head - body);
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace zp::detail
