// Tests of zp/schedule.hpp against values worked out from DeepSpeed's documented formulas.
#include <doctest/doctest.h>

#include <zp/schedule.hpp>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <numbers>
#include <string>

#include "expect_error.hpp"

using namespace zp::schedule;
using doctest::Approx;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();
constexpr double qnan =
    std::numeric_limits<double>::quiet_NaN();  // not `nan`: ::nan() is a function

// A bad learning rate and how the message prints it.
struct Bad {
  double value;
  const char* text;
};
constexpr Bad bad_rates[] = {
    {qnan, "got nan"}, {inf, "got inf"}, {-inf, "got -inf"}, {-1e-3, "got -0.001"}};

// Checks a schedule both directly (check()) and through lr() and lr(Any).
template <class S>
void expect_bad(const S& s, std::initializer_list<std::string> needles) {
  zp::test::expect_invalid([&] { s.check(); }, needles);
  zp::test::expect_invalid([&] { s.lr(0); }, needles);
  zp::test::expect_invalid([&] { lr(Any(s), 5); }, needles);
}
}  // namespace

TEST_CASE("WarmupLR rises logarithmically or linearly to max_lr and stays there") {
  const WarmupLR log{.warmup_min_lr = 0.0, .warmup_max_lr = 1e-3, .warmup_num_steps = 100};
  CHECK(log.lr(0) == 0.0);
  CHECK(log.lr(9) == Approx(1e-3 * std::log(10.0) / std::log(100.0)));
  CHECK(log.lr(99) == Approx(1e-3));
  CHECK(log.lr(100) == 1e-3);
  CHECK(log.lr(5000) == 1e-3);
  const WarmupLR lin{.warmup_min_lr = 1e-4,
                     .warmup_max_lr = 1e-3,
                     .warmup_num_steps = 10,
                     .warmup_type = Warmup::linear};
  CHECK(lin.lr(0) == Approx(1e-4));
  CHECK(lin.lr(5) == Approx(1e-4 + 0.9e-3 * 0.5));
  CHECK(lin.lr(10) == Approx(1e-3));
  // DeepSpeed raises warmup_num_steps to at least 2.
  CHECK(WarmupLR{.warmup_num_steps = 0, .warmup_type = Warmup::linear}.lr(1) == Approx(0.5e-3));
}

TEST_CASE("WarmupDecayLR decays linearly to zero at total_num_steps") {
  const WarmupDecayLR s{.warmup_min_lr = 0,
                        .warmup_max_lr = 1e-3,
                        .warmup_num_steps = 10,
                        .total_num_steps = 110,
                        .warmup_type = Warmup::linear};
  CHECK(s.lr(5) == Approx(0.5e-3));
  CHECK(s.lr(10) == Approx(1e-3));
  CHECK(s.lr(60) == Approx(0.5e-3));
  CHECK(s.lr(110) == 0.0);
  CHECK(s.lr(200) == 0.0);
}

TEST_CASE("WarmupCosineLR warms a ratio up and anneals it to cos_min_ratio") {
  const WarmupCosineLR s{.base_lr = 2e-3,
                         .total_num_steps = 110,
                         .warmup_min_ratio = 0.1,
                         .warmup_num_steps = 10,
                         .cos_min_ratio = 0.01,
                         .warmup_type = Warmup::linear};
  CHECK(s.lr(0) == Approx(2e-3 * 0.1));
  CHECK(s.lr(5) == Approx(2e-3 * (0.1 + 0.5 * 0.9)));
  // after warm-up: step it - 10 + 1 of 100 along a half cosine
  CHECK(s.lr(10) == Approx(2e-3 * (0.01 + 0.99 * (1 + std::cos(std::numbers::pi * 1 / 100)) / 2)));
  CHECK(s.lr(59) == Approx(2e-3 * (0.01 + 0.99 * 0.5)));
  CHECK(s.lr(109) == Approx(2e-3 * 0.01));
}

