// The transformer of examples/gpt.hpp on every DP x TP x PP grid of 4 mpi processes and every
// ZeRO stage: each process compares its part with a single-rank run of the same global batch
// (computed in the process on the threads backend), as tests/gpt_grid.test.cpp does on threads.
#include "zp/backend/mpi.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <map>

#include "expect_error.hpp"
#include "gpt_grid.hpp"
#include "mpi_main.hpp"

using zp::Collective;
using zp::backend::Mpi;
namespace g = zp::test::grid;

namespace {

std::uint64_t seed() { return zp::test::mpi_seed(); }

// The bound of gpt_grid.test.cpp: MPI's reductions round in their own order, which changes
// nothing at this scale.
constexpr double tolerance = 1e-6;

template <int Stage>
void check(Collective<Mpi>& world, zp::GridShape shape) {
  CAPTURE(shape.dp);
  CAPTURE(shape.tp);
  CAPTURE(shape.pp);
  CAPTURE(Stage);
  static std::map<int, g::Reference> refs;
  if (!refs.count(shape.dp)) refs.emplace(shape.dp, g::reference(seed(), shape.dp));
  const g::Reference& ref = refs.at(shape.dp);
  const g::RankResult r = g::train<Stage>(world, {.seed = seed(), .shape = shape});
  const g::Agreement a = g::compare(r, ref);
  CHECK(a.max_diff <= tolerance);
  CHECK(a.compared > 0);
  REQUIRE(r.norms.size() == ref.norms.size());
  REQUIRE(r.losses.size() == ref.losses.size());
  std::int64_t loss_checked = r.last_stage && shape.dp == 1;  // dp > 1: the replica's loss only
  if (loss_checked)
    for (std::size_t s = 0; s < r.losses.size(); ++s)
      CHECK(r.losses[s] == doctest::Approx(ref.losses[s]).epsilon(1e-5));
  world.all_reduce(std::span<std::int64_t>(&loss_checked, 1), zp::ReduceOp::sum);
  if (shape.dp == 1) CHECK(loss_checked == shape.tp);  // each of the last stage's TP ranks
  for (std::size_t s = 0; s < r.norms.size(); ++s)
    CHECK(r.norms[s] == doctest::Approx(ref.norms[s]).epsilon(1e-5));
  double worst = a.max_diff;
  world.all_reduce(std::span<double>(&worst, 1), zp::ReduceOp::max);
  if (world.rank() == 0)
    std::printf("gpt_grid_mpi: dp %d x tp %d x pp %d, stage %d: max |grid - single rank| = %.2e\n",
                shape.dp, shape.tp, shape.pp, Stage, worst);
}

template <int Stage>
void every_grid(Collective<Mpi>& world) {
  REQUIRE(world.size() == 4);
  for (zp::GridShape s : {zp::GridShape{4, 1, 1}, zp::GridShape{1, 4, 1}, zp::GridShape{1, 1, 4},
                          zp::GridShape{2, 2, 1}, zp::GridShape{2, 1, 2}, zp::GridShape{1, 2, 2}})
    check<Stage>(world, s);
}

}  // namespace

TEST_CASE(
    "processes that pass different grid shapes are an error on every process, and the world goes "
    "on") {
  Collective<Mpi> world{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  REQUIRE(world.size() == 4);
  const zp::GridShape s = world.rank() == 3 ? zp::GridShape{4, 1, 1} : zp::GridShape{2, 2, 1};
  zp::test::expect_invalid(
      [&] { zp::ProcessGrid<Mpi> g(world, s); },
      {"the ranks disagree on the shape", "dp ranges over [2, 4], tp over [1, 2]"});
  zp::ProcessGrid<Mpi> g(world, {2, 2, 1});
  CHECK(g.tp().size() == 2);
}

TEST_CASE("GPT on every grid of 4 mpi processes, every ZeRO stage, agrees with one rank") {
  Collective<Mpi> world{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(120)})};
  every_grid<0>(world);
  every_grid<1>(world);
  every_grid<2>(world);
  every_grid<3>(world);
}

// ZeRO++ (qwZ and qgZ, tests/gpt_grid.test.cpp) on dp 2 x tp 2 processes: after 10 steps every
// replicated tensor holds the same bits on every process (each holds it: pp 1).
TEST_CASE("GPT with ZeRO++ on 2 x 2 mpi processes keeps every replicated tensor alike") {
  Collective<Mpi> world{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(120)})};
  REQUIRE(world.size() == 4);
  const g::RankResult r = g::train<3>(world, {.seed = seed(), .shape = {2, 2, 1}, .zeropp = true});
  std::int64_t replicated = 0;
  for (std::size_t k = 0; k < r.names.size(); ++k) {
    if (!r.slices[k].is_whole()) continue;
    ++replicated;
    const std::uint64_t h =
        zp::detail::Fnv1a().bytes(r.values[k].data(), r.values[k].size() * sizeof(float)).value();
    CHECK_MESSAGE(zp::same_on_every_rank(world, h), r.names[k], " differs between the processes");
  }
  CHECK(replicated > 0);
}

int main(int argc, char** argv) { return zp::test::mpi_main(argc, argv, "gpt_grid_mpi.test"); }
