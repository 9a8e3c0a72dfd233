#include "zp/grid.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "zp/backend/threads.hpp"
#include "expect_error.hpp"

using zp::Collective;
using zp::GridCoords;
using zp::GridShape;
using zp::backend::run_threads;
using zp::backend::Threads;

namespace {

// Every rank checks its coordinates and its four groups against the order of grid.hpp,
// computed here independently: members of a group, in rank order, and the sum of their world
// ranks by an all_reduce in the group.
void check_grid(GridShape s) {
  CAPTURE(s.dp);
  CAPTURE(s.tp);
  CAPTURE(s.pp);
  run_threads(s.size(), [&](Collective<Threads>& world) {
    zp::ProcessGrid<Threads> g(world, s);
    const int r = world.rank();
    // tp fastest, then dp, then pp
    const GridCoords want{(r / s.tp) % s.dp, r % s.tp, r / (s.tp * s.dp)};
    CHECK(g.coords() == want);
    CHECK(g.rank_of(want) == r);
    CHECK(g.first_stage() == (want.pp == 0));
    CHECK(g.last_stage() == (want.pp == s.pp - 1));
    struct Group {
      Collective<Threads>* comm;
      int size, coord;
      std::vector<int> members;
    };
    std::vector<int> tp, dp, pp, mp;
    for (int t = 0; t < s.tp; ++t) tp.push_back(t + s.tp * (want.dp + s.dp * want.pp));
    for (int d = 0; d < s.dp; ++d) dp.push_back(want.tp + s.tp * (d + s.dp * want.pp));
    for (int p = 0; p < s.pp; ++p) pp.push_back(want.tp + s.tp * (want.dp + s.dp * p));
    for (int p = 0; p < s.pp; ++p)
      for (int t = 0; t < s.tp; ++t) mp.push_back(t + s.tp * (want.dp + s.dp * p));
    for (const Group& grp :
         {Group{&g.tp(), s.tp, want.tp, tp}, Group{&g.dp(), s.dp, want.dp, dp},
          Group{&g.pp(), s.pp, want.pp, pp},
          Group{&g.model_parallel(), s.tp * s.pp, want.tp + s.tp * want.pp, mp}}) {
      CHECK(grp.comm->size() == grp.size);
      CHECK(grp.comm->rank() == grp.coord);
      CHECK(grp.members[std::size_t(grp.coord)] == r);
      std::int64_t sum[2] = {r, std::int64_t(r) * r};
      grp.comm->all_reduce(std::span<std::int64_t>(sum));
      std::int64_t want_sum[2] = {0, 0};
      for (int m : grp.members) want_sum[0] += m, want_sum[1] += std::int64_t(m) * m;
      CHECK(sum[0] == want_sum[0]);
      CHECK(sum[1] == want_sum[1]);
    }
  });
}

}  // namespace

TEST_CASE(
    "a DP x TP x PP grid: Megatron's rank order, four groups per rank (tp, dp, pp, model "
    "parallel), each with its members") {
  for (int dp : {1, 2})
    for (int tp : {1, 2})
      for (int pp : {1, 2}) check_grid({.dp = dp, .tp = tp, .pp = pp});
  check_grid({.dp = 3, .tp = 2, .pp = 1});
  check_grid({.dp = 1, .tp = 3, .pp = 2});
}

TEST_CASE("a grid that does not factor the world is an error on every rank naming the sizes") {
  run_threads(4, [&](Collective<Threads>& world) {
    zp::test::expect_invalid(
        [&] { zp::ProcessGrid<Threads> g(world, {.dp = 3, .tp = 1, .pp = 1}); },
        {"3 x 1 x 1", "4 ranks"});
    zp::test::expect_invalid(
        [&] { zp::ProcessGrid<Threads> g(world, {.dp = 0, .tp = 2, .pp = 2}); }, {"dp=0"});
    zp::ProcessGrid<Threads> g(world, {.dp = 1, .tp = 2, .pp = 2});
    zp::test::expect_invalid([&] { (void)g.rank_of({.dp = 1, .tp = 0, .pp = 0}); },
                             {"dp 1", "1 x 2 x 2"});
  });
}

TEST_CASE(
    "ranks that pass different shapes are an error on every rank naming its shape and the "
    "disagreement") {
  // Rank 2 asks for another grid (one that factors the world, or one that is wrong on its own):
  // every rank throws, before any split, and the world stays usable.
  for (const GridShape odd :
       {GridShape{.dp = 4, .tp = 1, .pp = 1}, GridShape{.dp = 0, .tp = 2, .pp = 2}}) {
    CAPTURE(odd.dp);
    run_threads(4, [&](Collective<Threads>& world) {
      const bool me = world.rank() == 2;
      const GridShape s = me ? odd : GridShape{.dp = 1, .tp = 2, .pp = 2};
      zp::test::expect_invalid(
          [&] { zp::ProcessGrid<Threads> g(world, s); },
          {"the ranks disagree on the shape",
           zp::detail::cat("world rank ", world.rank(), ") has dp x tp x pp = ", s.dp, " x ", s.tp,
                           " x ", s.pp),
           zp::detail::cat("dp ranges over [", std::min(odd.dp, 1), ", ", std::max(odd.dp, 1),
                           "], tp over [", odd.tp, ", 2]")});
      zp::ProcessGrid<Threads> g(world, {.dp = 2, .tp = 2, .pp = 1});
      CHECK(g.tp().size() == 2);
    });
  }
}
