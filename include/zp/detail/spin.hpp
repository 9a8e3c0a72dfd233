// zp/detail/spin.hpp: how the host backends wait for each other (threads in one process, the
// mpi backend's ranks of one node in shared memory): a short spin pays only when every waiting
// rank can have a core of its own (it saves a sleep and wake-up of tens of microseconds);
// otherwise the waiter sleeps at once. The cores are those the ranks may run on (their affinity:
// taskset, a cpuset cgroup, a batch system's allocation), not the machine's: two thread ranks
// spinning on one allowed core took 108 us an all_reduce of 4 KiB, against 4 us not spinning.
// A cgroup's CPU quota (docker --cpus, Kubernetes' CPU limits) caps them too: spinning spends
// the quota the ranks computing need (bench/RESULTS.md, "A cgroup's CPU quota": zp_demo and
// zp_gpt runs in a cgroup of 1 CPU, before and after).
#pragma once

#include <sched.h>

#include <algorithm>
#include <thread>

#include "zp/detail/cgroup.hpp"

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

// The CPUs the calling thread may run on (empty where they cannot be read).
inline cpu_set_t allowed_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) CPU_ZERO(&set);
  return set;
}

// How many of `set`'s CPUs, or the machine's where it holds none.
inline int cores_in(const cpu_set_t& set) {
  const int n = CPU_COUNT(&set);
  return n > 0 ? n : int(std::thread::hardware_concurrency());
}

// The cores this process may run on (the affinity of the thread that asks first, which the
// threads it starts inherit), at most its CPU quota, asked once.
inline int cores() {
  static const int n = std::min(cores_in(allowed_cpus()), quota_cpus());
  return n;
}

// Whether `ranks` waiting for each other, all of them threads of this process, can each have a
// core.
inline bool spin_pays(int ranks) { return ranks <= cores(); }

// Spins a little (a few microseconds) until done() holds.
template <class Done>
void spin_until(Done&& done) {
  for (int i = 0; i < 4000 && !done(); ++i) cpu_relax();
}

}  // namespace zp::detail
