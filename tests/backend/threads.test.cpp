#include "zp/backend/threads.hpp"

#include <doctest/doctest.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <thread>

#include "../collective_cases.hpp"

using zp::Collective;
using zp::Errc;
using zp::ReduceOp;
using zp::backend::run_threads;
using zp::backend::Threads;
using zp::backend::World;

using zp::test::fresh_seed;

// The suite "bulk": long, and no clock in them, so ctest runs them beside other tests (the rest of
// this file bounds wall-clock times and runs alone: tests/CMakeLists.txt).
TEST_CASE("every operation and element type matches the serial reference at every world size" *
          doctest::test_suite("bulk")) {
  for (int ranks : {1, 2, 3, 4, 8}) {
    for (std::size_t n : {0, 1, 7, 64, 1000, 4099}) {
      const auto seed = fresh_seed();
      run_threads(ranks,
                  [&](Collective<Threads>& comm) { zp::test::check_every_type(comm, seed, n); });
    }
  }
}

TEST_CASE("a million-element operation with a count not divisible by the world size is exact" *
          doctest::test_suite("bulk")) {
  for (int ranks : {3, 4}) {
    const auto seed = fresh_seed();
#if ZP_ASAN || ZP_TSAN  // 5-20x slower there: a tenth, still a dozen 2048-element chunks a rank
    const std::size_t n = 100003;
#else
    const std::size_t n = 1000003;
#endif
    run_threads(ranks, [&](Collective<Threads>& comm) {
      for (bool in_place : {false, true}) {
        zp::test::check_all_reduce<float>(comm, seed, n, ReduceOp::sum, in_place);
        zp::test::check_reduce_scatter<zp::bf16>(comm, seed, n, ReduceOp::avg, in_place);
        zp::test::check_all_gather<float>(comm, seed, n, in_place);
      }
    });
  }
}

// A waiting rank spins only where each rank can have a core of those the process may run on, not
// of the machine's: zp.test.backend.threads.one_core runs this under `taskset -c 0` (two thread
// ranks spinning on one core took 108 us an all_reduce of 4 KiB, 4 us sleeping; bench/RESULTS.md),
// zp.test.backend.threads.cpu_quota in a cgroup with a quota of ZP_TEST_CPU_QUOTA CPUs.
TEST_CASE("ranks spin only where each has a core that this process may run on") {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  if (const char* quota = std::getenv("ZP_TEST_CPU_QUOTA"))
    CHECK(zp::detail::quota_cpus() == std::atoi(quota));
  const int allowed = std::min(CPU_COUNT(&set), zp::detail::quota_cpus());
  CHECK(zp::detail::cores() == allowed);
  CHECK(zp::detail::spin_pays(allowed));
  CHECK_FALSE(zp::detail::spin_pays(allowed + 1));
}

TEST_CASE("async operations complete in issue order and overlap the caller") {
  const auto seed = fresh_seed();
  run_threads(4, [&](Collective<Threads>& comm) {
    const int N = comm.size(), r = comm.rank();
    std::vector<std::vector<float>> bufs;
    for (int k = 0; k < 6; ++k)
      bufs.push_back(zp::test::inputs<float>(seed + k, r, 5000 + k, N, ReduceOp::sum));
    std::vector<Collective<Threads>::Work> works;
    for (auto& b : bufs) works.push_back(comm.all_reduce_async(std::span<float>(b)));
    comm.barrier();  // a blocking call after async ones runs after them
    for (auto& w : works) CHECK(w.test());
    for (auto& w : works) w.wait();
    for (int k = 0; k < 6; ++k) {
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < bufs[std::size_t(k)].size(); ++i) {
        double want = 0;
        for (int q = 0; q < N; ++q)
          want += zp::test::input<float>(seed + k, q, i, N, ReduceOp::sum);
        wrong += bufs[std::size_t(k)][i] != float(want);
      }
      CHECK(wrong == 0);
    }
  });
}

