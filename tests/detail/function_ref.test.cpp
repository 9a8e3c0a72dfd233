// zp/detail/function_ref.hpp: each kind of callable reached through a FunctionRef is the one
// called, with the arguments given (by reference where the signature says so), its result
// converted to the signature's or discarded for void; copies refer to the same callable.
#include "zp/detail/function_ref.hpp"

#include <doctest/doctest.h>

#include <string>

#include "../random.hpp"

using zp::detail::FunctionRef;

namespace {
int twice(int x) { return 2 * x; }
void append(std::string& s, int x) { s += std::to_string(x); }

int call_with(FunctionRef<int(int)> f, int x) { return f(x); }
}  // namespace

TEST_CASE("a FunctionRef calls the callable it was made from, with its arguments") {
  const int x = int(zp::test::run_seed("function_ref.test") % 1000);
  int calls = 0;
  auto counting = [&calls](int v) mutable {  // a non-const call operator
    ++calls;
    return v + 1;
  };
  CHECK(call_with(counting, x) == x + 1);
  CHECK(call_with([](int v) { return v * v; }, x) == x * x);  // a temporary, alive for the call
  CHECK(call_with(twice, x) == 2 * x);                        // a function
  CHECK(call_with(&twice, x) == 2 * x);                       // a function pointer
  struct Offset {
    int by;
    long operator()(int v) const { return long(v) + by; }  // a result converted to int
  } const offset{7};
  CHECK(call_with(offset, x) == x + 7);
  CHECK(calls == 1);

  std::string s;
  FunctionRef<void(std::string&, int)> a = append;
  a(s, x);
  const FunctionRef<void(std::string&, int)> copy = a;  // the same callable
  copy(s, 3);
  CHECK(s == std::to_string(x) + "3");

  auto count = [&] { return ++calls; };
  FunctionRef<void()> discards = count;  // the result, which a void signature drops
  discards();
  discards();
  CHECK(calls == 3);
}
