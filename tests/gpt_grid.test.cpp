// The transformer of examples/gpt.hpp on every DP x TP x PP grid of up to 8 thread ranks, every
// ZeRO stage, both pipeline schedules: parameters after 10 steps agree with a single-rank run
// of the same global batch to float rounding, every step's gradient norm too, and each group's
// counters match the communication formulas (tests/gpt_grid.hpp).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "expect_error.hpp"
#include "gpt_grid.hpp"
#include "zp/dispatch.hpp"

using zp::Collective;
using zp::backend::Threads;
namespace g = zp::test::grid;

namespace {

// fp32 throughout; the grid sums in other orders than one rank (TP's all_reduces add partial
// products of c_proj and the head, DP averages per replica before the global mean, the norm is
// summed per part). Those roundings, ~1e-7 relative in a gradient, move an Adam update by about
// lr * 1e-6 (eps keeps near-zero gradients from amplifying them); 10 steps stay far below 1e-6
// absolute. A wrong split, a double-counted norm or a lost micro-batch moves parameters by
// O(lr) = 1e-3 per step.
constexpr double tolerance = 1e-6;

std::uint64_t run_seed() { return zp::test::run_seed("gpt_grid.test"); }

const g::Reference& reference(int dp) {
  static std::map<int, g::Reference> cache;
  auto it = cache.find(dp);
  if (it == cache.end()) it = cache.emplace(dp, g::reference(run_seed(), dp)).first;
  return it->second;
}

template <int Stage>
void check_grid(zp::GridShape shape, zp::pipeline::Schedule schedule) {
  CAPTURE(shape.dp);
  CAPTURE(shape.tp);
  CAPTURE(shape.pp);
  CAPTURE(Stage);
  CAPTURE(zp::pipeline::name(schedule));
  const g::Reference& ref = reference(shape.dp);
  for (double norm : ref.norms) REQUIRE(norm > g::max_grad_norm);  // clipping acts on every step
  std::mutex m;
  double worst = 0;
  int loss_checked = 0;                             // ranks whose losses were compared
  std::map<std::string, std::vector<int>> covered;  // every element of every tensor, by some rank
  zp::backend::run_threads(shape.size(), [&](Collective<Threads>& world) {
    const g::RankResult r =
        g::train<Stage>(world, {.seed = run_seed(), .shape = shape, .schedule = schedule});
    const g::Agreement a = g::compare(r, ref);
    std::lock_guard lk(m);
    if (!(a.max_diff <= worst)) worst = a.max_diff;  // a NaN is the worst
    CHECK(a.max_diff <= tolerance);
    for (std::size_t k = 0; k < r.names.size(); ++k) {
      auto& c = covered[r.names[k]];
      c.resize(r.slices[k].full_size());
      for (std::size_t i = 0; i < r.values[k].size(); ++i) ++c[r.slices[k].full_index(i)];
    }
    REQUIRE(r.norms.size() == ref.norms.size());
    for (std::size_t s = 0; s < r.norms.size(); ++s)
      CHECK(r.norms[s] == doctest::Approx(ref.norms[s]).epsilon(1e-5));
    REQUIRE(r.losses.size() == ref.losses.size());
    if (r.last_stage && shape.dp == 1) {  // with dp > 1 a rank sees its replica's loss only
      ++loss_checked;
      for (std::size_t s = 0; s < r.losses.size(); ++s)
        CHECK(r.losses[s] == doctest::Approx(ref.losses[s]).epsilon(1e-5));
    }
  });
  if (shape.dp == 1) CHECK(loss_checked == shape.tp);  // each of the last stage's TP ranks
  // Each element is held by exactly the ranks that should hold it: every TP rank for replicated
  // tensors, one per TP group for split ones, times the DP replicas.
  CHECK(covered.size() == ref.tensors.size());
  for (const auto& [name, c] : covered) {
    const bool replicated = name.find("ln_") != std::string::npos || name == "wpe.weight" ||
                            name.find("c_proj.bias") != std::string::npos;
    const int want = shape.dp * (replicated ? shape.tp : 1);
    for (std::size_t i = 0; i < c.size(); ++i)
      if (c[i] != want) FAIL_CHECK(name, "[", i, "] is held by ", c[i], " ranks, expected ", want);
  }
  std::printf("gpt_grid: dp %d x tp %d x pp %d, stage %d, %s: max |grid - single rank| = %.2e\n",
              shape.dp, shape.tp, shape.pp, Stage, zp::pipeline::name(schedule), worst);
}

template <int Stage>
void every_grid() {
  for (int pp : {1, 2})
    for (int tp : {1, 2})
      for (int dp : {1, 2})
        check_grid<Stage>({.dp = dp, .tp = tp, .pp = pp}, zp::pipeline::Schedule::one_f_one_b);
  check_grid<Stage>({.dp = 2, .tp = 1, .pp = 2}, zp::pipeline::Schedule::gpipe);
  check_grid<Stage>({.dp = 1, .tp = 2, .pp = 2}, zp::pipeline::Schedule::gpipe);
}

}  // namespace

