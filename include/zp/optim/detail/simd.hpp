// zp/optim/detail/simd.hpp: the instruction-set levels of zp's CPU paths, and the x86 vector types
// the CPU optimizer and quantization run their element math on.
//
// Each ISA level gets a float vector type with the operators the element math uses (+ - * /,
// fma, sqrt, sign, rounded) and loads/stores that convert from and to the storage types. Every
// function carries its own target attribute, so this header compiles with any -m flags and the
// code is only run after a run-time CPU check (supported(), below). Loops calling these are
// marked [[gnu::flatten]] with the same target, which inlines the (target-less) element templates
// of optimizer.hpp and these operators into one vectorised loop body.
//
// Conversions match zp::bf16 / zp::fp16 bit for bit on non-nan values: bf16 rounds to nearest
// even with integer arithmetic (the AVX-512 BF16 instruction would flush subnormals), fp16 uses
// the F16C/AVX-512 conversion with round-to-nearest-even. A nan stored as bf16 is quieted as in
// zp::bf16; a nan stored as fp16 keeps the hardware's payload (zp::fp16 gives 0x7e00).
#pragma once

// nvcc's device pass (__CUDA_ARCH__) never sees the vector code: the element templates are
// __host__ __device__ and must not be instantiated for the device with x86 vector types.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDA_ARCH__)
#define ZP_OPTIM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define ZP_OPTIM_X86 0
#endif

#include <cstdint>
#include <type_traits>
#include <vector>

#include "zp/dtype.hpp"

namespace zp::optim::cpu {

// Instruction-set levels of the CPU paths (the optimizer, zp/quantize.hpp). `best` picks the
// widest the running CPU supports.
enum class Isa { best, portable, avx2, avx512 };

inline const char* name(Isa isa) noexcept {
  switch (isa) {
    case Isa::best: return "best";
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "unknown";  // a value cast from an integer outside the enum
}

#if ZP_OPTIM_X86
// F16C (CPUID leaf 1, ECX): Clang's __builtin_cpu_supports does not know it, GCC's does. Asked
// once: CPUID traps to the hypervisor in a virtual machine (14 us a call measured on a cloud VM),
// and quantize and dequantize ask supported() on every call.
inline bool has_f16c() noexcept {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  return yes;
}
#endif

// Whether this CPU (and OS) can run a level. avx2 means AVX2 with FMA and F16C; avx512 adds
// AVX-512F and BW (16-bit lanes).
inline bool supported(Isa isa) noexcept {
  switch (isa) {
    case Isa::best:
    case Isa::portable: return true;
#if ZP_OPTIM_X86
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             supported(Isa::avx2);
#else
    case Isa::avx2:
    case Isa::avx512: return false;
#endif
  }
  return false;
}

// The widest supported level.
inline Isa best_isa() noexcept {
  static const Isa best = supported(Isa::avx512) ? Isa::avx512
                          : supported(Isa::avx2) ? Isa::avx2
                                                 : Isa::portable;
  return best;
}

// The levels this CPU supports, narrowest first.
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::portable, Isa::avx2, Isa::avx512})
    if (supported(i)) out.push_back(i);
  return out;
}

}  // namespace zp::optim::cpu

#if ZP_OPTIM_X86
namespace zp::optim::detail::simd {

// Defined already by tests/avx512_emulated/immintrin.h, which runs the AVX-512 loops on AVX2
// (ZP_V16_OPERAND: rounded()'s asm operand for a V16, a zmm register here, memory there).
#ifndef ZP_TARGET_AVX2
#define ZP_TARGET_AVX2 gnu::target("avx2,fma,f16c")
#define ZP_TARGET_AVX512 gnu::target("avx512f,avx512bw,avx2,fma,f16c")
#define ZP_TARGET_AVX512_BF16 gnu::target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")
#define ZP_V16_OPERAND "+v"
#endif

// ---- AVX2 + FMA + F16C: 8 floats ----
struct V8 {
  __m256 v;
  static constexpr int width = 8;
  V8() = default;
  // User-provided copies make the type a MEMORY-class aggregate in the x86-64 ABI: passed and
  // returned through memory whether or not the caller was compiled with AVX, so unoptimised
  // builds (where the element templates are not inlined into the target functions) agree with
  // the target functions on how values travel. Optimised builds inline everything away.
  V8(const V8& o) : v(o.v) {}
  V8& operator=(const V8& o) {
    v = o.v;
    return *this;
  }
  [[ZP_TARGET_AVX2]] explicit V8(__m256 x) : v(x) {}
  [[ZP_TARGET_AVX2]] explicit V8(float x) : v(_mm256_set1_ps(x)) {}
};
[[ZP_TARGET_AVX2]] inline V8 operator+(const V8& a, const V8& b) {
  return V8(_mm256_add_ps(a.v, b.v));
}
[[ZP_TARGET_AVX2]] inline V8 operator-(const V8& a, const V8& b) {
  return V8(_mm256_sub_ps(a.v, b.v));
}
[[ZP_TARGET_AVX2]] inline V8 operator*(const V8& a, const V8& b) {
  return V8(_mm256_mul_ps(a.v, b.v));
}
[[ZP_TARGET_AVX2]] inline V8 operator/(const V8& a, const V8& b) {
  return V8(_mm256_div_ps(a.v, b.v));
}
[[ZP_TARGET_AVX2]] inline V8 fma(const V8& a, const V8& b, const V8& c) {
  return V8(_mm256_fmadd_ps(a.v, b.v, c.v));
}
// a, opaque to the compiler: a product passed through it is rounded on its own, never contracted
// with a following add into one fma (GCC does that to these operators from -O2 on, its default
// being -ffp-contract=fast), as the portable loops and the device round it.
[[ZP_TARGET_AVX2]] inline V8 rounded(V8 a) {
  asm("" : "+x"(a.v));
  return a;
}
[[ZP_TARGET_AVX2]] inline V8 sqrt(const V8& a) { return V8(_mm256_sqrt_ps(a.v)); }
[[ZP_TARGET_AVX2]] inline V8 sign(const V8& a) {
  const __m256 z = _mm256_setzero_ps();
  const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, z, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
  const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, z, _CMP_LT_OQ), _mm256_set1_ps(1.0f));
  return V8(_mm256_sub_ps(pos, neg));  // same operation as the scalar float(a>0) - float(a<0)
}

