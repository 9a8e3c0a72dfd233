// zp/step_gate.hpp: an optimizer step's statistics, the decision taken from them, and the
// update it gates (apply_update).
//
// Each rank sums its own gradient pieces' squared norm and non-finite count, so after one
// all_reduce every rank holds the model's. The same all_reduce checks that every rank runs the
// step with the same optimizer hyper-parameters (a rank whose lr differs would update its shard
// differently): the 32-bit fingerprint, as two 16-bit halves h, is summed with h^2, exactly in
// double; the ranks agree iff sum(h) = N h and sum(h^2) = N h^2 on every rank (the variance is
// then zero), and when they do not, every rank sees it. The statistics live where the gradients
// do, and so does the decision (StepGate: skip on overflow or differing hyper-parameters, else
// unscale and clip), so a device runs the whole step, gathers included, without the host.
//
// The all_reduce over the data-parallel group also compares, the same way in four 16-bit
// quarters, the fingerprints of the order each rank's gradient buckets became ready in
// (bucket.hpp): where they agree, the buckets launch in that order from then on. Only the
// data-parallel group shares the buckets' collectives, so the tensor and pipeline ranks' sum
// leaves these terms out.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "zp/layout.hpp"
#include "zp/memory.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/partition.hpp"
#include "zp/shard_step.hpp"

namespace zp {

namespace detail {
// Whether every one of `ranks` ranks contributed the same value h (at most 16 bits) to sums
// s[0] = sum(h), s[1] = sum(h^2), exact in double: the variance is then zero.
ZP_HOST_DEVICE inline bool same_everywhere(const double* s, double ranks, double h) {
  return s[0] == ranks * h && s[1] == ranks * h * h;
}

// Writes N doubles: the statistics' initial values, as a launch's argument rather than a copy
// from pageable host memory, which CUDA may make wait for the stream's earlier work.
template <std::size_t N>
struct Words {
  double v[N];
  ZP_HOST_DEVICE void operator()(double* s) const {
    for (std::size_t i = 0; i < N; ++i) s[i] = v[i];
  }
};

// A step's decision from its all-reduced statistics, taken where they live (Memory::invoke: host
// and device compute the same bits). s[0..6): the squared norm, the count of non-finite pieces,
// and the sums of the hyper-parameter fingerprint's halves and their squares (this rank's halves
// h0, h1); writes s[6] = grad_mul (unscale and clip) and s[7] = apply, overflow, or differ (skip,
// and the host throws). Outside any class template: nvcc takes no private member type as a
// kernel's template argument.
struct StepGate {
  static constexpr std::size_t statistics = 6;
  static constexpr double apply = 0, overflow = 1, differ = 2;
  double ranks, h0, h1;
  float unscale, max_norm;
  ZP_HOST_DEVICE void operator()(double* s) const {
    const bool same = same_everywhere(s + 2, ranks, h0) && same_everywhere(s + 4, ranks, h1);
    const bool finite = s[1] == 0 && s[0] <= 1.7976931348623157e308;  // not inf, not nan
    const float clip = finite ? optim::clip_coef(s[0], unscale, max_norm) : 1.0f;
    s[statistics] = double(optim::grad_mul(unscale, clip));
    s[statistics + 1] = !same ? differ : !finite ? overflow : apply;
  }
};
}  // namespace detail

// One step's statistics and gate in memory space S: begin(), add() every piece, all_reduce
// sums() over the data-parallel group and shared_sums() over the rest of the ranks that hold a
// part of the model, decide(), then the optimizer reads gate() where it runs and the host reads
// the outcome once (read()).
template <MemorySpace S>
class StepStatistics {
 public:
  // Doubles all-reduced per step: the bucket order's four quarters and their squares (summed over
  // the data-parallel group), then the gate's statistics (summed over every rank).
  static constexpr std::size_t order_terms = 8;
  static constexpr std::size_t count = order_terms + detail::StepGate::statistics;
  // With the gate (grad_mul, verdict) and one word for agreements after the update
  // (on_every_rank's, when the optimizer state is on NVMe).
  static constexpr std::size_t slots = count + 3;
  using Host = std::array<double, slots>;

