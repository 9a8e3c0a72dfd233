// Tests of zp/optim/cpu.hpp (and the element math of zp/optim/optimizer.hpp): every optimizer x
// model copy type T x gradient type G against an independent float64 reference, the SIMD levels
// against each other (bitwise), threads, tails, overflow, clipping and size checks.
#include <doctest/doctest.h>

#include "../random.hpp"

#include <zp/optim/cpu.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../expect_error.hpp"

using namespace zp::optim;
using zp::bf16;
using zp::fp16;
using zp::optim::cpu::Options;

namespace {

// One seed per run, printed on failure through doctest's INFO.
std::uint64_t run_seed() {
  static const std::uint64_t seed = zp::test::fresh_seed();
  return seed;
}

template <class X>
const char* type_name() {
  if constexpr (std::is_same_v<X, float>)
    return "f32";
  else if constexpr (std::is_same_v<X, bf16>)
    return "bf16";
  else
    return "f16";
}
template <class O>
const char* opt_name(const O&) {
  if constexpr (std::is_same_v<O, AdamW>)
    return "AdamW";
  else if constexpr (std::is_same_v<O, Adam>)
    return "Adam";
  else if constexpr (std::is_same_v<O, Sgd>)
    return "Sgd";
  else
    return "Lion";
}

template <class X>
std::uint32_t bits(X x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof x);
  return u;
}

template <class X>
bool same_bytes(const std::vector<X>& a, const std::vector<X>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(X)) == 0);
}

// Owns one shard's buffers.
template <class T, class G>
struct Shard {
  std::vector<float> master, s0, s1;
  std::vector<G> grad;
  std::vector<T> param;
  explicit Shard(std::size_t n, int slots)
      : master(n), s0(slots > 0 ? n : 0), s1(slots > 1 ? n : 0), grad(n), param(n) {}
  ShardView<T, G> view() {
    return {master, std::span<const G>(grad), {std::span<float>(s0), std::span<float>(s1)}, param};
  }
  void poison_param() {
    if (!param.empty()) std::memset(param.data(), 0xff, param.size() * sizeof(T));
  }
};

// Gradient values as stored: true gradient times the loss scale, rounded to G.
template <class G>
void fill_grad(std::vector<G>& g, std::mt19937_64& rng, float loss_scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : g) x = G(normal(rng) * loss_scale);
}

// ---- the float64 reference, written from the formulas (REFERENCE.md, torch docs) ----
struct Expect {
  double master, s0, s1;  // expected values
  double tol_master, tol_s0, tol_s1;
  bool master_sign_ambiguous = false;  // Lion: sign(c) too close to 0 to decide
  double alt_master = 0;
};
constexpr double u32 = 1.0 / (1 << 23);  // float's epsilon; tolerances are a few of these

