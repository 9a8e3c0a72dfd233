// zp/quantize.hpp against a float64 reference: for int8 and int4, fp32/bf16/fp16 inputs, block
// sizes 2-256 and lengths 0, 1, block - 1, block + 1 and primes, every scale is the block's
// absmax / qmax, every code is in [-qmax, qmax] and within one step of x / scale (a tie of the
// float64 quotient may go either way), |x - dequant| <= absmax / (2 qmax) up to fp32 rounding,
// dequantizing into T is the fp32 value rounded to T, and dequantize_add adds exactly that fp32
// value; every code byte and scale is written (poisoned first); a block with an inf or NaN
// dequantizes to NaN and leaves the other blocks exact; bad formats and sizes are errors. qgZ's
// two-hop reduce_scatter (quantized_collectives.hpp) on several node layouts against the float64
// sum within its quantization bounds. The AVX-512 and AVX2 paths (int8, int4) against the portable
// one, bit for bit; codes under a subnormal scale rounded below absmax / qmax clamped on each.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "zp/backend/threads.hpp"
#include "zp/quantize.hpp"
#include "zp/quantized_collectives.hpp"

namespace {

using zp::quant::Bits;
using zp::quant::Format;

int code_of(const std::vector<std::uint8_t>& q, Bits bits, std::size_t i) {
  if (bits == Bits::int8) return int(static_cast<std::int8_t>(q[i]));
  const int nib = (q[i / 2] >> (4 * (i % 2))) & 0xf;
  return nib >= 8 ? nib - 16 : nib;
}

template <class T>
void check_roundtrip(const Format& f, std::size_t n, std::mt19937_64& rng) {
  CAPTURE(n);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<T> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    // Blocks of very different magnitudes (down to 1e-38, subnormal scales), a block of zeros.
    const double mag =
        (i / f.block) % 7 == 5 ? 1e-38 : std::pow(10.0, double(int((i / f.block) % 5) - 2));
    x[i] = T(float((i / f.block) % 7 == 3 ? 0.0 : normal(rng) * mag));
  }
  std::vector<std::uint8_t> q(f.code_bytes(n), 0xAA);
  std::vector<float> s(f.blocks(n), -1.0f);
  zp::quant::quantize(std::span<const T>(x), f, std::span(q), std::span(s));
  std::vector<float> back(n, std::numeric_limits<float>::quiet_NaN());
  zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s),
                        std::span(back));
  const int qmax = f.qmax();
  for (std::size_t k = 0; k < f.blocks(n); ++k) {
    double absmax = 0;
    for (std::size_t i = k * f.block; i < std::min(n, (k + 1) * f.block); ++i)
      absmax = std::max(absmax, std::fabs(double(float(x[i]))));
    CHECK(s[k] == float(absmax) / float(qmax));
    for (std::size_t i = k * f.block; i < std::min(n, (k + 1) * f.block); ++i) {
      const double xi = double(float(x[i]));
      const int c = code_of(q, f.bits, i);
      CHECK(std::abs(c) <= qmax);
      // x * (1 / scale) is within 127 x 2^-23 < 2^-16 of x / scale.
      if (s[k] > 0) CHECK(std::fabs(xi / double(s[k]) - c) <= 0.5 + 0x1p-16);
      const double err = std::fabs(xi - double(back[i]));
      // fp32 rounding of the scale and of code x scale: a few ulps of absmax.
      CHECK(err <= absmax / (2.0 * qmax) + absmax * 0x1p-21 + 1e-30);
      CHECK(back[i] == float(c) * s[k]);
    }
  }
  if (f.bits == Bits::int4 && n % 2 == 1) CHECK((q.back() >> 4) == 0);  // the unused nibble
  // Into T: the fp32 value rounded to T; added: acc + that value, in fp32.
  std::vector<T> as_t(n);
  zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s),
                        std::span(as_t));
  std::vector<float> acc(n), want(n);
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(std::memcmp(&as_t[i], &(const T&)T(back[i]), sizeof(T)) == 0);
    acc[i] = float(normal(rng));
    want[i] = acc[i] + back[i];
  }
  zp::quant::dequantize_add(f, std::span<const std::uint8_t>(q), std::span<const float>(s),
                            std::span(acc));
  CHECK((n == 0 || std::memcmp(acc.data(), want.data(), n * sizeof(float)) == 0));
}

}  // namespace

