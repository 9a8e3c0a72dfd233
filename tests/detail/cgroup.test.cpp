// zp/detail/cgroup.hpp against references computed here, on cgroup trees made in a temporary
// directory: the CPU quota (v2's cpu.max over nested cgroups, v1's cpu.cfs_* where the cpu
// controller shares a hierarchy, a container's cgroup seen as the mount's root) and the memory
// room (limits, usage, page cache, shared memory and swap, v1 and v2), with random values;
// texts that name nothing readable mean no limit. Real cgroups:
// zp.test.backend.threads.cpu_quota and zp.test.engine.memory_cgroup.
#include "zp/detail/cgroup.hpp"

#include <doctest/doctest.h>

#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "../random.hpp"
#include "../temp_dir.hpp"

namespace {

namespace fs = std::filesystem;

void write(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text;
}

// A random quota in CPUs' worth of time, or none (0); the reference rounds in long double.
struct Quota {
  long long quota = 0, period = 0;
  int cpus() const {
    return quota > 0 ? int(std::ceil((long double)quota / (long double)period)) : INT_MAX;
  }
};

Quota random_quota(std::uint64_t seed, int i) {
  const std::uint64_t x = zp::test::mix(seed + std::uint64_t(i));
  if (x % 3 == 0) return {};
  return {1000 + (long long)(x >> 8) % 10'000'000, 1000 + (long long)(x >> 40) % 1'000'000};
}

}  // namespace

TEST_CASE("cgroup v2: the smallest cpu.max of the process's cgroup and its ancestors, rounded up") {
  const std::uint64_t seed = zp::test::run_seed("cgroup.test");
  for (int trial = 0; trial < 20; ++trial) {
    zp::test::TempDir dir("cgroup2");
    const fs::path mount = dir.path / "cgroup";
    const char* const levels[] = {"", "/kubepods", "/kubepods/pod7", "/kubepods/pod7/ctr"};
    int want = INT_MAX;
    for (int l = 0; l < 4; ++l) {
      const Quota q = random_quota(seed, trial * 8 + l);
      write(mount.string() + levels[l] + "/cpu.max",
            q.quota > 0 ? std::to_string(q.quota) + " " + std::to_string(q.period) + "\n"
                        : "max 100000\n");
      want = std::min(want, q.cpus());
    }
    // A sibling's limit is not the process's.
    write(mount / "kubepods/pod8/cpu.max", "1000 100000\n");
    const std::string mountinfo =
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "35 24 0:30 / " +
        mount.string() + " rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";
    CAPTURE(trial);
    CHECK(zp::detail::cgroup_cpus("0::/kubepods/pod7/ctr\n", mountinfo) == want);
    // In the cgroup's own namespace (a container's): the same cgroup seen as the root.
    const std::string own = "35 24 0:30 /kubepods/pod7/ctr " + mount.string() +
                            "/kubepods/pod7/ctr rw - cgroup2 cgroup2 rw\n";
    const Quota leaf = random_quota(seed, trial * 8 + 3);
    CHECK(zp::detail::cgroup_cpus("0::/kubepods/pod7/ctr\n", own) == leaf.cpus());
  }
}

