// Tests of include/zp/backend/mpi.hpp, run under mpiexec (ctest runs it at 2 and 4 ranks).
// Every rank runs every test case; checks that fail on any rank make that rank (and so
// mpiexec) exit non-zero. The abort paths (a rank that throws, a rank that never arrives) end
// the job, so they live in mpi_failure.cpp, checked by ctest on the message.
#include "zp/backend/mpi.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../collective_cases.hpp"

using zp::Collective;
using zp::DType;
using zp::Errc;
using zp::Launch;
using zp::ReduceOp;
using zp::backend::Mpi;

namespace {

Collective<Mpi> world(Mpi::Options opt = {}) {
  opt.timeout = std::chrono::seconds(60);  // a hung test ends with a message, not at ctest's limit
  return Collective<Mpi>(Mpi(MPI_COMM_WORLD, opt));
}

std::uint64_t fresh_seed(Collective<Mpi>& comm) {
  return zp::test::shared_seed(comm, zp::test::fresh_seed());
}

// Number of ranks for which `flag` is true.
int count_ranks(Collective<Mpi>& comm, bool flag) {
  std::int32_t x = flag ? 1 : 0;
  comm.all_reduce(std::span<std::int32_t>(&x, 1));
  return x;
}

}  // namespace

TEST_CASE("every operation and element type matches the serial reference") {
  auto comm = world();
  for (std::size_t n : {0, 1, 7, 64, 1000, 4099}) {
    const auto seed = fresh_seed(comm);
    zp::test::check_every_type(comm, seed, n);
  }
}

TEST_CASE("a million-element operation with a count not divisible by the world size is exact") {
  auto comm = world();
  const auto seed = fresh_seed(comm);
  const std::size_t n = 1000003;
  for (bool in_place : {false, true}) {
    zp::test::check_all_reduce<float>(comm, seed, n, ReduceOp::sum, in_place);
    zp::test::check_all_reduce<zp::fp16>(comm, seed + 1, n, ReduceOp::max, in_place);
    zp::test::check_all_reduce<std::int64_t>(comm, seed + 2, n, ReduceOp::avg, in_place);
    zp::test::check_reduce_scatter<zp::bf16>(comm, seed + 3, n, ReduceOp::avg, in_place);
    zp::test::check_reduce_scatter<double>(comm, seed + 4, n, ReduceOp::min, in_place);
    zp::test::check_all_gather<float>(comm, seed + 5, n, in_place);
  }
  zp::test::check_broadcast<std::int32_t>(comm, seed + 6, n, comm.size() - 1);
}

TEST_CASE("without the call check every operation is still exact") {
  Mpi::Options opt;
  opt.check_calls = false;
  auto comm = world(opt);
  for (std::size_t n : {0, 7, 4099}) {
    const auto seed = fresh_seed(comm);
    zp::test::check_every_operation<float>(comm, seed, n);
    zp::test::check_every_operation<zp::bf16>(comm, seed, n);
    zp::test::check_every_operation<std::int32_t>(comm, seed, n);
  }
  comm.barrier();
}

