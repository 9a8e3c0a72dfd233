// zp/schedule.hpp: learning-rate schedules with DeepSpeed's names and formulas, as small value types.
//
// Every schedule answers lr(iteration), where iteration counts the optimizer steps already taken
// (DeepSpeed's last_batch_iteration: 0 for the first step). A step skipped for overflow does not
// advance it. Pass the result into the optimizer's lr field before each step. OneCycle also
// gives the momentum (beta1) to use.
//
// Each schedule's check() throws zp::Error(invalid_argument) naming a bad setting (a negative or
// non-finite learning rate, steps out of order); lr() calls it, and rejects a negative iteration,
// so no setting can yield a nan or negative rate silently.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <variant>

#include "zp/error.hpp"

namespace zp::schedule {

enum class Warmup { log, linear };

namespace detail {
// Fraction of the warm-up reached at `it` (0 at it = 0, 1 once it >= steps); steps >= 2.
inline double warmup_fraction(Warmup type, std::int64_t it, std::int64_t steps) {
  if (it >= steps) return 1.0;
  if (type == Warmup::log) return std::log(double(it + 1)) / std::log(double(steps));
  return double(it) / double(steps);
}
inline std::int64_t warmup_steps(std::int64_t n) { return std::max<std::int64_t>(n, 2); }

inline void check_iteration(std::int64_t it) {
  ZP_EXPECT(it >= 0, "schedule: iteration must be >= 0, got ", it);
}
}  // namespace detail

// A constant learning rate.
struct Constant {
  double value = 1e-3;
  void check() const {
    zp::detail::expect_finite_non_negative(value, "schedule: Constant", "value");
  }
  double lr(std::int64_t it) const {
    check();
    detail::check_iteration(it);
    return value;
  }
};

// DeepSpeed WarmupLR: from min_lr to max_lr over warmup_num_steps (log or linear), then max_lr.
struct WarmupLR {
  double warmup_min_lr = 0.0, warmup_max_lr = 1e-3;
  std::int64_t warmup_num_steps = 1000;
  Warmup warmup_type = Warmup::log;
  void check() const {
    zp::detail::expect_finite_non_negative(warmup_min_lr, "schedule: WarmupLR", "warmup_min_lr");
    zp::detail::expect_finite_non_negative(warmup_max_lr, "schedule: WarmupLR", "warmup_max_lr");
    ZP_EXPECT(warmup_num_steps >= 0, "schedule: WarmupLR: warmup_num_steps must be >= 0, got ",
              warmup_num_steps);
  }
  double lr(std::int64_t it) const {
    check();
    detail::check_iteration(it);
    const double f =
        detail::warmup_fraction(warmup_type, it, detail::warmup_steps(warmup_num_steps));
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * f;
  }
};

// DeepSpeed WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps.
struct WarmupDecayLR {
  double warmup_min_lr = 0.0, warmup_max_lr = 1e-3;
  std::int64_t warmup_num_steps = 1000;
  std::int64_t total_num_steps = 10000;
  Warmup warmup_type = Warmup::log;
  void check() const {
    zp::detail::expect_finite_non_negative(warmup_min_lr, "schedule: WarmupDecayLR",
                                           "warmup_min_lr");
    zp::detail::expect_finite_non_negative(warmup_max_lr, "schedule: WarmupDecayLR",
                                           "warmup_max_lr");
    ZP_EXPECT(warmup_num_steps >= 0, "schedule: WarmupDecayLR: warmup_num_steps must be >= 0, got ",
              warmup_num_steps);
    ZP_EXPECT(total_num_steps >= warmup_num_steps, "schedule: WarmupDecayLR: total_num_steps (",
              total_num_steps, ") must be >= warmup_num_steps (", warmup_num_steps, ")");
  }
  double lr(std::int64_t it) const {
    check();
    detail::check_iteration(it);
    const std::int64_t w = detail::warmup_steps(warmup_num_steps);
    double f;
    if (it < w) {
      f = detail::warmup_fraction(warmup_type, it, w);
    } else {
      const double left = double(total_num_steps - it);
      f = std::max(0.0, left / std::max(1.0, double(total_num_steps - w)));
    }
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * f;
  }
};

// DeepSpeed WarmupCosineLR: a ratio of the optimizer's base lr, warmed up from warmup_min_ratio
// to 1, then cosine-annealed to cos_min_ratio at total_num_steps.
struct WarmupCosineLR {
  double base_lr = 1e-3;
  std::int64_t total_num_steps = 10000;
  double warmup_min_ratio = 0.0;
  std::int64_t warmup_num_steps = 1000;
  double cos_min_ratio = 0.0001;
  Warmup warmup_type = Warmup::log;
  void check() const {
    zp::detail::expect_finite_non_negative(base_lr, "schedule: WarmupCosineLR", "base_lr");
    ZP_EXPECT(warmup_num_steps >= 0,
              "schedule: WarmupCosineLR: warmup_num_steps must be >= 0, got ", warmup_num_steps);
    ZP_EXPECT(total_num_steps >= warmup_num_steps, "schedule: WarmupCosineLR: total_num_steps (",
              total_num_steps, ") must be >= warmup_num_steps (", warmup_num_steps, ")");
    ZP_EXPECT(warmup_min_ratio >= 0.0 && warmup_min_ratio <= 1.0,
              "schedule: WarmupCosineLR: warmup_min_ratio must be in [0, 1], got ",
              warmup_min_ratio);
    ZP_EXPECT(cos_min_ratio >= 0.0 && cos_min_ratio <= 1.0,
              "schedule: WarmupCosineLR: cos_min_ratio must be in [0, 1], got ", cos_min_ratio);
  }
  // The multiplier of base_lr; does not check (lr() does).
  double ratio(std::int64_t it) const {
    const std::int64_t w = detail::warmup_steps(warmup_num_steps);
    if (it < w) {
      const double f = detail::warmup_fraction(warmup_type, it, w);
      return warmup_min_ratio + f * (1.0 - warmup_min_ratio);
    }
    const double done = double(it - w + 1),
                 span = double(std::max<std::int64_t>(1, total_num_steps - w));
    const double c = (1.0 + std::cos(std::numbers::pi * done / span)) / 2.0;
    return std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * c);
  }
  double lr(std::int64_t it) const {
    check();
    detail::check_iteration(it);
    return base_lr * ratio(it);
  }
};

