#include "zp/dispatch.hpp"

#include <doctest/doctest.h>

#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>

#include "expect_error.hpp"

using zp::DType;
using zp::optim::Adam;
using zp::optim::AdamW;
using zp::optim::Lion;
using zp::optim::Sgd;
using zp::test::expect_invalid;

namespace {

using AnyOptimizer = std::variant<AdamW, Adam, Sgd, Lion>;

// What a call reached: the compile-time type, stage and optimizer, as run-time values.
struct Reached {
  DType dtype;
  int stage;
  std::string optimizer;
  float lr;
  bool operator==(const Reached&) const = default;
};

template <class T, int S, class O>
Reached reached(std::type_identity<T>, std::integral_constant<int, S>, const O& o) {
  static_assert(S >= 0 && S <= 3);
  return {zp::dtype_of<T>, S, zp::optim::detail::type_name(o), o.lr};
}

AnyOptimizer make(int k, float lr) {
  switch (k) {
    case 0: return AdamW{.lr = lr};
    case 1: return Adam{.lr = lr};
    case 2: return Sgd{.lr = lr};
    default: return Lion{.lr = lr};
  }
}

}  // namespace

TEST_CASE("every element type x stage x optimizer reaches its own instantiation") {
  const DType types[] = {DType::f32, DType::bf16, DType::f16};
  const char* const names[] = {"AdamW", "Adam", "Sgd", "Lion"};
  std::set<std::tuple<DType, int, std::string>> seen;
  for (DType t : types)
    for (int s = 0; s <= 3; ++s)
      for (int k = 0; k < 4; ++k) {
        const float lr = 0.125f * float(k + 1);
        const Reached r = zp::dispatch(t, s, make(k, lr), [](auto type, auto stage, const auto& o) {
          return reached(type, stage, o);
        });
        CHECK(r == Reached{t, s, names[k], lr});
        seen.emplace(r.dtype, r.stage, r.optimizer);
      }
  CHECK(seen.size() == 3 * 4 * 4);
}

TEST_CASE("the two-argument form, and an optimizer given as its own type") {
  for (DType t : {DType::f32, DType::bf16})
    for (int s : {1, 3}) {
      const auto [dt, st] = zp::dispatch<zp::Types<float, zp::bf16>, zp::Stages<1, 3>>(
          t, s, []<class T, int S>(std::type_identity<T>, std::integral_constant<int, S>) {
            return std::pair{zp::dtype_of<T>, S};
          });
      CHECK(dt == t);
      CHECK(st == s);
    }
  // A plain optimizer is passed on as it is (its type is checked against the list at compile time).
  const Reached r = zp::dispatch(DType::f16, 2, Lion{.lr = 0.5f},
                                 [](auto t, auto s, const auto& o) { return reached(t, s, o); });
  CHECK(r == Reached{DType::f16, 2, "Lion", 0.5f});
  // A void f, and the single-choice helpers.
  int calls = 0;
  zp::dispatch(DType::f32, 0, [&](auto, auto) { ++calls; });
  CHECK(calls == 1);
  CHECK(zp::dispatch_type(DType::bf16, []<class T>(std::type_identity<T>) { return sizeof(T); }) ==
        2);
  CHECK(zp::dispatch_stage(2, [](auto s) { return s.value * 10; }) == 20);
  CHECK(zp::dispatch_optimizer(make(2, 1.0f), [](const auto& o) {
          return std::string(zp::optim::detail::type_name(o));
        }) == "Sgd");
  // A variant with fewer alternatives than the list, and a list narrower than the variant.
  const std::variant<Sgd, AdamW> narrow = AdamW{.lr = 0.25f};
  CHECK(zp::dispatch_optimizer(narrow, [](const auto& o) { return o.lr; }) == 0.25f);
  CHECK(zp::dispatch_optimizer<zp::Optimizers<AdamW>>(narrow, [](const auto& o) { return o.lr; }) ==
        0.25f);
}

TEST_CASE("values and contains name what a list holds") {
  CHECK(zp::values(zp::AllTypes{}) == std::vector<DType>{DType::f32, DType::bf16, DType::f16});
  CHECK(zp::values(zp::AllStages{}) == std::vector<int>{0, 1, 2, 3});
  CHECK(zp::values(zp::AllOptimizers{}) ==
        std::vector<std::string>{"AdamW", "Adam", "Sgd", "Lion"});
  CHECK(zp::contains(zp::Types<float>{}, DType::f32));
  CHECK(!zp::contains(zp::Types<float>{}, DType::bf16));
  CHECK(!zp::contains(zp::Stages<1, 3>{}, 2));
  CHECK(zp::contains(zp::Optimizers<Sgd>{}, make(2, 1.0f)));
  CHECK(!zp::contains(zp::Optimizers<Sgd>{}, make(0, 1.0f)));
}

TEST_CASE("a value outside its list is an error naming it and the list, before f runs") {
  int calls = 0;
  auto f = [&](auto, auto, const auto&) { ++calls; };
  auto g = [&](auto, auto) { ++calls; };
  expect_invalid([&] { zp::dispatch(DType::f32, 4, make(0, 1), f); },
                 {"zp::dispatch: stage 4 is not one this program was built with {0, 1, 2, 3}"});
  expect_invalid([&] { zp::dispatch(DType::f32, -1, g); }, {"stage -1 is not one"});
  expect_invalid([&] { zp::dispatch<zp::AllTypes, zp::Stages<1, 3>>(DType::f32, 2, g); },
                 {"stage 2 is not one this program was built with {1, 3}"});
  expect_invalid(
      [&] { zp::dispatch(DType::i32, 0, make(0, 1), f); },
      {"zp::dispatch: element type i32 is not one this program was built with {f32, bf16, f16}"});
  expect_invalid([&] { zp::dispatch<zp::Types<float, zp::bf16>>(DType::f16, 0, g); },
                 {"element type f16 is not one this program was built with {f32, bf16}"});
  expect_invalid([&] { zp::dispatch(DType(200), 0, g); }, {"element type DType(200)"});
  expect_invalid(
      [&] {
        zp::dispatch<zp::AllTypes, zp::AllStages, zp::Optimizers<AdamW, Sgd>>(DType::f32, 0,
                                                                              make(3, 1), f);
      },
      {"zp::dispatch: optimizer Lion is not one this program was built with {AdamW, Sgd}"});
  expect_invalid([&] { zp::dispatch_stage<zp::Stages<3>>(0, [](auto) {}); },
                 {"stage 0 is not one"});
  // The type is named first, then the stage, then the optimizer.
  expect_invalid(
      [&] {
        zp::dispatch<zp::Types<float>, zp::AllStages, zp::Optimizers<Sgd>>(DType::bf16, 9,
                                                                           make(0, 1), f);
      },
      {"element type bf16"});
  expect_invalid(
      [&] {
        zp::dispatch<zp::Types<float>, zp::AllStages, zp::Optimizers<Sgd>>(DType::f32, 9,
                                                                           make(0, 1), f);
      },
      {"stage 9"});
  CHECK(calls == 0);
}
