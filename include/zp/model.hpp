// zp/model.hpp: how a C++ model hands its parameters to zp. No base class, no registration
// macro, no copies.
//
// A model opts in with one function found by argument-dependent lookup:
//
//   template <class Visit>
//   void for_each_parameter(MyModel& m, Visit&& visit) {
//     visit("fc1.weight", 0, m.w1, m.gw1);   // name, module, View<T>& value, View<T>& grad
//     visit("fc1.bias",   0, m.fc1_bias);    // or a zp::Param<T> holding both views
//     visit("fc2.weight", 1, m.w2, m.gw2, zp::TensorParallel::split);  // this rank's slice
//     visit("fc3.weight", 2, m.fc3, zp::Placement{{in, out}, {0, c0}, {in, c1}});  // ... and where
//   }
//
// Rules (checked by zp::bind_parameters, with messages naming the parameter):
//  - Parameters are visited in forward order; `module` numbers the units that stage 3 gathers
//    before they run and releases after: 0, 1, 2, ... non-decreasing, without gaps. A module is
//    also never split across gradient buckets, so make it a meaningful unit (a layer, a
//    transformer block), not a single bias. (Guards that run modules in another order train
//    the same values: stage 3 prefetches in the order the last micro-step ran, and gradient
//    buckets launch in the order the last optimizer step's backward made them ready.)
//  - Every visit of the same model visits the same parameters with the same sizes.
//  - Before zp takes over, a value view may point at the model's own storage holding the initial
//    values (zp copies them once), or be unbound where an Initializer gives them (below);
//    afterwards zp rebinds every view into its flat buffers. The
//    views are plain {pointer, size} pairs kept as members of the model, so the model must not
//    move while an engine refers to it.
//  - Gradients accumulate: the model's backward adds (+=) into the grad view; zp zeroes the
//    gradient memory when a new accumulation window (or, stage 2/3, a micro-step) starts.
//  - Stage 3 binds a module's value and grad views only inside the engine's guards for that
//    module; outside them data() is null.
//  - Under tensor parallelism (grid.hpp, tensor_parallel.hpp) a parameter is either replicated
//    (the same on every TP rank: layer norms, row-parallel biases; the default) or split (each TP
//    rank holds a different slice); the engine counts replicated ones once in the gradient norm.
//    Checkpoints of such a grid need each split parameter's Placement (where its slice sits in
//    the full tensor); a Placement that is the whole tensor means replicated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "zp/error.hpp"

namespace zp {

namespace detail {
// Debug builds: a clear message instead of a crash for the commonest stage 3 mistake.
[[noreturn]] inline void bad_view_access(bool bound, std::size_t i, std::size_t size) noexcept {
  if (!bound)
    std::fprintf(stderr,
                 "zp: a parameter view was used while unbound: with ZeRO stage 3 a module's "
                 "values and gradients are bound only inside engine.forward(m) / "
                 "engine.backward(m) for that module (and stage 2 binds gradients only "
                 "inside backward(m))\n");
  else
    std::fprintf(stderr, "zp: parameter view index %zu out of range [0, %zu)\n", i, size);
  std::abort();
}
}  // namespace detail

// A rebindable view of one parameter's values or gradient: a pointer zp may change and a size
// fixed by the model. Reads and writes go straight to wherever zp put the parameter.
template <class T>
class View {
 public:
  using element_type = T;

  View() = default;
  explicit View(std::size_t size) : size_(size) {}
  View(T* data, std::size_t size) : data_(data), size_(size) {}
  explicit View(std::span<T> s) : data_(s.data()), size_(s.size()) {}

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool bound() const noexcept { return data_ != nullptr; }
  T& operator[](std::size_t i) const noexcept {
#ifndef NDEBUG
    if (!data_ || i >= size_) detail::bad_view_access(data_ != nullptr, i, size_);
#endif
    return data_[i];
  }
  T* begin() const noexcept { return data_; }
  T* end() const noexcept { return data_ + size_; }
  std::span<T> span() const noexcept { return {data_, size_}; }
  operator std::span<T>() const noexcept { return span(); }
  operator std::span<const T>() const noexcept { return {data_, size_}; }