// DeepSpeed OneCycle: lr rises linearly from cycle_min_lr to cycle_max_lr over
// cycle_first_step_size steps, falls back over cycle_second_step_size (0 = same as the first),
// then decays as cycle_min_lr / (1 + decay_lr_rate * (steps past the cycle) / decay_step_size).
// Momentum moves the opposite way between cycle_max_mom and cycle_min_mom.
struct OneCycle {
  double cycle_min_lr = 1e-4, cycle_max_lr = 1e-3;
  double decay_lr_rate = 0.0;
  std::int64_t cycle_first_step_size = 2000;
  std::int64_t cycle_second_step_size = 0;  // 0: equal to cycle_first_step_size
  std::int64_t decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9, decay_mom_rate = 0.0;

  void check() const {
    zp::detail::expect_finite_non_negative(cycle_min_lr, "schedule: OneCycle", "cycle_min_lr");
    zp::detail::expect_finite_non_negative(cycle_max_lr, "schedule: OneCycle", "cycle_max_lr");
    zp::detail::expect_finite_non_negative(decay_lr_rate, "schedule: OneCycle", "decay_lr_rate");
    ZP_EXPECT(cycle_first_step_size >= 1,
              "schedule: OneCycle: cycle_first_step_size must be >= 1, got ",
              cycle_first_step_size);
    ZP_EXPECT(
        cycle_second_step_size >= 0,
        "schedule: OneCycle: cycle_second_step_size must be >= 0 (0 = same as the first), got ",
        cycle_second_step_size);
    // cycle_size() adds the two.
    ZP_EXPECT(cycle_first_step_size <= std::numeric_limits<std::int64_t>::max() - second(),
              "schedule: OneCycle: cycle_first_step_size (", cycle_first_step_size,
              ") + cycle_second_step_size (", cycle_second_step_size, ") overflows");
    ZP_EXPECT(decay_step_size >= 0, "schedule: OneCycle: decay_step_size must be >= 0, got ",
              decay_step_size);
    // The momentum is Adam's beta1: in [0, 1).
    ZP_EXPECT(cycle_min_mom >= 0 && cycle_min_mom < 1,
              "schedule: OneCycle: cycle_min_mom must be in [0, 1), got ", cycle_min_mom);
    ZP_EXPECT(cycle_max_mom >= 0 && cycle_max_mom < 1,
              "schedule: OneCycle: cycle_max_mom must be in [0, 1), got ", cycle_max_mom);
    ZP_EXPECT(cycle_min_mom <= cycle_max_mom, "schedule: OneCycle: cycle_min_mom (", cycle_min_mom,
              ") must be <= cycle_max_mom (", cycle_max_mom, ")");
    ZP_EXPECT(std::isfinite(decay_mom_rate),
              "schedule: OneCycle: decay_mom_rate must be finite, got ", decay_mom_rate);
  }

  std::int64_t second() const {
    return cycle_second_step_size > 0 ? cycle_second_step_size : cycle_first_step_size;
  }
  std::int64_t cycle_size() const { return cycle_first_step_size + second(); }
  // 0 at the cycle's ends, 1 at its peak.
  double height(std::int64_t it) const {
    const double total = double(cycle_size());
    const double ratio = double(cycle_first_step_size) / total;
    const double b = double(it + 1);
    const double x = 1.0 + b / total - std::floor(1.0 + b / total);
    return x <= ratio ? x / ratio : (x - 1.0) / (ratio - 1.0);
  }
  double decay_interval(std::int64_t it) const {
    const double past = double(it - cycle_size() + 1);
    return decay_step_size > 0 ? past / double(decay_step_size) : 0.0;
  }
  double lr(std::int64_t it) const {
    check();
    detail::check_iteration(it);
    if (it < cycle_size()) return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * height(it);
    return cycle_min_lr / (1.0 + decay_lr_rate * decay_interval(it));
  }
  // The momentum (Adam's beta1) for this iteration; cycle_max_mom when cycling is off.
  double momentum(std::int64_t it) const {
    check();
    detail::check_iteration(it);
    if (!cycle_momentum) return cycle_max_mom;
    if (it < cycle_size()) return cycle_max_mom - (cycle_max_mom - cycle_min_mom) * height(it);
    const double m = cycle_max_mom * (1.0 + decay_mom_rate * decay_interval(it));
    ZP_EXPECT(m >= 0 && m < 1, "schedule: OneCycle: the momentum at step ", it, " is ", m,
              " (cycle_max_mom ", cycle_max_mom, " x (1 + decay_mom_rate ", decay_mom_rate, " x ",
              decay_interval(it), ")), outside Adam's beta1 range [0, 1)");
    return m;
  }
};

// Any of the above, for code that picks the schedule at run time (a ds_config.json loader).
using Any = std::variant<Constant, WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle>;
inline double lr(const Any& s, std::int64_t it) {
  return std::visit([it](const auto& x) { return x.lr(it); }, s);
}

}  // namespace zp::schedule