// The moments and bias correction AdamW and Adam share. g is the gradient the moments see, sg
// the scale of its rounding error, p the weight before and p_decayed after any decoupled decay;
// v_tol adds to the scale of v's error.
template <class O>
Expect adam_reference(const O& o, std::int64_t t, double g, double sg, double p, double p_decayed,
                      double m, double v, double v_tol) {
  const double m1 = double(o.beta1) * m + (1.0 - double(o.beta1)) * g;
  const double v1 = double(o.beta2) * v + (1.0 - double(o.beta2)) * g * g;
  const double bc1 = 1.0 - std::pow(double(o.beta1), double(t));
  const double bc2 = 1.0 - std::pow(double(o.beta2), double(t));
  const double denom = std::sqrt(v1) / std::sqrt(bc2) + double(o.eps);
  const double step = double(o.lr) / bc1;
  const double upd = step * m1 / denom;
  return {p_decayed - upd,
          m1,
          v1,
          4 * u32 * (std::abs(p) + std::abs(upd) + step * (std::abs(m) + sg) / denom),
          4 * u32 * (std::abs(m) + sg),
          4 * u32 * (v1 + v_tol)};
}
Expect reference(const AdamW& o, std::int64_t t, double gm, double gs, double p, double m,
                 double v) {
  const double g = gs * gm;
  return adam_reference(o, t, g, std::abs(g), p, p * (1.0 - double(o.lr) * double(o.weight_decay)),
                        m, v, 0);
}
Expect reference(const Adam& o, std::int64_t t, double gm, double gs, double p, double m,
                 double v) {
  const double g = gs * gm + double(o.weight_decay) * p;
  const double sg = std::abs(gs * gm) + std::abs(double(o.weight_decay) * p);  // scale of g's error
  return adam_reference(o, t, g, sg, p, p, m, v, (1.0 - double(o.beta2)) * sg * sg);
}
Expect reference(const Sgd& o, std::int64_t t, double gm, double gs, double p, double buf, double) {
  double g = gs * gm + double(o.weight_decay) * p;
  const double sg = std::abs(gs * gm) + std::abs(double(o.weight_decay) * p);
  double sd = sg, buf1 = 0, sbuf = 0;
  if (o.momentum != 0) {
    buf1 = t == 1 ? g : double(o.momentum) * buf + (1.0 - double(o.dampening)) * g;
    sbuf = std::abs(double(o.momentum) * buf) + sg;
    if (o.nesterov) {
      g = g + double(o.momentum) * buf1;
      sd = sg + std::abs(double(o.momentum)) * sbuf;
    } else {
      g = buf1;
      sd = sbuf;
    }
  }
  return {p - double(o.lr) * g, buf1, 0, 4 * u32 * (std::abs(p) + double(o.lr) * sd),
          4 * u32 * sbuf,       0};
}
Expect reference(const Lion& o, std::int64_t, double gm, double gs, double p, double m, double) {
  const double g = gs * gm;
  const double c = double(o.beta1) * m + (1.0 - double(o.beta1)) * g;
  const double sign = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
  const double p1 = p * (1.0 - double(o.lr) * double(o.weight_decay));
  Expect e{p1 - double(o.lr) * sign,
           double(o.beta2) * m + (1.0 - double(o.beta2)) * g,
           0,
           4 * u32 * (std::abs(p) + double(o.lr)),
           4 * u32 * (std::abs(m) + std::abs(g)),
           0};
  if (std::abs(c) <= 4 * u32 * (std::abs(m) + std::abs(g))) {
    e.master_sign_ambiguous = true;
    e.alt_master = p1;
  }
  return e;
}

// Hyper-parameters that change on every step (the step must not cache them).
AdamW vary(AdamW o, std::int64_t t) {
  o.lr = float(1e-3 * (1.0 + 0.5 * std::sin(double(t))));
  o.weight_decay = 0.05f;
  return o;
}
Adam vary(Adam o, std::int64_t t) {
  o.lr = float(2e-3 * (1.0 + 0.5 * std::cos(double(t))));
  o.weight_decay = 0.01f;
  o.beta2 = 0.99f;
  return o;
}
Sgd vary(Sgd o, std::int64_t t) {
  o.lr = float(1e-2 / double(t));
  return o;
}
Lion vary(Lion o, std::int64_t t) {
  o.lr = float(1e-4 * (1.0 + 0.1 * double(t % 7)));
  o.weight_decay = 0.1f;
  return o;
}

// 100 steps with fresh gradients; each step compared element by element with the float64
// reference evaluated from the fp32 state before the step (so errors are one step's rounding,
// not amplified drift). Tolerance: 4 float epsilons of the sum of magnitudes of the terms that
// enter each output (see `reference`); the model copy must be exactly T(master).
template <class O, class T, class G>
void check_against_reference(O base, std::size_t n, int steps, const Options& options) {
  const int slots = detail::uses_slot(base, 1) ? 2 : detail::uses_slot(base, 0) ? 1 : 0;
  INFO("optimizer ", opt_name(base), " T ", type_name<T>(), " G ", type_name<G>(), " n ", n,
       " seed ", run_seed());
  std::string key = opt_name(base);
  key += type_name<T>();
  key += type_name<G>();
  std::mt19937_64 rng(run_seed() ^ std::hash<std::string>{}(key));
  Shard<T, G> sh(n, slots);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : sh.master) x = normal(rng);
  std::size_t ambiguous = 0;
  for (std::int64_t t = 1; t <= steps; ++t) {
    const O o = vary(base, t);
    // fp16 gradients keep a small loss scale so that they stay in range.
    const float loss_scale = std::is_same_v<G, fp16> ? 64.0f : 1024.0f;
    const float clip = 1.0f + float(t % 3);
    const StepScalars s{t, grad_mul(loss_scale, clip)};
    fill_grad(sh.grad, rng, loss_scale);
    const std::vector<float> p0 = sh.master, m0 = sh.s0, v0 = sh.s1;
    sh.poison_param();
    cpu::step(o, s, sh.view(), options);
    for (std::size_t i = 0; i < n; ++i) {
      const double gs = double(float(sh.grad[i]));
      const Expect e = reference(o, t, double(s.grad_mul), gs, p0[i], slots > 0 ? m0[i] : 0.0,
                                 slots > 1 ? v0[i] : 0.0);
      if (e.master_sign_ambiguous &&
          std::abs(double(sh.master[i]) - e.alt_master) <= e.tol_master + double(o.lr)) {
        ++ambiguous;
      } else if (!(std::abs(double(sh.master[i]) - e.master) <= e.tol_master)) {  // NaN fails
        FAIL_CHECK("master[", i, "] step ", t, ": got ", sh.master[i], " want ", e.master, " tol ",
                   e.tol_master);
        return;
      }
      if (slots > 0 && !(std::abs(double(sh.s0[i]) - e.s0) <= e.tol_s0)) {
        FAIL_CHECK("state0[", i, "] step ", t, ": got ", sh.s0[i], " want ", e.s0, " tol ",
                   e.tol_s0);
        return;
      }
      if (slots > 1 && !(std::abs(double(sh.s1[i]) - e.s1) <= e.tol_s1)) {
        FAIL_CHECK("state1[", i, "] step ", t, ": got ", sh.s1[i], " want ", e.s1, " tol ",
                   e.tol_s1);
        return;
      }
      if (bits(sh.param[i]) != bits(T(sh.master[i]))) {
        FAIL_CHECK("param[", i, "] step ", t, " is not the rounded master (", sh.master[i], ")");
        return;
      }
    }
  }
  CHECK(ambiguous <= n * std::size_t(steps) / 1000);  // sign ties are rare
}

