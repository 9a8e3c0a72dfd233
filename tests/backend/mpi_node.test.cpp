// Tests of include/zp/backend/mpi_node.hpp, the mpi backend's node path, run under mpiexec at 2,
// 3 and 4 processes and, with ZP_RANKS_PER_NODE, as 2 nodes x 2 and 3 nodes x 1 (the path
// across nodes). Inputs are random floats with full mantissas (and integers over the whole
// range), so a result is bitwise right only if it reduced in rank order with the threads
// backend's element math: every process runs the same operation on the threads backend with as
// many ranks, in process, and compares its own output bit for bit. Outputs are poisoned first.
#include "zp/backend/mpi.hpp"
#include "zp/backend/threads.hpp"
#include "zp/memory.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "../mpi_main.hpp"
#include "../random.hpp"

using zp::Collective;
using zp::CollOp;
using zp::DType;
using zp::Launch;
using zp::ReduceOp;
using zp::backend::Mpi;

namespace {

// Under the sanitizers (5-20x slower) the largest sizes shrink; the layouts and cases stay.
#if ZP_ASAN || ZP_TSAN
constexpr std::size_t largest_count = 4099, big_bytes = std::size_t(16) << 20;
#else
constexpr std::size_t largest_count = 40009, big_bytes = std::size_t(256) << 20;
#endif

Mpi::Options options() {
  Mpi::Options opt;
  opt.timeout = std::chrono::seconds(60);
  opt.node_chunk_bytes = 64 << 10;   // many rounds even at test sizes
  opt.node_stream_bytes = 64 << 10;  // the larger sizes stream their outputs, the smaller not
  return opt;
}

// Element i of rank r's input, as raw bytes of t: floats uniform over a few binades with full
// mantissas, integers over the whole range (so sums wrap).
std::vector<std::byte> input(DType t, std::uint64_t seed, int rank, std::size_t n) {
  std::vector<std::byte> v(n * zp::size_of(t));
  zp::visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    T* p = reinterpret_cast<T*>(v.data());
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t h = zp::test::mix(seed ^ zp::test::mix(std::uint64_t(rank) << 40 | i));
      if constexpr (std::is_integral_v<T>) {
        p[i] = T(h);
      } else {
        const float u = zp::test::hash_uniform(seed + std::uint64_t(rank), i);
        p[i] = T(double(u) * double(1 << (h % 8)));
      }
    }
  });
  return v;
}

struct Case {
  CollOp op;
  DType t;
  ReduceOp rop;
  std::size_t count;  // per rank's block for reduce_scatter / all_gather
  bool in_place;
};

std::size_t in_elems(const Case& c, int n) {
  return c.op == CollOp::reduce_scatter ? c.count * std::size_t(n) : c.count;
}
std::size_t out_elems(const Case& c, int n) {
  return c.op == CollOp::all_gather ? c.count * std::size_t(n) : c.count;
}

// Runs c on `comm` over rank r's input; returns the output buffer. Vec: the buffers' container
// (with zp::HostAllocator, memory the node's peers can map).
template <class Vec = std::vector<std::byte>, class B>
std::vector<std::byte> run(Collective<B>& comm, const Case& c, std::uint64_t seed, Launch l) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t es = zp::size_of(c.t);
  const auto generated = input(c.t, seed, r, in_elems(c, n));
  const Vec in(generated.begin(), generated.end());
  const std::size_t used = std::max(in.size(), out_elems(c, n) * es);
  Vec buf(used + 64, std::byte{0xA5});  // 64 bytes past the end: no rank may write there
  auto& b = comm.backend();
  void* dst = buf.data();
  const void* src = in.data();
  if (c.in_place) {
    if (c.op == CollOp::all_gather) {
      std::copy(in.begin(), in.end(), buf.begin() + std::ptrdiff_t(std::size_t(r) * c.count * es));
      src = buf.data() + std::size_t(r) * c.count * es;
    } else {
      std::copy(in.begin(), in.end(), buf.begin());
      src = buf.data();
      if (c.op == CollOp::reduce_scatter) dst = buf.data() + std::size_t(r) * c.count * es;
    }
  }
  auto w = c.op == CollOp::all_reduce       ? b.all_reduce(src, dst, c.count, c.t, c.rop, l)
           : c.op == CollOp::reduce_scatter ? b.reduce_scatter(src, dst, c.count, c.t, c.rop, l)
                                            : b.all_gather(src, dst, c.count, c.t, l);
  w.wait();
  CHECK(std::all_of(buf.begin() + std::ptrdiff_t(used), buf.end(),
                    [](std::byte x) { return x == std::byte{0xA5}; }));
  const std::byte* out = static_cast<const std::byte*>(dst);
  return {out, out + out_elems(c, n) * es};
}

