// zp/quantize.hpp: blockwise symmetric quantization to int8 or int4, the element math of ZeRO++'s
// quantized weight gathers and gradient reductions (issue #22), written once for host and device.
//
// A tensor of n values (float, bf16 or fp16) is cut into blocks of `block` values (the last one
// short). Block k has one fp32 scale, its largest |x| over qmax (127 for int8, 7 for int4), and
// each value becomes q = x * (1 / scale), the exact product rounded to the nearest integer, ties to
// even (Divisor), so that |x - q * scale| <= absmax / (2 qmax) up to fp32 rounding. int8 codes take
// a byte each; int4 codes two per byte, the lower nibble first (two's complement), and `block` must
// then be even so that every block starts on a byte. A block with an inf or NaN gets a NaN scale
// and dequantizes to NaN throughout: the overflow the loss scaler sees, never finite garbage.
//
//   zp::quant::Format f{.bits = zp::quant::Bits::int8, .block = 256};
//   std::vector<std::uint8_t> q(f.code_bytes(n));  std::vector<float> s(f.blocks(n));
//   zp::quant::quantize(std::span<const bf16>(x), f, std::span(q), std::span(s));
//   zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s), out);
//   zp::quant::dequantize_add(f, q, s, acc);   // acc += dequant(q): fp32 accumulation
//
// QuantizeBlock and DequantizeBlock are the work items (one block each) that a device launches
// with zp::device::launch; the host functions here run them in a loop, or, on a CPU with
// AVX-512 or AVX2 (checked at run time), the same math 16 values at a time with bitwise the same
// results (IEEE fused multiply-adds and products; a NaN stored as fp16 may keep another
// payload). Path::portable forces the loop of work items, Path::avx2 the AVX2 loops.
// dequantize writes an output of detail::stream_min_bytes or more with streaming stores (where
// it is 16-byte aligned and blocks keep that alignment): no read of each line before it is
// written, and the output not left in the caches; quantize writes its codes so when it reads and
// writes that much. Path::cached keeps plain stores, for an output read again right away.
#pragma once

#include <math.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>

#include "zp/config.hpp"
#include "zp/detail/copy.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"
#include "zp/optim/detail/simd.hpp"

namespace zp::quant {

enum class Bits : std::uint8_t { int8 = 8, int4 = 4 };

struct Format {
  Bits bits = Bits::int8;
  std::size_t block = 256;  // values per scale

  ZP_HOST_DEVICE int qmax() const { return bits == Bits::int8 ? 127 : 7; }
  ZP_HOST_DEVICE std::size_t blocks(std::size_t n) const { return (n + block - 1) / block; }
  ZP_HOST_DEVICE std::size_t code_bytes(std::size_t n) const {
    return bits == Bits::int8 ? n : (n + 1) / 2;
  }
  // Blocks of at most 2^31 values: a larger one would wrap blocks(n), to save at most one
  // 4-byte scale per 2^31 values.
  static constexpr std::size_t max_block = std::size_t(1) << 31;
  void check() const {
    ZP_EXPECT(bits == Bits::int8 || bits == Bits::int4, "quantize: bits must be int8 or int4, got ",
              int(bits));
    ZP_EXPECT(block >= 1 && block <= max_block, "quantize: block size ", block,
              " must be in [1, 2^31]");
    ZP_EXPECT(bits == Bits::int8 || block % 2 == 0, "quantize: block size ", block,
              " is odd; int4 packs two codes a byte, so its blocks must be even");
  }
};

namespace detail {

// Code i of the codes at q (int8: byte i; int4: nibble i, sign-extended).
ZP_HOST_DEVICE inline int code(const std::uint8_t* q, Bits bits, std::size_t i) {
  if (bits == Bits::int8) return int(static_cast<std::int8_t>(q[i]));
  const int nib = (q[i / 2] >> (4 * (i % 2))) & 0xf;
  return nib >= 8 ? nib - 16 : nib;
}

// x / scale rounded to the nearest integer, ties to even, as the exact product x * (1 / scale)
// so rounded: one division per block, not per value, and one fused multiply-add per value. The
// product is within 2^-16 of the quotient (|x / scale| <= qmax <= 127, the reciprocal's
// rounding of 2^-24). The sum with `magic`, an fp32 whose ulp is 1, rounds it to that integer
// and keeps it in its low bits (two's complement modulo 2^22), which the SIMD loops narrow with
// no conversion. A scale under 2^-128, whose reciprocal overflows, divides, and its quotient is
// clamped to [-qmax, qmax]: such a scale may be a subnormal rounded far below absmax / qmax. A
// zero scale (every x zero) multiplies by zero.
struct Divisor {
  static constexpr float magic = 0x1.8p23f;
  float scale, inverse, qmax;
  bool divide;
  ZP_HOST_DEVICE Divisor(float s, int q)
      : scale(s),
        inverse(s == 0 ? 0.0f : 1.0f / s),
        qmax(float(q)),
        divide(!(inverse < INFINITY)) {}
  // A scale whose reciprocal inv = 1 / s is known to be finite (no branch on it where inlined).
  ZP_HOST_DEVICE Divisor(float s, float inv, int q)
      : scale(s), inverse(inv), qmax(float(q)), divide(false) {}
  ZP_HOST_DEVICE float biased(float x) const {  // magic + the code, exactly
    if (divide) {
      const float t = x / scale;  // finite: x and scale are
      return (t < -qmax ? -qmax : t > qmax ? qmax : t) + magic;
    }
#ifdef __CUDA_ARCH__
    return ::fmaf(x, inverse, magic);
#else
    // The same rounding where fmaf may be a library call (x86-64's baseline has no fma): the
    // product is exact in double, and adding 1.5 x 2^52 (ulp 1) rounds it to an integer once,
    // fused into an fma or not.
    const double p = double(x) * double(inverse) + 0x1.8p52;
    return float(p - 0x1.8p52) + magic;
#endif
  }
  ZP_HOST_DEVICE int code(float x) const { return int(biased(x) - magic); }
};

// Codes of x[i, hi) of a finite block (int4: i even, so whole bytes): the work item's loop, and
// the rest of a block after the SIMD loops.
template <class T>
ZP_HOST_DEVICE void write_codes(const T* x, std::size_t i, std::size_t hi, Bits bits,
                                const Divisor& d, std::uint8_t* codes) {
  const auto q = [&](std::size_t j) { return j < hi ? d.code(float(x[j])) : 0; };
  if (bits == Bits::int8) {
    for (; i < hi; ++i) codes[i] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q(i)));
  } else {
    for (; i < hi; i += 2) codes[i / 2] = std::uint8_t((q(i) & 0xf) | ((q(i + 1) & 0xf) << 4));
  }
}

// Zero codes for values [lo, hi) (lo even for int4): a block of zeros, or with an inf or NaN.
ZP_HOST_DEVICE inline void zero_codes(std::uint8_t* codes, Bits bits, std::size_t lo,
                                      std::size_t hi) {
  const std::size_t b = bits == Bits::int8 ? lo : lo / 2,
                    e = bits == Bits::int8 ? hi : (hi + 1) / 2;
  for (std::size_t i = b; i < e; ++i) codes[i] = 0;
}

// code x scale rounded to fp32 on its own, as the SIMD loops do: never fused with a following add
// into one fma (nvcc's default, and GCC's where the target has fma). The product is exact in
// double (a code has at most 8 bits), so converting it rounds once.
ZP_HOST_DEVICE inline float times_scale(int c, float scale) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(float(c), scale);
#else
  return float(double(c) * double(scale));
#endif
}

// Values [i, hi) from their codes and block scale into out (Accumulate: added to it): the work
// item's loop, and the rest of a block after the SIMD loops.
template <bool Accumulate, class T>
ZP_HOST_DEVICE void write_values(const std::uint8_t* codes, Bits bits, std::size_t i,
                                 std::size_t hi, float scale, T* out) {
  for (; i < hi; ++i) {
    const float v = times_scale(code(codes, bits, i), scale);
    if constexpr (Accumulate)
      out[i] = T(float(out[i]) + v);
    else
      out[i] = T(v);
  }
}

}  // namespace detail

// Work item k: quantizes block k of x[0, n) into codes and scales[k].
template <class T>
struct QuantizeBlock {
  const T* x;
  std::size_t n;
  Format f;
  std::uint8_t* codes;
  float* scales;

