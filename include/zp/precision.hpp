// zp/precision.hpp: the loss scaler of mixed-precision training.
//
// fp16 gradients underflow unless the loss is multiplied by a large factor before backward; the
// optimizer step divides it out again (StepScalars::grad_mul). A dynamic scaler follows the
// DeepSpeed/Megatron algorithm: on an overflowing step (any inf/nan in any rank's gradients) the
// step is skipped and, after `hysteresis` overflows, the scale halves; after `window` clean steps
// since the last overflow it doubles. bf16 and fp32 training need no scaling: LossScaler::none().
// Neither kind loops forever on gradients that always overflow: a dynamic scale throws at its
// minimum, a constant one (none, fixed) after `max_skipped_in_row` overflowing steps in a row.
//
// Every rank must call update() with the same (all-reduced) overflow flag, so all ranks hold
// the same scale. The whole state is a small value (State) that checkpoints save and restore.
#pragma once

#include <cstdint>
#include <limits>

#include "zp/error.hpp"

namespace zp {

// Settings of a dynamic scale; the defaults are DeepSpeed's (initial_scale_power 16,
// loss_scale_window 1000, hysteresis 2, min_loss_scale 1).
struct DynamicScale {
  float initial_scale = 65536.0f;
  std::int64_t window = 1000;  // clean steps since the last overflow before the scale grows
  int hysteresis = 2;          // overflows tolerated before the scale shrinks
  bool consecutive_hysteresis = false;  // refill hysteresis on every clean step, not only on growth
  float min_scale = 1.0f;
  float factor = 2.0f;             // growth and backoff factor
  bool error_at_min_scale = true;  // overflow at min_scale throws instead of looping forever
};

class LossScaler {
 public:
  enum class Kind : std::uint8_t { none = 0, fixed = 1, dynamic = 2 };

  // Everything that changes during training; saved and restored by checkpoints.
  struct State {
    float scale = 1.0f;
    std::int64_t iter = 0;            // update() calls so far
    std::int64_t last_overflow = -1;  // iter of the most recent overflow, -1 if none
    int hysteresis = 1;               // overflows left before the next shrink
    std::int64_t skipped = 0;         // steps skipped for overflow
    std::int64_t skipped_in_row = 0;  // of those, the ones since the last applied step
    friend bool operator==(const State&, const State&) = default;
  };

  // A constant scale cannot adapt, and a skipped step leaves the weights as they were: gradients
  // that overflow because of the weights overflow on every later step. update() throws at this
  // many overflowing steps in a row (0: never); the weights stay those before the first of them.
  static constexpr std::int64_t default_max_skipped_in_row = 100;

  // bf16 / fp32: scale 1 forever; an overflow still skips the step.
  static LossScaler none(std::int64_t max_skipped_in_row = default_max_skipped_in_row) {
    return LossScaler(Kind::none, DynamicScale{.initial_scale = 1.0f}, max_skipped_in_row);
  }
  // A constant scale (DeepSpeed's "loss_scale": value > 0).
  static LossScaler fixed(float scale,
                          std::int64_t max_skipped_in_row = default_max_skipped_in_row) {
    ZP_EXPECT(scale > 0 && scale < 3.0e38f,
              "loss scaler: a fixed scale must be positive and below 3e38, got ", scale);
    return LossScaler(Kind::fixed, DynamicScale{.initial_scale = scale}, max_skipped_in_row);
  }
  static LossScaler dynamic(const DynamicScale& config = {}) {
    // Every float test is written so that NaN fails it; the upper bounds reject inf.
    constexpr float most = std::numeric_limits<float>::max();
    ZP_EXPECT(config.initial_scale > 0 && config.initial_scale <= most,
              "loss scaler: initial_scale must be positive and finite, got ", config.initial_scale);
    ZP_EXPECT(config.min_scale > 0 && config.min_scale <= config.initial_scale,
              "loss scaler: min_scale must be in (0, initial_scale = ", config.initial_scale,
              "], got ", config.min_scale);
    ZP_EXPECT(config.window >= 1, "loss scaler: window must be at least 1, got ", config.window);
    ZP_EXPECT(config.hysteresis >= 1, "loss scaler: hysteresis must be at least 1, got ",
              config.hysteresis);
    ZP_EXPECT(config.factor > 1 && config.factor <= most,
              "loss scaler: factor must be finite and > 1, got ", config.factor);
    return LossScaler(Kind::dynamic, config, 0);
  }

  // How far a dynamic scale grows (from a lower initial_scale): fp16 gradients scaled past it
  // overflow unless under 2^-48, and times any gradient_accumulation_steps (< 2^63) it stays
  // finite in fp32.
  static constexpr double max_growth = 0x1p64;

  Kind kind() const noexcept { return kind_; }
  const DynamicScale& config() const noexcept { return config_; }
  // none and fixed: the overflowing steps in a row that throw (0: no limit); dynamic: 0.
  std::int64_t max_skipped_in_row() const noexcept { return max_in_row_; }
  // Multiply the loss by this before backward.
  float scale() const noexcept { return state_.scale; }
  // 1/scale, the factor that unscales the gradients (fold a clip coefficient in with
  // optim::grad_mul(scale(), clip)).
  float inv_scale() const noexcept { return float(1.0 / double(state_.scale)); }