// The same operation on the threads backend with as many ranks: rank r's output.
std::vector<std::byte> threads_output(const Case& c, int n, int r, std::uint64_t seed) {
  std::vector<std::byte> out;
  zp::backend::run_threads(n, [&](Collective<zp::backend::Threads>& t) {
    auto o = run(t, c, seed, Launch::blocking);
    if (t.rank() == r) out = std::move(o);
  });
  return out;
}

std::string describe(const Case& c) {
  return zp::detail::cat(zp::name(c.op), "(count=", c.count, ", dtype=", zp::name(c.t),
                         ", op=", zp::name(c.rop), c.in_place ? ", in place)" : ")");
}

}  // namespace

TEST_CASE("every collective and element type is bitwise the threads backend's") {
  Collective<Mpi> comm(Mpi(MPI_COMM_WORLD, options()));
  const int n = comm.size(), r = comm.rank();
  const auto layout = comm.backend().node_layout();
  if (const char* e = std::getenv("ZP_RANKS_PER_NODE")) {  // the layout the job asked for
    const int per_node = std::atoi(e);
    CHECK(layout.per_node == per_node);
    CHECK(layout.nodes == n / per_node);
    CHECK(layout.node == r / per_node);
  } else {
    CHECK(layout.nodes == 1);
    CHECK(layout.per_node == n);
  }
  CHECK(layout.node * layout.per_node + layout.local == r);
  const std::uint64_t seed = zp::test::mpi_seed();
  std::size_t cases = 0, wrong = 0;
  for (std::size_t count : {std::size_t(0), std::size_t(1), std::size_t(2), std::size_t(61),
                            std::size_t(1009), std::size_t(4099), largest_count}) {
    for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64}) {
      for (CollOp op : {CollOp::all_reduce, CollOp::reduce_scatter, CollOp::all_gather}) {
        for (ReduceOp rop : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
          if (op == CollOp::all_gather && rop != ReduceOp::sum) continue;
          for (bool in_place : {false, true}) {
            const Case c{op, t, rop, count, in_place};
            const std::uint64_t s = seed + cases;
            const Launch l = cases % 2 ? Launch::async : Launch::blocking;
            const auto got = run(comm, c, s, l);
            const auto want = threads_output(c, n, r, s);
            ++cases;
            if (got != want) {
              ++wrong;
              if (wrong < 5)
                FAIL_CHECK(zp::detail::cat("rank ", r, ": ", describe(c),
                                           " differs from the threads backend"));
            }
          }
        }
      }
    }
  }
  CHECK(wrong == 0);
  CHECK(cases > 500);
}