TEST_CASE_TEMPLATE("quantize -> dequantize stays within absmax / (2 qmax)", T, float, zp::bf16,
                   zp::fp16) {
  std::mt19937_64 rng(zp::test::fresh_seed());
  for (Bits bits : {Bits::int8, Bits::int4})
    for (std::size_t block : {std::size_t(2), std::size_t(64), std::size_t(256)}) {
      const Format f{.bits = bits, .block = block};
      CAPTURE(int(bits));
      CAPTURE(block);
      for (std::size_t n : {std::size_t(0), std::size_t(1), block - 1, block + 1, std::size_t(997),
                            std::size_t(1009), 7 * block + 3})
        check_roundtrip<T>(f, n, rng);
    }
}

TEST_CASE("an inf or NaN makes its block NaN and leaves the others exact") {
  for (Bits bits : {Bits::int8, Bits::int4})
    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      const Format f{.bits = bits, .block = 8};
      std::vector<float> x(24);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 5) - 2);
      x[11] = bad;  // block 1
      std::vector<std::uint8_t> q(f.code_bytes(24));
      std::vector<float> s(3, -1.0f), back(24, 1e30f);  // unwritten: caught below
      zp::quant::quantize(std::span<const float>(x), f, std::span(q), std::span(s));
      zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s),
                            std::span(back));
      CHECK(std::isnan(s[1]));
      for (std::size_t b : {0, 2})  // absmax 2 in the exact blocks
        CHECK(s[b] == doctest::Approx(2.0 / f.qmax()).epsilon(1e-6));
      for (std::size_t i = 0; i < 24; ++i) {
        CAPTURE(i);
        if (i / 8 == 1)
          CHECK(std::isnan(back[i]));
        else
          CHECK(std::fabs(back[i] - x[i]) <= 2.0f / (2.0f * float(f.qmax())) * 1.0001f);
      }
    }
}

TEST_CASE("bad formats and sizes are errors naming them") {
  std::vector<float> x(10), s(5);
  std::vector<std::uint8_t> q(10);
  zp::test::expect_invalid(
      [&] {
        zp::quant::quantize(std::span<const float>(x), {.bits = Bits::int4, .block = 3},
                            std::span(q), std::span(s));
      },
      {"block size 3 is odd"});
  zp::test::expect_invalid(
      [&] {
        zp::quant::quantize(std::span<const float>(x), {.block = 0}, std::span(q), std::span(s));
      },
      {"block size 0 must be in [1, 2^31]"});
  // A block past 2^31 would wrap the count of blocks (to 0 here, for 10 values and no scales).
  zp::test::expect_invalid(
      [&] {
        zp::quant::quantize(std::span<const float>(x), {.block = std::size_t(-1)}, std::span(q),
                            std::span<float>());
      },
      {"block size 18446744073709551615 must be in [1, 2^31]"});
  zp::test::expect_invalid(
      [&] {
        zp::quant::quantize(std::span<const float>(x), {.bits = Bits(3)}, std::span(q),
                            std::span(s));
      },
      {"bits must be int8 or int4, got 3"});
  zp::test::expect_invalid(
      [&] {
        zp::quant::quantize(std::span<const float>(x), {.block = 4}, std::span(q), std::span(s));
      },
      {"10 values in blocks of 4 need 10 code bytes and 3 scales, got 10 and 5"});
  // A record's pack and unpack check the format before sizing the record by it.
  std::vector<std::int32_t> record(8);
  for (const Format bad : {Format{.block = 0}, Format{.bits = Bits::int4, .block = 3}}) {
    const std::string what = bad.block == 0 ? "block size 0" : "block size 3 is odd";
    zp::test::expect_invalid(
        [&] { zp::quant::pack(std::span<const float>(x), bad, std::span(record)); }, {what});
    zp::test::expect_invalid(
        [&] { zp::quant::unpack(bad, std::span<const std::int32_t>(record), std::span(x)); },
        {what});
  }
  zp::test::expect_invalid(
      [&] { zp::quant::pack(std::span<const float>(x), {.block = 4}, std::span(record)); },
      {"a record of 10 values takes 6 words, got 8"});
}