TEST_CASE("GPT on every DP x TP x PP grid of up to 8 ranks agrees with one rank: ZeRO stage 0") {
  every_grid<0>();
}
TEST_CASE("GPT on every DP x TP x PP grid of up to 8 ranks agrees with one rank: ZeRO stage 1") {
  every_grid<1>();
}
TEST_CASE("GPT on every DP x TP x PP grid of up to 8 ranks agrees with one rank: ZeRO stage 2") {
  every_grid<2>();
}
TEST_CASE("GPT on every DP x TP x PP grid of up to 8 ranks agrees with one rank: ZeRO stage 3") {
  every_grid<3>();
}

TEST_CASE("4 pipeline stages and 4 tensor-parallel ranks (one module, one head each)") {
  check_grid<1>({.dp = 1, .tp = 1, .pp = 4}, zp::pipeline::Schedule::one_f_one_b);
  check_grid<3>({.dp = 1, .tp = 4, .pp = 1}, zp::pipeline::Schedule::one_f_one_b);
}

// ZeRO++ quantizes each piece of a segment in blocks; a segment that mixed a replicated tensor
// with this TP rank's slice of split ones (the vocabulary of 13 splits into 7 and 6 rows, so
// even the offsets differ) gave the replicated tensor other values on each TP rank, then other
// gradients and master weights. With the segments cut by kind (layout.hpp) every rank holding a
// replicated tensor holds it bit for bit alike after 10 steps, and the run stays near the
// unquantized one.
TEST_CASE("ZeRO++ on tensor-parallel grids keeps every replicated tensor the same on every rank") {
  for (const zp::GridShape shape :
       {zp::GridShape{.dp = 2, .tp = 2, .pp = 1}, zp::GridShape{.dp = 2, .tp = 2, .pp = 2}}) {
    CAPTURE(shape.pp);
    const g::Reference& ref = reference(shape.dp);
    std::mutex m;
    std::map<std::string, std::vector<float>> seen;  // a replicated tensor as the first rank had it
    std::map<std::string, int> holders;
    double worst = 0;
    zp::backend::run_threads(shape.size(), [&](Collective<Threads>& world) {
      const g::RankResult r =
          g::train<3>(world, {.seed = run_seed(), .shape = shape, .zeropp = true});
      const g::Agreement a = g::compare(r, ref);
      std::lock_guard lk(m);
      if (!(a.max_diff <= worst)) worst = a.max_diff;
      for (double norm : r.norms) CHECK(std::isfinite(norm));
      for (std::size_t k = 0; k < r.names.size(); ++k) {
        if (!r.slices[k].is_whole()) continue;
        ++holders[r.names[k]];
        const auto [it, first] = seen.emplace(r.names[k], r.values[k]);
        if (!first && std::memcmp(it->second.data(), r.values[k].data(),
                                  r.values[k].size() * sizeof(float)) != 0)
          FAIL_CHECK(r.names[k], " differs between the ranks that hold it");
      }
    });
    for (const auto& [name, n] : holders) CHECK(n == shape.dp * shape.tp);
    std::size_t replicated = 0;  // as check_grid names them
    for (const auto& [name, t] : ref.tensors)
      replicated += name.find("ln_") != std::string::npos || name == "wpe.weight" ||
                    name.find("c_proj.bias") != std::string::npos;
    CHECK(holders.size() == replicated);
    // Bounded, not diverged: an update moves an element by about lr at most (Adam), so two runs
    // part by at most 2 lr a step (it was 0.94 lr after the 10 steps here).
    CHECK(worst < 2 * g::steps * g::lr);
    std::printf("gpt_grid: ZeRO++ dp %d x tp %d x pp %d: max |grid - single rank| = %.2e\n",
                shape.dp, shape.tp, shape.pp, worst);
  }
}

