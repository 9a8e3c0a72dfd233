#include "zp/pipeline.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "zp/backend/threads.hpp"
#include "zp/grid.hpp"
#include "expect_error.hpp"
#include "random.hpp"

using zp::Collective;
using zp::Errc;
using zp::backend::run_threads;
using zp::backend::Threads;
using zp::backend::ThreadsOptions;
using zp::pipeline::Op;
using zp::pipeline::Runner;
using zp::pipeline::Schedule;
using namespace std::chrono_literals;

namespace {

constexpr Schedule both[] = {Schedule::gpipe, Schedule::one_f_one_b};

// "F0 F1 B0 ..." from an op list, so a failing comparison shows the sequence.
std::string text(const std::vector<Op>& ops) {
  std::string s;
  for (const Op& op : ops) {
    if (!s.empty()) s += ' ';
    s += (op.kind == Op::Kind::forward ? "F" : "B") + std::to_string(op.micro);
  }
  return s;
}

double elapsed(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// --- 1. the op lists ---------------------------------------------------------------------------

TEST_CASE(
    "schedule(): each stage runs every forward and backward once, F(k) before B(k), holding at "
    "most max_in_flight") {
  for (Schedule s : both)
    for (int p = 1; p <= 8; ++p)
      for (int stage = 0; stage < p; ++stage)
        for (int m = 1; m <= 17; ++m) {
          CAPTURE(zp::pipeline::name(s));
          CAPTURE(p);
          CAPTURE(stage);
          CAPTURE(m);
          const auto ops = zp::pipeline::schedule(s, p, stage, m);
          REQUIRE(ops.size() == 2 * std::size_t(m));
          std::vector<int> fpos(std::size_t(m), -1), bpos(std::size_t(m), -1);
          int in_flight = 0, peak = 0, next_f = 0, next_b = 0;
          for (int i = 0; i < int(ops.size()); ++i) {
            const Op op = ops[std::size_t(i)];
            REQUIRE(op.micro >= 0);
            REQUIRE(op.micro < m);
            auto& pos = op.kind == Op::Kind::forward ? fpos : bpos;
            CHECK(pos[std::size_t(op.micro)] == -1);  // once
            pos[std::size_t(op.micro)] = i;
            if (op.kind == Op::Kind::forward) {
              CHECK(op.micro == next_f++);  // forwards in micro-batch order
              peak = std::max(peak, ++in_flight);
            } else {
              CHECK(op.micro == next_b++);  // backwards in micro-batch order (FIFO slots)
              CHECK(fpos[std::size_t(op.micro)] >= 0);  // after its forward
              --in_flight;
            }
          }
          CHECK(in_flight == 0);
          CHECK(peak == zp::pipeline::max_in_flight(s, p, stage, m));
          CHECK(peak == (s == Schedule::gpipe ? m : std::min(m, p - stage)));
        }
}

TEST_CASE("schedule(): the exact sequences of a 4-stage pipeline, written out by hand") {
  const auto one = Schedule::one_f_one_b;
  // 6 micro-batches: stage s warms up with 3 - s forwards, alternates, then drains.
  CHECK(text(zp::pipeline::schedule(one, 4, 0, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  CHECK(text(zp::pipeline::schedule(one, 4, 1, 6)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  CHECK(text(zp::pipeline::schedule(one, 4, 2, 6)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5");
  CHECK(text(zp::pipeline::schedule(one, 4, 3, 6)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // Fewer micro-batches than stages: the warm-up is cut to m, which is gpipe's order.
  CHECK(text(zp::pipeline::schedule(one, 4, 0, 2)) == "F0 F1 B0 B1");
  CHECK(text(zp::pipeline::schedule(one, 4, 2, 2)) == "F0 F1 B0 B1");
  CHECK(text(zp::pipeline::schedule(one, 4, 3, 2)) == "F0 B0 F1 B1");
  for (int stage = 0; stage < 4; ++stage)
    CHECK(text(zp::pipeline::schedule(Schedule::gpipe, 4, stage, 6)) ==
          "F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5");
  CHECK(text(zp::pipeline::schedule(one, 1, 0, 3)) == "F0 B0 F1 B1 F2 B2");
  CHECK(zp::pipeline::max_in_flight(one, 4, 0, 6) == 4);
  CHECK(zp::pipeline::max_in_flight(one, 4, 3, 6) == 1);
  CHECK(zp::pipeline::max_in_flight(Schedule::gpipe, 4, 3, 6) == 6);
  CHECK(Op{Op::Kind::forward, 2} == Op{Op::Kind::forward, 2});
  CHECK_FALSE(Op{Op::Kind::forward, 2} == Op{Op::Kind::backward, 2});
  static_assert(zp::pipeline::bubble_fraction(1, 7) == 0.0);
  static_assert(zp::pipeline::bubble_fraction(4, 6) == 3.0 / 9.0);
  static_assert(std::string_view(zp::pipeline::name(Schedule::gpipe)) == "gpipe");
  static_assert(std::string_view(zp::pipeline::name(Schedule::one_f_one_b)) == "1f1b");
  CHECK(std::isnan(zp::pipeline::bubble_fraction(0, 4)));
}

TEST_CASE("schedule() and max_in_flight() reject a bad position naming the value") {
  for (auto f :
       {+[](int p, int s, int m) { (void)zp::pipeline::schedule(Schedule::gpipe, p, s, m); },
        +[](int p, int s, int m) {
          (void)zp::pipeline::max_in_flight(Schedule::one_f_one_b, p, s, m);
        }}) {
    zp::test::expect_invalid([&] { f(0, 0, 4); }, {"stages must be >= 1, got 0"});
    zp::test::expect_invalid([&] { f(4, 4, 4); }, {"stage 4 is not in [0, 4)"});
    zp::test::expect_invalid([&] { f(4, -1, 4); }, {"stage -1 is not in [0, 4)"});
    zp::test::expect_invalid([&] { f(4, 0, 0); }, {"micro_batches must be >= 1, got 0"});
  }
  zp::test::expect_invalid([&] { (void)zp::pipeline::schedule(Schedule(7), 2, 0, 1); },
                           {"Schedule(7)"});
}

// --- 2. logical time ---------------------------------------------------------------------------

namespace {

// Every stage executes its op list in order; F(s,k) starts once stage s is free and F(s-1,k)
// ended, B(s,k) once B(s+1,k) ended (on the last stage, once its own F(s,k) ended, which the
// list order implies). Integer time units, so the idle fractions compare exactly.
struct Timeline {
  std::int64_t makespan = 0;
  std::vector<std::int64_t> busy;
  bool deadlocked = false;
};

Timeline simulate(Schedule sched, int p, int m, std::int64_t tf, std::int64_t tb) {
  std::vector<std::vector<Op>> ops;
  for (int s = 0; s < p; ++s) ops.push_back(zp::pipeline::schedule(sched, p, s, m));
  std::vector<std::vector<std::int64_t>> f_end(std::size_t(p),
                                               std::vector<std::int64_t>(std::size_t(m), -1)),
      b_end = f_end;
  std::vector<std::size_t> next(std::size_t(p), 0);
  std::vector<std::int64_t> free_at(std::size_t(p), 0);
  Timeline t;
  t.busy.assign(std::size_t(p), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto us = std::size_t(s);
      while (next[us] < ops[us].size()) {
        const Op op = ops[us][next[us]];
        const auto k = std::size_t(op.micro);
        const bool fwd = op.kind == Op::Kind::forward;
        const std::int64_t dep =
            fwd ? (s == 0 ? 0 : f_end[us - 1][k]) : (s == p - 1 ? f_end[us][k] : b_end[us + 1][k]);
        if (dep < 0) break;  // waits for another stage
        const std::int64_t end = std::max(free_at[us], dep) + (fwd ? tf : tb);
        (fwd ? f_end : b_end)[us][k] = end;
        free_at[us] = end;
        t.busy[us] += fwd ? tf : tb;
        ++next[us];
        progress = true;
      }
    }
  }
  for (int s = 0; s < p; ++s) {
    t.deadlocked |= next[std::size_t(s)] != ops[std::size_t(s)].size();
    t.makespan = std::max(t.makespan, free_at[std::size_t(s)]);
  }
  return t;
}

}  // namespace

TEST_CASE(
    "in logical time every stage idles bubble_fraction of the flush, and both schedules take (m + "
    "p - 1)(tf + tb)") {
  for (int p = 1; p <= 6; ++p)
    for (int m = 1; m <= 12; ++m)
      for (std::int64_t tb_over_tf : {1, 2}) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(tb_over_tf);
        const std::int64_t tf = 3, tb = tb_over_tf * tf;
        std::int64_t makespan[2] = {};
        for (Schedule s : both) {
          CAPTURE(zp::pipeline::name(s));
          const Timeline t = simulate(s, p, m, tf, tb);
          REQUIRE_FALSE(t.deadlocked);
          // Analytically: the first micro-batch needs p forwards to reach the last stage and p
          // backwards to come back; the other m - 1 add one forward and one backward each on the
          // busiest path.
          CHECK(t.makespan == (m + p - 1) * (tf + tb));
          makespan[s == Schedule::gpipe ? 0 : 1] = t.makespan;
          for (int st = 0; st < p; ++st) {
            CAPTURE(st);
            const std::int64_t busy = t.busy[std::size_t(st)];
            CHECK(busy == m * (tf + tb));
            // 1 - busy/makespan == (p-1)/(m+p-1), cross-multiplied: exact in integers.
            CHECK((t.makespan - busy) * (m + p - 1) == t.makespan * (p - 1));
            CHECK(1.0 - double(busy) / double(t.makespan) ==
                  doctest::Approx(zp::pipeline::bubble_fraction(p, m)).epsilon(1e-12));
          }
        }
        CHECK(makespan[0] == makespan[1]);
      }
}

// --- 3. the runner on the threads backend ------------------------------------------------------

namespace {

// The toy model: stage s computes out = in * w_s + b_s elementwise; the last stage's loss is
// sum(out^2) / 2. One copy of each formula, out of line, used by the runner's callbacks and by
// the serial reference, so both compute the same bits (no contraction into FMA in one place and
// not the other).
template <class A>
[[gnu::noinline]] void affine(std::span<const A> in, const std::vector<A>& w,
                              const std::vector<A>& b, std::span<A> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = in[i] * w[i] + b[i];
}
template <class A>
[[gnu::noinline]] double half_square_sum(std::span<const A> y) {
  double l = 0;
  for (A v : y) l += double(v) * double(v);
  return l / 2;
}
// g = d loss / d out: dw += g * in, db += g, in_grad = g * w.
template <class A>
[[gnu::noinline]] void affine_backward(std::span<const A> g, std::span<const A> in,
                                       const std::vector<A>& w, std::vector<A>& dw,
                                       std::vector<A>& db, std::span<A> in_grad) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    dw[i] += g[i] * in[i];
    db[i] += g[i];
    if (!in_grad.empty()) in_grad[i] = g[i] * w[i];
  }
}

template <class A>
struct Toy {
  int p, m;
  std::size_t n;
  std::uint64_t seed;
  A x(int k, std::size_t i) const {
    return A(zp::test::hash_uniform(seed, std::uint64_t(k) * n + i));
  }
  std::vector<A> param(int stage, int which) const {  // which: 0 = w, 1 = b
    std::vector<A> v(n);
    for (std::size_t i = 0; i < n; ++i)
      v[i] = A(zp::test::hash_uniform(seed + 1 + std::uint64_t(2 * stage + which), i)) *
             A(which ? 0.5 : 1.0);
    return v;
  }
};

template <class A>
struct Grads {
  std::vector<std::vector<A>> dw, db;  // per stage
  std::vector<double> loss;            // per micro-batch
};

// The whole chain on one thread, micro-batch after micro-batch.
template <class A>
Grads<A> serial(const Toy<A>& toy) {
  Grads<A> g;
  const std::size_t n = toy.n;
  g.dw.assign(std::size_t(toy.p), std::vector<A>(n, A(0)));
  g.db = g.dw;
  for (int k = 0; k < toy.m; ++k) {
    std::vector<std::vector<A>> act(std::size_t(toy.p) + 1, std::vector<A>(n));
    for (std::size_t i = 0; i < n; ++i) act[0][i] = toy.x(k, i);
    for (int s = 0; s < toy.p; ++s)
      affine<A>(act[std::size_t(s)], toy.param(s, 0), toy.param(s, 1), act[std::size_t(s) + 1]);
    g.loss.push_back(half_square_sum<A>(act[std::size_t(toy.p)]));
    std::vector<A> grad = act[std::size_t(toy.p)], in_grad(n);
    for (int s = toy.p - 1; s >= 0; --s) {
      affine_backward<A>(grad, act[std::size_t(s)], toy.param(s, 0), g.dw[std::size_t(s)],
                         g.db[std::size_t(s)], s > 0 ? std::span<A>(in_grad) : std::span<A>{});
      grad = in_grad;
    }
  }
  return g;
}

// One stage's part: runs the toy model through a Runner `runs` times over `pp`, checking what
// the runner hands out, and leaves this stage's gradients (of the last run) and the losses in
// `out`. Returns the stage's Stats of the last run.
template <class A>
zp::pipeline::Stats run_stage(Collective<Threads>& pp, Schedule sched, const Toy<A>& toy,
                              Grads<A>& out, int runs) {
  const int s = pp.rank(), p = pp.size(), m = toy.m;
  const std::size_t n = toy.n;
  const bool first = s == 0, last = s == p - 1;
  Runner<Threads, A> pipe(pp, sched, m, n);
  CHECK(pipe.stage() == s);
  CHECK(pipe.stages() == p);
  CHECK(pipe.micro_batches() == m);
  CHECK(pipe.schedule() == sched);
  const int slots = pipe.slots();
  CHECK(slots == zp::pipeline::max_in_flight(sched, p, s, m));
  const auto w = toy.param(s, 0), b = toy.param(s, 1);
  // This stage's own per-slot storage: stage 0 keeps its input, the last stage its output. A
  // middle stage keeps only the runner's `in` span, which must hold until the backward.
  std::vector<A> x(std::size_t(slots) * n), y(std::size_t(slots) * n);
  std::vector<std::span<const A>> saved_in(static_cast<std::size_t>(slots));
  std::vector<int> owner(std::size_t(slots), -1);  // the micro-batch holding each slot
  const auto slice = [&](std::vector<A>& v, int slot) {
    return std::span<A>(v).subspan(std::size_t(slot) * n, n);
  };
  std::vector<A> dw, db;
  zp::pipeline::Stats st;
  for (int run = 0; run < runs; ++run) {
    dw.assign(n, A(0));
    db.assign(n, A(0));
    int next_f = 0, next_b = 0;
    st = pipe.run(
        [&](int k, int slot, std::span<const A> in, std::span<A> o) {
          CHECK(k == next_f++);
          REQUIRE(slot >= 0);
          REQUIRE(slot < slots);
          CHECK(owner[std::size_t(slot)] == -1);  // not shared by two micro-batches in flight
          owner[std::size_t(slot)] = k;
          CHECK(in.size() == (first ? 0 : n));
          CHECK(o.size() == (last ? 0 : n));
          std::span<const A> input = in;
          if (first) {
            auto xs = slice(x, slot);
            for (std::size_t i = 0; i < n; ++i) xs[i] = toy.x(k, i);
            input = xs;
          }
          saved_in[std::size_t(slot)] = input;
          if (last) {
            affine<A>(input, w, b, slice(y, slot));
            out.loss[std::size_t(k)] = half_square_sum<A>(slice(y, slot));
          } else {
            affine<A>(input, w, b, o);
          }
        },
        [&](int k, int slot, std::span<const A> out_grad, std::span<A> in_grad) {
          CHECK(k == next_b++);
          REQUIRE(slot >= 0);
          REQUIRE(slot < slots);
          CHECK(owner[std::size_t(slot)] == k);
          CHECK(out_grad.size() == (last ? 0 : n));
          CHECK(in_grad.size() == (first ? 0 : n));
          const std::span<const A> g = last ? std::span<const A>(slice(y, slot)) : out_grad;
          affine_backward<A>(g, saved_in[std::size_t(slot)], w, dw, db, in_grad);
          owner[std::size_t(slot)] = -1;
        });
    CHECK(next_f == m);
    CHECK(next_b == m);
  }
  out.dw[std::size_t(s)] = dw;
  out.db[std::size_t(s)] = db;
  // Counts: one activation and one gradient per micro-batch over each boundary of this stage.
  const std::uint64_t msgs = std::uint64_t(first ? 0 : m) + std::uint64_t(last ? 0 : m);
  CHECK(st.sent == msgs);
  CHECK(st.received == msgs);
  CHECK(st.peak_in_flight == zp::pipeline::max_in_flight(sched, p, s, m));
  CHECK(st.total > 0);
  CHECK(st.busy >= 0);
  CHECK(st.busy <= st.total);
  CHECK(st.idle() >= 0);
  CHECK(st.idle() <= 1);
  const auto& cs = pp.stats();
  for (auto op : {zp::CollOp::send, zp::CollOp::recv}) {
    CAPTURE(zp::name(op));
    CHECK(cs[op].calls == msgs * std::uint64_t(runs));
    CHECK(cs[op].bytes == msgs * std::uint64_t(runs) * n * sizeof(A));
  }
  // Nothing but the transfers and the constructor's two agreements (its set-up on every rank,
  // the settings' spread)
  CHECK(cs[zp::CollOp::all_reduce].calls == 2);
  CHECK(cs.total().calls == 2 * msgs * std::uint64_t(runs) + 2);
  return st;
}

template <class A>
void check_against_serial(const Toy<A>& toy, const Grads<A>& got) {
  const Grads<A> want = serial(toy);
  CHECK(got.loss == want.loss);  // bitwise: the same formulas in the same order
  for (int s = 0; s < toy.p; ++s) {
    CAPTURE(s);
    CHECK(got.dw[std::size_t(s)] == want.dw[std::size_t(s)]);
    CHECK(got.db[std::size_t(s)] == want.db[std::size_t(s)]);
  }
}

}  // namespace

TEST_CASE_TEMPLATE(
    "the runner's gradients and losses equal a serial run of the whole chain, for every schedule "
    "and size",
    A, float, double) {
  for (Schedule sched : both)
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 3, 5}) {
        const Toy<A> toy{p, m, 37, zp::test::fresh_seed()};
        CAPTURE(zp::pipeline::name(sched));
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(toy.seed);
        Grads<A> got;
        got.dw.resize(std::size_t(p));
        got.db.resize(std::size_t(p));
        got.loss.assign(std::size_t(m), -1.0);
        // Two runs through one Runner: buffers and pending sends carry over between flushes.
        run_threads(p, [&](Collective<Threads>& pp) { run_stage(pp, sched, toy, got, 2); });
        check_against_serial(toy, got);
      }
}

TEST_CASE(
    "the runner works over the pipeline groups of a DP x PP grid, each replica on its own data") {
  const std::uint64_t seed = zp::test::fresh_seed();
  CAPTURE(seed);
  const zp::GridShape shape{.dp = 2, .tp = 1, .pp = 3};
  std::vector<Toy<float>> toys;
  std::vector<Grads<float>> got(2);
  for (int d = 0; d < 2; ++d) {
    toys.push_back({3, 4, 19, seed + 1000 * std::uint64_t(d)});
    got[std::size_t(d)].dw.resize(3);
    got[std::size_t(d)].db.resize(3);
    got[std::size_t(d)].loss.assign(4, -1.0);
  }
  run_threads(shape.size(), [&](Collective<Threads>& world) {
    zp::ProcessGrid<Threads> grid(world, shape);
    const int d = grid.coords().dp;
    run_stage(grid.pp(), Schedule::one_f_one_b, toys[std::size_t(d)], got[std::size_t(d)], 1);
    // run() is not a barrier: the other stages may still be exchanging when this one returns,
    // and a threads sub-group whose member is destroyed fails for everyone in it.
    world.barrier();
  });
  for (int d = 0; d < 2; ++d) check_against_serial(toys[std::size_t(d)], got[std::size_t(d)]);
}

// --- 4. failures -------------------------------------------------------------------------------

namespace {

// How a rank's part ended: "ok", "callback" (the callback's own exception) or the category of
// the zp::Error it threw, with the message.
struct Ending {
  std::string kind, what;
};

// Runs a pipeline of ends.size() ranks (5 micro-batches of 64 elements) with callbacks that
// call hook(stage, micro, backward) first; after run(), a barrier (what a training step's next
// collective would be). Records each rank's ending in `ends` and rethrows as run_threads does.
void run_failing(Schedule sched, std::vector<Ending>& ends, ThreadsOptions opt,
                 const std::function<void(int, int, bool)>& hook) {
  run_threads(
      int(ends.size()),
      [&](Collective<Threads>& pp) {
        const int s = pp.rank();
        auto& mine = ends[std::size_t(s)];
        try {
          Runner<Threads, float> pipe(pp, sched, 5, 64);
          pipe.run(
              [&](int k, int, std::span<const float>, std::span<float> out) {
                hook(s, k, false);
                std::fill(out.begin(), out.end(), 1.0f);
              },
              [&](int k, int, std::span<const float>, std::span<float> in_grad) {
                hook(s, k, true);
                std::fill(in_grad.begin(), in_grad.end(), 1.0f);
              });
          pp.barrier();
          mine.kind = "ok";
        } catch (const zp::Error& e) {
          mine = {zp::to_string(e.category()), e.what()};
          throw;
        } catch (const std::exception& e) {
          mine = {"callback", e.what()};
          throw;
        }
      },
      opt);
}

}  // namespace

TEST_CASE(
    "a forward or backward that throws leaves run() with its exception, and every other stage "
    "fails promptly") {
  for (Schedule sched : both)
    for (int p : {2, 4})
      for (int bad = 0; bad < p; ++bad)
        for (bool in_backward : {false, true})
          for (int bad_micro : {0, 2, 4}) {
            CAPTURE(zp::pipeline::name(sched));
            CAPTURE(p);
            CAPTURE(bad);
            CAPTURE(in_backward);
            CAPTURE(bad_micro);
            const std::string msg = std::string(in_backward ? "backward" : "forward") +
                                    " failed on stage " + std::to_string(bad) + " at micro-batch " +
                                    std::to_string(bad_micro);
            std::vector<Ending> ends(static_cast<std::size_t>(p));
            const auto t0 = std::chrono::steady_clock::now();
            try {
              run_failing(sched, ends, ThreadsOptions{.timeout = 5s},
                          [&](int s, int k, bool backward) {
                            if (s == bad && k == bad_micro && backward == in_backward)
                              throw std::runtime_error(msg);
                          });
              FAIL("run_threads should have rethrown");
            } catch (const zp::Error& e) {
              FAIL("a zp::Error instead of the callback's exception: ", e.what());
            } catch (const std::runtime_error& e) {
              CHECK(std::string(e.what()) == msg);  // the cause, not an abort it caused
            }
            // Far below the 5 s timeout: nobody waited for a peer that was never coming.
            CHECK(elapsed(t0) < 2.0);
            for (int s = 0; s < p; ++s) {
              CAPTURE(s);
              const Ending& e = ends[std::size_t(s)];
              INFO("ended with: ", e.kind, ": ", e.what);
              CHECK(e.kind == (s == bad ? "callback" : "aborted"));
              CHECK(e.what.find(msg) != std::string::npos);  // the others name the cause
            }
          }
}

TEST_CASE(
    "stages built with different schedules, micro-batch counts, activation sizes or element types "
    "fail at construction, on every stage, naming the setting") {
  struct Case {
    int bad_field;  // 0 schedule, 1 micro_batches, 2 activation_elems, 3 element type
    const char* name;
  };
  for (const Case c : {Case{0, "the same schedule (0: gpipe, 1: 1f1b); it ranges over [0, 1]"},
                       Case{1, "the same micro_batches; it ranges over [3, 4]"},
                       Case{2, "the same activation_elems; it ranges over [64, 65]"},
                       Case{3, "the same sizeof(activation element); it ranges over [4, 8]"}})
    for (int p : {2, 3}) {
      CAPTURE(c.bad_field);
      CAPTURE(p);
      const int bad = p - 1;  // the last stage differs
      std::vector<std::string> got(static_cast<std::size_t>(p));
      const auto t0 = std::chrono::steady_clock::now();
      run_threads(
          p,
          [&](Collective<Threads>& pp) {
            const int s = pp.rank();
            const bool odd = s == bad;
            const Schedule sched =
                odd && c.bad_field == 0 ? Schedule::one_f_one_b : Schedule::gpipe;
            const int m = odd && c.bad_field == 1 ? 4 : 3;
            const std::size_t n = odd && c.bad_field == 2 ? 65 : 64;
            try {
              if (odd && c.bad_field == 3)
                Runner<Threads, double> r(pp, sched, m, n);
              else
                Runner<Threads, float> r(pp, sched, m, n);
              got[std::size_t(s)] = "constructed";
            } catch (const zp::Error& e) {
              got[std::size_t(s)] = std::string(zp::to_string(e.category())) + ": " + e.what();
            }
          },
          ThreadsOptions{.timeout = 5s});
      CHECK(elapsed(t0) < 2.0);  // an agreement, not a timeout
      for (int s = 0; s < p; ++s) {
        CAPTURE(s);
        const std::string& e = got[std::size_t(s)];
        INFO(e);
        CHECK(e.starts_with("invalid argument: "));
        CHECK(e.find(c.name) != std::string::npos);
        CHECK(e.find("stage " + std::to_string(s) + " has ") != std::string::npos);
      }
    }
}

TEST_CASE("a Runner with a bad micro-batch count is an error naming it, on every stage") {
  run_threads(2, [&](Collective<Threads>& pp) {
    zp::test::expect_invalid([&] { Runner<Threads, float> r(pp, Schedule::gpipe, 0, 8); },
                             {"micro_batches must be >= 1, got 0"});
    // Only stage 1's: stage 0 names it and the stage.
    zp::test::expect_invalid(
        [&] { Runner<Threads, float> r(pp, Schedule::gpipe, pp.rank() == 1 ? 0 : 3, 8); },
        {pp.rank() == 0 ? "rank 1 failed: " : "", "micro_batches must be >= 1, got 0"});
  });
}