namespace {

// The qgZ reduce_scatter on `ranks` thread ranks in nodes of h, each rank's pieces drawn from
// its own seed (blocks of different magnitudes, a block of zeros): against the float64 sum, each
// output within the two hops' quantization bounds; every output written. Returns rank 0's output
// (and the whole input through `all_in`).
template <class T>
std::vector<float> quantized_sum(int ranks, int h, const Format& f, std::size_t piece,
                                 std::uint64_t seed) {
  std::vector<std::vector<T>> in(std::size_t(ranks), std::vector<T>(std::size_t(ranks) * piece));
  for (int r = 0; r < ranks; ++r) {
    std::mt19937_64 rng(seed + std::uint64_t(r));
    std::normal_distribution<double> normal(0.0, 1.0);
    for (std::size_t i = 0; i < in[std::size_t(r)].size(); ++i) {
      const std::size_t b = (i % piece) / f.block;
      in[std::size_t(r)][i] =
          T(float(b % 7 == 3 ? 0.0 : normal(rng) * std::pow(10.0, double(int(b % 4) - 1))));
    }
  }
  std::vector<std::vector<float>> out(static_cast<std::size_t>(ranks));
  zp::backend::run_threads(ranks, [&](zp::Collective<zp::backend::Threads>& comm) {
    const int r = comm.rank();
    auto node = comm.split(r / h, r % h);
    auto peers = comm.split(r % h, r / h);
    auto& o = out[std::size_t(r)];
    o.assign(piece, std::numeric_limits<float>::quiet_NaN());
    zp::quant::reduce_scatter(node, peers, std::span<const T>(in[std::size_t(r)]), std::span(o), f);
  });
  // Bound: hop 1 errs by at most absmax / (2 qmax) of each sender's block; the node's partial
  // has absmax at most the sum of its senders' absmax plus their errors, and hop 2 errs by at
  // most that over 2 qmax; a few fp32 ulps on top.
  const double q2 = 2.0 * f.qmax();
  for (int me = 0; me < ranks; ++me)
    for (std::size_t k = 0; k < f.blocks(piece); ++k) {
      const std::size_t lo = k * f.block, hi = std::min(piece, lo + f.block);
      double bound = 0, total = 0;
      for (int n = 0; n < ranks / h; ++n) {
        double node_absmax = 0, node_err = 0;
        for (int j = 0; j < h; ++j) {
          double absmax = 0;
          const auto& x = in[std::size_t(n * h + j)];
          for (std::size_t i = lo; i < hi; ++i)
            absmax = std::max(absmax, std::fabs(double(float(x[std::size_t(me) * piece + i]))));
          node_absmax += absmax;
          node_err += absmax / q2;
        }
        bound += node_err + (node_absmax + node_err) / q2;
        total += node_absmax;
      }
      for (std::size_t i = lo; i < hi; ++i) {
        double exact = 0;
        for (int r = 0; r < ranks; ++r)
          exact += double(float(in[std::size_t(r)][std::size_t(me) * piece + i]));
        const double got = out[std::size_t(me)][i];
        REQUIRE(std::isfinite(got));
        REQUIRE(std::fabs(got - exact) <= bound + total * 0x1p-19);
      }
    }
  return out[0];
}

}  // namespace

TEST_CASE_TEMPLATE(
    "qgZ's two-hop quantized reduce_scatter stays within its quantization bounds of the sum", T,
    float, zp::bf16, zp::fp16) {
  const std::uint64_t seed = zp::test::fresh_seed();
  for (Bits bits : {Bits::int8, Bits::int4})
    for (auto [ranks, h] : {std::pair{4, 2}, {6, 3}, {6, 2}, {4, 1}, {4, 4}, {1, 1}})
      for (std::size_t piece :
           {std::size_t(0), std::size_t(1), std::size_t(63), std::size_t(130)}) {
        CAPTURE(int(bits));
        CAPTURE(ranks);
        CAPTURE(h);
        CAPTURE(piece);
        quantized_sum<T>(ranks, h, {.bits = bits, .block = 32}, piece, seed);
      }
}