namespace {

// Six async operations at once (polling one, waiting for the rest), then a barrier and a dropped
// handle.
void check_async(Collective<Mpi>& comm) {
  const auto seed = fresh_seed(comm);
  const int N = comm.size(), r = comm.rank();
  const std::size_t n = 3001;
  using zp::test::input;
  using zp::test::inputs;
  auto f = inputs<float>(seed, r, n, N, ReduceOp::avg);
  auto h = inputs<zp::bf16>(seed + 1, r, n, N, ReduceOp::sum);
  auto i = inputs<std::int64_t>(seed + 2, r, n, N, ReduceOp::avg);
  auto rs = inputs<zp::fp16>(seed + 3, r, n * std::size_t(N), N, ReduceOp::avg);
  std::vector<float> ag(n * std::size_t(N), -1.0f);
  const auto mine = inputs<float>(seed + 4, r, n, N, ReduceOp::sum);
  std::copy(mine.begin(), mine.end(), ag.begin() + std::ptrdiff_t(std::size_t(r) * n));
  std::vector<double> bc =
      r == 0 ? inputs<double>(seed + 5, 0, n, N, ReduceOp::sum) : std::vector<double>(n, -1.0);

  std::vector<Collective<Mpi>::Work> works;
  works.push_back(comm.all_reduce_async(std::span<float>(f), ReduceOp::avg));
  works.push_back(comm.all_reduce_async(std::span<zp::bf16>(h), ReduceOp::sum));
  works.push_back(comm.all_reduce_async(std::span<std::int64_t>(i), ReduceOp::avg));
  works.push_back(comm.reduce_scatter_async(std::span<zp::fp16>(rs), ReduceOp::avg));
  works.push_back(comm.all_gather_async(std::span<float>(ag)));
  works.push_back(comm.broadcast_async(std::span<double>(bc), 0));
  // poll the first to completion, wait for the rest
  while (!works[0].test()) {
  }
  CHECK(works[0].test());
  for (auto& w : works) w.wait();

  std::size_t wrong = 0;
  for (std::size_t k = 0; k < n; ++k) {
    double sf = 0, sh = 0, si = 0, srs = 0;
    for (int q = 0; q < N; ++q) {
      sf += input<float>(seed, q, k, N, ReduceOp::avg);
      sh += input<zp::bf16>(seed + 1, q, k, N, ReduceOp::sum);
      si += input<std::int64_t>(seed + 2, q, k, N, ReduceOp::avg);
      srs += input<zp::fp16>(seed + 3, q, std::size_t(r) * n + k, N, ReduceOp::avg);
    }
    wrong += f[k] != float(sf / N);
    wrong += float(h[k]) != float(sh);
    wrong += i[k] != std::int64_t(si) / N;
    wrong += float(rs[std::size_t(r) * n + k]) != float(srs / N);
    wrong += bc[k] != input<double>(seed + 5, 0, k, N, ReduceOp::sum);
    for (int q = 0; q < N; ++q)
      wrong += ag[std::size_t(q) * n + k] != float(input<float>(seed + 4, q, k, N, ReduceOp::sum));
  }
  CHECK(wrong == 0);

  // A barrier and a dropped handle (its destructor waits) are fine too.
  comm.backend().barrier(Launch::async).wait();
  const auto before = comm.stats()[zp::CollOp::all_reduce].calls;
  { auto w = comm.all_reduce_async(std::span<float>(f)); }
  CHECK(comm.stats()[zp::CollOp::all_reduce].calls == before + 1);
}

}  // namespace

TEST_CASE("async operations overlap the caller and run their post-step on completion") {
  auto comm = world();
  check_async(comm);
  CHECK(comm.stats()[zp::CollOp::all_reduce].calls == 4);
}

// MpiOptions::shared_memory = false (ranks that cannot share a segment: README's containers in
// PID namespaces of their own) runs all_reduce, reduce_scatter and all_gather as one MPI call
// each, MPI_Reduce_scatter_block and the 16-bit staging included, blocking and nonblocking.
TEST_CASE(
    "without the node segment every operation and element type is exact, blocking and async") {
  Mpi::Options opt;
  opt.shared_memory = false;
  auto comm = world(opt);
  for (std::size_t n : {0, 1, 7, 1000, 4099}) {
    const auto seed = fresh_seed(comm);
    zp::test::check_every_type(comm, seed, n);
  }
  check_async(comm);
}

TEST_CASE("a backend assigned over frees its communicator and runs on the new one") {
  Mpi::Options opt;
  opt.timeout = std::chrono::seconds(60);
  Mpi first(MPI_COMM_WORLD, opt);
  first = Mpi(MPI_COMM_WORLD, opt);
  Collective<Mpi> comm{std::move(first)};
  std::int64_t x = comm.rank() + 1;
  comm.all_reduce(std::span<std::int64_t>(&x, 1));
  CHECK(x == std::int64_t(comm.size()) * (comm.size() + 1) / 2);
  CHECK(comm.stats()[zp::CollOp::all_reduce].calls == 1);
}

TEST_CASE("split forms sub-groups ordered by key whose collectives stay inside the group") {
  auto comm = world();
  const auto seed = fresh_seed(comm);
  const int N = comm.size(), r = comm.rank();
  // colour by parity, keys reversed: the sub-rank order is the reverse of the world order
  auto sub = comm.split(r % 2, -r);
  const int members = (N + 1 - r % 2) / 2;
  CHECK(sub.size() == members);
  CHECK(sub.rank() == members - 1 - r / 2);
  zp::test::check_every_operation<float>(sub, seed, 1001);
  zp::test::check_every_operation<zp::fp16>(sub, seed, 77);
  std::int64_t x = r, want = 0;
  for (int q = r % 2; q < N; q += 2) want += q;
  sub.all_reduce(std::span<std::int64_t>(&x, 1));
  CHECK(x == want);
  // a split of a split, and the parent still works afterwards
  auto solo = sub.split(sub.rank(), 0);
  CHECK(solo.size() == 1);
  zp::test::check_every_operation<double>(solo, seed, 5);
  zp::test::check_every_operation<double>(comm, seed, 5);
}