  // fingerprint: the optimizer's hyper-parameters'; invalid: this rank's failed validation. Its
  // sum of squares is then off by one, which no set of halves matches: every rank's gate says
  // differ, and no rank updates. order: this rank's bucket order proposal's fingerprint.
  void begin(std::uint64_t fingerprint, bool invalid = false, std::uint64_t order = 0) {
    detail::Words<slots> init{};  // the squared norm and the non-finite count start at 0
    terms(order, order_, init.v);
    terms(fingerprint, hyper_, init.v + order_terms + 2);
    if (invalid) init.v[order_terms + 3] += 1;
    Memory<S>::invoke(init, buf_.data());
  }
  // Adds the squared norms and non-finite counts of `grads` (in S).
  template <class G>
  void add(std::span<const std::span<const G>> grads, const optim::cpu::Options& o) {
    ShardStep<S>::statistics(grads, buf_.data() + order_terms, o);
  }
  // Appends to `out` the parts of `piece` (segment s of L, its elements from full-layout index
  // `first`) that hold the parameters p for which counted(p) holds.
  template <class G, class Counted>
  static void select(const Layout& L, int s, std::size_t first, std::span<const G> piece,
                     Counted&& counted, std::vector<std::span<const G>>& out) {
    L.for_each_param_in(s, first, piece.size(), [&](int p, std::size_t b, std::size_t e) {
      if (counted(p)) out.push_back(piece.subspan(b - first, e - b));
    });
  }
  std::span<double> sums() { return buf_.span(0, count); }
  std::span<double> shared_sums() { return buf_.span(order_terms, count - order_terms); }
  // The gate, for `ranks` ranks in all: unscale divides the gradients, max_norm clips (0: never).
  void decide(double ranks, float unscale, float max_norm) {
    Memory<S>::invoke(detail::StepGate{ranks, hyper_[0], hyper_[1], unscale, max_norm},
                      buf_.data() + order_terms);
  }
  // The squared gradient norm, of statistics in host memory.
  static double norm2(const Host& host) noexcept { return host[order_terms]; }
  const double* gate() const noexcept { return buf_.data() + count; }  // in S
  std::span<double> word() { return buf_.span(count + 2, 1); }         // in S
  // The statistics and the gate in host memory (a device: the host waits for them).
  Host read() const {
    Host host{};
    Memory<S>::to_host(std::span<double>(host), std::span<const double>(buf_.span()));
    return host;
  }
  // Whether the `ranks` ranks of the data-parallel group all proposed this rank's bucket order.
  bool same_order(const Host& host, double ranks) const noexcept {
    for (std::size_t q = 0; q < 4; ++q)
      if (!detail::same_everywhere(host.data() + 2 * q, ranks, order_[q])) return false;
    return true;
  }

 private:
  Buffer<double, S> buf_{slots, "engine: step statistics"};
  // Splits fingerprint f into h.size() 16-bit pieces h, and writes each with its square at
  // v[2i], v[2i + 1]: the terms same_everywhere() compares once summed.
  template <std::size_t N>
  static void terms(std::uint64_t f, std::array<double, N>& h, double* v) {
    for (std::size_t i = 0; i < N; ++i) {
      h[i] = double((f >> (16 * i)) & 0xffffu);
      v[2 * i] = h[i];
      v[2 * i + 1] = h[i] * h[i];
    }
  }

