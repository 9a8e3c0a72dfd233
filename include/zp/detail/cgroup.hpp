// zp/detail/cgroup.hpp: what the process's cgroups (v1 and v2) and its machine let it use: CPU
// time (a quota: how the host backends wait, spin.hpp) and memory (the room the engine's ranks
// check their host buffers against before they allocate them, engine_agreement.hpp: past a
// memory cgroup's limit the kernel kills the process, which names nothing).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "zp/detail/hash.hpp"
#include "zp/error.hpp"

namespace zp::detail {

// A small text file's contents ("" where it cannot be read): /proc and cgroup files, whose
// sizes stat does not know.
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// `text` split at each `sep`.
inline std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> f;
  for (std::size_t at = 0;;) {
    const std::size_t end = text.find(sep, at);
    f.push_back(text.substr(at, end - at));
    if (end == text.npos) return f;
    at = end + 1;
  }
}

// A directory of a cgroup that governs the process: under a v2 hierarchy, or a v1 one holding
// the controller asked for.
struct CgroupDir {
  std::string path;
  bool v2;
};

// The directories of the process's cgroups that can hold `controller`'s files (its cgroup under
// each hierarchy with that controller, v2's whatever it enables, and each ancestor up to the
// mount point), leaf first. `proc_cgroup` and `mountinfo` are the texts of /proc/self/cgroup and
// /proc/self/mountinfo.
inline std::vector<CgroupDir> cgroup_dirs(std::string_view proc_cgroup, std::string_view mountinfo,
                                          std::string_view controller) {
  const auto has = [](std::string_view list, std::string_view name) {
    const auto items = split(list, ',');
    return std::find(items.begin(), items.end(), name) != items.end();
  };
  std::vector<CgroupDir> dirs;
  for (const std::string_view entry : split(proc_cgroup, '\n')) {
    // "hierarchy:controllers:path": v2's is "0::path"; a v1 controller may share its hierarchy
    // ("cpu,cpuacct").
    const auto c = split(entry, ':');
    if (c.size() < 3 || c[2].empty() || c[2][0] != '/') continue;
    const bool v2 = c[0] == "0" && c[1].empty();
    if (!v2 && !has(c[1], controller)) continue;
    const std::string_view path = entry.substr(c[0].size() + c[1].size() + 2);
    for (const std::string_view line : split(mountinfo, '\n')) {
      // "id parent dev root mount-point options [tags] - type source super-options"
      const std::size_t dash = line.find(" - ");
      if (dash == line.npos) continue;
      // The type first: a host may have thousands of mounts, few of them cgroups.
      const auto t = split(line.substr(dash + 3), ' ');
      if (t.size() < 3 || (v2 ? t[0] != "cgroup2" : t[0] != "cgroup" || !has(t[2], controller)))
        continue;
      const auto m = split(line.substr(0, dash), ' ');
      if (m.size() < 5) continue;
      // The process's cgroup under the mount: its path less the mount's root (a container sees
      // its own cgroup as the root); one outside that root is read at the mount point.
      const std::string_view root = m[3] == "/" ? "" : m[3];
      std::string mount(m[4]), dir = mount;
      if (path.substr(0, root.size()) == root &&
          (path.size() == root.size() || path[root.size()] == '/'))
        dir += path.substr(root.size());
      while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
      for (;;) {
        dirs.push_back({dir, v2});
        if (dir.size() <= mount.size()) break;
        dir.resize(dir.rfind('/'));
      }
    }
  }
  return dirs;
}

// The CPU time a cgroup quota lets the process use, in CPUs rounded up: the smallest over its
// cgroup and the ancestors it can see, cgroup v2's cpu.max ("150000 100000": 2) and v1's
// cpu.cfs_quota_us over cpu.cfs_period_us; INT_MAX where none is set or none can be read.
inline int cgroup_cpus(std::string_view proc_cgroup, std::string_view mountinfo) {
  // Quota over period, rounded up; INT_MAX for none ("max", -1) or text that is not a number.
  const auto ratio = [](std::string_view quota, std::string_view period) {
    long long q = 0, p = 0;
    std::from_chars(quota.data(), quota.data() + quota.size(), q);
    std::from_chars(period.data(), period.data() + period.size(), p);
    return q > 0 && p > 0 ? int(std::min<long long>(q / p + (q % p != 0), INT_MAX)) : INT_MAX;
  };
  int cpus = INT_MAX;
  for (const CgroupDir& d : cgroup_dirs(proc_cgroup, mountinfo, "cpu")) {
    if (d.v2) {
      const std::string max = read_text(d.path + "/cpu.max");
      const auto q = split(max, ' ');
      if (q.size() == 2) cpus = std::min(cpus, ratio(q[0], q[1]));
    } else {
      cpus = std::min(cpus, ratio(read_text(d.path + "/cpu.cfs_quota_us"),
                                  read_text(d.path + "/cpu.cfs_period_us")));
    }
  }
  return cpus;
}