  ZP_HOST_DEVICE void operator()(std::size_t k) const {
    const std::size_t lo = k * f.block, hi = lo + f.block < n ? lo + f.block : n;
    float absmax = 0;
    bool finite = true;
    for (std::size_t i = lo; i < hi; ++i) {
      const float v = float(x[i]);
      finite = finite && v - v == 0;  // false for inf and NaN
      absmax = ::fabsf(v) > absmax ? ::fabsf(v) : absmax;
    }
    const float scale = finite ? absmax / float(f.qmax()) : NAN;
    scales[k] = scale;
    if (finite)
      detail::write_codes(x, lo, hi, f.bits, detail::Divisor(scale, f.qmax()), codes);
    else
      detail::zero_codes(codes, f.bits, lo, hi);
  }
};

// Work item k: dequantizes block k into out[lo, hi) (Accumulate: adds to it).
template <class T, bool Accumulate>
struct DequantizeBlock {
  const std::uint8_t* codes;
  const float* scales;
  std::size_t n;
  Format f;
  T* out;

  ZP_HOST_DEVICE void operator()(std::size_t k) const {
    const std::size_t lo = k * f.block, hi = lo + f.block < n ? lo + f.block : n;
    detail::write_values<Accumulate>(codes, f.bits, lo, hi, scales[k], out);
  }
};

// Which host code runs: the best the CPU supports (AVX-512, else AVX2, else the work items),
// the same with plain stores only (cached), the AVX2 loops where AVX-512 is there too (avx2: the
// AVX-512 loops' baseline), or the portable work items.
enum class Path { best, portable, cached, avx2 };

namespace detail {
using zp::optim::cpu::Isa;

// The loops a call on this path runs on this CPU (portable: the work items).
inline Isa isa(Path p) noexcept {
  using zp::optim::cpu::supported;
  if (p == Path::portable || !supported(Isa::avx2)) return Isa::portable;
  return p != Path::avx2 && supported(Isa::avx512) ? Isa::avx512 : Isa::avx2;
}

#if ZP_OPTIM_X86
namespace simd = zp::optim::detail::simd;

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12 warns of its own AVX-512 headers' _mm512_undefined_* operands (GCC bug 105593; at -O0
// also as -Wuninitialized, where a cast of a function's vector argument inlines one).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
// |v|'s bits, which order as the magnitudes do, with inf and NaN above every finite value.
template <class T>
std::uint32_t magnitude_bits(T v) {
  if constexpr (std::is_same_v<T, float>)
    return zp::detail::float_bits(v) & 0x7fffffffu;
  else
    return v.bits & 0x7fffu;
}
template <class T>
constexpr std::uint32_t inf_bits = std::is_same_v<T, float>  ? 0x7f800000u
                                   : std::is_same_v<T, bf16> ? 0x7f80u
                                                             : 0x7c00u;  // fp16

// The largest lane of top: 8 lanes of 32 bits, or 16 of 16 bits.
template <class T>
[[ZP_TARGET_AVX2]] inline std::uint32_t largest(__m256i top, std::type_identity<T>) {
  __m128i m = _mm256_castsi256_si128(top), h = _mm256_extracti128_si256(top, 1);
  if constexpr (sizeof(T) == 2) {  // the smallest complement is the largest lane
    m = _mm_minpos_epu16(_mm_xor_si128(_mm_max_epu16(m, h), _mm_set1_epi32(-1)));
    return ~std::uint32_t(_mm_cvtsi128_si32(m)) & 0xffffu;
  } else {
    m = _mm_max_epu32(m, h);
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
    return std::uint32_t(_mm_cvtsi128_si32(_mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1))));
  }
}

// Nibble k's int4 code (two's complement) as a float, in index order: times a block's scale,
// the entries of its table of 16 values (nothing converted per block).
alignas(64) inline constexpr float nibble_values[16] = {0,  1,  2,  3,  4,  5,  6,  7,
                                                        -8, -7, -6, -5, -4, -3, -2, -1};

// Codes i .. i + 15 as bytes (int4: unpacked in order, low nibble first, and sign-extended).
template <Bits B>
[[ZP_TARGET_AVX2]] inline __m128i codes16(const std::uint8_t* codes, std::size_t i) {
  if constexpr (B == Bits::int8) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2)),
                  m = _mm_set1_epi8(0x0f), e = _mm_set1_epi8(8);
    const __m128i c =
        _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm_sub_epi8(_mm_xor_si128(c, e), e);
  }
}

// 16 code bytes at `at` (Stream: non-temporal, at 16-byte aligned).
template <bool Stream>
inline void store_code_bytes(__m128i c, std::uint8_t* at) {
  if constexpr (Stream)
    _mm_stream_si128(reinterpret_cast<__m128i*>(at), c);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at), c);
}

// 64 code bytes, one cache line at `at` (64-byte aligned), streamed by two stores back to back,
// so that the line leaves its write-combining buffer at once (streamed 16 bytes a step, it held
// the buffer while the next steps' codes were made: 1.04-1.16x the time at block 2048,
// bench/RESULTS.md).
[[ZP_TARGET_AVX2]] inline void stream_line(std::uint8_t* at, __m128i a, __m128i b, __m128i c,
                                           __m128i d) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(at), _mm256_set_m128i(b, a));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(at) + 1, _mm256_set_m128i(d, c));
}

// 32 bytes of bits at `at` (Stream: streamed, at 16-byte aligned).
template <bool Stream>
[[ZP_TARGET_AVX2]] inline void store_bits(void* at, __m256i bits) {
  if constexpr (Stream)
    simd::stream(at, bits);
  else
    _mm256_storeu_si256(static_cast<__m256i*>(at), bits);
}

// Values a step of block_codes makes codes of: 16 code bytes.
template <Bits B>
constexpr std::size_t step_values = B == Bits::int8 ? 16 : 32;

template <class Simd, Bits B, bool Stream, class T>
std::size_t block_codes(const T* x, std::size_t lo, std::size_t hi, const Divisor& d,
                        std::uint8_t* out, typename Simd::Ahead& next);

// The vector halves of quantize and dequantize, one struct per instruction set, each member
// carrying its target (the entry points inline them into one loop per block):
//   ahead(lo, hi)             the next block, x[lo, hi), whose absmax block_codes may read;
//   absmax_bits(x, next)      the largest magnitude's bits in that block;
//   Coder(d)                  a finite block's scale, as vectors: bytes<B>(x) the 16 code bytes
//                             of x[0, 16) (int8) or x[0, 32) (int4, two a byte), nibbles(x) the
//                             8 bytes of int4's x[0, 16) (block_codes' steps);
//   values<B, T, Accumulate, Stream, MayBeNaN>(c, lo, hi, scale, out)  a block's values, 16 at a
//                             time (Stream: streaming stores; MayBeNaN: a NaN scale);
// values returns where the rest of the block (under 16 values) starts.
struct Avx2 {
  using V = simd::V8;

