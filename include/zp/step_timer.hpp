// zp/step_timer.hpp: the wall-clock bookkeeping behind StepTimes (engine_config.hpp): which
// phase of an optimizer step each moment belongs to, from the end of one step to the end of
// the next.
//
// Guards of one kind (forward or backward) count once while any of them is open, so nested or
// overlapping guards are not counted twice; the gather waits inside them are a phase of their
// own. In step(), each phase is charged the time since the previous one ended.
#pragma once

#include <algorithm>
#include <chrono>
#include <utility>

#include "zp/engine_config.hpp"

namespace zp {

class StepTimer {
 public:
  using Clock = std::chrono::steady_clock;
  enum Guard { forward = 0, backward = 1 };

  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  // A guard's start, taken before it waits for gathers.
  struct Stamp {
    Clock::time_point at;
    double gather_wait;
  };
  Stamp stamp() const { return {Clock::now(), times_.gather_wait}; }
  // A guard of kind g opened at s (once it started successfully), or ended.
  void open(Guard g, Stamp s) {
    if (open_[g]++ == 0) opened_[g] = s;
  }
  void close(Guard g) {
    if (--open_[g] > 0) return;
    double& field = g == forward ? times_.forward : times_.backward;
    field += seconds(opened_[g].at, Clock::now()) - (times_.gather_wait - opened_[g].gather_wait);
  }
  void add_gather_wait(double s) { times_.gather_wait += s; }

  // step() began: its phases are charged from now on.
  void begin_step() { entered_ = mark_ = Clock::now(); }
  // Charges the time since the previous phase ended to `field`.
  void phase(double StepTimes::*field) {
    const auto now = Clock::now();
    times_.*field += seconds(mark_, now);
    mark_ = now;
  }
  // The gradient reductions ran from `first` (their first launch) to `done`; step() waited
  // through the part after it began.
  void reductions(Clock::time_point first, Clock::time_point done) {
    times_.reduce_span += seconds(first, done);
    times_.reduce_exposed += seconds(std::max(first, entered_), done);
  }
  // Ends the window at the end of the last phase: its times, and a fresh window from there.
  StepTimes end_window() {
    times_.total = seconds(window_start_, mark_);
    window_start_ = mark_;
    return std::exchange(times_, StepTimes{});
  }

 private:
  StepTimes times_;
  Clock::time_point window_start_ = Clock::now(), entered_{}, mark_{};
  Stamp opened_[2]{};
  int open_[2] = {0, 0};
};

}  // namespace zp
