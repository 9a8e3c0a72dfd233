// Tests of zp/precision.hpp: the loss scaler's scale sequence on scripted overflow patterns,
// checkpoint state, the minimum-scale error and the no-scaling mode for bf16.
#include <doctest/doctest.h>

#include <zp/precision.hpp>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float qnan = std::numeric_limits<float>::quiet_NaN();  // not `nan`: ::nan() is a function

// A bad value and how the message prints it.
struct Bad {
  float value;
  const char* text;
};
constexpr Bad not_positive_or_finite[] = {
    {qnan, "got nan"}, {inf, "got inf"}, {-inf, "got -inf"}, {0.0f, "got 0"}, {-2.0f, "got -2"}};

struct Expected {
  bool overflow;
  bool applied;
  float scale_after;
};
void run_script(zp::LossScaler& s, const std::vector<Expected>& script) {
  for (std::size_t i = 0; i < script.size(); ++i) {
    CAPTURE(i);
    CHECK(s.update(script[i].overflow) == script[i].applied);
    CHECK(s.scale() == script[i].scale_after);
  }
}
}  // namespace

TEST_CASE(
    "a dynamic scale follows the DeepSpeed hysteresis algorithm on a scripted overflow pattern") {
  // window 4, hysteresis 2, start 16 (worked out by hand from the algorithm in REFERENCE.md).
  auto s = zp::LossScaler::dynamic({.initial_scale = 16.0f, .window = 4, .hysteresis = 2});
  run_script(s, {
                    {false, true, 16},
                    {false, true, 16},
                    {false, true, 16},
                    {false, true, 32},  // 4 clean steps: grow, refill hysteresis
                    {true, false, 32},  // first overflow uses up hysteresis
                    {true, false, 16},  // second halves
                    {false, true, 16},
                    {true, false, 8},  // hysteresis was not refilled by one clean step
                    {false, true, 8},
                    {false, true, 8},
                    {false, true, 8},
                    {false, true, 16},  // window clean steps after the last overflow
                    {true, false, 16},  // hysteresis refilled at growth
                    {false, true, 16},
                    {true, false, 8},
                });
  CHECK(s.state().skipped == 5);
  CHECK(s.state().iter == 15);
  CHECK(s.state().last_overflow == 14);
}

TEST_CASE("consecutive hysteresis refills on every clean step") {
  auto s = zp::LossScaler::dynamic(
      {.initial_scale = 16.0f, .window = 4, .hysteresis = 2, .consecutive_hysteresis = true});
  run_script(s, {{true, false, 16},
                 {false, true, 16},
                 {true, false, 16},
                 {true, false, 8},
                 {false, true, 8}});
}

TEST_CASE("a scale that grows without overflows stops at 2^64") {
  for (float factor : {2.0f, 3.0f, 1.5f}) {
    CAPTURE(factor);
    auto s = zp::LossScaler::dynamic({.window = 1, .hysteresis = 1, .factor = factor});
    float last = s.scale();
    for (int i = 0; i < 400; ++i) {  // gradients that never overflow (bf16, fp32)
      CHECK(s.update(false));
      REQUIRE(std::isfinite(s.scale()));
      CHECK(s.scale() >= last);
      last = s.scale();
    }
    CHECK(double(s.scale()) <= 0x1p64);
    CHECK(double(s.scale()) * factor > 0x1p64);  // as far as it goes
    s.load(s.state());                           // a checkpoint holds it
    CHECK_FALSE(s.update(true));
    CHECK(s.scale() == last / factor);
  }
}

TEST_CASE("DeepSpeed's defaults: 2^16, doubling after 1000 clean steps, hysteresis 2, minimum 1") {
  auto s = zp::LossScaler::dynamic();
  CHECK(s.scale() == 65536.0f);
  for (int i = 0; i < 999; ++i) s.update(false);
  CHECK(s.scale() == 65536.0f);
  s.update(false);
  CHECK(s.scale() == 131072.0f);
  s.update(true);
  CHECK(s.scale() == 131072.0f);
  s.update(true);
  CHECK(s.scale() == 65536.0f);
  CHECK(s.inv_scale() == 1.0f / 65536.0f);
}

TEST_CASE("an overflow at the minimum scale is an error instead of an endless loop") {
  auto s = zp::LossScaler::dynamic({.initial_scale = 4.0f, .hysteresis = 1, .min_scale = 2.0f});
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 2.0f);
  const auto before = s.state();
  zp::test::expect_invalid([&] { s.update(true); },
                           {"minimum loss scale 2 (2 of 2 steps skipped)"});
  CHECK(s.state() == before);  // refused before anything changed: the state still loads
  CHECK_NOTHROW(zp::LossScaler::dynamic({.initial_scale = 4.0f, .min_scale = 2.0f}).load(before));
  auto lenient = zp::LossScaler::dynamic(
      {.initial_scale = 4.0f, .hysteresis = 1, .min_scale = 2.0f, .error_at_min_scale = false});
  lenient.update(true);
  lenient.update(true);
  CHECK(lenient.scale() == 2.0f);
}

