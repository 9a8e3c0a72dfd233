// zp/dispatch.hpp: from run-time choices (the model's element type, the ZeRO stage, the
// optimizer) to the compile-time types and values an Engine is instantiated with. No engine, no
// config: a program that reads its choices from flags, a ds_config or anything else writes
//
//   zp::dispatch<zp::Types<float, zp::bf16>, zp::Stages<1, 3>>(dtype, stage,
//       [&]<class T, int S>(std::type_identity<T>, std::integral_constant<int, S>) {
//         train<zp::Engine<B, T, S>>(...);
//       });
//
// once instead of a switch per choice. Every combination listed is one instantiation of the
// lambda's body (an Engine costs seconds of compile time each): list only what the program uses.
// A run-time value outside its list is a zp::Error(invalid_argument) naming the value and the
// list, raised before f is called.
#pragma once

#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "zp/dtype.hpp"
#include "zp/error.hpp"
#include "zp/optim/optimizer.hpp"

namespace zp {

// The choices a program compiles in: element types (float, bf16, fp16, ...), ZeRO stages (0-3)
// and optimizers (optim::AdamW, Adam, Sgd, Lion). Each list names at least one entry.
template <class... Ts>
struct Types {};
template <int... Ss>
struct Stages {};
template <class... Os>
struct Optimizers {};

// Everything an Engine takes: the three model element types, the four stages, the four optimizers.
using AllTypes = Types<float, bf16, fp16>;
using AllStages = Stages<0, 1, 2, 3>;
using AllOptimizers = Optimizers<optim::AdamW, optim::Adam, optim::Sgd, optim::Lion>;

namespace detail {

template <class T, class... Ts>
inline constexpr bool one_of = (std::is_same_v<T, Ts> || ...);

template <class L>
inline constexpr bool non_empty_list = false;
template <class T0, class... Ts>
inline constexpr bool non_empty_list<Types<T0, Ts...>> = true;
template <int S0, int... Ss>
inline constexpr bool non_empty_list<Stages<S0, Ss...>> = true;
template <class O0, class... Os>
inline constexpr bool non_empty_list<Optimizers<O0, Os...>> = true;

template <class V>
inline constexpr bool is_variant = false;
template <class... As>
inline constexpr bool is_variant<std::variant<As...>> = true;

// The optimizer an optimizer value or a std::variant of optimizers holds, by name ("AdamW").
template <class V>
std::string optimizer_name(const V& o) {
  if constexpr (is_variant<V>)
    return std::visit([](const auto& x) { return std::string(optim::detail::type_name(x)); }, o);
  else
    return optim::detail::type_name(o);
}

template <class V>
std::string list_text(const std::vector<V>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += cat(i ? ", " : "", v[i]);
  return s + "}";
}

template <class F, class T0, class... Ts>
decltype(auto) pick_type(DType t, F& f) {
  if constexpr (sizeof...(Ts) == 0) {
    return f(std::type_identity<T0>{});  // the caller checked that t is in the list
  } else {
    if (t == dtype_of<T0>) return f(std::type_identity<T0>{});
    return pick_type<F, Ts...>(t, f);
  }
}

template <class F, int S0, int... Ss>
decltype(auto) pick_stage(int stage, F& f) {
  if constexpr (sizeof...(Ss) == 0) {
    return f(std::integral_constant<int, S0>{});
  } else {
    if (stage == S0) return f(std::integral_constant<int, S0>{});
    return pick_stage<F, Ss...>(stage, f);
  }
}

// Whether optimizer O is one of variant V's alternatives, and holds it.
template <class V, class O>
inline constexpr bool alternative_of = false;
template <class... As, class O>
inline constexpr bool alternative_of<std::variant<As...>, O> = one_of<O, As...>;
template <class O, class V>
bool holds(const V& v) noexcept {
  if constexpr (alternative_of<V, O>)
    return std::holds_alternative<O>(v);
  else
    return false;
}

// The optimizers of a list that variant V can hold, in the list's order.
template <class V, class Acc, class... Os>
struct held_by {
  using type = Acc;
};
template <class V, class... Acc, class O0, class... Os>
struct held_by<V, Optimizers<Acc...>, O0, Os...>
    : held_by<V,
              std::conditional_t<alternative_of<V, O0>, Optimizers<Acc..., O0>, Optimizers<Acc...>>,
              Os...> {};

template <class V, class L>
struct held_list;
template <class V, class... Os>
struct held_list<V, Optimizers<Os...>> : held_by<V, Optimizers<>, Os...> {};

// O0, Os...: alternatives of the variant v, one of which it holds (the caller checked).
template <class V, class F, class O0, class... Os>
decltype(auto) pick_alternative(const V& v, F& f) {
  if constexpr (sizeof...(Os) == 0) {
    return f(std::get<O0>(v));
  } else {
    if (std::holds_alternative<O0>(v)) return f(std::get<O0>(v));
    return pick_alternative<V, F, Os...>(v, f);
  }
}

}  // namespace detail

// The values a list holds, in order, e.g. for a message naming what a program was built with.
template <class... Ts>
std::vector<DType> values(Types<Ts...>) {
  return {dtype_of<Ts>...};
}
template <int... Ss>
std::vector<int> values(Stages<Ss...>) {
  return {Ss...};
}
template <class... Os>
std::vector<std::string> values(Optimizers<Os...>) {
  static_assert((detail::one_of<Os, optim::AdamW, optim::Adam, optim::Sgd, optim::Lion> && ...),
                "zp::Optimizers lists only optim::AdamW, Adam, Sgd, Lion");
  return {optim::detail::type_name(Os{})...};
}

// Whether a run-time value is in a list. An optimizer is an optimizer value or a std::variant of
// them (the alternative it holds counts).
template <class... Ts>
constexpr bool contains(Types<Ts...>, DType t) noexcept {
  return ((dtype_of<Ts> == t) || ...);
}
template <int... Ss>
constexpr bool contains(Stages<Ss...>, int stage) noexcept {
  return ((Ss == stage) || ...);
}
template <class... Os, class V>
bool contains(Optimizers<Os...>, const V& opt) noexcept {
  if constexpr (detail::is_variant<V>)
    return (detail::holds<Os>(opt) || ...);
  else
    return detail::one_of<V, Os...>;
}

namespace detail {

template <class L, class O>
inline constexpr bool lists_optimizer = false;
template <class... Os, class O>
inline constexpr bool lists_optimizer<Optimizers<Os...>, O> = one_of<O, Os...>;

// Each raises the Error of a value outside its list (naming the value and the list).
template <class TypeList>
void check_type(DType t) {
  static_assert(non_empty_list<TypeList>, "zp::Types lists at least one element type");
  if (contains(TypeList{}, t)) return;
  std::vector<std::string> names;
  for (DType x : values(TypeList{})) names.emplace_back(name(x));
  throw Error(Errc::invalid_argument,
              cat("zp::dispatch: element type ", name(t),
                  " is not one this program was built with ", list_text(names)));
}
template <class StageList>
void check_stage(int stage) {
  static_assert(non_empty_list<StageList>, "zp::Stages lists at least one stage");
  if (!contains(StageList{}, stage))
    throw Error(Errc::invalid_argument,
                cat("zp::dispatch: stage ", stage, " is not one this program was built with ",
                    list_text(values(StageList{}))));
}
template <class OptimizerList, class V>
void check_optimizer(const V& opt) {
  static_assert(non_empty_list<OptimizerList>, "zp::Optimizers lists at least one optimizer");
  static_assert(is_variant<V> || lists_optimizer<OptimizerList, V>,
                "zp::dispatch: the optimizer's type is not in the Optimizers list");
  if (!contains(OptimizerList{}, opt))
    throw Error(Errc::invalid_argument, cat("zp::dispatch: optimizer ", optimizer_name(opt),
                                            " is not one this program was built with ",
                                            list_text(values(OptimizerList{}))));
}

}  // namespace detail

// f(std::type_identity<T>{}) for the T of TypeList whose dtype_of<T> is t; returns what f returns
// (the same type for every T). A t not in the list is an Error naming it and the list.
template <class TypeList = AllTypes, class F>
decltype(auto) dispatch_type(DType t, F&& f) {
  detail::check_type<TypeList>(t);
  return [&]<class... Ts>(Types<Ts...>) -> decltype(auto) {
    return detail::pick_type<F, Ts...>(t, f);
  }(TypeList{});
}

// f(std::integral_constant<int, S>{}) for the S of StageList equal to stage.
template <class StageList = AllStages, class F>
decltype(auto) dispatch_stage(int stage, F&& f) {
  detail::check_stage<StageList>(stage);
  return [&]<int... Ss>(Stages<Ss...>)->decltype(auto) {
    return detail::pick_stage<F, Ss...>(stage, f);
  }
  (StageList{});
}

// f(o) with o the optimizer as its own type: `opt` is an optimizer (passed on as it is; its type
// must be in OptimizerList, checked at compile time) or a std::variant of optimizers (the
// alternative it holds, which must be in the list).
template <class OptimizerList = AllOptimizers, class V, class F>
decltype(auto) dispatch_optimizer(const V& opt, F&& f) {
  detail::check_optimizer<OptimizerList>(opt);
  if constexpr (!detail::is_variant<V>) {
    return f(opt);
  } else {
    using Held = typename detail::held_list<V, OptimizerList>::type;
    static_assert(detail::non_empty_list<Held>,
                  "zp::dispatch_optimizer: the variant holds none of the listed optimizers");
    return [&]<class... Os>(Optimizers<Os...>) -> decltype(auto) {
      return detail::pick_alternative<V, F, Os...>(opt, f);
    }(Held{});
  }
}

// f(std::type_identity<T>{}, std::integral_constant<int, S>{}) for element type t and stage s.
// Both are checked (t first) before f is called.
template <class TypeList = AllTypes, class StageList = AllStages, class F>
decltype(auto) dispatch(DType t, int stage, F&& f) {
  detail::check_type<TypeList>(t);
  detail::check_stage<StageList>(stage);
  return dispatch_type<TypeList>(t, [&](auto type) -> decltype(auto) {
    return dispatch_stage<StageList>(stage, [&](auto s) -> decltype(auto) { return f(type, s); });
  });
}

// f(std::type_identity<T>{}, std::integral_constant<int, S>{}, o) for element type t, stage s and
// the optimizer o as its own type (see dispatch_optimizer). All three are checked (t, stage,
// opt: the first wrong one is named) before f is called.
template <class TypeList = AllTypes, class StageList = AllStages,
          class OptimizerList = AllOptimizers, class V, class F>
decltype(auto) dispatch(DType t, int stage, const V& opt, F&& f) {
  detail::check_type<TypeList>(t);
  detail::check_stage<StageList>(stage);
  detail::check_optimizer<OptimizerList>(opt);
  return dispatch_type<TypeList>(t, [&](auto type) -> decltype(auto) {
    return dispatch_stage<StageList>(stage, [&](auto s) -> decltype(auto) {
      return dispatch_optimizer<OptimizerList>(
          opt, [&](const auto& o) -> decltype(auto) { return f(type, s, o); });
    });
  });
}

}  // namespace zp