TEST_CASE("OneCycle goes up, comes down, then decays, with momentum moving the other way") {
  const OneCycle s{.cycle_min_lr = 1e-4,
                   .cycle_max_lr = 1e-3,
                   .decay_lr_rate = 0.5,
                   .cycle_first_step_size = 10,
                   .decay_step_size = 5};
  CHECK(s.lr(0) == Approx(1e-4 + 0.9e-3 * 0.1));  // (0 + 1) / 10 of the way up
  CHECK(s.lr(4) == Approx(1e-4 + 0.9e-3 * 0.5));
  CHECK(s.lr(9) == Approx(1e-3));
  CHECK(s.lr(14) == Approx(1e-4 + 0.9e-3 * 0.5));
  CHECK(s.lr(19) == Approx(1e-4).epsilon(1e-9));
  CHECK(s.momentum(9) == Approx(0.8));
  CHECK(s.momentum(4) == Approx(0.85));
  CHECK(s.lr(24) == Approx(1e-4 / (1 + 0.5 * 1.0)));  // 5 steps past the cycle: one decay interval
  CHECK(s.lr(29) == Approx(1e-4 / (1 + 0.5 * 2.0)));
  // Past the cycle the momentum grows by decay_mom_rate (DeepSpeed's rule) until it would leave
  // Adam's beta1 range, which is an error naming the step and the settings.
  OneCycle grow = s;
  grow.decay_mom_rate = 0.05;
  CHECK(grow.momentum(24) == Approx(0.9 * 1.05));
  CHECK(grow.momentum(29) == Approx(0.9 * 1.1));
  zp::test::expect_invalid(
      [&] { (void)grow.momentum(34); },
      {"schedule: OneCycle: the momentum at step 34 is 1.035",
       "cycle_max_mom 0.9 x (1 + decay_mom_rate 0.05 x 3)", "outside Adam's beta1 range [0, 1)"});
}

TEST_CASE("a schedule chosen at run time gives the same values") {
  Any a = WarmupLR{.warmup_num_steps = 10};
  CHECK(lr(a, 3) == WarmupLR{.warmup_num_steps = 10}.lr(3));
  a = Constant{0.5};
  CHECK(lr(a, 1000) == 0.5);
}

TEST_CASE("a negative iteration is an error for every schedule") {
  const Any all[] = {Constant{}, WarmupLR{}, WarmupDecayLR{}, WarmupCosineLR{}, OneCycle{}};
  for (const Any& a : all) {
    CAPTURE(a.index());
    zp::test::expect_invalid([&] { lr(a, -3); }, {"schedule: iteration must be >= 0, got -3"});
    zp::test::expect_invalid([&] { lr(a, std::numeric_limits<std::int64_t>::min()); },
                             {"got -9223372036854775808"});
    CHECK(lr(a, 0) >= 0.0);
  }
  zp::test::expect_invalid([] { OneCycle{}.momentum(-1); },
                           {"schedule: iteration must be >= 0, got -1"});
}

TEST_CASE(
    "every non-finite or negative learning rate of a schedule is an error naming it and its "
    "value") {
  for (const Bad& b : bad_rates) {
    const double x = b.value;
    const std::string got = b.text;
    CAPTURE(x);
    expect_bad(Constant{x}, {"schedule: Constant: value must be finite and >= 0", got});
    expect_bad(WarmupLR{.warmup_min_lr = x},
               {"schedule: WarmupLR: warmup_min_lr must be finite and >= 0", got});
    expect_bad(WarmupLR{.warmup_max_lr = x},
               {"schedule: WarmupLR: warmup_max_lr must be finite and >= 0", got});
    expect_bad(WarmupDecayLR{.warmup_min_lr = x}, {"schedule: WarmupDecayLR: warmup_min_lr", got});
    expect_bad(WarmupDecayLR{.warmup_max_lr = x}, {"schedule: WarmupDecayLR: warmup_max_lr", got});
    expect_bad(WarmupCosineLR{.base_lr = x},
               {"schedule: WarmupCosineLR: base_lr must be finite and >= 0", got});
    expect_bad(OneCycle{.cycle_min_lr = x},
               {"schedule: OneCycle: cycle_min_lr must be finite and >= 0", got});
    expect_bad(OneCycle{.cycle_max_lr = x},
               {"schedule: OneCycle: cycle_max_lr must be finite and >= 0", got});
    expect_bad(OneCycle{.decay_lr_rate = x},
               {"schedule: OneCycle: decay_lr_rate must be finite and >= 0", got});
    zp::test::expect_invalid([&] { OneCycle{.cycle_max_lr = x}.momentum(0); },
                             {"cycle_max_lr", got});
  }
}