// A serial reference: the count of overflows since the last clean step, and the error at the
// limit, on random overflow patterns (none, fixed), with the state saved and reloaded halfway.
TEST_CASE("a constant scale throws at max_skipped_in_row overflows in a row, changing nothing") {
  std::mt19937_64 rng(zp::test::run_seed("precision.test"));
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t limit = std::int64_t(rng() % 6);  // 0: no limit
    const double p = double(rng() % 100) / 100.0;
    auto s = trial % 2 ? zp::LossScaler::none(limit) : zp::LossScaler::fixed(64.0f, limit);
    std::int64_t in_row = 0, skipped = 0, steps = 0;
    for (int i = 0; i < 60; ++i) {
      CAPTURE(trial);
      CAPTURE(limit);
      CAPTURE(i);
      if (i == 30) {  // a checkpoint round trip keeps the count
        auto t = trial % 2 ? zp::LossScaler::none(limit) : zp::LossScaler::fixed(64.0f, limit);
        t.load(s.state());
        s = t;
      }
      const bool overflow = std::uniform_real_distribution<>(0, 1)(rng) < p;
      if (overflow && limit > 0 && in_row + 1 >= limit) {
        const auto before = s.state();
        zp::test::expect_invalid(
            [&] { s.update(true); },
            {zp::detail::cat("loss scaler: ", limit, " steps in a row had inf/nan gradients"),
             zp::detail::cat("(", skipped + 1, " of ", steps + 1, " steps skipped")});
        CHECK(s.state() == before);
        continue;
      }
      CHECK(s.update(overflow) == !overflow);
      ++steps;
      skipped += overflow;
      in_row = overflow ? in_row + 1 : 0;
      CHECK(s.state().skipped_in_row == in_row);
      CHECK(s.state().skipped == skipped);
      CHECK(s.state().iter == steps);
    }
  }
  zp::test::expect_invalid([] { zp::LossScaler::none(-1); },
                           {"loss scaler: max_skipped_in_row must be >= 0", "got -1"});
  zp::test::expect_invalid([] { zp::LossScaler::fixed(2.0f, -3); },
                           {"max_skipped_in_row", "got -3"});
}

TEST_CASE("the scaler's state survives a checkpoint round trip") {
  auto a = zp::LossScaler::dynamic({.initial_scale = 1024.0f, .window = 3});
  for (bool o : {false, true, false, false, true, true, false}) a.update(o);
  const auto saved = a.state();
  auto b = zp::LossScaler::dynamic({.initial_scale = 1024.0f, .window = 3});
  b.load(saved);
  CHECK(b.state() == a.state());
  for (bool o : {false, false, false, true, false, false, false, false})
    CHECK(a.update(o) == b.update(o));
  CHECK(b.state() == a.state());
}

TEST_CASE("bf16 and fixed scales never change, but overflowing steps are still skipped") {
  auto none = zp::LossScaler::none();
  CHECK(none.scale() == 1.0f);
  CHECK_FALSE(none.update(true));
  CHECK(none.update(false));
  for (int i = 0; i < 3000; ++i) none.update(i % 7 == 0);
  CHECK(none.scale() == 1.0f);
  auto fixed = zp::LossScaler::fixed(128.0f);
  for (int i = 0; i < 3000; ++i) fixed.update(i % 5 == 0);
  CHECK(fixed.scale() == 128.0f);
  CHECK(fixed.state().skipped == 600);
}

TEST_CASE("invalid scaler settings are errors that name the value") {
  CHECK_THROWS_WITH_AS(zp::LossScaler::fixed(0.0f), doctest::Contains("got 0"), zp::Error);
  CHECK_THROWS_WITH_AS(zp::LossScaler::dynamic({.window = 0}), doctest::Contains("window"),
                       zp::Error);
  CHECK_THROWS_WITH_AS(zp::LossScaler::dynamic({.initial_scale = 1.0f, .min_scale = 2.0f}),
                       doctest::Contains("min_scale"), zp::Error);
}

