// zp/detail/spin.hpp: how the host backends wait for each other (threads in one process, the
// mpi backend's ranks of one node in shared memory): a short spin pays only when every waiting
// rank can have a core of its own (it saves a sleep and wake-up of tens of microseconds);
// otherwise the waiter sleeps at once.
#pragma once

#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace zp::detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// The cores of this machine, asked once: std::thread::hardware_concurrency reads /sys on every
// call (about 10 us, more than a whole small collective).
inline int cores() {
  static const int n = int(std::thread::hardware_concurrency());
  return n;
}

// Whether `ranks` waiting for each other can each have a core.
inline bool spin_pays(int ranks) { return ranks <= cores(); }

// Spins a little (a few microseconds) until done() holds.
template <class Done>
void spin_until(Done&& done) {
  for (int i = 0; i < 4000 && !done(); ++i) cpu_relax();
}

}  // namespace zp::detail