TEST_CASE("cgroup v1: cpu.cfs_quota_us over cpu.cfs_period_us of the hierarchy holding cpu") {
  const std::uint64_t seed = zp::test::run_seed("cgroup.test");
  for (int trial = 0; trial < 20; ++trial) {
    zp::test::TempDir dir("cgroup1");
    const fs::path cpu = dir.path / "cpu,cpuacct", cpuset = dir.path / "cpuset";
    const char* const levels[] = {"", "/docker", "/docker/abc"};
    int want = INT_MAX;
    for (int l = 0; l < 3; ++l) {
      const Quota q = random_quota(seed, trial * 8 + l);
      write(cpu.string() + levels[l] + "/cpu.cfs_quota_us",
            std::to_string(q.quota > 0 ? q.quota : -1) + "\n");
      write(cpu.string() + levels[l] + "/cpu.cfs_period_us",
            std::to_string(q.quota > 0 ? q.period : 100000) + "\n");
      want = std::min(want, q.cpus());
    }
    // Files of a hierarchy without the cpu controller are not a quota (nor is v2's hierarchy
    // here, which holds no controller: no cpu.max).
    write(cpuset / "docker/abc/cpu.cfs_quota_us", "1000\n");
    write(cpuset / "docker/abc/cpu.cfs_period_us", "100000\n");
    fs::create_directories(dir.path / "unified/docker/abc");
    const std::string cgroup = "11:cpuset:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n";
    const std::string mountinfo = "30 24 0:26 / " + cpuset.string() +
                                  " rw - cgroup cgroup rw,cpuset\n"
                                  "31 24 0:27 / " +
                                  cpu.string() +
                                  " rw - cgroup cgroup rw,cpu,cpuacct\n"
                                  "29 24 0:25 / " +
                                  (dir.path / "unified").string() + " rw - cgroup2 cgroup2 rw\n";
    CAPTURE(trial);
    CHECK(zp::detail::cgroup_cpus(cgroup, mountinfo) == want);
    // Docker without a cgroup namespace: the host's path, the container's cgroup mounted as the
    // root. A path outside the mount's root is read at the mount point.
    const Quota leaf = random_quota(seed, trial * 8 + 2);
    const std::string own =
        "31 24 0:27 /docker/abc " + (cpu / "docker/abc").string() + " rw - cgroup cgroup rw,cpu\n";
    CHECK(zp::detail::cgroup_cpus(cgroup, own) == leaf.cpus());
    CHECK(zp::detail::cgroup_cpus("4:cpu:/elsewhere\n", own) == leaf.cpus());
    CHECK(zp::detail::cgroup_cpus("4:cpu:/docker/abcdef\n", own) == leaf.cpus());
  }
}

TEST_CASE("no quota where none is set or the texts name nothing readable") {
  zp::test::TempDir dir("cgroup");
  write(dir.path / "cpu.max", "max 100000\n");
  const std::string mount = dir.path.string();
  CHECK(zp::detail::cgroup_cpus("0::/\n", "1 0 0:1 / " + mount + " rw - cgroup2 c rw\n") ==
        INT_MAX);
  // Whole CPUs are exact; a part of one counts as one.
  for (const auto& [text, cpus] :
       {std::pair{"50000 100000\n", 1}, std::pair{"100000 100000\n", 1},
        std::pair{"200000 100000\n", 2}, std::pair{"200001 100000", 3}}) {
    write(dir.path / "cpu.max", text);
    CHECK(zp::detail::cgroup_cpus("0::/\n", "1 0 0:1 / " + mount + " rw - cgroup2 c rw\n") == cpus);
  }
  for (const char* bad : {"", "0::", "0:/\n", "garbage", "0::relative\n", "::::\n"})
    CHECK(zp::detail::cgroup_cpus(bad, "1 0 0:1 / " + mount + " rw - cgroup2 c rw\n") == INT_MAX);
  for (const char* bad :
       {"", "1 0 0:1 / ", "- cgroup2", "1 0 0:1 /x /nonexistent rw - cgroup2 c rw",
        "1 0 0:1 / /nonexistent rw - cgroup2 c rw\n", " -  -  - \n"})
    CHECK(zp::detail::cgroup_cpus("0::/a/b\n", bad) == INT_MAX);
  write(dir.path / "cpu.max", "lots 100000\n");
  CHECK(zp::detail::cgroup_cpus("0::/\n", "1 0 0:1 / " + mount + " rw - cgroup2 c rw\n") ==
        INT_MAX);
}

