// zp/optim/cpu.hpp: the fused optimizer step and gradient statistics on the CPU (the ZeRO-Offload
// path). One pass over a shard reads master, gradient and state and writes master, state and the
// model copy: 28 bytes per parameter for fp32 AdamW, memory-bandwidth bound.
//
// The instruction set is chosen at run time from the CPU's features (AVX-512F+BW, else
// AVX2+FMA+F16C, else portable C++), never from compile flags; Options::isa forces a level (tests
// compare the levels with each other: they give bitwise identical steps). Options::threads
// splits the shard into one contiguous tile per thread.
//
// Order of a step on a rank (the engine, step_gate.hpp): grad_stats of the local gradient, one
// all_reduce (SUM) of sumsq, the non-finite count and the hyper-parameters' fingerprint, then
// either skip (overflow, or hyper-parameters that differ) or step with
// grad_mul = 1/(loss_scale*clip_coef). The statistics cannot be fused into the update: an
// inf/nan anywhere in any rank's gradients must leave every output untouched, and clipping needs
// the global norm before the first element is updated.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#include "zp/error.hpp"
#include "zp/optim/detail/simd.hpp"
#include "zp/optim/optimizer.hpp"

namespace zp::optim::cpu {

struct Options {
  int threads = 1;      // threads for this call (the calling thread is one of them)
  Isa isa = Isa::best;  // a forced level must be supported, or the call throws
};

namespace detail {
using optim::detail::Step;
using optim::detail::update;
#if ZP_OPTIM_X86
namespace simd = optim::detail::simd;
#endif

// Tiles smaller than this are not worth a thread.
inline constexpr std::size_t min_tile = std::size_t(1) << 16;

// The options checked; returns the level to run.
inline Isa resolve(const Options& o) {
  ZP_EXPECT(o.threads >= 1, "optimizer: threads must be at least 1, got ", o.threads);
  const Isa isa = o.isa;
  if (isa == Isa::best) return best_isa();
  ZP_EXPECT(isa >= Isa::best && isa <= Isa::avx512, "optimizer: instruction set Isa(",
            static_cast<int>(isa), ") is not one of best, portable, avx2, avx512 (0 to 3)");
  ZP_EXPECT(supported(isa), "optimizer: instruction set ", name(isa),
            " is not supported by this CPU");
  return isa;
}

// The tiles parallel_tiles splits n elements into for `threads` threads (at least 1).
inline std::size_t tiles(std::size_t n, int threads) {
  const std::size_t most = std::max<std::size_t>(1, (n + min_tile - 1) / min_tile);
  return std::min<std::size_t>(std::size_t(std::max(threads, 1)), most);
}

// Runs f(begin, end, k) over [0, n) split into tiles(n, threads) tiles, the k-th on a thread of
// its own, tiles aligned to 64 elements.
template <class F>
void parallel_tiles(std::size_t n, int threads, F&& f) {
  const std::size_t t = tiles(n, threads);
  if (t == 1) {
    f(std::size_t(0), n, std::size_t(0));
    return;
  }
  const std::size_t chunk = ((n + t - 1) / t + 63) / 64 * 64;
  std::vector<std::jthread> workers;
  workers.reserve(t - 1);
  for (std::size_t k = 1; k < t; ++k) {
    const std::size_t b = std::min(n, k * chunk), e = std::min(n, (k + 1) * chunk);
    workers.emplace_back([&f, b, e, k] { f(b, e, k); });
  }
  f(std::size_t(0), std::min(n, chunk), std::size_t(0));
}

template <class T, class G>
struct Buffers {
  float* master;
  const G* grad;
  float* state[2];
  T* param;
  int slots;  // state slots read and written (0 for SGD without momentum)
};

// ---- portable ----
template <class O, class T, class G>
void step_portable(const Step<O>& coeffs, const Buffers<T, G>& b, std::size_t begin,
                   std::size_t end) {
  const Step<O> c = coeffs;  // a local copy: stores through the buffers cannot alias it
  for (std::size_t i = begin; i < end; ++i) {
    float p = b.master[i];
    float s[2] = {0.0f, 0.0f};
    for (int k = 0; k < b.slots; ++k) s[k] = b.state[k][i];
    update(c, optim::detail::to_float(b.grad[i]), p, s);
    b.master[i] = p;
    for (int k = 0; k < b.slots; ++k) b.state[k][i] = s[k];
    b.param[i] = optim::detail::from_float<T>(p);
  }
}

template <class G>
double sumsq_portable(const G* g, std::size_t begin, std::size_t end) {
  double acc[4] = {0, 0, 0, 0};
  std::size_t i = begin;
  for (; i + 4 <= end; i += 4)
    for (int k = 0; k < 4; ++k) {
      const double x = optim::detail::to_float(g[i + k]);
      acc[k] += x * x;
    }
  for (; i < end; ++i) {
    const double x = optim::detail::to_float(g[i]);
    acc[0] += x * x;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

#if ZP_OPTIM_X86
// GCC 12 warns about the deliberately undefined pass-through operands inside its own AVX-512
// intrinsics once they are inlined (GCC bug 105593). Clang has no such warning.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// ---- SIMD: the same element math on vectors V (simd::V8, simd::V16) ----
template <class V, class O, class T, class G>
inline void step_block(const Step<O>& c, float* master, const G* grad, float* s0, float* s1,
                       T* param, int slots) {
  using simd::load;
  using simd::store;
  constexpr std::type_identity<V> as{};
  V p = load(master, as);
  V s[2] = {V(0.0f), V(0.0f)};
  if (slots > 0) s[0] = load(s0, as);
  if (slots > 1) s[1] = load(s1, as);
  update(c, load(grad, as), p, s);
  store(master, p);
  if (slots > 0) store(s0, s[0]);
  if (slots > 1) store(s1, s[1]);
  store(param, p);
}

template <class V, class O, class T, class G>
inline void step_simd(const Step<O>& coeffs, const Buffers<T, G>& b, std::size_t begin,
                      std::size_t end) {
  constexpr std::size_t w = V::width;
  const Step<O> c = coeffs;
  float* s0 = b.slots > 0 ? b.state[0] : nullptr;
  float* s1 = b.slots > 1 ? b.state[1] : nullptr;
  std::size_t i = begin;
  for (; i + w <= end; i += w)
    step_block<V>(c, b.master + i, b.grad + i, s0 ? s0 + i : s0, s1 ? s1 + i : s1, b.param + i,
                  b.slots);
  if (i < end) {  // the tail through the same vector code, on zero-padded copies
    const std::size_t r = end - i;
    float m[w] = {}, t0[w] = {}, t1[w] = {};
    G g[w] = {};
    T p[w] = {};
    std::memcpy(m, b.master + i, r * sizeof(float));
    std::memcpy(g, b.grad + i, r * sizeof(G));
    if (b.slots > 0) std::memcpy(t0, s0 + i, r * sizeof(float));
    if (b.slots > 1) std::memcpy(t1, s1 + i, r * sizeof(float));
    step_block<V>(c, m, g, t0, t1, p, b.slots);
    std::memcpy(b.master + i, m, r * sizeof(float));
    std::memcpy(b.param + i, p, r * sizeof(T));
    if (b.slots > 0) std::memcpy(s0 + i, t0, r * sizeof(float));
    if (b.slots > 1) std::memcpy(s1 + i, t1, r * sizeof(float));
  }
}

template <class O, class T, class G>
[[ZP_TARGET_AVX2, gnu::flatten]] void step_avx2(const Step<O>& c, const Buffers<T, G>& b,
                                                std::size_t begin, std::size_t end) {
  step_simd<simd::V8>(c, b, begin, end);
}
template <class O, class T, class G>
[[ZP_TARGET_AVX512, gnu::flatten]] void step_avx512(const Step<O>& c, const Buffers<T, G>& b,
                                                    std::size_t begin, std::size_t end) {
  step_simd<simd::V16>(c, b, begin, end);
}

template <class G>
[[ZP_TARGET_AVX2, gnu::flatten]] double sumsq_avx2(const G* g, std::size_t begin, std::size_t end) {
  constexpr std::type_identity<simd::V8> as{};
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    simd::add_squares(simd::load(g + i, as), a0, a1);
    simd::add_squares(simd::load(g + i + 8, as), a2, a3);
  }
  for (; i + 8 <= end; i += 8) simd::add_squares(simd::load(g + i, as), a0, a1);
  if (i < end) {
    G t[8] = {};
    std::memcpy(t, g + i, (end - i) * sizeof(G));
    simd::add_squares(simd::load(t, as), a2, a3);
  }
  return simd::hsum(_mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
}
template <class G>
[[ZP_TARGET_AVX512, gnu::flatten]] double sumsq_avx512(const G* g, std::size_t begin,
                                                       std::size_t end) {
  constexpr std::type_identity<simd::V16> as{};
  __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = begin;
  for (; i + 32 <= end; i += 32) {
    simd::add_squares(simd::load(g + i, as), a0, a1);
    simd::add_squares(simd::load(g + i + 16, as), a2, a3);
  }
  for (; i + 16 <= end; i += 16) simd::add_squares(simd::load(g + i, as), a0, a1);
  if (i < end) {
    G t[16] = {};
    std::memcpy(t, g + i, (end - i) * sizeof(G));
    simd::add_squares(simd::load(t, as), a2, a3);
  }
  return simd::hsum(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}
#pragma GCC diagnostic pop
#endif  // ZP_OPTIM_X86

template <class O, class T, class G>
void step_tile(Isa isa, const Step<O>& c, const Buffers<T, G>& b, std::size_t begin,
               std::size_t end) {
  switch (isa) {
#if ZP_OPTIM_X86
    case Isa::avx512: step_avx512<O, T, G>(c, b, begin, end); return;
    case Isa::avx2: step_avx2<O, T, G>(c, b, begin, end); return;
#endif
    default: step_portable<O, T, G>(c, b, begin, end); return;
  }
}

template <class G>
double sumsq_tile(Isa isa, const G* g, std::size_t begin, std::size_t end) {
  switch (isa) {
#if ZP_OPTIM_X86
    case Isa::avx512: return sumsq_avx512<G>(g, begin, end);
    case Isa::avx2: return sumsq_avx2<G>(g, begin, end);
#endif
    default: return sumsq_portable<G>(g, begin, end);
  }
}

}  // namespace detail

// Squared L2 norm (accumulated in double) and finiteness of a gradient shard as stored. Reads
// the gradient once (2 or 4 bytes per element). The sum's rounding depends on the level and the
// thread count (summation order), finite does not. An inf/nan makes sumsq inf/nan and finite false.
template <class G>
GradStats grad_stats(std::span<const G> grad, const Options& options = {}) {
  const Isa isa = detail::resolve(options);
  std::vector<double> partial(detail::tiles(grad.size(), options.threads), 0.0);
  detail::parallel_tiles(grad.size(), options.threads,
                         [&](std::size_t b, std::size_t e, std::size_t k) {
                           partial[k] = detail::sumsq_tile<G>(isa, grad.data(), b, e);
                         });
  double sum = 0;
  for (double x : partial) sum += x;
  return {sum, std::isfinite(sum)};
}
template <class G>
GradStats grad_stats(std::span<G> grad, const Options& options = {}) {
  return grad_stats(std::span<const G>(grad), options);
}

// One optimizer step over a shard: master and state updated in place, param written from the
// new master. The caller has checked for overflow (grad_stats): this function does not skip.
// Throws zp::Error(invalid_argument) when the spans' sizes differ.
template <Optimizer Opt, class T, class G>
void step(const Opt& opt, const StepScalars& s, const ShardView<T, G>& shard,
          const Options& options = {}) {
  optim::detail::check_step(opt, s, shard);
  const std::size_t n = shard.master.size();
  detail::Buffers<T, G> b{shard.master.data(),
                          shard.grad.data(),
                          {nullptr, nullptr},
                          shard.param.data(),
                          optim::detail::used_slots(opt)};
  for (int k = 0; k < b.slots; ++k) b.state[k] = shard.state[std::size_t(k)].data();
  const Isa isa = detail::resolve(options);
  const auto c = optim::detail::prepare(optim::detail::for_view(opt, shard.decay), s);
  detail::parallel_tiles(n, options.threads, [&](std::size_t begin, std::size_t end, std::size_t) {
    detail::step_tile<Opt, T, G>(isa, c, b, begin, end);
  });
}

// Single-rank convenience without clipping: grad_stats, then the step only when every gradient
// value is finite. On overflow nothing is written. Returns the statistics (finite says whether
// the step was taken). A multi-rank engine calls grad_stats and step itself.
template <Optimizer Opt, class T, class G>
GradStats step_if_finite(const Opt& opt, const StepScalars& s, const ShardView<T, G>& shard,
                         const Options& options = {}) {
  const GradStats stats = grad_stats(shard.grad, options);
  if (stats.finite) step(opt, s, shard, options);
  return stats;
}

}  // namespace zp::optim::cpu
