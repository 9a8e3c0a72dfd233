// zp/pipeline.hpp: pipeline parallelism. The model is cut into `stages` consecutive stages, one
// per rank of the pipeline group (ProcessGrid::pp()); a batch is cut into m micro-batches that
// flow forward through the stages and back as gradients. Runner plays one stage's part of one
// pipeline flush: it moves the boundary activations and their gradients, and calls the stage's
// forward and backward in the order of a schedule.
//
// Schedules (both end in a flush: every backward of the batch is done before run() returns, so
// the optimizer step sees the gradients of all m micro-batches, as in data-parallel training):
//  - gpipe (Huang et al. 2019, "GPipe"): every stage runs F0..F(m-1), then B0..B(m-1). Backward
//    in micro-batch order (first in, first out), the order 1F1B uses too: every boundary then
//    carries micro-batches 0..m-1 in order in both directions under either schedule, so the two
//    differ only in when a stage interleaves its backwards, and with uniform stages the order of
//    the backwards does not change the makespan. Holds all m micro-batches' activations at once.
//  - one_f_one_b, PipeDream-Flush (Narayanan et al. 2021) as Megatron-LM's non-interleaved
//    schedule: stage s runs w = min(stages - s - 1, m) warm-up forwards, then pairs "F(k + w),
//    B(k)" (one forward, one backward), then the remaining backwards. Same makespan as gpipe,
//    but stage s holds at most min(m, stages - s) micro-batches' activations instead of m.
//
// The bubble: with the same forward time tf and backward time tb on every stage, a flush takes
// (m + stages - 1)(tf + tb), of which each stage computes m(tf + tb); the rest is idle, the
// fraction (stages - 1) / (m + stages - 1) for both schedules (bubble_fraction). More
// micro-batches shrink it; 1F1B makes the larger m affordable in memory.
//
//   zp::ProcessGrid<B> grid(world, {.dp = 2, .pp = 4});
//   zp::pipeline::Runner<B, bf16> pipe(grid.pp(), zp::pipeline::Schedule::one_f_one_b,
//                                      /*micro_batches=*/8, micro_batch * seq * hidden);
//   std::vector<Saved> saved(pipe.slots());   // this stage's own per-micro-batch activations
//   int backwards = 0;                         // the engine's accumulation steps: 8 as well
//   auto stats = pipe.run(
//       [&](int k, int slot, std::span<const bf16> in, std::span<bf16> out) {
//         stage.forward(k, in, out, saved[slot]); },          // stage 0: in is empty (reads batch k)
//       [&](int k, int slot, std::span<const bf16> out_grad, std::span<bf16> in_grad) {
//         stage.backward(saved[slot], out_grad, in_grad);     // last stage: out_grad is empty
//         if (++backwards < 8) engine.step(); });             // ends a micro-step
//   auto r = engine.step();  // after run(): the boundary, the 8 micro-batches' gradients averaged
//
// Communication per run(): 2m messages of activation_elems elements over each boundary (m
// activations forward, m gradients back), point to point between neighbours only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <span>
#include <vector>

#include "zp/agreement.hpp"
#include "zp/collective.hpp"
#include "zp/error.hpp"