  // top with the magnitudes' bits of the 32 bytes at x folded in (lane by lane maxima).
  template <class T>
  [[ZP_TARGET_AVX2]] static __m256i fold(const T* x, __m256i top) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return sizeof(T) == 4
               ? _mm256_max_epu32(top, _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)))
               : _mm256_max_epu16(top, _mm256_and_si256(b, _mm256_set1_epi16(0x7fff)));
  }
  // The largest magnitude's bits in x[lo, hi) and top's lanes (the maxima read so far).
  template <class T>
  [[ZP_TARGET_AVX2]] static std::uint32_t absmax_bits(const T* x, std::size_t lo, std::size_t hi,
                                                      __m256i top) {
    constexpr std::size_t per = 32 / sizeof(T);
    std::size_t i = lo;
    for (; i + per <= hi; i += per) top = fold(x + i, top);
    std::uint32_t m = largest(top, std::type_identity<T>{});
    for (; i < hi; ++i) m = std::max(m, magnitude_bits(x[i]));
    return m;
  }

  // Divisor::biased of 8 values, as bits: the low 16 bits of each lane are its code.
  [[ZP_TARGET_AVX2]] static __m256i biased8(__m256 v, const Divisor& d, __m256 s, __m256 inv) {
    const __m256 magic = _mm256_set1_ps(d.magic);
    if (d.divide) {
      const __m256 q = _mm256_set1_ps(d.qmax);
      return _mm256_castps_si256(
          _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v, s), -q), q), magic));
    }
    return _mm256_castps_si256(_mm256_fmadd_ps(v, inv, magic));
  }

  // Divisor::biased of the 16 bf16 values at x, as bits: lane j of even holds value 2j's, lane j
  // of odd value 2j + 1's (a bf16 is the upper half of its fp32: a shift or a mask widens it).
  struct Biased {
    __m256i even, odd;
  };
  [[ZP_TARGET_AVX2]] static Biased bf16_biased(const bf16* x, const Divisor& d, __m256 s,
                                               __m256 inv) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return {
        biased8(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), d, s, inv),
        biased8(_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536))), d, s, inv)};
  }
  // The int4 codes of the 16 bf16 values at x, a byte of two in the low byte of each 32-bit lane
  // (lane j: codes 2j and 2j + 1, the even one in the low nibble): even and odd need no pairing
  // (0.79-0.82 of the codes' time on a Zen 3, bench/RESULTS.md).
  [[ZP_TARGET_AVX2]] static __m256i bf16_nibble_lanes(const bf16* x, const Divisor& d, __m256 s,
                                                      __m256 inv) {
    const auto [even, odd] = bf16_biased(x, d, s, inv);
    return _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0x0f)),
                           _mm256_and_si256(_mm256_slli_epi32(odd, 4), _mm256_set1_epi32(0xf0)));
  }
  // The low bytes of a's then b's 32-bit lanes, in order (each lane under 256: packs saturate none).
  [[ZP_TARGET_AVX2]] static __m128i low_bytes(__m256i a, __m256i b) {
    const __m256i p = _mm256_packus_epi32(a, b);  // per 128-bit half: a's four, then b's
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(
        _mm256_packus_epi16(p, p), _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));
  }

  // The 16 codes of x[i, i + 16) as bytes, in order (each within [-qmax, qmax]: no saturation).
  template <class T>
  [[ZP_TARGET_AVX2]] static __m128i code16(const T* x, const Divisor& d, __m256 s, __m256 inv) {
    if constexpr (std::is_same_v<T, bf16>) {
      // A bf16 is the upper half of its fp32: 32-bit lane j of a load holds value 2j in its lower
      // half and 2j + 1 in its upper half, so shifting and masking widen them in place, and one
      // blend of the biased sums' low halves puts the 16 codes in order, as 16-bit lanes.
      const auto [even, odd] = bf16_biased(x, d, s, inv);
      const __m256i w = _mm256_blend_epi16(even, _mm256_slli_epi32(odd, 16), 0xaa);
      return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    } else {
      // Each lane's low byte is its code: one shuffle gathers them into a 32-bit lane of each
      // 128-bit half (q0's into the first, q1's into the second), one permute orders the four.
      const __m256i q0 = biased8(simd::load(x, std::type_identity<V>{}).v, d, s, inv),
                    q1 = biased8(simd::load(x + 8, std::type_identity<V>{}).v, d, s, inv);
      const __m256i low0 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            -1, -1),
                    low1 = _mm256_setr_epi8(-1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1,
                                            -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                            -1, -1);
      const __m256i t =
          _mm256_or_si256(_mm256_shuffle_epi8(q0, low0), _mm256_shuffle_epi8(q1, low1));
      return _mm256_castsi256_si128(
          _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));
    }
  }

  // The next block, read for its absmax while a block's codes are made: x[lo, hi) is left to
  // read, the lanes' maxima so far in top.
  struct Ahead {
    std::size_t lo, hi;
    __m256i top;
  };
  [[ZP_TARGET_AVX2]] static Ahead ahead(std::size_t lo, std::size_t hi) {
    return {lo, hi, _mm256_setzero_si256()};
  }
  template <class T>
  [[ZP_TARGET_AVX2]] static std::uint32_t absmax_bits(const T* x, const Ahead& a) {
    return absmax_bits(x, a.lo, a.hi, a.top);
  }
  // The next N values of `next` folded into its top, where its block has N left (N values: a
  // multiple of 32 bytes). A codes loop calls it once per N codes it makes.
  template <std::size_t N, class T>
  [[ZP_TARGET_AVX2]] static void feed(const T* x, Ahead& next) {
    if (next.lo + N > next.hi) return;
    // The lines 8 KB past this read, into L2: the loop's demand loads alone keep too few lines
    // in flight (0.38-0.90 of the time with it, bench/RESULTS.md). An address, not an access: a
    // prefetch past x's end reads and faults nothing.
    const std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(x + next.lo) + 8192;
    for (std::size_t b = 0; b < std::max<std::size_t>(N * sizeof(T), 64); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
    for (std::size_t t = 0; t < N; t += 32 / sizeof(T)) next.top = fold(x + next.lo + t, next.top);
    next.lo += N;
  }

  // quantize_blocks takes small blocks eight at a time; a step of their absmax reads 32 bytes.
  static constexpr std::size_t group_size = 8, read_bytes = 32;
  // Whether a group's codes of T stream (where the call streams): 16-bit blocks of 64 values are
  // bound by their arithmetic, not the memory, and streamed their codes took 1.06-1.29x the time
  // of plain stores on a Zen 2 and a Zen 3; fp32 int4's, reading twice the bytes a code, 0.97-1.07
  // (bench/RESULTS.md, 2026-12-07).
  template <class T>
  static constexpr bool stream_groups = sizeof(T) == 4;

  // Eight blocks' absmax_bits at once, lane j block a[j]'s (what is left of it, none or all):
  // each block's maximum vector, folded to 32-bit lanes, then the eight reduced together, each
  // step halving their number and pairing up lanes (32-bit, 64-bit, then 128-bit), which leaves
  // block j's maximum in lane j.
  template <class T>
  [[ZP_TARGET_AVX2]] static __m256i absmax_bits_group(const T* x, const Ahead* a) {
    __m256i v[8];
    for (std::size_t j = 0; j < 8; ++j) {
      __m256i top = a[j].top;
      for (std::size_t i = a[j].lo; i < a[j].hi; i += 32 / sizeof(T)) top = fold(x + i, top);
      if constexpr (sizeof(T) == 2)  // each 32-bit lane's larger half, in its low half
        top = _mm256_and_si256(_mm256_max_epu16(top, _mm256_srli_epi32(top, 16)),
                               _mm256_set1_epi32(0xffff));
      v[j] = top;
    }
    for (std::size_t j = 0; j < 4; ++j)
      v[j] = _mm256_max_epu32(_mm256_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                              _mm256_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
    for (std::size_t j = 0; j < 2; ++j)
      v[j] = _mm256_max_epu32(_mm256_unpacklo_epi64(v[2 * j], v[2 * j + 1]),
                              _mm256_unpackhi_epi64(v[2 * j], v[2 * j + 1]));
    return _mm256_max_epu32(_mm256_permute2x128_si256(v[0], v[1], 0x20),
                            _mm256_permute2x128_si256(v[0], v[1], 0x31));
  }
  // Those eight blocks' scales into scales[0, 8) (QuantizeBlock's: absmax / qmax, NaN with an
  // inf or NaN).
  template <class T>
  [[ZP_TARGET_AVX2]] static void group_scales(const T* x, const Ahead* a, int qmax, float* scales) {
    const __m256i bits = absmax_bits_group(x, a);
    __m256 big;
    if constexpr (std::is_same_v<T, float>) {
      big = _mm256_castsi256_ps(bits);
    } else if constexpr (std::is_same_v<T, bf16>) {
      big = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    } else {  // lanes of at most 0x7fff: packing saturates none
      const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b10'00);
      big = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    }
    const __m256 finite = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(int(inf_bits<T>)), bits));  // bits < 2^31
    _mm256_storeu_ps(scales,
                     _mm256_blendv_ps(_mm256_set1_ps(NAN),
                                      _mm256_div_ps(big, _mm256_set1_ps(float(qmax))), finite));
  }
  // 1 / scales[j] into r[j] for the eight, if every one is finite (else false).
  [[ZP_TARGET_AVX2]] static bool reciprocals(const float* scales, float* r) {
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_loadu_ps(scales));
    if (_mm256_movemask_ps(_mm256_cmp_ps(inv, _mm256_set1_ps(INFINITY), _CMP_LT_OQ)) != 0xff)
      return false;
    _mm256_storeu_ps(r, inv);
    return true;
  }

  // 16 codes' bytes c as 8 16-bit lanes, lane j's low byte holding codes 2j and 2j + 1's nibbles.
  [[ZP_TARGET_AVX2]] static __m128i nibble_pairs(__m128i c) {
    return _mm_or_si128(_mm_and_si128(c, _mm_set1_epi16(0x000f)),
                        _mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi16(0x00f0)));
  }
  struct Coder {
    const Divisor& d;
    __m256 s, inv;
    [[ZP_TARGET_AVX2]] explicit Coder(const Divisor& d)
        : d(d), s(_mm256_set1_ps(d.scale)), inv(_mm256_set1_ps(d.inverse)) {}
    template <Bits B, class T>
    [[ZP_TARGET_AVX2]] __m128i bytes(const T* x) const {
      if constexpr (B == Bits::int8)
        return code16(x, d, s, inv);
      else if constexpr (std::is_same_v<T, bf16>)
        return low_bytes(bf16_nibble_lanes(x, d, s, inv), bf16_nibble_lanes(x + 16, d, s, inv));
      else
        return _mm_packus_epi16(nibble_pairs(code16(x, d, s, inv)),
                                nibble_pairs(code16(x + 16, d, s, inv)));
    }
    template <class T>
    [[ZP_TARGET_AVX2]] __m128i nibbles(const T* x) const {
      if constexpr (std::is_same_v<T, bf16>) {
        const __m256i n = bf16_nibble_lanes(x, d, s, inv);
        return low_bytes(n, n);
      } else {
        const __m128i n = nibble_pairs(code16(x, d, s, inv));
        return _mm_packus_epi16(n, n);
      }
    }
  };

  // Values [i, i + 8) in fp32 from the 8 codes in c's low bytes (Accumulate: plus out's).
  template <bool Accumulate, class T>
  [[ZP_TARGET_AVX2]] static V value8(__m128i c, __m256 s, const T* out, std::size_t i) {
    V v(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s));
    if constexpr (Accumulate) v = simd::load(out + i, std::type_identity<V>{}) + simd::rounded(v);
    return v;
  }

  // Values [i, i + 16) from the 16 codes c as bf16 bits, in order (Accumulate: plus out's). With
  // a finite scale and nothing to add, the even codes' products are rounded into the lower halves
  // of the 32-bit lanes and the odd codes' into the upper halves, so one blend orders them (no
  // pack and permute; bench/RESULTS.md).
  template <bool Accumulate, bool MayBeNaN>
  [[ZP_TARGET_AVX2]] static __m256i bf16_values16(__m128i c, __m256 s, const bf16* out,
                                                  std::size_t i) {
    if constexpr (MayBeNaN || Accumulate) {
      return simd::to_bf16<MayBeNaN>(value8<Accumulate>(c, s, out, i),
                                     value8<Accumulate>(_mm_srli_si128(c, 8), s, out, i + 8));
    } else {
      const __m256i w = _mm256_cvtepi8_epi16(c);
      const V even(
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16)), s)),
          odd(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(w, 16)), s));
      return _mm256_blend_epi16(simd::bf16_lanes<false>(even), simd::bf16_upper(odd), 0xaa);
    }
  }

  // A code in the top bits of a 32-bit lane converts to code x 2^Shift exactly, and its product
  // with scale x 2^-Shift (shifted<Shift>) is value8's (code x scale), rounded once the same,
  // where that is exact and normal: scale >= min_shifted<Shift> = 2^(Shift - 126), finite or inf
  // (smaller, zero, negative and NaN scales take value8's way).
  template <int Shift>
  static constexpr float shifted = 1.0f / float(1u << Shift);
  template <int Shift>
  static constexpr float min_shifted = 0x1p-126f * float(1u << Shift);

  // Values [i, i + 16) from the 16 int8 codes at `codes` as bf16 bits, in order, where s24 is
  // scale x shifted<24>. One byte shuffle puts each even code in the top byte of a 32-bit lane,
  // another each odd code. No widening and no shifts to sign-extend: 0.90 of the dequantize's
  // time at block 2048 on a Zen 3 (bench/RESULTS.md).
  [[ZP_TARGET_AVX2]] static __m256i bf16_int8_values16(const std::uint8_t* codes, __m256 s24) {
    const __m256i b =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m256i even = _mm256_shuffle_epi8(
                      b, _mm256_setr_epi8(-1, -1, -1, 0, -1, -1, -1, 2, -1, -1, -1, 4, -1, -1, -1,
                                          6, -1, -1, -1, 8, -1, -1, -1, 10, -1, -1, -1, 12, -1, -1,
                                          -1, 14)),
                  odd = _mm256_shuffle_epi8(
                      b, _mm256_setr_epi8(-1, -1, -1, 1, -1, -1, -1, 3, -1, -1, -1, 5, -1, -1, -1,
                                          7, -1, -1, -1, 9, -1, -1, -1, 11, -1, -1, -1, 13, -1, -1,
                                          -1, 15));
    const V e(_mm256_mul_ps(_mm256_cvtepi32_ps(even), s24)),
        o(_mm256_mul_ps(_mm256_cvtepi32_ps(odd), s24));
    return _mm256_blend_epi16(simd::bf16_lanes<false>(e), simd::bf16_upper(o), 0xaa);
  }

  // Values [at, at + 8) in fp32 from int4 code bytes b (each 128-bit lane holding the same 8
  // bytes) put by `order` in the top bytes of the 32-bit lanes (Accumulate: plus out's), where
  // s28 is scale x shifted<28>. A shift moves an even code's low nibble to the top and a mask
  // clears an odd one's low nibble: no unpacking and sign extension of nibbles into bytes
  // (codes16).
  template <bool Accumulate>
  [[ZP_TARGET_AVX2]] static V int4_value8(__m256i b, __m256i order, __m256 s28, const float* out,
                                          std::size_t at) {
    const __m256i c = _mm256_and_si256(
        _mm256_sllv_epi32(_mm256_shuffle_epi8(b, order), _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0)),
        _mm256_set1_epi32(std::int32_t(0xf0000000u)));
    V v(_mm256_mul_ps(_mm256_cvtepi32_ps(c), s28));
    if constexpr (Accumulate) v = simd::load(out + at, std::type_identity<V>{}) + simd::rounded(v);
    return v;
  }
  // Values [i, i + 16) in fp32, as two halves, from the 8 int4 code bytes at `codes`.
  template <bool Accumulate>
  [[ZP_TARGET_AVX2]] static std::pair<V, V> int4_values16(const std::uint8_t* codes, __m256 s28,
                                                          const float* out, std::size_t i) {
    std::int64_t bytes;
    std::memcpy(&bytes, codes, sizeof bytes);
    const __m256i b = _mm256_set1_epi64x(bytes);
    return {int4_value8<Accumulate>(
                b,
                _mm256_setr_epi8(-1, -1, -1, 0, -1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, 1, -1, -1,
                                 -1, 2, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 3),
                s28, out, i),
            int4_value8<Accumulate>(
                b,
                _mm256_setr_epi8(-1, -1, -1, 4, -1, -1, -1, 4, -1, -1, -1, 5, -1, -1, -1, 5, -1, -1,
                                 -1, 6, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1, 7),
                s28, out, i + 8)};
  }

  // An int4 code is one of 16, so a block's values in a 16-bit type are one of 16 too: made once
  // a block as the products of its scale with nibble_values (bitwise the loop's values), as a
  // table of their low bytes and one of their high bytes (entry k: nibble k's, in each 128-bit
  // lane) for byte shuffles.
  struct Table {
    __m256i lo, hi;
  };
  template <class T, bool MayBeNaN>
  [[ZP_TARGET_AVX2]] static Table table16(__m256 s) {
    const V a(_mm256_mul_ps(_mm256_load_ps(nibble_values), s)),
        b(_mm256_mul_ps(_mm256_load_ps(nibble_values + 8), s));
    const __m256i v = std::is_same_v<T, bf16>  // entry k in 16-bit lane k
                          ? simd::to_bf16<MayBeNaN>(a, b)
                          : _mm256_set_m128i(simd::to_fp16(b), simd::to_fp16(a));
    // Each 128-bit lane's low bytes, then its high bytes; then the 64-bit quarters as wanted.
    const __m256i split = _mm256_shuffle_epi8(
        v, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                            12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    return {_mm256_permute4x64_epi64(split, 0b10'00'10'00),
            _mm256_permute4x64_epi64(split, 0b11'01'11'01)};
  }
  // Values [i, i + 32) for each 32 codes of [lo, hi) from the table; returns where it stopped.
  // The 16 code bytes, in both 128-bit lanes, are shuffled into a nibble per byte in the order
  // that the two unpacks of the looked-up bytes want: lane 0 codes i .. i + 7 then i + 16 ..
  // i + 23, lane 1 codes i + 8 .. i + 15 then i + 24 .. i + 31.
  template <class T, bool Stream>
  [[ZP_TARGET_AVX2]] static std::size_t table_values(const std::uint8_t* codes, std::size_t lo,
                                                     std::size_t hi, const Table& t, T* out) {
    const __m256i twice = _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 8, 8, 9, 9, 10, 10, 11, 11, 4, 4,
                                           5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15);
    std::size_t i = lo;
    for (; i + 32 <= hi; i += 32) {
      const __m256i b = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(
                                                reinterpret_cast<const __m128i*>(codes + i / 2))),
                                            twice);
      // A 16-bit lane holds one code byte twice: its low nibble into the lower byte, its high
      // nibble into the upper.
      const __m256i k =
          _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16(0x000f)),
                          _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi16(0x0f00)));
      const __m256i l = _mm256_shuffle_epi8(t.lo, k), h = _mm256_shuffle_epi8(t.hi, k);
      const __m256i a = _mm256_unpacklo_epi8(l, h), z = _mm256_unpackhi_epi8(l, h);
      store_bits<Stream>(out + i, a);
      store_bits<Stream>(out + i + 16, z);
    }
    return i;
  }

  template <Bits B, class T, bool Accumulate, bool Stream, bool MayBeNaN>
  [[ZP_TARGET_AVX2]] static std::size_t values(const std::uint8_t* codes, std::size_t lo,
                                               std::size_t hi, float scale, T* out) {
    const __m256 s = _mm256_set1_ps(scale);
    std::size_t i = lo;
    if constexpr (B == Bits::int4 && sizeof(T) == 2 && !Accumulate)
      if (hi - lo >= 32) i = table_values<T, Stream>(codes, lo, hi, table16<T, MayBeNaN>(s), out);
    if constexpr (B == Bits::int8 && std::is_same_v<T, bf16> && !Accumulate && !MayBeNaN)
      if (scale >= min_shifted<24>)
        for (const __m256 s24 = _mm256_set1_ps(scale * shifted<24>); i + 16 <= hi; i += 16)
          store_bits<Stream>(out + i, bf16_int8_values16(codes + i, s24));
    if constexpr (B == Bits::int4 && std::is_same_v<T, float> && !MayBeNaN)
      if (scale >= min_shifted<28>)
        for (const __m256 s28 = _mm256_set1_ps(scale * shifted<28>); i + 16 <= hi; i += 16) {
          const auto [a, b] = int4_values16<Accumulate>(codes + i / 2, s28, out, i);
          store_bits<Stream>(out + i, _mm256_castps_si256(a.v));
          store_bits<Stream>(out + i + 8, _mm256_castps_si256(b.v));
        }
    for (; i + 16 <= hi; i += 16) {
      const __m128i c = codes16<B>(codes, i);
      if constexpr (std::is_same_v<T, bf16>) {
        store_bits<Stream>(out + i, bf16_values16<Accumulate, MayBeNaN>(c, s, out, i));
      } else {
        const V a = value8<Accumulate>(c, s, out, i),
                b = value8<Accumulate>(_mm_srli_si128(c, 8), s, out, i + 8);
        if constexpr (std::is_same_v<T, float>) {
          store_bits<Stream>(out + i, _mm256_castps_si256(a.v));
          store_bits<Stream>(out + i + 8, _mm256_castps_si256(b.v));
        } else if constexpr (Stream) {
          simd::stream(out + i, a);
          simd::stream(out + i + 8, b);
        } else {
          simd::store(out + i, a);
          simd::store(out + i + 8, b);
        }
      }
    }
    return i;
  }
};