TEST_CASE("qgZ's reduce_scatter: the same bits on every node layout's run, NaN where an inf went") {
  const std::uint64_t seed = zp::test::fresh_seed();
  const Format f{.bits = Bits::int4, .block = 16};
  // Deterministic: the same inputs give the same bits (the additions run in a fixed order).
  const auto a = quantized_sum<float>(4, 2, f, 40, seed),
             b = quantized_sum<float>(4, 2, f, 40, seed);
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  // An inf in one rank's input reaches its owner as NaN in that block only.
  std::vector<float> out;
  zp::backend::run_threads(4, [&](zp::Collective<zp::backend::Threads>& comm) {
    const int r = comm.rank();
    auto node = comm.split(r / 2, r % 2);
    auto peers = comm.split(r % 2, r / 2);
    std::vector<float> in(4 * 32, 1.0f), mine(32);
    if (r == 3) in[1 * 32 + 20] = std::numeric_limits<float>::infinity();  // rank 1's, block 1
    zp::quant::reduce_scatter(node, peers, std::span<const float>(in), std::span(mine), f);
    if (r == 1) out = mine;
  });
  for (std::size_t i = 0; i < 32; ++i) {
    CAPTURE(i);
    if (i / 16 == 1)
      CHECK(std::isnan(out[i]));
    else
      CHECK(out[i] == 4.0f);
  }
  zp::test::expect_invalid(
      [&] {
        zp::backend::run_threads(2, [&](zp::Collective<zp::backend::Threads>& comm) {
          auto node = comm.split(0, comm.rank());
          auto peers = comm.split(comm.rank(), 0);
          std::vector<float> in(5), mine(2);
          zp::quant::reduce_scatter(node, peers, std::span<const float>(in), std::span(mine), f);
        });
      },
      {"5 values in for 2 ranks (1 nodes of 2) of 2 each"});
}

// The vector paths this CPU runs (Path::best is AVX-512 where the CPU has it, else AVX2).
std::vector<zp::quant::Path> vector_paths() {
  using zp::quant::Path;
  namespace d = zp::quant::detail;
  std::vector<Path> out;
  for (Path p : {Path::best, Path::avx2})
    if (d::isa(p) != d::Isa::portable && (p == Path::best || d::isa(p) != d::isa(Path::best)))
      out.push_back(p);
  if (out.empty()) MESSAGE("no AVX2 on this CPU: only the portable path runs");
  return out;
}

