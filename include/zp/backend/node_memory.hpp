// zp/backend/node_memory.hpp: host memory that the other processes of a node can map, and
// their mappings of it. The mpi backend's node path (mpi_node.hpp) installs NodeHeap as
// Allocator<host>'s arena (zp/memory.hpp), so zp's large buffers (and a user's, through
// zp::HostAllocator) can be read and written in place by the node's peers: a collective then
// copies each byte once instead of twice through the staging segment.
//
// Each allocation of at least the heap's threshold is a memfd of its own, kept open while the
// allocation lives so that a peer can open it through /proc/<pid>/fd (as the segment is opened).
// It never has a name, so nothing outlives the job. Its memory is reserved when it is made
// (posix_fallocate: too little memory gives a plain allocation, or bad_alloc, never a SIGBUS on
// first touch). Freeing truncates it first: a peer's mapping of it (NodeMappings keeps some)
// then holds no memory, only addresses. Not while an exception unwinds: a node-path call that
// fails on one rank ends the job (its peers are mid-call, maybe reading this buffer), and a
// peer's access to a truncated buffer would end it with a SIGBUS instead of the error. (A buffer
// freed after such an exception was caught can still do that.) A descriptor per allocation: at
// most a quarter of the process's descriptor limit as it is at the allocation (and 4096) are
// taken, the rest are plain memory. The heap is process-wide and stays once installed: the
// threads backend's buffers in that process are such memfds too, a forked child shares their
// pages instead of copying them, and they get no transparent huge pages.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "zp/detail/host_arena.hpp"
#include "zp/error.hpp"

namespace zp::backend::mpi_detail {

// Where a buffer lies in a NodeHeap allocation, as another process of the node finds it.
struct SharedRef {
  std::uint64_t id = 0;      // the allocation (unique in its process); 0: not a heap allocation
  std::uint64_t bytes = 0;   // its length
  std::uint64_t offset = 0;  // the buffer's offset in it
  std::uint64_t inode = 0;   // the memfd's (what a peer opens must be this one)
  std::int32_t fd = -1;      // its descriptor in the owning process
};

class NodeHeap final : public detail::HostArena {
 public:
  // The process's heap, installed as Allocator<host>'s arena on first use. It is never
  // destroyed: buffers it served may be freed during static destruction.
  static NodeHeap& install(std::size_t min_bytes) {
    static NodeHeap* heap = new NodeHeap;
    std::size_t now = heap->min_bytes_.load(std::memory_order_relaxed);
    while (min_bytes < now && !heap->min_bytes_.compare_exchange_weak(now, min_bytes)) {
    }
    detail::host_arena().store(heap, std::memory_order_release);
    return *heap;
  }

  void* allocate(std::size_t bytes) noexcept override {
    if (bytes < min_bytes_.load(std::memory_order_relaxed)) return nullptr;
    const std::size_t cap = max_blocks();  // (a system call: not under the lock)
    {
      const std::lock_guard lock(m_);
      if (blocks_.size() >= cap) return nullptr;
    }
    const std::size_t len = (bytes + 4095) / 4096 * 4096;
    const int fd = memfd_create("zp-buffer", MFD_CLOEXEC);
    if (fd < 0) return nullptr;  // (the plain allocation serves it; its calls take the staging)
    struct stat st {};
    void* p = posix_fallocate(fd, 0, off_t(len)) == 0 && fstat(fd, &st) == 0
                  ? mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
    if (p == MAP_FAILED) {
      close(fd);
      return nullptr;
    }
    try {
      const std::lock_guard lock(m_);
      blocks_.emplace(reinterpret_cast<std::uintptr_t>(p),
                      Block{len, next_id_++, std::uint64_t(st.st_ino), fd});
    } catch (...) {
      munmap(p, len);
      close(fd);
      return nullptr;
    }
    return p;
  }

  bool deallocate(void* p) noexcept override {
    Block b;
    {
      const std::lock_guard lock(m_);
      const auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it == blocks_.end()) return false;
      b = it->second;
      blocks_.erase(it);
    }
    if (std::uncaught_exceptions() == 0)
      (void)!ftruncate(b.fd, 0);  // the pages go now, whoever still maps them
    munmap(p, b.bytes);
    close(b.fd);
    return true;
  }

  // The allocation holding [p, p + bytes), or id 0.
  SharedRef find(const void* p, std::size_t bytes) const {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    const std::lock_guard lock(m_);
    auto it = blocks_.upper_bound(at);
    if (it == blocks_.begin()) return {};
    --it;
    if (at + bytes > it->first + it->second.bytes) return {};
    const Block& b = it->second;
    return {b.id, b.bytes, at - it->first, b.inode, b.fd};
  }

 private:
  struct Block {
    std::size_t bytes = 0;
    std::uint64_t id = 0, inode = 0;
    int fd = -1;
  };
  NodeHeap() = default;
  // Read at each allocation: the rest of the limit is the program's and MPI's, whatever it is now.
  static std::size_t max_blocks() noexcept {
    rlimit files{};
    if (getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur == RLIM_INFINITY) return 4096;
    return std::min<std::size_t>(4096, std::size_t(files.rlim_cur) / 4);
  }

  std::atomic<std::size_t> min_bytes_{std::size_t(-1)};
  mutable std::mutex m_;
  std::map<std::uintptr_t, Block> blocks_;  // by address
  std::uint64_t next_id_ = 1;
};

// One process's mappings of its node peers' heap allocations, kept for reuse (a training step
// passes the same buffers every time: a new mapping costs a page fault per page read); past
// `per_peer` times the local ranks in all, the least recently used is unmapped. One call uses
// at most two per peer, so it never unmaps what it mapped itself. A freed one's pages are gone
// already (NodeHeap truncates), so a kept mapping costs addresses only.
class NodeMappings {
 public:
  static constexpr std::size_t per_peer = 64;

  NodeMappings() = default;
  NodeMappings(const NodeMappings&) = delete;
  NodeMappings& operator=(const NodeMappings&) = delete;
  ~NodeMappings() {
    for (const Map& m : maps_) munmap(m.base, m.bytes);
  }

  // Local rank q's (process `pid`) buffer `r`, mapped here for reading and writing (all_reduce
  // writes its slice's result into every peer's output); nullptr where it cannot be (the call
  // then takes the staging path on every rank).
  std::byte* map(int q, std::int32_t pid, const SharedRef& r, std::size_t peers) {
    for (auto it = maps_.begin(); it != maps_.end(); ++it)
      if (it->q == q && it->pid == pid && it->id == r.id) {
        std::rotate(it, it + 1, maps_.end());  // now the most recently used
        return maps_.back().base + r.offset;
      }
    const std::string path = detail::cat("/proc/", pid, "/fd/", r.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st {};
    void* p = fstat(fd, &st) == 0 && std::uint64_t(st.st_ino) == r.inode &&
                      std::uint64_t(st.st_size) >= r.bytes
                  ? mmap(nullptr, r.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED) return nullptr;
    if (maps_.size() >= per_peer * peers) {
      munmap(maps_.front().base, maps_.front().bytes);
      maps_.erase(maps_.begin());
    }
    maps_.push_back({q, pid, r.id, static_cast<std::byte*>(p), r.bytes});
    return maps_.back().base + r.offset;
  }

 private:
  struct Map {
    int q;
    std::int32_t pid;
    std::uint64_t id;
    std::byte* base;
    std::size_t bytes;
  };
  std::vector<Map> maps_;
};

}  // namespace zp::backend::mpi_detail