  std::array<double, 2> hyper_{};  // this rank's hyper-parameter fingerprint: its low 32 bits
  std::array<double, 4> order_{};  // this rank's bucket order fingerprint
};

// Calls f(w) for each run of view v (segment s of L, its elements from full-layout index
// `first`) whose parameters agree on weight decay (decays[p] for parameter p of L; empty: all
// decay), w.decay set. Padding between parameters goes with the run before it.
template <class V, class F>
void decay_runs(const Layout& L, std::span<const char> decays, int s, std::size_t first, const V& v,
                F&& f) {
  if (decays.empty()) return f(v);
  const std::size_t n = v.grad.size();
  std::size_t begin = 0;  // the current run's first element in v
  int decay = -1;         // the current run's flag (-1: no parameter seen yet)
  auto emit = [&](std::size_t end) {
    V w = v.subview(begin, end - begin);
    w.decay = decay != 0;
    f(w);
    begin = end;
  };
  L.for_each_param_in(s, first, n, [&](int p, std::size_t b, std::size_t) {
    const int d = decays[std::size_t(p)] != 0;
    if (decay >= 0 && d != decay) emit(b - first);
    decay = d;
  });
  emit(n);
}

// The optimizer update of every segment this rank updates, as the gate says: in the memory space
// where the shard lives, or, offloaded (master weights and state in host memory), by the CPU on
// host copies of the gradient and the new T values. gate: in the memory space, or in host memory
// when offloaded. F32: the gradient from the fp32 gradient buffer. decays: decay_runs'.
template <bool F32, class P, class Opt>
void apply_update(const P& part, const Opt& opt, const optim::StepScalars& scalars,
                  const optim::cpu::Options& o, const double* gate,
                  OffloadStaging<P::memory_space>& offload, std::span<const char> decays = {}) {
  const Layout& L = part.layout();
  const int segments = L.segment_count();
  const bool swapped = part.swap() || part.param_swap();
  if (!part.offloaded() && !swapped) {
    std::vector<decltype(part.template update_view<F32>(0))> views;
    views.reserve(std::size_t(segments));
    for (int s = 0; s < segments; ++s)
      decay_runs(L, decays, s, part.updated_offset(s), part.template update_view<F32>(s),
                 [&](const auto& w) { views.push_back(w); });
    ShardStep<P::memory_space>::update(opt, scalars, std::span(std::as_const(views)), o, gate);
    return;
  }
  if (gate[1] != 0) return;
  // The host step of the view of segment s from full-layout index `first`.
  const auto step = [&](int s, std::size_t first, const auto& v) {
    decay_runs(L, decays, s, first, v, [&](const auto& w) {
      ShardStep<MemorySpace::host>::update(opt, scalars, std::span(&w, 1), o, gate);
    });
  };
  // The new T values go where the view's param is: to the device, or, offloaded or swapped,
  // straight into host memory.
  const bool param_host = part.on_host(Field::param) || part.param_swap();
  if (!swapped)
    return offload.run(
        segments, [&](int s) { return part.template update_view<F32>(s); },
        [&](int s, const auto& v) { step(s, part.updated_offset(s), v); }, param_host);
  // On NVMe: the pieces of each sub-group between the swaps' enter and leave (the optimizer
  // state's swap, the parameters', or both: they have the same sub-groups).
  const auto each = [&](auto&& f) {
    if (auto* sw = part.swap()) f(*sw);
    if (auto* sw = part.param_swap()) f(*sw);
  };
  const std::vector<SwapPiece> pieces = part.swap_pieces();
  const int n = int(pieces.size());
  try {
    each([](auto& sw) { sw.begin_step(); });
    offload.run(
        n, [&](int j) { return part.template swap_view<F32>(pieces[std::size_t(j)]); },
        [&](int j, const auto& v) {
          const std::size_t c = pieces[std::size_t(j)].sub_group;
          if (j == 0 || pieces[std::size_t(j) - 1].sub_group != c)
            each([&](auto& sw) { sw.enter(c); });
          const SwapPiece& q = pieces[std::size_t(j)];
          step(q.segment, part.updated_offset(q.segment) + q.first, v);
          if (j + 1 == n || pieces[std::size_t(j) + 1].sub_group != c)
            each([&](auto& sw) { sw.leave(c); });
        },
        param_host);
    each([](auto& sw) { sw.end_step(); });
  } catch (...) {
    each([](auto& sw) { sw.abandon(); });
    throw;
  }
}

}  // namespace zp
