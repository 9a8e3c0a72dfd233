// zp_bench_quantize: blockwise quantization (zp/quantize.hpp, issue #22) on one CPU thread,
// against the memory's copy limit measured in the same benchmark.
//
// quant/<op>/<type>/<bits>[/avx2|/cached|/portable]/block:B/elems:N   op: quantize (T -> codes +
//   fp32 scales), dequantize (codes + scales -> T) or dequantize_add (acc += codes x scales, fp32
//   acc); B: 64, 512 (zp's qgZ default) and 2048 (its qwZ default).
//   Counters: GBps = bytes read + bytes written per second (codes, scales, values; for
//   dequantize_add the fp32 accumulator is read and written), copy_GBps = a streaming copy
//   (bench/membw.hpp) of as many bytes, and at least 512 MiB (out of the caches, as the row's
//   data is), on the same thread, timed in the same benchmark right before (the best of 5), and
//   copy_fraction = GBps / copy_GBps (issue #22's goal: >= 0.8); quantize rows also read_GBps =
//   reading x alone (at least 256 MiB) on the same thread (bench/membw.hpp, the best of 5) and
//   read_fraction = x's bytes per second over it; dequantize rows write_GBps = streaming stores
//   alone (at least 256 MiB, the same way) and write_fraction = y's bytes per second over it.
//   wrong = values
//   whose round trip misses the bound |x - dequant(quant(x))| <= absmax / (2 qmax) of their
//   block (any skips the benchmark with an error). Rows run the host's best path (AVX-512, else
//   AVX2, where the CPU has them; dequantize's 32M values are past
//   zp::detail::stream_min_bytes, so it streams its output); /avx2 rows force the AVX2 loops
//   (the AVX-512 loops' baseline), /portable rows the scalar work items, and /cached rows the
//   best loops with plain stores (the streaming stores' baseline; quantize streams its codes
//   here too, as it reads and writes more than stream_min_bytes).
// quant/pass/absmax/<type>[/avx2]/block:B, quant/pass/codes_from_l1/<type>/<bits>[/avx2]/block:B
//   (the AVX-512 loops; /avx2: the AVX2 ones): quantize's two kinds of work apart (quantize
//   overlaps them: it reads the next block's absmax while it makes a block's codes). absmax:
//   each block's absmax alone over the row's 32M values from memory (GBps = x's bytes per
//   second, read_fraction against read_GBps);
//   codes_from_l1: the codes over 16 KB of x, repeated for as many values (ms per 32M values,
//   with one fixed normal scale, no next block read alongside): their own work, no memory.
//   quant/pass/values_from_l1/<type>/<bits>[/avx2]/block:B: dequantize's the same way, 16 KB
//   of output (plain stores, in L1) from its codes, repeated for 32M values.
// quant/pieces/<op>/<type>/int8/block:B/piece:P/elems:N  the cost of a call: the same N values
//   (in the caches, as a bucket's pieces are when the engine packs them) as N / P calls of P
//   values each (a qgZ piece per peer, a small module's gather) against one call of N.
//   The time is the pieces' (the best of 5 passes); counters: pieces_vs_whole = that over the
//   whole call's (1: a call costs nothing more than its values), us_per_piece.
// membw/copy/threads:1  the copy limit on its own (256 MiB).
#include <benchmark/benchmark.h>

#include <zp/dtype.hpp>
#include <zp/memory.hpp>
#include <zp/quantize.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "membw.hpp"

namespace {

using zp::quant::Bits;
using zp::quant::Format;

enum class Op { quantize, dequantize, dequantize_add };
const char* op_name(Op op) {
  return op == Op::quantize ? "quantize" : op == Op::dequantize ? "dequantize" : "dequantize_add";
}

// A row's data: n normal values x, their codes and scales (quantized on `path`), x's round trip
// y, and an fp32 accumulator; in zp's host buffers (page-aligned from 1 MiB, as the engine's are,
// where glibc's large allocations start 16 bytes past a page).
template <class T>
using Buffer = std::vector<T, zp::HostAllocator<T>>;
template <class T>
struct Data {
  Format f;
  Buffer<T> x, y;
  Buffer<std::uint8_t> codes;
  Buffer<float> scales, acc;

