// zp_bench_gpt: what activation checkpointing (gpt::Activations' recompute, zp_gpt --recompute)
// costs and saves, on one rank of examples/gpt.hpp's transformer (no engine: the model's own
// forward, loss and backward, the part recomputing changes), and its matmuls against the
// one-row-at-a-time loops they replaced.
//
// matmul/backward:B/rows:R/in:I/out:O  gpt::matmul_forward (B 0: y = x W + b) or
//   matmul_backward (B 1: dx, dW and db) of R rows through an [I, O] weight, fp32, and in the same
//   iterations the same product one row at a time (the baseline, tests/gpt_matmul_by_row.hpp,
//   the reference tests/gpt.test.cpp checks the blocked ones against); the iteration
//   time is gpt's (manual time).
// Counters:
//   vs_row_at_a_time    gpt's time over the baseline's, summed over the iterations
//   GFLOPs              gpt's multiply-adds x 2 per second, in 1e9 (the backward: dx and dW)
//   same_bits           1 when every output is bitwise the baseline's (else the row fails)
// Shapes: GPT-2 small's c_fc and mlp.c_proj (d 768) on 256 tokens, its head (vocabulary 50257)
// on 64.
//
// gpt_step/layers:L  each iteration runs one micro-batch's forward, loss and backward twice from
//   the same weights: keeping every block's activations (the baseline) and recomputing them;
//   the iteration time is the recomputing step's (manual time).
// Counters:
//   vs_kept             the recomputing step's time over the keeping step's, summed over the
//                       iterations (both in the same iterations, alternating)
//   kept_MiB, recomputed_MiB  the micro-batch's activation set (Activations::bytes) each way
//   memory_ratio        recomputed_MiB / kept_MiB
//   same_gradients      1 when every gradient of the two steps is bitwise equal (else the row
//                       fails)
// Shape: d_model 128, 4 heads, context 128, micro-batch 4, vocabulary 64, fp32.
//
// gpt_setup/ranks:N  zp_gpt's set-up at stage 3 on N thread ranks: each rank builds its model and
//   a bf16 stage 3 engine, the model asked for its initial values through Model::initializer()
//   (ZeRO-Init: each rank draws only its shard; the iteration time) and, in the same iterations,
//   holding them (the baseline: every rank draws the whole model, the engine copies it in).
// Counters:
//   vs_held             ZeRO-Init's time over the baseline's, summed over the iterations
//   held_values_MiB     the initial values the baseline's models hold, over the ranks (ZeRO-Init's
//                       hold none)
//   same_bits           1 when every rank's engine holds bitwise the same parameters both ways
// Shape: GPT-2 small's blocks (d_model 768, 12 heads), 4 layers, context 64, vocabulary 65.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string_view>
#include <vector>

#include "gpt.hpp"
#include "gpt_matmul_by_row.hpp"  // tests/: the baseline
#include "zp/backend/threads.hpp"
#include "zp/engine.hpp"
#include "zp/model.hpp"

