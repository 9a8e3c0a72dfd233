// zp/detail/spin.hpp's cgroup CPU quota against a reference computed here, on cgroup trees
// made in a temporary directory (v2's cpu.max over nested cgroups, v1's cpu.cfs_* where the cpu
// controller shares a hierarchy, a container's cgroup seen as the mount's root) with random
// quotas; texts that name nothing readable mean no quota. The quota of a real cgroup:
// zp.test.backend.threads.cpu_quota.
#include "zp/detail/spin.hpp"

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
  const std::uint64_t seed = zp::test::run_seed("spin.test");
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
  const std::uint64_t seed = zp::test::run_seed("spin.test");
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
