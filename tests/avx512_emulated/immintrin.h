// tests/avx512_emulated/immintrin.h: stands in for the compiler's <immintrin.h> in the test
// programs built to run zp's AVX-512 loops on a CPU without AVX-512 (tests/CMakeLists.txt's
// *.avx512_emulated tests; this directory comes first on their include path).
//
// The AVX-512 intrinsics are SIMDe's portable definitions (Debian's libsimde-dev), under their
// Intel names; the 15 that SIMDe 0.7 lacks are below, built from two 256-bit halves (AVX2's own
// intrinsics) or written out lane by lane from Intel's definitions. __builtin_cpu_supports answers yes for every AVX-512
// feature (ZP_EMULATE_AVX512_BF16=0 takes avx512bf16 back, for the loops without it) and asks
// the CPU for the rest. The programs are built for AVX2 (-mavx2 -mfma -mf16c), and zp's target
// attributes are defined here first to add nothing: with AVX-512's, the compiler would vectorise
// the emulation with the instructions it stands in for.
#pragma once
#pragma GCC system_header  // for #include_next, under -Wpedantic

// The compiler's intrinsics first: built with -mavx2 -mfma -mf16c, these programs run AVX2's
// natively, and SIMDe emulates AVX-512's over AVX2's types (its own <immintrin.h> is this file,
// already included).
#include_next <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cpuid.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#define ZP_TARGET_AVX2 maybe_unused
#define ZP_TARGET_AVX512 maybe_unused
#define ZP_TARGET_AVX512_BF16 maybe_unused
#define ZP_V16_OPERAND "+m"

namespace zp_avx512_emulated {

inline bool emulates(std::string_view feature) {
  if (feature == "avx512bf16") {
    const char* v = std::getenv("ZP_EMULATE_AVX512_BF16");
    return !(v && std::string_view(v) == "0");
  }
  return feature.starts_with("avx512");
}

// These programs need AVX2, FMA and F16C: without them, they say so and are skipped (the check
// itself compiled without them).
[[gnu::target("no-avx,no-avx2,no-fma,no-f16c")]] inline bool has_avx2() {
  unsigned a = 0, b = 0, c = 0, d = 0;  // F16C: Clang's __builtin_cpu_supports does not know it
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0)
    return true;
  std::fprintf(stderr,
               "skipped: the AVX-512 emulation runs on AVX2, FMA and F16C, which this "
               "CPU lacks\n");
  std::_Exit(77);
}
[[maybe_unused]] static const bool checked = has_avx2();