TEST_CASE("split forms sub-groups ordered by key whose collectives stay inside the group") {
  const auto seed = fresh_seed();
  run_threads(6, [&](Collective<Threads>& comm) {
    const int r = comm.rank();
    // colour by parity, keys reversed: the sub-rank order is the reverse of the world order
    auto sub = comm.split(r % 2, -r);
    CHECK(sub.size() == 3);
    CHECK(sub.rank() == 2 - r / 2);
    zp::test::check_every_operation<float>(sub, seed, 1001);
    // the group's sum counts only its own members
    std::int64_t x = r;
    sub.all_reduce(std::span<std::int64_t>(&x, 1));
    CHECK(x == (r % 2 == 0 ? 0 + 2 + 4 : 1 + 3 + 5));
  });
}

TEST_CASE("the communicator counts calls, bytes and bus bytes per operation") {
  run_threads(4, [&](Collective<Threads>& comm) {
    std::vector<float> a(1000, 1.0f), g(4000);
    comm.all_reduce(std::span<float>(a));
    comm.all_gather(std::span<float>(g));
    comm.reduce_scatter(std::span<float>(g));
    const auto& s = comm.stats();
    CHECK(s[zp::CollOp::all_reduce].calls == 1);
    CHECK(s[zp::CollOp::all_reduce].bytes == 4000);
    CHECK(s[zp::CollOp::all_reduce].bus_bytes == doctest::Approx(4000 * 2.0 * 3 / 4));
    CHECK(s[zp::CollOp::all_gather].bytes == 16000);
    CHECK(s[zp::CollOp::all_gather].bus_bytes == doctest::Approx(16000 * 3.0 / 4));
    CHECK(s[zp::CollOp::reduce_scatter].bus_bytes == doctest::Approx(16000 * 3.0 / 4));
    CHECK(s.total().calls == 3);
    CHECK(s[zp::CollOp::all_reduce].seconds > 0);
  });
}

TEST_CASE("bad arguments are errors that name the values") {
  run_threads(2, [&](Collective<Threads>& comm) {
    std::vector<float> a(10), b(11), c(5);
    CHECK_THROWS_WITH_AS(comm.all_reduce(std::span<const float>(a), std::span<float>(b)),
                         doctest::Contains("input has 10 elements but output has 11"), zp::Error);
    CHECK_THROWS_WITH_AS(comm.all_gather(std::span<const float>(c), std::span<float>(b)),
                         doctest::Contains("full buffer has 11 elements but the shard has 5"),
                         zp::Error);
    CHECK_THROWS_WITH_AS(comm.broadcast(std::span<float>(a), 2), doctest::Contains("root 2"),
                         zp::Error);
    CHECK_THROWS_WITH_AS(comm.split(-1, 0), doctest::Contains("got -1"), zp::Error);
  });
  CHECK_THROWS_WITH_AS(World::create(0), doctest::Contains("got 0"), zp::Error);
}

TEST_CASE("mismatched calls on different ranks are an error on every rank, not a hang") {
  std::atomic<int> invalid{0};
  CHECK_THROWS_AS(run_threads(3,
                              [&](Collective<Threads>& comm) {
                                std::vector<float> a(comm.rank() == 1 ? 9 : 8);
                                try {
                                  comm.all_reduce(std::span<float>(a));
                                } catch (const zp::Error& e) {
                                  if (e.category() == Errc::invalid_argument &&
                                      std::string(e.what()).find(
                                          "rank 1 called all_reduce(count=9") != std::string::npos)
                                    ++invalid;
                                  throw;
                                }
                              }),
                  zp::Error);
  CHECK(invalid == 3);

  CHECK_THROWS_WITH_AS(run_threads(2,
                                   [&](Collective<Threads>& comm) {
                                     std::vector<zp::bf16> h(4);
                                     std::vector<float> f(4);
                                     if (comm.rank() == 0)
                                       comm.all_reduce(std::span<zp::bf16>(h));
                                     else
                                       comm.all_reduce(std::span<float>(f));
                                   }),
                       doctest::Contains("dtype=f32"), zp::Error);
}

