// Checkpoints of the transformer of examples/gpt.hpp on DP x TP x PP grids of thread ranks
// (checkpoint.hpp): k steps + save + load + k steps equals 2k steps bitwise on the same grid, and
// a checkpoint saved on one grid loads on any other (and at another ZeRO stage) with every
// field of every parameter bitwise as saved, read back through ckpt::Reader, which assembles
// whole tensors from any grid's files.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "expect_error.hpp"
#include "gpt_grid.hpp"
#include "temp_dir.hpp"
#include "zp/checkpoint.hpp"

using zp::Collective;
using zp::backend::Threads;
namespace g = zp::test::grid;

namespace {

std::uint64_t run_seed() { return zp::test::run_seed("gpt_checkpoint.test"); }

// One training session on a grid: optionally load a checkpoint, train steps [first, last),
// save under `save_tag`.
struct Session {
  zp::GridShape shape;
  int stage = 0;
  std::filesystem::path dir = {};
  std::string load_tag = {}, save_tag = {};  // empty: none
  int first = 0, last = 0;
  gpt::Config cfg = g::cfg;
};

template <int Stage>
void session(Collective<Threads>& world, const Session& s) {
  zp::ProcessGrid<Threads> grid(world, s.shape);
  const auto [first, end] = gpt::pipeline_stage(s.cfg, s.shape.pp, grid.coords().pp);
  gpt::Model<float> model(s.cfg, run_seed() ^ 0x5eed, zp::tp::Group<float>(grid.tp()),
                          {first, end});
  zp::EngineConfig ec;
  ec.batch = {.micro_batch_per_rank = g::micro_batch,
              .gradient_accumulation_steps = g::micro_batches};
  ec.bucket_bytes = 8192;  // several buckets, so ZeRO pieces cut tensors at many places
  ec.first_bucket_bytes = 1024;
  ec.align = 4;
  ec.max_grad_norm = g::max_grad_norm;
  zp::Engine<Threads, float, Stage> engine(
      grid, model, ec, zp::optim::AdamW{.lr = g::lr, .eps = 1e-4f, .weight_decay = 0.01f});
  if (!s.load_tag.empty()) {
    const auto user = zp::load_checkpoint(engine, s.dir, s.load_tag);
    REQUIRE(user.size() == 1);
    CHECK(int(user[0]) == s.first);  // rank 0's blob, read by every rank
    REQUIRE(engine.steps() == s.first);
  }
  const std::size_t rows = std::size_t(g::micro_batch) * std::size_t(s.cfg.context);
  zp::pipeline::Runner<Threads, float> runner(grid.pp(), zp::pipeline::Schedule::one_f_one_b,
                                              g::micro_batches, rows * std::size_t(s.cfg.d_model));
  std::vector<gpt::Activations<float>> slots;
  for (int k = 0; k < runner.slots(); ++k) slots.emplace_back(s.cfg, g::micro_batch);
  for (int step = s.first; step < s.last; ++step) {
    const auto r =
        gpt::train_step(engine, model, runner, slots, [&](int micro, gpt::Activations<float>& a) {
          g::fill(run_seed(), grid.coords().dp, step, micro, a);
        });
    REQUIRE(r.result.boundary);
  }
  if (!s.save_tag.empty()) {
    const std::byte blob[1] = {std::byte(s.last)};
    zp::save_checkpoint(engine, s.dir, s.save_tag, blob);
  }
}

void run(const Session& s) {
  CAPTURE(s.shape.dp);
  CAPTURE(s.shape.tp);
  CAPTURE(s.shape.pp);
  CAPTURE(s.stage);
  zp::backend::run_threads(s.shape.size(), [&](Collective<Threads>& world) {
    switch (s.stage) {
      case 0: return session<0>(world, s);
      case 1: return session<1>(world, s);
      case 2: return session<2>(world, s);
      default: return session<3>(world, s);
    }
  });
}

// Every field of every parameter of two checkpoints, whole tensors read through the Reader:
// bitwise equal, and the step too. Returns the elements compared.
std::size_t expect_same_state(const std::filesystem::path& a_dir, const std::string& a_tag,
                              const std::filesystem::path& b_dir, const std::string& b_tag) {
  zp::ckpt::Reader a(a_dir, a_tag), b(b_dir, b_tag);
  a.verify();
  b.verify();
  const auto &ma = a.manifest(), &mb = b.manifest();
  CHECK(ma.step == mb.step);
  REQUIRE(ma.params.size() == mb.params.size());
  REQUIRE(ma.fields == mb.fields);
  std::size_t compared = 0;
  for (std::size_t p = 0; p < ma.params.size(); ++p) {
    const int q = b.find(ma.params[p].name);
    REQUIRE(q >= 0);
    CHECK(ma.params[p].place.shape == mb.params[std::size_t(q)].place.shape);
    for (std::size_t f = 0; f < ma.fields.size(); ++f) {
      std::vector<float> x(ma.params[p].size, -1.0f), y(ma.params[p].size, -2.0f);
      a.read(f, p, 0, std::span<float>(x));
      b.read(f, std::size_t(q), 0, std::span<float>(y));
      if (std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0) {
        std::size_t i = 0;
        while (std::memcmp(&x[i], &y[i], sizeof(float)) == 0) ++i;
        FAIL_CHECK(ma.fields[f], "/", ma.params[p].name, "[", i, "]: ", x[i], " in ", a_tag, ", ",
                   y[i], " in ", b_tag);
      }
      compared += x.size();
    }
  }
  return compared;
}

}  // namespace