struct Avx512 {
  using V = simd::V16;

  // The next block's absmax is read as in Avx2: while a block's codes are made.
  using Ahead = Avx2::Ahead;
  [[ZP_TARGET_AVX2]] static Ahead ahead(std::size_t lo, std::size_t hi) {
    return Avx2::ahead(lo, hi);
  }
  // The largest magnitude's bits in the block `a` (x[a.lo, a.hi) and the maxima folded into
  // a.top so far): 64 bytes of x a step, then Avx2's loop on what is left.
  template <class T>
  [[ZP_TARGET_AVX512]] static std::uint32_t absmax_bits(const T* x, const Ahead& a) {
    constexpr std::size_t per = 64 / sizeof(T);
    const __m512i mask = sizeof(T) == 4 ? _mm512_set1_epi32(0x7fffffff) : _mm512_set1_epi16(0x7fff);
    __m512i top = _mm512_zextsi256_si512(a.top);
    std::size_t i = a.lo;
    for (; i + per <= a.hi; i += per) {
      const __m512i b = _mm512_and_si512(_mm512_loadu_si512(x + i), mask);
      top = sizeof(T) == 4 ? _mm512_max_epu32(top, b) : _mm512_max_epu16(top, b);
    }
    const __m256i l = _mm512_castsi512_si256(top), h = _mm512_extracti64x4_epi64(top, 1);
    return Avx2::absmax_bits(x, i, a.hi,
                             sizeof(T) == 4 ? _mm256_max_epu32(l, h) : _mm256_max_epu16(l, h));
  }