TEST_CASE("an all_to_all against another call, or with overlapping ranks' buffers, is an error") {
  CHECK_THROWS_WITH_AS(
      run_threads(2,
                  [&](Collective<Threads>& comm) {
                    std::vector<float> in(4), out(4);
                    if (comm.rank() == 0)
                      comm.all_to_all(std::span<const float>(in), std::span<float>(out));
                    else
                      comm.all_gather(std::span<const float>(in).first(2), std::span<float>(out));
                  }),
      doctest::Contains("rank 0 called all_to_all(count=2"), zp::Error);
  // Rank 1 writes its output where rank 0 reads its input.
  std::vector<float> shared(8);
  CHECK_THROWS_WITH_AS(run_threads(2,
                                   [&](Collective<Threads>& comm) {
                                     std::vector<float> own(4);
                                     const std::span<float> s(shared);
                                     if (comm.rank() == 0)
                                       comm.all_to_all(std::span<const float>(s.first(4)),
                                                       std::span<float>(own));
                                     else
                                       comm.all_to_all(std::span<const float>(own), s.first(4));
                                   }),
                       doctest::Contains("all_to_all: rank 1's output"), zp::Error);
}

TEST_CASE("all_to_all_v against all_to_all, or writing into another rank's input, is an error") {
  CHECK_THROWS_WITH_AS(
      run_threads(2,
                  [&](Collective<Threads>& comm) {
                    std::vector<float> in(4), out(4);
                    const std::vector<std::size_t> counts{2, 2};
                    if (comm.rank() == 0)
                      comm.all_to_all(std::span<const float>(in), std::span<float>(out));
                    else
                      comm.all_to_all_v(std::span<const float>(in),
                                        std::span<const std::size_t>(counts), std::span<float>(out),
                                        std::span<const std::size_t>(counts));
                  }),
      doctest::Contains("but rank 1 called all_to_all_v(dtype=f32)"), zp::Error);
  std::vector<float> shared(8);
  CHECK_THROWS_WITH_AS(
      run_threads(2,
                  [&](Collective<Threads>& comm) {
                    std::vector<float> own(4);
                    const std::vector<std::size_t> counts{2, 2};
                    const std::span<float> s(shared);
                    if (comm.rank() == 0)
                      comm.all_to_all_v(std::span<const float>(s.first(4)),
                                        std::span<const std::size_t>(counts), std::span<float>(own),
                                        std::span<const std::size_t>(counts));
                    else
                      comm.all_to_all_v(std::span<const float>(own),
                                        std::span<const std::size_t>(counts), s.subspan(2, 4),
                                        std::span<const std::size_t>(counts));
                  }),
      doctest::Contains("all_to_all: rank 1's output"), zp::Error);
}

