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
  union Target {
    void* object;
    void (*function)();  // a function's address, cast back to its own type before the call
  };

  template <class T, class... A>
  static R invoke(T& f, A&&... args) {
    if constexpr (std::is_void_v<R>)
      std::invoke(f, std::forward<A>(args)...);
    else
      return std::invoke(f, std::forward<A>(args)...);
  }

 public:
  // Any callable with this signature (a lambda, a function object, a function); it must outlive
  // the FunctionRef (a parameter's argument does: the call it is passed to). Not explicit: it
  // converts implicitly, as a callable parameter would.
  template <class F>
  FunctionRef(F&& f) noexcept
      requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> &&
               std::is_invocable_r_v<R, std::remove_reference_t<F>&, Args...>) {
    using T = std::remove_reference_t<F>;
    if constexpr (std::is_function_v<T>) {
      target_.function = reinterpret_cast<void (*)()>(&f);
      call_ = [](Target t, Args... args) -> R {
        return invoke(*reinterpret_cast<T*>(t.function), std::forward<Args>(args)...);
      };
    } else {
      target_.object = const_cast<void*>(static_cast<const void*>(std::addressof(f)));
      call_ = [](Target t, Args... args) -> R {
        return invoke(*static_cast<T*>(t.object), std::forward<Args>(args)...);
      };
    }
  }

  R operator()(Args... args) const { return call_(target_, std::forward<Args>(args)...); }

 private:
  Target target_;
  R (*call_)(Target, Args...);
};

}  // namespace zp::detail