template <class O>
void for_all_types(const O& o, std::size_t n, int steps, const Options& options) {
  check_against_reference<O, float, float>(o, n, steps, options);
  check_against_reference<O, float, bf16>(o, n, steps, options);
  check_against_reference<O, float, fp16>(o, n, steps, options);
  check_against_reference<O, bf16, float>(o, n, steps, options);
  check_against_reference<O, bf16, bf16>(o, n, steps, options);
  check_against_reference<O, bf16, fp16>(o, n, steps, options);
  check_against_reference<O, fp16, float>(o, n, steps, options);
  check_against_reference<O, fp16, bf16>(o, n, steps, options);
  check_against_reference<O, fp16, fp16>(o, n, steps, options);
}

// Runs `steps` steps of one optimizer from identical inputs under two option sets and requires
// bitwise identical outputs.
template <class O, class T, class G>
void check_same_bits(const O& o, std::size_t n, int steps, const Options& a, const Options& b) {
  const int slots = detail::uses_slot(o, 1) ? 2 : detail::uses_slot(o, 0) ? 1 : 0;
  INFO("optimizer ", opt_name(o), " T ", type_name<T>(), " G ", type_name<G>(), " n ", n, " isa ",
       cpu::name(a.isa), "/", cpu::name(b.isa), " threads ", a.threads, "/", b.threads, " seed ",
       run_seed());
  std::mt19937_64 rng(run_seed() + n);
  Shard<T, G> x(n, slots), y(n, slots);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x.master) v = normal(rng);
  y.master = x.master;
  x.poison_param();
  y.poison_param();
  for (std::int64_t t = 1; t <= steps; ++t) {
    fill_grad(x.grad, rng, 8.0f);
    y.grad = x.grad;
    const StepScalars s{t, 0.125f};
    cpu::step(vary(o, t), s, x.view(), a);
    cpu::step(vary(o, t), s, y.view(), b);
  }
  CHECK(same_bytes(x.master, y.master));
  CHECK(same_bytes(x.s0, y.s0));
  CHECK(same_bytes(x.s1, y.s1));
  CHECK(same_bytes(x.param, y.param));
  for (std::size_t i = 0; i < n; ++i)
    if (bits(x.param[i]) != bits(T(x.master[i]))) {
      FAIL_CHECK("param[", i, "] was not written");
      break;
    }
}

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float qnan = std::numeric_limits<float>::quiet_NaN();  // not `nan`: ::nan() is a function

// The value and how the message prints it, for the bad values every float field must reject.
struct Bad {
  float value;
  const char* text;
};
constexpr Bad non_finite_or_negative[] = {{qnan, "got nan"},
                                          {inf, "got inf"},
                                          {-inf, "got -inf"},
                                          {-1.0f, "got -1"},
                                          {-1e-30f, "got -1e-30"}};