TEST_CASE_TEMPLATE("the AVX-512 and AVX2 paths (int8, int4) give the portable work items' bits", T,
                   float, zp::bf16, zp::fp16) {
  for (const auto vector_path : vector_paths()) {
    CAPTURE(std::string(zp::optim::cpu::name(zp::quant::detail::isa(vector_path))));
    std::mt19937_64 rng(zp::test::fresh_seed());
    std::normal_distribution<double> normal(0.0, 1.0);
    for (Bits bits : {Bits::int8, Bits::int4})
      for (std::size_t block :
           {std::size_t(2), std::size_t(8), std::size_t(14), std::size_t(16), std::size_t(32),
            std::size_t(64), std::size_t(256), std::size_t(bits == Bits::int8 ? 19 : 18)})
        for (std::size_t n : {std::size_t(0), std::size_t(7), std::size_t(64), std::size_t(1001),
                              std::size_t(2085)})
          // special: zeros, subnormal scales, an inf and a NaN among the blocks; else every
          // scale normal, so that a group of blocks in a row (sixteen on AVX-512, eight on AVX2)
          // takes the path for small blocks.
          for (bool special : {true, false}) {
            CAPTURE(int(bits));
            CAPTURE(block);
            CAPTURE(n);
            CAPTURE(special);
            const Format f{.bits = bits, .block = block};
            std::vector<T> x(n);
            std::uniform_real_distribution<double> near_scale(0.1, 10.0);
            double c = 1;  // the scale of a block of near-ties
            for (std::size_t i = 0; i < n; ++i) {
              const std::size_t b = i / block;
              if (i % block == 0) c = near_scale(rng);
              // Magnitudes from 1e-3 to 1e3, a block of zeros, a block of ties (absmax qmax, so
              // the scale is 1 and x.5 rounds to even), a block of near-ties k + 1/2 for every k
              // under a random scale (where x / scale and x * (1 / scale) round apart: both paths
              // must take the product), a block near 1e-38 (subnormal scales; zero in fp16), an
              // inf and a NaN.
              const int qmax = f.qmax();
              const double tie =
                  i % block == 0 ? double(qmax) : double(int(i % (2 * qmax)) - qmax) + 0.5;
              const double v = special && b % 6 == 1   ? 0.0
                               : special && b % 6 == 3 ? normal(rng) * 1e-38
                               : b % 6 == 2            ? tie
                               : b % 6 == 4            ? tie * c
                                            : normal(rng) * std::pow(10.0, double(int(b % 7) - 3));
              x[i] = T(float(v));
            }
            if (special && n > 600) {
              x[300] = T(std::numeric_limits<float>::infinity());
              x[500] = T(std::numeric_limits<float>::quiet_NaN());
            }
            std::vector<std::uint8_t> q[2] = {std::vector<std::uint8_t>(f.code_bytes(n), 0xAA),
                                              std::vector<std::uint8_t>(f.code_bytes(n), 0x55)};
            std::vector<float> s[2] = {std::vector<float>(f.blocks(n), -1.0f),
                                       std::vector<float>(f.blocks(n), -2.0f)};
            std::vector<T> back[2] = {std::vector<T>(n, T(-3.0f)), std::vector<T>(n, T(5.0f))};
            std::vector<float> acc[2];
            for (int k = 0; k < 2; ++k) {
              const auto path = k ? zp::quant::Path::portable : vector_path;
              zp::quant::quantize(std::span<const T>(x), f, std::span(q[k]), std::span(s[k]), path);
              zp::quant::dequantize(f, std::span<const std::uint8_t>(q[k]),
                                    std::span<const float>(s[k]), std::span(back[k]), path);
              acc[k].assign(n, 0.25f);
              zp::quant::dequantize_add(f, std::span<const std::uint8_t>(q[k]),
                                        std::span<const float>(s[k]), std::span(acc[k]), path);
            }
            CHECK(q[0] == q[1]);
            CHECK((n == 0 ||
                   std::memcmp(s[0].data(), s[1].data(), s[0].size() * sizeof(float)) == 0));
            CHECK((n == 0 || std::memcmp(acc[0].data(), acc[1].data(), n * sizeof(float)) == 0));
            for (std::size_t i = 0; i < n; ++i) {
              const float a = float(back[0][i]), b = float(back[1][i]);
              if (std::isnan(b))
                REQUIRE(std::isnan(a));  // fp16 may keep another NaN payload
              else
                REQUIRE(std::memcmp(&back[0][i], &back[1][i], sizeof(T)) == 0);
            }
          }
  }
}

TEST_CASE("a subnormal scale rounded far below absmax / qmax clamps its codes on every path") {
  // fp32 values k x 2^-149 with |k| up to K, qmax < K < 1.5 qmax: the scale K / qmax x 2^-149
  // rounds to 2^-149, so x / scale = k, past qmax where |k| > qmax. Such codes are qmax with
  // x's sign (not wrapped, not the other path's saturation), and every path agrees.
  std::mt19937_64 rng(zp::test::fresh_seed());
  std::vector<zp::quant::Path> paths = vector_paths();
  paths.push_back(zp::quant::Path::portable);
  for (Bits bits : {Bits::int8, Bits::int4})
    for (const auto path : paths) {
      CAPTURE(int(bits));
      CAPTURE(std::string(zp::optim::cpu::name(zp::quant::detail::isa(path))));
      const Format f{.bits = bits, .block = 64};
      const int qmax = f.qmax();
      std::uniform_int_distribution<int> big(qmax + 1, qmax + qmax / 2);
      const std::size_t n = 5 * f.block + 3;
      std::vector<float> x(n);
      std::vector<int> k(n);
      for (std::size_t b = 0; b < f.blocks(n); ++b) {
        const int top = big(rng);
        std::uniform_int_distribution<int> any(-top, top);
        for (std::size_t i = b * f.block; i < std::min(n, (b + 1) * f.block); ++i)
          k[i] = i == b * f.block ? (b % 2 ? -top : top) : any(rng);
      }
      for (std::size_t i = 0; i < n; ++i) x[i] = float(std::ldexp(double(k[i]), -149));
      std::vector<std::uint8_t> q(f.code_bytes(n), 0xAA);
      std::vector<float> s(f.blocks(n), -1.0f);
      zp::quant::quantize(std::span<const float>(x), f, std::span(q), std::span(s), path);
      for (std::size_t b = 0; b < f.blocks(n); ++b) REQUIRE(s[b] == 0x1p-149f);
      for (std::size_t i = 0; i < n; ++i) {
        CAPTURE(k[i]);
        REQUIRE(code_of(q, bits, i) == std::clamp(k[i], -qmax, qmax));
      }
    }
}