  // quantize_blocks takes small blocks sixteen at a time; a step of their absmax reads 64 bytes.
  static constexpr std::size_t group_size = 16, read_bytes = 64;
  // Groups' codes stream as the call does: plain stores were not measured on an AVX-512 CPU.
  template <class T>
  static constexpr bool stream_groups = true;

  // Sixteen blocks' absmax_bits at once, lane j block a[j]'s (what is left of it, none or all:
  // the codes of the group before fold a block in whole). Each block's maximum vector is folded
  // to 32-bit lanes, then the sixteen are reduced together: each step halves their number and
  // pairs up lanes (32-bit, 64-bit, then 128-bit twice), which leaves block j's maximum in lane j.
  template <class T>
  [[ZP_TARGET_AVX512]] static __m512i absmax_bits_group(const T* x, const Ahead* a) {
    constexpr std::size_t per = 64 / sizeof(T);
    const __m512i mask = sizeof(T) == 4 ? _mm512_set1_epi32(0x7fffffff) : _mm512_set1_epi16(0x7fff);
    __m512i v[16];
    for (std::size_t j = 0; j < 16; ++j) {
      __m512i top = _mm512_zextsi256_si512(a[j].top);
      for (std::size_t i = a[j].lo; i < a[j].hi; i += per) {
        const __m512i b = _mm512_and_si512(_mm512_loadu_si512(x + i), mask);
        top = sizeof(T) == 4 ? _mm512_max_epu32(top, b) : _mm512_max_epu16(top, b);
      }
      if constexpr (sizeof(T) == 2)  // each 32-bit lane's larger half, in its low half
        top = _mm512_and_si512(_mm512_max_epu16(top, _mm512_srli_epi32(top, 16)),
                               _mm512_set1_epi32(0xffff));
      v[j] = top;
    }
    for (std::size_t j = 0; j < 8; ++j)
      v[j] = _mm512_max_epu32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                              _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
    for (std::size_t j = 0; j < 4; ++j)
      v[j] = _mm512_max_epu32(_mm512_unpacklo_epi64(v[2 * j], v[2 * j + 1]),
                              _mm512_unpackhi_epi64(v[2 * j], v[2 * j + 1]));
    for (std::size_t j = 0; j < 2; ++j)
      v[j] = _mm512_max_epu32(_mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0x88),
                              _mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0xdd));
    return _mm512_max_epu32(_mm512_shuffle_i32x4(v[0], v[1], 0x88),
                            _mm512_shuffle_i32x4(v[0], v[1], 0xdd));
  }

  // Those sixteen blocks' scales into scales[0, 16) (QuantizeBlock's: absmax / qmax, NaN with
  // an inf or NaN).
  template <class T>
  [[ZP_TARGET_AVX512]] static void group_scales(const T* x, const Ahead* a, int qmax,
                                                float* scales) {
    const __m512i bits = absmax_bits_group(x, a);
    __m512 big;
    if constexpr (std::is_same_v<T, float>)
      big = _mm512_castsi512_ps(bits);
    else if constexpr (std::is_same_v<T, bf16>)
      big = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    else
      big = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits));
    const __mmask16 finite = _mm512_cmplt_epu32_mask(bits, _mm512_set1_epi32(int(inf_bits<T>)));
    _mm512_storeu_ps(
        scales, _mm512_mask_div_ps(_mm512_set1_ps(NAN), finite, big, _mm512_set1_ps(float(qmax))));
  }

  // 1 / scales[j] into r[j] for the sixteen, if every one is finite (else false).
  [[ZP_TARGET_AVX512]] static bool reciprocals(const float* scales, float* r) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(scales));
    if (_mm512_cmp_ps_mask(inv, _mm512_set1_ps(INFINITY), _CMP_LT_OQ) != 0xffff) return false;
    _mm512_storeu_ps(r, inv);
    return true;
  }

  // Divisor::biased of 16 values: each lane's low 16 bits are its code (two's complement).
  [[ZP_TARGET_AVX512]] static __m512i biased16(__m512 v, const Divisor& d, __m512 s, __m512 inv) {
    const __m512 magic = _mm512_set1_ps(d.magic);
    if (d.divide) {
      const __m512 q = _mm512_set1_ps(d.qmax);
      return _mm512_castps_si512(
          _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v, s), -q), q), magic));
    }
    return _mm512_castps_si512(_mm512_fmadd_ps(v, inv, magic));
  }
  template <class T>
  [[ZP_TARGET_AVX512]] static __m512i biased16(const T* x, const Divisor& d, __m512 s, __m512 inv) {
    return biased16(simd::load(x, std::type_identity<V>{}).v, d, s, inv);
  }

  struct Coder {
    const Divisor& d;
    __m512 s, inv;
    [[ZP_TARGET_AVX512]] explicit Coder(const Divisor& d)
        : d(d), s(_mm512_set1_ps(d.scale)), inv(_mm512_set1_ps(d.inverse)) {}
    template <Bits B, class T>
    [[ZP_TARGET_AVX512]] __m128i bytes(const T* x) const {
      if constexpr (B == Bits::int8) {
        return _mm512_cvtepi32_epi8(biased16(x, d, s, inv));
      } else {
        // Each 32-bit lane's low byte gets two codes' nibbles (by one ternary-logic select),
        // then 16 lanes narrow to 16 bytes.
        const __m512i nibble = _mm512_set1_epi32(0x0f);
        __m512i b;
        if constexpr (std::is_same_v<T, bf16>) {
          // A bf16 is the upper half of its fp32: each 32-bit lane of a load holds code 2j's
          // value in its lower half and 2j + 1's in its upper half, so shifting and masking
          // widen them in place, with no reordering.
          const __m512i v = _mm512_loadu_si512(x);
          const __m512i even = biased16(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), d, s, inv),
                        odd = biased16(
                            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536))), d,
                            s, inv);
          b = _mm512_ternarylogic_epi32(nibble, even, _mm512_slli_epi32(odd, 4), 0xca);
        } else {
          // The two vectors' low 16 bits, in order, then each 32-bit lane's upper code shifted
          // down.
          const __m512i low_halves =
              _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30,
                               28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
          const __m512i w = _mm512_permutex2var_epi16(biased16(x, d, s, inv), low_halves,
                                                      biased16(x + 16, d, s, inv));
          b = _mm512_ternarylogic_epi32(nibble, w, _mm512_srli_epi32(w, 12), 0xca);
        }
        return _mm512_cvtepi32_epi8(b);
      }
    }
    template <class T>
    [[ZP_TARGET_AVX512]] __m128i nibbles(const T* x) const {
      // 64-bit lane j holds codes 2j, 2j + 1: their nibbles into byte j
      const __m512i t = _mm512_and_si512(biased16(x, d, s, inv), _mm512_set1_epi32(0x0f));
      return _mm512_cvtepi64_epi8(_mm512_or_si512(t, _mm512_srli_epi64(t, 28)));
    }
  };

  // Codes i .. i + 15 in int32 lanes (int4: each byte in two lanes, shifted so that one nibble
  // is on top, and shifted back down with its sign).
  [[ZP_TARGET_AVX512]] static __m512i load_codes16(const std::uint8_t* codes, std::size_t i,
                                                   std::integral_constant<Bits, Bits::int8>) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
  }
  [[ZP_TARGET_AVX512]] static __m512i load_codes16(const std::uint8_t* codes, std::size_t i,
                                                   std::integral_constant<Bits, Bits::int4>) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
    const __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
    return _mm512_srai_epi32(_mm512_sllv_epi32(w, _mm512_set1_epi64(0x000000180000001c)), 28);
  }

  // Whether the CPU has AVX-512 BF16's conversion (two vectors of fp32 to 32 bf16, rounded to
  // nearest even, subnormal inputs flushed to zero).
  static bool has_bf16_conversion() noexcept {
    static const bool ok = __builtin_cpu_supports("avx512bf16");
    return ok;
  }

  // 32 values of a 16-bit type, as bits, at out (Stream: streamed; out 16-byte aligned).
  template <bool Stream, class T>
  [[ZP_TARGET_AVX512]] static void store32(T* out, __m512i h) {
    if constexpr (Stream) {
      simd::stream(out, _mm512_castsi512_si256(h));
      simd::stream(out + 16, _mm512_extracti64x4_epi64(h, 1));
    } else {
      _mm512_storeu_si512(out, h);
    }
  }

  // bf16 values [lo, hi) of an int8 block with a normal scale, 32 at a time through that
  // conversion: each product of a code and the scale is zero or normal, so it rounds as to_bf16
  // does. (int4 blocks look their values up: table_values.)
  template <bool Stream>
  [[ZP_TARGET_AVX512_BF16]] static std::size_t bf16_values(const std::uint8_t* codes,
                                                           std::size_t lo, std::size_t hi,
                                                           float scale, bf16* out) {
    const __m512 s = _mm512_set1_ps(scale);
    constexpr std::integral_constant<Bits, Bits::int8> bits{};
    std::size_t i = lo;
    for (; i + 32 <= hi; i += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(load_codes16(codes, i, bits)), s),
                   b = _mm512_mul_ps(_mm512_cvtepi32_ps(load_codes16(codes, i + 16, bits)), s);
      store32<Stream>(out + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
    return i;
  }

  // int4 values [lo, hi) in a 16-bit type, 32 at a time, from a table as in Avx2::table16: the
  // block's 16 values (nibble_values times its scale), twice over (word k and k + 16:
  // nibble k's), and each 32 codes one permute of those words.
  template <class T, bool Stream, bool MayBeNaN>
  [[ZP_TARGET_AVX512]] static std::size_t table_values(const std::uint8_t* codes, std::size_t lo,
                                                       std::size_t hi, __m512 s, T* out) {
    const V v(_mm512_mul_ps(_mm512_load_ps(nibble_values), s));
    __m256i sixteen;
    if constexpr (std::is_same_v<T, bf16>)
      sixteen = simd::to_bf16<MayBeNaN>(v);
    else
      sixteen = simd::to_fp16(v);
    const __m512i table = _mm512_broadcast_i64x4(sixteen);
    std::size_t i = lo;
    for (; i + 32 <= hi; i += 32) {
      // Code byte j in 32-bit lane j, and again 12 bits up: word 2j's index is its low nibble
      // (and the high nibble's lowest bit, immaterial in a table twice over), word 2j + 1's its
      // high nibble.
      const __m512i w =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i / 2)));
      store32<Stream>(
          out + i, _mm512_permutexvar_epi16(_mm512_or_si512(w, _mm512_slli_epi32(w, 12)), table));
    }
    return i;
  }

  template <Bits B, class T, bool Accumulate, bool Stream, bool MayBeNaN>
  [[ZP_TARGET_AVX512]] static std::size_t values(const std::uint8_t* codes, std::size_t lo,
                                                 std::size_t hi, float scale, T* out) {
    const __m512 s = _mm512_set1_ps(scale);
    std::size_t i = lo;
    if constexpr (B == Bits::int4 && sizeof(T) == 2 && !Accumulate) {
      if (hi - lo >= 32) i = table_values<T, Stream, MayBeNaN>(codes, lo, hi, s, out);
    } else if constexpr (std::is_same_v<T, bf16> && !MayBeNaN) {
      if (scale >= 0x1p-126f && scale < INFINITY && has_bf16_conversion())
        i = bf16_values<Stream>(codes, lo, hi, scale, out);
    }
    for (; i + 16 <= hi; i += 16) {
      V v(_mm512_mul_ps(
          _mm512_cvtepi32_ps(load_codes16(codes, i, std::integral_constant<Bits, B>{})), s));
      if constexpr (Accumulate) v = simd::load(out + i, std::type_identity<V>{}) + simd::rounded(v);
      if constexpr (std::is_same_v<T, bf16>) {
        store_bits<Stream>(out + i, simd::to_bf16<MayBeNaN>(v));
      } else if constexpr (Stream) {
        simd::stream(out + i, v);
      } else {
        simd::store(out + i, v);
      }
    }
    return i;
  }
};