TEST_CASE("on a grid, k steps + save + load + k steps equal 2k steps bitwise") {
  zp::test::TempDir dir("gpt-ckpt");
  struct Case {
    zp::GridShape shape;
    int stage;
  };
  for (const Case c :
       {Case{{2, 2, 2}, 3}, Case{{1, 2, 2}, 1}, Case{{2, 1, 2}, 2}, Case{{4, 2, 1}, 0}}) {
    const std::string id =
        std::to_string(c.shape.dp) + std::to_string(c.shape.tp) + std::to_string(c.shape.pp);
    Session s{.shape = c.shape, .stage = c.stage, .dir = dir.path / id};
    run({s.shape, s.stage, s.dir, "", "straight", 0, 4});
    run({s.shape, s.stage, s.dir, "", "half", 0, 2});
    run({s.shape, s.stage, s.dir, "half", "resumed", 2, 4});
    CHECK(zp::ckpt::Reader(s.dir, "half").manifest().grid.size() == c.shape.size());
    const std::size_t n = expect_same_state(s.dir, "straight", s.dir, "resumed");
    std::printf("gpt_checkpoint: dp %d x tp %d x pp %d, stage %d: resumed = straight, %zu values\n",
                c.shape.dp, c.shape.tp, c.shape.pp, c.stage, n);
  }
}

TEST_CASE("a checkpoint saved on any grid loads on any other grid and stage, bitwise") {
  zp::test::TempDir dir("gpt-ckpt-any");
  const zp::GridShape grids[] = {{1, 1, 1}, {2, 2, 2}, {1, 4, 1}, {2, 1, 4}};
  const int n = int(std::size(grids));
  for (int i = 0; i < n; ++i) run({grids[i], i, dir.path, "", "saved-" + std::to_string(i), 0, 2});
  {  // offline, a grid's checkpoint rewritten for 3 data-parallel ranks holds the same values
    zp::ckpt::Reader rd(dir.path, "saved-1");
    zp::ckpt::reshard(rd, dir.path, "flat", 3);
    CHECK(zp::ckpt::Reader(dir.path, "flat").manifest().grid.dp == 3);
    expect_same_state(dir.path, "saved-1", dir.path, "flat");
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      // Loaded at grid j and stage (i + j) % 4, saved again at once, one more step trains.
      const std::string from = "saved-" + std::to_string(i),
                        again = "again-" + std::to_string(i) + "-" + std::to_string(j);
      run({grids[j], (i + j) % 4, dir.path, from, again, 2, 2});
      expect_same_state(dir.path, from, dir.path, again);
      run({grids[j], (i + j + 1) % 4, dir.path, again, "", 2, 3});
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
