// zp/optim/optimizer.hpp: the optimizers as hyper-parameter types, the buffers of one shard, and
// the per-element update math shared by the CPU path (optim/cpu.hpp) and the device step
// (optim/gpu.hpp).
//
// An optimizer is a plain value type (AdamW, Adam, Sgd, Lion); its fields may change on every
// step without recompiling anything. A step reads the gradient as stored (scaled by the loss
// scale, in fp32, bf16 or fp16), multiplies it by StepScalars::grad_mul (1 / (loss_scale * clip))
// and updates the fp32 master weights and fp32 state in place, then writes the model's copy of the
// weights in T (fp32, bf16 or fp16, rounded to nearest even).
//
// Determinism: the math below never lets a product feed an addition directly; every
// multiply-add is an explicit fma. So no compiler can contract it differently on the host, in the
// SIMD paths or on the device, and all of them give bitwise the same results (tested for the CPU
// levels). This needs IEEE division and square root (nvcc's defaults; not --use_fast_math).
//
// Validation: detail::prepare, which runs once per step on the host, calls validate(o) first, so
// a bad hyper-parameter (PyTorch's rules: lr finite and >= 0, betas in [0, 1), ...) throws
// zp::Error(invalid_argument) naming it before anything is written, whenever it changes, at no
// cost to the per-element code. describe() and fingerprint() name and hash the values, for
// messages and for comparing them across ranks.
#pragma once

#include <array>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "zp/config.hpp"
#include "zp/detail/hash.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"