TEST_CASE("async operations queue in issue order and a 256 MiB all_reduce is the rank-order sum") {
  // (16 MiB under the sanitizers)
  Collective<Mpi> comm(Mpi(MPI_COMM_WORLD, options()));
  const int n = comm.size(), r = comm.rank();
  const std::uint64_t seed = zp::test::mpi_seed() + 7;
  // Several async operations in flight, then waited in reverse order.
  std::vector<std::vector<float>> bufs;
  std::vector<Mpi::Work> work;
  for (int k = 0; k < 4; ++k) {
    bufs.emplace_back(10007 + std::size_t(k));
    for (std::size_t i = 0; i < bufs.back().size(); ++i)
      bufs.back()[i] = zp::test::hash_uniform(seed + std::uint64_t(k * 64 + r), i);
  }
  for (auto& b : bufs)
    work.push_back(comm.backend().all_reduce(b.data(), b.data(), b.size(), DType::f32,
                                             ReduceOp::sum, Launch::async));
  for (auto it = work.rbegin(); it != work.rend(); ++it) it->wait();
  for (int k = 0; k < 4; ++k) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < bufs[std::size_t(k)].size(); ++i) {
      float acc = zp::test::hash_uniform(seed + std::uint64_t(k * 64), i);
      for (int q = 1; q < n; ++q)
        acc += zp::test::hash_uniform(seed + std::uint64_t(k * 64 + q), i);
      bad += bufs[std::size_t(k)][i] != acc;
    }
    CHECK(bad == 0);
  }
  // 256 MiB in place (see big_bytes): against the serial rank-order loop (the threads backend's order), computed
  // element by element so no process holds the other ranks' inputs.
  const std::size_t big = big_bytes / sizeof(float);
  std::vector<float> x(big);
  for (std::size_t i = 0; i < big; ++i)
    x[i] = zp::test::hash_uniform(seed + 1000 + std::uint64_t(r), i);
  comm.all_reduce(std::span<float>(x));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < big; i += 7) {  // every 7th element: the loop's cost, not coverage
    float acc = zp::test::hash_uniform(seed + 1000, i);
    for (int q = 1; q < n; ++q) acc += zp::test::hash_uniform(seed + 1000 + std::uint64_t(q), i);
    bad += x[i] != acc;
  }
  CHECK(bad == 0);
}

using SharedVec = std::vector<std::byte, zp::HostAllocator<std::byte>>;

// Inputs whose results have a closed form: rank r's value i is (r + 1) (i % 7 + 1), exact in
// fp32 at these sizes.
float closed_form(int r, std::size_t i) { return float(r + 1) * float(i % 7 + 1); }
SharedVec closed_form_input(int r, std::size_t m) {
  SharedVec in(m * sizeof(float));
  for (std::size_t i = 0; i < m; ++i) {
    const float v = closed_form(r, i);
    std::memcpy(in.data() + i * sizeof(float), &v, sizeof v);
  }
  return in;
}
// How many of the first `count` floats at `got` differ from their closed-form result: the sum
// over n ranks (all_reduce), or rank i / m's block (all_gather of m values each).
std::size_t closed_form_wrong(const std::byte* got, std::size_t count, CollOp op, int n,
                              std::size_t m) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < count; ++i) {
    float v = 0;
    std::memcpy(&v, got + i * sizeof(float), sizeof v);
    bad += v != (op == CollOp::all_reduce ? float(n * (n + 1) / 2) * float(i % 7 + 1)
                                          : closed_form(int(i / m), i % m));
  }
  return bad;
}

// This process's mappings of NodeHeap allocations (its own and its peers'), and the kB of
// memory they hold (/proc/self/smaps).
struct HeapMaps {
  int count = 0;
  long rss_kb = 0;
};
HeapMaps heap_maps() {
  std::ifstream smaps("/proc/self/smaps");
  HeapMaps h;
  bool in = false;
  for (std::string line; std::getline(smaps, line);) {
    if (line.find(':') != std::string::npos && line.find('-') < line.find(' ') &&
        std::isxdigit(static_cast<unsigned char>(line[0]))) {  // a mapping's header line
      in = line.find("/memfd:zp-buffer") != std::string::npos;
      h.count += in;
    } else if (in && line.rfind("Rss:", 0) == 0) {
      h.rss_kb += std::atol(line.c_str() + 4);
    }
  }
  return h;
}