// The simulated link (ThreadsOptions::link): 4 ranks as 2 nodes of 2 at 20 kB/s. An all_gather of
// 2500 floats per rank reads 2 blocks (20 kB) from the other node: at least 1 s. The same inside
// one node (a split by node) crosses nothing and is not held back (a memcpy of 20 kB, well
// under the 0.5 s bound however loaded the machine). The other collectives, each 5 kB across
// (at least 0.25 s): an all_reduce of 1250 floats reads and writes its 1/4 slice on the 2 ranks
// of the other node, an all_to_all of 625 floats a peer reads a block from each of them, a
// broadcast of 1250 floats reads the root's buffer on the other node only.
TEST_CASE("the simulated link holds cross-node collectives for their bytes, and only those") {
  zp::backend::ThreadsOptions opt;
  opt.link = {2, 2e4};
  std::vector<double> cross(4), inside(4), reduce(4), exchange(4), broadcast(4);
  run_threads(
      4,
      [&](Collective<Threads>& comm) {
        const std::vector<float> in(2500, float(comm.rank()));
        std::vector<float> out(4 * in.size());
        auto timed = [&](auto&& op) {
          const auto t = std::chrono::steady_clock::now();
          op();
          return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        };
        auto gather = [&](auto& c, std::span<float> o) {
          return timed([&] { c.all_gather(std::span<const float>(in), o); });
        };
        const auto r = std::size_t(comm.rank());
        cross[r] = gather(comm, std::span<float>(out));
        CHECK(out[3 * in.size()] == 3.0f);
        auto node = comm.split(comm.rank() / 2, comm.rank());
        inside[r] = gather(node, std::span<float>(out).first(2 * in.size()));
        CHECK(out[in.size()] == float(comm.rank() / 2 * 2 + 1));
        std::span<float> part = std::span<float>(out).first(1250);
        std::fill(part.begin(), part.end(), 1.0f);
        reduce[r] = timed([&] { comm.all_reduce(part); });
        CHECK(part[1249] == 4.0f);
        exchange[r] = timed([&] {
          comm.all_to_all(std::span<const float>(in).first(4 * 625),
                          std::span<float>(out).first(4 * 625));
        });
        CHECK(out[3 * 625] == 3.0f);
        std::fill(part.begin(), part.end(), float(comm.rank()));
        broadcast[r] = timed([&] { comm.broadcast(part, 0); });
        CHECK(part[0] == 0.0f);
      },
      opt);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(cross[std::size_t(r)] >= 1.0);
    CHECK(inside[std::size_t(r)] < 0.5);
    CHECK(reduce[std::size_t(r)] >= 0.25);
    CHECK(exchange[std::size_t(r)] >= 0.25);
    if (r >= 2) CHECK(broadcast[std::size_t(r)] >= 0.25);
  }
  opt.link.bytes_per_second = -1;
  CHECK_THROWS_WITH_AS(run_threads(
                           2, [](Collective<Threads>&) {}, opt),
                       doctest::Contains("finite bytes_per_second >= 0, got 2 and -1"), zp::Error);
}

TEST_CASE("a rank that throws makes the others fail promptly with the cause") {
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int> aborted{0};
  try {
    run_threads(
        4,
        [&](Collective<Threads>& comm) {
          std::vector<float> a(100);
          comm.all_reduce(std::span<float>(a));
          if (comm.rank() == 2) throw std::runtime_error("loss exploded on rank 2");
          try {
            comm.all_reduce(std::span<float>(a));
          } catch (const zp::Error& e) {
            if (e.category() == Errc::aborted &&
                std::string(e.what()).find("loss exploded") != std::string::npos)
              ++aborted;
            throw;
          }
        },
        World::Options{.timeout = std::chrono::seconds(60)});
    FAIL("run_threads should have rethrown");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "loss exploded on rank 2");  // the cause, not an abort
  }
  CHECK(aborted == 3);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

TEST_CASE("a rank that leaves early fails the others, and a silent one times out") {
  SUBCASE("left") {
    auto world = World::create(2);
    std::thread gone([&] { Threads t(world, 1); });  // joins, then destroys its backend
    gone.join();
    Collective<Threads> comm{Threads(world, 0)};
    std::vector<float> a(3);
    CHECK_THROWS_WITH_AS(comm.all_reduce(std::span<float>(a)),
                         doctest::Contains("rank 1 left the communicator"), zp::Error);
  }
  SUBCASE("assigned over") {  // leaves as its destruction would, and runs on its new world
    auto world = World::create(2), other = World::create(1);
    std::thread gone([&] {
      Threads t(world, 1);
      t = Threads(other, 0);
      Collective<Threads> alone{std::move(t)};
      std::vector<float> x(3, 2.5f);
      alone.all_reduce(std::span<float>(x));
      CHECK(x == std::vector<float>(3, 2.5f));
      CHECK(alone.size() == 1);
    });
    gone.join();
    Collective<Threads> comm{Threads(world, 0)};
    std::vector<float> a(3);
    CHECK_THROWS_WITH_AS(comm.all_reduce(std::span<float>(a)),
                         doctest::Contains("rank 1 left the communicator"), zp::Error);
  }
  SUBCASE("silent") {
    auto world = World::create(2, {.timeout = std::chrono::milliseconds(200)});
    Threads idle(world, 1);  // a member that never calls
    Collective<Threads> comm{Threads(world, 0)};
    std::vector<float> a(3);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      comm.all_reduce(std::span<float>(a));
      FAIL("expected a timeout");
    } catch (const zp::Error& e) {
      CHECK(e.category() == Errc::timeout);
      CHECK(std::string(e.what()).find("rank 0 timed out after 200 ms in all_reduce") !=
            std::string::npos);
    }
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  }
}

