// zp/quantize.hpp: blockwise symmetric quantization to int8 or int4, the element math of ZeRO++'s
// quantized weight gathers and gradient reductions (issue #22), written once for host and device.
//
// A tensor of n values (float, bf16 or fp16) is cut into blocks of `block` values (the last one
// short). Block k has one fp32 scale, its largest |x| over qmax (127 for int8, 7 for int4), and
// each value becomes q = x * (1 / scale) rounded to the nearest integer, ties to even, so that
// |x - q * scale| <= absmax / (2 qmax) up to fp32 rounding. int8 codes take a byte each; int4
// codes two per byte, the lower nibble first (two's complement), and `block` must then be even so
// that every block starts on a byte. A block with an inf or NaN gets a NaN scale and dequantizes
// to NaN throughout: the overflow the loss scaler sees, never finite garbage.
//
//   zp::quant::Format f{.bits = zp::quant::Bits::int8, .block = 256};
//   std::vector<std::uint8_t> q(f.code_bytes(n));  std::vector<float> s(f.blocks(n));
//   zp::quant::quantize(std::span<const bf16>(x), f, std::span(q), std::span(s));
//   zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s), out);
//   zp::quant::dequantize_add(f, q, s, acc);   // acc += dequant(q): fp32 accumulation
//
// QuantizeBlock and DequantizeBlock are the work items (one block each) that a device launches
// with zp::device::launch; the host functions here run them in a loop, or, on a CPU with AVX2
// (checked at run time), the same math 8 or 16 values at a time with bitwise the same results
// (IEEE products, the conversion rounding to nearest even as rintf does; a NaN stored as fp16
// may keep another payload). Path::portable forces the loop of work items.
// dequantize writes an output of detail::stream_min_bytes or more with streaming stores (where
// it is 16-byte aligned and blocks keep that alignment): no read of each line before it is
// written, and the output not left in the caches; Path::cached keeps plain stores, for an
// output read again right away.
#pragma once

#include <math.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

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
  void check() const {
    ZP_EXPECT(block >= 1, "quantize: block size ", block, " must be at least 1");
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

// x / scale rounded to the nearest integer, ties to even (rintf in the default rounding mode),
// as x times 1 / scale: one division per block, not per value. The product is within 2^-16 of
// the quotient (|x / scale| <= qmax <= 127, two roundings of 2^-24). A scale under 2^-128,
// whose reciprocal overflows, divides; a zero scale (every x zero) multiplies by zero.
struct Divisor {
  float scale, inverse;
  bool divide;
  ZP_HOST_DEVICE explicit Divisor(float s)
      : scale(s), inverse(s == 0 ? 0.0f : 1.0f / s), divide(!(inverse < INFINITY)) {}
  ZP_HOST_DEVICE int code(float x) const { return int(::rintf(divide ? x / scale : x * inverse)); }
};

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
    const detail::Divisor d(scale);
    const auto q = [&](std::size_t i) { return i >= hi || !finite ? 0 : d.code(float(x[i])); };
    if (f.bits == Bits::int8) {
      for (std::size_t i = lo; i < hi; ++i)
        codes[i] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q(i)));
    } else {  // lo is even: the block's bytes are its own
      for (std::size_t i = lo; i < hi; i += 2)
        codes[i / 2] = std::uint8_t((q(i) & 0xf) | ((q(i + 1) & 0xf) << 4));
    }
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
    const float scale = scales[k];
    for (std::size_t i = lo; i < hi; ++i) {
      const float v = float(detail::code(codes, f.bits, i)) * scale;
      if constexpr (Accumulate)
        out[i] = T(float(out[i]) + v);
      else
        out[i] = T(v);
    }
  }
};

// Which host code runs: the best the CPU supports, the same with plain stores only (cached),
// or the portable work items.
enum class Path { best, portable, cached };