TEST_CASE("buffers the node's peers can map are read in place, bitwise the threads backend's") {
  Mpi::Options opt = options();
  opt.node_direct_bytes = 1;  // every allocation mappable, every call direct
  Collective<Mpi> comm(Mpi(MPI_COMM_WORLD, opt));
  const int n = comm.size(), r = comm.rank();
  const bool segment = comm.backend().node_layout().per_node > 1;
  const std::uint64_t seed = zp::test::mpi_seed() + 13;
  std::size_t cases = 0, wrong = 0, direct = 0;
  for (std::size_t count : {std::size_t(1), std::size_t(61), std::size_t(4099), largest_count}) {
    for (DType t : {DType::f32, DType::bf16, DType::f64, DType::i32}) {
      for (CollOp op : {CollOp::all_reduce, CollOp::reduce_scatter, CollOp::all_gather}) {
        for (ReduceOp rop : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
          if (op == CollOp::all_gather && rop != ReduceOp::sum) continue;
          for (bool in_place : {false, true}) {
            const Case c{op, t, rop, count, in_place};
            const std::uint64_t s = seed + cases;
            const Launch l = cases % 2 ? Launch::async : Launch::blocking;
            const std::uint64_t before = comm.backend().node_direct_calls();
            const auto got = run<SharedVec>(comm, c, s, l);
            direct += comm.backend().node_direct_calls() - before;
            ++cases;
            if (got != threads_output(c, n, r, s) && ++wrong < 5)
              FAIL_CHECK(zp::detail::cat("rank ", r, ": ", describe(c),
                                         " differs from the threads backend"));
          }
        }
      }
    }
  }
  CHECK(wrong == 0);
  CHECK(direct == (segment ? cases : 0));  // (without a second local rank: no segment)
  // Every buffer of those calls is freed: a peer keeps at most NodeMappings::per_peer mappings
  // per local rank (these calls made more), and they hold no memory.
  comm.barrier();
  const HeapMaps left = heap_maps();
  CHECK(left.count <= int(zp::backend::mpi_detail::NodeMappings::per_peer) *
                          comm.backend().node_layout().per_node);
  CHECK((!segment || left.count > 0));
  CHECK(left.rss_kb == 0);

  // A long-lived input beside a new output each call, more calls than the mappings kept, and a
  // staged call (plain buffers) every 5th: the input's mapping, used every call, is never the one
  // unmapped, and the paths alternate.
  {
    const std::size_t m = 1000;
    const SharedVec in = closed_form_input(r, m);
    const int calls = int(zp::backend::mpi_detail::NodeMappings::per_peer) * n + 8;
    std::size_t bad = 0, staged_calls = 0;
    const std::uint64_t before = comm.backend().node_direct_calls();
    for (int k = 0; k < calls; ++k) {
      SharedVec out(m * sizeof(float), std::byte{0xA5});
      std::vector<std::byte> plain(in.begin(), in.end()), plain_out(out.size());
      const bool staged = k % 5 == 4;
      staged_calls += staged;
      comm.backend()
          .all_reduce(staged ? static_cast<const void*>(plain.data()) : in.data(),
                      staged ? static_cast<void*>(plain_out.data()) : out.data(), m, DType::f32,
                      ReduceOp::sum, Launch::blocking)
          .wait();
      bad += closed_form_wrong(staged ? plain_out.data() : out.data(), m, CollOp::all_reduce, n, m);
    }
    CHECK(bad == 0);
    CHECK(comm.backend().node_direct_calls() - before ==
          (segment ? std::size_t(calls) - staged_calls : 0));
  }

  // A rank whose buffer is not mappable sends every rank of its node down the staging path,
  // same results.
  const Case c{CollOp::reduce_scatter, DType::bf16, ReduceOp::sum, 4099, false};
  const std::uint64_t before = comm.backend().node_direct_calls();
  const auto got = r == n - 1 ? run(comm, c, seed, Launch::blocking)
                              : run<SharedVec>(comm, c, seed, Launch::blocking);
  CHECK(got == threads_output(c, n, r, seed));
  const auto layout = comm.backend().node_layout();
  if (layout.node == layout.nodes - 1) CHECK(comm.backend().node_direct_calls() == before);
}