TEST_CASE("the communicator counts calls, bytes and bus bytes per operation") {
  auto comm = world();
  const double N = comm.size();
  std::vector<float> a(1000, 1.0f), g(1000 * std::size_t(comm.size()));
  comm.all_reduce(std::span<float>(a));
  comm.all_gather(std::span<float>(g));
  comm.reduce_scatter(std::span<float>(g));
  comm.barrier();
  const auto& s = comm.stats();
  CHECK(s[zp::CollOp::all_reduce].calls == 1);
  CHECK(s[zp::CollOp::all_reduce].bytes == 4000);
  CHECK(s[zp::CollOp::all_reduce].bus_bytes == doctest::Approx(4000 * 2.0 * (N - 1) / N));
  CHECK(s[zp::CollOp::all_gather].bytes == 4000 * std::uint64_t(N));
  CHECK(s[zp::CollOp::all_gather].bus_bytes == doctest::Approx(4000 * (N - 1)));
  CHECK(s[zp::CollOp::reduce_scatter].bus_bytes == doctest::Approx(4000 * (N - 1)));
  CHECK(s[zp::CollOp::barrier].calls == 1);
  CHECK(s.total().calls == 4);
  CHECK(s[zp::CollOp::all_reduce].seconds > 0);
  CHECK(a[0] == float(N));
}

TEST_CASE("bad arguments are errors that name the values, on every rank") {
  auto comm = world();
  const int N = comm.size(), r = comm.rank();
  std::vector<float> a(10), b(11), c(5);
  CHECK_THROWS_WITH_AS(comm.all_reduce(std::span<const float>(a), std::span<float>(b)),
                       doctest::Contains("input has 10 elements but output has 11"), zp::Error);
  CHECK_THROWS_WITH_AS(comm.all_gather(std::span<const float>(c), std::span<float>(b)),
                       doctest::Contains("full buffer has 11 elements but the shard has 5"),
                       zp::Error);
  CHECK_THROWS_WITH_AS(comm.broadcast(std::span<float>(a), N), doctest::Contains("root"),
                       zp::Error);
  CHECK_THROWS_WITH_AS(comm.split(-1, 0), doctest::Contains("got -1"), zp::Error);

  // What only the backend can see: MPI's int counts, and overlapping buffers that are not the
  // in-place layout. The signature exchange makes every rank fail, not only the guilty one.
  const std::size_t huge = std::size_t(INT_MAX) + 1;
  CHECK_THROWS_WITH_AS(comm.backend().all_reduce(a.data(), a.data(), huge, DType::f32,
                                                 ReduceOp::sum, Launch::blocking),
                       doctest::Contains("exceeds MPI's limit"), zp::Error);
  std::vector<float> big(4 * std::size_t(N) + 1);
  int rejected = 0;
  try {
    // rank 1 passes an output that overlaps its input at the wrong place
    float* out = r == 1 ? big.data() + 1 : c.data();
    comm.backend().reduce_scatter(big.data(), out, 4, DType::f32, ReduceOp::sum, Launch::blocking);
  } catch (const zp::Error& e) {
    const std::string what = e.what();
    rejected = e.category() == Errc::invalid_argument &&
               (r == 1 ? what.find("overlaps the input") : what.find("rank 1 rejected")) !=
                   std::string::npos;
  }
  CHECK(count_ranks(comm, rejected) == N);
  zp::test::check_all_reduce<float>(comm, fresh_seed(comm), 99, ReduceOp::sum,
                                    true);  // still usable
}

TEST_CASE(
    "the shared argument checks: overlap, null buffers, unknown ops and types, a bad root on one "
    "rank") {
  auto comm = world();
  zp::test::check_bad_arguments(comm);
}

TEST_CASE("integer sums wrap around, and dropped async Work completes before its buffers go") {
  auto comm = world();
  zp::test::check_integer_wraparound(comm);
  const auto seed = fresh_seed(comm);
  for (int rep = 0; rep < 5; ++rep)
    zp::test::check_dropped_work(comm, seed + 100 * std::uint64_t(rep), 20);
}

