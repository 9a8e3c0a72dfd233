// Checkpoints of the transformer of examples/gpt.hpp on DP x TP x PP grids of thread ranks
// (checkpoint.hpp): k steps + save + load + k steps equals 2k steps bitwise on the same grid, and
// a checkpoint saved on one grid loads on any other (and at another ZeRO stage) with every
// field of every parameter bitwise as saved, read back through ckpt::Reader, which assembles
// whole tensors from any grid's files.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "expect_error.hpp"
#include "gpt_checkpoint.hpp"
#include "temp_dir.hpp"

using zp::Collective;
using zp::backend::Threads;
namespace g = zp::test::grid;

namespace {

std::uint64_t run_seed() { return zp::test::run_seed("gpt_checkpoint.test"); }

void run(const g::Session& s) {
  CAPTURE(s.shape.dp);
  CAPTURE(s.shape.tp);
  CAPTURE(s.shape.pp);
  CAPTURE(s.stage);
  zp::backend::run_threads(s.shape.size(), [&](Collective<Threads>& world) {
    g::session_at_stage(world, s, run_seed());
  });
}

}  // namespace

TEST_CASE("on a grid, k steps + save + load + k steps equal 2k steps bitwise") {
  zp::test::TempDir dir("gpt-ckpt");
  for (const zp::GridShape shape : {zp::GridShape{2, 2, 2}, zp::GridShape{1, 2, 2},
                                    zp::GridShape{2, 1, 2}, zp::GridShape{4, 2, 1}})
    for (int stage = 0; stage < 4; ++stage) {
      const auto d = dir.path / (std::to_string(shape.dp) + std::to_string(shape.tp) +
                                 std::to_string(shape.pp) + "-" + std::to_string(stage));
      run({shape, stage, d, "", "straight", 0, 4});
      run({shape, stage, d, "", "half", 0, 2});
      run({shape, stage, d, "half", "resumed", 2, 4});
      CHECK(zp::ckpt::Reader(d, "half").manifest().grid.size() == shape.size());
      const std::size_t n = g::expect_same_state(d, "straight", d, "resumed");
      std::printf(
          "gpt_checkpoint: dp %d x tp %d x pp %d, stage %d: resumed = straight, %zu values\n",
          shape.dp, shape.tp, shape.pp, stage, n);
    }
}

TEST_CASE("a checkpoint saved on any grid loads on any other grid and stage, bitwise") {
  zp::test::TempDir dir("gpt-ckpt-any");
  const zp::GridShape grids[] = {{1, 1, 1}, {2, 2, 2}, {1, 4, 1}, {2, 1, 4}};
  const int n = int(std::size(grids));
  for (int i = 0; i < n; ++i) run({grids[i], i, dir.path, "", "saved-" + std::to_string(i), 0, 2});
  {  // a version-1 manifest (1-D tensors, no grid) of a data-parallel save loads on a grid
    namespace fs = std::filesystem;
    fs::create_directory(dir.path / "v1");
    for (const auto& f : fs::directory_iterator(dir.path / "saved-0"))
      if (f.path().filename() != "manifest.json") fs::copy(f.path(), dir.path / "v1");
    std::ifstream in(dir.path / "saved-0" / "manifest.json");
    nlohmann::json m = nlohmann::json::parse(in);
    m["version"] = 1;
    m["tag"] = "v1";
    m.erase("grid");
    m.erase("parts");
    for (auto& p : m["params"]) p.erase("shape");
    std::ofstream(dir.path / "v1" / "manifest.json") << m.dump();
    CHECK(zp::ckpt::Reader(dir.path, "v1").manifest().params[0].place.shape.size() == 1);
    run({grids[1], 3, dir.path, "v1", "again-v1", 2, 2});
    g::expect_same_state(dir.path, "saved-0", dir.path, "again-v1");
  }
  {  // offline, a grid's checkpoint rewritten for 3 data-parallel ranks holds the same values
    zp::ckpt::Reader rd(dir.path, "saved-1");
    zp::ckpt::reshard(rd, dir.path, "flat", 3);
    CHECK(zp::ckpt::Reader(dir.path, "flat").manifest().grid.dp == 3);
    g::expect_same_state(dir.path, "saved-1", dir.path, "flat");
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      // Loaded at grid j and every stage, saved again at once, and one more step trains.
      const std::string from = "saved-" + std::to_string(i);
      for (int stage = 0; stage < 4; ++stage) {
        const std::string again =
            "again-" + std::to_string(i) + "-" + std::to_string(j) + "-" + std::to_string(stage);
        run({grids[j], stage, dir.path, from, again, 2, 2});
        g::expect_same_state(dir.path, from, dir.path, again);
      }
      run({grids[j], (i + j) % 4, dir.path, from, "", 2, 3});
    }
}

TEST_CASE("a grid's checkpoint of another model is refused, naming the tensor and both shapes") {
  zp::test::TempDir dir("gpt-ckpt-other");
  run({{1, 2, 2}, 1, dir.path, "", "small", 0, 1});
  gpt::Config bigger = g::cfg;
  bigger.vocab += 2;
  zp::test::expect_error(zp::Errc::invalid_argument,
                         [&] {
                           run({{2, 2, 1}, 2, dir.path, "small", "", 1, 1, bigger});
                         },
                         {"parameter 'wte.weight' is of the shape [13, 16] in the checkpoint "
                          "but [15, 16] in the model"});
}
