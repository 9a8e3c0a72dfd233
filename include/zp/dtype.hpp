// zp/dtype.hpp: element types zp moves and reduces, including its own 16-bit floats.
//
// zp::bf16 and zp::fp16 are plain 16-bit storage types, bit-compatible with CUDA's
// __nv_bfloat16 and __half (so device buffers can be reinterpreted either way). Arithmetic is
// done in float; conversion from float rounds to nearest even and keeps NaN a NaN.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zp/config.hpp"
#include "zp/error.hpp"

namespace zp {

namespace detail {
ZP_HOST_DEVICE inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
ZP_HOST_DEVICE inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// "Type(k)" for every value k of a one-byte enum: what name() returns for a value outside the
// enum (an int cast into it), so that every message naming it shows the number, not a "?".
struct EnumValueNames {
  char text[256][16] = {};
  constexpr explicit EnumValueNames(const char* type) {
    for (int k = 0; k < 256; ++k) {
      char* p = text[k];
      for (const char* c = type; *c; ++c) *p++ = *c;
      *p++ = '(';
      if (k >= 100) *p++ = char('0' + k / 100);
      if (k >= 10) *p++ = char('0' + k / 10 % 10);
      *p++ = char('0' + k % 10);
      *p = ')';
    }
  }
  constexpr const char* operator[](std::uint8_t k) const { return text[k]; }
};
inline constexpr EnumValueNames dtype_values{"DType"};
}  // namespace detail

// bfloat16: 1 sign, 8 exponent, 7 mantissa bits; the top half of an IEEE float.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  ZP_HOST_DEVICE explicit bf16(float f) : bits(from_float(f)) {}
  ZP_HOST_DEVICE explicit operator float() const {
    return detail::bits_float(std::uint32_t(bits) << 16);
  }

  ZP_HOST_DEVICE static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 h{};
    h.bits = b;
    return h;
  }
  ZP_HOST_DEVICE static std::uint16_t from_float(float f) {
    std::uint32_t u = detail::float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x0040u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return std::uint16_t(u >> 16);
  }
  ZP_HOST_DEVICE friend bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

// IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits, with subnormals.
struct fp16 {
  std::uint16_t bits;

  fp16() = default;
  ZP_HOST_DEVICE explicit fp16(float f) : bits(from_float(f)) {}
  ZP_HOST_DEVICE explicit operator float() const { return to_float(bits); }

  ZP_HOST_DEVICE static constexpr fp16 from_bits(std::uint16_t b) {
    fp16 h{};
    h.bits = b;
    return h;
  }
  ZP_HOST_DEVICE static std::uint16_t from_float(float f) {
    std::uint32_t u = detail::float_bits(f);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    std::uint32_t h;
    if (u >= 0x47800000u) {  // |f| >= 2^16: inf or NaN (NaN stays quiet)
      h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {  // |f| < 2^-14: half subnormal or zero
      // Adding 0.5f aligns the binary point so the float adder rounds at the half's last bit.
      const float magic = detail::bits_float(0x3f000000u);
      h = detail::float_bits(detail::bits_float(u) + magic) - 0x3f000000u;
    } else {  // normal; the carry out of the mantissa may round up to the next binade or inf
      const std::uint32_t odd = (u >> 13) & 1u;
      u += 0xc8000fffu + odd;  // rebias exponent (15 - 127) << 23, add 0.5 ulp - 1 + odd
      h = u >> 13;
    }
    return std::uint16_t(h | sign);
  }
  ZP_HOST_DEVICE static float to_float(std::uint16_t b) {
    const std::uint32_t sign = std::uint32_t(b & 0x8000u) << 16;
    const std::uint32_t exp = (b >> 10) & 0x1fu;
    const std::uint32_t mant = b & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
      const float mag = float(mant) * 5.9604644775390625e-8f;
      return detail::bits_float(detail::float_bits(mag) | sign);
    }
    if (exp == 31) return detail::bits_float(sign | 0x7f800000u | (mant << 13));
    return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
  ZP_HOST_DEVICE friend bool operator==(fp16 a, fp16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2 && sizeof(fp16) == 2);

// The element types of the untyped core. Values are stable (they enter layout hashes).
enum class DType : std::uint8_t { f32 = 0, f64 = 1, i32 = 2, i64 = 3, bf16 = 4, f16 = 5 };

template <class T>
struct dtype_traits;  // undefined for unsupported types: a clear compile error
template <>
struct dtype_traits<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_traits<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_traits<std::int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_traits<std::int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_traits<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_traits<fp16> {
  static constexpr DType value = DType::f16;
};

template <class T>
inline constexpr DType dtype_of = dtype_traits<T>::value;

template <class T>
concept Element = requires {
  dtype_traits<T>::value;
};

// Bytes per element; 0 for a value outside the enum (check_call refuses those).
constexpr std::size_t size_of(DType t) noexcept {
  switch (t) {
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
    case DType::bf16:
    case DType::f16: return 2;
  }
  return 0;
}

constexpr const char* name(DType t) noexcept {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return detail::dtype_values[std::uint8_t(t)];
}

// Calls f(T{}) with the C++ type behind a runtime DType: the bridge from the untyped core
// back to typed loops. A value outside the enum is an Errc::invalid_argument naming it.
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::i32: return f(std::int32_t{});
    case DType::i64: return f(std::int64_t{});
    case DType::bf16: return f(bf16{});
    case DType::f16: return f(fp16{});
  }
  throw Error(Errc::invalid_argument,
              detail::cat("expected a DType (f32, f64, i32, i64, bf16, f16), got ", name(t)));
}

}  // namespace zp