namespace {

struct Run {
  double seconds = 0;
  std::size_t bytes = 0;
  std::vector<std::vector<float>> grads;
};

// One micro-batch's forward, loss and backward from fresh gradients; returns its time, the
// activation set's size and the gradients.
Run step(const gpt::Config& c, int batch, bool recompute) {
  gpt::Model<float> m(c, 1234);
  Run r;
  zp::visit_parameters<float>(m,
                              [&](std::string_view, int, zp::View<float>& v, zp::View<float>& g) {
                                r.grads.emplace_back(v.size(), 0.0f);
                                g.rebind(r.grads.back().data());
                              });
  gpt::Activations<float> a(c, batch, recompute);
  for (std::size_t i = 0; i < a.tokens.size(); ++i) {
    a.tokens[i] = int((i * 7919 + 13) % std::size_t(c.vocab));
    a.targets[i] = int((i * 104729 + 7) % std::size_t(c.vocab));
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < m.modules(); ++k) m.forward(k, a);
  benchmark::DoNotOptimize(m.loss(a, 1.0f));
  for (int k = m.modules() - 1; k >= 0; --k) m.backward(k, a);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.bytes = a.bytes();
  return r;
}

void gpt_step(benchmark::State& state) {
  const gpt::Config c{
      .vocab = 64, .context = 128, .d_model = 128, .heads = 4, .layers = int(state.range(0))};
  constexpr int batch = 4;
  double kept = 0, recomputed = 0;
  Run a, b;
  for (auto _ : state) {
    a = step(c, batch, false);
    b = step(c, batch, true);
    if (a.grads != b.grads) {
      state.SkipWithError("recomputed gradients differ from kept ones");
      return;
    }
    kept += a.seconds;
    recomputed += b.seconds;
    state.SetIterationTime(b.seconds);
  }
  state.counters["vs_kept"] = recomputed / kept;
  state.counters["kept_MiB"] = double(a.bytes) / (1 << 20);
  state.counters["recomputed_MiB"] = double(b.bytes) / (1 << 20);
  state.counters["memory_ratio"] = double(b.bytes) / double(a.bytes);
  state.counters["same_gradients"] = 1;
}
BENCHMARK(gpt_step)->ArgName("layers")->Arg(2)->Arg(6)->UseManualTime()->Unit(
    benchmark::kMillisecond);

void gpt_setup(benchmark::State& state) {
  const gpt::Config c{.vocab = 65, .context = 64, .d_model = 768, .heads = 12, .layers = 4};
  const int ranks = int(state.range(0));
  using Model = gpt::Model<zp::bf16>;
  double held = 0, asked = 0, held_bytes = 0;
  bool same = true;
  for (auto _ : state) {
    std::vector<std::vector<zp::bf16>> params(2 * std::size_t(ranks));
    std::vector<double> seconds(2);
    for (const auto values : {Model::InitialValues::held, Model::InitialValues::on_request})
      zp::backend::run_threads(ranks, [&](zp::Collective<zp::backend::Threads>& comm) {
        const bool lazy = values == Model::InitialValues::on_request;
        comm.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        Model model(c, 1234, {}, {}, values);
        zp::EngineConfig ec;
        if (lazy) ec.initializer = model.initializer();
        if (comm.rank() == 0 && !lazy)
          for (const auto& t : model.tensors()) held_bytes += double(t.init.size() * 2 * ranks);
        zp::Engine<zp::backend::Threads, zp::bf16, 3> engine(comm, model, ec);
        comm.barrier();
        if (comm.rank() == 0)
          seconds[lazy] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        params[std::size_t(lazy) * std::size_t(ranks) + std::size_t(comm.rank())] =
            engine.gather_params();
      });
    for (int r = 0; r < ranks; ++r)
      same = same && params[std::size_t(r)].size() == params[std::size_t(ranks + r)].size() &&
             std::memcmp(params[std::size_t(r)].data(), params[std::size_t(ranks + r)].data(),
                         params[std::size_t(r)].size() * sizeof(zp::bf16)) == 0;
    held += seconds[0];
    asked += seconds[1];
    state.SetIterationTime(seconds[1]);
  }
  if (!same) {
    state.SkipWithError("ZeRO-Init's parameters differ from the held model's");
    return;
  }
  state.counters["vs_held"] = asked / held;
  state.counters["held_values_MiB"] = held_bytes / double(state.iterations()) / (1 << 20);
  state.counters["same_bits"] = 1;
}
BENCHMARK(gpt_setup)->ArgName("ranks")->Arg(8)->Iterations(2)->UseManualTime()->Unit(
    benchmark::kMillisecond);

void matmul(benchmark::State& state) {
  const bool backward = state.range(0) != 0;
  const int rows = int(state.range(1)), in = int(state.range(2)), out = int(state.range(3));
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  auto fill = [&](std::size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  const std::size_t xs = std::size_t(rows) * std::size_t(in),
                    ws = std::size_t(in) * std::size_t(out),
                    ys = std::size_t(rows) * std::size_t(out);
  const auto x = fill(xs), w = fill(ws), b = fill(std::size_t(out)), dy = fill(ys);
  // Outputs: gpt's and the baseline's (y; or dx, dW, db, the last two accumulating from 0).
  std::vector<float> y[2] = {std::vector<float>(ys), std::vector<float>(ys)};
  std::vector<float> dx[2] = {std::vector<float>(xs), std::vector<float>(xs)};
  std::vector<float> dw[2] = {std::vector<float>(ws), std::vector<float>(ws)};
  std::vector<float> db[2] = {std::vector<float>(std::size_t(out)),
                              std::vector<float>(std::size_t(out))};
  auto timed = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double mine = 0, base = 0;
  for (auto _ : state) {
    for (int k = 0; k < 2; ++k) {
      std::fill(dw[k].begin(), dw[k].end(), 0.0f);
      std::fill(db[k].begin(), db[k].end(), 0.0f);
    }
    const double t = timed([&] {
      if (backward)
        gpt::matmul_backward(dx[0].data(), dw[0].data(), db[0].data(), dy.data(), x.data(),
                             w.data(), rows, in, out);
      else
        gpt::matmul_forward(y[0].data(), x.data(), w.data(), b.data(), rows, in, out);
    });
    base += timed([&] {
      if (backward)
        gpt::by_row::matmul_backward(dx[1].data(), dw[1].data(), db[1].data(), dy.data(), x.data(),
                                     w.data(), rows, in, out);
      else
        gpt::by_row::matmul_forward(y[1].data(), x.data(), w.data(), b.data(), rows, in, out);
    });
    mine += t;
    state.SetIterationTime(t);
  }
  const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  if (!(backward ? same(dx[0], dx[1]) && same(dw[0], dw[1]) && same(db[0], db[1])
                 : same(y[0], y[1]))) {
    state.SkipWithError("the blocked matmul's outputs differ from one row at a time");
    return;
  }
  const double flops = 2.0 * double(rows) * double(in) * double(out) * (backward ? 2 : 1);
  state.counters["vs_row_at_a_time"] = mine / base;
  state.counters["GFLOPs"] = flops * double(state.iterations()) / mine / 1e9;
  state.counters["same_bits"] = 1;
}
BENCHMARK(matmul)
    ->ArgNames({"backward", "rows", "in", "out"})
    ->Args({0, 256, 768, 3072})
    ->Args({1, 256, 768, 3072})
    ->Args({0, 256, 3072, 768})
    ->Args({1, 256, 3072, 768})
    ->Args({0, 64, 768, 50257})
    ->Args({1, 64, 768, 50257})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
