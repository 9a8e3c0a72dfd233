// zp/module_guard.hpp: the engine's module boundaries. ModuleGuard is the RAII guard that
// Engine::forward(m) and backward(m) return; ModuleTracker keeps which guards are open and which
// modules ran backward in the current micro-step, and names the misuse when a call comes at the
// wrong moment.
#pragma once

#include <cstddef>
#include <exception>
#include <memory>
#include <utility>
#include <vector>

#include "zp/error.hpp"

namespace zp {

// RAII module boundary of engine E. Move-only; errors raised when it ends are rethrown by the
// engine's next call. A backward guard ended by an exception (unwinding) does not launch its
// buckets: the module's gradients are incomplete, so the engine refuses every later call but
// destruction. E::guard_ended(m, backward, by_exception) is noexcept. The guard reaches its
// engine through a pointer they share, which the engine's destructor sets to null: a guard that
// outlives its engine ends doing nothing.
template <class E>
class [[nodiscard]] ModuleGuard {
 public:
  ModuleGuard(ModuleGuard&& o) noexcept
      : e_(std::move(o.e_)), m_(o.m_), backward_(o.backward_), unwinding_(o.unwinding_) {}
  ModuleGuard& operator=(ModuleGuard&&) = delete;
  ~ModuleGuard() { end(std::uncaught_exceptions() > unwinding_); }
  // Ends the module early (the destructor then does nothing).
  void release() { end(false); }

 private:
  friend E;
  ModuleGuard(std::shared_ptr<E*> e, int m, bool backward)
      : e_(std::move(e)), m_(m), backward_(backward), unwinding_(std::uncaught_exceptions()) {}
  void end(bool by_exception) noexcept {
    if (const auto e = std::exchange(e_, nullptr); e && *e)
      (*e)->guard_ended(m_, backward_, by_exception);
  }
  std::shared_ptr<E*> e_;
  int m_;
  bool backward_;
  int unwinding_;
};

// Which module guards are open and which modules ran backward in this micro-step. `where` is a
// callable giving "optimizer step k (micro-step j of n)" for messages (called only on failure).
class ModuleTracker {
 public:
  explicit ModuleTracker(int modules) : mods_(std::size_t(modules)) {}

  int count() const noexcept { return int(mods_.size()); }
  void check(int m) const {
    ZP_EXPECT(m >= 0 && m < count(), "engine: module ", m, " is not in [0, ", count(), ")");
  }
  template <class Where>
  void expect_first_backward(int m, Where&& where) const {
    ZP_EXPECT(
        !mods_[std::size_t(m)].backward_done, "engine: backward(", m, ") entered a second time in ",
        where(),
        "; each module's backward runs once per micro-step (call step() after every micro-step)");
  }
  void ran_backward(int m) noexcept {
    mods_[std::size_t(m)].backward_done = true;
    window_backward_ = guards_used_ = true;
  }
  void opened(int m, bool backward) noexcept {
    ++(backward ? mods_[std::size_t(m)].backward_open : mods_[std::size_t(m)].forward_open);
  }
  void closed(int m, bool backward) noexcept {
    --(backward ? mods_[std::size_t(m)].backward_open : mods_[std::size_t(m)].forward_open);
  }

  // step(): every guard has ended; backward may run again in the next micro-step. At the
  // accumulation boundary (`boundary`) some backward guard must have run in the window, if the
  // engine needs them (`guarded`) or they ran before: else the update would come from zero
  // gradients, and momentum and weight decay would still move every parameter. (Stage 0/1
  // without guards cannot tell: the model writes the gradients itself.) Throws before changing
  // anything.
  template <class Where>
  void end_micro_step(Where&& where, bool boundary, bool guarded) {
    for (int m = 0; m < count(); ++m) {
      const State& st = mods_[std::size_t(m)];
      ZP_EXPECT(st.forward_open == 0 && st.backward_open == 0, "engine: step() called in ", where(),
                " while the ", st.backward_open ? "backward" : "forward", " guard of module ", m,
                " is still open; end every guard (let it leave its scope, or call release()) "
                "before step()");
    }
    ZP_EXPECT(!boundary || window_backward_ || !(guarded || guards_used_), "engine: step() ends ",
              where(),
              " but no backward guard ran since the last optimizer step: its update would come "
              "from zero gradients; run the micro-steps' backward(m) before step()");
    for (auto& st : mods_) st.backward_done = false;
    if (boundary) window_backward_ = false;
  }
  // No guard open and no backward run since the last step(): `what` may look at the buffers.
  void expect_idle(const char* what) const {
    for (int m = 0; m < count(); ++m) {
      const State& st = mods_[std::size_t(m)];
      ZP_EXPECT(st.forward_open + st.backward_open == 0 && !st.backward_done, "engine: ", what,
                " while module ", m, " is inside a guard or has run backward without step()");
    }
  }

 private:
  struct State {
    int forward_open = 0, backward_open = 0;  // guards of this module not ended yet
    bool backward_done = false;               // backward(m) ran in this micro-step
  };
  std::vector<State> mods_;
  bool window_backward_ = false;  // some backward(m) ran since the last accumulation boundary
  bool guards_used_ = false;      // some backward(m) ever ran
};

}  // namespace zp