// A finite block's codes, x[lo, hi) into out, by Simd's steps of 16 code bytes (16 values int8,
// 32 int4), each with as many of next's values folded into its top: the next block's read from
// memory overlaps this block's arithmetic; int4's last 16 values 8 bytes. Stream: the bytes
// streamed, whole lines at once where the codes cover them (stream_line). Returns where the
// rest of the block (under 16 values) starts.
template <class Simd, Bits B, bool Stream, class T>
std::size_t block_codes(const T* x, std::size_t lo, std::size_t hi, const Divisor& d,
                        std::uint8_t* out, typename Simd::Ahead& next) {
  constexpr std::size_t n = step_values<B>;
  const typename Simd::Coder c(d);
  const auto at = [&](std::size_t i) { return out + (B == Bits::int8 ? i : i / 2); };
  // The next block is read a 64-byte line or more at a time: 16-bit int8 steps (32 bytes) read
  // two steps' worth every other step (one prefetch a line, not two: 0.77-0.85 of the time at
  // blocks 512 and 2048 on AVX-512, 0.90-1.04 on AVX2; bench/RESULTS.md).
  constexpr std::size_t fed = n * sizeof(T) >= 64 ? n : 2 * n;
  const auto step = [&](std::size_t i) {
    if (fed == n || (i - lo) % fed == 0) Avx2::feed<fed>(x, next);
    return c.template bytes<B>(x + i);
  };
  std::size_t i = lo;
  if constexpr (Stream) {
    for (; i + n <= hi && reinterpret_cast<std::uintptr_t>(at(i)) % 64 != 0; i += n)
      store_code_bytes<true>(step(i), at(i));
    for (; i + 4 * n <= hi; i += 4 * n) {
      const __m128i a = step(i), b = step(i + n), e = step(i + 2 * n), f = step(i + 3 * n);
      stream_line(at(i), a, b, e, f);
    }
  }
  for (; i + n <= hi; i += n) store_code_bytes<Stream>(step(i), at(i));
  if constexpr (B == Bits::int4)
    if (i + 16 <= hi) {
      Avx2::feed<16>(x, next);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(at(i)), c.nibbles(x + i));
      i += 16;
    }
  return i;
}