// A 16-byte-aligned window of n values inside v (which holds n + 8).
template <class T>
std::span<T> aligned_window(std::vector<T>& v, std::size_t n) {
  std::size_t at = 0;
  while (reinterpret_cast<std::uintptr_t>(v.data() + at) % 16) ++at;
  return std::span<T>(v).subspan(at, n);
}

// Codes from a file or a peer need not be quantize's: int8 -128 and int4 -8 occur there, as do
// scales no quantize makes (inf, negative). Each vector path looks int4 values up in a table
// per block, whose every entry must be the portable path's value.
TEST_CASE_TEMPLATE("dequantize of any code bytes and scales gives the portable work items' bits", T,
                   float, zp::bf16, zp::fp16) {
  std::mt19937_64 rng(zp::test::fresh_seed());
  std::uniform_int_distribution<int> byte(0, 255), kind(0, 10), tiny(96, 128), nan(0, 4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // NaN scales, quiet and signalling: a value's bf16 rounding must not carry the largest
  // payloads into an inf or a zero (a corrupt record's scale can hold any bits).
  const std::uint32_t nans[] = {0x7fc00000u, 0x7fffffffu, 0xffffffffu, 0x7f800001u, 0xffbfffffu};
  for (const auto vector_path : vector_paths())
    for (Bits bits : {Bits::int8, Bits::int4})
      for (std::size_t block :
           {std::size_t(16), std::size_t(32), std::size_t(48), std::size_t(2048)})
        for (std::size_t n : {std::size_t(31), std::size_t(1000), std::size_t(5000)}) {
          CAPTURE(std::string(zp::optim::cpu::name(zp::quant::detail::isa(vector_path))));
          CAPTURE(int(bits));
          CAPTURE(block);
          CAPTURE(n);
          const Format f{.bits = bits, .block = block};
          std::vector<std::uint8_t> q(f.code_bytes(n));
          for (auto& b : q) b = std::uint8_t(byte(rng));
          std::vector<float> s(f.blocks(n));
          for (auto& v : s) {
            const int k = kind(rng);
            v = k == 0    ? 0.0f
                : k == 1  ? std::bit_cast<float>(nans[nan(rng)])  // any sign and payload
                : k == 2  ? std::numeric_limits<float>::infinity()
                : k == 3  ? std::ldexp(std::fabs(normal(rng)), -140)            // subnormal
                : k == 10 ? std::ldexp(1 + std::fabs(normal(rng)), -tiny(rng))  // AVX2's bounds
                          : normal(rng) * std::ldexp(1.0f, k - 6);              // either sign
          }
          std::vector<T> back[2] = {std::vector<T>(n, T(-3.0f)), std::vector<T>(n, T(5.0f))};
          std::vector<float> acc[2] = {std::vector<float>(n, 0.5f), std::vector<float>(n, 0.5f)};
          for (int k = 0; k < 2; ++k) {
            const auto path = k ? zp::quant::Path::portable : vector_path;
            zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s),
                                  std::span(back[k]), path);
            zp::quant::dequantize_add(f, std::span<const std::uint8_t>(q),
                                      std::span<const float>(s), std::span(acc[k]), path);
          }
          for (std::size_t i = 0; i < n; ++i) {
            CAPTURE(i);
            if (std::isnan(float(back[1][i])))
              REQUIRE(std::isnan(float(back[0][i])));  // fp16 may keep another NaN payload
            else
              REQUIRE(std::memcmp(&back[0][i], &back[1][i], sizeof(T)) == 0);
            REQUIRE(std::memcmp(&acc[0][i], &acc[1][i], sizeof(float)) == 0);
          }
        }
}