namespace {

// A memory cgroup's figures, random; the reference room in long double, from the definitions
// (what the process may still fill: the limit less what page cache cannot free, plus swap).
struct MemCgroup {
  long long limit = -1, usage = 0, cache = 0, shmem = 0, swap_max = -1, swap_used = 0;
  long double room(long double swap_free, bool v2) const {
    if (limit < 0) return (long double)zp::detail::no_memory_limit;
    const long double held = (long double)usage - ((long double)cache - (long double)shmem);
    long double swap = swap_free;
    if (v2 && swap_max >= 0)
      swap = std::min(swap, std::max<long double>(0, (long double)(swap_max - swap_used)));
    long double r = std::max<long double>(0, (long double)limit - held) + swap;
    if (!v2 && swap_max >= 0)  // v1's memsw limit: memory and swap together
      r = std::min(r, std::max<long double>(0, (long double)swap_max -
                                                   ((long double)usage + (long double)swap_used) +
                                                   ((long double)cache - (long double)shmem)));
    return r;
  }
};

MemCgroup random_memory(std::uint64_t seed, int i, bool swap_limits) {
  const std::uint64_t x = zp::test::mix(seed + 1000 + std::uint64_t(i));
  MemCgroup m;
  if (x % 4 == 0) return m;  // no limit
  m.limit = (long long)(x >> 8 & 0xffffff) << 12;
  m.usage = (long long)(zp::test::mix(x) % std::uint64_t(m.limit + 1));
  m.cache = (long long)(zp::test::mix(x + 1) % std::uint64_t(m.usage + 1));
  m.shmem = (long long)(zp::test::mix(x + 2) % std::uint64_t(m.cache + 1));
  if (swap_limits && x >> 40 & 1) {
    m.swap_max = (long long)(zp::test::mix(x + 3) % (1ull << 34));
    m.swap_used = (long long)(zp::test::mix(x + 4) % std::uint64_t(m.swap_max / 2 + 1));
  }
  return m;
}

}  // namespace

TEST_CASE("memory room: the least over a cgroup and its ancestors, page cache and swap free") {
  const std::uint64_t seed = zp::test::run_seed("cgroup.test");
  for (int trial = 0; trial < 40; ++trial) {
    const bool v2 = trial % 2 == 0;
    zp::test::TempDir dir("memcg");
    const fs::path mount = dir.path / (v2 ? "unified" : "memory");
    const char* const levels[] = {"", "/kubepods", "/kubepods/pod7", "/kubepods/pod7/ctr"};
    const long double swap_free =
        trial % 3 == 0 ? 0
                       : (long double)(zp::test::mix(seed + std::uint64_t(trial)) % (1ull << 33));
    long double want = (long double)zp::detail::no_memory_limit;
    std::string want_dir;
    for (int l = 0; l < 4; ++l) {
      const MemCgroup m = random_memory(seed, trial * 8 + l, true);
      const std::string d = mount.string() + levels[l];
      const std::string limit =
          m.limit < 0 ? (v2 ? "max" : "9223372036854771712") : std::to_string(m.limit);
      if (v2) {
        write(d + "/memory.max", limit + "\n");
        write(d + "/memory.current", std::to_string(m.usage) + "\n");
        write(d + "/memory.stat", "anon 4096\nfile " + std::to_string(m.cache) +
                                      "\nkernel 8192\nshmem " + std::to_string(m.shmem) +
                                      "\nfile_mapped 0\n");
        if (m.swap_max >= 0) {
          write(d + "/memory.swap.max", std::to_string(m.swap_max) + "\n");
          write(d + "/memory.swap.current", std::to_string(m.swap_used) + "\n");
        }
      } else {
        write(d + "/memory.limit_in_bytes", limit + "\n");
        write(d + "/memory.usage_in_bytes", std::to_string(m.usage) + "\n");
        // The cgroup's own counts, then its subtree's (the ones that go with its usage).
        write(d + "/memory.stat", "cache 1\nshmem 0\nrss 4096\ntotal_cache " +
                                      std::to_string(m.cache) + "\ntotal_shmem " +
                                      std::to_string(m.shmem) + "\n");
        if (m.swap_max >= 0) {
          write(d + "/memory.memsw.limit_in_bytes", std::to_string(m.swap_max) + "\n");
          write(d + "/memory.memsw.usage_in_bytes", std::to_string(m.usage + m.swap_used) + "\n");
        }
      }
      const long double r = m.room(swap_free, v2);
      if (m.limit >= 0 && r <= want) {  // a tie names the innermost cgroup
        want = r;
        want_dir = d;
      }
    }
    // A sibling's limit is not the process's; nor is a hierarchy without the memory controller.
    write(mount / "kubepods/pod8/memory.max", "4096\n");
    write(mount / "kubepods/pod8/memory.limit_in_bytes", "4096\n");
    write(dir.path / "cpu/kubepods/pod7/ctr/memory.limit_in_bytes", "4096\n");
    write(dir.path / "cpu/kubepods/pod7/ctr/memory.usage_in_bytes", "0\n");
    const std::string cgroup =
        v2 ? "0::/kubepods/pod7/ctr\n" : "5:cpu:/kubepods/pod7/ctr\n3:memory:/kubepods/pod7/ctr\n";
    const std::string mountinfo =
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "30 24 0:26 / " +
        (dir.path / "cpu").string() + " rw - cgroup cgroup rw,cpu\n" + "35 24 0:30 / " +
        mount.string() +
        (v2 ? " rw shared:9 - cgroup2 cgroup2 rw\n" : " rw - cgroup cgroup rw,memory\n");
    CAPTURE(trial);
    const zp::detail::MemoryRoom got =
        zp::detail::cgroup_memory_room(cgroup, mountinfo, std::int64_t(swap_free));
    CHECK((long double)got.bytes == want);
    CHECK(got.path == want_dir);
    if (!want_dir.empty()) {
      CHECK(got.where.find("the memory cgroup " + want_dir + " (") == 0);
      CHECK(got.where.find(v2 ? "memory.max " : "memory.limit_in_bytes ") != std::string::npos);
    }
  }
}

