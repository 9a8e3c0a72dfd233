// zp/detail/function_ref.hpp: a non-owning reference to a callable. A function that takes any
// callable but does much besides calling it (on_every_rank's agreement, run_threads' threads and
// failure handling) takes a FunctionRef, so its body is compiled once instead of once for every
// caller's lambda; only a one-line trampoline is made per callable.
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace zp::detail {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  // f must outlive the FunctionRef (a parameter's does: the call it is passed to).
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> &&
             std::is_object_v<std::remove_reference_t<F>> &&
             std::is_invocable_r_v<R, std::remove_reference_t<F>&, Args...>)
  FunctionRef(F&& f)
  noexcept  // NOLINT: converts implicitly, as a callable parameter would
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, Args... args) -> R {
          auto& fn = *static_cast<std::remove_reference_t<F>*>(o);
          if constexpr (std::is_void_v<R>)
            std::invoke(fn, std::forward<Args>(args)...);
          else
            return std::invoke(fn, std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace zp::detail