namespace zp::pipeline {

enum class Schedule : std::uint8_t { gpipe, one_f_one_b };

namespace detail {
inline constexpr zp::detail::EnumValueNames schedule_values{"Schedule"};
}

// A value outside the enum names its number, e.g. "Schedule(7)".
constexpr const char* name(Schedule s) noexcept {
  switch (s) {
    case Schedule::gpipe: return "gpipe";
    case Schedule::one_f_one_b: return "1f1b";
  }
  return detail::schedule_values[std::uint8_t(s)];
}

// One step of a stage's schedule: the forward or backward of micro-batch `micro`.
struct Op {
  enum class Kind : std::uint8_t { forward, backward } kind;
  int micro;
  friend bool operator==(const Op&, const Op&) = default;
};

namespace detail {
inline void check_position(Schedule s, int stages, int stage, int micro_batches) {
  ZP_EXPECT(s == Schedule::gpipe || s == Schedule::one_f_one_b, "pipeline: schedule ", name(s),
            " is not one of gpipe, one_f_one_b");
  ZP_EXPECT(stages >= 1, "pipeline: stages must be >= 1, got ", stages);
  ZP_EXPECT(stage >= 0 && stage < stages, "pipeline: stage ", stage, " is not in [0, ", stages,
            ")");
  ZP_EXPECT(micro_batches >= 1, "pipeline: micro_batches must be >= 1, got ", micro_batches);
}
}  // namespace detail

// The order in which stage `stage` of `stages` runs the forwards and backwards of micro-batches
// 0..micro_batches-1 (see the file comment). Each appears exactly once, F(k) before B(k), and
// forwards and backwards are each in micro-batch order.
inline std::vector<Op> schedule(Schedule s, int stages, int stage, int micro_batches) {
  detail::check_position(s, stages, stage, micro_batches);
  const int m = micro_batches;
  std::vector<Op> ops;
  ops.reserve(2 * std::size_t(m));
  const auto fwd = [&](int k) { ops.push_back({Op::Kind::forward, k}); };
  const auto bwd = [&](int k) { ops.push_back({Op::Kind::backward, k}); };
  if (s == Schedule::gpipe) {
    for (int k = 0; k < m; ++k) fwd(k);
    for (int k = 0; k < m; ++k) bwd(k);
    return ops;
  }
  // Warm-up: just enough forwards that the first backward's gradient, coming back from the last
  // stage, arrives when this stage would otherwise sit idle.
  const int warmup = std::min(stages - stage - 1, m);
  for (int k = 0; k < warmup; ++k) fwd(k);
  for (int k = 0; k < m - warmup; ++k) {
    fwd(k + warmup);
    bwd(k);
  }
  for (int k = m - warmup; k < m; ++k) bwd(k);
  return ops;
}

// The idle fraction of every stage in a flush when all stages take the same time per micro-batch:
// (stages - 1) / (micro_batches + stages - 1), for gpipe and 1F1B alike. NaN for stages < 1 or
// micro_batches < 1.
constexpr double bubble_fraction(int stages, int micro_batches) noexcept {
  if (stages < 1 || micro_batches < 1) return std::numeric_limits<double>::quiet_NaN();
  return double(stages - 1) / (double(micro_batches) + double(stages - 1));  // no int overflow
}

// The most micro-batches stage `stage` holds forwarded but not yet backwarded (its activation
// memory, in micro-batches): gpipe m, 1F1B min(m, stages - stage).
inline int max_in_flight(Schedule s, int stages, int stage, int micro_batches) {
  detail::check_position(s, stages, stage, micro_batches);
  return s == Schedule::gpipe ? micro_batches : std::min(micro_batches, stages - stage);
}

// What one run() measured on this stage.
struct Stats {
  double total = 0;  // seconds in run()
  double busy = 0;   // seconds inside the user's forward and backward callbacks
  double idle() const noexcept { return total > 0 ? 1.0 - busy / total : 0.0; }
  int peak_in_flight = 0;  // most micro-batches forwarded but not yet backwarded at once
  std::uint64_t sent = 0, received = 0;  // messages (activations + gradients) sent / received
};

// One stage of a pipeline over the group `pp` (rank = stage, size = stages), which must outlive
// it. Every stage must construct its Runner with the same schedule, micro_batches and
// activation_elems (the constructor is collective over pp and checks that, an invalid_argument
// on every stage), and call run() the same number of times.
//
// Memory, allocated once here: slots() x activation_elems elements each for the received inputs
// and the sent gradients (not on stage 0) and for the outputs (not on the last stage), plus one
// gradient receive buffer (not on the last stage).
template <Backend B, Element A>
class Runner {
  // On a GPU, NCCL's sends are stream-ordered (a send waiting for its recv holds back the recv
  // queued behind it, which 1F1B needs to pass) and the boundaries would live in device memory.
  static_assert(
      B::memory == MemorySpace::host,
      "zp::pipeline::Runner keeps boundary activations in host memory: device backends (nccl, "
      "cuda_threads) are not supported yet");

