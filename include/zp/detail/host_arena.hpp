// zp/detail/host_arena.hpp: the hook through which a backend serves Allocator<host>'s
// allocations (zp/memory.hpp).
#pragma once

#include <atomic>
#include <cstddef>

namespace zp::detail {
// Where Allocator<host> takes the allocations a backend asks for: the mpi backend's node path
// installs memory the node's other processes can map (zp/backend/node_memory.hpp), so that its
// collectives read a peer's buffer in place instead of copying it through a staging area.
struct HostArena {
  virtual void* allocate(std::size_t bytes) noexcept = 0;  // nullptr: not taken from the arena
  virtual bool deallocate(void* p) noexcept = 0;           // false: p is not the arena's

 protected:
  ~HostArena() = default;
};
inline std::atomic<HostArena*>& host_arena() noexcept {
  static std::atomic<HostArena*> arena{nullptr};
  return arena;
}
}  // namespace zp::detail