template <class O>
void same_bits_all_types(const O& o, std::size_t n, int steps, const Options& a, const Options& b) {
  check_same_bits<O, float, float>(o, n, steps, a, b);
  check_same_bits<O, bf16, bf16>(o, n, steps, a, b);
  check_same_bits<O, fp16, fp16>(o, n, steps, a, b);
  check_same_bits<O, bf16, float>(o, n, steps, a, b);
  check_same_bits<O, float, fp16>(o, n, steps, a, b);
}

}  // namespace

TEST_CASE(
    "every optimizer, model type and gradient type matches a float64 reference over 100 steps") {
  // n is not a multiple of any vector width, so the tail path is exercised too.
  const std::size_t n = 523;
  const auto each_level = [&](const auto& opt) {
    for (cpu::Isa isa : cpu::supported_isas()) {
      CAPTURE(cpu::name(isa));
      for_all_types(opt, n, 100, Options{.threads = 1, .isa = isa});
    }
  };
  SUBCASE("AdamW") { each_level(AdamW{}); }
  SUBCASE("Adam with L2 weight decay") { each_level(Adam{}); }
  SUBCASE("SGD") { each_level(Sgd{}); }
  SUBCASE("SGD with momentum and dampening") {
    each_level(Sgd{.momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-2f});
  }
  SUBCASE("SGD with Nesterov momentum") {
    each_level(Sgd{.momentum = 0.8f, .weight_decay = 1e-3f, .nesterov = true});
  }
  SUBCASE("Lion") { each_level(Lion{}); }
}

TEST_CASE("every SIMD level gives bitwise the same step as the portable code") {
  const auto levels = cpu::supported_isas();
  std::string names;
  for (cpu::Isa i : levels) {
    names += cpu::name(i);
    names += ' ';
  }
  MESSAGE("instruction set levels tested on this CPU: ", names);
  if (!cpu::supported(cpu::Isa::avx512))
    MESSAGE("avx512 is not supported here: that level was compiled, not run");
  for (cpu::Isa isa : levels) {
    if (isa == cpu::Isa::portable) continue;
    const Options portable{.isa = cpu::Isa::portable}, simd{.isa = isa};
    for (std::size_t n : {0, 1, 7, 8, 9, 15, 16, 17, 33, 1031}) {
      same_bits_all_types(AdamW{}, n, 3, portable, simd);
      same_bits_all_types(Adam{.weight_decay = 0.1f}, n, 3, portable, simd);
      same_bits_all_types(Sgd{.momentum = 0.9f, .weight_decay = 0.1f, .nesterov = true}, n, 3,
                          portable, simd);
      same_bits_all_types(Lion{.weight_decay = 0.1f}, n, 3, portable, simd);
    }
  }
}

TEST_CASE("threads split the shard without changing a bit") {
  const std::size_t n = 3 * cpu::detail::min_tile + 77;
  for (int threads : {2, 3, 5}) {
    const Options one{.threads = 1}, many{.threads = threads};
    check_same_bits<AdamW, bf16, float>(AdamW{}, n, 2, one, many);
    check_same_bits<Lion, float, bf16>(Lion{}, n, 2, one, many);
    check_same_bits<Sgd, fp16, fp16>(Sgd{.momentum = 0.5f}, n, 2, one, many);
  }
}

TEST_CASE("grad_stats gives the squared norm and finiteness at every level and thread count") {
  std::mt19937_64 rng(run_seed());
  INFO("seed ", run_seed());
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(9), std::size_t(31),
                        std::size_t(1000), 2 * cpu::detail::min_tile + 3}) {
    std::vector<float> g(n);
    fill_grad(g, rng, 100.0f);
    std::vector<bf16> gb(n);
    std::vector<fp16> gh(n);
    double want = 0, want_b = 0, want_h = 0;
    for (std::size_t i = 0; i < n; ++i) {
      gb[i] = bf16(g[i]);
      gh[i] = fp16(g[i]);
      want += double(g[i]) * g[i];
      want_b += double(float(gb[i])) * double(float(gb[i]));
      want_h += double(float(gh[i])) * double(float(gh[i]));
    }
    for (cpu::Isa isa : cpu::supported_isas())
      for (int threads : {1, 2, 3}) {
        CAPTURE(n);
        CAPTURE(cpu::name(isa));
        CAPTURE(threads);
        const Options o{.threads = threads, .isa = isa};
        const auto a = cpu::grad_stats(std::span<const float>(g), o);
        const auto b = cpu::grad_stats(std::span<const bf16>(gb), o);
        const auto h = cpu::grad_stats(std::span<const fp16>(gh), o);
        CHECK(a.finite);
        CHECK(b.finite);
        CHECK(h.finite);
        CHECK(std::abs(a.sumsq - want) <= 1e-12 * want);
        CHECK(std::abs(b.sumsq - want_b) <= 1e-12 * want_b);
        CHECK(std::abs(h.sumsq - want_h) <= 1e-12 * want_h);
      }
  }
}