TEST_CASE("memory room: no limit where none is set or the files say nothing readable") {
  zp::test::TempDir dir("memcg");
  const std::string mountinfo = "1 0 0:1 / " + dir.path.string() + " rw - cgroup2 c rw\n";
  const auto room = [&](std::int64_t swap_free = 0) {
    return zp::detail::cgroup_memory_room("0::/\n", mountinfo, swap_free).bytes;
  };
  const std::int64_t none = zp::detail::no_memory_limit;
  CHECK(room() == none);
  write(dir.path / "memory.max", "max\n");
  write(dir.path / "memory.current", "4096\n");
  CHECK(room() == none);
  for (const char* bad : {"", "lots\n", "12 34\n", "-5\n", "0x100\n"}) {
    write(dir.path / "memory.max", bad);
    CHECK(room() == none);
  }
  // A limit without a readable usage is not a room; without memory.stat, no page cache counts.
  write(dir.path / "memory.max", "1048576\n");
  write(dir.path / "memory.current", "\n");
  CHECK(room() == none);
  write(dir.path / "memory.current", "262144\n");
  CHECK(room() == 786432);
  CHECK(room(100) == 786532);
  // Usage past the limit (the kernel reclaiming): no room, not a negative one.
  write(dir.path / "memory.current", "2097152\n");
  CHECK(room() == 0);
  // Values past an exbibyte read as no limit; v1's "unlimited" is one of them.
  write(dir.path / "memory.max", "18446744073709551615\n");
  CHECK(room() == none);
}

TEST_CASE("the machine's room: MemAvailable and SwapFree of /proc/meminfo, in bytes") {
  const std::uint64_t seed = zp::test::run_seed("cgroup.test");
  for (int trial = 0; trial < 20; ++trial) {
    const std::uint64_t x = zp::test::mix(seed + 7000 + std::uint64_t(trial));
    const long long available = (long long)(x % (1ull << 40)), swap = (long long)(x >> 44);
    // Keys that begin alike (SwapFree after a "SwapFreeX" decoy) must not be taken for it.
    const std::string meminfo =
        "MemTotal:       32768000 kB\nMemFree:          123456 kB\n"
        "MemAvailable:   " +
        std::to_string(available) +
        " kB\nSwapFreeX:        99 kB\nSwapTotal:      0 kB\nSwapFree: " + std::to_string(swap) +
        " kB\n";
    const auto r = zp::detail::machine_memory_room(meminfo);
    CHECK(r.bytes == (available + swap) * 1024);
    CHECK(r.path.empty());
    CHECK(r.where.find("/proc/meminfo: MemAvailable ") != std::string::npos);
  }
  CHECK(zp::detail::machine_memory_room("MemTotal: 1 kB\n").bytes == zp::detail::no_memory_limit);
  CHECK(zp::detail::machine_memory_room("").bytes == zp::detail::no_memory_limit);
  CHECK(zp::detail::machine_memory_room("MemAvailable: 4 kB\n").bytes == 4096);
  CHECK(zp::detail::mib(3 << 19) == "1.5 MiB");
}