namespace detail {
#if ZP_OPTIM_X86
namespace simd = zp::optim::detail::simd;

inline bool avx2() noexcept {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
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

// QuantizeBlock, 16 values at a time (the tail of each block as the work item does it). The
// absmax pass takes the largest magnitude's bits, 32 bytes of x at a time with no conversion.
template <Bits B, class T>
[[ZP_TARGET_AVX2, gnu::flatten]] void quantize_avx2(const T* x, std::size_t n, std::size_t block,
                                                    std::uint8_t* codes, float* scales) {
  constexpr std::type_identity<simd::V8> as{};
  constexpr int qmax = B == Bits::int8 ? 127 : 7;
  constexpr std::size_t per = 32 / sizeof(T);
  const __m256i mask = sizeof(T) == 4 ? _mm256_set1_epi32(0x7fffffff) : _mm256_set1_epi16(0x7fff);
  for (std::size_t k = 0, lo = 0; lo < n; ++k, lo += block) {
    const std::size_t hi = std::min(n, lo + block);
    __m256i top = _mm256_setzero_si256();
    std::size_t i = lo;
    for (; i + per <= hi; i += per) {
      const __m256i b =
          _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mask);
      top = sizeof(T) == 4 ? _mm256_max_epu32(top, b) : _mm256_max_epu16(top, b);
    }
    std::uint32_t m = largest(top, std::type_identity<T>{});
    for (std::size_t j = i; j < hi; ++j) m = std::max(m, magnitude_bits(x[j]));
    const bool finite = m < inf_bits<T>;
    T big;
    if constexpr (std::is_same_v<T, float>)
      big = zp::detail::bits_float(m);
    else
      big = T::from_bits(std::uint16_t(m));
    const float scale = finite ? float(big) / float(qmax) : NAN;
    scales[k] = scale;
    std::uint8_t* out = codes + (B == Bits::int8 ? lo : lo / 2);
    const Divisor d(scale);
    if (!finite || scale == 0) {
      std::memset(out, 0, B == Bits::int8 ? hi - lo : (hi - lo + 1) / 2);
      continue;
    }
    const __m256 s = _mm256_set1_ps(scale), inv = _mm256_set1_ps(d.inverse);
    for (i = lo; i + 16 <= hi; i += 16) {
      const __m256 v0 = simd::load(x + i, as).v, v1 = simd::load(x + i + 8, as).v;
      const __m256i q0 = _mm256_cvtps_epi32(d.divide ? _mm256_div_ps(v0, s)
                                                     : _mm256_mul_ps(v0, inv)),
                    q1 = _mm256_cvtps_epi32(d.divide ? _mm256_div_ps(v1, s)
                                                     : _mm256_mul_ps(v1, inv));
      const __m128i c = _mm_packs_epi16(  // 16 int8 codes, in order
          _mm_packs_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1)),
          _mm_packs_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1)));
      if constexpr (B == Bits::int8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), c);
      } else {  // 16-bit lane j holds codes 2j, 2j+1: low nibble of each into one byte
        const __m128i nib =
            _mm_or_si128(_mm_and_si128(c, _mm_set1_epi16(0x000f)),
                         _mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi16(0x00f0)));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i / 2), _mm_packus_epi16(nib, nib));
      }
    }
    const auto q = [&](std::size_t j) { return j < hi ? d.code(float(x[j])) : 0; };
    for (; i < hi; i += B == Bits::int8 ? 1 : 2) {
      if constexpr (B == Bits::int8)
        codes[i] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q(i)));
      else
        codes[i / 2] = std::uint8_t((q(i) & 0xf) | ((q(i + 1) & 0xf) << 4));
    }
  }
}

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

// Values [i, i + 8) of dequantize_avx2's output in fp32, from the 8 codes in c's low bytes and
// their block's scale s (Accumulate: plus out's values).
template <class T, bool Accumulate>
[[ZP_TARGET_AVX2]] inline simd::V8 values8(__m128i c, __m256 s, const T* out, std::size_t i) {
  simd::V8 v(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s));
  if constexpr (Accumulate) v = simd::load(out + i, std::type_identity<simd::V8>{}) + v;
  return v;
}

// Values [i, i + 16) of dequantize_avx2's output from the 16 codes in c (MayBeNaN: a NaN scale,
// so NaN values; bf16 skips the quieting otherwise, and packs the 16 at once).
template <class T, bool Accumulate, bool Stream, bool MayBeNaN>
[[ZP_TARGET_AVX2]] inline void dequantize16(__m128i c, __m256 s, T* out, std::size_t i) {
  const simd::V8 a = values8<T, Accumulate>(c, s, out, i),
                 b = values8<T, Accumulate>(_mm_srli_si128(c, 8), s, out, i + 8);
  if constexpr (std::is_same_v<T, bf16>) {
    const __m256i h = simd::to_bf16<MayBeNaN>(a, b);
    if constexpr (Stream) {  // out + i: 16-byte aligned only
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(h));
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i + 8), _mm256_extracti128_si256(h, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
    }
  } else if constexpr (Stream) {
    simd::stream(out + i, a);
    simd::stream(out + i + 8, b);
  } else {
    simd::store(out + i, a);
    simd::store(out + i + 8, b);
  }
}