TEST_CASE("a single inf or nan anywhere is reported and leaves every output bitwise unchanged") {
  const std::size_t n = 2 * cpu::detail::min_tile + 45;  // two tiles and a vector tail
  std::mt19937_64 rng(run_seed());
  INFO("seed ", run_seed());
  const float bad_values[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  Shard<bf16, fp16> drawn(n, 2);  // drawn once (drawing is most of the time under ASan)
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    drawn.master[i] = normal(rng);
    drawn.s0[i] = normal(rng);
    drawn.s1[i] = std::abs(normal(rng));
    drawn.grad[i] = fp16(normal(rng));
    drawn.param[i] = bf16::from_bits(std::uint16_t(i));
  }
  for (std::size_t where :
       {std::size_t(0), std::size_t(5), cpu::detail::min_tile + 1, n - 1, n - 20})
    for (float bad : bad_values)
      for (cpu::Isa isa : cpu::supported_isas()) {
        CAPTURE(where);
        CAPTURE(bad);
        CAPTURE(cpu::name(isa));
        Shard<bf16, fp16> sh = drawn;
        sh.grad[where] = fp16(bad);
        const auto before = sh;
        const GradStats st =
            cpu::step_if_finite(AdamW{}, {3, 0.5f}, sh.view(), {.threads = 2, .isa = isa});
        CHECK_FALSE(st.finite);
        CHECK(std::memcmp(sh.master.data(), before.master.data(), n * 4) == 0);
        CHECK(std::memcmp(sh.s0.data(), before.s0.data(), n * 4) == 0);
        CHECK(std::memcmp(sh.s1.data(), before.s1.data(), n * 4) == 0);
        CHECK(std::memcmp(sh.param.data(), before.param.data(), n * 2) == 0);
      }
  // And a clean gradient does step.
  Shard<float, float> sh(100, 2);
  for (auto& g : sh.grad) g = 1.0f;
  CHECK(cpu::step_if_finite(AdamW{}, {1}, sh.view()).finite);
  CHECK(sh.master[0] != 0.0f);
}

TEST_CASE("clipping by the global norm scales the update to max_norm") {
  CHECK(clip_coef(100.0, 1.0f, 0.0f) == 1.0f);  // disabled
  CHECK(clip_coef(0.25, 1.0f, 1.0f) == 1.0f);   // norm 0.5 under the limit
  CHECK(clip_coef(100.0 * 64 * 64, 64.0f, 2.0f) == doctest::Approx((10.0 + 1e-6) / 2.0));
  // Plain SGD with lr 1 moves the weights by -g/(scale*clip): the move has norm max_norm.
  const std::size_t n = 1000;
  std::mt19937_64 rng(run_seed());
  const float scale = 512.0f, max_norm = 0.5f;
  Shard<float, float> sh(n, 0);
  fill_grad(sh.grad, rng, scale);
  const GradStats st = cpu::grad_stats(std::span<const float>(sh.grad));
  const float clip = clip_coef(st.sumsq, scale, max_norm);
  REQUIRE(clip > 1.0f);
  cpu::step(Sgd{.lr = 1.0f}, {1, grad_mul(scale, clip)}, sh.view());
  double moved = 0;
  for (float p : sh.master) moved += double(p) * p;
  CHECK(std::sqrt(moved) == doctest::Approx(max_norm).epsilon(1e-5));
}