// Activation checkpointing changes when a block's activations are computed, not their values:
// every rank's parameters, gradient norms and losses are bitwise those of the same grid keeping
// them, under tensor parallelism (its all_reduces run again), pipelines and ZeRO stage 3 (the
// backward's gathered weights); the TP counters add the recomputed forwards (gpt_grid.hpp).
TEST_CASE("recomputed activations train bitwise as kept ones on DP x TP x PP grids") {
  // 4 layers: a pipeline stage of 2 blocks or more recomputes (the last block's set is kept).
  auto same = []<int Stage>(std::integral_constant<int, Stage>, zp::GridShape shape,
                            zp::pipeline::Schedule schedule) {
    CAPTURE(shape.dp);
    CAPTURE(shape.tp);
    CAPTURE(shape.pp);
    CAPTURE(Stage);
    std::map<int, g::RankResult> kept;
    std::mutex m;
    for (const bool recompute : {false, true})
      zp::backend::run_threads(shape.size(), [&](Collective<Threads>& world) {
        g::RankResult r = g::train<Stage>(world, {.seed = run_seed(),
                                                  .shape = shape,
                                                  .schedule = schedule,
                                                  .recompute = recompute,
                                                  .layers = 4});
        std::lock_guard lk(m);
        if (!recompute) {
          kept[world.rank()] = std::move(r);
          return;
        }
        const g::RankResult& k = kept.at(world.rank());
        CHECK(r.names == k.names);
        CHECK(r.values == k.values);
        CHECK(r.norms == k.norms);
        CHECK(r.losses == k.losses);
      });
  };
  same(std::integral_constant<int, 3>{}, {.dp = 2, .tp = 2, .pp = 2},
       zp::pipeline::Schedule::one_f_one_b);
  same(std::integral_constant<int, 1>{}, {.dp = 1, .tp = 2, .pp = 2},
       zp::pipeline::Schedule::gpipe);
  same(std::integral_constant<int, 3>{}, {.dp = 2, .tp = 1, .pp = 1},
       zp::pipeline::Schedule::one_f_one_b);
}

