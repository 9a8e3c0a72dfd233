// Checkpoints of the transformer of examples/gpt.hpp on grids of mpi processes: resume is exact
// (4 processes: 1 x 2 x 2 and 2 x 1 x 2; 8: 2 x 2 x 2 and 4 x 2 x 1), and a checkpoint saved on
// each of 4 grids loads on each other one (at another stage) with every field of every
// parameter bitwise as saved (tests/gpt_checkpoint.hpp).
#include "zp/backend/mpi.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "gpt_checkpoint.hpp"
#include "mpi_main.hpp"

using zp::Collective;
using zp::backend::Mpi;
namespace g = zp::test::grid;

namespace {

std::uint64_t seed() { return zp::test::mpi_seed(); }

// A directory every process names alike (from the run's seed and the process count); rank 0
// removes it when every process is done with it.
struct SharedDir {
  Collective<Mpi>& world;
  std::filesystem::path path;
  SharedDir(Collective<Mpi>& w, const char* name)
      : world(w),
        path(std::filesystem::temp_directory_path() /
             ("zp-" + std::string(name) + "-" + std::to_string(seed()) + "-np" +
              std::to_string(w.size()))) {}
  ~SharedDir() {
    world.barrier();
    if (world.rank() == 0) std::filesystem::remove_all(path);
  }
};

Collective<Mpi> world() {
  return Collective<Mpi>{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(120)})};
}

}  // namespace

TEST_CASE("on a grid of mpi processes, k steps + save + load + k steps equal 2k steps bitwise") {
  auto w = world();
  const SharedDir dir(w, "gpt-ckpt-mpi-exact");
  const auto shapes = w.size() == 8 ? std::vector<zp::GridShape>{{2, 2, 2}, {4, 2, 1}}
                                    : std::vector<zp::GridShape>{{1, 2, 2}, {2, 1, 2}};
  REQUIRE((w.size() == 4 || w.size() == 8));
  for (const zp::GridShape shape : shapes) {
    const auto d =
        dir.path / (std::to_string(shape.dp) + std::to_string(shape.tp) + std::to_string(shape.pp));
    const int stage = shape.dp == 1 ? 1 : shape.tp == 1 ? 3 : 2;
    g::session_at_stage(w, {shape, stage, d, "", "straight", 0, 4}, seed());
    g::session_at_stage(w, {shape, stage, d, "", "half", 0, 2}, seed());
    g::session_at_stage(w, {shape, stage, d, "half", "resumed", 2, 4}, seed());
    w.barrier();
    if (w.rank() == 0) g::expect_same_state(d, "straight", d, "resumed");
  }
}

TEST_CASE("a checkpoint saved on any grid of mpi processes loads on any other, bitwise") {
  auto w = world();
  const auto grids = w.size() == 8
                         ? std::vector<zp::GridShape>{{8, 1, 1}, {2, 2, 2}, {1, 4, 2}, {2, 1, 4}}
                         : std::vector<zp::GridShape>{{4, 1, 1}, {1, 2, 2}, {2, 2, 1}, {1, 1, 4}};
  const int n = int(grids.size());
  const SharedDir dir(w, "gpt-ckpt-mpi-any");
  const auto& d = dir.path;
  for (int i = 0; i < n; ++i)
    g::session_at_stage(w, {grids[i], i, d, "", "saved-" + std::to_string(i), 0, 2}, seed());
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      const std::string from = "saved-" + std::to_string(i),
                        again = "again-" + std::to_string(i) + "-" + std::to_string(j);
      g::session_at_stage(w, {grids[j], (i + j) % 4, d, from, again, 2, 2}, seed());
      w.barrier();
      if (w.rank() == 0) g::expect_same_state(d, from, d, again);
    }
}

int main(int argc, char** argv) {
  return zp::test::mpi_main(argc, argv, "gpt_checkpoint_mpi.test");
}