[[ZP_TARGET_AVX2]] inline V8 load(const float* p, std::type_identity<V8>) {
  return V8(_mm256_loadu_ps(p));
}
[[ZP_TARGET_AVX2]] inline V8 load(const bf16* p, std::type_identity<V8>) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return V8(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
}
[[ZP_TARGET_AVX2]] inline V8 load(const fp16* p, std::type_identity<V8>) {
  return V8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// x's values rounded to bf16 (to nearest even; no NaN), each in the upper half of its 32-bit
// lane, the lower half not cleared.
[[ZP_TARGET_AVX2]] inline __m256i bf16_upper(const V8& x) {
  const __m256i u = _mm256_castps_si256(x.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
}
// x's 8 values as bf16 bits, in the low halves of 32-bit lanes (MayBeNaN = false: the caller
// knows none is a NaN, and the quieting is skipped; every other value converts the same).
template <bool MayBeNaN = true>
[[ZP_TARGET_AVX2]] inline __m256i bf16_lanes(const V8& x) {
  const __m256i u = _mm256_castps_si256(x.v);
  const __m256i rounded = _mm256_srli_epi32(bf16_upper(x), 16);
  if constexpr (!MayBeNaN) return rounded;
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
// x's 8 values as bf16 bits, in order. (Every lane <= 0xffff: unsigned saturation is exact.)
template <bool MayBeNaN = true>
[[ZP_TARGET_AVX2]] inline __m128i to_bf16(const V8& x) {
  const __m256i r = bf16_lanes<MayBeNaN>(x);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b11'01'10'00));
}
// a's then b's 8 values as bf16 bits, in order: one pack for 16 values.
template <bool MayBeNaN = true>
[[ZP_TARGET_AVX2]] inline __m256i to_bf16(const V8& a, const V8& b) {
  return _mm256_permute4x64_epi64(
      _mm256_packus_epi32(bf16_lanes<MayBeNaN>(a), bf16_lanes<MayBeNaN>(b)), 0b11'01'10'00);
}
[[ZP_TARGET_AVX2]] inline __m128i to_fp16(const V8& x) {
  return _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT);
}
[[ZP_TARGET_AVX2]] inline void store(float* p, const V8& x) { _mm256_storeu_ps(p, x.v); }
[[ZP_TARGET_AVX2]] inline void store(bf16* p, const V8& x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x));
}
[[ZP_TARGET_AVX2]] inline void store(fp16* p, const V8& x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_fp16(x));
}
// store's non-temporal form, for outputs nobody reads soon (no read for ownership, not cached):
// p 16-byte aligned; the caller fences (_mm_sfence) before the data is published.
[[ZP_TARGET_AVX2]] inline void stream(fp16* p, const V8& x) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_fp16(x));
}
// 32 bytes of bits, streamed: in one store where p is 32-byte aligned (AVX2's bf16 int8 dequantize
// at blocks 512 and 2048 so takes 0.92-0.94 of the time on a Zen 3, bench/RESULTS.md), else as two
// 16-byte halves.
[[ZP_TARGET_AVX2]] inline void stream(void* p, __m256i bits) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 == 0) {
    _mm256_stream_si256(static_cast<__m256i*>(p), bits);
  } else {
    _mm_stream_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(bits));
    _mm_stream_si128(static_cast<__m128i*>(p) + 1, _mm256_extracti128_si256(bits, 1));
  }
}