TEST_CASE("bad arguments are errors on every rank and the communicator stays usable") {
  for (int ranks : {1, 2, 3})
    run_threads(ranks, [&](Collective<Threads>& comm) { zp::test::check_bad_arguments(comm); });
}

TEST_CASE("integer sums wrap around instead of overflowing") {
  run_threads(3, [&](Collective<Threads>& comm) { zp::test::check_integer_wraparound(comm); });
}

TEST_CASE("a dropped async Work completes before its buffers can be freed") {
  const auto seed = fresh_seed();
  for (int rep = 0; rep < 5; ++rep)
    run_threads(3, [&](Collective<Threads>& comm) {
      zp::test::check_dropped_work(comm, seed + 100 * rep, 20);
    });
}

TEST_CASE("a timeout of milliseconds::max() means never, not an immediate timeout") {
  run_threads(
      2,
      [&](Collective<Threads>& comm) {
        std::int64_t x = 1;
        comm.all_reduce(std::span<std::int64_t>(&x, 1));
        CHECK(x == 2);
        // a message posted before its match waits with no deadline too
        if (comm.rank() == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          comm.send(std::span<const std::int64_t>(&x, 1), 1);
        } else {
          comm.recv(std::span<std::int64_t>(&x, 1), 0);
          CHECK(x == 2);
        }
      },
      World::Options{.timeout = std::chrono::milliseconds::max()});
}

TEST_CASE("a second backend for one rank of a World is an error") {
  auto world = World::create(2);
  Threads first(world, 0);
  zp::test::expect_invalid([&] { Threads second(world, 0); },
                           {"rank 0 of this world already has a backend"});
}

TEST_CASE("two threads calling as the same rank at once is an error, not a wrong sum") {
  run_threads(2, [&](Collective<Threads>& comm) {
    std::int64_t x = 1;
    if (comm.rank() == 1) {
      // Rank 1 joins rank 0's one legitimate call only after its second thread was refused.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm.all_reduce(std::span<std::int64_t>(&x, 1));
      CHECK(x == 2);
      return;
    }
    std::atomic<int> refused{0}, summed{0};
    auto call = [&] {
      std::int64_t y = 1;
      try {
        comm.all_reduce(std::span<std::int64_t>(&y, 1));
        summed += y == 2;
      } catch (const zp::Error& e) {
        refused +=
            std::string(e.what()).find(
                "two threads issued all_reduce and another call as rank 0") != std::string::npos;
      }
    };
    std::thread a(call);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::thread b(call);
    a.join();
    b.join();
    CHECK(refused == 1);
    CHECK(summed == 1);
  });
}

TEST_CASE("a rank that returns early is named as returned, not as a barrier it never called") {
  CHECK_THROWS_WITH_AS(run_threads(2,
                                   [&](Collective<Threads>& comm) {
                                     if (comm.rank() == 0) return;
                                     std::vector<float> a(4);
                                     comm.all_reduce(std::span<float>(a));
                                   }),
                       doctest::Contains("returned from its function (run_threads)"), zp::Error);
}