namespace zp::optim {

// Decoupled weight decay, the update of torch.optim.AdamW: p *= 1 - lr*wd, then Adam.
struct AdamW {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
};
// Adam with L2 regularisation (torch.optim.Adam): the gradient gets weight_decay * p added.
struct Adam {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
};
// torch.optim.SGD: L2 weight decay, momentum with dampening (the buffer starts as the first
// gradient), optional Nesterov. With momentum == 0 no state is read or written.
struct Sgd {
  float lr = 1e-2f, momentum = 0.0f, dampening = 0.0f, weight_decay = 0.0f;
  bool nesterov = false;
};
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled decay.
struct Lion {
  float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.99f, weight_decay = 0.0f;
};

// fp32 state arrays per parameter: Adam(W) m and v, Sgd the momentum buffer, Lion m.
template <class O>
inline constexpr int state_slots = 0;
template <>
inline constexpr int state_slots<AdamW> = 2;
template <>
inline constexpr int state_slots<Adam> = 2;
template <>
inline constexpr int state_slots<Sgd> = 1;
template <>
inline constexpr int state_slots<Lion> = 1;

template <class O>
concept Optimizer = state_slots<O> >
0;

// The state arrays' names, as torch.optim calls them (checkpoints store them by name).
inline const char* state_name(const AdamW&, int k) { return k == 0 ? "exp_avg" : "exp_avg_sq"; }
inline const char* state_name(const Adam&, int k) { return k == 0 ? "exp_avg" : "exp_avg_sq"; }
inline const char* state_name(const Sgd&, int) { return "momentum_buffer"; }
inline const char* state_name(const Lion&, int) { return "exp_avg"; }

namespace detail {

// Each optimizer's name and fields in declaration order, for describe() and fingerprint().
inline const char* type_name(const AdamW&) { return "AdamW"; }
inline const char* type_name(const Adam&) { return "Adam"; }
inline const char* type_name(const Sgd&) { return "Sgd"; }
inline const char* type_name(const Lion&) { return "Lion"; }
// O is one of Opts, const or not.
template <class O, class... Opts>
concept one_of = (std::same_as<std::remove_const_t<O>, Opts> || ...);
// O may be const (read the fields) or not (assign them, e.g. from a checkpoint).
template <one_of<AdamW, Adam> O, class F>
void for_each_field(O& o, F&& f) {
  f("lr", o.lr);
  f("beta1", o.beta1);
  f("beta2", o.beta2);
  f("eps", o.eps);
  f("weight_decay", o.weight_decay);
}
template <one_of<Sgd> O, class F>
void for_each_field(O& o, F&& f) {
  f("lr", o.lr);
  f("momentum", o.momentum);
  f("dampening", o.dampening);
  f("weight_decay", o.weight_decay);
  f("nesterov", o.nesterov);
}
template <one_of<Lion> O, class F>
void for_each_field(O& o, F&& f) {
  f("lr", o.lr);
  f("beta1", o.beta1);
  f("beta2", o.beta2);
  f("weight_decay", o.weight_decay);
}

// The allowed ranges of a hyper-parameter.
enum class Range { non_negative, unit_open, unit_closed };  // [0, max], [0, 1), [0, 1], all finite

// Throws unless x is in the range. Written as !(in range) so that NaN fails every test.
inline void expect_in(const char* opt, const char* field, float x, Range r) {
  const bool ok = r == Range::non_negative ? x >= 0.0f && x <= std::numeric_limits<float>::max()
                  : r == Range::unit_open  ? x >= 0.0f && x < 1.0f
                                           : x >= 0.0f && x <= 1.0f;
  ZP_EXPECT(ok, opt, ": ", field, " must be ",
            r == Range::non_negative ? "finite and >= 0"
            : r == Range::unit_open  ? "in [0, 1)"
                                     : "in [0, 1]",
            ", got ", x);
}

}  // namespace detail

namespace detail {
// Decoupled weight decay multiplies the weights by 1 - lr x weight_decay: at 1 or more it zeroes
// them or flips their sign every step.
inline void expect_decay_below_one(const char* opt, float lr, float weight_decay) {
  ZP_EXPECT(double(lr) * double(weight_decay) < 1.0, opt,
            ": lr x weight_decay must be < 1 (decoupled decay multiplies the weights by 1 - lr x "
            "weight_decay), got ",
            lr, " x ", weight_decay);
}

// AdamW and Adam share their rules (torch.optim.Adam's), but for eps, which must be positive: with
// 0, an element whose gradients were all 0 so far divides 0 by 0.
template <class O>
void validate_adam(const O& o) {
  const char* n = type_name(o);
  expect_in(n, "lr", o.lr, Range::non_negative);
  expect_in(n, "beta1", o.beta1, Range::unit_open);
  expect_in(n, "beta2", o.beta2, Range::unit_open);
  expect_in(n, "eps", o.eps, Range::non_negative);
  ZP_EXPECT(o.eps > 0.0f, n,
            ": eps must be > 0 (with 0, an element whose gradients were all 0 "
            "divides 0 by 0), got 0");
  expect_in(n, "weight_decay", o.weight_decay, Range::non_negative);
}
}  // namespace detail

// Throw zp::Error(invalid_argument) naming the first bad hyper-parameter and its value.
inline void validate(const AdamW& o) {
  detail::validate_adam(o);
  detail::expect_decay_below_one("AdamW", o.lr, o.weight_decay);
}
inline void validate(const Adam& o) { detail::validate_adam(o); }
inline void validate(const Sgd& o) {
  using detail::Range;
  detail::expect_in("Sgd", "lr", o.lr, Range::non_negative);
  detail::expect_in("Sgd", "momentum", o.momentum, Range::non_negative);
  detail::expect_in("Sgd", "dampening", o.dampening, Range::unit_closed);
  detail::expect_in("Sgd", "weight_decay", o.weight_decay, Range::non_negative);
  ZP_EXPECT(!o.nesterov || (o.momentum > 0.0f && o.dampening == 0.0f),
            "Sgd: Nesterov momentum requires a momentum and zero dampening, got momentum ",
            o.momentum, ", dampening ", o.dampening);
}
inline void validate(const Lion& o) {
  using detail::Range;
  detail::expect_in("Lion", "lr", o.lr, Range::non_negative);
  detail::expect_in("Lion", "beta1", o.beta1, Range::unit_closed);
  detail::expect_in("Lion", "beta2", o.beta2, Range::unit_closed);
  detail::expect_in("Lion", "weight_decay", o.weight_decay, Range::non_negative);
  detail::expect_decay_below_one("Lion", o.lr, o.weight_decay);
}

// "AdamW(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.01)": every field, each
// float in its shortest exact form.
template <Optimizer O>
std::string describe(const O& o) {
  std::string out = std::string(detail::type_name(o)) + '(';
  bool first = true;
  detail::for_each_field(o, [&](const char* name, auto x) {
    out += first ? "" : ", ";
    first = false;
    out += name;
    out += '=';
    if constexpr (std::is_same_v<decltype(x), bool>)
      out += x ? "true" : "false";
    else
      out += zp::detail::cat(x);
  });
  return out + ')';
}

// FNV-1a (zp::detail::Fnv1a) of the type's name and the exact bits of every field (so -0 differs
// from 0; never padding): it differs between two ranks whenever the type or any field's bits
// differ (barring a 64-bit collision).
template <Optimizer O>
std::uint64_t fingerprint(const O& o) {
  zp::detail::Fnv1a h;
  h.add(std::string_view(detail::type_name(o)));
  detail::for_each_field(o, [&h](const char*, auto x) { h.add(x); });
  return h.value();
}

// One shard's buffers, all of the same length: the fp32 master weights (updated in place), the
// gradient in G (read only), the fp32 state (state[0..state_slots) used, updated in place) and
// the model's copy in T (written only). decay false: the step runs with weight_decay 0 (the
// parameters a model excludes from decay, as a PyTorch param group with weight_decay 0).
template <class T, class G>
struct ShardView {
  std::span<float> master;
  std::span<const G> grad;
  std::array<std::span<float>, 2> state;
  std::span<T> param;
  bool decay = true;

