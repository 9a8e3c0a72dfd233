// Tests of zp/schedule.hpp against values worked out from DeepSpeed's documented formulas.
#include <doctest/doctest.h>

#include <zp/schedule.hpp>

#include <cmath>
#include <numbers>

using namespace zp::schedule;
using doctest::Approx;

TEST_CASE("WarmupLR rises logarithmically or linearly to max_lr and stays there") {
  const WarmupLR log{.warmup_min_lr = 0.0, .warmup_max_lr = 1e-3, .warmup_num_steps = 100};
  CHECK(log.lr(0) == 0.0);
  CHECK(log.lr(9) == Approx(1e-3 * std::log(10.0) / std::log(100.0)));
  CHECK(log.lr(99) == Approx(1e-3));
  CHECK(log.lr(100) == 1e-3);
  CHECK(log.lr(5000) == 1e-3);
  const WarmupLR lin{.warmup_min_lr = 1e-4, .warmup_max_lr = 1e-3, .warmup_num_steps = 10, .warmup_type = Warmup::linear};
  CHECK(lin.lr(0) == Approx(1e-4));
  CHECK(lin.lr(5) == Approx(1e-4 + 0.9e-3 * 0.5));
  CHECK(lin.lr(10) == Approx(1e-3));
  // DeepSpeed raises warmup_num_steps to at least 2.
  CHECK(WarmupLR{.warmup_num_steps = 0, .warmup_type = Warmup::linear}.lr(1) == Approx(0.5e-3));
}

TEST_CASE("WarmupDecayLR decays linearly to zero at total_num_steps") {
  const WarmupDecayLR s{.warmup_min_lr = 0, .warmup_max_lr = 1e-3, .warmup_num_steps = 10,
                        .total_num_steps = 110, .warmup_type = Warmup::linear};
  CHECK(s.lr(5) == Approx(0.5e-3));
  CHECK(s.lr(10) == Approx(1e-3));
  CHECK(s.lr(60) == Approx(0.5e-3));
  CHECK(s.lr(110) == 0.0);
  CHECK(s.lr(200) == 0.0);
}

TEST_CASE("WarmupCosineLR warms a ratio up and anneals it to cos_min_ratio") {
  const WarmupCosineLR s{.base_lr = 2e-3, .total_num_steps = 110, .warmup_min_ratio = 0.1,
                         .warmup_num_steps = 10, .cos_min_ratio = 0.01, .warmup_type = Warmup::linear};
  CHECK(s.lr(0) == Approx(2e-3 * 0.1));
  CHECK(s.lr(5) == Approx(2e-3 * (0.1 + 0.5 * 0.9)));
  // after warm-up: step it - 10 + 1 of 100 along a half cosine
  CHECK(s.lr(10) == Approx(2e-3 * (0.01 + 0.99 * (1 + std::cos(std::numbers::pi * 1 / 100)) / 2)));
  CHECK(s.lr(59) == Approx(2e-3 * (0.01 + 0.99 * 0.5)));
  CHECK(s.lr(109) == Approx(2e-3 * 0.01));
}

TEST_CASE("OneCycle goes up, comes down, then decays, with momentum moving the other way") {
  const OneCycle s{.cycle_min_lr = 1e-4, .cycle_max_lr = 1e-3, .decay_lr_rate = 0.5,
                   .cycle_first_step_size = 10, .decay_step_size = 5};
  CHECK(s.lr(-1) == Approx(1e-4));
  CHECK(s.lr(4) == Approx(1e-4 + 0.9e-3 * 0.5));
  CHECK(s.lr(9) == Approx(1e-3));
  CHECK(s.lr(14) == Approx(1e-4 + 0.9e-3 * 0.5));
  CHECK(s.lr(19) == Approx(1e-4).epsilon(1e-9));
  CHECK(s.momentum(9) == Approx(0.8));
  CHECK(s.momentum(4) == Approx(0.85));
  CHECK(s.lr(24) == Approx(1e-4 / (1 + 0.5 * 1.0)));  // 5 steps past the cycle: one decay interval
  CHECK(s.lr(29) == Approx(1e-4 / (1 + 0.5 * 2.0)));
}

TEST_CASE("a schedule chosen at run time gives the same values") {
  Any a = WarmupLR{.warmup_num_steps = 10};
  CHECK(lr(a, 3) == WarmupLR{.warmup_num_steps = 10}.lr(3));
  a = Constant{0.5};
  CHECK(lr(a, 1000) == 0.5);
}