TEST_CASE("mismatched calls are an error on every rank, and the communicator stays usable") {
  auto comm = world();
  const int N = comm.size(), r = comm.rank();
  auto expect_everywhere = [&](auto&& call, const std::string& text) {
    bool ok = false;
    try {
      call();
    } catch (const zp::Error& e) {
      ok = e.category() == Errc::invalid_argument &&
           std::string(e.what()).find(text) != std::string::npos;
      INFO(e.what());
      CHECK(ok);
    }
    CHECK(count_ranks(comm, ok) == N);
  };
  SUBCASE("count") {
    std::vector<float> a(r == 1 ? 9 : 8);
    expect_everywhere([&] { comm.all_reduce(std::span<float>(a)); },
                      "rank 0 called all_reduce(count=8, dtype=f32, op=sum, root=0) but rank 1 "
                      "called all_reduce(count=9");
  }
  SUBCASE("all_to_all against all_gather") {
    std::vector<float> in(std::size_t(N) * 2), out(std::size_t(N) * 2);
    expect_everywhere(
        [&] {
          if (r == 0)
            comm.all_to_all(std::span<const float>(in), std::span<float>(out));
          else
            comm.all_gather(std::span<const float>(in).first(2), std::span<float>(out));
        },
        "rank 0 called all_to_all(count=2");
  }
  SUBCASE("element type") {
    std::vector<zp::bf16> h(4);
    std::vector<float> f(4);
    expect_everywhere(
        [&] {
          if (r == 0)
            comm.all_reduce(std::span<zp::bf16>(h));
          else
            comm.all_reduce(std::span<float>(f));
        },
        "dtype=f32");
  }
  SUBCASE("operation") {
    std::vector<float> f(4 * std::size_t(N));
    expect_everywhere(
        [&] {
          if (r == N - 1)
            comm.broadcast(std::span<float>(f), 0);
          else
            comm.all_gather(std::span<float>(f));
        },
        "called broadcast");
  }
  SUBCASE("reduce op and root") {
    std::vector<float> f(4);
    expect_everywhere(
        [&] { comm.all_reduce(std::span<float>(f), r == 1 ? ReduceOp::max : ReduceOp::sum); },
        "op=max");
    expect_everywhere([&] { comm.broadcast(std::span<float>(f), r == 0 ? 0 : 1); }, "root=1");
  }
  SUBCASE("async") {
    std::vector<double> d(r == 1 ? 3 : 2);
    expect_everywhere([&] { comm.all_reduce_async(std::span<double>(d)).wait(); }, "count=3");
  }
  zp::test::check_every_operation<float>(comm, fresh_seed(comm), 33);
}

TEST_CASE("send and recv deliver every element type in order between the pairs that meet") {
  auto comm = world();
  zp::test::check_point_to_point(comm, fresh_seed(comm));
  Mpi::Options opt;
  opt.check_calls = false;  // only the data messages
  auto unchecked = world(opt);
  zp::test::check_point_to_point(unchecked, fresh_seed(comm));
}

TEST_CASE("send and recv mistakes are errors naming the values, on both sides of a mismatch") {
  auto comm = world();
  zp::test::check_point_to_point_errors(comm);
  std::vector<char> big(16);
  zp::test::expect_invalid(
      [&] {
        comm.backend().send(big.data(), std::size_t(INT_MAX) / 2 + 1, DType::f32,
                            (comm.rank() + 1) % comm.size(), Launch::blocking);
      },
      {"exceeds MPI's limit of 2147483647 bytes per message"});
  zp::test::check_point_to_point(comm, fresh_seed(comm));  // still usable, in step
}

TEST_CASE("a dropped async send or recv completes before its buffers can be freed") {
  auto comm = world();
  zp::test::check_dropped_p2p_work(comm, fresh_seed(comm), 20);
}

TEST_CASE("the environment provides the thread level the watchdog needs") {
  auto comm = world();
  int level = 0;
  MPI_Query_thread(&level);
  CHECK(level == MPI_THREAD_MULTIPLE);
  CHECK(comm.backend().comm() != MPI_COMM_WORLD);  // a private duplicate
  CHECK(std::string(Mpi::name) == "mpi");
}

int main(int argc, char** argv) {
  zp::backend::MpiEnvironment env(&argc, &argv);
  doctest::Context ctx(argc, argv);
  if (env.world_rank() != 0) ctx.setOption("minimal", true);  // failures only, from other ranks
  // Cases this run leaves to another (doctest's --test-case-exclude; tests/CMakeLists.txt).
  if (const char* x = std::getenv("ZP_TEST_EXCLUDE")) ctx.addFilter("test-case-exclude", x);
  const int rc = ctx.run();
  return rc;
}