 public:
  // activation_elems: elements of one micro-batch's boundary activation (the same on every
  // boundary, e.g. micro_batch * seq * hidden).
  Runner(Collective<B>& pp, Schedule s, int micro_batches, std::size_t activation_elems)
      : pp_(pp),
        schedule_(s),
        stages_(pp.size()),
        stage_(pp.rank()),
        m_(micro_batches),
        n_(activation_elems) {
    on_every_rank(pp, [&] {
      ops_ = pipeline::schedule(s, stages_, stage_, micro_batches);
      slots_ = max_in_flight(s, stages_, stage_, micro_batches);
      const std::size_t per = zp::detail::checked_mul(std::size_t(slots_), n_, "pipeline: ", slots_,
                                                      " slots of activation_elems");
      if (!first()) {
        in_.resize(per);
        in_grad_.resize(per);
        grad_sends_.resize(std::size_t(slots_));
      }
      if (!last()) {
        out_.resize(per);
        out_grad_.resize(n_);
        act_sends_.resize(std::size_t(slots_));
      }
    });
    expect_same_everywhere();
  }

  // The activation sets this stage's user needs: max_in_flight for this stage.
  int slots() const noexcept { return slots_; }
  std::size_t activation_elems() const noexcept { return n_; }
  int stage() const noexcept { return stage_; }
  int stages() const noexcept { return stages_; }
  int micro_batches() const noexcept { return m_; }
  Schedule schedule() const noexcept { return schedule_; }

  // Runs this stage's schedule once (one pipeline flush). Collective over pp. Returns when this
  // stage's part is done and its sends were received; it is not a barrier (other stages may
  // still be exchanging with each other).
  //   fwd(int micro, int slot, std::span<const A> in, std::span<A> out)
  //     in: the previous stage's output for this micro-batch (empty on stage 0); out: to fill
  //     with what the next stage receives (empty on the last stage).
  //   bwd(int micro, int slot, std::span<const A> out_grad, std::span<A> in_grad)
  //     out_grad: d loss / d out from the next stage (empty on the last stage: its loss seeds
  //     backward); in_grad: to fill with d loss / d in for the previous stage (empty on stage 0).
  //   slot in [0, slots()): where the micro-batch's activations live; reused only after that
  //   micro-batch's backward returned. The runner owns the buffers; a forward's in and out stay
  //   valid and unchanged until its backward returns (the backward may read them, e.g. in for a
  //   weight gradient); out must not be written after the forward returns (it is being sent).
  // If a callback or the backend throws, the exception leaves run() once this stage's pending
  // sends are settled (see settle()); the other stages then fail as the backend reports it (on
  // threads: Errc::aborted once run_threads poisons the group).
  template <class Fwd, class Bwd>
  Stats run(Fwd&& fwd, Bwd&& bwd) {
    using clock = std::chrono::steady_clock;
    const auto seconds = [](clock::time_point t) {
      return std::chrono::duration<double>(clock::now() - t).count();
    };
    const auto t0 = clock::now();
    Stats st;
    int in_flight = 0;
    try {
      for (const Op& op : ops_) {
        const int k = op.micro;
        // Forwards and backwards both go in micro-batch order with at most slots() in flight,
        // so micro-batch k - slots(), the slot's previous user, has finished its backward.
        const int slot = k % slots_;
        const auto in = slice(in_, slot), in_grad = slice(in_grad_, slot), out = slice(out_, slot);
        if (op.kind == Op::Kind::forward) {
          if (!first()) {
            pp_.recv(in, stage_ - 1);
            ++st.received;
          }
          // Never blocks in practice: the next stage received this slot's last activation
          // before it sent the gradient that ended that micro-batch here.
          if (!last()) act_sends_[std::size_t(slot)].wait();
          st.peak_in_flight = std::max(st.peak_in_flight, ++in_flight);
          const auto c0 = clock::now();
          fwd(k, slot, std::span<const A>(in), out);
          st.busy += seconds(c0);
          if (!last()) {
            // Async, here and for gradients: with blocking sends (no buffering), in 1F1B stage
            // s would wait in an activation send to s + 1 while s + 1 waits in a gradient send
            // to s. The slot's buffer is rewritten only after this send completed.
            act_sends_[std::size_t(slot)] = pp_.send_async(std::span<const A>(out), stage_ + 1);
            ++st.sent;
          }
        } else {
          const std::span<A> out_grad = last() ? std::span<A>{} : std::span<A>(out_grad_);
          if (!last()) {
            pp_.recv(out_grad, stage_ + 1);
            ++st.received;
          }
          // The previous stage posts this recv right after the forward that let this slot be
          // reused here, so at most a short wait.
          if (!first()) grad_sends_[std::size_t(slot)].wait();
          const auto c0 = clock::now();
          bwd(k, slot, std::span<const A>(out_grad), in_grad);
          st.busy += seconds(c0);
          --in_flight;
          if (!first()) {
            grad_sends_[std::size_t(slot)] =
                pp_.send_async(std::span<const A>(in_grad), stage_ - 1);
            ++st.sent;
          }
        }
      }
      for (auto* sends : {&act_sends_, &grad_sends_})
        for (auto& w : *sends) w.wait();
    } catch (...) {
      std::rethrow_exception(settle(std::current_exception()));
    }
    st.total = seconds(t0);
    return st;
  }