TEST_CASE("mismatched sizes and unsupported levels are errors that name the sizes") {
  std::vector<float> master(10), grad(10), m(10), v(9), param(11);
  zp::test::expect_invalid(
      [&] {
        cpu::step(AdamW{}, {1}, ShardView<float, float>{master, grad, {m, m}, param});
      },
      {"param 11"});
  zp::test::expect_invalid(
      [&] {
        cpu::step(AdamW{}, {1}, ShardView<float, float>{master, grad, {m, v}, master});
      },
      {"state[1] has 9"});
  zp::test::expect_invalid(
      [&] {
        cpu::step(Lion{}, {1}, ShardView<float, float>{master, grad, {}, master});
      },
      {"state[0] has 0"});
  zp::test::expect_invalid(
      [&] {
        cpu::step(AdamW{}, {0}, ShardView<float, float>{master, grad, {m, m}, master});
      },
      {"step must count from 1"});
  // SGD without momentum needs no state.
  cpu::step(Sgd{}, {1}, ShardView<float, float>{master, grad, {}, master});
  if (!cpu::supported(cpu::Isa::avx512))
    zp::test::expect_invalid(
        [&] {
          cpu::step(Sgd{}, {1}, ShardView<float, float>{master, grad, {}, master},
                    {.isa = cpu::Isa::avx512});
        },
        {"not supported"});
}

TEST_CASE("every invalid AdamW and Adam hyper-parameter is an error naming it and its value") {
  const auto each = [](auto base, const char* who) {
    using O = decltype(base);
    CAPTURE(who);
    const std::pair<const char*, float O::*> fields[] = {{"lr", &O::lr},
                                                         {"beta1", &O::beta1},
                                                         {"beta2", &O::beta2},
                                                         {"eps", &O::eps},
                                                         {"weight_decay", &O::weight_decay}};
    for (const auto& named : fields) {
      const char* field = named.first;  // not a structured binding: lambdas capture it
      const auto member = named.second;
      CAPTURE(field);
      std::vector<Bad> bad(std::begin(non_finite_or_negative), std::end(non_finite_or_negative));
      if (std::string(field).starts_with("beta")) {
        bad.push_back({1.0f, "got 1"});
        bad.push_back({1.5f, "got 1.5"});
        bad.push_back(
            {std::nextafter(1.0f, 2.0f), "got 1.0000001"});  // printed exactly, not as "1"
      }
      for (const Bad& b : bad) {
        O o = base;
        o.*member = b.value;
        const std::string range =
            std::string(field).starts_with("beta") ? "in [0, 1)" : "finite and >= 0";
        zp::test::expect_invalid([&] { validate(o); },
                                 {std::string(who) + ": " + field + " must be " + range, b.text});
      }
    }
    // eps 0 would divide 0 by 0 where the gradients were all 0.
    O zero_eps = base;
    zero_eps.eps = 0.0f;
    zp::test::expect_invalid([&] { validate(zero_eps); },
                             {std::string(who) + ": eps must be > 0", "got 0"});
    // The boundaries stay valid.
    O edge = base;
    edge.lr = edge.beta1 = edge.beta2 = edge.weight_decay = 0.0f;
    edge.eps = std::numeric_limits<float>::denorm_min();
    CHECK_NOTHROW(validate(edge));
    edge.beta1 = edge.beta2 = std::nextafter(1.0f, 0.0f);
    edge.lr = edge.eps = std::numeric_limits<float>::max();
    CHECK_NOTHROW(validate(edge));
    edge.lr = 0.0f;
    edge.weight_decay = std::numeric_limits<float>::max();
    CHECK_NOTHROW(validate(edge));
  };
  each(AdamW{}, "AdamW");
  each(Adam{}, "Adam");
  // Decoupled decay (AdamW's, Lion's) multiplies the weights by 1 - lr x weight_decay: at 1 or
  // more it zeroes or flips them. Adam's L2 term has no such bound.
  for (const float lr : {0.5f, 0.25f}) {
    CAPTURE(lr);
    zp::test::expect_invalid(
        [&] { validate(AdamW{.lr = lr, .weight_decay = 1.0f / lr}); },
        {"AdamW: lr x weight_decay must be < 1", lr == 0.5f ? "got 0.5 x 2" : "got 0.25 x 4"});
    zp::test::expect_invalid([&] { validate(Lion{.lr = lr, .weight_decay = 1.0f / lr}); },
                             {"Lion: lr x weight_decay must be < 1"});
    CHECK_NOTHROW(validate(AdamW{.lr = lr, .weight_decay = std::nextafter(1.0f / lr, 0.0f)}));
    CHECK_NOTHROW(validate(Adam{.lr = lr, .weight_decay = 1.0f / lr}));
  }
}