  Data(const Format& format, std::size_t n, std::uint64_t seed, zp::quant::Path path)
      : f(format), x(n), y(n), codes(f.code_bytes(n)), scales(f.blocks(n)), acc(n, 0.0f) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : x) v = T(normal(rng));
    run(Op::quantize, 0, n, path);
    run(Op::dequantize, 0, n, path);
  }
  // op on values [b, b + m) (b a whole number of blocks; for int4 an even one).
  void run(Op op, std::size_t b, std::size_t m, zp::quant::Path path) {
    const std::size_t cb = f.code_bytes(b), k = b / f.block;
    const auto c = std::span(codes).subspan(cb, f.code_bytes(m));
    const auto s = std::span(scales).subspan(k, f.blocks(m));
    switch (op) {
      case Op::quantize:
        zp::quant::quantize(std::span<const T>(x).subspan(b, m), f, c, s, path);
        break;
      case Op::dequantize:
        zp::quant::dequantize(f, std::span<const std::uint8_t>(c), std::span<const float>(s),
                              std::span(y).subspan(b, m), path);
        break;
      case Op::dequantize_add:
        zp::quant::dequantize_add(f, std::span<const std::uint8_t>(c), std::span<const float>(s),
                                  std::span(acc).subspan(b, m), path);
        break;
    }
  }
};

template <class T>
void bench(benchmark::State& state, Op op, Bits bits, std::size_t block, std::size_t n,
           zp::quant::Path path) {
  Data<T> d({.bits = bits, .block = block}, n, n * 31 + block, path);
  const auto &x = d.x, &y = d.y;
  // The check: every value within its block's bound (an independent loop over the blocks).
  const double qmax = bits == Bits::int8 ? 127 : 7;
  std::uint64_t wrong = 0;
  for (std::size_t b = 0; b < n; b += block) {
    const std::size_t e = std::min(n, b + block);
    double absmax = 0;
    for (std::size_t i = b; i < e; ++i) absmax = std::max(absmax, std::fabs(double(float(x[i]))));
    // fp32 rounding (a few ulps of absmax), and a 16-bit output's own rounding.
    const double tol = absmax / (2 * qmax) + absmax * 0x1p-21 + (sizeof(T) == 2 ? absmax / 128 : 0);
    for (std::size_t i = b; i < e; ++i)
      wrong += !(std::fabs(double(float(y[i])) - double(float(x[i]))) <= tol);
  }
  if (wrong) {
    state.SkipWithError((std::to_string(wrong) + " values outside their block's bound").c_str());
    return;
  }
  const std::size_t coded = d.codes.size() + d.scales.size() * sizeof(float);
  const std::size_t bytes = op == Op::quantize     ? n * sizeof(T) + coded
                            : op == Op::dequantize ? coded + n * sizeof(T)
                                                   : coded + 2 * n * sizeof(float);
  const double limit = zp::bench::copy_gbps(bytes);
  const double read_limit = op == Op::quantize ? zp::bench::read_gbps(n * sizeof(T)) : 0;
  const double write_limit = op == Op::dequantize ? zp::bench::write_gbps(n * sizeof(T)) : 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    d.run(op, 0, n, path);
    benchmark::ClobberMemory();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double gb = double(bytes) * double(state.iterations()) * 1e-9;
  state.counters["GBps"] = benchmark::Counter(gb, benchmark::Counter::kIsRate);
  state.counters["copy_GBps"] = limit;
  state.counters["copy_fraction"] = gb / seconds / limit;
  if (op == Op::quantize) {  // it reads 4 or 2 bytes of x for each code byte it writes
    state.counters["read_GBps"] = read_limit;
    state.counters["read_fraction"] =
        double(n * sizeof(T)) * double(state.iterations()) * 1e-9 / seconds / read_limit;
  }
  if (op == Op::dequantize) {  // it writes 4 or 2 bytes of y for each code byte it reads
    state.counters["write_GBps"] = write_limit;
    state.counters["write_fraction"] =
        double(n * sizeof(T)) * double(state.iterations()) * 1e-9 / seconds / write_limit;
  }
  state.counters["wrong"] = double(wrong);
}

#if ZP_OPTIM_X86
namespace qd = zp::quant::detail;