// This process's soft limit on descriptors, lowered for a scope.
class FileLimit {
 public:
  explicit FileLimit(rlim_t soft) {
    REQUIRE(getrlimit(RLIMIT_NOFILE, &old_) == 0);
    rlimit l = old_;
    l.rlim_cur = soft;
    REQUIRE(setrlimit(RLIMIT_NOFILE, &l) == 0);
  }
  ~FileLimit() { setrlimit(RLIMIT_NOFILE, &old_); }
  FileLimit(const FileLimit&) = delete;
  FileLimit& operator=(const FileLimit&) = delete;

 private:
  rlimit old_{};
};

int highest_open_fd() {
  int top = 2;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
    top = std::max(top, std::stoi(e.path().filename().string()));
  return top;
}

// The descriptor the next open would get: with the limit at it, every open fails (EMFILE).
int lowest_free_fd() {
  const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  close(fd);
  return fd;
}

TEST_CASE(
    "out of descriptors: the heap serves plain memory, a rank that cannot map stages its node") {
  Mpi::Options opt = options();
  opt.node_direct_bytes = 1;
  Collective<Mpi> comm(Mpi(MPI_COMM_WORLD, opt));
  const int n = comm.size(), r = comm.rank();
  const auto layout = comm.backend().node_layout();
  if (layout.per_node < 2) return;  // no heap without a second local rank
  auto& heap = zp::backend::mpi_detail::NodeHeap::install(1);

  // The heap takes at most a quarter of the limit as it is now: past that, allocations are plain
  // memory while descriptors are still free.
  {
    const int soft = highest_open_fd() + 1 + 64;
    const FileLimit limit{rlim_t(soft)};
    std::vector<SharedVec> held;
    std::size_t taken = 0;
    for (;;) {
      held.emplace_back(4096);
      if (heap.find(held.back().data(), 4096).id == 0) break;
      REQUIRE(++taken <= std::size_t(soft) / 4);
    }
    const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);  // the cap made it plain, not the limit
    if (fd >= 0) close(fd);
  }

  // The node's last local rank cannot open its peers' buffers (its limit at the next free
  // descriptor): every rank of the node stages, same results; with descriptors again, the same
  // buffers go in place (a failed mapping is not remembered).
  const std::size_t m = 3001;
  for (CollOp op : {CollOp::all_reduce, CollOp::all_gather}) {
    // (new buffers for each: a peer's buffer mapped already needs no descriptor)
    const SharedVec in = closed_form_input(r, m);
    SharedVec out(std::size_t(n) * m * sizeof(float));
    const auto call = [&](const void* src, void* dst) {
      auto& b = comm.backend();
      (op == CollOp::all_reduce
           ? b.all_reduce(src, dst, m, DType::f32, ReduceOp::sum, Launch::blocking)
           : b.all_gather(src, dst, m, DType::f32, Launch::blocking))
          .wait();
    };
    {  // (connections MPI makes on first use are made before a limit is lowered)
      std::vector<std::byte> plain(in.begin(), in.end()), plain_out(out.size());
      call(plain.data(), plain_out.data());
    }
    for (const bool starved : {true, false}) {
      CAPTURE(std::string(zp::name(op)));
      CAPTURE(starved);
      std::fill(out.begin(), out.end(), std::byte{0xA5});
      const std::uint64_t before = comm.backend().node_direct_calls();
      {
        std::optional<FileLimit> limit;
        if (starved && layout.local == layout.per_node - 1) limit.emplace(rlim_t(lowest_free_fd()));
        call(in.data(), out.data());
      }
      CHECK(closed_form_wrong(out.data(), op == CollOp::all_reduce ? m : std::size_t(n) * m, op, n,
                              m) == 0);
      CHECK(comm.backend().node_direct_calls() - before == (starved ? 0u : 1u));
    }
  }
}

TEST_CASE("node_direct_bytes that differ between ranks are an error on every rank") {
  Mpi::Options opt = options();
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  opt.node_direct_bytes = r == 0 ? 4096 : 8192;
  std::string what;
  try {
    Mpi m(MPI_COMM_WORLD, opt);
  } catch (const zp::Error& e) {
    what = e.what();
  }
  CAPTURE(what);
  CHECK(what.find("node_direct_bytes is") != std::string::npos);
  CHECK(what.find("from 4096 to 8192") != std::string::npos);
}