  // Records one step's global overflow flag and adjusts the scale. Returns true when the step
  // must be applied, false when it must be skipped. Throws zp::Error, changing nothing, where
  // training has diverged and looping would never end: a dynamic scale that overflows while
  // already at min_scale, a constant one at max_skipped_in_row() overflows in a row.
  bool update(bool overflow) {
    if (overflow) {
      expect_progress();
      ++state_.skipped;
      ++state_.skipped_in_row;
    } else {
      state_.skipped_in_row = 0;
    }
    if (kind_ == Kind::dynamic) {
      if (overflow) {
        if (config_.hysteresis == 1 || state_.hysteresis == 1) {
          const float next = state_.scale / config_.factor;
          state_.scale = next > config_.min_scale ? next : config_.min_scale;
        } else {
          --state_.hysteresis;
        }
        state_.last_overflow = state_.iter;
      } else {
        if (config_.consecutive_hysteresis) state_.hysteresis = config_.hysteresis;
        if ((state_.iter - state_.last_overflow) % config_.window == 0) {
          if (!config_.consecutive_hysteresis) state_.hysteresis = config_.hysteresis;
          // Never past max_growth: gradients that cannot overflow (bf16, fp32) would grow it to
          // inf, which unscales every gradient to 0.
          const double next = double(state_.scale) * double(config_.factor);
          if (next <= max_growth) state_.scale = float(next);
        }
      }
    }
    ++state_.iter;
    return !overflow;
  }

  const State& state() const noexcept { return state_; }
  // Restores a saved state; the settings (kind, config) come from the constructor.
  void load(const State& s) {
    ZP_EXPECT(s.scale > 0 && s.scale <= std::numeric_limits<float>::max(),
              "loss scaler: saved scale must be positive and finite, got ", s.scale);
    ZP_EXPECT(s.hysteresis >= 1, "loss scaler: saved hysteresis must be at least 1, got ",
              s.hysteresis);
    ZP_EXPECT(s.iter >= 0, "loss scaler: saved iter must be >= 0, got ", s.iter);
    ZP_EXPECT(s.skipped >= 0 && s.skipped <= s.iter,
              "loss scaler: saved skipped must be in [0, iter = ", s.iter, "], got ", s.skipped);
    ZP_EXPECT(s.skipped_in_row >= 0 && s.skipped_in_row <= s.skipped,
              "loss scaler: saved skipped_in_row must be in [0, skipped = ", s.skipped, "], got ",
              s.skipped_in_row);
    // update() records an overflow at iter, then counts that iter: a saved one is always older.
    ZP_EXPECT(s.last_overflow >= -1 && s.last_overflow < s.iter,
              "loss scaler: saved last_overflow must be in [-1, iter = ", s.iter, "), got ",
              s.last_overflow);
    ZP_EXPECT(kind_ == Kind::dynamic || s.scale == state_.scale, "loss scaler: saved scale ",
              s.scale, " differs from this non-dynamic scaler's ", state_.scale);
    state_ = s;
  }

 private:
  LossScaler(Kind kind, const DynamicScale& config, std::int64_t max_skipped_in_row)
      : kind_(kind), config_(config), max_in_row_(max_skipped_in_row) {
    ZP_EXPECT(max_skipped_in_row >= 0,
              "loss scaler: max_skipped_in_row must be >= 0 (0: no limit), got ",
              max_skipped_in_row);
    state_.scale = config.initial_scale;
    state_.hysteresis = config.hysteresis;
  }

  // The overflow about to be recorded ends training (see update()).
  void expect_progress() const {
    const std::int64_t steps = state_.iter + 1, skipped = state_.skipped + 1,
                       in_row = state_.skipped_in_row + 1;
    if (kind_ == Kind::dynamic) {
      if (config_.error_at_min_scale && state_.scale <= config_.min_scale &&
          (config_.hysteresis == 1 || state_.hysteresis == 1))
        throw Error(Errc::invalid_argument,
                    detail::cat("loss scaler: gradients overflow at the minimum loss scale ",
                                config_.min_scale, " (", skipped, " of ", steps,
                                " steps skipped); lower the learning rate or min_scale"));
    } else if (max_in_row_ > 0 && in_row >= max_in_row_) {
      throw Error(Errc::invalid_argument,
                  detail::cat("loss scaler: ", in_row,
                              " steps in a row had inf/nan gradients and were skipped (", skipped,
                              " of ", steps, " steps skipped, loss scale ", state_.scale,
                              "); a skipped step leaves the weights unchanged, so "
                              "this would repeat: check the data and lower the learning rate, "
                              "or allow more with max_skipped_in_row (now ",
                              max_in_row_, ", 0: no limit)"));
    }
  }

  Kind kind_;
  DynamicScale config_;
  std::int64_t max_in_row_;
  State state_;
};

}  // namespace zp
