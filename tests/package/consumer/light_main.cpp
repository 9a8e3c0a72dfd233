// Proves the include path of zp::zp (and its C++20) arrives, where main.cpp has already shown
// the rest through the same target definition.
#include <zp/config.hpp>

#include <cstdio>

static_assert(__cplusplus >= 202002L, "zp::zp must ask for C++20");

int main() {
  std::printf("consumer: zp %d.%d.%d headers found\n", ZP_VERSION_MAJOR, ZP_VERSION_MINOR,
              ZP_VERSION_PATCH);
  return 0;
}
