#include "zp/dtype.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <initializer_list>
#include <cstring>

#include "zp/collective.hpp"
#include "zp/pipeline.hpp"

// Independent references: round-to-nearest-even through double arithmetic.
namespace {
double round_to(double x, int mant_bits, int min_exp, double max_finite) {
  if (std::isnan(x) || x == 0) return x;
  const double a = std::fabs(x);
  int e = std::ilogb(a);
  if (e < min_exp) e = min_exp;  // subnormals share the smallest exponent's quantum
  const double q = std::ldexp(1.0, e - mant_bits);
  double r = std::nearbyint(a / q) * q;  // default rounding mode: ties to even
  if (r > max_finite) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}
}  // namespace

TEST_CASE("fp16 round-trips every bit pattern and rounds floats to nearest even") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = zp::fp16::from_bits(std::uint16_t(b));
    const float f = float(h);
    if (std::isnan(f)) {
      CHECK(std::isnan(float(zp::fp16(f))));
      continue;
    }
    REQUIRE(zp::fp16(f).bits == b);
  }
  // every float in a sweep across the half range (including subnormals and overflow)
  std::uint32_t wrong = 0;
  for (std::uint32_t u = 0x33000000u; u < 0x47900000u; u += 97) {
    float f;
    std::memcpy(&f, &u, 4);
    for (float s : {f, -f}) {
      const double want = round_to(s, 10, -14, 65504.0 + 16.0 - 1e-9);  // >= 65520 -> inf
      wrong += double(float(zp::fp16(s))) != want;
    }
  }
  CHECK(wrong == 0);
}

TEST_CASE("bf16 round-trips every bit pattern and rounds floats to nearest even") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = zp::bf16::from_bits(std::uint16_t(b));
    const float f = float(h);
    if (std::isnan(f)) {
      CHECK(std::isnan(float(zp::bf16(f))));
      continue;
    }
    REQUIRE(zp::bf16(f).bits == b);
  }
  std::uint32_t wrong = 0;
  for (std::uint32_t u = 0x00800000u; u < 0x7f800000u; u += 4099) {
    float f;
    std::memcpy(&f, &u, 4);
    const double maxf = double(std::numeric_limits<float>::max());
    const double want = round_to(f, 7, -126, maxf);
    wrong += double(float(zp::bf16(f))) != want;
  }
  CHECK(wrong == 0);
  CHECK(std::isinf(float(zp::bf16(std::numeric_limits<float>::max()))));
}

TEST_CASE("dtype metadata") {
  CHECK(zp::size_of(zp::DType::bf16) == 2);
  CHECK(zp::size_of(zp::DType::i64) == 8);
  CHECK(std::string(zp::name(zp::dtype_of<zp::fp16>)) == "f16");
}

// An int cast into one of zp's enums (DType, ReduceOp, CollOp, Schedule) is named with its
// number wherever a message names it, and where it selects code it is an error naming it.
TEST_CASE(
    "a value outside its enum is named with its number, and an error where it would select code") {
  using zp::CollOp, zp::DType, zp::ReduceOp;
  CHECK(std::string(zp::name(DType(6))) == "DType(6)");
  CHECK(std::string(zp::name(DType(255))) == "DType(255)");
  CHECK(std::string(zp::name(ReduceOp(9))) == "ReduceOp(9)");
  CHECK(std::string(zp::name(CollOp(42))) == "CollOp(42)");
  CHECK(std::string(zp::pipeline::name(zp::pipeline::Schedule(7))) == "Schedule(7)");
  CHECK_THROWS_WITH_AS(
      zp::visit_dtype(DType(6), [](auto) { return 0; }),
      doctest::Contains("expected a DType (f32, f64, i32, i64, bf16, f16), got DType(6)"),
      zp::Error);
  zp::CommStats stats;
  CHECK_THROWS_WITH_AS((void)stats[CollOp(9)], doctest::Contains("expected a CollOp (all_reduce, "),
                       zp::Error);
  CHECK_THROWS_WITH_AS((void)stats[CollOp(9)], doctest::Contains("got CollOp(9)"), zp::Error);
}
