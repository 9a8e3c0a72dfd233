// zp/backend/mpi_node.hpp: the mpi backend's reductions through a node's shared memory, and
// deterministic across nodes (MpiOptions::shared_memory, on by default).
//
// Node layout: the ranks of one machine are MPI's shared-memory split (MPI_COMM_TYPE_SHARED);
// MpiOptions::ranks_per_node, or else the environment variable ZP_RANKS_PER_NODE, cuts them
// finer (world rank / ranks_per_node is the node), so one machine can run 4 processes as 2 nodes
// x 2 and exercise the path between nodes. The layout is used when every node holds the same
// number L of consecutive ranks (rank = node * L + local index), which is what mpirun's default
// placement gives; any other layout runs with every rank as a node of its own (no shared memory,
// same results).
//
// Inside a node: one shared segment, a header of per-rank arrival counters and, per rank, two
// areas of MpiOptions::node_chunk_bytes each. A collective runs in rounds: each rank copies the
// part of its input the others need into an area (what it reduces itself it reads from its own
// buffer), the ranks meet (a counter barrier in the segment: spin briefly where there is a core
// per rank, then yield, then sleep 50 us), each rank reduces its slice across every local rank's
// data in rank order with the threads backend's element math (detail::reduce_chunks: fp32
// accumulation for 16-bit types, one rounding), and writes it where it belongs. reduce_scatter
// and all_gather stage in the two areas by turns and meet once a round; all_reduce stages in
// one, publishes its slice's result in the other and meets twice. Chunks of a megabyte keep the
// staged data in the L3 cache between the writer and its readers. So 16-bit operations move
// 16-bit bytes. all_gather writes outputs of MpiOptions::node_stream_bytes or more with
// streaming stores (zp/detail/copy.hpp).
//
// Reading peers in place (MpiOptions::node_direct_bytes): where every local rank's buffers of a
// call are NodeHeap allocations (node_memory.hpp: zp's Buffers are, from that size up), the
// ranks publish where they lie, map each other's, and skip the staging: reduce_scatter reduces
// its column straight from the peers' inputs, all_gather copies the peers' blocks from their
// outputs, all_reduce reduces its slice from the peers' inputs and stores the result into every
// local rank's output (as the threads backend does: in place, each line it writes it has just
// read, and no rank touches another's slice, so no barrier until the end). Each byte is then
// copied once, not twice. Two barriers decide it (every rank's buffers mappable, every rank's
// mappings made), so a node takes one path.
//
// Across nodes: rank (node k, local index l) continues the rank-order reduction of its slice:
// it receives from node k-1's rank l the accumulator of ranks 0 .. kL-1 (in the accumulation
// type, fp32 for 16-bit types), adds its node's L inputs in rank order, and sends the
// accumulator on to node k+1; node N-1 finishes (avg divides, 16-bit rounds once) and returns
// each final piece to the rank it belongs to (reduce_scatter) or broadcasts it to the ranks of
// local index l (all_reduce), which share it inside their node. all_gather gathers across
// nodes among the ranks of one local index, then inside the node. Every byte of a rank's slice
// crosses the network once per node boundary; the results are bitwise those of the threads
// backend with as many ranks, on any layout. reduce_scatter's ranks receive their finished
// pieces without waiting for them round by round, so the first node starts the next round's
// accumulator while the last finishes this one's. (A pipelined ring across nodes would be faster
// at many nodes and is not built yet.)
//
// Failure: the segment is a memfd of local rank 0, which the others open through /proc: it never
// has a name, so the kernel frees it when the node's last process that maps it ends, whatever
// kills them. A wait in the barrier runs under the backend's watchdog (Options::timeout ends the
// job naming the operation); a local rank whose process is gone ends the job at once, naming
// it, whether the others wait in the segment or, through the watchdog's PeerCheck, inside any
// MPI call of the communicator. The segment's memory is reserved when it is made
// (posix_fallocate), so too little memory is an error naming the size, not a SIGBUS later; one
// over half the machine's memory, or over the room its memory cgroup leaves (past which the
// kernel kills the process as it reserves), is refused before it is made.
#pragma once

#include <fcntl.h>
#include <mpi.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "zp/backend/mpi_watchdog.hpp"
#include "zp/backend/node_memory.hpp"
#include "zp/collective.hpp"
#include "zp/detail/copy.hpp"
#include "zp/detail/reduce.hpp"
#include "zp/detail/spin.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"