TEST_CASE(
    "every invalid Sgd hyper-parameter, and Nesterov without plain momentum, is an error naming "
    "it") {
  const std::pair<const char*, float Sgd::*> fields[] = {{"lr", &Sgd::lr},
                                                         {"momentum", &Sgd::momentum},
                                                         {"dampening", &Sgd::dampening},
                                                         {"weight_decay", &Sgd::weight_decay}};
  for (const auto& named : fields) {
    const char* field = named.first;
    const auto member = named.second;
    CAPTURE(field);
    std::vector<Bad> bad(std::begin(non_finite_or_negative), std::end(non_finite_or_negative));
    if (std::string(field) == "dampening") bad.push_back({1.5f, "got 1.5"});
    for (const Bad& b : bad) {
      Sgd o;
      o.*member = b.value;
      const std::string range = std::string(field) == "dampening" ? "in [0, 1]" : "finite and >= 0";
      zp::test::expect_invalid([&] { validate(o); },
                               {std::string("Sgd: ") + field + " must be " + range, b.text});
    }
  }
  zp::test::expect_invalid([] { validate(Sgd{.nesterov = true}); },
                           {"Sgd: Nesterov momentum requires", "momentum 0"});
  zp::test::expect_invalid(
      [] { validate(Sgd{.momentum = 0.9f, .dampening = 0.1f, .nesterov = true}); },
      {"Sgd: Nesterov momentum requires", "dampening 0.1"});
  CHECK_NOTHROW(
      validate(Sgd{.lr = 0.0f, .momentum = 0.0f, .dampening = 1.0f, .weight_decay = 0.0f}));
  CHECK_NOTHROW(validate(Sgd{.momentum = 0.9f, .nesterov = true}));
}

TEST_CASE("every invalid Lion hyper-parameter is an error naming it and its value") {
  const std::pair<const char*, float Lion::*> fields[] = {{"lr", &Lion::lr},
                                                          {"beta1", &Lion::beta1},
                                                          {"beta2", &Lion::beta2},
                                                          {"weight_decay", &Lion::weight_decay}};
  for (const auto& named : fields) {
    const char* field = named.first;
    const auto member = named.second;
    CAPTURE(field);
    const bool beta = std::string(field).starts_with("beta");
    std::vector<Bad> bad(std::begin(non_finite_or_negative), std::end(non_finite_or_negative));
    if (beta) bad.push_back({std::nextafter(1.0f, 2.0f), "got 1.0000001"});
    for (const Bad& b : bad) {
      Lion o;
      o.*member = b.value;
      zp::test::expect_invalid([&] { validate(o); }, {std::string("Lion: ") + field + " must be " +
                                                          (beta ? "in [0, 1]" : "finite and >= 0"),
                                                      b.text});
    }
  }
  CHECK_NOTHROW(validate(Lion{.lr = 0.0f, .beta1 = 0.0f, .beta2 = 0.0f, .weight_decay = 0.0f}));
  CHECK_NOTHROW(validate(Lion{.beta1 = 1.0f, .beta2 = 1.0f}));  // Lion's betas may be 1
}

TEST_CASE("a step with a bad hyper-parameter throws before writing anything, at every level") {
  const std::size_t n = 2 * cpu::detail::min_tile + 45;
  std::mt19937_64 rng(run_seed());
  INFO("seed ", run_seed());
  const auto check_untouched = [&](const auto& opt, const char* needle) {
    Shard<bf16, float> sh(n, 2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      sh.master[i] = normal(rng);
      sh.s0[i] = normal(rng);
      sh.s1[i] = std::abs(normal(rng));
      sh.grad[i] = normal(rng);
      sh.param[i] = bf16::from_bits(std::uint16_t(i));
    }
    const auto before = sh;
    for (cpu::Isa isa : cpu::supported_isas()) {
      CAPTURE(cpu::name(isa));
      const Options options{.threads = 2, .isa = isa};
      zp::test::expect_invalid([&] { cpu::step(opt, {3, 0.5f}, sh.view(), options); }, {needle});
      zp::test::expect_invalid(
          [&] {
            cpu::step_if_finite(opt, {3, 0.5f}, sh.view(), options);
          },
          {needle});
      CHECK(same_bytes(sh.master, before.master));
      CHECK(same_bytes(sh.s0, before.s0));
      CHECK(same_bytes(sh.s1, before.s1));
      CHECK(same_bytes(sh.param, before.param));
    }
  };
  check_untouched(AdamW{.lr = qnan}, "AdamW: lr");
  check_untouched(AdamW{.beta2 = 1.0f}, "AdamW: beta2");
  check_untouched(Adam{.eps = -inf}, "Adam: eps");
  check_untouched(Adam{.weight_decay = inf}, "Adam: weight_decay");
  check_untouched(Sgd{.momentum = -0.5f}, "Sgd: momentum");
  check_untouched(Sgd{.nesterov = true}, "Nesterov");
  check_untouched(Lion{.beta1 = qnan}, "Lion: beta1");
  check_untouched(Lion{.weight_decay = -1.0f}, "Lion: weight_decay");
}

