// tests/expect_error.hpp: the check every "bad input is a clear error" test makes.
#pragma once

#include <doctest/doctest.h>

#include <initializer_list>
#include <string>

#include "zp/detail/function_ref.hpp"
#include "zp/error.hpp"

namespace zp::test {

// Runs f, which must throw zp::Error of category `c` whose what() contains every needle (the
// value and the parameter or file it names); a call that does not throw fails the check. (f by
// FunctionRef: this body is compiled once per test file, not once per call.)
inline void expect_error(Errc c, detail::FunctionRef<void()> f,
                         std::initializer_list<std::string> needles) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.category() == c);
    INFO("message: ", std::string(e.what()));
    for (const std::string& n : needles)
      CHECK_MESSAGE(std::string(e.what()).find(n) != std::string::npos, "missing \"", n, "\"");
    return;
  }
  FAIL_CHECK("no zp::Error thrown; expected one containing \"",
             needles.size() ? *needles.begin() : "", "\"");
}

// The commonest case: a user mistake (Errc::invalid_argument).
inline void expect_invalid(detail::FunctionRef<void()> f,
                           std::initializer_list<std::string> needles) {
  expect_error(Errc::invalid_argument, f, needles);
}

}  // namespace zp::test
