// The transformer of examples/gpt.hpp trained on a DP x TP x PP grid (gpt::train_step), for the
// threads and mpi grid tests: every rank compares its part of the model with a single-rank run
// of the same global batch, and its communicators' counters with the formulas of Megatron-LM's
// analysis (tensor_parallel.hpp, pipeline.hpp) and of ZeRO (engine.hpp).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "gpt.hpp"
#include "random.hpp"
#include "zp/backend/threads.hpp"
#include "zp/engine.hpp"
#include "zp/grid.hpp"
#include "zp/pipeline.hpp"

namespace zp::test::grid {

// Small enough for 8 thread ranks on 2 cores; 4 heads and 4 modules so TP and PP go up to 4.
inline const gpt::Config cfg{.vocab = 13, .context = 6, .d_model = 16, .heads = 4, .layers = 2};
inline constexpr int micro_batch = 2, micro_batches = 2, steps = 10;
inline constexpr float lr = 1e-3f;
// Clipping to a norm the gradients exceed, so every step's update depends on the global norm
// (a replicated parameter counted twice would change it).
inline constexpr float max_grad_norm = 0.05f;

struct Run {
  std::uint64_t seed = 0;
  zp::GridShape shape;
  zp::pipeline::Schedule schedule = zp::pipeline::Schedule::one_f_one_b;
  int micro_batches = grid::micro_batches;  // per data-parallel rank and step
  // The single-rank reference: its micro-batch k is micro-batch k % micro_batches of replica
  // k / micro_batches, so it sees the global batch of every replica.
  bool reference = false;
  bool recompute = false;  // activation checkpointing (gpt::Activations)
  bool zeropp = false;     // stage 3: ZeRO++'s qwZ and qgZ, in nodes of one DP rank
  int layers = grid::cfg.layers;