TEST_CASE(
    "a reduction outside ReduceOp is named with its number, also when only one rank passes it") {
  run_threads(2, [](Collective<Threads>& comm) {
    std::vector<float> x(4);
    const ReduceOp op = comm.rank() == 1 ? ReduceOp(9) : ReduceOp::sum;
    CHECK_THROWS_WITH_AS(comm.all_reduce(std::span<float>(x), op),
                         doctest::Contains("op=ReduceOp(9)"), zp::Error);
    CHECK_THROWS_WITH_AS(
        comm.all_reduce(std::span<float>(x), ReduceOp(9)),
        doctest::Contains("reduction ReduceOp(9) is not one of sum, avg, max, min"), zp::Error);
  });
}

TEST_CASE("mismatched calls leave the communicator usable") {
  run_threads(3, [&](Collective<Threads>& comm) {
    std::vector<float> a(comm.rank() == 2 ? 5 : 4, 1.0f);
    zp::test::expect_invalid([&] { comm.all_reduce(std::span<float>(a)); },
                             {"rank 2 called all_reduce(count=5"});
    std::vector<float> b(4, 1.0f);
    comm.all_reduce(std::span<float>(b));
    CHECK(b[3] == 3.0f);
  });
}

TEST_CASE("send and recv deliver every element type in order between the pairs that meet") {
  for (int ranks : {2, 3, 4}) {
    const auto seed = fresh_seed();
    run_threads(ranks,
                [&](Collective<Threads>& comm) { zp::test::check_point_to_point(comm, seed); });
  }
}

TEST_CASE("send and recv mistakes are errors naming the values, on both sides of a mismatch") {
  for (int ranks : {2, 3})
    run_threads(ranks,
                [&](Collective<Threads>& comm) { zp::test::check_point_to_point_errors(comm); });
}

TEST_CASE("a dropped async send or recv completes before its buffers can be freed") {
  const auto seed = fresh_seed();
  for (int ranks : {2, 3})
    run_threads(ranks, [&](Collective<Threads>& comm) {
      zp::test::check_dropped_p2p_work(comm, seed, 20);
    });
}

TEST_CASE("a pair exchanging messages does not wait for the ranks outside it") {
  // Ranks 2 and 3 are busy elsewhere (here: asleep) while 0 and 1 exchange; a collective-style
  // rendezvous of the whole world would make 0 and 1 wait for them.
  run_threads(4, [&](Collective<Threads>& comm) {
    const int r = comm.rank();
    if (r >= 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 20; ++k) {
      std::int64_t x = r == 0 ? k : -1;
      if (r == 0)
        comm.send(std::span<const std::int64_t>(&x, 1), 1);
      else
        comm.recv(std::span<std::int64_t>(&x, 1), 0);
      CHECK(x == k);
    }
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(900));
  });
}

TEST_CASE("a blocking send completes when its recv is posted later") {
  run_threads(2, [&](Collective<Threads>& comm) {
    std::vector<float> a(1000, comm.rank() == 0 ? 3.0f : 0.0f);
    if (comm.rank() == 0) {
      comm.send(std::span<const float>(a), 1);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      comm.recv(std::span<float>(a), 0);
      CHECK(a[999] == 3.0f);
    }
  });
}

TEST_CASE(
    "a send or recv whose peer never comes times out naming the ranks, the operation and the "
    "call") {
  SUBCASE("recv") {
    auto world = World::create(2, {.timeout = std::chrono::milliseconds(200)});
    Threads idle(world, 0);  // a member that never sends
    Collective<Threads> comm{Threads(world, 1)};
    std::vector<float> a(3);
    const auto t0 = std::chrono::steady_clock::now();
    zp::test::expect_error(
        Errc::timeout, [&] { comm.recv(std::span<float>(a), 0); },
        {"rank 1 timed out after 200 ms in recv from rank 0 (call #1, message #1",
         "waiting for rank 0 to send it"});
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
    CHECK(world->poisoned());
    // The communicator is poisoned now: the next call fails at once.
    zp::test::expect_error(Errc::aborted, [&] { comm.recv(std::span<float>(a), 0); },
                           {"timed out"});
  }
  SUBCASE("async send") {
    auto world = World::create(3, {.timeout = std::chrono::milliseconds(200)});
    Threads idle1(world, 1), idle2(world, 2);
    Collective<Threads> comm{Threads(world, 0)};
    std::vector<float> a(3);
    auto w = comm.send_async(std::span<const float>(a), 2);
    zp::test::expect_error(
        Errc::timeout, [&] { w.wait(); },
        {"rank 0 timed out after 200 ms in send to rank 2 (call #1, message #1 from rank 0 "
         "to rank 2)",
         "waiting for rank 2 to recv it"});
  }
}

