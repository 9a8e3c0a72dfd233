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
#include <charconv>
#include <climits>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

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

// A small text file's contents ("" where it cannot be read): /proc and cgroup files, whose
// sizes stat does not know.
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The CPU time a cgroup quota lets the process use, in CPUs rounded up: the smallest over its
// cgroup and the ancestors it can see, cgroup v2's cpu.max ("150000 100000": 2) and v1's
// cpu.cfs_quota_us over cpu.cfs_period_us; INT_MAX where none is set or none can be read.
// `proc_cgroup` and `mountinfo` are the texts of /proc/self/cgroup and /proc/self/mountinfo.
inline int cgroup_cpus(std::string_view proc_cgroup, std::string_view mountinfo) {
  const auto fields = [](std::string_view line, char sep) {
    std::vector<std::string_view> f;
    for (std::size_t at = 0;;) {
      const std::size_t end = line.find(sep, at);
      f.push_back(line.substr(at, end - at));
      if (end == line.npos) return f;
      at = end + 1;
    }
  };
  const auto has = [&](std::string_view list, std::string_view name) {
    const auto items = fields(list, ',');
    return std::find(items.begin(), items.end(), name) != items.end();
  };
  // Quota over period, rounded up; INT_MAX for none ("max", -1) or text that is not a number.
  const auto ratio = [](std::string_view quota, std::string_view period) {
    long long q = 0, p = 0;
    std::from_chars(quota.data(), quota.data() + quota.size(), q);
    std::from_chars(period.data(), period.data() + period.size(), p);
    return q > 0 && p > 0 ? int(std::min<long long>(q / p + (q % p != 0), INT_MAX)) : INT_MAX;
  };
  int cpus = INT_MAX;
  for (const std::string_view entry : fields(proc_cgroup, '\n')) {
    // "hierarchy:controllers:path": v2's is "0::path"; v1's cpu controller may share its
    // hierarchy ("cpu,cpuacct").
    const auto c = fields(entry, ':');
    if (c.size() < 3 || c[2].empty() || c[2][0] != '/') continue;
    const bool v2 = c[0] == "0" && c[1].empty();
    if (!v2 && !has(c[1], "cpu")) continue;
    const std::string_view path = entry.substr(c[0].size() + c[1].size() + 2);
    for (const std::string_view line : fields(mountinfo, '\n')) {
      // "id parent dev root mount-point options [tags] - type source super-options"
      const std::size_t dash = line.find(" - ");
      if (dash == line.npos) continue;
      // The type first: a host may have thousands of mounts, few of them cgroups.
      const auto t = fields(line.substr(dash + 3), ' ');
      if (t.size() < 3 || (v2 ? t[0] != "cgroup2" : t[0] != "cgroup" || !has(t[2], "cpu")))
        continue;
      const auto m = fields(line.substr(0, dash), ' ');
      if (m.size() < 5) continue;
      // The process's cgroup under the mount: its path less the mount's root (a container sees
      // its own cgroup as the root); one outside that root is read at the mount point.
      const std::string_view root = m[3] == "/" ? "" : m[3];
      std::string mount(m[4]), dir = mount;
      if (path.substr(0, root.size()) == root &&
          (path.size() == root.size() || path[root.size()] == '/'))
        dir += path.substr(root.size());
      while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
      for (;;) {  // the cgroup and its ancestors up to the mount point
        if (v2) {
          const std::string max = read_text(dir + "/cpu.max");
          const auto q = fields(max, ' ');
          if (q.size() == 2) cpus = std::min(cpus, ratio(q[0], q[1]));
        } else {
          cpus = std::min(cpus, ratio(read_text(dir + "/cpu.cfs_quota_us"),
                                      read_text(dir + "/cpu.cfs_period_us")));
        }
        if (dir.size() <= mount.size()) break;
        dir.resize(dir.rfind('/'));
      }
    }
  }
  return cpus;
}

// This process's cgroup CPU quota (cgroup_cpus), read once: that costs more than a small
// collective.
inline int quota_cpus() {
  static const int n =
      cgroup_cpus(read_text("/proc/self/cgroup"), read_text("/proc/self/mountinfo"));
  return n;
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