  gpt::Config config() const {
    gpt::Config c = grid::cfg;
    c.layers = layers;
    return c;
  }
};

// Micro-batch `micro` of replica `dp` at `step`: random tokens, the same on every rank of it.
inline void fill(std::uint64_t seed, int dp, int step, int micro, gpt::Activations<float>& a) {
  const std::uint64_t base =
      mix(seed ^ mix((std::uint64_t(step) * 64 + std::uint64_t(micro)) * 64 + std::uint64_t(dp)));
  for (std::size_t i = 0; i < a.tokens.size(); ++i) {
    a.tokens[i] = int(mix(base + 2 * i) % std::uint64_t(cfg.vocab));
    a.targets[i] = int(mix(base + 2 * i + 1) % std::uint64_t(cfg.vocab));
  }
}

// What one rank saw: its tensors (full-model names and where its part sits) and their values
// after training, the gradient norm of every step, and its groups' counters.
struct RankResult {
  std::vector<std::string> names;
  std::vector<zp::Placement> slices;
  std::vector<std::vector<float>> values;
  std::vector<double> norms;
  std::vector<double> losses;  // mean loss per step (last stage, else 0)
  bool last_stage = false;     // this rank holds the last pipeline stage (and the loss)
};

template <int Stage, zp::Backend B>
RankResult train(zp::Collective<B>& world, const Run& run) {
  zp::ProcessGrid<B> grid(world, run.shape);
  const gpt::Config cfg = run.config();
  const auto [first, end] = gpt::pipeline_stage(cfg, run.shape.pp, grid.coords().pp);
  gpt::Model<float> model(cfg, run.seed, zp::tp::Group<float>(grid.tp()), {first, end});
  zp::EngineConfig ec;
  ec.batch = {.micro_batch_per_rank = micro_batch,
              .gradient_accumulation_steps = run.micro_batches};
  ec.bucket_bytes = 8192;  // several buckets per rank
  ec.first_bucket_bytes = 1024;
  ec.align = 4;
  ec.max_grad_norm = max_grad_norm;
  if (run.zeropp) {
    ec.quantized_weights = zp::zero_quantized_weights;
    ec.quantized_gradients = zp::zero_quantized_gradients;
    ec.ranks_per_node = 1;
  }
  // eps 1e-4: gradients that are zero up to rounding (the key bias: softmax ignores a constant
  // added to every score) must not turn rounding into +-lr steps (see engine.test.cpp).
  using E = zp::Engine<B, float, Stage>;
  // The estimate lays the part out as the engine does (ZeRO++ cuts its segments by kind).
  const zp::MemoryReport want = E::estimate_memory(model, run.shape.dp, ec, run.shape.tp).host;
  E engine(grid, model, ec, zp::optim::AdamW{.lr = lr, .eps = 1e-4f, .weight_decay = 0.01f});
  const zp::MemoryReport got = engine.memory_plan().host;
  CHECK(want.params == got.params);
  CHECK(want.master == got.master);
  CHECK(want.buckets == got.buckets);
  CHECK(want.gathered == got.gathered);
  model.release_initial_values();  // as zp_gpt does: nothing reads them now (ASan would see)
  const std::size_t rows = std::size_t(micro_batch) * std::size_t(cfg.context);
  zp::pipeline::Runner<B, float> runner(grid.pp(), run.schedule, run.micro_batches,
                                        rows * std::size_t(cfg.d_model));
  std::vector<gpt::Activations<float>> slots;
  for (int k = 0; k < runner.slots(); ++k) slots.emplace_back(cfg, micro_batch, run.recompute);
  zp::CommStats dp = grid.dp().stats();  // after the engine's set-up collectives
  const zp::OpStats mp0 = grid.model_parallel().stats()[zp::CollOp::all_reduce];
  const zp::OpStats tp0 = grid.tp().stats()[zp::CollOp::all_reduce];  // the engine's checks
  RankResult out;
  out.last_stage = grid.coords().pp == run.shape.pp - 1;
  for (int step = 0; step < steps; ++step) {
    const auto r =
        gpt::train_step(engine, model, runner, slots, [&](int micro, gpt::Activations<float>& a) {
          if (run.reference)
            fill(run.seed, micro / grid::micro_batches, step, micro % grid::micro_batches, a);
          else
            fill(run.seed, grid.coords().dp, step, micro, a);
        });
    REQUIRE(r.result.boundary);
    out.norms.push_back(r.result.grad_norm);
    out.losses.push_back(r.loss);
  }
  const std::vector<float> params = engine.gather_params();
  std::size_t at = 0;
  for (const auto& t : model.tensors()) {
    out.names.push_back(t.name);
    out.slices.push_back(t.place);
    out.values.emplace_back(params.begin() + std::ptrdiff_t(at),
                            params.begin() + std::ptrdiff_t(at + t.place.size()));
    at += t.place.size();
  }
  REQUIRE(at == params.size());

  // Communication of the whole run (steps x micro-batches), from the groups' counters.
  const std::uint64_t mb = std::uint64_t(steps) * std::uint64_t(run.micro_batches);
  const std::uint64_t act = rows * std::uint64_t(cfg.d_model) * sizeof(float);
  zp::OpStats tp = grid.tp().stats()[zp::CollOp::all_reduce];
  tp -= tp0;
  if (run.shape.tp > 1) {
    // Per micro-batch: 4 all_reduces of b x s x h per block (2 forward, 2 backward), 1 for the
    // embedding's output, 1 for the head's input gradient, and the loss's 1 + 2 of b x s.
    // Recomputing adds a block's 2 forward ones for every block of the stage but its last.
    const std::uint64_t blocks =
        std::uint64_t(std::clamp(end, 1, cfg.layers + 1) - std::clamp(first, 1, cfg.layers + 1));
    const std::uint64_t per_mb = 4 * blocks + (run.recompute && blocks ? 2 * (blocks - 1) : 0);
    const bool embed = first == 0, head = end == cfg.layers + 2;
    CHECK(tp.calls == mb * (per_mb + (embed ? 1 : 0) + (head ? 3 : 0)));
    CHECK(tp.bytes == mb * ((per_mb + (embed ? 1 : 0) + (head ? 1 : 0)) * act +
                            (head ? 3 * rows * sizeof(float) : 0)));
  } else {
    CHECK(tp.calls == 0);
  }
  for (auto op : {zp::CollOp::send, zp::CollOp::recv}) {
    // Two transfers per micro-batch per stage boundary: the activation forward, its gradient back.
    const std::uint64_t links =
        std::uint64_t(!grid.last_stage()) + std::uint64_t(!grid.first_stage());
    CHECK(grid.pp().stats()[op].calls == mb * links);
    CHECK(grid.pp().stats()[op].bytes == mb * links * act);
  }
  // DP: the engine's reductions and gathers (ZeRO's formulas, engine.hpp) over the DP group, the
  // statistics all_reduce there and, with TP or PP, once more over the replica's TP x PP group.
  for (std::size_t i = 0; i < zp::coll_op_count; ++i) {
    zp::OpStats now = grid.dp().stats().ops[i];
    dp.ops[i] = (now -= dp.ops[i]);
  }
  const std::uint64_t P = engine.layout().total() * sizeof(float), n = std::uint64_t(run.shape.dp);
  const std::uint64_t stats = zp::Engine<B, float, Stage>::statistics_count * sizeof(double);
  if (n > 1 && !run.zeropp) {
    if (Stage == 0) CHECK(dp[zp::CollOp::all_reduce].bytes == std::uint64_t(steps) * (P + stats));
    if (Stage == 1) CHECK(dp[zp::CollOp::reduce_scatter].bytes == std::uint64_t(steps) * P);
    if (Stage >= 2) CHECK(dp[zp::CollOp::reduce_scatter].bytes == mb * P);
    if (Stage == 1 || Stage == 2)
      CHECK(dp[zp::CollOp::all_gather].bytes == std::uint64_t(steps) * P);
  }
  zp::OpStats mp = grid.model_parallel().stats()[zp::CollOp::all_reduce];
  mp -= mp0;
  CHECK(mp.calls == (run.shape.tp * run.shape.pp > 1 ? std::uint64_t(steps) : 0));
  CHECK(mp.bytes ==  // all but the bucket order's terms, which only the DP group compares
        mp.calls * zp::Engine<B, float, Stage>::grid_statistics_count * sizeof(double));
  return out;
}

// The single-rank run of the global batch of `dp` replicas: full tensors by name, the norms.
struct Reference {
  std::map<std::string, std::vector<float>> tensors;
  std::vector<double> norms, losses;
};
inline Reference reference(std::uint64_t seed, int dp) {
  Reference ref;
  zp::backend::run_threads(1, [&](zp::Collective<zp::backend::Threads>& world) {
    Run run{.seed = seed, .shape = {}, .micro_batches = dp * micro_batches, .reference = true};
    RankResult r = train<0>(world, run);
    for (std::size_t k = 0; k < r.names.size(); ++k)
      ref.tensors[r.names[k]] = std::move(r.values[k]);
    ref.norms = r.norms;
    ref.losses = r.losses;
  });
  return ref;
}

// How far a rank's part is from the reference.
struct Agreement {
  double max_diff = 0;       // largest |grid - reference| over this rank's elements
  std::size_t compared = 0;  // elements compared
};
inline Agreement compare(const RankResult& r, const Reference& ref) {
  Agreement a;
  for (std::size_t k = 0; k < r.names.size(); ++k) {
    const auto it = ref.tensors.find(r.names[k]);
    REQUIRE_MESSAGE(it != ref.tensors.end(), "no tensor ", r.names[k], " in the single-rank model");
    const auto& full = it->second;
    REQUIRE(full.size() == r.slices[k].full_size());
    for (std::size_t i = 0; i < r.values[k].size(); ++i) {
      const double d = std::fabs(r.values[k][i] - full[r.slices[k].full_index(i)]);
      if (!(d <= a.max_diff)) a.max_diff = d;  // a NaN is the worst
      ++a.compared;
    }
  }
  return a;
}

}  // namespace zp::test::grid