TEST_CASE("a rank that leaves or throws fails the send and recv waiting for it") {
  SUBCASE("left") {
    auto world = World::create(2);
    Collective<Threads> comm{Threads(world, 0)};
    std::vector<float> a(3);
    std::thread gone([&] {
      Threads t(world, 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    });  // its backend goes while rank 0 waits
    zp::test::expect_error(
        Errc::aborted, [&] { comm.recv(std::span<float>(a), 1); },
        {"rank 0 in recv from rank 1 (call #1)", "rank 1 left the communicator"});
    gone.join();
  }
  SUBCASE("threw") {
    std::atomic<int> aborted{0};
    CHECK_THROWS_WITH_AS(run_threads(
                             3,
                             [&](Collective<Threads>& comm) {
                               std::vector<float> a(3);
                               if (comm.rank() == 2) {
                                 std::this_thread::sleep_for(std::chrono::milliseconds(50));
                                 throw std::runtime_error("rank 2 gave up");
                               }
                               try {
                                 if (comm.rank() == 0)
                                   comm.send(std::span<const float>(a), 2);
                                 else
                                   comm.recv_async(std::span<float>(a), 2).wait();
                               } catch (const zp::Error& e) {
                                 aborted += e.category() == Errc::aborted &&
                                            std::string(e.what()).find("rank 2 gave up") !=
                                                std::string::npos;
                                 throw;
                               }
                             },
                             World::Options{.timeout = std::chrono::seconds(60)}),
                         doctest::Contains("rank 2 gave up"), std::runtime_error);
    CHECK(aborted == 2);
  }
}

// Threads::meet, the rendezvous cuda_threads runs its device collectives through: the body runs
// once on every rank with every rank's call (and its ext pointer) in view, between two meetings;
// calls that disagree are an invalid_argument on every rank, naming both.
TEST_CASE(
    "meet runs the body on every rank with every rank's call; mismatched calls are an error "
    "everywhere") {
  for (int n : {1, 2, 3, 4}) {
    std::vector<int> own(static_cast<std::size_t>(n));
    std::atomic<int> bodies{0};
    run_threads(n, [&](Collective<Threads>& comm) {
      const int r = comm.rank();
      zp::backend::threads_detail::Call c{zp::CollOp::barrier};
      c.ext = &own[std::size_t(r)];
      comm.backend().meet(c, [&](const std::vector<zp::backend::threads_detail::Call>& calls) {
        REQUIRE(calls.size() == std::size_t(n));
        for (int k = 0; k < n; ++k) CHECK(calls[std::size_t(k)].ext == &own[std::size_t(k)]);
        ++bodies;
      });
      CHECK(bodies.load() == n);  // the second meeting: every body ran before any rank returns
      zp::backend::threads_detail::Call d{zp::CollOp::all_reduce};
      d.count = r == 0 ? 4 : 5;
      if (n > 1)
        zp::test::expect_invalid(
            [&] {
              comm.backend().meet(d,
                                  [](const auto&) { FAIL("the body of a mismatched call ran"); });
            },
            {"mismatched collective calls", "count=4", "count=5"});
    });
  }
}

// Ranks are threads of one address space: a buffer one rank writes that overlaps another rank's
// buffer would make the ranks' copies race (memcpy between overlapping ranges). Every rank gets
// the same invalid_argument naming both ranges, and the communicator stays usable.
TEST_CASE(
    "a buffer one rank writes that overlaps another rank's is an error on every rank naming both "
    "ranges") {
  std::vector<float> shared(64);
  float* const a = shared.data();
  std::fill_n(a + 32, 4, 2.0f);
  const auto at = [](const float* p, std::size_t floats) {
    return zp::detail::cat("[", static_cast<const void*>(p), ", +", floats * sizeof(float),
                           " bytes)");
  };
  const auto check_usable = [](Collective<Threads>& comm) {
    std::int64_t x = 1;
    comm.all_reduce(std::span<std::int64_t>(&x, 1));
    CHECK(x == comm.size());
  };
  run_threads(2, [&](Collective<Threads>& comm) {
    const int r = comm.rank();
    std::vector<float> own(8, float(r));
    // all_gather: rank 0 gathers into a[0, 8) while rank 1 contributes a[2, 6).
    zp::test::expect_invalid(
        [&] {
          if (r == 0)
            comm.all_gather(std::span<const float>(own.data(), 4), std::span<float>(a, 8));
          else
            comm.all_gather(std::span<const float>(a + 2, 4), std::span<float>(own));
        },
        {"all_gather: rank 0's output " + at(a, 8), "overlaps rank 1's input " + at(a + 2, 4)});
    check_usable(comm);
    // all_reduce in place on one buffer shared by both ranks: the outputs overlap.
    zp::test::expect_invalid(
        [&] { comm.all_reduce(std::span<float>(a, 4)); },
        {"all_reduce: rank 0's output " + at(a, 4), "overlaps rank 1's output " + at(a, 4)});
    // reduce_scatter: rank 1's shard lands inside rank 0's input.
    zp::test::expect_invalid(
        [&] {
          if (r == 0)
            comm.reduce_scatter(std::span<const float>(a, 8), std::span<float>(own.data(), 4));
          else
            comm.reduce_scatter(std::span<const float>(own), std::span<float>(a + 6, 4));
        },
        {"reduce_scatter: rank 1's output " + at(a + 6, 4), "overlaps rank 0's input " + at(a, 8)});
    // broadcast: rank 1 receives into the root's buffer, shifted by one element.
    zp::test::expect_invalid(
        [&] { comm.broadcast(std::span<float>(a + r, 4), 0); },
        {"broadcast: rank 0's output " + at(a, 4), "overlaps rank 1's output " + at(a + 1, 4)});
    // Async: the same error from wait().
    zp::test::expect_invalid([&] { comm.all_reduce_async(std::span<float>(a + r, 4)).wait(); },
                             {"overlaps"});
    check_usable(comm);
    // Reading one shared input (a[32, 36) = 2) is fine: only writes must be disjoint.
    comm.all_reduce(std::span<const float>(a + 32, 4), std::span<float>(own.data(), 4));
    CHECK(own[3] == 4.0f);
  });
}

TEST_CASE(
    "a send and its recv whose buffers overlap are an error on both ranks naming both ranges") {
  std::vector<float> shared(16);
  float* const a = shared.data();
  run_threads(3, [&](Collective<Threads>& comm) {
    const int r = comm.rank();
    if (r == 2) return;  // only the pair takes part
    const std::string want =
        zp::detail::cat("rank 1's recv buffer [", static_cast<const void*>(a + 2),
                        ", +16 bytes) overlaps rank 0's send buffer [", static_cast<const void*>(a),
                        ", +16 bytes)");
    zp::test::expect_invalid(
        [&] {
          if (r == 0)
            comm.send(std::span<const float>(a, 4), 1);
          else
            comm.recv(std::span<float>(a + 2, 4), 0);
        },
        {"message #1 from rank 0 to rank 1", want});
    // The pair stays usable.
    std::int64_t x = r == 0 ? 7 : 0;
    if (r == 0)
      comm.send(std::span<std::int64_t>(&x, 1), 1);
    else
      comm.recv(std::span<std::int64_t>(&x, 1), 0);
    CHECK(x == 7);
  });
}