TEST_CASE("every inconsistent step count or ratio of a schedule is an error naming it") {
  expect_bad(WarmupLR{.warmup_num_steps = -1},
             {"schedule: WarmupLR: warmup_num_steps must be >= 0, got -1"});
  expect_bad(WarmupDecayLR{.warmup_num_steps = -1, .total_num_steps = 10},
             {"schedule: WarmupDecayLR: warmup_num_steps must be >= 0, got -1"});
  expect_bad(WarmupDecayLR{.warmup_num_steps = 1000, .total_num_steps = 100},
             {"schedule: WarmupDecayLR: total_num_steps (100) must be >= warmup_num_steps (1000)"});
  expect_bad(WarmupCosineLR{.total_num_steps = 10, .warmup_num_steps = -1},
             {"schedule: WarmupCosineLR: warmup_num_steps must be >= 0, got -1"});
  expect_bad(
      WarmupCosineLR{.total_num_steps = 100, .warmup_num_steps = 1000},
      {"schedule: WarmupCosineLR: total_num_steps (100) must be >= warmup_num_steps (1000)"});
  for (const Bad& b : {Bad{qnan, "got nan"}, Bad{inf, "got inf"}, Bad{-inf, "got -inf"},
                       Bad{-0.1, "got -0.1"}, Bad{1.5, "got 1.5"}}) {
    const double x = b.value;
    const std::string got = b.text;
    CAPTURE(got);
    expect_bad(WarmupCosineLR{.warmup_min_ratio = x},
               {"schedule: WarmupCosineLR: warmup_min_ratio must be in [0, 1]", got});
    expect_bad(WarmupCosineLR{.cos_min_ratio = x},
               {"schedule: WarmupCosineLR: cos_min_ratio must be in [0, 1]", got});
  }
  expect_bad(OneCycle{.cycle_first_step_size = 0},
             {"schedule: OneCycle: cycle_first_step_size must be >= 1, got 0"});
  expect_bad(OneCycle{.cycle_second_step_size = -1},
             {"schedule: OneCycle: cycle_second_step_size must be >= 0", "got -1"});
  expect_bad(OneCycle{.decay_step_size = -2},
             {"schedule: OneCycle: decay_step_size must be >= 0, got -2"});
  expect_bad(OneCycle{.cycle_min_mom = 0.95, .cycle_max_mom = 0.9},
             {"schedule: OneCycle: cycle_min_mom (0.95) must be <= cycle_max_mom (0.9)"});
  expect_bad(OneCycle{.cycle_min_mom = qnan},
             {"schedule: OneCycle: cycle_min_mom must be in [0, 1), got nan"});
  expect_bad(OneCycle{.cycle_max_mom = inf},
             {"schedule: OneCycle: cycle_max_mom must be in [0, 1), got inf"});
  // The momentum is Adam's beta1.
  expect_bad(OneCycle{.cycle_max_mom = 1.0},
             {"schedule: OneCycle: cycle_max_mom must be in [0, 1), got 1"});
  expect_bad(OneCycle{.cycle_min_mom = -0.1},
             {"schedule: OneCycle: cycle_min_mom must be in [0, 1), got -0.1"});
  expect_bad(OneCycle{.decay_mom_rate = -inf},
             {"schedule: OneCycle: decay_mom_rate must be finite, got -inf"});
  const std::int64_t most = std::numeric_limits<std::int64_t>::max();
  expect_bad(OneCycle{.cycle_first_step_size = most, .cycle_second_step_size = 1},
             {"schedule: OneCycle: cycle_first_step_size", "overflows"});
  expect_bad(OneCycle{.cycle_first_step_size = most}, {"overflows"});  // second = first
}

TEST_CASE("boundary schedule settings stay valid and give finite, non-negative rates") {
  const auto in_range = [](const auto& s, double max_lr) {
    for (std::int64_t it : {0, 1, 2, 9, 10, 11, 12, 50, 1000}) {
      CAPTURE(it);
      const double x = s.lr(it);
      CHECK(std::isfinite(x));
      CHECK(x >= 0.0);
      CHECK(x <= max_lr);
    }
  };
  in_range(Constant{0.0}, 0.0);
  in_range(WarmupLR{.warmup_min_lr = 0.0, .warmup_max_lr = 0.0, .warmup_num_steps = 0}, 0.0);
  in_range(WarmupDecayLR{.warmup_num_steps = 10, .total_num_steps = 10}, 1e-3);
  in_range(WarmupDecayLR{.warmup_num_steps = 0, .total_num_steps = 0}, 1e-3);
  in_range(WarmupCosineLR{.total_num_steps = 10, .warmup_num_steps = 10}, 1e-3);
  in_range(WarmupCosineLR{.total_num_steps = 0,
                          .warmup_min_ratio = 1.0,
                          .warmup_num_steps = 0,
                          .cos_min_ratio = 0.0},
           1e-3);
  in_range(WarmupCosineLR{.base_lr = 0.0, .warmup_min_ratio = 0.0, .cos_min_ratio = 1.0}, 0.0);
  in_range(OneCycle{.cycle_min_lr = 0.0, .cycle_max_lr = 0.0, .cycle_first_step_size = 1}, 0.0);
  in_range(OneCycle{.cycle_first_step_size = 1, .decay_step_size = 1}, 1e-3);
  const OneCycle flat{.cycle_min_mom = 0.9, .cycle_max_mom = 0.9};
  CHECK_NOTHROW(flat.check());
  CHECK(flat.momentum(5) == 0.9);
}