  // Points the view at new memory of the same size (zp calls this; a model never needs to).
  void rebind(T* data) noexcept { data_ = data; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// Convenience pair for models that keep value and gradient together.
template <class T>
struct Param {
  View<T> value;
  View<T> grad;

  Param() = default;
  explicit Param(std::size_t size) : value(size), grad(size) {}
  std::size_t size() const noexcept { return value.size(); }
};

// How a parameter is held across a tensor-parallel group (model.hpp's rules).
enum class TensorParallel : std::uint8_t { replicated, split };

// Where a rank's part of a parameter sits in the full tensor, for checkpoints that load at any
// grid: the full tensor, row-major, seen as an array of `shape`, and the part as the box
// [begin, end) of it, row-major. A Megatron split is one dimension's range (a column-parallel
// weight [in, out] split by columns: shape {in, out}, begin {0, c0}, end {in, c1}); fused q, k, v
// columns split by heads inside each of the three: shape {in, 3, out / 3}. An empty shape is the
// whole tensor.
struct Placement {
  std::vector<std::size_t> shape, begin, end;

  bool is_whole() const noexcept {
    for (std::size_t k = 0; k < shape.size(); ++k)
      if (begin[k] != 0 || end[k] != shape[k]) return false;
    return true;
  }
  std::size_t size() const noexcept {  // of the part
    std::size_t n = 1;
    for (std::size_t k = 0; k < shape.size(); ++k) n *= end[k] - begin[k];
    return n;
  }
  std::size_t full_size() const noexcept {
    std::size_t n = 1;
    for (std::size_t s : shape) n *= s;
    return n;
  }
  // The full tensor's index of element i of the part.
  std::size_t full_index(std::size_t i) const noexcept {
    if (shape.empty()) return i;
    std::size_t full = 0, stride = 1;
    for (std::size_t k = shape.size(); k-- > 0;) {
      const std::size_t w = end[k] - begin[k];
      full += (begin[k] + i % w) * stride;
      i /= w;
      stride *= shape[k];
    }
    return full;
  }
  // Elements [first, first + count) of the part as runs contiguous in both: fn(full index,
  // part index, run length), in order.
  template <class Fn>
  void for_each_run(std::size_t first, std::size_t count, Fn&& fn) const {
    if (shape.empty()) {
      if (count) fn(first, first, count);
      return;
    }
    const std::size_t w = end.back() - begin.back();
    for (std::size_t i = first; i < first + count;) {
      const std::size_t n = std::min(w - i % w, first + count - i);
      fn(full_index(i), i, n);
      i += n;
    }
  }
  // Throws unless the box lies in the shape and is not empty; `what` names the parameter.
  void check(std::string_view what) const {
    ZP_EXPECT(begin.size() == shape.size() && end.size() == shape.size(), what,
              ": a Placement needs begin and end of the shape's ", shape.size(),
              " dimensions, got ", begin.size(), " and ", end.size());
    for (std::size_t k = 0; k < shape.size(); ++k)
      ZP_EXPECT(begin[k] < end[k] && end[k] <= shape[k], what, ": dimension ", k,
                " of the Placement is [", begin[k], ", ", end[k],
                "), not a non-empty range inside [0, ", shape[k], ")");
  }
};

// What zp learns about one parameter from the model.
struct ParamInfo {
  std::string name;
  int module = 0;
  std::size_t size = 0;
  TensorParallel tp = TensorParallel::replicated;
  Placement place = {};  // empty shape: the whole tensor, or (TensorParallel::split) undescribed
};

namespace detail {

// The visitor zp passes to for_each_parameter: accepts every spelling (value and grad views or a
// Param; nothing, the tensor-parallel kind, or a Placement, whose kind is split unless it is the
// whole tensor) and forwards to f(name, module, value, grad[, tp[, placement]]).
template <class T, class F>
struct ParamVisitor {
  F& f;
  void operator()(std::string_view name, int module, View<T>& value, View<T>& grad,
                  TensorParallel tp = TensorParallel::replicated) {
    forward(name, module, value, grad, tp, Placement{});
  }
  void operator()(std::string_view name, int module, View<T>& value, View<T>& grad,
                  const Placement& place) {
    forward(name, module, value, grad,
            place.is_whole() ? TensorParallel::replicated : TensorParallel::split, place);
  }
  template <class Kind>
  void operator()(std::string_view name, int module, Param<T>& p, const Kind& kind) {
    (*this)(name, module, p.value, p.grad, kind);
  }
  void operator()(std::string_view name, int module, Param<T>& p) {
    (*this)(name, module, p.value, p.grad);
  }

 private:
  void forward(std::string_view name, int module, View<T>& value, View<T>& grad, TensorParallel tp,
               const Placement& place) {
    if constexpr (std::is_invocable_v<F&, std::string_view, int, View<T>&, View<T>&, TensorParallel,
                                      const Placement&>)
      f(name, module, value, grad, tp, place);
    else if constexpr (std::is_invocable_v<F&, std::string_view, int, View<T>&, View<T>&,
                                           TensorParallel>)
      f(name, module, value, grad, tp);
    else
      f(name, module, value, grad);
  }
};

}  // namespace detail

// A type whose parameters of element type T zp can manage.
namespace detail {
struct IgnoreParam {
  template <class... A>
  void operator()(A&&...) const {}
};
}  // namespace detail

template <class M, class T>
concept Model = requires(M& m, detail::ParamVisitor<T, detail::IgnoreParam>& v) {
  for_each_parameter(m, v);
};

// Calls f(name, module, View<T>& value, View<T>& grad) -- or, if f takes them, f(...,
// TensorParallel) or f(..., TensorParallel, const Placement&) -- for each parameter, in forward
// order.
template <class T, Model<T> M, class F>
void visit_parameters(M& model, F&& f) {
  detail::ParamVisitor<T, std::remove_reference_t<F>> v{f};
  for_each_parameter(model, v);
}

// ZeRO-Init (EngineConfig::initializer; DeepSpeed's zero.Init, FSDP2's meta-device
// initialisation): writes the initial values of elements [first, first + out.size()) of the
// parameter `name` (flattened; under tensor parallelism, of the slice this rank's model visits,
// whose Placement maps it into the full tensor) into out; the engine asks each rank for the
// elements it keeps.
using Initializer =
    std::function<void(std::string_view name, std::size_t first, std::span<float> out)>;

// A model's parameters as zp takes them over: the list and, per parameter, the model's value and
// gradient views.
template <class T>
struct BoundParameters {
  std::vector<ParamInfo> params;
  std::vector<View<T>*> values, grads;
};

// Visits the model twice and checks what model.hpp's rules promise, with messages naming the
// parameter: sizes of value and grad agree and are not zero, modules are numbered 0, 1, ... in
// non-decreasing order without gaps, names are not empty, every view is a distinct object (the
// same Param registered twice, or a value view passed as its own gradient, would have zp write
// two things into one view), and the second visit sees exactly what the first did.
template <class T, Model<T> M>
BoundParameters<T> bind_parameters(M& model) {
  BoundParameters<T> out;
  std::vector<std::pair<const View<T>*, std::size_t>> seen;  // every view, with its parameter
  visit_parameters<T>(model, [&](std::string_view name, int module, View<T>& value, View<T>& grad,
                                 TensorParallel tp, const Placement& place) {
    const std::string n(name);
    const auto& ps = out.params;
    ZP_EXPECT(!n.empty(), "model: parameter #", ps.size(), " has an empty name");
    ZP_EXPECT(value.size() == grad.size(), "model: parameter '", n, "' has a value view of ",
              value.size(), " elements but a gradient view of ", grad.size());
    ZP_EXPECT(value.size() > 0, "model: parameter '", n,
              "' has 0 elements; leave empty parameters out of for_each_parameter");
    const int prev = ps.empty() ? 0 : ps.back().module;
    ZP_EXPECT(
        module == prev || module == prev + 1, "model: parameter '", n, "' is in module ", module,
        " but the previous parameter was in module ", prev,
        "; visit parameters in forward order with modules numbered 0, 1, 2, ... without gaps");
    ZP_EXPECT(!ps.empty() || module == 0, "model: the first parameter '", n, "' is in module ",
              module, "; modules are numbered from 0");
    place.check("model: parameter '" + n + "'");
    ZP_EXPECT(place.shape.empty() || place.size() == value.size(), "model: parameter '", n,
              "' has ", value.size(), " elements but its Placement's box holds ", place.size());
    out.params.push_back({n, module, value.size(), tp, place});
    out.values.push_back(&value);
    out.grads.push_back(&grad);
    seen.push_back({&value, ps.size() - 1});
    seen.push_back({&grad, ps.size() - 1});
  });
  ZP_EXPECT(!out.params.empty(), "model: for_each_parameter visited no parameter");
  std::sort(seen.begin(), seen.end(), [](const auto& a, const auto& b) {
    return std::less<const View<T>*>()(a.first, b.first);
  });
  for (std::size_t i = 1; i < seen.size(); ++i) {
    if (seen[i].first != seen[i - 1].first) continue;
    const auto& a = out.params[seen[i - 1].second];
    const auto& b = out.params[seen[i].second];
    throw Error(
        Errc::invalid_argument,
        detail::cat("model: parameters '", a.name, "' and '", b.name, "' share one View object",
                    a.name == b.name ? " (a value view passed as its own gradient?)" : "",
                    "; every parameter needs its own value and gradient views"));
  }
  std::size_t k = 0;
  visit_parameters<T>(model, [&](std::string_view name, int module, View<T>& value, View<T>& grad) {
    const auto& ps = out.params;
    ZP_EXPECT(k < ps.size() && ps[k].name == name && ps[k].module == module &&
                  out.values[k] == &value && out.grads[k] == &grad,
              "model: for_each_parameter visited '", name, "' (module ", module, ") as parameter #",
              k, " the second time, but ",
              k < ps.size() ? "'" + ps[k].name + "'" : std::string("nothing"),
              " the first time; it must visit the same parameters (and views) every time");
    ++k;
  });
  ZP_EXPECT(k == out.params.size(), "model: for_each_parameter visited ", out.params.size(),
            " parameters the first time but ", k,
            " the second; it must visit the same parameters every time");
  return out;
}

// The parameter list of a model, checked as bind_parameters does.
template <class T, Model<T> M>
std::vector<ParamInfo> describe_parameters(M& model) {
  return bind_parameters<T>(model).params;
}

}  // namespace zp