namespace zp::backend::mpi_detail {

// The MPI type that moves one element of t (16-bit floats as raw words).
inline MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::bf16:
    case DType::f16: return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

// Where a rank sits: `nodes` nodes of `per_node` consecutive ranks each.
struct NodeLayout {
  int nodes = 1, per_node = 1;
  int node = 0, local = 0;  // this rank = node * per_node + local
};

// The ranks per node a job asks for: `option` if positive, else ZP_RANKS_PER_NODE if set, else 0
// (the machines' own split).
inline int requested_ranks_per_node(int option) {
  if (option > 0) return option;
  const char* env = std::getenv("ZP_RANKS_PER_NODE");
  if (!env || !*env) return 0;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(env, &end, 10);
  if (*end || errno || v < 1 || v > (1 << 20))
    throw Error(Errc::invalid_argument,
                detail::cat("mpi backend: ZP_RANKS_PER_NODE=\"", env,
                            "\" is not a positive number of ranks per node"));
  return int(v);
}

// A wait that spins only where every local rank can have a core (`spin`), then yields, then
// sleeps.
class Backoff {
 public:
  explicit Backoff(bool spin) : spins_(spin ? 4000 : 0) {}
  void pause() {
    ++n_;
    if (n_ <= spins_) {
      detail::cpu_relax();
    } else if (n_ <= spins_ + 200) {
      sched_yield();
    } else {
      const timespec ts{0, 50'000};
      nanosleep(&ts, nullptr);
    }
  }
  // Every 256 pauses (12.8 ms or more once sleeping): time to look at the peers' processes.
  bool due() const { return n_ % 256 == 0; }

 private:
  long spins_;
  long n_ = 0;
};

// The shared segment of one node's ranks (see the file comment). Its header holds each local
// rank's pid, so it is also the watchdog's PeerCheck for every call of the communicator.
class NodeSegment final : public PeerCheck {
 public:
  // Collective over `node` (one node's ranks, in local order): maps a segment with two areas of
  // `area_bytes` per rank. `first_rank` is the communicator rank of local rank 0 (for messages).
  NodeSegment(MPI_Comm node, std::size_t area_bytes, int first_rank, int rank)
      : area_(round_up(area_bytes, 4096)), first_rank_(first_rank) {
    check(MPI_Comm_rank(node, &local_), "MPI_Comm_rank (node)", rank);
    check(MPI_Comm_size(node, &size_), "MPI_Comm_size (node)", rank);
    header_ = round_up(std::size_t(size_) * sizeof(Peer), 4096);
    bytes_ = header_ + std::size_t(size_) * 2 * area_;
    // The segment is opened, and the peers' processes watched, through their pids, which mean
    // other processes (or none) in another PID namespace: local ranks in containers of their
    // own must run without it. (0: this /proc cannot tell; opening through it will fail.) The
    // same call takes the smallest of the ranks' CPU quotas (ranks in one cgroup share its
    // quota), for spin_ below.
    struct stat ns {};
    const auto pid_ns = std::int64_t(stat("/proc/self/ns/pid", &ns) == 0 ? ns.st_ino : 0);
    std::int64_t least[3] = {pid_ns, -pid_ns, detail::quota_cpus()};
    check(MPI_Allreduce(MPI_IN_PLACE, least, 3, MPI_INT64_T, MPI_MIN, node),
          "MPI_Allreduce (pid namespaces, cpu quotas)", rank);
    if (least[0] != -least[1])
      throw Error(
          Errc::backend,
          detail::cat("mpi backend: rank ", rank,
                      ": the ranks of its node run in different PID namespaces (a "
                      "container each?), so they cannot share memory through "
                      "/proc/<pid>; set MpiOptions::shared_memory = false, or run them "
                      "in one PID namespace (docker --pid, a pod's shareProcessNamespace)"));
    // Local rank 0 makes the segment as a memfd; the others open it through /proc. It never
    // has a name, so it lives exactly as long as a process maps it (or holds it open).
    std::string error;
    int fd = -1;
    std::int32_t made[2] = {0, -1};  // local rank 0's pid and its descriptor of the segment
    // A memfd has no size limit of its own (a /dev/shm has half the memory): past the memory,
    // posix_fallocate would take it all before failing, and past the room a memory cgroup
    // leaves, the kernel kills the process as it reserves.
    const std::size_t memory =
        local_ == 0 ? std::size_t(sysconf(_SC_PHYS_PAGES)) * std::size_t(sysconf(_SC_PAGESIZE)) : 0;
    const detail::HostRoom room = local_ == 0 ? detail::host_memory_room() : detail::HostRoom{};
    const detail::MemoryRoom& tight =
        room.cgroup.bytes < room.machine.bytes ? room.cgroup : room.machine;
    const std::string what = detail::cat("the node's shared segment of ", bytes_, " bytes (", size_,
                                         " local ranks x 2 areas of ", area_, " bytes)");
    if (local_ == 0 && bytes_ > memory / 2) {
      error = detail::cat(what, " is more than half of the ", memory,
                          " bytes of memory; lower MpiOptions::node_chunk_bytes");
    } else if (local_ == 0 && std::int64_t(bytes_) > tight.bytes) {
      error = detail::cat(what, " is more than the ", detail::mib(tight.bytes), " left by ",
                          tight.where,
                          ", past which the kernel kills the process; lower "
                          "MpiOptions::node_chunk_bytes");
    } else if (local_ == 0) {
      fd = memfd_create("zp-node", MFD_CLOEXEC);
      if (fd < 0) {
        error = os_error("memfd_create", "");
      } else if (const int e = posix_fallocate(fd, 0, off_t(bytes_)); e != 0) {
        errno = e;
        error = os_error(detail::cat("posix_fallocate(", bytes_, " bytes)").c_str(), "");
      } else {
        made[0] = std::int32_t(getpid());
        made[1] = fd;
      }
    }
    check(MPI_Bcast(made, 2, MPI_INT32_T, 0, node), "MPI_Bcast (segment)", rank);
    if (local_ != 0 && made[1] >= 0) {
      const std::string path = detail::cat("/proc/", made[0], "/fd/", made[1]);
      fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) error = os_error("open", path.c_str());
    }
    if (fd >= 0 && error.empty()) {
      void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED)
        error = os_error("mmap", "");
      else
        base_ = static_cast<std::byte*>(p);
    }
    if (base_ && local_ == 0)  // zeroed pages; the others touch the header after the allreduce
      for (int q = 0; q < size_; ++q) new (peer(q)) Peer{};
    int ok = base_ ? 1 : 0;
    check(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, node), "MPI_Allreduce (segment)",
          rank);
    if (fd >= 0) close(fd);  // (local rank 0's stays open until every rank has opened its own)
    if (!ok) {
      unmap();
      throw Error(Errc::io,
                  error.empty()
                      ? detail::cat("mpi backend: a rank of this node could not map the shared "
                                    "segment of ",
                                    bytes_,
                                    " bytes (see its error); set "
                                    "MpiOptions::shared_memory = false to run without one")
                      : detail::cat("mpi backend: rank ", rank, ": ", error,
                                    "; set MpiOptions::shared_memory = false to run without a "
                                    "shared segment"));
    }
    // The CPUs the node's ranks may run on, together: each rank may be bound to a core of its
    // own (mpirun's default for two), or all of them share a few (a cpuset); at most the
    // smallest CPU quota (least[2]).
    cpu_set_t cpus = detail::allowed_cpus();
    check(MPI_Allreduce(MPI_IN_PLACE, &cpus, int(sizeof cpus), MPI_BYTE, MPI_BOR, node),
          "MPI_Allreduce (cpus)", rank);
    spin_ = size_ <= std::min<std::int64_t>(detail::cores_in(cpus), least[2]);
    peer(local_)->pid.store(std::int32_t(getpid()), std::memory_order_relaxed);
    check(MPI_Barrier(node), "MPI_Barrier (segment)", rank);  // the pids are published
  }
  ~NodeSegment() { unmap(); }
  NodeSegment(const NodeSegment&) = delete;
  NodeSegment& operator=(const NodeSegment&) = delete;

  int size() const { return size_; }
  int local() const { return local_; }
  std::size_t area_bytes() const { return area_; }
  std::byte* stage(int q) const { return base_ + header_ + std::size_t(q) * 2 * area_; }
  std::byte* result(int q) const { return stage(q) + area_; }

  // The direct path's exchange (NodeComm::go_direct): where this rank's buffers of the call lie
  // (which 0: input, 1: output), local rank q's, q's mapped here, and whether q mapped every
  // peer buffer it reads.
  void publish(const SharedRef& src, const SharedRef& dst) {
    peer(local_)->ref[0] = src;
    peer(local_)->ref[1] = dst;
  }
  const SharedRef& ref(int q, int which) const { return peer(q)->ref[which]; }
  std::byte* map(int q, int which) {
    return mappings_.map(q, peer(q)->pid.load(std::memory_order_relaxed), peer(q)->ref[which],
                         std::size_t(size_));
  }
  void set_mapped(bool ok) { peer(local_)->mapped = ok ? 1 : 0; }
  bool mapped(int q) const { return peer(q)->mapped != 0; }

  // Waits until every local rank has arrived here as often as this one.
  void barrier(const Blocked& info) {
    const std::uint64_t e = ++arrivals_;
    peer(local_)->arrived.store(e, std::memory_order_release);
    for (int q = 0; q < size_; ++q) {
      Backoff wait(spin_);
      while (peer(q)->arrived.load(std::memory_order_acquire) < e) {
        wait.pause();
        if (wait.due())
          if (const std::string g = gone(q); !g.empty()) abort_gone(info, g);
      }
    }
  }

  // The first other local rank whose process is gone (its pid no longer exists), or "".
  std::string gone() const override {
    for (int q = 0; q < size_; ++q)
      if (q != local_)
        if (std::string g = gone(q); !g.empty()) return g;
    return {};
  }

 private:
  struct alignas(64) Peer {
    std::atomic<std::uint64_t> arrived{0};
    std::atomic<std::int32_t> pid{0};
    // Written before a barrier, read after it (the barrier's release and acquire order them).
    SharedRef ref[2];
    std::int32_t mapped = 0;
  };
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

  static std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }
  // `path`: where another rank opens local rank 0's segment ("" for local rank 0's calls).
  static std::string os_error(const char* call, const char* path) {
    return detail::cat(call, *path ? detail::cat("(", path, ")") : std::string(),
                       " of the node's shared segment failed: ", std::strerror(errno));
  }
  Peer* peer(int q) const { return reinterpret_cast<Peer*>(base_) + q; }
  void unmap() noexcept {
    if (base_) munmap(base_, bytes_);
    base_ = nullptr;
  }

  // Local rank q's process, if it is gone: a rank that never arrives, so the job ends naming it.
  std::string gone(int q) const {
    const int pid = peer(q)->pid.load(std::memory_order_relaxed);
    if (pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH) return {};
    return detail::cat("rank ", first_rank_ + q, " of its node (pid ", pid,
                       ") is gone (killed or crashed)");
  }

  std::size_t area_, header_ = 0, bytes_ = 0;
  int first_rank_ = 0, local_ = 0, size_ = 1;
  bool spin_ = false;  // every local rank has a core of its own (Backoff)
  std::byte* base_ = nullptr;
  std::uint64_t arrivals_ = 0;
  NodeMappings mappings_;
};

