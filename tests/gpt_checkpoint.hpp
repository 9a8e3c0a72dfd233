// Checkpoints of the transformer of examples/gpt.hpp on DP x TP x PP grids, for the threads and
// mpi checkpoint tests: a training session that loads, trains and saves on a grid, and a
// comparison of two checkpoints, whole tensors read through ckpt::Reader (which assembles them
// from any grid's files).
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gpt_grid.hpp"
#include "zp/checkpoint.hpp"

namespace zp::test::grid {

// One training session on a grid: optionally load a checkpoint, train steps [first, last),
// save under `save_tag`.
struct Session {
  zp::GridShape shape;
  int stage = 0;
  std::filesystem::path dir = {};
  std::string load_tag = {}, save_tag = {};  // empty: none
  int first = 0, last = 0;
  gpt::Config cfg = grid::cfg;
};

template <int Stage, zp::Backend B>
void session(zp::Collective<B>& world, const Session& s, std::uint64_t seed) {
  zp::ProcessGrid<B> grid(world, s.shape);
  const auto [first, end] = gpt::pipeline_stage(s.cfg, s.shape.pp, grid.coords().pp);
  gpt::Model<float> model(s.cfg, seed ^ 0x5eed, zp::tp::Group<float>(grid.tp()), {first, end});
  zp::EngineConfig ec;
  ec.batch = {.micro_batch_per_rank = micro_batch, .gradient_accumulation_steps = micro_batches};
  ec.bucket_bytes = 8192;  // several buckets, so ZeRO pieces cut tensors at many places
  ec.first_bucket_bytes = 1024;
  ec.align = 4;
  ec.max_grad_norm = max_grad_norm;
  zp::Engine<B, float, Stage> engine(
      grid, model, ec, zp::optim::AdamW{.lr = lr, .eps = 1e-4f, .weight_decay = 0.01f});
  if (!s.load_tag.empty()) {
    const auto user = zp::load_checkpoint(engine, s.dir, s.load_tag);
    REQUIRE(user.size() == 1);
    CHECK(int(user[0]) == s.first);  // rank 0's blob, read by every rank
    REQUIRE(engine.steps() == s.first);
  }
  const std::size_t rows = std::size_t(micro_batch) * std::size_t(s.cfg.context);
  zp::pipeline::Runner<B, float> runner(grid.pp(), zp::pipeline::Schedule::one_f_one_b,
                                        micro_batches, rows * std::size_t(s.cfg.d_model));
  std::vector<gpt::Activations<float>> slots;
  for (int k = 0; k < runner.slots(); ++k) slots.emplace_back(s.cfg, micro_batch);
  for (int step = s.first; step < s.last; ++step) {
    const auto r =
        gpt::train_step(engine, model, runner, slots, [&](int micro, gpt::Activations<float>& a) {
          fill(seed, grid.coords().dp, step, micro, a);
        });
    REQUIRE(r.result.boundary);
  }
  if (!s.save_tag.empty()) {
    const std::byte blob[1] = {std::byte(s.last)};
    zp::save_checkpoint(engine, s.dir, s.save_tag, blob);
  }
}

// session() at s.stage.
template <zp::Backend B>
void session_at_stage(zp::Collective<B>& world, const Session& s, std::uint64_t seed) {
  switch (s.stage) {
    case 0: return session<0>(world, s, seed);
    case 1: return session<1>(world, s, seed);
    case 2: return session<2>(world, s, seed);
    default: return session<3>(world, s, seed);
  }
}

// Every field of every parameter of two checkpoints, whole tensors read through the Reader:
// bitwise equal, and the step too. Returns the elements compared.
inline std::size_t expect_same_state(const std::filesystem::path& a_dir, const std::string& a_tag,
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

}  // namespace zp::test::grid