// Sum of squares of 8 floats into two double accumulators (4 lanes each).
[[ZP_TARGET_AVX2]] inline void add_squares(const V8& x, __m256d& lo, __m256d& hi) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x.v));
  const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x.v, 1));
  lo = _mm256_fmadd_pd(a, a, lo);
  hi = _mm256_fmadd_pd(b, b, hi);
}
[[ZP_TARGET_AVX2]] inline double hsum(__m256d a) {
  alignas(32) double t[4];
  _mm256_store_pd(t, a);
  return (t[0] + t[1]) + (t[2] + t[3]);
}

// ---- AVX-512F: 16 floats ----
struct V16 {
  __m512 v;
  static constexpr int width = 16;
  V16() = default;
  // User-provided copies make the type a MEMORY-class aggregate in the x86-64 ABI: passed and
  // returned through memory whether or not the caller was compiled with AVX, so unoptimised
  // builds (where the element templates are not inlined into the target functions) agree with
  // the target functions on how values travel. Optimised builds inline everything away.
  V16(const V16& o) : v(o.v) {}
  V16& operator=(const V16& o) {
    v = o.v;
    return *this;
  }
  [[ZP_TARGET_AVX512]] explicit V16(__m512 x) : v(x) {}
  [[ZP_TARGET_AVX512]] explicit V16(float x) : v(_mm512_set1_ps(x)) {}
};
[[ZP_TARGET_AVX512]] inline V16 operator+(const V16& a, const V16& b) {
  return V16(_mm512_add_ps(a.v, b.v));
}
[[ZP_TARGET_AVX512]] inline V16 operator-(const V16& a, const V16& b) {
  return V16(_mm512_sub_ps(a.v, b.v));
}
[[ZP_TARGET_AVX512]] inline V16 operator*(const V16& a, const V16& b) {
  return V16(_mm512_mul_ps(a.v, b.v));
}
[[ZP_TARGET_AVX512]] inline V16 operator/(const V16& a, const V16& b) {
  return V16(_mm512_div_ps(a.v, b.v));
}
[[ZP_TARGET_AVX512]] inline V16 fma(const V16& a, const V16& b, const V16& c) {
  return V16(_mm512_fmadd_ps(a.v, b.v, c.v));
}
[[ZP_TARGET_AVX512]] inline V16 rounded(V16 a) {  // as V8's
  asm("" : ZP_V16_OPERAND(a.v));
  return a;
}
[[ZP_TARGET_AVX512]] inline V16 sqrt(const V16& a) { return V16(_mm512_sqrt_ps(a.v)); }
[[ZP_TARGET_AVX512]] inline V16 sign(const V16& a) {
  const __m512 z = _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, z, _CMP_GT_OQ), one);
  const __m512 neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, z, _CMP_LT_OQ), one);
  return V16(_mm512_sub_ps(pos, neg));
}

[[ZP_TARGET_AVX512]] inline V16 load(const float* p, std::type_identity<V16>) {
  return V16(_mm512_loadu_ps(p));
}
[[ZP_TARGET_AVX512]] inline V16 load(const bf16* p, std::type_identity<V16>) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return V16(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
}
[[ZP_TARGET_AVX512]] inline V16 load(const fp16* p, std::type_identity<V16>) {
  return V16(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
[[ZP_TARGET_AVX512]] inline void store(float* p, const V16& x) { _mm512_storeu_ps(p, x.v); }
// x's 16 values as bf16 bits, in order (MayBeNaN: as bf16_lanes).
template <bool MayBeNaN = true>
[[ZP_TARGET_AVX512]] inline __m256i to_bf16(const V16& x) {
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  if constexpr (MayBeNaN)
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), r,
                                _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}
[[ZP_TARGET_AVX512]] inline __m256i to_fp16(const V16& x) {
  return _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT);
}
[[ZP_TARGET_AVX512]] inline void store(bf16* p, const V16& x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
}
[[ZP_TARGET_AVX512]] inline void store(fp16* p, const V16& x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_fp16(x));
}
// store's non-temporal forms, with V8's contract (p 16-byte aligned, the caller fences).
[[ZP_TARGET_AVX512]] inline void stream(float* p, const V16& x) {
  const __m512i u = _mm512_castps_si512(x.v);
  stream(p, _mm512_castsi512_si256(u));
  stream(p + 8, _mm512_extracti64x4_epi64(u, 1));
}
[[ZP_TARGET_AVX512]] inline void stream(fp16* p, const V16& x) { stream(p, to_fp16(x)); }

[[ZP_TARGET_AVX512]] inline void add_squares(const V16& x, __m512d& lo, __m512d& hi) {
  const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x.v));
  const __m512d b =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1)));
  lo = _mm512_fmadd_pd(a, a, lo);
  hi = _mm512_fmadd_pd(b, b, hi);
}
[[ZP_TARGET_AVX512]] inline double hsum(__m512d a) {
  alignas(64) double t[8];
  _mm512_store_pd(t, a);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

}  // namespace zp::optim::detail::simd
#endif  // ZP_OPTIM_X86