inline __m512i combine(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
inline __m512 combine(__m256 lo, __m256 hi) {
  return _mm512_castsi512_ps(combine(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}
inline __m256i hi256(__m512i a) { return _mm512_extracti64x4_epi64(a, 1); }
inline __m256 hi256(__m512 a) { return _mm256_castsi256_ps(hi256(_mm512_castps_si512(a))); }
inline __m128i hi64(__m128i a) { return _mm_srli_si128(a, 8); }

// VCVTNE2PS2BF16's conversion of one float: nan quieted, a subnormal input taken as zero of its
// sign, otherwise rounded to nearest even.
inline std::uint16_t to_bf16_ne(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40);
  if ((u & 0x7f800000u) == 0) return std::uint16_t((u >> 16) & 0x8000);
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// What SIMDe 0.7 lacks. Widening and narrowing conversions, two 256-bit halves at a time:
inline __m512 cvtepi32_ps(__m512i a) {
  return combine(_mm256_cvtepi32_ps(_mm512_castsi512_si256(a)), _mm256_cvtepi32_ps(hi256(a)));
}
inline __m512 cvtph_ps(__m256i a) {
  return combine(_mm256_cvtph_ps(_mm256_castsi256_si128(a)),
                 _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
}
inline __m256i cvtps_ph(__m512 a) {  // rounded to nearest even
  return _mm256_set_m128i(_mm256_cvtps_ph(hi256(a), _MM_FROUND_TO_NEAREST_INT),
                          _mm256_cvtps_ph(_mm512_castps512_ps256(a), _MM_FROUND_TO_NEAREST_INT));
}
inline __m512d cvtps_pd(__m256 a) {
  return _mm512_castsi512_pd(
      combine(_mm256_castpd_si256(_mm256_cvtps_pd(_mm256_castps256_ps128(a))),
              _mm256_castpd_si256(_mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)))));
}
inline __m512i cvtepi8_epi32(__m128i a) {
  return combine(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(hi64(a)));
}
inline __m512i cvtepu8_epi32(__m128i a) {
  return combine(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(hi64(a)));
}
inline __m512i cvtepu16_epi32(__m256i a) {
  return combine(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
                 _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
inline __m512i srai_epi32(__m512i a, int n) {
  return combine(_mm256_srai_epi32(_mm512_castsi512_si256(a), n), _mm256_srai_epi32(hi256(a), n));
}
inline __m512i zextsi256_si512(__m256i a) { return combine(a, _mm256_setzero_si256()); }

// Truncations, a compare and the bf16 conversion, lane by lane:
template <class R, class Lane, int N, class A>
inline R truncate(A a) {
  alignas(64) std::int64_t in[8];
  alignas(64) Lane out[sizeof(R) / sizeof(Lane)] = {};
  std::memcpy(in, &a, 64);
  for (int i = 0; i < N; ++i)
    out[i] = N == 8 ? Lane(in[i]) : Lane(reinterpret_cast<const std::int32_t*>(in)[i]);
  R r;
  std::memcpy(&r, out, sizeof r);
  return r;
}
inline __mmask16 cmplt_epu32_mask(__m512i a, __m512i b) {
  std::uint32_t x[16], y[16];
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  __mmask16 r = 0;
  for (int i = 0; i < 16; ++i) r = __mmask16(r | (x[i] < y[i] ? 1u : 0u) << i);
  return r;
}
// Lanes 0-15 from b, 16-31 from a; as __m512i, since Clang 16 cannot pass or return its
// __m512bh (a vector of __bf16) without AVX-512 BF16 (zp casts the result to __m512i).
inline __m512i cvtne2ps_pbh(__m512 a, __m512 b) {
  float x[32];
  std::memcpy(x, &b, 64);
  std::memcpy(x + 16, &a, 64);
  std::uint16_t h[32];
  for (int i = 0; i < 32; ++i) h[i] = to_bf16_ne(x[i]);
  __m512i r;
  std::memcpy(&r, h, 64);
  return r;
}

}  // namespace zp_avx512_emulated

#define __builtin_cpu_supports(feature) \
  (zp_avx512_emulated::emulates(feature) || __builtin_cpu_supports(feature))

#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps zp_avx512_emulated::cvtepi32_ps
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps zp_avx512_emulated::cvtph_ps
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(a, rounding) zp_avx512_emulated::cvtps_ph(a)
#undef _mm512_cvtps_pd
#define _mm512_cvtps_pd zp_avx512_emulated::cvtps_pd
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 zp_avx512_emulated::cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 zp_avx512_emulated::cvtepu8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 zp_avx512_emulated::cvtepu16_epi32
#undef _mm512_srai_epi32
#define _mm512_srai_epi32 zp_avx512_emulated::srai_epi32
#undef _mm512_zextsi256_si512
#define _mm512_zextsi256_si512 zp_avx512_emulated::zextsi256_si512
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 zp_avx512_emulated::truncate<__m256i, std::int16_t, 16>
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 zp_avx512_emulated::truncate<__m128i, std::int8_t, 16>
#undef _mm512_cvtepi64_epi8
#define _mm512_cvtepi64_epi8 zp_avx512_emulated::truncate<__m128i, std::int8_t, 8>
#undef _mm512_cmplt_epu32_mask
#define _mm512_cmplt_epu32_mask zp_avx512_emulated::cmplt_epu32_mask
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh zp_avx512_emulated::cvtne2ps_pbh