TEST_CASE_TEMPLATE("quantize's and dequantize's streaming stores write the bits plain stores do", T,
                   float, zp::bf16, zp::fp16) {
  namespace d = zp::quant::detail;
  using zp::quant::Path;
  const auto paths = vector_paths();
  if (paths.empty()) return;
  const std::uint64_t seed = zp::test::fresh_seed();
  // When: Path::best, a large enough, 16-byte-aligned output, blocks that keep the alignment.
  constexpr std::size_t big = zp::detail::stream_min_bytes / sizeof(T);
  std::vector<T> room(big + 8);
  const std::span<T> out = aligned_window(room, big);
  CHECK(d::streams(Path::best, out.data(), big, 256));
  CHECK(d::streams(Path::avx2, out.data(), big, 256));
  CHECK_FALSE(d::streams(Path::cached, out.data(), big, 256));
  CHECK_FALSE(d::streams(Path::best, out.data(), big - 1, 256));
  CHECK_FALSE(d::streams(Path::best, out.data() + 1, big - 1, 256));
  CHECK_FALSE(d::streams(Path::best, out.data(), big, 26));  // 26 x 2 bytes: blocks misaligned
  // quantize: when it reads and writes stream_min_bytes, every block's codes 16-byte aligned.
  const Format int8{.bits = Bits::int8, .block = 256}, int4{.bits = Bits::int4, .block = 256};
  std::vector<std::uint8_t> code_room(big + 16);
  const std::span<std::uint8_t> codes = aligned_window(code_room, big);
  const std::size_t least = zp::detail::stream_min_bytes / (sizeof(T) + 1) + 1,
                    least4 = 2 * zp::detail::stream_min_bytes / (2 * sizeof(T) + 1) + 1;
  CHECK(d::streams_codes<T>(Path::best, codes.data(), least, int8));
  CHECK(d::streams_codes<T>(Path::avx2, codes.data(), least, int8));
  CHECK(d::streams_codes<T>(Path::best, codes.data(), least4, int4));
  CHECK_FALSE(d::streams_codes<T>(Path::best, codes.data(), least - 2, int8));
  CHECK_FALSE(d::streams_codes<T>(Path::best, codes.data(), least4 - 4, int4));
  CHECK_FALSE(d::streams_codes<T>(Path::cached, codes.data(), least, int8));
  CHECK_FALSE(d::streams_codes<T>(Path::best, codes.data() + 1, least, int8));
  CHECK_FALSE(d::streams_codes<T>(Path::best, codes.data(), least, Format{.block = 24}));
  CHECK_FALSE(d::streams_codes<T>(Path::best, codes.data(), least4,  // 24 code bytes a block
                                  Format{.bits = Bits::int4, .block = 48}));
#if ZP_OPTIM_X86
  // The streaming loops against the portable work items, bitwise, on small outputs (a NaN block,
  // short last blocks included: 1011 ends int4 blocks of 32 or more with 16 + 3 values);
  // quantize's at each 16-byte offset in a line, so that blocks start with steps before their
  // first whole line, or have none (16 and 32 code bytes).
  for (const Path path : paths)
    for (Bits bits : {Bits::int8, Bits::int4})
      for (std::size_t block : {std::size_t(8), std::size_t(16), std::size_t(32), std::size_t(48),
                                std::size_t(64), std::size_t(256), std::size_t(352)})
        for (std::size_t n : {std::size_t(8), std::size_t(1011), std::size_t(4099)}) {
          CAPTURE(std::string(zp::optim::cpu::name(d::isa(path))));
          CAPTURE(int(bits));
          CAPTURE(block);
          CAPTURE(n);
          const Format f{.bits = bits, .block = block};
          std::vector<T> x(n), want(n);
          for (std::size_t i = 0; i < n; ++i) x[i] = T(zp::test::hash_uniform(seed, i) * 100.0f);
          if (n > 600) x[500] = T(std::numeric_limits<float>::quiet_NaN());
          std::vector<std::uint8_t> q(f.code_bytes(n));
          std::vector<float> s(f.blocks(n));
          zp::quant::quantize(std::span<const T>(x), f, std::span(q), std::span(s));
          zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s),
                                std::span(want), Path::portable);
          if (f.code_bytes(block) % 16 == 0) {  // quantize's streaming loops
            std::vector<float> s_portable(s.size(), -2.0f);
            std::vector<std::uint8_t> q_portable(q.size(), 0x55);
            zp::quant::quantize(std::span<const T>(x), f, std::span(q_portable),
                                std::span(s_portable), Path::portable);
            for (std::size_t offset = 0; offset < 64; offset += 16) {
              CAPTURE(offset);
              std::vector<std::uint8_t> q_room(q.size() + 128, 0xAA);
              std::uint8_t* line = q_room.data();
              while (reinterpret_cast<std::uintptr_t>(line) % 64) ++line;
              const std::span<std::uint8_t> q_streamed(line + offset, q.size());
              std::vector<float> s_streamed(s.size(), -1.0f);
              d::quantize_x86<true>(d::isa(path), x.data(), n, f, q_streamed.data(),
                                    s_streamed.data());
              REQUIRE(std::equal(q_streamed.begin(), q_streamed.end(), q_portable.begin()));
              REQUIRE(std::all_of(q_room.data(), q_streamed.data(),  // nothing around it
                                  [](std::uint8_t b) { return b == 0xAA; }));
              REQUIRE(std::all_of(q_streamed.data() + q.size(), q_room.data() + q_room.size(),
                                  [](std::uint8_t b) { return b == 0xAA; }));
              REQUIRE(std::memcmp(s_streamed.data(), s_portable.data(), s.size() * sizeof(float)) ==
                      0);
            }
          }
          // dequantize's at each 16-byte offset in a line too: a step's 32 bytes go in one store
          // where they are 32-byte aligned, in two where not.
          const T guard(-7.0f);
          const auto is_guard = [&](const T& v) { return std::memcmp(&v, &guard, sizeof(T)) == 0; };
          for (std::size_t offset = 0; offset < 64; offset += 16) {
            CAPTURE(offset);
            std::vector<T> room(n + 128 / sizeof(T), guard);
            T* line = room.data();
            while (reinterpret_cast<std::uintptr_t>(line) % 64) ++line;
            const std::span<T> got(line + offset / sizeof(T), n);
            d::dequantize_x86<false, true>(d::isa(path), f, q.data(), s.data(), n, got.data());
            for (std::size_t i = 0; i < n; ++i) {
              if (std::isnan(float(want[i])))
                REQUIRE(std::isnan(float(got[i])));  // fp16 may keep another NaN payload
              else
                REQUIRE(std::memcmp(&want[i], &got[i], sizeof(T)) == 0);
            }
            REQUIRE(std::all_of(room.data(), got.data(), is_guard));  // nothing around it
            REQUIRE(std::all_of(got.data() + n, room.data() + room.size(), is_guard));
          }
        }