// The codes of Simd::group_size blocks from x + lo (`block` values each, which block_codes takes
// whole) with scales[0, group_size), if every one multiplies (no zero, NaN or tiny scale; else
// false, and nothing written): one vector division for their reciprocals, and no branch per
// block. Block j's codes read next[j] for its absmax.
template <class Simd, Bits B, bool Stream, class T>
bool group_codes(const T* x, std::size_t lo, std::size_t block, int qmax, const float* scales,
                 std::uint8_t* out, typename Simd::Ahead* next) {
  float r[Simd::group_size];
  if (!Simd::reciprocals(scales, r)) return false;
  for (std::size_t j = 0; j < Simd::group_size; ++j)
    block_codes<Simd, B, Stream>(x, lo + j * block, lo + (j + 1) * block,
                                 Divisor(scales[j], r[j], qmax), out, next[j]);
  return true;
}

// QuantizeBlock over every block with Simd's loops (bitwise the same codes and scales; Stream:
// the codes with streaming stores, codes and every block's first 16-byte aligned).
template <class Simd, Bits B, bool Stream, class T>
void quantize_blocks(const T* x, std::size_t n, std::size_t block, std::uint8_t* codes,
                     float* scales) {
  constexpr int qmax = B == Bits::int8 ? 127 : 7;
  const auto scale_of = [&](std::uint32_t m) {  // QuantizeBlock's, from the absmax's bits
    T big;
    if constexpr (std::is_same_v<T, float>)
      big = zp::detail::bits_float(m);
    else
      big = T::from_bits(std::uint16_t(m));
    return m < inf_bits<T> ? float(big) / float(qmax) : NAN;
  };
  // Block [lo, hi)'s codes, with the next block's absmax read alongside where Simd does so.
  const auto write = [&](std::size_t lo, std::size_t hi, float scale, auto& next) {
    if (!(scale > 0)) {  // every x zero, or an inf or NaN
      zero_codes(codes, B, lo, hi);
      return;
    }
    const Divisor d(scale, qmax);
    write_codes(x, block_codes<Simd, B, Stream>(x, lo, hi, d, codes, next), hi, B, d, codes);
  };
  std::size_t k = 0, lo = 0;
  // Blocks of two lines or less, or of two code steps or less (fp32 int4 blocks of up to 64
  // values), Simd::group_size at a time: their scales first (the blocks stay in L1), then their
  // codes. One block alone has a serial chain (its maximum across the lanes, then its scale's two
  // divisions) that costs as much as its values. AVX-512, sixteen blocks: 0.75-0.87 of the time
  // at 16-bit block 64 and 0.76-0.90 at fp32 int4 block 64; blocks of 1 KB measured 1.1-1.5x
  // slower so (the memory idles while the codes are made), and 256-byte blocks of four steps or
  // more 0.84-1.23 (fp32 int8 block 64, 16-bit block 128; bench/RESULTS.md). A group's codes read
  // the next group's blocks for their absmax, block j alongside block j (0.80-0.91 of the time at
  // 16-bit block 64, 2026-12-05). AVX2, eight blocks, on a Zen 3: 0.77-0.88 of the time at 16-bit
  // block 64 and 0.85 at fp32 int4 block 64; fp32 int8 block 64 so measured 1.01 (2026-12-06).
  // A block must be whole absmax steps (read_bytes) and whole code steps (16 values), so that
  // absmax_bits_group and block_codes leave no rest.
  constexpr std::size_t G = Simd::group_size;
  if (block % std::max<std::size_t>(Simd::read_bytes / sizeof(T), step_values<Bits::int8>) == 0 &&
      (block * sizeof(T) <= 128 || block <= 2 * step_values<B>)) {
    // The G blocks from `from` to read for their absmax; none where x ends before the last.
    const auto group = [&](std::size_t from, typename Simd::Ahead* g) {
      for (std::size_t j = 0; j < G; ++j)
        g[j] = from + G * block <= n ? Simd::ahead(from + j * block, from + (j + 1) * block)
                                     : Simd::ahead(0, 0);
    };
    typename Simd::Ahead groups[2][G], *now = groups[0], *next = groups[1];
    constexpr bool GroupStream = Stream && Simd::template stream_groups<T>;
    group(lo, now);
    for (; n - lo >= G * block; k += G, lo += G * block, std::swap(now, next)) {
      Simd::group_scales(x, now, qmax, scales + k);
      group(lo + G * block, next);
      if (!group_codes<Simd, B, GroupStream>(x, lo, block, qmax, scales + k, codes, next))
        for (std::size_t j = 0; j < G; ++j)
          write(lo + j * block, lo + (j + 1) * block, scales[k + j], next[j]);
    }
  }
  // Each block is read twice: from memory for its absmax, then from L1 for its codes. The codes
  // loops read the next block's absmax while they make a block's codes, so that the memory does
  // not idle meanwhile (AVX2 with code16's narrowings: 0.59-0.78 of the time at block 2048 on a
  // Zen 3; AVX-512 on a Xeon: 16-bit inputs 0.60-0.98 at blocks 512 and 2048, fp32 0.80 at 512
  // and no gain at 2048, where the next block's loads bound the loop; bench/RESULTS.md,
  // 2026-12-05). feed also prefetches 8 KB past the next block's read into L2 (1-2 KB ahead
  // measured no gain, into L1 a loss on fp32; 4 and 16 KB into L2 as good).
  auto next = Simd::ahead(lo, std::min(n, lo + block));
  for (; lo < n; ++k, lo += block) {
    const std::size_t hi = std::min(n, lo + block);
    scales[k] = scale_of(Simd::absmax_bits(x, next));
    next = Simd::ahead(hi, std::min(n, hi + block));
    write(lo, hi, scales[k], next);
  }
  if constexpr (Stream) _mm_sfence();
}