TEST_CASE("a ZP_RANKS_PER_NODE that is not a positive count is an error naming it") {
  const char* was = std::getenv("ZP_RANKS_PER_NODE");
  const std::optional<std::string> saved = was ? std::optional<std::string>(was) : std::nullopt;
  for (const char* bad : {"0", "-2", "two", "2x", "99999999999"}) {
    CAPTURE(bad);
    ::setenv("ZP_RANKS_PER_NODE", bad, 1);
    std::string what;
    try {
      Mpi m(MPI_COMM_WORLD, options());
    } catch (const zp::Error& e) {
      what = e.what();
    }
    CAPTURE(what);
    CHECK(what.find(std::string("ZP_RANKS_PER_NODE=\"") + bad +
                    "\" is not a positive number of ranks per node") != std::string::npos);
  }
  // MpiOptions::ranks_per_node takes precedence over the variable.
  Mpi::Options opt = options();
  opt.ranks_per_node = 1;
  {
    Mpi m(MPI_COMM_WORLD, opt);
    CHECK(m.node_layout().per_node == 1);
  }
  if (saved)
    ::setenv("ZP_RANKS_PER_NODE", saved->c_str(), 1);
  else
    ::unsetenv("ZP_RANKS_PER_NODE");
}

TEST_CASE("sub-groups from split run the node path over their own layout") {
  Collective<Mpi> comm(Mpi(MPI_COMM_WORLD, options()));
  const int n = comm.size(), r = comm.rank();
  // Even and odd ranks: across nodes when nodes are pairs, inside one otherwise.
  auto sub = comm.backend().split(r % 2, r);
  Collective<Mpi> group(std::move(sub));
  const int g = group.size();
  CHECK(g == (n + 1 - r % 2) / 2);
  const std::uint64_t seed = zp::test::mpi_seed() + 11;
  for (DType t : {DType::bf16, DType::f32}) {
    const Case c{CollOp::reduce_scatter, t, ReduceOp::sum, 3001, true};
    const auto got = run(group, c, seed + std::uint64_t(r % 2), Launch::blocking);
    CHECK(got == threads_output(c, g, group.rank(), seed + std::uint64_t(r % 2)));
  }
}

TEST_CASE("a segment larger than half the memory is an error on every rank, naming its size") {
  Mpi::Options opt = options();
  opt.node_chunk_bytes = std::size_t(1) << 46;  // 64 TiB per area
  std::string what;
  try {
    Mpi m(MPI_COMM_WORLD, opt);
    if (m.node_layout().per_node < 2) return;  // no segment without a second local rank
  } catch (const zp::Error& e) {
    what = e.what();
  }
  CAPTURE(what);
  const bool local0 = what.find("more than half of the") != std::string::npos &&
                      what.find("lower MpiOptions::node_chunk_bytes") != std::string::npos;
  const bool other = what.find("could not map the shared segment") != std::string::npos;
  CHECK((local0 || other));
  // The communicator works afterwards with the default rounds.
  Collective<Mpi> comm(Mpi(MPI_COMM_WORLD, options()));
  std::vector<float> one(1, 1.0f);
  comm.all_reduce(std::span<float>(one));
  CHECK(one[0] == float(comm.size()));
}

// A name in /dev/shm outlives a job killed while it exists; the segment must never have one.
TEST_CASE("the node's segment is an unnamed memfd, mapped by every local rank") {
  Collective<Mpi> comm(Mpi(MPI_COMM_WORLD, options()));
  if (comm.backend().node_layout().per_node < 2) return;  // no segment without a second rank
  std::ifstream maps("/proc/self/maps");
  int memfd = 0, named = 0;
  for (std::string line; std::getline(maps, line);) {
    memfd += line.find("/memfd:zp-node") != std::string::npos;
    named += line.find("/dev/shm/zp-") != std::string::npos;
  }
  CHECK(memfd >= 1);
  CHECK(named == 0);
}

int main(int argc, char** argv) { return zp::test::mpi_main(argc, argv, "mpi_node.test"); }