#endif
  // And through quantize and dequantize themselves at a size where they stream: best (streamed)
  // equals cached.
  const Format f{.bits = Bits::int8, .block = 256};
  std::vector<T> x(big);
  for (std::size_t i = 0; i < big; ++i) x[i] = T(zp::test::hash_uniform(seed + 1, i));
  std::vector<std::uint8_t> q(f.code_bytes(big));
  std::vector<float> s(f.blocks(big)), s_cached(f.blocks(big), -1.0f);
  std::fill(codes.begin(), codes.end(), std::uint8_t(0xAA));
  zp::quant::quantize(std::span<const T>(x), f, codes, std::span(s));
  zp::quant::quantize(std::span<const T>(x), f, std::span(q), std::span(s_cached), Path::cached);
  CHECK(std::equal(q.begin(), q.end(), codes.begin()));
  CHECK(std::memcmp(s.data(), s_cached.data(), s.size() * sizeof(float)) == 0);
  std::vector<T> plain(big);
  zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s),
                        std::span(plain), Path::cached);
  std::fill(out.begin(), out.end(), T(-7.0f));
  zp::quant::dequantize(f, std::span<const std::uint8_t>(q), std::span<const float>(s), out);
  CHECK(std::memcmp(plain.data(), out.data(), big * sizeof(T)) == 0);
}