// zp_gpt's ZeRO-Init: a model holding no initial values, its engine asking Model::initializer()
// for the elements each rank keeps, holds every parameter and master weight bit for bit as the
// engine of a model holding them (fp32 and bf16, every stage, on a 2 x 2 x 2 grid: each TP rank
// asked for its slice, each PP stage for its modules).
TEST_CASE_TEMPLATE("the model's initializer gives each grid rank what a model holding it would", T,
                   float, zp::bf16) {
  const zp::GridShape shape{.dp = 2, .tp = 2, .pp = 2};
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    zp::backend::run_threads(shape.size(), [&](Collective<Threads>& world) {
      zp::ProcessGrid<Threads> grid(world, shape);
      const auto [first, end] = gpt::pipeline_stage(g::cfg, shape.pp, grid.coords().pp);
      using Model = gpt::Model<T>;
      Model held(g::cfg, run_seed(), zp::tp::Group<float>(grid.tp()), {first, end});
      Model lazy(g::cfg, run_seed(), zp::tp::Group<float>(grid.tp()), {first, end},
                 Model::InitialValues::on_request);
      for (const auto& t : lazy.tensors()) CHECK(!t.param.value.bound());
      zp::EngineConfig ec;
      ec.batch = {.micro_batch_per_rank = g::micro_batch, .gradient_accumulation_steps = 1};
      ec.bucket_bytes = 2048;  // several segments
      zp::EngineConfig asking = ec;
      asking.initializer = lazy.initializer();
      zp::dispatch<zp::Types<T>, zp::Stages<0, 1, 2, 3>>(
          zp::dtype_of<T>, stage,
          [&]<class U, int S>(std::type_identity<U>, std::integral_constant<int, S>) {
            zp::Engine<Threads, T, S> from_held(grid, held, ec);
            zp::Engine<Threads, T, S> from_lazy(grid, lazy, asking);
            const std::vector<T> p = from_held.gather_params(), q = from_lazy.gather_params();
            CHECK(p.size() == q.size());
            CHECK(std::memcmp(p.data(), q.data(), p.size() * sizeof(T)) == 0);
            CHECK(from_held.gather_master() == from_lazy.gather_master());
          });
    });
  }
  gpt::Model<float> lazy(g::cfg, 1, {}, {}, gpt::Model<float>::InitialValues::on_request);
  std::vector<float> out(2);
  zp::test::expect_invalid([&] { lazy.initializer()("no.such", 0, out); },
                           {"gpt: no tensor 'no.such' on this rank"});
  zp::test::expect_invalid([&] { lazy.initializer()("ln_f.bias", 15, out); },
                           {"gpt: elements [15, 17) of 'ln_f.bias' are past its 16"});
}

// gpt::train_step copies the pipeline's boundaries into the model's residual stream: a runner
// whose boundary is not one micro-batch's stream, or a stage holding another stage's modules,
// is an error on each rank before any boundary moves (it overran the buffer or ran a module
// nowhere before).
TEST_CASE("train_step refuses a runner whose boundary or stages do not fit the model's part") {
  for (const bool swapped : {false, true}) {
    CAPTURE(swapped);
    zp::backend::run_threads(2, [&](Collective<Threads>& world) {
      zp::ProcessGrid<Threads> grid(world, {.dp = 1, .tp = 1, .pp = 2});
      const int stage = swapped ? 1 - grid.coords().pp : grid.coords().pp;
      const auto [first, end] = gpt::pipeline_stage(g::cfg, 2, stage);
      gpt::Model<float> model(g::cfg, 1, zp::tp::Group<float>(grid.tp()), {first, end});
      zp::EngineConfig ec;
      ec.batch = {.micro_batch_per_rank = g::micro_batch,
                  .gradient_accumulation_steps = g::micro_batches};
      zp::Engine<Threads, float, 1> engine(grid, model, ec);
      const std::size_t elems =
          std::size_t(g::micro_batch) * std::size_t(g::cfg.context) * std::size_t(g::cfg.d_model);
      zp::pipeline::Runner<Threads, float> runner(grid.pp(), zp::pipeline::Schedule::one_f_one_b,
                                                  g::micro_batches, elems + !swapped);
      std::vector<gpt::Activations<float>> slots;
      for (int k = 0; k < runner.slots(); ++k) slots.emplace_back(g::cfg, g::micro_batch);
      zp::test::expect_invalid(
          [&] {
            gpt::train_step(engine, model, runner, slots, [](int, gpt::Activations<float>&) {});
          },
          swapped ? std::initializer_list<std::string>{"gpt: modules [", "on pipeline stage",
                                                       "the first stage must hold module 0"}
                  : std::initializer_list<std::string>{"the pipeline's boundary holds 193 elements",
                                                       "stream 192"});
    });
  }
}