TEST_CASE("a zero learning rate is valid and leaves the master weights bitwise unchanged") {
  const auto each = [](const auto& opt) {
    CAPTURE(opt_name(opt));
    Shard<float, float> sh(100, 2);
    std::mt19937_64 rng(run_seed());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < sh.master.size(); ++i) {
      sh.master[i] = normal(rng);
      sh.grad[i] = normal(rng);
    }
    const auto before = sh.master;
    cpu::step(opt, {1}, sh.view());
    CHECK(same_bytes(sh.master, before));
  };
  each(AdamW{.lr = 0.0f});
  each(Adam{.lr = 0.0f, .weight_decay = 0.1f});
  each(Sgd{.lr = 0.0f, .momentum = 0.9f});
  each(Lion{.lr = 0.0f, .weight_decay = 0.1f});
}

TEST_CASE(
    "describe names every hyper-parameter exactly and fingerprint changes with any field's bits") {
  CHECK(describe(AdamW{}) ==
        "AdamW(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.01)");
  CHECK(describe(Adam{}) == "Adam(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0)");
  CHECK(describe(Sgd{.momentum = 0.9f, .nesterov = true}) ==
        "Sgd(lr=0.01, momentum=0.9, dampening=0, weight_decay=0, nesterov=true)");
  CHECK(describe(Lion{.beta1 = std::nextafter(0.9f, 1.0f)}) ==
        "Lion(lr=1e-04, beta1=0.90000004, beta2=0.99, weight_decay=0)");

  CHECK(fingerprint(AdamW{}) == fingerprint(AdamW{}));
  // Same field values, different type.
  CHECK(fingerprint(Adam{.weight_decay = 0.01f}) != fingerprint(AdamW{}));
  CHECK(fingerprint(Sgd{}) != fingerprint(Sgd{.nesterov = true}));
  CHECK(fingerprint(Sgd{}) != fingerprint(Sgd{.weight_decay = -0.0f}));  // -0 and 0 differ in bits
  // One ulp in any field changes it.
  const auto each_field = [](auto base, std::initializer_list<float decltype(base)::*> members) {
    for (auto member : members) {
      auto o = base;
      o.*member = std::nextafter(o.*member, 1.0f);
      CAPTURE(describe(o));
      CHECK(fingerprint(o) != fingerprint(base));
    }
  };
  each_field(AdamW{},
             {&AdamW::lr, &AdamW::beta1, &AdamW::beta2, &AdamW::eps, &AdamW::weight_decay});
  each_field(Adam{}, {&Adam::lr, &Adam::beta1, &Adam::beta2, &Adam::eps, &Adam::weight_decay});
  each_field(Sgd{}, {&Sgd::lr, &Sgd::momentum, &Sgd::dampening, &Sgd::weight_decay});
  each_field(Lion{}, {&Lion::lr, &Lion::beta1, &Lion::beta2, &Lion::weight_decay});
}

TEST_CASE(
    "an out-of-range instruction set or thread count is an error naming it and the valid ones") {
  CHECK(std::string(cpu::name(cpu::Isa(7))) == "unknown");
  std::vector<float> master(10), grad(10);
  for (int bad : {7, 4, -1}) {
    CAPTURE(bad);
    const Options options{.isa = cpu::Isa(bad)};
    const std::string number = "Isa(" + std::to_string(bad) + ")";
    zp::test::expect_invalid(
        [&] {
          cpu::step(Sgd{}, {1}, ShardView<float, float>{master, grad, {}, master}, options);
        },
        {"optimizer: instruction set " + number, "best, portable, avx2, avx512"});
    zp::test::expect_invalid([&] { cpu::grad_stats(std::span<const float>(grad), options); },
                             {number});
  }
  for (int threads : {0, -3}) {
    const Options options{.threads = threads};
    const std::string what =
        "optimizer: threads must be at least 1, got " + std::to_string(threads);
    zp::test::expect_invalid(
        [&] {
          cpu::step(Sgd{}, {1}, ShardView<float, float>{master, grad, {}, master}, options);
        },
        {what});
    zp::test::expect_invalid([&] { cpu::grad_stats(std::span<const float>(grad), options); },
                             {what});
  }
}