// Values [lo, hi) of a block, 16 at a time, then the tail as the work item does it.
template <Bits B, class T, bool Accumulate, bool Stream, bool MayBeNaN>
[[ZP_TARGET_AVX2]] inline void dequantize_block(const std::uint8_t* codes, std::size_t lo,
                                                std::size_t hi, float scale, T* out) {
  const __m256 s = _mm256_set1_ps(scale);
  std::size_t i = lo;
  for (; i + 16 <= hi; i += 16)
    dequantize16<T, Accumulate, Stream, MayBeNaN>(codes16<B>(codes, i), s, out, i);
  for (; i < hi; ++i) {
    const float v = float(code(codes, B, i)) * scale;
    if constexpr (Accumulate)
      out[i] = T(float(out[i]) + v);
    else
      out[i] = T(v);
  }
}

// DequantizeBlock<T, Accumulate>, 16 values at a time (Stream: with streaming stores; out and
// every block start 16-byte aligned).
template <Bits B, class T, bool Accumulate, bool Stream = false>
[[ZP_TARGET_AVX2, gnu::flatten]] void dequantize_avx2(const std::uint8_t* codes,
                                                      const float* scales, std::size_t n,
                                                      std::size_t block, T* out) {
  static_assert(!(Accumulate && Stream), "an accumulator was just read: it is in the cache");
  for (std::size_t k = 0, lo = 0; lo < n; ++k, lo += block) {
    const std::size_t hi = std::min(n, lo + block);
    if (scales[k] != scales[k])  // a NaN scale: every value NaN
      dequantize_block<B, T, Accumulate, Stream, true>(codes, lo, hi, scales[k], out);
    else
      dequantize_block<B, T, Accumulate, Stream, false>(codes, lo, hi, scales[k], out);
  }
  if constexpr (Stream) _mm_sfence();
}
#pragma GCC diagnostic pop
#endif  // ZP_OPTIM_X86

// Whether the AVX2 loops serve this call on this CPU.
inline bool use_avx2(Path p) noexcept {
#if ZP_OPTIM_X86
  return p != Path::portable && avx2();
#else
  (void)p;
  return false;
#endif
}

// Whether dequantize writes n values of T in blocks of `block` at out with streaming stores.
template <class T>
bool streams(Path p, const T* out, std::size_t n, std::size_t block) noexcept {
  return p == Path::best && n * sizeof(T) >= zp::detail::stream_min_bytes &&
         reinterpret_cast<std::uintptr_t>(out) % 16 == 0 && block * sizeof(T) % 16 == 0;
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
  if (detail::use_avx2(path))
    return f.bits == Bits::int8 ? detail::quantize_avx2<Bits::int8>(x.data(), x.size(), f.block,
                                                                    codes.data(), scales.data())
                                : detail::quantize_avx2<Bits::int4>(x.data(), x.size(), f.block,
                                                                    codes.data(), scales.data());
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
  if (detail::use_avx2(path)) {
    const auto run = [&]<bool Stream>(std::bool_constant<Stream>) {
      return f.bits == Bits::int8
                 ? detail::dequantize_avx2<Bits::int8, T, false, Stream>(
                       codes.data(), scales.data(), out.size(), f.block, out.data())
                 : detail::dequantize_avx2<Bits::int4, T, false, Stream>(
                       codes.data(), scales.data(), out.size(), f.block, out.data());
    };
    return detail::streams(path, out.data(), out.size(), f.block) ? run(std::true_type{})
                                                                  : run(std::false_type{});
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
  if (detail::use_avx2(path))
    return f.bits == Bits::int8 ? detail::dequantize_avx2<Bits::int8, float, true>(
                                      codes.data(), scales.data(), acc.size(), f.block, acc.data())
                                : detail::dequantize_avx2<Bits::int4, float, true>(
                                      codes.data(), scales.data(), acc.size(), f.block, acc.data());
#endif
  (void)path;
  const DequantizeBlock<float, true> item{codes.data(), scales.data(), acc.size(), f, acc.data()};
  for (std::size_t k = 0; k < scales.size(); ++k) item(k);
}

}  // namespace zp::quant