  // Elements [b, b + n) of every buffer (an empty buffer stays empty).
  ShardView subview(std::size_t b, std::size_t n) const {
    auto cut = [&](auto sp) { return sp.empty() ? sp : sp.subspan(b, n); };
    return {cut(master), cut(grad), {cut(state[0]), cut(state[1])}, cut(param), decay};
  }
};

// Values of one step, may change on every step.
struct StepScalars {
  std::int64_t step;   // 1-based count of this update, for bias correction (skipped steps excluded)
  float grad_mul = 1;  // 1/(loss_scale*clip_coef): unscale and clip folded into one multiply
};

// Squared L2 norm and finiteness of gradient values as stored (still scaled by the loss scale).
// sumsq is accumulated in double; finite is false when any value is inf or nan.
struct GradStats {
  double sumsq = 0;
  bool finite = true;
};

// Combines per-shard statistics (after an all_reduce, or of several buckets on one rank).
inline GradStats operator+(const GradStats& a, const GradStats& b) {
  return {a.sumsq + b.sumsq, a.finite && b.finite};
}

// Clipping by global norm (DeepSpeed/Megatron): norm = sqrt(global_sumsq)/loss_scale, coefficient
// max(1, (norm + 1e-6) / max_norm); the step then multiplies gradients by 1/(loss_scale*coef).
// max_norm <= 0 disables clipping (returns 1).
// Host and device compute the same bits (IEEE double operations, nothing to contract).
ZP_HOST_DEVICE inline float clip_coef(double global_sumsq, float loss_scale, float max_norm) {
  if (max_norm <= 0) return 1.0f;
  const double norm = ::sqrt(global_sumsq) / double(loss_scale);
  const double coef = (norm + 1e-6) / double(max_norm);
  return coef > 1.0 ? float(coef) : 1.0f;
}

// grad_mul for a step: unscale and clip in one factor.
ZP_HOST_DEVICE inline float grad_mul(float loss_scale, float clip) {
  return float(1.0 / (double(loss_scale) * double(clip)));
}

namespace detail {

// The few operations the element math needs beyond + - * /. Vector types of the SIMD paths
// provide the same names, found by argument-dependent lookup.
ZP_HOST_DEVICE inline float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
ZP_HOST_DEVICE inline float sqrt(float a) { return ::sqrtf(a); }
// -1, +0 or +1, like torch.sign (nan never reaches it: overflowing steps are skipped).
ZP_HOST_DEVICE inline float sign(float a) { return float(a > 0.0f) - float(a < 0.0f); }

// The optimizer of a view's step: `o`, or `o` without weight decay (ShardView::decay).
template <class O>
O for_view(O o, bool decay) {
  if (!decay) o.weight_decay = 0;
  return o;
}

// Per-step coefficients, computed once on the host in double and rounded to float, so the
// element loops do no transcendental work. `Step<O>` is what an element update reads.
template <class O>
struct Step;

template <>
struct Step<AdamW> {
  float grad_mul, decay, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps, neg_step_size;
};
template <>
struct Step<Adam> {
  float grad_mul, weight_decay, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps,
      neg_step_size;
};
template <>
struct Step<Sgd> {
  // momentum_now is 0 on the first step: the buffer becomes (1 - 0) * g, as in torch.
  float grad_mul, weight_decay, momentum_now, one_minus_dampening_now, momentum, neg_lr;
  bool has_momentum, nesterov;
};
template <>
struct Step<Lion> {
  float grad_mul, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
};

inline Step<AdamW> prepare(const AdamW& o, const StepScalars& s) {
  validate(o);
  const double t = double(s.step);
  const double bc1 = 1.0 - std::pow(double(o.beta1), t);
  const double bc2 = 1.0 - std::pow(double(o.beta2), t);
  return {s.grad_mul,
          float(1.0 - double(o.lr) * double(o.weight_decay)),
          float(1.0 - double(o.beta1)),
          o.beta2,
          float(1.0 - double(o.beta2)),
          float(1.0 / std::sqrt(bc2)),
          o.eps,
          float(-double(o.lr) / bc1)};
}
inline Step<Adam> prepare(const Adam& o, const StepScalars& s) {
  validate(o);
  const double t = double(s.step);
  const double bc1 = 1.0 - std::pow(double(o.beta1), t);
  const double bc2 = 1.0 - std::pow(double(o.beta2), t);
  return {s.grad_mul,
          o.weight_decay,
          float(1.0 - double(o.beta1)),
          o.beta2,
          float(1.0 - double(o.beta2)),
          float(1.0 / std::sqrt(bc2)),
          o.eps,
          float(-double(o.lr) / bc1)};
}
inline Step<Sgd> prepare(const Sgd& o, const StepScalars& s) {
  validate(o);
  const bool first = s.step <= 1;
  return {s.grad_mul,
          o.weight_decay,
          first ? 0.0f : o.momentum,
          first ? 1.0f : float(1.0 - double(o.dampening)),
          o.momentum,
          -o.lr,
          o.momentum != 0.0f,
          o.nesterov};
}
inline Step<Lion> prepare(const Lion& o, const StepScalars& s) {
  validate(o);
  return {s.grad_mul, float(1.0 - double(o.lr) * double(o.weight_decay)),
          o.beta1,    float(1.0 - double(o.beta1)),
          o.beta2,    float(1.0 - double(o.beta2)),
          -o.lr};
}

// The element updates. V is float (scalar CPU path, CUDA) or a SIMD vector of floats; `g` is the
// stored gradient already converted to float, `p` the master weight, `s` the state slots.
// A coefficient becomes a V by V(float) (a broadcast for vectors).

// torch.optim.AdamW: p *= 1-lr*wd; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
// p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
template <class V>
ZP_HOST_DEVICE inline void update(const Step<AdamW>& c, const V& g_stored, V& p, V* s) {
  V& m = s[0];
  V& v = s[1];
  const V g_minus_m = fma(g_stored, V(c.grad_mul), V(0.0f) - m);  // g - m, g unscaled
  const V g = g_stored * V(c.grad_mul);
  m = fma(V(c.one_minus_beta1), g_minus_m, m);
  v = fma(V(c.one_minus_beta2), g * g, v * V(c.beta2));
  const V denom = fma(sqrt(v), V(c.inv_sqrt_bc2), V(c.eps));
  p = fma(V(c.neg_step_size), m / denom, p * V(c.decay));
}

// torch.optim.Adam with weight_decay: g += wd * p, then the same moments and update.
template <class V>
ZP_HOST_DEVICE inline void update(const Step<Adam>& c, const V& g_stored, V& p, V* s) {
  V& m = s[0];
  V& v = s[1];
  const V g = fma(V(c.weight_decay), p, g_stored * V(c.grad_mul));
  m = fma(V(c.one_minus_beta1), g - m, m);
  v = fma(V(c.one_minus_beta2), g * g, v * V(c.beta2));
  const V denom = fma(sqrt(v), V(c.inv_sqrt_bc2), V(c.eps));
  p = fma(V(c.neg_step_size), m / denom, p);
}

// torch.optim.SGD: g += wd*p; buf = momentum*buf + (1-dampening)*g (buf = g on step 1);
// g = nesterov ? g + momentum*buf : buf; p -= lr*g.
template <class V>
ZP_HOST_DEVICE inline void update(const Step<Sgd>& c, const V& g_stored, V& p, V* s) {
  V g = fma(V(c.weight_decay), p, g_stored * V(c.grad_mul));
  if (c.has_momentum) {
    V& buf = s[0];
    buf = fma(V(c.momentum_now), buf, g * V(c.one_minus_dampening_now));
    g = c.nesterov ? fma(V(c.momentum), buf, g) : buf;
  }
  p = fma(V(c.neg_lr), g, p);
}

// Lion: u = sign(b1*m + (1-b1)*g); p = p*(1-lr*wd) - lr*u; m = b2*m + (1-b2)*g.
template <class V>
ZP_HOST_DEVICE inline void update(const Step<Lion>& c, const V& g_stored, V& p, V* s) {
  V& m = s[0];
  const V g = g_stored * V(c.grad_mul);
  const V u = sign(fma(V(c.one_minus_beta1), g, m * V(c.beta1)));
  p = fma(V(c.neg_lr), u, p * V(c.decay));
  m = fma(V(c.one_minus_beta2), g, m * V(c.beta2));
}

// Whether a step of this optimizer reads and writes state slot `slot`.
template <class O>
inline bool uses_slot(const O&, int slot) {
  return slot < state_slots<O>;
}
inline bool uses_slot(const Sgd& o, int slot) { return slot < 1 && o.momentum != 0.0f; }
// How many state slots a step of `opt` uses: the first used_slots(opt) of ShardView::state.
template <class O>
int used_slots(const O& opt) {
  int k = 0;
  while (k < 2 && uses_slot(opt, k)) ++k;
  return k;
}

// The checks of a step over `shard` (the CPU's and a device's): Errc::invalid_argument naming
// the step count below 1, or the array whose length differs from the master's.
template <class O, class T, class G>
void check_step(const O& opt, const StepScalars& s, const ShardView<T, G>& shard) {
  const std::size_t n = shard.master.size();
  ZP_EXPECT(shard.grad.size() == n && shard.param.size() == n,
            "optimizer step: sizes differ: master ", n, ", grad ", shard.grad.size(), ", param ",
            shard.param.size());
  for (int k = 0; k < used_slots(opt); ++k)
    ZP_EXPECT(shard.state[std::size_t(k)].size() == n, "optimizer step: state[", k, "] has ",
              shard.state[std::size_t(k)].size(), " elements, master has ", n);
  ZP_EXPECT(s.step >= 1, "optimizer step: step must count from 1, got ", s.step);
}

// Conversions between storage types and float (round to nearest even for 16-bit types).
template <class T>
ZP_HOST_DEVICE inline float to_float(T x) {
  return float(x);
}
template <class T>
ZP_HOST_DEVICE inline T from_float(float x) {
  return T(x);
}

}  // namespace detail
}  // namespace zp::optim
