#include "zp/agreement.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "zp/backend/threads.hpp"

using zp::Collective;
using zp::backend::run_threads;
using zp::backend::Threads;

namespace {

std::uint64_t seed() { return zp::test::run_seed("agreement.test"); }

// Value i of rank r: from a few distinct values, so that some agree on every rank and some do
// not; negative and extreme values included.
std::int64_t value(int r, std::size_t i) {
  const std::uint64_t h = zp::test::mix(seed() + i);
  if (h % 3 == 0)
    return std::int64_t(h >> 1) - std::int64_t(std::uint64_t(1) << 62);  // one value on every rank
  const std::int64_t pool[] = {std::numeric_limits<std::int64_t>::max(),
                               std::numeric_limits<std::int64_t>::min() + 1, -7, 0, 42};
  return pool[zp::test::mix(h + std::uint64_t(r)) % 5];
}

}  // namespace

TEST_CASE(
    "spread gives every rank each value's smallest and largest over the ranks, as a serial loop "
    "does") {
  const std::size_t n = 37;
  for (int P : {1, 2, 3, 5}) {
    CAPTURE(P);
    run_threads(P, [&](Collective<Threads>& comm) {
      std::vector<std::int64_t> mine(n);
      for (std::size_t i = 0; i < n; ++i) mine[i] = value(comm.rank(), i);
      const std::vector<zp::Spread> s = zp::spread(comm, std::span<const std::int64_t>(mine));
      REQUIRE(s.size() == n);
      for (std::size_t i = 0; i < n; ++i) {
        std::int64_t lo = value(0, i), hi = lo;
        for (int r = 1; r < P; ++r) lo = std::min(lo, value(r, i)), hi = std::max(hi, value(r, i));
        CAPTURE(i);
        CHECK(s[i].lo == lo);
        CHECK(s[i].hi == hi);
        CHECK(s[i].same() == (lo == hi));
      }
    });
  }
}

TEST_CASE(
    "first_difference names the first fingerprint some rank disagrees on, and same_on_every_rank "
    "agrees") {
  const std::size_t n = 9;
  for (int P : {1, 2, 4}) {
    for (std::size_t differ = 0; differ <= n; ++differ) {  // n: none differs
      CAPTURE(P);
      CAPTURE(differ);
      run_threads(P, [&](Collective<Threads>& comm) {
        std::vector<std::uint64_t> h(n);
        for (std::size_t i = 0; i < n; ++i) h[i] = zp::test::mix(seed() + 100 + i);
        // The last rank changes fingerprint `differ` and every later one, in its top bits.
        if (comm.rank() == P - 1 && P > 1)
          for (std::size_t i = differ; i < n; ++i) h[i] ^= std::uint64_t(1) << 63;
        const std::size_t want = P > 1 ? differ : n;
        CHECK(zp::first_difference(comm, std::span<const std::uint64_t>(h)) == want);
        CHECK(zp::same_on_every_rank(comm, h[n - 1]) == (want == n));
      });
    }
  }
}

TEST_CASE(
    "on_every_rank turns one rank's failure into an error on every rank, naming it and its "
    "message") {
  for (int P : {1, 3}) {
    for (int failing = 0; failing < P; ++failing) {
      CAPTURE(P);
      CAPTURE(failing);
      run_threads(P, [&](Collective<Threads>& comm) {
        bool ran = false;
        zp::on_every_rank(comm, [&] { ran = true; });  // nobody fails: nobody throws
        CHECK(ran);
        const auto f = [&] {
          zp::on_every_rank(comm, [&] {
            if (comm.rank() == failing) throw zp::Error(zp::Errc::io, "disk full on purpose");
          });
        };
        if (comm.rank() == failing)
          zp::test::expect_error(zp::Errc::io, f, {"disk full on purpose"});
        else
          zp::test::expect_error(
              zp::Errc::io, f,
              {"rank " + std::to_string(failing) + " failed", "disk full on purpose"});
      });
    }
  }
}

// An exception of no std::exception type (a user callback's): its rank rethrows it, the others
// name it, and none is left waiting in the agreement.
TEST_CASE("on_every_rank agrees on an exception not derived from std::exception") {
  run_threads(3, [&](Collective<Threads>& comm) {
    try {
      zp::on_every_rank(comm, [&] {
        if (comm.rank() == 1) throw 42;
      });
      FAIL("no rank may go on");
    } catch (int x) {
      CHECK(comm.rank() == 1);
      CHECK(x == 42);
    } catch (const zp::Error& e) {
      CHECK(comm.rank() != 1);
      CHECK(e.category() == zp::Errc::backend);
      CHECK_MESSAGE(
          std::string(e.what()).find(
              "rank 1 failed: an exception not derived from std::exception") != std::string::npos,
          e.what());
    }
  });
}

TEST_CASE("spread refuses INT64_MIN, whose negation does not exist, as zp's own error") {
  run_threads(1, [](Collective<Threads>& comm) {
    const std::int64_t v[] = {std::numeric_limits<std::int64_t>::min()};
    zp::test::expect_error(zp::Errc::internal,
                           [&] { (void)zp::spread(comm, std::span<const std::int64_t>(v)); },
                           {"INT64_MIN"});
  });
}