// DequantizeBlock<T, Accumulate> over every block with Simd's loops (Stream: streaming stores;
// out and every block start 16-byte aligned).
template <class Simd, Bits B, class T, bool Accumulate, bool Stream>
void dequantize_blocks(const std::uint8_t* codes, const float* scales, std::size_t n,
                       std::size_t block, T* out) {
  static_assert(!(Accumulate && Stream), "an accumulator was just read: it is in the cache");
  for (std::size_t k = 0, lo = 0; lo < n; ++k, lo += block) {
    const std::size_t hi = std::min(n, lo + block);
    const float scale = scales[k];
    const std::size_t i =
        scale != scale  // a NaN scale: every value NaN
            ? Simd::template values<B, T, Accumulate, Stream, true>(codes, lo, hi, scale, out)
            : Simd::template values<B, T, Accumulate, Stream, false>(codes, lo, hi, scale, out);
    write_values<Accumulate>(codes, B, i, hi, scale, out);
  }
  if constexpr (Stream) _mm_sfence();
}

// The entry points, one per instruction set: each inlines its struct's loops into the blocks'.
template <Bits B, bool Stream, class T>
[[ZP_TARGET_AVX2, gnu::flatten]] void quantize_avx2(const T* x, std::size_t n, std::size_t block,
                                                    std::uint8_t* codes, float* scales) {
  quantize_blocks<Avx2, B, Stream>(x, n, block, codes, scales);
}
template <Bits B, bool Stream, class T>
[[ZP_TARGET_AVX512, gnu::flatten]] void quantize_avx512(const T* x, std::size_t n,
                                                        std::size_t block, std::uint8_t* codes,
                                                        float* scales) {
  quantize_blocks<Avx512, B, Stream>(x, n, block, codes, scales);
}
template <Bits B, class T, bool Accumulate, bool Stream>
[[ZP_TARGET_AVX2, gnu::flatten]] void dequantize_avx2(const std::uint8_t* codes,
                                                      const float* scales, std::size_t n,
                                                      std::size_t block, T* out) {
  dequantize_blocks<Avx2, B, T, Accumulate, Stream>(codes, scales, n, block, out);
}
template <Bits B, class T, bool Accumulate, bool Stream>
[[ZP_TARGET_AVX512, gnu::flatten]] void dequantize_avx512(const std::uint8_t* codes,
                                                          const float* scales, std::size_t n,
                                                          std::size_t block, T* out) {
  dequantize_blocks<Avx512, B, T, Accumulate, Stream>(codes, scales, n, block, out);
}

// Quantizes x (n values) on instruction set `isa` (avx2 or avx512; Stream: codes streamed).
template <bool Stream, class T>
void quantize_x86(Isa isa, const T* x, std::size_t n, const Format& f, std::uint8_t* codes,
                  float* scales) {
  const bool wide = isa == Isa::avx512, int8 = f.bits == Bits::int8;
  if (wide)
    int8 ? quantize_avx512<Bits::int8, Stream>(x, n, f.block, codes, scales)
         : quantize_avx512<Bits::int4, Stream>(x, n, f.block, codes, scales);
  else
    int8 ? quantize_avx2<Bits::int8, Stream>(x, n, f.block, codes, scales)
         : quantize_avx2<Bits::int4, Stream>(x, n, f.block, codes, scales);
}

// Dequantizes n values into out (Accumulate: adds to it) on instruction set `isa`.
template <bool Accumulate, bool Stream, class T>
void dequantize_x86(Isa isa, const Format& f, const std::uint8_t* codes, const float* scales,
                    std::size_t n, T* out) {
  const bool wide = isa == Isa::avx512, int8 = f.bits == Bits::int8;
  if (wide)
    int8 ? dequantize_avx512<Bits::int8, T, Accumulate, Stream>(codes, scales, n, f.block, out)
         : dequantize_avx512<Bits::int4, T, Accumulate, Stream>(codes, scales, n, f.block, out);
  else
    int8 ? dequantize_avx2<Bits::int8, T, Accumulate, Stream>(codes, scales, n, f.block, out)
         : dequantize_avx2<Bits::int4, T, Accumulate, Stream>(codes, scales, n, f.block, out);
}
#pragma GCC diagnostic pop
#endif  // ZP_OPTIM_X86

// Whether dequantize writes n values of T in blocks of `block` at out with streaming stores.
template <class T>
bool streams(Path p, const T* out, std::size_t n, std::size_t block) noexcept {
  return (p == Path::best || p == Path::avx2) && n * sizeof(T) >= zp::detail::stream_min_bytes &&
         reinterpret_cast<std::uintptr_t>(out) % 16 == 0 && block * sizeof(T) % 16 == 0;
}

// Whether quantize writes the codes of n values of T at `codes` with streaming stores: when the
// call reads and writes stream_min_bytes or more (by its end its first codes have left the
// cache anyway), and every block's codes start 16-byte aligned.
template <class T>
bool streams_codes(Path p, const std::uint8_t* codes, std::size_t n, const Format& f) noexcept {
  return (p == Path::best || p == Path::avx2) &&
         n * sizeof(T) + f.code_bytes(n) >= zp::detail::stream_min_bytes &&
         reinterpret_cast<std::uintptr_t>(codes) % 16 == 0 && f.code_bytes(f.block) % 16 == 0;
}

inline void check_sizes(const Format& f, std::size_t n, std::size_t code_bytes, std::size_t scales,
                        const char* what) {
  f.check();
  ZP_EXPECT(code_bytes == f.code_bytes(n) && scales == f.blocks(n), what, ": ", n,
            " values in blocks of ", f.block, " need ", f.code_bytes(n), " code bytes and ",
            f.blocks(n), " scales, got ", code_bytes, " and ", scales);
}
}  // namespace detail

// x -> codes, scales (sizes f.code_bytes(n), f.blocks(n)), on the host.
template <class T>
void quantize(std::span<const T> x, const Format& f, std::span<std::uint8_t> codes,
              std::span<float> scales, Path path = Path::best) {
  detail::check_sizes(f, x.size(), codes.size(), scales.size(), "quantize");
#if ZP_OPTIM_X86
  if (const auto isa = detail::isa(path); isa != detail::Isa::portable)
    return detail::streams_codes<T>(path, codes.data(), x.size(), f)
               ? detail::quantize_x86<true>(isa, x.data(), x.size(), f, codes.data(), scales.data())
               : detail::quantize_x86<false>(isa, x.data(), x.size(), f, codes.data(),
                                             scales.data());
#endif
  (void)path;
  const QuantizeBlock<T> item{x.data(), x.size(), f, codes.data(), scales.data()};
  for (std::size_t k = 0; k < scales.size(); ++k) item(k);
}

// codes, scales -> out (rounded to T, to nearest even), on the host.
template <class T>
void dequantize(const Format& f, std::span<const std::uint8_t> codes, std::span<const float> scales,
                std::span<T> out, Path path = Path::best) {
  detail::check_sizes(f, out.size(), codes.size(), scales.size(), "dequantize");
#if ZP_OPTIM_X86
  if (const auto isa = detail::isa(path); isa != detail::Isa::portable) {
    return detail::streams(path, out.data(), out.size(), f.block)
               ? detail::dequantize_x86<false, true>(isa, f, codes.data(), scales.data(),
                                                     out.size(), out.data())
               : detail::dequantize_x86<false, false>(isa, f, codes.data(), scales.data(),
                                                      out.size(), out.data());
  }
#endif
  (void)path;
  const DequantizeBlock<T, false> item{codes.data(), scales.data(), out.size(), f, out.data()};
  for (std::size_t k = 0; k < scales.size(); ++k) item(k);
}

// acc += dequantized codes, in fp32, on the host.
inline void dequantize_add(const Format& f, std::span<const std::uint8_t> codes,
                           std::span<const float> scales, std::span<float> acc,
                           Path path = Path::best) {
  detail::check_sizes(f, acc.size(), codes.size(), scales.size(), "dequantize_add");
#if ZP_OPTIM_X86
  if (const auto isa = detail::isa(path); isa != detail::Isa::portable)
    return detail::dequantize_x86<true, false>(isa, f, codes.data(), scales.data(), acc.size(),
                                               acc.data());
#endif
  (void)path;
  const DequantizeBlock<float, true> item{codes.data(), scales.data(), acc.size(), f, acc.data()};
  for (std::size_t k = 0; k < scales.size(); ++k) item(k);
}

}  // namespace zp::quant
