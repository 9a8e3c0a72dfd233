// Sums each rank's id over 3 thread-ranks: proves the headers, the target's include path,
// C++20 and the thread library all arrive with zp::zp.
#include <zp/zp.hpp>

#include <cstdio>
#include <span>

#ifndef ZP_CONSUMER_FLAG
#error "zp changed the consumer's CMAKE_CXX_FLAGS"
#endif

int main() {
  int wrong = 0;
  zp::backend::run_threads(3, [&](zp::Collective<zp::backend::Threads>& comm) {
    float x = float(comm.rank());
    comm.all_reduce(std::span<float>(&x, 1));
    if (x != 3.0f) ++wrong;
  });
  std::printf("consumer: all_reduce over 3 thread-ranks %s\n", wrong ? "WRONG" : "ok");
  return wrong ? 1 : 0;
}