// This process's /proc/self/cgroup and /proc/self/mountinfo, read once (a host may have
// thousands of mounts; zp does not move processes between cgroups).
struct SelfCgroup {
  std::string cgroup, mountinfo;
};
inline const SelfCgroup& self_cgroup() {
  static const SelfCgroup s{read_text("/proc/self/cgroup"), read_text("/proc/self/mountinfo")};
  return s;
}

// This process's cgroup CPU quota (cgroup_cpus), read once: that costs more than a small
// collective.
inline int quota_cpus() {
  static const int n = cgroup_cpus(self_cgroup().cgroup, self_cgroup().mountinfo);
  return n;
}

// ---- memory ---------------------------------------------------------------------------------

// Byte counts are capped here (an exbibyte), so that sums of a few of them fit an int64_t;
// v1's "no limit" (9223372036854771712) and v2's "max" read as it.
inline constexpr std::int64_t no_memory_limit = std::int64_t(1) << 60;

// The number a cgroup file or a memory.stat line holds: "max" and values past no_memory_limit
// are no_memory_limit; -1 where the text is not a number.
inline std::int64_t cgroup_bytes(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  if (text == "max") return no_memory_limit;
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return -1;
  return std::int64_t(std::min<std::uint64_t>(v, no_memory_limit));
}

// The value of `key` in a "key value" file (memory.stat; /proc/meminfo's "Key: N kB" in bytes);
// -1 where it is missing.
inline std::int64_t stat_bytes(std::string_view text, std::string_view key) {
  for (std::string_view line : split(text, '\n')) {
    const std::size_t space = line.find_first_of(" :");
    if (line.substr(0, space) != key) continue;
    line.remove_prefix(space + 1);
    const bool kb = line.ends_with(" kB");
    if (kb) line.remove_suffix(3);
    line.remove_prefix(std::min(line.size(), line.find_first_not_of(' ')));
    const std::int64_t v = cgroup_bytes(line);
    return v < 0 || !kb ? v : std::min(v, no_memory_limit >> 10) << 10;
  }
  return -1;
}

// Bytes as MiB with one decimal, for messages.
inline std::string mib(std::int64_t bytes) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, double(bytes) / double(1 << 20),
                               std::chars_format::fixed, 1);
  return std::string(buf, r.ptr) + " MiB";
}

// What memory the process may still fill before the kernel kills it (or, outside a memory
// cgroup, the machine's OOM killer picks a process): optimistic, so that a check against it
// refuses only what cannot fit. Page cache (not shared memory: memfds and tmpfs are not
// reclaimable without swap) counts as free, and so does the swap the process may use.
struct MemoryRoom {
  std::int64_t bytes = no_memory_limit;  // no_memory_limit: none found
  std::string where;                     // what sets it, with its figures
  std::string path;                      // the cgroup directory ("" for the machine)
};