 private:
  using Work = typename Collective<B>::Work;

  bool first() const noexcept { return stage_ == 0; }
  bool last() const noexcept { return stage_ == stages_ - 1; }
  std::span<A> slice(std::vector<A>& buf, int slot) noexcept {
    if (buf.empty()) return {};
    return std::span<A>(buf).subspan(std::size_t(slot) * n_, n_);
  }

  // On failure, waits for this stage's pending sends before the exception leaves run(): the
  // Work destructors would wait for them anyway (the buffers are ours), and waiting here also
  // sees their errors. It cannot hang while the neighbours live: each boundary carries the
  // micro-batches in order, so a neighbour posts the recv of every message sent here before it
  // blocks on one that never will be; and it never first waits on its own send to this stage:
  // an activation's send completed before its slot is reused (the gradient that frees the slot
  // came after it), and this stage received gradient k before sending any activation the next
  // stage needs before it reuses k's slot (by the schedules: k + warm-up < the reusing micro-
  // batch). So the neighbours take the messages, then block until the failure reaches them (on
  // threads, when run_threads poisons the group). The tests throw from every stage position.
  // Which error leaves: the first, unless it only echoes another rank's failure (Errc::aborted)
  // and one of our sends failed for a reason of its own, e.g. a count mismatch with the
  // neighbour, which is then this stage's part of the cause.
  std::exception_ptr settle(std::exception_ptr first_error) noexcept {
    bool echo = false;
    try {
      std::rethrow_exception(first_error);
    } catch (const Error& e) {
      echo = e.category() == Errc::aborted;
    } catch (...) {
    }
    for (auto* sends : {&act_sends_, &grad_sends_})
      for (auto& w : *sends) {
        try {
          w.wait();
        } catch (const Error& e) {
          if (echo && e.category() != Errc::aborted) {
            first_error = std::current_exception();
            echo = false;
          }
        } catch (...) {
        }
        w = Work{};  // a failed wait leaves the handle armed; the next run() must find it idle
      }
    return first_error;
  }

  // What every stage must have the same of: a stage that differs would wait in a recv with no
  // send (micro_batches, schedule) or fail in its neighbours' send/recv check (the sizes).
  void expect_same_everywhere() {
    const std::int64_t mine[] = {
        std::int64_t(schedule_), m_,
        std::int64_t(std::min<std::size_t>(n_, std::numeric_limits<std::int64_t>::max())),
        std::int64_t(sizeof(A))};
    const std::vector<Spread> got = spread(pp_, std::span<const std::int64_t>(mine));
    static constexpr const char* what[] = {"schedule (0: gpipe, 1: 1f1b)", "micro_batches",
                                           "activation_elems", "sizeof(activation element)"};
    for (std::size_t i = 0; i < got.size(); ++i)
      ZP_EXPECT(got[i].same(), "pipeline: every stage must build its Runner with the same ",
                what[i], "; it ranges over [", got[i].lo, ", ", got[i].hi,
                "] on the pipeline group, stage ", stage_, " has ", mine[i]);
  }

  Collective<B>& pp_;
  std::vector<Op> ops_;
  Schedule schedule_;
  int stages_, stage_, m_, slots_ = 0;
  std::size_t n_;
  std::vector<A> in_, out_, out_grad_, in_grad_;
  std::vector<Work> act_sends_, grad_sends_;  // the pending send of each slot's out / in_grad
};

}  // namespace zp::pipeline