// The passes' loops on Simd's instruction set, entered through a function of its target.
template <class Simd, class T>
std::uint32_t absmax_blocks(const T* x, std::size_t n, std::size_t block) {
  std::uint32_t m = 0;
  for (std::size_t lo = 0; lo < n; lo += block)
    m = std::max(m, Simd::absmax_bits(x, Simd::ahead(lo, std::min(n, lo + block))));
  return m;
}
template <class Simd, Bits B, class T>
void codes_blocks(const T* x, std::size_t n, std::size_t block, std::uint8_t* codes) {
  const qd::Divisor d(0.25f, B == Bits::int8 ? 127 : 7);
  auto none = Simd::ahead(0, 0);  // no next block read alongside
  for (std::size_t lo = 0; lo < n; lo += block)
    qd::block_codes<Simd, B, false>(x, lo, std::min(n, lo + block), d, codes, none);
}
template <class T>
[[ZP_TARGET_AVX512, gnu::flatten]] std::uint32_t absmax_avx512(const T* x, std::size_t n,
                                                               std::size_t block) {
  return absmax_blocks<qd::Avx512>(x, n, block);
}
template <class T>
[[ZP_TARGET_AVX2, gnu::flatten]] std::uint32_t absmax_avx2(const T* x, std::size_t n,
                                                           std::size_t block) {
  return absmax_blocks<qd::Avx2>(x, n, block);
}
template <Bits B, class T>
[[ZP_TARGET_AVX512, gnu::flatten]] void codes_avx512(const T* x, std::size_t n, std::size_t block,
                                                     std::uint8_t* codes) {
  codes_blocks<qd::Avx512, B>(x, n, block, codes);
}
template <Bits B, class T>
[[ZP_TARGET_AVX2, gnu::flatten]] void codes_avx2(const T* x, std::size_t n, std::size_t block,
                                                 std::uint8_t* codes) {
  codes_blocks<qd::Avx2, B>(x, n, block, codes);
}

enum class Pass { absmax, codes, values };

// isa: the AVX-512 or the AVX2 loops.
template <class T>
void bench_pass(benchmark::State& state, qd::Isa isa, Pass pass, Bits bits, std::size_t block,
                std::size_t n) {
  if (!zp::optim::cpu::supported(isa)) {
    state.SkipWithError(isa == qd::Isa::avx512 ? "this CPU has no AVX-512"
                                               : "this CPU has no AVX2");
    return;
  }
  const bool wide = isa == qd::Isa::avx512, absmax = pass == Pass::absmax;
  const std::size_t l1 = 16384 / sizeof(T);  // values whose x (or y) stays in L1
  std::mt19937_64 rng(n * 37 + block);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<T> x(absmax ? n : l1), y(pass == Pass::values ? l1 : 0);
  for (auto& v : x) v = T(normal(rng));
  const Format f{.bits = bits, .block = block};
  std::vector<std::uint8_t> codes(pass == Pass::values ? f.code_bytes(l1) : x.size());
  std::vector<float> scales(f.blocks(l1));
  // The loops the call runs: best is AVX-512 where wide (supported, checked above).
  const auto path = wide ? zp::quant::Path::best : zp::quant::Path::avx2;
  if (pass == Pass::values) zp::quant::quantize(std::span<const T>(x), f, codes, scales, path);
  const double read_limit = absmax ? zp::bench::read_gbps(n * sizeof(T)) : 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (absmax) {
      benchmark::DoNotOptimize(wide ? absmax_avx512(x.data(), n, block)
                                    : absmax_avx2(x.data(), n, block));
    } else if (pass == Pass::codes) {
      const auto codes_of =
          wide ? (bits == Bits::int8 ? codes_avx512<Bits::int8, T> : codes_avx512<Bits::int4, T>)
               : (bits == Bits::int8 ? codes_avx2<Bits::int8, T> : codes_avx2<Bits::int4, T>);
      for (std::size_t r = 0; r < n / l1; ++r) codes_of(x.data(), l1, block, codes.data());
      benchmark::DoNotOptimize(codes.data());
    } else {  // 16 KB of y: under stream_min_bytes, so plain stores into L1
      for (std::size_t r = 0; r < n / l1; ++r)
        zp::quant::dequantize(f, std::span<const std::uint8_t>(codes),
                              std::span<const float>(scales), std::span(y), path);
      benchmark::DoNotOptimize(y.data());
    }
    benchmark::ClobberMemory();
  }
  if (pass == Pass::values)  // every value written, within its block's bound
    for (std::size_t i = 0; i < l1; ++i) {
      const double s = scales[i / block], tol = s / 2 + s * (bits == Bits::int8 ? 127 : 7) *
                                                            (sizeof(T) == 2 ? 0x1p-8 : 0x1p-21);
      if (!(std::fabs(double(float(y[i])) - double(float(x[i]))) <= tol)) {
        state.SkipWithError("dequantize wrote a value outside its block's bound");
        return;
      }
    }
  if (absmax) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gb = double(n * sizeof(T)) * double(state.iterations()) * 1e-9;
    state.counters["GBps"] = benchmark::Counter(gb, benchmark::Counter::kIsRate);
    state.counters["read_GBps"] = read_limit;
    state.counters["read_fraction"] = gb / seconds / read_limit;
  }
}