// The least room over the process's memory cgroup and the ancestors it can see with a limit
// (v2: memory.max less memory.current, v1: memory.limit_in_bytes less memory.usage_in_bytes,
// each plus its page cache and its swap room); `swap_free` is the machine's (SwapFree).
inline MemoryRoom cgroup_memory_room(std::string_view proc_cgroup, std::string_view mountinfo,
                                     std::int64_t swap_free) {
  MemoryRoom least;
  for (const CgroupDir& d : cgroup_dirs(proc_cgroup, mountinfo, "memory")) {
    const auto file = [&](const char* name) { return cgroup_bytes(read_text(d.path + name)); };
    const char* const limit_file = d.v2 ? "/memory.max" : "/memory.limit_in_bytes";
    const std::int64_t limit = file(limit_file),
                       usage = file(d.v2 ? "/memory.current" : "/memory.usage_in_bytes");
    if (limit < 0 || limit >= no_memory_limit || usage < 0) continue;
    const std::string stat = read_text(d.path + "/memory.stat");
    // v1's total_ counts are the subtree's, as its usage is.
    const std::int64_t cache = stat_bytes(stat, d.v2 ? "file" : "total_cache"),
                       shmem = stat_bytes(stat, d.v2 ? "shmem" : "total_shmem");
    const std::int64_t reclaimable =
                           std::max<std::int64_t>(0, cache - std::max<std::int64_t>(0, shmem)),
                       held = std::max<std::int64_t>(0, usage - reclaimable);
    std::int64_t swap = std::max<std::int64_t>(0, swap_free), room = limit - held;
    if (d.v2) {  // no memory.swap.max: the cgroup's swap is not limited
      const std::int64_t max = file("/memory.swap.max"), used = file("/memory.swap.current");
      if (max >= 0 && used >= 0) swap = std::min(swap, std::max<std::int64_t>(0, max - used));
      room = std::max<std::int64_t>(0, room) + swap;
    } else {  // memsw: memory and swap together
      const std::int64_t both = file("/memory.memsw.limit_in_bytes"),
                         used = file("/memory.memsw.usage_in_bytes");
      room = std::max<std::int64_t>(0, room) + swap;
      if (both >= 0 && both < no_memory_limit && used >= 0)
        room = std::min(room, std::max<std::int64_t>(0, both - used + (usage - held)));
    }
    if (room < least.bytes)
      least = {room,
               cat("the memory cgroup ", d.path, " (", limit_file + 1, " ", mib(limit), ", ",
                   mib(held), " in use besides page cache",
                   swap > 0 ? cat(", ", mib(swap), " of swap") : std::string(), ")"),
               d.path};
  }
  return least;
}

// The machine's room: MemAvailable and SwapFree of `meminfo` (/proc/meminfo's text).
inline MemoryRoom machine_memory_room(std::string_view meminfo) {
  const std::int64_t available = stat_bytes(meminfo, "MemAvailable"),
                     swap = std::max<std::int64_t>(0, stat_bytes(meminfo, "SwapFree"));
  if (available < 0) return {};
  return {available + swap,
          cat("this machine (/proc/meminfo: MemAvailable ", mib(available), ", SwapFree ",
              mib(swap), ")"),
          ""};
}

// A limit's identity in the memory check: a positive 62-bit value, so that a sum of one per
// rank is exact.
inline std::int64_t limit_identity(const Fnv1a& h) { return std::int64_t(h.value() >> 2) | 1; }

// The process's room now: its memory cgroup's (`cgroup`) and its machine's (`machine`), each
// with an identity that the ranks sharing it share (the machine's boot, the cgroup's inode
// there): 0 where no limit was found.
struct HostRoom {
  MemoryRoom cgroup, machine;
  std::int64_t cgroup_id = 0, machine_id = 0;
};
inline HostRoom host_memory_room() {
  // The machine: its boot (which its containers share), else its name; "" for neither.
  static const std::string machine = [] {
    std::string boot = read_text("/proc/sys/kernel/random/boot_id");
    if (boot.empty()) {
      char name[256] = {};
      ::gethostname(name, sizeof name - 1);
      boot = name;
    }
    return boot;
  }();
  const std::string meminfo = read_text("/proc/meminfo");
  HostRoom r;
  r.machine = machine_memory_room(meminfo);
  r.cgroup = cgroup_memory_room(self_cgroup().cgroup, self_cgroup().mountinfo,
                                std::max<std::int64_t>(0, stat_bytes(meminfo, "SwapFree")));
  if (machine.empty()) return r;  // no identity to share: no check
  if (r.machine.bytes < no_memory_limit)
    r.machine_id = limit_identity(Fnv1a().all(std::string_view(machine)));
  struct stat st {};
  if (r.cgroup.bytes < no_memory_limit && ::stat(r.cgroup.path.c_str(), &st) == 0)
    r.cgroup_id = limit_identity(
        Fnv1a().all(std::string_view(machine), std::uint64_t(st.st_dev), std::uint64_t(st.st_ino)));
  return r;
}

}  // namespace zp::detail