// The node-local path of one communicator: its layout, segment and the communicator among the
// ranks of one local index (across nodes).
class NodeComm {
 public:
  // Collective over comm. ranks_per_node: as requested_ranks_per_node returned it; the rest:
  // MpiOptions' node_chunk_bytes, node_stream_bytes and node_direct_bytes.
  NodeComm(MPI_Comm comm, int ranks_per_node, std::size_t chunk_bytes, std::size_t stream_bytes,
           std::size_t direct_bytes)
      : stream_bytes_(stream_bytes), direct_bytes_(direct_bytes) {
    int rank = 0, n = 1, world = 0;
    check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", rank);
    check(MPI_Comm_size(comm, &n), "MPI_Comm_size", rank);
    check(MPI_Comm_rank(MPI_COMM_WORLD, &world), "MPI_Comm_rank", rank);
    rank_ = rank;
    size_ = n;
    // The machine: its ranks share memory. Its lowest world rank names it.
    MPI_Comm machine = MPI_COMM_NULL;
    check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &machine),
          "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)", rank);
    int machine_id = world;
    check(MPI_Allreduce(MPI_IN_PLACE, &machine_id, 1, MPI_INT, MPI_MIN, machine),
          "MPI_Allreduce (node layout)", rank);
    MPI_Comm node = machine;
    if (ranks_per_node > 0) {  // finer nodes, named by world rank so sub-groups agree
      check(MPI_Comm_split(comm, world / ranks_per_node, rank, &node), "MPI_Comm_split (node)",
            rank);
      int ids[2] = {machine_id, -machine_id};
      check(MPI_Allreduce(MPI_IN_PLACE, ids, 2, MPI_INT, MPI_MAX, node),
            "MPI_Allreduce (node layout)", rank);
      MPI_Comm_free(&machine);
      if (ids[0] != -ids[1]) {
        MPI_Comm_free(&node);
        throw Error(Errc::invalid_argument,
                    detail::cat("mpi backend: ", ranks_per_node,
                                " ranks per node (MpiOptions::ranks_per_node or "
                                "ZP_RANKS_PER_NODE) puts ranks of different machines into one "
                                "node; it must divide the ranks each machine runs"));
      }
    }
    int local = 0, per_node = 1;
    check(MPI_Comm_rank(node, &local), "MPI_Comm_rank (node)", rank);
    check(MPI_Comm_size(node, &per_node), "MPI_Comm_size (node)", rank);
    // Uniform and consecutive: every node has per_node ranks, node k holds ranks k*L .. k*L+L-1.
    int span[2] = {rank, -rank};  // the node's lowest and highest rank
    check(MPI_Allreduce(MPI_IN_PLACE, span, 2, MPI_INT, MPI_MIN, node),
          "MPI_Allreduce (node layout)", rank);
    int agree[3] = {
        per_node, -per_node,
        span[0] % per_node == 0 && -span[1] - span[0] == per_node - 1 && rank - span[0] == local
            ? 1
            : 0};
    check(MPI_Allreduce(MPI_IN_PLACE, agree, 3, MPI_INT, MPI_MIN, comm),
          "MPI_Allreduce (node layout)", rank);
    const bool uniform = agree[0] == -agree[1] && agree[2] == 1 && n % per_node == 0;
    if (!uniform || per_node == 1) {
      MPI_Comm_free(&node);
      per_node = 1;
      local = 0;
    }
    layout_ = {n / per_node, per_node, rank / per_node, local};
    // Every rank must take the direct path for the same calls. (Clamped: the negation.)
    const auto mine = std::int64_t(std::min<std::size_t>(direct_bytes, INT64_MAX));
    std::int64_t direct[2] = {mine, -mine};
    check(MPI_Allreduce(MPI_IN_PLACE, direct, 2, MPI_INT64_T, MPI_MIN, comm),
          "MPI_Allreduce (node_direct_bytes)", rank);
    if (direct[0] != -direct[1]) {
      if (per_node > 1) MPI_Comm_free(&node);
      throw Error(Errc::invalid_argument,
                  detail::cat("mpi backend: MpiOptions::node_direct_bytes is ", mine, " on rank ",
                              rank, " but ranges from ", direct[0], " to ", -direct[1],
                              " over the communicator; it must be the same on every "
                              "rank"));
    }
    if (per_node > 1) {
      try {
        segment_ = std::make_unique<NodeSegment>(node, std::max(chunk_bytes, std::size_t(n) * 64),
                                                 rank - local, rank);
      } catch (...) {
        MPI_Comm_free(&node);
        throw;
      }
      MPI_Comm_free(&node);
      if (direct_bytes_ > 0) heap_ = &NodeHeap::install(direct_bytes_);
      peer_in_.resize(std::size_t(per_node));
      peer_out_.resize(std::size_t(per_node));
    }
    if (layout_.nodes > 1) {
      check(MPI_Comm_split(comm, layout_.local, layout_.node, &cross_), "MPI_Comm_split (cross)",
            rank);
      check(MPI_Comm_set_errhandler(cross_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
    }
  }
  ~NodeComm() {
    int fin = 0;
    MPI_Finalized(&fin);
    if (cross_ != MPI_COMM_NULL && !fin) MPI_Comm_free(&cross_);
  }
  NodeComm(const NodeComm&) = delete;
  NodeComm& operator=(const NodeComm&) = delete;

  const NodeLayout& layout() const { return layout_; }
  // Operations that read the node peers' buffers in place (go_direct).
  std::uint64_t direct_calls() const { return direct_calls_.load(std::memory_order_relaxed); }
  // The other local ranks' processes, for the watchdog (null without a segment).
  const PeerCheck* peers() const { return segment_.get(); }

  // The three operations, with the signatures of the untyped core (count per rank's block for
  // reduce_scatter and all_gather). `info` names the operation in a wait's error.
  void all_reduce(const void* src, void* dst, std::size_t count, DType t, ReduceOp op,
                  const Blocked& info) {
    visit_dtype(t, [&](auto tag) {
      using T = decltype(tag);
      all_reduce_typed(static_cast<const T*>(src), static_cast<T*>(dst), count, op, info);
    });
  }
  void reduce_scatter(const void* src, void* dst, std::size_t count, DType t, ReduceOp op,
                      const Blocked& info) {
    visit_dtype(t, [&](auto tag) {
      using T = decltype(tag);
      reduce_scatter_typed(static_cast<const T*>(src), static_cast<T*>(dst), count, op, info);
    });
  }
  void all_gather(const void* src, void* dst, std::size_t count, DType t, const Blocked& info) {
    visit_dtype(t, [&](auto tag) {
      using T = decltype(tag);
      all_gather_typed(static_cast<const T*>(src), static_cast<T*>(dst), count, t, info);
    });
  }

 private:
  static constexpr int tag_chain = 0x7a80, tag_final = 0x7a81;
  int L() const { return layout_.per_node; }
  int N() const { return layout_.nodes; }

  void barrier(const Blocked& info) {
    if (segment_) segment_->barrier(info);
  }
  // The direct path (MpiOptions::node_direct_bytes): each local rank publishes where its input
  // (in: true) and output (out: true) lie in its process's NodeHeap; where every rank's do, each
  // maps its peers' (peer_in_, peer_out_; its own are the pointers) and they agree that all
  // could, and the operation reads the peers' buffers in place, copying each byte once. Its
  // two barriers to decide and one at the end cost more than the copies they save on small
  // calls, so it is tried from node_direct_bytes up; the test is the same on every rank (count
  // and type agree, and the threshold: the constructor). false: the staging path, on every rank
  // (after one or both of those barriers).
  bool go_direct(const void* src, std::size_t src_bytes, bool in, void* dst, std::size_t dst_bytes,
                 bool out, const Blocked& info) {
    if (!heap_ || std::max(src_bytes, dst_bytes) < direct_bytes_) return false;
    const int me = layout_.local;
    segment_->publish(in ? heap_->find(src, src_bytes) : SharedRef{},
                      out ? heap_->find(dst, dst_bytes) : SharedRef{});
    barrier(info);
    busy_ = -1;  // every peer has left the last call: the staging needs no barrier for that
    for (int q = 0; q < L(); ++q)
      if ((in && segment_->ref(q, 0).id == 0) || (out && segment_->ref(q, 1).id == 0)) return false;
    bool ok = true;
    for (int q = 0; q < L(); ++q) {
      const auto i = std::size_t(q);
      peer_in_[i] = !in       ? nullptr
                    : q == me ? static_cast<const std::byte*>(src)
                              : segment_->map(q, 0);
      peer_out_[i] = !out ? nullptr : q == me ? static_cast<std::byte*>(dst) : segment_->map(q, 1);
      ok = ok && (!in || peer_in_[i]) && (!out || peer_out_[i]);
    }
    segment_->set_mapped(ok);
    barrier(info);
    for (int q = 0; q < L(); ++q)
      if (!segment_->mapped(q)) return false;
    direct_calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  // The end of a direct operation: no peer reads this rank's buffers (or staging areas) after.
  void end_direct(const Blocked& info) {
    barrier(info);
    busy_ = -1;
  }
  template <class T>
  const T* peer_in(int q) const {
    return reinterpret_cast<const T*>(peer_in_[std::size_t(q)]);
  }
  template <class T>
  T* peer_out(int q) const {
    return reinterpret_cast<T*>(peer_out_[std::size_t(q)]);
  }
  // Elements of T per block per round when `blocks` blocks of a round share one area.
  template <class T>
  std::size_t round_elems(std::size_t blocks) const {
    const std::size_t area = segment_ ? segment_->area_bytes() : std::size_t(1) << 20;
    return std::max<std::size_t>(1, area / (blocks * sizeof(T)) / 16 * 16);
  }
  // Tables of n input or output pointers, kept per thread and type so that a call allocates
  // nothing once warm.
  template <class T>
  static std::vector<const T*>& inputs(std::size_t n) {
    static thread_local std::vector<const T*> v;
    v.resize(n);
    return v;
  }
  template <class T>
  static std::vector<T*>& outputs(std::size_t n) {
    static thread_local std::vector<T*> v;
    v.resize(n);
    return v;
  }
  template <class T>
  T* stage(int q) const {
    return reinterpret_cast<T*>(segment_->stage(q));
  }
  template <class T>
  T* result(int q) const {
    return reinterpret_cast<T*>(segment_->result(q));
  }
  template <class T>
  T* area(int q, int a) const {
    return a == 0 ? stage<T>(q) : result<T>(q);
  }
  // reduce_scatter and all_gather stage in the two areas by turns and meet once a round: a rank
  // writes an area again only two rounds on, when every peer has passed the barrier after its
  // reads. The last round's area may still be read when an operation returns (busy_).
  int first_area() const { return busy_ == 0 ? 1 : 0; }
  void send(const void* p, std::size_t bytes, int to, int tag) {
    check(MPI_Send(p, int(bytes), MPI_BYTE, to, tag, cross_), "MPI_Send (across nodes)", rank_);
  }
  // all_gather's copy into the caller's output of `total` bytes: streamed past the caches when
  // the output is larger than they are (MpiOptions::node_stream_bytes; nobody reads it before
  // the operation returns), saving each line's read for ownership; a plain memcpy otherwise,
  // leaving it in cache for the caller. (all_reduce's copies stay plain: streamed, its 64-256
  // MiB rows ran 7-23% slower in bench/RESULTS.md's same-run comparison.)
  void put(void* to, const void* from, std::size_t bytes, std::size_t total) const {
    if (total >= stream_bytes_)
      detail::stream_copy(to, from, bytes);
    else
      std::memcpy(to, from, bytes);
  }
  void recv(void* p, std::size_t bytes, int from, int tag) {
    check(MPI_Recv(p, int(bytes), MPI_BYTE, from, tag, cross_, MPI_STATUS_IGNORE),
          "MPI_Recv (across nodes)", rank_);
  }

  // This node's stretch of the rank-order reduction of `blocks` pieces of m elements, in[b][q]
  // local rank q's input for piece b: the first node starts it, the others continue the
  // accumulator received from the node before; all but the last pass it on. On the last node
  // the pieces are finished into out[b] (n_out outputs each); elsewhere out is untouched.
  template <class T>
  void chain(std::vector<const T*>& in, std::size_t blocks, std::size_t m, T* const* out, int n_out,
             ReduceOp op) {
    using A = detail::accum_t<T>;
    const bool first = layout_.node == 0, last = layout_.node == N() - 1;
    const int l = L();
    if (N() > 1) {
      acc_.resize(blocks * m * sizeof(A));
      if (!first) recv(acc_.data(), blocks * m * sizeof(A), layout_.node - 1, tag_chain);
    }
    A* acc = reinterpret_cast<A*>(acc_.data());
    for (std::size_t b = 0; b < blocks; ++b)
      detail::reduce_chunks<T>(first ? nullptr : acc + b * m, in.data() + b * std::size_t(l), l,
                               last ? out + b * std::size_t(n_out) : nullptr, last ? n_out : 0,
                               N() > 1 ? acc + b * m : nullptr, m, op, size_);
    if (!last) send(acc, blocks * m * sizeof(A), layout_.node + 1, tag_chain);
  }

  template <class T>
  void all_reduce_typed(const T* src, T* dst, std::size_t count, ReduceOp op, const Blocked& info) {
    if (count == 0) return;
    const int l = L(), me = layout_.local;
    auto& cols = cols_;
    cols.resize(std::size_t(l));
    std::size_t longest = 0;
    for (int q = 0; q < l; ++q) {
      cols[std::size_t(q)] = detail::rank_slice(count, q, l);
      longest = std::max(longest, cols[std::size_t(q)].second - cols[std::size_t(q)].first);
    }
    auto& in = inputs<T>(std::size_t(l));
    auto& outs = outputs<T>(std::size_t(std::max(l, 2)));
    const bool direct = go_direct(src, count * sizeof(T), true, dst, count * sizeof(T), true, info);
    if (!direct) {
      if (busy_ == 0) barrier(info);  // the stage area a peer may still read
      busy_ = 1;                      // the last round's results are read after its second barrier
    }
    const bool publish = segment_ && !direct;  // results go through the segment
    // Rounds keep the staged pieces in cache (staging) and pipeline the chain across nodes; a
    // direct call inside one node reduces its whole slice at once.
    const std::size_t c = direct && N() == 1 ? longest : round_elems<T>(std::size_t(l));
    for (std::size_t lo = 0; lo < longest; lo += c) {
      const auto piece = [&](int q) {  // column q's part in this round: {begin, length}
        const auto [b, e] = cols[std::size_t(q)];
        const std::size_t at = std::min(b + lo, e);
        return std::pair{at, std::min(c, e - at)};
      };
      if (!direct) {
        for (int q = 0; q < l; ++q)
          if (q != me && piece(q).second)
            std::memcpy(stage<T>(me) + std::size_t(q) * c, src + piece(q).first,
                        piece(q).second * sizeof(T));
        barrier(info);
      }
      const auto [at, m] = piece(me);
      for (int q = 0; q < l; ++q)
        in[std::size_t(q)] = direct    ? peer_in<T>(q) + at
                             : q == me ? src + at
                                       : stage<T>(q) + std::size_t(me) * c;
      // Direct inside one node: the result goes into every local rank's output at once.
      int n_out = 1;
      outs[0] = dst + at;
      if (direct && N() == 1) {
        for (int q = 0; q < l; ++q) outs[std::size_t(q)] = peer_out<T>(q) + at;
        n_out = l;
      } else if (publish && N() == 1) {
        outs[1] = result<T>(me);
        n_out = 2;
      }
      if (m) {
        chain<T>(in, 1, m, outs.data(), n_out, op);
        if (N() > 1) {
          check(MPI_Bcast(dst + at, int(m * sizeof(T)), MPI_BYTE, N() - 1, cross_),
                "MPI_Bcast (across nodes)", rank_);
          if (publish) std::memcpy(result<T>(me), dst + at, m * sizeof(T));
          for (int q = 0; direct && q < l; ++q)
            if (q != me) std::memcpy(peer_out<T>(q) + at, dst + at, m * sizeof(T));
        }
      }
      if (!direct) {
        barrier(info);
        for (int q = 0; q < l; ++q)
          if (const auto [qa, qm] = piece(q); q != me && qm)
            std::memcpy(dst + qa, result<T>(q), qm * sizeof(T));
      }
    }
    if (direct) end_direct(info);
  }

  template <class T>
  void reduce_scatter_typed(const T* src, T* dst, std::size_t count, ReduceOp op,
                            const Blocked& info) {
    if (count == 0) return;
    const int l = L(), me = layout_.local, nodes = N();
    const auto block = [&](int b) { return src + std::size_t(b) * count; };
    auto& in = inputs<T>(std::size_t(nodes) * std::size_t(l));
    auto& outs = outputs<T>(std::size_t(nodes));
    auto& sent = sent_;
    auto& finals_in = finals_in_;  // the rounds' finished pieces, received as they come
    finals_in.clear();
    // Where a call across nodes throws, no receive is left to write into dst after it.
    struct Outstanding {
      std::vector<MPI_Request>& r;
      ~Outstanding() {
        for (MPI_Request& q : r)
          if (q != MPI_REQUEST_NULL) {
            MPI_Cancel(&q);
            MPI_Wait(&q, MPI_STATUS_IGNORE);
          }
      }
    } outstanding{finals_in};
    const bool direct =
        go_direct(src, std::size_t(size_) * count * sizeof(T), true, dst, 0, false, info);
    const std::size_t c = direct && nodes == 1 ? count : round_elems<T>(std::size_t(size_));
    for (std::size_t lo = 0, a = std::size_t(first_area()); lo < count; lo += c, a ^= 1) {
      const std::size_t m = std::min(c, count - lo);
      // Blocks of the other local ranks' columns (block b is reduced by local rank b % L).
      if (segment_ && !direct) {
        for (int b = 0; b < size_; ++b)
          if (b % l != me)
            std::memcpy(area<T>(me, int(a)) + std::size_t(b) * c, block(b) + lo, m * sizeof(T));
        barrier(info);
        busy_ = int(a);
      }
      for (int k = 0; k < nodes; ++k) {
        const int b = k * l + me;  // the column: this local index's block on every node
        for (int q = 0; q < l; ++q)
          in[std::size_t(k * l + q)] = direct    ? peer_in<T>(q) + std::size_t(b) * count + lo
                                       : q == me ? block(b) + lo
                                                 : area<T>(q, int(a)) + std::size_t(b) * c;
      }
      if (nodes == 1) {
        T* out = dst + lo;
        chain<T>(in, 1, m, &out, 1, op);
      } else {
        // The last node finishes every node's piece of this column and returns it to its rank.
        finals_.resize(std::size_t(nodes) * m * sizeof(T));
        for (int k = 0; k < nodes; ++k)
          outs[std::size_t(k)] = k == layout_.node
                                     ? dst + lo
                                     : reinterpret_cast<T*>(finals_.data()) + std::size_t(k) * m;
        chain<T>(in, std::size_t(nodes), m, outs.data(), 1, op);
        if (layout_.node == nodes - 1) {
          sent.assign(std::size_t(nodes - 1), MPI_REQUEST_NULL);
          for (int k = 0; k + 1 < nodes; ++k)
            check(MPI_Isend(outs[std::size_t(k)], int(m * sizeof(T)), MPI_BYTE, k, tag_final,
                            cross_, &sent[std::size_t(k)]),
                  "MPI_Isend (across nodes)", rank_);
          check(MPI_Waitall(nodes - 1, sent.data(), MPI_STATUSES_IGNORE),
                "MPI_Waitall (across nodes)", rank_);
        } else {  // (so the chain's next round starts without waiting for this one's end)
          check(MPI_Irecv(dst + lo, int(m * sizeof(T)), MPI_BYTE, nodes - 1, tag_final, cross_,
                          &finals_in.emplace_back()),
                "MPI_Irecv (across nodes)", rank_);
        }
      }
    }
    if (!finals_in.empty())
      check(MPI_Waitall(int(finals_in.size()), finals_in.data(), MPI_STATUSES_IGNORE),
            "MPI_Waitall (across nodes)", rank_);
    if (direct) end_direct(info);
  }

  template <class T>
  void all_gather_typed(const T* src, T* dst, std::size_t count, DType t, const Blocked& info) {
    if (count == 0) return;
    const int l = L(), me = layout_.local, nodes = N();
    T* own = dst + std::size_t(rank_) * count;
    const std::size_t total = std::size_t(size_) * count * sizeof(T);
    if (nodes > 1) {  // this local index's blocks from every node, straight into place
      MPI_Datatype piece = MPI_DATATYPE_NULL, strided = MPI_DATATYPE_NULL;
      check(MPI_Type_contiguous(int(count), mpi_type(t), &piece), "MPI_Type_contiguous", rank_);
      check(
          MPI_Type_create_resized(piece, 0, MPI_Aint(std::size_t(l) * count * sizeof(T)), &strided),
          "MPI_Type_create_resized", rank_);
      MPI_Type_free(&piece);
      MPI_Type_commit(&strided);
      const int rc = MPI_Allgather(src == own ? MPI_IN_PLACE : src, src == own ? 0 : 1,
                                   src == own ? MPI_DATATYPE_NULL : strided,
                                   dst + std::size_t(me) * count, 1, strided, cross_);
      MPI_Type_free(&strided);
      check(rc, "MPI_Allgather (across nodes)", rank_);
    } else if (src != own && count) {
      put(own, src, count * sizeof(T), total);
    }
    if (!segment_) return;
    const auto block = [&](int b) { return dst + std::size_t(b) * count; };
    if (go_direct(src, 0, false, dst, total, true, info)) {  // the peers' blocks from their outputs
      for (int q = 0; q < l; ++q)
        for (int k = 0; q != me && k < nodes; ++k) {
          const std::size_t at = std::size_t(k * l + q) * count;
          put(dst + at, peer_out<T>(q) + at, count * sizeof(T), total);
        }
      return end_direct(info);
    }
    const std::size_t c = round_elems<T>(std::size_t(nodes));
    for (std::size_t lo = 0, a = std::size_t(first_area()); lo < count; lo += c, a ^= 1) {
      const std::size_t m = std::min(c, count - lo);
      for (int k = 0; k < nodes; ++k)
        std::memcpy(area<T>(me, int(a)) + std::size_t(k) * c, block(k * l + me) + lo,
                    m * sizeof(T));
      barrier(info);
      busy_ = int(a);
      for (int q = 0; q < l; ++q)
        if (q != me)
          for (int k = 0; k < nodes; ++k)
            put(block(k * l + q) + lo, area<T>(q, int(a)) + std::size_t(k) * c, m * sizeof(T),
                total);
    }
  }

  NodeLayout layout_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<NodeSegment> segment_;
  MPI_Comm cross_ = MPI_COMM_NULL;
  std::vector<std::byte> acc_, finals_;  // the chain's accumulator; the last node's results
  // Per-call tables, kept so that a call allocates nothing (calls run one at a time).
  std::vector<std::pair<std::size_t, std::size_t>> cols_;
  std::vector<MPI_Request> sent_, finals_in_;
  std::size_t stream_bytes_, direct_bytes_;
  NodeHeap* heap_ = nullptr;  // the direct path's (with a segment and node_direct_bytes)
  std::vector<const std::byte*> peer_in_;  // per local rank: go_direct's mappings
  std::vector<std::byte*> peer_out_;
  std::atomic<std::uint64_t> direct_calls_{0};  // (async calls count on the progress thread)
  int busy_ = -1;  // the area of this rank's that peers may still read (-1: none)
};

}  // namespace zp::backend::mpi_detail