template <class T>
void register_passes(const char* type, std::size_t n) {
  for (qd::Isa isa : {qd::Isa::avx512, qd::Isa::avx2})
    for (std::size_t block : {std::size_t(64), std::size_t(512), std::size_t(2048)}) {
      const std::string tail = std::string(isa == qd::Isa::avx2 ? "/avx2" : "") +
                               "/block:" + std::to_string(block) + "/elems:" + std::to_string(n);
      benchmark::RegisterBenchmark(
          (std::string("quant/pass/absmax/") + type + tail).c_str(),
          [=](benchmark::State& s) { bench_pass<T>(s, isa, Pass::absmax, Bits::int8, block, n); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
      for (Pass pass : {Pass::codes, Pass::values})
        for (Bits bits : {Bits::int8, Bits::int4})
          benchmark::RegisterBenchmark(
              (std::string(pass == Pass::codes ? "quant/pass/codes_from_l1/"
                                               : "quant/pass/values_from_l1/") +
               type + (bits == Bits::int8 ? "/int8" : "/int4") + tail)
                  .c_str(),
              [=](benchmark::State& s) { bench_pass<T>(s, isa, pass, bits, block, n); })
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
    }
}
#endif

// One call's cost: op over x as pieces of `piece` values, against one call over all of x.
template <class T>
void bench_pieces(benchmark::State& state, Op op, std::size_t block, std::size_t piece,
                  std::size_t n) {
  Data<T> d({.bits = Bits::int8, .block = block}, n, n * 41 + piece, zp::quant::Path::best);
  const auto time = [&](std::size_t m) {  // the best of 5 passes over x in calls of m values
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t b = 0; b < n; b += m)
        d.run(op, b, std::min(m, n - b), zp::quant::Path::best);
      benchmark::ClobberMemory();
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  double pieces = 0, whole = 0;
  for (auto _ : state) {
    const double t = time(piece);
    state.SetIterationTime(t);
    pieces += t;
    whole += time(n);
  }
  state.counters["pieces_vs_whole"] = pieces / whole;
  state.counters["us_per_piece"] =
      pieces / double(state.iterations()) / double((n + piece - 1) / piece) * 1e6;
}

template <class T>
void register_pieces(const char* type, Op op, std::size_t block) {
  constexpr std::size_t piece = 4096, n = std::size_t(1) << 18;  // 64 pieces, inside L3
  benchmark::RegisterBenchmark(
      (std::string("quant/pieces/") + op_name(op) + "/" + type + "/int8/block:" +
       std::to_string(block) + "/piece:" + std::to_string(piece) + "/elems:" + std::to_string(n))
          .c_str(),
      [=](benchmark::State& s) { bench_pieces<T>(s, op, block, piece, n); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

template <class T>
void register_type(const char* type) {
  constexpr std::size_t n = std::size_t(1) << 25;  // 32M values: 64 MB or more, out of the caches
  for (Op op : {Op::quantize, Op::dequantize, Op::dequantize_add})
    for (Bits bits : {Bits::int8, Bits::int4})
      for (auto path : {zp::quant::Path::best, zp::quant::Path::avx2, zp::quant::Path::cached,
                        zp::quant::Path::portable})
        for (std::size_t block : {std::size_t(64), std::size_t(512), std::size_t(2048)}) {
          if (op == Op::dequantize_add && !std::is_same_v<T, float>) continue;  // fp32 acc only
          if (path == zp::quant::Path::cached && op == Op::dequantize_add) continue;  // = best
          const std::string name = std::string("quant/") + op_name(op) + "/" + type + "/" +
                                   (bits == Bits::int8 ? "int8" : "int4") +
                                   (path == zp::quant::Path::portable ? "/portable"
                                    : path == zp::quant::Path::cached ? "/cached"
                                    : path == zp::quant::Path::avx2   ? "/avx2"
                                                                      : "") +
                                   "/block:" + std::to_string(block) +
                                   "/elems:" + std::to_string(n);
          benchmark::RegisterBenchmark(
              name.c_str(), [=](benchmark::State& s) { bench<T>(s, op, bits, block, n, path); })
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
        }
#if ZP_OPTIM_X86
  register_passes<T>(type, n);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  zp::bench::register_membw_copy(std::size_t(256) << 20, {1});
  register_type<float>("f32");
  register_type<zp::bf16>("bf16");
  register_type<zp::fp16>("f16");
  // qgZ's calls (gradients packed, summed in fp32, the sums packed) and qwZ's (weights unpacked).
  register_pieces<zp::bf16>("bf16", Op::quantize, 512);
  register_pieces<float>("f32", Op::dequantize_add, 512);
  register_pieces<float>("f32", Op::quantize, 512);
  register_pieces<zp::bf16>("bf16", Op::dequantize, 2048);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