TEST_CASE("every non-finite or out-of-range scaler setting is an error naming it and its value") {
  zp::test::expect_invalid([] { zp::LossScaler::fixed(3.2e38f); },
                           {"a fixed scale must be positive and below 3e38, got 3.2e+38"});
  for (const Bad& b : not_positive_or_finite) {
    const float bad = b.value;
    const std::string got = b.text;
    CAPTURE(bad);
    zp::test::expect_invalid([&] { zp::LossScaler::fixed(bad); },
                             {"loss scaler: a fixed scale must be positive and below 3e38", got});
    zp::test::expect_invalid([&] { zp::LossScaler::dynamic({.initial_scale = bad}); },
                             {"loss scaler: initial_scale", got});
    zp::test::expect_invalid([&] { zp::LossScaler::dynamic({.min_scale = bad}); },
                             {"loss scaler: min_scale", got});
    zp::test::expect_invalid([&] { zp::LossScaler::dynamic({.factor = bad}); },
                             {"loss scaler: factor must be finite and > 1", got});
  }
  zp::test::expect_invalid([] { zp::LossScaler::dynamic({.factor = 1.0f}); },
                           {"loss scaler: factor", "got 1"});
  zp::test::expect_invalid([] { zp::LossScaler::dynamic({.factor = 0.5f}); },
                           {"loss scaler: factor", "got 0.5"});
  zp::test::expect_invalid([] { zp::LossScaler::dynamic({.window = -5}); },
                           {"loss scaler: window", "got -5"});
  zp::test::expect_invalid([] { zp::LossScaler::dynamic({.hysteresis = 0}); },
                           {"loss scaler: hysteresis", "got 0"});
  // The boundaries stay valid.
  CHECK_NOTHROW(zp::LossScaler::dynamic({.initial_scale = 8.0f,
                                         .window = 1,
                                         .hysteresis = 1,
                                         .min_scale = 8.0f,
                                         .factor = std::nextafter(1.0f, 2.0f)}));
  CHECK_NOTHROW(zp::LossScaler::dynamic({.initial_scale = std::numeric_limits<float>::max()}));
  CHECK_NOTHROW(zp::LossScaler::fixed(std::numeric_limits<float>::denorm_min()));
}

TEST_CASE("loading a saved scaler state rejects every impossible value and keeps the old state") {
  auto s = zp::LossScaler::dynamic({.initial_scale = 1024.0f, .window = 3});
  for (bool o : {false, true, false}) s.update(o);
  const auto good = s.state();  // iter 3, last_overflow 1, skipped 1
  const auto load_with = [&](auto&& change) {
    auto st = good;
    change(st);
    s.load(st);
  };
  using State = zp::LossScaler::State;
  for (const Bad& b : not_positive_or_finite) {
    const float bad = b.value;
    const std::string got = b.text;
    CAPTURE(bad);
    zp::test::expect_invalid([&] { load_with([&](State& st) { st.scale = bad; }); },
                             {"loss scaler: saved scale must be positive and finite", got});
  }
  zp::test::expect_invalid([&] { load_with([](State& st) { st.iter = -1; }); },
                           {"loss scaler: saved iter", "got -1"});
  zp::test::expect_invalid([&] { load_with([](State& st) { st.skipped = -1; }); },
                           {"loss scaler: saved skipped", "got -1"});
  zp::test::expect_invalid([&] { load_with([](State& st) { st.skipped = 4; }); },
                           {"saved skipped must be in [0, iter = 3]", "got 4"});
  zp::test::expect_invalid([&] { load_with([](State& st) { st.last_overflow = -2; }); },
                           {"loss scaler: saved last_overflow", "got -2"});
  zp::test::expect_invalid([&] { load_with([](State& st) { st.last_overflow = 3; }); },
                           {"saved last_overflow must be in [-1, iter = 3)", "got 3"});
  zp::test::expect_invalid([&] { load_with([](State& st) { st.skipped_in_row = -1; }); },
                           {"loss scaler: saved skipped_in_row", "got -1"});
  zp::test::expect_invalid([&] { load_with([](State& st) { st.skipped_in_row = 2; }); },
                           {"saved skipped_in_row must be in [0, skipped = 1]", "got 2"});
  zp::test::expect_invalid([&] { load_with([](State& st) { st.hysteresis = 0; }); },
                           {"loss scaler: saved hysteresis", "got 0"});
  zp::test::expect_invalid(
      [&] { load_with([](State& st) { st.iter = std::numeric_limits<std::int64_t>::min(); }); },
      {"saved iter", "got -9223372036854775808"});
  CHECK(s.state() == good);  // a rejected load changes nothing
  // The boundaries stay valid: a fresh state, and every step skipped with the last one overflowing.
  CHECK_NOTHROW(
      s.load(State{.scale = 1.0f, .iter = 0, .last_overflow = -1, .hysteresis = 1, .skipped = 0}));
  CHECK_NOTHROW(
      s.load(State{.scale = 2.0f, .iter = 5, .last_overflow = 4, .hysteresis = 1, .skipped = 5}));
  CHECK(s.state().skipped == 5);
}
